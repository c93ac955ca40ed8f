"""pskv.torch: same starting weights, both update modes, and a short 2-worker MNIST run."""

import gc
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import pskv
import pskv.torch as pt
from conftest import server_uri


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 20, generator=g), torch.randint(0, 3, (8,), generator=g)


def run_two_workers(body):
    errors = []

    def guarded(w):
        try:
            body(w)
        except BaseException as e:  # surfaced in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]


def test_workers_start_from_the_same_weights(transport):
    with pskv.Server(server_uri(transport), arena_mb=16) as s:
        models = [small_model(1), small_model(2)]
        assert not torch.equal(models[0][0].weight, models[1][0].weight)
        clients = [pskv.Client(s.uri, worker_id=None) for _ in models]
        for m, c in zip(models, clients):
            pt.DistributedOptimizer(m.named_parameters(), c)
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
        for c in clients:
            c.close()


def test_a_worker_that_starts_late_still_starts_from_the_same_weights(transport):
    # Worker 0 trains a step as soon as its optimizer exists; worker 1 arrives later. Pushes are
    # applied as they come (only reads are bounded), so without the barrier at construction
    # worker 1 would pull weights worker 0 had already moved.
    with pskv.Server(server_uri(transport), workers=2, mode="bsp", rule="sgd", lr=0.5, arena_mb=16,
                     wait_timeout=30.0) as s:
        starts = [None, None]

        def worker(w):
            if w == 1:
                threading.Event().wait(0.5)
            with pskv.Client(s.uri, worker_id=w) as c:
                m = small_model(10 + w)
                opt = pt.DistributedOptimizer(m.named_parameters(), c)
                starts[w] = [p.detach().clone() for p in m.parameters()]
                x, y = batch(w)
                opt.zero_grad()
                F.cross_entropy(m(x), y).backward()
                opt.step()

        run_two_workers(worker)
    for a, b in zip(*starts):
        assert torch.equal(a, b), "the late worker started from weights the other had already moved"


def test_a_second_backward_before_step_is_an_error_not_a_lost_gradient(server):
    with pskv.Client(server.uri) as c:
        m = small_model(4)
        opt = pt.DistributedOptimizer(m.named_parameters(), c)
        x, y = batch(1)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        with pytest.raises(RuntimeError, match="backward_passes_per_step"):
            F.cross_entropy(m(x), y).backward()


def test_accumulated_gradients_are_pushed_once_with_backward_passes_per_step(transport):
    with pskv.Server(server_uri(transport), rule="sgd", lr=1.0, arena_mb=16) as s:
        with pskv.Client(s.uri) as c:
            m = small_model(8)
            opt = pt.DistributedOptimizer(m.named_parameters(), c, backward_passes_per_step=2)
            before = [p.detach().clone() for p in m.parameters()]
            opt.zero_grad()
            for seed in (1, 2):
                x, y = batch(seed)
                F.cross_entropy(m(x), y).backward()
            total = [p.grad.clone() for p in m.parameters()]
            opt.step()
            for b, g, p in zip(before, total, m.parameters()):
                torch.testing.assert_close(p.detach(), b - g)  # both passes' gradients, once


def test_one_optimizer_per_parameter_and_dropped_ones_stop_pushing(transport):
    with pskv.Server(server_uri(transport), rule="sgd", lr=1.0, arena_mb=16) as s:
        with pskv.Client(s.uri) as c:
            m = small_model(9)
            first = pt.DistributedOptimizer(m.named_parameters(), c)
            with pytest.raises(ValueError, match="another pskv.torch.DistributedOptimizer"):
                pt.DistributedOptimizer(m.named_parameters(), c)
            del first
            gc.collect()
            opt = pt.DistributedOptimizer(m.named_parameters(), c)  # the dropped one let go
            before = [p.detach().clone() for p in m.parameters()]
            x, y = batch(3)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            opt.step()
            for b, g, p in zip(before, grads, m.parameters()):
                torch.testing.assert_close(p.detach(), b - g)  # applied once, not once per optimizer


