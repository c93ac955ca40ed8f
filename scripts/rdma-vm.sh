#!/usr/bin/env bash
# shellcheck disable=SC2054  # (commas in qemu options are not array separators)
# scripts/rdma-vm.sh: run a command inside a Soft-RoCE (rdma_rxe) VM. `--help` tells more; the
# guest side lives in scripts/rdma-vm/ (build-image.sh, guest-init.sh, smoke.sh, README.md).
set -uo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/rdma-vm.sh [--] COMMAND [ARG...]
       scripts/rdma-vm.sh --build      build (or refresh) the VM image only, then exit
       scripts/rdma-vm.sh --help

Runs COMMAND in a small qemu VM whose kernel has a Soft-RoCE device rxe0 (rdma_rxe), so verbs
and rdma_cm code can be tested on machines without RDMA hardware or kernel support.

  - One COMMAND argument is a shell command line (as with sh -c); several are an argv.
  - The guest chroots into the host's / (mounted read-only over 9p), so host-built binaries and
    their libraries work unchanged. The repository is mounted read-write at its host path; the
    command starts in the caller's directory if that is inside the repository, else at its root.
    /tmp, /run and /dev/shm are guest tmpfs: the host's /tmp is NOT visible in the guest.
  - The command's stdout and stderr are streamed to ours (separately); stdin is /dev/null.
  - Exit status: COMMAND's own; 125 if the VM itself failed or timed out (the last console
    lines are then printed on stderr).

