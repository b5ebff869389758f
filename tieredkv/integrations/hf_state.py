"""CachedPrefill for hybrid models: attention K/V per chunk plus the recurrent state at chunk boundaries.

A hybrid model (Qwen3-Next, Qwen3.5, Granite 4 / GraniteMoeHybrid, Nemotron-H, Bamba, Falcon-H1, LFM2,
OLMo-Hybrid, Zamba2) interleaves attention layers with linear-attention or mamba layers. transformers
5.x keeps both in one ``DynamicCache``: attention layers hold per-token K/V, the others
(``LinearAttentionLayer``) hold per request a conv state (the last ``kernel`` inputs of the causal
convolution) and a recurrent state (the SSM / delta-rule matrix), both overwritten as tokens go by.
A prefix ``[0, P)`` is therefore the attention layers' K/V of ``[0, P)`` plus every state layer's
conv and recurrent state at exactly ``P``.

What is stored:

- the attention layers' K/V in the usual chunk blocks, ``(attention layers, 2, kv_heads, C, head_dim)``
  (the spec counts the attention layers only);
- at some chunk boundaries ``P`` the state: every state tensor of every state layer in model order
  (conv then recurrent, per state slot), its own bytes in its own dtype, cut into ``pieces`` blocks
  of the same cache (key scheme ``tieredkv.keys.state_keys``: piece ``j`` of the state at the end of
  chunk ``k`` is keyed ``xxh3_128(key_k || STATE_TAG || j)``, the scheme the vLLM connector uses);
- ``KVSpec.extra`` = ``state=<pattern>:hf:<tensors>``: one letter per model layer (``a`` attention,
  ``m`` state, ``h`` both, ``-`` neither) and each state tensor's shape and dtype, so a model whose
  state differs in any byte layout (kernel, heads, state dims, dtype) never reads these blocks; the
  ``hf`` marks transformers' layout (vLLM keeps the conv state in another order and other dtypes).

A hit is the longest chunk boundary ``P`` such that every attention chunk of ``[0, P)`` and every
piece of the state at ``P`` are in the tiers; a prefix whose state at its end is missing is a hit
only up to the last boundary before it that has one.

Which boundaries get a state (``state_boundaries``): a state costs one forward piece ending there
(the prefill of the uncached tail is split at every boundary that is stored) and its bytes, which for
real models are many chunks' worth of K/V (Qwen3-Next-80B in bfloat16: 36 gated-delta-net layers x
(32 heads x 128 x 128 float32 recurrent + 8192 x 4 bfloat16 conv) is 74 MiB per boundary, against
1.5 MiB for a 64-token chunk of its 12 attention layers' K/V). ``"ends"`` (default) stores it where a later prompt
is likely to branch: the prompt's last boundary before its last token (a repeat of the prompt hits
there), its last full boundary (a longer prompt that extends this one, as the next turn of a chat,
hits there), and the end of the attention chunks already cached (where an earlier prompt and this one
part: the next prompt of that family hits there), so at most three pieces per prefill. ``"every"``
stores every boundary of the computed tail: any later prompt sharing a prefix hits at its last
shared boundary, at the price of one state per chunk and a forward piece per chunk.

Which models: those whose transformers implementation continues a state across a multi-token forward
(a prefill in pieces computes what one forward computes, up to float rounding) and keeps every
state in ``DynamicCache`` layers (``VERIFIED``, each tested). Refused, with the reason: Jamba and
Zamba (their mamba-1 layers restart the SSM state from zero on every multi-token forward in
transformers 5.19: a state cannot be continued), MiniMax (its own ``MiniMaxCache``), Kimi Linear (MLA
attention layers), models without attention layers (pure mamba), hybrids with sliding-window
attention layers, and any other model type with state layers (not verified).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import numpy as np
import torch

from tieredkv.errors import InvalidInput, SpecMismatch
from tieredkv.keys import chunk_keys, piece_count, state_keys
from tieredkv.spec import KVSpec, normalize_dtype

#: Model types (of the text config) whose state layers CachedPrefill caches: each continues its state
#: across multi-token forwards in transformers 5.19 (tests/test_hf_hybrid.py checks every one).
VERIFIED = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid", "nemotron_h", "bamba",
            "falcon_h1", "lfm2", "lfm2_moe", "olmo_hybrid", "zamba2")

#: Model types with state layers that are refused, and why.
REFUSED = {
    "jamba": "Jamba's mamba layers restart their SSM state from zero on every multi-token forward in "
             "transformers (mamba_selective_scan takes no initial state), so a stored state cannot be continued",
    "zamba": "Zamba's mamba layers restart their SSM state from zero on every multi-token forward in "
             "transformers, so a stored state cannot be continued",
    "minimax": "MiniMax keeps its lightning-attention state in its own MiniMaxCache, not in DynamicCache layers",
    "kimi_linear": "Kimi Linear's attention layers are MLA (transformers caches decompressed K and V)",
    "mamba": "a model without attention layers (pure mamba): tieredkv keys and stores attention KV chunks",
    "mamba2": "a model without attention layers (pure mamba): tieredkv keys and stores attention KV chunks",
    "falcon_mamba": "a model without attention layers (pure mamba): tieredkv keys and stores attention KV chunks",
}

STATE_BOUNDARIES = ("ends", "every")


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One state tensor of one cache layer: ``kind`` ``"conv"`` or ``"recurrent"``, state ``slot``."""

    layer: int
    slot: int
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{self.kind[0]}{self.slot}={'x'.join(map(str, self.shape[1:]))}{normalize_dtype(self.dtype)}"


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Where a hybrid model keeps what: its attention layers' K/V geometry and its state tensors.

    ``attention``: the cache layers with K/V, model order (the spec's layer axis). ``previous``: per
    (layer, slot) with a conv state, the layer's ``has_previous_state`` flag after a forward (what
    tells the model's next forward to continue the state).
    """

    model_type: str
    pattern: str
    attention: tuple[int, ...]
    kv_heads: int
    head_dim: int
    tensors: tuple[StateTensor, ...]
    previous: tuple[tuple[int, int], ...]

    @property
    def state_bytes(self) -> int:
        """The state at one boundary, every state tensor."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def descriptor(self) -> str:
        """``state=<pattern>:hf:<tensors>``: what changes a boundary state's bytes (``KVSpec.extra``)."""
        per_layer: dict[int, list[str]] = {}
        for t in self.tensors:
            per_layer.setdefault(t.layer, []).append(t.describe())
        sigs = ["+".join(v) for v in per_layer.values()]
        body = sigs[0] if len(set(sigs)) == 1 else ",".join(sigs)
        return f"state={self.pattern}:hf:{body}"

    def spec(self, dtype: Any, *, chunk_tokens: int, model_id: str) -> KVSpec:
        return KVSpec(model_id=model_id, num_layers=len(self.attention), num_kv_heads=self.kv_heads,
                      head_dim=self.head_dim, dtype=dtype, chunk_tokens=chunk_tokens, extra=self.descriptor)


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _new_cache(model: Any) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config)


