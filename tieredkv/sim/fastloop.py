"""The replay's per-request loop compiled whole (numba), over the policies' own compiled kernels.

``replay.simulate`` serves a request in a few dozen Python-level steps (lookups, ``hit``, ``evict``,
``insert`` and each policy's hooks); a whole-trace sweep of thousands of requests spends most of its
time in that glue. Here the same steps run as one compiled loop over the trace: the block id -> slot
lookups, the hit and prefix-hit counts, pinning the request's hits, the free-slot stack and the
common bookkeeping (``_jit.insert_common`` / ``remove_common``), with every policy decision taken by
the kernels its class calls in the hot tier (``policies._kernels``, ``_jit``). Nothing here decides
which block goes: the loop only sequences the calls ``base.hit`` / ``evict`` / ``insert`` make, in
the order they make them, so the state ends word for word as the request-by-request replay leaves it
(``tests/test_sim_fastloop.py`` compares every field, global and ghost word, for every policy).

Used for the policies whose every hook has a kernel (``KINDS``: LRU, FIFO, LFU, CLOCK, SIEVE, S3-FIFO,
ARC, as registered, not subclasses) when the kernels are enabled; the others replay request by request.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv.policies import _jit, _kernels
from tieredkv.policies.arc import ARC
from tieredkv.policies.clock import Clock
from tieredkv.policies.fifo import FIFO
from tieredkv.policies.lfu import LFU
from tieredkv.policies.lru import LRU
from tieredkv.policies.s3fifo import S3FIFO
from tieredkv.policies.sieve import Sieve

from . import victims as vs

__all__ = ["KINDS", "supports", "run"]

#: Policy classes with a compiled replay, and the number the loop dispatches on.
KINDS: dict[type, int] = {LRU: 0, FIFO: 1, LFU: 2, Clock: 3, Sieve: 4, S3FIFO: 5, ARC: 6}
_COMMON = 8            # the common slot fields come first in every layout (state.COMMON_SLOT_FIELDS)
_compiled: Any = None  # the compiled ``_replay`` once ``_bind`` ran


def _on_hit(kind, f0, f1, prm, slots):
    if kind == 3:
        _kernels.saturating_hit(f0, slots, prm[0])
    elif kind == 4:
        _kernels.sieve_hit(f0, slots)
    elif kind == 5:
        _kernels.saturating_hit(f1, slots, prm[2])
    elif kind == 6:
        _kernels.arc_hit(f0, slots)


def _choose(kind, resident, last, ins, hits, f0, f1, f2, g, gf, gi, prm, n, cand, ids, w, tk, tr, L, R, shift):
    """The victims the policy's kernels choose (a pass over all the slots, as the hot tier does)."""
    if kind == 0:
        return _kernels.oldest(last, n, cand)
    if kind == 1:
        return _kernels.oldest(ins, n, cand)
    if kind == 2:
        return _kernels.smallest_lex(hits, last, n, cand)
    if kind == 3:
        victims, seq = _jit.clock_choose(f0, f1, cand, n, g[gi[0]])
        g[gi[0]] = seq
        return victims
    if kind == 4:
        victims, hand = _kernels.sieve_choose(f0, f1, resident, cand, n, g[gi[1]])
        g[gi[1]] = hand
        return victims
    if kind == 5:
        victims, seq = _kernels.s3fifo_choose(f0, f1, f2, resident, cand, n, len(resident), prm[0], prm[1], g[gi[0]])
        g[gi[0]] = seq
        if len(victims):
            g[gi[1]] = 1
        return victims
    return _kernels.arc_choose(f0, resident, last, cand, n, gf[gi[0]], ids, True, w, tk, tr, L, R, shift)


