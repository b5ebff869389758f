"""A registered handle on a hot segment: create or attach, register as an owner, notice a fork or an
unlink and reattach, close.

Each open handle holds one row of the segment's owner registry, and that row's byte-range lock for
as long as it lives: the lock is how other processes tell a live owner from a dead one (hot/recovery.py
reclaims a dead owner's claims and pins). A handle whose registration fails never touches anybody's
row, and a segment that an open created but cannot use is unlinked again.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import secrets
import time
import warnings
import weakref

import numpy as np
import posix_ipc

from tieredkv import counters, policies
from tieredkv.errors import CorruptState, FormatError, InvalidInput
from tieredkv.hot import batch, locks
from tieredkv.hot import segment as seg
from tieredkv.hot.index import HotIndex
from tieredkv.hot.recovery import Recovery
from tieredkv.hot.segment import STAT_FIELDS

# Open handles of this process. A forked child inherits their descriptors, and with them the open
# file descriptions that hold the owners' registry locks: a child that never touches the tier would
# keep a dead parent looking alive (its WRITING slots and pins never reclaimed). So the child drops
# its copies at once; a handle it does use reattaches with a descriptor of its own (see _check).
_HANDLES: weakref.WeakSet[SegmentHandle] = weakref.WeakSet()


def _drop_inherited_descriptors() -> None:
    for handle in list(_HANDLES):
        mapping = getattr(handle, "_map", None)
        if mapping is not None and mapping.fd >= 0:
            try:
                os.close(mapping.fd)  # the parent's descriptor, and so its locks, are untouched
            except OSError:
                pass
            mapping.fd = -1


os.register_at_fork(after_in_child=_drop_inherited_descriptors)


def _close_at_exit() -> None:
    """Close the handles a process left open when it exits normally, while the modules they use are
    still whole: left to ``__del__`` at interpreter teardown, the close found them half gone, warned
    and left the owner's row for others to reclaim as a dead process's. Registered at import, so it
    runs after a ``TieredCache``'s own exit flush (atexit runs last-registered first), which still
    reads queued blocks out of the segment. A handle that cannot close (a daemon thread of the caller's
    still reading through it) is left as before, to the kernel: exiting closes its descriptor."""
    for handle in list(_HANDLES):
        if not handle._closed and handle._pid == os.getpid():
            try:
                handle.close()
            except Exception:  # the process is exiting: nothing to report it to, and the others go on
                pass


atexit.register(_close_at_exit)


def public(method):
    """Decorator for a handle's public calls: refuse a closed handle, reattach after a fork or an
    unlink (``_check``), and count the call while it runs.

    Threads share a handle (a cache's caller and its write-behind writer), and a reattach swaps the
    mapping, the descriptor and every view under whatever else runs on the handle: it would free the
    slots another thread's ``put_many`` is filling (another process could take them, and then read
    that thread's bytes under its own keys) and drop the pins of another thread's read. So a reattach
    waits for a call that finds no other call of the handle in flight; until then the handle serves
    from the old mapping, still valid memory, as it does before its once-a-second check notices.
    """

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._calls_lock:
            self._check()
            self._calls += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._calls_lock:
                self._calls = max(self._calls - 1, 0)

    return call


class _Unpublished(Exception):
    """The segment was unlinked between attaching and registering; the open starts over."""


class SegmentHandle(Recovery):
    """Opening, registering, reattaching and closing; ``HotTier`` adds the block calls."""

    _args: dict  # what the handle was opened with: a reattach opens again with the same

    # ---- open / close ----------------------------------------------------------------------------
    def _open(self, **args) -> None:
        for _ in range(8):
            try:
                return self._open_once(**args)
            except _Unpublished:
                continue  # removed between attach and registration: attach (or create) again
        raise FormatError(f"segment {self.name} keeps being removed while this handle opens it; is an "
                          "operator running `tieredkv rm` in a loop?")

    def _open_once(self, capacity_bytes, n_slots, policy, mode, create) -> None:
        spec = self.spec
        if policy is not None and not isinstance(policy, str):
            raise InvalidInput("policy must be a registered policy name, e.g. 'lru'")
        try:
            engine = policies.make(policy or "lru")
        except KeyError as e:  # UnknownPolicy: its message lists the valid names
            raise InvalidInput(str(e)) from None
        # The full spec ("prefix_aware:arc", not "prefix_aware") is recorded and compared: two
        # policies with one name keep different state, and a wrapper's base changes every decision.
        wanted = engine.full_name()
        if len(wanted.encode()) > seg.POLICY_BYTES:
            raise InvalidInput(f"policy {policy!r} names a policy spec longer than {seg.POLICY_BYTES} bytes; "
                               "register it under a shorter name")
        if create and capacity_bytes is None and n_slots is None:
            self._map, self.created = self._attach(mode, "; give capacity_bytes (or n_slots) to create it"), False
        elif create:
            sized_by_bytes = n_slots is None
            if sized_by_bytes:
                n_slots = seg.Layout.slots_for(
                    spec, int(capacity_bytes), lambda n: policies.StateLayout.for_policy(engine, n).nbytes)
            state_bytes = policies.StateLayout.for_policy(engine, int(n_slots)).nbytes
            layout = seg.Layout.compute(spec, int(n_slots), state_bytes)
            if sized_by_bytes and layout.total_bytes > capacity_bytes:
                raise InvalidInput(f"capacity_bytes={capacity_bytes} cannot hold one {spec.block_bytes}-byte block "
                                   f"and the segment's metadata ({layout.total_bytes} bytes needed)")
            self._map, self.created = seg.create_or_attach(spec, self.name, layout, wanted, mode,
                                                           lambda m: self._init_segment(m, engine))
        else:
            self._map, self.created = self._attach(mode, "; create=False only attaches: pass create=True and a "
                                                         "capacity_bytes to create it"), False
        made_inode = os.fstat(self._map.fd).st_ino if self.created else None
        try:
            self._adopt(policy, wanted)
        except BaseException:
            # A segment this call created and cannot use must not stay in /dev/shm for others to trip on.
            if made_inode is not None:
                seg.unlink_if_same(self.name, made_inode)
            raise

    def _attach(self, mode: int, how_to_create: str) -> seg.Mapping:
        try:
            return seg.attach(self.spec, self.name, mode=mode)
        except posix_ipc.ExistentialError:
            raise InvalidInput(f"segment {self.name} does not exist{how_to_create}") from None

    def _adopt(self, policy: str | None, wanted: str) -> None:
        """Check the segment's policy, build the views and register this handle."""
        recorded = self._map.header["policy"].decode()
        try:
            self._policy = policies.make(recorded)
        except KeyError:
            self._map.close()
            raise FormatError(f"segment {self.name} names an eviction policy this tieredkv does not know "
                              f"({recorded!r}); remove it with `tieredkv rm {self.name}`") from None
        if policy is not None and self._policy.full_name() != wanted:
            self._map.close()
            used = self._policy.full_name()
            raise InvalidInput(f"segment {self.name} uses eviction policy {used!r}, not {wanted!r}; open it "
                               f"with the same policy (TieredCache: eviction={used!r}; HotTier: policy={used!r}, "
                               f"or policy=None for the segment's), or remove the segment (`tieredkv rm "
                               f"{self.name}`) to start over with {wanted!r}")
        self._h = h = self._map.header
        self._owners, self._slots, self._tokens, region, self._free, self._data = self._map.views()
        self._index = HotIndex(region, self._slots["key"], self.name)
        self._words = batch.slot_words(self._slots)
        self._pin_lists, self._n_pins = self._owners["pins"], self._owners["n_pins"]
        self.n_slots = int(h["n_slots"])
        self._state = policies.SlotState.over(self._policy, self.n_slots, self._map.mm, int(h["policy_off"]))
        if (ours := self._state.layout.nbytes) != int(h["policy_bytes"]):
            self._drop_mapping()
            # Either the header was damaged or another tieredkv version laid this policy's state out
            # differently (a rolling upgrade that changed the policy): either way not this code's to use.
            raise CorruptState(f"segment {self.name}: policy state size does not match the header "
                               f"({int(h['policy_bytes'])} bytes recorded, {ours} for "
                               f"{self._policy.full_name()!r} in this tieredkv version): damaged, or made by "
                               f"another version whose state for this policy differs; remove it with "
                               f"`tieredkv rm {self.name}` once no process uses it")
        self._fd = self._map.fd
        self._instance = int(h["instance"])
        self._inode = os.fstat(self._fd).st_ino
        self._pid = os.getpid()
        self._last_check = time.monotonic()
        self._closed = False
        self._owner, self._token = -1, 0
        self._stats = np.zeros(len(STAT_FIELDS), dtype=np.uint64)  # until registered
        self._claim_ids = itertools.count(1)  # tells one call's claims from another thread's
        self._retrying = False  # a block call runs again after a repair (see damage.survives_damage)
        self._register()
        _HANDLES.add(self)

    @staticmethod
    def _init_segment(mapping: seg.Mapping, engine) -> None:
        owners, slots, tokens, index, free, data = mapping.views()
        index[:] = 0  # every entry empty (hot/index.py)
        n = len(slots)
        free[:] = np.arange(n - 1, -1, -1)  # pop from the end: slot 0 first
        mapping.header["free_top"] = n
        policies.SlotState.over(engine, n, mapping.mm, int(mapping.header["policy_off"])).reset()
        del owners, slots, tokens, index, free, data

    def _register(self) -> None:
        """Take a free owner registry byte for this handle's lifetime and record who we are."""
        def take_a_row() -> int:
            for i in range(seg.MAX_OWNERS):
                if locks.try_lock(self._fd, locks.REGISTRY_BASE + i):
                    if not self._still_published():
                        # `rm --stale` judged the segment unused and unlinked it between our attach
                        # and this registration (it judges under this same lock): attach afresh.
                        locks.unlock(self._fd, locks.REGISTRY_BASE + i)
                        return i
                    if self._owners[i]["token"]:
                        self._reclaim_owner(i)  # its previous holder died without closing
                    self._owner = i
                    self._token = secrets.randbits(63) | 1
                    rec = self._owners[i]
                    rec["token"] = self._token
                    rec["pid"] = self._pid
                    rec["n_pins"] = 0
                    self._stats = rec["stats"]
                    self.counters = counters.CacheCounters(rec, self._owners)
                    return i
            return -1

        i = self._locked(take_a_row)
        if self._owner >= 0:
            return
        self._drop_mapping()  # never registered: close() must not touch anybody's row
        if i < 0:
            raise InvalidInput(f"segment {self.name} already has {seg.MAX_OWNERS} open handles; close some")
        raise _Unpublished(self.name)

    def close(self) -> None:
        """Release this handle (idempotent). The segment stays; ``tieredkv rm`` removes it."""
        if self._closed:
            return
        try:
            if os.getpid() == self._pid:
                try:
                    def let_go() -> None:
                        self._release_pins()
                        # Slots a call of ours left WRITING (it raised mid-way) die with the handle.
                        self._reclaim_owner(self._owner)

                    self._locked(let_go)
                    locks.unlock(self._fd, locks.REGISTRY_BASE + self._owner)
                except Exception as e:  # closing must not raise on a broken segment
                    warnings.warn(f"tieredkv: closing {self.name}: {e}", RuntimeWarning, stacklevel=2)
        finally:
            # Even if interrupted above: closing the lock descriptor drops every lock this handle
            # holds (its registry byte included), so whatever it still held reads as a dead owner's.
            self._drop_mapping()

    def _drop_mapping(self) -> None:
        self._closed = True
        # Drop every view before closing the mmap: a view over a closed mapping would segfault. The
        # attributes are typed for an open handle; a closed one refuses every call (_check) first.
        self._owners = self._slots = self._tokens = self._free = self._data = None  # type: ignore[assignment]
        self._words = self._pin_lists = self._n_pins = None  # type: ignore[assignment]
        self._index = self._state = self._h = self._stats = self.counters = None  # type: ignore[assignment]
        self._map.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass

    def _check(self) -> None:
        """Run by every public call (``public``): refuse closed handles, reattach after fork or unlink."""
        if self._closed:
            raise InvalidInput(f"hot tier {self.name} is closed")
        if os.getpid() != self._pid:
            # A forked child shares the parent's open file description (and so its locks): it needs
            # its own. The parent still owns the registry entry, so don't deregister it. The calls
            # other threads had in flight at the fork do not exist here.
            self._calls = 0
            self._drop_mapping()
            self._open(**self._args)
            return
        now = time.monotonic()
        if now - self._last_check > 1.0 and not self._calls:
            self._last_check = now
            if not self._still_published():
                a = self._args
                attach_only = not a["create"] or (a["capacity_bytes"] is None and a["n_slots"] is None)
                if attach_only and not os.path.exists(seg._shm_path(self.name)):
                    # Removed and not (yet) recreated, and this handle cannot create it: keep serving
                    # from the old mapping (still valid memory) rather than closing for good; the
                    # next check reattaches once a creating process has made a new segment.
                    return
                warnings.warn(f"tieredkv: segment {self.name} was removed or replaced; reattaching",
                              RuntimeWarning, stacklevel=3)
                # This handle's close, not the tier's: ``before_close`` (the cache's write-behind
                # rescue) is for closing for good; run from here it could be the writer's own call,
                # waiting on the job it is inside. Blocks still queued for a lower level are then
                # read from the new segment: the ones it lacks are counted as dropped.
                SegmentHandle.close(self)
                self._open(**self._args)

    def _still_published(self) -> bool:
        try:
            return os.stat(seg._shm_path(self.name)).st_ino == self._inode
        except FileNotFoundError:
            return False
