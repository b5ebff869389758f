"""Compiled kernels for the bookkeeping every policy operation does (numba, optional).

``insert`` and ``remove`` in ``base.py`` keep the common per-slot fields; done with numpy that is a
dozen small array operations per call, which dominates a replay (one call per request) and the hot
tier's store path. With numba installed (``pip install 'tieredkv[fast]'``) and the kernels enabled
(``enable``: the simulator does; a serving process with ``TIEREDKV_NUMBA=1``) they run as one compiled
loop each; otherwise the numpy code in ``base.py`` runs, slower, to the same result: the kernels
write exactly what the numpy code writes (``tests/test_policies_jit.py`` replays workloads both
ways and compares every word of the state), so processes with and without numba can share one
segment.

``TIEREDKV_NO_NUMBA=1`` keeps the kernels off (to compare, or to rule them out).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

_OFF = os.environ.get("TIEREDKV_NO_NUMBA", "") in ("1", "true", "yes")

#: The numba module once ``enable`` imported it (None before, or when it is missing or turned off).
numba: Any = None
#: True once ``enable`` bound the compiled kernels; the callers test it on every call.
ENABLED = False
insert_common: Any = None
remove_common: Any = None
oldest: Any = None
clock_choose: Any = None
table_find: Any = None
ghost_remove: Any = None
ghost_pop: Any = None
ghost_push: Any = None
ghost_lookup: Any = None
#: One refill of CLOCK's walk: the up to ``size`` candidates with the smallest order in ``(after,
#: below)``, ascending (``_kernels.k_smallest``, bound by ``enable``).
_ascending_chunk: Any = None


def _insert_common(resident, key64, last_access, insert_tick, hits, n_children, position, parent,
                   slots, keys, parents, positions, first_tick):
    """``base.insert``'s field updates; returns the number of parents that counted (resident)."""
    for i in range(len(slots)):
        s = slots[i]
        resident[s] = 1
        key64[s] = keys[i]
        last_access[s] = first_tick + i
        insert_tick[s] = first_tick + i
        hits[s] = 0
        n_children[s] = 0
        position[s] = positions[i]
    linked = 0
    # A second pass: a parent counts if resident, which it may be by the first pass (same batch).
    for i in range(len(slots)):
        p = parents[i]
        if p >= 0 and resident[p] == 1:
            parent[slots[i]] = p
            n_children[p] += 1
            linked += 1
        else:
            parent[slots[i]] = -1
    return linked


def _remove_common(resident, parent, n_children, slots):
    """``base.remove``'s field updates for ``slots`` (all resident, distinct)."""
    for i in range(len(slots)):
        p = parent[slots[i]]
        if p >= 0:
            n_children[p] -= 1
    orphaned = False
    for i in range(len(slots)):
        if n_children[slots[i]] > 0:
            orphaned = True
            break
    if orphaned:
        gone = np.zeros(len(parent), dtype=np.bool_)
        for i in range(len(slots)):
            if n_children[slots[i]] > 0:
                gone[slots[i]] = True
        for j in range(len(parent)):
            p = parent[j]
            if p >= 0 and gone[p]:
                parent[j] = -1
    for i in range(len(slots)):
        s = slots[i]
        resident[s] = 0
        parent[s] = -1
        n_children[s] = 0


# ---- ghosts: the ring lists and their probe table (``state.py``; ``tieredkv.hashtable``) -----------
# Same words, same algorithms as the Python code: Fibonacci hashing, linear probing, backward-shift
# deletion, ring compaction in place. The words are ``w``: per list head, tail, live; then the ring
# keys (L x R), the ring flags (L x R); ``tk``/``tr`` are the table's key and ref (value + 1) words.
_FIB = np.uint64(0x9E3779B97F4A7C15)


def _home(key, shift):
    return np.int64((np.uint64(key) * _FIB) >> np.uint64(shift))


def _tfind(tk, tr, key, shift):
    mask = len(tr) - 1
    i = _home(key, shift)
    for _ in range(len(tr)):
        if tr[i] == 0:
            return -1
        if tk[i] == key:
            return i
        i = (i + 1) & mask
    return -1


def _tinsert(tk, tr, key, value, shift):
    mask = len(tr) - 1
    i = _home(key, shift)
    for _ in range(len(tr)):
        if tr[i] == 0:
            tk[i] = key
            tr[i] = value + 1
            return True
        i = (i + 1) & mask
    return False