def sgd_on_mean_gradient(start, steps, lr):
    """What both workers must compute: SGD, in one process, on the mean of their gradients,
    from the weights `start` they began with."""
    ref = small_model(0)
    with torch.no_grad():
        for p, s in zip(ref.parameters(), start):
            p.copy_(s)
    for step in range(steps):
        grads = []
        for w in (0, 1):
            ref.zero_grad()
            x, y = batch(100 * step + w)
            F.cross_entropy(ref(x), y).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= lr * (grads[0][i] + grads[1][i]) / 2
    return ref


def test_worker_update_applies_the_mean_gradient_everywhere(transport):
    steps, lr = 4, 0.1
    with pskv.Server(server_uri(transport), workers=2, mode="sync", rule="assign", arena_mb=16,
                     wait_timeout=30.0) as s:
        models = [small_model(5), small_model(6)]
        starts = [None, None]

        def worker(w):
            with pskv.Client(s.uri, worker_id=w) as c:
                m = models[w]
                opt = pt.DistributedOptimizer(m.named_parameters(), c, update="worker",
                                              optimizer=torch.optim.SGD(m.parameters(), lr=lr))
                starts[w] = [p.detach().clone() for p in m.parameters()]
                for step in range(steps):
                    x, y = batch(100 * step + w)
                    opt.zero_grad()
                    F.cross_entropy(m(x), y).backward()
                    opt.step()
                assert c.current_clock() == steps

        run_two_workers(worker)
    # Both start from the same weights: each key holds whichever worker's init reached its
    # server first, so with two workers initialising at once the start can mix their models.
    for a, b in zip(starts[0], starts[1]):
        assert torch.equal(a, b), "the workers did not start from the same weights"
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    ref = sgd_on_mean_gradient(starts[0], steps, lr)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ref.parameters(), models[0].parameters())), \
        "the workers' weights are not SGD on the mean gradient"


def test_server_update_with_hooks_pushes_during_backward(transport):
    with pskv.Server(server_uri(transport), workers=1, mode="bsp", rule="sgd", lr=0.5, arena_mb=16) as s:
        with pskv.Client(s.uri, worker_id=0) as c:
            m = small_model(3)
            opt = pt.DistributedOptimizer(m.named_parameters(), c)
            before = [p.detach().clone() for p in m.parameters()]
            x, y = batch(7)
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            assert all(w is not None for w in opt._pending)  # every parameter's push began in backward
            grads = [p.grad.clone() for p in m.parameters()]
            opt.step()
            for b, g, p in zip(before, grads, m.parameters()):
                torch.testing.assert_close(p.detach(), b - 0.5 * g)
            assert opt.staleness()["max"] == 0


def test_refuses_what_it_cannot_move(server):
    with pskv.Client(server.uri) as c:
        m = torch.nn.Linear(4, 2).double()
        with pytest.raises(ValueError, match="float32"):
            pt.DistributedOptimizer(m.named_parameters(), c)
        with pytest.raises(ValueError, match="optimizer"):
            pt.DistributedOptimizer(torch.nn.Linear(4, 2).named_parameters(), c, update="worker")
        m = torch.nn.Linear(4, 2)
        opt = pt.DistributedOptimizer(m.named_parameters(), c)
        m.weight.grad = torch.zeros(4, 2).t()  # the right shape, but not contiguous: refused at its push
        with pytest.raises(ValueError, match=r"parameter weight\.grad: .*contiguous"):
            opt.step()


