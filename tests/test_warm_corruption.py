"""Damaged warm tier files: bad blocks are detected, never served, and `verify` reports exactly them."""

from __future__ import annotations

import os

import numpy as np
import pytest

from helpers import flip
from tieredkv import FormatError, KVSpec, chunk_keys
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import check_index, payload_for

SPEC = KVSpec(model_id="test/warm-tiny", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
SLOT = 4096
PER_SLAB = 8


def make_tier(root, n_blocks=16, verify="always"):
    """A tier of 2 slabs x 8 slots holding ``n_blocks`` blocks of one prompt (slot i = chunk i)."""
    k = chunk_keys(SPEC, np.arange(n_blocks * SPEC.chunk_tokens))
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT, slab_bytes=PER_SLAB * SLOT, verify=verify) as t:
        t.put_many(k, payload_for(k, SPEC.block_bytes))
    return k, os.path.join(root, SPEC.namespace)


def slab(d, i):
    return os.path.join(d, f"slab-{i:04d}.bin")


def bad_of(report):
    return sorted((b["slot"], b["reason"]) for b in report["bad_blocks"])


def test_flipped_bytes(tmp_path):
    k, d = make_tier(tmp_path)
    flip(slab(d, 0), 5 * SLOT + 100)
    flip(slab(d, 1), (11 - PER_SLAB) * SLOT + SPEC.block_bytes - 1)  # last payload byte of slot 11
    flip(slab(d, 1), (12 - PER_SLAB) * SLOT + SPEC.block_bytes + 5)  # padding: not payload, harmless
    report = admin.verify(d)
    assert not report["ok"] and report["meta"] == "ok"
    assert bad_of(report) == [(5, "checksum"), (11, "checksum")]
    assert report["blocks_checked"] == 16 and report["blocks_ok"] == 14
    assert report["bad_blocks"][0]["key"] == k[5].hex() and report["bad_blocks"][0]["slab"] == 0
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        assert t.get_many(k, out) == 5  # the run stops before the first bad block
        np.testing.assert_array_equal(out[:5], payload_for(k[:5], SPEC.block_bytes))
        assert t.stats().corrupt == 2  # every block copied was checked: 5 and 11 are both caught
        assert t.match(k) == 5  # removed from the index
        assert t.contains_many(k).tolist() == [i not in (5, 11) for i in range(16)]
        assert t.get_many(k[6:], out[:10]) == 5  # 6..10 good, 11 gone
        np.testing.assert_array_equal(out[:5], payload_for(k[6:11], SPEC.block_bytes))
        assert t.get_many(k[12:], out[:4]) == 4
        assert t.stats().corrupt == 2
    report = admin.verify(d)
    assert report["ok"] and report["blocks_checked"] == 14
    check_index(d)


def test_sampled_and_never_still_catch_bad_block_when_checked(tmp_path):
    k, d = make_tier(tmp_path)
    flip(slab(d, 0), 2 * SLOT)
    with WarmTier(SPEC, tmp_path, verify="sampled", sample_rate=1.0) as t:
        assert t.get_many(k, np.zeros((16, SPEC.block_bytes), np.uint8)) == 2
        assert t.stats().corrupt == 1


def test_verify_repair_drops_exactly_the_bad_blocks(tmp_path):
    k, d = make_tier(tmp_path)
    flip(slab(d, 1), 3 * SLOT)  # slot 11
    report = admin.verify(d, repair=True)
    assert bad_of(report) == [(11, "checksum")] and report["removed"] == 1 and report["repaired"]
    after = admin.verify(d)
    assert after["ok"] and after["blocks_checked"] == 15
    with WarmTier(SPEC, tmp_path) as t:
        assert t.contains_many(k).tolist() == [i != 11 for i in range(16)]
    check_index(d)


def test_truncated_slab(tmp_path):
    k, d = make_tier(tmp_path)
    os.truncate(slab(d, 1), 3 * SLOT + 10)  # slots 8, 9, 10 intact; 11 cut short; 12..15 gone
    report = admin.verify(d)
    assert report["slabs"][1]["status"] == "truncated"
    assert bad_of(report) == [(s, "short read") for s in range(11, 16)]
    with pytest.warns(UserWarning, match=r"\['truncated'\]; dropped 5"):
        WarmTier(SPEC, tmp_path).close()
    # (opening above repaired it: records past the end dropped, the file restored to full size)
    assert os.path.getsize(slab(d, 1)) == PER_SLAB * SLOT
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        assert t.get_many(k, out) == 11
        np.testing.assert_array_equal(out[:11], payload_for(k[:11], SPEC.block_bytes))
        assert (t.put_many(k, payload_for(k, SPEC.block_bytes)) == 0).sum() == 5  # space reusable
    assert admin.verify(d)["ok"]
    check_index(d)


