"""tieredkv: one shared copy of the KV cache of common prompt prefixes, kept across restarts.

Public names: ``KVSpec``, ``chunk_keys``, ``ChunkKeys``, the tiers (``HotTier``, ``WarmTier``), the cache
users hold (``TieredCache``) and the ``TieredKVError`` family.
"""

from tieredkv.errors import (
    CapacityError,
    CorruptState,
    FormatError,
    InvalidInput,
    InvalidName,
    InvalidPayload,
    LockTimeout,
    PermissionDenied,
    RemoteUnavailable,
    SpecMismatch,
    TieredKVError,
    WarmTierUnavailable,
)
from tieredkv.keys import ChunkKeys, chunk_keys
from tieredkv.spec import KVSpec
from tieredkv.tier import Evicted, PutResult, Tier, TierStats

__version__ = "0.1.0"

_LAZY = {
    "HotTier": "tieredkv.hot",
    "WarmTier": "tieredkv.warm",
    "RemoteTier": "tieredkv.remote",
    "TieredCache": "tieredkv.cache",
    "PrefixHit": "tieredkv.hit",
}


def __getattr__(name: str):
    # The tiers pull in posix_ipc / lmdb; import them on first use so `import tieredkv` stays light.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["CapacityError", "ChunkKeys", "CorruptState", "Evicted", "FormatError", "HotTier", "InvalidInput",
           "InvalidName", "InvalidPayload", "KVSpec", "LockTimeout", "PermissionDenied", "PrefixHit",
           "PutResult", "RemoteTier", "RemoteUnavailable", "SpecMismatch", "Tier", "TierStats", "TieredCache",
           "TieredKVError", "WarmTier", "WarmTierUnavailable", "chunk_keys"]
