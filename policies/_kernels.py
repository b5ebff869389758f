"""Compiled (numba) versions of the policies' own decisions: LFU, CLOCK, SIEVE, S3-FIFO and ARC.

Each function here is the policy's hook written as a loop over the state's arrays, word for word what
the numpy code in the policy's module does (``tests/test_policies_jit.py`` runs every policy both ways
and compares every word of the state). The policies call them when the kernels are enabled
(``_jit.enable``), and the simulator's compiled replay loop (``tieredkv.sim.fastloop``) calls the very
same functions, so a policy keeps one definition of its decisions whether it runs in the hot tier's
shared memory, in a replay request by request, or in the compiled loop.

Plain Python until ``_jit.enable`` compiles them (``bind``): importing this module never imports numba.

Conventions: ``slots``/``keys`` are int64 arrays; a policy's global words are passed in and the new
values returned (the caller stores them); the ghost words are ``_jit``'s (``w``, ``tk``, ``tr``, lists
``L``, ring ``R``, list capacity ``cap``, table ``shift``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_I64_MIN = np.iinfo(np.int64).min
_I64_MAX = np.iinfo(np.int64).max
#: The ghost kernels of ``_jit`` (probe, push, remove, pop), handed over by ``bind``: this module
#: imports nothing of the package, so ``_jit`` imports it without a cycle.
_tfind: Any = None
_ghost_push: Any = None
_ghost_remove: Any = None
_ghost_pop: Any = None
_RUN = 64  # slots per run in k_smallest's first pass
GHOST_LIVE, GHOST_MARK = 1, 2        # state.GHOST_LIVE / GHOST_MARK (this module imports none of the package)


# ---- selection -----------------------------------------------------------------------------------
def _sift_down(hv, hs, i, m):
    """Restore the max-heap (by (value, slot)) of the first ``m`` entries below ``i``."""
    while True:
        c = 2 * i + 1
        if c >= m:
            return
        if c + 1 < m and (hv[c + 1] > hv[c] or (hv[c + 1] == hv[c] and hs[c + 1] > hs[c])):
            c += 1
        if hv[c] > hv[i] or (hv[c] == hv[i] and hs[c] > hs[i]):
            hv[i], hv[c] = hv[c], hv[i]
            hs[i], hs[c] = hs[c], hs[i]
            i = c
        else:
            return


def _heap_add(hv, hs, m, k, v, s):
    """Offer ``(v, s)`` to the bounded max-heap of the ``m`` (of at most ``k``) smallest; returns ``m``.
    Slots are offered in ascending order, so an equal value never beats the top."""
    if m < k:                           # not full: sift the new entry up
        i = m
        m += 1
        hv[i] = v
        hs[i] = s
        while i > 0:
            p = (i - 1) // 2
            if hv[p] > hv[i] or (hv[p] == hv[i] and hs[p] > hs[i]):
                break
            hv[i], hv[p] = hv[p], hv[i]
            hs[i], hs[p] = hs[p], hs[i]
            i = p
    elif v < hv[0]:
        hv[0] = v
        hs[0] = s
        _sift_down(hv, hs, 0, m)
    return m


def k_smallest(field, mask, after, below, k):
    """The up to ``k`` slots of ``mask`` with ``after < field < below`` smallest by ``(field, slot)``,
    in that order.

    Two passes, O(n_slots + k log k): the first takes the minimum of every run of 256 slots
    (branch-free, so it runs vectorised); the ``k`` smallest values all lie in the runs whose minimum
    is at most the k-th smallest run minimum (at least k values are at most that), so the second pass
    offers only those runs' slots, in ascending order, to a bounded max-heap.
    """
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    n = len(mask)
    n_runs = (n + _RUN - 1) // _RUN
    mins = np.empty(n_runs, dtype=field.dtype)
    for c in range(n_runs):
        mn = below
        run_f = field[c * _RUN:c * _RUN + _RUN]   # slices: LLVM vectorises this loop, not one over a range
        run_m = mask[c * _RUN:c * _RUN + _RUN]
        for i in range(len(run_f)):
            v = run_f[i]
            ok = run_m[i] & (v > after)
            mn = min(mn, v if ok else below)
        mins[c] = mn
    bar = below
    if n_runs > k:
        bar = np.partition(mins, k - 1)[k - 1]
    hv = np.empty(k, dtype=field.dtype)
    hs = np.empty(k, dtype=np.int64)
    m = 0
    # Values at or above ``top`` cannot enter the heap: the k smallest are all at most ``bar``.
    top = below if bar >= below else bar + 1
    for c in range(n_runs):
        if mins[c] >= below or mins[c] > bar:
            continue
        for s in range(c * _RUN, min(c * _RUN + _RUN, n)):
            v = field[s]
            if v < top and v > after and mask[s]:
                m = _heap_add(hv, hs, m, k, v, s)
                if m == k:
                    top = min(hv[0], top)
    for end in range(m - 1, 0, -1):     # heap sort: ascending by (value, slot)
        hv[0], hv[end] = hv[end], hv[0]
        hs[0], hs[end] = hs[end], hs[0]
        _sift_down(hv, hs, 0, end)
    return hs[:m].copy()


def oldest(field, n, candidates):
    """``order.oldest``: the ``n`` candidates smallest by ``(field, slot)``, in that order."""
    return k_smallest(field, candidates, _I64_MIN, _I64_MAX, n)


def smallest_lex(primary, secondary, n, candidates):
    """``order.smallest_lex`` for int64 fields: the ``n`` candidates smallest by ``(primary,
    secondary)``, in that order (ties on both go to the lower slot)."""
    count = 0
    for s in range(len(candidates)):
        if candidates[s]:
            count += 1
    m = min(n, count)
    if m <= 0:
        return np.zeros(0, dtype=np.int64)
    # The m smallest primaries (ties at the m-th to the smallest secondaries) are the victims.
    first = k_smallest(primary, candidates, _I64_MIN, _I64_MAX, m)
    kth = primary[first[m - 1]]
    below = 0
    for i in range(m):
        if primary[first[i]] < kth:
            below += 1
    tied = np.zeros(len(candidates), dtype=np.bool_)
    for s in range(len(candidates)):
        if candidates[s] and primary[s] == kth:
            tied[s] = True
    chosen = k_smallest(secondary, tied, _I64_MIN, _I64_MAX, m - below)
    sel = np.empty(m, dtype=np.int64)
    sel[:below] = first[:below]
    sel[below:] = chosen
    # Sort by (primary, secondary): stable sorts, the minor key first.
    sel = sel[np.argsort(secondary[sel], kind="mergesort")]
    return sel[np.argsort(primary[sel], kind="mergesort")]


def walk_next(order, mask, buf, at, after, size):
    """One step of ``order.OrderCursor``: the next slot of ``mask`` in ascending ``order`` (-1 at the
    end) and the cursor's new ``(buf, at, after, size)``. Refills take the next ``size`` smallest
    orders above the last one taken (``size`` grows fourfold), skipping slots no longer in ``mask``,
    exactly as the cursor does; a slot moved behind the others (a new largest order) comes up again."""
    while True:
        if at == len(buf):
            nxt = k_smallest(order, mask, after, _I64_MAX, size)
            if len(nxt) == 0:
                return -1, buf, at, after, size
            buf = nxt
            at = 0
            after = order[buf[len(buf) - 1]]
            size *= 4
        s = buf[at]
        at += 1
        if mask[s]:
            return s, buf, at, after, size


# ---- ghosts: what ``SlotState`` offers, over ``_jit``'s words -------------------------------------
def ghost_len(w, lst):
    return w[3 * lst + 2] if len(w) else 0


def ghost_find(w, tk, tr, key, L, R, shift):
    """``SlotState.ghost_find``: ``(list, flags)`` of ``key``, ``(-1, 0)`` if it is no ghost."""
    i = _tfind(tk, tr, key, shift)
    if i < 0:
        return -1, 0
    ref = tr[i] - 1
    return ref // R, w[3 * L + L * R + ref]


def ghost_mark(w, tk, tr, key, L, R, shift):
    i = _tfind(tk, tr, key, shift)
    if i >= 0:
        at = 3 * L + L * R + tr[i] - 1
        w[at] = w[at] | GHOST_MARK


def ghost_push(w, tk, tr, keys, lst, L, R, cap, shift, fresh):
    if L == 0 or len(keys) == 0:      # a state without ghost lists (too small for any)
        return
    flags = np.full(len(keys), GHOST_LIVE, dtype=np.int64)
    _ghost_push(w, tk, tr, keys, flags, lst, L, R, cap, shift, fresh)


# ---- CLOCK (``clock.Clock``) ---------------------------------------------------------------------
def clock_insert(ref, order, slots, init_ref, seq):
    """New blocks get ``init_ref`` and the next orders; returns the new ``clock_seq``."""
    for i in range(len(slots)):
        ref[slots[i]] = init_ref
        order[slots[i]] = seq + i
    return seq + len(slots)


def saturating_hit(counter, slots, top):
    """``counter[slots] = min(counter[slots] + 1, top)`` (CLOCK's reference, S3-FIFO's frequency)."""
    for i in range(len(slots)):
        s = slots[i]
        counter[s] = min(counter[s] + 1, top)


# ---- SIEVE (``sieve.Sieve``) ---------------------------------------------------------------------
def sieve_insert(visited, order, slots, seq):
    for i in range(len(slots)):
        visited[slots[i]] = 0
        order[slots[i]] = seq + i
    return seq + len(slots)


def sieve_hit(visited, slots):
    for i in range(len(slots)):
        visited[slots[i]] = 1


def sieve_choose(visited, order, resident, candidates, n, hand_at):
    """``Sieve.choose``: returns (victims, new ``sieve_hand``)."""
    mask = candidates.copy()
    head = _I64_MIN
    for s in range(len(resident)):      # branch-free: vectorised
        head = max(head, order[s] if resident[s] == 1 else _I64_MIN)
    buf = np.zeros(0, dtype=np.int64)
    at, after, size = 0, hand_at - 1, 32
    fresh = False
    victims = np.empty(n, dtype=np.int64)
    got = 0
    while got < n:
        s, buf, at, after, size = walk_next(order, mask, buf, at, after, size)
        if s < 0:
            if fresh:
                break
            buf = np.zeros(0, dtype=np.int64)      # past the head: a new walk from the tail
            at, after, size = 0, _I64_MIN, 32
            fresh = True
            continue
        fresh = False
        if visited[s]:
            visited[s] = 0
            continue
        victims[got] = s
        got += 1
        mask[s] = False
        hand_at = order[s] + 1 if order[s] < head else 0
    return victims[:got], hand_at


# ---- S3-FIFO (``s3fifo.S3FIFO``; queues SMALL = 0, MAIN = 1; ghost lists GHOST = 0, PENDING = 1) ---
def s3fifo_miss(w, tk, tr, keys, L, R, cap, shift):
    """``S3FIFO.on_miss``: keys in G move to the pending list."""
    s3fifo_miss_seen(w, tk, tr, keys, L, R, cap, shift, np.empty(len(keys), dtype=np.bool_))


def s3fifo_miss_seen(w, tk, tr, keys, L, R, cap, shift, seen):
    """``s3fifo_miss``, also writing whether each key is a ghost (``seen``, for ``s3fifo_insert_counted``)."""
    found = np.empty(len(keys), dtype=np.int64)
    nf = 0
    for i in range(len(keys)):          # membership first, as the vectorised lookup does
        lst = ghost_find(w, tk, tr, keys[i], L, R, shift)[0]
        seen[i] = lst >= 0
        if lst == 0:
            found[nf] = keys[i]
            nf += 1
    for i in range(nf):
        _ghost_remove(w, tk, tr, found[i], L, R, shift)
    ghost_push(w, tk, tr, found[:nf], 1, L, R, cap, shift, False)


def s3fifo_insert(queue, freq, order, resident, key64, slots, w, tk, tr, L, R, shift, warm, small_cap, seq):
    """``S3FIFO.on_insert`` (``warm``: nothing evicted yet); returns the new ``s3_seq``."""
    small = 0
    if warm:
        in_batch = np.zeros(len(resident), dtype=np.bool_)
        for i in range(len(slots)):
            in_batch[slots[i]] = True
        for s in range(len(resident)):
            if resident[s] == 1 and not in_batch[s] and queue[s] == 0:
                small += 1
    return s3fifo_insert_counted(queue, freq, order, key64, slots, w, tk, tr, L, R, shift, warm,
                                 max(small_cap - small, 0), seq, np.ones(len(slots), dtype=np.bool_))


def s3fifo_insert_counted(queue, freq, order, key64, slots, w, tk, tr, L, R, shift, warm, room, seq, seen):
    """``s3fifo_insert`` once the room left in S is known (``small_cap`` less the resident small
    blocks outside the batch; read only when ``warm``): the compiled replay keeps that count.
    ``seen[i]`` False: ``slots[i]``'s key is known to be no ghost (``s3fifo_miss_seen`` found none
    and only the keys of resident blocks became ghosts since), so it is not probed again."""
    n = len(slots)
    q = np.zeros(n, dtype=np.int64)
    for i in range(n):
        if seen[i] and ghost_find(w, tk, tr, key64[slots[i]], L, R, shift)[0] >= 0:
            q[i] = 1
    for i in range(n):
        if q[i] == 1:
            _ghost_remove(w, tk, tr, key64[slots[i]], L, R, shift)
    if warm:
        for i in range(n):
            if q[i] == 0:
                if room > 0:
                    room -= 1
                else:
                    q[i] = 1
    for i in range(n):
        s = slots[i]
        queue[s] = q[i]
        freq[s] = 0
        order[s] = seq + i
    return seq + n


def s3fifo_remove(queue, key64, slots, w, tk, tr, L, R, cap, shift):
    """``S3FIFO.on_remove`` of evicted ``slots``: those leaving S go to G."""
    keys = np.empty(len(slots), dtype=np.int64)
    k = 0
    for i in range(len(slots)):
        if queue[slots[i]] == 0:
            keys[k] = key64[slots[i]]
            k += 1
    ghost_push(w, tk, tr, keys[:k], 0, L, R, cap, shift, True)


def s3fifo_requeue(queue, freq, order, s, to_main, seq):
    """A block S3-FIFO's walk passes instead of evicting: from S to M (``to_main``: it was hit
    often enough; its count restarts) or back to M's tail (one hit spent); returns the next ``seq``."""
    if to_main:
        queue[s] = 1
        freq[s] = 0
    else:
        freq[s] -= 1
    order[s] = seq
    return seq + 1


