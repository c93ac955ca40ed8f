"""python -m pskv.bench: what Python costs over C++ for the same pskv operations.

For each transport it starts one pskv-server and, on one pskv.Client, times the same loop (one
operation in flight: push or pull, then wait) from Python, in both forms (op(...).wait() and
op(..., async_op=False)), and in C++ (Client._cpp_loop: the loop
pskv-bench runs, in this process, on the same connection), alternating every --seconds for
--rounds rounds. This kind of machine drifts by more between seconds than Python could cost, so
each Python window is compared with the C++ window next to it, and the median of those ratios is
printed with their range. Points: push/pull bandwidth of 1 MiB and 16 MiB values and the p50 of a
64-byte (16-float) push and pull. --cpp-bench also runs pskv-bench against the server once, for
reference. --json prints one object per line.
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


FORMS = ("wait", "blocking")  # op(...).wait(), and op(..., async_op=False)


def python_window(c: Client, key: int, value: np.ndarray, op: str, form: str, seconds: float):
    """(bytes/s, p50 us) of `op` from Python, one operation in flight, in either form. The loop
    does what Client._cpp_loop does, no more: two clock reads per operation, the second one
    also deciding when to stop."""
    call = c.push if op == "push" else c.pull
    now = time.perf_counter_ns
    latencies = []
    record = latencies.append
    start = time.perf_counter()
    end = now() + int(seconds * 1e9)
    if form == "wait":
        while True:
            t0 = now()
            call(key, value).wait()
            t1 = now()
            record(t1 - t0)
            if t1 >= end and len(latencies) >= 5:
                break
    else:
        while True:
            t0 = now()
            call(key, value, async_op=False)
            t1 = now()
            record(t1 - t0)
            if t1 >= end and len(latencies) >= 5:
                break
    elapsed = time.perf_counter() - start
    return value.nbytes * len(latencies) / elapsed, statistics.median(latencies) / 1000


def run(transports, seconds: float, rounds: int, as_json: bool, with_cpp_bench: bool) -> None:
    for transport in transports:
        ratios, differences = {}, {}
        with ServerGroup(1, transport, arena_mb=128, io_threads=1) as server:
            uri = server.uris[0]
            reference = cpp_figures(uri, transport, seconds) if with_cpp_bench else {}
            with Client(uri) as c:
                for i, nbytes in enumerate(SIZES.values()):
                    key, value = 1000 + i, np.ones(nbytes // 4, np.float32)
                    c.init(key, value).wait()
                    for op in ("push", "pull"):
                        for _ in range(3):  # warm up every path
                            c._cpp_loop(key, value, op, 0.0)
                            for form in FORMS:
                                python_window(c, key, value, op, form, 0.0)
                        for r in range(rounds):
                            for form in FORMS:
                                if r % 2 == 0:
                                    cpp = c._cpp_loop(key, value, op, seconds)
                                    py = python_window(c, key, value, op, form, seconds)
                                else:
                                    py = python_window(c, key, value, op, form, seconds)
                                    cpp = c._cpp_loop(key, value, op, seconds)
                                ratios.setdefault((op, nbytes, form), []).append(py[0] / cpp[0])
                                differences.setdefault((op, nbytes, form), []).append(py[1] - cpp[1])
        if not as_json:
            print(f"\n{transport} (server {uri}; {rounds} alternating rounds of {seconds} s: median, and the range)")
            print(f"{'op':5} {'size':>5} {'form':8}  {'python/C++ bandwidth':>22}  {'p50: python - C++':>24}")
        for (op, nbytes, form), r in ratios.items():
            name = next(k for k, v in SIZES.items() if v == nbytes)
            ratio, diff = statistics.median(r), statistics.median(differences[(op, nbytes, form)])
            ref = reference.get((op, nbytes))
            if as_json:
                row = {"transport": transport, "op": op, "value_bytes": nbytes, "form": form, "rounds": rounds,
                       "bandwidth_ratio": ratio, "bandwidth_ratios": r, "p50_difference_us": diff,
                       "p50_differences_us": differences[(op, nbytes, form)]}
                if ref:
                    row.update({"pskv_bench_bytes_per_s": ref[0], "pskv_bench_p50_us": ref[1]})
                print(json.dumps(row))
                continue
            d = differences[(op, nbytes, form)]
            line = (f"{op:5} {name:>5} {form:8}  {ratio:8.3f} ({min(r):.2f}-{max(r):.2f})    "
                    f"{diff:+8.2f} us ({min(d):+.2f} to {max(d):+.2f})")
            if ref:
                line += f"    pskv-bench: {ref[0] / 1e9:.2f} GB/s, p50 {ref[1]:.2f} us"
            print(line)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m pskv.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="shm,tcp", help="comma-separated: shm, tcp")
    p.add_argument("--seconds", type=float, default=0.25, help="measuring time of each window")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds of C++ and Python windows")
    p.add_argument("--cpp-bench", action="store_true", help="also run pskv-bench against the server, for reference")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    run([t for t in a.transports.split(",") if t], a.seconds, a.rounds, a.json, a.cpp_bench)


if __name__ == "__main__":
    main()
