"""A vLLM engine's KV cache groups as one tieredkv block layout, or a refusal that names why.

A tieredkv block holds one chunk of every cached layer, in model order, as
``(layers, 2, kv_heads, chunk_tokens, head_dim)`` (see ``tieredkv.layout``). vLLM describes its cache
as KV cache groups (``KVCacheConfig.kv_cache_groups``): layers that share one block table, with one
``KVCacheSpec`` each. This module decides, once at start-up, how those groups fill a block:

=====================  ===========================================  ====================================
vLLM group spec        what a block holds for its layers            live pages at a hit point P
=====================  ===========================================  ====================================
``FullAttentionSpec``  K and V per KV head (also sliding layers      every block of ``[0, P)``
                       vLLM folded into full attention, HMA off)
``MLAAttentionSpec``   the latent (``kv_lora_rank`` compressed +   every block of ``[0, P)``
                       ``qk_rope_head_dim`` rotated values) per
                       token, once for all TP ranks
``SlidingWindowSpec``  K and V per KV head                          only blocks overlapping the window
                                                                    ``[P - window + 1, P)``; vLLM
                                                                    hands the others as the null block
=====================  ===========================================  ====================================

An MLA latent has no K/V split and no heads: its ``L = kv_lora_rank + rope`` values per token are
stored as one "head" whose first ``L/2`` values sit in the K slot and the last ``L/2`` in the V slot.
The bytes are the page's own, in the page's order; only the namespace says how to read them (a
``CachedPrefill`` worker, which caches decompressed K/V, never shares it).

Everything that changes a block's bytes beyond ``KVSpec``'s own fields goes into ``KVSpec.extra``
(so into the namespace): the attention family and latent dims, the sliding window and which layers
slide, the KV dtype's quantisation and scale scheme and the compute dtype it was quantised from. How
vLLM happens to group layers (HMA on or off) changes no byte and is left out, so engines with and
without the hybrid KV cache manager share blocks.

``MambaSpec`` groups (linear attention, mamba: Qwen3-Next, Nemotron-H, Granite 4) hold no per-token
K/V but one recurrent state per request, which vLLM's prefix caching (``mamba_cache_mode="align"``)
snapshots at block boundaries: the state after tokens ``[0, (i+1)*block_size)`` lives in the group's
block ``i``, and only the boundaries vLLM materialised have a non-null block. They are described by
``StateGroup`` and cached apart from the KV blocks, one state per chunk boundary
(``tieredkv.integrations.vllm_state``); the KV block holds the attention layers only. The namespace
then adds ``state=<pattern>:<state kind>:<shapes and dtypes>:conv=<layout>``.

Anything else (chunked local attention, sparse MLA index caches, per-token or packed quantisation,
cross or encoder-only attention, unequal head geometry across groups, a model without attention
layers, mamba state with speculative decoding) raises ``InvalidInput`` naming the feature, so such a
model is never served through tieredkv.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tieredkv.errors import InvalidInput
from tieredkv.spec import normalize_dtype, sliding_window_extra

#: vLLM ``cache_dtype`` strings of per-tensor fp8 caches -> tieredkv dtype names.
FP8_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}

#: Spec classes whose bytes tieredkv knows how to read (exact types: a subclass may add state).
FAMILY = {FullAttentionSpec: "full", MLAAttentionSpec: "mla", SlidingWindowSpec: "sliding"}


@dataclasses.dataclass(frozen=True)
class Group:
    """One vLLM KV cache group: its index in the block-id tuples, family and layers.

    ``layers`` are indices into ``CacheLayout.layer_names`` (tieredkv's model-order layer axis).
    """

    index: int
    family: str
    layers: tuple[int, ...]
    window: int | None = None


@dataclasses.dataclass(frozen=True)
class StateGroup:
    """One vLLM ``MambaSpec`` group: layers whose cache is a recurrent state per block boundary.

    ``layer_names`` in model order; ``state_bytes``: one layer's state at one boundary (the page's
    content, without vLLM's padding); ``cached``: vLLM snapshots the state at block boundaries
    (``mamba_cache_mode="align"``, without ReplaySSM), so boundary states can be saved and restored.
    """

    index: int
    layer_names: tuple[str, ...]
    state_bytes: int
    cached: bool

    @property
    def boundary_bytes(self) -> int:
        """The group's state at one boundary, all its layers."""
        return self.state_bytes * len(self.layer_names)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """How one engine's paged cache maps onto tieredkv blocks (the same on every TP rank).

    ``replicated``: every TP rank holds the same bytes (MLA), so one namespace serves all ranks and
    only rank 0 writes. ``extra`` is the namespace descriptor (``KVSpec.extra``). ``states``: the
    mamba / linear-attention groups, cached apart from the KV blocks (empty for attention-only models).
    """

    family: str
    groups: tuple[Group, ...]
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    replicated: bool
    extra: str
    states: tuple[StateGroup, ...] = ()

    @property
    def state_bytes(self) -> int:
        """The recurrent state at one boundary, every state group and layer (0: attention only)."""
        return sum(g.boundary_bytes for g in self.states)

    @property
    def uniform_window(self) -> int | None:
        """The window when every attention group slides (a hit then needs only a window of chunks,
        ``tieredkv.integrations.vllm_window``); None when some layer attends to the whole prefix."""
        if self.groups and all(g.window is not None for g in self.groups):
            return self.window
        return None

    @property
    def mixed_window(self) -> int | None:
        """The largest window when some attention groups slide and others attend to the whole prefix
        (Gemma 2/3 under vLLM's hybrid manager: a chunk outside every window at a hit point needs its
        full layers only, ``tieredkv.integrations.vllm_window.mixed_lookup``); None otherwise (vLLM's
        manager off folds sliding layers into one full group, which keeps every block)."""
        windows = [g.window for g in self.groups if g.window is not None]
        if windows and len(windows) < len(self.groups):
            return max(windows)
        return None

    @property
    def window(self) -> int | None:
        """The smallest sliding window of any group that keeps only its window (None: no such group)."""
        windows = [g.window for g in self.groups if g.window is not None]
        return min(windows) if windows else None


def _refuse(feature: str, detail: str = "") -> InvalidInput:
    return InvalidInput(f"TieredKVConnector does not support {feature}{': ' + detail if detail else ''}; "
                        "serve this model without it")


def _kv_dtype(vllm_config: Any, attn: Any) -> tuple[str, str]:
    """The tieredkv dtype of the pages and the quantisation part of the namespace descriptor."""
    mode = getattr(attn, "kv_quant_mode", KVQuantMode.NONE)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if mode == KVQuantMode.NONE:
        try:
            return normalize_dtype(attn.dtype), ""
        except InvalidInput as e:
            raise _refuse(f"the KV cache dtype {attn.dtype}", str(e)) from None
    if mode != KVQuantMode.FP8_PER_TENSOR or cache_dtype not in FP8_DTYPES:
        raise _refuse(f"the quantised KV cache {cache_dtype!r} ({mode.name})",
                      "only per-tensor fp8 (fp8, fp8_e4m3, fp8_e5m2) keeps plain per-token pages")
    skipped = list(getattr(vllm_config.cache_config, "kv_cache_dtype_skip_layers", None) or [])
    if skipped:
        raise _refuse("an fp8 KV cache with unquantised layers (kv_cache_dtype_skip_layers)", str(skipped[:3]))
    # fp8 bytes depend on the values quantised (so on the compute dtype) and on the per-layer scales;
    # those are per-tensor constants read from the checkpoint (1.0 without one), covered by the
    # model's identity: the scheme, not the values, is what the namespace must add.
    compute = normalize_dtype(vllm_config.model_config.dtype)
    return FP8_DTYPES[cache_dtype], f"kv={FP8_DTYPES[cache_dtype]}:per-tensor-static-scales:from={compute}"


def _hf(vllm_config: Any) -> Any:
    model = vllm_config.model_config
    return getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)


