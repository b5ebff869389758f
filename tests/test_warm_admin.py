"""`list_warm_tiers` and `verify` over a root holding several tiers."""

from __future__ import annotations

import errno
import os

import numpy as np

from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import check_index, payload_for

A = KVSpec(model_id="test/model-a", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
B = KVSpec(model_id="test/model-b", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=4)


def test_list_and_verify_root(tmp_path):
    for spec, n in ((A, 3), (B, 5)):
        k = chunk_keys(spec, np.arange(n * spec.chunk_tokens))
        with WarmTier(spec, tmp_path, capacity_bytes=8 * 4096) as t:
            t.put_many(k, payload_for(k, spec.block_bytes))
    (tmp_path / "not-a-tier").mkdir()
    rows = admin.list_warm_tiers(tmp_path)
    assert [(r["model"], r["blocks"], r["capacity_blocks"], r["namespace"]) for r in rows] == sorted(
        [("test/model-a", 3, 8, A.namespace), ("test/model-b", 5, 8, B.namespace)], key=lambda r: r[3])
    for r in rows:
        assert r["error"] is None and r["size_bytes"] >= 8 * 4096 and r["format_version"] == 1
        assert r["capacity_bytes"] == 8 * 4096
    report = admin.verify(tmp_path)
    assert report["ok"] and [t["blocks_checked"] for t in report["tiers"]] == [r["blocks"] for r in rows]
    assert admin.list_warm_tiers(tmp_path / "missing") == []


def test_repair_restores_a_slab_where_fallocate_is_unsupported(tmp_path, monkeypatch):
    """`verify --repair` restores slabs with the tier's own code, fallback included: on a filesystem
    without fallocate (EOPNOTSUPP) the slab comes back at full size, as opening the tier would do."""
    k = chunk_keys(A, np.arange(6 * A.chunk_tokens))
    with WarmTier(A, tmp_path, capacity_bytes=4 * 4096, slab_bytes=2 * 4096) as t:
        assert (t.put_many(k[:4], payload_for(k[:4], A.block_bytes)) == 0).all()
    tier = tmp_path / A.namespace
    (tier / "slab-0001.bin").write_bytes(b"")          # truncated: slots 2 and 3 lost their bytes

    def no_fallocate(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
    report = admin.verify(tier, repair=True)
    assert report["error"] is None and not report["ok"] and report["removed"] == 2
    assert os.path.getsize(tier / "slab-0001.bin") == 2 * 4096
    assert admin.verify(tier)["ok"]
    out = np.empty((4, A.block_bytes), dtype=np.uint8)
    with WarmTier(A, tmp_path) as t:
        assert t.get_many(k[:4], out) == 2
        assert np.array_equal(out[:2], payload_for(k[:2], A.block_bytes))
    check_index(str(tier))