def _choose_inc(kind, n_slots, f0, f1, f2, g, gi, prm, n, cand, count, links, lists, where, aux, victims):
    """``_choose`` from the lists kept incrementally (``victims``) for LFU, CLOCK, SIEVE and S3-FIFO
    (the loop takes LRU's, FIFO's and ARC's itself): the same victims in the same order, the same
    state words written. ``count``: the candidates (resident, not pinned); ``victims``: a buffer of at
    least ``n`` words, which the returned victims are a part of."""
    if kind == 2:
        return vs.lfu_choose(links, lists, where, aux, cand, n, victims)
    if kind == 3:
        victims, seq = vs.clock_choose(links, lists, where, f0, f1, cand, n, count, g[gi[0]], victims)
        g[gi[0]] = seq
        return victims
    if kind == 4:
        victims, hand = vs.sieve_choose(links, lists, where, aux, f0, f1, cand, n, g[gi[1]], victims)
        g[gi[1]] = hand
        return victims
    victims, seq = vs.s3fifo_choose(links, lists, where, f0, f1, f2, cand, n, n_slots, prm[0], prm[1], g[gi[0]],
                                    victims)
    g[gi[0]] = seq
    if len(victims):
        g[gi[1]] = 1
    return victims


def _on_insert(kind, resident, key64, f0, f1, f2, g, gf, gi, prm, slots, w, tk, tr, L, R, shift):
    if kind == 3:
        g[gi[0]] = _kernels.clock_insert(f0, f1, slots, prm[1], g[gi[0]])
    elif kind == 4:
        g[gi[0]] = _kernels.sieve_insert(f0, f1, slots, g[gi[0]])
    elif kind == 5:
        g[gi[0]] = _kernels.s3fifo_insert(f0, f1, f2, resident, key64, slots, w, tk, tr, L, R, shift, g[gi[1]] == 0,
                                          prm[0], g[gi[0]])
    elif kind == 6:
        gf[gi[0]] = _kernels.arc_insert(f0, resident, key64, slots, w, tk, tr, L, R, shift, gf[gi[0]], len(resident))


def _link(kids, parent, slots):
    """Put each of ``slots`` that has a parent on its parent's child list."""
    first, nxt, prv = kids[0], kids[1], kids[2]
    for j in range(len(slots)):
        s = slots[j]
        p = parent[s]
        if p >= 0:
            nxt[s] = first[p]
            prv[s] = -1
            if first[p] >= 0:
                prv[first[p]] = s
            first[p] = s


def _remove_common(resident, parent, n_children, slots, kids):
    """``_jit.remove_common`` (``base.remove``'s common fields), word for word, but finding the
    children of the removed blocks on their child lists (``kids``: first child, next and previous
    sibling per slot) rather than by a pass over every slot's parent."""
    first, nxt, prv = kids[0], kids[1], kids[2]
    for i in range(len(slots)):
        s = slots[i]
        p = parent[s]
        if p >= 0:
            n_children[p] -= 1
            if prv[s] >= 0:
                nxt[prv[s]] = nxt[s]
            else:
                first[p] = nxt[s]
            if nxt[s] >= 0:
                prv[nxt[s]] = prv[s]
            nxt[s] = -1
            prv[s] = -1
    for i in range(len(slots)):             # the children left lose their parent link
        c = first[slots[i]]
        while c >= 0:
            after = nxt[c]
            parent[c] = -1
            nxt[c] = -1
            prv[c] = -1
            c = after
        first[slots[i]] = -1
    for i in range(len(slots)):
        s = slots[i]
        resident[s] = 0
        parent[s] = -1
        n_children[s] = 0


def _lookup(slot_of, blocks, a, b, hit_slots, miss_at):
    """The resident blocks of ``blocks[a:b]`` (their slots, in prompt order) and the positions of the
    others; returns how many of each."""
    nh = 0
    nm = 0
    for i in range(a, b):
        s = slot_of[blocks[i]]
        if s >= 0:
            hit_slots[nh] = s
            nh += 1
        else:
            miss_at[nm] = i - a
            nm += 1
    return nh, nm


def _hit_common(last, hits, slots, t):
    """``base.hit``'s common fields: a tick each, in prompt order; returns the last tick."""
    for j in range(len(slots)):
        t += 1
        last[slots[j]] = t
        hits[slots[j]] += 1
    return t


def _pin(cand, slots, flag):
    for j in range(len(slots)):
        cand[slots[j]] = flag


def _release(victims, cand, slot_of, block_at, free, top):
    """The victims' slots out of the maps and back on the free stack; returns its new top."""
    for j in range(len(victims)):
        v = victims[j]
        cand[v] = False
        slot_of[block_at[v]] = -1
        block_at[v] = -1
        free[top] = v
        top += 1
    return top


