"""HotTier: fixed-size block slots in one POSIX shared-memory segment that every worker maps.

Concurrency (docs/architecture.md, "Concurrency and crash invariants"), in one paragraph: metadata
(slot states, the index, the free stack, pins, policy state) changes only inside critical sections (see
``_enter``), under an OFD lock the kernel releases if its holder dies. Data is copied outside the lock:
a writer claims a slot (state WRITING, generation odd), fills it without the lock, and publishes it
(READY, generation even) under the lock. Readers never take the lock to *find* blocks; they read a
slot's generation, its key and state, use the data, and re-read the generation, so a block recycled or
torn meanwhile is a miss, never wrong bytes. ``get_many`` also pins the blocks it copies (pin count and
state checked in one critical section) so they cannot be evicted under it; pins are recorded per owner
so a dead reader's pins are reclaimed.

Crash recovery (invariant 6 there): the lock holder marks the header ``dirty`` on entry and clears it
on exit. A holder that finds ``dirty`` set knows the previous holder died inside a critical section and
scrubs: it rebuilds the index, the free stack, the pin counts and the policy's residency from the slot
table. A WRITING slot or a pin whose owner is dead is reclaimed by the next process that runs short of
space (owner = registry index + token; liveness = the owner's registry lock is held).

Interrupts (an exception from a signal handler can be raised between any two calls of the main
thread) leave nothing held: see ``_enter`` for the lock, ``_read_batch`` for pins and ``put_many`` for
claims. Damage to a derived structure is a miss plus a scrub (``_survives_damage``).
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import os
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import posix_ipc

from tieredkv import counters, forksafe, numa, policies
from tieredkv.errors import CorruptState, FormatError, InvalidInput, require_positive_int, require_positive_seconds
from tieredkv.hot import batch, locks
from tieredkv.hot import segment as seg
from tieredkv.hot.index import HotIndex
from tieredkv.hot.segment import FREE, READY, STAT_FIELDS, WRITING
from tieredkv.keys import ChunkKeys
from tieredkv.layout import address, as_block_bytes, copy_rows, run_rows, slot_runs
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats, check_count, check_keys, out_rows

_STAT = {name: i for i, name in enumerate(STAT_FIELDS)}

# Open handles of this process. A forked child inherits their descriptors, and with them the open
# file descriptions that hold the owners' registry locks: a child that never touches the tier would
# keep a dead parent looking alive (its WRITING slots and pins never reclaimed). So the child drops
# its copies at once; a handle it does use reattaches with a descriptor of its own (see _check).
_HANDLES: weakref.WeakSet[HotTier] = weakref.WeakSet()


_T = TypeVar("_T")

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
_STORED, _EXISTS, _NO_SPACE = int(PutResult.STORED), int(PutResult.EXISTS), int(PutResult.NO_SPACE)


class _Unpublished(Exception):
    """The segment was unlinked between attaching and registering; the open starts over."""


class _Damage(Exception):
    """A derived structure (index, free stack, pin list, policy state) holds a value it cannot hold:
    a damaged word. Never reaches a caller: the call is a miss and the segment is scrubbed."""


#: What policy code raises when its state holds garbage: an index out of range, a size that asks for
#: terabytes, a choice its own checks refuse (``policies.evict`` raises RuntimeError).
_POLICY_FAULTS = (IndexError, ValueError, RuntimeError, OverflowError, MemoryError)


def _survives_damage(method=None, *, user_code: bool = False):
    """Decorator for the block calls: damage to a derived structure found during the call (or a
    numpy IndexError it caused) scrubs the segment, rebuilding everything derived from the slot
    table, and runs the call once more. Damage that a scrub cannot cure is a ``CorruptState``.
    ``user_code``: the call runs a caller's function, whose own IndexError must pass through."""
    if method is None:
        return functools.partial(_survives_damage, user_code=user_code)
    caught = (_Damage,) if user_code else (_Damage, IndexError)

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        self._heal_if_abandoned()
        try:
            result = method(self, *args, **kwargs)
        except caught as e:
            self._repair(e)
            self._retrying = True
            try:
                result = method(self, *args, **kwargs)
            except caught as again:
                raise CorruptState(f"segment {self.name} is damaged beyond what a scrub repairs ({again}); "
                                   f"remove it with `tieredkv rm {self.name}`") from again
            finally:
                self._retrying = False
        if self._index is not None and self._index.damaged:
            self._repair("a damaged index entry")  # the lookup already answered with a miss
        return result

    return guarded


