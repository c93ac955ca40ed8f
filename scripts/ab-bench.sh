#!/usr/bin/env bash
# A/B of two builds' pskv-bench on this machine, interleaved so both see the same noise.
#
#   scripts/ab-bench.sh OLD_BUILD NEW_BUILD [ROUNDS]        (default 5 rounds)
#
# Each round runs every configuration below once per build, in an order that rotates from round
# to round (a fixed order favours whichever runs first after the page cache and THP settle).
# Prints, per point, the median over rounds of NEW/OLD (keys/s for sparse, bytes/s for dense)
# and its range. This is how "unchanged within noise" is checked before a change lands: one
# run against figures measured at another time says nothing on these shared hosts.
# Build an older commit with: git worktree add /tmp/old <commit> &&
#   cmake -S /tmp/old -B /tmp/old/build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build /tmp/old/build --target pskv-bench
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,12p "$0" >&2; exit 2; }
OLD=$1/bench/pskv-bench NEW=$2/bench/pskv-bench ROUNDS=${3:-5}
for b in "$OLD" "$NEW"; do [ -x "$b" ] || { echo "no $b" >&2; exit 1; }; done
OUT=$(mktemp /tmp/pskv-ab.XXXXXX.jsonl)
CONFIGS=(
  "--transport tcp --workload sparse --clients 1,2"
  "--transport shm --workload sparse --clients 1,2"
  "--transport tcp --sizes 64,1M --clients 1"
  "--transport shm --sizes 64,1M --clients 1"
)
for r in $(seq 1 "$ROUNDS"); do
  order=(old new)
  [ $((r % 2)) = 0 ] && order=(new old)
  for cfg in "${CONFIGS[@]}"; do
    for v in "${order[@]}"; do
      bin=$OLD; [ "$v" = new ] && bin=$NEW
      # shellcheck disable=SC2086  # cfg is a list of flags
      "$bin" --json --seconds "${PSKV_BENCH_SECONDS:-0.5}" $cfg 2>/dev/null | grep '"transport"' |
        sed "s/^{/{\"v\":\"$v\",\"round\":$r,/" >> "$OUT"
    done
  done
  echo "round $r of $ROUNDS done" >&2
done
python3 - "$OUT" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(dict))
for line in open(sys.argv[1]):
    j = json.loads(line)
    sparse = j.get("workload") == "sparse"
    point = (j["transport"], "sparse" if sparse else "dense", j["op"], j["value_bytes"], j["clients"])
    runs[point][j["round"]][j["v"]] = j["keys_per_s"] if sparse else j["bytes_per_s"]
print("| transport | workload | op | value bytes | clients | new/old median | range | rounds |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for point in sorted(runs):
    r = [v["new"] / v["old"] for v in runs[point].values() if "new" in v and "old" in v and v["old"]]
    if r:
        print("| %s | %s | %s | %d | %d | %.2f | %.2f-%.2f | %d |" % (*point, statistics.median(r), min(r), max(r), len(r)))
PY
echo "raw results: $OUT" >&2
