"""The data paths copy runs, not rows: slot allocation order, run coalescing, layout helpers.

These check the invariants that make one copy per run possible (a prefix stored in one call gets
adjacent ascending slots, also after eviction and removal) and that run copies move the right bytes
in both directions and into the model layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import kv_for, payload_for, same_bytes
from tieredkv import HotTier, KVSpec, PutResult, chunk_keys
from tieredkv.layout import blocks_to_model, model_to_blocks, run_rows, slot_runs


def prompt(spec, seed, n_chunks):
    rng = np.random.default_rng(seed)
    return chunk_keys(spec, rng.integers(0, 30_000, n_chunks * spec.chunk_tokens))


@pytest.mark.parametrize("slots, runs", [
    ([5, 6, 7], [(0, 3, 5, 1)]),
    ([7, 6, 5], [(0, 3, 7, -1)]),
    ([1, 9, 8], [(0, 1, 1, 1), (1, 3, 9, -1)]),
    ([5, 6, 5, 4], [(0, 2, 5, 1), (2, 4, 5, -1)]),
    ([0, 1, 2, 10, 9, 8, 20], [(0, 3, 0, 1), (3, 6, 10, -1), (6, 7, 20, 1)]),
    ([3], [(0, 1, 3, 1)]),
    ([1, 3, 5], [(0, 1, 1, 1), (1, 2, 3, 1), (2, 3, 5, 1)]),
])
def test_slot_runs_exact(slots, runs):
    assert slot_runs(np.array(slots)) == runs


def test_slot_runs_cover_any_sequence():
    rng = np.random.default_rng(0)
    for _ in range(300):
        slots = np.cumsum(rng.choice([-1, 1, 1, 5, -7], size=rng.integers(1, 40))) + 100
        rebuilt = [s + step * i for b, e, s, step in slot_runs(slots) for i in range(e - b)]
        assert rebuilt == slots.tolist()
        rows = np.arange(400)
        for b, e, s, step in slot_runs(slots):
            assert run_rows(rows, s, e - b, step).tolist() == slots[b:e].tolist()


def five_blocks(spec):
    """A 5-chunk (+1 token) model-layout KV array, its tokens and its 5 blocks (``model_to_blocks``)."""
    tokens = np.arange(5 * spec.chunk_tokens + 1)
    kv = kv_for(spec, tokens)
    blocks = np.zeros((5, spec.block_bytes), np.uint8)
    model_to_blocks(spec, kv, 0, blocks)
    return tokens, kv, blocks


def test_layout_helpers_roundtrip(tiny_spec):
    C = tiny_spec.chunk_tokens
    tokens, kv, blocks = five_blocks(tiny_spec)
    assert same_bytes(blocks, payload_for(tiny_spec, chunk_keys(tiny_spec, tokens[:5 * C])))
    out = np.zeros_like(kv)
    blocks_to_model(tiny_spec, blocks[1:4], out, C)  # blocks 1..3 into tokens [C, 4C)
    assert same_bytes(out[:, :, :, C:4 * C], kv[:, :, :, C:4 * C])
    assert not out[:, :, :, :C].any() and not out[:, :, :, 4 * C:].any()
    # A reversed (negative stride) view of rows lands in order too.
    rev = np.zeros_like(kv)
    blocks_to_model(tiny_spec, blocks[::-1][1:4][::-1], rev, C)
    assert same_bytes(rev[:, :, :, C:4 * C], kv[:, :, :, C:4 * C])


def test_host_placer_puts_groups_where_blocks_to_model_does(tiny_spec):
    # The placer views the target's whole chunks once; groups at a chunk boundary go through that
    # view, any other position (or past the last whole chunk) through blocks_to_model.
    from tieredkv.tensors import host_placer

    C = tiny_spec.chunk_tokens
    _, kv, blocks = five_blocks(tiny_spec)
    out = np.zeros_like(kv)
    place = host_placer(tiny_spec, out[:, :, :, 1:])  # a strided target, 5 * C tokens
    for first, k in ((0, 1), (1, 3), (4, 1)):
        place(blocks[first:first + k], first * C, False)
    assert same_bytes(out[:, :, :, 1:], kv[:, :, :, :5 * C]) and not out[:, :, :, :1].any()
    skewed = np.zeros_like(kv)
    host_placer(tiny_spec, skewed)(blocks[2:4], 3, False)  # not at a chunk boundary
    assert same_bytes(skewed[:, :, :, 3:3 + 2 * C], kv[:, :, :, 2 * C:4 * C])
    assert not skewed[:, :, :, :3].any() and not skewed[:, :, :, 3 + 2 * C:].any()


def slots_of(tier, keys):
    return tier._find(keys.keys)


def test_one_call_gets_adjacent_ascending_slots(tiny_spec, seg_name):
    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        a, b = prompt(tiny_spec, 1, 8), prompt(tiny_spec, 2, 8)
        tier.put_many(a, payload_for(tiny_spec, a))
        tier.put_many(b, payload_for(tiny_spec, b))
        assert slots_of(tier, a).tolist() == list(range(8))
        assert slots_of(tier, b).tolist() == list(range(8, 16))
        # Freed slots come back as one ascending run (the free stack keeps runs in order).
        assert tier.remove(a) == 8
        c = prompt(tiny_spec, 3, 8)
        tier.put_many(c, payload_for(tiny_spec, c))
        assert slots_of(tier, c).tolist() == list(range(8))


def test_eviction_batch_keeps_runs(tiny_spec, seg_name):
    # LRU evicts the oldest prompt's slots; the next prompt stored in one call reuses them in order.
    with HotTier(tiny_spec, n_slots=16, name=seg_name, policy="lru") as tier:
        a, b, c = (prompt(tiny_spec, s, 8) for s in (1, 2, 3))
        for k in (a, b):
            assert (tier.put_many(k, payload_for(tiny_spec, k)) == PutResult.STORED).all()
        assert (tier.put_many(c, payload_for(tiny_spec, c)) == PutResult.STORED).all()
        assert tier.match(a) == 0
        assert slots_of(tier, c).tolist() == list(range(8))
        out = np.zeros((8, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(c, out) == 8
        assert same_bytes(out, payload_for(tiny_spec, c))


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_reads_coalesce_runs_in_both_directions(tiny_spec, seg_name, order):
    with HotTier(tiny_spec, n_slots=64, name=seg_name) as tier:
        keys = prompt(tiny_spec, 7, 12)
        rows = {"ascending": np.arange(12), "descending": np.arange(12)[::-1],
                "shuffled": np.random.default_rng(1).permutation(12)}[order]
        stored = keys.take(rows)
        tier.put_many(stored, payload_for(tiny_spec, stored))
        slots = slots_of(tier, keys)
        if order == "descending":
            assert slots.tolist() == list(range(11, -1, -1))
        runs = []
        assert tier.read_runs(keys, lambda i, r: runs.append((i, r.strides[0], r.copy()))) == 12
        expect = payload_for(tiny_spec, keys)
        assert same_bytes(np.concatenate([r for _, _, r in runs]), expect)
        assert all(stride > 0 for _, stride, _ in runs)  # what torch.from_numpy takes
        if order == "ascending":
            assert len(runs) == 1  # one copy for the whole prompt
        elif order == "descending":
            assert [i for i, _, _ in runs] == list(range(12))  # a block at a time, forwards in memory
        else:
            assert [i for i, _, _ in runs] == [i for a, b, _, step in slot_runs(slots)
                                              for i in ([a] if step == 1 else range(a, b))]
        out = np.zeros((12, tiny_spec.block_bytes), np.uint8)
        assert tier.get_many(keys, out) == 12
        assert same_bytes(out, expect)
        per_block = np.zeros_like(out)
        assert tier.read_into(keys, lambda i, b: per_block.__setitem__(i, b)) == 12
        assert same_bytes(per_block, expect)


def test_misaligned_destination_rows(seg_name):
    # Rows whose stride is not a multiple of 64 and a base 16 bytes off: the per-run skew path.
    spec = KVSpec(model_id="test/odd", num_layers=1, num_kv_heads=1, head_dim=9, dtype="float32",
                  chunk_tokens=4)  # 288-byte rows
    with HotTier(spec, n_slots=32, name=seg_name) as tier:
        keys = prompt(spec, 5, 9)
        data = payload_for(spec, keys)
        raw = np.zeros(9 * spec.block_bytes + 64, np.uint8)
        src = raw[16:16 + data.nbytes].reshape(9, spec.block_bytes)
        src[:] = data
        tier.put_many(keys, src)
        out_raw = np.zeros_like(raw)
        out = out_raw[16:16 + data.nbytes].reshape(9, spec.block_bytes)
        assert tier.get_many(keys, out) == 9
        assert same_bytes(out, data)


@pytest.mark.parametrize("choice", ["ufunc", "memcpy", "probe"])
def test_skewed_copy_strategy_is_chosen_per_cpu_and_copies_the_same_bytes(monkeypatch, choice):
    """A misaligned copy takes the ufunc pass or memcpy as a probe of this CPU (or the override) says;
    either way the bytes arrive."""
    from tieredkv import layout

    monkeypatch.setattr(layout, "_SKEWED_UFUNC", None)
    if choice == "probe":
        monkeypatch.delenv("TIEREDKV_SKEWED_COPY", raising=False)
    else:
        monkeypatch.setenv("TIEREDKV_SKEWED_COPY", choice)
    decided = layout.skewed_copy_uses_ufunc()
    assert isinstance(decided, bool) and layout._SKEWED_UFUNC is decided
    if choice != "probe":
        assert decided == (choice == "ufunc")
    calls = []
    real_or = np.bitwise_or
    monkeypatch.setattr(layout.np, "bitwise_or", lambda *a, **k: calls.append(1) or real_or(*a, **k))
    src = layout.page_aligned_empty((1 << 16) + 64)
    src[:] = np.arange(len(src)) % 251
    dst = layout.page_aligned_empty((1 << 16) + 64)
    s, d = src[: 1 << 16].reshape(16, -1), dst[16:16 + (1 << 16)].reshape(16, -1)
    assert layout.misaligned(d, s)
    layout.copy_rows(d, s, True)
    assert same_bytes(d, s) and bool(calls) == decided
