"""KV-aware eviction: recency shifted by a reuse probability learned online per class of block, and
superseded or stranded prefix branches evicted first."""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidInput

from .base import EvictionPolicy, register
from .order import smallest_lex
from .state import GHOST_TAG_SHIFT

# Class of a block = hits bucket x store-start bucket x last-of-its-store flag x store-size bucket.
HIT_BUCKETS = 4           # 0, 1, 2, 3+ hits since insert
START_EDGES = (2, 16)     # prompt position of the store's first chunk: < 2, 2-15, >= 16
N_START = len(START_EDGES) + 1
SIZE_EDGES = (4, 16)      # chunks stored together with it: < 4, 4-15, >= 16
N_SIZE = len(SIZE_EDGES) + 1
N_CLASSES = HIT_BUCKETS * N_START * 2 * N_SIZE
#: Classes per hits bucket (the hits bucket is the class index's most significant part).
HIT_STRIDE = N_START * 2 * N_SIZE
#: Ghost tags hold the class in their low bits and the block's last access tick above them.
CLASS_BITS = 7
CLASS_MASK = (1 << CLASS_BITS) - 1
assert N_CLASSES <= CLASS_MASK + 1
#: Subtracted from a demoted block's priority: below every class-shifted priority, so demoted
#: blocks go first, among themselves by recency. A power of two: exact in float64 with any tick.
DEMOTED = float(2 ** 52)