class HotTier(Tier):
    """Blocks in POSIX shared memory, shared by every process of the host that opens the same spec.

    Args:
        spec: the namespace; one segment per spec (and NUMA node).
        capacity_bytes: total segment size to create (ignored when attaching to an existing segment).
        n_slots: create exactly this many slots instead of deriving them from ``capacity_bytes``.
        name: segment name; default ``/tieredkv-<namespace>``.
        policy: eviction policy name for a new segment (default ``"lru"``); the full spec is recorded
            (``"prefix_aware:arc"``), and attaching with a different one is an error. ``None``
            attaches with whatever the segment uses.
        mode: permission bits of a new segment (default 0600: a KV cache holds users' prompts), at
            least 0600, never writable by every user, no set-id or sticky bits. An existing segment
            whose mode allows more than ``mode`` (widened after creation) is refused.
        create: create the segment if missing (``False``: attach only; a missing segment is then
            ``InvalidInput``).
        lock_timeout_s: bound on every lock wait (positive seconds).
        on_evict: called with an ``Evicted`` (keys and copied bytes) for blocks evicted to make room,
            outside the lock, before their slots are reused: the demotion hook.
        numa_node: suffix the segment name with the node (one segment per node).

    Raises:
        CapacityError: the segment does not fit in /dev/shm.
        SpecMismatch: the existing segment was made for another spec.
        FormatError: the existing segment is not ours or has another layout version.
        PermissionDenied: the existing segment belongs to another user, or its mode is wider than ``mode``.
        InvalidName: an unusable ``name``.
        InvalidInput: a size, timeout, mode or policy that is not one (named in the message).
    """

    #: Evict at least this fraction of the slots whenever eviction runs: the policy's O(n_slots) pass is
    #: then paid once per n_slots/512 blocks, so the per-block cost stays flat as the segment grows.
    EVICT_BATCH_FRACTION = 1 / 512

    def __init__(self, spec: KVSpec, capacity_bytes: int | None = None, *, n_slots: int | None = None,
                 name: str | None = None, policy: str | None = "lru", mode: int = 0o600, create: bool = True,
                 lock_timeout_s: float = 10.0, on_evict: Callable[[Evicted], None] | None = None,
                 numa_node: int | None = None):
        if not isinstance(spec, KVSpec):
            raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
        self.spec = spec
        if numa_node is not None:
            numa.check_node(numa_node)
        self.name = seg.check_name(name) if name is not None else seg.default_name(spec, numa_node)
        self.on_evict = on_evict
        #: whether ``on_evict`` gets the evicted bytes (a copy); False: keys and hits only
        self.evict_payloads = True
        self.lock_timeout_s = require_positive_seconds("lock_timeout_s", lock_timeout_s)
        if capacity_bytes is not None:
            capacity_bytes = require_positive_int("capacity_bytes", capacity_bytes, "64 << 20")
        if n_slots is not None:
            n_slots = require_positive_int("n_slots", n_slots, "1024")
        seg.check_mode(mode)
        self._args = dict(capacity_bytes=capacity_bytes, n_slots=n_slots, policy=policy, mode=mode,
                          create=create)
        self._tlock = threading.Lock()
        self._read_lock = threading.Lock()
        forksafe.register(self)  # unlocked in a forked child (see tieredkv.forksafe)
        self._closed = True
        self._open(**self._args)

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
        if self._state.layout.nbytes != int(h["policy_bytes"]):
            self._drop_mapping()
            raise CorruptState(f"segment {self.name}: policy state size does not match the header")
        self._fd = self._map.fd
        self._instance = int(h["instance"])
        self._inode = os.fstat(self._fd).st_ino
        self._pid = os.getpid()
        self._last_check = time.monotonic()
        self._closed = False
        self._owner, self._token = -1, 0
        self._stats = np.zeros(len(STAT_FIELDS), dtype=np.uint64)  # until registered
        self._claim_ids = itertools.count(1)  # tells one call's claims from another thread's
        self._retrying = False  # a block call runs again after a repair (see _survives_damage)
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
        self._owners = self._slots = self._tokens = self._free = self._data = None
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
        """Called by every public method: refuse closed handles, reattach after fork or unlink."""
        if self._closed:
            raise InvalidInput(f"hot tier {self.name} is closed")
        if os.getpid() != self._pid:
            # A forked child shares the parent's open file description (and so its locks): it needs
            # its own. The parent still owns the registry entry, so don't deregister it.
            self._drop_mapping()
            self._open(**self._args)
            return
        now = time.monotonic()
        if now - self._last_check > 1.0:
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
                self.close()
                self._open(**self._args)

    def _still_published(self) -> bool:
        try:
            return os.stat(seg._shm_path(self.name)).st_ino == self._inode
        except FileNotFoundError:
            return False

    # ---- the critical section --------------------------------------------------------------------
    # Every critical section is ``self._locked(body)``, which runs
    #
    #     with self._tlock:                     # threads sharing this handle take turns
    #         try:
    #             self._enter()                 # the lock; repairs first if needed; marks dirty
    #             result = body()               # the metadata changes
    #             self._h["dirty"] = 0          # reached only if the body finished
    #             return result
    #         finally:
    #             fcntl.fcntl(self._fd, locks.SETLK, locks.UNLOCK_META)
    #
    # and not as a context manager: an exception from a signal handler can be raised on entry to any
    # Python function, a context manager's __exit__ included, which would leave the lock held by a
    # live (and maybe idle) process. Here the unlock is the finally's first call, and no Python-level
    # code runs before it (an exception on entry to ``body`` is inside the try); releasing a lock this
    # description does not hold is a no-op. tests/test_hot_hardening.py interrupts it at random points.
    def _locked(self, body: Callable[[], _T]) -> _T:
        """Run ``body()`` as a critical section (see above) and return what it returns."""
        with self._tlock:
            try:
                self._enter()
                result = body()
                self._h["dirty"] = 0
                return result
            finally:
                fcntl.fcntl(self._fd, locks.SETLK, locks.UNLOCK_META)

    def _enter(self) -> None:
        """Take the metadata lock; repair first if the previous holder died inside (or if a reader
        dropped its pins without the lock); mark the header dirty. Call as shown above."""
        locks.acquire(self._fd, locks.META_LOCK_BYTE, self.lock_timeout_s, f"segment {self.name} lock")
        h = self._h
        if int(h["dirty"]):
            try:
                self._scrub()
            except (_Damage, *_POLICY_FAULTS):
                # A policy's own repair choked on damaged state (a garbage size asks for terabytes):
                # start the policy state afresh instead.
                self._scrub(policy_too=True)
        elif int(h["repin"]):
            self._recount_pins()
        h["dirty"] = self._owner + 1 if self._owner >= 0 else seg.MAX_OWNERS + 1  # who is inside

    def _heal_if_abandoned(self) -> None:
        """Scrub now if a critical section was left unfinished and nobody is inside one.

        ``dirty`` is set inside every critical section and cleared on the way out; set while the lock
        is free, it means the holder died or was interrupted (an exception from a signal handler) half
        way, maybe with the index emptied by a rebuild it did not finish. Readers never take the lock,
        so without this they would all miss every block until some writer happened to enter. One
        word read per call; the lock only when that word says so and no other process holds it.
        """
        h = self._h
        if self._closed or h is None or os.getpid() != self._pid or self._retrying or not int(h["dirty"]):
            return  # (a forked child's descriptor shares the parent's locks: _check reattaches first)
        if self._tlock.locked() or locks.is_locked(self._fd, locks.META_LOCK_BYTE):
            return  # a thread of ours, or another process, is inside right now: it clears the flag
        # `with` and an unconditional unlock, as in every critical section here: an interrupt at any
        # point leaves nothing held. (A thread that took _tlock since the check above is waited for
        # as any critical section waits; this thread never holds it here: the check saw it free.)
        with self._tlock:
            try:
                if int(h["dirty"]) and locks.try_lock(self._fd, locks.META_LOCK_BYTE) and int(h["dirty"]):
                    try:
                        self._scrub()
                    except (_Damage, *_POLICY_FAULTS):
                        self._scrub(policy_too=True)
                    h["dirty"] = 0
            finally:
                fcntl.fcntl(self._fd, locks.SETLK, locks.UNLOCK_META)

    # ---- liveness and recovery -----------------------------------------------------------------
    def _owner_alive(self, i: int, token: int) -> bool:
        if i == self._owner and token == self._token:
            return True
        if not 0 <= i < seg.MAX_OWNERS:
            return False  # a damaged slot record: no such owner, so nobody is writing that slot
        if int(self._owners[i]["token"]) != token:
            return False
        return locks.is_locked(self._fd, locks.REGISTRY_BASE + i)

    def _reclaim_owner(self, i: int) -> int:
        """Free the WRITING slots and drop the pins of dead owner ``i``. Under the lock."""
        rec = self._owners[i]
        token = int(rec["token"])
        slots = self._slots
        mine = np.flatnonzero((slots["state"] == WRITING) & (slots["owner"] == i) & (slots["owner_token"] == token))
        self._free_slots(mine)
        n_pins = int(rec["n_pins"])
        if n_pins:
            pinned = rec["pins"][: min(n_pins, seg.MAX_PINS)]
            if n_pins > seg.MAX_PINS or (pinned < 0).any() or (pinned >= self.n_slots).any():
                self._h["repin"] = 1  # a damaged pin list: the next holder counts from every row
            else:
                np.subtract.at(slots["pins"], pinned, 1)
            rec["n_pins"] = 0
        rec["token"] = 0
        self._stats[_STAT["reclaimed"]] += len(mine)
        return len(mine)

    def _reclaim_dead(self) -> int:
        """Reclaim every dead owner's WRITING slots and pins, and every abandoned claim (a token that
        is not its owner's: an interrupted call gave it up). Under the lock. Returns slots freed."""
        freed = 0
        for i in np.flatnonzero(self._owners["token"]):
            i = int(i)
            if i != self._owner and not locks.is_locked(self._fd, locks.REGISTRY_BASE + i):
                freed += self._reclaim_owner(i)
        rec = self._slots
        writing = np.flatnonzero(rec["state"] == WRITING)
        if len(writing):
            owner = rec["owner"][writing]
            known = owner < seg.MAX_OWNERS
            tokens = self._owners["token"][np.where(known, owner, 0).astype(np.int64)]
            orphans = writing[~known | (rec["owner_token"][writing] != tokens)]
            self._free_slots(orphans)
            self._stats[_STAT["reclaimed"]] += len(orphans)
            freed += len(orphans)
        return freed

    def _recount_pins(self) -> None:
        """Pin counts from the live owners' pin lists (a reader dropped its list without the lock,
        or a list was damaged). Under the lock."""
        self._h["repin"] = 0
        pins = np.zeros(self.n_slots, dtype=np.uint64)
        for i in np.flatnonzero(self._owners["token"]):
            rec = self._owners[int(i)]
            if self._owner_alive(int(i), int(rec["token"])):
                listed = rec["pins"][: min(int(rec["n_pins"]), seg.MAX_PINS)]
                np.add.at(pins, listed[(listed >= 0) & (listed < self.n_slots)], 1)
            else:
                rec["n_pins"] = 0
        self._slots["pins"] = pins

    def recover(self) -> dict:
        """Reclaim what dead processes left (WRITING slots, pins) and scrub; returns what was done."""
        self._check()

        def reclaim_and_scrub() -> int:
            freed = self._reclaim_dead()
            self._scrub()
            return freed

        freed = self._locked(reclaim_and_scrub)
        return {"reclaimed_slots": freed, "scrubs": int(self._h["scrubs"])}

    def _repair(self, why) -> None:
        """Scrub after damage was found in a derived structure, rebuilding the policy state too."""
        warnings.warn(f"tieredkv: segment {self.name}: damaged metadata ({why}); rebuilding it from the slot "
                      "table", RuntimeWarning, stacklevel=3)
        self._locked(functools.partial(self._scrub, policy_too=True))

    def _scrub(self, policy_too: bool = False) -> None:
        """Rebuild derived metadata from the slot table. Under the lock.

        The slot table is the truth; the index, the free stack, pin counts, the used count and the
        policy's residency are derived from it. A slot a dead writer left half-published (READY with
        an odd generation) or WRITING by a dead owner is freed. ``policy_too``: also reset the policy
        state and re-insert every resident block (its history is lost; damage may be anywhere in it).
        """
        slots = self._slots
        state = slots["state"]
        odd_ready = (state == READY) & (slots["gen"] % 2 == 1)
        bad_state = state > READY
        writing = np.flatnonzero(state == WRITING)
        dead = [s for s in writing if not self._owner_alive(int(slots["owner"][s]), int(slots["owner_token"][s]))]
        broken = np.concatenate([np.flatnonzero(odd_ready | bad_state), np.asarray(dead, dtype=np.int64)])
        if len(broken):
            gen = slots["gen"][broken]
            slots["gen"][broken] = gen + 1 + (gen + 1) % 2  # to the next even value: readers re-check
            slots["state"][broken] = FREE
        # Pins: only live owners' pin lists count; dead owners' rows are retired.
        for i in np.flatnonzero(self._owners["token"]):
            if not self._owner_alive(int(i), int(self._owners[int(i)]["token"])):
                self._owners[int(i)]["n_pins"] = 0
                self._owners[int(i)]["token"] = 0
        self._recount_pins()
        # Free stack and index from the slot table.
        free = np.flatnonzero(slots["state"] == FREE)[::-1]
        self._free[: len(free)] = free
        self._h["free_top"] = len(free)
        self._index.rebuild(self._indexed_slots())
        # Policy residency must equal READY.
        st, engine = self._state, self._policy
        ready = slots["state"] == READY
        if policy_too:
            st.reset()
            resident = np.flatnonzero(ready)
            parents = self._index.find(slots["parent"][resident])
            parents[(parents >= 0) & ~ready[np.maximum(parents, 0)]] = -1
            policies.insert(engine, st, resident, slots["key"][resident, 0], parents,
                            slots["position"][resident].astype(np.int64))
        stale = np.flatnonzero((st.resident == 1) & ~ready)
        st.resident[stale] = 0
        missing = np.flatnonzero(ready & (st.resident != 1))
        if len(missing):
            policies.insert(engine, st, missing, slots["key"][missing, 0], np.full(len(missing), -1),
                            slots["position"][missing].astype(np.int64))
        st.parent[(st.resident != 1) | (st.parent >= self.n_slots)] = -1
        live_parent = st.parent[(st.resident == 1) & (st.parent >= 0)]
        st.n_children[:] = np.bincount(live_parent, minlength=self.n_slots)[: self.n_slots]
        st.set_g("n_resident", int(np.count_nonzero(st.resident == 1)))
        repair = getattr(engine, "repair", None)
        if repair is not None:
            repair(st)
        self._h["scrubs"] += 1
        self._stats[_STAT["recoveries"]] += 1

    # ---- index -----------------------------------------------------------------------------------
    def _find(self, keys: np.ndarray) -> np.ndarray:
        """Slot holding each key (WRITING or READY) or -1. Lock-free; the answer is a hint that
        callers confirm against the slot (its key, state and generation)."""
        return self._index.find(keys)

    def _indexed_slots(self) -> np.ndarray:
        """Slots the index must hold: READY or WRITING with a key. Victims detached from their old
        key (zeroed, see ``_choose_victims``) and FREE slots are not indexed."""
        rec = self._slots
        return np.flatnonzero((rec["state"] != FREE) & (rec["key"] != 0).any(axis=1))

    # ---- slot bookkeeping (under the lock) -------------------------------------------------------
    def _free_slots(self, slots: np.ndarray) -> None:
        """WRITING/READY slots -> FREE, out of the index and the policy, onto the free stack."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        rec = self._slots
        try:
            policies.remove(self._policy, self._state, slots)
        except _POLICY_FAULTS as e:
            raise _Damage(f"policy state: {e}") from e
        gen = rec["gen"][slots]
        rec["gen"][slots] = gen + 1 + (gen + 1) % 2  # next even value, always a change
        rec["state"][slots] = FREE
        self._index.remove(slots, rec["key"][slots])
        self._push_free(slots)

    def _push_free(self, slots: np.ndarray) -> None:
        """Push FREE slots onto the stack, highest first, so that they pop lowest first: a batch
        freed together is taken again as one ascending run of adjacent slots. Under the lock."""
        top = int(self._h["free_top"])
        if top + len(slots) > self.n_slots:
            raise _Damage(f"free stack holds {top} entries, {len(slots)} more would pass its {self.n_slots}")
        self._free[top:top + len(slots)] = np.sort(slots)[::-1]
        self._h["free_top"] = top + len(slots)

    def _take_free(self, n: int) -> np.ndarray:
        top = int(self._h["free_top"])
        if top > self.n_slots:
            raise _Damage(f"free stack top {top} is past its {self.n_slots} entries")
        k = min(n, top)
        got = self._free[top - k:top][::-1].copy()
        # Every entry must name a FREE slot, once: handing out a READY slot would overwrite a block.
        if k and ((got < 0).any() or (got >= self.n_slots).any() or len(np.unique(got)) != k
                  or (self._slots["state"][got] != FREE).any()):
            raise _Damage("the free stack names a slot that is not free")
        self._h["free_top"] = top - k
        return got

    def _choose_victims(self, n: int, incoming: np.ndarray | None, claim: int) -> tuple[np.ndarray, Evicted]:
        """Let the policy pick up to ``n`` READY, unpinned victims and detach them from the index and
        the policy: they become WRITING by us (generation odd), with their key zeroed, until reused
        or freed. Returns the victims and what they held (keys, hit counts; bytes still in place)."""
        rec = self._slots
        evictable = (rec["state"] == READY) & (rec["pins"] == 0)
        try:
            victims = policies.evict(self._policy, self._state, n, evictable, incoming=incoming)
        except _POLICY_FAULTS as e:  # base.evict also checks what the policy chose (RuntimeError)
            raise _Damage(f"policy state: {e}") from e
        if len(victims) < min(n, int(np.count_nonzero(evictable))) and not self._retrying:
            # A policy evicts min(n, candidates) (the conformance suite holds every one to it), so
            # fewer means damaged state (residency, child counts, queue marks) that would refuse
            # stores from now on.
            raise _Damage(f"the policy chose {len(victims)} of {n} victims among evictable blocks")
        old = Evicted(ChunkKeys(rec["key"][victims].copy(), rec["parent"][victims].copy(),
                                self._tokens[victims].copy(), 0, rec["position"][victims].astype(np.int64)),
                      None, self._state.hits[victims].copy())  # remove() leaves hits: demotion rules use them
        if len(victims):
            self._claim(victims, claim)
            self._index.remove(victims, old.keys.keys)
            rec["key"][victims] = 0
            self._stats[_STAT["evictions"]] += len(victims)
        return victims, old

    def _claim(self, slots: np.ndarray, claim: int) -> None:
        """Slots -> WRITING by this handle, for the call whose id is ``claim``. Under the lock."""
        rec = self._slots
        rec["claim"][slots] = claim
        rec["gen"][slots] += 1  # odd: readers treat the slot as being rewritten
        rec["state"][slots] = WRITING
        rec["owner"][slots] = self._owner
        rec["owner_token"][slots] = self._token

    # ---- the block interface -------------------------------------------------------------------
    def _confirmed(self, keys: ChunkKeys, found: np.ndarray) -> np.ndarray:
        """Bool per key: slot ``found`` (from ``_find``: it held the key) holds it READY with the same
        parent and chunk tokens."""
        return batch.check(self._words, self._tokens, found, keys)[1]

    def _held(self, keys: ChunkKeys) -> np.ndarray:
        """Bool per key: a slot holds it READY with the same parent and chunk tokens. Lock-free."""
        return batch.confirmed(self._index, self._words, self._tokens, keys)[2]

    def _check_keys(self, keys: ChunkKeys) -> None:
        check_keys(self.spec, keys)

    @_survives_damage
    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        self._check()
        self._check_keys(keys)
        return self._held(keys)

    @_survives_damage
    def match(self, keys: ChunkKeys) -> int:
        self._check()
        self._check_keys(keys)
        n = batch.leading(self._held(keys))
        self._stats[_STAT["lookups"]] += 1
        return n

    @_survives_damage
    def get_many(self, keys: ChunkKeys, out: np.ndarray,
                 sink: Callable[[int, np.ndarray], None] | None = None) -> int:
        """Copy the leading resident blocks into ``out`` rows; return how many.

        ``out``: the spec's dtype (or uint8) holding at least ``len(keys)`` blocks. Rows past the
        returned count are untouched or partially written; never use them. ``sink(i, rows)``, if
        given, gets each run of ``out``'s rows right after it is copied (see ``Tier.get_many``).
        """
        self._check()
        self._check_keys(keys)
        dst = out_rows(self.spec, out, len(keys))
        data = self._data
        # Alignment is decided once per call: slot strides are multiples of 64, so every row pair has
        # the same skew when the destination's row stride is one too (else per run, by arithmetic).
        dst0, src0, dstride, sstride = address(dst), address(data), dst.strides[0], data.strides[0]
        uniform = dstride % 64 == 0
        skew0 = (dst0 - src0) % 64 != 0

        def copy(first: int, slots: np.ndarray) -> None:
            # One copy per run of adjacent slots (ascending or descending), the common case: a prompt
            # stored in one call. Not np.take: slower than row copies from a shared mapping.
            for a, b, s, step in slot_runs(slots):
                at = first + a
                lowest = s if step == 1 else s - (b - a) + 1
                skew = skew0 if uniform else (dst0 + at * dstride - src0 - lowest * sstride) % 64 != 0
                copy_rows(dst[at:first + b], run_rows(data, s, b - a, step), skew)
                if sink is not None:
                    sink(at, dst[at:first + b])

        return self._read(keys, copy)

    @_survives_damage(user_code=True)
    def read_runs(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Like ``get_many``, but hand each run of blocks to ``sink(i, rows)`` while it is pinned.

        ``rows`` is a ``(k, block_bytes)`` uint8 view of ``k`` adjacent slots in shared memory holding
        blocks ``i .. i+k-1`` of ``keys``, valid only during the call: copy it where it belongs (e.g.
        a model-layout tensor, ``tieredkv.layout.blocks_to_model``), which saves the intermediate
        copy ``get_many`` would make. A prefix stored in one call is one run. Returns how many
        leading blocks were delivered.
        """
        self._check()
        self._check_keys(keys)
        data = self._data

        def copy(first: int, slots: np.ndarray) -> None:
            for a, b, s, step in slot_runs(slots):
                sink(first + a, run_rows(data, s, b - a, step))

        return self._read(keys, copy)

    @_survives_damage(user_code=True)
    def read_into(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Like ``get_many``, but hand each block to ``sink(i, block_bytes)`` while it is pinned.

        ``block_bytes`` is a uint8 view of the slot in shared memory, valid only during the call:
        copy it where it belongs (e.g. a strided slice of a model's cache tensor), which saves the
        intermediate copy ``get_many`` would make. Returns how many leading blocks were delivered.
        """
        self._check()
        self._check_keys(keys)
        data = self._data

        def copy(first: int, slots: np.ndarray) -> None:
            for i, slot in enumerate(slots.tolist()):
                sink(first + i, data[slot])

        return self._read(keys, copy)

    def _read(self, keys: ChunkKeys, copy: Callable[[int, np.ndarray], None]) -> int:
        n = len(keys)
        done = 0
        while done < n:
            batch = min(n - done, seg.MAX_PINS)
            with self._read_lock:  # one pin list per handle: threads sharing a handle take turns
                got = self._read_batch(keys[done:done + batch], done, copy)
            done += got
            if got < batch:
                break
        st = self._stats
        st[_STAT["hits"]] += done
        st[_STAT["misses"]] += n - done
        st[_STAT["bytes_out"]] += done * self.spec.block_bytes
        return done

    def _read_batch(self, keys: ChunkKeys, first: int, copy) -> int:
        words = self._words
        slots, seen = batch.read_run(self._index, words, self._tokens, keys)
        if not len(slots):
            return 0
        run = batch.one_run(slots)
        owner = self._owner

        def pin() -> int:
            # Re-check under the lock and pin in the same critical section (invariant 3; hot/batch.py).
            # The pin list goes into our owner row before the counts: whatever interrupts this, the
            # row says at least what the counts hold (a scrub recounts from rows).
            m = batch.still_seen(words, slots, seen)
            self._pin_lists[owner, :m] = slots[:m]
            self._n_pins[owner] = m
            batch.add_pins(words, slots[:m], run)
            return m

        try:
            n = self._locked(pin)
            slots, seen = slots[:n], seen[:n]
            copy(first, slots)
            # Seqlock check while still pinned: a pinned slot is never recycled, so this only fires
            # on a broken invariant (checked after unpinning, a legitimate eviction would trip it).
            torn = batch.torn(words, slots, seen)
            if torn < n:
                n = torn
                self._stats[_STAT["torn_reads"]] += 1
            # Still pinned: the hit lands on the blocks we read, not on a recycled slot.
            try:
                if self._policy.hit_needs_lock:
                    self._locked(functools.partial(policies.hit, self._policy, self._state, slots[:n]))
                else:
                    policies.hit(self._policy, self._state, slots[:n])  # relaxed: aligned int64 stores only
            except _POLICY_FAULTS as e:
                raise _Damage(f"policy state: {e}") from e
            self._locked(self._release_pins)
        except BaseException:
            # Interrupted anywhere above (a signal handler's exception, MemoryError, a sink that
            # raised): drop our pins without waiting for the lock, which could itself be interrupted
            # or time out. Plain stores only, no calls: nothing can interrupt them. The next lock
            # holder recounts the pin counts from the owner rows.
            self._owners["n_pins"][self._owner] = 0
            self._h["repin"] = 1
            raise
        return n

    def _release_pins(self) -> None:
        me = self._owners[self._owner]
        n_pins = int(me["n_pins"])
        if n_pins:
            listed = me["pins"][: min(n_pins, seg.MAX_PINS)]
            if n_pins > seg.MAX_PINS or (listed < 0).any() or (listed >= self.n_slots).any():
                self._h["repin"] = 1  # a damaged pin list: count again from every row
            else:
                batch.drop_pins(self._words, listed, batch.one_run(listed))
            me["n_pins"] = 0

    @_survives_damage(user_code=True)  # on_evict is the caller's
    def put_many(self, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
        """Store blocks. Returns one ``PutResult`` code per key (int8 array).

        A key already READY, or being written by anyone (this call included, for repeated keys), is
        EXISTS. When the segment is full the policy evicts; if nothing can be evicted the key is
        NO_SPACE. Evicted blocks are handed to ``on_evict`` before their slots are reused.
        """
        self._check()
        self._check_keys(keys)
        n = len(keys)
        src = as_block_bytes(self.spec, payloads, n)
        codes = np.full(n, _EXISTS, dtype=np.int8)
        if n == 0:
            return codes
        _, first = np.unique(keys.keys, axis=0, return_index=True)
        todo = np.sort(first)
        # Lock-free pre-check, re-checked below: skip keys already READY. A key found WRITING still
        # goes to the locked path, which frees it if its writer died (else that prefix would answer
        # EXISTS, and be prefilled again, on every request for as long as the segment lives).
        found = self._find(keys.keys[todo])
        held = found >= 0
        held[held] = self._slots["state"][found[held]] == READY
        todo = todo[~held]
        if not len(todo):
            self._stats[_STAT["exists"]] += n
            return codes
        rec = self._slots
        claim = next(self._claim_ids)

        def claim_slots() -> tuple[np.ndarray, Any, np.ndarray, np.ndarray, np.ndarray]:
            found = self._find(keys.keys[todo])
            if self._reclaim_abandoned(found):
                found = self._find(keys.keys[todo])
            new = todo[found < 0]
            slots, victims, old = self._take_slots(len(new), keys.keys[new, 0], claim)
            # A batch gets adjacent, ascending slots where it can: free slots come off the stack in
            # ascending runs (see _push_free), the lowest victims are used and the surplus (spare)
            # goes back; so a prefix stored in one call is one run, and reads copy it in one piece.
            by_slot = np.sort(victims)
            need = max(len(new) - len(slots), 0)
            spare = by_slot[need:]
            use = np.sort(np.concatenate([slots, by_slot[:need]]))
            stored = new[: len(use)]
            codes[new[len(use):]] = _NO_SPACE
            rec["key"][use] = keys.keys[stored]
            rec["parent"][use] = keys.parents[stored]
            rec["position"][use] = keys.positions[stored]
            rec["length"][use] = self.spec.block_bytes
            self._index.insert(use, keys.keys[stored])
            return victims, old, spare, use, stored

        def publish() -> None:
            rec["gen"][use] += 1  # even again: published
            rec["state"][use] = READY
            parents = self._find(keys.parents[stored])
            try:
                policies.insert(self._policy, self._state, use, keys.keys[stored, 0], parents,
                                keys.positions[stored])
            except _POLICY_FAULTS as e:
                raise _Damage(f"policy state: {e}") from e
            self._release_spare(spare)

        def give_back() -> None:
            self._free_slots(use)
            self._release_spare(spare)

        try:
            victims, old, spare, use, stored = self._locked(claim_slots)
            evicted = None
            try:
                if len(victims) and old is not None:
                    # The victims are WRITING by us: nobody else touches their bytes until we publish.
                    payload = self._data[victims].copy() if self.on_evict is not None and self.evict_payloads else None
                    evicted = Evicted(old.keys, payload, old.hits)
                self._tokens[use] = keys.tokens[stored]
                self._write_rows(use, src, stored)
            except BaseException:
                # Interrupted (KeyboardInterrupt, MemoryError, ...): give the claimed slots back now
                # rather than leave them WRITING until this handle closes.
                self._locked(give_back)
                raise
            self._locked(publish)
        except BaseException:
            # Interrupted anywhere above, even inside the giving back: abandon what this call still
            # holds WRITING (its claim id tells which) without the lock, with plain stores only. A
            # zero token reads as a dead writer's, which the next process short of space, storing
            # the same keys, or scrubbing frees.
            rec["owner_token"][(rec["state"] == WRITING) & (rec["owner"] == self._owner) & (rec["claim"] == claim)] = 0
            raise
        codes[stored] = _STORED
        st = self._stats
        st[_STAT["puts"]] += len(stored)
        st[_STAT["bytes_in"]] += len(stored) * self.spec.block_bytes
        st[_STAT["exists"]] += int(np.count_nonzero(codes == _EXISTS))
        st[_STAT["no_space"]] += int(np.count_nonzero(codes == _NO_SPACE))
        if evicted is not None and self.on_evict is not None:
            self.on_evict(evicted)
        return codes

    def _take_slots(self, need: int, incoming: np.ndarray, claim: int) -> tuple[np.ndarray, np.ndarray, Any]:
        """The allocation ladder of ``put_many``, under the lock: free slots first; then the slots of
        dead writers; then victims the policy evicts, in a batch of at least ``EVICT_BATCH_FRACTION``
        of the segment (the surplus is the caller's spare); if the policy finds none, dead writers'
        slots once more. ``incoming``: the low key words of the ``need`` blocks to place.

        Returns:
            ``(free, victims, old)``: free slots claimed by ``claim``, victim slots (claimed by
            ``_choose_victims``), and the victims' ``Evicted``-to-be (keys, hits) or None.
        """
        slots = self._take_free(need)
        if len(slots) < need and self._reclaim_dead():
            slots = np.concatenate([slots, self._take_free(need - len(slots))])
        n_free = len(slots)
        victims, old = np.zeros(0, dtype=np.int64), None
        if n_free < need:
            want = max(need - n_free, int(self.n_slots * self.EVICT_BATCH_FRACTION))
            rest = incoming[n_free:]
            victims, old = self._choose_victims(want, rest, claim)
            if not len(victims) and self._reclaim_dead():
                slots = np.concatenate([slots, self._take_free(need - len(slots))])
                if len(slots) < need:
                    victims, old = self._choose_victims(want, rest, claim)
        self._claim(slots, claim)  # victims are claimed already
        return slots, victims, old

    def _write_rows(self, slots: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
        """Copy ``src[rows[j]]`` into slot ``slots[j]``: one copy per run where both are adjacent
        (both ascending: ``put_many`` sorts its slots), alignment decided once per call."""
        if not len(slots):
            return
        data = self._data
        dst0, src0, sstride, rstride = address(data), address(src), data.strides[0], src.strides[0]
        uniform = rstride % 64 == 0
        skew0 = (dst0 - src0) % 64 != 0
        edges = np.flatnonzero((np.diff(slots) != 1) | (np.diff(rows) != 1)) + 1
        begins = np.concatenate(([0], edges)).tolist()
        ends = np.concatenate((edges, [len(slots)])).tolist()
        for b, e in zip(begins, ends):
            s, r = int(slots[b]), int(rows[b])
            skew = skew0 if uniform else (dst0 + s * sstride - src0 - r * rstride) % 64 != 0
            copy_rows(data[s:s + e - b], src[r:r + e - b], skew)

    def _reclaim_abandoned(self, found: np.ndarray) -> int:
        """Free WRITING slots among ``found`` whose writer died, so their keys can be stored again.
        Returns how many were freed."""
        rec = self._slots
        cand = found[found >= 0]
        cand = cand[(rec["state"][cand] == WRITING) & (rec["owner"][cand] != self._owner)]
        dead = [s for s in cand.tolist()
                if not self._owner_alive(int(rec["owner"][s]), int(rec["owner_token"][s]))]
        if dead:
            self._free_slots(np.asarray(dead, dtype=np.int64))
            self._stats[_STAT["reclaimed"]] += len(dead)
        return len(dead)

    def _release_spare(self, spare: np.ndarray) -> None:
        """Claimed (WRITING by us, out of the index and policy) slots -> FREE. Under the lock."""
        if not len(spare):
            return
        rec = self._slots
        gen = rec["gen"][spare]
        rec["gen"][spare] = gen + 1 + (gen + 1) % 2
        rec["state"][spare] = FREE
        self._push_free(spare)

    @_survives_damage
    def remove(self, keys: ChunkKeys) -> int:
        """Remove resident, unpinned blocks; returns how many were removed."""
        self._check()
        self._check_keys(keys)

        def free_unpinned() -> np.ndarray:
            found = self._find(keys.keys)
            ok = self._confirmed(keys, found) & (self._slots["pins"][np.maximum(found, 0)] == 0)
            slots = np.unique(found[ok])
            self._free_slots(slots)
            return slots

        slots = self._locked(free_unpinned)
        self._stats[_STAT["removed"]] += len(slots)
        return len(slots)

    @_survives_damage
    def evict(self, n: int) -> Evicted:
        """Evict up to ``n`` blocks chosen by the policy; returns their keys and bytes."""
        self._check()
        n = check_count(n)
        rec = self._slots
        claim = next(self._claim_ids)
        try:
            victims, old = self._locked(functools.partial(self._choose_victims, n, None, claim))
            payloads = self._data[victims].copy()
            self._locked(functools.partial(self._release_spare, victims))
        except BaseException:  # as in put_many: abandon the victims without the lock
            rec["owner_token"][(rec["state"] == WRITING) & (rec["owner"] == self._owner) & (rec["claim"] == claim)] = 0
            raise
        return Evicted(old.keys, payloads, old.hits)

    # ---- introspection ---------------------------------------------------------------------------
    def stats(self) -> TierStats:
        self._check()
        totals = self._owners["stats"].sum(axis=0)
        s = {name: int(totals[i]) for name, i in _STAT.items()}
        state = self._slots["state"]
        return TierStats(
            name="hot", capacity_blocks=self.n_slots, used_blocks=int(np.count_nonzero(state == READY)),
            hits=s["hits"], misses=s["misses"], bytes_in=s["bytes_in"], bytes_out=s["bytes_out"],
            puts=s["puts"], evictions=s["evictions"], recoveries=s["recoveries"],
            extra={"segment": self.name, "policy": self._policy.name, "segment_bytes": self._map.size,
                   "shm_dir": str(seg.shm_dir()), "huge_pages": seg.huge_page_policy(),
                   "huge_mapped_bytes": seg.huge_mapped_bytes(self._map),
                   "writing_blocks": int(np.count_nonzero(state == WRITING)),
                   "live_handles": self.live_handles(), "scrubs": int(self._h["scrubs"]),
                   **{k: s[k] for k in ("lookups", "exists", "no_space", "removed", "reclaimed", "torn_reads")}})

    def cache_counters(self) -> counters.CacheCounters | None:
        """This handle's row of the cache's counters, in the segment (totals: per host)."""
        self._check()
        return self.counters

    @property
    def corrupt_seen(self) -> int:
        """Blocks this handle saw change under a pinned read (a broken invariant; never returned)."""
        return int(self._stats[_STAT["torn_reads"]]) if self._stats is not None else 0

    def live_handles(self) -> int:
        """Open handles (processes, or several handles in one process) attached right now."""
        return sum(1 for i in np.flatnonzero(self._owners["token"])
                   if self._owner_alive(int(i), int(self._owners[int(i)]["token"])))

    def slot_census(self) -> dict:
        """Counts of slots by state, and WRITING slots split by live and dead owners (for checks)."""
        self._check()
        rec = self._slots
        writing = np.flatnonzero(rec["state"] == WRITING)
        live = sum(1 for s in writing if self._owner_alive(int(rec["owner"][s]), int(rec["owner_token"][s])))
        return {"capacity": self.n_slots, "free": int(np.count_nonzero(rec["state"] == FREE)),
                "ready": int(np.count_nonzero(rec["state"] == READY)), "writing_live": live,
                "writing_dead": len(writing) - live, "pinned": int(np.count_nonzero(rec["pins"]))}

    def unlink(self) -> None:
        """Remove the segment's name (mappers keep their mapping until they close). Then close."""
        try:
            if self._still_published():
                seg.unlink(self.name)
        finally:
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.n_slots} slots"
        return f"HotTier({self.name!r}, {state})"