def _tdelete_at(tk, tr, pos, shift):
    mask = len(tr) - 1
    i = pos
    j = i
    for _ in range(len(tr)):
        j = (j + 1) & mask
        if tr[j] == 0:
            break
        h = _home(tk[j], shift)
        if (i < j and i < h <= j) or (i > j and (h > i or h <= j)):
            continue
        tk[i] = tk[j]
        tr[i] = tr[j]
        i = j
    tr[i] = 0


def _ghost_remove(w, tk, tr, key, n_lists, ring, shift):
    """Forget ``key``; its list, or -1 if it was no ghost."""
    i = _tfind(tk, tr, key, shift)
    if i < 0:
        return -1
    ref = tr[i] - 1
    lst = ref // ring
    w[3 * n_lists + n_lists * ring + ref] = 0
    _tdelete_at(tk, tr, i, shift)
    w[3 * lst + 2] -= 1
    return lst


def _ghost_pop(w, tk, tr, lst, n_lists, ring, shift):
    """Forget the oldest live key of ``lst``: (True, key), or (False, 0) if it has none."""
    o_ring, o_flag, hd = 3 * n_lists, 3 * n_lists + n_lists * ring, 3 * lst
    head, tail = w[hd], w[hd + 1]
    while head < tail:
        ref = lst * ring + head % ring
        head += 1
        if w[o_flag + ref] != 0:
            w[hd] = head
            key = w[o_ring + ref]
            w[o_flag + ref] = 0
            _tdelete_at(tk, tr, _tfind(tk, tr, key, shift), shift)
            w[hd + 2] -= 1
            return True, key
    w[hd] = head
    return False, np.int64(0)


def _ghost_compact(w, tk, tr, lst, n_lists, ring, shift):
    o_ring, o_flag, hd = 3 * n_lists, 3 * n_lists + n_lists * ring, 3 * lst
    head, tail = w[hd], w[hd + 1]
    n = tail - head
    keys = np.empty(n, dtype=np.int64)
    flags = np.empty(n, dtype=np.int64)
    kept = 0
    for a in range(head, tail):
        ref = lst * ring + a % ring
        if w[o_flag + ref] != 0:
            keys[kept] = w[o_ring + ref]
            flags[kept] = w[o_flag + ref]
            kept += 1
    for a in range(head, tail):
        w[o_flag + lst * ring + a % ring] = 0
    for i in range(kept):
        ref = lst * ring + (head + i) % ring
        w[o_ring + ref] = keys[i]
        w[o_flag + ref] = flags[i]
        tr[_tfind(tk, tr, keys[i], shift)] = ref + 1
    w[hd + 1] = head + kept


def _ghost_push(w, tk, tr, keys, flags, lst, n_lists, ring, cap, shift, fresh):
    o_ring, o_flag, hd = 3 * n_lists, 3 * n_lists + n_lists * ring, 3 * lst
    for i in range(len(keys)):
        k = keys[i]
        if not fresh and _tfind(tk, tr, k, shift) >= 0:
            _ghost_remove(w, tk, tr, k, n_lists, ring, shift)
        if w[hd + 2] >= cap:
            _ghost_pop(w, tk, tr, lst, n_lists, ring, shift)
        if w[hd + 1] - w[hd] >= ring:
            _ghost_compact(w, tk, tr, lst, n_lists, ring, shift)
        tail = w[hd + 1]
        ref = lst * ring + tail % ring
        w[o_ring + ref] = k
        w[o_flag + ref] = flags[i]
        _tinsert(tk, tr, k, ref, shift)
        w[hd + 1] = tail + 1
        w[hd + 2] += 1


def _ghost_lookup(w, tk, tr, keys, n_lists, ring, shift):
    """Per key its list (-1: no ghost) and its flags."""
    lists = np.full(len(keys), -1, dtype=np.int64)
    flags = np.zeros(len(keys), dtype=np.int64)
    o_flag = 3 * n_lists + n_lists * ring
    for i in range(len(keys)):
        j = _tfind(tk, tr, keys[i], shift)
        if j >= 0:
            ref = tr[j] - 1
            lists[i] = ref // ring
            flags[i] = w[o_flag + ref]
    return lists, flags


