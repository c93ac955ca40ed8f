"""Bad input ends in a clear pskv exception: nothing converted, nothing lost, no crash."""

import gc
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import pskv

N = 64


@pytest.fixture
def ready(client):
    client.init(1, np.zeros(N, np.float32)).wait()
    return client


def expect(error, match, call):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, pskv.Error)
    return info.value


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.int64, np.uint8])
def test_other_dtypes_are_refused_not_converted(ready, dtype):
    e = expect(pskv.InvalidArgument, "not float32", lambda: ready.push(1, np.ones(N, dtype)))
    assert e.code == "invalid_argument" and isinstance(e, ValueError)
    out = np.zeros(N, dtype)
    expect(pskv.InvalidArgument, "not float32", lambda: ready.pull(1, out))
    assert (out == 0).all()


def test_byte_swapped_float32_is_refused(ready):
    expect(pskv.InvalidArgument, "not float32", lambda: ready.push(1, np.ones(N, ">f4")))


def test_non_contiguous_arrays_are_refused(ready):
    wide = np.zeros(2 * N, np.float32)
    expect(pskv.InvalidArgument, "C-contiguous", lambda: ready.pull(1, wide[::2]))
    expect(pskv.InvalidArgument, "C-contiguous", lambda: ready.push(1, np.zeros((8, 8), np.float32).T))
    assert (wide == 0).all()


def test_read_only_pull_targets_are_refused(ready):
    frozen = np.zeros(N, np.float32)
    frozen.flags.writeable = False
    expect(pskv.InvalidArgument, "read-only", lambda: ready.pull(1, frozen))
    expect(pskv.InvalidArgument, "read-only", lambda: ready.pull(1, memoryview(bytes(4 * N)).cast("f")))
    ready.push(1, frozen).wait()  # reading a read-only array is fine


def test_non_buffers_are_refused(ready):
    expect(pskv.InvalidArgument, "never converted", lambda: ready.push(1, [1.0] * N))
    expect(pskv.InvalidArgument, "is a list", lambda: ready.push([1], [[1.0] * N]))
    expect(pskv.InvalidArgument, "format 'B'", lambda: ready.push(1, bytes(4 * N)))
    expect(pskv.InvalidArgument, "is a NoneType", lambda: ready.pull(1, None))


def test_tensors_off_the_cpu_or_of_other_dtypes_are_refused(ready):
    import torch  # required: python3-torch is a dependency, never a skip
    # No CUDA on the test machines: the meta device stands in for any non-CPU device, which is
    # what the check looks at. A real CUDA tensor gets the same message with "cuda:0".
    expect(pskv.InvalidArgument, "CPU memory only", lambda: ready.pull(1, torch.zeros(N, device="meta")))
    if torch.cuda.is_available():
        expect(pskv.InvalidArgument, "CUDA tensors are not supported", lambda: ready.pull(1, torch.zeros(N).cuda()))
    expect(pskv.InvalidArgument, "torch.float64", lambda: ready.push(1, torch.zeros(N, dtype=torch.float64)))
    expect(pskv.InvalidArgument, "non-contiguous", lambda: ready.pull(1, torch.zeros(N, 2)[:, 0]))
    expect(pskv.InvalidArgument, "dense", lambda: ready.push(1, torch.zeros(N).to_sparse()))


def test_a_length_other_than_the_keys_is_refused_by_the_server(ready):
    expect(pskv.LengthMismatch, "64 floats", lambda: ready.push(1, np.ones(N + 1, np.float32)).wait())
    out = np.full(N - 1, 7.0, np.float32)
    expect(pskv.LengthMismatch, "64 floats", lambda: ready.pull(1, out).wait())
    assert (out == 7.0).all()
    expect(pskv.InvalidArgument, "lengths must be", lambda: ready.push(1, np.ones(0, np.float32)))
    check = np.zeros(N, np.float32)
    ready.pull(1, check).wait()
    assert (check == 0).all()  # nothing half-applied


def test_keys_and_arrays_of_different_counts(ready):
    a = np.zeros(N, np.float32)
    expect(pskv.InvalidArgument, "2 keys but 1", lambda: ready.pull([1, 1], [a]))
    expect(pskv.InvalidArgument, "one key but a list", lambda: ready.pull(1, [a, a]))
    expect(pskv.InvalidArgument, "need a list", lambda: ready.pull([1, 1], a))
    expect(pskv.InvalidArgument, "no keys", lambda: ready.pull([], []))


