#!/usr/bin/env bash
# Two pskv-server binaries, A and B, measured by the same pskv-bench client, alternately, so a
# change to the server is judged against what it replaced under the same machine load. Each
# pass starts both servers fresh and runs the dense points and the sparse workload against A,
# then B (then B, A on the next pass, so neither always goes first).
#   scripts/ab-servers.sh A_SERVER_BIN B_SERVER_BIN [PASSES] [BENCH_BIN]
# Prints one JSON line per result with "server":"A"|"B" and "pass", then medians per point.
set -euo pipefail
source "$(dirname "$0")/lib/server.sh"
A=$1
B=$2
PASSES=${3:-5}
BENCH=${4:-build/bench/pskv-bench}
WORK=$(mktemp -d /tmp/pskv-ab.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

serve() {  # BIN NAME [flags] -> prints its URI
  local bin=$1 name=$2; shift 2
  "$bin" --uri tcp://127.0.0.1:0 "$@" > "$WORK/$name.out" 2> "$WORK/$name.err" &
  PIDS+=($!)
  pskv_server_uri "$WORK/$name.out"
}

for pass in $(seq "$PASSES"); do
  order=(A B)
  [ $((pass % 2)) = 0 ] && order=(B A)
  for who in "${order[@]}"; do
    bin=$A
    [ "$who" = B ] && bin=$B
    uri=$(serve "$bin" "$who-dense-$pass")
    "$BENCH" --server "$uri" --json --sizes 64,4K,1M,16M --ops push,pull --clients 1 --rounds 3 --seconds 0.4 \
      2>/dev/null | sed "s/^{/{\"server\":\"$who\",\"pass\":$pass,/"
    uri=$(serve "$bin" "$who-sparse-$pass" --arena-mb 200 --max-keys 1500000)
    "$BENCH" --server "$uri" --json --workload sparse --clients 1,2 --seconds 0.5 2>/dev/null |
      sed "s/^{/{\"server\":\"$who\",\"pass\":$pass,/"
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
  done
done | tee "$WORK/all.jsonl" | python3 -c '
import json, statistics, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
for r in rows:
    print(json.dumps(r))
pts = {}
for r in rows:
    if "op" not in r:
        continue
    key = (r.get("workload", "dense"), r["op"], r.get("value_bytes"), r.get("clients"))
    metric = r.get("ratio") if "ratio" in r else r.get("keys_per_s")
    pts.setdefault(key, {"A": [], "B": []})[r["server"]].append(metric)
print("point: median A, median B, B/A of the ratio of each result to the baseline of its own run")
print("(bandwidth and sparse points: higher is better; 64 B and 4 KiB points are p50 latency: lower is better)")
for key, v in sorted(pts.items(), key=lambda kv: str(kv[0])):
    if v["A"] and v["B"] and None not in v["A"] + v["B"]:
        a, b = statistics.median(v["A"]), statistics.median(v["B"])
        print(f"{key}: {a:.3g} {b:.3g} {b / a:.2f}")
'
