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
transaction is discarded), so every multi-step change here is one transaction. Every write transaction
is also taken under the tier's own writer lock (``owners.Owners``), which has a deadline: a writer
stopped inside a transaction costs the others a ``LockTimeout``, not a hang. Reads take no lock and
never wait for a writer; every transaction of the process only enters a gate (``_TxnGate``) that a
remap or a fork closes for a moment.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import lmdb
import numpy as np

from tieredkv import forksafe
from tieredkv.errors import CapacityError, CorruptState, WarmTierUnavailable
from tieredkv.warm.owners import Owners, files_identity

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

#: in-flight claim: slot, owner (registry slot in ``owners``), owner token, claim time. Liveness comes
#: from the owner's registry lock (see tieredkv.warm.owners), never from a pid: pids are per namespace.
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


# ---- the data file's size, checked before LMDB touches a page ----------------------------------------
_META_MAGIC = 0xBEEFC0DE
# An LMDB meta page: a 16-byte page header, then MDB_meta: magic u32, version u32, address, map size,
# two MDB_db records of 48 bytes (the first one's pad word holds the page size), last page, txn id.
_META = struct.Struct("<II8x8xI36xQ40xQQQ")  # magic, version, page size, free root, main root, last, txn
_META_AT = 16
_NO_PAGE = 2**64 - 1  # P_INVALID: an empty tree's root
#: How many pages short of its meta page's last page a data.mdb may be and still pass the quick
#: (not ``exact``) check; see ``data_file_problem``.
_UNWRITTEN_TAIL_PAGES = 64


