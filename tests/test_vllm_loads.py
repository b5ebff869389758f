"""The connector's layer-wise loads (tieredkv.integrations.vllm_loads) without vLLM or an engine: a real
TieredCache (hot tier in shared memory) and paged caches built as vLLM builds them (tests/test_paged_kv.py),
on the CPU and, where there is one, on a CUDA device (the DMA path: staging in device memory). On the CPU
a step of one hot-tier hit goes straight from the slots into the pages (no staging buffer); the steps of
several plans, or with a lower level's blocks, take the staged path.

On a GPU machine: ``pytest -q tests/test_vllm_loads.py`` (torch with CUDA; vLLM not required)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from test_paged_kv import BLOCK, HEAD_DIM, HEADS, LAYERS, LAYOUT_ORDERS, backend_kv, devices, paged_caches, view_all

from tieredkv import InvalidInput, KVSpec, TieredCache, chunk_keys
from tieredkv.integrations.paged import Chunks, PagedKV
from tieredkv.integrations.vllm_loads import NULL_BLOCK, LayerLoader

CHUNK = 2 * BLOCK
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the connector's ``LoadPlan`` carries to the loader."""

    req_id: str
    hit: object
    skip_tokens: int
    block_ids: tuple[tuple[int, ...], ...]


def spec_for(dtype=torch.float32) -> KVSpec:
    return KVSpec(model_id="test/loads", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                  dtype=str(dtype).removeprefix("torch."), chunk_tokens=CHUNK)


@pytest.fixture
def cache(seg_name):
    with TieredCache(spec_for(), hot_bytes=8 << 20, hot_name=seg_name) as c:
        yield c


def stored(cache, tokens, n_tokens):
    """Store a random KV for ``tokens[:n_tokens]``; return it and the hit of ``tokens``."""
    kv = torch.randn(LAYERS, 2, HEADS, n_tokens, HEAD_DIM)
    cache.store(tokens[:n_tokens], kv)
    return kv, cache.lookup(tokens)


def pages_of(caches, layer, block, split="halves"):
    k, v = backend_kv(caches[layer], split)
    return torch.stack([k[block], v[block]]).cpu()  # [2, H, N, D]


def expect(caches, layer, block, kv, first_token):
    return torch.equal(pages_of(caches, layer, block), kv[layer, :, :, first_token:first_token + BLOCK])


def holds(caches, blocks, kv) -> bool:
    """Whether ``blocks`` hold ``kv``'s tokens from token 0 on, a block each, in every layer."""
    return all(expect(caches, layer, b, kv, i * BLOCK) for layer in range(LAYERS) for i, b in enumerate(blocks))


def loader_for(cache, device, mode="layer", groups=(0, 0)):
    caches = paged_caches("LBHNC", device)
    paged = PagedKV(view_all(caches, "LBHNC", "halves"), BLOCK)
    return LayerLoader(cache, paged, list(groups), {n: i for i, n in enumerate(NAMES)}, mode), caches


class Gate:
    """Holds the loader thread before the paged copy of ``layer`` until opened."""

    def __init__(self, loader: LayerLoader, layer: int):
        self.opened, self.reached = threading.Event(), threading.Event()
        real = loader.paged.write

        def write(ids, host, first_token=0, layers=None):
            if layers == (layer,):
                self.reached.set()
                assert self.opened.wait(30), "the test never opened the gate"
            real(ids, host, first_token, layers=layers)

        loader.paged.write = write  # type: ignore[method-assign]


def test_a_layer_wait_returns_once_its_layer_is_written_and_not_before(cache):
    tokens = np.arange(1, 4 * BLOCK + 2)
    kv, hit = stored(cache, tokens, 4 * BLOCK)
    loader, caches = loader_for(cache, "cpu")
    gate = Gate(loader, 1)
    try:
        loader.start([Plan("a", hit, 0, ((5, 9, 2, 7),))])  # returns with the copies under way
        assert gate.reached.wait(30)
        loader.wait_layer(NAMES[0])  # layer 0 is in place, layer 1's copy is held at the gate
        assert all(expect(caches, 0, b, kv, i * BLOCK) for i, b in enumerate((5, 9, 2, 7)))
        assert not pages_of(caches, 1, 5).any()
        waiter = threading.Thread(target=loader.wait_layer, args=(NAMES[1],))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # still waiting: its layer is not written
        loader.wait_layer("model.layers.99.mlp")  # not a layer this loader restores: no wait
        gate.opened.set()
        waiter.join(30)
        assert not waiter.is_alive()
        assert all(expect(caches, 1, b, kv, i * BLOCK) for i, b in enumerate((5, 9, 2, 7)))
        assert loader.finish() == set() and loader.finish() == set()
        assert loader._buffer is None  # one hot-tier hit: straight from the slots, no staging buffer
    finally:
        gate.opened.set()
        loader.close()


