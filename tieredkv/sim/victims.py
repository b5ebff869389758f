"""Victim structures kept incrementally for the compiled replay: intrusive lists over the slots.

The policies' choose kernels (``policies._kernels``, ``_jit.clock_choose``) find their victims from
the shared state alone: every eviction walks or partially sorts all the slots (``k_smallest``), and
S3-FIFO, ARC and SIEVE count their queues over all the slots again on every call. That is what the
hot tier needs (the state is all a process attaching to a segment has, and hits bump ``last_access``
without the lock), but in a replay it makes each request cost O(capacity). Here the replay keeps,
beside the state and private to the run, the order each policy selects in, as doubly linked lists
of slots updated in O(1) per insert, hit and eviction:

=========  ==========================================================================================
policy     lists (head = the end victims are taken from)
=========  ==========================================================================================
LRU        one, by ``last_access`` (a hit moves the slot to the tail)
FIFO       one, by ``insert_tick``
LFU        one per hit count (bucket ``hits``), each by ``last_access``; the lowest non-empty first
CLOCK      one, by ``clock_order`` (a passed block moves to the tail, as its new order says)
SIEVE      one, by ``sieve_order``; the hand is the slot after the last victim
S3-FIFO    small (queue 0) and main (queue 1), each by ``s3_order``
ARC        T1 (list 1) and T2 (list 2), each by ``last_access``
=========  ==========================================================================================

Every order above is a strictly increasing counter in the state (ticks, sequence numbers), so a
list in push order is exactly the state's ascending order, ties included (there are none). The
walks below take the victims the kernels take, in the same order, and write the same state words
(references, frequencies, orders, hands, sequence counters); they only find them without a pass
over all the slots. ``tests/test_sim_victims.py`` replays slices of both Mooncake traces with the
kernels' selection and with these lists and compares hits, prefix hits, evictions and every word
of the state; ``tests/test_sim_fastloop.py`` compares both with the numpy policies.

The ``*_choose`` walks write their victims into ``victims`` (an int64 buffer of at least ``n``
words, reused: no allocation per eviction) and return the filled part of it.

Plain Python until ``bind`` compiles them (``tieredkv.sim.fastloop`` does, with numba).

Arrays: ``links`` int64 ``(2, n_slots)``: next and previous slot (-1: none); ``lists`` int64
``(3, n_lists)``: head, tail and length per list; ``where`` int64 ``(n_slots,)``: the list a slot is
on (-1: none); ``aux`` int64 words: ``LOW`` (LFU: every bucket below is empty), ``TOP`` (LFU: no
bucket above is used), ``HAND`` (SIEVE: the slot the hand points at, -1 if not known).
"""

from __future__ import annotations

import numpy as np

from tieredkv.policies import _kernels

LOW, TOP, HAND = 0, 1, 2
AUX_WORDS = 3
#: A walk's cursor before its first step (``NEXT`` starts it at the list's head).
UNSTARTED = -2


def lists_for(kind: int, n_requests: int) -> int:
    """How many lists policy ``kind`` (``fastloop.KINDS``) uses: LFU one per possible hit count
    (ids are distinct within a request, so a block gains at most one hit per request)."""
    return n_requests + 2 if kind == 2 else 3