def _take(free, top, ids, new, slot_of, block_at):
    """Slots for ``ids`` from the free stack's top (the top first) into ``new``, mapped both ways."""
    for j in range(len(ids)):
        s = free[top - 1 - j]
        new[j] = s
        slot_of[ids[j]] = s
        block_at[s] = ids[j]


def _gather(blocks, prev, a, miss_at, ids, pids):
    """The missing blocks' ids and their parents' ids (-1: none), for the ``len(ids)`` first misses."""
    for j in range(len(ids)):
        ids[j] = blocks[a + miss_at[j]]
        pids[j] = prev[a + miss_at[j]]


def _resolve(slot_of, pids, parents):
    """The slots of the parents ``pids`` (-1: none or not resident) into ``parents``, once the batch's own
    slots are mapped."""
    for j in range(len(pids)):
        parents[j] = slot_of[pids[j]] if pids[j] >= 0 else -1


def _replay(kind, blocks, prev, offsets, r0, r1, fields, g, gf, gi, prm, w, tk, tr, L, R, gcap, shift,
            slot_of, block_at, free, cand, kids, acc, inc, vic, buf):
    """Requests ``r0`` to ``r1``, as ``replay.simulate`` serves them; ``acc`` holds (hits, prefix hits,
    evictions, free-stack top) across calls; ``inc``: keep and use the incremental victim lists ``vic``;
    ``buf``: scratch, 7 rows of at least the longest request's length.

    The policy's kernels are called here directly, per kind: a compiled call that LLVM does not
    inline costs an atomic reference count per array argument each way, so a dispatching wrapper
    with twenty arrays would cost more than the kernel it calls."""
    # Unpacked once: a tuple of arrays handed to a compiled call costs a reference count per array.
    resident, key64, last, ins, hits, parent, n_children, position, f0, f1, f2 = fields
    links, lists, where, aux = vic
    hit_slots, miss_at, ids, pids, new, parents, vbuf = buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6]
    # Per missing key, whether on_miss found it a ghost: one that is not stays none until its insert
    # (only evicted blocks' keys become ghosts, and a missing block is not resident), so the insert
    # hook probes the ghost table only for those that are.
    seen = np.ones(len(vbuf), dtype=np.bool_)
    n_slots = len(resident)
    n_hits, n_prefix, evictions, top = acc[0], acc[1], acc[2], acc[3]
    for r in range(r0, r1):
        a = offsets[r]
        nh, nm = _lookup(slot_of, blocks, a, offsets[r + 1], hit_slots, miss_at)   # 1. look up every block
        if nh:                              # base.hit: a tick each, in prompt order
            g[0] = _hit_common(last, hits, hit_slots[:nh], g[0])
            if kind >= 3:
                _on_hit(kind, f0, f1, prm, hit_slots[:nh])
            if inc and (kind == 0 or kind == 2 or kind == 6):
                vs.on_hit(kind, links, lists, where, aux, hits, hit_slots[:nh])
            n_hits += nh
        if nm == 0:
            n_prefix += nh
            continue
        n_prefix += miss_at[0]
        # 2. _Cache.store of the misses (their leading ``n_slots`` at most)
        m = min(nm, n_slots)
        _gather(blocks, prev, a, miss_at, ids[:m], pids)
        need = m - top
        if kind == 5:                       # base.evict's on_miss (``seen``: which keys are ghosts)
            _kernels.s3fifo_miss_seen(w, tk, tr, ids[:m], L, R, gcap, shift, seen)
        elif kind == 6:
            gf[gi[0]] = _kernels.arc_miss_seen(w, tk, tr, ids[:m], L, R, shift, gf[gi[0]], n_slots, seen)
        if need > 0 and g[1] - nh > 0:      # base.evict: some resident slot is a candidate
            _pin(cand, hit_slots[:nh], False)   # never the request's hits
            if not inc:
                victims = _choose(kind, resident, last, ins, hits, f0, f1, f2, g, gf, gi, prm, need, cand, ids[:m],
                                  w, tk, tr, L, R, shift)
            elif kind <= 1:
                victims = vbuf[:vs.oldest_of(links, lists, where, 0, cand, need, vbuf, 0)]
            elif kind == 6:
                victims = vs.arc_choose(links, lists, where, f0, cand, need, gf[gi[0]], ids[:m], w, tk, tr, L, R,
                                        shift, vbuf)
            else:
                victims = _choose_inc(kind, n_slots, f0, f1, f2, g, gi, prm, need, cand, g[1] - nh, links, lists,
                                      where, aux, vbuf)
            nv = len(victims)
            if nv:                          # base.remove: the policy's hook, then the common fields
                if kind == 5:
                    _kernels.s3fifo_remove(f0, key64, victims, w, tk, tr, L, R, gcap, shift)
                elif kind == 6:
                    _kernels.arc_remove(f0, key64, victims, w, tk, tr, L, R, gcap, shift)
                _remove_common(resident, parent, n_children, victims, kids)
                g[1] -= nv
                top = _release(victims, cand, slot_of, block_at, free, top)
            _pin(cand, hit_slots[:nh], True)
            evictions += nv
        k = min(m, top)
        if k == 0:
            continue
        _take(free, top, ids[:k], new, slot_of, block_at)
        top -= k
        _resolve(slot_of, pids[:k], parents)   # after the batch's own slots are set
        first = g[0] + 1
        g[0] += k
        _jit.insert_common(resident, key64, last, ins, hits, n_children, position, parent, new[:k], ids[:k],
                           parents[:k], miss_at[:k], first)
        _link(kids, parent, new[:k])
        g[1] += k
        _pin(cand, new[:k], True)
        if not inc:
            _on_insert(kind, resident, key64, f0, f1, f2, g, gf, gi, prm, new[:k], w, tk, tr, L, R, shift)
            continue
        if kind == 5:                       # S3-FIFO's and ARC's queue lengths from the lists
            g[gi[0]] = _kernels.s3fifo_insert_counted(f0, f1, f2, key64, new[:k], w, tk, tr, L, R, shift,
                                                      g[gi[1]] == 0, max(prm[0] - lists[2, 0], 0), g[gi[0]], seen)
        elif kind == 6:
            gf[gi[0]] = _kernels.arc_insert_counted(f0, key64, new[:k], w, tk, tr, L, R, shift, gf[gi[0]], n_slots,
                                                    lists[2, 1], lists[2, 2], seen)
        elif kind >= 3:
            _on_insert(kind, resident, key64, f0, f1, f2, g, gf, gi, prm, new[:k], w, tk, tr, L, R, shift)
        vs.on_insert(kind, links, lists, where, aux, f0, new[:k])
    acc[0], acc[1], acc[2], acc[3] = n_hits, n_prefix, evictions, top


