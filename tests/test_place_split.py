"""Large placements into host memory in two halves: a run of hot blocks that ``TieredCache.load`` copies
into a numpy array or a CPU tensor is split between the calling thread and the placement's helper thread
(``tieredkv.halves.SPLIT_BYTES``) when a CPU is free. Under test: the split happens,
the destination gets the stored bytes (contiguous, strided, a CPU tensor), and busy CPUs place it all on
the calling thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from helpers import kv_for, same_bytes
from tieredkv import KVSpec, TieredCache, halves
from tieredkv.halves import Halves

SPEC = KVSpec(model_id="test/place-split", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              chunk_tokens=8)  # 4 KiB blocks
N = 24


@pytest.fixture
def splits(monkeypatch):
    """Placements of 4 blocks or more split; a CPU free whatever the host's load; each run's outcome."""
    monkeypatch.setattr(halves, "SPLIT_BYTES", 4 * SPEC.block_bytes)
    monkeypatch.setattr(halves, "other_cpu_free", lambda: True)
    seen: list[tuple[bool, set[int]]] = []
    run = Halves.run

    def recorded(self, first, second):
        threads: set[int] = set()

        def on(fn):
            return lambda: (threads.add(threading.get_ident()), fn())

        seen.append((run(self, on(first), on(second)), threads))
        return seen[-1][0]

    monkeypatch.setattr(Halves, "run", recorded)
    return seen


def hot_cache(tmp_path, seg_name):
    tokens = np.random.default_rng(5).integers(0, 30_000, N * SPEC.chunk_tokens + 3)
    kv = kv_for(SPEC, tokens)
    cache = TieredCache(SPEC, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=32 * 4096)
    assert cache.store(tokens, kv) == N
    return cache, tokens, kv


@pytest.mark.parametrize("kind", ["numpy", "strided", "torch"])
def test_a_hot_run_is_placed_in_two_halves_with_the_stored_bytes(tmp_path, seg_name, splits, kind):
    C, s = SPEC.chunk_tokens, SPEC
    cache, tokens, kv = hot_cache(tmp_path, seg_name)
    with cache:
        if kind == "numpy":
            out = np.zeros_like(kv)
        elif kind == "strided":  # (tokens, head_dim) planes not contiguous
            out = np.swapaxes(np.zeros((s.num_layers, 2, s.num_kv_heads, s.head_dim, kv.shape[3]), np.float16), 3, 4)
        else:
            out = torch.zeros(kv.shape, dtype=torch.float16)
        hit = cache.lookup(tokens)
        assert hit.hot_blocks == N
        assert cache.load(hit, out) == N * C
        assert [split for split, _ in splits] == [True]
        assert len(splits[0][1]) == 2  # two threads placed it
        got = out.numpy() if kind == "torch" else np.ascontiguousarray(out)
        assert same_bytes(got[:, :, :, :N * C], kv[:, :, :, :N * C])


def test_busy_cpus_place_the_run_on_the_calling_thread(tmp_path, seg_name, splits, monkeypatch):
    C = SPEC.chunk_tokens
    monkeypatch.setattr(halves, "other_cpu_free", lambda: False)
    cache, tokens, kv = hot_cache(tmp_path, seg_name)
    with cache:
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(tokens), out) == N * C
        assert splits == [(False, {threading.get_ident()})]
        assert same_bytes(out[:, :, :, :N * C], kv[:, :, :, :N * C])


def test_a_small_run_is_placed_in_one_piece(tmp_path, seg_name, splits):
    C = SPEC.chunk_tokens
    cache, tokens, kv = hot_cache(tmp_path, seg_name)
    with cache:
        few = tokens[:3 * C + 1]  # 3 blocks: under the 4-block threshold
        out = np.zeros_like(kv)
        assert cache.load(cache.lookup(few), out) == 3 * C
        assert splits == []
        assert same_bytes(out[:, :, :, :3 * C], kv[:, :, :, :3 * C])
