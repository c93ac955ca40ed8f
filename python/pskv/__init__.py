"""pskv: a parameter server for data-parallel training, from Python.

    import numpy as np, pskv
    with pskv.Server("tcp://127.0.0.1:0", rule="sgd", lr=0.1) as server:
        with pskv.Client(server.uri) as c:
            w = np.zeros(1000, np.float32)
            c.init(7, w).wait()                 # the first initialiser wins
            c.push(7, np.ones(1000, np.float32)).wait()
            c.pull(7, w).wait()                 # lands in w's own memory
            c.pull(7, w, async_op=False)        # the same, blocking: no Work, returns None

Arrays are float32, C-contiguous, CPU (numpy, memoryview, array('f'), torch.Tensor); they are read
and written in place, never converted. push/pull return a Work: wait(timeout=None), done(); with async_op=False (as in
torch.distributed) they wait and return None.
pskv.torch has the PyTorch optimizer; pskv.launch starts pskv-server processes.
"""

from . import _errors
from ._errors import (Capacity, Error, InvalidArgument, Io, LengthMismatch, NoDevice, NotFound, PeerFailure,
                      Permission, Protocol, StaleResource, Timeout, Unsupported)
from . import _pskv

_missing = set(_pskv.errc_names()) - set(_errors.BY_CODE)
if _missing:  # a C++ Errc added without its Python class
    raise ImportError(f"pskv: no Python exception for {sorted(_missing)}")
_pskv._set_error_classes(dict(_errors.BY_CODE))

from ._pskv import Client, Server, Work  # noqa: E402
from .launcher import ServerGroup, launch  # noqa: E402
from ._env import Cluster, detect_cluster  # noqa: E402

__all__ = ["Client", "Server", "Work", "launch", "ServerGroup", "Cluster", "detect_cluster", "Error",
           "InvalidArgument", "NotFound", "LengthMismatch", "Capacity", "Timeout", "PeerFailure", "Protocol", "Io",
           "NoDevice", "Permission", "StaleResource", "Unsupported"]
