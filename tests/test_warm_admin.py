"""`list_warm_tiers` and `verify` over a root holding several tiers."""

from __future__ import annotations

import numpy as np

from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import payload_for

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
