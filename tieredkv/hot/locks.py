"""Locks that a dead holder cannot keep, and liveness without trusting pids.

Both use open-file-description (OFD) byte-range locks (``F_OFD_SETLK``) on the segment's own file
descriptor: the kernel drops them when the holder dies, SIGKILL included, so a crashed worker never
blocks the others (a POSIX semaphore or a process-shared mutex without robustness would). OFD locks,
unlike classic ``lockf`` locks, belong to one open of the file, not to the process: two handles in one
process exclude each other, and closing an unrelated descriptor of the same file drops nothing.

Lock bytes live far beyond the end of the segment (locks do not need the bytes to exist):

    META_LOCK_BYTE            the metadata lock (slot table, index, free stack, policy state)
    REGISTRY_BASE + i         held for its lifetime by the handle registered as owner ``i``

An owner is alive iff someone holds its registry byte (``F_OFD_GETLK``, a few microseconds) and the
owner table's token for ``i`` is still the one the slot recorded (pid reuse and index reuse are both
harmless). Lock, test and dead-holder hand-off costs: docs/benchmarks.md, "Notes behind the code".
Waits are bounded: ``acquire`` polls with backoff and raises ``LockTimeout``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time

from tieredkv.errors import LockTimeout

META_LOCK_BYTE = 1 << 40
REGISTRY_BASE = (1 << 40) + 4096

# struct flock on Linux x86_64 / aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (+ padding). OFD locks require l_pid == 0.
_FLOCK = struct.Struct("hhqqi4x")
if _FLOCK.size != 32:  # pragma: no cover - other ABIs
    raise ImportError("tieredkv's hot tier needs the Linux struct flock layout")

try:
    _SETLK = fcntl.F_OFD_SETLK
    _GETLK = fcntl.F_OFD_GETLK
except AttributeError:  # pragma: no cover - non-Linux
    raise ImportError("tieredkv's hot tier needs Linux open-file-description locks (F_OFD_SETLK)") from None


def refuse_reentry(lock, holder: int, what: str) -> int:
    """This thread's id, or ``LockTimeout`` when it holds ``lock`` already (``holder``: the id the
    holder recorded): a signal handler or a callback entering again would wait for itself for ever."""
    me = threading.get_ident()
    if holder == me and lock.locked():
        raise LockTimeout(f"{what}: this thread is inside already (re-entered from a signal handler or a callback)")
    return me


def _flock(kind: int, start: int, length: int = 1) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


#: ``fcntl.fcntl(fd, SETLK, UNLOCK_META)`` releases the metadata lock in one C call. Release paths
#: make exactly that call, first thing, so that no Python-level check (where a signal handler's
#: exception can be raised) runs between deciding to release and releasing.
SETLK = _SETLK
UNLOCK_META = _flock(fcntl.F_UNLCK, META_LOCK_BYTE)


def try_lock(fd: int, start: int, length: int = 1, *, shared: bool = False) -> bool:
    """Take an exclusive (or, with ``shared``, a read) lock on ``[start, start+length)`` if free;
    True if taken. A shared lock needs only read access to the file."""
    try:
        fcntl.fcntl(fd, _SETLK, _flock(fcntl.F_RDLCK if shared else fcntl.F_WRLCK, start, length))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def unlock(fd: int, start: int, length: int = 1) -> None:
    fcntl.fcntl(fd, _SETLK, _flock(fcntl.F_UNLCK, start, length))


def is_locked(fd: int, start: int, length: int = 1) -> bool:
    """Whether another open file description holds a lock overlapping the range."""
    out = fcntl.fcntl(fd, _GETLK, _flock(fcntl.F_WRLCK, start, length))
    return _FLOCK.unpack(out)[0] != fcntl.F_UNLCK


def acquire(fd: int, start: int, timeout_s: float, what: str = "lock") -> None:
    """Spin briefly, then sleep with exponential backoff until the lock is ours or time runs out.

    Raises:
        LockTimeout: a live process held it for ``timeout_s`` (a dead one would have released it).
    """
    if try_lock(fd, start):
        return
    for _ in range(64):  # most critical sections are a few microseconds: spin first
        if try_lock(fd, start):
            return
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while True:
        time.sleep(pause)
        if try_lock(fd, start):
            return
        if time.monotonic() > deadline:
            raise LockTimeout(f"{what} still held by a live process after {timeout_s:.1f} s; "
                              f"a process may be stopped (SIGSTOP) inside a critical section")
        pause = min(pause * 2, 1e-3)