@register
class KVAware(EvictionPolicy):
    """Evict the block with the smallest ``last access + horizon * log-odds(reuse | class)``; blocks of
    a superseded or stranded prefix branch first.

    LRU orders blocks by their last access. This policy shifts each block by how likely blocks
    like it are to be used again, learned online, so that a block from a class that is rarely reused
    (the last, partial chunk of a prompt; the new chunks of a follow-up to a long prompt) leaves
    before a block of the same age from a class that usually comes back. The class is four cheap
    features known when the block is stored or hit:

    - its hits since insert (0, 1, 2, 3+; a recalled block, below, counts on from its old class);
    - where the store that brought it starts in the prompt (< 2, 2-15, 16+ chunks already cached: a
      new prompt, a follow-up to a short one, a follow-up to a long one);
    - whether it is the last chunk of the store that brought it (the prompt's partial last chunk:
      the next turn appends to it, so its hash changes and it is almost never reused);
    - how many chunks that store brought (< 4, 4-15, 16+).

    The store's two features count only its chunks that are not recalled (below): a follow-up whose
    prefix this cache dropped stores that prefix again, but what it adds is still a follow-up's.

    Learning: per class, decayed counts of successes (a hit while resident, or a store of a key still
    in the ghost list of evicted keys, which records each key's class and last access) and of
    evictions; ``p = (successes + 1) / (successes + evictions + 2)``. Without the ghosts the estimate
    feeds on itself: a class this policy evicts early gets few hits, so it looks worse, so it goes
    earlier. The shift is ``horizon * (ln(p / (1 - p)) - ln(p_ref / (1 - p_ref)))``, ``p_ref`` being
    the most observed class's, with ``horizon = horizon_factor x`` the mean **reuse time** of stored
    blocks (ticks from a block's store to its first reuse, over resident hits and stores of ghost
    keys), also learned: with a reuse that comes with probability ``p`` after an exponential time of
    that mean, the chance of a reuse in the next instant ranks blocks as ``ln(p / (1 - p)) - age /
    mean``, which is this order. Measuring against the reference class keeps the common class in pure LRU order: a
    priority is fixed when it is set, so an absolute shift would carry every refresh's drift of the
    table and of the horizon into the order of blocks set at different times.

    **Recall**: a block stored again while its key is still a ghost gets back the class it was
    evicted with, one hit up (its reuse is a hit that came late), instead of starting as a fresh
    block of its new store: its history says more about it than the store that brings it back.

    Two rules from the prefix tree, with no learning (``supersede``, ``orphans``):

    - **superseded branch**: when a store extends a block that has exactly one other resident child,
      that child is demoted (evicted first). A conversation's next turn replaces the previous turn's
      partial last chunk with a full one, and an edited or regenerated turn replaces the old one; on
      the Mooncake traces the older branch is used again after that in 11 of 4,532 cases
      (conversation) and 94 of 1,569 (synthetic). Blocks with more children (a shared system
      prompt's) are left alone: their children are different conversations.
    - **stranded blocks**: when a block is evicted, its resident children are demoted: without their
      parent they can never be part of a prefix hit.

    A demoted block keeps its recency order among the demoted; a hit gives it its class priority
    back; its eviction counts against its class like any other.

    This follows the spirit of reuse-prediction caches (LHD: N. Beckmann, H. Chen, A. Cidon, "LHD:
    Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018; Hawkeye: A. Jain, C. Lin,
    ISCA 2016) with features specific to prompt chunks, and the ordering Belady's MIN would pick if
    each class's reuse times were exponential with that mean and its reuse probability ``p``.

    Shared-memory state: per slot ``kv_class`` and ``kv_priority`` (float64); globals: the counts
    per class (float64), the reuse-time sums, the number of recalled blocks and the log-odds table,
    recomputed every ``refresh`` evictions (under the lock); one ghost list (``ghost_ratio`` x the
    slots) of evicted keys tagged with their class and last access tick. Choosing the victims is one
    partial sort of the candidates. A hit stores the block's new class and priority and adds to a
    class's hit count and the reuse-time sums: plain aligned word stores (a lost update under a race
    only costs one sample). The two rules run in ``insert`` and ``evict`` (under the lock), each a
    pass over the parent field when it applies; recall is one ghost lookup of the stored keys.

    Args:
        horizon_factor: shift per log-odds unit, in mean reuse times. 0.7 and ``decay=0.97`` were
            chosen on the first half of the Mooncake conversation trace only (see docs/policies.md,
            which also shows how far it gets).
        ghost_ratio: evicted keys remembered, as a share of the slots (0: no ghosts).
        decay: the counts are multiplied by this at every refresh (forgets old behaviour).
        refresh: evictions between two recomputations of the table.
        supersede: apply the superseded-branch rule.
        orphans: apply the stranded-block rule.
        last_first: demote a store's last chunk when it is stored fresh (not recalled from the
            ghosts): a prompt's partial last chunk, used again 0.7% of the time on the first half
            of the Mooncake conversation trace. Off by default: on that half it gained at 20% and
            lost a little at 5% (docs/policies.md).
    """

    name = "kv_aware"
    slot_fields = ("kv_class", "kv_priority")
    global_fields = (("kv_refresh_at", "kv_evictions", "kv_reuse_sum", "kv_reuse_n", "kv_horizon", "kv_recalled")
                     + tuple(f"kv_hits{i}" for i in range(N_CLASSES))
                     + tuple(f"kv_evicted{i}" for i in range(N_CLASSES))
                     + tuple(f"kv_logodds{i}" for i in range(N_CLASSES)))

    def __init__(self, horizon_factor: float = 0.7, ghost_ratio: float = 2.0, decay: float = 0.97,
                 refresh: int = 1024, supersede: bool = True, orphans: bool = True, last_first: bool = False):
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
        self.supersede = bool(supersede)
        self.orphans = bool(orphans)
        self.last_first = bool(last_first)

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
        back, tags = self._ghosts(st, slots)
        # The store's features describe what it adds: blocks recalled from the ghosts are a prefix
        # this cache dropped, not part of the new text (a follow-up whose prefix was evicted is
        # still a follow-up).
        fresh = slots if back is None or not back.any() else slots[~back]
        if not len(fresh):
            fresh = slots
        start = int(np.searchsorted(START_EDGES, int(st.position[fresh[0]]), side="right"))
        size_bucket = int(np.searchsorted(SIZE_EDGES, len(fresh), side="right"))
        last = np.zeros(len(slots), dtype=np.int64)
        last[-1] = 1
        classes = (start * 2 + last) * N_SIZE + size_bucket              # hits bucket 0
        if back is not None and back.any():
            self._recall(st, slots, classes, back, tags)
        st.kv_class[slots] = classes
        self._set_priority(st, slots)
        if self.supersede:
            self._demote_superseded(st, slots)
        if self.last_first and (back is None or not back[-1]):
            self._demote(st, slots[-1:])

    def _demote_superseded(self, st, slots) -> None:
        """Demote the other child of every block this store extends that now has exactly two."""
        forks = st.parent[slots]
        forks = forks[forks >= 0]
        forks = forks[st.n_children[forks] == 2]
        if not len(forks):                              # the common case: no pass over the slots
            return
        forks = np.setdiff1d(forks, slots)              # blocks of this store are not forks it extends
        if not len(forks):
            return
        fork = np.zeros(st.n_slots + 1, dtype=bool)     # index -1 (no parent) lands on the spare entry
        fork[forks] = True
        older = fork[st.parent] & (st.resident == 1)
        older[slots] = False
        self._demote(st, np.flatnonzero(older))

    def _ghosts(self, st, slots):
        """(is a ghost, its tag) per stored block; (None, None) without ghosts."""
        if not self.ghost_ratio:
            return None, None
        lists, flags = st.ghost_lookup(st.key64[slots])
        return lists >= 0, flags >> GHOST_TAG_SHIFT

    def _recall(self, st, slots, classes, back, tags) -> None:
        """Blocks stored while their key is a ghost (``back``): each is a success of the class it was
        evicted with (it would have been a hit), and comes back in that class one hit up (in
        ``classes``)."""
        tags = tags[back]
        old = tags & CLASS_MASK
        # Counting these successes keeps the estimate honest for the classes this policy evicts early.
        np.add.at(self._tables(st)[0], old, 1.0)
        first = old < HIT_STRIDE
        if first.any():
            self._reuse_times(st, st.g("tick") - (tags[first] >> CLASS_BITS))
        classes[back] = np.minimum(old // HIT_STRIDE + 1, HIT_BUCKETS - 1) * HIT_STRIDE + old % HIT_STRIDE
        for key in st.key64[slots[back]].tolist():
            st.ghost_remove(key)
        st.add_g("kv_recalled", int(back.sum()))

    @staticmethod
    def _reuse_times(st, ages) -> None:
        """Add samples of a stored block's time to its first reuse (decayed at each refresh)."""
        g = st.globals_view(np.float64)
        at = st.global_index("kv_reuse_sum")             # kv_reuse_n follows it
        g[at] += float(np.sum(ages))
        g[at + 1] += len(ages)

    @staticmethod
    def _demote(st, slots) -> None:
        st.f64("kv_priority")[slots] = st.last_access[slots] - DEMOTED

    def on_hit(self, st, slots):
        cls = st.kv_class[slots]
        first = cls < HIT_STRIDE                  # hits bucket 0: never hit since stored
        if first.any():
            self._reuse_times(st, st.last_access[slots[first]] - st.insert_tick[slots[first]])
        hits = self._tables(st)[0]
        np.add.at(hits, cls, 1.0)
        bucket = np.minimum(cls // HIT_STRIDE + 1, HIT_BUCKETS - 1)
        st.kv_class[slots] = bucket * HIT_STRIDE + cls % HIT_STRIDE
        self._set_priority(st, slots)

    ghost_lists = 1

    def ghost_capacity(self, n_slots):
        return int(self.ghost_ratio * n_slots)

    def on_remove(self, st, slots, evicted):
        if not evicted:
            return
        # Demoted blocks count as their class's evictions too: a superseded block is a dead block of
        # its class (most are partial last chunks), which is what the class's odds should say.
        if self.orphans and (st.n_children[slots] > 0).any():
            gone = np.zeros(st.n_slots + 1, dtype=bool)   # index -1 (no parent) lands on the spare entry
            gone[slots] = True
            stranded = gone[st.parent]
            stranded[slots] = False
            self._demote(st, np.flatnonzero(stranded))
        np.add.at(self._tables(st)[1], st.kv_class[slots], 1.0)
        if self.ghost_ratio:
            st.ghost_push(st.key64[slots], 0, fresh=True,
                          tags=st.kv_class[slots] | (st.last_access[slots] << CLASS_BITS))
        if st.add_g("kv_evictions", len(slots)) >= st.g("kv_refresh_at"):
            self._relearn(st)

    def _relearn(self, st) -> None:
        """Recompute the log-odds table and the horizon from the counts, then decay the counts."""
        hits, evicted, logodds = self._tables(st)
        p = (hits + 1.0) / (hits + evicted + 2.0)
        logodds[:] = np.log(p / (1.0 - p))
        logodds -= logodds[int(np.argmax(hits + evicted))]   # the most observed class: no shift
        n = st.gf("kv_reuse_n")
        if n > 0:
            st.set_gf("kv_horizon", self.horizon_factor * st.gf("kv_reuse_sum") / n)
        hits *= self.decay
        evicted *= self.decay
        st.set_gf("kv_reuse_sum", st.gf("kv_reuse_sum") * self.decay)
        st.set_gf("kv_reuse_n", n * self.decay)
        st.set_g("kv_refresh_at", st.g("kv_evictions") + self.refresh)

    def choose(self, st, n, candidates):
        return smallest_lex(st.f64("kv_priority"), st.last_access, n, candidates)

    def __repr__(self):
        return (f"KVAware(horizon_factor={self.horizon_factor}, ghost_ratio={self.ghost_ratio}, "
                f"decay={self.decay}, refresh={self.refresh}, supersede={self.supersede}, "
                f"orphans={self.orphans}, last_first={self.last_first})")


__all__ = ["KVAware", "N_CLASSES", "N_SIZE", "N_START"]