def _sliding_descriptor(vllm_config: Any, n_layers: int) -> str:
    """The model's sliding window and which layers slide, as the model config states them."""
    hf = _hf(vllm_config)
    doc = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf)) if hf is not None else {}
    return sliding_window_extra(doc, n_layers)


def _refuse_parallelism(parallel: Any) -> None:
    """Refuse the splits whose pages a chunk of tokens cannot name: pipeline parallelism (each rank holds
    a part of the layers) and context parallelism (each rank's pages hold an interleaved share of every
    block's tokens: a block spans block_size x ranks tokens)."""
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise _refuse("pipeline parallelism", "each rank would hold a part of the layers; use tensor parallelism")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise _refuse(f"context parallelism ({name}={getattr(parallel, name)})",
                          "each rank holds an interleaved share of every block's tokens")


def cache_layout(vllm_config: Any, kv_cache_config: Any) -> CacheLayout:
    """Classify ``kv_cache_config``'s groups into a ``CacheLayout``.

    Raises:
        InvalidInput: naming the unsupported feature (mamba state, a quantisation, ...), or pipeline
            parallelism, or groups whose block size, head geometry or dtype differ.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    _refuse_parallelism(vllm_config.parallel_config)
    every = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not every:
        raise InvalidInput("the engine has no KV cache groups")
    # Group indices are positions in vLLM's per-group block-id tuples: keep them for every group.
    state_groups = [(i, g) for i, g in enumerate(every) if type(g.kv_cache_spec) is MambaSpec]
    indexed = [(i, g) for i, g in enumerate(every) if type(g.kv_cache_spec) is not MambaSpec]
    if not indexed:
        raise _refuse("a model without attention layers (pure mamba / linear attention)",
                      "tieredkv keys and stores attention KV chunks; a recurrent state alone has none")
    groups = [g for _, g in indexed]
    states = tuple(_state_group(vllm_config, i, g) for i, g in state_groups)
    families = []
    for g in groups:
        spec = g.kv_cache_spec
        family = FAMILY.get(type(spec))
        if family is None:
            name = type(spec).__name__
            feature = {"MambaSpec": "mamba / linear-attention state of a MambaSpec subclass",
                       "ChunkedLocalAttentionSpec": "chunked local attention"}.get(name, f"the KV cache type {name}")
            raise _refuse(feature, f"layers {list(g.layer_names)[:3]}")
        if not getattr(g, "enable_kv_transfer", True):
            raise _refuse("a KV cache group vLLM marks as not transferable", f"layers {list(g.layer_names)[:3]}")
        if getattr(spec, "non_causal", False):
            # A token's KV then depends on the tokens after it: a prefix's KV is not the prefix's alone
            # (vLLM turns its own prefix caching off for these models too).
            raise _refuse("non-causal (prefix-LM) attention", f"layers {list(g.layer_names)[:3]}")
        families.append(family)
    if "mla" in families and set(families) != {"mla"}:
        raise _refuse("MLA mixed with other attention types", str(sorted(set(families))))
    first = groups[0].kv_cache_spec
    for g in groups:
        spec = g.kv_cache_spec
        if (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype) != \
                (first.block_size, first.num_kv_heads, first.head_size, first.dtype):
            raise _refuse("KV cache groups with different block sizes, head geometry or dtypes",
                          f"{type(first).__name__}{first.block_size, first.num_kv_heads, first.head_size, first.dtype}"
                          f" vs {type(spec).__name__}{spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype}")
        if spec.num_head_slots is not None or spec.state_content_bytes is not None or spec.tokens_per_state != 1:
            raise _refuse("packed KV pages", "one slot per KV head and one state per token are needed")
        if isinstance(spec, MLAAttentionSpec):
            if spec.model_version is not None or spec.alignment is not None:
                raise _refuse("sparse MLA caches (DeepSeek V3.2/V4 style)", f"model_version={spec.model_version}")
        elif spec.head_size_v != spec.head_size:
            raise _refuse("K and V of different head sizes", f"{spec.head_size} vs {spec.head_size_v}")
        if getattr(spec, "extra_retained_tokens", 0):
            raise _refuse("sliding windows with retained extra tokens (multi-module speculative decoding)")
    names = sorted((n for g in groups for n in g.layer_names), key=extract_layer_index)
    position = {n: i for i, n in enumerate(names)}
    dtype, quant = _kv_dtype(vllm_config, first)
    family = "mla" if "mla" in families else ("sliding" if "sliding" in families else "full")
    # Plain full attention adds nothing: its spec is the one KVSpec.from_hf_config derives (shared
    # with CachedPrefill). A sliding window is a property of the model, not of the group type.
    parts: list[str] = []
    if family == "mla":
        hf = _hf(vllm_config)
        rank, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
        if not rank or not rope or rank + rope != first.head_size or first.head_size % 2:
            raise _refuse("this MLA layout", f"page width {first.head_size} is not kv_lora_rank {rank} + "
                                             f"qk_rope_head_dim {rope} (an even count)")
        parts = [f"attn=mla:latent={rank}+{rope}"]
        heads, head_dim = 1, first.head_size // 2
    else:
        heads, head_dim = int(first.num_kv_heads), int(first.head_size)
    sliding = _sliding_descriptor(vllm_config, len(names))
    if family == "sliding" and not sliding:
        sliding = f"window={groups[families.index('sliding')].kv_cache_spec.sliding_window}:{'s' * len(names)}"
    parts += [p for p in (sliding, quant, _state_descriptor(states, every)) if p]
    out = tuple(Group(index=i, family=f, layers=tuple(sorted(position[n] for n in g.layer_names)),
                      window=int(g.kv_cache_spec.sliding_window) if f == "sliding" else None)
                for (i, g), f in zip(indexed, families))
    if states and any(int(g.kv_cache_spec.block_size) != int(first.block_size) for _, g in state_groups):
        raise _refuse("mamba state blocks of another size than the attention blocks",
                      f"{[int(g.kv_cache_spec.block_size) for _, g in state_groups]} vs {first.block_size}")
    return CacheLayout(family=family, groups=out, layer_names=tuple(names), block_size=int(first.block_size),
                       num_kv_heads=heads, head_dim=head_dim, dtype=dtype, replicated=family == "mla",
                       extra=";".join(parts), states=states)


def _state_group(vllm_config: Any, index: int, group: Any) -> StateGroup:
    """A ``MambaSpec`` group as a ``StateGroup``, or a refusal naming what cannot be cached."""
    from vllm.model_executor.models.utils import extract_layer_index

    spec = group.kv_cache_spec
    layers = list(group.layer_names)
    if spec.num_speculative_blocks:
        raise _refuse("mamba / linear-attention state with speculative decoding",
                      f"{spec.num_speculative_blocks} speculative state blocks per request")
    if spec.tp_replicated:
        raise _refuse("a mamba state replicated on every TP rank", f"layers {layers[:3]}")
    if not getattr(group, "enable_kv_transfer", True):
        raise _refuse("a KV cache group vLLM marks as not transferable", f"layers {layers[:3]}")
    mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", spec.mamba_cache_mode) or "none")
    # ReplaySSM keeps recent inputs instead of storing the state every step and writes a checkpoint
    # back only on a flush: a boundary's block need not hold its state when the connector reads it.
    replay = bool(getattr(vllm_config.cache_config, "use_replayssm", False))
    return StateGroup(index=index, layer_names=tuple(sorted(layers, key=extract_layer_index)),
                      state_bytes=int(spec.state_content_size_bytes), cached=mode == "align" and not replay)


def _state_descriptor(states: tuple[StateGroup, ...], every: list[Any]) -> str:
    """``state=<one letter per model layer, m state, a attention>:<kind>:<shapes>:conv=<layout>``: what
    changes a boundary state's bytes (which layers carry one, the state kernel, each state tensor's
    shape and dtype, vLLM's conv-state layout); empty without state groups."""
    if not states:
        return ""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.model_executor.models.utils import extract_layer_index

    kinds = {n: "m" for g in states for n in g.layer_names}
    every_name = sorted((n for g in every for n in g.layer_names), key=extract_layer_index)
    pattern = "".join(kinds.get(n, "a") for n in every_name)
    specs = sorted({(str(g.kv_cache_spec.mamba_type.name),
                     "+".join(f"{'x'.join(map(str, shape))}{normalize_dtype(dt)}"
                              for shape, dt in zip(g.kv_cache_spec.shapes, g.kv_cache_spec.dtypes)))
                    for g in every if type(g.kv_cache_spec) is MambaSpec})
    return f"state={pattern}:" + ",".join(f"{k}:{shapes}" for k, shapes in specs) + f":conv={get_conv_state_layout()}"
