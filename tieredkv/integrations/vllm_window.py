"""Hit points of models whose every layer slides (Mistral-style): a full window of stored chunks.

A token at position ``P`` of a layer with a sliding window of ``W`` tokens attends to ``[P - W + 1, P]``
only, so continuing a prompt from ``P`` needs the cached K/V of ``[P - W + 1, P)`` and nothing before
it: vLLM hands the blocks wholly before ``P - W + 1`` as the null block (they are skipped). When every
layer of the model slides, a hit at a chunk boundary ``P`` is therefore valid when the chunks
overlapping that window are stored, whatever happened to the chunks before them (never stored because
vLLM had dropped their blocks by then, or evicted since). This is how vLLM's own ``OffloadingConnector``
looks sliding-window groups up: from the end of the prompt backwards, for a full window of stored
chunks, the first gap ruling out every window that contains it.

The chunks' keys still chain the whole prefix (``tieredkv.keys``), so a window is only found for the
same tokens before it (and the same salt and request identity): a hit never mixes prefixes.

A model that mixes sliding and full-attention layers needs every chunk of ``[0, P)`` for its full
layers; a tieredkv block holds one chunk of every layer, so its hits stay tieredkv's prefix runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tieredkv.cache import PrefixHit, TieredCache
from tieredkv.keys import as_tokens, chunk_keys


@dataclasses.dataclass(frozen=True)
class WindowHit(PrefixHit):
    """A hit at ``tokens`` that needs only the chunks ``[first, tokens / chunk_tokens)``: those
    overlapping the window before ``tokens``. ``keys`` still covers ``[0, tokens)`` (the chain);
    ``where`` is -1 for the chunks before ``first`` (not needed, not looked up)."""

    first: int = 0


def first_chunk(end: int, window: int, chunk_tokens: int) -> int:
    """The first chunk a continuation from token ``end`` reads: the one holding ``end - window + 1``."""
    return max(end - window + 1, 0) // chunk_tokens


def window_lookup(cache: TieredCache, tokens: Any, salt: bytes, extra: Sequence[bytes | None] | None,
                  window: int, computed: int = 0) -> PrefixHit:
    """The largest chunk boundary ``P`` (beyond ``computed``, which vLLM holds itself, and short of the
    whole prompt) whose window's chunks are all in some level, as a ``WindowHit``; an empty
    ``PrefixHit`` when there is none. Counts nothing (vLLM may ask again for a waiting request).
    """
    ids = as_tokens(tokens)
    C = cache.spec.chunk_tokens
    n = max(len(ids) - 1, 0) // C  # never the whole prompt: the model needs a token to compute
    keys = chunk_keys(cache.spec, ids[:n * C], salt, extra)
    low = computed // C
    end = n
    while end > low:
        first = max(first_chunk(end * C, window, C), low)
        run = cache.resident_run(keys[first:end])
        if len(run) == end - first:
            where = np.full(end, -1, dtype=np.int8)
            where[first:] = run
            return WindowHit(tokens=end * C, prompt_tokens=len(ids), keys=keys[:end], where=where, first=first)
        end = first + len(run)  # a window ending after the first missing chunk would contain it
    return PrefixHit(tokens=0, prompt_tokens=len(ids), keys=keys[:0], where=np.zeros(0, dtype=np.int8))
