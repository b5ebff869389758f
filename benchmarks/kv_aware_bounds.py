"""How much of the LRU-to-MIN gap an online policy can close on a trace: the ceilings behind kv_aware.

Usage (from the repository root; about a minute per trace and capacity on a quiet machine)::

    python benchmarks/kv_aware_bounds.py --trace benchmarks/traces/mooncake_conversation_trace.jsonl \
        --requests :6015 --capacity 9140,36558
    python benchmarks/kv_aware_bounds.py --trace benchmarks/traces/mooncake_synthetic_trace.jsonl \
        --capacity 5%,20%

Prints, per capacity, the block hit ratio and the fraction of the LRU-to-MIN gap closed by:

- ``lru``, ``kv_aware`` and Belady's MIN: the real simulator (``tieredkv.sim.simulate``, ``belady``);
- **oracles** in an idealised replay (below): LRU that knows which blocks are never used again
  (``dead-block oracle``: they go first), LRU ordered by each block's total number of accesses over
  the whole trace (``popularity oracle``: a perfect LFU, recency breaking ties) or by the number of
  its accesses still to come (``remaining-accesses oracle``), and LRU shifted by
  a **predictor of a given quality**: the dead-block label plus Gaussian noise shared by the blocks
  of one request (a request's new chunks are reused together or not at all), scaled so that its area
  under the ROC curve is 0.6, 0.7, 0.8 or 0.9, each block's priority ``tick + H x score`` with the
  best ``H`` of a few multiples of the capacity (chosen on the same data: an upper bound of what
  such a predictor gives this ordering);
- **probation** (2Q / S3-FIFO-style admission applied to prefix chunks): a new chunk enters a small
  FIFO (``small`` x the capacity) and moves to the main LRU queue when it is hit there; a chunk
  pushed out of the FIFO leaves its key in a ghost FIFO (``ghost`` x the capacity), and a chunk
  stored again while its key is there goes straight to main;
- and, per request that stores new chunks, the area under the ROC curve of cheap features for "some
  of its new chunks are used again": the number of new chunks, of chunks already cached before them
  (the prompt's known prefix), the turn count of its conversation (how many times the chain of
  prefixes it extends was extended before) and the time since that previous turn; and over the
  follow-ups, whether the next turn comes about when the previous gap says (the share that continue
  at all, the share that continue within twice their previous gap, the correlation of the two gaps).

The idealised replay serves a request as the simulator does (look every block up, the hits first,
then store the missing blocks with the request's hits pinned), with one priority per block frozen
when it is set (insert and hit), and one liberty: a store's own new blocks may be dropped at once
when theirs is the lowest priority (bypass, which MIN has too). With recency as the priority it is
LRU exactly: the script checks its LRU hits against the simulator's and says so.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from tieredkv.sim import belady, gap_closed, read_trace, resolve_capacity, simulate
from tieredkv.sim.cli import request_slice
from tieredkv.sim.trace import Trace

#: A priority offset larger than any tick: blocks shifted by it go before (or after) every other.
BIG = float(2 ** 40)
AUCS = (0.6, 0.7, 0.8, 0.9)
H_FACTORS = (0.25, 0.5, 1.0, 2.0)       # the predictor's shift, in capacities of block accesses
PROBATION = ((0.05, 4.0), (0.1, 4.0), (0.2, 1.0), (0.4, 1.0))   # (small, ghost) shares of the capacity


class Structure:
    """Per access and per request facts of a trace (the oracles' and the features' raw material).

    Attributes:
        nxt: per access, the index of the same block's next access (-1: never again).
        prv: per access, the index of its previous access (-1: first).
        req_of: per access, its request.
        remaining: per access, how many accesses of the same block come after it.
        known: per request, how many of its leading blocks were accessed before (its known prefix).
    """

    def __init__(self, trace: Trace):
        blocks = trace.blocks
        n = len(blocks)
        self.req_of = np.repeat(np.arange(trace.n_requests), np.diff(trace.offsets))
        order = np.lexsort((np.arange(n), blocks))
        same = blocks[order[1:]] == blocks[order[:-1]]
        self.nxt = np.full(n, -1, dtype=np.int64)
        self.nxt[order[:-1][same]] = order[1:][same]
        self.prv = np.full(n, -1, dtype=np.int64)
        self.prv[order[1:][same]] = order[:-1][same]
        self.remaining = np.zeros(n, dtype=np.int64)   # per access, the same block's accesses after it
        for i in order[::-1].tolist():                  # a block's accesses, last first
            j = self.nxt[i]
            self.remaining[i] = self.remaining[j] + 1 if j >= 0 else 0
        seen = self.prv >= 0
        self.known = np.zeros(trace.n_requests, dtype=np.int64)
        for r in range(trace.n_requests):
            a, b = trace.offsets[r], trace.offsets[r + 1]
            first_new = np.flatnonzero(~seen[a:b])
            self.known[r] = first_new[0] if len(first_new) else b - a


def replay(trace: Trace, capacity: int, priority: Callable[[np.ndarray, int], np.ndarray]) -> float:
    """Idealised replay (see the module docstring); ``priority(access indices, ticks)`` for the blocks
    accessed (hit or stored) at those indices (``ticks``: one per block, counting every access), the
    lowest evicted first. Returns the block hit ratio."""
    blocks, offsets = trace.blocks, trace.offsets
    prio: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = tick = 0
    for r in range(trace.n_requests):
        a, b = int(offsets[r]), int(offsets[r + 1])
        ids = blocks[a:b].tolist()
        resident = [x in prio for x in ids]
        hit_at = np.array([a + i for i in range(b - a) if resident[i]], dtype=np.int64)
        new_at = np.array([a + i for i in range(b - a) if not resident[i]], dtype=np.int64)
        for at, count in ((hit_at, True), (new_at, False)):
            if not len(at):
                continue
            ticks = np.arange(tick + 1, tick + len(at) + 1, dtype=np.float64)   # one per block, as the policies'
            tick += len(at)
            hits += len(at) if count else 0
            for j, p in zip(at.tolist(), priority(at, ticks).tolist()):
                prio[ids[j - a]] = p
                heapq.heappush(heap, (p, ids[j - a]))
        pinned = {ids[j - a] for j in hit_at.tolist()}
        held = []
        while len(prio) > capacity and heap:
            p, x = heapq.heappop(heap)
            if prio.get(x) != p:
                continue                      # a stale entry: the block was re-prioritised or evicted
            if x in pinned:
                held.append((p, x))
                continue
            del prio[x]
        for entry in held:
            heapq.heappush(heap, entry)
    return hits / max(trace.n_accesses, 1)


def probation(trace: Trace, capacity: int, small: float, ghost: float) -> float:
    """2Q-style admission over prefix chunks (see the module docstring); the block hit ratio."""
    s_cap, g_cap = max(1, int(small * capacity)), int(ghost * capacity)
    fifo: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    ghosts: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in range(trace.n_requests):
        ids = trace.request(r).tolist()
        pinned = set()
        for x in ids:
            if x in main:
                main.move_to_end(x)
            elif x in fifo:
                del fifo[x]
                main[x] = None
            else:
                continue
            hits += 1
            pinned.add(x)
        for x in ids:
            if x in main or x in fifo:
                continue
            if x in ghosts:
                del ghosts[x]
                main[x] = None
            else:
                fifo[x] = None
            while len(fifo) + len(main) > capacity:
                if len(fifo) > s_cap or not main:
                    y, _ = fifo.popitem(last=False)
                    ghosts[y] = None
                    if len(ghosts) > g_cap:
                        ghosts.popitem(last=False)
                else:
                    y = next((z for z in main if z not in pinned), None)
                    if y is None:
                        fifo.popitem(last=False)
                    else:
                        del main[y]
    return hits / max(trace.n_accesses, 1)


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve of ``score`` for the boolean ``label`` (ties count half)."""
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + b - 1) / 2 + 1
    pos = int(label.sum())
    neg = len(label) - pos
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg)) if pos and neg else math.nan