def s3fifo_choose(queue, freq, order, resident, candidates, n, n_slots, small_cap, move_threshold, seq):
    """``S3FIFO.choose``: returns (victims, new ``s3_seq``)."""
    n_small = 0
    n_res = 0
    small_mask = np.empty(len(candidates), dtype=np.bool_)
    main_mask = np.empty(len(candidates), dtype=np.bool_)
    for s in range(len(candidates)):    # branch-free: vectorised
        r = resident[s] == 1
        small = queue[s] == 0
        n_res += r
        n_small += r & small
        small_mask[s] = candidates[s] & small
        main_mask[s] = candidates[s] & ~small
    n_main = n_res - n_small
    main_cap = n_slots - small_cap
    sbuf = np.zeros(0, dtype=np.int64)
    sat, safter, ssize = 0, _I64_MIN, 32
    mbuf = np.zeros(0, dtype=np.int64)
    mat, mafter, msize = 0, _I64_MIN, 32
    victims = np.empty(n, dtype=np.int64)
    got = 0
    while got < n:
        from_main = n_main > main_cap or n_small == 0
        victim = -1
        if not from_main:
            while True:
                s, sbuf, sat, safter, ssize = walk_next(order, small_mask, sbuf, sat, safter, ssize)
                if s < 0:
                    break
                small_mask[s] = False
                n_small -= 1
                if freq[s] >= move_threshold:
                    seq = s3fifo_requeue(queue, freq, order, s, True, seq)
                    main_mask[s] = True
                    n_main += 1
                else:
                    victim = s
                    break
        if victim < 0:
            while True:
                s, mbuf, mat, mafter, msize = walk_next(order, main_mask, mbuf, mat, mafter, msize)
                if s < 0:
                    break
                if freq[s]:
                    seq = s3fifo_requeue(queue, freq, order, s, False, seq)
                else:
                    victim = s
                    main_mask[s] = False
                    n_main -= 1
                    break
        if victim < 0:
            s, sbuf, sat, safter, ssize = walk_next(order, small_mask, sbuf, sat, safter, ssize)
            if s < 0:
                break
            small_mask[s] = False
            n_small -= 1
            victim = s
        victims[got] = victim
        got += 1
    return victims[:got], seq


