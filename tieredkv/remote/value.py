"""The remote tier's value format: one self-describing value per block.

A remote store is shared by hosts that may run other models, other tenants and other tieredkv versions,
and any client of the store can write any key. So a value proves what it is before a byte of it reaches
a KV cache::

    offset  size  field
         0     4  magic b"TKVR"
         4     2  format version (1)
         6     2  flags: bit 0 = payload is byte-plane split and zlib-compressed
         8     8  namespace digest (xxh3_64 of the spec's namespace bytes)
        16    16  key (the block's chained key: namespace and tenant salt are in it)
        32    16  parent key
        48     4  chunk tokens
        52     4  zero
        56     8  payload length as stored (after compression, if any)
        64     8  raw payload length (the spec's block_bytes)
        72     8  checksum: xxh3_64 of bytes [0, 72) and of everything after the header
        80  4*C   the chunk's token ids (uint32 little-endian)
         …        the payload

A value that fails any check (magic, version, namespace, key, parent, tokens, lengths, checksum,
decompression) is refused: the reader counts a corruption and treats the block as a miss.

Byte-plane compression: bf16/fp16 elements split into a plane of low bytes and a plane of high bytes
(sign + exponent + top mantissa bits), which zlib compresses well where the mixed stream does not. The
split is lossless; whether it pays depends on the link (see docs/fleet.md).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import xxhash

from tieredkv.keys import ChunkKeys
from tieredkv.spec import KVSpec

MAGIC = b"TKVR"
FORMAT_VERSION = 1
FLAG_PLANES_ZLIB = 1
HEADER = struct.Struct("<4sHHQ16s16sIIQQQ")
HEADER_BYTES = HEADER.size  # 80
_CHECKED = HEADER_BYTES - 8  # the checksum covers the header up to itself
#: zlib level for byte-plane compression: level 1 is several times faster than the default and gives
#: most of the ratio on exponent planes.
ZLIB_LEVEL = 1


def namespace_digest(spec: KVSpec) -> int:
    """The 64-bit digest of a spec's namespace written into every value."""
    return xxhash.xxh3_64_intdigest(spec.namespace_bytes())


