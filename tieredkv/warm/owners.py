"""Who has a warm tier open, and its writer lock: OFD byte-range locks on ``<tier>/owners``.

Liveness by pid + /proc start time is namespace-local: a writer in another PID namespace (a container
sharing the warm directory) has a pid that means nothing here, so its live claims looked dead and were
reaped under it, while a dead container's claims looked alive forever. Locks held by the kernel on a
shared file have no such blind spot. Every process that opens the tier for writing holds an
open-file-description lock on its own registry byte for as long as it has the tier open; the kernel
drops it when the process dies (SIGKILL included, in any namespace), so ``F_OFD_GETLK`` on that byte
answers "is owner ``i`` alive" for every process on the host. The hot tier does the same in shared
memory (``tieredkv.hot.locks``); the lock primitives are shared.

The file's bytes hold one entry per registry slot; the lock bytes lie far past its end::

    offset 32*i           entry i: token (random, never 0 while registered), the device and inodes
                          of index.lmdb/lock.mdb and index.lmdb/data.mdb this owner uses
    WRITER_BYTE           the writer lock: held around every LMDB write transaction
    PRESENCE_BYTE         a shared lock held by every process that has the index open (read-only too)
    REGISTRY_BASE + i     held by owner i for its lifetime

A claim names ``(i, token)``: it is live iff byte ``REGISTRY_BASE + i`` is locked and entry ``i`` still
carries ``token`` (a slot reused by a later owner has a new token).

Why a writer lock of our own when LMDB has one: LMDB's writer mutex has no timeout, so one writer
stopped inside a transaction (SIGSTOP, a debugger, a frozen cgroup) blocked every other writer without
bound. Ours is taken with a deadline first (a ``LockTimeout`` after ``lock_timeout_s``, as in the hot
tier), so LMDB's mutex is only ever contended inside one process.

The inodes in the entries catch a replaced index: a process that deleted or replaced ``lock.mdb``
while others had it open would start a second LMDB lock table, and two writers (or a writer that
cannot see the others' readers) corrupt the index. An opener refuses when a live owner uses other
files; an owner stops writing when the files at the path are no longer the ones it opened.
"""

from __future__ import annotations

import os
import secrets
import stat
import struct
import threading

from tieredkv import forksafe
from tieredkv.errors import LockTimeout, WarmTierUnavailable
from tieredkv.hot import locks

OWNERS_NAME = "owners"
WRITER_BYTE = locks.META_LOCK_BYTE
PRESENCE_BYTE = locks.META_LOCK_BYTE + 1
REGISTRY_BASE = locks.REGISTRY_BASE
#: Registry slots: one more process than this opening the tier for writing gets WarmTierUnavailable.
MAX_OWNERS = 1 << 14
ENTRY = struct.Struct("<QQQQ")  # token, st_dev, lock.mdb inode, data.mdb inode


def files_identity(index_dir: str) -> tuple[int, int, int]:
    """``(st_dev, lock.mdb inode, data.mdb inode)`` at the path now (0 for a missing file)."""
    ids = []
    dev = 0
    for name in ("lock.mdb", "data.mdb"):
        try:
            st = os.stat(os.path.join(index_dir, name))
        except FileNotFoundError:
            ids.append(0)
            continue
        dev = st.st_dev
        ids.append(st.st_ino)
    return dev, ids[0], ids[1]