# ---- ARC (``arc.ARC``; lists T1 = 1, T2 = 2; ghost lists B1 = 0, B2 = 1) ------------------------------
def arc_adapt(w, lst, p, n_slots):
    """``ARC._adapt``: the new target size of T1 after a ghost hit in ``lst``."""
    b1 = ghost_len(w, 0)
    b2 = ghost_len(w, 1)
    if lst == 0:
        return min(float(n_slots), p + max(b2 / b1, 1.0))
    return max(0.0, p - max(b1 / b2, 1.0))


def arc_miss(w, tk, tr, keys, L, R, shift, p, n_slots):
    """``ARC.on_miss``: adapt ``p`` for each missing key found unmarked in a ghost list; returns ``p``."""
    return arc_miss_seen(w, tk, tr, keys, L, R, shift, p, n_slots, np.empty(len(keys), dtype=np.bool_))


def arc_miss_seen(w, tk, tr, keys, L, R, shift, p, n_slots, seen):
    """``arc_miss``, also writing whether each key is a ghost (``seen``, for ``arc_insert_counted``)."""
    lists = np.empty(len(keys), dtype=np.int64)
    todo = np.zeros(len(keys), dtype=np.bool_)
    for i in range(len(keys)):          # membership first, as the vectorised lookup does
        lst, flags = ghost_find(w, tk, tr, keys[i], L, R, shift)
        lists[i] = lst
        seen[i] = lst >= 0
        todo[i] = lst >= 0 and flags & GHOST_MARK == 0
    for i in range(len(keys)):
        if todo[i]:
            p = arc_adapt(w, lists[i], p, n_slots)
            ghost_mark(w, tk, tr, keys[i], L, R, shift)
    return p


