"""The remote tier's value format: one self-describing, authenticated value per block.

A remote store is shared by hosts that may run other models, other tenants and other tieredkv versions,
and any client of the store can write any name. So a value proves, under the fleet's key
(``tieredkv.remote.auth``), that a holder of the key wrote it for exactly the block asked for, before
a byte of it reaches a KV cache::

    offset  size  field
         0     4  magic b"TKVR"
         4     2  format version (2)
         6     1  codec: 0 = raw payload, 1 = byte-plane split + zlib (others: refused, reserved)
         7     1  flags (0; reserved)
         8     4  chunk tokens
        12     4  zero
        16     8  payload length as stored (after compression, if any)
        24     8  raw payload length (the spec's block_bytes)
        32    16  name digest: the keyed digest that is the block's name in the store (namespace, key,
                  parent key and the chunk's tokens; ``Codec.digests``)
        48    32  MAC: HMAC-SHA256 under the fleet's value key of bytes [0, 48) and the payload
        80     …  the payload

Neither the tokens nor the chained keys are in the value: the name digest binds them (a reader computes
it from the prompt it holds), so a reader of the store learns no token ids from names or values.

A value that fails any check (magic, version, codec, lengths, name digest, MAC, decompression) is
refused: the reader counts a corruption and treats the block as a miss. The MAC is checked before the
payload is copied or inflated, and inflation is bounded by the raw length (no zlib bomb).

Byte-plane compression: bf16/fp16 elements split into a plane of low bytes and a plane of high bytes
(sign + exponent + top mantissa bits), which zlib compresses well where the mixed stream does not. The
split is lossless; whether it pays depends on the link (see docs/fleet.md).
"""

from __future__ import annotations

import hmac
import struct
import zlib

import numpy as np

from tieredkv.keys import ChunkKeys
from tieredkv.remote.auth import MAC_BYTES, NAME_DIGEST_BYTES, FleetKey
from tieredkv.spec import KVSpec

MAGIC = b"TKVR"
FORMAT_VERSION = 2
CODEC_RAW = 0
CODEC_PLANES_ZLIB = 1
#: Codecs this version reads (a value with another is refused, never guessed at).
CODECS = (CODEC_RAW, CODEC_PLANES_ZLIB)
HEADER = struct.Struct(f"<4sHBBIIQQ{NAME_DIGEST_BYTES}s")
_MAC_AT = HEADER.size  # 48
HEADER_BYTES = _MAC_AT + MAC_BYTES  # 80
#: zlib level for byte-plane compression: level 1 is several times faster than the default and gives
#: most of the ratio on exponent planes.
ZLIB_LEVEL = 1


def value_bytes(spec: KVSpec) -> int:
    """Size of an uncompressed value (the most a value of this spec may take)."""
    return HEADER_BYTES + spec.block_bytes


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


