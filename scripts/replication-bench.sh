#!/usr/bin/env bash
# Replication's cost over tcp: pskv-bench with 2 servers at --replicas 1 and 2, interleaved, in
# the same run (docs/bench/replication.md).
#
#   scripts/replication-bench.sh BUILD_DIR [ROUNDS]        (default 5 rounds)
#
# Prints, per point, the median over rounds of R=2 against R=1 (bandwidth, and p50 latency) with
# the range of the rounds' ratios.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,8p "$0" >&2; exit 2; }
BIN=$1/bench/pskv-bench ROUNDS=${2:-5}
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
OUT=$(mktemp /tmp/pskv-replication.XXXXXX.jsonl)
for r in $(seq 1 "$ROUNDS"); do
  order=(1 2)
  [ $((r % 2)) = 0 ] && order=(2 1)
  for R in "${order[@]}"; do
    "$BIN" --json --seconds "${PSKV_BENCH_SECONDS:-0.5}" --transport tcp --servers 2 --replicas "$R" \
      --sizes 4K,1M,16M --clients 1 2>/dev/null | grep '"transport"' | sed "s/^{/{\"round\":$r,/" >> "$OUT"
  done
  echo "round $r of $ROUNDS done" >&2
done
python3 - "$OUT" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(dict))
for line in open(sys.argv[1]):
    j = json.loads(line)
    runs[(j["op"], j["value_bytes"])][j["round"]][j["replicas"]] = j
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
print("| op | value | R=1 GB/s | R=2 GB/s | R=2 / R=1 bandwidth | R=1 p50 us | R=2 p50 us | R=2 / R=1 p50 |")
print("|---|---|---|---|---|---|---|---|")
for (op, b), rounds in sorted(runs.items()):
    pairs = [(v[1], v[2]) for v in rounds.values() if 1 in v and 2 in v]
    bw = [p[1]["bytes_per_s"] / p[0]["bytes_per_s"] for p in pairs]
    lat = [p[1]["p50_us"] / p[0]["p50_us"] for p in pairs]
    med = lambda xs: statistics.median(xs)
    print(f"| {op} | {size(b)} | {med([p[0]['bytes_per_s'] for p in pairs]) / 1e9:.2f} | "
          f"{med([p[1]['bytes_per_s'] for p in pairs]) / 1e9:.2f} | {med(bw):.2f}x ({min(bw):.2f}-{max(bw):.2f}) | "
          f"{med([p[0]['p50_us'] for p in pairs]):.1f} | {med([p[1]['p50_us'] for p in pairs]):.1f} | "
          f"{med(lat):.2f}x ({min(lat):.2f}-{max(lat):.2f}) |")
PY
echo "raw: $OUT" >&2
