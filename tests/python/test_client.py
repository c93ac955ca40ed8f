"""pskv.Client over shm and tcp: the API, in-place (zero-copy) transfers and consistency waits."""

import inspect
import threading
import time
import tracemalloc

import numpy as np
import pytest

import pskv


def test_push_pull_one_key(client):
    w = np.zeros(1000, np.float32)
    assert client.init(7, np.full(1000, 2.0, np.float32)).wait()
    client.init(7, np.full(1000, 5.0, np.float32)).wait()  # the first initialiser wins
    client.push(7, np.ones(1000, np.float32)).wait()  # rule "add"
    client.pull(7, w).wait()
    assert (w == 3.0).all()


def test_blocking_form_waits_and_returns_none(client):
    w = np.zeros(1000, np.float32)
    assert client.init(8, np.full(1000, 2.0, np.float32), async_op=False) is None
    assert client.push(8, np.ones(1000, np.float32), async_op=False) is None
    pointer = w.ctypes.data
    assert client.pull(8, w, async_op=False) is None
    assert (w == 3.0).all() and w.ctypes.data == pointer
    big = np.zeros(1 << 18, np.float32)  # 1 MiB: the path that hands the GIL over around send and wait
    client.init([9, 10], [big, big], async_op=False)
    client.push([9, 10], [big + 1, big + 2], async_op=False)
    out = [np.empty_like(big), np.empty_like(big)]
    client.pull([9, 10], out, async_op=False)
    assert (out[0] == 1.0).all() and (out[1] == 2.0).all()
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        client.pull(8, w, False)  # keyword only, as in torch.distributed


def test_arguments_by_keyword_and_their_errors(client):
    # push, pull and init parse their own arguments (not through pybind11): the same rules.
    w = np.zeros(4, np.float32)
    client.init(keys=11, values=np.full(4, 1.0, np.float32), async_op=False)
    client.push(11, values=np.ones(4, np.float32)).wait()
    assert client.pull(out=w, keys=11, async_op=0) is None
    assert (w == 2.0).all()
    for call, message in [(lambda: client.pull(11), "missing required argument 'out'"),
                          (lambda: client.push(values=w), "missing required argument 'keys'"),
                          (lambda: client.pull(11, w, outt=w), "unexpected keyword argument 'outt'"),
                          (lambda: client.pull(11, w, out=w), "multiple values for argument 'out'"),
                          (lambda: client.init(11, w, 1, 2), "takes 2 positional arguments but 4 were given")]:
        with pytest.raises(TypeError, match=message):
            call()
    work = client.pull(11, w)
    assert work.wait(timeout=5) and work.wait(5.0) and work.wait(None) and work.wait()
    for call, message in [(lambda: work.wait(1, 2), "takes 1 positional argument but 2 were given"),
                          (lambda: work.wait(time=1), "unexpected keyword argument 'time'"),
                          (lambda: work.wait("1"), "must be real number")]:
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(pskv.InvalidArgument, match="float32"):
        client.pull(11, np.zeros(4, np.float64), async_op=False)  # pskv's errors still come through
    assert str(inspect.signature(pskv.Client.pull)) == "(self, /, keys, out, *, async_op=True)"
    # A worker id out of range is named, not answered with pybind11's dump of the signature.
    for bad in (-1, 2**32 - 1, 2**70, "0", True, 1.0):
        with pytest.raises(pskv.InvalidArgument, match=r"worker_id must be None or an int from 0 to 4294967294, not"):
            pskv.Client("tcp://127.0.0.1:1", worker_id=bad)  # refused before any connection


def test_many_keys_of_different_lengths(client):
    keys = [1, 2, 3, 2**63 + 5]
    values = [np.arange(n, dtype=np.float32) for n in (1, 17, 4096, 3)]
    client.init(keys, values).wait()
    client.push(keys, values).wait()
    out = [np.empty(n, np.float32) for n in (1, 17, 4096, 3)]
    client.pull(tuple(keys), out).wait()
    for v, o in zip(values, out):
        np.testing.assert_array_equal(o, 2 * v)
    client.pull(np.array(keys, dtype=np.uint64), out).wait()  # keys as a numpy array


