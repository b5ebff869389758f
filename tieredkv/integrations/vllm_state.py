"""Recurrent state (mamba / linear attention) of hybrid models, cached at chunk boundaries.

A hybrid model (Qwen3-Next: gated-delta-net layers between full-attention layers) keeps per request
one recurrent state per state layer instead of per-token K/V. vLLM's prefix caching for such models
(``mamba_cache_mode="align"``) snapshots the state at block boundaries: the state after tokens
``[0, (i+1)*N)`` sits in block ``i`` of the ``MambaSpec`` group, and only the boundaries vLLM
materialised (the end of a prefill step, an internal checkpoint) have a block; the others are the null
block. A prefix hit at ``P`` therefore needs the attention KV of ``[0, P)`` and the state at ``P``.

tieredkv stores the attention KV in its usual chunk blocks and the state at a chunk boundary ``P`` as
``pieces`` extra blocks of the same cache (same namespace, levels, eviction, remote tier): the state's
bytes (every state group and layer, model order, each layer's page content without vLLM's padding)
cut into rows of ``block_bytes``, the last one zero-padded. Piece ``j`` of the state at the end of chunk
``k`` has the key ``xxh3_128(key_k || STATE_TAG || j)``, parent ``key_k`` and chunk ``k``'s tokens, so
a read confirms it like any block, and the namespace (``KVSpec.extra``'s ``state=...``) covers what
changes the state's bytes (which layers hold one, the kernel, the shapes and dtypes, the conv layout).

Hit points: the largest chunk boundary ``P`` whose KV chunks ``[0, P)`` and whose state pieces are all
in the tiers (searched back from the longest KV run); a request whose prompt reaches no such boundary
is a miss. Saves: a boundary's state is saved in the step that completes its chunk if vLLM holds it in
a block then (not null); other boundaries have KV but no state, and are never hit points.

Loads: vLLM copies the state a request continues from (block ``P/N - 1``) into the block the step runs
in before the connector's ``start_load_kv``, so the restored state is written into both blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from tieredkv.cache import PrefixHit, TieredCache
from tieredkv.errors import InvalidInput
from tieredkv.integrations.vllm_groups import CacheLayout
from tieredkv.keys import STATE_TAG, chunk_keys, piece_count, state_keys

logger = logging.getLogger(__name__)

__all__ = ["NULL_BLOCK", "STATE_TAG", "StateCache", "StateSave", "piece_count", "state_keys"]

NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class StateSave:
    """Save the state at token ``boundary`` (a chunk boundary) from ``blocks`` (one per state group)."""

    boundary: int
    blocks: tuple[int, ...]


class StateCache:
    """The boundary states of one engine's state groups in a ``TieredCache`` (see the module doc).

    Scheduler side: ``usable`` (a hit cut back to the last boundary with a stored state). Worker side:
    ``register`` the state layers' pages, ``load`` a plan's state, ``store`` a save's states.
    """

    def __init__(self, cache: TieredCache, layout: CacheLayout):
        self.cache = cache
        self.layout = layout
        self.pieces = piece_count(layout.state_bytes, cache.spec.block_bytes)
        self._rows: list[list[torch.Tensor]] = []  # per state group, per layer: (blocks, state_bytes) uint8

    # ---- scheduler side ---------------------------------------------------------------------------
    def usable(self, hit: PrefixHit, computed: int) -> PrefixHit:
        """``hit`` cut back to the largest chunk boundary beyond ``computed`` whose state is stored
        (an empty hit when there is none). Counts nothing."""
        C = self.cache.spec.chunk_tokens
        for end in range(len(hit.keys), computed // C, -1):
            keys = state_keys(hit.keys[end - 1:end], self.pieces)
            if len(self.cache.resident_run(keys)) == self.pieces:
                return dataclasses.replace(hit, tokens=end * C, keys=hit.keys[:end], where=hit.where[:end])
        return dataclasses.replace(hit, tokens=0, keys=hit.keys[:0], where=hit.where[:0])

    def saves(self, block_ids: list[list[int]], start: int, end: int) -> tuple[StateSave, ...]:
        """The chunk boundaries in ``(start, end]`` whose state every state group holds in a block."""
        C, N = self.cache.spec.chunk_tokens, self.layout.block_size
        out = []
        for boundary in range((start // C + 1) * C, end + 1, C):
            i = boundary // N - 1
            blocks = tuple(block_ids[g.index][i] if i < len(block_ids[g.index]) else NULL_BLOCK
                           for g in self.layout.states)
            if NULL_BLOCK not in blocks:
                out.append(StateSave(boundary, blocks))
        return tuple(out)

    def targets(self, block_ids: list[list[int]], boundary: int) -> tuple[tuple[int, ...], ...]:
        """Per state group, the blocks a restored state at ``boundary`` goes to: the boundary's own
        block and the block the request runs in (its last), the null block left out."""
        i = boundary // self.layout.block_size - 1
        out = []
        for g in self.layout.states:
            ids = block_ids[g.index]
            picked = [ids[k] for k in (i, len(ids) - 1) if 0 <= k < len(ids) and ids[k] != NULL_BLOCK]
            out.append(tuple(dict.fromkeys(picked)))
        return tuple(out)

    # ---- worker side ------------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take each state layer's pages as rows of its state's bytes.

        Raises:
            InvalidInput: a state layer is missing, or its cache is not one tensor of whole states per block.
        """
        rows = []
        for g in self.layout.states:
            group = []
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if not isinstance(cache, torch.Tensor) or cache.element_size() != 1:
                    raise InvalidInput(f"state layer {name}: expected one byte tensor of pages, got "
                                       f"{type(cache).__name__} {getattr(cache, 'dtype', '')}")
                page = cache.reshape(cache.shape[0], -1) if cache.dim() > 2 else cache
                if page.shape[1] != g.state_bytes or page.stride(1) != 1:
                    raise InvalidInput(f"state layer {name}: pages of shape {tuple(cache.shape)} strides "
                                       f"{cache.stride()} do not hold one {g.state_bytes}-byte state per block")
                group.append(page.view(torch.uint8))
            rows.append(group)
        self._rows = rows

    def _staging(self, n: int) -> np.ndarray:
        return np.zeros((n * self.pieces, self.cache.spec.block_bytes), dtype=np.uint8)

    def load(self, hit: PrefixHit, targets: tuple[tuple[int, ...], ...]) -> bool:
        """Write the state at the end of ``hit`` into ``targets`` (``targets``). False: some piece is
        gone (nothing written)."""
        if not len(hit.keys):
            return False
        keys = state_keys(hit.keys[len(hit.keys) - 1:], self.pieces)
        rows = self._staging(1)
        if not self.cache.get_blocks(keys, rows).all():
            return False
        flat = torch.from_numpy(rows.reshape(-1))
        offset = 0
        for g, layers, blocks in zip(self.layout.states, self._rows, targets):
            for pages in layers:
                src = flat[offset:offset + g.state_bytes]
                for b in blocks:
                    pages[b].copy_(src)
                offset += g.state_bytes
        return True

    def store(self, tokens: np.ndarray, salt: bytes, extra: Any, saves: tuple[StateSave, ...]) -> None:
        """Store the states of ``saves`` (boundaries of ``tokens``) read from their blocks."""
        if not saves:
            return
        C = self.cache.spec.chunk_tokens
        last = max(s.boundary for s in saves)
        keys = chunk_keys(self.cache.spec, tokens[:last], salt, None if extra is None else list(extra)[:last // C])
        rows = self._staging(len(saves))
        flat = torch.from_numpy(rows.reshape(len(saves), -1))
        for k, save in enumerate(saves):
            offset = 0
            for g, layers, block in zip(self.layout.states, self._rows, save.blocks):
                for pages in layers:
                    flat[k, offset:offset + g.state_bytes].copy_(pages[block])
                    offset += g.state_bytes
        boundaries = keys.take(np.array([s.boundary // C - 1 for s in saves]))
        self.cache.put_blocks(state_keys(boundaries, self.pieces), rows, owned=True)