class Codec:
    """Names, encodes and checks the values of one spec under one fleet key.

    Args:
        spec: the namespace every value must belong to.
        key: the fleet key (``tieredkv.remote.auth.load_key``).
        compress: byte-plane split + zlib on write (reads accept both forms regardless).
    """

    def __init__(self, spec: KVSpec, key: FleetKey, compress: bool = False):
        self.spec = spec
        self.key = key
        self.compress = bool(compress)
        self.max_bytes = value_bytes(spec)
        self.width = spec.dtype_bytes
        self._ns = spec.fingerprint.encode()

    def digests(self, keys: ChunkKeys) -> list[bytes]:
        """The keyed name digest of each block: namespace, key, parent key and tokens under the name key."""
        raw = np.ascontiguousarray(keys.keys, dtype="<u8").tobytes()
        par = np.ascontiguousarray(keys.parents, dtype="<u8").tobytes()
        tok = np.ascontiguousarray(keys.tokens, dtype="<u4")
        return [self.key.name_digest(b"".join((self._ns, raw[16 * i:16 * i + 16], par[16 * i:16 * i + 16],
                                               tok[i].tobytes())))
                for i in range(len(keys))]

    def encode(self, digest: bytes, payload: np.ndarray, into: np.ndarray | None = None) -> memoryview:
        """The value of one block (``payload``: any dtype, ``block_bytes`` bytes) named by ``digest``.

        ``into``: a uint8 buffer of at least ``max_bytes`` to build the value in (zero-copy puts from
        registered memory); otherwise a new buffer is allocated. Returns a view of the value's bytes.
        """
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        codec = CODEC_RAW
        body: bytes | np.ndarray = raw
        if self.compress:
            packed = zlib.compress(split_planes(raw, self.width), ZLIB_LEVEL)
            if len(packed) < len(raw):  # incompressible blocks travel raw
                codec, body = CODEC_PLANES_ZLIB, packed
        n_body = len(body)
        total = HEADER_BYTES + n_body
        buf = np.empty(total, dtype=np.uint8) if into is None else into[:total]
        buf[HEADER_BYTES:] = np.frombuffer(body, dtype=np.uint8) if isinstance(body, bytes) else body
        HEADER.pack_into(buf.data, 0, MAGIC, FORMAT_VERSION, codec, 0, self.spec.chunk_tokens, 0, n_body,
                         self.spec.block_bytes, digest)
        mac = self.key.mac()
        mac.update(buf[:_MAC_AT].data)
        mac.update(buf[HEADER_BYTES:].data)
        buf[_MAC_AT:HEADER_BYTES] = np.frombuffer(mac.digest(), dtype=np.uint8)
        return buf.data

    def decode_into(self, value, digest: bytes, out: np.ndarray) -> bool:
        """Check ``value`` against the block named by ``digest`` and, only if every check holds, write its
        payload into ``out`` (uint8, ``block_bytes``). Returns False, leaving ``out`` untouched, if any
        check fails."""
        mv = memoryview(value).cast("B")
        head = parse(mv, self.key)
        if head is None or head["raw_len"] != self.spec.block_bytes or head["chunk_tokens"] != self.spec.chunk_tokens:
            return False
        if not hmac.compare_digest(head["digest"], digest):
            return False
        body = mv[HEADER_BYTES:]
        if head["codec"] == CODEC_PLANES_ZLIB:
            planes = inflate(body, head["raw_len"])
            if planes is None:
                return False
            join_planes(planes, self.width, out)
        else:
            out[:] = np.frombuffer(body, dtype=np.uint8)
        return True


def parse(mv: memoryview, key: FleetKey) -> dict | None:
    """The header of a value whose framing and MAC hold under ``key``, or None. Reads nothing past the
    value's own bytes, whatever its header claims."""
    if len(mv) < HEADER_BYTES:
        return None
    magic, version, codec, flags, chunk, zero, n_body, n_raw, digest = HEADER.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION or codec not in CODECS or flags or zero:
        return None
    if len(mv) != HEADER_BYTES + n_body or (codec == CODEC_RAW and n_body != n_raw) or n_body > n_raw:
        return None
    mac = key.mac()
    mac.update(mv[:_MAC_AT])
    mac.update(mv[HEADER_BYTES:])
    if not hmac.compare_digest(mac.digest(), mv[_MAC_AT:HEADER_BYTES]):
        return None
    return {"codec": codec, "digest": digest, "chunk_tokens": chunk, "stored_len": n_body, "raw_len": n_raw}


def check_value(value, digest_hex: str, key: FleetKey) -> str | None:
    """Check a value on its own, without the prompt that made it (``tieredkv verify --remote``).

    ``digest_hex`` is the digest part of the value's name. Returns None when the value is sound (its
    MAC holds under ``key``, it carries its name's digest, its payload decompresses to its length),
    else the reason. Never raises on any bytes.
    """
    try:
        mv = memoryview(value).cast("B")
    except TypeError:
        return "not a byte string"
    head = parse(mv, key)
    if head is None:
        return "bad framing or MAC (not a tieredkv value of this fleet, forged, or damaged)"
    if head["digest"].hex() != digest_hex:
        return "the value carries another block's name"
    if head["codec"] == CODEC_PLANES_ZLIB and inflate(mv[HEADER_BYTES:], head["raw_len"]) is None:
        return "compressed payload does not decompress to its length"
    return None
