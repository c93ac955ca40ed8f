#!/usr/bin/env python3
"""A click-through-rate model over pskv embedding tables, on a click log this script generates.

    python3 examples/ctr_fm.py                       # 2 tcp servers, 2 workers, 12M clicks, ~1.5 minutes
    python3 examples/ctr_fm.py --transport shm       # the same over shared memory
    python3 examples/ctr_fm.py --train 10000000 --ids-per-field 100000000 --json

The log: every sample has --fields categorical fields; each field's ids are drawn from
--ids-per-field distinct features by a Zipf law (exponent --zipf), as real click logs are. Labels
come from a hidden factorization machine whose parameters are a fixed function of each feature
(a hash), so nothing is stored and the generator knows every sample's true click probability.
Its AUC on the test set (the "generator AUC") is the best any model can reach on these labels;
the trained model's AUC is checked against it.

The model is a factorization machine, logit = b + sum_f w_f + sum_{f<g} <v_f, v_g>, with
[w_f | v_f] one row of a pskv embedding table per feature (pskv.torch.Embedding): rows are
created at a feature's second push (--admit-after), updated on the servers by the table's rule
(lazy, row-wise Adagrad here, its epsilon large so that a new row's first steps are small), and
each worker trains on its own share of the log, asynchronously (ASP).
The hidden model's effects shrink with a feature's rank (rare features are mostly noise), so
that the head a finite log can learn carries most of the signal.
"""

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time

import numpy as np

try:
    import pskv
except ImportError as e:
    sys.exit(f"ctr_fm: {e}; run with PYTHONPATH=build/python, or cmake --install build")

