"""Offline optima: Belady's MIN over block ids, and why it is also the prefix-respecting optimum.

``belady(trace, capacity)`` replays the trace's block accesses one by one, as libCacheSim does, and
on a miss with the cache full evicts the block whose next access is farthest in the future
(L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems
Journal 5(2), 1966). With ``bypass=True`` (the default) a missing block whose own next access is
farther than every cached block's is not stored at all: the optimum when admission is a choice too,
as it is for every policy here (a policy may evict a block as soon as it is stored). Without bypass
it is libCacheSim's ``Belady`` (the tests check the two agree access for access).

**Prefix optimum.** A chunk's KV is usable only while its whole parent chain is cached, so what a
prefix cache can really reuse is the *prefix* hit count (blocks before a request's first miss). No
policy's prefix hits exceed its block hits, and no policy's block hits exceed MIN's. On a prefix-tree
trace (every block id always has the same parent, the block before it in the prompt; Mooncake's
``hash_ids`` are built that way) MIN with bypass, ties broken towards the deepest block, never holds
a block without its parent:

- a parent is accessed in every request that accesses its child, before it, so a cached parent's
  next access is strictly earlier than any cached child's: the farthest block is always a leaf
  (blocks never accessed again tie at "never"; the deepest of them is a leaf too);
- a child missing right after its parent was bypassed is bypassed too (its next access is later);

so every block hit of that schedule is a prefix hit. Its prefix hit ratio therefore equals its
block hit ratio, which bounds every policy's block *and* prefix hit ratio: on a prefix-tree trace it
is the exact prefix-respecting optimum (``exact_prefix`` in the result). On other traces it is an
upper bound of the prefix optimum, and ``prefix_hit_ratio`` reports what the MIN schedule itself
gets.

The simulator's replay (one lookup per request, then one batched store with the request's hits
pinned) can only do what a per-block replay can do (its evictions never touch the blocks of the
request being served), so these numbers bound it too.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from tieredkv.errors import InvalidInput

from .trace import Trace

__all__ = ["belady", "gap_closed", "is_prefix_tree", "next_use"]


def next_use(blocks: np.ndarray) -> np.ndarray:
    """Index of the next access of the same block after each access (``len(blocks)``: never)."""
    blocks = np.asarray(blocks, dtype=np.int64)
    n = len(blocks)
    order = np.lexsort((np.arange(n), blocks))
    nxt = np.full(n, n, dtype=np.int64)
    same = blocks[order[1:]] == blocks[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _depths(trace: Trace) -> np.ndarray:
    """Each access's index in its request (its depth in the prefix tree on a prefix-tree trace)."""
    lengths = np.diff(trace.offsets)
    return np.arange(trace.n_accesses, dtype=np.int64) - np.repeat(trace.offsets[:-1], lengths)


def is_prefix_tree(trace: Trace) -> bool:
    """True if every block id always follows the same block (or always starts its request)."""
    if not trace.n_accesses:
        return True
    depth = _depths(trace)
    prev = np.empty_like(trace.blocks)
    prev[1:] = trace.blocks[:-1]
    prev[depth == 0] = -1
    order = np.argsort(trace.blocks, kind="stable")
    b, p = trace.blocks[order], prev[order]
    same = b[1:] == b[:-1]
    return bool(np.all(p[1:][same] == p[:-1][same]))


def belady(trace: Trace, capacity_blocks: int, *, bypass: bool = True) -> dict:
    """Belady's MIN over the trace's block accesses, one at a time.

    Args:
        trace: the requests.
        capacity_blocks: cache size in blocks.
        bypass: a missing block whose next access is farther than every cached block's is not
            stored (the optimum with admission); False: always stored (libCacheSim's ``Belady``).

    Returns:
        ``{"policy": "belady", "capacity_blocks", "block_hit_ratio", "prefix_hit_ratio", "hits",
        "prefix_hits", "accesses", "bypass", "exact_prefix", "seconds"}``; ``exact_prefix``: the
        prefix hit ratio is the exact prefix-respecting optimum (a prefix-tree trace, with bypass).

    Raises:
        InvalidInput: capacity not positive.
    """
    if capacity_blocks <= 0:
        raise InvalidInput(f"capacity_blocks must be positive, got {capacity_blocks}")
    t0 = time.perf_counter()
    cap = int(capacity_blocks)
    nxt = next_use(trace.blocks).tolist()
    depth = _depths(trace).tolist()
    blocks = trace.blocks.tolist()
    offsets = trace.offsets.tolist()
    cached: dict[int, int] = {}     # block -> its next access (the heap entry that is current)
    # Max-heap by (next access, depth) as negated tuples; stale entries are skipped when popped.
    heap: list[tuple[int, int, int]] = []
    hits = prefix_hits = 0
    for r in range(trace.n_requests):
        leading = True
        for t in range(offsets[r], offsets[r + 1]):
            b, nu = blocks[t], nxt[t]
            if b in cached:
                hits += 1
                prefix_hits += leading
                cached[b] = nu
                heapq.heappush(heap, (-nu, -depth[t], b))
                continue
            leading = False
            if len(cached) >= cap:
                while cached.get(heap[0][2]) != -heap[0][0]:
                    heapq.heappop(heap)
                far_nu, far_depth, victim = heap[0]
                if bypass and (nu, depth[t]) >= (-far_nu, -far_depth):
                    continue
                heapq.heappop(heap)
                del cached[victim]
            cached[b] = nu
            heapq.heappush(heap, (-nu, -depth[t], b))
    n = max(trace.n_accesses, 1)
    return {"policy": "belady", "capacity_blocks": cap, "block_hit_ratio": hits / n,
            "prefix_hit_ratio": prefix_hits / n, "hits": hits, "prefix_hits": prefix_hits,
            "accesses": trace.n_accesses, "bypass": bypass,
            "exact_prefix": bool(bypass and is_prefix_tree(trace)),
            "seconds": round(time.perf_counter() - t0, 4)}


def gap_closed(hit_ratio: float, baseline: float, optimum: float) -> float | None:
    """Fraction of the baseline-to-optimum gap a hit ratio closes (None when there is no gap)."""
    gap = optimum - baseline
    if gap <= 1e-12:
        return None
    return (hit_ratio - baseline) / gap