def arc_insert(lists, resident, key64, slots, w, tk, tr, L, R, shift, p, n_slots):
    """``ARC.on_insert``; returns ``p``."""
    t1 = 0
    n_res = 0
    for s in range(len(resident)):      # branch-free: vectorised
        r = resident[s] == 1
        n_res += r
        t1 += r & (lists[s] == 1)
    for i in range(len(slots)):         # the batch (resident already) is not counted
        n_res -= 1
        t1 -= lists[slots[i]] == 1
    return arc_insert_counted(lists, key64, slots, w, tk, tr, L, R, shift, p, n_slots, t1, n_res - t1,
                              np.ones(len(slots), dtype=np.bool_))


def arc_insert_counted(lists, key64, slots, w, tk, tr, L, R, shift, p, n_slots, t1, t2, seen):
    """``arc_insert`` once T1's and T2's resident lengths outside the batch are known (the compiled
    replay keeps them); ``seen`` as in ``s3fifo_insert_counted`` (from ``arc_miss_seen``)."""
    c = n_slots
    for i in range(len(slots)):
        s = slots[i]
        key = key64[s]
        lst, flags = ghost_find(w, tk, tr, key, L, R, shift) if seen[i] else (-1, 0)
        if lst >= 0:
            if not flags & GHOST_MARK:
                p = arc_adapt(w, lst, p, n_slots)
            _ghost_remove(w, tk, tr, key, L, R, shift)
            lists[s] = 2
            t2 += 1
            continue
        b1 = ghost_len(w, 0)
        b2 = ghost_len(w, 1)
        if t1 + b1 >= c:
            if b1:
                _ghost_pop(w, tk, tr, 0, L, R, shift)
        elif t1 + t2 + b1 + b2 >= 2 * c and b2:
            _ghost_pop(w, tk, tr, 1, L, R, shift)
        lists[s] = 1
        t1 += 1
    return p