def test_two_worker_mnist_run_beats_the_floor():
    # 200 steps of 32 samples per worker, MLP, SSP s=2 over shm, server-side SGD: ~88% here.
    example = os.path.join(os.environ.get("PSKV_EXAMPLES", "../../examples"), "pytorch_mnist.py")
    out = subprocess.run([sys.executable, example, "--launch", "--servers", "2", "--workers", "2", "--transport",
                          "shm", "--model", "mlp", "--epochs", "1", "--train-limit", "12800", "--test-limit", "2000",
                          "--data", os.environ.get("PSKV_DATA", "../../data/mnist"), "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workers"] == 2 and summary["mode"] == "ssp" and summary["max_staleness"] <= 2
    assert summary["test_accuracy"] >= 0.85, summary


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_the_mnist_example_runs_in_every_mode(mode):
    # The servers take a staleness only in ssp: the example must not pass its default elsewhere.
    example = os.path.join(os.environ.get("PSKV_EXAMPLES", "../../examples"), "pytorch_mnist.py")
    out = subprocess.run([sys.executable, example, "--launch", "--servers", "2", "--workers", "2", "--transport",
                          "tcp", "--model", "mlp", "--epochs", "1", "--train-limit", "2000", "--test-limit", "500",
                          "--mode", mode, "--data", os.environ.get("PSKV_DATA", "../../data/mnist"), "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["mode"] == mode and summary["staleness"] == 0, summary


def test_model_parameters_work_as_named_parameters_do(transport):
    # torch.optim's spelling: before, the tensors were unpacked as (name, tensor) pairs, and a
    # model of two-row weights trained nothing without an error.
    with pskv.Server(server_uri(transport), rule="sgd", lr=1.0, arena_mb=16) as s:
        with pskv.Client(s.uri) as c:
            m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
            opt = pt.DistributedOptimizer(m.parameters(), c)
            before = [p.detach().clone() for p in m.parameters()]
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            grads = [p.grad.clone() for p in m.parameters()]
            opt.step()
            for b, g, p in zip(before, grads, m.parameters()):
                torch.testing.assert_close(p.detach(), b - g)
            with pytest.raises(TypeError, match="named_parameters"):
                pt.DistributedOptimizer([("w", torch.zeros(2)), 3], c)


def test_two_models_on_one_client_need_their_own_keys(server):
    with pskv.Client(server.uri) as c:
        a, b = small_model(1), small_model(2)
        opt_a = pt.DistributedOptimizer(a.named_parameters(), c)
        with pytest.raises(ValueError, match="key_base=4 on"):
            pt.DistributedOptimizer(b.named_parameters(), c)
        opt_b = pt.DistributedOptimizer(b.named_parameters(), c, key_base=4)
        assert not torch.equal(a[0].weight, b[0].weight)
        opt_a.remove_hooks()
        opt_c = pt.DistributedOptimizer(small_model(3).named_parameters(), c)  # a's keys are free again
        del opt_b, opt_c


def test_weights_cannot_land_on_another_models_gradient_keys(server):
    with pskv.Client(server.uri) as c:
        a = small_model(1)
        opt_a = pt.DistributedOptimizer(a.named_parameters(), c, update="worker",
                                        optimizer=torch.optim.SGD(a.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="gradients at key_base"):
            pt.DistributedOptimizer(small_model(2).named_parameters(), c, key_base=pt.GRAD_KEY_OFFSET)
        opt_a.remove_hooks()
        opt_b = pt.DistributedOptimizer(small_model(2).named_parameters(), c, key_base=pt.GRAD_KEY_OFFSET)
        del opt_b


def test_a_tied_parameter_gets_one_key_and_an_empty_one_none(server):
    # Listed twice (tied weights), a parameter once had two keys and two hooks pulling into one
    # tensor; an empty one failed construction with "key 0 has 0 floats".
    with pskv.Client(server.uri) as c:
        w = torch.nn.Parameter(torch.ones(4))
        empty = torch.nn.Parameter(torch.empty(0))
        opt = pt.DistributedOptimizer([("w", w), ("tied", w), ("empty", empty)], c)
        assert opt.names == ["w"] and opt.weight_keys == [0]
        (w * 2).sum().backward()
        opt.step()
        opt.remove_hooks()
