"""Cross-check against libCacheSim on synthetic traces of unit-size objects.

Each object is one block and each access one request, replayed by our simulator (the same policy
code as the hot tier) and by libCacheSim's own implementations with matching parameters: S3-FIFO
with a 10% small queue, a ghost of 90% of the cache and a move-to-main threshold of 2; CLOCK with a
1-bit counter starting at 0. The issue asks for block hit ratios within 0.5 percentage points.
"""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv.sim import Trace, simulate
from tieredkv.sim.libcachesim import MATCHING, factories

lcs = pytest.importorskip("libcachesim")

LIBCACHESIM = {name: make for name, make in factories(lcs).items() if name in MATCHING}
TOLERANCE_PP = 0.5


def _zipf_keys(n_requests: int, n_objects: int, alpha: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_objects + 1) ** alpha
    ranks = rng.choice(n_objects, size=n_requests, p=weights / weights.sum())
    return rng.permutation(n_objects)[ranks]  # popularity unrelated to id order


def _libcachesim_hit_ratio(name: str, capacity: int, keys: np.ndarray) -> float:
    cache = LIBCACHESIM[name](capacity)
    req = lcs.Request()
    req.obj_size = 1
    hits = 0
    for key in keys.tolist():
        req.obj_id = key
        hits += cache.get(req)
    return hits / len(keys)


TRACES = {
    # (requests, objects, zipf alpha, seed)
    "zipf0.8": (6000, 800, 0.8, 1),
    "zipf1.1": (6000, 800, 1.1, 2),
}


@pytest.fixture(scope="module", params=sorted(TRACES))
def unit_trace(request):
    keys = _zipf_keys(*TRACES[request.param])
    return keys, Trace.from_requests(([int(k)] for k in keys), name=request.param)


@pytest.mark.parametrize("capacity", [40, 200])
@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
def test_block_hit_ratio_matches_libcachesim(name, capacity, unit_trace):
    keys, trace = unit_trace
    ours = simulate(trace, name, capacity)["block_hit_ratio"]
    theirs = _libcachesim_hit_ratio(name, capacity, keys)
    assert 0.05 < theirs < 0.95, "trace too easy or too hard to tell policies apart"
    assert abs(ours - theirs) * 100 <= TOLERANCE_PP, f"{name}@{capacity}: ours {ours:.4f} vs libCacheSim {theirs:.4f}"


def test_the_policies_differ_on_these_traces(unit_trace):
    """Guard against a vacuous cross-check: the six policies do not all score the same."""
    _, trace = unit_trace
    ratios = {name: simulate(trace, name, 40)["block_hit_ratio"] for name in LIBCACHESIM}
    assert len({round(r, 4) for r in ratios.values()}) >= 4, ratios
