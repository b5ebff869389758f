"""Lossless block compression for the warm and remote tiers: byte planes plus a fast codec.

bf16/fp16 KV does not compress as an interleaved byte stream, but its byte planes do: the high byte of
each element (sign, exponent, top mantissa bits) takes few values (about 3 bits of entropy in real KV),
the low byte is close to random. Splitting the planes ("shuffle") and entropy-coding them gives about
1.45x on the KV of a real model (docs/benchmarks.md, "Compression"); an LZ-only codec (LZ4) finds
repeats but codes no entropy and gets about 1.2x. Compression is lossless: a block decompresses to
exactly its bytes.

Codecs, by the id that the warm tier's frames and the remote tier's values carry per block::

    id  name   how                                                          needs
     0  raw    the block's bytes as they are                                -
     1  zlib   byte planes split in numpy, zlib level 1 (12-30 MB/s here)   - (standard library)
     2  blosc2 a blosc2 chunk: shuffle (typesize = the KV dtype's bytes)    blosc2 (``tieredkv[compress]``)
               + ZSTD level 1 ("zstd") or LZ4 ("lz4"); the chunk's own header
               says which, so one id decodes both

The names a user gives (``compress="zstd"``) are in ``CHOICES``. blosc2 is optional: asking to write
with it when it is not installed raises ``MissingDependency`` with the pip command; reading a block that
needs it raises the same from ``decompress_into``, which the tiers turn into a miss (never garbage,
never a deleted block: another process may have the codec). ``TIEREDKV_DISABLE_CODECS=blosc2`` makes
this process behave as if blosc2 were not installed (tests, and a quick way to rule the codec out).

Safety: blosc2 checks neither the chunk's integrity (a flipped byte decompresses to wrong bytes) nor a
destination too small for the size the chunk's header claims (it writes past it). So the callers check
the stored bytes first (the warm tier's checksum, the remote tier's MAC) and ``decompress_into``
checks the header's sizes against the expected raw length and the destination before decompressing.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np

from tieredkv.errors import InvalidInput, MissingDependency

RAW = 0
ZLIB = 1
BLOSC2 = 2
#: Codec ids this version decodes (anything else is refused, never guessed at).
KNOWN = (RAW, ZLIB, BLOSC2)
ID_NAMES = {RAW: "raw", ZLIB: "zlib", BLOSC2: "blosc2"}

#: What ``compress=`` accepts: a name, or off. ``True``/"1" means ``DEFAULT``.
CHOICES = ("none", "zstd", "lz4", "zlib")
#: The choice ``compress=True`` stands for: the best ratio among the fast codecs (1.45x vs LZ4's 1.2x).
DEFAULT = "zstd"
INSTALL = "pip install 'tieredkv[compress]'  (or: pip install blosc2)"
#: zlib level for byte-plane compression: level 1 is several times faster than the default and gives
#: most of the ratio on exponent planes.
ZLIB_LEVEL = 1
#: A block is stored compressed only if that saves at least this share of its bytes: below it, every
#: read would pay a decompression for almost nothing.
MIN_SAVING = 1 / 16
#: blosc2 threads per block: blocks below ``_THREAD_BYTES`` use one (a thread pool per call costs
#: more than it saves on a 64 KiB block: 235 us vs 396 us measured here).
THREADS = min(4, os.cpu_count() or 1)
_THREAD_BYTES = 1 << 20

_blosc2: Any = None  # the module once imported; False once its import failed (not retried)


def disabled() -> set[str]:
    """Codec libraries this process must treat as missing (``TIEREDKV_DISABLE_CODECS``, comma-separated)."""
    return {x.strip() for x in os.environ.get("TIEREDKV_DISABLE_CODECS", "").split(",") if x.strip()}


def blosc2_module():
    """The ``blosc2`` module, imported on first use (it takes about 0.2 s to import).

    Raises:
        MissingDependency: blosc2 is not installed (or disabled by ``TIEREDKV_DISABLE_CODECS``).
    """
    global _blosc2
    if "blosc2" in disabled():
        raise MissingDependency(f"compression codec blosc2 is disabled here (TIEREDKV_DISABLE_CODECS); "
                                f"it is needed for compress='zstd'/'lz4' and to read blocks written so: {INSTALL}")
    if _blosc2 is None:
        try:
            import blosc2
        except ImportError:
            _blosc2 = False
        else:
            _blosc2 = blosc2
    if _blosc2 is False:
        raise MissingDependency(f"compression codec blosc2 is not installed; it is needed for "
                                f"compress='zstd'/'lz4' and to read blocks written so: {INSTALL}")
    return _blosc2


def blosc2_available() -> bool:
    """Whether this process can run blosc2 (installed, and not disabled by ``TIEREDKV_DISABLE_CODECS``)."""
    try:
        blosc2_module()
    except MissingDependency:
        return False
    return True


def choice(value: Any, what: str = "compress") -> str:
    """Normalise a ``compress`` option: None/False/0/"0"/"none" -> "none", True/1/"1"/"true" -> ``DEFAULT``,
    else one of ``CHOICES``.

    Raises:
        InvalidInput: anything else (the message lists the choices).
    """
    if value is None or value is False or value in (0, "0", "false", "none", ""):
        return "none"
    if value is True or value in (1, "1", "true"):
        return DEFAULT
    if isinstance(value, str) and value in CHOICES:
        return value
    raise InvalidInput(f"{what} must be one of {CHOICES} (or True/False), got {value!r}")


def typesize_of(dtype_bytes: int) -> int:
    """blosc2's typesize for a KV dtype of ``dtype_bytes`` bytes (2: bf16/fp16, 1: fp8, 4: fp32)."""
    return max(1, int(dtype_bytes))


