"""The remote tier's value format: one self-describing, authenticated value per block.

A remote store is shared by hosts that may run other models, other tenants and other tieredkv versions,
and any client of the store can write any name. So a value proves, under the fleet's key
(``tieredkv.remote.auth``), that a holder of the key wrote it for exactly the block asked for, before
a byte of it reaches a KV cache::

    offset  size  field
         0     4  magic b"TKVR"
         4     2  format version (2)
         6     1  codec (``tieredkv.codec``): 0 = raw payload, 1 = byte planes + zlib, 2 = a blosc2
                  chunk (shuffle + ZSTD or LZ4); another codec (a later version's) is left alone
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
payload is copied or decompressed, and decompression is bounded by the raw length (no zlib bomb; a blosc2
chunk's claimed sizes are checked before it is touched). A sound value whose codec this process cannot
run (blosc2 not installed, or a codec a later tieredkv added) is not a corruption: ``decode_into``
raises ``MissingDependency`` and the tier counts a miss, leaving the value for the hosts that can read
it. So the codec byte is judged only after the MAC: a fleet upgraded host by host keeps the values its
newer hosts write.

Compression (``tieredkv.codec``): bf16/fp16 elements split into byte planes, which an entropy coder
compresses well (about 1.45x with blosc2's shuffle + ZSTD) where the mixed stream does not. It is
lossless; whether it pays depends on the link (docs/fleet.md, docs/benchmarks.md).
"""

from __future__ import annotations

import hmac
import struct

import numpy as np

from tieredkv import codec as cd
from tieredkv.codec import inflate, join_planes, split_planes  # noqa: F401 - the names this module had
from tieredkv.errors import MissingDependency
from tieredkv.keys import ChunkKeys
from tieredkv.remote.auth import MAC_BYTES, NAME_DIGEST_BYTES, FleetKey
from tieredkv.spec import KVSpec

MAGIC = b"TKVR"
FORMAT_VERSION = 2
CODEC_RAW = cd.RAW
CODEC_PLANES_ZLIB = cd.ZLIB
CODEC_BLOSC2 = cd.BLOSC2
#: Codecs this version reads (a value with another is refused, never guessed at).
CODECS = cd.KNOWN
HEADER = struct.Struct(f"<4sHBBIIQQ{NAME_DIGEST_BYTES}s")
_MAC_AT = HEADER.size  # 48
HEADER_BYTES = _MAC_AT + MAC_BYTES  # 80
ZLIB_LEVEL = cd.ZLIB_LEVEL


def value_bytes(spec: KVSpec) -> int:
    """Size of an uncompressed value (the most a value of this spec may take)."""
    return HEADER_BYTES + spec.block_bytes


class Codec:
    """Names, encodes and checks the values of one spec under one fleet key.

    Args:
        spec: the namespace every value must belong to.
        key: the fleet key (``tieredkv.remote.auth.load_key``).
        compress: the codec values are written with (``tieredkv.codec.CHOICES``; True: "zstd"). Reads
            accept every codec whatever this says.

    Raises:
        MissingDependency: ``compress`` needs blosc2, which is not installed.
        InvalidInput: an unknown ``compress``.
    """

    def __init__(self, spec: KVSpec, key: FleetKey, compress: bool | str | None = False):
        self.spec = spec
        self.key = key
        #: the codec choice ("none", "zstd", "lz4", "zlib")
        self.compression = cd.choice(compress)
        self.compress = self.compression != "none"
        self._compressor = cd.Compressor(self.compression, spec.dtype_bytes) if self.compress else None
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
        if self._compressor is not None:
            packed = self._compressor.compress(raw)
            if packed is not None:  # None: incompressible blocks travel raw
                codec, body = self._compressor.id, packed
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
        payload into ``out`` (uint8, ``block_bytes``). Returns False if any check fails: ``out`` is
        untouched when the framing, MAC or name fail; a (MAC-valid) payload that does not decompress to
        its length may have written part of ``out``.

        Raises:
            MissingDependency: the value is sound but its codec's library is not installed here: a miss
                for this process, not a damaged value.
        """
        mv = memoryview(value).cast("B")
        head = parse(mv, self.key)
        if head is None or head["raw_len"] != self.spec.block_bytes or head["chunk_tokens"] != self.spec.chunk_tokens:
            return False
        if not hmac.compare_digest(head["digest"], digest):
            return False
        if head["codec"] not in CODECS:
            raise MissingDependency(f"remote value in codec {head['codec']}, which this tieredkv version does "
                                    "not know (written by a newer one): upgrade this host to read it")
        return cd.decompress_into(head["codec"], mv[HEADER_BYTES:], out, self.width)


def parse(mv: memoryview, key: FleetKey) -> dict | None:
    """The header of a value whose framing and MAC hold under ``key``, or None. Reads nothing past the
    value's own bytes, whatever its header claims."""
    if len(mv) < HEADER_BYTES:
        return None
    magic, version, codec, flags, chunk, zero, n_body, n_raw, digest = HEADER.unpack_from(mv)
    if magic != MAGIC or version != FORMAT_VERSION or flags or zero:
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
    if head["codec"] not in CODECS:
        return None  # the MAC holds: written by a newer tieredkv, in a codec this one does not know
    if head["codec"] != CODEC_RAW:
        try:
            sound = cd.decompress_into(head["codec"], mv[HEADER_BYTES:], np.empty(head["raw_len"], np.uint8),
                                       _width_of(head["raw_len"]))
        except MissingDependency:
            return None  # the MAC holds: sound as far as this host can tell (it cannot run the codec)
        if not sound:
            return "compressed payload does not decompress to its length"
    return None


def _width_of(raw_len: int) -> int:
    """A dtype width that divides the payload (the byte-plane join needs one; blosc2 ignores it)."""
    for w in (2, 4, 1):
        if raw_len % w == 0:
            return w
    return 1
