"""Ideas for closing the LRU-to-MIN gap beyond kv_aware, tried on the idealised replay with their
parameter chosen on a tuning split and measured on held-out data.

Usage (from the repository root; about ten minutes on a quiet machine)::

    python benchmarks/kv_aware_ideas.py

Every idea is a priority ``tick + H x C x feature`` frozen when a block is stored or hit (the
idealised replay of ``kv_aware_bounds.py``, whose LRU is the simulator's exactly), ``C`` the
capacity in blocks and ``H`` one of ``H_FACTORS``. Features are computed from the past only (what a
cache could know at that access):

- ``children``: log(1 + distinct children the block has had so far): a prefix-tree node's value as
  the number of continuations it gates (a shared interior node before a leaf);
- ``fork``: the block has had two or more distinct children (an interior node of the tree);
- ``not last``: the block was not the last chunk of the request that touched it (leaves and partial
  last chunks first);
- ``large store``: the store that brought the block had 4 or more new chunks;
- ``frequency``: log of the block's accesses so far, evictions included (a ghost count: LRFU /
  TinyLFU-like frequency that survives eviction);
- ``frequency + not last``: both shifts added;
- ``root popularity``: log of the accesses so far of the request's first block (a document's or
  system prompt's popularity, shared by everything under it);
- ``inter-reference gap``: minus 0.25 x log of the ticks since the block's previous access (LIRS's
  inter-reference recency as a shift, S. Jiang, X. Zhang, SIGMETRICS 2002; a first access counts as
  2^24 ticks), ``H`` fixed at 1 (its scale is in the feature);
- ``admission``: minus one for the new chunks of a store of 16 or more chunks with fewer than 2 known
  before it (a first-seen long prompt is inserted at the lowest priority: it goes first unless hit).

``H`` is chosen per idea on the first half of the conversation trace (requests 0-6,014) at 9,140
and 36,558 blocks (the whole trace's 5% and 20%), as the value with the best smaller of the two gap
fractions; the table then gives the second half, the whole conversation trace and the whole synthetic
trace (at 5% and 20% of its unique blocks) with that ``H``.

``--lhd`` runs instead a prototype of LHD (N. Beckmann, H. Chen, A. Cidon, "LHD: Improving Cache Hit
Rate by Maximizing Hit Density", NSDI 2018) on the same splits: per class (hits since stored 0-3+ x
last chunk of its request) and log2 age bin, online counts of hits (resident hits, and stores of a
key still in a ghost FIFO of 4x the capacity, at the age it came back: as if it had been kept) and of
deaths (a ghost leaving the FIFO, at its age then), decayed by 0.9 every 1,024 evictions; the hit
density of (class, age) is the hits expected from that age on over the space-time expected from it
on, and a victim is the lowest density among 64 random resident blocks (the request's hits pinned).
Nothing is tuned: these are LHD's published choices, with the prefix-chunk class.

``--ceilings`` prints, per trace, the share of new chunks used again (a request's last one, the
others: ``kv_aware``'s ``last_first`` rule rests on it) and what better *features* could give:
the area under the ROC curve for "some new chunk of this request is used again" of the request's
token counts (the prompt's ``input_length``, ``input_length mod 512``, the ``output_length`` the
trace records), and the gap closed by kv_aware's classes (hits bucket x store start x last chunk x
store size, 72 classes) scored with their **in-sample** reuse rates (each class's true share of
accesses followed by another, counted over the whole split: a perfectly calibrated table, which no
online policy has), alone and with a bucket of the inter-reference gap (first access, under 8,000
ticks, more), ordered by ``tick + H x C x log-odds`` with the best ``H`` of 0.1-4 on the same data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import OrderedDict, defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_aware_bounds import Structure, auc, replay  # noqa: E402

from tieredkv.sim import belady, gap_closed, read_trace, resolve_capacity  # noqa: E402
from tieredkv.sim.cli import request_slice  # noqa: E402
from tieredkv.sim.trace import Trace  # noqa: E402

H_FACTORS = (0.25, 0.5, 1.0, 2.0)
#: The inter-reference gap of a first access: longer than any trace here (a constant, so that a
#: feature does not depend on how long the trace goes on).
FIRST_GAP = 2 ** 24
CONVERSATION = "benchmarks/traces/mooncake_conversation_trace.jsonl"
SYNTHETIC = "benchmarks/traces/mooncake_synthetic_trace.jsonl"


def features(trace: Trace, s: Structure) -> dict[str, np.ndarray]:
    """Per access, each idea's feature from the past only (see the module docstring)."""
    n, offsets, blocks = trace.n_accesses, trace.offsets, trace.blocks
    count = np.zeros(n)
    children = np.zeros(n)
    store = np.zeros(n)
    last = np.zeros(n)
    root = np.zeros(n)
    admit = np.zeros(n)
    seen: dict[int, int] = defaultdict(int)
    kids: dict[int, set] = defaultdict(set)
    stored_with: dict[int, int] = {}
    for r in range(trace.n_requests):
        a, b = int(offsets[r]), int(offsets[r + 1])
        ids = blocks[a:b].tolist()
        for i in range(1, len(ids)):
            kids[ids[i - 1]].add(ids[i])
        new = int((s.prv[a:b] < 0).sum())
        big_new_prompt = new >= 16 and s.known[r] < 2
        for i, x in enumerate(ids):
            stored_with.setdefault(x, new)
            seen[x] += 1
            count[a + i] = seen[x]
            children[a + i] = len(kids[x])
            store[a + i] = stored_with[x]
            last[a + i] = i == len(ids) - 1
            root[a + i] = seen[ids[0]]
            admit[a + i] = big_new_prompt and s.prv[a + i] < 0
    gap = np.where(s.prv >= 0, np.arange(n) - s.prv, FIRST_GAP).astype(float)
    return {
        "inter-reference gap": -0.25 * np.log(gap),
        "children": np.log1p(children),
        "fork": (children >= 2).astype(float),
        "not last": 1.0 - last,
        "large store": (store >= 4).astype(float),
        "frequency": np.log(count),
        "frequency + not last": np.log(count) + 1.0 - last,
        "root popularity": np.log(root),
        "admission": -admit,
    }


