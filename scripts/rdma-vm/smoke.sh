#!/bin/sh
# Soft-RoCE smoke test, to run inside the VM:  scripts/rdma-vm.sh sh scripts/rdma-vm/smoke.sh
# Checks rxe0 with the host's rdma-core tools: device listing, port state and GID, RC SEND/RECV
# over GID index $RXE_GID_INDEX (event-driven completions), rdma_cm (rping) on $RXE_IP, and
# short perftest RDMA WRITE / RDMA READ runs. Exit status 0 when all pass.
set -u
if [ -z "${RXE_DEV:-}" ] || [ -z "${RXE_IP:-}" ]; then
  echo "smoke.sh: RXE_DEV/RXE_IP unset: run it in the VM (scripts/rdma-vm.sh sh $0)" >&2
  exit 2
fi
GID=${RXE_GID_INDEX:-1}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/rdma-smoke.XXXXXX") || exit 2
passed=0 failed=0
now_ms() { echo $(($(date +%s%N) / 1000000)); }

result() { # NAME STATUS START_MS [LOG...]: print one line, and the logs of a failure
  name=$1 st=$2 t0=$3; shift 3
  ms=$(($(now_ms) - t0))
  if [ "$st" = 0 ]; then
    passed=$((passed + 1)); printf 'ok    %-22s %d.%03ds\n' "$name" $((ms / 1000)) $((ms % 1000))
  else
    failed=$((failed + 1)); printf 'FAIL  %-22s %d.%03ds\n' "$name" $((ms / 1000)) $((ms % 1000))
    for f in "$@"; do echo "  --- ${f##*/}:"; sed 's/^/  | /' "$f"; done
  fi
}

check() { # NAME COMMAND...: a single command
  name=$1; shift
  t0=$(now_ms)
  "$@" >"$LOGS/$name.out" 2>&1
  result "$name" $? "$t0" "$LOGS/$name.out"
}

# shellcheck disable=SC2086  # $srv and $cli are command lines, split on purpose
pair() { # NAME "SERVER COMMAND" "CLIENT COMMAND"
  # The server may take a while to start listening (the first run of a binary loads its
  # libraries over 9p), so the client is retried while the server is alive instead of sleeping
  # a fixed time: a refused connection makes these clients exit at once, harmlessly.
  name=$1 srv=$2 cli=$3
  t0=$(now_ms)
  timeout 120 $srv >"$LOGS/$name.server" 2>&1 &
  spid=$!
  deadline=$(($(now_ms) + 60000)) c=1 tries=0
  while [ "$(now_ms)" -lt "$deadline" ]; do
    tries=$((tries + 1))
    timeout 60 $cli >"$LOGS/$name.client" 2>&1 && { c=0; break; }
    kill -0 "$spid" 2>/dev/null || break   # the server is gone: no point in retrying
    sleep 0.2
  done
  [ "$c" = 0 ] || kill "$spid" 2>/dev/null
  wait "$spid"; s=$?
  st=0; [ "$c" = 0 ] && [ "$s" = 0 ] || st=1
  [ "$st" = 0 ] || echo "client rc=$c after $tries tries, server rc=$s" >>"$LOGS/$name.client"
  result "$name" $st "$t0" "$LOGS/$name.server" "$LOGS/$name.client"
}

devices() { ibv_devices && ibv_devices | grep -qw "$RXE_DEV"; }
devinfo() {
  ibv_devinfo -v -d "$RXE_DEV" >"$LOGS/devinfo.txt" || return 1
  grep -E 'hca_id|transport|state:|link_layer|active_mtu|GID\[ *'"$GID"'\]' "$LOGS/devinfo.txt"
  grep -q 'PORT_ACTIVE' "$LOGS/devinfo.txt" &&
    grep -E 'GID\[ *'"$GID"'\]' "$LOGS/devinfo.txt" | grep -q "$RXE_IP"
}

echo "smoke: $RXE_DEV on $RXE_NETDEV, $RXE_IP, GID index $GID"
check ibv_devices devices
check ibv_devinfo devinfo
pair ibv_rc_pingpong \
  "ibv_rc_pingpong -d $RXE_DEV -g $GID -e -p 18515" \
  "ibv_rc_pingpong -d $RXE_DEV -g $GID -e -p 18515 $RXE_IP"
pair rping \
  "rping -s -a $RXE_IP -p 7174 -C 10 -V" \
  "rping -c -a $RXE_IP -p 7174 -C 10 -V"
pair ib_write_bw \
  "ib_write_bw -d $RXE_DEV -x $GID -F -n 200 -p 18516" \
  "ib_write_bw -d $RXE_DEV -x $GID -F -n 200 -p 18516 $RXE_IP"
pair ib_read_bw \
  "ib_read_bw -d $RXE_DEV -x $GID -F -n 200 -p 18517" \
  "ib_read_bw -d $RXE_DEV -x $GID -F -n 200 -p 18517 $RXE_IP"
# perftest's summary lines (bandwidth under emulation: a sanity figure, not a measurement)
for t in ib_write_bw ib_read_bw; do
  [ -s "$LOGS/$t.client" ] && awk -v t=$t '/^ *65536 /{print "      " t ": " $0}' "$LOGS/$t.client"
done

rm -rf "$LOGS"
echo "smoke: $passed passed, $failed failed"
[ "$failed" = 0 ]
