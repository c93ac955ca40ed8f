#!/bin/sh
# Replication's cost over rdma, inside the Soft-RoCE VM: two rdma:// servers on $RXE_IP without
# replicas, then with --replicas 2, one after the other, ROUNDS times; pskv-bench pushes and
# pulls 1 MiB values against each pair. RING=verbs (the default) replicates over verbs, RING=tcp
# over --peer-uri tcp://. WORKLOAD=rows inserts, pushes and pulls rows of an embedding table
# instead (100,000 rows of 16 floats, 1,000-id batches, 2 clients). The figures are emulation:
# only the R=2 / R=1 ratio of one run means anything.
#   scripts/rdma-vm.sh "sh tests/rdma/replication-bench-in-vm.sh build [ROUNDS]"
set -u
B=${1:?usage: replication-bench-in-vm.sh BUILD_DIR [ROUNDS]}
ROUNDS=${2:-3}
RING=${RING:-verbs}
WORKLOAD=${WORKLOAD:-dense}
: "${RXE_IP:?run this inside the Soft-RoCE VM (scripts/rdma-vm.sh)}"
OUT=$(mktemp -d "$B/replication-bench.XXXXXX") || exit 2
round=0
while [ $round -lt "$ROUNDS" ]; do
  round=$((round + 1))
  for R in 1 2; do
    P0=$((20000 + round * 10 + R * 2))
    U0=rdma://$RXE_IP:$P0 U1=rdma://$RXE_IP:$((P0 + 1))
    T0=tcp://$RXE_IP:$((P0 + 100)) T1=tcp://$RXE_IP:$((P0 + 101))
    if [ $R = 1 ]; then
      X0="" X1=""
    elif [ "$RING" = tcp ]; then
      X0="--replicas 2 --peers $T0,$T1 --peer-uri $T0" X1="--replicas 2 --peers $T0,$T1 --peer-uri $T1"
    else
      X0="--replicas 2 --peers $U0,$U1" X1="--replicas 2 --peers $U0,$U1"
    fi
    # shellcheck disable=SC2086  # X0 and X1 are lists of flags
    "$B/apps/pskv-server" --uri "$U0" --server-id 0 --arena-mb 128 --io-threads 1 $X0 >"$OUT/s0" 2>&1 &
    a=$!
    # shellcheck disable=SC2086
    "$B/apps/pskv-server" --uri "$U1" --server-id 1 --arena-mb 128 --io-threads 1 $X1 >"$OUT/s1" 2>&1 &
    b=$!
    i=0
    until grep -q listening "$OUT/s0" && grep -q listening "$OUT/s1"; do
      i=$((i + 1))
      if [ $i -gt 300 ]; then cat "$OUT/s0" "$OUT/s1"; exit 1; fi
      sleep 0.1
    done
    if [ "$WORKLOAD" = rows ]; then
      "$B/bench/pskv-bench" --json --transport rdma --server "$U0" --server "$U1" --workload rows \
        --table-keys 100000 --clients 2 --seconds 2 2>/dev/null |
        grep -oE '"op":"[a-z]+"|"(rows|inserts)_per_s":[0-9]+' | paste -d' ' - - |
        sed "s/^/round $round, R=$R ($RING, rows): /"
    else
      "$B/bench/pskv-bench" --json --transport rdma --server "$U0" --server "$U1" --sizes 1M --clients 1 \
        --seconds 2 2>/dev/null | grep -o '"op":"[a-z]*".*"bytes_per_s":[0-9]*' | sed "s/^/round $round, R=$R ($RING): /"
    fi
    kill $a $b
    wait $a $b 2>/dev/null
  done
done
rm -rf "$OUT"
