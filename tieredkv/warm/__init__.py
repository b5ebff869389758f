"""The warm tier: preallocated slab files on SSD plus an LMDB index that survives restarts.

See ``tier.py`` for the protocol and docs/warm-tier.md for the on-disk format and guarantees.
"""

from tieredkv.warm.tier import SYNC_MODES, VERIFY_MODES, WarmTier

__all__ = ["SYNC_MODES", "VERIFY_MODES", "WarmTier"]
