"""Write-behind copies blocks out of the hot tier (``tieredkv.writeback``): a store keeps no copy of its
blocks once it returned, the writer's reads are not counted as hits, and a block evicted before the
writer reached it is written from a rescue copy (this process's eviction) or dropped and counted
(another process's), never written wrong."""

from __future__ import annotations

import gc
import threading
import tracemalloc
import warnings

import numpy as np
import pytest

from helpers import kv_for
from tieredkv import KVSpec, TieredCache, chunk_keys, policies
from tieredkv.hot import segment as seg
from tieredkv.writeback import STAGE_BYTES

SPEC = KVSpec(model_id="test/writeback", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
MiB = 1 << 20


def prompt(seed: int, blocks: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, blocks * SPEC.chunk_tokens + 1)


def hot_bytes_for(spec: KVSpec, slots: int) -> int:
    engine = policies.make("lru")
    return seg.Layout.compute(spec, slots, policies.StateLayout.for_policy(engine, slots).nbytes).total_bytes


def warm_blocks_are_right(cache: TieredCache, seeds: list[int], blocks: int = 4) -> list[int]:
    """Per prompt, how many of its blocks the warm tier holds; asserts each held block has its own bytes."""
    held = []
    for seed in seeds:
        tokens = prompt(seed, blocks)
        keys = chunk_keys(SPEC, tokens[:blocks * SPEC.chunk_tokens])
        present = cache.warm.contains_many(keys)
        want = kv_for(SPEC, tokens)
        for b in np.flatnonzero(present).tolist():
            out = np.zeros((1, SPEC.block_bytes), np.uint8)
            assert cache.warm.get_many(keys[b:b + 1], out) == 1
            block = np.ascontiguousarray(want[:, :, :, 4 * b:4 * b + 4, :]).tobytes()
            assert out[0].tobytes() == block, (seed, b)
        held.append(int(present.sum()))
    return held


@pytest.fixture
def stuck_first_put(monkeypatch):
    """Make the first warm write of a cache wait until released (a slow disk): later jobs stay queued."""
    def arm(cache: TieredCache) -> tuple[threading.Event, threading.Event]:
        started, release = threading.Event(), threading.Event()
        real_put = cache.warm.put_many

        def put(keys, payloads):
            if not started.is_set():
                started.set()
                assert release.wait(60)
            return real_put(keys, payloads)

        monkeypatch.setattr(cache.warm, "put_many", put)
        return started, release
    return arm


def test_a_store_keeps_no_copy_of_its_blocks_once_written_behind(tmp_path, seg_name):
    """A store of 24 MiB through write-behind: once the writer is done, what the process still holds
    is at most its two bounded staging buffers (the store's and the writer's), not the store's size
    (before: the whole payload buffer was kept for the next store)."""
    spec = KVSpec(model_id="test/writeback-mem", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                  chunk_tokens=16)  # 64 KiB blocks
    cache = TieredCache(spec, hot_bytes=48 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=64 * MiB)
    try:
        warm_up = np.arange(16 * 4 + 1)  # imports and first-use costs: not measured
        cache.store(warm_up, kv_for(spec, warm_up))
        assert cache.flush(60)
        tokens = np.random.default_rng(1).integers(0, 30_000, 16 * 384 + 1)  # 384 blocks, 24 MiB
        kv = kv_for(spec, tokens)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            assert cache.store(tokens, kv) == 384
            assert cache.flush(60)
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert cache.stats()["warm_bytes_written"] >= 384 * spec.block_bytes
        assert kept < 2 * STAGE_BYTES + MiB, f"the process keeps {kept / MiB:.1f} MiB after a 24 MiB store"
    finally:
        cache.close()


def test_the_writers_reads_are_not_hits(tmp_path, seg_name):
    """Copying blocks out of the hot tier for the warm write is not a request's read: the hot tier
    counts no hit, and a block read once by a request has one hit (on_nth_hit rules and LFU-like
    policies count them)."""
    cache = TieredCache(SPEC, hot_bytes=8 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB)
    try:
        tokens = prompt(5)
        assert cache.store(tokens, kv_for(SPEC, tokens)) == 4
        assert cache.flush(60)
        assert cache.warm.stats().used_blocks == 4
        st = cache.hot.stats()
        assert (st.hits, st.misses, st.bytes_out) == (0, 0, 0)
        out = np.zeros((2, 2, 2, 17, 8), np.float16)
        assert cache.load(cache.lookup(tokens), out) == 16
        assert cache.hot.stats().hits == 4
    finally:
        cache.close()


@pytest.mark.parametrize("evictor, want_held, want_dropped", [
    ("this", [4, 4, 8], 0),   # this process's store: the queued job copies prompt 2 out first
    ("other", [4, 0, 0], 4),  # another process's (a handle this one cannot see): dropped, counted
])
def test_a_queued_block_evicted_from_hot_is_rescued_or_dropped_never_written_wrong(
        tmp_path, seg_name, stuck_first_put, evictor, want_held, want_dropped):
    """Hot holds 8 blocks. With the warm write of prompt 1 stuck (its blocks copied out already),
    prompt 2 is queued; prompt 3's store (8 blocks) evicts prompt 2's blocks from hot and reuses their
    slots before the writer reached them. Stored by this cache, the queued job copies them out first
    and warm gets all three prompts; stored by another handle of the segment (hot only), prompt 2's
    blocks are dropped and counted. Either way every block in warm holds its own bytes."""
    cache = TieredCache(SPEC, hot_bytes=hot_bytes_for(SPEC, 8), hot_name=seg_name, warm_dir=tmp_path / "warm",
                        warm_bytes=4 * MiB)
    other = TieredCache(SPEC, hot_bytes=hot_bytes_for(SPEC, 8), hot_name=seg_name)
    started, release = stuck_first_put(cache)
    try:
        for seed in (1, 2):
            tokens = prompt(seed)
            assert cache.store(tokens, kv_for(SPEC, tokens)) == 4
        assert started.wait(60)
        tokens = prompt(3, 8)
        assert (cache if evictor == "this" else other).store(tokens, kv_for(SPEC, tokens)) == 8
        assert not cache.hot.contains_many(chunk_keys(SPEC, prompt(2)[:16])).any()  # evicted from hot
        release.set()
        assert cache.flush(60)
        assert warm_blocks_are_right(cache, [1, 2]) + warm_blocks_are_right(cache, [3], 8) == want_held
        assert cache.stats()["warm_dropped_blocks"] == want_dropped
    finally:
        release.set()
        other.close()
        cache.close()


@pytest.mark.parametrize("head_dim", [8, 3])  # 128-byte blocks fill their slots; 48-byte ones are padded to 64
def test_store_builds_blocks_in_the_hot_slots_and_they_load_back_exactly(tmp_path, seg_name, head_dim):
    """``store`` gathers straight into the slots the hot tier claimed (no buffer of its own): a prompt
    stored in two calls, the second one with a gap (chunks 4-7 held already), loads back bit-exact
    from hot and, once the segment is gone, from what write-behind copied to warm."""
    spec = KVSpec(model_id=f"test/fill-{head_dim}", num_layers=1, num_kv_heads=1, head_dim=head_dim,
                  dtype="float16", chunk_tokens=4)
    tokens = np.random.default_rng(7).integers(0, 30_000, 4 * 12 + 1)
    kv = kv_for(spec, tokens)
    kw = dict(hot_bytes=4 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB)
    with TieredCache(spec, **kw) as cache:
        assert cache.store(tokens[:4 * 8], kv[:, :, :, :4 * 8], from_token=16) == 4   # chunks 4-7
        assert cache.store(tokens, kv) == 8                                           # 0-3 and 8-11
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(tokens), out) == 48
        assert out[:, :, :, :48].tobytes() == kv[:, :, :, :48].tobytes()
        assert cache.flush(60)
        cache.unlink_hot()
    with TieredCache(spec, **kw) as cache:
        hit = cache.lookup(tokens)
        assert (hit.tokens, hit.warm_blocks) == (48, 12)
        out = np.zeros_like(kv)
        assert cache.load(hit, out) == 48
        assert out[:, :, :, :48].tobytes() == kv[:, :, :, :48].tobytes()
        cache.unlink_hot()