def test_chunked_key_over_two_servers(transport):
    from conftest import server_uri
    with pskv.Server(server_uri(transport), arena_mb=16) as a, pskv.Server(server_uri(transport), arena_mb=16) as b:
        with pskv.Client([a.uri, b.uri], chunk_floats=1000) as c:
            v = np.arange(10_000, dtype=np.float32)
            c.init(3, v).wait()
            out = np.zeros_like(v)
            c.pull(3, out).wait()
            np.testing.assert_array_equal(out, v)
            assert c.num_servers() == 2
            assert c.server_stats(0)["keys"] == 1 and c.server_stats(1)["keys"] == 1  # split, not whole


def test_torch_tensors_and_memoryviews_in_place(client):
    import torch  # required: python3-torch is a dependency, never a skip
    t = torch.arange(64, dtype=torch.float32)
    client.init(1, t).wait()
    target = torch.zeros(8, 8)  # any shape; C-contiguous float32 is what counts
    pointer = target.data_ptr()
    client.pull(1, target).wait()
    assert target.data_ptr() == pointer
    assert torch.equal(target.flatten(), t)
    raw = bytearray(64 * 4)
    client.pull(1, memoryview(raw).cast("f")).wait()
    assert np.frombuffer(raw, np.float32)[63] == 63.0
    client.push(1, memoryview(np.ones(64, np.float32))).wait()
    client.pull(1, target).wait()
    assert target[7, 7].item() == 64.0


def test_pull_lands_in_the_arrays_own_memory(client):
    n = 1 << 18  # 1 MiB
    client.init(5, np.arange(n, dtype=np.float32)).wait()
    out = np.zeros(n, np.float32)
    alias = out[:]  # another view of the same memory sees the pull only if it was written in place
    pointer = out.ctypes.data
    for _ in range(3):
        client.pull(5, out).wait()
        assert out.ctypes.data == pointer
    assert alias[n - 1] == n - 1


def test_no_allocation_per_operation_beyond_the_handle(client):
    n = 1 << 18  # 1 MiB: a copy of the array anywhere in Python's allocators would show here
    v = np.ones(n, np.float32)
    out = np.empty(n, np.float32)
    client.init(9, v).wait()
    for _ in range(20):  # warm up caches, free lists, thread-local scratch
        client.push(9, v).wait()
        client.pull(9, out).wait()
        client.push(9, v, async_op=False)
        client.pull(9, out, async_op=False)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(200):
            client.push(9, v).wait()
            client.pull(9, out).wait()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each operation allocates its Work handle and frees it; nothing stays and nothing array-sized appears.
    assert after - before < 4096, f"{after - before} bytes kept over 400 operations"
    assert peak - before < 16384, f"peak {peak - before} bytes above the start"
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(200):
            client.push(9, v, async_op=False)
            client.pull(9, out, async_op=False)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The blocking form makes no handle at all: nothing kept beyond the first tracing's own noise.
    assert after - before < 4096 and peak - before < 4096, f"kept {after - before}, peak {peak - before} bytes"


def test_work_done_wait_timeout_and_staleness(bsp_pair):
    _, w0, w1 = bsp_pair
    x = np.zeros(16, np.float32)
    w0.init(1, x).wait()
    w0.clock()  # w0 at clock 1: BSP holds its pull until w1 reaches clock 1
    assert w0.current_clock() == 1
    work = w0.pull(1, x)
    started = time.monotonic()
    assert work.wait(timeout=0.1) is False
    # Its deadline, not tcp's one-second receive tick (it returned after 1.02 s over tcp).
    assert time.monotonic() - started < 0.8
    assert not work.done() and not work.is_completed()
    assert work.wait(timeout=0) is False
    w1.clock()
    assert work.wait() is True
    assert work.done() and work.wait()  # waiting again returns at once
    finished = w0.pull(1, x)
    while not finished.done():
        pass
    assert finished.wait(timeout=0) is True  # a finished operation completes even with no time left
    st = w0.staleness()
    assert st["reads"] == 2 and st["max"] == 0 and len(st["histogram"]) == 17 and st["histogram"][0] == 2
    assert w0.server_stats(0)["clocks"] >= 2


