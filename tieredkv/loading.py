"""Reading blocks out of a cache's levels into the caller's memory, and promoting what came from below.

``TieredCache.load`` hands the work to a ``Loader`` (``get_blocks`` its promotions). It reads each run
of blocks from the level that holds it: the top level's straight from the tier's memory into place (one
copy), a lower level's group by group, each group copied into place right after the level read it. A run
of the level just below the top, loaded into host memory (numpy, a CPU tensor), is needed only in place
whatever the promotion rule: the level may read every group into one small buffer of its own
(``Tier.read_through``; the warm tier's group is then still in the CPU cache when it is hashed and
placed, and a large run is split between the calling thread and the tier's helper thread), and the
blocks the rule promotes are copied from the destination into the slots the top level claims
(``promote_placed``; a large promotion, too, in two halves on two threads). Otherwise (a CUDA
destination, a level further down) a run that the rule will not promote is read the same way, and a run
to promote is read into a kept staging buffer, from which it is promoted. Only once all is in place are
the blocks read below the top level promoted into the levels above: promoting mid-load could evict this
very hit's top-level blocks before they were read (a full hot tier), cutting the restore short. The
promotion rule answers from each block's count of hits below the top level, this process's memory of the
last ``HIT_MEMORY`` keys.

A loader never refers to the cache: it is handed the levels, and the cache counts what it returns.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv import forksafe, tensors
from tieredkv.halves import Halves
from tieredkv.hit import PrefixHit
from tieredkv.keys import ChunkKeys
from tieredkv.layout import model_to_rows, page_aligned_empty
from tieredkv.levels import Level
from tieredkv.policies.promotion import PromotionRule
from tieredkv.spec import KVSpec

#: Per-process memory of hits below the top level (for ``on_nth_hit`` promotion), in keys.
HIT_MEMORY = 65536


class Loader:
    """The read path of one ``TieredCache``: its staging buffer and its promotion memory.

    Args:
        spec: the cache's spec.
        placement: where loaded blocks go (``tensors.Placement``: numpy, torch CPU or CUDA).
        promotion: the promotion rule (``tieredkv.policies.promotion``).
    """

    def __init__(self, spec: KVSpec, placement: tensors.Placement, promotion: PromotionRule):
        self.spec = spec
        self.placement = placement
        self.promotion = promotion
        self._load_lock = threading.Lock()  # one kept staging buffer (and device staging buffer)
        self._hits_lock = threading.Lock()
        forksafe.register(self)  # both unlocked in a forked child
        self._staging: np.ndarray | None = None
        self._halves = Halves("tieredkv-promote")
        self._lower_hits: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        #: Called with (the top level, the number of blocks) before a promotion puts into the top level
        #: (``WriteBehind.before_put``: blocks queued for write-behind that the put may evict are copied
        #: out first).
        self.before_put: Callable[[Level, int], None] | None = None

    def load(self, hit: PrefixHit, out: Any, levels: list[Level], by_code: dict[int, Level]) -> int:
        """Copy the hit's blocks into ``out`` (``TieredCache.load``); return how many blocks were loaded:
        the leading run read before a block was missing (evicted since the lookup, or its level closed)."""
        below = hit.blocks - hit.blocks_in(levels[0].code)
        # One kept staging buffer for blocks from lower levels, one device staging buffer.
        with self._load_lock if below or tensors.on_device(out) else contextlib.nullcontext():
            return self._load(hit, out, levels, by_code, below)

    def _load(self, hit: PrefixHit, out: Any, levels: list[Level], by_code: dict[int, Level], below: int) -> int:
        place, finish = self.placement.placer(out, hit.tokens)
        host = self.placement.host(out) if len(levels) > 1 else None
        C = self.spec.chunk_tokens
        staging = self._staging_rows(below)  # (0, block_bytes) when every block is in the top level
        staged = loaded = 0  # lower runs take consecutive staging rows: promotion reads them after the loop
        promote: list[tuple[Level, ChunkKeys, Any]] = []
        edges = np.flatnonzero(np.diff(hit.where)) + 1
        for i, j in zip([0, *edges.tolist()], [*edges.tolist(), hit.blocks]):
            level, run = by_code.get(int(hit.where[i])), hit.keys[i:j]
            if level is None:
                break  # a level closed since the lookup
            sink = functools.partial(_place_at, place, i * C, C, level is levels[0])
            if level is levels[0]:  # one copy per run of adjacent slots, straight from the tier's memory
                got = level.read_shared(run, sink)
            elif host is not None and level is levels[1]:  # one pass into place; promoted from there
                # A host placer writes only each block's own places: the level may split the read
                # between two threads.
                got = level.read_through(run, sink, staging[staged:staged + j - i], parallel=True)
                staged += j - i
                if got:
                    promote.append((level, run[:got], (host, i)))
            else:  # each group read is copied into place before the level reads the next one
                rows = staging[staged:staged + j - i]
                staged += j - i
                got, kept = self.read_below(level, run, sink, rows)
                if got and kept:
                    promote.append((level, run[:got], rows[:got]))
            loaded += got
            if got < j - i:
                break
        finish(loaded * C)
        # Promote only now: promoting mid-load could evict this very hit's top-level blocks before they
        # were read (a full hot tier), cutting the restore short.
        for level, keys, payloads in promote:
            if isinstance(payloads, tuple):  # placed in ``host`` from chunk ``first`` on
                self.promote_placed(levels, level, keys, *payloads)
            else:
                self.promote(levels, level, keys, payloads)
        return loaded

    def _staging_rows(self, n_blocks: int) -> np.ndarray:
        """``(n_blocks, block_bytes)`` rows of the kept staging buffer (call under ``_load_lock``).

        Kept and reused, never allocated per call: a fresh buffer costs a page fault per 4 KiB on
        every load. Page-aligned: the kernel's copy into a buffer 16 bytes off (where malloc puts
        large ones) runs at half speed on some CPUs (docs/benchmarks.md). It grows to the largest
        lower-level part of a hit and is released at ``close``.
        """
        need = n_blocks * self.spec.block_bytes
        if not need:
            return np.empty((0, self.spec.block_bytes), dtype=np.uint8)
        buf = self._staging
        if buf is None or buf.size < need:
            self._staging = None  # drop the old one before allocating the larger one
            buf = self._staging = page_aligned_empty(need)
        return buf[:need].reshape(n_blocks, self.spec.block_bytes)

    def promote(self, levels: list[Level], source: Level, keys: ChunkKeys, payloads: np.ndarray) -> None:
        """Copy blocks just read from ``source`` into every level above it (the top one first), per
        the promotion rule, from the bytes in hand."""
        chosen = self._promotion_chosen(keys)
        if not len(chosen):
            return
        keys, payloads = keys.take(chosen), payloads[chosen]
        for level in levels[:levels.index(source)]:
            if level is levels[0] and self.before_put is not None:
                self.before_put(level, len(keys))
            level.put(keys, payloads, why="promoted")

    def promote_placed(self, levels: list[Level], source: Level, keys: ChunkKeys, host: np.ndarray,
                       first: int) -> None:
        """``promote`` for blocks of ``source`` (the level just below the top one) that a load placed in
        ``host`` (a host array in the model layout) from chunk ``first`` on, verified: counts a hit for
        each (as ``promote``) and copies those the rule promotes out of ``host`` straight into the slots
        the top level claims (a fill, as ``store`` does). The restore itself stays one pass (no staging
        buffer written and read back), and the promotion is the one copy it must make."""
        chosen = self._promotion_chosen(keys)
        if not len(chosen):
            return
        spec, top = self.spec, levels[0]
        at = first + chosen

        def fill(data: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
            # A large promotion in two halves on two threads (disjoint slots), as the read that placed it.
            self._halves.split(len(rows), spec.block_bytes,
                               lambda a, b: model_to_rows(spec, host, at[rows[a:b]], data, slots[a:b]))

        if self.before_put is not None:
            self.before_put(top, len(chosen))
        top.put(keys.take(chosen), fill, why="promoted")

    def read_below(self, level: Level, keys: ChunkKeys, sink: Callable[[int, np.ndarray], None],
                   staging: np.ndarray) -> tuple[int, bool]:
        """Read the leading ``keys`` from a level below the top, each group handed to ``sink``.

        When the promotion rule will promote some of them, they are read into ``staging`` (``(>=
        len(keys), block_bytes)`` rows) and kept there for ``promote``; otherwise the level may read
        every group into a small buffer of its own (``Level.read_through``: the bytes go only where
        ``sink`` puts them) and the hits are counted for the rule now.

        Returns:
            ``(got, kept)``: the leading blocks read, and whether ``staging[:got]`` holds them.
        """
        if self._may_promote(keys):
            return level.read(keys, staging, sink), True
        got = level.read_through(keys, sink, staging)
        # Counted all the same (``on_nth_hit``). A block another thread's load made due meanwhile is
        # not promoted this time: its bytes were not kept.
        self._promotion_chosen(keys[:got])
        return got, False

    def _may_promote(self, keys: ChunkKeys) -> bool:
        """Whether the promotion rule would promote any of ``keys`` if they were read now (counts
        nothing: ``_promotion_chosen`` does, after the read)."""
        with self._hits_lock:
            counts = np.fromiter((self._lower_hits.get(k, 0) + 1 for k in keys), dtype=np.int64, count=len(keys))
        return bool(np.any(self.promotion.should_promote(counts)))

    def _promotion_chosen(self, keys: ChunkKeys) -> np.ndarray:
        """Count a hit below the top level for each key; return the rows the promotion rule promotes."""
        with self._hits_lock:
            counts = np.empty(len(keys), dtype=np.int64)
            for i, k in enumerate(keys):
                n = self._lower_hits.pop(k, 0) + 1
                self._lower_hits[k] = n
                counts[i] = n
            while len(self._lower_hits) > HIT_MEMORY:  # bounded, per process
                self._lower_hits.popitem(last=False)
        return np.flatnonzero(self.promotion.should_promote(counts))

    def release(self) -> None:
        """Drop the staging buffer and stop the helper thread (at ``close``)."""
        self._staging = None
        self._halves.close()


def _place_at(place: tensors.Placer, first_token: int, chunk_tokens: int, shared: bool, i: int,
              rows: np.ndarray) -> None:
    """A read's sink: rows of blocks ``i..`` of a run that starts at ``first_token`` go into place."""
    place(rows, first_token + i * chunk_tokens, shared)


