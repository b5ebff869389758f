"""Chained chunk keys.

``k_0 = H(namespace_bytes || salt)`` and ``k_i = H(k_{i-1} || tokens_i)`` with tokens as little-endian
uint32 and ``H = xxh3_128``. A chunk's K/V depend on every token before it, so its key covers the whole
prefix; the salt isolates tenants. Keys are pure functions of their inputs: identical across processes,
restarts and machines.

A chunk whose K/V depend on more than its token ids (an engine's LoRA adapter, an image whose
placeholder tokens fall in the chunk, prompt embeddings) carries *extra bytes*, which an integration
computes and passes per chunk: ``k_i = H(k_{i-1} || tokens_i || EXTRA_TAG || extra_i)``. A chunk with
no extra bytes keeps the plain key, so two prompts that share text before an image still share those
chunks, and every chunk after a chunk with extra bytes differs through the chain.

Every key travels with its parent key and its chunk's token ids (``ChunkKeys``); tiers store both and a
hit is confirmed by comparing them, so even a 128-bit collision of token ids never hands out wrong KV.
Extra bytes are confirmed through the 128-bit key alone (as an engine's own prefix cache confirms them
through its block hash).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np
import xxhash

from tieredkv.errors import InvalidInput
from tieredkv.spec import KVSpec

KEY_BYTES = 16
#: Separates a chunk's token ids from its extra bytes in the hashed input (the token part has a fixed
#: width, so the tag only makes the form readable; it keeps "no extra" and "empty extra" apart too).
EXTRA_TAG = b"\x00tieredkv-extra\x00"
_MAX_TOKEN = 2**32 - 1


def as_tokens(tokens: object) -> np.ndarray:
    """Return token ids as a 1-D little-endian uint32 array, or raise with how to fix the call."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor, without importing torch
        if getattr(getattr(tokens, "device", None), "type", None) == "meta":
            raise InvalidInput("tokens are a tensor on torch's meta device, which holds no values; pass "
                               "the real token ids (a CPU or GPU tensor, a list or a numpy array)")
        try:
            tokens = tokens.detach().cpu().numpy()
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # no data to read, an odd dtype
            raise InvalidInput(f"tokens must be a tensor of integer token ids that can be read ({exc})") from None
    if isinstance(tokens, (bytes, bytearray, str)):
        raise InvalidInput("tokens must be a 1-D sequence of integer token ids, not bytes or str")
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, objects numpy cannot hold
        raise InvalidInput(f"tokens must be a 1-D sequence of integer token ids ({exc})") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise InvalidInput(f"tokens must be 1-D (or shaped (1, n)), got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise InvalidInput(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise InvalidInput("token ids must be >= 0; found a negative id")
    if int(arr.max()) > _MAX_TOKEN:
        raise InvalidInput(f"token ids must fit in uint32 (<= {_MAX_TOKEN})")
    return np.ascontiguousarray(arr, dtype="<u4")


def _check_salt(salt: object) -> bytes:
    if isinstance(salt, str):
        raise InvalidInput("salt must be bytes; encode a tenant id first, e.g. tenant.encode()")
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"salt must be bytes, got {type(salt).__name__}")
    return bytes(salt)


def key_at(raw: bytes, i: int) -> bytes:
    """The ``i``-th 16-byte key of ``raw``, keys laid end to end (``ChunkKeys.keys.tobytes()``)."""
    return raw[i * KEY_BYTES:(i + 1) * KEY_BYTES]


def root_key(spec: KVSpec, salt: bytes = b"") -> bytes:
    """``k_0``: the parent of a prompt's first chunk, one per (namespace, salt)."""
    return xxhash.xxh3_128_digest(spec.namespace_bytes() + _check_salt(salt))


class ChunkKeys:
    """The keys of a prompt's full chunks, with what confirms each one.

    Attributes:
        keys: ``(n, 2)`` uint64, one 128-bit key per chunk (row ``i`` covers tokens ``[0, (i+1)*C)``).
        parents: ``(n, 2)`` uint64, the key before each one (``k_0`` for the first).
        tokens: ``(n, chunk_tokens)`` uint32, the chunk's own token ids.
        start: index of the first chunk in the prompt (non-zero for a slice).

    Indexing with an int gives the 16-byte key; slicing gives a ``ChunkKeys``.
    """

    __slots__ = ("keys", "parents", "tokens", "start", "_positions")

    def __init__(self, keys: np.ndarray, parents: np.ndarray, tokens: np.ndarray, start: int = 0,
                 positions: np.ndarray | None = None):
        self.keys = keys
        self.parents = parents
        self.tokens = tokens
        self.start = start
        self._positions = positions

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> ChunkKeys: ...

    def __getitem__(self, index: int | slice) -> bytes | ChunkKeys:
        if isinstance(index, slice):
            begin, _, step = index.indices(len(self))
            if step != 1:
                raise InvalidInput("ChunkKeys slices must be contiguous")
            pos = None if self._positions is None else self._positions[index]
            return ChunkKeys(self.keys[index], self.parents[index], self.tokens[index], self.start + begin, pos)
        return self.keys[index].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        return (row.tobytes() for row in self.keys)

    @property
    def positions(self) -> np.ndarray:
        """Chunk index of each key in its prompt (grows with recompute cost)."""
        if self._positions is not None:
            return self._positions
        return np.arange(self.start, self.start + len(self), dtype=np.int64)

    @property
    def key64(self) -> np.ndarray:
        """The low 64 bits of each key (the index's hash; policies' ghost entries)."""
        return self.keys[:, 0]

    def take(self, rows: np.ndarray) -> ChunkKeys:
        """The keys at ``rows`` (indices, any order; or a bool mask of ``len(self)``), keeping each one's
        prompt position.

        Raises:
            InvalidInput: a mask of another length (it is never read as the indices 0 and 1).
        """
        rows = np.asarray(rows)
        if rows.dtype == bool:
            if rows.shape != (len(self),):
                raise InvalidInput(f"a mask for take() needs {len(self)} entries (one per key), got shape {rows.shape}")
            rows = np.flatnonzero(rows)
        rows = rows.astype(np.int64, copy=False)
        return ChunkKeys(self.keys[rows], self.parents[rows], self.tokens[rows], 0, self.positions[rows])

    def __repr__(self) -> str:
        return f"ChunkKeys(n={len(self)}, start={self.start})"


