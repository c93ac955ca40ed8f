"""Embedding tables from Python: the Client's row calls and pskv.torch.Embedding."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import pskv
import pskv.torch as pt


@pytest.fixture
def tcp_client():
    with pskv.Server("tcp://127.0.0.1:0", arena_mb=16, io_threads=1, table_memory_mb=256) as s:
        with pskv.Client(s.uri) as c:
            yield c


def test_rows_round_trip_with_numpy_and_torch_ids(tcp_client):
    c = tcp_client
    c.create_table(0, 4, init="zeros", rule="add", max_rows=1000)
    ids = np.array([3, 8, 3], dtype=np.int64)
    grads = np.arange(12, dtype=np.float32)
    c.push_rows(0, ids, grads, async_op=False)
    out = np.full(12, -1, np.float32)
    c.pull_rows(0, torch.tensor([3, 8, 3]), out).wait()
    # id 3 got rows 0 and 2 summed; the repeat reads the same row.
    np.testing.assert_array_equal(out[:4], grads[:4] + grads[8:])
    np.testing.assert_array_equal(out[4:8], grads[4:8])
    np.testing.assert_array_equal(out[8:], out[:4])
    one = np.zeros(4, np.float32)
    c.pull_rows(0, 8, one).wait()  # one id, as push(7, value) takes one key
    np.testing.assert_array_equal(one, grads[4:8])
    assert c.server_stats(0)["table_0_rows"] == 2


def test_bad_row_calls_raise_clear_errors(tcp_client):
    c = tcp_client
    c.create_table(1, 8, max_rows=100)
    with pytest.raises(pskv.InvalidArgument, match="take 16 floats, not 8"):
        c.pull_rows(1, [1, 2], np.zeros(8, np.float32))
    with pytest.raises(pskv.InvalidArgument, match="never converted from floats"):
        c.pull_rows(1, np.array([1.0, 2.0]), np.zeros(16, np.float32))
    with pytest.raises(pskv.InvalidArgument, match="sequence of ints or an int64 array, not str"):
        c.pull_rows(1, "12", np.zeros(16, np.float32))
    with pytest.raises(pskv.InvalidArgument, match="unknown to this client"):
        c.pull_rows(2, [1], np.zeros(8, np.float32))
    with pytest.raises(pskv.InvalidArgument, match="another spec"):
        c.create_table(1, 8, max_rows=100, seed=5)
    with pytest.raises(pskv.InvalidArgument, match="eviction must be"):
        c.create_table(3, 8, eviction="random")


def test_embedding_module_trains_rows_on_the_servers(tcp_client):
    torch.manual_seed(0)
    emb = pt.Embedding(tcp_client, table=2, dim=4, init="zeros", rule="sgd", lr=0.05, max_rows=1000)
    assert list(emb.parameters()) == []
    target = torch.tensor([1.0, -2.0, 0.5, 3.0])
    ids = torch.tensor([[7, 7], [9, 7]])
    for _ in range(100):
        rows = emb(ids)  # [2, 2, 4]
        loss = ((rows - target) ** 2).sum()
        loss.backward()
    emb.wait()
    final = emb(torch.tensor([7, 9])).detach()
    torch.testing.assert_close(final, target.expand(2, 4), rtol=0, atol=1e-3)
    with pytest.raises(pskv.InvalidArgument, match="int64"):
        emb(torch.tensor([1.0]))
    with pytest.raises(pskv.InvalidArgument, match="torch.from_numpy"):
        emb(np.array([1, 2]))
    assert emb(torch.zeros((0, 3), dtype=torch.int64)).shape == (0, 3, 4)  # as torch.nn.Embedding


def test_an_embedding_module_over_a_table_made_before(tcp_client):
    # README's lines: the table made with a full spec, then the module over it as it is.
    tcp_client.create_table(5, 16, init="normal", rule="adagrad", lr=0.05, admit_after=2, eviction="lru",
                            max_rows=10**5)
    emb = pt.Embedding(tcp_client, table=5, dim=16, create=False)
    assert emb(torch.tensor([3, 4])).shape == (2, 16)
    same = pt.Embedding(tcp_client, table=5, dim=16, init="normal", rule="adagrad", lr=0.05, admit_after=2,
                        eviction="lru", max_rows=10**5)  # the same spec again: found, not an error
    assert same.table == 5
    with pytest.raises(TypeError, match="create=True"):
        pt.Embedding(tcp_client, table=5, dim=16, create=False, lr=0.1)
    with pytest.raises(pskv.InvalidArgument, match="another spec [(]rule adagrad here, sgd asked; lr 0.05 here, 0.1"):
        pt.Embedding(tcp_client, table=5, dim=16, init="normal", rule="sgd", lr=0.1, admit_after=2, eviction="lru",
                     max_rows=10**5)


def test_the_click_through_rate_example_learns_the_hidden_model():
    # 600K clicks over 2 workers and 2 tcp servers: ~0.75 AUC against the generator's ~0.80 here
    # (the full default run of 12M gets within 0.01; docs/BENCHMARKS.md).
    example = os.path.join(os.environ.get("PSKV_EXAMPLES", "../../examples"), "ctr_fm.py")
    out = subprocess.run([sys.executable, example, "--train", "600000", "--test", "50000", "--target-gap", "0.1",
                          "--table-memory-mb", "512", "--json"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["train_samples"] == 600000 and summary["rows"] > 100000, summary
    assert 0.7 < summary["generator_auc"] < 0.9, summary
    assert summary["gap"] < 0.1, summary


def test_a_replicated_server_killed_mid_run_costs_a_retrying_workers_row_pushes_nothing():
    # pskv.launch(replicas=2): a server SIGKILLed while row pushes are in flight and restarted
    # (it takes its tables back from its replica); the worker, made with retry_timeout, sees no
    # error, and every row push lands exactly once: each row ends at the number of pushes.
    ids = np.arange(0, 300 * 7919, 7919, dtype=np.int64)
    with pskv.launch(3, "tcp", replicas=2, workers=1, arena_mb=16) as servers:
        c = pskv.Client(servers.uris, worker_id=0, retry_timeout=30.0)
        c.create_table(0, 8, init="zeros", rule="add", max_rows=10000)
        ones = np.ones(len(ids) * 8, np.float32)
        crash = threading.Thread(target=lambda: (time.sleep(0.3), servers.kill(1), time.sleep(0.1), servers.restart(1)))
        crash.start()
        pushes = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline or crash.is_alive():
            c.push_rows(0, ids, ones, async_op=False)
            pushes += 1
        crash.join()
        out = np.zeros(len(ids) * 8, np.float32)
        c.pull_rows(0, ids, out).wait()
        assert (out == float(pushes)).all(), (out[:: 8 * 50], pushes)
        assert c.server_stats(1)["table_0_rows"] > 0  # the restarted server holds its rows again
        c.close()
