"""vLLM integration: a KV connector, and a secondary tier behind vLLM's own CPU offloading.

Both are loaded by module path; vLLM is not patched. This module and ``vllm_identity`` (what a
request's keys hold besides its tokens) are the only ones of tieredkv that import vLLM.

``TieredKVConnector`` (a ``KVConnectorBase_V1``)::

    scheduler process                                  worker process (one per TP rank)
    get_num_new_matched_tokens                         start_load_kv (a loader thread, vllm_loads)
      cache.lookup(tokens, salt, per-chunk extras)       cache.load -> staging (L, 2, H, T, D)
      -> whole vLLM blocks, never the whole prompt       -> paged cache, layer by layer
    update_state_after_alloc -> a load plan            wait_for_layer_load(l): layer l is in place
    build_connector_meta -> loads + saves  ─────────►  wait_for_save: loads done, then
                                                         paged cache -> host -> cache.store
                                                       get_block_ids_with_load_errors -> recompute

``TieredKVTier`` (a ``SecondaryTierManager``): the tiers behind vLLM's ``OffloadingConnector`` +
``TieringOffloadingSpec``, keyed by vLLM's ``OffloadKey``; vLLM's CPU tier stays the primary.

Paged-cache layouts, and the copies between vLLM's pages and tieredkv's blocks, are in
``tieredkv.integrations.paged``: the engine's resolved ``KVCacheLayout`` and the attention backend's
K/V split decide how a layer is read, and anything not understood is refused at start-up. Which KV
cache groups (full attention, MLA, sliding windows, fp8) fill a tieredkv block, and how, is decided
once in ``tieredkv.integrations.vllm_groups``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.cache import HOT, REMOTE, WARM, PrefixHit, TieredCache
from tieredkv.config import CacheConfig
from tieredkv.errors import InvalidInput, TieredKVError
from tieredkv.integrations import extra as extra_config
from tieredkv.integrations.extra import DEFAULT_HOT_BYTES  # noqa: F401 (re-exported)
from tieredkv.integrations.kv_events import ConnectorEvents, TierEvents
from tieredkv.integrations.paged import KV_SPLIT, MLA_BACKENDS, PagedKV, paged_view
from tieredkv.integrations.vllm_groups import CacheLayout, cache_layout
from tieredkv.integrations.vllm_identity import Unkeyable, chunk_extras, request_tokens
from tieredkv.integrations.vllm_loads import LOAD_MODES, NULL_BLOCK, LayerLoader, leading_nulls
from tieredkv.integrations.vllm_state import StateCache, StateSave
from tieredkv.integrations.vllm_window import (
    MixedHit,
    WindowHit,
    first_chunk,
    mixed_lookup,
    store_partial,
    window_lookup,
)
from tieredkv.keys import ChunkKeys, chunk_keys, opaque_keys
from tieredkv.model_identity import canonical_model_id
from tieredkv.spec import KVSpec, digest_of, join_extra, weights_extra
from tieredkv.tier import PutResult

logger = logging.getLogger(__name__)

#: ``kv_connector_extra_config`` keys the connector reads itself; every other key must be one of
#: ``TieredCache``'s keywords (``tieredkv.config.KEYWORDS``; sizes may be "8G").
CONNECTOR_KEYS = ("chunk_tokens", "model_id", "load_mode")

# ---- configuration -----------------------------------------------------------------------------
def cache_kwargs(extra: Mapping[str, Any] | None, *, own_keys: tuple[str, ...] = CONNECTOR_KEYS) -> dict[str, Any]:
    """``TieredCache`` keyword arguments from a vLLM ``extra_config`` mapping (see
    ``tieredkv.integrations.extra.cache_kwargs``).

    Raises:
        InvalidInput: an unknown key (the message lists the valid ones) or a malformed size.
    """
    return extra_config.cache_kwargs(extra, own_keys=own_keys, what="kv_connector_extra_config")


def cache_config(extra: Mapping[str, Any] | None, *, own_keys: tuple[str, ...] = CONNECTOR_KEYS) -> CacheConfig:
    """The ``CacheConfig`` of a vLLM ``extra_config`` mapping (see ``cache_kwargs``), every option checked.

    Raises:
        InvalidInput: an unknown key or a bad value (the message names the key).
    """
    return CacheConfig.from_kwargs(**cache_kwargs(extra, own_keys=own_keys))


def _default_chunk_tokens(block_size: int) -> int:
    """The smallest multiple of the engine's block size that is >= 64 tokens (tieredkv's default)."""
    return -(-64 // block_size) * block_size


def vllm_weights_extra(model_config: Any) -> str:
    """``weights_extra`` of a vLLM engine's model: its quantisation (``--quantization``, or the
    checkpoint's own) and its ``hf_overrides`` (``--hf-overrides``, e.g. a RoPE scaling)."""
    return weights_extra(getattr(model_config, "quantization", None), getattr(model_config, "hf_overrides", None))