LHD_BINS = 24             # log2 age bins: 0, 1, 2-3, 4-7, ...
LHD_CLASSES = 8           # hits since stored (0, 1, 2, 3+) x last chunk of its request


def lhd(trace: Trace, capacity: int, sample: int = 64, ghost: float = 4.0, seed: int = 0) -> float:
    """The LHD prototype (see the module docstring); the block hit ratio."""
    rng = random.Random(seed)
    offsets, blocks = trace.offsets, trace.blocks
    res: dict[int, tuple[int, int, int]] = {}      # block -> (last access tick, class, hits)
    slots: list[int] = []                          # resident blocks, for sampling
    where: dict[int, int] = {}
    ghosts: OrderedDict[int, tuple[int, int, int]] = OrderedDict()
    hit_n = np.zeros((LHD_CLASSES, LHD_BINS))
    death_n = np.zeros((LHD_CLASSES, LHD_BINS))
    density = np.zeros((LHD_CLASSES, LHD_BINS))
    mids = np.array([0.5] + [1.5 * 2.0 ** (b - 1) for b in range(1, LHD_BINS)])
    tick = hits = evictions = 0

    def age_bin(age: int) -> int:
        return min(LHD_BINS - 1, int(age).bit_length())

    def relearn() -> None:
        for c in range(LHD_CLASSES):
            ahead = hit_n[c][::-1].cumsum()[::-1]            # hits expected from each age on
            ends = hit_n[c] + death_n[c]
            life = np.array([((mids[b:] - mids[b]) * ends[b:]).sum() + ends[b:].sum() * mids[b] * 0.5
                             for b in range(LHD_BINS)])
            density[c] = (ahead + 1e-3) / (life + 1.0)
        hit_n[:] *= 0.9
        death_n[:] *= 0.9

    for r in range(trace.n_requests):
        ids = blocks[int(offsets[r]):int(offsets[r + 1])].tolist()
        pinned, new = set(), []
        for x in ids:
            if x in res:
                last, c, h = res[x]
                tick += 1
                hits += 1
                hit_n[c, age_bin(tick - last)] += 1
                res[x] = (tick, min(h + 1, 3) * 2 + (c & 1), h + 1)
                pinned.add(x)
            else:
                new.append(x)
        for j, x in enumerate(new):
            tick += 1
            h = 0
            if x in ghosts:
                last, c, h = ghosts.pop(x)
                hit_n[c, age_bin(tick - last)] += 1
                h += 1
            res[x] = (tick, min(h, 3) * 2 + (j == len(new) - 1), h)
            where[x] = len(slots)
            slots.append(x)
        over, tries = len(res) - capacity, 0
        while over > 0 and tries < 1000:
            tries += 1
            victim, low = None, math.inf
            for y in (slots[rng.randrange(len(slots))] for _ in range(sample)):
                if y not in pinned:
                    last, c, _ = res[y]
                    d = density[c, age_bin(tick - last)]
                    if d < low:
                        victim, low = y, d
            if victim is None:
                continue
            ghosts[victim] = res.pop(victim)
            i, tail = where.pop(victim), slots.pop()
            if tail != victim:
                slots[i] = tail
                where[tail] = i
            over -= 1
            evictions += 1
            if len(ghosts) > ghost * capacity:
                _, (last, c, _) = ghosts.popitem(last=False)
                death_n[c, age_bin(tick - last)] += 1
            if evictions % 1024 == 0:
                relearn()
    return hits / max(trace.n_accesses, 1)


