"""Block bytes <-> arrays.

One block is ``[layer][K, V][kv_head][token][head_dim]`` in the spec's dtype, C-contiguous. Restoring
layer ``l`` of a prefix is then one strided copy per block (and layer-by-layer loading needs no
re-layout), and a batch of blocks is one ``(n, block_bytes)`` byte matrix.
"""

from __future__ import annotations

import numpy as np

from tieredkv.errors import InvalidPayload
from tieredkv.spec import KVSpec


def as_block_bytes(spec: KVSpec, payloads: np.ndarray, n: int, *, what: str = "payloads",
                   writable: bool = False) -> np.ndarray:
    """View ``n`` blocks as an ``(n, block_bytes)`` uint8 matrix without copying.

    Accepted: the spec's numpy dtype shaped ``(n, *block_shape)`` or ``(n, elements_per_block)``, or
    uint8 shaped ``(n, block_bytes)``. Anything else is an ``InvalidPayload`` that says what was expected.
    """
    if not isinstance(payloads, np.ndarray):
        raise InvalidPayload(f"{what} must be a numpy array, got {type(payloads).__name__}")
    if writable and not payloads.flags.writeable:
        raise InvalidPayload(f"{what} is read-only; pass a writable array")
    if payloads.dtype not in (spec.numpy_dtype, np.dtype(np.uint8)):
        raise InvalidPayload(f"{what} dtype {payloads.dtype} does not match the spec's {spec.dtype} "
                             f"(numpy {spec.numpy_dtype}); pass {spec.numpy_dtype} or raw uint8 bytes")
    if payloads.nbytes != n * spec.block_bytes or (payloads.ndim and payloads.shape[0] != n):
        raise InvalidPayload(f"{what} must hold {n} blocks of {spec.block_bytes} bytes "
                             f"(shape ({n}, *{spec.block_shape})), got shape {payloads.shape} "
                             f"dtype {payloads.dtype}")
    if not payloads.flags.c_contiguous:
        raise InvalidPayload(f"{what} must be C-contiguous; call np.ascontiguousarray first")
    return payloads.reshape(-1).view(np.uint8).reshape(n, spec.block_bytes)


def block_view(spec: KVSpec, raw: np.ndarray) -> np.ndarray:
    """View ``(n, block_bytes)`` bytes as ``(n, layers, 2, kv_heads, chunk_tokens, head_dim)``."""
    n = raw.shape[0]
    return raw.reshape(-1).view(spec.numpy_dtype).reshape(n, *spec.block_shape)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for same-shape arrays, without glibc's slow misaligned ``rep movsb``.

    For large copies glibc's memcpy uses ``rep movsb``, which on some x86 machines runs several times
    slower when the destination is 16 bytes off the source's 64-byte alignment (a fresh ``np.empty``
    row against a page-aligned slot: slots are page-aligned and numpy's large buffers usually are not,
    so this is the common case). A uint64 ufunc pass (numpy's SIMD loop, no memcpy) runs at one speed
    whatever the alignment; we use it only when the two are misaligned, since memcpy is faster when
    they are not. Measurements: docs/benchmarks.md (the glibc note at the top).
    """
    if (dst.ctypes.data - src.ctypes.data) % 64 and dst.shape and (dst.shape[-1] * dst.itemsize) % 8 == 0 \
            and dst.strides[-1] == dst.itemsize and src.strides[-1] == src.itemsize and dst.dtype == src.dtype:
        np.bitwise_or(src.view(np.uint8).view(np.uint64), 0, out=dst.view(np.uint8).view(np.uint64))
    else:
        np.copyto(dst, src)


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two elements of an array with this ``shape`` and byte ``strides`` may share memory
    (``as_strided`` with overlapping strides, ``broadcast_to``): writing into such an array makes later
    rows overwrite earlier ones.

    Conservative: the dims, ordered by stride, must each step past everything the smaller ones span;
    a layout that interleaves without overlapping (never produced by slicing or transposing) counts
    as overlapping too.
    """
    span = itemsize
    for stride, size in sorted((abs(st), n) for st, n in zip(strides, shape) if n > 1):
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False
