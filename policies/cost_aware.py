"""Cost-aware eviction: keep the blocks whose expected reuse times recompute cost is highest."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from .base import EvictionPolicy, register
from .order import smallest_lex


@register
class CostAware(EvictionPolicy):
    """Evict the block of least value, value = expected reuse x recompute cost.

    ``cost(position) = 1 + position_weight * position`` models the prefill work a block saves: a
    chunk's MLP/projection work is the same at every position, its attention work grows with the
    number of tokens before it, so deep chunks (long shared prompts) cost more to recompute.
    Expected reuse is the block's hit count, aged the GreedyDual way so that old popularity fades::

        priority = L + (hits + 1) * cost(position)     (set on insert and on every hit)
        victim   = smallest priority (ties: least recently used); then L = victim's priority

    This is GreedyDual-Size-Frequency with size 1 (P. Cao, S. Irani, "Cost-Aware WWW Proxy Caching
    Algorithms", USITS 1997; L. Cherkasova, "Improving WWW Proxy Performance with
    Greedy-Dual-Size-Frequency Caching Policy", HP Labs TR HPL-98-69, 1998). The inflation ``L``
    rises to each victim's priority, so a block not hit for a while sinks below fresh ones.

    A hit is one plain store of ``ca_priority`` (reading ``L`` without the lock is fine).

    Args:
        position_weight: extra cost per chunk of depth (default 1/64: with 512-token chunks, a chunk at
            32k tokens costs twice one at position 0, about where attention matches the MLP work of
            an 8B model).
    """

    name = "cost_aware"
    slot_fields = ("ca_priority",)
    global_fields = ("ca_inflation",)

    def __init__(self, position_weight: float = 1 / 64):
        if position_weight < 0:
            raise InvalidInput(f"position_weight must be >= 0, got {position_weight}")
        self.position_weight = float(position_weight)

    def cost(self, positions: np.ndarray) -> np.ndarray:
        """Recompute cost of chunks at ``positions`` (1.0 at position 0)."""
        return 1.0 + self.position_weight * np.asarray(positions, dtype=np.float64)

    def _set(self, st, slots):
        st.f64("ca_priority")[slots] = st.gf("ca_inflation") + (st.hits[slots] + 1) * self.cost(st.position[slots])

    def on_insert(self, st, slots):
        self._set(st, slots)

    def on_hit(self, st, slots):
        self._set(st, slots)

    def choose(self, st, n, candidates):
        prio = st.f64("ca_priority")
        victims = smallest_lex(prio, st.last_access, n, candidates)
        if len(victims):
            st.set_gf("ca_inflation", max(st.gf("ca_inflation"), float(prio[victims[-1]])))
        return victims

    def __repr__(self):
        return f"CostAware(position_weight={self.position_weight})"
