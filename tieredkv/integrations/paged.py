"""vLLM's paged KV cache seen from tieredkv, in torch and numpy only (no vLLM import).

vLLM hands each attention layer a logical ``[B, H, N, C]`` view of its pages (blocks, KV heads, tokens
per block, content), whose physical axis order is a ``KVCacheLayout`` member resolved by the engine;
``C`` holds K and V of ``head_size`` elements each. How ``C`` splits into K and V is the attention
backend's own convention (read from each backend's forward in vLLM 0.32):

- ``CPU_ATTN`` views a (block, head) page as ``[2 * N, head_size]`` and halves it: the page is
  ``[K: N x D][V: N x D]``;
- ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER`` split the last axis: per token ``[K: D | V: D]``.

Reading one convention as the other swaps values between K and V and between tokens without any error,
so the connector refuses a backend not in ``KV_SPLIT``. Every layer is normalised to a
``[B, 2, H, N, D]`` strided view, and a restore is one fancy-index copy per layer for all of a
request's blocks::

    tieredkv host (L, 2, H, k*N, D)[l] --view--> (2, H, k, N, D) --permute--> (k, 2, H, N, D)
                                                                 --index copy--> paged[l][block_ids]

A CPU restore may also come straight from the hot tier's memory (``Chunks``: a run of tieredkv blocks,
each ``(L, 2, H, C, D)``, pinned while the copy runs), with no host buffer in between::

    blocks (k, L, 2, H, C, D)[:, l] --view--> (k, 2, H, C/N, N, D)[:, :, :, r] --index copy-->
                                              paged[l][the block_ids at offset r*N of their chunk]

one index copy per layer and offset (``C / N`` of them: 2 for chunks of 64 tokens in blocks of 32).

This module is separate from ``tieredkv.integrations.vllm`` so that the copies can be checked on a
CUDA machine without vLLM installed (tests/test_paged_kv.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from tieredkv.errors import InvalidInput

#: How each attention backend splits a page's content axis into K and V (see the module docstring).
KV_SPLIT = {"CPU_ATTN": "halves", "FLASH_ATTN": "last_axis", "TRITON_ATTN": "last_axis",
            "FLASHINFER": "last_axis"}

#: MLA backends that keep the latent as vLLM's ``[kv_c | k_pe]`` per token, token-major in each page
#: (``concat_and_cache_mla`` or, for ``AMX_MLA``, its own kernel on a ``[slots, 1, L]`` view).
MLA_BACKENDS = ("CPU_MLA", "AMX_MLA", "TRITON_MLA")

#: Legacy per-layer caches ``[2, num_blocks, ...]`` (K/V outermost): the axis order of the rest,
#: by the layout name vLLM maps the legacy ``NHD`` / ``HND`` names to.
_LEGACY_ORDER = {"LBNHC": "BNHD", "LBHNC": "BHND"}


def paged_view(cache: torch.Tensor, layout: Any, split: str, *, num_kv_heads: int, block_size: int,
               head_size: int) -> torch.Tensor:
    """A ``[num_blocks, 2, kv_heads, block_size, head_size]`` view of one layer's paged cache.

    Args:
        cache: the layer's tensor from ``register_kv_caches``: vLLM's logical ``[B, H, N, 2*D]`` view,
            or a legacy ``[2, B, N, H, D]`` / ``[2, B, H, N, D]`` tensor (K/V outermost).
        layout: the engine's resolved ``vllm.v1.kv_cache_layout.KVCacheLayout`` (its ``name`` and
            ``layer_view_order`` are read); the tensor's strides must agree with it.
        split: ``KV_SPLIT[backend]``: ``"halves"`` or ``"last_axis"``.

    Raises:
        InvalidInput: a shape, stride order or layout this function does not know how to read.
    """
    H, N, D = num_kv_heads, block_size, head_size
    shape, stride = tuple(cache.shape), tuple(cache.stride())
    if cache.dim() == 5 and shape[0] == 2:
        order = _LEGACY_ORDER.get(layout.name)
        if order is None:
            raise InvalidInput(f"a legacy [2, blocks, ...] KV cache with layout {layout.name}: only "
                               f"{sorted(_LEGACY_ORDER)} are understood")
        want = {"B": shape[1], "H": H, "N": N, "D": D}
        if shape[1:] != tuple(want[a] for a in order):
            raise InvalidInput(f"legacy KV cache shape {shape} does not match [2, B, {', '.join(order[1:])}] "
                               f"with H={H}, N={N}, D={D}")
        return cache.permute(1, 0, 1 + order.index("H"), 1 + order.index("N"), 4)
    if cache.dim() != 4 or shape[1:] != (H, N, 2 * D):
        raise InvalidInput(f"paged KV cache shape {shape}: expected [num_blocks, {H}, {N}, {2 * D}] (vLLM's "
                           "logical [B, H, N, C] page view)")
    # The physical order of the logical axes must be the one the layout names (size-1 axes have no
    # order); a mismatch means the tensor is not the view vLLM documents, so nothing is guessed.
    axes = [a for a in range(4) if shape[a] > 1]
    physical = sorted(axes, key=lambda a: -stride[a])
    expected = [a for a in layout.layer_view_order if shape[a] > 1]
    if physical != expected or stride[3] != 1:
        raise InvalidInput(f"paged KV cache strides {stride} do not match layout {layout.name} "
                           f"(physical axis order {expected} of [B, H, N, C], C contiguous)")
    if split == "last_axis":
        return cache.unflatten(3, (2, D)).permute(0, 3, 1, 2, 4)
    if split == "halves":
        if shape[2] > 1 and stride[2] != 2 * D:
            raise InvalidInput(f"layout {layout.name}: a (block, head) page is not contiguous (strides "
                               f"{stride}); the CPU backend's halves split needs it")
        return torch.as_strided(cache, (shape[0], 2, H, N, D), (stride[0], N * D, stride[1], D, 1),
                                cache.storage_offset())
    raise InvalidInput(f"unknown K/V split {split!r}; expected one of {sorted(set(KV_SPLIT.values()))}")


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The source of a ``PagedKV.write`` straight from tieredkv blocks: ``rows`` (``(k, block_bytes)``
    uint8, a run of hot-tier slots, say) hold tokens ``first_token .. first_token + k * chunk_tokens``,
    each row one block ``(layers, 2, kv_heads, chunk_tokens, head_dim)`` (``KVSpec.block_shape``)."""

    rows: np.ndarray
    first_token: int
    chunk_tokens: int


