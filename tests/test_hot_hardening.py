"""Hot tier under attack: dead writers, damaged derived structures, interrupts, hostile segments.

Each test reproduces one way the hot tier was broken (issue 11 of the tracker) on real processes,
real signals and real shared-memory bytes, and checks the outcome the fix promises.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from helpers import payload_for
from tieredkv import (CorruptState, HotTier, InvalidInput, InvalidPayload, KVSpec, PermissionDenied, PutResult,
                      chunk_keys)

FORK = mp.get_context("fork")


def prompt(spec, seed, n_chunks):
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens))


def _write_then_hang(spec, name, keys, ready):
    tier = HotTier(spec, name=name, policy=None, create=False)

    def hang():
        ready.set()
        time.sleep(3600)

    tier._hooks["write"] = hang
    tier.put_many(keys, payload_for(spec, keys))


def _kill_mid_write(spec, name, keys):
    ready = FORK.Event()
    p = FORK.Process(target=_write_then_hang, args=(spec, name, keys, ready))
    p.start()
    assert ready.wait(30), "child never reached the write"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL


# ---- item 11: a dead writer's WRITING slot --------------------------------------------------------
def test_a_prefix_whose_writer_died_mid_copy_can_be_stored_again(tiny_spec, seg_name):
    """Plenty of free room (no eviction pass would ever reclaim the dead claim): the next store of
    the same prefix must reclaim the dead writer's slots and store, not answer EXISTS forever."""
    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        keys = prompt(tiny_spec, 11, 4)
        _kill_mid_write(tiny_spec, seg_name, keys)
        assert tier.slot_census()["writing_dead"] == 4
        assert tier.match(keys) == 0
        codes = tier.put_many(keys, payload_for(tiny_spec, keys))
        assert (codes == PutResult.STORED).all(), codes
        out = np.zeros((4, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 4
        assert np.array_equal(out, payload_for(tiny_spec, keys))
        assert tier.slot_census()["writing_dead"] == 0


# ---- item 13: the full policy spec is recorded and compared ----------------------------------------
@pytest.mark.parametrize("base", ["arc", "s3fifo", "sieve", "clock", "lfu", "fifo"])
def test_prefix_aware_over_any_base_opens_and_is_compared_on_attach(tiny_spec, seg_name, base):
    spec = f"prefix_aware:{base}"
    with HotTier(tiny_spec, n_slots=16, name=seg_name, policy=spec) as tier:
        assert tier.stats().extra["policy"] == "prefix_aware"
        assert tier._policy.full_name() == spec
        keys = prompt(tiny_spec, 1, 4)
        assert (tier.put_many(keys, payload_for(tiny_spec, keys)) == PutResult.STORED).all()
        with HotTier(tiny_spec, name=seg_name, policy=spec, create=False) as again:
            assert again.match(keys) == 4
        with HotTier(tiny_spec, name=seg_name, policy=None, create=False) as again:
            assert again._policy.full_name() == spec
        with pytest.raises(InvalidInput, match="prefix_aware:lru"):
            HotTier(tiny_spec, name=seg_name, policy="prefix_aware", create=False)
        with pytest.raises(InvalidInput, match=f"uses eviction policy '{spec}'"):
            HotTier(tiny_spec, n_slots=16, name=seg_name, policy=base)


def test_a_segment_this_call_created_but_cannot_open_is_unlinked(tiny_spec, seg_name, monkeypatch):
    from tieredkv.hot import tier as hot_tier

    def broken_register(self):
        raise CorruptState("injected: registration fails")

    monkeypatch.setattr(hot_tier.HotTier, "_register", broken_register)
    with pytest.raises(CorruptState, match="injected"):
        HotTier(tiny_spec, n_slots=8, name=seg_name)
    assert not os.path.exists("/dev/shm" + seg_name)
    leftovers = [p for p in os.listdir("/dev/shm") if p.startswith(f"tieredkv-tmp-{os.getpid()}-")]
    assert not leftovers


# ---- items 16 and 17 (hot part): modes and arguments -------------------------------------------------
def test_a_widened_segment_is_refused_and_set_id_modes_are_bad_input(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=8, name=seg_name):
        os.chmod("/dev/shm" + seg_name, 0o666)
        with pytest.raises(PermissionDenied, match="mode 0o666"):
            HotTier(tiny_spec, name=seg_name, create=False)
    for bad in (0o4777, 0o2700, 0o1600, 0o666, 0o400, -1, "rw", 0o600 + 0.5, True):
        with pytest.raises(InvalidInput, match="mode"):
            HotTier(tiny_spec, n_slots=8, name=seg_name + "x", mode=bad)
    assert not os.path.exists("/dev/shm" + seg_name + "x")


@pytest.mark.parametrize("kwargs, msg", [
    (dict(capacity_bytes="8M"), "capacity_bytes must be a positive integer"),
    (dict(capacity_bytes=8.0e6), "capacity_bytes must be a positive integer"),
    (dict(n_slots="8"), "n_slots must be a positive integer"),
    (dict(n_slots=8, lock_timeout_s="x"), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, lock_timeout_s=float("nan")), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, lock_timeout_s=-1), "lock_timeout_s must be a positive"),
    (dict(n_slots=8, mode="rw"), "mode must be permission bits"),
])
def test_bad_hot_tier_arguments_are_invalid_input_naming_them(tiny_spec, seg_name, kwargs, msg):
    with pytest.raises(InvalidInput, match=msg):
        HotTier(tiny_spec, name=seg_name, **kwargs)
    assert not os.path.exists("/dev/shm" + seg_name)