def has_state_layers(model: Any) -> bool:
    """Whether ``model``'s transformers cache has linear-attention / mamba layers (no forward run)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # pragma: no cover - transformers before the unified hybrid cache
        return False
    try:
        layers = _new_cache(model).layers
    except (TypeError, KeyError, ValueError, AttributeError):
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


def hybrid_layout(model: Any) -> HybridLayout:
    """The state layout of a hybrid ``model``, probed once with a two-token forward and kept per model.

    Raises:
        InvalidInput: the model is refused (``REFUSED``, not ``VERIFIED``, sliding-window attention
            layers, attention layers of unequal geometry, a batch dimension other than 1).
    """
    known = _LAYOUTS.get(model)
    if known is not None:
        return known
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    text = _text_config(model)
    model_type = str(getattr(text, "model_type", "") or getattr(model.config, "model_type", ""))
    kinds = sorted({str(t) for t in (getattr(text, "layer_types", None) or [])
                    if t not in ("full_attention", "sliding_attention")})
    if model_type in REFUSED:
        raise InvalidInput(f"CachedPrefill does not cache {model_type}: {REFUSED[model_type]}")
    if model_type not in VERIFIED:
        raise InvalidInput(f"model type {model_type!r} has linear-attention or mamba layers (layer types "
                           f"{kinds}) that CachedPrefill has not verified to continue a state across prefill "
                           f"pieces (a linear-attention or mamba layer's state is not per-token K/V); "
                           f"verified: {', '.join(VERIFIED)}")
    cache = _new_cache(model)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise InvalidInput(f"{model_type}: a hybrid model with sliding-window attention layers (transformers "
                           "keeps only the window there, so a prefix's K/V cannot be read back)")
    device = next(iter(model.parameters())).device
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
              position_ids=torch.arange(2, device=device).unsqueeze(0), use_cache=True,
              **{_cache_keyword(model): cache})
    attention, tensors, previous, pattern, geometry = [], [], [], [], set()
    for i, layer in enumerate(cache.layers):
        has_kv = isinstance(layer, CacheLayerMixin) and getattr(layer, "is_initialized", False)
        has_state = False
        if has_kv:
            attention.append(i)
            geometry.add((int(layer.keys.shape[1]), int(layer.keys.shape[-1]), int(layer.keys.shape[0])))
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for slot in range(layer.number_of_states):
                for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                    t = states.get(slot)
                    if t is not None:
                        tensors.append(StateTensor(i, slot, kind, tuple(t.shape), t.dtype))
                        has_state = True
                if layer.conv_states.get(slot) is not None and layer.has_previous_state.get(slot):
                    previous.append((i, slot))
        pattern.append("h" if has_kv and has_state else "a" if has_kv else "m" if has_state else "-")
    if not attention:
        raise InvalidInput(f"{model_type}: " + REFUSED["mamba"])
    if len(geometry) != 1 or next(iter(geometry))[2] != 1:
        raise InvalidInput(f"{model_type}: attention layers of unequal (kv_heads, head_dim): {sorted(geometry)}")
    if any(t.shape[0] != 1 for t in tensors):
        raise InvalidInput(f"{model_type}: state tensors without a batch dimension of 1")
    heads, head_dim, _ = next(iter(geometry))
    layout = HybridLayout(model_type=model_type, pattern="".join(pattern), attention=tuple(attention),
                          kv_heads=heads, head_dim=head_dim, tensors=tuple(tensors), previous=tuple(previous))
    _LAYOUTS[model] = layout
    return layout


def _cache_keyword(model: Any) -> str:
    import inspect

    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hybrid_spec(model: Any, *, chunk_tokens: int, model_id: str) -> KVSpec:
    """The ``KVSpec`` of a hybrid model: its attention layers' K/V geometry, the state in ``extra``."""
    return hybrid_layout(model).spec(model.dtype, chunk_tokens=chunk_tokens, model_id=model_id)


