"""The remote tier: a store shared by the hosts of a fleet (Valkey over RESP, or Mooncake Store).

See ``tieredkv.remote.tier`` for the tier, ``tieredkv.remote.value`` for the value format and
``tieredkv.remote.store`` for the store clients.
"""

from tieredkv.remote.store import Store, open_store, parse_url
from tieredkv.remote.tier import RemoteTier

__all__ = ["RemoteTier", "Store", "open_store", "parse_url"]
