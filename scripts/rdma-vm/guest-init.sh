#!/bin/sh
# /init (PID 1) of the Soft-RoCE test VM: busybox ash from the initramfs that build-image.sh
# makes. Started by ../rdma-vm.sh, which provides:
#   9p share "ctl"       config.sh (RDMA_VM_NETDEV, RDMA_VM_WORKDIR), cmd.sh (the command); we
#                        write the command's exit status to "rc" there (no rc = the VM failed)
#   9p share "hostroot"  the host's / (read-only): the command runs chrooted into it
#   9p share "work"      the repository, read-write, mounted at its host path inside the chroot
#   ttyS0  console: kernel messages and our "[rdma-vm]" lines (the host prints its last lines
#          when the VM fails, and the "[rdma-vm]" lines as they come with RDMA_VM_DEBUG=1)
#   ttyS1  the command's stdout,  ttyS2  the command's stderr
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm

DEBUG=
case " $(cat /proc/cmdline) " in *" rdma_vm.debug=1 "*) DEBUG=1 ;; esac
up() { read -r t _ </proc/uptime; echo "$t"; }
log() { [ -z "$DEBUG" ] || echo "[rdma-vm] guest ${1}s: $2"; }
die() { echo "[rdma-vm] error: $*"; sync; poweroff -f; sleep 60; }
log "$(up)" "init started"

# Raw mode: no \n -> \r\n translation, no echo. busybox stty sets it with TCSADRAIN, so calling
# it again at the end waits until all of the command's output has left the UARTs.
stty raw -echo </dev/ttyS1 || die "no ttyS1"
stty raw -echo </dev/ttyS2 || die "no ttyS2"

# Kernel modules: the RDMA stack loads in the background while the 9p shares come up.
load() { while read -r m; do insmod "/lib/modules/$m.ko" || { echo "[rdma-vm] error: insmod $m failed"; return 1; }; done <"$1"; }
load /etc/modules.rdma &
RDMA_MODS=$!
load /etc/modules.9p || die "cannot load the 9p modules"
log "$(up)" "9p modules loaded"

P9=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o "$P9" ctl /ctl || die "cannot mount the ctl share"
RDMA_VM_NETDEV=dummy RDMA_VM_WORKDIR=
# shellcheck disable=SC1091
. /ctl/config.sh
[ -n "$RDMA_VM_WORKDIR" ] || die "RDMA_VM_WORKDIR not set"

# The host's / , read-only. cache=loose makes executables and libraries load much faster; the
# price: a host file outside the repository that changes during the run may look stale here.
R=/hostroot
mount -t 9p -o "$P9,ro,cache=loose" hostroot $R || die "cannot mount the host's / (9p)"
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -o bind /dev $R/dev
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs tmpfs $R/tmp
mount -t tmpfs tmpfs $R/run
mkdir -p $R/run/rdma-vm && mount -o bind /ctl $R/run/rdma-vm
# A repository under /tmp or /run lives on the guest's own tmpfs: make its mount point there.
mkdir -p "$R$RDMA_VM_WORKDIR" 2>/dev/null
mount -t 9p -o "$P9" work "$R$RDMA_VM_WORKDIR" || die "cannot mount the work share at $RDMA_VM_WORKDIR"
log "$(up)" "9p shares mounted"

wait $RDMA_MODS || die "cannot load the rdma modules"
log "$(up)" "rdma modules loaded"

# Network + Soft-RoCE. iproute2's `rdma` comes from the host (chroot); busybox does the rest.
ip link set lo up
case $RDMA_VM_NETDEV in
  dummy) # no NIC at all: rxe loops packets back inside the guest (RFC 5737 test address)
    RXE_NETDEV=dummy0 RXE_IP=192.0.2.1
    ip addr add $RXE_IP/24 dev dummy0 ;;
  eth0)  # virtio-net on qemu's user network with restrict=on: nothing leaves the VM
    RXE_NETDEV=eth0 RXE_IP=10.0.2.15
    ip addr add $RXE_IP/24 dev eth0 ;;
  *) die "unknown RDMA_VM_NETDEV=$RDMA_VM_NETDEV (dummy|eth0)" ;;
esac
ip link set "$RXE_NETDEV" up || die "cannot bring $RXE_NETDEV up"
PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot $R rdma link add rxe0 type rxe netdev "$RXE_NETDEV" || die "rdma link add rxe0 failed"
# Wait until the port is ACTIVE and GID 1 (the IPv4-mapped RoCE v2 GID) is filled in.
P=/sys/class/infiniband/rxe0/ports/1
i=0
until grep -q ACTIVE $P/state 2>/dev/null && ! grep -q '^0000:0000:0000:0000:0000:0000:0000:0000$' $P/gids/1 2>/dev/null; do
  i=$((i + 1)); [ $i -le 100 ] || die "rxe0 not ready: state $(cat $P/state 2>&1), gid 1 $(cat $P/gids/1 2>&1)"
  sleep 0.05
done
log "$(up)" "rxe0 on $RXE_NETDEV ($RXE_IP), gid 1 = $(cat $P/gids/1)"

hostname rdma-vm
# shellcheck disable=SC3045  # (busybox ash has ulimit -l)
ulimit -l unlimited
# Run the command with a clean environment; cmd.sh (made by the host) changes to the caller's
# directory, exports the variables passed through with RDMA_VM_ENV and runs the command.
log "$(up)" "running the command"
env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb \
    RDMA_VM=1 RXE_DEV=rxe0 RXE_GID_INDEX=1 RXE_NETDEV="$RXE_NETDEV" RXE_IP="$RXE_IP" \
    chroot $R /bin/sh /run/rdma-vm/cmd.sh </dev/null >/dev/ttyS1 2>/dev/ttyS2
rc=$?
log "$(up)" "command exited with $rc"
stty raw -echo </dev/ttyS1; stty raw -echo </dev/ttyS2   # drain the UARTs
echo $rc >/ctl/rc
sync
umount "$R$RDMA_VM_WORKDIR" 2>/dev/null
umount /ctl 2>/dev/null
poweroff -f
