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


# ---- each walk against its kernel on random states (small, so the walks wrap and run dry) ----------
def _lists_from(n_slots: int, n_lists: int, members: list[np.ndarray]):
    """The lists as the replay keeps them: list ``i`` holds ``members[i]`` in the given order."""
    links, lists, where, aux = victims.new(n_slots, n_lists)
    for lst, slots in enumerate(members):
        for s in slots:
            victims.push(links, lists, where, lst, int(s))
    return links, lists, where, aux


def _random_state(rng, n_slots: int):
    resident = (rng.random(n_slots) < 0.85).astype(np.int64)
    cand = (resident == 1) & (rng.random(n_slots) < 0.8)     # the others pinned
    order = rng.permutation(4 * n_slots)[:n_slots].astype(np.int64)
    return resident, cand, order


def _by_order(order: np.ndarray, mask: np.ndarray) -> np.ndarray:
    slots = np.flatnonzero(mask)
    return slots[np.argsort(order[slots], kind="stable")]


def _assert_lists_match(links, lists, members: list[np.ndarray]):
    for lst, want in enumerate(members):
        got, s = [], lists[0, lst]
        while s >= 0:
            got.append(int(s))
            s = links[0, s]
        assert got == want.tolist() and lists[2, lst] == len(want)


TRIALS = [(seed, n_slots) for seed in range(40) for n_slots in (1, 5, 23)]


@pytest.mark.parametrize("seed,n_slots", TRIALS)
def test_clock_and_sieve_walks_match_their_kernels(seed, n_slots):
    from tieredkv.policies import _kernels

    rng = np.random.default_rng(seed)
    resident, cand, order = _random_state(rng, n_slots)
    ref = rng.integers(0, 3, n_slots).astype(np.int64)
    n = int(rng.integers(1, n_slots + 3))
    seq = 4 * n_slots
    r1, o1, r2, o2 = ref.copy(), order.copy(), ref.copy(), order.copy()
    want, want_seq = _jit.clock_choose(r1, o1, cand.copy(), n, seq)
    links, lists, where, aux = _lists_from(n_slots, 1, [_by_order(order, resident == 1)])
    got, got_seq = victims.clock_choose(links, lists, where, r2, o2, cand.copy(), n, int(cand.sum()), seq,
                                          np.empty(n, np.int64))
    assert got.tolist() == want.tolist() and got_seq == want_seq
    assert np.array_equal(r1, r2) and np.array_equal(o1, o2)
    left = (resident == 1).copy()
    left[want] = False
    _assert_lists_match(links, lists, [_by_order(o1, left)])

    if not resident.any():
        return
    visited = rng.integers(0, 2, n_slots).astype(np.int64)
    res_orders = order[resident == 1]
    hand_at = int(rng.choice([0, int(rng.choice(res_orders)), int(rng.choice(res_orders)) + 1]))
    v1, v2 = visited.copy(), visited.copy()
    want, want_hand = _kernels.sieve_choose(v1, order, resident, cand.copy(), n, hand_at)
    for known_hand in (False, True):
        v2 = visited.copy()
        links, lists, where, aux = _lists_from(n_slots, 1, [_by_order(order, resident == 1)])
        if known_hand:   # the slot the replay would remember; unknown (-1): found by a scan
            at = [s for s in _by_order(order, resident == 1) if order[s] >= hand_at]
            aux[victims.HAND] = at[0] if at else -1
        got, got_hand = victims.sieve_choose(links, lists, where, aux, v2, order, cand.copy(), n, hand_at,
                                                     np.empty(n, np.int64))
        assert got.tolist() == want.tolist() and got_hand == want_hand and np.array_equal(v1, v2)


@pytest.mark.parametrize("seed,n_slots", TRIALS)
def test_s3fifo_and_lfu_walks_match_their_kernels(seed, n_slots):
    from tieredkv.policies import _kernels

    rng = np.random.default_rng(1000 + seed)
    resident, cand, order = _random_state(rng, n_slots)
    queue = rng.integers(0, 2, n_slots).astype(np.int64)
    freq = rng.integers(0, 4, n_slots).astype(np.int64)
    n = int(rng.integers(1, n_slots + 3))
    small_cap = int(rng.integers(0, n_slots + 1))
    seq = 4 * n_slots
    q1, f1, o1 = queue.copy(), freq.copy(), order.copy()
    want, want_seq = _kernels.s3fifo_choose(q1, f1, o1, resident, cand.copy(), n, n_slots, small_cap, 2, seq)
    q2, f2, o2 = queue.copy(), freq.copy(), order.copy()
    res = resident == 1
    links, lists, where, aux = _lists_from(n_slots, 3, [_by_order(order, res & (queue == 0)),
                                                         _by_order(order, res & (queue == 1))])
    got, got_seq = victims.s3fifo_choose(links, lists, where, q2, f2, o2, cand.copy(), n, n_slots, small_cap, 2, seq,
                                           np.empty(n, np.int64))
    assert got.tolist() == want.tolist() and got_seq == want_seq
    assert np.array_equal(q1, q2) and np.array_equal(f1, f2) and np.array_equal(o1, o2)
    left = res.copy()
    left[want] = False
    _assert_lists_match(links, lists, [_by_order(o1, left & (q1 == 0)), _by_order(o1, left & (q1 == 1))])

    hits = rng.integers(0, 4, n_slots).astype(np.int64)
    want = _kernels.smallest_lex(hits, order, n, cand.copy())
    links, lists, where, aux = _lists_from(n_slots, 5, [_by_order(order, res & (hits == b)) for b in range(4)])
    aux[victims.TOP] = 3
    got = victims.lfu_choose(links, lists, where, aux, cand.copy(), n, np.empty(n, np.int64))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("seed,n_slots", TRIALS)
