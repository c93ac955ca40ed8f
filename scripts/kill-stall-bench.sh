#!/usr/bin/env bash
# How long a worker stalls when a replicated server is SIGKILLed mid-training and restarted with
# --rejoin (docs/bench/replication.md): pskv-bench's steps workload with --kill-at-step, retrying
# workers, TRIALS runs per value size. Prints, per size, the p50 and max over the trials of the
# longest step and of the restart (kill to serving).
# FAILOVER_MS=MS: 3 servers fail over instead (pskv-server --failover-ms); nothing restarts, and
# the longest step is the failover's stall (the restart columns are then -1).
#
#   [FAILOVER_MS=MS] scripts/kill-stall-bench.sh BUILD_DIR [TRIALS]        (default 10)
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,8p "$0" >&2; exit 2; }
BIN=$1/bench/pskv-bench TRIALS=${2:-10}
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
FAILOVER_MS=${FAILOVER_MS:-0} SERVERS=2
[ "$FAILOVER_MS" -gt 0 ] && SERVERS=3
OUT=$(mktemp /tmp/pskv-kill-stall.XXXXXX.jsonl)
for t in $(seq 1 "$TRIALS"); do
  for size in 4K 1M; do
    steps=2000; [ "$size" = 1M ] && steps=400
    "$BIN" --json --workload steps --transport tcp --servers "$SERVERS" --replicas 2 --workers 2 --sizes "$size" \
      --mode ssp --steps "$steps" --retry-timeout-ms 30000 --kill-at-step $((steps / 2)) \
      --failover-ms "$FAILOVER_MS" 2>/dev/null |
      grep '"workload":"steps"' >>"$OUT"
  done
  echo "trial $t of $TRIALS done" >&2
done
python3 - "$OUT" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    j = json.loads(line)
    runs[j["value_bytes"]].append(j)
print("| value | trials | longest step p50 ms | longest step max ms | restart p50 ms | restart max ms | p50 step us |")
print("|---|---|---|---|---|---|---|")
for b, rs in sorted(runs.items()):
    stall = [r["max_step_us"] / 1e3 for r in rs]
    restart = [r["restart_ms"] for r in rs]
    size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
    print(f"| {size} | {len(rs)} | {statistics.median(stall):.1f} | {max(stall):.1f} | {statistics.median(restart):.1f} | "
          f"{max(restart):.1f} | {statistics.median(r['p50_step_us'] for r in rs):.0f} |")
PY
