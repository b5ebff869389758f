"""The compiled replay's incremental victim lists (``tieredkv.sim.victims``) decide as the kernels do.

Each case replays the same trace twice in the compiled loop: once choosing victims with the policies'
own kernels (a pass over all the slots: what the hot tier runs) and once from the lists kept
incrementally, and asserts the same hits, prefix hits and evictions and the same state word for
word (every slot field, global and ghost word, the block id <-> slot maps and the free slots).
``tests/test_sim_fastloop.py`` compares the loop with the numpy request-by-request replay too.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tieredkv import policies
from tieredkv.policies import _jit
from tieredkv.sim import Trace, fastloop, read_trace, replay, victims

pytestmark = pytest.mark.skipif(not _jit.enable(), reason="numba is not installed (pip install 'tieredkv[fast]')")

TRACES = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "traces")
POLICIES = ["lru", "fifo", "lfu", "clock", "sieve", "s3fifo", "arc"]


def _full(kind: str) -> Trace:
    return read_trace(os.path.join(TRACES, f"mooncake_{kind}_trace.jsonl"))


def _slice(trace: Trace, start: int, n: int) -> Trace:
    return Trace.from_requests((trace.request(i).tolist() for i in range(start, start + n)),
                               name=f"{trace.name}[{start}:{start + n}]")


@pytest.fixture(scope="module")
def traces():
    syn, conv = _full("synthetic"), _full("conversation")
    # A slice from the start and one from the middle of each trace (other sessions, other reuse).
    return {"synthetic": _slice(syn, 0, 1500), "synthetic-mid": _slice(syn, 2000, 1200),
            "conversation": _slice(conv, 0, 1500), "conversation-mid": _slice(conv, 6000, 1500)}


def _replay(trace: Trace, name: str, capacity: int, incremental: bool):
    cache = replay._Cache(policies.make(name), capacity, trace.unique_blocks)
    out = fastloop.run(cache, trace, incremental=incremental)
    assert out is not None
    return out, cache


def _assert_same(trace: Trace, name: str, capacity: int) -> int:
    (hits, prefix), a = _replay(trace, name, capacity, incremental=False)
    (hits2, prefix2), b = _replay(trace, name, capacity, incremental=True)
    assert (hits, prefix, a.evictions) == (hits2, prefix2, b.evictions), (name, capacity)
    for field in a.st.layout.slot_fields:
        assert np.array_equal(getattr(a.st, field), getattr(b.st, field)), (name, capacity, field)
    assert np.array_equal(a.st.globals_view(), b.st.globals_view()), (name, capacity)
    assert np.array_equal(a.st._gw, b.st._gw), (name, capacity)
    assert np.array_equal(a.st._table.keys, b.st._table.keys) and np.array_equal(a.st._table.refs, b.st._table.refs)
    assert np.array_equal(a.slot_of, b.slot_of) and np.array_equal(a.block_at, b.block_at)
    assert a.free == b.free
    return a.evictions


@pytest.mark.parametrize("name", POLICIES)
def test_incremental_lists_choose_as_the_kernels_do(name, traces):
    for trace in traces.values():
        for fraction in (0.01, 0.05, 0.2, 0.4):
            cap = max(1, round(fraction * trace.unique_blocks))
            assert _assert_same(trace, name, cap) > 0


@pytest.mark.parametrize("name", POLICIES)
def test_incremental_lists_at_tiny_capacities_and_one_block_per_request(name, traces):
    """Requests longer than the cache (everything but the request's hits goes), and the accesses fed
    one block per request as libCacheSim sees them (nothing pinned)."""
    trace = traces["synthetic"]
    for cap in (1, 2, 3, 7):
        _assert_same(_slice(trace, 0, 200), name, cap)
    n = 20000
    per_block = Trace("per block", trace.blocks[:n].copy(), np.arange(n + 1, dtype=np.int64))
    for cap in (5, 300, 2000):
        assert _assert_same(per_block, name, cap) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["synthetic", "conversation"])
def test_incremental_lists_on_whole_traces(kind):
    trace = _full(kind)
    for name in POLICIES:
        for fraction in (0.01, 0.05, 0.2):
            _assert_same(trace, name, max(1, round(fraction * trace.unique_blocks)))


def test_lists_keep_push_order_through_moves_and_unlinks():
    links, lists, where, aux = victims.new(6, 3)
    for s in (4, 1, 5, 0):
        victims.push(links, lists, where, 0, s)
    victims.move_back(links, lists, where, 0, 1)      # 4 5 0 1
    victims.unlink(links, lists, where, 5)            # 4 0 1
    victims.push(links, lists, where, 2, 5)
    victims.unlink(links, lists, where, 3)            # on no list: nothing happens

    def walk(lst):
        out, s = [], lists[0, lst]
        while s >= 0:
            out.append(int(s))
            s = links[0, s]
        return out

    assert walk(0) == [4, 0, 1] and walk(2) == [5] and walk(1) == []
    assert list(lists[2]) == [3, 0, 1] and lists[1, 0] == 1 and where[5] == 2 and where[3] == -1
    cand = np.array([True, False, True, True, True, True])   # slot 1 pinned
    got = np.empty(3, dtype=np.int64)
    assert victims.oldest_of(links, lists, where, 0, cand, 2, got, 0) == 2 and list(got[:2]) == [4, 0]
    assert walk(0) == [1]