@pytest.mark.parametrize("mode", ["layer", "sync"])
def test_blocks_lost_after_the_lookup_are_reported_and_every_layer_is_released(cache, mode):
    tokens = np.arange(3, 6 * BLOCK + 3)
    kv, hit = stored(cache, tokens, 6 * BLOCK)
    other_kv, other_hit = stored(cache, tokens + 1000, 2 * BLOCK)
    cache.hot.remove(chunk_keys(cache.spec, tokens[:2 * CHUNK])[1:2])  # chunk 1 gone before the load
    loader, caches = loader_for(cache, "cpu", mode)
    try:
        loader.start([Plan("a", hit, 0, ((11, 12, 13, 14, 15, 16),)), Plan("b", other_hit, 0, ((20, 21),))])
        for name in NAMES:
            loader.wait_layer(name)
        # Chunk 1 and everything after it (never loaded: a hit is a prefix) are recomputed.
        assert loader.finish() == {13, 14, 15, 16}
        assert holds(caches, (11, 12), kv) and holds(caches, (20, 21), other_kv)
    finally:
        loader.close()


def test_a_paged_copy_that_raises_fails_its_plan_and_never_the_forward(cache):
    tokens = np.arange(5, 2 * BLOCK + 6)
    kv, hit = stored(cache, tokens, 2 * BLOCK)
    other_kv, other_hit = stored(cache, tokens + 1000, 2 * BLOCK)
    loader, caches = loader_for(cache, "cpu")
    real = loader.paged.write

    def write(ids, host, first_token=0, layers=None):
        if layers == (1,) and 30 in ids:
            raise OSError("injected: the copy into plan a's pages failed")
        real(ids, host, first_token, layers=layers)

    loader.paged.write = write  # type: ignore[method-assign]
    try:
        loader.start([Plan("a", hit, 0, ((30, 31),)), Plan("b", other_hit, 0, ((40, 41),))])
        for name in NAMES:
            loader.wait_layer(name)
        assert loader.finish() == {30, 31}
        assert expect(caches, 1, 40, other_kv, 0) and expect(caches, 1, 41, other_kv, BLOCK)
        # The next step's loads run on the same thread as before.
        loader.start([Plan("c", other_hit, 0, ((50, 51),))])
        assert loader.finish() == set() and expect(caches, 0, 51, other_kv, BLOCK)
    finally:
        loader.close()


def test_a_step_whose_loads_were_never_finished_keeps_its_errors_for_the_next(cache):
    tokens = np.arange(9, 2 * BLOCK + 10)
    _, hit = stored(cache, tokens, 2 * BLOCK)
    empty = dataclasses.replace(hit, tokens=0, keys=hit.keys[:0], where=hit.where[:0])
    loader, _ = loader_for(cache, "cpu")
    try:
        loader.start([Plan("a", empty, 0, ((3, 4),))])  # a range not offered: nothing loads
        loader.start([Plan("b", hit, 0, ((5, 6),))])
        assert loader.finish() == {3, 4}
    finally:
        loader.close()


@pytest.mark.parametrize("device", devices())
def test_layer_and_sync_modes_fill_the_same_pages(seg_name, device):
    """Two plans, a local prefix-cache hit to skip, two KV cache groups (one sliding, with a null block):
    the same pages either way. On CUDA the staging is device memory filled by DMA from the hot segment."""
    spec = spec_for()
    tokens = np.arange(1, 6 * BLOCK + 2)
    results = {}
    with TieredCache(spec, hot_bytes=8 << 20, hot_name=seg_name) as cache:
        kv, hit = stored(cache, tokens, 6 * BLOCK)
        other_kv, other_hit = stored(cache, tokens + 500, 2 * BLOCK)
        # Group 0 (layer 0) gets all of the hit after the skipped block; group 1 (layer 1) holds the
        # first of them as the null block (outside a window), which is left alone.
        plans = [Plan("a", hit, BLOCK, ((3, 4, 5, 6, 7), (NULL_BLOCK, 14, 15, 16, 17))),
                 Plan("b", other_hit, 0, ((20, 21), (22, 23)))]
        for mode in ("sync", "layer"):
            loader, caches = loader_for(cache, device, mode, groups=(0, 1))
            try:
                loader.start(plans)
                for name in NAMES:
                    loader.wait_layer(name)
                assert loader.finish() == set()
                if device == "cuda":
                    assert loader._buffer is not None and loader._buffer.is_cuda  # no pinned host staging
                    torch.cuda.synchronize()
                results[mode] = [c.cpu().clone() for c in caches]
                assert all(expect(caches, 0, b, kv, (i + 1) * BLOCK) for i, b in enumerate((3, 4, 5, 6, 7)))
                assert all(expect(caches, 1, b, kv, (i + 2) * BLOCK) for i, b in enumerate((14, 15, 16, 17)))
                assert not pages_of(caches, 1, NULL_BLOCK).any() and not pages_of(caches, 0, 14).any()
                assert expect(caches, 0, 21, other_kv, BLOCK) and expect(caches, 1, 23, other_kv, BLOCK)
            finally:
                loader.close()
        cache.unlink_hot()
    assert all(torch.equal(a, b) for a, b in zip(results["sync"], results["layer"]))


