"""Least recently used: evict the smallest ``last_access``."""

from __future__ import annotations

import numpy as np

from .base import EvictionPolicy, register


def oldest(field: np.ndarray, n: int, candidates: np.ndarray) -> np.ndarray:
    """The ``n`` candidate slots with the smallest ``field`` values, smallest first."""
    slots = np.flatnonzero(candidates)
    if n < len(slots):
        part = np.argpartition(field[slots], n - 1)[:n]
        slots = slots[part]
    return slots[np.argsort(field[slots], kind="stable")][:n]


@register
class LRU(EvictionPolicy):
    name = "lru"

    def choose(self, st, n, candidates):
        return oldest(st.last_access, n, candidates)