def test_attach_only_to_a_missing_segment_is_invalid_input(tiny_spec, seg_name):
    with pytest.raises(InvalidInput, match="does not exist; create=False only attaches"):
        HotTier(tiny_spec, name=seg_name, create=False)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(hot_bytes="8M"), "hot_bytes must be a positive integer"),
    (dict(hot_bytes=1 << 20, lock_timeout_s="x"), "lock_timeout_s must be a positive"),
    (dict(hot_blocks=True), "hot_blocks must be a positive integer"),
])
def test_bad_tiered_cache_arguments_are_invalid_input_naming_them(tiny_spec, seg_name, kwargs, msg):
    from tieredkv import TieredCache

    with pytest.raises(InvalidInput, match=msg):
        TieredCache(tiny_spec, hot_name=seg_name, **kwargs)


def test_meta_requires_grad_and_overlapping_outputs_are_invalid_payloads(tiny_spec, seg_name):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from tieredkv import TieredCache

    tokens = np.arange(17)
    kv = np.random.default_rng(0).standard_normal((2, 2, 1, 16, 8)).astype(np.float32)
    with TieredCache(tiny_spec, hot_bytes=1 << 20, hot_name=seg_name) as cache:
        cache.store(tokens, kv)
        hit = cache.lookup(tokens)
        assert hit.tokens == 16
        with pytest.raises(InvalidPayload, match="meta device"):
            cache.store(tokens, torch.zeros(2, 2, 1, 16, 8, device="meta"))
        with pytest.raises(InvalidPayload, match="meta device"):
            cache.load(hit, torch.zeros(2, 2, 1, 16, 8, device="meta"))
        with pytest.raises(InvalidPayload, match="requires grad"):
            cache.load(hit, torch.zeros(2, 2, 1, 16, 8, requires_grad=True))
        base = torch.zeros(2 * 2 * 16 * 8)
        overlapping = torch.as_strided(base, (2, 2, 1, 16, 8), (128, 64, 0, 4, 1))  # tokens overlap
        with pytest.raises(InvalidPayload, match="overlapping strides"):
            cache.load(hit, overlapping)
        np_base = np.zeros(2 * 2 * 16 * 8, np.float32)
        np_overlapping = np.lib.stride_tricks.as_strided(np_base, (2, 2, 1, 16, 8), (512, 256, 0, 16, 4))
        with pytest.raises(InvalidPayload, match="overlapping strides"):
            cache.load(hit, np_overlapping)
        # What is fine still works: a transposed (non-contiguous, non-overlapping) tensor, and a
        # tensor that requires grad given as a detached view.
        out = torch.zeros(2, 2, 16, 1, 8).transpose(2, 3)
        assert cache.load(hit, out) == 16
        assert np.array_equal(out.numpy(), kv)
        grad = torch.zeros(2, 2, 1, 16, 8, requires_grad=True)
        assert cache.load(hit, grad.detach()) == 16
