#!/usr/bin/env bash
# build-image.sh OUTDIR KVER DEBDIR
#
# Builds the boot image of the Soft-RoCE test VM (see ../rdma-vm.sh, which calls this on first
# use and whenever this file, guest-init.sh or the kernel version changes):
#   OUTDIR/vmlinux         the stock Debian kernel linux-image-KVER, decompressed to an ELF that
#                          qemu boots directly (PVH entry point: no in-guest decompression,
#                          which costs seconds under TCG emulation)
#   OUTDIR/vmlinuz         the same kernel as shipped (bzImage), booted if vmlinux could not be made
#   OUTDIR/initramfs.cpio  uncompressed: busybox-static, the kernel modules the VM needs (with
#                          their dependencies, in load order) and guest-init.sh as /init
# The .deb files come from `apt-get download` (nothing is installed) and are kept in DEBDIR.
# Everything else (iproute2's `rdma`, libibverbs, perftest, the code under test) comes from the
# host's own / , which the guest mounts read-only and chroots into.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 OUTDIR KVER DEBDIR" >&2; exit 2; }
OUT=$1 KVER=$2 DEBS=$3
HERE=$(cd "$(dirname "$0")" && pwd -P)

# Two independent groups (with their dependencies) that the guest loads in parallel: the 9p
# file system over virtio (+ virtio_net, used with RDMA_VM_NETDEV=eth0), and the RDMA stack
# (+ dummy, for the default RDMA_VM_NETDEV=dummy). crc32_generic provides the "crc32" crypto
# algorithm that rdma_rxe asks for (the guest has no modprobe to load it on demand).
MODULES_9P="virtio_pci 9pnet_virtio 9p virtio_net"
MODULES_RDMA="dummy crc32_generic rdma_rxe ib_uverbs rdma_ucm"

mkdir -p "$OUT" "$DEBS"
WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/stage ROOT=$WORK/root
mkdir -p "$STAGE"

# --- packages: download only what is not cached yet; drop the debs of other kernel versions
(
  cd "$DEBS"
  need=()
  for p in "linux-image-$KVER" busybox-static; do
    compgen -G "${p}_*.deb" >/dev/null || need+=("$p")
  done
  if [ ${#need[@]} -gt 0 ]; then
    # as root, apt warns that the _apt user cannot write here; that is harmless
    apt-get download "${need[@]}" 2>&1 | grep -v 'Download is performed unsandboxed' || true
  fi
  for f in linux-image-*_*.deb; do
    case $f in "linux-image-${KVER}_"*|'linux-image-*_*.deb') ;; *) rm -f -- "$f" ;; esac
  done
)
KDEB=$(compgen -G "$DEBS/linux-image-${KVER}_*.deb" | head -1) || true
BDEB=$(compgen -G "$DEBS/busybox-static_*.deb" | head -1) || true
if [ -z "$KDEB" ] || [ -z "$BDEB" ]; then echo "build-image: apt-get download failed" >&2; exit 1; fi

# Only the kernel and its modules (the .deb holds nothing else of use here).
dpkg-deb --fsys-tarfile "$KDEB" | tar -x -C "$STAGE" "./boot/vmlinuz-$KVER" "./lib/modules/$KVER"
dpkg-deb --fsys-tarfile "$BDEB" | tar -x -C "$STAGE" ./bin/busybox
BB=$STAGE/bin/busybox    # static: runs on the host as well (cpio below)
MOD=$STAGE/lib/modules/$KVER

# --- kernel: the shipped bzImage + its payload decompressed to vmlinux (an ELF with a PVH note)
VMLINUZ=$STAGE/boot/vmlinuz-$KVER
cp "$VMLINUZ" "$WORK/vmlinuz"
le() { od -An -v -t"u$2" -j "$1" -N "$2" "$VMLINUZ" | tr -d ' '; }   # little-endian field of the boot header
setup_sects=$(le $((0x1f1)) 1); [ "$setup_sects" -ne 0 ] || setup_sects=4
payload=$(( (setup_sects + 1) * 512 + $(le $((0x248)) 4) ))
payload_len=$(le $((0x24c)) 4)
magic=$(od -An -v -tx1 -j "$payload" -N 4 "$VMLINUZ" | tr -d ' ')
case $magic in
  fd377a58) dec="xz -dc" ;;   1f8b08*) dec="gzip -dc" ;;   28b52ffd) dec="zstd -dc" ;;
  *) dec= ;;
