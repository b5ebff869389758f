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
bytes that were loaded, so even a block evicted meanwhile is re-stored correctly.

Tested with transformers 5.24 (the ``cache=`` keyword) on Llama and Qwen2 architectures; the code also
speaks the ``past_key_values=`` keyword of earlier 5.x releases and the ``key_cache`` lists of 4.x.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import numpy as np
import torch

from tieredkv.errors import InvalidInput, SpecMismatch
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
    """

    logits: torch.Tensor
    cache: Any
    cached_tokens: int
    computed_tokens: int
    stored_blocks: int = 0
    restore_ms: float = 0.0
    compute_ms: float = 0.0
    store_ms: float = 0.0


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``"cache"`` (5.x later) or ``"past_key_values"``.

    Raises:
        InvalidInput: ``forward`` takes neither.
    """
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise InvalidInput(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; "
                       "CachedPrefill needs a causal LM with a KV cache")


def spec_for_model(model: Any, *, chunk_tokens: int = 64, model_id: str | None = None) -> KVSpec:
    """The ``KVSpec`` of ``model``'s KV cache: geometry from its config, dtype from its weights.

    Build the ``TieredCache`` with this spec. ``model_id`` defaults to the config's ``_name_or_path``;
    pass your own for weights that have no name (e.g. random weights: include the seed).
    """
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


class CachedPrefill:
    """Prefill a causal LM through a ``TieredCache``: restore the longest cached prefix, compute the rest.

    Args:
        model: a transformers causal LM (full attention, or sliding windows as in Mistral and Gemma 3), in
            eval mode, on
            CPU or one CUDA device. Its dtype is the KV dtype.
        cache: a ``TieredCache`` (or anything with its ``lookup`` / ``load`` / ``store`` contract) whose
            spec matches the model (build it with ``spec_for_model(model)``), or ``None`` to prefill
            without a cache (a baseline with the same code path).
        spec: the spec to key blocks with; default the cache's ``spec`` attribute, else
            ``spec_for_model(model)``.
        reuse_host_buffer: keep one host buffer (the largest prompt's KV) for all calls (default: yes).
            A restore into memory already touched runs at memcpy speed; into a freshly allocated
            tensor it pays a page fault per 4 KiB first, several times the copy itself. On CUDA the
            buffer is pinned (pinning is expensive). On CPU the restored prefix is adopted by the cache
            layers only until the tail's forward concatenates them into new tensors; a buffer a layer
            still views after the call is handed over to that cache and a new one is made next time.
            ``False``: a new tensor per call (one less prompt-sized allocation kept per worker).

    Raises:
        SpecMismatch: the cache's spec describes another geometry or dtype than the model's KV.
        InvalidInput: the model has linear-attention or mamba layers, is an MLA model (see
            ``KVSpec.from_hf_config``), or has no KV-cache keyword.
    """

    def __init__(self, model: Any, cache: Any = None, *, spec: KVSpec | None = None,
                 reuse_host_buffer: bool | None = None):
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
        unsupported = sorted(layer_types - {"full_attention", "sliding_attention"})
        if unsupported:
            raise InvalidInput(f"layer types {unsupported}: CachedPrefill caches full and sliding-window "
                               "attention only (a linear-attention or mamba layer's state is not per-token K/V)")
        # transformers' sliding-window cache layers keep only the window, so the K/V of a whole prefix
        # could not be read back: a model with a window gets plain layers (its masks still apply the
        # window), holding the prefix's K/V for every layer while the request runs.
        self._sliding = bool(self.spec.extra and "window=" in self.spec.extra) or "sliding_attention" in layer_types
        self._cache_kw = cache_keyword(model)
        forward_params = inspect.signature(model.forward).parameters
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in forward_params),
                               None)
        self._on_cuda = self.device.type == "cuda"
        self.reuse_host_buffer = True if reuse_host_buffer is None else bool(reuse_host_buffer)
        # The reused host buffer (pinned on CUDA, where it only carries new chunks device -> host for
        # ``store``: restores go straight into device memory).
        self._host_buf: torch.Tensor | None = None

    # ---- host buffer --------------------------------------------------------------------------
    def _host_buffer(self, n_tokens: int) -> torch.Tensor:
        """A ``(layers, 2, kv_heads, n_tokens, head_dim)`` host tensor in the model's dtype.

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
    def prefill(self, input_ids: Any, salt: bytes = b"", *, all_logits: bool = False) -> PrefillResult:
        """Prefill one prompt, restoring its longest cached prefix and storing its new full chunks.

        Args:
            input_ids: token ids of one prompt: a list, a 1-D tensor or a ``(1, n)`` tensor.
            salt: tenant bytes; a prefix stored under one salt is never restored under another.
            all_logits: return the logits of every computed position, not only the last.

        Returns:
            A ``PrefillResult``; ``res.cache`` continues decoding at position ``n``.

        Raises:
            InvalidInput: not one sequence of token ids.
        """
        ids = _as_input_ids(input_ids)
        n = ids.shape[1]
        chunk = self.spec.chunk_tokens
        n_full = n // chunk * chunk
        kv_cache = self._new_cache()
        t0 = time.perf_counter()
        cached, host = 0, None
        if self.cache is not None and n_full:
            tokens = ids[0].numpy()
            hit = self.cache.lookup(tokens, salt=salt)
            host = self._host_buffer(n_full)
            if hit.tokens:
                # On CUDA the prefix goes straight into device memory (DMA out of the hot segment);
                # on CPU into the host buffer, whose restored part the layers then adopt.
                dest = torch.empty(self._kv_shape(hit.tokens), dtype=self.dtype, device=self.device) \
                    if self._on_cuda else host
                cached = int(self.cache.load(hit, dest))
                if cached:
                    self._restore(kv_cache, dest, cached)
        t1 = time.perf_counter()
        kwargs: dict[str, Any] = {self._cache_kw: kv_cache, "use_cache": True}
        if self._logits_kw and not all_logits:
            kwargs[self._logits_kw] = 1
        positions = torch.arange(cached, n, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids[:, cached:].to(self.device), position_ids=positions, **kwargs)
        logits = out.logits if all_logits else out.logits[:, -1:]
        t2 = time.perf_counter()
        stored = 0
        if host is not None and n_full > cached:
            self._extract(kv_cache, host, cached, n_full)
            # On CUDA the host buffer's prefix part was never filled: store from the restored end on.
            stored = int(self.cache.store(ids[0, :n_full].numpy(), host, salt=salt,
                                          from_token=cached if self._on_cuda else 0))
        if host is not None and self.reuse_host_buffer and not self._on_cuda:
            self._release_if_viewed(kv_cache)
        t3 = time.perf_counter()
        return PrefillResult(logits=logits, cache=kv_cache, cached_tokens=cached,
                             computed_tokens=n - cached, stored_blocks=stored,
                             restore_ms=(t1 - t0) * 1e3, compute_ms=(t2 - t1) * 1e3,
                             store_ms=(t3 - t2) * 1e3)

    def decode(self, result: PrefillResult, max_new_tokens: int, *,
               eos_token_id: int | list[int] | None = None) -> list[int]:
        """Greedy decoding that continues a ``prefill`` result (its cache grows in place).

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
