"""SGLang integration: tieredkv's tiers as the L3 storage backend of SGLang's HiCache.

HiCache keeps a private host (L2) pool per SGLang instance; its L3 backends are pluggable. This one
makes the host's shared-memory tier the L3 every instance of the host shares (one copy), the warm
tier the copy that survives restarts, and the remote tier (if configured) the fleet's. Loaded by
SGLang's own factory, nothing patched::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tieredkv",
            "module_path": "tieredkv.integrations.sglang", "class_name": "TieredKVStorage",
            "interface_v1": 1, "hot_bytes": "8G", "warm_dir": "/var/cache/tieredkv", "warm_bytes": "200G"}'

Keys: SGLang names each page with a chained SHA-256 hex string (``get_storage_hash_str``) whose
chain is seeded with the request's ``extra_key`` (SGLang appends the LoRA id to it) and
``cache_salt``; multimodal inputs are in the chain as the pad values SGLang derives from each item's
hash. Each string becomes a tieredkv key under a namespace of the model, the host layout, the page
geometry, the KV dtype, the TP shard (one for MLA, whose KV every rank holds) and the PP stage, so
nothing is ever served across those identities (docs/sglang.md).

The model is SGLang's ``--model-path`` (read from SGLang's runtime context; the storage config carries
only the served name, an alias), named by ``canonical_model_id``: a local directory by its
``config.json`` and weight files, so new weights at the same path, or two models under one alias, never
share pages; a hub name by the name (and ``--revision``). The extra-config key ``model_id`` overrides it.

Zero-copy (``interface_v1``): ``batch_get_v1`` copies hot blocks straight from shared memory into
the registered host pool's pages (one copy, no staging); warm blocks through one staging buffer.
``batch_set_v1`` gathers the pages into one buffer and stores it (hot; warm per the demotion rule).
A block is the page's bytes in the order of SGLang's own flat data page (``get_data_page``), so the
generic ``get``/``set`` path and the v1 path read and write the same blocks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from tieredkv import blocks
from tieredkv.cache import TieredCache
from tieredkv.errors import InvalidInput, TieredKVError
from tieredkv.integrations.extra import cache_kwargs
from tieredkv.keys import ChunkKeys, opaque_keys
from tieredkv.model_identity import canonical_model_id
from tieredkv.spec import KVSpec, join_extra, weights_extra
from tieredkv.tier import PutResult

logger = logging.getLogger(__name__)

#: extra-config keys SGLang's factory and controllers read; every other key is a ``TieredCache`` argument.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "enable_metadata_cache",
               "metadata_ttl", "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
#: this backend's own extra-config keys: ``model_id`` names the model instead of SGLang's model path.
OWN_KEYS = ("model_id",)
#: host-pool layouts this backend reads, per attention kind.
LAYOUTS = {"mha": ("layer_first", "page_first", "page_first_direct", "page_head"),
           "mla": ("layer_first", "page_first", "page_first_direct", "page_first_kv_split")}


def _launched(field: str) -> Any:
    """A field of SGLang's published ``model`` config (``model_path``, ``revision``, ``quantization``,
    ``json_model_override_args``, ...): the process that builds the storage backend has one; None where
    SGLang has published none (or is older, or lacks the field)."""
    try:
        from sglang.srt.runtime_context import get_model

        return getattr(get_model(), field, None)
    except (ImportError, ValueError, AttributeError):
        return None


def _model_id(storage_config: HiCacheStorageConfig, override: Any = None) -> str:
    """The namespace's model identity: ``override`` (extra config ``model_id``) when given; else
    ``canonical_model_id`` of the model path SGLang was launched with (a local directory: its files;
    a hub name: the name, ``@revision`` when one is pinned); else of ``storage_config.model_name`` (the
    served name, which defaults to the model path) when SGLang publishes no path.

    Raises:
        OSError: a local model directory cannot be read.
    """
    if override:
        return str(override)
    path = _launched("model_path")
    if not path:
        return canonical_model_id(str(storage_config.model_name or "sglang-model"))
    return canonical_model_id(str(path), _launched("revision"))


def _launched_weights() -> str:
    """``weights_extra`` of the model SGLang was launched with: ``--quantization`` (weights quantised at
    load time) and ``--json-model-override-args`` (config fields such as a RoPE scaling); ``""`` for
    neither, or when SGLang has published nothing."""
    quantization, overrides = _launched("quantization"), _launched("json_model_override_args")
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides) if overrides.strip() else None
        except ValueError:
            overrides = {"json_model_override_args": overrides}  # named as given: still its own namespace
    return weights_extra(quantization, overrides)


def page_components(pool: Any, mla: bool) -> list[torch.Tensor]:
    """The host pool's buffers as views indexed by page first: ``[pages, ...]`` each.

    A page's block is the concatenation of its row in each view, in order: for MHA ``[K | V]``, each
    in the layout's own axis order (the bytes of SGLang's flat ``get_data_page``); for MLA's
    ``page_first_kv_split`` ``[latent | rope]``.

    Raises:
        InvalidInput: a layout this backend does not read, or a pool whose buffers do not match it.
    """
    layout = getattr(pool, "layout", None)
    kind = "mla" if mla else "mha"
    if layout not in LAYOUTS[kind]:
        raise InvalidInput(f"tieredkv's SGLang backend does not read the {kind.upper()} host layout {layout!r}; "
                           f"supported: {list(LAYOUTS[kind])} (--hicache-mem-layout)")
    kv = getattr(pool, "k_buffer" if mla and layout == "page_first_kv_split" else "kv_buffer", None)
    if not isinstance(kv, torch.Tensor):
        raise InvalidInput(f"host pool {type(pool).__name__} holds no KV buffer of its own (a logical or anchor "
                           "pool): tieredkv's SGLang backend stores pools whose pages are their kv_buffer")
    # A page's bytes must be all in the buffers read here: a pool that keeps part of a page elsewhere
    # (MXFP8's per-page scales in k_scale_host / v_scale_host) would be served another writer's
    # payload with its own scales. SGLang's own page methods refuse such pools for storage too.
    elsewhere = sorted(name for name, value in vars(pool).items()
                       if isinstance(value, torch.Tensor) and "scale" in name)
    if elsewhere:
        raise InvalidInput(f"host pool {type(pool).__name__} keeps part of each page outside its KV buffer "
                           f"({', '.join(elsewhere)}): tieredkv's SGLang backend cannot store its pages")
    P = int(pool.page_size)
    if mla and layout == "page_first_kv_split":
        comps = [pool.k_buffer, pool.v_buffer]                      # [pages, L, P, 1, width] each
    else:
        comps = [pool.kv_buffer] if mla else [pool.kv_buffer[0], pool.kv_buffer[1]]
        if layout == "layer_first":                                  # [L, tokens, ...] -> [pages, L, P, ...]
            comps = [c.unflatten(1, (-1, P)).transpose(0, 1) for c in comps]
        elif layout == "page_first":                                 # [tokens, L, ...] -> [pages, P, L, ...]
            comps = [c.unflatten(0, (-1, P)) for c in comps]
        # page_first_direct [pages, L, P, ...] and page_head [pages, H, P, L, D] are indexed by page already
    for c in comps:
        if c.device.type != "cpu" or c.stride(-1) != 1:
            raise InvalidInput(f"host pool buffer {tuple(c.shape)} on {c.device}: expected a CPU tensor whose last "
                               "axis is contiguous")
    return comps


@dataclasses.dataclass
class StorageStats:
    """What ``get_stats`` returns: SGLang's ``StorageMetrics`` fields (pages and bandwidths since the last
    call), plus tieredkv's own counts.

    Attributes:
        hits_by_tier: pages served since start, by tier (``hot``, ``warm``), and ``miss``: pages asked
            for and not found.
        cache: ``TieredCache.stats()`` (per-host counters and each tier's stats).
    """

    prefetch_pgs: list[int] = dataclasses.field(default_factory=list)
    backup_pgs: list[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: list[float] = dataclasses.field(default_factory=list)
    backup_bandwidth: list[float] = dataclasses.field(default_factory=list)
    hits_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)


class TieredKVStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a ``TieredCache`` (see the module docstring).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` carries the
            ``TieredCache`` arguments (``hot_bytes``, ``warm_dir``, ``warm_bytes``, ``hot_name``, ...)
            besides the factory's own keys.
        kwargs: what SGLang's factory passes on (unused).

    Raises:
        InvalidInput: an unknown extra-config key, or a parallel setting this backend cannot key
            (decode context parallelism, heads split across heterogeneous TP sizes).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        extra = {k: v for k, v in (storage_config.extra_config or {}).items() if k not in SGLANG_KEYS}
        self._cache_kwargs = cache_kwargs(extra, own_keys=OWN_KEYS, what="hicache storage extra config")
        self._model_id_override = extra.get("model_id")
        if storage_config.dcp_size > 1:
            raise InvalidInput("tieredkv's SGLang backend does not support decode context parallelism (dcp_size > 1)")
        if getattr(storage_config, "attn_cp_size", 1) > 1:
            # Context-parallel ranks hold slices of a page; SGLang's own key scheme refuses them too.
            raise InvalidInput("tieredkv's SGLang backend does not support attention context parallelism "
                               "(attn_cp_size > 1)")
        if storage_config.should_split_heads:
            raise InvalidInput("tieredkv's SGLang backend does not split heads across TP sizes (tp_lcm_size)")
        self.mla = bool(storage_config.is_mla_model)
        self.cache: TieredCache | None = None
        self.spec: KVSpec | None = None
        self._comps: list[np.ndarray] = []
        self._widths: list[int] = []
        self._page_size = 1
        self._lock = threading.Lock()
        self._hits = {"hot": 0, "warm": 0, "miss": 0}  # pages served by level name, and pages missed
        self._since = {"prefetch_pgs": 0, "backup_pgs": 0}

    # ---- start-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Read the host pool's layout and geometry and open the tiers under their namespace.

        Raises:
            InvalidInput: an unsupported layout (see ``LAYOUTS``), or buffers that do not match it.
        """
        super().register_mem_pool_host(mem_pool_host)
        comps = page_components(mem_pool_host, self.mla)
        self._page_size = int(mem_pool_host.page_size)
        self._comps = [c.view(torch.uint8).numpy() for c in comps]   # byte views of the same memory
        self._widths = [int(np.prod(c.shape[1:])) for c in self._comps]
        block_bytes = sum(self._widths)
        if block_bytes % 2:
            raise InvalidInput(f"a host page of {block_bytes} bytes: tieredkv needs an even page size")
        cfg = self.storage_config
        geometry = "x".join(str(d) for c in comps for d in c.shape[1:])
        # MLA: every TP rank holds the same latent KV, so all ranks share one namespace (one writer).
        tp_rank, tp_size = (0, 1) if self.mla else (cfg.tp_rank, cfg.tp_size)
        # SGLang tags model_name with a pool's own page format; the model path does not carry it.
        tag = getattr(mem_pool_host, "storage_format_tag", None)
        self.spec = KVSpec(model_id=_model_id(cfg, self._model_id_override), num_layers=1, num_kv_heads=1,
                           head_dim=block_bytes // 2, dtype="int8", chunk_tokens=1, tp_rank=tp_rank, tp_size=tp_size,
                           extra=join_extra(f"sglang;layout={mem_pool_host.layout};mla={int(self.mla)};"
                                            f"page={self._page_size};dtype={mem_pool_host.dtype};geometry={geometry};"
                                            f"pp={cfg.pp_rank}of{cfg.pp_size}",
                                            f"format={tag}" if tag else "", _launched_weights()))
        if self.cache is not None:
            self.cache.close()
        self.cache = TieredCache(self.spec, **self._cache_kwargs)

    def on_host_pools_registered(self) -> None:
        """Refuse side pools (hybrid models' Mamba/SWA/indexer state): only the KV pool is stored.

        Raises:
            InvalidInput: a side pool was registered.
        """
        others = sorted(str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv")
        if others:
            raise InvalidInput(f"tieredkv's SGLang backend stores the KV pool only; side pools {others} "
                               "(hybrid models) are not supported")

    # ---- keys and pages --------------------------------------------------------------------------
    def _tiers(self) -> TieredCache:
        if self.cache is None:
            raise InvalidInput("no host pool registered (SGLang calls register_mem_pool_host first)")
        return self.cache

    def _keys(self, keys: list[str]) -> ChunkKeys:
        if self.spec is None:
            raise InvalidInput("no host pool registered (SGLang calls register_mem_pool_host first)")
        return opaque_keys(self.spec, [k.encode() for k in keys])

    def _pages(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        """Page numbers of the ``n`` pages starting at ``host_indices[::page_size]`` (token indices)."""
        idx = np.asarray(host_indices.cpu() if isinstance(host_indices, torch.Tensor) else host_indices,
                         dtype=np.int64)
        P = self._page_size
        if len(idx) < n * P:
            raise InvalidInput(f"{len(idx)} host indices for {n} pages of {P} tokens")
        starts = idx[: n * P: P]
        if (starts % P).any():
            raise InvalidInput("host indices do not start pages (not multiples of the page size)")
        pages = starts // P
        if len(pages) and (pages.min() < 0 or pages.max() >= len(self._comps[0])):
            raise InvalidInput(f"host indices past the host pool ({len(self._comps[0])} pages of {P} tokens)")
        return pages

    def _scatter(self, pages: np.ndarray, rows: np.ndarray) -> None:
        """Copy blocks ``rows`` (``(k, block_bytes)``) into host pages ``pages``: one copy per buffer."""
        at = 0
        for comp, width in zip(self._comps, self._widths):
            comp[pages] = rows[:, at:at + width].reshape(len(pages), *comp.shape[1:])
            at += width

    def _gather(self, pages: np.ndarray) -> np.ndarray:
        """The blocks of host pages ``pages`` as ``(n, block_bytes)`` rows (one buffer, owned by the caller)."""
        n = len(pages)
        out = np.empty((n, sum(self._widths)), dtype=np.uint8)
        at = 0
        for comp, width in zip(self._comps, self._widths):
            # _pages checked the range; "clip" only spares numpy a buffered copy ("raise" buffers ``out``).
            np.take(comp, pages, axis=0, out=out[:, at:at + width].reshape(n, *comp.shape[1:]), mode="clip")
            at += width
        return out

    def _read(self, keys: list[str], sink) -> int:
        try:
            by_level = blocks.read(self._tiers(), self._keys(keys), sink)
        except (TieredKVError, OSError) as e:
            logger.warning("tieredkv: read failed (a miss): %s", e)
            by_level = {}
        run = sum(by_level.values())
        with self._lock:
            for name, n in by_level.items():
                self._hits[name] = self._hits.get(name, 0) + n
            self._hits["miss"] += len(keys) - run
            self._since["prefetch_pgs"] += run
        return run

    def _write(self, keys: list[str], rows: np.ndarray) -> list[bool]:
        if not self.storage_config.is_storage_writer:
            return [True] * len(keys)  # MLA: one writer per shard; the others' pages are the same bytes
        cache = self._tiers()
        try:
            codes = cache.put_blocks(self._keys(keys), rows, owned=True)
        except (TieredKVError, OSError) as e:
            logger.warning("tieredkv: write failed (not cached): %s", e)
            return [False] * len(keys)
        # A page the top level had no room for went to the level below it, if there is one.
        ok = (codes != PutResult.NO_SPACE) | (len(cache.levels) > 1)
        with self._lock:
            self._since["backup_pgs"] += int(ok.sum())
        return ok.tolist()

    # ---- the zero-copy interface (interface_v1) ---------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages the tiers hold (hot or warm)."""
        if not keys:
            return 0
        try:
            return len(self._tiers().resident_run(self._keys(keys)))
        except (TieredKVError, OSError) as e:
            logger.warning("tieredkv: lookup failed (a miss): %s", e)
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Copy the leading run of pages the tiers hold into the host pool at ``host_indices``."""
        pages = self._pages(host_indices, len(keys))
        run = self._read(keys, lambda i, rows: self._scatter(pages[i:i + len(rows)], rows))
        return [True] * run + [False] * (len(keys) - run)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``."""
        if not keys:
            return []
        return self._write(keys, self._gather(self._pages(host_indices, len(keys))))

    # ---- the generic interface (flat data pages) ---------------------------------------------------
    def _flat(self, target: Any) -> torch.Tensor:
        if target is None:
            target = torch.empty(sum(self._widths), dtype=torch.uint8)
        if not isinstance(target, torch.Tensor) or target.device.type != "cpu" or not target.is_contiguous() \
                or target.numel() * target.element_size() != sum(self._widths):
            raise InvalidInput(f"target must be a contiguous CPU tensor of {sum(self._widths)} bytes (a flat page)")
        return target

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page ``key`` into ``target_location`` (a flat page tensor), or None when absent."""
        got = self.batch_get([key], [target_location])
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Each page into its flat target (None where the leading run of held pages ends)."""
        targets = [self._flat(t) for t in (target_locations or [None] * len(keys))]

        def sink(i: int, rows: np.ndarray) -> None:
            for j, row in enumerate(rows):
                targets[i + j].view(torch.uint8).numpy()[:] = row.reshape(-1)

        run = self._read(keys, sink)
        return [t if i < run else None for i, t in enumerate(targets)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages; True when every one is held afterwards."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise InvalidInput(f"batch_set: {len(keys)} keys and {0 if values is None else len(values)} values")
        rows = np.empty((len(keys), sum(self._widths)), dtype=np.uint8)
        for i, value in enumerate(values):
            rows[i] = self._flat(value.contiguous()).view(torch.uint8).numpy()
        return all(self._write(keys, rows))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- the rest --------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Not done: the tiers are shared by every instance of the host (and survive restarts). Remove
        a namespace with the ``tieredkv`` command instead. Returns False."""
        logger.warning("tieredkv: clear() leaves the shared tiers alone (other instances use them); "
                       "remove a segment with `tieredkv rm`")
        return False

    def get_stats(self) -> StorageStats:
        """Pages read and written since the last call (SGLang's metrics), hits by tier since start, and
        the cache's per-host counters."""
        with self._lock:
            since, self._since = self._since, {"prefetch_pgs": 0, "backup_pgs": 0}
            hits = dict(self._hits)
        cache = self.cache.stats() if self.cache is not None else {}
        return StorageStats(prefetch_pgs=[since["prefetch_pgs"]] if since["prefetch_pgs"] else [],
                            backup_pgs=[since["backup_pgs"]] if since["backup_pgs"] else [],
                            hits_by_tier=hits, cache=cache)

    def close(self) -> None:
        """Close this instance's handle on the tiers (idempotent); the shared state stays."""
        if self.cache is not None:
            self.cache.close()
            self.cache = None
