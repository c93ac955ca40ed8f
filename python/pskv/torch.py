"""pskv for PyTorch: a distributed optimizer over model.named_parameters(), one key per parameter.

    import pskv.torch as pt
    client = pt.client_from_env()                  # rank, world size, servers from the launcher
    opt = pt.DistributedOptimizer(model.named_parameters(), client)         # server-side SGD etc.
    # or: pt.DistributedOptimizer(model.named_parameters(), client, update="worker",
    #                             optimizer=torch.optim.Adam(model.parameters()))
    for x, y in batches:
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()          # each gradient is pushed as soon as it is ready
        opt.step()                                  # ends the step (clock) and brings the new weights

Two ways to update, both with every worker starting from the same weights (the first
initialiser of each key wins, everyone pulls what won, then waits at a barrier so that no
worker's first push reaches another's first pull; so every worker must build its optimizer):
- update="server": gradients go to the servers, whose rule (sgd, momentum, adam, adagrad, with
  the servers' lr) updates the weights; step() pulls the weights straight into the parameters.
  Consistency is the servers': BSP, SSP or ASP.
- update="worker": the servers run mode "sync" with rule "assign", so each gradient key holds the
  mean of the step's gradients; step() pulls that mean into .grad and the local torch optimizer
  steps. Every worker then computes the same weights.
Large parameters are split over the servers by pskv (ClientOptions.chunk_floats).

Pushes start from gradient-accumulator hooks during backward (as Horovod and BytePS do), so
communication overlaps the rest of the backward pass.
"""

import time
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import Client, InvalidArgument, Io, PeerFailure, StaleResource, Timeout
from ._env import detect_cluster, servers_from_env

# Which live DistributedOptimizer pushes each parameter's gradient (by id: tensors compare by
# value): two would push it twice. An optimizer holds its parameters, so while it lives the ids
# cannot be reused; a dead one's weak reference answers None.
_owners: "Dict[int, weakref.ref]" = {}
# Weight keys in use by this process's optimizers, per client: (id(client), key) -> optimizer. Two
# models on one client with the same key_base would otherwise share (or fight over) their keys.
_key_users: "Dict[Tuple[int, int], weakref.ref]" = {}
# What a server that is still starting answers a connect with; anything else will not go away.
_NOT_UP_YET = (PeerFailure, Timeout, Io, StaleResource, ConnectionError)

# Gradient keys of update="worker" sit this far above the weight keys.
GRAD_KEY_OFFSET = 1 << 32


def client_from_env(servers: Optional[List[str]] = None, connect_for: float = 60.0, **client_options) -> Client:
    """A pskv.Client for this process's worker rank.

    Servers: `servers`, else PSKV_SERVERS (comma-separated URIs). Rank: torchrun (RANK,
    WORLD_SIZE), PSKV_RANK/PSKV_WORLD_SIZE, Open MPI, PMI or Slurm; under mpirun/srun the first
    len(servers) ranks are the servers and worker ids start after them, as in pskv-mnist.
    Connecting is retried for `connect_for` seconds while the servers may still be starting
    (connection refused, no segment yet); other errors (a bad option, a missing token file) at once.
    A client made with `retry_timeout` keeps trying an unreachable server that long itself, in
    each try here: with both, the wait may reach their sum.
    """
    uris = servers or servers_from_env()
    if not uris:
        raise ValueError("no servers: pass servers=[...] or set PSKV_SERVERS=uri,uri")
    worker, workers = worker_rank(len(uris))
    deadline = time.monotonic() + connect_for
    while True:
        try:
            return Client(uris, worker_id=worker, **client_options)
        except _NOT_UP_YET:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_rank(num_servers: int) -> Tuple[int, int]:
    """(worker id, number of workers) of this process; (0, 1) when run alone."""
    cluster = detect_cluster()
    if cluster is None:
        return 0, 1
    if cluster.workers_only:
        return cluster.rank, cluster.size
    if cluster.rank < num_servers:
        raise ValueError(f"rank {cluster.rank} is one of the {num_servers} server ranks, not a worker")
    return cluster.rank - num_servers, cluster.size - num_servers


def _contiguous_float32(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise InvalidArgument(f"parameter {name}: pskv.torch moves contiguous float32 CPU tensors, got {t.dtype} on "
                         f"{t.device} (contiguous: {t.is_contiguous()})")


def _holder(registry: dict, key):
    """The live optimizer `registry` records for `key`, or None."""
    ref = registry.get(key)
    return ref() if ref is not None else None


def _let_go(registry: dict, key, optimizer) -> None:
    """Forgets `key` if `optimizer` (or a dead one) holds it."""
    if key in registry and _holder(registry, key) in (optimizer, None):
        del registry[key]


def _named(parameters: Iterable) -> List[Tuple[str, torch.Tensor]]:
    """model.named_parameters() as given, or model.parameters() (torch.optim's spelling), named by
    position."""
    items = list(parameters)
    if all(isinstance(x, torch.Tensor) for x in items):
        return [(f"parameter {i}", t) for i, t in enumerate(items)]
    for x in items:
        if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)):
            raise TypeError("DistributedOptimizer takes model.named_parameters() or model.parameters(), not an "
                            f"iterable holding {type(x).__name__}")
    return items