def test_barrier_from_two_threads(bsp_pair):
    _, w0, w1 = bsp_pair
    passed = []
    t = threading.Thread(target=lambda: (w1.barrier(), passed.append(1)))
    t.start()
    w0.barrier()
    t.join(timeout=30)
    assert passed == [1]


def test_gil_is_released_while_a_pull_waits_at_the_bound(bsp_pair):
    # The pull below can only complete once the other thread clocks worker 1; that thread needs
    # the GIL to run, so a wait that held the GIL would end in the server's 30 s timeout instead.
    _, w0, w1 = bsp_pair
    x = np.zeros(16, np.float32)
    w0.init(1, np.full(16, 4.0, np.float32)).wait()
    w0.clock()
    spins = []

    def other_python_thread():
        n = 0
        while n < 200_000:  # pure Python work, which needs the GIL
            n += 1
        spins.append(n)
        w1.clock()

    t = threading.Thread(target=other_python_thread)
    work = w0.pull(1, x)
    t.start()
    work.wait()
    t.join()
    assert spins == [200_000] and (x == 4.0).all()


def test_gil_is_released_while_a_blocking_pull_waits_at_the_bound(bsp_pair):
    _, w0, w1 = bsp_pair
    x = np.zeros(16, np.float32)
    w0.init(1, np.full(16, 5.0, np.float32)).wait()
    w0.clock()
    t = threading.Thread(target=lambda: (sum(range(200_000)), w1.clock()))
    t.start()
    w0.pull(1, x, async_op=False)  # completes only once the other Python thread has run
    t.join()
    assert (x == 5.0).all()


def test_with_announces_finished_only_on_a_normal_exit(transport):
    from conftest import server_uri
    with pskv.Server(server_uri(transport), workers=2, mode="ssp", staleness=1, arena_mb=16) as s:
        with pskv.Client(s.uri, worker_id=0):
            pass
        with pytest.raises(RuntimeError):
            with pskv.Client(s.uri, worker_id=1):
                raise RuntimeError("the training loop failed")
        assert not s.workers_finished()  # worker 1 failed: it did not finish
        with pskv.Client(s.uri, worker_id=1):
            pass
        assert s.workers_finished()


def test_dropped_work_is_completed_by_the_client(client):
    n = 1 << 20
    client.init(2, np.zeros(n, np.float32)).wait()
    for _ in range(5):
        client.push(2, np.ones(n, np.float32))  # handle dropped at once; the array has no other owner
    out = np.zeros(n, np.float32)
    client.pull(2, out).wait()  # ordered after this client's pushes on both transports
    assert (out == 5.0).all()


def test_with_failover_a_killed_servers_keys_move_and_the_worker_never_waits_for_a_restart():
    # pskv.launch(replicas=2, failover_ms=...): a server SIGKILLed while pushes are in flight is
    # not restarted; its successor serves its keys, the retrying worker follows them there
    # without an error, and every push lands exactly once. Restarted later, it takes its keys
    # back (a hand-back), the worker follows them back, and still every push lands once.
    keys = list(range(12))
    with pskv.launch(3, "tcp", replicas=2, failover_ms=400, workers=1, mode="ssp", staleness=1, rule="add",
                     arena_mb=16) as servers:
        c = pskv.Client(servers.uris, worker_id=0, retry_timeout=30.0)
        c.init(keys, [np.zeros(64, np.float32) for _ in keys]).wait()
        ones = [np.ones(64, np.float32) for _ in keys]
        crash = threading.Thread(target=lambda: (time.sleep(0.3), servers.kill(1)))
        crash.start()
        pushes = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline or crash.is_alive():
            c.push(keys, ones).wait()
            c.clock()
            pushes += 1
        crash.join()
        out = [np.zeros(64, np.float32) for _ in keys]
        c.pull(keys, out).wait()
        assert all((o == float(pushes)).all() for o in out), ([o[0] for o in out], pushes)
        assert servers.processes[1].poll() is not None  # nobody restarted it
        assert c.server_stats(2)["failover_serving"] == "1"
        back = threading.Thread(target=lambda: servers.restart(1))
        back.start()
        while back.is_alive():
            c.push(keys, ones).wait()
            c.clock()
            pushes += 1
        back.join()
        for _ in range(20):
            c.push(keys, ones).wait()
            c.clock()
            pushes += 1
        c.pull(keys, out).wait()
        assert all((o == float(pushes)).all() for o in out), ([o[0] for o in out], pushes)
        assert c.server_stats(2)["failover_serving"] == ""
        c.close()


