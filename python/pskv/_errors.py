"""pskv's exceptions: one pskv.Error subclass per C++ pskv::Errc, carrying the C++ message.

Each also derives from the built-in exception a Python caller would expect (InvalidArgument is a
ValueError, Timeout a TimeoutError, PeerFailure a ConnectionError...), so generic handlers work.
"""


class Error(Exception):
    """Base of every error pskv raises; `code` is the C++ Errc's name."""

    code = "unknown"


class InvalidArgument(Error, ValueError):
    """The call was malformed (wrong dtype, layout, count, key, or the client is closed)."""

    code = "invalid_argument"


class NotFound(Error, KeyError):
    """Unknown key: init() it first."""

    code = "not_found"

    def __str__(self):  # KeyError would quote the message
        return Exception.__str__(self)


class LengthMismatch(Error, ValueError):
    """The array's length differs from the key's fixed length."""

    code = "length_mismatch"


class Capacity(Error, MemoryError):
    """An arena, index or queue is full: raise the named limit."""

    code = "capacity"


class Timeout(Error, TimeoutError):
    """A peer did not answer in time."""

    code = "timeout"


class PeerFailure(Error, ConnectionError):
    """A peer died or closed the connection."""

    code = "peer_failure"


class Protocol(Error):
    """A malformed or incompatible message."""

    code = "protocol"


class Io(Error, OSError):
    """An operating-system call failed."""

    code = "io"


class NoDevice(Error):
    """No usable RDMA device."""

    code = "no_device"


class Permission(Error, PermissionError):
    """Access refused (auth token, file mode, memlock limit)."""

    code = "permission"


class StaleResource(Error):
    """A leftover of a crashed run was found."""

    code = "stale_resource"


class Unsupported(Error):
    """Not available on this backend or build."""

    code = "unsupported"


BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, LengthMismatch, Capacity, Timeout, PeerFailure,
                                     Protocol, Io, NoDevice, Permission, StaleResource, Unsupported)}
BY_CODE["ok"] = Error  # never raised; keeps the table total