@pytest.mark.parametrize("key", [-1, 2**64, "1", 1.5])
def test_keys_out_of_range_or_not_integers(ready, key):
    expect(pskv.InvalidArgument, "key", lambda: ready.pull(key, np.zeros(N, np.float32)))
    expect(pskv.InvalidArgument, "key", lambda: ready.pull([1, key], [np.zeros(N, np.float32)] * 2))
    if isinstance(key, str):  # not read as a sequence of one-character keys
        expect(pskv.InvalidArgument, "keys are integers, not str", lambda: ready.pull(key, np.zeros(N, np.float32)))


def test_unknown_key(ready):
    expect(pskv.NotFound, "init it", lambda: ready.pull(99, np.zeros(N, np.float32)).wait())
    expect(pskv.NotFound, "init it", lambda: ready.pull(99, np.zeros(N, np.float32), async_op=False))
    expect(pskv.NotFound, "init it", lambda: ready.pull(99, np.zeros(1 << 20, np.float32), async_op=False))


def test_array_dropped_while_its_push_is_in_flight(client):
    n = 4 << 20  # 16 MiB: long enough to still be in flight when the array is dropped
    client.init(3, np.zeros(n, np.float32)).wait()
    for _ in range(3):
        work = client.push(3, np.ones(n, np.float32))
        # The caller's array is gone; if pskv had let go of it too, these would take its memory
        # and their 9s would be what the server receives.
        gc.collect()
        decoys = [np.full(n, 9.0, np.float32) for _ in range(2)]
        work.wait()
        del decoys
    out = np.zeros(n, np.float32)
    client.pull(3, out).wait()
    assert (out == 3.0).all()


def test_pull_target_dropped_while_its_pull_waits(bsp_pair):
    # A push is sent before push() returns; a pull writes later, so it is the one whose target
    # must outlive the caller's references. Here the pull waits at the BSP bound while its array
    # and its Work are both dropped and the freed sizes handed out again.
    _, w0, w1 = bsp_pair
    w0.init(1, np.full(N, 6.0, np.float32)).wait()
    w0.clock()
    w0.pull(1, np.zeros(N, np.float32))  # neither the array nor the Work is kept
    gc.collect()
    decoys = [np.full(N, 9.0, np.float32) for _ in range(64)]
    w1.clock()  # the pull lands now, in memory pskv still holds
    w0.clock()  # reaps it (an error would be raised here)
    assert all((d == 9.0).all() for d in decoys), "a dropped pull's values landed in memory handed out again"


def test_use_after_close(server):
    c = pskv.Client(server.uri, worker_id=None)
    a = np.zeros(N, np.float32)
    c.init(1, a).wait()
    pending = c.pull(1, a)
    c.close()
    assert c.closed
    assert pending.done()  # close completed it
    pending.wait()
    for call in (lambda: c.push(1, a), lambda: c.pull(1, a), lambda: c.init(1, a), c.clock, c.barrier,
                 c.staleness, c.current_clock, lambda: c.server_stats(0)):
        expect(pskv.InvalidArgument, "closed", call)
    c.close()  # idempotent


def test_clock_without_a_worker_id(client):
    expect(pskv.InvalidArgument, "worker_id", client.clock)


def test_retrying_needs_a_worker_id(server):
    expect(pskv.InvalidArgument, "worker_id", lambda: pskv.Client(server.uri, retry_timeout=5.0))
    expect(pskv.InvalidArgument, "retry_timeout", lambda: pskv.Client(server.uri, worker_id=0, retry_timeout=-1.0))


def test_unreachable_server():
    expect(pskv.Error, "", lambda: pskv.Client("tcp://127.0.0.1:1", connect_timeout=1.0))
    expect(pskv.InvalidArgument, "partition", lambda: pskv.Client("tcp://127.0.0.1:1", partition="modulo"))


def test_ctrl_c_interrupts_a_wait_and_the_client_stays_usable(bsp_pair):
    _, w0, w1 = bsp_pair
    x = np.zeros(N, np.float32)
    w0.init(1, np.full(N, 6.0, np.float32)).wait()
    w0.clock()
    work = w0.pull(1, x)  # blocked until w1 clocks; the server would give up only after 30 s
    sent = []
    timer = threading.Timer(0.2, lambda: (sent.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT)))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        work.wait()
    after = time.monotonic() - sent[0]
    print(f"KeyboardInterrupt {1000 * after:.1f} ms after SIGINT")
    assert after < 10.0, "the wait was not interrupted: it ran until something else ended it"
    assert not work.done()  # still in flight, not lost
    w1.clock()
    assert work.wait()
    assert (x == 6.0).all()
    w0.push(1, x).wait()  # still usable


