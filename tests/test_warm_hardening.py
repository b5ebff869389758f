"""The warm tier under attack: containers, stopped writers, damaged and replaced index files, full disks,
hostile directories and bad arguments (issue 11's warm-tier items, issue 14's verify exit codes).

Everything here is real: processes in another PID namespace (``unshare``), SIGSTOP and SIGKILL, files
truncated or replaced on disk, a small tmpfs for disk-full. Tests that need root say so when they skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tieredkv import (CapacityError, CorruptState, InvalidInput, KVSpec, PutResult, TieredCache, TieredKVError,
                      WarmTierUnavailable, chunk_keys)
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import TEST_SPEC_ARGS, check_index, payload_for, prompt_keys

SPEC = KVSpec(**TEST_SPEC_ARGS)
SLOT = 4096
ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare / mount / chown)")


def keys(start, n):
    return chunk_keys(SPEC, np.arange(start, start + n * SPEC.chunk_tokens))


def fill(tier, k):
    return tier.put_many(k, payload_for(k, SPEC.block_bytes))


def served(tier, k) -> int:
    out = np.zeros((len(k), SPEC.block_bytes), np.uint8)
    n = tier.get_many(k, out)
    np.testing.assert_array_equal(out[:n], payload_for(k[:n], SPEC.block_bytes))
    return n


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


# ---- 17: bad arguments name the argument --------------------------------------------------------------
@pytest.mark.parametrize("kw,arg", [(dict(tp_rank="0"), "tp_rank"), (dict(tp_rank=0.5), "tp_rank"),
                                    (dict(tp_rank=True), "tp_rank"), (dict(extra=object()), "extra"),
                                    (dict(extra=None), "extra")])
def test_bad_spec_fields_are_invalid_input_naming_the_field(kw, arg):
    with pytest.raises(InvalidInput, match=arg):
        KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, **kw)


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_key_value_heads", "hidden_size", "head_dim"])
def test_from_hf_config_with_a_string_count_names_the_field(field):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 16}
    cfg[field] = "2"
    with pytest.raises(InvalidInput, match=field):
        KVSpec.from_hf_config(cfg)
    with pytest.raises(InvalidInput, match="tp_size"):
        KVSpec.from_hf_config({**cfg, field: 2}, tp_size="1")


@pytest.mark.parametrize("bad", [5, "", b"/tmp", None.__class__])
def test_bad_warm_dir_is_invalid_input_naming_it(bad, seg_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" must not mean "here": nothing may appear in the cwd
    with pytest.raises(InvalidInput, match="warm_dir"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=bad, warm_bytes=MiB)
    with pytest.raises(InvalidInput, match="directory"):
        WarmTier(SPEC, bad, capacity_bytes=MiB)
    assert os.listdir(tmp_path) == []


# ---- issue 14 item 5: verify's exit status ---------------------------------------------------------------
def test_verify_exit_codes(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("verify", str(empty))
    assert proc.returncode == 1 and "no warm tier" in proc.stderr
    root = tmp_path / "warm"
    k = keys(0, 4)
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, k)
    assert cli("verify", str(root)).returncode == 0
    slab = root / SPEC.namespace / "slab-0000.bin"
    with open(slab, "r+b") as f:  # damage one block's bytes on disk
        f.seek(SLOT + 7)
        f.write(b"\xff\xfe")
    assert cli("verify", str(root)).returncode == 2
    proc = cli("verify", "--repair", str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # repaired: `verify --repair && start` works
    assert "1 dropped" in proc.stdout
    assert cli("verify", str(root)).returncode == 0


# ---- 6: TieredCache starts hot-only when the warm tier cannot open ------------------------------------
def test_cache_starts_hot_only_when_warm_cannot_open(tmp_path, seg_name):
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT) as t:
        fill(t, keys(0, 2))
    (tmp_path / SPEC.namespace / "meta.json").write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="hot-only"):
        cache = TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=16 * SLOT)
    try:
        assert cache.warm is None
        tokens = np.arange(4 * SPEC.chunk_tokens + 1)
        kv = np.ones((2, 2, 1, len(tokens), 8), np.float16)
        cache.store(tokens, kv)
        assert cache.lookup(tokens).tokens == 4 * SPEC.chunk_tokens  # the hot tier serves
        assert cache.stats()["warm_errors"] == 1
    finally:
        cache.close()
