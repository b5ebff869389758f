"""TieredCache: lookup across tiers, load, store, promotion, demotion, isolation, real processes."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for, same_bytes
from tieredkv import InvalidInput, InvalidPayload, KVSpec, TieredCache
from tieredkv.cache import HOT, WARM

# Workers start fresh ("spawn"): an LMDB environment must never be inherited across fork.
SPAWN = mp.get_context("spawn")
MiB = 1 << 20


@pytest.fixture
def spec():
    return KVSpec(model_id="test/cache", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                  chunk_tokens=4)


@pytest.fixture
def make(spec, seg_name, tmp_path):
    opened = []

    def factory(hot_slots=None, warm=True, **kw):
        hot_bytes = kw.pop("hot_bytes", None)
        if hot_bytes is None:
            from tieredkv import policies
            from tieredkv.hot import segment as seg
            n = hot_slots or 64
            engine = policies.make(kw.get("eviction", "lru"))
            hot_bytes = seg.Layout.compute(spec, n, policies.StateLayout.for_policy(engine, n).nbytes).total_bytes
        c = TieredCache(spec, hot_bytes=hot_bytes, hot_name=seg_name,
                        warm_dir=tmp_path / "warm" if warm else None, warm_bytes=4 * MiB if warm else None, **kw)
        opened.append(c)
        return c

    yield factory
    for c in opened:
        c.close()


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 30_000, n)


def test_store_lookup_load_roundtrip_hot_only(spec, make):
    cache = make(warm=False)
    tokens = prompt(4 * 5 + 2)
    kv = kv_for(spec, tokens)
    assert cache.lookup(tokens).tokens == 0
    assert cache.store(tokens, kv) == 5
    hit = cache.lookup(tokens)
    assert (hit.tokens, hit.hot_blocks, hit.warm_blocks, hit.prefill_tokens) == (20, 5, 0, 2)
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 20
    assert same_bytes(out[:, :, :, :20], kv[:, :, :, :20])
    assert cache.store(tokens, kv) == 0  # already there
    stats = cache.stats()
    assert stats["hit_tokens"] == 20 and stats["prompt_tokens"] == 44
    assert stats["prefix_hit_rate"] == pytest.approx(20 / 44)


def test_store_from_token_skips_the_restored_chunks(spec, make):
    cache = make(warm=False)
    tokens = prompt(4 * 5 + 2)
    kv = kv_for(spec, tokens)
    garbage = kv.copy()
    garbage[:, :, :, :8] = 7  # positions before from_token are never read
    assert cache.store(tokens, garbage, from_token=8) == 3
    hot = cache.hot
    from tieredkv.keys import chunk_keys
    keys = chunk_keys(spec, tokens[:20])
    assert hot.contains_many(keys).tolist() == [False, False, True, True, True]
    assert cache.store(tokens, kv) == 2  # the first two, now from real bytes
    out = np.zeros_like(kv)
    assert cache.load(cache.lookup(tokens), out) == 20
    assert same_bytes(out[:, :, :, :20], kv[:, :, :, :20])
    assert cache.store(tokens, kv, from_token=400) == 0  # past the end: nothing to store
    for bad in (-4, 3, 4.0, True, "8"):
        with pytest.raises(InvalidInput, match="from_token"):
            cache.store(tokens, kv, from_token=bad)


def test_whole_prompt_hit_leaves_one_token(spec, make):
    cache = make(warm=False)
    tokens = prompt(16)
    cache.store(tokens, kv_for(spec, tokens))
    hit = cache.lookup(tokens)
    assert hit.tokens == 12 and hit.prefill_tokens == 4
    assert cache.lookup(tokens[:13]).tokens == 12
    assert cache.lookup(tokens[:12]).tokens == 8


def test_shorter_and_diverging_prompts(spec, make):
    cache = make(warm=False)
    tokens = prompt(40)
    cache.store(tokens, kv_for(spec, tokens))
    other = tokens.copy()
    other[9] += 1  # diverges inside chunk 2
    assert cache.lookup(other).tokens == 8
    assert cache.lookup(tokens[:25]).tokens == 24


def test_store_takes_only_the_first_n_tokens_of_kv(spec, make):
    cache = make(warm=False)
    tokens = prompt(20)
    kv = kv_for(spec, tokens)[:, :, :, :9]  # KV for 9 tokens: 2 full chunks
    assert cache.store(tokens, kv) == 2
    assert cache.lookup(tokens).tokens == 8


def test_demotion_on_evict_and_promotion_on_load(spec, make):
    cache = make(hot_slots=4, demotion="on_evict")
    a, b = prompt(17, 1), prompt(17, 2)
    kv_a, kv_b = kv_for(spec, a), kv_for(spec, b)
    cache.store(a, kv_a)
    cache.store(b, kv_b)  # evicts a's 4 blocks from hot into warm
    stats = cache.stats()
    assert stats["demotions"] == 4
    hit = cache.lookup(a)
    assert (hit.hot_blocks, hit.warm_blocks) == (0, 4)
    out = np.zeros_like(kv_a)
    assert cache.load(hit, out) == 16
    assert same_bytes(out[:, :, :, :16], kv_a[:, :, :, :16])
    assert cache.stats()["promotions"] == 4
    assert cache.lookup(a).hot_blocks == 4


def test_hit_spanning_hot_and_warm(spec, make):
    cache = make(hot_slots=8)
    tokens = prompt(33)
    kv = kv_for(spec, tokens)
    cache.store(tokens, kv)                      # 8 blocks in hot
    evicted = cache.hot.evict(8)                 # move them all to warm by hand...
    cache.warm.put_many(evicted.keys, evicted.payloads)
    cache.hot.put_many(evicted.keys[1::2] if False else evicted.keys.take([1, 3, 5]),
                       evicted.payloads[[1, 3, 5]])  # ...and bring 3 back: hot and warm interleave
    hit = cache.lookup(tokens)
    assert hit.tokens == 32
    assert hit.where.tolist() == [WARM, HOT, WARM, HOT, WARM, HOT, WARM, WARM]
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 32
    assert same_bytes(out[:, :, :, :32], kv[:, :, :, :32])


def test_block_lost_between_lookup_and_load_truncates(spec, make):
    cache = make(warm=False)
    tokens = prompt(25)
    kv = kv_for(spec, tokens)
    cache.store(tokens, kv)
    hit = cache.lookup(tokens)
    cache.hot.remove(hit.keys[3:4])
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 12
    assert same_bytes(out[:, :, :, :12], kv[:, :, :, :12])
    assert cache.stats()["lost_blocks"] == 3


def test_salt_isolates_tenants_in_every_tier(spec, make):
    cache = make(hot_slots=4)
    tokens = prompt(17)
    cache.store(tokens, kv_for(spec, tokens, b"alice"), salt=b"alice")
    cache.store(prompt(17, 9), kv_for(spec, prompt(17, 9)))  # pushes alice's blocks to warm
    assert cache.flush()                                     # (written behind: wait for it)
    assert cache.lookup(tokens, salt=b"alice").tokens == 16
    assert cache.lookup(tokens, salt=b"bob").tokens == 0
    assert cache.lookup(tokens).tokens == 0


def test_write_through_and_restart_from_warm_only(spec, make, seg_name):
    cache = make(demotion="write_through")
    tokens = prompt(29)
    kv = kv_for(spec, tokens)
    assert cache.store(tokens, kv) == 7
    assert cache.warm.stats().used_blocks == 7
    cache.close()
    posix_ipc.unlink_shared_memory(seg_name)  # the node restarted: shared memory is gone
    fresh = make(demotion="write_through")
    hit = fresh.lookup(tokens)
    assert (hit.tokens, hit.warm_blocks) == (28, 7)
    out = np.zeros_like(kv)
    assert fresh.load(hit, out) == 28
    assert same_bytes(out[:, :, :, :28], kv[:, :, :, :28])


def test_demotion_on_nth_hit_spares_one_off_blocks(spec, make):
    cache = make(hot_slots=4, demotion="on_nth_hit:1")
    hot_one, cold_one = prompt(9, 1), prompt(9, 2)
    cache.store(hot_one, kv_for(spec, hot_one))
    cache.store(cold_one, kv_for(spec, cold_one))
    out = np.zeros((2, 2, 2, 9, 8), np.float16)
    cache.load(cache.lookup(hot_one), out)       # hot_one's blocks get a hit; cold_one's don't
    other = prompt(17, 3)
    cache.store(other, kv_for(spec, other))      # evicts all four
    assert cache.lookup(hot_one).warm_blocks == 2
    assert cache.lookup(cold_one).tokens == 0


def test_promotion_never_and_nth(spec, make):
    cache = make(hot_slots=4, promotion="on_nth_hit:2")
    a = prompt(9, 1)
    cache.store(a, kv_for(spec, a))
    cache.store(prompt(17, 2), kv_for(spec, prompt(17, 2)))
    assert cache.flush()                         # a's blocks, written behind, are in warm
    out = np.zeros((2, 2, 2, 9, 8), np.float16)
    cache.load(cache.lookup(a), out)
    assert cache.lookup(a).warm_blocks == 2      # first warm hit: not promoted yet
    cache.load(cache.lookup(a), out)
    assert cache.lookup(a).hot_blocks == 2       # second: promoted


def test_torch_tensors_fp16_and_bf16(seg_name, tmp_path):
    torch = pytest.importorskip("torch")
    for dtype in ("float16", "bfloat16"):
        spec = KVSpec(model_id="test/torch", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, chunk_tokens=4)
        with TieredCache(spec, hot_bytes=2 * MiB, hot_name=seg_name) as cache:
            tokens = torch.arange(100, 123)
            kv = torch.randn(2, 2, 2, 23, 8).to(getattr(torch, dtype))
            assert cache.store(tokens, kv) == 5
            hit = cache.lookup(tokens)
            out = torch.zeros_like(kv)
            assert cache.load(hit, out) == 20
            assert torch.equal(out[:, :, :, :20], kv[:, :, :, :20])
            # Non-contiguous destination (a slice of a bigger cache tensor): still one copy, in place.
            big = torch.zeros(2, 2, 2, 64, 8, dtype=kv.dtype)
            assert cache.load(hit, big[:, :, :, :40]) == 20
            assert torch.equal(big[:, :, :, :20], kv[:, :, :, :20])
        posix_ipc.unlink_shared_memory(seg_name)


def test_bad_input_is_explained(spec, make):
    cache = make(warm=False)
    tokens = prompt(12)
    with pytest.raises(InvalidPayload, match="shaped"):
        cache.store(tokens, np.zeros((2, 2, 8, 12), np.float16))
    with pytest.raises(InvalidPayload, match="dtype"):
        cache.store(tokens, np.zeros((2, 2, 2, 12, 8), np.float32))
    with pytest.raises(InvalidInput, match="token ids"):
        cache.store(tokens[:4], np.zeros((2, 2, 2, 12, 8), np.float16))
    with pytest.raises(InvalidInput, match="bytes"):
        cache.lookup(tokens, salt="tenant")
    cache.store(tokens, kv_for(spec, tokens))
    hit = cache.lookup(tokens)
    with pytest.raises(InvalidPayload, match="holds 4 tokens"):
        cache.load(hit, np.zeros((2, 2, 2, 4, 8), np.float16))
    with pytest.raises(InvalidInput, match="PrefixHit"):
        cache.load(8, np.zeros((2, 2, 2, 12, 8), np.float16))
    with pytest.raises(InvalidInput, match="warm_bytes"):
        TieredCache(spec, hot_bytes=MiB, warm_dir="/tmp/x")
    with pytest.raises(InvalidInput, match="valid"):
        TieredCache(spec, hot_bytes=MiB, eviction="nope")
    with pytest.raises(InvalidInput):
        TieredCache(spec, hot_bytes=MiB, promotion="sometimes")


def _worker(spec, seg_name, warm_dir, worker, results):
    """Store and load a shared set of prefixes; check every loaded byte."""
    rng = np.random.default_rng(worker)
    wrong = loaded = 0
    with TieredCache(spec, hot_bytes=None, hot_name=seg_name, warm_dir=warm_dir, warm_bytes=4 * MiB) as cache:
        for _ in range(60):
            tokens = prompt(int(rng.integers(5, 40)), seed=int(rng.integers(6)))
            tokens = np.concatenate([np.arange(16), tokens])  # a shared "system prompt"
            kv = kv_for(spec, tokens)
            hit = cache.lookup(tokens)
            out = np.zeros_like(kv)
            n = cache.load(hit, out)
            wrong += int(not same_bytes(out[:, :, :, :n], kv[:, :, :, :n]))
            loaded += n
            cache.store(tokens, kv)
    results.put((wrong, loaded))


@pytest.mark.procs
def test_eight_processes_store_and_load_the_same_prefixes(spec, make, tmp_path, seg_name):
    cache = make(hot_slots=24)  # creates the segment and the warm tier; workers attach
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=_worker, args=(spec, seg_name, tmp_path / "warm", w, results)) for w in range(8)]
    for p in procs:
        p.start()
    got = [results.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(w for w, _ in got) == 0
    assert sum(n for _, n in got) > 0
    census = cache.hot.slot_census()
    assert census["writing_live"] == census["writing_dead"] == census["pinned"] == 0
    # Counters live in the segment: this process sees every worker's lookups (per host, not per process).
    stats = cache.stats()
    assert stats["lookups"] == 8 * 60
    assert stats["loaded_tokens"] == sum(n for _, n in got)
    assert sum(stats["lookup_hist"]) == 8 * 60


def test_store_larger_than_hot_sends_the_rest_to_warm(spec, make):
    cache = make(hot_slots=4)
    tokens = prompt(33)
    kv = kv_for(spec, tokens)
    assert cache.store(tokens, kv) == 4          # 4 fit in hot...
    assert cache.flush()
    hit = cache.lookup(tokens)
    assert (hit.hot_blocks, hit.warm_blocks) == (4, 4)  # ...the other 4 went straight to warm
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 32
    assert same_bytes(out[:, :, :, :32], kv[:, :, :, :32])


def test_promotion_never_evicts_the_hit_being_loaded(spec, make):
    """Warm blocks first, hot blocks after, hot tier full: promoting the warm ones mid-load would
    evict the hot ones before they are read. Promotion waits until the load is done."""
    cache = make(hot_slots=4)
    tokens = prompt(33)
    kv = kv_for(spec, tokens)
    cache.store(tokens, kv)                      # blocks 0-3 hot, 4-7 warm
    assert cache.flush()
    keys = cache.lookup(tokens).keys
    front = cache.hot.evict(4)                   # 0-3 -> warm
    cache.warm.put_many(front.keys, front.payloads)
    back = np.zeros((4, spec.block_bytes), np.uint8)
    assert cache.warm.get_many(keys[4:], back) == 4
    cache.hot.put_many(keys[4:], back)           # 4-7 -> hot: the hot tier is full again
    hit = cache.lookup(tokens)
    assert hit.where.tolist() == [WARM] * 4 + [HOT] * 4
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 32
    assert same_bytes(out[:, :, :, :32], kv[:, :, :, :32])
    assert cache.stats()["promotions"] == 4


def test_hot_blocks_and_unlink_hot(spec, seg_name, tmp_path):
    cache = TieredCache(spec, hot_blocks=6, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB,
                        demotion="write_through")
    assert cache.hot.n_slots == 6
    tokens = prompt(9)
    cache.store(tokens, kv_for(spec, tokens))
    cache.unlink_hot()
    assert not os.path.exists("/dev/shm" + seg_name)
    with TieredCache(spec, hot_blocks=6, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB) as fresh:
        assert fresh.lookup(tokens).warm_blocks == 2


def test_warm_read_errors_degrade_to_a_miss(spec, make, monkeypatch):
    import errno

    from tieredkv.warm import slabs

    cache = make(hot_slots=4)
    tokens = prompt(17)
    kv = kv_for(spec, tokens)
    cache.store(tokens, kv)
    cache.store(prompt(17, 5), kv_for(spec, prompt(17, 5)))  # tokens' blocks now live in warm
    assert cache.flush()
    hit = cache.lookup(tokens)
    assert hit.warm_blocks == 4

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(slabs.os, "preadv", eio)
    out = np.zeros_like(kv)
    with pytest.warns(RuntimeWarning, match="warm tier failed"):
        assert cache.load(hit, out) == 0
    assert cache.stats()["warm_errors"] == 1
    monkeypatch.undo()
    assert cache.load(cache.lookup(tokens), out) == 16
    assert same_bytes(out[:, :, :, :16], kv[:, :, :, :16])


def test_corrupt_warm_blocks_are_counted_per_host_and_never_served(spec, make):
    cache = make(hot_slots=4)
    tokens = prompt(17)
    kv = kv_for(spec, tokens)
    cache.store(tokens, kv)
    cache.store(prompt(17, 5), kv_for(spec, prompt(17, 5)))  # tokens' 4 blocks now live in warm
    assert cache.flush()
    hit = cache.lookup(tokens)
    assert hit.warm_blocks == 4
    # Damage the second block's bytes on disk, where the warm tier keeps it.
    slab = sorted(cache.warm.path.glob("slab-*"))[0]
    out1 = np.zeros((1, spec.block_bytes), np.uint8)
    assert cache.warm.get_many(hit.keys[1:2], out1) == 1
    data = bytearray(slab.read_bytes())
    at = data.find(out1.tobytes())
    assert at >= 0
    data[at + 7] ^= 0xFF
    slab.write_bytes(bytes(data))
    out = np.zeros_like(kv)
    assert cache.load(hit, out) == 4          # only the first block: the damaged one ends the run
    assert same_bytes(out[:, :, :, :4], kv[:, :, :, :4])
    stats = cache.stats()
    assert stats["corrupt_blocks"] == 1 and stats["lost_blocks"] == 3


def test_torch_float8_kv_and_out(seg_name):
    """fp8 KV as torch tensors (numpy has no float8): stored and loaded bit for bit, not a bare
    TypeError from ``Tensor.numpy()``."""
    torch = pytest.importorskip("torch")
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        spec = KVSpec(model_id="test/fp8", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, chunk_tokens=4)
        with TieredCache(spec, hot_bytes=2 * MiB, hot_name=seg_name) as cache:
            tokens = torch.arange(100, 113)
            bits = torch.randint(0, 256, (2, 2, 2, 13, 8), dtype=torch.uint8)
            assert cache.store(tokens, bits.view(getattr(torch, dtype))) == 3
            out = torch.zeros(2, 2, 2, 13, 8, dtype=getattr(torch, dtype))
            assert cache.load(cache.lookup(tokens), out) == 12
            assert torch.equal(out.view(torch.uint8)[:, :, :, :12], bits[:, :, :, :12])
        posix_ipc.unlink_shared_memory(seg_name)


def test_tensors_that_hold_no_plain_array_are_refused(spec, make):
    torch = pytest.importorskip("torch")
    cache = make()
    tokens = prompt(9)
    kv = torch.from_numpy(kv_for(spec, tokens))
    with pytest.raises(InvalidPayload, match="dense"):
        cache.store(tokens, kv.to_sparse())
    with pytest.raises(InvalidPayload, match="negated"):
        cache.store(tokens, kv._neg_view())
    assert cache.lookup(tokens).blocks == 0


def test_load_runs_hands_rows_that_go_forwards_through_memory(spec, make):
    """A prefix whose chunks were stored last-first lies in descending slots: its rows still reach the
    sink with a positive row stride (``torch.from_numpy`` refuses a negative one), in key order."""
    cache = make(warm=False)
    tokens = prompt(13, seed=5)
    kv = kv_for(spec, tokens)
    for end in (12, 8, 4):  # chunk 2, then 1, then 0
        cache.store(tokens[:end + 1], kv[:, :, :, :end + 1], from_token=end - 4)
    hit = cache.lookup(tokens)
    assert hit.blocks == 3
    got = {}

    def sink(first_token, rows):
        assert rows.strides[0] > 0
        for j in range(rows.shape[0]):
            got[first_token // 4 + j] = rows[j].copy()

    assert cache.load_runs(hit, sink) == 12
    from helpers import payload_for
    from tieredkv import chunk_keys

    expected = payload_for(spec, chunk_keys(spec, tokens))
    assert sorted(got) == [0, 1, 2] and all(np.array_equal(got[i], expected[i]) for i in range(3))
