"""HotTier: fixed-size block slots in one POSIX shared-memory segment that every worker maps.

Concurrency (docs/architecture.md, "Concurrency and crash invariants"), in one paragraph: metadata
(slot states, the index, the free stack, pins, policy state) changes only inside critical sections (see
``Recovery._locked``), under an OFD lock the kernel releases if its holder dies. Data is copied outside
the lock: a writer claims a slot (state WRITING, generation odd), fills it without the lock, and
publishes it (READY, generation even) under the lock. Readers never take the lock to *find* blocks; they
read a slot's generation, its key and state, use the data, and re-read the generation, so a block
recycled or torn meanwhile is a miss, never wrong bytes. ``get_many`` also pins the blocks it copies
(pin count and state checked in one critical section) so they cannot be evicted under it; pins are
recorded per owner so a dead reader's pins are reclaimed.

This module is the block interface (the ``Tier`` protocol); the rest of a handle lives beside it:

- ``hot/slots.py``: the slot table and the bookkeeping of every slot state change;
- ``hot/recovery.py``: the critical section, owner liveness, reclaiming what the dead left, the scrub;
- ``hot/allocation.py``: where a store's slots come from (free, dead writers', the policy's victims);
- ``hot/handle.py``: create or attach, register as an owner, reattach after a fork or an unlink, close;
- ``hot/damage.py``: a damaged derived structure is a miss plus a scrub (``survives_damage``).

Interrupts (an exception from a signal handler can be raised between any two calls of the main
thread) leave nothing held: see ``Recovery._locked`` for the lock, ``_read_batch`` for pins and
``put_many`` for claims.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv import counters, forksafe, numa, policies
from tieredkv.errors import InvalidInput, require_positive_int, require_positive_seconds
from tieredkv.hot import batch, locks
from tieredkv.hot import segment as seg
from tieredkv.hot.allocation import Allocation
from tieredkv.hot.damage import POLICY_FAULTS, Damage, survives_damage
from tieredkv.hot.handle import SegmentHandle, public
from tieredkv.hot.segment import FREE, READY, WRITING
from tieredkv.hot.slots import STAT
from tieredkv.keys import ChunkKeys
from tieredkv.layout import address, as_block_bytes, copy_rows, run_rows, slot_runs
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats, check_count, check_keys, out_rows

_STORED, _EXISTS, _NO_SPACE = int(PutResult.STORED), int(PutResult.EXISTS), int(PutResult.NO_SPACE)


class HotTier(SegmentHandle, Allocation, Tier):
    """Blocks in POSIX shared memory, shared by every process of the host that opens the same spec.

    Args:
        spec: the namespace; one segment per spec (and NUMA node).
        capacity_bytes: total segment size to create (ignored when attaching to an existing segment).
        n_slots: create exactly this many slots instead of deriving them from ``capacity_bytes``.
        name: segment name; default ``/tieredkv-v<layout>-u<uid>-<namespace>`` (``segment.default_name``).
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
        #: called once before the handle lets go of the segment (the cache's write-behind copies out
        #: what it has not written yet: ``tieredkv.writeback``)
        self.before_close: Callable[[], None] | None = None
        self.lock_timeout_s = require_positive_seconds("lock_timeout_s", lock_timeout_s)
        if capacity_bytes is not None:
            capacity_bytes = require_positive_int("capacity_bytes", capacity_bytes, "64 << 20")
        if n_slots is not None:
            n_slots = require_positive_int("n_slots", n_slots, "1024")
        seg.check_mode(mode)
        self._args = dict(capacity_bytes=capacity_bytes, n_slots=n_slots, policy=policy, mode=mode,
                          create=create)
        self._tlock = threading.Lock()
        self._calls_lock = threading.RLock()  # over _calls, and a reattach (see handle.public)
        self._calls = 0  # this handle's public calls in flight, every thread's
        self._read_lock = threading.Lock()
        self._read_holder = 0  # the thread inside a read (threading.get_ident), 0 when none
        forksafe.register(self)  # unlocked in a forked child (see tieredkv.forksafe)
        self._closed = True
        self._open(**self._args)

    @public
    def recover(self) -> dict:
        """Reclaim what dead processes left (WRITING slots, pins) and scrub; returns what was done."""

        def reclaim_and_scrub() -> int:
            freed = self._reclaim_dead()
            self._scrub()
            return freed

        freed = self._locked(reclaim_and_scrub)
        return {"reclaimed_slots": freed, "scrubs": int(self._h["scrubs"])}

    # ---- the block interface -------------------------------------------------------------------
    def _check_keys(self, keys: ChunkKeys) -> None:
        check_keys(self.spec, keys)

    @public
    @survives_damage
    def contains_many(self, keys: ChunkKeys) -> np.ndarray:
        self._check_keys(keys)
        return self._held(keys)

    @public
    @survives_damage
    def match(self, keys: ChunkKeys) -> int:
        self._check_keys(keys)
        n = batch.leading(self._held(keys))
        self._stats[STAT["lookups"]] += 1
        return n

    @public
    @survives_damage(user_code=True)  # sink is the caller's
    def get_many(self, keys: ChunkKeys, out: np.ndarray,
                 sink: Callable[[int, np.ndarray], None] | None = None, *, touch: bool = True) -> int:
        """Copy the leading resident blocks into ``out`` rows; return how many.

        ``out``: the spec's dtype (or uint8) holding at least ``len(keys)`` blocks. Rows past the
        returned count are untouched or partially written; never use them. ``sink(i, rows)``, if
        given, gets each run of ``out``'s rows right after it is copied (see ``Tier.get_many``).
        ``touch=False``: a read on the cache's own behalf (write-behind copying a block to a lower
        level), not a request's: no hit or miss counted, the eviction policy not told.
        """
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

        return self._read(keys, copy, touch)

    @public
    @survives_damage(user_code=True)
    def read_runs(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Like ``get_many``, but hand each run of blocks to ``sink(i, rows)`` while it is pinned.

        ``rows`` is a ``(k, block_bytes)`` uint8 view of ``k`` adjacent slots in shared memory holding
        blocks ``i .. i+k-1`` of ``keys``, valid only during the call: copy it where it belongs (e.g.
        a model-layout tensor, ``tieredkv.layout.blocks_to_model``), which saves the intermediate
        copy ``get_many`` would make. A prefix stored in one call is one run. Its rows always go
        forwards through memory (a positive row stride, as ``torch.from_numpy`` needs): blocks that
        lie in descending slots are handed one at a time. Returns how many leading blocks were
        delivered.
        """
        self._check_keys(keys)
        data = self._data

        def copy(first: int, slots: np.ndarray) -> None:
            for a, b, s, step in slot_runs(slots):
                if step == 1:
                    sink(first + a, run_rows(data, s, b - a, step))
                else:
                    for j in range(b - a):
                        sink(first + a + j, data[s - j:s - j + 1])

        return self._read(keys, copy)

    @public
    @survives_damage(user_code=True)
    def read_into(self, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None]) -> int:
        """Like ``get_many``, but hand each block to ``sink(i, block_bytes)`` while it is pinned.

        ``block_bytes`` is a uint8 view of the slot in shared memory, valid only during the call:
        copy it where it belongs (e.g. a strided slice of a model's cache tensor), which saves the
        intermediate copy ``get_many`` would make. Returns how many leading blocks were delivered.
        """
        self._check_keys(keys)
        data = self._data

        def copy(first: int, slots: np.ndarray) -> None:
            for i, slot in enumerate(slots.tolist()):
                sink(first + i, data[slot])

        return self._read(keys, copy)

    def _read(self, keys: ChunkKeys, copy: Callable[[int, np.ndarray], None], touch: bool = True) -> int:
        n = len(keys)
        done = 0
        me = locks.refuse_reentry(self._read_lock, self._read_holder, f"a read of segment {self.name}")
        while done < n:
            size = min(n - done, seg.MAX_PINS)
            with self._read_lock:  # one pin list per handle: threads sharing a handle take turns
                self._read_holder = me
                try:
                    got = self._read_batch(keys[done:done + size], done, copy, touch)
                finally:
                    self._read_holder = 0
            done += got
            if got < size:
                break
        if not touch:
            return done
        st = self._stats
        st[STAT["hits"]] += done
        st[STAT["misses"]] += n - done
        st[STAT["bytes_out"]] += done * self.spec.block_bytes
        return done

    def _read_batch(self, keys: ChunkKeys, first: int, copy, touch: bool = True) -> int:
        # Checked once per batch (hot/batch.py): lock-free, every record of the batch in one pass;
        # under the lock, only that the generation and key seen are still there.
        words = self._words
        slots, seen = batch.read_run(self._index, words, self._tokens, keys)
        if not len(slots):
            return 0
        run = batch.one_run(slots)
        owner = self._owner

        def pin() -> int:
            # Re-check under the lock and pin in the same critical section (invariant 3). The pin
            # list goes into our owner row before the counts: whatever interrupts this, the row says
            # at least what the counts hold (a scrub recounts from rows). A key twice in a batch
            # pins its slot twice (batch.add_pins).
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
                self._stats[STAT["torn_reads"]] += 1
            # Still pinned: the hit lands on the blocks we read, not on a recycled slot.
            try:
                if not touch:
                    pass
                elif self._policy.hit_needs_lock:
                    self._locked(functools.partial(policies.hit, self._policy, self._state, slots[:n]))
                else:
                    policies.hit(self._policy, self._state, slots[:n])  # relaxed: aligned int64 stores only
            except POLICY_FAULTS as e:
                raise Damage(f"policy state: {e}") from e
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


    @public
    @survives_damage(user_code=True)  # on_evict is the caller's
    def put_many(self, keys: ChunkKeys, payloads: np.ndarray | Callable[[np.ndarray, np.ndarray, np.ndarray], None]
                 ) -> np.ndarray:
        """Store blocks. Returns one ``PutResult`` code per key (int8 array).

        A key already READY, or being written by anyone (this call included, for repeated keys), is
        EXISTS. When the segment is full the policy evicts; if nothing can be evicted the key is
        NO_SPACE. Evicted blocks are handed to ``on_evict`` before their slots are reused.
        ``payloads`` may also be a callable ``fill(data, slots, rows)`` that writes block ``rows[j]``
        (an index into ``keys``) into ``data[slots[j]]`` (the segment's ``(n_slots, block_bytes)``
        rows): the caller builds its blocks in place, with no copy of its own (``TieredCache.store``).
        """
        self._check_keys(keys)
        n = len(keys)
        if callable(payloads):
            fill = payloads
        else:
            src = as_block_bytes(self.spec, payloads, n)

            def fill(data: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
                self._write_rows(slots, src, rows)
        codes = np.full(n, _EXISTS, dtype=np.int8)
        if n == 0:
            return codes
        todo = batch.distinct(keys.keys)
        # Lock-free pre-check, re-checked below: skip keys already READY. A key found WRITING still
        # goes to the locked path, which frees it if its writer died (else that prefix would answer
        # EXISTS, and be prefilled again, on every request for as long as the segment lives).
        found = self._find(keys.keys[todo])
        held = found >= 0
        held[held] = self._slots["state"][found[held]] == READY
        todo = todo[~held]
        if not len(todo):
            self._stats[STAT["exists"]] += n
            return codes
        rec, words = self._slots, self._words
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
            run = batch.one_run(use)
            named = np.concatenate((keys.keys[stored], keys.parents[stored]), axis=1)
            batch.set_words(words, use, run, slice(batch.KEY, batch.PARENT + 2), named)
            batch.set_words(words, use, run, batch.POSITION, keys.positions[stored])
            batch.set_words(words, use, run, batch.LENGTH, self.spec.block_bytes)
            self._index.insert(use, named[:, :2])
            return victims, old, spare, use, stored

        def publish() -> None:
            # The claim is still ours, or something broke an invariant (a reattach or a reclaim freed
            # it, and another writer may have filled the slots since): publish nothing then.
            if not ((rec["state"][use] == WRITING) & (rec["owner"][use] == self._owner)
                    & (rec["owner_token"][use] == self._token) & (rec["claim"][use] == claim)).all():
                raise Damage("a slot this put claimed was taken from it before it published")
            run = batch.one_run(use)
            batch.bump(words, use, run)  # even again: published
            batch.set_words(words, use, run, batch.STATE, READY)
            parents = self._find(keys.parents[stored])
            try:
                policies.insert(self._policy, self._state, use, keys.keys[stored, 0], parents,
                                keys.positions[stored])
            except POLICY_FAULTS as e:
                raise Damage(f"policy state: {e}") from e
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
                fill(self._data, use, stored)  # slots claimed by us: nobody reads them before publish
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
        st[STAT["puts"]] += len(stored)
        st[STAT["bytes_in"]] += len(stored) * self.spec.block_bytes
        st[STAT["exists"]] += int(np.count_nonzero(codes == _EXISTS))
        st[STAT["no_space"]] += int(np.count_nonzero(codes == _NO_SPACE))
        if evicted is not None and self.on_evict is not None:
            self.on_evict(evicted)
        return codes

    def _write_rows(self, slots: np.ndarray, src: np.ndarray, rows: np.ndarray) -> None:
        """Copy ``src[rows[j]]`` into slot ``slots[j]``: one copy per run where both are adjacent
        (both ascending: ``put_many`` sorts its slots), alignment decided once per call."""
        if not len(slots):
            return
        data = self._data
        dst0, src0, sstride, rstride = address(data), address(src), data.strides[0], src.strides[0]
        uniform = rstride % 64 == 0
        skew0 = (dst0 - src0) % 64 != 0
        if batch.one_run(slots) and batch.one_run(rows):  # a prompt stored in one call: one copy
            s, r = int(slots[0]), int(rows[0])
            skew = skew0 if uniform else (dst0 + s * sstride - src0 - r * rstride) % 64 != 0
            copy_rows(data[s:s + len(slots)], src[r:r + len(rows)], skew)
            return
        edges = np.flatnonzero((np.diff(slots) != 1) | (np.diff(rows) != 1)) + 1
        begins = np.concatenate(([0], edges)).tolist()
        ends = np.concatenate((edges, [len(slots)])).tolist()
        for b, e in zip(begins, ends):
            s, r = int(slots[b]), int(rows[b])
            skew = skew0 if uniform else (dst0 + s * sstride - src0 - r * rstride) % 64 != 0
            copy_rows(data[s:s + e - b], src[r:r + e - b], skew)

    @public
    @survives_damage
    def remove(self, keys: ChunkKeys) -> int:
        """Remove resident, unpinned blocks; returns how many were removed."""
        self._check_keys(keys)

        def free_unpinned() -> np.ndarray:
            found = self._find(keys.keys)
            ok = self._confirmed(keys, found) & (self._slots["pins"][np.maximum(found, 0)] == 0)
            slots = np.unique(found[ok])
            self._free_slots(slots)
            return slots

        slots = self._locked(free_unpinned)
        self._stats[STAT["removed"]] += len(slots)
        return len(slots)

    @public
    @survives_damage
    def evict(self, n: int) -> Evicted:
        """Evict up to ``n`` blocks chosen by the policy; returns their keys and bytes."""
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
    @public
    def stats(self) -> TierStats:
        totals = self._owners["stats"].sum(axis=0)
        s = {name: int(totals[i]) for name, i in STAT.items()}
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

    @public
    def cache_counters(self) -> counters.CacheCounters | None:
        """This handle's row of the cache's counters, in the segment (totals: per host)."""
        return self.counters

    def close(self) -> None:
        """Release this handle (idempotent); ``before_close`` runs first. The segment stays."""
        hook, self.before_close = getattr(self, "before_close", None), None
        if hook is not None and not self._closed:
            try:
                hook()
            except Exception as e:  # closing must not raise
                warnings.warn(f"tieredkv: closing {self.name}: {e}", RuntimeWarning, stacklevel=2)
        super().close()

    @property
    def free_blocks(self) -> int:
        """Free slots right now (a hint, read without the lock): a put of more blocks evicts."""
        return int(self._h["free_top"])

    @property
    def corrupt_seen(self) -> int:
        """Blocks this handle saw change under a pinned read (a broken invariant; never returned)."""
        return int(self._stats[STAT["torn_reads"]]) if self._stats is not None else 0

    def live_handles(self) -> int:
        """Open handles (processes, or several handles in one process) attached right now."""
        return sum(1 for i in np.flatnonzero(self._owners["token"])
                   if self._owner_alive(int(i), int(self._owners[int(i)]["token"])))

    @public
    def slot_census(self) -> dict:
        """Counts of slots by state, and WRITING slots split by live and dead owners (for checks)."""
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
