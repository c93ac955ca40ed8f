"""python -m pskv.bench: pskv from Python next to pskv-bench (C++) against the same server.

For each transport it starts one pskv-server, runs pskv-bench against it (--server), measures
the same operations through pskv.Client, then runs pskv-bench again; the C++ figure is the
mean of the two runs around the Python one, because this kind of machine drifts between runs.
Printed: push/pull bandwidth of 1 MiB and 16 MiB values and the p50 of a 64-byte (16-float)
pull, with Python/C++ ratios. --json prints one object per line.
"""

import argparse
import json
import statistics
import subprocess
import time

import numpy as np

from . import Client
from .launcher import ServerGroup, _find_binary

SIZES = {"64": 64, "1M": 1 << 20, "16M": 16 << 20}


def bench_binary() -> str:
    """PSKV_BENCH_BIN, else the one built beside this package, else pskv-bench on PATH."""
    return _find_binary("PSKV_BENCH_BIN", "BENCH_BIN", "pskv-bench",
                        "build it (PSKV_BUILD_BENCH=ON) or set PSKV_BENCH_BIN")


def cpp_figures(uri: str, transport: str, seconds: float) -> dict:
    """{(op, value_bytes): (bytes_per_s, p50_us)} from one pskv-bench run against `uri`."""
    out = subprocess.run([bench_binary(), "--server", uri, "--transport", transport, "--json", "--clients", "1",
                          "--sizes", ",".join(SIZES), "--rounds", "1", "--seconds", str(seconds)],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    figures = {}
    for line in out.splitlines():
        row = json.loads(line)
        if row.get("workload") == "dense":
            figures[(row["op"], row["value_bytes"])] = (row["bytes_per_s"], row["p50_us"])
    return figures


def python_figures(uri: str, seconds: float, key_base: int) -> dict:
    """The same points through pskv.Client: one operation in flight, as pskv-bench --depth 1."""
    figures = {}
    with Client(uri) as c:
        for i, nbytes in enumerate(SIZES.values()):
            key = key_base + i
            value = np.ones(nbytes // 4, np.float32)
            c.init(key, value).wait()
            for op in ("push", "pull"):
                call = c.push if op == "push" else c.pull
                for _ in range(3):  # warm up
                    call(key, value).wait()
                latencies = []
                start = time.perf_counter()
                end = start + seconds
                while True:
                    t0 = time.perf_counter_ns()
                    call(key, value).wait()
                    latencies.append(time.perf_counter_ns() - t0)
                    if time.perf_counter() >= end and len(latencies) >= 5:
                        break
                elapsed = time.perf_counter() - start
                figures[(op, nbytes)] = (nbytes * len(latencies) / elapsed, statistics.median(latencies) / 1000)
    return figures


def run(transports, seconds: float, as_json: bool) -> None:
    for transport in transports:
        with ServerGroup(1, transport, arena_mb=128, io_threads=1) as server:
            uri = server.uris[0]
            before = cpp_figures(uri, transport, seconds)
            py = python_figures(uri, seconds, key_base=1000)
            after = cpp_figures(uri, transport, seconds)
        if not as_json:
            print(f"\n{transport} (server {uri}; C++ = mean of the pskv-bench runs before and after Python)")
            print(f"{'op':5} {'size':>5}  {'python':>14}  {'C++':>14}  {'python/C++':>10}")
        for (op, nbytes), (py_bw, py_p50) in py.items():
            cpp_bw = (before[(op, nbytes)][0] + after[(op, nbytes)][0]) / 2
            cpp_p50 = (before[(op, nbytes)][1] + after[(op, nbytes)][1]) / 2
            name = next(k for k, v in SIZES.items() if v == nbytes)
            if as_json:
                print(json.dumps({"transport": transport, "op": op, "value_bytes": nbytes, "python_bytes_per_s": py_bw,
                                  "cpp_bytes_per_s": cpp_bw, "bandwidth_ratio": py_bw / cpp_bw,
                                  "python_p50_us": py_p50, "cpp_p50_us": cpp_p50,
                                  "p50_difference_us": py_p50 - cpp_p50}))
            elif nbytes == 64:
                print(f"{op:5} {name:>5}  {py_p50:11.2f} us  {cpp_p50:11.2f} us  {py_p50 - cpp_p50:+8.2f} us (p50)")
            else:
                print(f"{op:5} {name:>5}  {py_bw / 1e9:9.2f} GB/s  {cpp_bw / 1e9:9.2f} GB/s  {py_bw / cpp_bw:10.3f}")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pskv.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp")
    p.add_argument("--seconds", type=float, default=1.0, help="measuring time per point")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    run([t for t in a.transports.split(",") if t], a.seconds, a.json)


if __name__ == "__main__":
    main()