def confirm_digest(parent: np.ndarray, tokens: np.ndarray) -> int:
    """xxh3_64 of a block's parent key and chunk tokens: part of its name in the store, so that a probe
    by name confirms the hit (a right key with other tokens or another parent is another name)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(parent, dtype="<u8").tobytes()
                                    + np.ascontiguousarray(tokens, dtype="<u4").tobytes())


def value_bytes(spec: KVSpec) -> int:
    """Size of an uncompressed value (the most a value of this spec may take)."""
    return HEADER_BYTES + 4 * spec.chunk_tokens + spec.block_bytes


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


class Codec:
    """Encodes and checks the values of one spec.

    Args:
        spec: the namespace every value must belong to.
        compress: byte-plane split + zlib on write (reads accept both forms regardless).
    """

    def __init__(self, spec: KVSpec, compress: bool = False):
        self.spec = spec
        self.compress = bool(compress)
        self.digest = namespace_digest(spec)
        self.max_bytes = value_bytes(spec)
        self.width = spec.dtype_bytes

    def encode(self, keys: ChunkKeys, payloads: np.ndarray, i: int, into: np.ndarray | None = None) -> memoryview:
        """Value of block ``i`` (``payloads[i]``, any dtype, ``block_bytes`` bytes).

        ``into``: a uint8 buffer of at least ``max_bytes`` to build the value in (zero-copy puts from
        registered memory); otherwise a new buffer is allocated. Returns a view of the value's bytes.
        """
        spec = self.spec
        raw = np.ascontiguousarray(payloads[i]).reshape(-1).view(np.uint8)
        flags = 0
        body: bytes | np.ndarray = raw
        if self.compress:
            packed = zlib.compress(split_planes(raw, self.width), ZLIB_LEVEL)
            if len(packed) < len(raw):  # incompressible blocks travel raw
                flags, body = FLAG_PLANES_ZLIB, packed
        n_body = len(body)
        total = HEADER_BYTES + 4 * spec.chunk_tokens + n_body
        buf = np.empty(total, dtype=np.uint8) if into is None else into[:total]
        tok_end = HEADER_BYTES + 4 * spec.chunk_tokens
        buf[HEADER_BYTES:tok_end] = np.ascontiguousarray(keys.tokens[i], dtype="<u4").view(np.uint8)
        buf[tok_end:] = np.frombuffer(body, dtype=np.uint8) if isinstance(body, bytes) else body
        HEADER.pack_into(buf.data, 0, MAGIC, FORMAT_VERSION, flags, self.digest, keys.keys[i].tobytes(),
                         keys.parents[i].tobytes(), spec.chunk_tokens, 0, n_body, spec.block_bytes, 0)
        h = xxhash.xxh3_64(buf[:_CHECKED].data)
        h.update(buf[HEADER_BYTES:].data)
        struct.pack_into("<Q", buf.data, _CHECKED, h.intdigest())
        return buf.data

    def decode_into(self, value, keys: ChunkKeys, i: int, out: np.ndarray) -> bool:
        """Check ``value`` against block ``i`` of ``keys`` and write its payload into ``out`` (uint8,
        ``block_bytes``). Returns False, leaving ``out`` undefined, if any check fails."""
        spec = self.spec
        mv = memoryview(value).cast("B")
        head = _parse(mv)
        if (head is None or head["digest"] != self.digest or head["chunk_tokens"] != spec.chunk_tokens
                or head["raw_len"] != spec.block_bytes or head["key"] != keys.keys[i].tobytes()
                or head["parent"] != keys.parents[i].tobytes()):
            return False
        tok_end = HEADER_BYTES + 4 * spec.chunk_tokens
        if mv[HEADER_BYTES:tok_end] != np.ascontiguousarray(keys.tokens[i], dtype="<u4").data.cast("B"):
            return False
        return _unpack_body(mv[tok_end:], head, self.width, out)


def _parse(mv: memoryview) -> dict | None:
    """The header of a value whose framing and checksum hold, or None."""
    if len(mv) < HEADER_BYTES:
        return None
    magic, version, flags, digest, key, parent, chunk, zero, n_body, n_raw, checksum = HEADER.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_PLANES_ZLIB or zero != 0:
        return None
    if len(mv) != HEADER_BYTES + 4 * chunk + n_body or (not flags and n_body != n_raw):
        return None
    h = xxhash.xxh3_64(mv[:_CHECKED])
    h.update(mv[HEADER_BYTES:])
    if h.intdigest() != checksum:
        return None
    return {"flags": flags, "digest": digest, "key": key, "parent": parent, "chunk_tokens": chunk,
            "stored_len": n_body, "raw_len": n_raw}


def _unpack_body(body: memoryview, head: dict, width: int, out: np.ndarray) -> bool:
    if head["flags"] & FLAG_PLANES_ZLIB:
        try:
            planes = zlib.decompress(body)
        except zlib.error:
            return False
        if len(planes) != head["raw_len"]:
            return False
        join_planes(planes, width, out)
    else:
        out[:] = np.frombuffer(body, dtype=np.uint8)
    return True


def check_value(value, fingerprint: str, key_hex: str, confirm_hex: str) -> str | None:
    """Check a value on its own, without the prompt that made it (``tieredkv verify --remote``).

    ``fingerprint``, ``key_hex`` and ``confirm_hex`` come from the value's name. Returns None when the
    value is sound, else the reason.
    """
    mv = memoryview(value).cast("B")
    head = _parse(mv)
    if head is None:
        return "bad framing or checksum (not a tieredkv value, or damaged)"
    if f"{head['digest']:016x}" != fingerprint:
        return "namespace digest differs from the name's"
    if head["key"].hex() != key_hex:
        return "key differs from the name's"
    tok_end = HEADER_BYTES + 4 * head["chunk_tokens"]
    tokens = np.frombuffer(mv[HEADER_BYTES:tok_end], dtype="<u4")
    if f"{confirm_digest(np.frombuffer(head['parent'], dtype='<u8'), tokens):016x}" != confirm_hex:
        return "parent key or tokens differ from the name's"
    if head["flags"] & FLAG_PLANES_ZLIB:
        out = np.empty(head["raw_len"], dtype=np.uint8)
        # Plane order does not matter for this check: only that the bytes decompress to their length.
        if not _unpack_body(mv[tok_end:], head, 1, out):
            return "compressed payload does not decompress to its length"
    return None
