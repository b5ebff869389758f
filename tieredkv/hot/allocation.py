"""Where a hot-tier store finds its slots: the allocation ladder and the choice of victims.

A store needs one slot per new block. It takes them, under the segment lock, in this order: free
slots; the slots of writers that died mid-copy; victims the eviction policy picks among READY,
unpinned blocks (at least ``EVICT_BATCH_FRACTION`` of the segment at a time); dead writers' slots once
more. Every slot it takes is claimed (WRITING by this handle, for one call) until the call publishes
or gives it back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tieredkv import policies
from tieredkv.hot.damage import POLICY_FAULTS, Damage
from tieredkv.hot.recovery import Recovery
from tieredkv.hot.segment import READY, WRITING
from tieredkv.hot.slots import STAT
from tieredkv.keys import ChunkKeys
from tieredkv.tier import Evicted


class Allocation(Recovery):
    """The allocation ladder of ``HotTier.put_many`` and the victims of ``HotTier.evict``."""

    #: Evict at least this fraction of the slots whenever eviction runs: the policy's O(n_slots) pass is
    #: then paid once per n_slots/512 blocks, so the per-block cost stays flat as the segment grows.
    EVICT_BATCH_FRACTION = 1 / 512

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

    def _choose_victims(self, n: int, incoming: np.ndarray | None, claim: int) -> tuple[np.ndarray, Evicted]:
        """Let the policy pick up to ``n`` READY, unpinned victims and detach them from the index and
        the policy: they become WRITING by us (generation odd), with their key zeroed, until reused
        or freed. Returns the victims and what they held (keys, hit counts; bytes still in place)."""
        rec = self._slots
        evictable = (rec["state"] == READY) & (rec["pins"] == 0)
        try:
            victims = policies.evict(self._policy, self._state, n, evictable, incoming=incoming)
        except POLICY_FAULTS as e:  # base.evict also checks what the policy chose (CorruptState)
            raise Damage(f"policy state: {e}") from e
        if len(victims) < min(n, int(np.count_nonzero(evictable))) and not self._retrying:
            # A policy evicts min(n, candidates) (the conformance suite holds every one to it), so
            # fewer means damaged state (residency, child counts, queue marks) that would refuse
            # stores from now on.
            raise Damage(f"the policy chose {len(victims)} of {n} victims among evictable blocks")
        old = Evicted(ChunkKeys(rec["key"][victims].copy(), rec["parent"][victims].copy(),
                                self._tokens[victims].copy(), 0, rec["position"][victims].astype(np.int64)),
                      None, self._state.hits[victims].copy())  # remove() leaves hits: demotion rules use them
        if len(victims):
            self._claim(victims, claim)
            self._index.remove(victims, old.keys.keys)
            rec["key"][victims] = 0
            self._stats[STAT["evictions"]] += len(victims)
        return victims, old

    def _reclaim_abandoned(self, found: np.ndarray) -> int:
        """Free WRITING slots among ``found`` whose writer died, so their keys can be stored again.
        Returns how many were freed."""
        rec = self._slots
        cand = found[found >= 0]
        # Not this handle's live claims (another thread's put in flight); its own abandoned ones (an
        # interrupted put zeroes their token) are dead like anyone's.
        ours = (rec["owner"][cand] == self._owner) & (rec["owner_token"][cand] == self._token)
        cand = cand[(rec["state"][cand] == WRITING) & ~ours]
        dead = [s for s in cand.tolist()
                if not self._owner_alive(int(rec["owner"][s]), int(rec["owner_token"][s]))]
        if dead:
            self._free_slots(np.asarray(dead, dtype=np.int64))
            self._stats[STAT["reclaimed"]] += len(dead)
        return len(dead)
