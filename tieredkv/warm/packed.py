"""Compressed blocks in the warm tier's slots: the frame, and writing and reading them.

A slot holds either a block's raw bytes or a frame::

    offset  size  field
         0     4  magic b"TKVZ"
         4     1  codec (``tieredkv.codec``: 1 zlib, 2 blosc2; 0 is never framed)
         5     3  zero
         8     8  raw length (the spec's block_bytes)
        16     …  the compressed body

Which one is in the record: its ``length`` (the bytes the block occupies in its slot) is
``block_bytes`` for a raw block and less for a frame (a block is framed only when that saves at least
``tieredkv.codec.MIN_SAVING`` of it). So every record says how its block is stored and the frame says
with which codec: a directory written with compression reads correctly in a process configured without
it, a directory written before compression existed (every length is ``block_bytes``) reads as before,
and both kinds mix freely in one tier. A tieredkv from before compression takes a record whose length
is not ``block_bytes`` for a damaged one: a miss, never wrong bytes.

Checksums cover the stored bytes (the frame, header included), not the raw block: a damaged frame is
caught before the decompressor sees it (blosc2 decompresses a flipped byte into wrong bytes without a
word, and trusts the sizes in its header), the codec byte and raw length are covered too, and hashing
the smaller frame costs less. So a framed block is checked on every read whatever ``verify`` says; its
decompressed size is checked as well.

In a tier of full slots compression saves disk reads and writes (the bytes past a frame are never
read), not capacity. A compact tier (``WarmTier(slot_fraction=...)``, meta format version 2) has slots
smaller than a block, so its capacity is ``1 / slot_fraction`` times the blocks in the same disk space:
every block in it is a frame no longer than the slot (a length above ``slot_bytes`` is a damaged
record), and a block that does not compress into a slot is refused at ``put_many`` (``NO_SPACE``,
counted as ``too_big``) before a slot is claimed for it: nothing is evicted or written for it. bf16 KV
of a real model compresses to 0.68-0.72 of its bytes with "zstd" (docs/benchmarks.md), so slots of
0.75 hold every such block.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import xxhash

from tieredkv import codec as cd
from tieredkv.errors import MissingDependency
from tieredkv.warm.slabs import Slabs

FRAME = struct.Struct("<4sB3xQ")
MAGIC = b"TKVZ"


def valid_length(lengths: np.ndarray, block_bytes: int, slot_bytes: int | None = None) -> np.ndarray:
    """Bool per record length: a raw block (``block_bytes``) or a frame with a body (shorter), and
    never longer than a slot (``slot_bytes``; a compact tier's slots are smaller than a block)."""
    frame = (lengths > FRAME.size) & (lengths < block_bytes)
    if slot_bytes is not None and slot_bytes < block_bytes:
        return frame & (lengths <= slot_bytes)
    return (lengths == block_bytes) | frame


def servable(lengths: np.ndarray, block_bytes: int, slot_bytes: int | None = None) -> np.ndarray:
    """Bool per record length: a block this process can read. Frames only where blosc2 runs here (the
    only codec the warm tier writes): a lookup does not promise blocks its load would miss."""
    raw = lengths == block_bytes
    if slot_bytes is not None and slot_bytes < block_bytes:
        raw = np.zeros(np.shape(lengths), dtype=bool)  # a compact tier holds frames only
    elif raw.all():
        return raw
    if not cd.blosc2_available():
        return raw
    return raw | valid_length(lengths, block_bytes, slot_bytes)


class Packer:
    """Frames blocks with one codec choice (``tieredkv.codec.CHOICES``, not "none").

    Raises:
        MissingDependency: the codec needs blosc2, which is not installed.
    """

    def __init__(self, name: str, block_bytes: int, dtype_bytes: int):
        self.compressor = cd.Compressor(name, dtype_bytes)
        self.name = self.compressor.name
        self.block_bytes = block_bytes

    def pack(self, row: np.ndarray) -> np.ndarray:
        """The slot contents of one block: its frame, or ``row`` itself when compression saves too little."""
        body = self.compressor.compress(row)
        if body is None or FRAME.size + len(body) >= self.block_bytes:
            return row
        frame = np.empty(FRAME.size + len(body), dtype=np.uint8)
        FRAME.pack_into(frame.data, 0, MAGIC, self.compressor.id, self.block_bytes)
        frame[FRAME.size:] = np.frombuffer(body, dtype=np.uint8)
        return frame


def unpack(stored: np.ndarray, out: np.ndarray, typesize: int) -> bool:
    """Decompress a frame (``stored``, checksum already verified) into ``out``; False if it is not a
    well-formed frame of ``out``'s length.

    Raises:
        MissingDependency: the frame's codec is not installed here.
    """
    if stored.nbytes <= FRAME.size:
        return False
    magic, codec, raw_len = FRAME.unpack_from(stored.data)
    if magic != MAGIC or codec == cd.RAW or raw_len != out.nbytes:
        return False
    return cd.decompress_into(codec, stored[FRAME.size:], out, typesize)


def pack(packer: Packer | None, rows: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """The slot contents of ``rows[idx[j]]``: frames where ``packer`` compresses them, else the rows."""
    if packer is None:
        return [rows[i] for i in idx.tolist()]
    return [packer.pack(rows[i]) for i in idx.tolist()]


def write(slabs: Slabs, packer: Packer | None, slots: np.ndarray, rows: np.ndarray,
          idx: np.ndarray, parts: list[np.ndarray] | None = None) -> tuple[list[int], np.ndarray | None, set[int]]:
    """Write ``rows[idx[j]]`` into ``slots[j]``, framed where ``packer`` compresses them.

    Args:
        parts: the slot contents, if ``pack`` made them already (each at most a slot long).

    Returns:
        ``(checksums, lengths, slabs touched)``: the xxh3_64 of each block's stored bytes and the
        lengths stored (None: every block raw, ``block_bytes``).
    """
    if parts is None:
        parts = pack(packer, rows, idx)
    sums = [xxhash.xxh3_64_intdigest(p.data) for p in parts]
    lengths = np.asarray([p.nbytes for p in parts], dtype=np.int64)
    if (lengths == rows.shape[1]).all():
        return sums, None, slabs.write(slots, rows, idx)  # runs of slots in one call each
    return sums, lengths, slabs.write_parts(slots, parts)


def read(slabs: Slabs, slots: np.ndarray, lengths: np.ndarray, expected: np.ndarray, rows: np.ndarray,
         check: np.ndarray, sink: Callable | None, typesize: int,
         group_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read blocks of which some are framed into ``rows``, a group of about ``group_bytes`` at a time:
    each slot's stored bytes are read (raw ones straight into their row, frames into a scratch row),
    hashed, frames whose checksum holds decompressed into their row, and the group handed to ``sink``.

    Args:
        slabs: the tier's slab files.
        slots, lengths, expected: each block's slot, stored length and checksum (from its record).
        rows: ``(n, block_bytes)`` uint8 destination.
        check: raw blocks to checksum (frames always are).
        sink: ``sink(i, rows)`` per group, as in ``WarmTier.get_many``.
        typesize: the KV dtype's bytes.
        group_bytes: about how many bytes to read per group.

    Returns:
        ``(complete, sums, checked, failed, lacking)``: read in full; xxh3_64 of the stored bytes of
        each checked block; which were checked; frames that do not decompress to their length
        (damaged, like a failed checksum); frames whose codec is not installed here (a miss).
    """
    n = len(slots)
    block_bytes = rows.shape[1]
    framed = lengths != block_bytes
    checked = check | framed
    complete = np.zeros(n, dtype=bool)
    sums = np.zeros(n, dtype=np.uint64)
    failed = np.zeros(n, dtype=bool)
    lacking = np.zeros(n, dtype=bool)
    per_group = max(1, group_bytes // block_bytes)
    scratch = np.empty((min(n, per_group), block_bytes), dtype=np.uint8)
    if n > per_group:
        slabs.prefetch_parts(slots, lengths)
    for b in range(0, n, per_group):
        e = min(n, b + per_group)
        bufs = [scratch[j - b, :int(lengths[j])] if framed[j] else rows[j] for j in range(b, e)]
        complete[b:e] = slabs.read_parts(slots[b:e], bufs)
        for j in range(b, e):
            if not complete[j] or not checked[j]:
                continue
            sums[j] = xxhash.xxh3_64_intdigest(bufs[j - b].data)
            if framed[j] and sums[j] == expected[j]:
                try:
                    failed[j] = not unpack(bufs[j - b], rows[j], typesize)
                except MissingDependency:
                    lacking[j] = True
        if sink is not None:
            sink(b, rows[b:e])
    return complete, sums, checked, failed, lacking
