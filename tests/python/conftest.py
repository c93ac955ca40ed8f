"""Shared fixtures: in-process servers over shm and tcp, and worker clients bound to them."""

import itertools
import os

import pytest

import pskv

_names = itertools.count()


def server_uri(transport):
    # shm names are per process and per test, so parallel ctest runs and reruns never collide.
    return f"shm://pytest-{os.getpid()}-{next(_names)}" if transport == "shm" else "tcp://127.0.0.1:0"


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


@pytest.fixture
def server(transport):
    with pskv.Server(server_uri(transport), arena_mb=64, io_threads=1) as s:
        yield s


@pytest.fixture
def client(server):
    with pskv.Client(server.uri) as c:
        yield c


@pytest.fixture
def bsp_pair(transport):
    """A BSP server for two workers and both workers' clients (pulls past the bound wait)."""
    with pskv.Server(server_uri(transport), workers=2, mode="bsp", wait_timeout=30.0, arena_mb=16,
                     io_threads=1) as s:
        w0 = pskv.Client(s.uri, worker_id=0)
        w1 = pskv.Client(s.uri, worker_id=1)
        yield s, w0, w1
        w0.close()
        w1.close()
