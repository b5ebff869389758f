"""Block bytes <-> arrays.

One block is ``[layer][K, V][kv_head][token][head_dim]`` in the spec's dtype, C-contiguous. Restoring
layer ``l`` of a prefix is then one strided copy per block (and layer-by-layer loading needs no
re-layout), and a batch of blocks is one ``(n, block_bytes)`` byte matrix.
"""

from __future__ import annotations

import os
import time

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


def page_aligned_empty(nbytes: int, page: int = 4096) -> np.ndarray:
    """An uninitialised uint8 buffer starting on a page boundary (malloc returns large blocks 16
    bytes past one, which makes ``rep movsb`` copies into it slow on some CPUs, see ``copy_rows``)."""
    raw = np.empty(nbytes + page, dtype=np.uint8)
    start = (-address(raw)) % page
    return raw[start:start + nbytes]


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first byte (cheaper than ``a.ctypes.data``, which builds a helper)."""
    return a.__array_interface__["data"][0]


def misaligned(dst: np.ndarray, src: np.ndarray) -> bool:
    """True when a copy from ``src`` to ``dst`` would start 64-byte misaligned (see ``copy_rows``)."""
    return (address(dst) - address(src)) % 64 != 0


#: Whether a misaligned copy runs faster as a uint64 ufunc pass than as memcpy on this CPU: ``None``
#: until ``skewed_copy_uses_ufunc`` first decides (by a probe, or ``TIEREDKV_SKEWED_COPY``).
_SKEWED_UFUNC: bool | None = None


def skewed_copy_uses_ufunc() -> bool:
    """Whether ``copy_rows`` copies misaligned arrays with the ufunc pass (decided once per process).

    The answer depends on the CPU: on an AMD EPYC host glibc's ``rep movsb`` ran 3-4x slower for a
    16-byte skew, on an Intel Sapphire Rapids host a misaligned memcpy costs nothing extra and the ufunc
    pass is the slower one (0.88x memcpy). So it is measured, not assumed: the first call times both on
    4 MiB copied with a 16-byte skew (best of 5 each, about 10 ms) and picks the ufunc pass only if it
    is at least 10% faster. ``TIEREDKV_SKEWED_COPY=ufunc`` or ``=memcpy`` decides without the probe.
    """
    global _SKEWED_UFUNC
    if _SKEWED_UFUNC is None:
        forced = os.environ.get("TIEREDKV_SKEWED_COPY", "").strip().lower()
        _SKEWED_UFUNC = forced == "ufunc" if forced in ("ufunc", "memcpy") else _probe_skewed_copy()
    return _SKEWED_UFUNC


def _probe_skewed_copy(nbytes: int = 4 << 20, repeats: int = 5) -> bool:
    src = page_aligned_empty(nbytes + 64)
    src[:] = 1
    dst = page_aligned_empty(nbytes + 64)
    s, d = src[:nbytes], dst[16:16 + nbytes]  # 16 bytes off, where malloc puts large buffers
    s64, d64 = s.view(np.uint64), d.view(np.uint64)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    np.copyto(d, s)  # touch both first
    t_memcpy = best(lambda: np.copyto(d, s))
    t_ufunc = best(lambda: np.bitwise_or(s64, 0, out=d64))
    return t_ufunc < 0.9 * t_memcpy


def copy_rows(dst: np.ndarray, src: np.ndarray, skewed: bool) -> None:
    """Copy same-shape arrays; ``skewed`` (decided once per batch by the caller, see ``misaligned``)
    picks the SIMD ufunc pass over memcpy where this CPU copies misaligned data faster that way
    (``skewed_copy_uses_ufunc``). Rows may be strided (a slot matrix); the last axis must be
    contiguous in both for the ufunc pass, else it falls back to ``np.copyto``.

    Why: for large copies glibc's memcpy uses ``rep movsb``, which on some x86 CPUs runs several times
    slower when the destination is 16 bytes off the source's 64-byte alignment (docs/benchmarks.md;
    ``GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold`` in docs/tuning.md). Slots are page-aligned and
    numpy's large buffers usually are not. A uint64 ufunc pass (numpy's SIMD loop, no memcpy) runs at
    the same speed whatever the alignment; it is used only when the two are misaligned and the probe
    found it faster, since memcpy is faster when they are aligned."""
    if skewed and _ufunc_ok(dst, src) and skewed_copy_uses_ufunc():
        np.bitwise_or(src.view(np.uint8).view(np.uint64), 0, out=dst.view(np.uint8).view(np.uint64))
    else:
        np.copyto(dst, src)


def _ufunc_ok(dst: np.ndarray, src: np.ndarray) -> bool:
    return bool(dst.shape) and dst.dtype == src.dtype and (dst.shape[-1] * dst.itemsize) % 8 == 0 \
        and dst.strides[-1] == dst.itemsize and src.strides[-1] == src.itemsize


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Split ``slots`` into runs of adjacent slots, ascending or descending.

    Returns:
        ``(begin, end, first_slot, step)`` per run: ``slots[begin:end]`` is ``first_slot``,
        ``first_slot + step``, ... with ``step`` 1 or -1 (1 for a run of one).

    Vectorised: the only Python loop is over runs (one for a prefix stored in one call). The split
    is greedy and valid (every run really is adjacent); a zigzag such as 5, 6, 5, 6 may be cut into
    more runs than the fewest possible, which costs copies, never correctness.
    """
    n = len(slots)
    if n == 0:
        return []
    if n == 1:
        return [(0, 1, int(slots[0]), 1)]
    d = np.diff(np.asarray(slots, dtype=np.int64))
    up = d == 1
    if up.all():  # one ascending run: a prompt stored in one call
        return [(0, n, int(slots[0]), 1)]
    unit = up | (d == -1)
    start = np.ones(n, dtype=bool)
    start[1:] = ~unit  # element i starts a run unless it is one step from i-1 ...
    start[2:] |= unit[:-1] & (d[1:] != d[:-1])  # ... in the direction the run already goes
    begins = np.flatnonzero(start)
    ends = np.append(begins[1:], n)
    steps = np.where(ends - begins > 1, d[np.minimum(begins, n - 2)], 1)
    return list(zip(begins.tolist(), ends.tolist(), slots[begins].tolist(), steps.tolist()))