def test_closing_the_hot_tier_with_writes_queued_still_writes_them(tmp_path, seg_name, stuck_first_put):
    """``cache.hot.unlink()`` (a simulated reboot, as in docs/quickstart.md) closes the segment while
    the writer is stuck on prompt 1 and prompt 2 is queued: the queued job copies its blocks out before
    the mapping goes, and the cache's close writes both prompts to warm."""
    kw = dict(hot_bytes=8 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB)
    cache = TieredCache(SPEC, **kw)
    started, release = stuck_first_put(cache)
    try:
        for seed in (1, 2):
            tokens = prompt(seed)
            assert cache.store(tokens, kv_for(SPEC, tokens)) == 4
        assert started.wait(60)
        cache.hot.unlink()
        release.set()
        cache.close()
    finally:
        release.set()
        cache.close()
    with TieredCache(SPEC, **kw) as fresh:
        assert warm_blocks_are_right(fresh, [1, 2]) == [4, 4]
        fresh.hot.unlink()


def test_a_block_another_handle_is_still_writing_is_not_counted_as_dropped(tmp_path, seg_name):
    """Another handle of the segment has claimed prompt 1's slots and is still filling them when this
    cache stores the same prompt: the hot tier answers EXISTS, the block is queued, and the writer finds
    it not readable yet. That block is the other handle's to write behind, not a drop of this cache's
    (before: 4 counted in ``warm_dropped_blocks``, on a host where nothing was lost)."""
    cache = TieredCache(SPEC, hot_bytes=8 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB)
    other = TieredCache(SPEC, hot_bytes=8 * MiB, hot_name=seg_name)
    tokens = prompt(1)
    keys = chunk_keys(SPEC, tokens[:16])
    kv = kv_for(SPEC, tokens)
    rows = np.stack([np.ascontiguousarray(kv[:, :, :, 4 * b:4 * b + 4, :]).view(np.uint8).reshape(-1)
                     for b in range(4)])
    filling, release = threading.Event(), threading.Event()

    def fill(data, slots, idx):
        filling.set()
        assert release.wait(60)
        data[slots] = rows[idx]

    writer = threading.Thread(target=lambda: other.hot.put_many(keys, fill))
    writer.start()
    try:
        assert filling.wait(60)
        assert cache.store(tokens, kv) == 0  # EXISTS: the other handle is writing them
        assert cache.flush(60)
        assert cache.stats()["warm_dropped_blocks"] == 0
        release.set()
        writer.join(60)
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(tokens), out) == 16  # the other handle's blocks, published
        assert out[:, :, :, :16].tobytes() == kv[:, :, :, :16].tobytes()
    finally:
        release.set()
        writer.join(60)
        other.close()
        cache.close()


