"""What a hot-tier read checks, once per batch: the slot table seen as rows of words.

A slot record (``segment.SLOT_DTYPE``) is twelve aligned 8-byte words. Viewed as an ``(n_slots, 12)``
uint64 matrix, one ``take`` fetches every field of a batch's slots, and each check is one comparison
over the whole batch (a structured array costs one gather per field). Checks test the whole batch
first and look for the first failing row only when one fails: a full hit, the common case, pays for
no per-row reduction.

The read protocol these serve (docs/architecture.md, invariant 1):

1. ``read_run`` (no lock): the index's hint for each key; the leading run of slots that hold the key
   READY with an even generation, its parent and its chunk tokens; and, per slot, the words seen
   (generation and key).
2. ``still_seen`` (under the lock, in the critical section that pins): the leading run of those
   slots whose generation and key are still the ones seen, and still READY. A generation only moves
   forward, and every change of a slot's fields happens while it is odd, so a slot that shows the
   generation seen holds what was checked, and the pin taken in the same critical section keeps it so.
3. ``torn`` (after the copy, still pinned): the generations again; a change there is a broken
   invariant, counted and returned as a miss.
"""

from __future__ import annotations

import numpy as np

from tieredkv.hot.segment import READY, SLOT_DTYPE, WRITING
from tieredkv.keys import ChunkKeys