def test_an_unknown_mode_is_refused(cache):
    with pytest.raises(ValueError, match="choose one of"):
        loader_for(cache, "cpu", "async")


def test_a_loader_whose_thread_is_gone_loads_in_the_caller(cache):
    """After ``close`` (or in a process forked from the engine's) there is no loader thread: loads are
    done in ``start``, never queued for a thread that will not take them."""
    tokens = np.arange(2, 2 * BLOCK + 3)
    kv, hit = stored(cache, tokens, 2 * BLOCK)
    loader, caches = loader_for(cache, "cpu")
    loader.close()
    done = threading.Event()
    caller = threading.Thread(target=lambda: (loader.start([Plan("a", hit, 0, ((8, 9),))]), loader.finish(),
                                              done.set()), daemon=True)
    caller.start()
    assert done.wait(30), "the loads were queued for a thread that is gone"
    assert expect(caches, 1, 9, kv, BLOCK)


@pytest.mark.parametrize("verdict", ["no", "raise"])
def test_a_plan_its_after_copy_hook_rejects_is_recomputed(cache, verdict):
    """A hybrid model restores its recurrent state after the KV tier copy: no state (or a failure
    restoring it) fails the plan, whose KV alone cannot be continued from."""
    tokens = np.arange(4, 2 * BLOCK + 5)
    kv, hit = stored(cache, tokens, 2 * BLOCK)
    other_kv, other_hit = stored(cache, tokens + 1000, 2 * BLOCK)
    seen = []

    def after_copy(plan, loaded):
        seen.append((plan.req_id, loaded))
        if plan.req_id == "a" and verdict == "raise":
            raise OSError("injected: the state's pieces could not be read")
        return plan.req_id != "a"

    caches = paged_caches("LBHNC", "cpu")
    loader = LayerLoader(cache, PagedKV(view_all(caches, "LBHNC", "halves"), BLOCK), [0, 0],
                         {n: i for i, n in enumerate(NAMES)}, "layer", after_copy=after_copy)
    try:
        loader.start([Plan("a", hit, 0, ((3, 4),)), Plan("b", other_hit, 0, ((5, 6),))])
        assert loader.finish() == {3, 4}
        assert seen == [("a", 2 * BLOCK), ("b", 2 * BLOCK)]
        assert not pages_of(caches, 0, 3).any() and expect(caches, 1, 6, other_kv, BLOCK)
    finally:
        loader.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,split", [("LBHNC", "halves"), ("LBNHC", "last_axis"), ("BHLNC", "halves")])
def test_one_hot_hit_goes_from_the_slots_into_the_pages_of_any_layout(seg_name, dtype, name, split):
    """The direct path with a local prefix-cache hit to skip (one block: half a chunk), two KV cache groups
    (the second's first block the null block, outside a window), bfloat16 as raw bytes, and page layouts
    whose (N, D) are one run or not: every page holds the stored tokens, and no staging buffer is made."""
    assert name in LAYOUT_ORDERS
    tokens = np.arange(1, 6 * BLOCK + 2)
    with TieredCache(spec_for(dtype), hot_bytes=8 << 20, hot_name=seg_name) as cache:
        kv = torch.randn(LAYERS, 2, HEADS, 6 * BLOCK, HEAD_DIM).to(dtype)
        cache.store(tokens[:6 * BLOCK], kv)
        hit = cache.lookup(tokens)
        caches = paged_caches(name, "cpu", dtype)
        loader = LayerLoader(cache, PagedKV(view_all(caches, name, split), BLOCK), [0, 1],
                             {n: i for i, n in enumerate(NAMES)}, "layer")
        try:
            loader.start([Plan("a", hit, BLOCK, ((3, 4, 5, 6, 7), (NULL_BLOCK, 14, 15, 16, 17)))])
            for layer_name in NAMES:
                loader.wait_layer(layer_name)
            assert loader.finish() == set() and loader._buffer is None
            for i, b in enumerate((3, 4, 5, 6, 7)):
                assert torch.equal(pages_of(caches, 0, b, split), kv[0, :, :, (i + 1) * BLOCK:(i + 2) * BLOCK])
            for i, b in enumerate((14, 15, 16, 17)):
                assert torch.equal(pages_of(caches, 1, b, split), kv[1, :, :, (i + 2) * BLOCK:(i + 3) * BLOCK])
            assert not pages_of(caches, 1, NULL_BLOCK, split).any()
            assert not pages_of(caches, 0, 14, split).any()  # group 1's pages are not group 0's
        finally:
            loader.close()
            cache.unlink_hot()


