"""Least frequently used, ties broken by least recent use."""

from __future__ import annotations

from .base import EvictionPolicy, register
from .order import smallest_lex


@register
class LFU(EvictionPolicy):
    """Least frequently used: the victim has the fewest hits since it was inserted.

    In-cache LFU (counts start at zero on insert, no history of evicted blocks); among equal counts
    the least recently used goes first, so a block that was hit long ago does not stay forever.
    """

    name = "lfu"

    def choose(self, st, n, candidates):
        return smallest_lex(st.hits, st.last_access, n, candidates)
