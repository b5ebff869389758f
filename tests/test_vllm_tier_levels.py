"""vLLM's secondary-tier path (``TieredKVTier``) goes through the cache's levels like every other path:
write-behind to warm, the remote tier, the counters. (Before, it wrote hot and warm itself and skipped
all three.) No engine starts here: vLLM's ``SecondaryTierFactory`` builds the tier over a memoryview."""

from __future__ import annotations

import os
import secrets

import numpy as np
import posix_ipc
import pytest

pytest.importorskip("vllm")

from test_vllm_connector import job, offloading_spec  # noqa: E402
from vllm.v1.kv_offload.base import (
    LookupResult,  # noqa: E402
    ReqContext,  # noqa: E402
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

from tieredkv.remote import testing as servers  # noqa: E402


@pytest.fixture(scope="module")
def valkey_url():
    with servers.ValkeyServer() as server:
        yield server.url


def make_tier(primary: np.ndarray, seg: str, **options):
    config = {"type": "TieredKVTier", "module_path": "tieredkv.integrations.vllm", "hot_bytes": "2M",
              "hot_name": seg, **options}
    return SecondaryTierFactory.create_secondary_tier(config, memoryview(primary), offloading_spec())


def run(tier, one_job):
    tier.submit_store(one_job) if one_job.job_id % 2 else tier.submit_load(one_job)
    tier.drain_jobs()
    (done,) = tier.get_finished_jobs()
    return done


def test_the_offloading_tier_writes_behind_sends_to_the_fleet_and_counts(seg_name, tmp_path, valkey_url):
    rng = np.random.default_rng(0)
    primary = rng.integers(0, 256, size=(4, 4096), dtype=np.uint8)
    keys = [bytes([i + 1]) * 36 for i in range(3)]
    tier = make_tier(primary, seg_name, warm_dir=str(tmp_path / "warm"), warm_bytes="8M",
                     demotion="write_behind", remote=valkey_url)
    try:
        assert run(tier, job(1, keys, [0, 1, 2])).success
        assert tier.cache.flush(10.0)
        stats = tier.cache.stats()
        assert stats["stored_blocks"] == 3 and stats["hot_bytes_written"] == 3 * 4096
        assert stats["warm_queued_blocks"] == 3 and stats["warm_bytes_written"] == 3 * 4096  # behind
        assert stats["remote_bytes_written"] == 3 * 4096                                       # the fleet
        assert [tier.lookup(k, ReqContext(req_id="q")) for k in keys] == [LookupResult.HIT] * 3
        assert tier.cache.stats()["hit_tokens"] == 3
    finally:
        tier.cache.unlink_hot()
        tier.shutdown()
    # Another host (its own segment, no warm tier) finds the chunks in the remote tier and loads them.
    other_seg = f"/tieredkv-test-{os.getpid()}-{secrets.token_hex(4)}"
    theirs = np.zeros((4, 4096), dtype=np.uint8)
    other = make_tier(theirs, other_seg, remote=valkey_url)
    try:
        assert other.lookup(keys[1], ReqContext(req_id="q")) == LookupResult.HIT
        assert run(other, job(2, keys[::-1], [3, 2, 1], promotion=True)).success
        assert np.array_equal(theirs[[1, 2, 3]], primary[[0, 1, 2]])  # keys 2, 1, 0 went to rows 3, 2, 1
        stats = other.cache.stats()
        assert stats["remote_hit_tokens"] == 1 and stats["remote_bytes_read"] == 3 * 4096
        assert stats["promotions"] == 3  # into this host's hot tier
    finally:
        other.cache.unlink_hot()
        other.shutdown()
        try:
            posix_ipc.unlink_shared_memory(other_seg)
        except posix_ipc.ExistentialError:
            pass