_COL = {name: spec[1] // 8 for name, spec in (SLOT_DTYPE.fields or {}).items()}
GEN, KEY, PARENT, STATE, PINS = _COL["gen"], _COL["key"], _COL["parent"], _COL["state"], _COL["pins"]
WORDS = SLOT_DTYPE.itemsize // 8
#: The words a pin re-checks: the generation and the two key words, adjacent in the record.
SEEN = slice(GEN, KEY + 2)
if (KEY, PARENT, SEEN.stop) != (GEN + 1, KEY + 2, PARENT) or SLOT_DTYPE.itemsize % 8:
    raise ImportError("hot/batch.py assumes gen, key, parent are adjacent words of a slot record")

_STEPS = np.arange(1 << 12, dtype=np.int64)


def slot_words(slots: np.ndarray) -> np.ndarray:
    """The slot table (``SLOT_DTYPE`` records) as an ``(n_slots, WORDS)`` uint64 matrix over the same
    memory."""
    return slots.view(np.uint64).reshape(len(slots), WORDS)


def leading(ok: np.ndarray) -> int:
    """How many leading entries of the bool array ``ok`` are True."""
    return len(ok) if ok.all() else int(ok.argmin())


def one_run(slots: np.ndarray) -> bool:
    """Whether ``slots`` is one ascending run of adjacent slots (``s, s+1, ...``): a prompt stored in
    one call, read back in one copy, its pins counted with one slice."""
    n = len(slots)
    if n <= 1 or n > len(_STEPS):
        return n == 1
    return bool((slots == slots[0] + _STEPS[:n]).all())


def confirmed(index, words: np.ndarray, tokens: np.ndarray,
              keys: ChunkKeys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which ``keys`` are held READY (generation even) with their parent and chunk tokens. Lock-free:
    a hint for the caller to pin or re-check under the lock.

    Args:
        index: the segment's ``HotIndex``.
        words: ``slot_words`` of the slot table.
        tokens: the segment's chunk tokens, ``(n_slots, chunk_tokens)``.
        keys: the batch.

    Returns:
        ``(slots, rows, ok)``: the slot the index names for each key (-1: none), that slot's record
        words as read, and whether it holds the key.
    """
    slots = index.hint(keys.keys)
    rows, ok, all_ok = check(words, tokens, slots, keys)
    if not all_ok and ((slots >= 0) & (rows[:, KEY:KEY + 2] != keys.keys).any(axis=1)).any():
        # The index matched a key's first word and the slot holds another key: two keys share their
        # first word (rare), which the index's scan of the whole probe run tells apart.
        slots = index.find(keys.keys)
        rows, ok, _ = check(words, tokens, slots, keys)
    return slots, rows, ok


def check(words: np.ndarray, tokens: np.ndarray, slots: np.ndarray,
          keys: ChunkKeys) -> tuple[np.ndarray, np.ndarray, bool]:
    """Whether each slot of ``slots`` (-1: none) holds its key READY, generation even, with its
    parent and chunk tokens. Returns ``(rows, ok, all_ok)``: the slots' record words as read, the
    answer per key, and whether every key passed."""
    rows = words.take(slots, axis=0)  # slot -1 reads the last row: masked by ``slots >= 0``
    ok = slots >= 0
    ok &= rows[:, STATE] == READY
    ok &= (rows[:, GEN] & 1) == 0
    named = rows[:, KEY:PARENT + 2] == np.concatenate((keys.keys, keys.parents), axis=1)
    same_tokens = tokens.take(slots, axis=0) == keys.tokens
    if ok.all() and named.all() and same_tokens.all():
        return rows, ok, True
    ok &= named.all(axis=1)
    ok &= same_tokens.all(axis=1)
    return rows, ok, False


def read_run(index, words: np.ndarray, tokens: np.ndarray, keys: ChunkKeys) -> tuple[np.ndarray, np.ndarray]:
    """The leading run of ``keys`` a read may pin (step 1 of the protocol above). Lock-free.

    Returns:
        ``(slots, seen)``: the slots of the leading confirmed keys (see ``confirmed``) and the words
        seen for each (``(n, 3)``: generation and key).
    """
    slots, rows, ok = confirmed(index, words, tokens, keys)
    n = leading(ok)
    return slots[:n], rows[:n, SEEN]


def still_seen(words: np.ndarray, slots: np.ndarray, seen: np.ndarray) -> int:
    """How many leading ``slots`` still show the generation and key ``seen`` and are READY (step 2
    of the protocol above). Call under the lock."""
    rows = words.take(slots, axis=0)
    same = rows[:, SEEN] == seen
    ready = rows[:, STATE] == READY
    if same.all() and ready.all():
        return len(slots)
    return leading(same.all(axis=1) & ready)


def torn(words: np.ndarray, slots: np.ndarray, seen: np.ndarray) -> int:
    """Index of the first slot whose generation changed since ``seen`` (step 3), or ``len(slots)``."""
    return leading(words[:, GEN][slots] == seen[:, 0])  # not take(): it would copy the whole column first


def add_pins(words: np.ndarray, slots: np.ndarray, run: bool) -> None:
    """One more pin on each of ``slots`` (a slot listed twice gets two). ``run``: ``one_run(slots)``.
    Under the lock."""
    if not len(slots):
        return
    if run:
        words[slots[0]:slots[0] + len(slots), PINS] += 1
    else:
        np.add.at(words[:, PINS], slots, 1)


def drop_pins(words: np.ndarray, slots: np.ndarray, run: bool) -> None:
    """The inverse of ``add_pins``. Under the lock."""
    if not len(slots):
        return
    if run:
        words[slots[0]:slots[0] + len(slots), PINS] -= 1
    else:
        np.subtract.at(words[:, PINS], slots, 1)


# ---- the write path (under the lock) ------------------------------------------------------------------
OWNER, OWNER_TOKEN, POSITION, LENGTH, CLAIM = (_COL[f] for f in ("owner", "owner_token", "position", "length",
                                                                 "claim"))
if (OWNER, OWNER_TOKEN, LENGTH) != (STATE + 1, STATE + 2, POSITION + 1):
    raise ImportError("hot/batch.py assumes state, owner, owner_token and position, length are adjacent words")


def set_words(words: np.ndarray, slots: np.ndarray, run: bool, cols: int | slice, values) -> None:
    """``words[slots, cols] = values``; a slice of rows when ``run`` (``one_run(slots)``)."""
    if run:
        words[slots[0]:slots[0] + len(slots), cols] = values
    else:
        words[slots, cols] = values


def bump(words: np.ndarray, slots: np.ndarray, run: bool) -> None:
    """One more on the generation of each of ``slots`` (distinct). Under the lock."""
    if run:
        words[slots[0]:slots[0] + len(slots), GEN] += 1
    else:
        words[slots, GEN] += 1


def claim(words: np.ndarray, slots: np.ndarray, call: int, owner: int, token: int) -> None:
    """Slots (distinct) -> WRITING by ``owner`` (token ``token``) for the call whose id is ``call``;
    the generation turns odd before the state changes. Under the lock."""
    if not len(slots):
        return
    run = one_run(slots)
    set_words(words, slots, run, CLAIM, call)
    bump(words, slots, run)  # odd: readers treat the slot as being rewritten
    set_words(words, slots, run, slice(STATE, OWNER_TOKEN + 1), (WRITING, owner, token))


def distinct(keys: np.ndarray) -> np.ndarray:
    """Rows of the first occurrence of each distinct ``(n, 2)`` key, ascending."""
    lo = np.sort(keys[:, 0])
    if (lo[1:] != lo[:-1]).all():  # no two keys share a first word: all distinct (the common case)
        return np.arange(len(keys))
    return np.sort(np.unique(keys, axis=0, return_index=True)[1])
