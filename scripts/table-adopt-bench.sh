#!/usr/bin/env bash
# How long an shm server takes to adopt the embedding table a killed predecessor left
# (shm://NAME?adopt=1; docs/bench/tables.md, "shm servers made to be adopted"): ROWS rows of 16
# floats (Adam) pushed in batches of 100,000, the server SIGKILLed and started again, its
# `adopted_ms` read from its stats, and 1,000 probed rows compared with what they held.
#
#   scripts/table-adopt-bench.sh BUILD_DIR [ROWS]     (default 2000000 rows)
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,7p "$0" >&2; exit 2; }
BUILD=$(cd "$1" && pwd) ROWS=${2:-2000000}
[ -x "$BUILD/apps/pskv-server" ] || { echo "no $BUILD/apps/pskv-server" >&2; exit 1; }
PYTHONPATH=$BUILD/python /usr/bin/python3 - "$BUILD/apps/pskv-server" "$ROWS" <<'PY'
import json, os, signal, subprocess, sys, time
import numpy as np
import pskv

server, rows = sys.argv[1], int(sys.argv[2])
name = f"adopt-bench-{os.getpid()}"
args = [server, "--uri", f"shm://{name}?adopt=1", "--table-memory-mb", str(max(1024, rows * 240 >> 20))]

def start():
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    p.stdout.readline()  # its URI: serving
    return p

def table(c):
    c.create_table(0, dim=16, init="uniform", rule="adam", lr=0.01)

p = start()
try:
    c = pskv.Client([f"shm://{name}"])
    table(c)
    batch = 100000
    grads = np.ones((batch, 16), np.float32)
    began = time.monotonic()
    for first in range(0, rows, batch):
        ids = np.arange(first, min(first + batch, rows), dtype=np.int64)
        c.push_rows(0, ids, grads[:len(ids)]).wait()
    inserted = time.monotonic() - began
    probe = np.arange(0, rows, max(1, rows // 1000), dtype=np.int64)
    before = np.zeros((len(probe), 16), np.float32)
    c.pull_rows(0, probe, before).wait()
    del c
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed = time.monotonic()
    p = start()
    serving = time.monotonic() - killed
    c = pskv.Client([f"shm://{name}"])
    table(c)
    after = np.zeros_like(before)
    c.pull_rows(0, probe, after).wait()
    stats = c.server_stats(0)
    del c
    print(json.dumps({"rows": rows, "insert_s": round(inserted, 2), "serving_again_s": round(serving, 2),
                      "adopted_ms": float(stats["adopted_ms"]), "adopted_rows": int(stats["adopted_rows"]),
                      "probed_rows_equal": bool((before == after).all())}))
finally:
    p.send_signal(signal.SIGTERM)
    p.wait()
PY