def _released_at_each_write(loader):
    """Wrap ``loader.paged.write``: record how many layers the step had released when each copy began."""
    seen = []
    real = loader.paged.write

    def write(ids, host, first_token=0, layers=None):
        seen.append((layers, loader._job.layers_ready, isinstance(host, Chunks)))
        real(ids, host, first_token, layers=layers)

    loader.paged.write = write  # type: ignore[method-assign]
    return seen


def test_a_hit_in_one_run_is_released_layer_by_layer_and_one_in_two_runs_at_the_end(cache):
    one = np.arange(1, 4 * BLOCK + 2)
    kv_one, hit_one = stored(cache, one, 4 * BLOCK)
    two = np.arange(7, 4 * BLOCK + 8)
    kv_two, _ = stored(cache, two, 2 * BLOCK)  # its first chunk; a third prompt takes the next slots
    stored(cache, two + 3000, 2 * BLOCK)
    cache.store(two[:4 * BLOCK], kv_two_full := torch.cat([kv_two, torch.randn(LAYERS, 2, HEADS, 2 * BLOCK,
                                                                                 HEAD_DIM)], dim=3))
    hit_two = cache.lookup(two)
    assert hit_two.tokens == 4 * BLOCK
    for hit, kv, runs in ((hit_one, kv_one, 1), (hit_two, kv_two_full, 2)):
        loader, caches = loader_for(cache, "cpu")
        seen = _released_at_each_write(loader)
        try:
            loader.start([Plan("a", hit, 0, ((5, 6, 7, 8),))])
            assert loader.finish() == set()
            assert all(isinstance_ for _, _, isinstance_ in seen)  # straight from the slots
            if runs == 1:  # layer l's copy starts once the layers before it are released
                assert [(layers, ready) for layers, ready, _ in seen] == [((0,), 0), ((1,), 1)]
            else:  # two runs: nothing released before the last copy
                assert len(seen) == 2 * LAYERS and {ready for _, ready, _ in seen} == {0}
            assert holds(caches, (5, 6, 7, 8), kv)
        finally:
            loader.close()


def test_a_single_plan_losing_blocks_after_the_lookup_reports_them(cache):
    tokens = np.arange(3, 6 * BLOCK + 3)
    kv, hit = stored(cache, tokens, 6 * BLOCK)
    cache.hot.remove(chunk_keys(cache.spec, tokens[:2 * CHUNK])[1:2])  # chunk 1 gone before the load
    loader, caches = loader_for(cache, "cpu")
    try:
        loader.start([Plan("a", hit, 0, ((11, 12, 13, 14, 15, 16),))])
        for name in NAMES:
            loader.wait_layer(name)
        assert loader.finish() == {13, 14, 15, 16} and loader._buffer is None
        assert holds(caches, (11, 12), kv)
    finally:
        loader.close()


def test_a_direct_copy_that_raises_fails_the_plan_and_releases_every_layer(cache):
    tokens = np.arange(5, 2 * BLOCK + 6)
    _, hit = stored(cache, tokens, 2 * BLOCK)
    loader, _ = loader_for(cache, "cpu")
    real = loader.paged.write

    def write(ids, host, first_token=0, layers=None):
        if layers == (1,):
            raise OSError("injected: the copy into the pages failed")
        real(ids, host, first_token, layers=layers)

    loader.paged.write = write  # type: ignore[method-assign]
    before = cache.stats()
    try:
        loader.start([Plan("a", hit, 0, ((30, 31),))])
        for name in NAMES:
            loader.wait_layer(name)
        assert loader.finish() == {30, 31}
        after = cache.stats()  # counted as a load that lost its blocks
        assert after["loaded_tokens"] == before["loaded_tokens"]
        assert after["lost_blocks"] == before["lost_blocks"] + hit.blocks
        assert cache.hot.remove(hit.keys) == hit.blocks == 1  # unpinned again (a pinned block stays)
    finally:
        loader.close()