def test_a_replicated_server_killed_mid_run_costs_a_retrying_worker_nothing():
    # pskv.launch(replicas=2): a server SIGKILLed while pushes are in flight and restarted (it
    # rejoins from its replicas); the worker, made with retry_timeout, sees no error, and every
    # push lands exactly once: each key ends equal to the number of pushes.
    keys = list(range(12))
    with pskv.launch(3, "tcp", replicas=2, workers=1, mode="ssp", staleness=1, rule="add", arena_mb=16) as servers:
        c = pskv.Client(servers.uris, worker_id=0, retry_timeout=30.0)
        c.init(keys, [np.zeros(64, np.float32) for _ in keys]).wait()
        ones = [np.ones(64, np.float32) for _ in keys]
        crash = threading.Thread(target=lambda: (time.sleep(0.3), servers.kill(1), time.sleep(0.1), servers.restart(1)))
        crash.start()
        pushes = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline or crash.is_alive():
            c.push(keys, ones).wait()
            c.clock()
            pushes += 1
        crash.join()
        out = [np.zeros(64, np.float32) for _ in keys]
        c.pull(keys, out).wait()
        assert all((o == float(pushes)).all() for o in out), ([o[0] for o in out], pushes)
        assert c.server_stats(1)["keys"] > 0  # the restarted server holds its keys again
        c.close()


def test_launched_servers_write_and_restore_checkpoints(tmp_path):
    # launch(restore_dir=...) is pskv-server's --restore (it was passed as --restore-dir, refused).
    with pskv.launch(1, "tcp", checkpoint_dir=str(tmp_path), arena_mb=16) as servers:
        with pskv.Client(servers.uris) as c:
            c.init(3, np.full(8, 2.5, np.float32)).wait()
    with pskv.launch(1, "tcp", restore_dir=str(tmp_path), arena_mb=16) as servers:
        with pskv.Client(servers.uris) as c:
            out = np.zeros(8, np.float32)
            c.pull(3, out).wait()
            assert (out == 2.5).all(), out


def test_a_server_away_freezes_neither_the_interpreter_nor_other_calls():
    # The thread that found the connection failed used to reconnect it holding the link's lock for
    # up to retry_timeout; a small push from another thread (issued with the GIL held) then waited
    # for that lock, and the whole interpreter stopped with it, until the push failed with "gave
    # up". Server 1 is restarted only once the push and its bounded wait have returned.
    keys = list(range(8))
    with pskv.launch(2, "tcp", replicas=2, workers=1, rule="add", arena_mb=16) as servers:
        c = pskv.Client(servers.uris, worker_id=0, retry_timeout=30.0)
        c.init(keys, [np.zeros(16, np.float32) for _ in keys]).wait()
        servers.kill(1)
        out = [np.zeros(16, np.float32) for _ in keys]
        waiter = threading.Thread(target=lambda: c.pull(keys, out).wait())
        waiter.start()
        time.sleep(0.3)  # the waiter has found server 1's connection failed
        work = c.push(keys, [np.ones(16, np.float32) for _ in keys])
        assert work.wait(timeout=0.1) is False  # server 1 is still away
        servers.restart(1)
        waiter.join(timeout=60)
        assert not waiter.is_alive()
        work.wait()
        c.pull(keys, out).wait()
        assert all((o == 1.0).all() for o in out)
        c.close()
