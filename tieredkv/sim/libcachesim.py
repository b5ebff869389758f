"""libCacheSim's counterparts of our eviction policies, with the parameters that make them decide alike.

One mapping for the agreement test and the simulator benchmark, so the two never drift apart. The
parameters are what libCacheSim's own implementations use for the same algorithms: S3-FIFO with a
10% small queue, a ghost of 90% of the capacity and a move-to-main threshold of 2 hits; CLOCK with one
reference bit starting at 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Policies whose block hit ratio equals libCacheSim's on unit-size traces (LFU breaks ties differently).
MATCHING = ("lru", "fifo", "clock", "sieve", "s3fifo", "arc")


def factories(lcs: Any, **common: Any) -> dict[str, Callable[[int], Any]]:
    """``name -> (capacity -> libCacheSim cache)`` for the imported ``libcachesim`` module ``lcs``.

    Args:
        lcs: the module.
        **common: parameters every libCacheSim cache takes, e.g. ``hashpower=18`` (its hash table
            starts with 2**hashpower buckets; the default, 24, costs ~0.2 s per cache to allocate).
    """
    return {
        "lru": lambda c: lcs.LRU(c, **common),
        "fifo": lambda c: lcs.FIFO(c, **common),
        "clock": lambda c: lcs.Clock(c, init_freq=0, n_bit_counter=1, **common),
        "sieve": lambda c: lcs.Sieve(c, **common),
        "s3fifo": lambda c: lcs.S3FIFO(c, small_size_ratio=0.1, ghost_size_ratio=0.9, move_to_main_threshold=2,
                                       **common),
        "arc": lambda c: lcs.ARC(c, **common),
        "lfu": lambda c: lcs.LFU(c, **common),
    }
