"""First in, first out: evict the oldest insert; hits change nothing."""

from __future__ import annotations

from .base import EvictionPolicy, register
from .order import oldest


@register
class FIFO(EvictionPolicy):
    """First in, first out: the victim is the block inserted longest ago, whatever its hits."""

    name = "fifo"

    def choose(self, st, n, candidates):
        return oldest(st.insert_tick, n, candidates)