def spec_from_vllm(vllm_config: Any, kv_cache_config: Any, *, chunk_tokens: int | None = None,
                   model_id: str | None = None, tp_rank: int = 0) -> tuple[KVSpec, CacheLayout, list[str]]:
    """The ``KVSpec`` of one TP rank of a vLLM engine, with its cache layout and ordered layer names.

    For a plain full-attention model the spec is the one ``KVSpec.from_hf_config`` gives for the same
    model path, dtype and chunk size, so a HuggingFace worker (``CachedPrefill``) and a vLLM engine
    share blocks. MLA, sliding-window and fp8 caches add their descriptor (``CacheLayout.extra``) to
    the namespace; an MLA latent is the same on every TP rank, so its spec is rank 0 of 1 on all.

    Raises:
        InvalidInput: ``chunk_tokens`` is not a multiple of the engine's block size (or exceeds a
            sliding window), or the cache has a feature tieredkv cannot store (named in the message).
    """
    layout = cache_layout(vllm_config, kv_cache_config)
    block = layout.block_size
    default = _default_chunk_tokens(block)
    if layout.window is not None:  # a chunk must fit in the window (see TieredKVConnector's saves)
        default = min(default, max(layout.window // block, 1) * block)
    chunk = default if chunk_tokens is None else int(chunk_tokens)
    if chunk <= 0 or chunk % block:
        raise InvalidInput(f"chunk_tokens={chunk_tokens} must be a positive multiple of the engine's block "
                           f"size {block} (set kv_connector_extra_config chunk_tokens, e.g. {block * 2})")
    if layout.window is not None and chunk > layout.window:
        raise InvalidInput(f"chunk_tokens={chunk} exceeds the sliding window of {layout.window} tokens: a chunk's "
                           f"first blocks could leave the window before it is saved; use at most "
                           f"{max(layout.window // block, 1) * block}")
    model = vllm_config.model_config
    if model_id is None:
        # A local directory: its files, not its spelling; a hub name: the name and its pinned revision.
        model_id = canonical_model_id(str(model.model), getattr(model, "revision", None))
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    if layout.replicated:
        tp_rank, tp_size = 0, 1  # every rank holds (and reads) the same bytes: one copy per host
    spec = KVSpec(model_id=model_id, num_layers=len(layout.layer_names), num_kv_heads=layout.num_kv_heads,
                  head_dim=layout.head_dim, dtype=layout.dtype, chunk_tokens=chunk, tp_rank=tp_rank,
                  tp_size=tp_size, extra=join_extra(layout.extra, vllm_weights_extra(model)))
    return spec, layout, list(layout.layer_names)


def _resolved_layout(vllm_config: Any, kv_cache_config: Any) -> KVCacheLayout:
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        return vllm_config.cache_config.get_resolved_kv_cache_layout()
    from vllm.config.cache import _layout_from_name

    return _layout_from_name(name)


def _backend_name(vllm_config: Any, layer_name: str) -> str | None:
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else None


# ---- connector metadata ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Restore ``hit`` (chunk-aligned, may start before the local prefix-cache hit) into ``block_ids``.

    ``skip_tokens`` leading tokens of the hit are already in vLLM's cache and are not copied; block
    ``block_ids[g][i]`` of KV cache group ``g`` receives the hit's tokens ``[skip + i*N, skip + (i+1)*N)``
    of that group's layers (``NULL_BLOCK``: outside a sliding window, not loaded).
    """

    req_id: str
    hit: PrefixHit
    skip_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    #: per state group (hybrid models), the blocks that receive the state at the hit's end
    state_blocks: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Store the prompt's full chunks ``[start_token, len(token_ids))`` from ``block_ids`` (per KV cache
    group, the blocks holding tokens from ``start_token`` on, one vLLM block each).

    ``prefix_block_ids``: every block of the prompt up to its last full chunk, all groups (the saved
    chunks were computed over all of them); ``extra``: the chunks' extra key bytes (``vllm_identity``).
    """

    req_id: str
    token_ids: np.ndarray
    salt: bytes
    start_token: int
    block_ids: tuple[tuple[int, ...], ...]
    prefix_block_ids: tuple[int, ...] = ()
    extra: tuple[bytes | None, ...] | None = None
    #: hybrid models: the chunk boundaries whose recurrent state is saved, and its blocks
    states: tuple[StateSave, ...] = ()
    #: sliding + full layers: the leading tokens from ``start_token`` whose sliding blocks vLLM no
    #: longer holds (null), stored as full-layers-only blocks (``vllm_window.store_partial``)
    partial_tokens: int = 0


@dataclasses.dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """What the scheduler side hands the workers for one engine step.

    ``recomputed``: the sets of blocks reported as failed loads that the scheduler has handled since
    the last step (vLLM recomputes them from now on), one per step output, in order.
    """

    loads: list[LoadPlan] = dataclasses.field(default_factory=list)
    saves: list[SavePlan] = dataclasses.field(default_factory=list)
    recomputed: list[tuple[int, ...]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Tracked:
    """Scheduler-side state of one running request: what to save once its prompt is computed."""

    token_ids: np.ndarray
    salt: bytes
    saved_tokens: int  # leading tokens held by the tiers or already planned for saving (chunk-aligned)
    block_ids: list[list[int]]  # per KV cache group
    extra: list[bytes | None] | None = None


def _group_ids(block_ids: Any) -> list[list[int]]:
    """vLLM's per-group block ids (a tuple of lists, one per KV cache group) as lists."""
    return [list(ids) for ids in block_ids]


def _raw(host: torch.Tensor) -> Any:
    """fp8 pages travel as uint8 (``register_kv_caches``); torch has no fp8 view the cache checks
    against the spec's fp8 dtype, so their host buffer goes to the cache as numpy bytes."""
    return host.numpy() if host.dtype == torch.uint8 else host


@dataclasses.dataclass(frozen=True)
class _Identity:
    """What a request's chunk keys are made of (``None`` in its place: a request that is not cached)."""

    tokens: np.ndarray
    salt: bytes
    extra: list[bytes | None] | None


#: Prefixes the salt of an engine's requests after ``reset_cache`` (followed by its 16-byte generation).
_GENERATION_TAG = b"\x00tieredkv-generation\x00"

#: The vLLM hit source of each tier: the hot tier is host memory, the warm tier disk; a remote store is
#: what vLLM's ``CacheHitSource`` files under "external_unspecified" (its P2P is another engine's KV).
HIT_SOURCES = {HOT: CacheHitSource.HOST, WARM: CacheHitSource.DISK, REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED}


def _slice_hit(hit: PrefixHit, first: int, end: int, chunk_tokens: int) -> PrefixHit:
    """The blocks ``[first, end)`` of ``hit``, as a hit that ``TieredCache.load`` restores from 0."""
    return dataclasses.replace(hit, tokens=(end - first) * chunk_tokens, keys=hit.keys[first:end],
                               where=hit.where[first:end])


# ---- the connector ----------------------------------------------------------------------------------
class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Serve vLLM prompts' prefixes from tieredkv's host tiers and store what vLLM computes.

    Configured by ``kv_connector_extra_config``: ``chunk_tokens`` (a multiple of the engine's block
    size; default the smallest multiple >= 64), ``model_id`` (default: the model vLLM was given; a
    local directory is named by its files, ``local_model_id``, as ``KVSpec.from_hf_config`` does),
    and any ``TieredCache`` argument (``hot_bytes``, ``warm_dir``, ``warm_bytes``, ``eviction``,
    ``hot_name``, ...), and ``load_mode``: ``"layer"`` (default: ``start_load_kv`` starts the step's loads
    on a background thread and attention layer ``l`` waits only for layer ``l``, so the copies overlap
    the forward; ``tieredkv.integrations.vllm_loads``) or ``"sync"`` (every load finishes in
    ``start_load_kv``). Saves happen in ``wait_for_save``, after the forward and the loads.

    Cache families (``tieredkv.integrations.vllm_groups``): full attention, MLA (one latent copy per
    host: every TP rank reads it, rank 0 alone writes it), sliding windows (with or without vLLM's
    hybrid KV cache manager: blocks outside a request's window are neither loaded nor saved; when
    every layer slides, a hit needs only its window's chunks; beside full layers, the full layers need
    every chunk and the sliding ones the window's, ``vllm_window``), hybrid models'
    recurrent state at the chunk boundaries vLLM snapshots (``vllm_state``) and per-tensor fp8 KV;
    anything else is refused at start-up with the feature named.

    A lookup, load or save failure never fails a request: a lookup failure is a miss; blocks a load
    could not fill are reported by ``get_block_ids_with_load_errors`` (run vLLM with
    ``kv_load_failure_policy="recompute"`` so it recomputes them); a failed save is logged and skipped.
    Nothing computed over a failed load is stored: the worker skips the saves of every prompt whose
    blocks include one that failed, and the scheduler side plans them again once vLLM recomputed.

    A request's keys hold what vLLM's own block hashes hold (``vllm_identity``: LoRA adapter,
    multimodal items, prompt embeddings, cache salt), per chunk; a request that cannot be keyed
    exactly is neither looked up nor stored. ``reset_cache`` moves the engine to a new generation.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        config = cache_config(extra)
        self._load_mode = str(extra.get("load_mode", "layer"))
        if self._load_mode not in LOAD_MODES:
            raise InvalidInput(f"kv_connector_extra_config load_mode={self._load_mode!r}: choose one of {LOAD_MODES}")
        # With KV events on, the tiers are announced to routers too: the host journal carries them.
        events_on = bool(getattr(vllm_config.kv_events_config, "enable_kv_cache_events", False))
        if events_on and not config.journal:
            config = dataclasses.replace(config, journal=True)
        tp_rank = 0
        if role == KVConnectorRole.WORKER and vllm_config.parallel_config.tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        self.spec, self._layout, self._layer_names = spec_from_vllm(
            vllm_config, kv_cache_config, chunk_tokens=extra.get("chunk_tokens"), model_id=extra.get("model_id"),
            tp_rank=tp_rank)
        self._block_size = self._layout.block_size
        # Loads are asynchronous (the request waits a step for them, vLLM caches its blocks only once
        # the load succeeded) where a failed synchronous load cannot be undone:
        # - several KV cache groups (a full and a sliding group under the hybrid manager; attention and
        #   mamba state groups, which count too): vLLM 0.32 takes a failed load of such a model only as
        #   a failed receive (block ids are not unique across groups; reporting them as invalid blocks
        #   stops the engine);
        # - async scheduling (vLLM's default on GPUs): a synchronously loaded block is in vLLM's prefix
        #   cache at once, and the next step, scheduled before vLLM sees the load fail, can give it
        #   to another request as a local hit; vLLM then takes back only the failed request's tokens.
        async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._async_loads = len(self._layout.groups) + len(self._layout.states) > 1 or async_scheduling
        # A replicated cache (MLA) is written by rank 0 alone; every rank loads it.
        self._writer = not self._layout.replicated or tp_rank == 0
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.cache = TieredCache(self.spec, config)
        # Hybrid models: recurrent states at chunk boundaries, as extra blocks of the same cache.
        self._states = StateCache(self.cache, self._layout) if self._layout.states else None
        # Every layer slides (and no recurrent state): hits need a window of chunks, not a prefix.
        self._window = self._layout.uniform_window if self._states is None else None
        # Sliding + full layers: full layers need a prefix, sliding ones the window (vllm_window).
        self._mixed = self._layout.mixed_window if self._states is None else None
        self._declined = ("vLLM does not snapshot this model's recurrent state at block boundaries "
                          "(mamba_cache_mode is not 'align' or ReplaySSM is on; enable prefix caching)"
                          if any(not g.cached for g in self._layout.states) else None)
        if self._declined and role == KVConnectorRole.SCHEDULER:
            logger.warning("tieredkv: no request of this engine is cached: %s", self._declined)
        self._events = (ConnectorEvents(self.cache, self._block_size)
                        if role == KVConnectorRole.SCHEDULER and events_on and self.cache.journal is not None else None)
        # scheduler side
        self._lookups: dict[str, tuple[PrefixHit, int]] = {}
        self._loads: dict[str, LoadPlan] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._identities: dict[str, _Identity | None] = {}
        self._counted: set[str] = set()  # requests whose lookup is counted (once per request)
        self._sources: dict[str, dict[CacheHitSource, int]] = {}
        self._generation = b""  # after reset_cache: 16 random bytes in every request's salt
        self._recomputed: list[tuple[int, ...]] = []  # invalid-block sets handled, for the next metadata
        self._no_load: set[str] = set()  # requests whose asynchronous load failed: computed, not loaded
        # worker side
        self._paged: PagedKV | None = None
        self._loader: LayerLoader | None = None
        self._load_errors: set[int] = set()
        self._receiving: set[str] = set()  # asynchronous loads started, not yet reported finished
        self._received: set[str] = set()   # ... finished (and, of them, failed: some block left unfilled)
        self._failed_receives: set[str] = set()
        # Blocks whose load failed, until the scheduler says vLLM recomputes them (one count per step
        # that reported the block): no save computed over them.
        self._poisoned: collections.Counter[int] = collections.Counter()

    # ---- scheduler side -------------------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        """False: saves finish inside the step that computed them, and a lost save is a future miss."""
        return False

    def _identity(self, request: Any) -> _Identity | None:
        """The request's tokens, salt (with the engine's generation) and per-chunk extra key bytes;
        ``None`` for a request that cannot be keyed exactly (it is neither looked up nor stored)."""
        req_id = request.request_id
        if req_id in self._identities:
            return self._identities[req_id]
        identity: _Identity | None
        if self._declined:
            self._identities[req_id] = None
            return None
        try:
            tokens = request_tokens(request)
            extra = chunk_extras(request, len(tokens) // self.spec.chunk_tokens, self.spec.chunk_tokens)
            salt = getattr(request, "cache_salt", None)
            # As vLLM hashes it: any str, lone surrogates included (JSON "\ud800" decodes to one).
            salt = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt or b"")
            if self._generation:
                salt = _GENERATION_TAG + self._generation + salt
            identity = _Identity(tokens, salt, extra)
        except Unkeyable as e:
            logger.info("tieredkv: request %s is not cached (%s)", req_id, e)
            identity = None
        self._identities[req_id] = identity
        return identity

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the tiers can supply: whole chunks (so whole vLLM
        blocks), never the whole prompt. A failing lookup is a miss. Counts nothing (vLLM may ask
        again every step for a waiting request): ``update_state_after_alloc`` counts once."""
        identity = self._identity(request)
        if identity is None or request.request_id in self._no_load:
            return 0, False
        try:
            if self._window is not None:  # every layer slides: a full window of chunks is a hit
                hit = window_lookup(self.cache, identity.tokens, identity.salt, identity.extra, self._window,
                                    num_computed_tokens)
            elif self._mixed is not None:  # full layers a prefix, sliding layers the window before its end
                hit = mixed_lookup(self.cache, identity.tokens, identity.salt, identity.extra, self._mixed,
                                   num_computed_tokens)
            else:
                hit = self.cache.lookup(identity.tokens, identity.salt, extra=identity.extra, count=False)
        except (TieredKVError, OSError) as e:
            logger.warning("tieredkv: lookup failed, serving request %s without it: %s", request.request_id, e)
            self._lookups.pop(request.request_id, None)
            return 0, False
        if self._states is not None:  # a hybrid model's hit ends where a recurrent state is stored
            hit = self._states.usable(hit, num_computed_tokens)
        self._lookups[request.request_id] = (hit, num_computed_tokens)
        external = max(hit.tokens - num_computed_tokens, 0)
        return external, self._async_loads and external > 0

    def _count_once(self, req_id: str, prompt_tokens: int, hit: PrefixHit | None, local: int, external: int) -> None:
        """Count the request's lookup once, crediting the tiers only with the tokens they served:
        ``[local, local + external)``, beyond what vLLM's own prefix cache held."""
        where = hit.where if hit is not None else np.zeros(0, np.int8)
        if (where < 0).any() and (where >= 0).any():
            # A window hit: vLLM skips the chunks before the window thanks to the level that held it.
            where = np.where(where < 0, where[where >= 0][0], where)
        if external <= 0 or local + external > len(where) * self.spec.chunk_tokens:
            where = np.zeros(0, np.int8)  # nothing served (a range the connector did not offer is recomputed)
        served = where[np.arange(local, local + external) // self.spec.chunk_tokens] if len(where) else where
        codes, counts = np.unique(served, return_counts=True)
        per_level = {int(c): int(n) for c, n in zip(codes, counts)}
        sources: dict[CacheHitSource, int] = {}
        for code, n in per_level.items():
            source = HIT_SOURCES.get(code, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + n
        self._sources[req_id] = sources
        if req_id in self._counted:
            return
        self._counted.add(req_id)
        try:
            self.cache.count_served(prompt_tokens, per_level, prefill_tokens=max(prompt_tokens - local - external, 0))
        except (TieredKVError, OSError) as e:  # counters are never worth a failed request
            logger.warning("tieredkv: counting request %s failed: %s", req_id, e)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The tokens each tier supplied: hot as host memory, warm as disk (``HIT_SOURCES``)."""
        sources = self._sources.pop(request.request_id, None)
        if sources is None or sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return sources

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` after the local hit, and track the request's save."""
        req_id = request.request_id
        hit, local = self._lookups.pop(req_id, (None, 0))
        block_ids = _group_ids(blocks.get_block_ids()) if blocks is not None else [[] for _ in self._layout.groups]
        tracked = self._tracked.get(req_id)
        if hit is None and num_external_tokens <= 0 and tracked is not None:
            # The request leaves WAITING_FOR_REMOTE_KVS (its asynchronous load ended) and vLLM allocates
            # again, without a lookup: it is tracked already. Planned afresh, it would save every loaded
            # chunk again, and after a reset_cache under the new generation's salt.
            tracked.block_ids = block_ids
            return
        identity = self._identity(request)
        self._count_once(req_id, int(getattr(request, "num_prompt_tokens", 0) or 0), hit, local,
                         num_external_tokens if hit is not None else 0)
        if identity is None:
            return  # not keyed exactly: never stored
        saved = 0 if hit is None else hit.tokens
        if isinstance(hit, MixedHit):  # chunks before vLLM's own hit that the tiers lack are stored too
            saved = min(max(saved, hit.first * self.spec.chunk_tokens), hit.held * self.spec.chunk_tokens)
        self._tracked[req_id] = _Tracked(token_ids=identity.tokens, salt=identity.salt, extra=identity.extra,
                                         saved_tokens=saved, block_ids=block_ids)
        self._note_events(request, hit)
        if num_external_tokens <= 0 or hit is None:
            return
        C, N = self.spec.chunk_tokens, self._block_size
        end = local + num_external_tokens
        # A window hit needs no chunk before its window's first: vLLM holds those blocks as null.
        first, last = max(local // C, getattr(hit, "first", 0)), -(-end // C)
        start = max(local, first * C)
        # (A window hit cut short by vLLM would need chunks before its window, which were not looked up.)
        short_window = (isinstance(hit, WindowHit) and first_chunk(end, self._window or 0, C) < hit.first) or \
            (isinstance(hit, MixedHit) and not hit.window_is_whole(end, self._mixed or 0, C))
        if local % N or end % N or end > hit.tokens or short_window:
            # Not a range this connector offered: load nothing and let the worker report every
            # block as failed, so vLLM recomputes them rather than reading unfilled pages.
            logger.warning("tieredkv: request %s: vLLM asked for tokens [%d, %d) but the hit covers [0, %d) in "
                           "blocks of %d; recomputing them", req_id, local, end, hit.tokens, N)
            last = first
        self._loads[req_id] = LoadPlan(req_id=req_id, hit=_slice_hit(hit, first, last, C),
                                       skip_tokens=start - first * C,
                                       block_ids=tuple(tuple(ids[start // N:-(-end // N)]) for ids in block_ids),
                                       state_blocks=self._states.targets(block_ids, end) if self._states else ())

    def _note_events(self, request: Any, hit: PrefixHit | None) -> None:
        """Describe the prompt's full chunks in the host journal (vLLM's hashes for whichever process
        stores them) and announce the ones this lookup found in the tiers."""
        events = self._events
        if events is None:
            return
        events.sync_generation(self._generation)
        identity = self._identity(request)
        if identity is None:
            return  # not keyed exactly: never stored, never announced
        # The keys the worker's store and this side's lookup make: the same tokens, salt and extras.
        C = self.spec.chunk_tokens
        n = len(identity.tokens) // C
        extra = identity.extra[:n] if identity.extra is not None else None
        keys = chunk_keys(self.spec, identity.tokens[:n * C], identity.salt, extra)
        # Announced: the leading run found (a window hit's chunks before its window were not looked up;
        # a full-layers-only block is held under another key than its chunk's, and is not announced).
        where = hit.where if hit is not None else np.zeros(0)
        if isinstance(hit, MixedHit):
            where = np.where(hit.complete, where, -1)
        where = where[:np.argmax(where < 0)] if (where < 0).any() else where
        events.note_request(request, keys, where.tolist())

    def take_events(self) -> list:
        """KV events for routers since the last call (vLLM's scheduler publishes them with its own):
        ``BlockStored`` for chunks stored into or found in tieredkv's tiers by any engine of the host,
        ``BlockRemoved`` when a tier evicts one announced here (``tieredkv.integrations.kv_events``)."""
        events = self._events
        if events is None:
            return []
        # A reset_cache gives this engine new keys (a generation in every salt): follow it.
        events.sync_generation(self._generation)
        return events.take()

    def build_connector_meta(self, scheduler_output: Any) -> TieredKVMetadata:
        """This step's loads, and saves for prompts whose last full chunk this step computes."""
        meta = TieredKVMetadata(loads=list(self._loads.values()), recomputed=self._recomputed)
        self._loads.clear()
        self._recomputed = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = _group_ids(new.block_ids)
                self._forget_behind_windows(tracked, new.num_computed_tokens)
                self._maybe_save(meta, new.req_id, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                # A request resumed after preemption gets its whole block list again; otherwise
                # blocks are appended (block tables are append-only while a request runs).
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = _group_ids(new_ids)
                else:
                    for ids, more in zip(tracked.block_ids, new_ids):
                        ids.extend(more)
            self._forget_behind_windows(tracked, cached.num_computed_tokens[i])
            self._maybe_save(meta, req_id, tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._tracked.pop(req_id, None)
        return meta

    def _forget_behind_windows(self, tracked: _Tracked, computed: int) -> None:
        """Null the blocks of sliding groups that vLLM may have freed by this step (``computed``: the
        request's computed tokens as the step starts).

        vLLM frees a sliding group's blocks wholly before ``computed - window + 1`` and nulls them in
        its own table, but the lists it sends only ever grow: kept here, such an id may belong to
        another request by now, and a save planned again after a failed load (or a failure report
        naming it) would read that request's KV. Nulling at least what vLLM freed (its count of
        processed tokens is never larger) makes such chunks unreadable instead (``_maybe_save``)."""
        N = self._block_size
        for g in self._layout.groups:
            if g.window is None:
                continue
            ids = tracked.block_ids[g.index]
            for b in range(min(max(0, computed - g.window + 1) // N, len(ids))):
                ids[b] = NULL_BLOCK

    def _maybe_save(self, meta: TieredKVMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """Plan the save of the prompt's chunks completed by the end of this step and not saved yet.

        Saving in the step that completes a chunk (not once the whole prompt is done) matters for
        sliding windows: a chunk no longer than the window is still in it then, while under chunked
        prefill vLLM frees the blocks that leave the window in later steps.
        """
        C, N = self.spec.chunk_tokens, self._block_size
        full = min(computed, len(tracked.token_ids)) // C * C
        start = tracked.saved_tokens // C * C
        if full <= start:
            return
        tracked.saved_tokens = full
        ids = [g[start // N:full // N] for g in tracked.block_ids]
        if any(len(g) < (full - start) // N for g in ids):
            return
        # Blocks a sliding group no longer keeps (e.g. behind vLLM's own prefix-cache hit) lead as the
        # null block: the chunks they touch cannot be read, so the save starts after them; with full
        # layers beside the sliding ones those chunks are stored as full-layers-only blocks instead.
        # (State groups are null between the boundaries vLLM snapshots: they never hold chunks back.)
        mixed = self._mixed is not None
        nulls = max((leading_nulls(ids[g.index]) for g in self._layout.groups if not mixed or g.window is None),
                    default=0)
        skip = -(-nulls * N // C) * C
        if start + skip >= full:
            return
        partial = 0
        if mixed:
            sliding = max(leading_nulls(ids[g.index]) for g in self._layout.groups if g.window is not None)
            partial = min(max(-(-sliding * N // C) * C - skip, 0), full - start - skip)
        extra = None if tracked.extra is None else tuple(tracked.extra[:full // C])
        meta.saves.append(SavePlan(req_id=req_id, token_ids=tracked.token_ids[:full], salt=tracked.salt,
                                   start_token=start + skip,
                                   block_ids=tuple(tuple(g[skip // N:]) for g in ids),
                                   prefix_block_ids=tuple(b for g in tracked.block_ids for b in g[:full // N]
                                                          if b != NULL_BLOCK),
                                   extra=extra,
                                   states=self._states.saves(tracked.block_ids, start + skip, full)
                                   if self._states else (), partial_tokens=partial))

    def update_connector_output(self, connector_output: Any) -> None:
        """Plan again the saves of requests that hold a block whose load failed.

        vLLM recomputes such a request from its first bad block; the worker skipped its save
        (``wait_for_save``), so the recomputed chunks are stored once the prompt is computed again.
        """
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            # An asynchronous load that failed: vLLM recomputes the whole request. It is served without
            # the tiers from now on (a load failing again would send it round that loop once more),
            # and its chunks are stored once computed.
            tracked = self._tracked.get(req_id)
            if tracked is not None:  # else vLLM has finished it already (aborted, or load failures fail it)
                self._no_load.add(req_id)
                tracked.saved_tokens = 0
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        self._recomputed.append(tuple(sorted(invalid)))  # the workers may save over them again
        N = self._block_size
        for tracked in self._tracked.values():
            full = len(tracked.token_ids) // self.spec.chunk_tokens * self.spec.chunk_tokens
            if any(not invalid.isdisjoint(b for b in g[:full // N] if b != NULL_BLOCK) for g in tracked.block_ids):
                tracked.saved_tokens = 0  # chunks lost from the tiers are stored again

    def reset_cache(self) -> bool:
        """Serve nothing stored before this call: move this engine to a new generation.

        Every later request's salt holds 16 fresh random bytes, so no block stored before (by this
        engine or any other) can match, and no other engine of the host ever matches this engine's
        new blocks (nor the blocks of another engine reset at the same time: each reset draws its own
        generation). The old blocks stay until eviction reclaims them. Requests already planned keep
        their old keys: what they store can never be served after the reset.
        """
        self._generation = os.urandom(16)
        self._identities.clear()
        self._lookups.clear()
        if self._events is not None:  # routers hear AllBlocksCleared from this engine (only)
            self._events.sync_generation(self._generation)
        logger.info("tieredkv: reset_cache: a new generation; blocks stored before are never served")
        return True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous, so the blocks can be freed at once."""
        req_id = request.request_id
        for state in (self._tracked, self._lookups, self._identities, self._sources):
            state.pop(req_id, None)
        self._counted.discard(req_id)
        self._no_load.discard(req_id)
        return False, None

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid KV cache manager (``SupportsHMA``): the same."""
        return self.request_finished(request, [])

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check every layer's cache against the engine's resolved layout and the backend's page format.

        Raises:
            InvalidInput: a layer is missing, or its layout, backend or shape is not understood.
        """
        missing = [n for n in self._layer_names if n not in kv_caches]
        if missing:
            raise InvalidInput(f"register_kv_caches lacks layers {missing[:3]} of the KV cache groups")
        backend = _backend_name(self._vllm_config, self._layer_names[0])
        mla = self._layout.family == "mla"
        known = MLA_BACKENDS if mla else KV_SPLIT
        if (backend or "") not in known:
            raise InvalidInput(f"attention backend {backend!r}: how it stores {'the MLA latent' if mla else 'K and V'} "
                               f"in a page is not known to tieredkv; supported backends: {sorted(known)}")
        layout = _resolved_layout(self._vllm_config, self._kv_cache_config)
        views = []
        for name in self._layer_names:
            cache = kv_caches[name]
            if cache.element_size() == 1 and cache.dtype not in (torch.uint8, torch.int8):
                cache = cache.view(torch.uint8)  # fp8 pages: their bytes move as they are
            if mla and cache.dim() == 3:  # [B, N, latent]: the one "head" axis is implicit
                cache = cache.unsqueeze(1)
            # An MLA latent [B, 1, N, L] reads as K = its first L/2 values, V = the rest (vllm_groups).
            views.append(paged_view(cache, layout, "last_axis" if mla else KV_SPLIT[backend or ""],
                                    num_kv_heads=self.spec.num_kv_heads, block_size=self._block_size,
                                    head_size=self.spec.head_dim))
        self._paged = PagedKV(views, self._block_size)
        after_copy = None
        if self._states is not None:
            self._states.register(kv_caches)
            after_copy = self._load_state
        group_of_layer = [0] * len(self._layer_names)
        for group in self._layout.groups:
            for layer in group.layers:
                group_of_layer[layer] = group.index
        # A hybrid model's state layers read their state without asking wait_for_layer_load (vLLM asks
        # in attention layers only): their loads must be done before the forward.
        mode = "sync" if self._states is not None else self._load_mode
        self._loader = LayerLoader(self.cache, self._paged, group_of_layer,
                                   {name: i for i, name in enumerate(self._layer_names)}, mode, after_copy=after_copy)

    def _load_state(self, plan: LoadPlan, loaded: int) -> bool:
        """After a plan's KV tier copy (hybrid models): restore the recurrent state at the hit's end.
        False (the plan's blocks are recomputed): the KV is short of the hit, or the state is gone;
        the KV alone cannot be continued from."""
        assert self._states is not None
        return loaded == plan.hit.tokens and self._states.load(plan.hit, plan.state_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's planned restores into the paged cache (``load_mode="sync"``: do them).

        Each KV cache group's layers go to that group's blocks; a sliding group's null blocks (outside
        its window) are left alone. Blocks that could not be filled (evicted since the lookup, damaged,
        an I/O error) are reported by ``get_block_ids_with_load_errors``; the ones filled are kept.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredKVMetadata):
            return
        for handled in meta.recomputed:
            self._poisoned.subtract(handled)
        self._poisoned = +self._poisoned  # drop counts at or below zero
        if meta.loads and self._loader is not None:
            self._loader.start(meta.loads)
        if self._async_loads and meta.loads:
            started = {plan.req_id for plan in meta.loads}
            if self._loader is None:  # no paged cache to load into: each one ends now, failed
                self._received |= started
                self._failed_receives |= started
            else:
                self._receiving |= started

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's loads have written layer ``layer_name`` (or failed on it)."""
        if self._loader is not None:
            self._loader.wait_layer(layer_name)

    def _finish_loads(self) -> None:
        """Wait for the step's loads; note the blocks they could not fill (reported to vLLM, and no
        save computed over them until vLLM took them back)."""
        if self._loader is None:
            return
        errors = self._loader.finish()
        failed = self._loader.take_failed()
        if self._async_loads:
            # Reported per request (get_transfer_results): vLLM recomputes a failed one from its start
            # before anything reads its blocks (they are cached only once a load succeeded).
            self._received |= self._receiving
            self._failed_receives |= failed & self._receiving
            self._receiving = set()
            return
        self._load_errors |= errors
        self._poisoned.update(errors)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Saves read all layers at once in ``wait_for_save``, after the forward wrote them."""

    def wait_for_save(self) -> None:
        """Store the full prompt chunks this step finished computing (skipping ones already held).

        A prompt with a block whose load failed is not stored until the scheduler side reports that
        vLLM took the block back (``TieredKVMetadata.recomputed``): its chunks were computed over pages
        the load never filled, in this step or in one scheduled before vLLM saw the failure (async
        scheduling). The scheduler side plans its save again. With tensor parallelism every rank
        skips what any rank skips.
        """
        self._finish_loads()  # before any save: they read pages the loads write, and need their failures
        meta = self._get_connector_metadata()
        paged = self._paged
        if not isinstance(meta, TieredKVMetadata) or not meta.saves or paged is None:
            return
        poisoned = set(self._poisoned)
        # Every rank takes part in the agreement (a collective), also the ranks that do not write a
        # replicated (MLA) cache, whose spec has no TP rank: the engine's TP size counts here.
        skip = _agree_across_ranks([not poisoned.isdisjoint(p.prefix_block_ids) for p in meta.saves],
                                   self._tp_size)
        if not self._writer:
            return
        for plan, skipped in zip(meta.saves, skip):
            if skipped:
                logger.warning("tieredkv: request %s: not saving chunks computed over a failed load", plan.req_id)
                continue
            try:
                # Positions before start_token (already in the tiers) are left unread: store skips them.
                host = paged.host_buffer(len(plan.token_ids))
                whole = plan.start_token + plan.partial_tokens  # sliding layers held from here on
                for group in self._layout.groups:
                    at = plan.start_token if group.window is None or not plan.partial_tokens else whole
                    paged.read(plan.block_ids[group.index][(at - plan.start_token) // self._block_size:],
                               host[:, :, :, at:], layers=group.layers)
                self.cache.store(plan.token_ids, _raw(host), plan.salt, from_token=whole,
                                 extra=None if plan.extra is None else list(plan.extra))
                if plan.partial_tokens:
                    store_partial(self.cache, plan.token_ids, host, plan.salt, plan.extra, plan.start_token, whole,
                                  [i for g in self._layout.groups if g.window is not None for i in g.layers])
                if self._states is not None:  # after the KV: a stored state implies its chunks were
                    self._states.store(plan.token_ids, plan.salt, plan.extra, plan.states)
            except Exception:  # a failed save is a future miss, never a failed request
                logger.exception("tieredkv: saving request %s failed; it is not cached", plan.req_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The asynchronous loads (models with several KV cache groups) that ended, and those that failed
        (also among the ended: vLLM then recomputes the request from its start)."""
        self._finish_loads()
        received, self._received = self._received, set()
        failed, self._failed_receives = self._failed_receives, set()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()  # vLLM calls wait_for_save first; this holds without it too
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Close this process's handle on the tiers (the shared state stays for other engines)."""
        if self._loader is not None:
            self._loader.close()
        if self._events is not None:
            self._events.close()
        self.cache.close()


def _agree_across_ranks(flags: list[bool], tp_size: int) -> list[bool]:
    """``flags`` OR-ed over the tensor-parallel group (every rank gets the same saves in the same
    order). A rank computes its KV over the other ranks' activations, so a load that failed on one
    rank spoils what every rank computed after it."""
    if tp_size <= 1 or not flags:
        return flags
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    mine = torch.tensor(flags, dtype=torch.uint8)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
    return [bool(v) for v in mine.tolist()]


# ---- a secondary tier behind vLLM's CPU offloading ------------------------------------------------
def _offload_rank(cfg: Any) -> tuple[int, int]:
    """(rank, world size) of a secondary tier's worker: each rank's rows hold its own shard, unless the
    layout is replicated (every rank's bytes the same: one copy, rank 0 of 1)."""
    if cfg is None:
        return 0, 1
    if getattr(cfg, "replicated_layout", False):
        return 0, 1
    return int(cfg.parallel.rank), int(cfg.parallel.world_size)


def offload_layout_extra(cfg: Any) -> str:
    """The namespace part of a secondary tier's rows: whatever decides their bytes besides the tokens
    and the request (vLLM's offload keys name those): the KV dtype, the split over TP, PP and context
    parallelism, the KV cache groups (their layers and tokens per block), tokens per hash and blocks
    per chunk, the cache's memory layout, the canonical format, a replicated layout."""
    if cfg is None:
        return "vllm-offload"
    par, cache = cfg.parallel, cfg.cache
    groups = [[int(g.tokens_per_block), list(g.layer_names)] for g in cfg.groups]
    doc = {"dtype": str(cfg.model.dtype), "tp": int(par.tp_size), "pp": int(par.pp_size),
           "pcp": int(getattr(par, "pcp_size", 1)), "dcp": int(getattr(par, "dcp_size", 1)),
           "groups": groups, "tokens_per_hash": int(cache.tokens_per_hash),
           "blocks_per_chunk": int(cache.blocks_per_chunk), "layout": str(getattr(cfg, "kv_cache_layout", None)),
           "canonical": bool(getattr(cfg, "canonical_layout", False)),
           "replicated": bool(getattr(cfg, "replicated_layout", False))}
    return f"vllm-offload;dtype={cfg.model.dtype};rows={digest_of(doc)}"


def _offload_model(cfg: Any, model_id: str | None) -> tuple[str, str]:
    """A secondary tier's model id and weights part of its namespace.

    vLLM's ``OffloadingConfig`` names the model only; what else decides the KV (``--hf-overrides``,
    ``--quantization``, a pinned revision) is read from the engine's config where vLLM has set it as
    the current one. Where it has not, two engines of one checkpoint with other overrides would share
    rows: give each its own ``model_id`` then (logged)."""
    name = getattr(getattr(cfg, "model", None), "name", None) if cfg is not None else None
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - releases without it
        current = None
    engine = getattr(current, "model_config", None)
    if engine is not None and name is not None and str(getattr(engine, "model", "")) != str(name):
        engine = None  # another engine's config: not this tier's model
    if model_id:
        return model_id, vllm_weights_extra(engine) if engine is not None else ""
    if name is None:
        return "vllm-model", ""
    if engine is None:
        logger.warning("tieredkv: the secondary tier cannot see the engine's load-time overrides or "
                       "quantisation; engines of %s with different ones must each set model_id", name)
        return canonical_model_id(str(name)), ""
    return canonical_model_id(str(name), getattr(engine, "revision", None)), vllm_weights_extra(engine)


def offload_keys(spec: KVSpec, keys: Any) -> ChunkKeys:
    """``ChunkKeys`` for vLLM ``OffloadKey`` bytes (``tieredkv.keys.opaque_keys``).

    vLLM's block hashes already chain the whole prefix and the request's cache salt, so a block is
    confirmed by its key alone.
    """
    return opaque_keys(spec, list(keys))


class TieredKVTier(SecondaryTierManager):
    """tieredkv's levels (hot shared memory, warm disk, remote) as a vLLM secondary offloading tier.

    Every chunk of vLLM's CPU (primary) tier is one opaque tieredkv block under a namespace of the
    model, the KV dtype and the chunk size, so engines of one host share chunks through shared memory
    and find them again on disk after a restart. Transfers run on one background thread; every
    method called by the scheduler returns at once. Configured by the tier's config dict: any
    ``TieredCache`` argument (``hot_bytes``, ``warm_dir``, ...) and ``model_id``.
    """

    medium = Medium.CPU

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **config: Any):
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        cache_cfg = cache_config({k: v for k, v in config.items() if k != "locality"}, own_keys=("model_id",))
        chunk_bytes = self.block_size_bytes
        rows = np.asarray(primary_kv_view)
        self._primary = rows.view(np.uint8).reshape(rows.shape[0], -1)
        if chunk_bytes % 2 or self._primary.shape[1] != chunk_bytes:
            raise InvalidInput(f"the primary tier's rows must be {chunk_bytes} contiguous bytes (an even count), "
                               f"got shape {rows.shape} strides {primary_kv_view.strides}")
        cfg = getattr(offloading_spec, "config", None)
        model, weights = _offload_model(cfg, config.get("model_id"))
        rank, world = _offload_rank(cfg)
        # One opaque block per chunk: 1 layer x (K,V) x 1 head x 1 token x chunk_bytes/2 int8 values. vLLM's
        # offload keys name the tokens and the request's identity, not the bytes' layout: the namespace does.
        self.spec = KVSpec(model_id=str(model), num_layers=1, num_kv_heads=1, head_dim=chunk_bytes // 2, dtype="int8",
                           chunk_tokens=1, tp_rank=rank, tp_size=world,
                           extra=join_extra(offload_layout_extra(cfg), weights))
        self.cache = TieredCache(self.spec, cache_cfg)
        # With the config's journal on, chunks stored and evicted on the host become OffloadingEvents.
        self._events = TierEvents(self.cache) if self.cache.journal is not None else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tieredkv-tier", daemon=True)
        self._thread.start()

    # ---- scheduler-facing calls (non-blocking) ----------------------------------------------------
    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        """HIT when some level holds the chunk (a failing lower level is a miss; the remote tier, if
        configured, is asked within its deadline)."""
        try:
            keys = offload_keys(self.spec, [key])
            where = self.cache.locate(keys)
            if where[0] >= 0 and self._events is not None:
                self._events.found(keys[0], bytes(key), int(where[0]))
        except (TieredKVError, OSError) as e:
            logger.warning("tieredkv tier: lookup failed (a miss): %s", e)
            return LookupResult.MISS
        return LookupResult.HIT if where[0] >= 0 else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def _submit(self, kind: str, job: TransferJob) -> None:
        if len(job.keys) != len(job.chunk_ids):
            raise InvalidInput(f"job {job.job_id}: {len(job.keys)} keys but {len(job.chunk_ids)} chunk ids")
        with self._idle:
            self._pending += 1
        self._jobs.put((kind, job))

    def get_finished_jobs(self) -> list[JobResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._pending > 0

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Block until every submitted job has finished (its result is queued)."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def take_events(self) -> list:
        """``OffloadingEvent`` for chunks stored into or found in the tiers on this host, and for the ones
        announced here that a tier evicted since (with the config's ``journal`` on; else none)."""
        return self._events.take() if self._events is not None else []

    def shutdown(self) -> None:
        """Finish submitted jobs, stop the thread, close the tiers (idempotent)."""
        if self._thread.is_alive():
            self.drain_jobs()
            self._jobs.put(None)
            self._thread.join()
        if self._events is not None:
            self._events.close()
        self.cache.close()

    # ---- the transfer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            kind, job = item
            try:
                result = self._store(job) if kind == "store" else self._load(job)
            except Exception:  # a failed job is reported as failed, never lost
                logger.exception("tieredkv tier: %s job %s failed", kind, job.job_id)
                result = JobResult(job_id=job.job_id, success=False)
            self._done.put(result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _store(self, job: TransferJob) -> JobResult:
        keys = offload_keys(self.spec, list(job.keys))
        rows = np.asarray(job.chunk_ids, dtype=np.int64)
        payloads = self._primary[rows]  # a gather copy: the primary slots are released after the job
        if self._events is not None:
            self._events.note_store(keys, list(job.keys))
        # The cache's store path: every level by its admission rule (write-behind and the remote tier
        # included), counted. A chunk the top level had no room for went below it if there is a level.
        codes = self.cache.put_blocks(keys, payloads, owned=True)
        ok = bool(np.all(codes != PutResult.NO_SPACE)) or len(self.cache.levels) > 1
        return JobResult(job_id=job.job_id, success=ok, transfer_bytes=int(payloads.nbytes))

    def _load(self, job: TransferJob) -> JobResult:
        keys_in = list(job.keys)
        keys = offload_keys(self.spec, keys_in)
        rows = np.asarray(job.chunk_ids, dtype=np.int64)
        staging = np.empty((len(keys), self.block_size_bytes), dtype=np.uint8)
        # Chunks of one job need not be a prefix run: each is read from wherever it is.
        got = self.cache.get_blocks(keys, staging)
        self._primary[rows[got]] = staging[got]
        success = bool(got.all())
        return JobResult(job_id=job.job_id, success=success,
                         successful_keys=None if success else [k for k, g in zip(keys_in, got) if g],
                         transfer_bytes=int(got.sum()) * self.block_size_bytes)
