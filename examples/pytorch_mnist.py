#!/usr/bin/env python3
"""PyTorch MNIST through pskv: seed 001's CNN, data-parallel over S servers and W workers.

    python3 examples/pytorch_mnist.py --launch --servers 2 --workers 2 --transport shm --mode ssp --staleness 2
    python3 examples/pytorch_mnist.py --local --threads 2                  # one process, no PS: the baseline
    torchrun --nproc-per-node 2 examples/pytorch_mnist.py --servers 2      # rank 0 also hosts the servers
    mpirun -np 4 python3 examples/pytorch_mnist.py --servers 2 --workers 2 --transport tcp --port-base 9700

Under mpirun/srun ranks [0, servers) serve and the rest train, as with pskv-mnist. Prints the test
accuracy after each epoch and, with --json, the same one-line summary as pskv-mnist.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import pskv
    import pskv.torch as pt
except ImportError as e:  # the usual cause: the package is neither installed nor on PYTHONPATH
    sys.exit(f"pytorch_mnist: {e}; run with PYTHONPATH=build/python, or cmake --install build")


# ---- data: the project's own IDX files (scripts/fetch-data.sh), read with numpy ----
def read_idx(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {data.size} bytes of data")
    return data.reshape(shape)


def load_split(data_dir: str, split: str, limit: int):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte"))
    if limit:
        images, labels = images[:limit], labels[:limit]
    # The seed's transform: ToTensor (pixels in [0,1]) then Normalize((0.1307,), (0.3081,)).
    x = torch.from_numpy(((images.astype(np.float32) / 255.0 - 0.1307) / 0.3081)[:, None, :, :].copy())
    return x, torch.from_numpy(labels.astype(np.int64))


# ---- models ----
class SimpleCNN(nn.Module):
    """Seed 001's network, layer for layer (pskv-mnist's --model cnn)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.dropout1 = nn.Dropout2d(0.5)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout2 = nn.Dropout2d(0.75)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 20)
        self.fc3 = nn.Linear(20, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.dropout1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = self.dropout2(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.fc2(x)
        x = F.relu(x)
        x = self.fc3(x)
        return F.log_softmax(x, dim=1)


class MLP(nn.Module):
    """pskv-mnist's --model mlp: 784-256-128-10."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 256), nn.Linear(256, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def make_model(name: str) -> nn.Module:
    return SimpleCNN() if name == "cnn" else MLP()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            correct += (model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
    model.train()
    return correct / max(1, len(x))


def summary(a, result: dict, mode_name: str) -> str:
    local = mode_name == "local"
    return json.dumps({
        "mode": mode_name, "staleness": a.staleness, "transport": "none" if local else a.transport,
        "workers": 1 if local else a.workers, "servers": 0 if local else a.servers, "model": a.model,
        "dataset": "mnist", "epochs": a.epochs, "batch": a.batch, "lr": a.lr, "threads": a.threads,
        "update": a.update, "test_accuracy": round(result["test_accuracy"], 4),
        "samples_per_s": round(result["samples_per_s"], 1), "max_staleness": result["max_staleness"],
        "wall_s": round(result["wall_s"], 2), "time_to_target_s": -1.0, "target_accuracy": 0.0,
        "server_restarts": 0, "epoch_accuracy": [round(x, 4) for x in result["epoch_accuracy"]]})


def local_optimizer(a, model: nn.Module) -> torch.optim.Optimizer:
    """The torch optimizer matching --rule (what the servers apply with update="server"), for
    --local and for update="worker"."""
    if a.rule == "adam":
        return torch.optim.Adam(model.parameters(), lr=a.lr)
    if a.rule == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=a.lr)
    return torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum if a.rule == "momentum" else 0.0)


# ---- training ----
def train(a, worker: int, workers: int, client) -> dict:
    """One worker's loop (client None: --local). Worker 0 evaluates after each epoch; evaluation
    time is left out of samples/s, as pskv-mnist does."""
    torch.manual_seed(a.seed + worker)  # different dropout per worker; the weights come from the servers
    x, y = load_split(a.data, "train", a.train_limit)
    lo, hi = len(x) * worker // workers, len(x) * (worker + 1) // workers
    x, y = x[lo:hi], y[lo:hi]
    chief = worker == 0
    tx, ty = load_split(a.data, "test", a.test_limit) if chief else (None, None)
    model = make_model(a.model)
    if client is None:
        opt = local_optimizer(a, model)
    elif a.update == "worker":
        opt = pt.DistributedOptimizer(model.named_parameters(), client, update="worker",
                                      optimizer=local_optimizer(a, model))
    else:
        opt = pt.DistributedOptimizer(model.named_parameters(), client)
    if client is not None:
        client.barrier()
    rng = np.random.default_rng(a.seed * 7919 + worker)
    steps = len(x) // a.batch
    if steps == 0:
        raise SystemExit(f"pytorch_mnist: --batch {a.batch} is more than the {len(x)} training samples of worker {worker}")
    samples, eval_s, epoch_accuracy = 0, 0.0, []
    start = time.monotonic()
    for epoch in range(a.epochs):
        order = torch.from_numpy(rng.permutation(len(x)))
        loss = torch.zeros(())
        for s in range(steps):
            idx = order[s * a.batch:(s + 1) * a.batch]
            opt.zero_grad()
            loss = F.nll_loss(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            samples += a.batch
        if chief:
            e0 = time.monotonic()
            acc = accuracy(model, tx, ty)
            eval_s += time.monotonic() - e0
            epoch_accuracy.append(acc)
            rate = samples * workers / max(1e-9, time.monotonic() - start - eval_s)
            stale = client.staleness()["max"] if client else 0
            print(f"epoch {epoch + 1}/{a.epochs}: test accuracy {100 * acc:.2f}%, loss {loss.item():.4f}, "
                  f"{rate:.0f} samples/s, max staleness {stale}", flush=True)
    wall = time.monotonic() - start
    result = {"samples": samples, "samples_per_s": samples / max(1e-9, wall - eval_s), "wall_s": wall,
              "epoch_accuracy": epoch_accuracy, "test_accuracy": epoch_accuracy[-1] if epoch_accuracy else 0.0,
              "max_staleness": 0}
    if client is not None:
        client.barrier()  # everyone's last pushes are in
        if chief:
            if a.update == "server":
                opt.pull_weights()
            result["test_accuracy"] = accuracy(model, tx, ty)
        result["max_staleness"] = client.staleness()["max"]
    return result


def server_uris(a, job: str):
    if a.transport == "shm":
        return [f"shm://{job}-{s}" for s in range(a.servers)]
    if not a.port_base:
        sys.exit("pytorch_mnist: tcp/rdma cluster runs need --port-base (server s listens on port-base + s)")
    return [f"{a.transport}://{a.host}:{a.port_base + s}" for s in range(a.servers)]


def server_options(a, workers: int) -> dict:
    # update="worker" exchanges mean gradients: sync aggregation, stored as they are ("assign").
    worker_update = a.update == "worker"
    return dict(workers=workers, mode="sync" if worker_update else a.mode,
                staleness=0 if worker_update else a.staleness,  # main() zeroes it outside ssp
                rule="assign" if worker_update else a.rule, lr=a.lr, momentum=a.momentum,
                wait_timeout=a.wait_timeout, arena_mb=64, io_threads=1,
                **(dict(shm_clients=workers + 4, shm_area_mb=16) if a.transport == "shm" else {}))


def serve(a, index: int, uri: str, workers: int) -> None:
    """Hosts one shard in this process until every worker finished (or the job failed)."""
    with pskv.Server(uri, server_id=index, **server_options(a, workers)) as server:
        while not server.workers_finished():
            if server.failure():
                time.sleep(5)  # let the workers see their own errors first
                failure = server.failure()  # a worker that reconnected cleared it: not the job's end
                if failure:
                    sys.exit(f"pytorch_mnist: server {index}: {failure}")
            time.sleep(0.2)


def run_worker(a, worker: int, workers: int, uris) -> dict:
    # Connects (retrying while the servers start); 'with' announces "finished" only on success.
    with pt.client_from_env(uris, chunk_floats=1 << 16, io_timeout=a.wait_timeout + 10) as client:
        return train(a, worker, workers, client)


def launch(a) -> dict:
    """S pskv-server processes and W worker processes on this node."""
    job = a.job or f"pytorch-mnist-{os.getpid()}"
    opts = server_options(a, a.workers)
    with pskv.launch(a.servers, a.transport, job=job, **opts) as servers:
        print(f"pytorch_mnist: {a.servers} servers, {a.workers} workers over {a.transport}, mode "
              f"{opts['mode']}{' s=%d' % a.staleness if opts['mode'] == 'ssp' else ''}, update {a.update}, "
              f"model {a.model}, {a.epochs} epochs; servers at {', '.join(servers.uris)}", flush=True)
        procs = []
        for w in range(a.workers):
            env = dict(os.environ, PSKV_RANK=str(w), PSKV_WORLD_SIZE=str(a.workers), PSKV_SERVERS=",".join(servers.uris))
            args = [sys.executable, os.path.abspath(__file__), "--worker-process"] + sys.argv[1:]
            procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
        results = [None] * a.workers

        def relay(w):  # progress lines through, the result line kept
            for line in procs[w].stdout:
                if line.startswith("RESULT "):
                    results[w] = json.loads(line[7:])
                else:
                    print(line, end="", flush=True)

        relays = [threading.Thread(target=relay, args=(w,)) for w in range(a.workers)]
        for t in relays:
            t.start()
        # One failed worker fails the job at once: the others would only wait for it at the bound.
        failed = []
        while not failed and any(p.poll() is None for p in procs):
            failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
            time.sleep(0.2)
        # Looked at again after that last sleep, so workers failing together (one cause, e.g. no
        # data) are reported as failed rather than stopped, and none that failed last is missed.
        failed = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
        stopped = [w for w, p in enumerate(procs) if p.poll() is None]
        for w in stopped:
            procs[w].terminate()
        for p in procs:
            p.wait()
        for t in relays:
            t.join()
        failed += [w for w in range(a.workers) if results[w] is None and w not in failed + stopped]
        if failed or stopped:
            sys.exit(f"pytorch_mnist: worker(s) {failed} failed" + (f", so {stopped} were stopped" if stopped else "") +
                     "; see the messages above")
    return {"test_accuracy": results[0]["test_accuracy"], "epoch_accuracy": results[0]["epoch_accuracy"],
            "samples_per_s": sum(r["samples_per_s"] for r in results),
            "max_staleness": max(r["max_staleness"] for r in results), "wall_s": max(r["wall_s"] for r in results)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    p.add_argument("--launch", action="store_true", help="start --servers servers and --workers workers on this node")
    p.add_argument("--local", action="store_true", help="train in this process without a parameter server")
    p.add_argument("--worker-process", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", default=env("PSKV_DATA", "data/mnist"))
    p.add_argument("--model", choices=["cnn", "mlp"], default=env("PSKV_MODEL", "cnn"))
    p.add_argument("--epochs", type=int, default=int(env("PSKV_EPOCHS", 4)))
    p.add_argument("--batch", type=int, default=int(env("PSKV_BATCH", 32)))
    p.add_argument("--lr", type=float, default=float(env("PSKV_LR", 0.05)))
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=int(env("PSKV_THREADS", 1)), help="torch threads per process")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--transport", choices=["shm", "tcp", "rdma"], default=env("PSKV_TRANSPORT", "shm"))
    p.add_argument("--servers", type=int, default=int(env("PSKV_SERVERS_COUNT", 2)))
    p.add_argument("--workers", type=int, default=int(env("PSKV_WORKERS", 2)))
    p.add_argument("--mode", choices=["bsp", "ssp", "asp"], default=env("PSKV_MODE", "ssp"))
    p.add_argument("--staleness", type=int, default=int(env("PSKV_STALENESS", 2)))
    p.add_argument("--rule", choices=["sgd", "momentum", "adam", "adagrad"], default=env("PSKV_RULE", "sgd"))
    p.add_argument("--update", choices=["server", "worker"], default="server",
                   help="server: the servers' rule updates the weights; worker: mean gradients, local SGD")
    # Generous: worker 0 evaluates the test set after each epoch while the others wait at the
    # bound, and on a loaded 2-core host the CNN's evaluation alone took over 60 s.
    p.add_argument("--wait-timeout", type=float, default=600.0,
                   help="seconds a bounded read waits for a stalled worker")
    p.add_argument("--host", default=env("PSKV_HOST", "127.0.0.1"))
    p.add_argument("--port-base", type=int, default=int(env("PSKV_PORT_BASE", 0)))
    p.add_argument("--job", default=env("PSKV_JOB", ""))
    p.add_argument("--json", action="store_true", help="end with a one-line JSON summary")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.mode != "ssp":  # the servers take a staleness only in ssp
        a.staleness = 0

    if a.local:
        r = train(a, 0, 1, None)
        print(f"final test accuracy {100 * r['test_accuracy']:.2f}% ({r['samples_per_s']:.0f} samples/s, "
              f"{r['wall_s']:.1f} s)")
        if a.json:
            print(summary(a, r, "local"))
        return
    if a.worker_process:  # one of --launch's workers
        worker, workers = pt.worker_rank(len(pskv._env.servers_from_env()))
        if worker != 0:
            sys.stdout = open(os.devnull, "w")  # only the chief reports progress
        r = run_worker(a, worker, workers, None)
        sys.stdout = sys.__stdout__
        print("RESULT " + json.dumps(r), flush=True)
        return
    if a.launch:
        r = launch(a)
    else:
        cluster = pskv.detect_cluster()
        if cluster is None:
            sys.exit("pytorch_mnist: say --launch (this node), --local (no PS), or run under torchrun/mpirun/srun")
        if cluster.workers_only:  # torchrun: every rank trains; rank 0 hosts the servers in-process
            a.workers = cluster.size
            master_port = int(env("MASTER_PORT", "29500"))
            if not a.port_base:
                a.port_base = master_port + 1
            a.host = env("MASTER_ADDR", a.host) if a.transport != "shm" else a.host
            uris = server_uris(a, a.job or f"torchrun-{master_port}")
            hosted = []
            if cluster.rank == 0:
                hosted = [pskv.Server(u, server_id=s, **server_options(a, a.workers)) for s, u in enumerate(uris)]
            r = run_worker(a, cluster.rank, cluster.size, uris)
            deadline = time.monotonic() + 60
            while hosted and not all(s.workers_finished() for s in hosted) and time.monotonic() < deadline:
                time.sleep(0.1)
            for s in hosted:
                s.stop()
            if cluster.rank != 0:
                return
        else:  # mpirun/srun: ranks below --servers serve
            if cluster.size != a.servers + a.workers:
                sys.exit(f"pytorch_mnist: {cluster.size} ranks but --servers {a.servers} + --workers {a.workers}")
            uris = server_uris(a, a.job or "pytorch-mnist-job")
            if cluster.rank < a.servers:
                serve(a, cluster.rank, uris[cluster.rank], a.workers)
                return
            worker, workers = pt.worker_rank(len(uris))
            r = run_worker(a, worker, workers, uris)
            if worker != 0:
                return
    mode_name = "sync" if a.update == "worker" else a.mode
    # --launch adds up every worker's samples/s; a cluster run reports worker 0's, as pskv-mnist does.
    rate = f"over {a.workers} workers" if a.launch else "worker 0"
    print(f"final test accuracy {100 * r['test_accuracy']:.2f}% ({r['samples_per_s']:.0f} samples/s {rate}, "
          f"max staleness {r['max_staleness']}, {r['wall_s']:.1f} s)")
    if a.json:
        print(summary(a, r, mode_name))


if __name__ == "__main__":
    main()