class DistributedOptimizer:
    """See the module's doc. Keys: key_base + i for the i-th parameter with requires_grad (in the
    order of named_parameters), and key_base + 2**32 + i for its gradient (update="worker").

    Thread-safety: none; drive it from the training loop's thread (backward() there too, which is
    where PyTorch runs the CPU hooks that push).
    """

    def __init__(self, named_parameters: Iterable, client: Client, *,
                 update: str = "server", optimizer: Optional[torch.optim.Optimizer] = None, key_base: int = 0,
                 backward_passes_per_step: int = 1):
        if update not in ("server", "worker"):
            raise ValueError(f"update must be 'server' or 'worker', not {update!r}")
        if update == "worker" and optimizer is None:
            raise ValueError("update='worker' needs the local torch optimizer (optimizer=...)")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.client = client
        self.update = update
        self.optimizer = optimizer
        self.backward_passes_per_step = backward_passes_per_step
        # One key per tensor: a parameter listed twice (tied weights, concatenated lists) once, as
        # torch.optim does; an empty one has nothing to keep in step.
        named, seen = [], set()
        for n, p in _named(named_parameters):
            if p.requires_grad and p.numel() > 0 and id(p) not in seen:
                seen.add(id(p))
                named.append((n, p))
        if not named:
            raise ValueError("no parameters that require gradients")
        for n, p in named:
            if _holder(_owners, id(p)) is not None:
                raise ValueError(f"parameter {n} is already driven by another pskv.torch.DistributedOptimizer; "
                                 "call remove_hooks() on that one (or drop it) first")
        weight_keys = [key_base + i for i in range(len(named))]
        grad_keys = [key_base + GRAD_KEY_OFFSET + i for i in range(len(named))]
        # Gradient keys too: another model's weights at key_base + 2**32 would land on them.
        keys = weight_keys + (grad_keys if update == "worker" else [])
        taken = [k for k in keys if _holder(_key_users, (id(client), k)) is not None]
        if taken:
            used = [k % GRAD_KEY_OFFSET for (c, k) in _key_users
                    if c == id(client) and _holder(_key_users, (c, k)) is not None]
            raise ValueError(f"keys {taken[0]}..{taken[-1]} are already used by another DistributedOptimizer on this "
                             "client (its weights at key_base + i, or with update='worker' its gradients at key_base "
                             f"+ 2**32 + i): give each model its own key range (from key_base={max(used) + 1} on, "
                             "none is), or call remove_hooks() on the other first")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        for n, p in named:
            _contiguous_float32(n, p.data)
        self.weight_keys = weight_keys
        self.grad_keys = grad_keys
        self._registered = keys
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # stable tensors: pushes read them, pulls may land in them
        # Same starting point everywhere: the first initialiser of each key wins, everyone pulls it.
        client.init(self.weight_keys, [p.data for p in self.params], async_op=False)
        if update == "worker":
            client.init(self.grad_keys, [torch.zeros_like(p) for p in self.params], async_op=False)
        client.pull(self.weight_keys, [p.data for p in self.params], async_op=False)
        # No worker pushes before every worker has pulled the starting weights: under BSP and SSP
        # only reads are bounded, so an early push would otherwise reach a slower worker's pull.
        if client.worker_id is not None:
            client.barrier()
        for p in self.params:  # fixed addresses from here on: RDMA registers them once
            client.register_buffer(p.data)
            client.register_buffer(p.grad)
        self._push_keys = self.grad_keys if update == "worker" else self.weight_keys
        self._pending: List[Optional[object]] = [None] * len(self.params)
        self._passes = [0] * len(self.params)
        self._hooks = []
        self._accumulators = []  # kept alive: PyTorch holds hooks on these autograd nodes weakly
        for i, p in enumerate(self.params):
            accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
            self._hooks.append(accumulator.register_hook(self._make_hook(weakref.ref(self), i)))
            self._accumulators.append(accumulator)
            _owners[id(p)] = weakref.ref(self)
        for k in self._registered:
            _key_users[(id(client), k)] = weakref.ref(self)
        self.steps = 0

    @staticmethod
    def _make_hook(owner: "weakref.ref[DistributedOptimizer]", i: int):
        # The hook holds its optimizer weakly: an optimizer dropped without remove_hooks() stops
        # pushing instead of living on inside the autograd graph.
        def pushed_when_accumulated(*_):
            opt = owner()
            if opt is not None:
                opt._accumulated(i)
        return pushed_when_accumulated

    def _accumulated(self, i: int) -> None:
        # Runs once .grad holds this backward's contribution: send it while backward goes on.
        self._passes[i] += 1
        if self._passes[i] == self.backward_passes_per_step:
            self._push(i)
        elif self._passes[i] > self.backward_passes_per_step:
            raise RuntimeError(
                f"parameter {self.names[i]} got a gradient {self._passes[i]} times since the last step(), but "
                f"backward_passes_per_step is {self.backward_passes_per_step}: its gradient was already pushed, so "
                "this one would be lost. Call step() after each backward, or raise backward_passes_per_step")

    def _push(self, i: int) -> None:
        # The binding checks the gradient (CPU, float32, dense, contiguous) as it reads it.
        try:
            self._pending[i] = self.client.push(self._push_keys[i], self.params[i].grad)
        except InvalidArgument as e:
            raise InvalidArgument(f"parameter {self.names[i]}.grad: {e}") from e

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients in place (set_to_none is refused: pskv reads and writes .grad)."""
        if set_to_none:
            raise ValueError("pskv.torch keeps .grad tensors in place; call zero_grad() without set_to_none")
        for p in self.params:
            p.grad.zero_()

    def step(self, closure=None):
        """Ends the step: waits for this step's pushes (parameters that got no gradient push
        zeros), advances the clock, then pulls the new weights (update="server") or the mean
        gradients and steps the local optimizer (update="worker")."""
        loss = closure() if closure is not None else None
        for i, work in enumerate(self._pending):
            if work is None:  # unused this step, or backward not run: the servers still count on it
                self._push(i)
        try:
            for work in self._pending:
                work.wait()
        finally:  # a failed push is raised once; the next step starts clean
            self._pending = [None] * len(self.params)
            self._passes = [0] * len(self.params)
        if self.client.worker_id is not None:  # an anonymous client (ASP, no clocks) has no step to end
            self.client.clock()
        if self.update == "server":
            self.pull_weights()
        else:
            self.client.pull(self.grad_keys, [p.grad for p in self.params], async_op=False)
            self.optimizer.step()
        self.steps += 1
        return loss

    def pull_weights(self) -> None:
        """Brings the servers' weights into the parameters (update="server"; e.g. before evaluating)."""
        self.client.pull(self.weight_keys, [p.data for p in self.params], async_op=False)

    def staleness(self) -> Dict[str, object]:
        """What bounded reads observed: {'reads', 'max', 'histogram'} (clocks behind)."""
        return self.client.staleness()

    def remove_hooks(self) -> None:
        """Stops pushing from backward; the parameters may then get another DistributedOptimizer."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._accumulators.clear()
        for p in self.params:
            _let_go(_owners, id(p), self)
        for k in self._registered:
            _let_go(_key_users, (id(self.client), k), self)

    def __del__(self):
        if getattr(self, "_hooks", None):
            self.remove_hooks()


class Embedding(torch.nn.Module):
    """An embedding table that lives on the pskv servers, as a module (torch.nn.Embedding's shape).

        emb = pt.Embedding(client, table=0, dim=16, rule="adagrad", lr=0.05)
        rows = emb(ids)                  # ids: int64 tensor of any shape -> [*ids.shape, 16]
        loss(model(rows)).backward()     # the rows' gradients are pushed to the servers
        emb.wait()                       # (optional) before reading rows that must include them

    Rows are created on the servers as ids are admitted (see Client.create_table for the spec
    arguments); the update rule runs there, row by row, so no local optimizer touches them and
    model.parameters() does not include them. An id repeated in a batch is fetched once and its
    gradients are summed before they are sent. backward() sends the gradients without waiting;
    the next forward (or wait()) waits for them, so a worker always reads its own updates.
    """

    def __init__(self, client: Client, table: int, dim: int, *, create: bool = True, **spec):
        """create=False: this client made the table already with Client.create_table (as every
        worker must, with the same spec), which this module then need not repeat; otherwise it is
        made here with `spec`, or found made with the same one."""
        super().__init__()
        if create:
            client.create_table(table, dim, **spec)
        elif spec:
            raise TypeError(f"Embedding(create=False) uses table {table} as it is; spec arguments "
                            f"{sorted(spec)} need create=True")
        self.client, self.table, self.dim = client, table, dim
        self._pending: List = []
        # Gives each output a grad_fn (rows are not parameters of this process).
        self._anchor = torch.zeros((), requires_grad=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise InvalidArgument(f"Embedding ids must be an int64 torch tensor, not {type(ids).__name__} "
                                  "(torch.from_numpy(ids) makes one without a copy)")
        if ids.dtype != torch.int64:
            raise InvalidArgument(f"Embedding ids must be int64, not {ids.dtype}")
        self.wait()
        return _Rows.apply(ids, self._anchor, self)

    def wait(self) -> None:
        """Waits until every gradient pushed by backward() is applied."""
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()

    def extra_repr(self) -> str:
        return f"table={self.table}, dim={self.dim}"


class _Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, anchor: torch.Tensor, emb: "Embedding") -> torch.Tensor:
        flat = ids.detach().reshape(-1).contiguous()
        out = torch.empty(flat.numel(), emb.dim, dtype=torch.float32)
        if flat.numel():  # no ids, no rows: an empty batch, as torch.nn.Embedding gives
            emb.client.pull_rows(emb.table, flat, out, async_op=False)
        ctx.emb, ctx.flat = emb, flat
        return out.view(*ids.shape, emb.dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        emb = ctx.emb
        g = grad.reshape(-1, emb.dim).to(torch.float32).contiguous()
        if ctx.flat.numel():
            emb._pending.append(emb.client.push_rows(emb.table, ctx.flat, g))
        return None, None, None
