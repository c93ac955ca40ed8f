#!/usr/bin/env bash
# The scaling study: every figure next to the machine's own limits measured in the same run.
# Writes docs/bench/*.jsonl (raw results), docs/bench/*.png (gnuplot) and docs/BENCHMARKS.md.
#   scripts/bench.sh [BUILD_DIR]      (default build; PSKV_BENCH_SECONDS per point, default 0.5)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BENCH=$BUILD/bench/pskv-bench
OUT=docs/bench
SECONDS_PER_POINT=${PSKV_BENCH_SECONDS:-0.5}
[ -f "$BUILD/CMakeCache.txt" ] || { echo "configure first: $BUILD has no CMakeCache.txt (scripts/test.sh or cmake -B $BUILD)" >&2; exit 1; }
# Results from stale binaries would describe some other commit.
cmake --build "$BUILD" -j "${JOBS:-2}" >&2
[ -x "$BENCH" ] || { echo "$BENCH is missing: configure $BUILD with -DPSKV_BUILD_BENCH=ON" >&2; exit 1; }
command -v gnuplot >/dev/null || apt-get install -y -qq --no-install-recommends gnuplot-nox >/dev/null
command -v python3 >/dev/null || apt-get install -y -qq --no-install-recommends python3 >/dev/null
mkdir -p "$OUT"
run() { local name=$1; shift; echo "--- $name: pskv-bench $*" >&2; "$BENCH" --json --seconds "$SECONDS_PER_POINT" "$@" > "$OUT/$name.jsonl"; }

# Value size sweep, 1 and 2 clients, one server.
run dense-tcp --transport tcp --clients 1,2
run dense-shm --transport shm --clients 1,2
# The goals' points again, in independent runs (fresh servers, buffers and baselines each): runs
# differ by more than the rounds within a run do, so one run cannot say whether a goal holds.
for r in 1 2 3 4 5; do
  run large-tcp-$r --transport tcp --sizes 1M,4M,16M --clients 1
  run large-shm-$r --transport shm --sizes 1M,4M,16M --clients 1
done
# Large values streamed: 4 operations in flight per client, as a training step issues its layers
# (the raw TCP baseline is a continuous stream too).
run depth4-tcp --transport tcp --sizes 1M,4M,16M --clients 1 --depth 4
run depth4-shm --transport shm --sizes 1M,4M,16M --clients 1 --depth 4
# Clients sweep at 1 MB.
run clients-tcp --transport tcp --sizes 1M --clients 1,2,4,8,16
run clients-shm --transport shm --sizes 1M --clients 1,2,4,8,16 --ops pull
# Small pushes against clients: every one a round trip through the server's threads.
run clients-shm-small --transport shm --sizes 64 --clients 1,2,4,8,16 --ops push
# Servers sweep for a 16 MB value, chunked over all servers (the default) and whole on one.
run servers-tcp --transport tcp --sizes 16M --clients 2 --servers 1
for n in 2 4; do
  run servers$n-tcp --transport tcp --sizes 16M --clients 2 --servers $n
  run servers$n-tcp-whole --transport tcp --sizes 16M --clients 2 --servers $n --chunk-floats 0
done
# Sparse: 1M keys x 16 floats, batches of 1,000, uniform and Zipf, 1..16 clients.
run sparse-shm --transport shm --workload sparse --clients 1,2,4,8,16
run sparse-tcp --transport tcp --workload sparse --clients 1,2,4,8,16
run sparse-zipf-shm --transport shm --workload sparse --dist zipf --clients 1,2,4
# Consistency modes: steps/s and observed staleness, 4 workers, worker 0 a straggler.
: > "$OUT/steps.jsonl"
for m in "bsp" "ssp --staleness 3" "asp" "sync" "sync --sync-required 3"; do
  "$BENCH" --json --workload steps --transport shm --workers 4 --steps 400 --sizes 64K --straggler-us 1000 --mode $m \
    >> "$OUT/steps.jsonl"
done
# RDMA inside the Soft-RoCE VM: emulation, reported apart and never as performance.
if [ -f "$BUILD/tests/rdma/CTestTestfile.cmake" ] && [ "${PSKV_BENCH_RDMA:-1}" != 0 ]; then
  scripts/rdma-vm.sh sh tests/rdma/bench-in-vm.sh "$BUILD" --json --sizes 64,4K,1M --clients 1 \
    --seconds "$SECONDS_PER_POINT" > "$OUT/dense-rdma-emulated.jsonl" || echo "rdma run failed; see above" >&2
fi
# A healthy client and the server's memory while each attack class runs (writes attacks.jsonl).
PSKV_ATTACK_SECONDS=${PSKV_ATTACK_SECONDS:-6} scripts/attack-bench.sh "$BUILD" >&2
python3 scripts/lib/bench_report.py "$OUT" docs/BENCHMARKS.md
echo "wrote docs/BENCHMARKS.md and $OUT/*.png"