def _log_odds_ceiling(trace: Trace, s: Structure, capacity: int, with_gap: bool) -> float:
    """Best gap closed (over H) by kv_aware's classes, optionally x a gap bucket, scored in-sample."""
    offsets, blocks, n = trace.offsets, trace.blocks, trace.n_accesses
    cls = np.zeros(n, dtype=np.int64)
    stored: dict[int, int] = {}
    seen: dict[int, int] = defaultdict(int)
    for r in range(trace.n_requests):
        a, b = int(offsets[r]), int(offsets[r + 1])
        new = int((s.prv[a:b] < 0).sum())
        size = 0 if new < 4 else 1 if new < 16 else 2
        start = 0 if s.known[r] < 2 else 1 if s.known[r] < 16 else 2
        for i in range(a, b):
            x = int(blocks[i])
            stored.setdefault(x, (start * 2 + (i == b - 1)) * 3 + size)
            cls[i] = min(seen[x], 3) * 18 + stored[x]
            seen[x] += 1
            if with_gap:
                gap = i - s.prv[i] if s.prv[i] >= 0 else -1
                cls[i] = cls[i] * 3 + (0 if gap < 0 else 1 if gap < 8000 else 2)
    used = (s.nxt >= 0).astype(float)
    p = (np.bincount(cls, weights=used) + 1) / (np.bincount(cls) + 2)
    score = np.log(p / (1 - p))[cls]
    lru = replay(trace, capacity, lambda at, t: t)
    best = belady(trace, capacity)["block_hit_ratio"]
    return max(gap_closed(replay(trace, capacity, lambda at, t, h=h: t + h * capacity * score[at]), lru, best)
               for h in (0.1, 0.25, 0.5, 1.0, 2.0, 4.0))


