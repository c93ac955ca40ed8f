"""pskv.launch(): pskv-server processes on this node, stopped when the group is (or Python exits)."""

import ctypes
import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

_PR_SET_PDEATHSIG = 1


def _find_binary(env_var: str, paths_attr: str, name: str, hint: str) -> str:
    """$env_var, else the one built beside this package (_paths.<paths_attr>), else `name` on PATH;
    FileNotFoundError saying `hint` if none is executable."""
    candidates = [os.environ.get(env_var, "")]
    try:
        from . import _paths
        candidates.append(getattr(_paths, paths_attr))
    except ImportError:
        pass
    candidates.append(shutil.which(name) or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"{name} not found: {hint}")


def server_binary() -> str:
    """PSKV_SERVER_BIN, else the one built beside this package, else pskv-server on PATH."""
    return _find_binary("PSKV_SERVER_BIN", "SERVER_BIN", "pskv-server",
                        "build it (cmake --build build), put it on PATH, or set PSKV_SERVER_BIN")


# Servers are started from this one long-lived thread: the kernel's parent-death signal fires when
# the *thread* that forked a child exits, so a server restarted from a short-lived thread (say, a
# timer that kills and restarts one) would be SIGTERMed as soon as that thread ended.
_spawner = None
_spawner_pid = 0


def _spawn_thread() -> ThreadPoolExecutor:
    # One per process: a forked child (a DataLoader worker, say) does not have its parent's thread.
    global _spawner, _spawner_pid
    if _spawner is None or _spawner_pid != os.getpid():
        _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pskv-launch")
        _spawner_pid = os.getpid()
    return _spawner


def _die_with_parent():
    # Runs in the child before exec: a server must not outlive a Python that was killed.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# Options whose pskv-server flag is not just --name-with-dashes, or whose unit differs.
_FLAG_NAMES = {"straggler": "--straggler-policy", "wait_timeout": "--wait-timeout-ms",
               "checkpoint_every": "--checkpoint-every-s", "restore_dir": "--restore"}


def _flag(name: str, value) -> List[str]:
    if name == "wait_timeout":
        value = int(round(float(value) * 1000))
    flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    return [flag, str(value)]


