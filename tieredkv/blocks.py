"""Whole-block calls on a ``TieredCache`` for engines that name blocks themselves (SGLang's page hashes).

``TieredCache.lookup/load/store`` take token ids and model-layout tensors; an engine whose keys already
chain the prefix and whose pages are opaque bytes needs only three calls over ``opaque_keys``:

```
match(cache, keys)                -> leading blocks resident in hot or warm
read(cache, keys, sink)           -> leading blocks handed to sink(i, rows): hot rows straight from
                                     shared memory, warm rows from a staging buffer (then promoted)
write(cache, keys, payloads)      -> per block: held by the cache afterwards (hot, and warm per the
                                     cache's demotion rule)
```

Each goes through the cache's own paths (promotion rule, write-behind, journal), so an engine here
and a token-keyed engine on the same host see the same tiers behave the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tieredkv.cache import HOT, WARM, TieredCache
from tieredkv.journal import STORED
from tieredkv.keys import ChunkKeys
from tieredkv.tier import PutResult

#: ``sink(i, rows)``: ``rows`` (``(k, block_bytes)`` uint8) are blocks ``i .. i+k-1`` of the call's keys;
#: valid only during the call (hot rows are views of shared memory).
Sink = Callable[[int, np.ndarray], None]


def match(cache: TieredCache, keys: ChunkKeys) -> np.ndarray:
    """Where each block of the leading resident run is (``HOT``/``WARM``); its length is the run."""
    where = np.full(len(keys), -1, dtype=np.int8)
    if not len(keys):
        return where
    where[cache.hot.contains_many(keys)] = HOT
    missing = np.flatnonzero(where < 0)
    warm = cache.warm
    if len(missing) and warm is not None:
        found = cache._warm_call(lambda: warm.contains_many(keys.take(missing)),
                                 default=np.zeros(len(missing), dtype=bool))
        where[missing[np.asarray(found, dtype=bool)]] = WARM
    run = int(np.argmin(where >= 0)) if (where < 0).any() else len(where)
    return where[:run]


def read(cache: TieredCache, keys: ChunkKeys, sink: Sink) -> tuple[int, int]:
    """Hand the leading run of ``keys`` the tiers hold to ``sink``, hot first, then warm.

    Returns:
        ``(hot, warm)``: how many of the leading blocks came from each tier; the run is their sum.
        Warm blocks read are promoted to hot per the cache's promotion rule.
    """
    done = hot_n = warm_n = 0
    n = len(keys)
    while done < n:
        def shifted(i: int, rows: np.ndarray, at: int = done) -> None:
            sink(at + i, rows)

        got = cache.hot.read_runs(keys[done:], shifted)
        done += got
        hot_n += got
        warm = cache.warm
        if done >= n or warm is None:
            break
        rest = keys[done:]
        staging = np.empty((len(rest), cache.spec.block_bytes), dtype=np.uint8)
        got = cache._warm_call(lambda w=warm, r=rest, s=staging: w.get_many(r, s), default=0)
        if not got:
            break
        sink(done, staging[:got])
        cache._promote(rest[:got], staging[:got])
        done += got
        warm_n += got
    return hot_n, warm_n


def write(cache: TieredCache, keys: ChunkKeys, payloads: np.ndarray) -> np.ndarray:
    """Store ``payloads`` (``(n, block_bytes)`` uint8, owned by this call: a write-behind queue keeps
    them) under ``keys``. Returns a bool per block: the cache holds it now (stored, or already there).
    """
    codes = cache.hot.put_many(keys, payloads)
    cache._journal(STORED, HOT, keys, codes)
    ok = codes != PutResult.NO_SPACE
    warm = cache.warm
    if warm is None:
        return ok
    if cache.demotion.at_store:
        to_warm = np.flatnonzero(codes == PutResult.STORED) if cache._writer is not None else np.arange(len(keys))
    else:
        to_warm = np.flatnonzero(codes == PutResult.NO_SPACE)  # did not fit in hot at all
    if len(to_warm):
        wkeys, wpayloads = keys.take(to_warm), payloads[to_warm]
        if cache._writer is not None and cache.demotion.at_store:
            cache._write_behind(wkeys, wpayloads, None)
            ok[to_warm] = True
        else:
            wcodes = cache._warm_call(lambda: warm.put_many(wkeys, wpayloads), default=None)
            if wcodes is not None:
                cache._journal(STORED, WARM, wkeys, wcodes)
                ok[to_warm] = wcodes != PutResult.NO_SPACE
    return ok