def new(n_slots: int, n_lists: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Empty ``(links, lists, where, aux)``."""
    lists = np.full((3, n_lists), -1, dtype=np.int64)
    lists[2] = 0
    aux = np.zeros(AUX_WORDS, dtype=np.int64)
    aux[HAND] = -1
    return (np.full((2, n_slots), -1, dtype=np.int64), lists, np.full(n_slots, -1, dtype=np.int64), aux)


def push(links, lists, where, lst, s):
    """Append slot ``s`` (on no list) at the tail of list ``lst``."""
    t = lists[1, lst]
    links[0, s] = -1
    links[1, s] = t
    if t >= 0:
        links[0, t] = s
    else:
        lists[0, lst] = s
    lists[1, lst] = s
    lists[2, lst] += 1
    where[s] = lst


def unlink(links, lists, where, s):
    """Take slot ``s`` off its list (nothing if it is on none)."""
    lst = where[s]
    if lst < 0:
        return
    a = links[1, s]
    b = links[0, s]
    if a >= 0:
        links[0, a] = b
    else:
        lists[0, lst] = b
    if b >= 0:
        links[1, b] = a
    else:
        lists[1, lst] = a
    lists[2, lst] -= 1
    where[s] = -1
    links[0, s] = -1
    links[1, s] = -1


def move_back(links, lists, where, lst, s):
    """Move slot ``s`` to the tail of list ``lst`` (its order became the largest)."""
    unlink(links, lists, where, s)
    push(links, lists, where, lst, s)


def step(links, lists, cand, lst, p):
    """A cursor's next candidate on list ``lst``: ``(slot or -1, new cursor)``. The cursor is the
    next slot to look at; -1 once past the tail (a slot pushed later is looked at if the caller sets
    the cursor to it: ``requeue``)."""
    if p == UNSTARTED:
        p = lists[0, lst]
    while p >= 0:
        s = p
        p = links[0, s]
        if cand[s]:
            return s, p
    return -1, -1


def requeue(p, s):
    """The cursor after slot ``s`` was pushed at the tail of the cursor's list: a cursor past the
    tail now points at ``s`` (the kernels' walks find a slot whose order became the largest again)."""
    return s if p == -1 else p


def oldest_of(links, lists, where, lst, cand, n, victims, got):
    """Take candidates from the head of ``lst`` until ``got == n``; returns ``got``."""
    s = lists[0, lst]
    while s >= 0 and got < n:
        nx = links[0, s]
        if cand[s]:
            victims[got] = s
            got += 1
            unlink(links, lists, where, s)
        s = nx
    return got


# ---- the hooks the compiled replay calls, per policy kind (``fastloop.KINDS``) ---------------------
def on_hit(kind, links, lists, where, aux, hits, slots):
    """After the state's hit updates of ``slots`` (in prompt order: their ticks increase)."""
    if kind == 0 or kind == 2 or kind == 6:
        for j in range(len(slots)):
            s = slots[j]
            lst = 0 if kind == 0 else (hits[s] if kind == 2 else 2)
            move_back(links, lists, where, lst, s)
            if kind == 2 and lst > aux[TOP]:
                aux[TOP] = lst


def on_insert(kind, links, lists, where, aux, queue, slots):
    """After the state's insert updates of ``slots`` (their orders increase with the batch index).
    ``queue``: the list per slot for S3-FIFO (``s3_queue``) and ARC (``arc_list``)."""
    for j in range(len(slots)):
        s = slots[j]
        push(links, lists, where, queue[s] if kind >= 5 else 0, s)
    if kind == 2:
        aux[LOW] = 0


def lfu_choose(links, lists, where, aux, cand, n, victims):
    """``_kernels.smallest_lex(hits, last_access)``: buckets from the lowest, each oldest first."""
    b = aux[LOW]
    while b <= aux[TOP] and lists[2, b] == 0:
        b += 1
    aux[LOW] = b
    got = 0
    while got < n and b <= aux[TOP]:
        if lists[2, b]:
            got = oldest_of(links, lists, where, b, cand, n, victims, got)
        b += 1
    return victims[:got]


def clock_choose(links, lists, where, ref, order, cand, n, count, seq, victims):
    """``_jit.clock_choose``: returns (victims, new ``clock_seq``). ``count``: candidates."""
    got = 0
    s = lists[0, 0]
    while got < n and got < count and s >= 0:
        nx = links[0, s]
        if cand[s]:
            r = ref[s]
            if r != 0:
                ref[s] = r - 1
                order[s] = seq
                seq += 1
                move_back(links, lists, where, 0, s)
                if nx < 0:
                    nx = s
            else:
                victims[got] = s
                got += 1
                unlink(links, lists, where, s)
        s = nx
    return victims[:got], seq


def sieve_choose(links, lists, where, aux, visited, order, cand, n, hand_at, victims):
    """``_kernels.sieve_choose``: returns (victims, new ``sieve_hand``)."""
    head = order[lists[1, 0]]                  # the largest order of a resident slot
    if hand_at == 0:
        p = lists[0, 0]
    else:                                       # the first slot with order >= hand_at
        h = aux[HAND]
        if h >= 0 and where[h] == 0 and order[h] >= hand_at and (links[1, h] < 0 or order[links[1, h]] < hand_at):
            p = h
        else:
            p = -1
            t = lists[1, 0]
            while t >= 0 and order[t] >= hand_at:
                p = t
                t = links[1, t]
    got = 0
    fresh = False
    while got < n:
        if p < 0:
            if fresh:
                break
            p = lists[0, 0]                     # past the head: a new walk from the tail
            fresh = True
            continue
        s = p
        p = links[0, s]
        if not cand[s]:
            continue
        fresh = False
        if visited[s]:
            visited[s] = 0
            continue
        victims[got] = s
        got += 1
        unlink(links, lists, where, s)
        hand_at = order[s] + 1 if order[s] < head else 0
        aux[HAND] = p
    return victims[:got], hand_at


def s3fifo_choose(links, lists, where, queue, freq, order, cand, n, n_slots, small_cap, move_threshold, seq,
                  victims):
    """``_kernels.s3fifo_choose``: returns (victims, new ``s3_seq``)."""
    n_small = lists[2, 0]
    n_main = lists[2, 1]
    main_cap = n_slots - small_cap
    ps = UNSTARTED
    pm = UNSTARTED
    got = 0
    while got < n:
        from_main = n_main > main_cap or n_small == 0
        victim = -1
        if not from_main:
            while True:
                s, ps = step(links, lists, cand, 0, ps)
                if s < 0:
                    break
                n_small -= 1
                if freq[s] >= move_threshold:
                    seq = _kernels.s3fifo_requeue(queue, freq, order, s, True, seq)
                    unlink(links, lists, where, s)
                    push(links, lists, where, 1, s)
                    pm = requeue(pm, s)
                    n_main += 1
                else:
                    victim = s
                    break
        if victim < 0:
            while True:
                s, pm = step(links, lists, cand, 1, pm)
                if s < 0:
                    break
                if freq[s]:
                    seq = _kernels.s3fifo_requeue(queue, freq, order, s, False, seq)
                    move_back(links, lists, where, 1, s)
                    pm = requeue(pm, s)
                else:
                    victim = s
                    n_main -= 1
                    break
        if victim < 0:
            s, ps = step(links, lists, cand, 0, ps)
            if s < 0:
                break
            n_small -= 1
            victim = s
        victims[got] = victim
        got += 1
        unlink(links, lists, where, victim)
    return victims[:got], seq


def arc_choose(links, lists, where, arc_list, cand, n, p, incoming, w, tk, tr, L, R, shift, victims):
    """``_kernels.arc_choose`` (with ``incoming``): T1's or T2's least recent candidates."""
    t1 = lists[2, 1]
    c1 = UNSTARTED
    c2 = UNSTARTED
    got = 0
    for i in range(n):
        first_t1 = _kernels.arc_from_t1(t1, p, incoming, True, n, i, w, tk, tr, L, R, shift)
        s = -1
        for attempt in range(2):
            if first_t1 == (attempt == 0):
                s, c1 = step(links, lists, cand, 1, c1)
            else:
                s, c2 = step(links, lists, cand, 2, c2)
            if s >= 0:
                break
        if s < 0:
            break
        if arc_list[s] == 1:
            t1 -= 1
        victims[got] = s
        got += 1
        unlink(links, lists, where, s)
    return victims[:got]


#: Compiled in this order on ``bind`` (a function calls the compiled versions of those before it).
_ORDER = ("push", "unlink", "move_back", "step", "requeue", "oldest_of", "on_hit", "on_insert", "lfu_choose",
          "clock_choose", "sieve_choose", "s3fifo_choose", "arc_choose")


def bind(compile_) -> None:
    """Replace every function above by its compiled version (``fastloop`` calls this once)."""
    g = globals()
    for name in _ORDER:
        g[name] = compile_(g[name])