Inside the guest:
  RXE_DEV=rxe0  RXE_GID_INDEX=1 (IPv4-mapped RoCE v2 GID)  RXE_NETDEV (rxe0's netdev)
  RXE_IP        rxe0's IPv4 address: use it for rdma_cm and for out-of-band TCP (not 127.0.0.1)
  RDMA_VM=1     HOME=/root (read-only)  TERM=dumb  `ulimit -l unlimited`; stdout/stderr are ttys

Environment knobs:
  RDMA_VM_ENV="VAR1 VAR2"  host variables to pass into the guest (the rest is not passed)
  RDMA_VM_TIMEOUT=900      seconds for the whole VM run (boot included)
  RDMA_VM_MEM=2048         guest RAM in MiB (the guest /tmp is a tmpfs of half of it)
  RDMA_VM_SMP=<nproc>      guest CPUs
  RDMA_VM_ACCEL=auto       auto|kvm|tcg; auto uses KVM only with VT-x/AMD-V, else TCG emulation
  RDMA_VM_NETDEV=dummy     dummy: rxe0 on a dummy netdev (no NIC at all);
                           eth0: on a virtio-net NIC (qemu user network, restrict=on)
  RDMA_VM_DIR=<dir>        image cache (default ${XDG_CACHE_HOME:-$HOME/.cache}/pskv/rdma-vm)
  RDMA_VM_KVER=<abi>       Debian kernel to use, e.g. 6.1.0-56-amd64 (default: linux-image-amd64's)
  RDMA_VM_LOG=<file>       keep the guest's serial console log there
  RDMA_VM_APPEND="..."     extra kernel command line arguments (debugging)
  RDMA_VM_DEBUG=1          print boot timings and progress on stderr

First use installs what is missing with apt-get (qemu-system-x86, libibverbs1, ibverbs-providers,
librdmacm1, ibverbs-utils, rdmacm-utils, perftest, iproute2) and builds a kernel + initramfs
from Debian packages into RDMA_VM_DIR (under a minute); it is rebuilt when build-image.sh
or guest-init.sh in scripts/rdma-vm/ change, or a new kernel version appears. Smoke test: scripts/rdma-vm.sh sh scripts/rdma-vm/smoke.sh
Pitfalls (CPU features, busy polling, timings): scripts/rdma-vm/README.md.
EOF
}

SELF=$(readlink -f "${BASH_SOURCE[0]}")
HERE=${SELF%/*}
LIB=$HERE/rdma-vm
REPO=$(cd "$HERE/.." && pwd -P)
T0=${EPOCHREALTIME/./}
DEBUG=${RDMA_VM_DEBUG:-}; [ "$DEBUG" != 0 ] || DEBUG=

say() { echo "rdma-vm: $*" >&2; }
fail() { say "$*"; exit 125; }
elapsed() { local us=$(( ${EPOCHREALTIME/./} - T0 )); printf '%d.%02d' $((us / 1000000)) $((us % 1000000 / 10000)); }
dbg() { [ -z "$DEBUG" ] || echo "[rdma-vm] host $(elapsed)s: $*" >&2; }

# Until qemu runs, a signal ends the script once the apt-get or image build in progress is done
# (and kept); Ctrl-C on a terminal reaches those directly as well.
PENDING=
trap 'PENDING=130' INT; trap 'PENDING=143' TERM; trap 'PENDING=129' HUP

BUILD_ONLY=
case ${1:-} in
  -h|--help) usage; exit 0 ;;
  --build) BUILD_ONLY=1; shift ;;
  --) shift ;;
  -*) fail "unknown option $1 (see --help; use -- before a command that starts with -)" ;;
esac
if [ -z "$BUILD_ONLY" ] && [ $# -eq 0 ]; then usage >&2; exit 125; fi

VMDIR=${RDMA_VM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pskv/rdma-vm}
TIMEOUT=${RDMA_VM_TIMEOUT:-900}
MEM=${RDMA_VM_MEM:-2048}
SMP=${RDMA_VM_SMP:-$(nproc)}
ACCEL=${RDMA_VM_ACCEL:-auto}
NETDEV=${RDMA_VM_NETDEV:-dummy}
for kv in "RDMA_VM_TIMEOUT=$TIMEOUT" "RDMA_VM_MEM=$MEM" "RDMA_VM_SMP=$SMP"; do
  [[ ${kv#*=} =~ ^[1-9][0-9]*$ ]] || fail "$kv: a positive integer is expected"
done
case $NETDEV in dummy|eth0) ;; *) fail "RDMA_VM_NETDEV=$NETDEV: dummy or eth0 expected" ;; esac
case $ACCEL in auto|kvm|tcg) ;; *) fail "RDMA_VM_ACCEL=$ACCEL: auto, kvm or tcg expected" ;; esac
mkdir -p "$VMDIR" || fail "cannot create $VMDIR"

# ---------------------------------------------------------------------------------------------
# Host packages: qemu, plus the rdma userspace the guest uses from the host's / (iproute2's
# `rdma` creates rxe0; the tools are for smoke.sh and for debugging by hand).
HOST_PKGS=(qemu-system-x86 libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils rdmacm-utils perftest iproute2)
apt_get() {
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 "$@" >>"$VMDIR/apt.log" 2>&1
}
ensure_host_packages() {
  local st p missing=()
  st=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${HOST_PKGS[@]}" 2>/dev/null)
  for p in "${HOST_PKGS[@]}"; do
    grep -qx "$p installed" <<<"$st" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || fail "missing packages: ${missing[*]} (install them with apt-get as root)"
  say "installing ${missing[*]} (apt-get; log: $VMDIR/apt.log)"
  apt_get install -y --no-install-recommends "${missing[@]}" ||
    { apt_get update && apt_get install -y --no-install-recommends "${missing[@]}"; } ||
    { tail -n 15 "$VMDIR/apt.log" >&2; fail "apt-get install ${missing[*]} failed"; }
}

# The kernel linux-image-amd64 points at. apt-cache is slow (>1 s), so the answer is cached
# until the apt lists change (apt-get update).
kernel_version() {
  [ -z "${RDMA_VM_KVER:-}" ] || { echo "$RDMA_VM_KVER"; return; }
  local stamp s k
  stamp=$(stat -c %Y /var/lib/apt/lists/*_Packages* 2>/dev/null | sort -n | tail -1)
  if [ -n "$stamp" ] && read -r s k 2>/dev/null <"$VMDIR/kver" && [ "$s" = "$stamp" ] && [ -n "$k" ]; then
    echo "$k"; return
  fi
  k=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: linux-image-\([0-9][^ ]*\)$/\1/p' | head -1)
  [ -z "$k" ] || [ -z "$stamp" ] || echo "$stamp $k" >"$VMDIR/kver"
  echo "$k"
}

# The image lives in image-KVER-HASH/, HASH covering the scripts that go into it: a change of
# either makes a new one. Built under a lock, into a temporary directory renamed at the end.
ensure_image() {
  local hash kver d
  hash=$(cat "$LIB/build-image.sh" "$LIB/guest-init.sh" | sha256sum | cut -c1-16)
  exec 9>"$VMDIR/.lock" || fail "cannot create $VMDIR/.lock"
  flock 9 || fail "cannot lock $VMDIR/.lock"
  ensure_host_packages
  kver=$(kernel_version)
  if [ -z "$kver" ]; then
    # No apt lists (fresh machine): an image of these scripts will do, else ask apt.
    for d in "$VMDIR"/image-*-"$hash"; do [ -s "$d/initramfs.cpio" ] && IMG=$d && break; done
    if [ -z "${IMG:-}" ]; then
      [ "$(id -u)" = 0 ] || fail "cannot tell the kernel version (run apt-get update as root)"
      apt_get update || { tail -n 15 "$VMDIR/apt.log" >&2; fail "apt-get update failed"; }
      kver=$(kernel_version)
      [ -n "$kver" ] || fail "no linux-image-amd64 in the apt lists (set RDMA_VM_KVER)"
    fi
  fi
  [ -n "${IMG:-}" ] || IMG=$VMDIR/image-$kver-$hash
  if [ ! -s "$IMG/initramfs.cpio" ]; then
    say "building the VM image (kernel $kver) in $VMDIR (first use only; under a minute)"
    local tmp=$VMDIR/.build-$$ t=$SECONDS
    rm -rf "$VMDIR"/.build-*   # leftovers of an interrupted build (we hold the lock)
    if ! "$LIB/build-image.sh" "$tmp" "$kver" "$VMDIR/debs" >"$VMDIR/build.log" 2>&1; then
      tail -n 20 "$VMDIR/build.log" >&2; rm -rf "$tmp"
      fail "building the VM image failed (log: $VMDIR/build.log)"
    fi
    rm -rf "$IMG"
    mv "$tmp" "$IMG" || fail "cannot create $IMG"
    for d in "$VMDIR"/image-*; do [ "$d" = "$IMG" ] || rm -rf "$d"; done   # old versions
    dbg "image built in $((SECONDS - t)) s"
  fi
  exec 9>&-
}

ensure_image
[ -z "$PENDING" ] || exit "$PENDING"
dbg "image $IMG"
if [ -n "$BUILD_ONLY" ]; then echo "$IMG"; exit 0; fi

# ---------------------------------------------------------------------------------------------
CTL=$(mktemp -d "${TMPDIR:-/tmp}/rdma-vm.XXXXXX") || fail "mktemp failed"
QPID='' READERS=()
# shellcheck disable=SC2317  # (called by the trap)
cleanup() {
  [ -z "$QPID" ] || kill -TERM "$QPID" 2>/dev/null
  [ ${#READERS[@]} -eq 0 ] || kill "${READERS[@]}" 2>/dev/null
  rm -rf "$CTL"
}
trap cleanup EXIT

q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }   # quote for sh
CWD=$(pwd -P)
case $CWD/ in "$REPO"/*) ;; *) CWD=$REPO ;; esac
{
  echo "RDMA_VM_NETDEV=$NETDEV"
  echo "RDMA_VM_WORKDIR=$(q "$REPO")"
} >"$CTL/config.sh"
{
  echo "cd $(q "$CWD") || exit 125"
  for v in ${RDMA_VM_ENV:-}; do
    [[ $v =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || fail "RDMA_VM_ENV: '$v' is not a variable name"
    [ -z "${!v+x}" ] || echo "export $v=$(q "${!v}")"
  done
  if [ $# -eq 1 ]; then
    printf '%s\n' "$1"
  else
    printf 'exec'; for a in "$@"; do printf ' %s' "$(q "$a")"; done; echo
  fi
} >"$CTL/cmd.sh"

if [ "$ACCEL" = auto ]; then
  # A /dev/kvm without VT-x/AMD-V (a PVM-style nested setup, as on our machines) cannot run a
  # stock kernel: qemu aborts ("failed to set MSR") or hangs. Only use KVM with the real thing.
  ACCEL=tcg
  if [ -r /dev/kvm ] && [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then ACCEL=kvm; fi
fi
if [ "$ACCEL" = kvm ]; then
  QEMU=(-accel kvm -accel tcg,thread=multi -cpu max)   # qemu falls back to TCG if KVM fails
else
  QEMU=(-accel tcg,thread=multi -cpu max)
fi
# The decompressed kernel boots through its PVH entry point, skipping the bzImage's
# self-decompression (seconds under TCG); qboot is a faster firmware than SeaBIOS.
if [ -s "$IMG/vmlinux" ]; then KERNEL=$IMG/vmlinux; else KERNEL=$IMG/vmlinuz; fi
[ ! -r /usr/share/qemu/qboot.rom ] || QEMU+=(-bios /usr/share/qemu/qboot.rom)
APPEND="console=ttyS0 quiet panic=-1 mitigations=off cryptomgr.notests pci=noacpi tsc=reliable"
[ -z "$DEBUG" ] || APPEND+=" rdma_vm.debug=1"
APPEND+=" ${RDMA_VM_APPEND:-}"
QEMU+=(-m "$MEM" -smp "$SMP" -nodefaults -no-user-config -no-reboot -display none
       -kernel "$KERNEL" -initrd "$IMG/initramfs.cpio" -append "$APPEND"
       -serial "file:$CTL/con" -serial "file:$CTL/out" -serial "file:$CTL/err")
V9=security_model=none,multidevs=remap
QEMU+=(-virtfs "local,path=$CTL,mount_tag=ctl,$V9"
       -virtfs "local,path=/,mount_tag=hostroot,$V9,readonly=on"
       -virtfs "local,path=$REPO,mount_tag=work,$V9")
[ "$NETDEV" != eth0 ] ||
  QEMU+=(-netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0,romfile=)

# The three serial ports are FIFOs read here; the readers start first since qemu blocks in
# open() until each has one.
console_reader() {
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%$'\r'}
    printf '%s\n' "$line"
    case $line in
      '[rdma-vm] '*) [ -z "$DEBUG" ] || echo "[rdma-vm] host $(elapsed)s: ${line#\[rdma-vm\] }" >&2 ;;
    esac
  done >"$CTL/console.log"
}
mkfifo "$CTL/con" "$CTL/out" "$CTL/err" || fail "mkfifo failed"
console_reader <"$CTL/con" & READERS+=($!)
cat "$CTL/out" & READERS+=($!)
cat "$CTL/err" >&2 & READERS+=($!)

[ -z "$PENDING" ] || exit "$PENDING"
dbg "starting qemu ($ACCEL, ${SMP} CPUs, ${MEM} MiB, $(basename "$KERNEL"))"
timeout -k 5 "$TIMEOUT" qemu-system-x86_64 "${QEMU[@]}" </dev/null >"$CTL/qemu.log" 2>&1 &
QPID=$!
INTERRUPTED=
for sig in INT:130 TERM:143 HUP:129; do
  # shellcheck disable=SC2064  # the exit status is fixed now, $QPID expands at the signal
  trap "INTERRUPTED=${sig#*:}; kill -TERM \"\$QPID\" 2>/dev/null" "${sig%:*}"
done
# (stderr: no "Aborted"/"Killed" job notices from bash when qemu dies of a signal)
{ wait "$QPID"; QRC=$?; } 2>/dev/null
while kill -0 "$QPID" 2>/dev/null; do { wait "$QPID"; QRC=$?; } 2>/dev/null; done   # early return on a signal
QPID=
dbg "qemu exited ($QRC)"
# A reader whose FIFO qemu never opened (qemu failed early) still waits in open(): give it a
# writer that closes at once. For a reader past open() this changes nothing.
for f in con out err; do exec {fd}<>"$CTL/$f" && exec {fd}>&-; done
wait "${READERS[@]}" 2>/dev/null
READERS=()
[ -z "${RDMA_VM_LOG:-}" ] || cp "$CTL/console.log" "$RDMA_VM_LOG" 2>/dev/null || say "cannot write RDMA_VM_LOG=$RDMA_VM_LOG"

[ -z "$INTERRUPTED" ] || { say "interrupted"; exit "$INTERRUPTED"; }
if read -r rc 2>/dev/null <"$CTL/rc" && [[ $rc =~ ^[0-9]+$ ]]; then
  dbg "done, exit status $rc"
  exit "$rc"
fi
if [ "$QRC" = 124 ]; then
  say "the VM timed out after ${TIMEOUT}s (RDMA_VM_TIMEOUT); last console lines:"
else
  say "the VM failed (qemu exit status $QRC) before the command finished; last console lines:"
fi
if [ -s "$CTL/console.log" ]; then tail -n 30 "$CTL/console.log" >&2; else echo "(none: the kernel did not start)" >&2; fi
if [ -s "$CTL/qemu.log" ]; then say "qemu said:"; tail -n 10 "$CTL/qemu.log" >&2; fi
exit 125
