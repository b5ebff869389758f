"""The vLLM connector's loads (tieredkv.integrations.vllm_loads, no vLLM needed) when a warm block read
in one pass (``WarmTier.read_through``) turns out damaged: its bytes already went through the tier copy
into the connector's host buffer before the checksum failed, and must never reach vLLM's paged cache."""

from __future__ import annotations

import numpy as np
import torch
from test_paged_kv import BLOCK, HEAD_DIM, HEADS, LAYERS
from test_vllm_loads import CHUNK, NAMES, Plan, expect, loader_for, pages_of, spec_for
from test_warm_read_through import flip_block_on_disk

from tieredkv import TieredCache
from tieredkv.warm import WarmTier


def test_a_damaged_warm_block_and_all_after_it_are_recomputed_not_written(tmp_path, seg_name, monkeypatch):
    through = []
    real = WarmTier.read_through
    monkeypatch.setattr(WarmTier, "read_through", lambda self, *a, **k: through.append(1) or real(self, *a, **k))
    chunks, bad = 8, 4
    tokens = np.arange(5, chunks * CHUNK + 6)
    kv = torch.randn(LAYERS, 2, HEADS, chunks * CHUNK, HEAD_DIM)
    with TieredCache(spec_for(), hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=1 << 20,
                     promotion="never", demotion="write_through", warm_verify="always") as cache:
        assert cache.store(tokens[:chunks * CHUNK], kv) == chunks
        cache.hot.remove(cache.lookup(tokens).keys)
        hit = cache.lookup(tokens)
        assert hit.warm_blocks == chunks
        flip_block_on_disk(cache, hit.keys, bad, cache.spec.block_bytes // 3)
        per_chunk = CHUNK // BLOCK
        ids = tuple(range(10, 10 + chunks * per_chunk))
        loader, caches = loader_for(cache, "cpu")
        try:
            loader.start([Plan("a", hit, 0, (ids,))])
            for name in NAMES:
                loader.wait_layer(name)
            assert loader.finish() == set(ids[bad * per_chunk:])  # reported: vLLM recomputes them
            for layer in range(LAYERS):
                assert all(expect(caches, layer, b, kv, i * BLOCK) for i, b in enumerate(ids[:bad * per_chunk]))
                assert not any(pages_of(caches, layer, b).any() for b in ids[bad * per_chunk:])  # never written
        finally:
            loader.close()
        assert cache.stats()["corrupt_blocks"] == 1 and through  # the one-pass path ran
