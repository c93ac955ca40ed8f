#!/bin/sh
# pskv-bench inside the Soft-RoCE VM (pskv-bench starts its own servers on 127.0.0.1, which
# rdma_cm cannot use, so this starts one on $RXE_IP and points the bench at it):
#   scripts/rdma-vm.sh sh tests/rdma/bench-in-vm.sh build-rdma --sizes 64,4K,1M --clients 1
# SCHEME=tcp runs the same over tcp:// on the same address, the baseline for a ratio:
#   scripts/rdma-vm.sh "for s in rdma tcp; do SCHEME=\$s sh tests/rdma/bench-in-vm.sh build --workload rows; done"
# Extra server flags go in SERVER_FLAGS. The figures are emulation, never performance.
set -u
BUILD=${1:?usage: bench-in-vm.sh BUILD_DIR [pskv-bench options]}
shift
: "${RXE_IP:?run this inside the Soft-RoCE VM (scripts/rdma-vm.sh)}"
SCHEME=${SCHEME:-rdma}
OUT=$(mktemp -d "$BUILD/bench-$SCHEME.XXXXXX") || exit 2
# shellcheck disable=SC2086  # SERVER_FLAGS is a list of flags
"$BUILD/apps/pskv-server" --uri "$SCHEME://$RXE_IP:0" --arena-mb 128 --io-threads 1 ${SERVER_FLAGS:-} \
  >"$OUT/server.out" 2>"$OUT/server.err" &
spid=$!
i=0
while ! grep -q listening "$OUT/server.out" 2>/dev/null; do
  i=$((i + 1))
  if [ $i -gt 300 ] || ! kill -0 $spid 2>/dev/null; then cat "$OUT/server.err"; exit 1; fi
  sleep 0.1
done
uri=$(sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$OUT/server.out")
"$BUILD/bench/pskv-bench" --transport "$SCHEME" --server "$uri" "$@"
rc=$?
kill $spid
wait $spid
rm -rf "$OUT"
exit $rc