def _timer() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


class HybridPrefill:
    """The prefill of a hybrid model through a ``TieredCache`` (``CachedPrefill`` delegates here).

    Args:
        model: the hybrid causal LM.
        cache: a ``TieredCache`` (``lookup``, ``load``, ``store``, ``resident_run``, ``get_blocks``,
            ``put_blocks``) or ``None``.
        spec: the spec blocks are keyed with; its ``extra`` must be the model's state descriptor.
        cache_kw: the keyword the model's forward takes its cache by.
        logits_kw: the keyword that limits the logits computed (``logits_to_keep``), if any.
        state_boundaries: ``"ends"`` or ``"every"`` (module doc).

    Each call restores into a new host buffer and a new ``DynamicCache`` (``reuse_host_buffer`` and the
    in-place ``BufferLayer`` of attention-only models do not apply here).

    Raises:
        SpecMismatch: the spec describes another state layout.
        InvalidInput: an unknown ``state_boundaries``.
    """

    def __init__(self, model: Any, cache: Any, spec: KVSpec, *, cache_kw: str, logits_kw: str | None,
                 state_boundaries: str = "ends"):
        if state_boundaries not in STATE_BOUNDARIES:
            raise InvalidInput(f"state_boundaries must be one of {STATE_BOUNDARIES}, got {state_boundaries!r}")
        self.model, self.cache, self.spec = model, cache, spec
        self.layout = hybrid_layout(model)
        if spec.extra != self.layout.descriptor:
            raise SpecMismatch(f"the spec's extra {spec.extra!r} is not this model's state layout "
                               f"{self.layout.descriptor!r}; build the cache with spec_for_model(model)")
        self.cache_kw, self.logits_kw = cache_kw, logits_kw
        self.state_boundaries = state_boundaries
        self.pieces = piece_count(self.layout.state_bytes, spec.block_bytes)
        self.device = next(iter(model.parameters())).device

    # ---- state <-> bytes ----------------------------------------------------------------------
    def snapshot(self, kv_cache: Any, row: np.ndarray) -> None:
        """Copy every state tensor of ``kv_cache`` into ``row`` (``pieces * block_bytes`` uint8)."""
        flat = torch.from_numpy(row.reshape(-1))
        offset = 0
        for t in self.layout.tensors:
            layer = kv_cache.layers[t.layer]
            src = (layer.conv_states if t.kind == "conv" else layer.recurrent_states)[t.slot]
            if src is None or tuple(src.shape) != t.shape or src.dtype != t.dtype:
                raise InvalidInput(f"layer {t.layer} {t.kind} state is {None if src is None else tuple(src.shape)},"
                                   f" expected {t.shape} {t.dtype}")
            flat[offset:offset + t.nbytes].copy_(src.detach().reshape(-1).view(torch.uint8), non_blocking=False)
            offset += t.nbytes

    def restore(self, kv_cache: Any, row: np.ndarray) -> None:
        """Make the state in ``row`` every state layer's state in the fresh ``kv_cache``."""
        flat = torch.from_numpy(row.reshape(-1))
        offset = 0
        for t in self.layout.tensors:
            # A copy of the bytes first: a view as another dtype needs an offset aligned to its size.
            value = flat[offset:offset + t.nbytes].clone().view(t.dtype).reshape(t.shape).to(self.device)
            offset += t.nbytes
            layer = kv_cache.layers[t.layer]
            if t.kind == "conv":
                layer.lazy_initialization(conv_states=value, state_idx=t.slot, conv_kernel_size=t.shape[-1])
                layer.conv_states[t.slot].copy_(value)
            else:
                layer.lazy_initialization(recurrent_states=value, state_idx=t.slot)
                layer.recurrent_states[t.slot].copy_(value)
        for i, slot in self.layout.previous:
            kv_cache.layers[i].has_previous_state[slot] = True

    def _rows(self, n: int) -> np.ndarray:
        return np.zeros((n * self.pieces, self.spec.block_bytes), dtype=np.uint8)

    def _has_state(self, keys: Any, boundary_chunks: int) -> bool:
        pieces = state_keys(keys[boundary_chunks - 1:boundary_chunks], self.pieces)
        return len(self.cache.resident_run(pieces)) == self.pieces

    # ---- restore ------------------------------------------------------------------------------
    def _restore_prefix(self, hit: Any, kv_cache: Any, host: torch.Tensor) -> int:
        """Load the longest prefix of ``hit`` whose state is stored: its attention K/V and its state.
        Returns its length in tokens (0: none). Blocks evicted meanwhile shorten it."""
        C = self.spec.chunk_tokens
        limit = hit.blocks
        while limit > 0:
            k = next((k for k in range(limit, 0, -1) if self._has_state(hit.keys, k)), 0)
            if k == 0:
                return 0
            row = self._rows(1)
            if not self.cache.get_blocks(state_keys(hit.keys[k - 1:k], self.pieces), row).all():
                limit = k - 1  # a piece was evicted since: look further back
                continue
            sub = dataclasses.replace(hit, tokens=k * C, keys=hit.keys[:k], where=hit.where[:k])
            got = int(self.cache.load(sub, host))
            if got < k * C:
                limit = got // C  # K/V evicted since the lookup: a state before the gap, if any
                continue
            for j, i in enumerate(self.layout.attention):
                kv_cache.update(host[j, 0, :, :got].unsqueeze(0).to(self.device),
                                host[j, 1, :, :got].unsqueeze(0).to(self.device), i)
            self.restore(kv_cache, row)
            return got
        return 0

    def _boundaries(self, keys: Any, cached: int, run_end: int, n: int, n_full: int) -> list[int]:
        """The chunk boundaries in ``(cached, n_full]`` whose state this prefill stores (not yet stored)."""
        C = self.spec.chunk_tokens
        if self.state_boundaries == "every":
            wanted = set(range(cached + C, n_full + 1, C))
        else:
            wanted = {run_end, (n - 1) // C * C, n_full}
        return [b for b in sorted(wanted) if cached < b <= n_full and not self._has_state(keys, b // C)]

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, salt: bytes, extra: list | None, *, all_logits: bool,
                store: bool) -> dict[str, Any]:
        """``CachedPrefill.prefill`` for a hybrid model; returns ``PrefillResult``'s fields."""
        n = ids.shape[1]
        C = self.spec.chunk_tokens
        n_full = n // C * C
        t0 = _timer()
        marks = {"lookup": t0, "load": t0, "adopt": t0}
        kv_cache = _new_cache(self.model)
        cached, host, keys, boundaries = 0, None, None, []
        if self.cache is not None and n_full:
            tokens = ids[0].numpy()
            hit = self.cache.lookup(tokens, salt=salt, extra=extra, count=False)
            keys = chunk_keys(self.spec, tokens[:n_full], salt, extra)
            marks["lookup"] = _timer()
            host = torch.empty((len(self.layout.attention), 2, self.layout.kv_heads, n_full, self.layout.head_dim),
                               dtype=self.model.dtype)
            cached = self._restore_prefix(hit, kv_cache, host) if hit.blocks else 0
            marks["load"] = marks["adopt"] = _timer()
            if hasattr(self.cache, "count_served"):
                served: dict[int, int] = {}
                for code in hit.where[:cached // C].tolist():
                    served[int(code)] = served.get(int(code), 0) + C
                self.cache.count_served(n, served, prefill_tokens=n - cached)
            boundaries = self._boundaries(keys, cached, hit.tokens, n, n_full)
        rows = self._rows(len(boundaries))
        logits = []
        start = cached
        with torch.inference_mode():
            for end in [*boundaries, n]:
                if end <= start:
                    continue
                kwargs: dict[str, Any] = {self.cache_kw: kv_cache, "use_cache": True}
                if self.logits_kw and not all_logits:
                    kwargs[self.logits_kw] = 1
                out = self.model(input_ids=ids[:, start:end].to(self.device),
                                 position_ids=torch.arange(start, end, device=self.device).unsqueeze(0), **kwargs)
                logits.append(out.logits if all_logits else out.logits[:, -1:])
                if end in boundaries:
                    k = boundaries.index(end)
                    self.snapshot(kv_cache, rows[k * self.pieces:(k + 1) * self.pieces])
                start = end
        t2 = _timer()
        marks["forward"] = marks["extract"] = t2
        phases: dict[str, float] = {}
        last = t0
        for name, mark in marks.items():
            phases[name], phases[f"{name}_cpu"] = (mark[0] - last[0]) * 1e3, (mark[1] - last[1]) * 1e3
            last = mark

        def extract(into: torch.Tensor) -> None:
            for j, i in enumerate(self.layout.attention):
                layer = kv_cache.layers[i]
                into[j, 0, :, cached:n_full].copy_(layer.keys[0, :, cached:n_full])
                into[j, 1, :, cached:n_full].copy_(layer.values[0, :, cached:n_full])

        # A pending store must not read the cache later (the caller may crop or reset it and run other
        # tokens first): ``host`` is this call's own, so the new chunks are copied into it now.
        extracted = False
        if not store and host is not None and n_full > cached:
            extract(host)
            extracted = True

        def save() -> int:
            """Store the new attention chunks (from ``host``, which holds the restored prefix) and
            the states of ``boundaries``."""
            a = _timer()
            stored = 0
            b = a
            if host is not None and n_full > cached:
                if not extracted:
                    extract(host)
                b = _timer()
                stored = int(self.cache.store(ids[0, :n_full].numpy(), host, salt=salt, extra=extra))
                if boundaries and keys is not None:
                    picked = keys.take(np.array([bd // C - 1 for bd in boundaries]))
                    self.cache.put_blocks(state_keys(picked, self.pieces), rows)
            c = _timer()
            phases.update(extract=(b[0] - a[0]) * 1e3, extract_cpu=(b[1] - a[1]) * 1e3,
                          store=(c[0] - b[0]) * 1e3, store_cpu=(c[1] - b[1]) * 1e3)
            return stored

        fields: dict[str, Any] = dict(
            logits=torch.cat(logits, dim=1) if all_logits else logits[-1], cache=kv_cache, cached_tokens=cached,
            computed_tokens=n - cached, restore_ms=(marks["adopt"][0] - t0[0]) * 1e3,
            compute_ms=(t2[0] - marks["adopt"][0]) * 1e3, phases=phases)
        if not store:
            phases.update(extract=0.0, extract_cpu=0.0, store=0.0, store_cpu=0.0)
            return {**fields, "pending_store": [save]}
        stored = save()
        return {**fields, "stored_blocks": stored, "store_ms": (time.perf_counter() - t2[0]) * 1e3}