def test_slab_truncated_under_an_open_tier(tmp_path):
    k, d = make_tier(tmp_path)
    with WarmTier(SPEC, tmp_path) as t:
        os.truncate(slab(d, 1), 0)
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        assert t.get_many(k, out) == 8
        assert t.stats().corrupt == 8  # slots 8..15: short reads, removed
        assert t.match(k) == 8
        assert t.get_many(k[:8], out[:8]) == 8


def test_deleted_slab(tmp_path):
    k, d = make_tier(tmp_path)
    os.unlink(slab(d, 0))
    report = admin.verify(d)
    assert report["slabs"][0]["status"] == "missing" and report["slabs"][1]["status"] == "ok"
    assert bad_of(report) == [(s, "missing slab") for s in range(8)]
    with pytest.warns(UserWarning, match=r"slab\(s\) \[0\] were \['missing'\]; dropped 8"):
        t = WarmTier(SPEC, tmp_path)
    with t:
        assert t.match(k) == 0
        assert t.contains_many(k).tolist() == [False] * 8 + [True] * 8
        out = np.zeros((8, SPEC.block_bytes), np.uint8)
        assert t.get_many(k[8:], out) == 8
        np.testing.assert_array_equal(out, payload_for(k[8:], SPEC.block_bytes))
        assert (t.put_many(k[:8], payload_for(k[:8], SPEC.block_bytes)) == 0).all()
        assert t.get_many(k, np.zeros((16, SPEC.block_bytes), np.uint8)) == 16
    assert admin.verify(d)["ok"]
    check_index(d)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted", "wrong_geometry"])
def test_damaged_meta(tmp_path, damage):
    k, d = make_tier(tmp_path)
    p = os.path.join(d, "meta.json")
    if damage == "garbage":
        with open(p, "r+b") as f:
            f.write(b"\x00\xffgarbage")
    elif damage == "truncated":
        os.truncate(p, 20)
    elif damage == "deleted":
        os.unlink(p)
    else:
        text = open(p).read().replace('"n_slots": 16', '"n_slots": 12')
        open(p, "w").write(text)
    if damage == "wrong_geometry":
        with pytest.raises(Exception, match="slots"):
            WarmTier(SPEC, tmp_path)
    else:
        with pytest.raises(FormatError, match=r"meta\.json.*verify --repair"):
            WarmTier(SPEC, tmp_path)
    report = admin.verify(d)
    assert not report["ok"]
    assert report["meta"].startswith("missing" if damage == "deleted" else "damaged")
    assert report["bad_blocks"] == [] and report["blocks_checked"] == 16  # the data is fine
    report = admin.verify(d, repair=True)
    assert report["meta"] == "restored"
    assert admin.verify(d)["ok"]
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        assert t.get_many(k, out) == 16
        np.testing.assert_array_equal(out, payload_for(k, SPEC.block_bytes))


def test_flipped_bytes_caught_by_the_grouped_hashing(tmp_path, monkeypatch):
    # Groups of 3 blocks: each group is hashed and handed to the sink right after it is read.
    from tieredkv.warm import reads as warm_reads

    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", 3 * SPEC.block_bytes)
    k, d = make_tier(tmp_path)
    flip(slab(d, 1), (13 - PER_SLAB) * SLOT + 7)  # slot 13: the fifth group
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        seen = []
        assert t.get_many(k, out, lambda i, rows: seen.append(i)) == 13
        np.testing.assert_array_equal(out[:13], payload_for(k[:13], SPEC.block_bytes))
        assert t.stats().corrupt == 1
        assert t.contains_many(k).tolist() == [i != 13 for i in range(16)]
        assert seen == [0, 3, 6, 9, 12, 15]  # the grouped path ran (not the one-read one)


@pytest.mark.parametrize("group_blocks", [3, 1000])  # the grouped path and the one-read one
def test_sink_gets_every_group_in_order_and_its_errors_surface(tmp_path, monkeypatch, group_blocks):
    from tieredkv.warm import reads as warm_reads

    monkeypatch.setattr(warm_reads, "READ_GROUP_BYTES", group_blocks * SPEC.block_bytes)
    k, _ = make_tier(tmp_path)
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros((16, SPEC.block_bytes), np.uint8)
        seen = []
        assert t.get_many(k, out, lambda i, rows: seen.append((i, rows.copy()))) == 16
        assert [i for i, _ in seen] == ([0, 3, 6, 9, 12, 15] if group_blocks == 3 else [0])
        np.testing.assert_array_equal(np.concatenate([r for _, r in seen]), payload_for(k, SPEC.block_bytes))

        def boom(i, rows):
            raise RuntimeError("sink failed")

        with pytest.raises(RuntimeError, match="sink failed"):
            t.get_many(k, out, boom)
