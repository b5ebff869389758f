"""Prefix-aware eviction: only leaves of the prefix tree may go, in any base policy's order."""

from __future__ import annotations

import numpy as np

from .base import EvictionPolicy, make, register


@register
class PrefixAware(EvictionPolicy):
    """Evict only blocks with no resident child (leaves of the prefix tree), in ``base``'s order.

    A block's KV is only reachable through its whole prefix: evicting a parent strands its resident
    children (they can never hit again) while they keep using space. Restricting victims to leaves
    evicts prefixes from their ends, the way radix-tree caches do (SGLang's RadixAttention: L. Zheng et
    al., "SGLang: Efficient Execution of Structured Language Model Programs", NeurIPS 2024).

    ``make("prefix_aware:s3fifo")`` wraps S3-FIFO; ``make("prefix_aware")`` wraps LRU. When more
    victims are needed than there are leaves, evicting leaves makes their parents leaves and the base
    policy is asked again among those.

    Args:
        base: the policy (or name) whose order is used among the leaves.
    """

    name = "prefix_aware"

    def __init__(self, base: EvictionPolicy | str = "lru", **params):
        self.base = make(base, **params)
        self.slot_fields = self.base.slot_fields
        self.global_fields = self.base.global_fields
        self.ghost_lists = self.base.ghost_lists
        self.hit_needs_lock = self.base.hit_needs_lock

    def ghost_capacity(self, n_slots):
        return self.base.ghost_capacity(n_slots)

    def full_name(self):
        return f"{self.name}:{self.base.full_name()}"

    def on_insert(self, st, slots):
        self.base.on_insert(st, slots)

    def on_hit(self, st, slots):
        self.base.on_hit(st, slots)

    def on_remove(self, st, slots, evicted):
        self.base.on_remove(st, slots, evicted)

    def on_miss(self, st, key64s):
        self.base.on_miss(st, key64s)

    def choose(self, st, n, candidates):
        leaves = candidates & (st.n_children == 0)
        children = None
        chosen: list[np.ndarray] = []
        while n > 0 and leaves.any():
            got = np.asarray(self.base.choose(st, n, leaves), dtype=np.int64)
            if not len(got):
                break
            chosen.append(got)
            n -= len(got)
            leaves[got] = False
            # Parents whose every resident child is now chosen become leaves for the next round.
            if children is None:
                children = st.n_children.copy()
            parents = st.parent[got]
            parents = parents[parents >= 0]
            np.subtract.at(children, parents, 1)
            freed = parents[(children[parents] == 0) & candidates[parents]]
            leaves[freed] = True
        return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)

    def __repr__(self):
        return f"PrefixAware(base={self.base!r})"
