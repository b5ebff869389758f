"""Compiled kernels for the bookkeeping every policy operation does (numba, optional).

``insert`` and ``remove`` in ``base.py`` keep the common per-slot fields; done with numpy that is a
dozen small array operations per call, which dominates a replay (one call per request) and the hot
tier's store path. With numba installed (``pip install 'tieredkv[fast]'``) they run as one compiled
loop each; without it the numpy code in ``base.py`` runs, slower, to the same result: the kernels
write exactly what the numpy code writes (``tests/test_policies_jit.py`` replays workloads both
ways and compares every word of the state), so processes with and without numba can share one
segment.

``TIEREDKV_NO_NUMBA=1`` turns the kernels off (to compare, or to rule them out).
"""

from __future__ import annotations

import os

import numpy as np

try:
    import numba
except ImportError:  # the numpy path in base.py runs instead
    numba = None

#: True when the compiled kernels are in use.
ENABLED = numba is not None and os.environ.get("TIEREDKV_NO_NUMBA", "") not in ("1", "true", "yes")


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


def _oldest(field, n, candidates):
    """``order.oldest``: the ``n`` candidates smallest by ``(field, slot)``, in that order."""
    count = 0
    for s in range(len(candidates)):
        if candidates[s]:
            count += 1
    slots = np.empty(count, dtype=np.int64)
    k = 0
    for s in range(len(candidates)):
        if candidates[s]:
            slots[k] = s
            k += 1
    if n < count:
        values = np.empty(count, dtype=field.dtype)
        for i in range(count):
            values[i] = field[slots[i]]
        kth = np.partition(values, n - 1)[n - 1]
        chosen = np.empty(n, dtype=np.int64)
        k = 0
        for i in range(count):          # below kth, in slot order
            if values[i] < kth:
                chosen[k] = slots[i]
                k += 1
        for i in range(count):          # then ties at kth, lowest slots first
            if k == n:
                break
            if values[i] == kth:
                chosen[k] = slots[i]
                k += 1
        slots = chosen
    keys = np.empty(len(slots), dtype=field.dtype)
    for i in range(len(slots)):
        keys[i] = field[slots[i]]
    order = np.argsort(keys, kind="mergesort")   # stable: equal values keep slot order
    return slots[order][:n]


if ENABLED:
    insert_common = numba.njit(cache=True, nogil=True)(_insert_common)
    remove_common = numba.njit(cache=True, nogil=True)(_remove_common)
    oldest = numba.njit(cache=True, nogil=True)(_oldest)
else:
    insert_common = remove_common = oldest = None
