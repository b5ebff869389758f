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

A model that mixes sliding and full-attention layers (Gemma 2/3 under vLLM's hybrid KV cache
manager) needs every chunk of ``[0, P)`` for its full layers and the window's chunks for its sliding
ones, as vLLM's own offloading looks such groups up (full groups a prefix, sliding groups a window).
A tieredkv block holds one chunk of every layer; a chunk whose sliding layers vLLM no longer held at
save time (behind the window, e.g. after vLLM's own prefix hit) is stored as a *full-layers-only*
block: the same block layout and namespace, its sliding layers zero-filled, under the key
``xxh3_128(chunk key || PARTIAL_TAG)`` (``partial_keys``). ``mixed_lookup`` takes, per chunk, the
whole block or else the full-layers-only one, and a hit at ``P`` is valid when every chunk of
``[0, P)`` has one of them and every chunk overlapping the window before ``P`` has a whole block.
Loads write a chunk's sliding layers only into the blocks vLLM keeps for the window (not null), which
lie in those whole chunks, so the zeros are never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from tieredkv.cache import PrefixHit, TieredCache
from tieredkv.keys import ChunkKeys, as_tokens, chunk_keys
from tieredkv.tier import PutResult

#: Separates a chunk key from the tag of the chunk's full-layers-only block in its hashed input.
PARTIAL_TAG = b"\x00tieredkv-full-layers-only\x00"


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


# ---- sliding + full layers -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MixedHit(PrefixHit):
    """A hit at ``tokens`` of a model with sliding and full layers. ``keys`` and ``where`` cover
    ``[0, tokens / chunk_tokens)``: per chunk its whole block's key or, where ``complete`` is False,
    its full-layers-only block's key (``partial_keys``). The hit is needed from chunk ``first`` on
    (vLLM's own prefix hit holds the ones before); ``held``: the leading chunks some level holds (at
    least ``tokens / chunk_tokens`` unless the tiers miss some chunk before ``first``: ``where`` -1
    from there to ``first``, and those chunks are still to be stored)."""

    first: int = 0
    held: int = 0
    complete: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=bool))

    def window_is_whole(self, end: int, window: int, chunk_tokens: int) -> bool:
        """Whether the chunks a continuation from token ``end`` (<= ``tokens``) reads in its sliding
        layers are whole blocks (vLLM may take fewer tokens than offered)."""
        lo = max(first_chunk(end, window, chunk_tokens), self.first)
        return bool(self.complete[lo:-(-end // chunk_tokens)].all())


def partial_keys(keys: ChunkKeys) -> ChunkKeys:
    """The keys of the chunks' full-layers-only blocks: ``xxh3_128(chunk key || PARTIAL_TAG)``, each
    one's parent its chunk's key and its tokens the chunk's tokens (a read confirms it like any block)."""
    raw = b"".join(xxhash.xxh3_128_digest(key + PARTIAL_TAG) for key in keys)
    n = len(keys)
    return ChunkKeys(np.frombuffer(raw, dtype="<u8").reshape(n, 2) if n else np.zeros((0, 2), "<u8"),
                     keys.keys.copy(), keys.tokens, keys.start, keys.positions)


def _choose(whole: ChunkKeys, partial: ChunkKeys, complete: np.ndarray) -> ChunkKeys:
    """Per chunk the key of ``whole`` where ``complete``, else the one of ``partial``."""
    pick = complete[:, None]
    return ChunkKeys(np.where(pick, whole.keys, partial.keys), np.where(pick, whole.parents, partial.parents),
                     whole.tokens, whole.start, whole.positions)


def mixed_lookup(cache: TieredCache, tokens: Any, salt: bytes, extra: Sequence[bytes | None] | None,
                 window: int, computed: int = 0) -> PrefixHit:
    """The largest chunk boundary ``P`` (beyond ``computed``, which vLLM holds itself, and short of the
    whole prompt) such that every chunk of ``[computed, P)`` is in some level as a whole or a
    full-layers-only block and the chunks overlapping the window before ``P`` as whole blocks, as a
    ``MixedHit`` (``tokens`` 0 when there is none: ``held`` still says which chunks the tiers hold).
    Counts nothing.
    """
    ids = as_tokens(tokens)
    C = cache.spec.chunk_tokens
    n = max(len(ids) - 1, 0) // C  # never the whole prompt: the model needs a token to compute
    keys = chunk_keys(cache.spec, ids[:n * C], salt, extra)
    partial = partial_keys(keys)
    low = computed // C
    where = np.full(n, -1, dtype=np.int8)
    complete = np.zeros(n, dtype=bool)

    def run_from(end: int) -> int:
        """The end of the full layers' run from chunk ``end``: whole blocks, else full-layers-only ones."""
        while end < n:
            run = cache.resident_run(keys[end:n])
            where[end:end + len(run)], complete[end:end + len(run)] = run, True
            end += len(run)
            if end == n:
                break
            run = cache.resident_run(partial[end:n])
            if not len(run):
                break
            where[end:end + len(run)] = run
            end += len(run)
        return end

    held = run_from(0)  # from 0, so a save knows which chunks vLLM's own hit holds that the tiers lack
    end = held if held >= low else run_from(low)
    while end > low:  # the sliding layers: the window before the end must be whole blocks
        first = max(first_chunk(end * C, window, C), low)
        gaps = np.flatnonzero(~complete[first:end])
        if not len(gaps):
            return MixedHit(tokens=end * C, prompt_tokens=len(ids), keys=_choose(keys, partial, complete)[:end],
                            where=where[:end].copy(), first=low, held=held, complete=complete[:end].copy())
        end = first + int(gaps[-1])  # a window ending after that chunk would contain it
    return MixedHit(tokens=0, prompt_tokens=len(ids), keys=keys[:0], where=where[:0], first=low, held=held,
                    complete=complete[:0])


def store_partial(cache: TieredCache, tokens: np.ndarray, host: Any, salt: bytes,
                  extra: Sequence[bytes | None] | None, start: int, end: int, sliding_layers: Sequence[int]) -> int:
    """Store the chunks ``[start, end)`` of ``host`` (``(layers, 2, heads, >= end, head_dim)``, a torch
    tensor holding the full layers' K/V) as full-layers-only blocks, their ``sliding_layers`` zero-filled.
    A chunk whose whole block some level holds is skipped. Returns the blocks newly stored."""
    import torch

    C = cache.spec.chunk_tokens
    keys = chunk_keys(cache.spec, tokens[:end], salt, None if extra is None else list(extra)[:end // C])[start // C:]
    todo = [i for i in range(len(keys)) if not len(cache.resident_run(keys[i:i + 1]))]
    if not todo:
        return 0
    blocks = host[:, :, :, start:end].unflatten(3, (len(keys), C)).permute(3, 0, 1, 2, 4, 5)[todo].contiguous()
    blocks[:, list(sliding_layers)] = 0
    rows = blocks.reshape(len(todo), -1).view(torch.uint8).numpy()
    codes = cache.put_blocks(partial_keys(keys).take(np.array(todo)), rows, owned=True)
    return int(np.count_nonzero(codes == PutResult.STORED))