def data_file_problem(index_dir: str, fd: int | None = None, *, exact: bool = False) -> str | None:
    """Why ``data.mdb`` cannot be mapped safely (``"missing"``, ``"truncated: ..."``), or None if it can.

    LMDB maps the file and touches the pages its trees reference; a file shorter than that (truncated
    under it, or copied short) turns the first such touch into SIGBUS, which kills the process whatever
    Python does. So the size is checked against both meta pages, read with pread, before LMDB opens the
    file and before every transaction. An empty file is not a problem: LMDB initialises it as a new
    index.

    A healthy file may end short of the last page the meta page names: the last pages a transaction
    allocated and freed again before its commit are never written. Without ``exact`` a file up to
    ``_UNWRITTEN_TAIL_PAGES`` short passes (the roots must be inside); with ``exact`` (at open, in
    ``verify``) a short file's trees are walked with pread and every page they reference must exist.
    """
    own = fd is None
    if fd is None:
        try:
            fd = os.open(os.path.join(index_dir, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "missing"
    try:
        for _ in range(8):  # a commit during a walk may recycle pages it reads: walk that txn again
            meta = _newest_meta(fd)
            # Meta first, size second: a commit writes its pages (growing the file) before its meta
            # page, so the size read after a meta page covers every page written for it.
            size = os.fstat(fd).st_size
            if size == 0:
                return None
            if meta is None:
                return f"damaged: no valid LMDB meta page in {size} bytes"
            txnid, psize, last_pg, roots = meta
            pages = size // psize
            need = max([2] + [r + 1 for r in roots])
            if pages < need:
                return f"truncated: {size} bytes, the index needs at least {need * psize}"
            if pages > last_pg:
                return None
            if not exact:
                if pages < last_pg + 1 - _UNWRITTEN_TAIL_PAGES:
                    return f"truncated: {size} bytes, the index needs at least {(last_pg + 1) * psize}"
                return None
            missing = _first_missing_page(fd, psize, pages, roots)
            again = _newest_meta(fd)
            if again is not None and again[0] != txnid:
                continue
            if missing is None:
                return None
            return f"truncated: {size} bytes, page {missing} ({(missing + 1) * psize} bytes) is in use"
        return None  # the index kept changing under the walk: it is being written, so it is mapped fine
    finally:
        if own:
            os.close(fd)


def _newest_meta(fd: int) -> tuple[int, int, int, list[int]] | None:
    """``(txn id, page size, last page, tree roots)`` of the newer valid meta page, or None."""
    metas = []
    psize = 4096
    for page_no in (0, 1):  # meta page 1 sits one page size in: learn the page size from page 0
        raw = os.pread(fd, _META.size, page_no * psize + _META_AT)
        if len(raw) < _META.size:
            continue
        magic, _, page, free_root, main_root, last_pg, txnid = _META.unpack(raw)
        if magic == _META_MAGIC and page >= 512 and not page & (page - 1):
            metas.append((txnid, page, last_pg, [r for r in (free_root, main_root) if r != _NO_PAGE]))
            psize = page
    return max(metas, key=lambda m: m[0]) if metas else None


_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size (a branch node's child is lo | hi<<16 | flags<<32)


def _first_missing_page(fd: int, psize: int, pages: int, roots: list[int]) -> int | None:
    """Walk every tree from ``roots`` with pread; return a referenced page at or past ``pages``.

    Follows branch children, named databases (a leaf's sub-database root) and overflow runs. Pages are
    never touched through a map, so a short file is an answer here, not a signal.
    """
    stack, seen = list(roots), set()
    while stack:
        pg = stack.pop()
        if pg in seen:
            continue
        seen.add(pg)
        if pg >= pages or len(seen) > pages:
            return pg
        buf = os.pread(fd, psize, pg * psize)
        if len(buf) < psize:
            return pg
        flags, lower = struct.unpack_from("<HH", buf, 10)
        if flags & _P_OVERFLOW:
            last = pg + struct.unpack_from("<I", buf, 12)[0] - 1
            if last >= pages:
                return last
            continue
        if not flags & (_P_BRANCH | _P_LEAF) or lower < 16 or lower > psize:
            continue  # a sub-page or damaged header: nothing we can follow
        for i in range((lower - 16) >> 1):
            off = struct.unpack_from("<H", buf, 16 + 2 * i)[0]
            if off + _NODE.size > psize:
                continue
            lo, hi, nflags, ksize = _NODE.unpack_from(buf, off)
            if flags & _P_BRANCH:
                stack.append(lo | hi << 16 | nflags << 32)
            elif nflags & _F_BIGDATA and off + 8 + ksize + 8 <= psize:
                stack.append(struct.unpack_from("<Q", buf, off + 8 + ksize)[0])
            elif nflags & _F_SUBDATA and off + 8 + ksize + 48 <= psize:
                root = struct.unpack_from("<Q", buf, off + 8 + ksize + 40)[0]
                if root != _NO_PAGE:
                    stack.append(root)
    return None


# ---- the environment -----------------------------------------------------------------------------
class _TxnGate:
    """Who may have a transaction open on one environment in this process, for remapping and fork.

    LMDB allows any number of read transactions beside a write (MVCC: a reader never waits for a
    writer), so transactions only *enter* the gate (shared). Two things need every transaction of the
    process closed: changing the map size (``set_mapsize`` remaps the file under open transactions)
    and ``fork`` (py-lmdb cannot close, in the child, an environment with a transaction open on a
    thread that did not survive). They take the gate exclusively: new transactions wait (briefly: a
    remap is quick; a fork is bounded by its timeout), open ones end first. Transactions never nest
    on one thread, and the exclusive holder opens none, so this cannot deadlock; nobody holds the gate
    across a wait for the writer lock or a data copy.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._active = 0                   # transactions open now
        self._owner: int | None = None     # the thread holding the gate exclusively
        self._depth = 0
        self._waiting = 0                  # threads waiting for it exclusively (they go first)
        forksafe.register(self)  # unlocked in a forked child (the child opens its own environment)

    def _after_fork_in_child(self) -> None:
        self._active, self._owner, self._depth, self._waiting = 0, None, 0, 0

    def enter(self) -> None:
        me = threading.get_ident()
        with self._cond:
            while self._owner not in (None, me) or (self._waiting and self._owner != me):
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def acquire_exclusive(self, timeout_s: float | None = None) -> bool:
        """Wait until no transaction is open and hold off new ones; False after ``timeout_s``."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            self._waiting += 1
            try:
                ok = self._cond.wait_for(lambda: self._owner is None and not self._active, timeout_s)
            finally:
                self._waiting -= 1
                if not self._waiting:
                    self._cond.notify_all()  # transactions held off for us may go on
            if ok:
                self._owner, self._depth = me, 1
            return ok

    def release_exclusive(self) -> None:
        with self._cond:
            self._depth -= 1
            if not self._depth:
                self._owner = None
                self._cond.notify_all()

    def remap(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a ``set_mapsize``) with no transaction open; the caller has entered the gate
        and holds no transaction: it leaves for the remap and enters again."""
        self.leave()
        try:
            self.acquire_exclusive()
            try:
                fn()
            finally:
                self.release_exclusive()
        finally:
            self.enter()


class Index:
    """One process's handle on the LMDB environment, with map growth and resize handling.

    Args:
        path: the ``index.lmdb`` directory (created 0700 by the caller).
        sync: ``"none"`` (no fsync), ``"data"`` (fsync per commit, meta page lazily: a system crash may
            undo the last commit but never corrupts), ``"full"`` (fsync data and meta per commit).
        map_size: initial map size in bytes (LMDB reserves address space, not disk).
        map_max: the map never grows past this; a full map past it is a ``CapacityError``.
        readonly: open for reading only.
        lock_timeout_s: longest wait for the writer lock (held by a live writer) before ``LockTimeout``.

    Raises:
        CorruptState: ``data.mdb`` is shorter than its own meta pages say (truncated).
        WarmTierUnavailable: a live process uses other index files at this path (they were replaced
            or deleted under it), or LMDB cannot open the files.
        LockTimeout: a live writer held the writer lock for ``lock_timeout_s`` while we opened.
    """

    def __init__(self, path: str, *, sync: str, map_size: int, map_max: int, readonly: bool = False,
                 lock_timeout_s: float = 10.0):
        self.path = path
        self.readonly = readonly
        self.sync_mode = sync
        self.map_max = max(int(map_max), int(map_size))
        self.lock_timeout_s = float(lock_timeout_s)
        self._key = (os.getpid(), os.path.realpath(path))
        shared = _ENVS.get(self._key)
        if shared is None:
            shared = _SharedEnv(path, sync=sync, map_size=map_size, readonly=readonly,
                                lock_timeout_s=self.lock_timeout_s)
            _ENVS[self._key] = shared
        elif shared.readonly and not readonly:
            raise WarmTierUnavailable(f"{path} is already open read-only in this process; close that "
                                      f"handle before opening it for writing")
        shared.refs += 1
        self._shared = shared
        self.env = shared.env
        self.owners = shared.owners
        # A handle asking for more durability than the environment was opened with syncs by hand.
        self._extra_sync = _SYNC_RANK[sync] > _SYNC_RANK[shared.sync]
        self.blocks, self.slots, self.free, self.inflight, self.info = shared.dbs
        self.writes = 0
        self._closed = False

    @property
    def identity(self) -> tuple[int, int]:
        """``(owner, token)`` that this process's claims carry."""
        return self.owners.owner, self.owners.token

    def claim_alive(self, owner: int, token: int) -> bool:
        """Whether another process that made a claim as ``(owner, token)`` still has the tier open."""
        return self.owners.alive(owner, token)

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
                self._shared.owners.drop_inherited()
                self._shared.close_data_fd()
                self.env.close()
            return
        self._shared.refs -= 1
        if self._shared.refs == 0 and _ENVS.get(self._key) is self._shared:
            del _ENVS[self._key]
            self._shared.close()

    def reader_check(self) -> int:
        """Clear reader slots of dead processes (they pin old pages); return how many were cleared."""
        if self.readonly:
            return 0
        try:
            return self.env.reader_check()
        except lmdb.Error:
            return 0

    def begin_read(self) -> lmdb.Transaction:
        """Begin a read transaction (never waits for a writer).

        For single-threaded tools (``verify``): the transaction is outside the gate that ``read``
        and ``write`` use, so no other thread of this process may use the environment meanwhile.

        Raises:
            CorruptState: the data file was truncated (reading it would be SIGBUS).
            WarmTierUnavailable: LMDB failed (a damaged file, out of reader slots).
        """
        self._shared.check_size()
        try:
            try:
                return self.env.begin(write=False, buffers=False)
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (0 = the size now in the file).
                gate = self._shared.gate
                gate.acquire_exclusive()
                try:
                    self.env.set_mapsize(0)
                finally:
                    gate.release_exclusive()
                return self.env.begin(write=False, buffers=False)
        except lmdb.Error as exc:  # readers full, a damaged file: a tier problem, not the caller's
            raise WarmTierUnavailable(f"cannot read the warm index: {exc}") from exc

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a read transaction.

        Raises:
            CorruptState: see ``begin_read``.
            WarmTierUnavailable: LMDB failed (the index is damaged or out of reader slots).
        """
        gate = self._shared.gate
        gate.enter()  # never waits for a writer: only for a remap or a fork, both short
        try:
            if self._closed:
                raise WarmTierUnavailable(f"the warm tier index {self.path} was closed")
            self._shared.check_size()
            try:
                try:
                    txn = self.env.begin(write=False, buffers=False)
                except lmdb.MapResizedError:
                    # Another process grew the map: adopt its size (0 = the size now in the file).
                    gate.remap(lambda: self.env.set_mapsize(0))
                    txn = self.env.begin(write=False, buffers=False)
            except lmdb.Error as exc:  # readers full, a damaged file: a tier problem, not the caller's
                raise WarmTierUnavailable(f"cannot read the warm index: {exc}") from exc
            try:
                return fn(txn)
            except lmdb.Error as exc:
                raise WarmTierUnavailable(f"cannot read the warm index: {exc}") from exc
            finally:
                txn.abort()
        finally:
            gate.leave()

    def write(self, fn: Callable[[lmdb.Transaction], T], *, wait_s: float | None = None) -> T:
        """Run ``fn`` in a write transaction and commit; grow the map and retry if it is full.

        ``fn`` must be safe to run again (it is re-run from scratch after a map-full abort).

        Args:
            fn: the transaction's body.
            wait_s: longest wait for the writer lock; None: ``lock_timeout_s``; 0: only if free now
                (bookkeeping on the read path never waits behind a writer).

        Raises:
            LockTimeout: another live process held the writer lock all that time.
            WarmTierUnavailable: the index cannot be written (read-only, disk full, I/O error, its
                files were replaced under this process).
            CorruptState: the data file was truncated.
            CapacityError: the map would have to grow past ``map_max``.
        """
        if self.readonly:
            raise WarmTierUnavailable(f"warm tier index {self.path} is open read-only")
        try:
            self.owners.acquire_writer(self.lock_timeout_s if wait_s is None else wait_s)
            self._shared.check_files()
            result = self._write_locked(fn)
        finally:
            self.owners.release_writer()
        self.writes += 1
        if self.writes % 1024 == 0:
            # A reader killed mid-transaction pins old pages until cleared; clear now and then.
            self.reader_check()
        return result

    def _write_locked(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        # Entered only now, with the writer lock held: waiting for that lock keeps no remap or fork
        # (and so no reader) waiting.
        gate = self._shared.gate
        gate.enter()
        try:
            return self._write_entered(fn, gate)
        finally:
            gate.leave()

    def _write_entered(self, fn: Callable[[lmdb.Transaction], T], gate: _TxnGate) -> T:
        while True:
            try:
                txn = self.env.begin(write=True)
            except lmdb.MapResizedError:
                gate.remap(lambda: self.env.set_mapsize(0))
                continue
            except lmdb.Error as exc:
                raise _unavailable(self.path, exc) from exc
            try:
                result = fn(txn)
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                gate.remap(self._grow)
                continue
            except lmdb.MapResizedError:
                txn.abort()
                gate.remap(lambda: self.env.set_mapsize(0))
                continue
            except lmdb.Error as exc:
                txn.abort()
                raise _unavailable(self.path, exc) from exc
            except BaseException:
                txn.abort()
                raise
            if self._extra_sync:
                self.env.sync(True)
            return result

    def sync_meta(self) -> None:
        """Make the last commit durable, meta page included (``sync="data"`` commits leave it to the next
        commit's fsync)."""
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise _unavailable(self.path, exc) from exc

    def _grow(self) -> None:
        current = self.env.info()["map_size"]
        if current >= self.map_max:
            raise CapacityError(f"the warm tier index {self.path} is full at its map limit of "
                                f"{current} bytes; open the tier with a larger map_max_bytes "
                                f"(long-lived readers pin pages: check for stuck processes)")
        self.env.set_mapsize(min(self.map_max, current * 2))

    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def quiesce(self, timeout_s: float) -> bool:
        """Before ``fork``: wait (at most ``timeout_s``) until no transaction of this process is open
        on the environment and hold new ones off until ``resume``. Returns whether it got there."""
        return self._shared.gate.acquire_exclusive(timeout_s)

    def resume(self) -> None:
        self._shared.gate.release_exclusive()


_SYNC_RANK = {"none": 0, "data": 1, "full": 2}


class _SharedEnv:
    """The one LMDB environment of a path in this process (LMDB allows only one per process), with
    this process's registration in the tier's owner registry."""

    def __init__(self, path: str, *, sync: str, map_size: int, readonly: bool, lock_timeout_s: float):
        self.path = path
        self.sync = sync
        self.readonly = readonly
        self.refs = 0
        self.pid = os.getpid()
        self.closed = False
        self.broken: str | None = None
        self.gate = _TxnGate()
        # check_size compares against the largest size seen: two threads' fstat results must not
        # interleave (an older, smaller one would read as a truncation).
        self._size_lock = threading.Lock()
        forksafe.register(self)  # unlocked in a forked child (which never uses this environment)
        problem = data_file_problem(path, exact=True)
        if problem is not None and problem != "missing":
            raise CorruptState(f"the warm tier index {path}/data.mdb is {problem}; run `tieredkv verify "
                               f"--repair {os.path.dirname(path)}` to rebuild it")
        if problem == "missing" and readonly:
            raise WarmTierUnavailable(f"the warm tier index {path} has no data.mdb (opened read-only)")
        self.owners = Owners(os.path.dirname(path), writable=not readonly)
        try:
            if self.owners.registry_lost(path):
                raise WarmTierUnavailable(
                    f"{self.owners.path} was deleted or replaced while processes have the warm tier open: "
                    f"they are not in this registry, so their claims would look dead and be reaped under "
                    f"them; stop every process using this tier, then reopen it")
            self.owners.hold_presence()
            try:
                if not readonly:
                    # open_db may run a write transaction: bounded like every other write.
                    self.owners.acquire_writer(lock_timeout_s)
                before = files_identity(path)
                self._open_env(path, sync, map_size, readonly)
                self.identity = files_identity(path)
                if any(b and b != a for b, a in zip(before[1:], self.identity[1:])):
                    # Replaced while LMDB opened them: we cannot tell which ones it holds.
                    raise WarmTierUnavailable(f"the warm tier index files in {path} were replaced while "
                                              f"this process opened them; open the tier again")
                if not readonly:
                    self.owners.register(self.identity)
                    self._check_peers()
            finally:
                self.owners.release_writer()
            self._data_fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
            self._seen_size = os.fstat(self._data_fd).st_size
            self._checks = 0
            self._dir_stamp: tuple[int, int, int] | None = None
        except BaseException as exc:
            if getattr(self, "env", None) is not None:
                self.env.close()
            self.owners.close()
            if isinstance(exc, lmdb.Error):  # a full disk, an I/O error: the tier's state, not a bug
                raise _unavailable(path, exc) from exc
            raise

    def _open_env(self, path: str, sync: str, map_size: int, readonly: bool) -> None:
        kwargs: dict[str, Any] = dict(subdir=True, map_size=int(map_size), max_dbs=8, mode=0o600, readahead=False,
                      meminit=False, max_readers=510, sync=sync != "none", metasync=sync == "full",
                      readonly=readonly, create=not readonly)
        try:
            self.env = lmdb.open(path, **kwargs)
        except lmdb.Error as exc:
            if not readonly or _lmdb_errno(path, exc) not in NOT_WRITABLE:
                raise
            # A read-only directory: the lock file cannot be opened for writing. Read without the
            # reader table; safe only because nobody can write here either.
            self.env = lmdb.open(path, lock=False, **kwargs)
        self.dbs = tuple(self.env.open_db(name, create=not readonly)
                         for name in (DB_BLOCKS, DB_SLOTS, DB_FREE, DB_INFLIGHT, DB_INFO))

    def _check_peers(self) -> None:
        """Refuse when a live owner uses other lock.mdb / data.mdb files than the ones at the path."""
        for owner, ident in self.owners.others():
            if ident != self.identity:
                raise WarmTierUnavailable(
                    f"{self.path}: a live process (owner {owner} in {self.owners.path}) has other index "
                    f"files open than the ones now at this path: lock.mdb or data.mdb was deleted or "
                    f"replaced while it ran. Two LMDB lock tables would let two writers commit at once; "
                    f"stop every process using this tier, then reopen it")

    def check_size(self) -> None:
        """Raise instead of touching a truncated data file (SIGBUS). Marks the environment broken."""
        with self._size_lock:
            self._check_size_locked()

    def _check_size_locked(self) -> None:
        if self.broken is None:
            size = os.fstat(self._data_fd).st_size
            self._checks += 1
            # LMDB (without writemap) never shrinks data.mdb: a file smaller than we saw was truncated.
            # A file of the size we last checked against its meta pages still holds every page they
            # reference (referenced pages are written, and writing past the end grows the file), so
            # the meta pages are read again only when the size changed, and now and then in case the
            # file was grown by others and cut back to exactly the size we saw.
            problem: str | None
            if size < self._seen_size:
                problem = f"truncated: {size} bytes, it had {self._seen_size}"
            elif size != self._seen_size or self._checks % 64 == 0:
                problem = data_file_problem(self.path, self._data_fd)
            else:
                problem = None
            self._seen_size = max(self._seen_size, size)
            if problem is not None:
                self.broken = (f"the warm tier index {self.path}/data.mdb was {problem} while this process "
                               f"had it open; its records are lost: run `tieredkv verify --repair "
                               f"{os.path.dirname(self.path)}` after stopping the workers")
        if self.broken is not None:
            raise CorruptState(self.broken)

    def check_files(self) -> None:
        """Before a write: the index files at the path are still ours, and not truncated."""
        self.check_size()
        # Replacing or deleting a file changes its directory's mtime, and LMDB itself creates no file
        # after open: an unchanged directory (one stat) means unchanged files (two more).
        st = os.stat(self.path)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        if stamp == self._dir_stamp:
            return
        now = files_identity(self.path)
        if now == self.identity:
            self._dir_stamp = stamp
        else:
            raise WarmTierUnavailable(
                f"the warm tier index files in {self.path} were deleted or replaced while this process had "
                f"them open (lock.mdb/data.mdb inodes {self.identity[1:]} -> {now[1:]}); this process "
                f"stops writing so that two LMDB lock tables never hold two writers: restart the workers")

    def close(self) -> None:
        self.closed = True
        self.env.close()
        self.owners.close()
        self.close_data_fd()

    def close_data_fd(self) -> None:
        fd, self._data_fd = self._data_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


#: (pid, realpath) -> the environment shared by every handle of this process. Keyed by pid so a
#: forked child never reuses its parent's environment.
_ENVS: dict[tuple[int, str], _SharedEnv] = {}


def _drop_inherited_registrations() -> None:
    # A forked child holds the parent's registry lock through the inherited descriptor: drop it at
    # once, or a child that never touches the tier keeps a dead parent's claims looking alive.
    for shared in list(_ENVS.values()):
        if shared.pid != os.getpid():
            shared.owners.drop_inherited()


os.register_at_fork(after_in_child=_drop_inherited_registrations)


#: errno values that say this process may not write a file: its mode (EACCES), an immutable file or a
#: security module (EPERM, root's writes included), a read-only mount (EROFS).
NOT_WRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: errno values of a full disk, or of a full quota.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def refuses_writes(exc: BaseException) -> bool:
    """Whether ``exc``, raised opening or writing the index, says this process may not write its files:
    py-lmdb's ``ReadonlyError`` (EACCES, or LMDB's own read-only code), or an error that carries one of
    ``NOT_WRITABLE`` (an ``OSError``; a ``WarmTierUnavailable`` from ``_unavailable`` or the owner
    registry)."""
    return isinstance(exc, lmdb.ReadonlyError) or getattr(exc, "errno", None) in NOT_WRITABLE


def _lmdb_errno(path: str, exc: lmdb.Error) -> int | None:
    """The errno behind ``exc`` (an LMDB failure on the index at ``path``), or None if none is known.

    py-lmdb raises a class of its own for EACCES (``ReadonlyError``) and ENOSPC (``DiskError``), and a
    bare ``lmdb.Error`` carrying only a message for every other errno. For those the files are asked
    instead: a read-only mount is EROFS; an index file that ``access`` says may not be written (or, for
    one still to be made, its directory) is EPERM: a mode that forbids it would have been EACCES, a
    ``ReadonlyError``. Asked, not opened: closing a descriptor of lock.mdb would drop this process's
    POSIX locks on it, which LMDB holds.
    """
    if isinstance(exc, lmdb.ReadonlyError):
        return errno.EACCES
    if isinstance(exc, lmdb.DiskError):
        return errno.ENOSPC
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return errno.EROFS
    except OSError:
        return None
    for name in ("lock.mdb", "data.mdb"):
        file = os.path.join(path, name)
        if not os.access(file if os.path.exists(file) else path, os.W_OK):
            return errno.EPERM
    return None


def _unavailable(path: str, exc: lmdb.Error) -> WarmTierUnavailable:
    code = _lmdb_errno(path, exc)
    if code in NOT_WRITABLE:
        why = "the index is read-only here"
    elif code in DISK_FULL:
        why = "the disk is full"
    else:
        why = "LMDB error"
    return WarmTierUnavailable(f"cannot write the warm tier index {path}: {why} ({exc})", errno=code)


# ---- small helpers over a transaction ------------------------------------------------------------
def get_u64(txn: lmdb.Transaction, db, name: bytes, default: int = 0) -> int:
    raw = txn.get(name, db=db)
    return U64.unpack(raw)[0] if raw is not None else default


def put_u64(txn: lmdb.Transaction, db, name: bytes, value: int) -> None:
    txn.put(name, U64.pack(int(value)), db=db)


def init_info(txn: lmdb.Transaction, index: Index, n_slots: int, meta_bytes: bytes) -> None:
    """Fill a new (or emptied) index's ``info``: slot count, high-water mark, gen, the meta copy."""
    # A half-made earlier attempt may have left an index: keep what it holds.
    if txn.get(INFO_N_SLOTS, db=index.info) is None:
        put_u64(txn, index.info, INFO_N_SLOTS, n_slots)
        put_u64(txn, index.info, INFO_HWM, 0)
        put_u64(txn, index.info, INFO_GEN, 0)
    txn.put(INFO_META, meta_bytes, db=index.info)