def arc_hit(lists, slots):
    for i in range(len(slots)):
        lists[slots[i]] = 2


def arc_remove(lists, key64, slots, w, tk, tr, L, R, cap, shift):
    """``ARC.on_remove`` of evicted ``slots``: keys from T1 go to B1, from T2 to B2, in order."""
    b1 = np.empty(len(slots), dtype=np.int64)
    b2 = np.empty(len(slots), dtype=np.int64)
    n1 = 0
    n2 = 0
    for i in range(len(slots)):
        s = slots[i]
        if lists[s] == 1:
            b1[n1] = key64[s]
            n1 += 1
        else:
            b2[n2] = key64[s]
            n2 += 1
    ghost_push(w, tk, tr, b1[:n1], 0, L, R, cap, shift, True)
    ghost_push(w, tk, tr, b2[:n2], 1, L, R, cap, shift, True)


def arc_from_t1(t1, p, incoming, has_incoming, n, i, w, tk, tr, L, R, shift):
    """The paper's rule for the ``i``-th of ``n`` victims: from T1 (True) or T2. The key it makes
    room for is ``incoming``'s matching one, if the home passed them."""
    if t1 < 1 or t1 < p:
        return False
    if t1 > p:
        return True
    # t1 == p: the tie goes to T1 if the key is in B2 (probed only here: most calls never need it)
    j = len(incoming) - n + i
    return has_incoming and j >= 0 and ghost_find(w, tk, tr, incoming[j], L, R, shift)[0] == 1


