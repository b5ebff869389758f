"""`tieredkv stats` on a host without a segment yet (a watcher started before the workers): not a usage
error. Once it exits 1 saying what is missing; with --watch it waits for the segment and shows it.
Each test has a segment directory of its own (TIEREDKV_SHM_DIR), so other tests' segments are not seen."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CREATE = """
import numpy as np
from tieredkv import KVSpec, TieredCache
spec = KVSpec(model_id="watch-me", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=4)
with TieredCache(spec, hot_bytes=4 << 20, hot_name="/tieredkv-watch-me{suffix}") as cache:
    cache.store(np.arange(8), np.ones((1, 2, 1, 8, 8), np.float16))
    cache.lookup(np.arange(9))
"""


def _env(shm: Path) -> dict:
    return {**os.environ, "TIEREDKV_SHM_DIR": str(shm), "PYTHONPATH": str(ROOT)}


def _tieredkv(shm: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv", *args], capture_output=True, text=True,
                          env=_env(shm), timeout=timeout)


@pytest.mark.procs
def test_stats_without_any_segment_is_not_a_usage_error(tmp_path):
    proc = _tieredkv(tmp_path, "stats")
    assert proc.returncode == 1, proc.stderr
    assert "no tieredkv segment" in proc.stderr and "tieredkv ls" in proc.stderr
    assert "usage:" not in proc.stderr
    named = _tieredkv(tmp_path, "stats", "nope")
    assert named.returncode == 1 and "no segment named 'nope'" in named.stderr


@pytest.mark.procs
def test_stats_watch_waits_for_the_first_segment(tmp_path):
    watcher = subprocess.Popen([sys.executable, "-m", "tieredkv", "stats", "--watch", "0.2", "--count", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        err_line = watcher.stderr.readline()             # announced at once, before any segment exists
        assert "waiting" in err_line and time.monotonic() < deadline, err_line
        assert watcher.poll() is None
        subprocess.run([sys.executable, "-c", CREATE.format(suffix="")], check=True, env=_env(tmp_path), timeout=60)
        out, err = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    assert "/tieredkv-watch-me" in out and "PREFIX HIT RATE" in out  # (its counters may be read before the store)


@pytest.mark.procs
def test_stats_with_several_segments_and_no_name_is_still_a_usage_error(tmp_path):
    for suffix in ("-a", "-b"):
        subprocess.run([sys.executable, "-c", CREATE.format(suffix=suffix)], check=True, env=_env(tmp_path),
                       timeout=60)
    proc = _tieredkv(tmp_path, "stats", "--watch", "1")
    assert proc.returncode == 2 and "name one of" in proc.stderr, proc.stderr
