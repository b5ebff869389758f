"""KV-aware eviction: recency shifted by a reuse probability learned online per class of block."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from .base import EvictionPolicy, register
from .order import smallest_lex
from .state import GHOST_TAG_SHIFT

# Class of a block = hits bucket x last-of-its-store flag x store-size bucket.
HIT_BUCKETS = 4           # 0, 1, 2, 3+ hits since insert
SIZE_EDGES = (4, 16)      # chunks stored together with it: < 4, 4-15, >= 16
N_SIZE = len(SIZE_EDGES) + 1
N_CLASSES = HIT_BUCKETS * 2 * N_SIZE


@register
class KVAware(EvictionPolicy):
    """Evict the block with the smallest ``last access + horizon * log-odds(reuse | class)``.

    LRU orders blocks by their last access. This policy shifts each block by how likely blocks
    like it are to be used again, learned online, so that a block from a class that is rarely reused
    (the last, partial chunk of a prompt; the first-turn tail of a long one-off document) leaves
    before a block of the same age from a class that usually comes back (the prefix of a conversation
    that already went on for several turns). The class is three cheap features known when the block
    is stored or hit:

    - its hits since insert (0, 1, 2, 3+): a conversation prefix hit again is likely to be hit again;
    - whether it is the last chunk of the store that brought it (the prompt's partial last chunk:
      the next turn appends to it, so its hash changes and it is almost never reused);
    - how many chunks that store brought (< 4, 4-15, 16+): a short follow-up message, a new
      conversation, a pasted document.

    Learning: per class, decayed counts of successes (a hit while resident, or a miss on a key still
    in the ghost list of evicted keys, which records each key's class) and of evictions;
    ``p = (successes + 1) / (successes + evictions + 2)``. Without the ghosts the estimate feeds on
    itself: a class this policy evicts early gets few hits, so it looks worse, so it goes earlier. The shift is
    ``horizon * ln(p / (1 - p))`` with ``horizon = horizon_factor x`` the mean age (ticks since last
    access) of evicted blocks, also learned: a shift of one log-odds unit keeps a block about as much
    longer as the cache keeps blocks anyway. This is the ordering that Belady's MIN would pick if
    each class's reuse times were exponential with that mean and its reuse probability ``p``; it
    follows the spirit of reuse-prediction caches (LHD: N. Beckmann, H. Chen, A. Cidon, "LHD:
    Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018; Hawkeye: A. Jain, C. Lin,
    ISCA 2016) with features specific to prompt chunks.

    Shared-memory state: per slot ``kv_class`` and ``kv_priority`` (float64); globals: the counts
    per class (float64), the mean eviction age and the log-odds table, recomputed every ``refresh``
    evictions (under the lock); one ghost list (``ghost_ratio`` x the slots) of evicted keys tagged
    with their class. A priority is fixed when it is set (on insert and hit), so choosing the
    victims is one partial sort of the candidates. A hit stores the block's new class and priority
    and adds one to a class's hit count: plain aligned word stores (a lost update under a race
    only costs one sample).

    Args:
        horizon_factor: shift per log-odds unit, in mean eviction ages. 0.25 and ``decay=0.9`` were
            chosen on the first half of the Mooncake conversation trace only (see docs/policies.md,
            which also shows where the policy loses to LRU).
        ghost_ratio: evicted keys remembered, as a share of the slots (0: no ghosts).
        decay: the counts are multiplied by this at every refresh (forgets old behaviour).
        refresh: evictions between two recomputations of the table.
    """

    name = "kv_aware"
    slot_fields = ("kv_class", "kv_priority")
    global_fields = (("kv_refresh_at", "kv_evictions", "kv_age_sum", "kv_age_n", "kv_horizon")
                     + tuple(f"kv_hits{i}" for i in range(N_CLASSES))
                     + tuple(f"kv_evicted{i}" for i in range(N_CLASSES))
                     + tuple(f"kv_logodds{i}" for i in range(N_CLASSES)))

    def __init__(self, horizon_factor: float = 0.25, ghost_ratio: float = 2.0, decay: float = 0.9,
                 refresh: int = 1024):
        if ghost_ratio < 0:
            raise InvalidInput(f"ghost_ratio must be >= 0, got {ghost_ratio}")
        self.ghost_ratio = float(ghost_ratio)
        if horizon_factor < 0:
            raise InvalidInput(f"horizon_factor must be >= 0, got {horizon_factor}")
        if not 0 < decay <= 1:
            raise InvalidInput(f"decay must be in (0, 1], got {decay}")
        if refresh < 1:
            raise InvalidInput(f"refresh must be >= 1, got {refresh}")
        self.horizon_factor = float(horizon_factor)
        self.decay = float(decay)
        self.refresh = int(refresh)

    # ---- the state's tables -------------------------------------------------------------------
    @staticmethod
    def _tables(st) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hits, evictions, log-odds) per class: float64 views of the global words."""
        g = st.globals_view(np.float64)
        at = st.global_index("kv_hits0")
        return (g[at:at + N_CLASSES], g[at + N_CLASSES:at + 2 * N_CLASSES],
                g[at + 2 * N_CLASSES:at + 3 * N_CLASSES])

    def _set_priority(self, st, slots: np.ndarray) -> None:
        logodds = self._tables(st)[2]
        st.f64("kv_priority")[slots] = (st.last_access[slots]
                                        + st.gf("kv_horizon") * logodds[st.kv_class[slots]])

    # ---- hooks --------------------------------------------------------------------------------
    def on_insert(self, st, slots):
        size_bucket = int(np.searchsorted(SIZE_EDGES, len(slots), side="right"))
        last = np.zeros(len(slots), dtype=np.int64)
        last[-1] = 1
        st.kv_class[slots] = last * N_SIZE + size_bucket   # hits bucket 0
        self._set_priority(st, slots)

    def on_hit(self, st, slots):
        cls = st.kv_class[slots]
        hits = self._tables(st)[0]
        np.add.at(hits, cls, 1.0)
        stride = 2 * N_SIZE
        bucket = np.minimum(cls // stride + 1, HIT_BUCKETS - 1)
        st.kv_class[slots] = bucket * stride + cls % stride
        self._set_priority(st, slots)

    ghost_lists = 1

    def ghost_capacity(self, n_slots):
        return int(self.ghost_ratio * n_slots)

    def on_miss(self, st, key64s):
        if not self.ghost_ratio:
            return
        lists, flags = st.ghost_lookup(key64s)
        back = lists >= 0
        if back.any():
            # An evicted block asked for again: it would have been a hit. Counting it as a success
            # of its class keeps the estimate honest for classes this policy evicts early.
            np.add.at(self._tables(st)[0], flags[back] >> GHOST_TAG_SHIFT, 1.0)
            for key in key64s[back].tolist():
                st.ghost_remove(key)

    def on_remove(self, st, slots, evicted):
        if not evicted:
            return
        np.add.at(self._tables(st)[1], st.kv_class[slots], 1.0)
        if self.ghost_ratio:
            st.ghost_push(st.key64[slots], 0, fresh=True, tags=st.kv_class[slots])
        st.set_gf("kv_age_sum", st.gf("kv_age_sum") + float(np.sum(st.g("tick") - st.last_access[slots])))
        st.set_gf("kv_age_n", st.gf("kv_age_n") + len(slots))
        if st.add_g("kv_evictions", len(slots)) >= st.g("kv_refresh_at"):
            self._relearn(st)

    def _relearn(self, st) -> None:
        """Recompute the log-odds table and the horizon from the counts, then decay the counts."""
        hits, evicted, logodds = self._tables(st)
        p = (hits + 1.0) / (hits + evicted + 2.0)
        logodds[:] = np.log(p / (1.0 - p))
        n = st.gf("kv_age_n")
        if n > 0:
            st.set_gf("kv_horizon", self.horizon_factor * st.gf("kv_age_sum") / n)
        hits *= self.decay
        evicted *= self.decay
        st.set_gf("kv_age_sum", st.gf("kv_age_sum") * self.decay)
        st.set_gf("kv_age_n", n * self.decay)
        st.set_g("kv_refresh_at", st.g("kv_evictions") + self.refresh)

    def choose(self, st, n, candidates):
        return smallest_lex(st.f64("kv_priority"), st.last_access, n, candidates)

    def __repr__(self):
        return (f"KVAware(horizon_factor={self.horizon_factor}, ghost_ratio={self.ghost_ratio}, "
                f"decay={self.decay}, refresh={self.refresh})")


__all__ = ["KVAware", "N_CLASSES"]