def ceilings(path: str, requests: str | None, capacities: tuple[str, ...]) -> None:
    """Print the ``--ceilings`` rows for one trace (or a slice of it)."""
    trace = read_trace(path)
    with open(path) as f:
        meta = [json.loads(line) for line in f if line.strip()]
    lo = 0
    if requests:
        lo = int(requests.split(":")[0] or 0)
        trace = request_slice(trace, requests)
    s = Structure(trace)
    rows, labels = [], []
    for r in range(trace.n_requests):
        a, b = int(trace.offsets[r]), int(trace.offsets[r + 1])
        k = int(s.known[r])
        if k == b - a:
            continue
        m = meta[lo + r]
        rows.append((m["input_length"], m["input_length"] % 512, m["output_length"]))
        labels.append(bool((s.nxt[a + k:b] >= 0).any()))
    x, y = np.array(rows, dtype=float), np.array(labels)
    print(f"{os.path.basename(path)} {requests or 'whole'}:")
    new = s.prv < 0
    last = np.zeros(trace.n_accesses, dtype=bool)
    last[trace.offsets[1:] - 1] = True
    used = s.nxt >= 0
    print(f"  new chunks used again: the last of their request {used[new & last].mean():.3f}, "
          f"the others {used[new & ~last].mean():.3f}")
    for i, name in enumerate(("input_length", "input_length mod 512", "output_length")):
        v = auc(x[:, i], y)
        print(f"  AUC {name}: {max(v, 1 - v):.3f}")
    for c in capacities:
        cap = resolve_capacity(c, trace.unique_blocks)
        print(f"  {cap} blocks: in-sample classes {_log_odds_ceiling(trace, s, cap, False):+.2f}, "
              f"with a gap bucket {_log_odds_ceiling(trace, s, cap, True):+.2f}", flush=True)


class Split:
    """A trace (or a slice of one) with its structure, features, and LRU and MIN per capacity."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.s = Structure(trace)
        self.f = features(trace, self.s)
        self.ref: dict[int, tuple[float, float]] = {}

    def gap(self, idea: str, h: float, cap: int) -> float:
        """Gap closed by ``idea`` with factor ``h`` at ``cap`` blocks (``idea="lhd"``: the prototype)."""
        if cap not in self.ref:
            self.ref[cap] = (replay(self.trace, cap, lambda at, t: t), belady(self.trace, cap)["block_hit_ratio"])
        lru, best = self.ref[cap]
        if idea == "lhd":
            return gap_closed(lhd(self.trace, cap), lru, best)
        f = self.f[idea]
        hit = replay(self.trace, cap, lambda at, t: t + h * cap * f[at])
        return gap_closed(hit, lru, best)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ideas", help="comma-separated subset of the ideas")
    parser.add_argument("--lhd", action="store_true", help="run the LHD prototype instead (nothing to tune)")
    parser.add_argument("--ceilings", action="store_true", help="print the feature ceilings instead")
    args = parser.parse_args(argv)
    if args.ceilings:
        print(f"load average {os.getloadavg()[0]:.1f}")
        ceilings(CONVERSATION, ":6015", ("9140", "36558"))
        ceilings(CONVERSATION, "6015:", ("9140", "36558"))
        ceilings(SYNTHETIC, None, ("5%", "20%"))
        return 0
    conv = read_trace(CONVERSATION)
    syn = read_trace(SYNTHETIC)
    tune = Split(request_slice(conv, ":6015"))
    caps = (9140, 36558)
    evals = [("conversation, second half", Split(request_slice(conv, "6015:")), caps),
             ("conversation, whole", Split(conv), caps),
             ("synthetic, whole", Split(syn), tuple(resolve_capacity(c, syn.unique_blocks) for c in ("5%", "20%")))]
    ideas = ["lhd"] if args.lhd else args.ideas.split(",") if args.ideas else list(tune.f)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for idea in ideas:
        t0 = time.perf_counter()
        factors = (1.0,) if idea in ("inter-reference gap", "lhd") else H_FACTORS
        tried = {h: tuple(tune.gap(idea, h, c) for c in caps) for h in factors}
        h = max(tried, key=lambda k: min(tried[k]))
        row = [f"H={h}", "tuning {:+.2f} / {:+.2f}".format(*tried[h])]
        for name, split, cs in evals:
            row.append(f"{name} " + " / ".join(f"{split.gap(idea, h, c):+.2f}" for c in cs))
        print(f"{idea}: " + "; ".join(row) + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
