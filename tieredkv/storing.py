"""Writing new blocks into a cache's levels: the top level now, the levels below at store or later.

``TieredCache.store`` and ``put_blocks`` hand the work to a ``Storer``. It finds the blocks no level
holds (``new_blocks``), puts them into the top level (gathered straight into the slots it claims, no copy
of ours), writes them through to the lower levels that admit blocks at store and write in the caller's
thread (a bounded staging buffer's worth at a time), hands the levels with a writer to write-behind
(``tieredkv.writeback``: the writer copies the blocks out of the top level later), and gives the blocks
the top level had no room for to the levels below that take them.

A storer never refers to the cache: it is handed the levels, and counts stored blocks on the cache's
counters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tieredkv import writeback
from tieredkv.keys import ChunkKeys
from tieredkv.layout import model_to_rows
from tieredkv.levels import Counting, Level
from tieredkv.spec import KVSpec
from tieredkv.tier import PutResult

#: ``gather(idx, rows)``: write blocks ``new[idx]`` into ``rows`` (for the levels below the top one).
Gather = Callable[[np.ndarray, np.ndarray], None]


class Storer:
    """The write path of one ``TieredCache``: its staging rows and its write-behind jobs.

    Args:
        spec: the cache's spec.
        counting: the cache's counters (``stored_blocks``).
    """

    def __init__(self, spec: KVSpec, counting: Counting):
        self.spec = spec
        self._counting = counting
        # Bounded, reused: blocks written through are gathered into these a group at a time.
        self._rows = writeback.Staging(spec.block_bytes, keep=2)
        #: The jobs of written-behind levels (``WriteBehind.before_put`` before a put into the top level).
        self.behind = writeback.WriteBehind(spec.block_bytes)

    def new_blocks(self, levels: list[Level], keys: ChunkKeys, skip: int) -> np.ndarray:
        """Positions from ``skip`` on of the blocks no level holds that a store would write again: not
        in the top level, nor in a local level that holds what the top one evicted."""
        todo = skip + np.flatnonzero(~levels[0].contains(keys[skip:])) if len(keys) > skip else np.zeros(0, int)
        for level in levels[1:]:
            if level.exclusive and len(todo):
                todo = todo[~level.contains(keys.take(todo))]
        return todo

    def store_model(self, levels: list[Level], keys: ChunkKeys, todo: np.ndarray, src: Any) -> np.ndarray:
        """Store blocks ``keys[todo]`` read out of ``src``, a host array in the model's layout
        (``tensors.host_source``). Returns the top level's ``PutResult`` codes."""
        spec = self.spec

        def gather(idx: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
            # Block new[idx[j]] into rows[at[j]] (rows[j] without ``at``).
            model_to_rows(spec, src, todo[idx], rows, np.arange(len(idx)) if at is None else at)

        def fill(data: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
            gather(rows, data, slots)  # straight into the slots the top level claimed: no copy of ours

        return self.put(levels, keys.take(todo), fill, gather)

    def put(self, levels: list[Level], new: ChunkKeys, top_payloads: Any, gather: Gather) -> np.ndarray:
        """Store blocks no level holds into the top level (``top_payloads``: rows, or a fill callable,
        see ``HotTier.put_many``), into each lower level that admits them at store and writes in this
        thread, and queue them for the written-behind levels; blocks the top level has no room for go to
        the levels below it that admit them. ``gather`` writes blocks into rows for the lower levels
        (through a bounded staging buffer, or into rows queued jobs keep). Returns the top level's
        ``PutResult`` codes."""
        top = levels[0]
        self.behind.before_put(top, len(new))
        codes = top.put(new, top_payloads)  # the top level raises rather than return None
        if codes is None:
            codes = np.full(len(new), PutResult.NO_SPACE, dtype=np.int8)
        through = [level for level in levels[1:] if level.at_store and level.writer is None]
        if through:  # written through, a staging buffer's worth at a time
            with self._rows.rows(len(new)) as rows:
                for g in range(0, len(new), len(rows)):
                    idx = np.arange(g, min(g + len(rows), len(new)))
                    gather(idx, rows[:len(idx)])
                    for level in through:
                        level.put(new[g:g + len(idx)], rows[:len(idx)])
        full = np.flatnonzero(codes == PutResult.NO_SPACE)
        below = [level for i, level in enumerate(levels[1:], start=1)
                 if (level.at_store and level.writer is not None) or (i == 1 and not level.at_store)]
        if len(full) and below:
            # Not in the top level at all (a store larger than it), so no writer can copy them from
            # there: at-store levels with a writer, and the level below if it takes evicted blocks, get
            # rows of their own (queued jobs keep them).
            rows = np.empty((len(full), self.spec.block_bytes), dtype=np.uint8)
            gather(full, rows)
            for level in below:
                level.write(new.take(full), rows)
        self._counting.add(stored_blocks=int(np.count_nonzero(codes == PutResult.STORED)))
        self._write_behind(levels, new, codes)
        return codes

    def _write_behind(self, levels: list[Level], new: ChunkKeys, codes: np.ndarray) -> None:
        """Queue the blocks the top level holds now (stored, or there already) on each written-behind
        level's writer, which copies them out of the top level (``tieredkv.writeback``). A block there
        already (EXISTS: stored by another process, or still being written by it) is that process's to
        write behind: if it is gone when the writer comes, no drop is counted."""
        held = np.flatnonzero(codes != PutResult.NO_SPACE)
        if not len(held):
            return
        keys = new if len(held) == len(new) else new.take(held)
        ours = codes[held] == PutResult.STORED
        for level in levels[1:]:
            if level.at_store and level.writer is not None:
                self.behind.submit(level, levels[0], keys, ours=ours)

    def release(self) -> None:
        """Drop the staging rows and the write-behind buffers (``close``)."""
        self._rows.clear()
        self.behind.clear()