def chunk_keys(spec: KVSpec, tokens: Sequence[int] | np.ndarray, salt: bytes = b"",
               extra: Sequence[bytes | None] | None = None) -> ChunkKeys:
    """Return the chained key of every full chunk of ``tokens`` (a trailing partial chunk has none).

    Args:
        spec: the namespace; the first key depends on it.
        tokens: 1-D token ids (list, numpy array or torch tensor), each in ``[0, 2**32)``.
        salt: per-tenant bytes; prefixes stored under one salt are never found under another.
        extra: per chunk (index ``i`` for chunk ``i``), bytes folded into that chunk's key, or
            ``None`` for none; at least one entry per full chunk. The caller encodes them
            injectively (two different identities never give the same bytes).

    Raises:
        InvalidInput: tokens not 1-D integers in range, salt not bytes, or ``extra`` too short or
            holding something other than bytes and ``None``.
    """
    ids = as_tokens(tokens)
    chunk = spec.chunk_tokens
    n = len(ids) // chunk
    table = ids[: n * chunk].reshape(n, chunk)
    raw = table.tobytes()
    width = chunk * 4
    # The chain is sequential; keep the loop body to one concat, one hash, one append (a 128k-token
    # prompt is 2,048 iterations; its cost: docs/benchmarks.md, "Notes behind the code").
    prev = root_key(spec, salt)
    digests = [prev]
    append, h = digests.append, xxhash.xxh3_128_digest
    pieces = [raw[i * width:(i + 1) * width] for i in range(n)]
    if extra is not None:
        pieces = _with_extra(pieces, extra)
    for piece in pieces:
        prev = h(prev + piece)
        append(prev)
    chain = np.frombuffer(b"".join(digests), dtype="<u8").reshape(n + 1, 2)
    return ChunkKeys(chain[1:], chain[:-1], table)


def _with_extra(pieces: list[bytes], extra: Iterable[bytes | None]) -> list[bytes]:
    """Each chunk's hashed input with its extra bytes appended (``chunk_keys``)."""
    extra = list(extra)
    if len(extra) < len(pieces):
        raise InvalidInput(f"extra has {len(extra)} entries for {len(pieces)} full chunks (one per chunk)")
    out = []
    for piece, more in zip(pieces, extra):
        if more is None:
            out.append(piece)
        elif isinstance(more, (bytes, bytearray, memoryview)):
            out.append(piece + EXTRA_TAG + bytes(more))
        else:
            raise InvalidInput(f"extra entries must be bytes or None, got {type(more).__name__}")
    return out


def opaque_keys(spec: KVSpec, names: Sequence[bytes]) -> ChunkKeys:
    """``ChunkKeys`` for blocks an engine names itself (vLLM's offload keys, SGLang's page hashes).

    Each key is xxh3-128 of ``spec.namespace_bytes() + name``: the same name under another namespace
    (model, layout, TP shard, ...) is another key. The engine's names already chain the whole prefix
    and its request identity, so a block is confirmed by its key alone: parents and tokens are zero.
    """
    seed = spec.namespace_bytes()
    raw = b"".join(xxhash.xxh3_128_digest(seed + bytes(name)) for name in names)
    n = len(raw) // 16
    return ChunkKeys(np.frombuffer(raw, dtype="<u8").reshape(n, 2), np.zeros((n, 2), dtype="<u8"),
                     np.zeros((n, spec.chunk_tokens), dtype="<u4"))


#: Separates a chunk key from a piece number in a recurrent-state piece's hashed input.
STATE_TAG = b"\x00tieredkv-recurrent-state\x00"


def piece_count(state_bytes: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` that hold one chunk boundary's recurrent state of ``state_bytes``."""
    return -(-int(state_bytes) // int(block_bytes))


def state_keys(boundaries: ChunkKeys, pieces: int) -> ChunkKeys:
    """The keys of the recurrent-state pieces at the end of each chunk of ``boundaries``.

    A hybrid model (linear-attention or mamba layers beside attention layers) needs, to continue a
    prefix, its recurrent state at the prefix's end besides the attention K/V. That state is cut into
    ``pieces`` blocks of the same cache: piece ``j`` of the state at the end of chunk ``k`` has the key
    ``xxh3_128(key_k || STATE_TAG || j)``, parent ``key_k`` and chunk ``k``'s tokens, so a read confirms
    it like any block. ``pieces`` per chunk, chunk by chunk.
    """
    raw = b"".join(xxhash.xxh3_128_digest(key + STATE_TAG + j.to_bytes(4, "little"))
                   for key in boundaries for j in range(pieces))
    n = len(boundaries) * pieces
    return ChunkKeys(np.frombuffer(raw, dtype="<u8").reshape(n, 2) if n else np.zeros((0, 2), "<u8"),
                     np.repeat(boundaries.keys, pieces, axis=0), np.repeat(boundaries.tokens, pieces, axis=0),
                     positions=np.repeat(boundaries.positions, pieces))