def test_ctrl_c_interrupts_a_blocking_pull_and_its_target_stays_held(bsp_pair):
    _, w0, w1 = bsp_pair
    w0.init(1, np.full(N, 7.0, np.float32)).wait()
    w0.clock()
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        w0.pull(1, np.zeros(N, np.float32), async_op=False)  # blocked until w1 clocks
    assert time.monotonic() - t0 < 10.0
    gc.collect()
    decoys = [np.full(N, 9.0, np.float32) for _ in range(64)]
    w1.clock()  # the interrupted pull lands now, in memory pskv still holds
    w0.clock()  # reaps it
    assert all((d == 9.0).all() for d in decoys), "an interrupted pull's values landed in memory handed out again"
    w1.clock()
    x = np.zeros(N, np.float32)
    w0.pull(1, x, async_op=False)  # still usable
    assert (x == 7.0).all()


def test_ctrl_c_interrupts_a_barrier_and_the_client_stays_usable(bsp_pair):
    _, w0, w1 = bsp_pair
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        w0.barrier()  # worker 1 never comes: only Ctrl-C ends it
    assert time.monotonic() - t0 < 10.0
    w1.barrier()  # meets the barrier worker 0 left in flight
    w0.clock()    # reaps it; the client goes on
    w1.clock()
    x = np.zeros(N, np.float32)
    w0.init(2, x).wait()
    w0.pull(2, x).wait()


def test_timeouts_of_any_size(client):
    a = np.zeros(N, np.float32)
    client.init(1, a).wait()
    assert client.pull(1, a).wait(timeout=float("inf"))
    assert client.pull(1, a).wait(timeout=1e300)
    work = client.pull(1, a)
    assert work.wait(timeout=-5) in (True, False)  # a look, as timeout=0; over tcp it may still be in flight
    assert work.wait()
    expect(pskv.InvalidArgument, "NaN", lambda: client.pull(1, a).wait(timeout=float("nan")))


def test_close_from_another_thread_while_a_call_reads_its_arguments(server):
    c = pskv.Client(server.uri)
    a = np.zeros(N, np.float32)
    c.init(1, a).wait()

    class SlowKey:  # runs Python code inside push(): another thread gets the GIL meanwhile
        def __index__(self):
            time.sleep(0.3)
            return 1

    results = []

    def push():
        try:
            results.append(c.push(SlowKey(), a))
        except pskv.InvalidArgument as e:
            results.append(e)

    t = threading.Thread(target=push)
    t.start()
    time.sleep(0.1)
    c.close()  # waits for the push being issued, then completes it
    t.join()
    assert len(results) == 1
    if isinstance(results[0], pskv.Work):
        assert results[0].done()
    else:
        assert "closed" in str(results[0])


def test_close_completes_each_work_even_when_others_are_dropped_meanwhile(bsp_pair):
    _, w0, w1 = bsp_pair
    w0.init(1, np.full(N, 4.0, np.float32)).wait()
    w0.clock()
    a, b = np.zeros(N, np.float32), np.zeros(N, np.float32)
    work_a = w0.pull(1, a)
    work_b = w0.pull(1, b)  # both wait at the bound
    failure = []

    def close():
        try:
            w0.close()
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=close)
    t.start()
    time.sleep(0.2)  # close() is waiting for work_a without the GIL
    del work_b
    gc.collect()  # work_b's operation moves to the orphans while close() waits
    w1.clock()
    t.join(timeout=30)
    assert not t.is_alive()
    assert failure == [], failure
    assert work_a.done() and (a == 4.0).all() and (b == 4.0).all()


def test_server_dying_during_a_wait(transport):
    # A pskv-server process, killed while a pull waits at the BSP bound for worker 1.
    with pskv.launch(1, transport, workers=2, mode="bsp", wait_timeout=30.0, arena_mb=16) as servers:
        c = pskv.Client(servers.uris[0], worker_id=0, io_timeout=5.0)
        x = np.zeros(N, np.float32)
        c.init(1, x).wait()
        c.clock()
        work = c.pull(1, x)
        threading.Timer(0.3, servers.processes[0].kill).start()
        with pytest.raises((pskv.PeerFailure, pskv.Timeout, pskv.Io)):
            work.wait()
        assert work.done()
        with pytest.raises(pskv.Error):
            c.pull(1, x).wait()
        c.close(finished=False)


