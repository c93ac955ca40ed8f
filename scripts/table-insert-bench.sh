#!/usr/bin/env bash
# Inserts into a 100M-row table (pskv-bench --workload rows), on memory as the machine gives it to
# a new process and on memory just backed by the hypervisor, interleaved (docs/bench/tables.md,
# "What bounds them").
#
#   scripts/table-insert-bench.sh BUILD_DIR [ROUNDS] [ROWS]     (default 3 rounds, 100000000 rows)
#
# "warm" first touches WARM_GB (default 12) of huge pages in a process that then exits: on a VM
# whose freed memory goes back to the host (free page reporting), the next process's first touch
# of that much is then the guest's work alone, not the hypervisor's too.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,10p "$0" >&2; exit 2; }
BIN=$1/bench/pskv-bench ROUNDS=${2:-3} ROWS=${3:-100000000}
[ -x "$BIN" ] || { echo "no $BIN" >&2; exit 1; }
warm() {
  python3 - "${WARM_GB:-12}" <<'PY'
import mmap, sys, time
n = int(sys.argv[1]) << 30
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.madvise(mmap.MADV_HUGEPAGE)
t = time.monotonic()
m[::4096] = b"\1" * (n // 4096)
print(f"warm: {n >> 30} GiB first touched in {time.monotonic() - t:.1f} s", file=sys.stderr)
PY
}
for r in $(seq 1 "$ROUNDS"); do
  for memory in fresh warm; do
    [ "$memory" = warm ] && warm
    "$BIN" --workload rows --transport tcp --table-keys "$ROWS" --clients 2 --seconds 0.2 --ops pull --json 2>/dev/null |
      grep '"op":"insert"' | sed "s/^{/{\"round\":$r,\"memory\":\"$memory\",/"
  done
done