def run_rows(rows: np.ndarray, first: int, count: int, step: int) -> np.ndarray:
    """``rows[first], rows[first + step], ...`` (``count`` of them) as one view, ``step`` +-1."""
    if step == 1:
        return rows[first:first + count]
    return rows[first - count + 1:first + 1][::-1]


def blocks_to_model(spec: KVSpec, blocks: np.ndarray, target: np.ndarray, at_token: int) -> None:
    """Copy ``k`` blocks (``(k, block_bytes)`` uint8 rows, any row stride) into the model layout
    ``target[:, :, :, at_token:at_token + k * C, :]`` in one numpy call (no per-block Python)."""
    blocks_to_chunks(spec, blocks, _split_tokens(target, at_token, blocks.shape[0], spec.chunk_tokens), 0)


def model_chunks(spec: KVSpec, target: np.ndarray) -> np.ndarray:
    """``target``'s whole chunks as one ``(L, 2, H, tokens // C, C, D)`` view, for ``blocks_to_chunks``:
    built once per load, it saves a strided view per group (~10 us each, 64 per 112 MiB prefix)."""
    return _split_tokens(target, 0, target.shape[3] // spec.chunk_tokens, spec.chunk_tokens)


def blocks_to_chunks(spec: KVSpec, blocks: np.ndarray, chunks: np.ndarray, first: int) -> None:
    """``blocks_to_model`` into ``chunks`` (a ``model_chunks`` view) from chunk ``first`` on."""
    k = blocks.shape[0]
    src = blocks.view(spec.numpy_dtype).reshape(k, *spec.block_shape)
    np.copyto(chunks[:, :, :, first:first + k], src.transpose(1, 2, 3, 0, 4, 5))


def model_to_blocks(spec: KVSpec, source: np.ndarray, at_token: int, blocks: np.ndarray) -> None:
    """The inverse of ``blocks_to_model``: ``k = len(blocks)`` chunks from ``at_token`` on, one call."""
    k, C = blocks.shape[0], spec.chunk_tokens
    dst = blocks.reshape(-1).view(spec.numpy_dtype).reshape(k, *spec.block_shape) if blocks.dtype == np.uint8 \
        else blocks.reshape(k, *spec.block_shape)
    np.copyto(dst.transpose(1, 2, 3, 0, 4, 5), _split_tokens(source, at_token, k, C))


def model_to_rows(spec: KVSpec, source: np.ndarray, chunks: np.ndarray, rows: np.ndarray, at: np.ndarray) -> None:
    """Chunk ``chunks[j]`` of ``source`` (model layout; tokens ``chunks[j] * C ..``) into ``rows[at[j]]``
    (``(m, block_bytes)`` uint8 rows, a tier's slots say): one ``model_to_blocks`` per run where both
    the chunks and the rows are consecutive (one for a fresh prompt). Rows of padded slots (a row
    stride over ``block_bytes``) are not one array: block by block."""
    if not len(chunks):
        return
    whole = rows.strides[0] == spec.block_bytes
    edges = np.flatnonzero((np.diff(chunks) != 1) | (np.diff(at) != 1) | (not whole)) + 1
    for a, b in zip([0, *edges.tolist()], [*edges.tolist(), len(chunks)]):
        r = int(at[a])
        model_to_blocks(spec, source, int(chunks[a]) * spec.chunk_tokens, rows[r:r + b - a])


def _split_tokens(arr: np.ndarray, at_token: int, k: int, C: int) -> np.ndarray:
    """``arr[:, :, :, at_token:at_token + k*C, :]`` viewed as ``(L, 2, H, k, C, D)``: always a view
    (``reshape`` could silently copy, and a copy written to would lose the data)."""
    part = arr[:, :, :, at_token:at_token + k * C, :]
    sL, s2, sH, sT, sD = part.strides
    L, two, H, _, D = part.shape
    return np.lib.stride_tricks.as_strided(part, (L, two, H, k, C, D), (sL, s2, sH, C * sT, sT, sD),
                                           writeable=part.flags.writeable)


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

