"""Eviction, promotion and demotion policies (installed as ``tieredkv.policies``).

Policies see only the struct-of-arrays slot state (``state.SlotState``), never a tier, so the same code
decides in the hot tier's shared memory and in the offline simulator.

Eviction policies by name (``make("s3fifo")``, ``make("prefix_aware:arc")``): lru, fifo, lfu, clock,
sieve, s3fifo, arc, prefix_aware (wraps any of them), cost_aware, kv_aware. Tier movement rules:
``promotion.make("on_nth_hit:2")``, ``demotion.make("write_through")``.
"""

from . import arc, clock, cost_aware, demotion, fifo, kv_aware, lfu, lru, prefix_aware, promotion, s3fifo, sieve  # noqa: F401  (register)
from .base import (
    ENTRY_POINT_GROUP,
    EvictionPolicy,
    UnknownPolicy,
    evict,
    hit,
    import_policy,
    insert,
    make,
    names,
    register,
    remove,
)
from .state import SlotState, StateLayout

__all__ = ["ENTRY_POINT_GROUP", "EvictionPolicy", "SlotState", "StateLayout", "UnknownPolicy", "demotion", "evict",
           "hit", "import_policy", "insert", "make", "names", "promotion", "register", "remove"]