class Compressor:
    """Compresses blocks of one dtype with one codec choice (thread-safe: no state per call).

    Args:
        name: one of ``CHOICES`` other than "none".
        dtype_bytes: bytes per KV element (the shuffle's typesize).
        threads: blosc2 threads for blocks of 1 MiB and more.

    Raises:
        MissingDependency: the codec needs blosc2 and it is not installed.
        InvalidInput: an unknown name.
    """

    def __init__(self, name: str, dtype_bytes: int, threads: int = THREADS):
        self.name = choice(name)
        if self.name == "none":
            raise InvalidInput("a Compressor needs a codec; 'none' means no compression")
        self.typesize = typesize_of(dtype_bytes)
        self.threads = max(1, int(threads))
        self.id = ZLIB if self.name == "zlib" else BLOSC2
        self._kwargs: dict[str, Any] = {}
        if self.id == BLOSC2:
            b = blosc2_module()
            zstd = self.name == "zstd"
            # ALWAYS_SPLIT: each byte plane is coded as its own stream (the entropy coder sees one
            # distribution per plane, not a mix); measured 1.48x vs 1.30x unsplit on real bf16 KV.
            self._kwargs = dict(typesize=self.typesize, clevel=1 if zstd else 9, filters=[b.Filter.SHUFFLE],
                                codec=b.Codec.ZSTD if zstd else b.Codec.LZ4, splitmode=b.SplitMode.ALWAYS_SPLIT)

    def compress(self, raw: np.ndarray) -> bytes | None:
        """The compressed body of ``raw`` (one block, contiguous uint8), or None when compression saves
        less than ``MIN_SAVING`` (the block is then stored raw)."""
        n = raw.nbytes
        if self.id == ZLIB:
            body = zlib.compress(split_planes(raw, self.typesize), ZLIB_LEVEL)
        else:
            threads = self.threads if n >= _THREAD_BYTES else 1
            body = blosc2_module().compress2(raw, nthreads=threads, **self._kwargs)
        return body if len(body) <= n - n * MIN_SAVING else None


def decompress_into(codec: int, body, out: np.ndarray, typesize: int) -> bool:
    """Decompress ``body`` (codec ``codec``) into ``out`` (contiguous uint8, the raw length).

    Returns False if ``body`` is not one well-formed stream of exactly ``len(out)`` bytes in that codec
    (``out`` may then be partly written). Checks the sizes the stream claims before decompressing: a
    damaged or hostile size never makes the codec write past ``out`` or inflate without bound. The
    caller has checked ``body``'s integrity (a checksum or MAC): the codecs do not.

    Raises:
        MissingDependency: the codec's library is not installed here, or the codec is one this version
            does not know (written by a newer tieredkv): the block is fine, this process cannot read it.
    """
    if codec not in KNOWN:
        raise MissingDependency(f"codec {codec}, which this tieredkv version does not know (written by a "
                                "newer one): upgrade this host to read it")
    raw_len = out.nbytes
    if codec == RAW:
        if len(body) != raw_len:
            return False
        out[:] = np.frombuffer(body, dtype=np.uint8)
        return True
    if codec == ZLIB:
        planes = inflate(body, raw_len)
        if planes is None:
            return False
        join_planes(planes, typesize, out)
        return True
    b = blosc2_module()
    try:
        nbytes, cbytes, _ = b.get_cbuffer_sizes(body)
    except Exception:  # noqa: BLE001 - any complaint about the header: not a blosc2 chunk
        return False
    if nbytes != raw_len or cbytes != len(body):
        return False
    threads = THREADS if raw_len >= _THREAD_BYTES else 1
    try:
        b.decompress2(body, dst=out, nthreads=threads)
    except Exception:  # noqa: BLE001 - blosc2 raises ValueError/RuntimeError on a bad stream
        return False
    return True


# ---- byte planes + zlib (codec 1) ---------------------------------------------------------------------
def split_planes(raw: np.ndarray, width: int) -> bytes:
    """Byte planes of ``raw`` (uint8, length a multiple of ``width``): all first bytes, then all second..."""
    if width == 1:
        return raw.tobytes()
    return np.ascontiguousarray(raw.reshape(-1, width).T).tobytes()


def join_planes(planes: bytes | memoryview, width: int, out: np.ndarray) -> None:
    """Inverse of ``split_planes``, written into ``out`` (uint8, ``len(planes)`` bytes)."""
    src = np.frombuffer(planes, dtype=np.uint8)
    if width == 1:
        out[:] = src
    else:
        out.reshape(-1, width)[:] = src.reshape(width, -1).T


def inflate(body, raw_len: int) -> bytes | None:
    """``body`` decompressed, or None unless it is one complete zlib stream of exactly ``raw_len`` bytes.

    Never holds more than ``raw_len + 1`` inflated bytes, whatever ``body`` claims (a zlib bomb stops
    there)."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(body, raw_len + 1)
    except zlib.error:
        return None
    if len(out) != raw_len or not d.eof or d.unused_data or d.unconsumed_tail:
        return None
    return out
