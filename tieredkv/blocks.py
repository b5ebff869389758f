"""Whole-block calls on a ``TieredCache`` for engines that name blocks themselves (SGLang's page hashes).

``TieredCache.lookup/load/store`` take token ids and model-layout tensors; an engine whose keys already
chain the prefix and whose pages are opaque bytes (``tieredkv.keys.opaque_keys``) needs three calls:

```
cache.resident_run(keys)     -> per block of the leading run held by some level: its level's code
read(cache, keys, sink)      -> leading blocks handed to sink(i, rows): top-level rows straight from
                                shared memory, lower ones from a staging buffer (then promoted) or,
                                when none will be promoted, from the level's own small buffer
cache.put_blocks(keys, rows) -> per block: held by some level afterwards (as ``store`` places blocks)
```

Each goes through the cache's levels (their admission and promotion rules, background writers, failure
handling and observers), so an engine here and a token-keyed engine on the same host see the same
tiers behave the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from tieredkv.cache import TieredCache
from tieredkv.keys import ChunkKeys

#: ``sink(i, rows)``: ``rows`` (``(k, block_bytes)`` uint8) are blocks ``i .. i+k-1`` of the call's keys;
#: valid only during the call (top-level rows are views of shared memory).
Sink = Callable[[int, np.ndarray], None]


def read(cache: TieredCache, keys: ChunkKeys, sink: Sink) -> dict[str, int]:
    """Hand the leading run of ``keys`` the levels hold to ``sink``, each block from the first level
    that has it. Blocks read below the top level are promoted per the cache's promotion rule, once
    the whole run has been read.

    Returns:
        How many of the leading blocks came from each level, by level name; the run is their sum.
    """
    levels = list(cache.levels)
    by_level = {level.name: 0 for level in levels}
    done, n = 0, len(keys)
    # Promoted once the read is over, as ``load`` does: promoted at once, a run read from below could
    # evict this same read's later blocks from the top level (with a full top level, each block then
    # goes round through the lower one, read after read).
    promotions = []
    while done < n:
        got = levels[0].read_shared(keys[done:], functools.partial(_shifted, sink, done))
        done += got
        by_level[levels[0].name] += got
        progress = got
        for level in levels[1:]:
            if done >= n:
                break
            rest = keys[done:]
            staging = np.empty((len(rest), cache.spec.block_bytes), dtype=np.uint8)
            got, kept = cache._loader.read_below(level, rest, functools.partial(_shifted, sink, done), staging)
            if got:
                if kept:
                    promotions.append((level, rest[:got], staging[:got]))
                done += got
                by_level[level.name] += got
                progress += got
                break  # back to the top: the next blocks may be there
        if not progress:
            break
    for level, promoted, rows in promotions:
        cache._loader.promote(levels, level, promoted, rows)
    return by_level


def _shifted(sink: Sink, at: int, i: int, rows: np.ndarray) -> None:
    sink(at + i, rows)
