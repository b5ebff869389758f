"""The hot tier: block slots in one POSIX shared-memory segment per namespace."""

from tieredkv.hot.tier import HotTier

__all__ = ["HotTier"]