class PagedKV:
    """All layers of one engine's paged cache, in model order, as ``[B, 2, H, N, D]`` views.

    ``read`` and ``write`` move whole vLLM blocks between the paged cache and a tieredkv host buffer
    ``(layers, 2, kv_heads, tokens, head_dim)``: one fancy-index copy per layer for all blocks of a
    request. A CUDA cache is copied by torch on the device (one kernel per layer; the host side goes
    through the caller's pinned buffer); a CPU cache by numpy, whose copy is single-threaded: torch's
    CPU ``index_put_`` splits even a few MiB over all intra-op threads, and on cores busy with the
    model those threads mostly wait for each other (many times slower than one thread here).
    """

    def __init__(self, views: list[torch.Tensor], block_size: int):
        self.device = views[0].device
        self.block_size = block_size
        self.dtype = views[0].dtype
        _, _, self.kv_heads, _, self.head_dim = views[0].shape
        self._host: torch.Tensor | None = None
        # Where a (block, K|V, head) page is one run of N*D elements (the CPU backend's halves), the
        # token and dim axes are merged: the copy's inner loop then moves whole runs, not head_dim
        # elements at a time. The GPU backends interleave K and V per token: their views keep both.
        self._runs = all(v.stride(3) == v.shape[4] * v.stride(4) for v in views)
        # Torch views on a device; numpy views of the same memory on the CPU (see the class docstring).
        self.views: list[Any] = [self._pages(v) for v in views]
        if self.device.type == "cpu":
            self.views = [_numpy(v) for v in self.views]

    def host_buffer(self, n_tokens: int) -> torch.Tensor:
        """A reused, C-contiguous host buffer ``(layers, 2, kv_heads, n_tokens, head_dim)`` in the
        cache's dtype, pinned when the cache is on a CUDA device (pinning costs milliseconds, so the
        storage only grows). Contiguous, so each layer crosses to the device in one copy."""
        shape = (len(self.views), 2, self.kv_heads, n_tokens, self.head_dim)
        need = int(np.prod(shape))
        if self._host is None or self._host.numel() < need:
            self._host = torch.empty(need, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        return self._host[:need].view(shape)

    def _pages(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``[..., N, D]``) with N and D merged when this cache's pages are runs."""
        return t.flatten(-2) if self._runs else t

    def _ids(self, block_ids):
        ids = np.asarray(block_ids, dtype=np.int64)
        return ids if self.device.type == "cpu" else torch.as_tensor(ids).to(self.device)

    def _layers(self, layers):
        return range(len(self.views)) if layers is None else layers

    def write(self, block_ids, host: torch.Tensor | Chunks, first_token: int = 0, layers=None) -> None:
        """Copy ``host[:, :, :, first_token:first_token + k*N]`` into blocks ``block_ids`` (k of them).

        ``host``: a host buffer ``(layers, 2, kv_heads, tokens, head_dim)``, or (a CPU cache only)
        ``Chunks`` holding the tokens ``first_token .. first_token + k*N``.
        ``layers``: only these layer indices (a KV cache group's layers; default all)."""
        k, N = len(block_ids), self.block_size
        if not k:
            return
        if isinstance(host, Chunks):
            self._write_chunks(block_ids, host, first_token, self._layers(layers))
            return
        ids = self._ids(block_ids)
        on_cpu = self.device.type == "cpu"
        for layer in self._layers(layers):
            pages = self.views[layer]
            src = host[layer]
            if not on_cpu:  # one host-to-device copy per layer (contiguous from host_buffer), then on device
                src = src.to(self.device, non_blocking=True)
            # [2, H, k*N, D] -> [k, 2, H, N, D]; merging N and D stays a view (both contiguous).
            src = self._pages(src[:, :, first_token:first_token + k * N].unflatten(2, (k, N)).permute(2, 0, 1, 3, 4))
            pages[ids] = _numpy(src) if on_cpu else src

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """The bytes of one tieredkv block of ``chunk_tokens`` tokens of every layer of this cache: what
        ``Chunks`` rows must hold."""
        return len(self.views) * 2 * self.kv_heads * chunk_tokens * self.head_dim * self.dtype.itemsize

    def _write_chunks(self, block_ids, chunks: Chunks, first_token: int, layers) -> None:
        """``write`` from ``Chunks`` (CPU): per layer, one index copy per offset of a vLLM block in its
        chunk, each from a strided view of the rows (see the module docstring)."""
        k, N, C = len(block_ids), self.block_size, chunks.chunk_tokens
        rows, at = chunks.rows, first_token - chunks.first_token
        n, per = rows.shape[0], C // N
        if self.device.type != "cpu" or C % N or at < 0 or at % N or at + k * N > n * C \
                or rows.shape[1] != self.chunk_bytes(C):
            raise InvalidInput(f"{k} blocks of {N} tokens from token {first_token} do not lie in {n} chunks of "
                               f"{C} tokens from token {chunks.first_token} of this CPU cache")
        ids = np.asarray(block_ids, dtype=np.int64)
        where = at // N + np.arange(k)  # each vLLM block: chunk where // per, offset where % per
        for layer in layers:
            pages = self.views[layer]
            blocks = rows.view(pages.dtype).reshape(n, len(self.views), 2, self.kv_heads, per, N, self.head_dim)
            for r in range(per):
                chosen = where % per == r
                if not chosen.any():
                    continue
                c = where[chosen] // per  # consecutive chunks
                src = blocks[c[0]:c[-1] + 1, layer, :, :, r]  # (m, 2, H, N, D)
                pages[ids[chosen]] = src.reshape(*src.shape[:3], -1) if self._runs else src

    def read(self, block_ids, host: torch.Tensor, layers=None) -> None:
        """Copy blocks ``block_ids`` (k of them) into ``host[:, :, :, :k*N]`` (``layers``: as in ``write``)."""
        k, N = len(block_ids), self.block_size
        if not k:
            return
        ids = self._ids(block_ids)
        for layer in self._layers(layers):
            pages = self.views[layer]
            if self.device.type == "cpu":
                dst = self._pages(host[layer, :, :, :k * N].unflatten(2, (k, N))).movedim(2, 0)  # [k, 2, H, ...]
                np.copyto(_numpy(dst), pages[ids])
            else:  # gather and reorder on the device, then one device-to-host copy per layer
                got = pages.index_select(0, ids).view(k, 2, self.kv_heads, N, self.head_dim)
                host[layer, :, :, :k * N].copy_(got.permute(1, 2, 0, 3, 4).reshape(2, self.kv_heads, k * N,
                                                                                    self.head_dim))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing ``t``'s memory and strides (bfloat16 viewed as int16: bytes are moved)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8):  # fp8: raw bytes
        t = t.view(torch.uint8)
    return t.detach().numpy()
