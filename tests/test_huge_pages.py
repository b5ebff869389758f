"""Huge pages for the hot segment: a tmpfs mounted with ``huge=always`` (needs root to mount one)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from helpers import payload_for
from tieredkv import HotTier, KVSpec, TieredCache, chunk_keys
from tieredkv.hot import admin
from tieredkv.hot import segment as seg

SPEC = KVSpec(model_id="test/huge", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", chunk_tokens=64)


@pytest.fixture
def huge_dir(tmp_path):
    """A 64 MiB tmpfs mounted with huge=always, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "huge"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=64m,mode=0700", "none", str(point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"this host refuses a huge=always tmpfs: {done.stderr.strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def test_policy_of_mounts(huge_dir):
    assert seg.huge_page_policy(huge_dir) == "always"
    assert seg.huge_page_policy("/proc") == "unknown"  # not a tmpfs


def test_segment_on_huge_tmpfs_gets_huge_pages(huge_dir, seg_name, monkeypatch):
    monkeypatch.setenv(seg.SHM_DIR_ENV, str(huge_dir))
    keys = chunk_keys(SPEC, np.arange(32 * SPEC.chunk_tokens))
    data = payload_for(SPEC, keys)
    with HotTier(SPEC, n_slots=40, name=seg_name) as tier:
        assert (huge_dir / seg_name.lstrip("/")).exists()
        assert not (seg.SHM_DIR / seg_name.lstrip("/")).exists()
        tier.put_many(keys, data)
        out = np.zeros_like(data)
        assert tier.get_many(keys, out) == 32
        assert np.array_equal(out, data)
        extra = tier.stats().extra
        assert extra["huge_pages"] == "always" and extra["shm_dir"] == str(huge_dir)
        assert extra["huge_mapped_bytes"] >= 2 << 20  # at least one 2 MiB page backs what we touched
        # Another handle (another process would do the same) finds it through the same directory.
        with HotTier(SPEC, name=seg_name, policy=None, create=False) as other:
            assert other.match(keys) == 32
        tier.unlink()
    assert not (huge_dir / seg_name.lstrip("/")).exists()


def test_cache_and_ls_see_the_directory(huge_dir, seg_name, monkeypatch):
    monkeypatch.setenv(seg.SHM_DIR_ENV, str(huge_dir))
    with TieredCache(SPEC, hot_blocks=8, hot_name=seg_name) as cache:
        assert cache.hot.stats().extra["shm_dir"] == str(huge_dir)
        [doc] = [d for d in admin.list_segments() if d["name"] == seg_name]
        assert doc["huge_pages"] == "always" and not doc["error"]
        cache.unlink_hot()


def test_default_dev_shm_reports_its_policy(tiny_spec, seg_name, monkeypatch):
    monkeypatch.delenv(seg.SHM_DIR_ENV, raising=False)
    with HotTier(tiny_spec, n_slots=4, name=seg_name) as tier:
        extra = tier.stats().extra
        assert extra["shm_dir"] == str(seg.SHM_DIR)
        assert extra["huge_pages"] in ("always", "within_size", "advise", "never", "unknown")
        assert extra["huge_mapped_bytes"] >= 0