# ---- CLOCK's hand (``clock.Clock.choose``) --------------------------------------------------------
def _clock_choose(ref, order, candidates, n, seq):
    """Walk the candidates in ascending ``order``; a block with a non-zero counter loses one and
    goes behind the hand (order = seq, seq + 1, ...), the first with zero is a victim. Returns
    (victims, new seq). The walk ``OrderCursor`` makes: the candidates by their orders, then the
    passed blocks again in the order they were passed (their new orders are larger than any)."""
    count = 0
    room = 0
    for s in range(len(candidates)):    # branch-free: vectorised
        c = candidates[s]
        count += c
        room += c * max(ref[s], 0)     # a block re-enters at most ref times (one less each pass)
    passed = np.empty(room, dtype=np.int64)
    tail = 0
    victims = np.empty(min(n, count), dtype=np.int64)
    got = 0
    first_seq = seq
    chunk = np.empty(0, dtype=np.int64)
    at = 0
    size = 32
    after = np.int64(-1) << 62
    walked = 0
    head = 0
    while got < n:
        if walked < count:              # the initial candidates, ascending, fetched lazily
            if at == len(chunk):
                # Passed blocks have orders >= first_seq: they come from ``passed``, not from here.
                chunk = _ascending_chunk(order, candidates, after, first_seq, size)
                at = 0
                size *= 4
                after = order[chunk[-1]]
            s = chunk[at]
            at += 1
            walked += 1
        elif head < tail:
            s = passed[head]
            head += 1
        else:
            break
        r = ref[s]
        if r != 0:
            ref[s] = r - 1
            order[s] = seq
            seq += 1
            passed[tail] = s
            tail += 1
        else:
            victims[got] = s
            got += 1
    return victims[:got], seq


def compiler(*sources: str):
    """``numba.njit(cache=True, nogil=True)`` for kernels, keyed by the kernels' sources.

    numba's on-disk cache of a function is checked against its own file only, yet a compiled
    function carries the code of the kernels it calls from other files: edit ``_kernels.py`` and a
    cached caller in ``_jit.py`` (or the simulator's loop) would keep running the old kernel. So every
    kernel's cache entry is named after a digest of this file, ``_kernels.py`` and ``sources`` (the
    caller's own file): any edit to them compiles afresh.
    """
    digest = hashlib.sha1()
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "_jit.py"), os.path.join(here, "_kernels.py"), *sources):
        with open(path, "rb") as f:
            digest.update(f.read())
    tag = digest.hexdigest()[:12]
    njit = numba.njit(cache=True, nogil=True)

    def compile_(fn):
        fn.__qualname__ = f"{fn.__qualname__}_{tag}"   # numba names the cache file after it
        return njit(fn)

    return compile_


def enable() -> bool:
    """Import numba and bind the compiled kernels; return whether they are in use (idempotent).

    Off by default: the simulator turns them on (a replay is thousands of policy calls), a serving
    process only with ``TIEREDKV_NUMBA=1``. Serving processes keep the numpy path unless asked, because
    importing numba there costs its start-up and a compilation per process where the package directory
    is read-only, and because vLLM 0.32's CPU platform scans every loaded module when an in-process
    engine starts and fails on an llvmlite object numba leaves there. ``TIEREDKV_NO_NUMBA=1`` keeps
    them off whatever asks.
    """
    global numba, ENABLED, insert_common, remove_common, oldest, clock_choose
    global table_find, ghost_remove, ghost_pop, ghost_push, ghost_lookup
    global _home, _tinsert, _tdelete_at, _tfind, _ghost_remove, _ghost_pop, _ghost_compact, _ascending_chunk
    if numba is not None or _OFF:  # bound once already (a caller may have set ENABLED off since)
        return ENABLED
    try:
        import numba as module
    except ImportError:  # the numpy path in base.py runs instead
        return False
    numba = module
    compile_ = compiler()
    insert_common = compile_(_insert_common)
    remove_common = compile_(_remove_common)
    # Rebind the helpers first: a kernel calls the compiled versions it finds under these names.
    _home, _tinsert, _tdelete_at = compile_(_home), compile_(_tinsert), compile_(_tdelete_at)
    table_find = _tfind = compile_(_tfind)
    ghost_remove = _ghost_remove = compile_(_ghost_remove)
    ghost_pop = _ghost_pop = compile_(_ghost_pop)
    _ghost_compact = compile_(_ghost_compact)
    ghost_push = compile_(_ghost_push)
    ghost_lookup = compile_(_ghost_lookup)
    # The policies' own kernels (they call the ghost kernels above); ``oldest`` and the clock's
    # refills are their one-pass selection (the up to k smallest values in a range, in order).
    from . import _kernels
    _kernels.bind(compile_, _tfind, ghost_push, _ghost_remove, _ghost_pop)
    oldest = _kernels.oldest
    _ascending_chunk = _kernels.k_smallest
    clock_choose = compile_(_clock_choose)
    ENABLED = True
    return True


if os.environ.get("TIEREDKV_NUMBA", "") in ("1", "true", "yes"):
    enable()