class Owners:
    """This process's view of ``<tier>/owners``: liveness of others, our registration, the writer lock.

    Args:
        tier_dir: the tier directory.
        writable: open the file for writing (register, take the writer lock). Without it only
            ``alive`` works (a read-only directory: nobody can write the tier there anyway).

    Raises:
        WarmTierUnavailable: the owners file cannot be opened (or is not a regular file).
    """

    def __init__(self, tier_dir: str, *, writable: bool):
        self.path = os.path.join(tier_dir, OWNERS_NAME)
        self.writable = writable
        self.owner = -1
        self.token = 0
        self._thread_lock = threading.Lock()  # OFD locks do not exclude threads sharing the descriptor
        forksafe.register(self)  # unlocked in a forked child (see tieredkv.forksafe)
        self._holder: int | None = None  # the thread that owns _thread_lock (and so the writer byte)
        flags = os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            if writable:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | flags, 0o600)
            else:
                try:
                    self.fd = os.open(self.path, os.O_RDONLY | flags)
                except FileNotFoundError:
                    self.fd = -1  # nobody ever opened the tier for writing: no owner is alive
        except OSError as exc:
            raise WarmTierUnavailable(f"cannot open the warm tier's owner registry {self.path}: "
                                      f"{os.strerror(exc.errno) if exc.errno else exc}", errno=exc.errno) from exc
        if self.fd >= 0 and not _is_regular(self.fd):
            os.close(self.fd)
            self.fd = -1
            raise WarmTierUnavailable(f"{self.path} is not a regular file; remove it")

    def hold_presence(self) -> None:
        """Hold a shared lock on ``PRESENCE_BYTE`` for as long as this process has the index open.

        Taken before LMDB opens the index and dropped after it closes, in read-only processes too
        (a shared lock needs only read access), so "some process has ``lock.mdb`` open" implies
        "some process holds the presence byte of *this* registry file".
        """
        if self.fd >= 0:
            locks.try_lock(self.fd, PRESENCE_BYTE, shared=True)  # shared: never refused by other holders

    def registry_lost(self, index_dir: str) -> bool:
        """True if processes have the index open but none of them holds this registry's presence
        byte: the registry file was deleted (or replaced) under them.

        They are registered in the old file, so their claims would look dead in this one (reaped
        while they still write) and their writer lock is not ours. LMDB keeps a shared lock on byte 0
        of ``lock.mdb`` in every process that has the environment open; the kernel reports both
        locks across PID namespaces. Call it before this process opens the index itself.
        """
        if self.fd < 0 or locks.is_locked(self.fd, PRESENCE_BYTE):
            return False
        try:
            fd = os.open(os.path.join(index_dir, "lock.mdb"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            return locks.is_locked(fd, 0)
        finally:
            os.close(fd)

    # ---- registration ------------------------------------------------------------------------------
    def register(self, identity: tuple[int, int, int]) -> None:
        """Take a free registry slot for this process's lifetime and record ``identity`` in it.

        Raises:
            WarmTierUnavailable: every registry slot is held by a live process.
        """
        for i in range(MAX_OWNERS):
            if locks.try_lock(self.fd, REGISTRY_BASE + i):
                self.owner, self.token = i, secrets.randbits(63) | 1
                self._write_entry(i, (self.token, *identity))
                return
        raise WarmTierUnavailable(f"{self.path}: {MAX_OWNERS} processes have the warm tier open; no "
                                  f"registry slot is free")

    def _write_entry(self, i: int, entry: tuple[int, int, int, int]) -> None:
        os.pwrite(self.fd, ENTRY.pack(*entry), i * ENTRY.size)

    def _entry(self, i: int) -> tuple[int, int, int, int]:
        raw = os.pread(self.fd, ENTRY.size, i * ENTRY.size)
        return ENTRY.unpack(raw) if len(raw) == ENTRY.size else (0, 0, 0, 0)

    def alive(self, owner: int, token: int) -> bool:
        """Whether the process that registered as ``owner`` with ``token`` still has the tier open.

        This process's own registration reads as not alive here (the kernel shows a descriptor's own
        locks as free): callers know their own claims without asking.
        """
        if self.fd < 0 or not 0 <= owner < MAX_OWNERS or token == 0:
            return False
        written = self._entry(owner)[0]
        if written not in (token, 0):
            return False  # a later owner took the slot and wrote its own token: this one is gone
        # The entry carries this token, or nothing (a zeroed or truncated file cannot vouch either
        # way): the kernel's lock decides. A live writer's claim is never freed on the file's word,
        # or its late copy would land on a reused slot.
        return locks.is_locked(self.fd, REGISTRY_BASE + owner)

    def others(self) -> list[tuple[int, tuple[int, int, int]]]:
        """``(owner, (dev, lock inode, data inode))`` of every other live owner."""
        if self.fd < 0:
            return []
        size = os.fstat(self.fd).st_size
        out = []
        for i in range(min(MAX_OWNERS, size // ENTRY.size)):
            token, dev, lock_ino, data_ino = self._entry(i)
            if token and i != self.owner and locks.is_locked(self.fd, REGISTRY_BASE + i):
                out.append((i, (dev, lock_ino, data_ino)))
        return out

    # ---- the writer lock -----------------------------------------------------------------------------
    def acquire_writer(self, timeout_s: float) -> None:
        """Take the writer lock, waiting at most ``timeout_s`` (0: only if free now).

        Call it inside ``try`` and ``release_writer`` in the ``finally``: an exception raised by a
        signal handler anywhere in here must not leave the lock held by a live, idle process.

        Raises:
            LockTimeout: a live process held it all that time (a dead one would have released it).
        """
        what = f"the warm tier's writer lock ({self.path})"
        if timeout_s > 0:
            got = self._thread_lock.acquire(timeout=timeout_s)
        else:
            got = self._thread_lock.acquire(blocking=False)
        if not got:
            raise LockTimeout(f"{what} is held by another thread of this process for over {timeout_s:.1f} s")
        # From here on this thread owns the byte range too: release_writer may unlock it whatever
        # happened next (unlocking a range we did not get is a no-op).
        self._holder = threading.get_ident()
        if timeout_s > 0:
            locks.acquire(self.fd, WRITER_BYTE, timeout_s, what)
        elif not locks.try_lock(self.fd, WRITER_BYTE):
            raise LockTimeout(f"{what} is held by another process right now")

    def release_writer(self) -> None:
        """Release what ``acquire_writer`` took in this thread, if anything (safe after a failed or
        interrupted acquire)."""
        if self._holder != threading.get_ident():
            return  # the thread lock is another thread's: so is the byte range
        try:
            locks.unlock(self.fd, WRITER_BYTE)
        finally:
            self._holder = None
            self._thread_lock.release()

    def close(self) -> None:
        """Deregister (entry cleared, lock dropped) and close. Idempotent."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            if self.owner >= 0:
                os.pwrite(fd, bytes(ENTRY.size), self.owner * ENTRY.size)
        except OSError:
            pass
        finally:
            os.close(fd)  # drops every lock of this open file description
            self.owner, self.token = -1, 0

    def drop_inherited(self) -> None:
        """In a forked child: close the inherited descriptor without touching the parent's entry.

        The descriptor shares the parent's open file description and so its locks: a child that kept
        it would keep a dead parent looking alive.
        """
        fd, self.fd = self.fd, -1
        self.owner, self.token = -1, 0
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)
