"""TieredCache as a loop over levels: a fourth tier plugs in with one LevelConfig, options are checked once.

The fourth level here is ``MemoryTier`` (tieredkv/memory.py, also in the contract suite): the cache's
lookup, load and store were not edited for it, and these tests prove it is asked, read, written by
its admission rule and promoted from like the standard levels.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import kv_for, same_bytes
from tieredkv import InvalidInput, KVSpec, TieredCache, chunk_keys
from tieredkv.config import CacheConfig, HotConfig, LevelConfig, RemoteConfig, WarmConfig
from tieredkv.memory import MemoryTier

SPEC = KVSpec(model_id="test/levels", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)
B = SPEC.block_bytes


def prompt(n_chunks: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n_chunks * SPEC.chunk_tokens + 1)


def memory_level(write: str = "on_evict", capacity_blocks: int = 64, **kw) -> LevelConfig:
    return LevelConfig("memory", lambda spec, on_evict: MemoryTier(spec, capacity_blocks, on_evict=on_evict),
                       write=write, **kw)


def restored(cache: TieredCache, tokens: np.ndarray, n: int) -> bool:
    hit = cache.lookup(tokens)
    out = np.zeros((2, 2, 2, len(tokens), 8), np.float16)
    return cache.load(hit, out) == n and same_bytes(out[:, :, :, :n], kv_for(SPEC, tokens)[:, :, :, :n])


def test_a_fourth_level_gets_what_warm_evicts_serves_it_and_promotes_it(tmp_path, seg_name):
    """hot (8 slots) -> warm (write-through, 8 slots) -> memory (on_evict from warm): blocks that
    leave both local tiers are found in the fourth level, loaded byte-exact and promoted back up."""
    cfg = CacheConfig(hot=HotConfig(blocks=8, name=seg_name),
                      warm=WarmConfig(tmp_path / "warm", bytes=8 * 4096 + 8 * B, write="write_through"),
                      levels=(memory_level(),))
    with TieredCache(SPEC, cfg) as cache:
        assert [lv.name for lv in cache.levels] == ["hot", "warm", "memory"]
        first = prompt(6, seed=1)
        cache.store(first, kv_for(SPEC, first))
        for seed in range(2, 6):  # push the first prompt out of hot and warm
            other = prompt(6, seed=seed)
            cache.store(other, kv_for(SPEC, other))
        hit = cache.lookup(first)
        assert hit.blocks_in(3) >= 1, hit.where  # the fourth level's code
        assert hit.tokens == 6 * SPEC.chunk_tokens
        assert restored(cache, first, 24)
        stats = cache.stats()
        mine = stats["memory"]["cache"]  # two lookups counted: the one above and restored's
        n = hit.blocks_in(3)
        assert mine["memory_hit_tokens"] == 2 * n * 4 and mine["memory_bytes_read"] == n * B
        assert mine["memory_demotions"] >= hit.blocks_in(3) and stats["memory"]["puts"] >= hit.blocks_in(3)
        again = cache.lookup(first)
        assert again.blocks_in(3) == 0 and again.tokens == 24  # promoted into hot (and warm)


def test_a_fourth_level_written_behind_at_store_and_flushed_at_close(seg_name):
    tier_box = []

    def open_memory(spec, on_evict):
        tier_box.append(MemoryTier(spec, 64, on_evict=on_evict))
        return tier_box[0]

    level = LevelConfig("memory", open_memory, write="write_behind", queue_blocks=4)  # a 4-block queue
    with TieredCache(SPEC, CacheConfig(hot=HotConfig(blocks=16, name=seg_name), levels=(level,))) as cache:
        assert cache.level("memory").writer is not None
        tokens = prompt(10, seed=7)
        keys = chunk_keys(SPEC, tokens[:40])
        assert cache.store(tokens, kv_for(SPEC, tokens)) == 10
        assert cache.flush(10.0)
        counted = cache.stats()["memory"]["cache"]
        # In jobs of at most 4 blocks; a job that finds the queue full is dropped and counted.
        assert counted["memory_queued_blocks"] + counted["memory_dropped_blocks"] == 10
        assert tier_box[0].contains_many(keys).sum() == counted["memory_queued_blocks"] >= 4
        assert counted["memory_bytes_written"] == counted["memory_queued_blocks"] * B
        cache.hot.remove(keys[:2])
        assert cache.lookup(tokens).where[:2].tolist() == [3, 3] and restored(cache, tokens, 40)
    assert tier_box[0].stats  # closed with the cache
    with pytest.raises(InvalidInput, match="closed"):
        tier_box[0].match(keys)


def test_observers_see_stores_and_evictions_per_level(tmp_path, seg_name):
    events = []
    cfg = CacheConfig(hot=HotConfig(blocks=4, name=seg_name),
                      warm=WarmConfig(tmp_path / "warm", bytes=64 * 4096 + 64 * B, write="on_evict"))
    with TieredCache(SPEC, cfg) as cache:
        cache.observers.append(lambda event, level, keys: events.append((event, level, len(keys))))
        a, b = prompt(4, seed=1), prompt(4, seed=2)
        cache.store(a, kv_for(SPEC, a))
        cache.store(b, kv_for(SPEC, b))  # evicts a's 4 blocks from hot into warm
    assert ("stored", "hot", 4) in events
    assert ("evicted", "hot", 4) in events and ("stored", "warm", 4) in events


# ---- one configuration, checked once, in the caller's words (issue 19 item 15, issue 20 item 2) ----------
def test_warm_flush_s_inf_is_refused_at_construction(tmp_path, seg_name):
    """Regression: ``warm_flush_s=inf`` was accepted, then made ``close()`` raise (and lose the queue)."""
    with pytest.raises(InvalidInput, match=r"warm_flush_s must be a finite number of seconds"):
        TieredCache(SPEC, hot_bytes=1 << 20, hot_name=seg_name, warm_dir=tmp_path / "w", warm_bytes="8M",
                    warm_flush_s=float("inf"))
    with pytest.raises(InvalidInput, match=r"WarmConfig\.flush_s must be a finite"):
        WarmConfig(tmp_path / "w", "8M", flush_s=float("inf"))


@pytest.mark.parametrize("url,msg", [
    ("valkey://127.0.0.1:6399?deadline_ms=inf", "deadline_ms=inf must be a finite number"),
    ("valkey://127.0.0.1:6399?min_mb_per_s=inf", "min_mb_per_s=inf must be a finite number"),
    ("valkey://" + "h" * 70 + ":6399", "is not a host name"),
], ids=["deadline_ms-inf", "min_mb_per_s-inf", "70-character-host"])
def test_remote_url_options_that_would_fail_every_lookup_are_refused_at_construction(seg_name, url, msg):
    """Regression: these URLs were accepted, then every lookup raised."""
    with pytest.raises(InvalidInput, match=msg):
        TieredCache(SPEC, hot_bytes=1 << 20, hot_name=seg_name, remote=url)
    assert not os.path.exists("/dev/shm" + seg_name)  # checked before any tier was opened


@pytest.mark.parametrize("kwargs,msg", [
    ({"remote_queue_blocks": 0}, r"remote_queue_blocks must be a positive integer"),
    ({"remote_flush_s": True}, r"remote_flush_s must be a finite number of seconds"),
    ({"warm_flush_s": True}, r"warm_flush_s must be a finite number of seconds"),
    ({"warm_queue_bytes": "lots"}, r"warm_queue_bytes must be a byte count"),
    ({"lock_timeout_s": float("inf")}, r"lock_timeout_s must be a positive, finite number of seconds"),
    ({"demotion": "sometimes"}, r"demotion: "),
    ({"promotion": "on_nth_hit:x"}, r"promotion: "),
    ({"hot_bytes": "8 parsecs"}, r"hot_bytes must be a byte count"),
    ({"hot_size": "8G"}, r"unknown TieredCache option\(s\) \['hot_size'\]"),
    ({"remote_queue_blocks": 8, "remote_queue_bytes": "8M"}, "give remote_queue_blocks or remote_queue_bytes"),
])
def test_every_option_is_checked_at_construction_under_the_callers_name(tmp_path, seg_name, kwargs, msg):
    base = {"hot_bytes": 1 << 20, "hot_name": seg_name, "warm_dir": tmp_path / "w", "warm_bytes": "8M",
            "remote": "valkey://127.0.0.1:6399"}
    with pytest.raises(InvalidInput, match=msg):
        TieredCache(SPEC, **{**base, **kwargs})
    assert not os.path.exists("/dev/shm" + seg_name) and not (tmp_path / "w").exists()


def test_sizes_accept_unit_strings_everywhere_and_the_config_is_normalised(tmp_path):
    cfg = CacheConfig.from_kwargs(hot_bytes="64M", warm_dir=tmp_path, warm_bytes="1.5G", warm_queue_bytes="16M",
                                  remote="valkey://127.0.0.1:6399", remote_queue_bytes="4M")
    assert (cfg.hot.bytes, cfg.warm.bytes, cfg.warm.queue_bytes) == (64 << 20, 3 << 29, 16 << 20)
    assert cfg.remote.max_blocks(1 << 20) == 4 and RemoteConfig("valkey://h:1").max_blocks(1 << 20) == 256
    with pytest.raises(AttributeError):
        cfg.hot.bytes = 1  # frozen
    # A config and keywords together: the keywords replace its fields.
    over = CacheConfig.from_kwargs(cfg, warm_flush_s=3, remote=None)
    assert over.warm.flush_s == 3.0 and over.warm.bytes == 3 << 29 and over.remote is None


def test_options_of_an_absent_tier_are_still_checked(seg_name):
    with pytest.raises(InvalidInput, match="warm_flush_s"):
        TieredCache(SPEC, hot_bytes=1 << 20, hot_name=seg_name, warm_dir=None, warm_flush_s=-1)
    with TieredCache(SPEC, hot_bytes=1 << 20, hot_name=seg_name, warm_dir=None, warm_bytes="8M") as cache:
        assert cache.warm is None  # warm_bytes without warm_dir: no warm tier, as before


def test_the_positional_form_of_earlier_versions_still_works(tmp_path, seg_name):
    with TieredCache(SPEC, 1 << 20, tmp_path / "w", 8 << 20, "lru", hot_name=seg_name) as cache:
        assert cache.warm is not None and cache.config.warm.bytes == 8 << 20
    with pytest.raises(InvalidInput, match="both by position and by keyword"):
        TieredCache(SPEC, 1 << 20, hot_bytes=1 << 20)


def test_a_level_name_and_position_are_checked():
    with pytest.raises(InvalidInput, match="LevelConfig.name"):
        LevelConfig("warm", lambda spec, on_evict: None)
    with pytest.raises(InvalidInput, match=r"LevelConfig.after='nvme' names no level"):
        CacheConfig(levels=(memory_level(after="nvme"),))
    with pytest.raises(InvalidInput, match="LevelConfig.write"):
        memory_level(write="sometimes")
