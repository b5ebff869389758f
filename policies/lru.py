"""Least recently used: evict the smallest ``last_access``."""

from __future__ import annotations

from .base import EvictionPolicy, register
from .order import oldest

__all__ = ["LRU", "oldest"]


@register
class LRU(EvictionPolicy):
    """Least recently used: the victim is the block whose last insert or hit is oldest.

    Hits are one plain store (``last_access``), so they never need the lock.
    """

    name = "lru"

    def choose(self, st, n, candidates):
        return oldest(st.last_access, n, candidates)