@pytest.mark.parametrize("seconds", [float("inf"), 1e300])
def test_a_timeout_past_a_year_is_refused(server, seconds):
    # float("inf") was converted to int64 milliseconds: undefined, then a timeout of INT64_MIN ms.
    expect(pskv.InvalidArgument, "at most a year", lambda: pskv.Client(server.uri, io_timeout=seconds))


def test_a_registered_buffer_is_held_until_the_client_closes(server):
    # Registered memory is found by address: freed and reused, it would be served from the old
    # registration's pages over RDMA. The client now keeps the buffer alive.
    c = pskv.Client(server.uri)
    a = np.zeros(1024, np.float32)
    before = sys.getrefcount(a)
    c.register_buffer(a)
    c.register_buffer(a)  # once is enough
    assert sys.getrefcount(a) == before + 1
    c.close()
    assert sys.getrefcount(a) == before


def test_close_from_a_signal_handler_ends_the_call_it_interrupted(bsp_pair):
    # A SIGTERM-style handler that closes the client runs inside the call it interrupted, which
    # close() used to wait for: for good, since the call could not end until the handler did.
    _, w0, _ = bsp_pair
    x = np.full(N, 2.0, np.float32)
    w0.init(1, x).wait()
    pushed = w0.push(1, x)
    pushed.wait()
    queued = w0.push(1, x)  # live when the handler runs; completed or failed by the close, never left
    closed_in_handler = []

    def handler(signum, frame):
        w0.close()
        closed_in_handler.append(w0.closed)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        t0 = time.monotonic()
        with pytest.raises(pskv.InvalidArgument, match="closed from inside a call.*abandoned"):
            w0.barrier()  # worker 1 never comes
        assert time.monotonic() - t0 < 10.0
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert closed_in_handler == [True]
    assert queued.done()
    try:
        queued.wait()
    except pskv.InvalidArgument as e:
        assert "closed before" in str(e)
    expect(pskv.InvalidArgument, "closed", lambda: w0.pull(1, x))
    w0.close()  # again: nothing left to do


@pytest.mark.parametrize("make, name", [
    (lambda uri: pskv.Client(uri, max_in_flight=-1), "max_in_flight"),
    (lambda uri: pskv.Client(uri, chunk_floats=2**64), "chunk_floats"),
    (lambda uri: pskv.Client(uri, initial_clock="3"), "initial_clock"),
    (lambda uri: pskv.Client(uri, range_keys=1.5), "range_keys"),
    (lambda uri: pskv.Server("tcp://127.0.0.1:0", workers=-1), "workers"),
    (lambda uri: pskv.Server("tcp://127.0.0.1:0", io_threads=True), "io_threads"),
    (lambda uri: pskv.Server("tcp://127.0.0.1:0", arena_mb=2**50), "arena_mb"),
    (lambda uri: pskv.Server("tcp://127.0.0.1:0", max_request_mb=-4), "max_request_mb"),
])
def test_integer_arguments_out_of_range_are_named(server, make, name):
    # pybind11 refused these with a dump of the whole signature, and arena_mb=2**50 wrapped to a
    # 0-byte arena when shifted into bytes.
    e = expect(pskv.InvalidArgument, f"{name} must be an int from 0 to \\d+, not ", lambda: make(server.uri))
    assert "Invoked with" not in str(e)


def test_integer_arguments_of_tables_are_named(client):
    expect(pskv.InvalidArgument, "dim must be an int", lambda: client.create_table(1, -16))
    expect(pskv.InvalidArgument, "table must be an int", lambda: client.create_table(-1, 16))
    expect(pskv.InvalidArgument, "max_rows must be an int", lambda: client.create_table(1, 16, max_rows=-1))
    ids = np.arange(4, dtype=np.int64)
    expect(pskv.InvalidArgument, "table must be an int",
           lambda: client.pull_rows(-2, ids, np.zeros(64, np.float32)))
    expect(pskv.InvalidArgument, "server must be an int", lambda: client.server_stats(-1))
    assert client.server_stats(np.uint8(0))["keys"] >= 0  # numpy integers are ints