esac
rm -f "$WORK/vmlinux"
if [ -n "$dec" ] && command -v "${dec%% *}" >/dev/null; then
  # the payload ends with a 4-byte size field that some decompressors call trailing garbage
  tail -c +$((payload + 1)) "$VMLINUZ" | head -c "$payload_len" | $dec >"$WORK/vmlinux" 2>/dev/null || true
fi
# keep it only if it is an ELF file (the PVH note is checked by qemu at boot: see ../rdma-vm.sh)
if [ "$(head -c 4 "$WORK/vmlinux" 2>/dev/null | od -An -tx1 | tr -d ' ')" != 7f454c46 ]; then
  echo "build-image: cannot decompress the kernel payload (magic $magic); booting the bzImage" >&2
  rm -f "$WORK/vmlinux"
fi

# --- initramfs
mkdir -p "$ROOT"/{bin,dev,proc,sys,tmp,run,etc,ctl,hostroot,lib/modules}
cp "$BB" "$ROOT/bin/busybox"
for a in $("$BB" --list); do [ -e "$ROOT/bin/$a" ] || ln -s busybox "$ROOT/bin/$a"; done
ln -s bin "$ROOT/sbin"

# Modules with their dependencies (from each module's modinfo "depends=" field: the .deb ships
# no modules.dep), depth first so that dependencies come first. Built-in ones are skipped.
declare -A path_of seen
while read -r rel; do
  n=${rel##*/}; n=${n%%.ko*}; path_of[${n//-/_}]=$rel
done <"$MOD/modules.order"
order=()
resolve() {
  local m=${1//-/_} rel deps d
  [ -z "${seen[$m]:-}" ] || return 0
  seen[$m]=1
  rel=${path_of[$m]:-}
  if [ -z "$rel" ]; then
    grep -Eq "/(${m}|${m//_/-})\.ko" "$MOD/modules.builtin" && return 0
    echo "build-image: module $m not found in linux-image-$KVER" >&2; return 1
  fi
  case $rel in
    *.ko.xz) xz -dc "$MOD/$rel" >"$WORK/$m.ko" ;;
    *.ko.zst) zstd -qdc "$MOD/$rel" >"$WORK/$m.ko" ;;
    *.ko.gz) gzip -dc "$MOD/$rel" >"$WORK/$m.ko" ;;
    *) cp "$MOD/$rel" "$WORK/$m.ko" ;;
  esac
  deps=$(tr '\0' '\n' <"$WORK/$m.ko" | sed -n 's/^depends=//p' | head -1)
  for d in ${deps//,/ }; do resolve "$d"; done
  mv "$WORK/$m.ko" "$ROOT/lib/modules/$m.ko"
  order+=("$m")
}
for m in $MODULES_9P; do resolve "$m"; done
printf '%s\n' "${order[@]}" >"$ROOT/etc/modules.9p"
n9p=${#order[@]}
for m in $MODULES_RDMA; do resolve "$m"; done
printf '%s\n' "${order[@]:$n9p}" >"$ROOT/etc/modules.rdma"

install -m 755 "$HERE/guest-init.sh" "$ROOT/init"
# Uncompressed: the kernel would spend longer decompressing it under TCG than qemu spends reading it.
(cd "$ROOT" && find . | LC_ALL=C sort | "$BB" cpio -o -H newc 2>/dev/null) >"$WORK/initramfs.cpio"

for f in vmlinux vmlinuz initramfs.cpio; do
  [ -e "$WORK/$f" ] && mv -f "$WORK/$f" "$OUT/$f"
done
echo "build-image: kernel $KVER, modules: ${order[*]}"
ls -l "$OUT"