def feature_aucs(trace: Trace, s: Structure) -> dict[str, float]:
    """Per request that stores new chunks: each cheap feature's AUC for "a new chunk is used again"
    (taken in the direction that predicts, so 0.5 is useless and 1 perfect)."""
    offsets, n = trace.offsets, trace.n_requests
    turn = np.zeros(n, dtype=np.int64)
    rows, labels = [], []
    for r in range(n):
        a, b = int(offsets[r]), int(offsets[r + 1])
        k = int(s.known[r])
        before = int(s.req_of[s.prv[a + k - 1]]) if k >= 2 else -1   # the previous turn (past a shared first block)
        turn[r] = turn[before] + 1 if before >= 0 else 0
        if k == b - a:
            continue
        gap = (float(trace.timestamps_ms[r] - trace.timestamps_ms[before])
               if before >= 0 and trace.timestamps_ms is not None else -1.0)
        again = s.nxt[a + k]              # the first new chunk's next use: the next turn, if any
        after = (float(trace.timestamps_ms[s.req_of[again]] - trace.timestamps_ms[r])
                 if again >= 0 and trace.timestamps_ms is not None else math.inf)
        rows.append((b - a - k, k, turn[r], gap, after))
        labels.append(bool((s.nxt[a + k:b] >= 0).any()))
    x, y = np.array(rows, dtype=float), np.array(labels)
    out = {"requests storing new chunks": float(len(y)), "share of them with a new chunk reused": float(y.mean())}
    for i, name in enumerate(("new chunks", "known prefix", "turn count", "time since previous turn")):
        a = auc(x[:, i], y)
        out[f"AUC {name}"] = max(a, 1 - a)
    # Timing: is the next turn due about when the previous gap says? (Expiring a conversation that is
    # overdue needs that.) Over follow-ups (a previous turn known):
    follow = x[:, 3] >= 0
    gap, after = x[follow, 3], x[follow, 4]
    came = np.isfinite(after)
    if came.sum() > 2:
        out["follow-ups: share continued"] = float(came.mean())
        out["follow-ups: share continued within 2x their previous gap"] = float((after <= 2 * gap).mean())
        out["follow-ups continued: correlation of log previous gap, log next gap"] = float(
            np.corrcoef(np.log1p(gap[came]), np.log1p(after[came]))[0, 1])
    return out


