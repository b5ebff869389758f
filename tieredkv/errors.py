"""The one exception family of tieredkv.

Running out of room is a result (``PutResult.NO_SPACE``), never an exception. Everything here means
"the call was wrong" or "the state is not what it must be"; each message says how to fix the call.
"""

import math
import numbers


class TieredKVError(Exception):
    """Base class of every error tieredkv raises on purpose."""


class InvalidInput(TieredKVError, ValueError):
    """A call's arguments are wrong (shape, dtype, type, range)."""


class InvalidPayload(InvalidInput):
    """A payload or output buffer has the wrong size, dtype, shape or layout."""


class InvalidName(InvalidInput):
    """A segment or directory name that tieredkv refuses to use."""


class SpecMismatch(TieredKVError):
    """An existing segment or directory was made for a different KV spec (namespace)."""


class FormatError(TieredKVError):
    """Foreign magic, unknown layout/format version, or a header that does not parse."""


class CorruptState(TieredKVError):
    """Shared or on-disk state broke an invariant and could not be repaired."""


class CapacityError(TieredKVError):
    """The requested size cannot be reserved (e.g. /dev/shm or the disk is too small)."""


class LockTimeout(TieredKVError, TimeoutError):
    """A bounded wait for a lock ran out: some live process holds it far longer than it should."""


class PermissionDenied(TieredKVError, PermissionError):
    """A segment or directory is owned by another user or has unsafe permissions."""


class WarmTierUnavailable(TieredKVError):
    """The warm tier cannot be written (read-only directory, disk full, I/O error).

    Attributes:
        errno: the operating system's error number when one caused it (``errno.ENOSPC``: the disk is
            full), else ``None``.
    """

    def __init__(self, message: str, *, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class Unsupported(TieredKVError):
    """The store or tier cannot do this at all (a ``mooncake://`` store cannot list its names): not a
    mistake in the call, and not a failure to retry."""


class UsageError(InvalidInput):
    """A command or its configuration asks for something that cannot work (a command-line tool reports
    it in one line and exits with status 2)."""


class MissingDependency(TieredKVError, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


class RemoteUnavailable(TieredKVError):
    """The remote store did not answer (refused, reset, or past the deadline). The remote tier turns
    this into a counted miss on the serving path; only administrative calls let it through."""


# ---- argument checks shared by the public constructors ----------------------------------------
def require_positive_int(name: str, value: object, example: str = "") -> int:
    """Return ``value`` as an int, or raise ``InvalidInput`` naming ``name``.

    Bools and strings are refused even though Python would convert some of them: ``"8M"`` or
    ``True`` as a size is always a caller's mistake.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        hint = f" (e.g. {name}={example})" if example else ""
        raise InvalidInput(f"{name} must be a positive integer{hint}, got {value!r}")
    return int(value)


def require_positive_seconds(name: str, value: object) -> float:
    """Return ``value`` as a finite, positive float of seconds, or raise ``InvalidInput`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"{name} must be a positive, finite number of seconds (e.g. {name}=10.0), got {value!r}")
    return float(value)
