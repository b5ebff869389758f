"""Crash safety of a hot segment: the critical section, owner liveness, reclaiming what the dead
left, and the scrub that rebuilds derived metadata from the slot table.

Invariant 6 of docs/architecture.md: the lock holder marks the header ``dirty`` on entry and clears it
on exit. A holder that finds ``dirty`` set knows the previous holder died inside a critical section
and scrubs: it rebuilds the index, the free stack, the pin counts and the policy's residency from the
slot table. A WRITING slot or a pin whose owner is dead is reclaimed by the next process that runs
short of space (owner = registry index + token; liveness = the owner's registry lock is held).
"""

from __future__ import annotations

import fcntl
import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from tieredkv import policies
from tieredkv.hot import batch, locks
from tieredkv.hot import segment as seg
from tieredkv.hot.damage import POLICY_FAULTS, Damage
from tieredkv.hot.segment import FREE, READY, WRITING
from tieredkv.hot.slots import STAT, SlotTable

_T = TypeVar("_T")


class Recovery(SlotTable):
    """Critical sections over a segment's metadata, and the repairs they run."""

    _tlock: threading.Lock  # threads sharing this handle take turns in critical sections
    _tlock_holder: int = 0  # the thread inside one (threading.get_ident), 0 when none
    _fd: int  # the segment's descriptor: its byte-range locks are the segment lock and the registry
    lock_timeout_s: float  # bound on every lock wait
    _closed: bool
    _pid: int  # the process that opened this handle (a forked child reattaches)

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
    #
    # A thread that is inside one already and enters again (a signal handler that closes the cache
    # while the interrupted code held the lock) would wait for itself for ever: it gets ``LockTimeout``
    # at once instead (``close`` then warns and drops the mapping; the segment sees a holder that
    # died inside, and the next holder scrubs).
    def _locked(self, body: Callable[[], _T]) -> _T:
        """Run ``body()`` as a critical section (see above) and return what it returns."""
        me = locks.refuse_reentry(self._tlock, self._tlock_holder, f"segment {self.name}'s critical section")
        with self._tlock:
            self._tlock_holder = me
            try:
                self._enter()
                result = body()
                self._h["dirty"] = 0
                return result
            finally:
                fcntl.fcntl(self._fd, locks.SETLK, locks.UNLOCK_META)
                self._tlock_holder = 0

    def _enter(self) -> None:
        """Take the metadata lock; repair first if the previous holder died inside (or if a reader
        dropped its pins without the lock); mark the header dirty. Call as shown above."""
        locks.acquire(self._fd, locks.META_LOCK_BYTE, self.lock_timeout_s, f"segment {self.name} lock")
        h = self._h
        if int(h["dirty"]):
            try:
                self._scrub()
            except (Damage, *POLICY_FAULTS):
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
                    except (Damage, *POLICY_FAULTS):
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
        self._stats[STAT["reclaimed"]] += len(mine)
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
            self._stats[STAT["reclaimed"]] += len(orphans)
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

    def _release_pins(self) -> None:
        """Drop this handle's pins (the list in its owner row) from the counts. Under the lock."""
        me = self._owners[self._owner]
        n_pins = int(me["n_pins"])
        if n_pins:
            listed = me["pins"][: min(n_pins, seg.MAX_PINS)]
            if n_pins > seg.MAX_PINS or (listed < 0).any() or (listed >= self.n_slots).any():
                self._h["repin"] = 1  # a damaged pin list: count again from every row
            else:
                batch.drop_pins(self._words, listed, batch.one_run(listed))
            me["n_pins"] = 0

    # ---- repair ----------------------------------------------------------------------------------
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
        self._stats[STAT["recoveries"]] += 1
