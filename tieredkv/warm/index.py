"""The warm tier's LMDB index: records, free list, in-flight claims, and safe transactions.

One LMDB environment (``<tier>/index.lmdb/``) holds five named databases::

    blocks    key (16 B)              -> record (``record_dtype``: slot, length, checksum, gen, parent,
                                          policy fields, chunk tokens)
    slots     slot (4 B big-endian)   -> key (16 B)        reverse map of ``blocks``
    free      slot (4 B big-endian)   -> b""               slots below the high-water mark that are free
    inflight  key (16 B)              -> claim (``CLAIM``)  slots claimed by a writer, data not committed
    info      name                    -> value             hwm, n_slots, gen, corrupt counter, meta copy

Invariants (every write transaction keeps them):

* a slot below ``hwm`` is in exactly one of ``slots`` (holds a committed block), ``free`` or
  ``inflight`` (being written); slots at or above ``hwm`` were never used and are free;
* ``blocks[k].slot == s``  <=>  ``slots[s] == k``;
* a record is only written after its payload is in the slot (data first, index second), so a record
  never points at bytes that were not written by its own ``put_many``;
* ``gen`` (global, only grows) is stamped on each record at commit: a slot recycled for another block,
  or the same key stored again, always carries a different gen, so a reader that re-checks
  ``(slot, gen)`` after copying knows whether the bytes it copied were still that block's.

The LMDB writer lock is a robust mutex (a writer killed inside a transaction releases it and the
transaction is discarded), so every multi-step change here is one transaction.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar

import lmdb
import numpy as np

from tieredkv.errors import CapacityError, WarmTierUnavailable

T = TypeVar("T")

DB_BLOCKS = b"blocks"
DB_SLOTS = b"slots"
DB_FREE = b"free"
DB_INFLIGHT = b"inflight"
DB_INFO = b"info"

INFO_HWM = b"hwm"
INFO_N_SLOTS = b"n_slots"
INFO_GEN = b"gen"
INFO_CORRUPT = b"corrupt_total"
INFO_META = b"meta"

#: in-flight claim: slot, owner pid, owner start time (clock ticks since boot, from /proc), claim time.
CLAIM = struct.Struct("<IIQq")
U64 = struct.Struct("<Q")
SLOT_KEY = struct.Struct(">I")  # big-endian so LMDB's byte order is slot order (free list: lowest first)


def record_dtype(chunk_tokens: int) -> np.dtype:
    """The fixed-size, little-endian record stored per block (``blocks`` values).

    Policy fields use wall-clock microseconds, so records written by different processes compare.
    """
    return np.dtype([
        ("slot", "<u4"), ("length", "<u4"), ("checksum", "<u8"), ("gen", "<u8"),
        ("parent", "<u8", (2,)),
        ("insert_us", "<i8"), ("last_access_us", "<i8"), ("hits", "<i8"), ("position", "<i8"),
        ("tokens", "<u4", (chunk_tokens,)),
    ])


def now_us() -> int:
    return time.time_ns() // 1000


def slot_key(slot: int) -> bytes:
    return SLOT_KEY.pack(slot)


# ---- liveness of claim owners ----------------------------------------------------------------------
def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), None if gone.

    pid + start time names a process exactly: a reused pid has a later start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return 0  # /proc unreadable: cannot tell, treat as alive (never steal a live writer's slot)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    if len(fields) > 1 and fields[0] == b"Z":
        return None  # a zombie has finished writing for good
    return int(fields[19]) if len(fields) > 19 else 0


def owner_alive(pid: int, start: int) -> bool:
    """True while the process that made a claim (pid, start time) still runs."""
    if not os.path.exists("/proc/self/stat"):  # no procfs: fall back to signal 0 (pid reuse unsafe)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    current = process_start_time(pid)
    return current is not None and (current == 0 or current == start)


_SELF_START: dict[int, int] = {}


def self_identity() -> tuple[int, int]:
    """(pid, start time) of the calling process (cached per pid, so it stays right after fork)."""
    pid = os.getpid()
    start = _SELF_START.get(pid)
    if start is None:
        start = process_start_time(pid) or 0
        _SELF_START[pid] = start
    return pid, start


# ---- the environment -----------------------------------------------------------------------------
class Index:
    """One process's handle on the LMDB environment, with map growth and resize handling.

    Args:
        path: the ``index.lmdb`` directory (created 0700 by the caller).
        sync: ``"none"`` (no fsync), ``"data"`` (fsync per commit, meta page lazily: a system crash may
            undo the last commit but never corrupts), ``"full"`` (fsync data and meta per commit).
        map_size: initial map size in bytes (LMDB reserves address space, not disk).
        map_max: the map never grows past this; a full map past it is a ``CapacityError``.
        readonly: open for reading only.
    """

    def __init__(self, path: str, *, sync: str, map_size: int, map_max: int, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        self.sync_mode = sync
        self.map_max = max(int(map_max), int(map_size))
        self._key = (os.getpid(), os.path.realpath(path))
        shared = _ENVS.get(self._key)
        if shared is None:
            shared = _SharedEnv(path, sync=sync, map_size=map_size, readonly=readonly)
            _ENVS[self._key] = shared
        elif shared.readonly and not readonly:
            raise WarmTierUnavailable(f"{path} is already open read-only in this process; close that "
                                      f"handle before opening it for writing")
        shared.refs += 1
        self._shared = shared
        self.env = shared.env
        # A handle asking for more durability than the environment was opened with syncs by hand.
        self._extra_sync = _SYNC_RANK[sync] > _SYNC_RANK[shared.sync]
        self.blocks, self.slots, self.free, self.inflight, self.info = shared.dbs
        self.writes = 0
        self._closed = False

    def close(self) -> None:
        """Release this handle; the environment closes with its last handle in this process.

        In a forked child, closing a handle inherited from the parent closes the child's copy of the
        environment: py-lmdb refuses to open a path twice in one process, and the copy must not be
        used. Closing it in the child leaves the parent's locks and reader slots alone (both are
        per pid).
        """
        if self._closed:
            return
        self._closed = True
        if self._shared.pid != os.getpid():
            _ENVS.pop(self._key, None)
            if not self._shared.closed:
                self._shared.closed = True
                self.env.close()
            return
        self._shared.refs -= 1
        if self._shared.refs == 0 and _ENVS.get(self._key) is self._shared:
            del _ENVS[self._key]
            self._shared.closed = True
            self.env.close()

    def reader_check(self) -> int:
        """Clear reader slots of dead processes (they pin old pages); return how many were cleared."""
        if self.readonly:
            return 0
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0

    def begin_read(self) -> lmdb.Transaction:
        try:
            try:
                return self.env.begin(write=False, buffers=False)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (0 = the size now in the file).
                self.env.set_mapsize(0)
                return self.env.begin(write=False, buffers=False)
        except lmdb.Error as exc:  # readers full, a damaged file: a tier problem, not the caller's
            raise WarmTierUnavailable(f"cannot read the warm index: {exc}") from exc

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a read transaction.

        Raises:
            WarmTierUnavailable: LMDB failed (the index is damaged or out of reader slots).
        """
        txn = self.begin_read()
        try:
            return fn(txn)
        except lmdb.Error as exc:
            raise WarmTierUnavailable(f"cannot read the warm index: {exc}") from exc
        finally:
            txn.abort()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a write transaction and commit; grow the map and retry if it is full.

        ``fn`` must be safe to run again (it is re-run from scratch after a map-full abort).

        Raises:
            WarmTierUnavailable: the index cannot be written (read-only, disk full, I/O error).
            CapacityError: the map would have to grow past ``map_max``.
        """
        if self.readonly:
            raise WarmTierUnavailable(f"warm tier index {self.path} is open read-only")
        while True:
            try:
                txn = self.env.begin(write=True)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)
                continue
            except lmdb.Error as exc:
                raise _unavailable(self.path, exc) from exc
            try:
                result = fn(txn)
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                self._grow()
                continue
            except lmdb.MapResizedError:
                txn.abort()
                self.env.set_mapsize(0)
                continue
            except lmdb.Error as exc:
                txn.abort()
                raise _unavailable(self.path, exc) from exc
            except BaseException:
                txn.abort()
                raise
            if self._extra_sync:
                self.env.sync(True)
            self.writes += 1
            if self.writes % 1024 == 0:
                # A reader killed mid-transaction pins old pages until cleared; clear now and then.
                self.reader_check()
            return result

    def _grow(self) -> None:
        current = self.env.info()["map_size"]
        if current >= self.map_max:
            raise CapacityError(f"the warm tier index {self.path} is full at its map limit of "
                                f"{current} bytes; open the tier with a larger map_max_bytes "
                                f"(long-lived readers pin pages: check for stuck processes)")
        self.env.set_mapsize(min(self.map_max, current * 2))

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])


_SYNC_RANK = {"none": 0, "data": 1, "full": 2}


class _SharedEnv:
    """The one LMDB environment of a path in this process (LMDB allows only one per process)."""

    def __init__(self, path: str, *, sync: str, map_size: int, readonly: bool):
        self.sync = sync
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self.closed = False
        kwargs: dict[str, Any] = dict(subdir=True, map_size=int(map_size), max_dbs=8, mode=0o600, readahead=False,
                      meminit=False, max_readers=510, sync=sync != "none", metasync=sync == "full",
                      readonly=readonly, create=not readonly)
        try:
            self.env = lmdb.open(path, **kwargs)
        except lmdb.Error as exc:
            if not readonly or not _is_permission(exc):
                raise
            # A read-only directory: the lock file cannot be opened for writing. Read without the
            # reader table; safe only because nobody can write here either.
            self.env = lmdb.open(path, lock=False, **kwargs)
        try:
            self.dbs = tuple(self.env.open_db(name, create=not readonly)
                             for name in (DB_BLOCKS, DB_SLOTS, DB_FREE, DB_INFLIGHT, DB_INFO))
        except BaseException:
            self.env.close()
            raise


#: (pid, realpath) -> the environment shared by every handle of this process. Keyed by pid so a
#: forked child never reuses its parent's environment.
_ENVS: dict[tuple[int, str], _SharedEnv] = {}


def _is_permission(exc: Exception) -> bool:
    text = str(exc).lower()
    return "permission" in text or "read-only" in text or "eacces" in text or "erofs" in text


def _unavailable(path: str, exc: Exception) -> WarmTierUnavailable:
    if isinstance(exc, lmdb.ReadonlyError) or _is_permission(exc):
        why = "the index is read-only here"
    elif "no space" in str(exc).lower() or getattr(exc, "errno", None) == errno.ENOSPC:
        why = "the disk is full"
    else:
        why = "LMDB error"
    return WarmTierUnavailable(f"cannot write the warm tier index {path}: {why} ({exc})")


# ---- small helpers over a transaction ------------------------------------------------------------
def get_u64(txn: lmdb.Transaction, db, name: bytes, default: int = 0) -> int:
    raw = txn.get(name, db=db)
    return U64.unpack(raw)[0] if raw is not None else default


def put_u64(txn: lmdb.Transaction, db, name: bytes, value: int) -> None:
    txn.put(name, U64.pack(int(value)), db=db)
