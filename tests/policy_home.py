"""A minimal home for policy tests: keys -> slots, like the hot tier's index, with exact victims."""

from __future__ import annotations

import numpy as np

from tieredkv import policies


class Home:
    """Runs one policy over ``n_slots`` slots; ``access(key)`` returns the evicted keys.

    Args:
        policy: name or policy object.
        n_slots: capacity.
        buffer: optional writable buffer: the state then lives there (``SlotState.over``) at ``offset``.
    """

    def __init__(self, policy, n_slots: int, buffer=None, offset: int = 0):
        self.policy = policies.make(policy)
        if buffer is None:
            self.st = policies.SlotState.private(self.policy, n_slots)
        else:
            self.st = policies.SlotState.over(self.policy, n_slots, buffer, offset)
            self.st.reset()
        self.slot_of: dict[int, int] = {}
        self.key_at: dict[int, int] = {}
        self.free = list(range(n_slots - 1, -1, -1))
        self.victims: list[int] = []

    def access(self, key: int, parent: int | None = None, position: int = 0) -> list[int]:
        """Hit ``key`` if resident, else evict as needed and insert it (under ``parent``'s key)."""
        s = self.slot_of.get(key)
        if s is not None:
            policies.hit(self.policy, self.st, np.array([s]))
            return []
        return self.insert([key], [parent], [position])

    def insert(self, keys, parents=None, positions=None, evictable=None) -> list[int]:
        parents = parents or [None] * len(keys)
        positions = positions or [0] * len(keys)
        need = len(keys) - len(self.free)
        got = policies.evict(self.policy, self.st, need, evictable, incoming=np.array(keys, dtype=np.int64))
        gone = [self.key_at.pop(v) for v in got.tolist()]
        for k in gone:
            del self.slot_of[k]
        self.free.extend(got.tolist())
        self.victims.extend(gone)
        slots = [self.free.pop() for _ in keys]
        for k, s in zip(keys, slots):
            self.slot_of[k], self.key_at[s] = s, k
        pslots = [self.slot_of.get(p, -1) if p is not None else -1 for p in parents]
        policies.insert(self.policy, self.st, np.array(slots), np.array(keys, dtype=np.int64),
                        np.array(pslots), np.array(positions))
        return gone

    def run(self, keys) -> list[int]:
        for k in keys:
            self.access(k)
        return self.victims
