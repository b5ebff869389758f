"""Replay a trace through the real policy code on a private slot state.

The simulator is a home like the hot tier: it keeps its own block id -> slot map and calls exactly
``policies.hit`` / ``evict`` / ``insert``, so a policy decides here as it would in shared memory.

Per request (the way a prefix cache serves a prompt):

1. look up every block; resident ones are hits (``hit`` on them, in prompt order);
2. the blocks that missed are stored: ``evict`` frees room for them (with ``incoming`` = their keys),
   then ``insert`` adds them, each with its parent (the block before it in the prompt) and position.
   The blocks the request just hit are not evictable meanwhile (a serving engine holds them while it
   prefills the rest), so a request never evicts its own prefix. A request with more missing blocks
   than there is evictable room stores its leading blocks only.

Hit ratios: block hit ratio = hits / block accesses (every resident block counts); prefix hit ratio
= blocks before the request's first miss / block accesses (what a prefix cache can really reuse).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from tieredkv import policies
from tieredkv.errors import InvalidInput
from tieredkv.policies import _jit
from tieredkv.policies import demotion as demotion_rules
from tieredkv.policies import promotion as promotion_rules

from . import fastloop
from .optimal import belady, gap_closed
from .trace import Trace

__all__ = ["resolve_capacity", "simulate", "simulate_tiered", "run_simulation"]


def resolve_capacity(capacity: int | str, unique_blocks: int) -> int:
    """Capacity in blocks from ``1000`` / ``"1000"`` (blocks) or ``"5%"`` (of the trace's unique blocks).

    Raises:
        InvalidInput: not a positive count or percentage.
    """
    text = str(capacity).strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not pct > 0:
                raise ValueError
            return max(1, int(round(pct / 100.0 * unique_blocks)))
        blocks = int(text)
        if blocks <= 0:
            raise ValueError
        return blocks
    except ValueError:
        raise InvalidInput(f"capacity {capacity!r}: give a positive number of blocks (1000) or a "
                           f"percentage of the trace's unique blocks (5%)") from None


class _Cache:
    """One level: a policy, its private state, and the simulator's block id <-> slot maps."""

    def __init__(self, policy: policies.EvictionPolicy, capacity: int, n_ids: int):
        self.policy = policy
        self.capacity = capacity
        self.st = policies.SlotState.private(policy, capacity)
        self.slot_of = np.full(n_ids, -1, dtype=np.int64)
        self.block_at = np.full(capacity, -1, dtype=np.int64)
        self.free = list(range(capacity - 1, -1, -1))   # stack; pops 0, 1, 2, ...
        self.evictions = 0

    def store(self, ids: np.ndarray, positions: np.ndarray, parent_ids: np.ndarray,
              pinned: np.ndarray | None = None) -> tuple[np.ndarray, tuple]:
        """Insert ``ids`` (not resident), evicting as needed but never the ``pinned`` slots.

        Returns:
            (stored ids, (evicted ids, their hits while resident, their positions)).
        """
        ids, positions, parent_ids = ids[:self.capacity], positions[:self.capacity], parent_ids[:self.capacity]
        need = len(ids) - len(self.free)
        evictable = None
        if need > 0 and pinned is not None and len(pinned):
            evictable = np.ones(self.capacity, dtype=bool)
            evictable[pinned] = False
        victims = policies.evict(self.policy, self.st, need, evictable, incoming=ids)
        # Read the victims' fields now: insert() below reuses their slots.
        evicted = (self.block_at[victims], self.st.hits[victims], self.st.position[victims])
        if len(victims):
            self.slot_of[evicted[0]] = -1
            self.block_at[victims] = -1
            self.free.extend(victims.tolist())
            self.evictions += len(victims)
        m = min(len(ids), len(self.free))
        if not m:
            return ids[:0], evicted
        ids, positions, parent_ids = ids[:m], positions[:m], parent_ids[:m]
        new = np.array(self.free[-m:][::-1], dtype=np.int64)
        del self.free[-m:]
        self.slot_of[ids] = new
        self.block_at[new] = ids
        parents = np.where(parent_ids >= 0, self.slot_of[np.maximum(parent_ids, 0)], -1)
        policies.insert(self.policy, self.st, new, ids, parents, positions)
        return ids, evicted


def _requests(trace: Trace, progress: Callable[[int], None] | None) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Yield (ids, parent ids) per request; parent = previous block in the prompt, -1 for the first."""
    blocks, offsets = trace.blocks, trace.offsets
    prev = np.empty_like(blocks)
    prev[1:] = blocks[:-1]
    prev[offsets[:-1][offsets[:-1] < len(blocks)]] = -1
    step = max(trace.n_requests // 100, 1)
    for r in range(trace.n_requests):
        a, b = offsets[r], offsets[r + 1]
        yield blocks[a:b], prev[a:b]
        if progress is not None and (r + 1) % step == 0:
            progress(step)
    if progress is not None and trace.n_requests % step:
        progress(trace.n_requests % step)


def simulate(trace: Trace, policy: str | policies.EvictionPolicy, capacity_blocks: int, *,
             progress: Callable[[int], None] | None = None) -> dict:
    """Replay ``trace`` through one policy at one capacity.

    Args:
        trace: the requests.
        policy: a policy name (``"s3fifo"``, ``"prefix_aware:lru"``) or object.
        capacity_blocks: cache size in blocks.
        progress: called with the number of requests done since the last call.

    Returns:
        ``{"policy", "capacity_blocks", "block_hit_ratio", "prefix_hit_ratio", "hits", "prefix_hits",
        "accesses", "evictions", "seconds", "requests_per_s"}``.
    """
    name = policy if isinstance(policy, str) else policy.name
    if capacity_blocks <= 0:
        raise InvalidInput(f"capacity_blocks must be positive, got {capacity_blocks}")
    _jit.enable()  # a replay is thousands of policy calls: the compiled kernels, where numba is installed
    cache = _Cache(policies.make(policy), int(capacity_blocks), max(trace.unique_blocks, 1))
    hits = prefix_hits = 0
    t0 = time.perf_counter()
    # The policies with kernels for every hook replay in one compiled loop (the same calls, in the
    # same order, as the loop below); None: a trace this loop does not take.
    done = fastloop.run(cache, trace, progress) if fastloop.supports(cache.policy) else None
    if done is not None:
        hits, prefix_hits = done
    for ids, prev in _requests(trace, progress) if done is None else ():
        slots = cache.slot_of[ids]
        present = slots >= 0
        n_hit = int(np.count_nonzero(present))
        if n_hit:
            policies.hit(cache.policy, cache.st, slots[present])
            hits += n_hit
        if n_hit == len(ids):
            prefix_hits += n_hit
            continue
        miss_pos = np.flatnonzero(~present)
        prefix_hits += int(miss_pos[0])
        cache.store(ids[miss_pos], miss_pos, prev[miss_pos], pinned=slots[present])
    seconds = time.perf_counter() - t0
    n = max(trace.n_accesses, 1)
    return {"policy": name, "capacity_blocks": int(capacity_blocks),
            "block_hit_ratio": hits / n, "prefix_hit_ratio": prefix_hits / n,
            "hits": hits, "prefix_hits": prefix_hits, "accesses": trace.n_accesses,
            "evictions": cache.evictions, "seconds": round(seconds, 4),
            "requests_per_s": round(trace.n_requests / seconds, 1) if seconds > 0 else None}


def simulate_tiered(trace: Trace, policy: str | policies.EvictionPolicy, hot_blocks: int, warm_blocks: int, *,
                    promotion: str = "always", demotion: str = "on_evict",
                    progress: Callable[[int], None] | None = None) -> dict:
    """Replay ``trace`` through a hot level over a warm level, both run by ``policy``.

    A block is looked up hot first, then warm. Missing blocks are stored hot (and warm too when the
    demotion rule writes through); blocks evicted from hot go warm if the demotion rule says so
    (judged by their hits while hot); warm hits are copied hot if the promotion rule says so (judged
    by the block's warm hits, this one included).

    Returns:
        Like ``simulate`` plus ``hot_blocks``, ``warm_blocks``, ``hot_hit_ratio``, ``warm_hit_ratio``,
        ``promotions``, ``demotions``; ``block_hit_ratio`` counts a hit in either level.
    """
    name = policy if isinstance(policy, str) else policy.name
    promote = promotion_rules.make(promotion)
    demote = demotion_rules.make(demotion)
    n_ids = max(trace.unique_blocks, 1)
    _jit.enable()
    hot = _Cache(policies.make(policy), int(hot_blocks), n_ids)
    warm = _Cache(policies.make(policy), int(warm_blocks), n_ids)
    warm_hits_of = np.zeros(n_ids, dtype=np.int64)
    hot_hits = warm_hits = prefix_hits = promotions = demotions = 0
    t0 = time.perf_counter()

    def to_warm(ids: np.ndarray, positions: np.ndarray, parent_ids: np.ndarray) -> None:
        nonlocal demotions
        fresh = warm.slot_of[ids] < 0
        if fresh.any():
            stored, _ = warm.store(ids[fresh], positions[fresh], parent_ids[fresh])
            warm_hits_of[stored] = 0
            demotions += len(stored)

    def to_hot(ids: np.ndarray, positions: np.ndarray, parent_ids: np.ndarray) -> None:
        _, (gone, gone_hits, gone_pos) = hot.store(ids, positions, parent_ids)
        down = demote.should_demote(gone_hits)
        if down.any():
            # Parent links are not carried to warm: the parent may be anywhere by now.
            to_warm(gone[down], gone_pos[down], np.full(int(down.sum()), -1))

    for ids, prev in _requests(trace, progress):
        positions = np.arange(len(ids))
        hslots = hot.slot_of[ids]
        in_hot = hslots >= 0
        wslots = warm.slot_of[ids]
        in_warm = ~in_hot & (wslots >= 0)
        if in_hot.any():
            policies.hit(hot.policy, hot.st, hslots[in_hot])
            hot_hits += int(in_hot.sum())
        if in_warm.any():
            policies.hit(warm.policy, warm.st, wslots[in_warm])
            warm_hits += int(in_warm.sum())
            wid = ids[in_warm]
            warm_hits_of[wid] += 1
            up = promote.should_promote(warm_hits_of[wid])
            if up.any():
                promotions += int(up.sum())
                to_hot(wid[up], positions[in_warm][up], prev[in_warm][up])
        present = in_hot | in_warm
        first_miss = int(np.argmin(present)) if not present.all() else len(ids)
        prefix_hits += first_miss
        missing = ~present
        if missing.any():
            mids, mpos, mprev = ids[missing], positions[missing], prev[missing]
            if demote.at_store:
                to_warm(mids, mpos, mprev)
            to_hot(mids, mpos, mprev)
    seconds = time.perf_counter() - t0
    n = max(trace.n_accesses, 1)
    return {"policy": name, "capacity_blocks": int(hot_blocks) + int(warm_blocks),
            "hot_blocks": int(hot_blocks), "warm_blocks": int(warm_blocks),
            "promotion": promotion, "demotion": demotion,
            "block_hit_ratio": (hot_hits + warm_hits) / n, "prefix_hit_ratio": prefix_hits / n,
            "hot_hit_ratio": hot_hits / n, "warm_hit_ratio": warm_hits / n,
            "hits": hot_hits + warm_hits, "prefix_hits": prefix_hits, "accesses": trace.n_accesses,
            "promotions": promotions, "demotions": demotions, "evictions": hot.evictions + warm.evictions,
            "seconds": round(seconds, 4),
            "requests_per_s": round(trace.n_requests / seconds, 1) if seconds > 0 else None}


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar when asked for and installed; otherwise no bar (returns (update, close))."""
    if not enabled:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, unit="req", desc="simulate", leave=False)
    return bar.update, bar.close


def _run_job(trace: Trace, name: str, size, two_level: bool, promotion: str, demotion: str,
             progress: Callable[[int], None] | None = None) -> dict:
    if two_level:
        return simulate_tiered(trace, name, size[0], size[1], promotion=promotion, demotion=demotion,
                               progress=progress)
    return simulate(trace, name, size, progress=progress)


_FORK_TRACE: Trace | None = None  # the trace, inherited by forked workers (never pickled)


def _run_job_in_worker(name: str, size, two_level: bool, promotion: str, demotion: str) -> dict:
    if _FORK_TRACE is None:
        raise RuntimeError("a simulation worker started without the trace its parent set")
    return _run_job(_FORK_TRACE, name, size, two_level, promotion, demotion)


def run_simulation(trace: Trace, policy_names: Sequence[str], capacities: Sequence[int | str], *,
                   hot: Sequence[int | str] | None = None, warm: Sequence[int | str] | None = None,
                   promotion: str = "always", demotion: str = "on_evict", progress: bool = False,
                   jobs: int = 1, optimal: bool = True, baseline: str = "lru") -> dict:
    """Replay ``trace`` for every policy x capacity (or x hot/warm size pair); the CLI's JSON.

    Args:
        trace: the requests.
        policy_names: eviction policy names (each checked before any replay starts).
        capacities: sizes in blocks or ``"5%"`` of the trace's unique blocks (ignored when ``hot``).
        hot, warm: two-level replay: hot sizes and warm sizes, paired in order (one warm size is
            used for every hot size).
        promotion, demotion: rule names for two-level replay.
        progress: show a tqdm progress bar (if tqdm is installed).
        jobs: worker processes (0: one per CPU). Each policy x capacity replay is independent and
            single-threaded, so they run side by side; results keep the same order either way.
        optimal: single-level replay only: also compute Belady's MIN per capacity (``optimal.belady``,
            the block and prefix optimum) and each result's ``gap_closed``: the fraction of the
            ``baseline``-to-optimum block-hit gap it closes (``baseline`` is replayed too if it is
            not among the policies; its rows go to ``"baseline"``).
        baseline: the policy the gap is measured from.

    Returns:
        ``{"trace", "requests", "unique_blocks", "accesses", "results": [{"policy",
        "capacity_blocks", "block_hit_ratio", "prefix_hit_ratio", "gap_closed", ...}, ...],
        "optimal": [{"policy": "belady", "capacity_blocks", "block_hit_ratio", "prefix_hit_ratio",
        "exact_prefix", ...}, ...], "baseline": [...]}``, one result per policy and capacity,
        policies in the given order, capacities ascending (no ``optimal``/``baseline``/``gap_closed``
        for two-level replay or ``optimal=False``).

    Raises:
        UnknownPolicy: a policy name is not registered (listing the valid ones).
        InvalidInput: a bad capacity.
    """
    for name in policy_names:
        policies.make(name)
    unique = trace.unique_blocks
    if hot:
        hots = [resolve_capacity(h, unique) for h in hot]
        warms = [resolve_capacity(w, unique) for w in (warm or [])]
        if len(warms) not in (1, len(hots)):
            raise InvalidInput(f"give one warm size or one per hot size; got {len(warms)} for {len(hots)} hot sizes")
        pairs = list(zip(hots, warms * len(hots) if len(warms) == 1 else warms))
        promotion_rules.make(promotion)
        demotion_rules.make(demotion)
        todo: list[tuple[str, Any]] = [(p, pair) for p in policy_names for pair in pairs]
    else:
        caps = sorted({resolve_capacity(c, unique) for c in capacities})
        if not caps:
            raise InvalidInput("give at least one capacity")
        todo = [(p, c) for p in policy_names for c in caps]
        optimal = optimal and trace.n_accesses > 0
        if optimal:
            policies.make(baseline)
            if baseline not in policy_names:
                todo += [(baseline, c) for c in caps]
    workers = min(len(todo), (os.cpu_count() or 1) if jobs <= 0 else jobs)
    update, close = _progress_bar(len(todo) * trace.n_requests, progress)
    try:
        if workers <= 1 or "fork" not in mp.get_all_start_methods():
            results = [_run_job(trace, name, size, bool(hot), promotion, demotion, update) for name, size in todo]
        else:
            global _FORK_TRACE
            _FORK_TRACE = trace
            try:
                with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
                    futures = [pool.submit(_run_job_in_worker, name, size, bool(hot), promotion, demotion)
                               for name, size in todo]
                    results = []
                    for f in futures:
                        results.append(f.result())
                        if update is not None:
                            update(trace.n_requests)
            finally:
                _FORK_TRACE = None
    finally:
        close()
    for r in results:
        r["capacity_fraction"] = r["capacity_blocks"] / unique if unique else math.nan
    out: dict[str, Any] = {"trace": trace.name, "requests": trace.n_requests, "unique_blocks": unique,
                           "accesses": trace.n_accesses}
    if hot or not optimal:
        out["results"] = results
        return out
    n_asked = len(policy_names) * len(caps)
    results, extra = results[:n_asked], results[n_asked:]
    base_rows = [r for r in results if r["policy"] == baseline][:len(caps)] or extra
    best = {c: belady(trace, c) for c in caps}
    base = {r["capacity_blocks"]: r["block_hit_ratio"] for r in base_rows}
    for r in results:
        c = r["capacity_blocks"]
        r["optimal_block_hit_ratio"] = best[c]["block_hit_ratio"]
        r["gap_closed"] = gap_closed(r["block_hit_ratio"], base[c], best[c]["block_hit_ratio"])
    for o in best.values():
        o["capacity_fraction"] = o["capacity_blocks"] / unique if unique else math.nan
    out.update(results=results, optimal=[best[c] for c in caps], baseline=base_rows)
    return out