BIAS_ID = (1 << 63) + 1  # the shared bias: one more row of the table, outside every field's ids
TABLE = 0
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over uint64 arrays (numpy's uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & M64
        return x ^ (x >> np.uint64(31))


def uniform(x: np.ndarray) -> np.ndarray:
    """(0, 1) floats from uint64 hashes."""
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


class ClickLog:
    """The generator: Zipf feature ids per field and labels from a hidden factorization machine."""

    def __init__(self, fields: int, ids_per_field: int, zipf: float, k: int, seed: int):
        self.fields, self.n, self.s, self.k, self.seed = fields, ids_per_field, zipf, k, seed

    def ranks(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """[count, fields] feature ranks, 0 the most frequent: the continuous power law x^-s on
        [1, n + 1) by its inverse CDF, floored (a Zipf law up to the discretisation)."""
        u = rng.random((count, self.fields))
        a = 1.0 - self.s
        if abs(a) < 1e-9:  # s = 1: the CDF is a logarithm
            x = (self.n + 1.0) ** u
        else:
            x = (1.0 - u * (1.0 - (self.n + 1.0) ** a)) ** (1.0 / a)
        return np.minimum(np.floor(x).astype(np.int64) - 1, self.n - 1)

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        """Feature ids: a field's ranks scattered over 48 bits, the field in the top bits."""
        field = np.arange(self.fields, dtype=np.uint64)[None, :]
        scattered = splitmix(ranks.astype(np.uint64) ^ (field * np.uint64(0x632BE59BD9B4E019))) >> np.uint64(16)
        return ((field << np.uint64(48)) | scattered).astype(np.int64)

    def hidden(self, ids: np.ndarray, ranks: np.ndarray):
        """The hidden model's w [.., 1] and v [.., k] of each feature: normal draws from the id's
        hash, scaled down with the feature's rank."""
        base = splitmix(ids.astype(np.uint64) ^ np.uint64(self.seed * 0x2545F4914F6CDD1D))
        draws = []
        for j in range(2 * (self.k + 1)):
            base = splitmix(base)
            draws.append(uniform(base))
        z = [np.sqrt(-2 * np.log(draws[2 * j])) * np.cos(2 * np.pi * draws[2 * j + 1]) for j in range(self.k + 1)]
        scale = 1.0 / np.sqrt(1.0 + ranks / 200.0)
        w = 0.6 * z[0] * scale
        v = np.stack([0.45 * zj * scale for zj in z[1:]], axis=-1)
        return w, v

    def logits(self, ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        w, v = self.hidden(ids, ranks)
        s = v.sum(axis=1)
        pairs = 0.5 * ((s * s).sum(-1) - (v * v).sum(axis=(1, 2)))
        return -1.0 + w.sum(axis=1) + pairs

    def batch(self, rng: np.random.Generator, count: int):
        """(ids [count, fields], labels [count], true logits [count])."""
        ranks = self.ranks(rng, count)
        ids = self.ids(ranks)
        z = self.logits(ids, ranks)
        labels = (rng.random(count) < 1.0 / (1.0 + np.exp(-z))).astype(np.float32)
        return ids, labels, z


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):  # average rank over runs of equal scores
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i:j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty(len(s))
    r[order] = ranks
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((r[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def with_bias(ids: np.ndarray) -> np.ndarray:
    """The bias's id as one more column: pulled with the features (and sent once per batch)."""
    return np.concatenate([ids, np.full((len(ids), 1), BIAS_ID - (1 << 64), np.int64)], axis=1)


def fm_logits(rows):
    """rows [B, F + 1, 1 + k] (the bias's row last) -> logits [B]."""
    bias = rows[:, -1, 0]
    rows = rows[:, :-1]
    w, v = rows[..., 0], rows[..., 1:]
    s = v.sum(dim=1)
    pairs = 0.5 * ((s * s).sum(-1) - (v * v).sum(dim=(1, 2)))
    return bias + w.sum(dim=1) + pairs


def table_spec(args) -> dict:
    return dict(init="normal", init_scale=args.init_scale, seed=args.seed, rule=args.rule, lr=args.lr,
                eps=args.eps, max_rows=args.max_rows, admit_after=args.admit_after,
                eviction="lru" if args.max_rows else "none")


def worker(rank: int, args, servers, results) -> None:
    import torch
    import pskv.torch as pt
    torch.set_num_threads(1)
    log = ClickLog(args.fields, args.ids_per_field, args.zipf, args.hidden_k, args.seed)
    client = pskv.Client(servers)  # asynchronous (ASP) and anonymous: no clocks to keep
    emb = pt.Embedding(client, TABLE, 1 + args.k, **table_spec(args))
    rng = np.random.default_rng([args.seed, 1, rank])
    share = args.train // args.workers
    seen, start, losses = 0, time.perf_counter(), []
    for epoch in range(args.epochs):
        rng = np.random.default_rng([args.seed, 1, rank])  # the same share of the log every epoch
        for first in range(0, share, args.batch):
            count = min(args.batch, share - first)
            ids, labels, _ = log.batch(rng, count)
            logits = fm_logits(emb(torch.from_numpy(with_bias(ids))))
            # Summed, not averaged: each row's gradient is the sum over its own samples, as a
            # row-wise Adagrad expects, whatever else is in the batch.
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels),
                                                                        reduction="sum")
            loss.backward()
            losses.append(loss.item() / count)
            seen += count
    emb.wait()
    results.put((rank, seen, time.perf_counter() - start, float(np.mean(losses[-50:]))))
    client.close()


def evaluate(args, servers):
    import torch
    import pskv.torch as pt
    log = ClickLog(args.fields, args.ids_per_field, args.zipf, args.hidden_k, args.seed)
    rng = np.random.default_rng([args.seed, 2])
    ids, labels, z = log.batch(rng, args.test)
    client = pskv.Client(servers)
    emb = pt.Embedding(client, TABLE, 1 + args.k, **table_spec(args))
    scores = []
    with torch.no_grad():
        for first in range(0, args.test, 10000):
            scores.append(fm_logits(emb(torch.from_numpy(with_bias(ids[first:first + 10000])))).numpy())
    stats = [client.server_stats(s) for s in range(len(servers))]
    client.close()
    return auc(np.concatenate(scores), labels), auc(z, labels), float(labels.mean()), stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--transport", default="tcp", choices=["tcp", "shm"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--ids-per-field", type=int, default=10_000_000)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--train", type=int, default=12_000_000, help="training samples (over all workers, per epoch)")
    p.add_argument("--test", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--k", type=int, default=7, help="factor dimensions of the model (rows hold 1 + k floats)")
    p.add_argument("--hidden-k", type=int, default=4, help="factor dimensions of the hidden model")
    p.add_argument("--rule", default="adagrad", choices=["sgd", "adagrad", "adam"])
    p.add_argument("--lr", type=float, default=None,
                   help="the rule's learning rate (0.07; 0.01 for sgd, whose steps are not scaled by a row's history)")
    p.add_argument("--init-scale", type=float, default=0.01)
    p.add_argument("--eps", type=float, default=1.0, help="the rule's epsilon (Adagrad: damps the first steps of a row)")
    p.add_argument("--admit-after", type=int, default=2,
                   help="pushes before a feature gets a row (features seen once stay at their initial value)")
    p.add_argument("--max-rows", type=int, default=0, help="rows per server, evicted LRU past it (0: no cap)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--table-memory-mb", type=int, default=4096, help="each server's room for table rows")
    p.add_argument("--target-gap", type=float, default=0.01,
                   help="exit 1 if the trained AUC is further than this below the generator's")
    p.add_argument("--json", action="store_true", help="print one JSON summary line")
    args = p.parse_args()
    if args.lr is None:
        args.lr = 0.01 if args.rule == "sgd" else 0.07
    t0 = time.perf_counter()
    with pskv.launch(args.servers, transport=args.transport, table_memory_mb=args.table_memory_mb) as group:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, args, group.uris, results)) for r in range(args.workers)]
        for proc in procs:
            proc.start()
        done = []
        while len(done) < len(procs):  # a worker that dies must not leave this waiting
            try:
                done.append(results.get(timeout=0.5))
            except queue.Empty:
                dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
                if dead:
                    print(f"ctr_fm: a worker exited with {dead[0]}", file=sys.stderr)
                    for proc in procs:
                        proc.terminate()
                    return 1
        for proc in procs:
            proc.join()
        train_s = max(d[2] for d in done)
        samples = sum(d[1] for d in done)
        trained, best, ctr, stats = evaluate(args, group.uris)
    rows = sum(s.get(f"table_{TABLE}_rows", 0) for s in stats)
    table_bytes = sum(s.get(f"table_{TABLE}_bytes", 0) for s in stats)
    summary = {
        "example": "ctr_fm", "transport": args.transport, "servers": args.servers, "workers": args.workers, "fields": args.fields,
        "ids_per_field": args.ids_per_field, "zipf": args.zipf, "train_samples": samples, "test_samples": args.test,
        "click_rate": round(ctr, 4), "trained_auc": round(trained, 4), "generator_auc": round(best, 4),
        "gap": round(best - trained, 4), "samples_per_s": round(samples / train_s), "rows": rows,
        "bytes_per_row": round(table_bytes / max(rows, 1), 1), "final_loss": round(float(np.mean([d[3] for d in done])), 4),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"trained AUC {trained:.4f}, generator AUC {best:.4f} (gap {best - trained:.4f}); "
              f"{samples:,} clicks at {summary['samples_per_s']:,} samples/s over {args.workers} workers; "
              f"{rows:,} rows on {args.servers} servers, {summary['bytes_per_row']} bytes each")
    return 0 if best - trained <= args.target_gap else 1


if __name__ == "__main__":
    sys.exit(main())