def test_a_read_retried_after_damage_never_takes_a_released_layer_back(cache, monkeypatch):
    """The hot tier retries a read whose bookkeeping found damage (here the policy's hit, after the copy):
    the sink runs again and rewrites the same bytes, and a layer once released stays released."""
    from tieredkv.hot import tier as hot_tier

    tokens = np.arange(1, 4 * BLOCK + 2)
    kv, hit = stored(cache, tokens, 4 * BLOCK)
    real_hit, calls = hot_tier.policies.hit, [0]

    def hit_once_damaged(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            raise IndexError("injected: the policy state is damaged")
        return real_hit(*args, **kwargs)

    monkeypatch.setattr(hot_tier.policies, "hit", hit_once_damaged)
    loader, caches = loader_for(cache, "cpu")
    seen = _released_at_each_write(loader)
    try:
        with pytest.warns(RuntimeWarning, match="damaged"):
            loader.start([Plan("a", hit, 0, ((5, 6, 7, 8),))])
            assert loader.finish() == set()
        ready = [r for _, r, _ in seen]
        assert len(seen) == 2 * LAYERS and ready == sorted(ready) and ready[:LAYERS] == list(range(LAYERS))
        assert holds(caches, (5, 6, 7, 8), kv)
    finally:
        loader.close()


def test_pages_of_another_dtype_than_the_cache_are_never_written(seg_name):
    """A float16 cache and bfloat16 pages (same size): no raw bytes reinterpreted, the plan is recomputed."""
    tokens = np.arange(1, 2 * BLOCK + 2)
    with TieredCache(spec_for(torch.float16), hot_bytes=8 << 20, hot_name=seg_name) as cache:
        cache.store(tokens[:2 * BLOCK], torch.randn(LAYERS, 2, HEADS, 2 * BLOCK, HEAD_DIM).half())
        hit = cache.lookup(tokens)
        caches = paged_caches("LBHNC", "cpu", torch.bfloat16)
        loader = LayerLoader(cache, PagedKV(view_all(caches, "LBHNC", "halves"), BLOCK), [0, 0],
                             {n: i for i, n in enumerate(NAMES)}, "sync")
        try:
            loader.start([Plan("a", hit, 0, ((3, 4),))])
            assert loader.finish() == {3, 4}
            assert not any(c.any() for c in caches)
        finally:
            loader.close()
            cache.unlink_hot()


def test_a_hit_partly_in_the_warm_tier_takes_the_staged_path(seg_name, tmp_path):
    tokens = np.arange(2, 4 * BLOCK + 3)
    with TieredCache(spec_for(), hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path,
                     warm_bytes=64 << 20) as cache:
        kv, _ = stored(cache, tokens, 4 * BLOCK)
        assert cache.flush(timeout_s=30)  # written behind to the warm tier
        cache.hot.remove(chunk_keys(cache.spec, tokens[:4 * BLOCK])[1:])  # chunk 1 on in the warm tier only
        hit = cache.lookup(tokens)
        assert hit.blocks == 2 and hit.blocks_in(hit.where[0]) == 1
        assert cache.load_runs(hit, lambda i, rows: None) is None  # nothing read: load it
        loader, caches = loader_for(cache, "cpu")
        try:
            loader.start([Plan("a", hit, 0, ((5, 6, 7, 8),))])
            assert loader.finish() == set() and loader._buffer is not None
            assert holds(caches, (5, 6, 7, 8), kv)
        finally:
            loader.close()
            cache.unlink_hot()


def test_load_runs_hands_over_pinned_runs_and_counts_them_as_load(cache):
    tokens = np.arange(1, 4 * BLOCK + 2)
    kv, hit = stored(cache, tokens, 4 * BLOCK)
    before = cache.stats()["loaded_tokens"]
    runs = []
    assert cache.load_runs(hit, lambda first, rows: runs.append((first, rows.copy()))) == 4 * BLOCK
    assert [first for first, _ in runs] == [0] and runs[0][1].shape == (2, cache.spec.block_bytes)
    out = np.zeros((2, cache.spec.block_bytes), np.uint8)
    assert cache.hot.get_many(hit.keys, out) == 2 and np.array_equal(runs[0][1], out)
    assert cache.stats()["loaded_tokens"] == before + 4 * BLOCK
    with pytest.raises(InvalidInput):
        cache.load_runs("not a hit", lambda first, rows: None)