def arc_choose(lists, resident, last_access, candidates, n, p, incoming, has_incoming, w, tk, tr, L, R, shift):
    """``ARC.choose``: T1's or T2's least recent candidates, by the paper's rule."""
    t1 = 0
    m1 = np.empty(len(candidates), dtype=np.bool_)
    m2 = np.empty(len(candidates), dtype=np.bool_)
    for s in range(len(candidates)):    # branch-free: vectorised
        in_t1 = lists[s] == 1
        t1 += in_t1 & (resident[s] == 1)
        m1[s] = candidates[s] & in_t1
        m2[s] = candidates[s] & ~in_t1
    b1, a1, f1, z1 = np.zeros(0, dtype=np.int64), 0, _I64_MIN, 32
    b2, a2, f2, z2 = np.zeros(0, dtype=np.int64), 0, _I64_MIN, 32
    victims = np.empty(n, dtype=np.int64)
    got = 0
    for i in range(n):
        first_t1 = arc_from_t1(t1, p, incoming, has_incoming, n, i, w, tk, tr, L, R, shift)
        s = -1
        for attempt in range(2):
            if first_t1 == (attempt == 0):
                s, b1, a1, f1, z1 = walk_next(last_access, m1, b1, a1, f1, z1)
            else:
                s, b2, a2, f2, z2 = walk_next(last_access, m2, b2, a2, f2, z2)
            if s >= 0:
                break
        if s < 0:
            break
        if lists[s] == 1:
            t1 -= 1
        victims[got] = s
        got += 1
    return victims[:got]


#: Compiled in this order on ``bind`` (a function calls the compiled versions of those before it).
_ORDER = ("_sift_down", "_heap_add", "k_smallest", "oldest", "smallest_lex", "walk_next", "ghost_len", "ghost_find",
          "ghost_mark", "ghost_push", "clock_insert", "saturating_hit", "sieve_insert", "sieve_hit",
          "sieve_choose", "s3fifo_miss_seen", "s3fifo_miss", "s3fifo_insert_counted", "s3fifo_insert",
          "s3fifo_remove", "s3fifo_requeue", "s3fifo_choose", "arc_adapt", "arc_miss_seen", "arc_miss",
          "arc_insert_counted", "arc_insert", "arc_hit", "arc_remove", "arc_from_t1", "arc_choose")


def bind(compile_, tfind, ghost_push, ghost_remove, ghost_pop) -> None:
    """Replace every function above by its compiled version, over ``_jit``'s compiled ghost kernels
    (``_jit.enable`` calls this once)."""
    g = globals()
    g.update(_tfind=tfind, _ghost_push=ghost_push, _ghost_remove=ghost_remove, _ghost_pop=ghost_pop)
    for name in _ORDER:
        g[name] = compile_(g[name])
