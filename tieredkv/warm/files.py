"""A warm tier's directory on disk: create it, check who owns it, lock it, repair its slabs.

``WarmTier`` (at open) and ``tieredkv verify --repair`` (offline) both go through these functions, so
an offline repair restores exactly what opening the tier would, with the same fallbacks (a filesystem
without ``fallocate`` gets a sparse file in both), under the same lock, after the same ownership
checks::

    <root>/<namespace>/          0700, owned by the user of the cache
        meta.json                written last at creation: its presence means the rest is complete
        slab-0000.bin ...        preallocated slot files (slabs.py)
        index.lmdb/              the LMDB index (index.py)
        lock                     flock'd while a process creates or repairs the tier
        owners                   who has the tier open, and the writer lock (owners.py)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import shutil
import stat
import time
import warnings
from collections.abc import Iterator
from typing import Any

from tieredkv.errors import (
    CapacityError,
    CorruptState,
    FormatError,
    InvalidInput,
    LockTimeout,
    PermissionDenied,
    TieredKVError,
    WarmTierUnavailable,
)
from tieredkv.keys import KEY_BYTES
from tieredkv.spec import KVSpec
from tieredkv.warm import index as ix
from tieredkv.warm import meta as mt
from tieredkv.warm.owners import OWNERS_NAME, Owners
from tieredkv.warm.slabs import Slabs, slab_name, slot_bytes_for


def make_dir(root: str | os.PathLike, path: str | os.PathLike) -> None:
    """Create ``root`` and the tier directory ``path`` (0700, whatever the umask) if missing.

    Raises:
        WarmTierUnavailable: the directory cannot be created and does not exist.
    """
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        if not os.path.lexists(path):  # a (dangling) symlink is refused by check_access, never created through
            os.mkdir(path, mode=0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass  # another process made it meanwhile
    except OSError as exc:
        if not os.path.isdir(path):
            raise WarmTierUnavailable(f"cannot create the warm tier directory {path}: {exc}") from exc


def check_access(path: str) -> None:
    """Refuse a tier directory that is a symlink, or that another user owns, or files in it that
    another user owns, or symbolic links in it; restrict modes wider than 0700 / 0600 (with a warning).

    The directory being ours is not enough: a file planted in it (while its mode was wider, or by a
    bind mount) would let another user read the prompts we write or feed us KV of their choosing, and
    a symlink would redirect our writes anywhere we may write. The tier directory itself is never
    followed as a link: in a root others can write to, a link planted under our namespace's name
    would send this process's files wherever its owner likes.

    Raises:
        WarmTierUnavailable: there is no directory at ``path``.
        PermissionDenied: the directory is a symlink, or it or an entry in it (or in ``index.lmdb/``) is
            not this user's, or a mode open to others cannot be restricted.
        FormatError: an entry is neither a regular file nor a directory (a FIFO, socket or device).
    """
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise WarmTierUnavailable(f"no warm tier at {path} (opened read-only, nothing to create)") from None
    if stat.S_ISLNK(st.st_mode):
        raise PermissionDenied(f"the warm tier directory {path} is a symbolic link (to {os.readlink(path)!r}); "
                               f"tieredkv never follows one. Remove it, or pass the real directory as warm_dir")
    if not stat.S_ISDIR(st.st_mode):
        raise WarmTierUnavailable(f"{path} is not a directory; remove it or use another warm_dir")
    if st.st_uid != me:
        raise PermissionDenied(f"the warm tier directory {path} belongs to uid {st.st_uid}, not to this "
                               f"process (uid {me}); a KV cache holds users' prompts, so tieredkv does not "
                               f"share one across users")
    wide = [path] if st.st_mode & 0o077 else []
    for where in (path, os.path.join(path, mt.INDEX_NAME)):
        try:
            entries = list(os.scandir(where))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            est = entry.stat(follow_symlinks=False)
            if entry.is_symlink() or est.st_uid != me:
                what = "is a symbolic link" if entry.is_symlink() else f"belongs to uid {est.st_uid}"
                raise PermissionDenied(f"{entry.path} {what}, not a file of this user (uid {me}); remove "
                                       f"it, or use a warm directory only this user writes to")
            if not (stat.S_ISREG(est.st_mode) or stat.S_ISDIR(est.st_mode)):
                # A FIFO under a slab's name would hang the first read of it; a device, worse.
                raise FormatError(f"{entry.path} is not a regular file (mode {stat.filemode(est.st_mode)}); "
                                  "remove it")
            if est.st_mode & 0o077:
                wide.append(entry.path)
    if wide:
        _restrict_modes(path, wide)


def _restrict_modes(path: str, wide: list[str]) -> None:
    """Take group/other permissions off the tier's directory and files (0700 / 0600), warning.

    A world-writable tier directory lets another user swap files in; a world-readable slab hands out
    users' prompts. Ours to fix (we own them), so fixed rather than refused.
    """
    for p in wide:
        try:
            os.chmod(p, 0o700 if stat.S_ISDIR(os.lstat(p).st_mode) else 0o600)
        except OSError as exc:
            raise PermissionDenied(f"{p} is open to other users (mode {oct(os.lstat(p).st_mode & 0o777)}) and "
                                   f"cannot be restricted ({exc}); chmod it 0600 (files) / 0700 (directories)") from exc
    warnings.warn(f"warm tier {path}: {len(wide)} path(s) were open to other users "
                  f"({', '.join(os.path.basename(p) or p for p in wide[:5])}{', ...' if len(wide) > 5 else ''}); "
                  f"restricted them to this user (0700/0600). Blocks another user may have changed fail their "
                  f"checksums (verify='always')", stacklevel=5)


@contextlib.contextmanager
def init_lock(path: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the tier's ``lock`` file (flock, freed by the kernel if we die) while creating or repairing.

    A read-only directory without a lock file cannot be created or repaired by anyone: no lock needed.

    Args:
        path: the tier directory.
        timeout_s: longest wait for a holder that is alive but stopped (SIGSTOP, a debugger) inside
            its open; None waits as long as it takes (an operator's ``verify --repair``).

    Raises:
        LockTimeout: a live process held the lock for ``timeout_s``.
    """
    lock_path = os.path.join(path, mt.LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            yield
            return
    try:
        if timeout_s is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            _flock_within(fd, lock_path, timeout_s)
        yield
    finally:
        os.close(fd)  # releases the flock


def _flock_within(fd: int, lock_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if time.monotonic() > deadline:
            raise LockTimeout(f"{lock_path} is still held by a live process after {timeout_s:.1f} s: a "
                              f"process opening or repairing the warm tier may be stopped (SIGSTOP)")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def index_sizes(n_slots: int, record_bytes: int, map_size: int | None = None,
                map_max: int | None = None) -> tuple[int, int]:
    """Initial and largest LMDB map size for ``n_slots`` records of ``record_bytes`` (defaults)."""
    # Per block: the record, the reverse map, a free-list entry, B-tree overhead: ~3x is ample.
    per_block = 3 * (record_bytes + 3 * KEY_BYTES + 64)
    size = map_size or max(16 << 20, n_slots * per_block)
    return size, map_max or max(size * 16, 1 << 30)


def open_index(path: str, *, write: bool = False) -> ix.Index:
    """Open a tier's index from a tool (``verify``, ``ls``, the metrics exporter, test checks).

    A tiny initial map (LMDB adopts the file's real size) and read-only unless ``write``: looking
    must neither grow the index nor hold the writers' lock. ``write`` (``verify --repair``) syncs
    every commit.
    """
    return ix.Index(os.path.join(path, mt.INDEX_NAME), sync="full" if write else "none",
                    map_size=1 << 20, map_max=1 << 40, readonly=not write)


def block_count(index: ix.Index) -> int:
    """Blocks stored in the tier now (one read transaction)."""
    return int(index.read(lambda txn: txn.stat(index.blocks)["entries"]))


def corrupt_total(index: ix.Index) -> int:
    """Blocks found corrupt and dropped over the tier's life (the index's counter)."""
    return int(index.read(lambda txn: ix.get_u64(txn, index.info, ix.INFO_CORRUPT)))


def slot_bytes_of(spec: KVSpec, slot_fraction: float) -> int:
    """The slot size of a new tier: ``slot_fraction`` of a block rounded up to 4 KiB, at most a full slot."""
    return min(slot_bytes_for(math.ceil(spec.block_bytes * slot_fraction)), slot_bytes_for(spec.block_bytes))


def create(path: str, spec: KVSpec, capacity_bytes: int | None, slab_bytes: int,
           map_size: int | None = None, map_max: int | None = None, slot_fraction: float = 1.0) -> dict[str, Any]:
    """Create a tier in the (existing, locked) directory ``path``: slabs, index, then ``meta.json``.

    ``slot_fraction`` below 1 makes a compact tier: slots of that share of a block (rounded up to
    4 KiB), so the same ``capacity_bytes`` holds ``1 / slot_fraction`` times as many of them and every
    block is stored as a compressed frame (``tieredkv.warm.packed``). A fraction whose rounding reaches
    a full slot makes an ordinary tier.

    Safe to rerun after a crash part-way: existing slabs and index contents are kept.

    Returns:
        The new tier's meta document.

    Raises:
        InvalidInput: no or too small ``capacity_bytes``.
        CapacityError: the disk cannot hold the slabs or the index. Whatever failed, the files this
            call made are removed again.
        WarmTierUnavailable: another OS error while creating.
    """
    if capacity_bytes is None:
        raise InvalidInput(f"no warm tier at {path} yet: pass capacity_bytes to create one")
    slot_bytes = slot_bytes_of(spec, slot_fraction)
    n_slots = int(capacity_bytes) // slot_bytes
    if n_slots < 1:
        raise InvalidInput(f"capacity_bytes={capacity_bytes} holds no slot of {slot_bytes} bytes")
    if n_slots >= 2**32:
        raise InvalidInput(f"capacity_bytes={capacity_bytes} makes {n_slots} slots; at most 2**32-1")
    per_slab = max(1, min(n_slots, int(slab_bytes) // slot_bytes))
    meta = mt.make_meta(spec, n_slots=n_slots, slots_per_slab=per_slab, slot_bytes=slot_bytes)
    index_path = os.path.join(path, mt.INDEX_NAME)
    made_index = not os.path.lexists(index_path)
    made_slabs: list[int] = []
    try:
        made_slabs = Slabs(path, n_slots, per_slab, slot_bytes, spec.block_bytes).create_missing()
        os.makedirs(index_path, mode=0o700, exist_ok=True)
        size, limit = index_sizes(n_slots, ix.record_dtype(spec.chunk_tokens).itemsize, map_size, map_max)
        index = ix.Index(index_path, sync="full", map_size=size, map_max=limit)
        try:
            index.write(lambda txn: ix.init_info(txn, index, n_slots, mt.encode_meta(meta)))
        finally:
            index.close()
        mt.write_meta(path, meta)  # last: its presence means slabs and index are complete
    except BaseException as exc:
        # Leave nothing behind: a half-made tier on a full disk would hold the space a retry needs (and a
        # sparse leftover on tmpfs turns into SIGBUS when touched).
        for i in made_slabs:
            _unlink_quiet(os.path.join(path, slab_name(i)))
        if made_index:
            shutil.rmtree(index_path, ignore_errors=True)
            _unlink_quiet(os.path.join(path, OWNERS_NAME))
        err = _disk_error(path, exc)
        if err is exc:
            raise
        raise err from exc
    return meta


def _disk_error(path: str, exc: BaseException) -> BaseException:
    """A creation failure as a tieredkv error: a full disk is a ``CapacityError``, other OS errors a
    ``WarmTierUnavailable``; anything else (tieredkv errors, KeyboardInterrupt) as it is."""
    if isinstance(exc, OSError) and not isinstance(exc, TieredKVError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return CapacityError(f"cannot create the warm tier in {path}: the disk is full ({exc}); free "
                                 f"space or pass a smaller capacity_bytes")
        return WarmTierUnavailable(f"cannot create the warm tier in {path}: {exc}")
    if isinstance(exc, WarmTierUnavailable) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"cannot create the warm tier in {path}: {exc}; free space or pass a smaller "
                             f"capacity_bytes")
    return exc


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def index_state(path: str) -> str:
    """State of a tier's index files, judged without letting LMDB touch a page.

    Returns:
        ``"ok"``, ``"missing"``, ``"empty"`` (no slot count and no record: deleted and recreated, or
        emptied), ``"truncated: <sizes>"`` or ``"damaged: <why>"``.
    """
    index_dir = os.path.join(path, mt.INDEX_NAME)
    problem = ix.data_file_problem(index_dir, exact=True) if os.path.isdir(index_dir) else "missing"
    if problem is not None:
        return problem
    if os.path.getsize(os.path.join(index_dir, "data.mdb")) == 0:
        return "empty"
    index = open_index(path)
    try:
        empty = index.read(lambda txn: ix.get_u64(txn, index.info, ix.INFO_N_SLOTS) == 0
                           and txn.stat(index.blocks)["entries"] == 0)
    finally:
        index.close()
    return "empty" if empty else "ok"


def rebuild_index(path: str, meta: dict[str, Any]) -> None:
    """Replace a lost, emptied or truncated index with an empty one made from ``meta`` (under
    ``init_lock``). Every slot is free afterwards: the blocks the old index named are lost.

    Refused while any process has the tier open: it may still hold the old index, and two indexes over
    one set of slabs would hand one slot to two blocks.

    Raises:
        CorruptState: live processes have the tier open.
    """
    registry = Owners(path, writable=False)
    try:
        others = registry.others()
    finally:
        registry.close()
    if others:
        raise CorruptState(f"{len(others)} process(es) have the warm tier {path} open; stop them, then run "
                           f"`tieredkv verify --repair` again to rebuild its index")
    index_dir = os.path.join(path, mt.INDEX_NAME)
    shutil.rmtree(index_dir, ignore_errors=True)
    os.makedirs(index_dir, mode=0o700, exist_ok=True)
    index = open_index(path, write=True)
    try:
        index.write(lambda txn: ix.init_info(txn, index, meta["n_slots"], mt.encode_meta(meta)))
    finally:
        index.close()


def slabs_of(path: str, meta: dict[str, Any], *, readonly: bool = False) -> Slabs:
    """The ``Slabs`` of the tier at ``path`` described by ``meta`` (not opened yet)."""
    return Slabs(path, int(meta["n_slots"]), int(meta["slots_per_slab"]), int(meta["slot_bytes"]),
                 int(meta["block_bytes"]), readonly=readonly)


def repair_slabs(index: ix.Index, slabs: Slabs) -> tuple[dict[int, tuple[str, int]], int]:
    """A missing or truncated slab: drop the records whose bytes are gone, then restore the file.

    Run under ``init_lock``; the drop is one write transaction, so two processes repairing at once
    repair once. Blocks in the intact part of a truncated slab are kept. The dropped blocks are added
    to the index's lifetime corrupt counter.

    A missing slab is not recreated while other processes have the tier open: they still read and
    write the deleted file through their descriptors (so their blocks stay right), and a new file
    beside it would split the tier in two, each side's records pointing at the other's bytes.

    Returns:
        ``(damaged, dropped)``: ``{slab: ("missing" | "truncated", size)}`` as found, and how many
        records were dropped.

    Raises:
        CorruptState: a slab is missing while other processes have the tier open.
    """
    damaged = slabs.damaged()
    if not damaged:
        return damaged, 0
    missing = sorted(i for i, (what, _) in damaged.items() if what == "missing")
    if missing:
        live = index.owners.others()
        if live:
            raise CorruptState(f"slab(s) {missing} of the warm tier {slabs.directory} were deleted while "
                               f"{len(live)} process(es) have it open (they still use the deleted files); "
                               f"stop them, then open the tier again to repair it")
    per, block_bytes, slot_bytes = slabs.slots_per_slab, slabs.block_bytes, slabs.slot_bytes

    def purge(txn):
        dropped = 0
        for slab, (_, size) in damaged.items():
            # Slots whose payload extends past the end of the file lost their bytes.
            intact = (size - block_bytes) // slot_bytes + 1 if size >= block_bytes else 0
            lo = slab * per + intact
            hi = min(slabs.n_slots, (slab + 1) * per)
            cur = txn.cursor(db=index.slots)
            if not cur.set_range(ix.slot_key(lo)):
                continue
            victims = []
            for sk, key in cur:
                if ix.SLOT_KEY.unpack(sk)[0] >= hi:
                    break
                victims.append((sk, key))
            for sk, key in victims:
                txn.delete(sk, db=index.slots)
                txn.delete(key, db=index.blocks)
                txn.put(sk, b"", db=index.free)
            dropped += len(victims)
        corrupt = ix.get_u64(txn, index.info, ix.INFO_CORRUPT) + dropped
        ix.put_u64(txn, index.info, ix.INFO_CORRUPT, corrupt)
        return dropped

    dropped = index.write(purge)
    for slab in damaged:
        slabs.restore_size(slab)
    return damaged, dropped


def warn_repaired(path: str, damaged: dict[int, tuple[str, int]], dropped: int, stacklevel: int) -> None:
    """Tell the user what ``repair_slabs`` did when a tier was opened."""
    warnings.warn(f"warm tier {path}: slab(s) {sorted(damaged)} were {sorted({v[0] for v in damaged.values()})}; "
                  f"dropped {dropped} block(s) whose bytes were lost and restored the files",
                  stacklevel=stacklevel)