def test_jobs_a_closing_writer_drops_leave_the_cache(tmp_path, seg_name, stuck_first_put):
    """Prompt 1's warm write is stuck and prompt 2's is queued when the cache closes with a short
    ``warm_flush_s``: the writer drops prompt 2's job, counted. The dropped job is told: it leaves the
    cache's set of jobs and holds no rows (before: it stayed there for good, and the close's rescue
    copied its blocks into rows nobody would write)."""
    cache = TieredCache(SPEC, hot_bytes=8 * MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=4 * MiB,
                        warm_flush_s=0.2)
    started, release = stuck_first_put(cache)
    behind = cache._storer.behind
    writer = next(level.writer for level in cache._levels if level.name == "warm")
    try:
        for seed in (1, 2):
            tokens = prompt(seed)
            assert cache.store(tokens, kv_for(SPEC, tokens)) == 4
        assert started.wait(60)
        queued = [job for job in behind._jobs]
        assert len(queued) == 2
        with warnings.catch_warnings():  # the stuck put, once released, finds warm closed: warned
            warnings.simplefilter("ignore", RuntimeWarning)
            cache.close()
            assert writer.dropped_blocks == 4
            release.set()
            for _ in range(600):  # the stuck job ends once released, on the writer's thread
                if not behind._jobs:
                    break
                threading.Event().wait(0.05)
        assert not behind._jobs
        assert all(job._rescued is None for job in queued)
    finally:
        release.set()
        cache.close()