def _has_repeats(blocks, offsets, n_ids):
    """True if some request holds a block id twice (the loop assumes distinct ids per request)."""
    seen = np.full(n_ids, -1, dtype=np.int64)
    for r in range(len(offsets) - 1):
        for i in range(offsets[r], offsets[r + 1]):
            if seen[blocks[i]] == r:
                return True
            seen[blocks[i]] = r
    return False


def _bind() -> None:
    global _compiled, _on_hit, _choose, _on_insert, _link, _remove_common, _has_repeats
    global _choose_inc, _gather, _resolve, _lookup, _hit_common, _pin, _release, _take
    # Cached, and compiled afresh when any kernel's source changes (this file's and the lists' too).
    compile_ = _jit.compiler(__file__, vs.__file__)
    vs.bind(compile_)
    _on_hit, _choose, _on_insert = compile_(_on_hit), compile_(_choose), compile_(_on_insert)
    _has_repeats, _choose_inc = compile_(_has_repeats), compile_(_choose_inc)
    _gather, _resolve = compile_(_gather), compile_(_resolve)
    _link, _remove_common = compile_(_link), compile_(_remove_common)
    _lookup, _hit_common, _pin = compile_(_lookup), compile_(_hit_common), compile_(_pin)
    _release, _take = compile_(_release), compile_(_take)
    _compiled = compile_(_replay)