def bounds(trace: Trace, capacity: int, s: Structure, seed: int = 0) -> list[tuple[str, float]]:
    """(name, block hit ratio) of every row the script prints for one capacity."""
    nxt = s.nxt
    total = np.bincount(trace.blocks)
    rows: list[tuple[str, float]] = []
    lru_real = simulate(trace, "lru", capacity)["block_hit_ratio"]
    lru_ideal = replay(trace, capacity, lambda at, t: t)
    if lru_ideal != lru_real:
        print(f"  warning: the idealised replay's LRU ({lru_ideal:.4f}) is not the simulator's "
              f"({lru_real:.4f})", file=sys.stderr)
    rows.append(("lru", lru_real))
    rows.append(("kv_aware", simulate(trace, "kv_aware", capacity)["block_hit_ratio"]))
    rows.append(("dead-block oracle (LRU, never-reused blocks first)",
                 replay(trace, capacity, lambda at, t: t - BIG * (nxt[at] < 0))))
    rows.append(("popularity oracle (LRU by total accesses)",
                 replay(trace, capacity, lambda at, t: BIG * total[trace.blocks[at]] + t)))
    rows.append(("remaining-accesses oracle (LRU by accesses to come)",
                 replay(trace, capacity, lambda at, t: BIG * s.remaining[at] + t)))
    noise = np.random.default_rng(seed).standard_normal(trace.n_requests)[s.req_of]
    for a in AUCS:
        d = math.sqrt(2) * _probit(a)   # label * d + unit noise: AUC = Phi(d / sqrt(2))
        score = d * (nxt >= 0) + noise
        best = max(replay(trace, capacity, lambda at, t, h=h * capacity, sc=score: t + h * sc[at]) for h in H_FACTORS)
        rows.append((f"predictor of AUC {a} (best H)", best))
    for small, ghost in PROBATION:
        rows.append((f"probation small={small} ghost={ghost}", probation(trace, capacity, small, ghost)))
    rows.append(("belady (MIN)", belady(trace, capacity)["block_hit_ratio"]))
    return rows


def _probit(p: float) -> float:
    """The standard normal quantile of ``p`` (bisection on erf: no scipy needed)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--requests", metavar="A:B", help="replay only requests A to B-1, from a cold cache")
    parser.add_argument("--capacity", default="5%,20%", help="blocks or N%% of the (sliced) trace's unique blocks")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    if args.requests:
        trace = request_slice(trace, args.requests)
    print(f"{os.path.basename(trace.name)}: {trace.n_requests} requests, {trace.n_accesses} block accesses, "
          f"{trace.unique_blocks} unique blocks; load average {os.getloadavg()[0]:.1f}")
    s = Structure(trace)
    for name, value in feature_aucs(trace, s).items():
        print(f"  {name}: {value:.3f}" if value < 10 else f"  {name}: {value:.0f}")
    for cap in [resolve_capacity(c, trace.unique_blocks) for c in args.capacity.split(",")]:
        t0 = time.perf_counter()
        rows = bounds(trace, cap, s)
        lru, best = rows[0][1], rows[-1][1]
        print(f"capacity {cap} blocks ({time.perf_counter() - t0:.0f} s)")
        for name, value in rows:
            print(f"  {name:<52} {value:.4f}  gap closed {gap_closed(value, lru, best):+.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