def _free_ports(host: str, count: int) -> List[int]:
    # All held open until all are chosen, so no two are the same.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class ServerGroup:
    """`count` pskv-server processes serving shm://JOB-i or tcp://HOST:PORT (free ports);
    `uris` are what clients connect to, `processes` the children, `binary` the pskv-server run.

    replicas=R (tcp): every key is also kept by the next R-1 servers, which listen on ports chosen
    up front so that each knows the others (--replicas R --peers ...). kill(i) SIGKILLs server i
    and restart(i) starts it again at its address with --rejoin: it takes its keys back from its
    replicas, and clients made with retry_timeout (and a worker_id) see no error.

    failover_ms=MS (with replicas and count >= 3): a killed server need not be restarted; the
    next server of its chain serves its keys after at most MS ms, and retrying clients follow
    them there (--failover-ms; the votes go to a directory removed with the group). restart(i)
    then gives server i its keys back from that server, and the clients follow them back.

    Thread-safety: start and stop from one thread. The servers are stopped by stop(), by leaving a
    `with` block, when the group is garbage collected, at interpreter exit, and (SIGTERM from the
    kernel) if this process dies.
    """

    def __init__(self, count: int = 1, transport: str = "shm", workers: int = 0, mode: str = "asp",
                 staleness: int = 0, rule: str = "add", lr: float = 0.01, host: str = "127.0.0.1",
                 job: Optional[str] = None, start_timeout: float = 30.0, replicas: int = 1,
                 failover_ms: int = 0, **options):
        if count < 1:
            raise ValueError("count must be >= 1")
        if transport not in ("shm", "tcp", "rdma"):
            raise ValueError(f"transport must be shm, tcp or rdma, not {transport!r}")
        if replicas != 1 and (transport != "tcp" or not 1 <= replicas <= count):
            raise ValueError(f"replicas={replicas} needs transport='tcp' and at most count={count} servers")
        if failover_ms and (replicas < 2 or count < 3):
            raise ValueError("failover_ms needs replicas >= 2 and count >= 3 servers (a majority decides)")
        binary = self.binary = server_binary()
        job = job or f"py-{os.getpid()}-{id(self) & 0xffff:x}"
        self.processes: List[subprocess.Popen] = []
        self.uris: List[str] = []
        votes = tempfile.mkdtemp(prefix="pskv-votes-") if failover_ms else None
        self._finalizer = weakref.finalize(self, ServerGroup._stop_all, self.processes, votes, self.uris)
        self._start_timeout = start_timeout
        self._args: List[List[str]] = []
        ring = [f"tcp://{host}:{p}" for p in _free_ports(host, count)] if replicas > 1 else []
        self._token = options.get("auth_token_file")
        try:
            for s in range(count):
                uri = ring[s] if ring else f"shm://{job}-{s}" if transport == "shm" else f"{transport}://{host}:0"
                args = [binary, "--uri", uri, "--server-id", str(s), "--workers", str(workers), "--mode", mode,
                        "--staleness", str(staleness), "--rule", rule, "--lr", repr(float(lr))]
                if ring:
                    args += ["--replicas", str(replicas), "--peers", ",".join(ring)]
                if votes:
                    args += ["--failover-ms", str(int(failover_ms)), "--failover-dir", votes]
                for name, value in options.items():
                    args += _flag(name, value)
                self._args.append(args)
                self.processes.append(self._spawn(args))
                self.uris.append(self._read_uri(self.processes[-1], start_timeout))
            self._replicas = replicas
            self._wait_synced()
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _spawn(args: List[str]) -> subprocess.Popen:
        return _spawn_thread().submit(subprocess.Popen, args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      preexec_fn=_die_with_parent).result()

    def kill(self, index: int):
        """SIGKILLs server `index` (a crash, for fault-tolerance tests) and reaps it; with replicas,
        returns once the servers it replicated for have noticed (so restart() waits for a real
        transfer, not for their old view)."""
        p = self.processes[index]
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout:
            p.stdout.close()
        self._wait_replicas(lambda state, of: state != "synced" if of == index else True)

    def restart(self, index: int):
        """Starts server `index` again at its address, after kill(): with replicas it rejoins
        (--rejoin), taking its keys back from the servers that kept them."""
        if not self._finalizer.alive:
            raise RuntimeError("the group was stopped")
        if self.processes[index].poll() is None:
            raise RuntimeError(f"server {index} is still running: kill() it first")
        args = self._args[index] + (["--rejoin"] if self._replicas > 1 else [])
        p = self._spawn(args)
        self.processes[index] = p
        uri = self._read_uri(p, self._start_timeout)
        if uri != self.uris[index]:
            raise RuntimeError(f"server {index} came back at {uri}, not {self.uris[index]}")
        self._wait_synced()

    def _wait_synced(self):
        # With replicas, returns once every running server's running replicas hold all its keys:
        # a server killed before then could not rejoin (no replica of its keys would be complete).
        self._wait_replicas(lambda state, of: state == "synced" or self.processes[of].poll() is not None)

    def _wait_replicas(self, ok):
        # Until ok(state, replica) holds for each replica_<id>_state of every running server.
        if self._replicas < 2:
            return
        from . import Client
        deadline = time.monotonic() + self._start_timeout
        for s, uri in enumerate(self.uris):
            if self.processes[s].poll() is not None:
                continue
            with Client(uri, auth_token_file=self._token or "") as admin:
                while True:
                    stats = admin.server_stats(0)
                    states = {int(k[len("replica_"):-len("_state")]): v for k, v in stats.items()
                              if k.startswith("replica_") and k.endswith("_state") and not k.startswith("replica_of_")}
                    if all(ok(v, r) for r, v in states.items()):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"server {s}'s replicas did not reach the expected state within "
                                           f"{self._start_timeout} s: {stats}")
                    time.sleep(0.02)

    @staticmethod
    def _read_uri(p: subprocess.Popen, timeout: float) -> str:
        # pskv-server prints "pskv-server listening on URI (...)" once it serves.
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([p.stdout], [], [], left)[0]:
                raise TimeoutError(f"pskv-server (pid {p.pid}) did not start within {timeout} s")
            chunk = os.read(p.stdout.fileno(), 1)
            if not chunk:
                raise RuntimeError(f"pskv-server exited with status {p.wait()} before serving; see its messages above")
            line += chunk
        words = line.decode().split()
        if len(words) < 4 or words[1] != "listening":
            raise RuntimeError(f"unexpected first line from pskv-server: {line!r}")
        return words[3]

    @staticmethod
    def _stop_all(processes, votes=None, uris=()):
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        if votes:
            shutil.rmtree(votes, ignore_errors=True)
        # All servers are reaped now. One that did not stop cleanly (kill(), a crash) left its
        # segment and table files, which only a server of the same name would reclaim, and job
        # names are not reused. A server that stopped cleanly removed its own.
        for p, uri in zip(processes, uris):
            if p.returncode != 0 and uri.startswith("shm://"):
                name = "/dev/shm/pskv-" + uri[len("shm://"):].split("?")[0]
                for path in [name] + glob.glob(glob.escape(name) + ".tables.*"):
                    try:
                        os.unlink(path)
                    except IsADirectoryError:
                        shutil.rmtree(path, ignore_errors=True)
                    except FileNotFoundError:
                        pass

    def stop(self):
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def launch(servers: int = 1, transport: str = "shm", **options) -> ServerGroup:
    """Starts `servers` pskv-server processes; see ServerGroup for the options (any pskv-server
    flag, with underscores: workers=2, mode="ssp", staleness=2, rule="sgd", lr=0.05, arena_mb=64,
    replicas=2 over tcp)."""
    return ServerGroup(servers, transport, **options)