#: Per trace: what ``_prepared`` derived from it (a sweep replays one trace dozens of times).
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _prepared(trace, n_ids: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """``(blocks, offsets, previous block per access or -1, whether a request repeats an id)`` of
    ``trace``, computed once per trace object (a ``Trace`` is frozen)."""
    got = _PREPARED.get(trace)
    if got is not None and got[0] is trace.blocks and got[1] is trace.offsets and got[2] == n_ids:
        return got[3]
    blocks = np.ascontiguousarray(trace.blocks, dtype=np.int64)
    offsets = np.ascontiguousarray(trace.offsets, dtype=np.int64)
    prev = np.empty_like(blocks)
    prev[1:] = blocks[:-1]
    prev[offsets[:-1][offsets[:-1] < len(blocks)]] = -1
    out = (blocks, offsets, prev, bool(_has_repeats(blocks, offsets, n_ids)))
    _PREPARED[trace] = (trace.blocks, trace.offsets, n_ids, out)
    return out


def supports(policy) -> bool:
    """Whether ``policy`` replays in the compiled loop here (its class has kernels for every hook and
    the kernels are enabled)."""
    return _jit.ENABLED and type(policy) in KINDS


def run(cache, trace, progress: Callable[[int], None] | None = None, *,
        incremental: bool = True) -> tuple[int, int] | None:
    """Replay ``trace`` into ``cache`` (a fresh ``replay._Cache``) in the compiled loop.

    Args:
        cache: the level to fill.
        trace: the requests.
        progress: called with the number of requests done since the last call.
        incremental: choose the victims from lists kept incrementally (``victims``: O(victims) per
            eviction); False: with the policies' own kernels, which pass over all the slots (the
            hot tier's way; the same decisions, kept to compare).

    Returns:
        ``(hits, prefix hits)``, with ``cache``'s state, maps, free slots and eviction count as the
        request-by-request replay leaves them; None (nothing done) if the trace repeats a block id
        inside a request, which only the request-by-request replay handles.
    """
    if _compiled is None:
        _bind()
    policy, st = cache.policy, cache.st
    blocks, offsets, prev, repeats = _prepared(trace, len(cache.slot_of))
    if repeats:
        return None
    layout = st.layout
    names = layout.slot_fields
    fields = [getattr(st, f) for f in names]
    fields += [np.zeros(1, dtype=np.int64)] * (_COMMON + 3 - len(fields))   # unused by this policy
    gi = np.array([st.global_index(n) for n in policy.global_fields] or [0], dtype=np.int64)
    if isinstance(policy, Clock):
        prm = [policy.max_ref, policy.init_ref, 0]
    elif isinstance(policy, S3FIFO):
        prm = [policy.small_capacity(st.n_slots), policy.move_threshold, policy.max_freq]
    else:
        prm = [0, 0, 0]
    w, tk, tr, L, R, gcap, shift = st.ghost_args()
    if len(cache.free) == cache.capacity and not cache.evictions:
        # A fresh cache's stack (capacity - 1 down to 0: nothing was stored, so none was evicted),
        # without converting the list.
        free = np.arange(cache.capacity - 1, -1, -1, dtype=np.int64)
    else:
        free = np.zeros(cache.capacity, dtype=np.int64)
        free[:len(cache.free)] = cache.free
    cand = st.resident == 1
    if st.resident.any():
        raise ValueError("the compiled replay starts from an empty cache")
    kids = np.full((3, cache.capacity), -1, dtype=np.int64)   # first child, next and previous sibling
    acc = np.array([0, 0, cache.evictions, len(cache.free)], dtype=np.int64)
    kind = KINDS[type(policy)]
    vic = vs.new(cache.capacity, vs.lists_for(kind, trace.n_requests) if incremental else 1)
    g = st.globals_view()
    longest = int(np.max(np.diff(offsets))) if trace.n_requests else 1
    buf = np.empty((7, max(longest, cache.capacity, 1)), dtype=np.int64)   # the loop's scratch
    step = max(trace.n_requests // 100, 1) if progress is not None else trace.n_requests
    for r0 in range(0, trace.n_requests, max(step, 1)):
        r1 = min(r0 + step, trace.n_requests)
        _compiled(kind, blocks, prev, offsets, r0, r1, tuple(fields), g, st.globals_view(np.float64),
                  gi, np.array(prm, dtype=np.int64), w, tk, tr, L, R, gcap, shift, cache.slot_of, cache.block_at,
                  free, cand, kids, acc, incremental, vic, buf)
        if progress is not None:
            progress(r1 - r0)
    cache.evictions = int(acc[2])
    cache.free = free[:int(acc[3])].tolist()
    return int(acc[0]), int(acc[1])