def test_arc_walk_matches_its_kernel(seed, n_slots):
    from tieredkv.policies import _kernels

    rng = np.random.default_rng(2000 + seed)
    resident, cand, last = _random_state(rng, n_slots)
    arc_list = rng.integers(1, 3, n_slots).astype(np.int64)
    st = policies.SlotState.private(policies.make("arc"), max(n_slots, 8))
    incoming = rng.integers(1, 50, int(rng.integers(0, n_slots + 3))).astype(np.int64)
    st.ghost_push(np.unique(incoming[rng.random(len(incoming)) < 0.5]), 1)   # some of them are in B2
    w, tk, tr, L, R, _, shift = st.ghost_args()
    n = int(rng.integers(1, n_slots + 3))
    p = float(rng.integers(0, n_slots + 1))
    want = _kernels.arc_choose(arc_list, resident, last, cand.copy(), n, p, incoming, True, w, tk, tr, L, R, shift)
    res = resident == 1
    links, lists, where, aux = _lists_from(n_slots, 3, [np.zeros(0, np.int64), _by_order(last, res & (arc_list == 1)),
                                                         _by_order(last, res & (arc_list == 2))])
    got = victims.arc_choose(links, lists, where, arc_list, cand.copy(), n, p, incoming, w, tk, tr, L, R, shift,
                             np.empty(n, np.int64))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
@pytest.mark.parametrize("seed", range(12))
def test_insert_skips_the_probe_only_for_keys_the_miss_found_no_ghost(name, seed):
    """``*_miss_seen`` marks which missing keys are ghosts; the insert hook given those marks writes
    the same words as the one that probes every key (and as the miss hook without marks)."""
    from tieredkv.policies import _kernels

    rng = np.random.default_rng(3000 + seed)
    n_slots = 16
    st = policies.SlotState.private(policies.make(name), n_slots)
    pool = rng.permutation(np.arange(1, 200))
    for lst in range(st.layout.ghost_lists):   # some keys are ghosts, in each list
        st.ghost_push(pool[lst * 20:lst * 20 + int(rng.integers(1, 20))], lst)
    keys = np.ascontiguousarray(rng.choice(pool[:60], int(rng.integers(1, 10)), replace=False), dtype=np.int64)
    slots = np.arange(len(keys), dtype=np.int64)
    states = []
    for marked in (True, False):
        s2 = policies.SlotState.private(policies.make(name), n_slots)
        s2._gw[:], s2._table.keys[:], s2._table.refs[:] = st._gw, st._table.keys, st._table.refs
        w, tk, tr, L, R, cap, shift = s2.ghost_args()
        s2.key64[slots] = keys
        seen = np.ones(len(keys), dtype=np.bool_)
        field = np.zeros(n_slots, dtype=np.int64)
        if name == "s3fifo":
            if marked:
                _kernels.s3fifo_miss_seen(w, tk, tr, keys, L, R, cap, shift, seen)
            else:
                _kernels.s3fifo_miss(w, tk, tr, keys, L, R, cap, shift)
            out = _kernels.s3fifo_insert_counted(field, s2.s3_freq, s2.s3_order, s2.key64, slots, w, tk, tr, L, R,
                                                 shift, True, 3, 7, seen)
        else:
            p = _kernels.arc_miss_seen(w, tk, tr, keys, L, R, shift, 2.0, n_slots, seen) if marked else \
                _kernels.arc_miss(w, tk, tr, keys, L, R, shift, 2.0, n_slots)
            out = _kernels.arc_insert_counted(field, s2.key64, slots, w, tk, tr, L, R, shift, p, n_slots, 3, 2, seen)
        if marked:   # the marks say exactly which keys were ghosts before the miss
            assert seen.tolist() == [st.ghost_find(int(k))[0] >= 0 for k in keys]
        states.append((out, field.copy(), s2._gw.copy(), s2._table.keys.copy(), s2._table.refs.copy()))
    a, b = states
    assert a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1:], b[1:]))
