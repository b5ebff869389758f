"""Compact warm tiers (``WarmTier(slot_fraction=...)``): slots smaller than a block hold its compressed
frame, so the same disk holds more blocks. Capacity, refusal of blocks that do not fit, reopening,
damaged frames, a writer killed mid-write, and tiers of full slots (format version 1) left as they were.

The data is bf16 bit patterns of normal floats (``test_compression.bf16_payloads``): 0.70 of their bytes
with "zstd", like real KV (0.68-0.72, docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import secrets
import textwrap
import warnings

import numpy as np
import posix_ipc
import pytest
from test_compression import SLOT, SPEC, bf16_payloads, keys_of, kill_writer_and_check, lengths_of, noise

from helpers import flip
from tieredkv import TieredCache
from tieredkv.config import WarmConfig
from tieredkv.errors import FormatError, InvalidInput
from tieredkv.tier import PutResult
from tieredkv.warm import WarmTier, admin, packed
from tieredkv.warm import meta as mt
from tieredkv.warm.testing import check_index

pytest.importorskip("blosc2", reason="compression needs blosc2 (tieredkv[compress]; .ci/setup installs it)")

COMPACT = 24576  # 0.75 of a 32 KiB block: six 4 KiB pages
BUDGET = 16 * SLOT  # the disk budget every tier here gets: 16 full slots, 21 compact ones


def fill(tier, n, batch=4, base=0):
    """Store ``n`` blocks in batches (the tier evicts, LRU, once full); return their keys and bytes."""
    k = keys_of(n, base)
    data = bf16_payloads(k)
    for b in range(0, n, batch):
        codes = tier.put_many(k[b:b + batch], data[b:b + batch])
        assert (codes == PutResult.STORED).all()
    return k, data


def slab_bytes_on_disk(root):
    d = root / SPEC.namespace
    return sum(os.path.getsize(d / f) for f in os.listdir(d) if f.startswith("slab-"))


def test_the_same_disk_budget_holds_more_blocks(tmp_path):
    """Full slots, compressed or not, hold 16 blocks in the budget; compact ones hold 21 (1.31x), in
    slab files no larger, and every block still there reads back exactly."""
    held = {}
    for name, kwargs in {"raw": {}, "zstd": {"compress": "zstd"}, "compact": {"slot_fraction": 0.75}}.items():
        root = tmp_path / name
        with WarmTier(SPEC, root, BUDGET, **kwargs) as t:
            k, data = fill(t, 40)
            resident = t.contains_many(k)
            held[name] = int(resident.sum())
            assert t.stats().used_blocks == held[name] == t.stats().capacity_blocks
            first = int(np.argmax(resident))
            assert resident[first:].all()  # LRU kept the newest ones
            out = np.zeros((40 - first, SPEC.block_bytes), np.uint8)
            assert t.get_many(k[first:], out) == 40 - first
            np.testing.assert_array_equal(out, data[first:])
        assert slab_bytes_on_disk(root) <= BUDGET
    assert held == {"raw": 16, "zstd": 16, "compact": 21}
    meta = mt.read_meta(str(tmp_path / "compact" / SPEC.namespace))
    assert meta["slot_bytes"] == COMPACT and meta["compact"] is True and meta["format_version"] == 2


def test_a_block_that_does_not_fit_is_refused_and_leaves_nothing(tmp_path):
    """Incompressible blocks in a batch are NO_SPACE (counted too_big); their claims are given back,
    the others are stored, and the tier can still fill every slot."""
    k = keys_of(8)
    data = bf16_payloads(k)
    data[2], data[5] = noise(k[2:3])[0], noise(k[5:6])[0]
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        codes = t.put_many(k, data)
        assert codes.tolist() == [PutResult.STORED if i not in (2, 5) else PutResult.NO_SPACE for i in range(8)]
        assert t.stats().extra["too_big"] == 2 and t.stats().used_blocks == 6
        assert t.contains_many(k).tolist() == [i not in (2, 5) for i in range(8)]
        assert (lengths_of(t, k[:2]) <= COMPACT).all() and (lengths_of(t, k[6:]) <= COMPACT).all()
        counts = check_index(str(tmp_path / SPEC.namespace))  # no claim left, every slot accounted for
        assert counts["used"] == 6 and counts["claimed"] == 0
        more, _ = fill(t, 15, base=10_000)
        assert t.stats().used_blocks == 21 and t.stats().evictions == 0
        assert t.contains_many(more).all()


def test_reopened_compact_tier_keeps_its_slots_and_writes_compressed(tmp_path):
    """A restart without any compression option: the tier stays compact, new blocks are still framed
    (zstd), old ones read back; a tier made by another codec mixes with this one's frames."""
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.85, compress="lz4") as t:
        k1, d1 = fill(t, 6)
        l1 = lengths_of(t, k1)
    assert (l1 <= 28672).all()  # 0.85 of a block, rounded up to 4 KiB: lz4's frames fit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same capacity_bytes: no "keeps its capacity" warning
        t = WarmTier(SPEC, tmp_path, BUDGET)
    with t:
        assert t.stats().extra["compact"] and t.stats().extra["compress"] == "zstd"
        k2, d2 = fill(t, 6, base=5000)
        assert (lengths_of(t, k2) < l1.min()).all()  # zstd frames: smaller than lz4's
    with WarmTier(SPEC, tmp_path, verify="never", readonly=True) as t:
        for k, d in ((k1, d1), (k2, d2)):
            out = np.zeros_like(d)
            assert t.get_many(k, out) == len(k)
            np.testing.assert_array_equal(out, d)
    assert admin.verify(str(tmp_path / SPEC.namespace))["ok"]


def test_evicted_compact_blocks_are_handed_on_decompressed(tmp_path):
    got = []
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75, on_evict=got.append) as t:
        k, data = fill(t, 25)
        ev = t.evict(2)
    handed = np.concatenate([e.payloads for e in got] + [ev.payloads])
    keys = np.concatenate([e.keys.keys for e in got] + [ev.keys.keys])
    assert len(handed) == 6  # 4 evicted to make room, 2 asked for
    for key, row in zip(keys, handed):
        np.testing.assert_array_equal(row, data[int(np.flatnonzero((k.keys == key).all(axis=1))[0])])


@pytest.mark.parametrize("verify", ["always", "never"])
def test_a_damaged_compact_frame_is_a_counted_miss(tmp_path, verify):
    k = keys_of(8)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        t.put_many(k, data)
        lengths = lengths_of(t, k)
    slab = tmp_path / SPEC.namespace / "slab-0000.bin"
    flip(slab, 3 * COMPACT + lengths[3] // 2)   # block 3's body, at the compact slot's offset
    flip(slab, 6 * COMPACT + lengths[6] + 10)   # past block 6's frame, inside its slot: unused
    report = admin.verify(str(tmp_path / SPEC.namespace))
    assert [(b["slot"], b["reason"]) for b in report["bad_blocks"]] == [(3, "checksum")]
    with WarmTier(SPEC, tmp_path, verify=verify) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 3
        np.testing.assert_array_equal(out[:3], data[:3])
        assert t.stats().corrupt == 1 and not t.contains_many(k[3:4])[0]
        assert t.get_many(k[4:], out[:4]) == 4
        np.testing.assert_array_equal(out[:4], data[4:])


def test_a_record_longer_than_its_compact_slot_is_never_read(tmp_path):
    """A length field damaged to more than a slot (it would read the next slot's bytes) is a miss."""
    k = keys_of(2)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        t.put_many(k, data)
        raw = t._raw(k[:1])

        def lengthen(txn):
            rec = np.frombuffer(txn.get(raw, db=t._index.blocks), dtype=t._rec).copy()
            rec["length"] = COMPACT + 4096
            txn.put(raw, rec.tobytes(), db=t._index.blocks)

        t._index.write(lengthen)
        assert t.contains_many(k).tolist() == [False, True]
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 0
    lengths = np.array([COMPACT, COMPACT + 1, SPEC.block_bytes, packed.FRAME.size + 1])
    assert packed.valid_length(lengths, SPEC.block_bytes, COMPACT).tolist() == [True, False, False, True]
    assert packed.valid_length(lengths, SPEC.block_bytes, SLOT).tolist() == [True, True, True, True]


def test_tiers_of_full_slots_keep_format_version_1(tmp_path):
    """The default (and compression in full slots) writes the meta document of version 1 with the
    fields it always had, so tieredkv versions before compact tiers open it; a compact option given
    to an existing tier of full slots changes nothing."""
    with WarmTier(SPEC, tmp_path, BUDGET, compress="zstd") as t:
        k, data = fill(t, 4)
    meta = json.loads((tmp_path / SPEC.namespace / "meta.json").read_text())
    assert meta["format_version"] == 1 and "compact" not in meta
    assert sorted(meta) == ["block_bytes", "capacity_bytes", "fingerprint", "format", "format_version",
                            "n_slots", "namespace", "slot_bytes", "slots_per_slab", "spec"]
    with pytest.warns(UserWarning, match="keeps its slots of 32768 bytes; slot_fraction=0.75"):
        t = WarmTier(SPEC, tmp_path, slot_fraction=0.75)
    with t:
        assert t.slot_bytes == SLOT and not t.stats().extra["compact"]
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 4
        np.testing.assert_array_equal(out, data)
        raw_k = keys_of(1, base=9000)
        noisy = noise(raw_k)
        assert t.put_many(raw_k, noisy)[0] == PutResult.STORED  # full slots still take raw blocks


@pytest.mark.parametrize("edit, message", [
    ({"format_version": 2}, "compact tier is version 2"),               # version 2 that is not compact
    ({"compact": True}, "compact tier is version 2"),                   # compact but version 1
    ({"format_version": 2, "compact": True, "slot_bytes": SLOT}, "impossible slot geometry"),
])
def test_meta_of_a_compact_tier_is_checked(tmp_path, edit, message):
    WarmTier(SPEC, tmp_path, BUDGET).close()
    p = tmp_path / SPEC.namespace / "meta.json"
    meta = json.loads(p.read_text())
    meta.update(edit)
    p.write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=message):
        WarmTier(SPEC, tmp_path)


def test_slot_fraction_is_checked(tmp_path):
    for bad in (0, 1.5, True, "0.75"):
        with pytest.raises(InvalidInput, match="slot_fraction"):
            WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=bad)
    # a fraction that rounds up to the whole block makes an ordinary tier
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.99) as t:
        assert t.slot_bytes == SLOT and t.meta["format_version"] == 1


def test_warm_config_slot_fraction_is_checked(tmp_path):
    for bad in (0, 2, True, "x"):
        with pytest.raises(InvalidInput, match="slot_fraction"):
            WarmConfig(tmp_path, "1M", slot_fraction=bad)
    assert WarmConfig(tmp_path, "1M", slot_fraction=0.75).slot_fraction == 0.75


def test_tiered_cache_warm_slot_fraction(tmp_path):
    name = f"/tkv-test-{secrets.token_hex(4)}"
    with TieredCache(SPEC, hot_bytes=1 << 20, hot_name=name, warm_dir=tmp_path, warm_bytes=BUDGET,
                     demotion="write_through", warm_slot_fraction=0.75) as cache:
        k = keys_of(24)
        tokens = np.arange(24 * SPEC.chunk_tokens + 1)
        data = bf16_payloads(k)
        kv = data.view(np.uint16).reshape(24, *SPEC.block_shape).transpose(1, 2, 3, 0, 4, 5).reshape(
            SPEC.num_layers, 2, SPEC.num_kv_heads, 24 * SPEC.chunk_tokens, SPEC.head_dim)
        cache.store(tokens, np.ascontiguousarray(kv))
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
    with WarmTier(SPEC, tmp_path) as t:
        assert t.stats().used_blocks == 21 and t.slot_bytes == COMPACT


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_compression import SPEC, SLOT, bf16_payloads, keys_of, noise
    from tieredkv.warm import WarmTier
    with WarmTier(SPEC, {root!r}, 16 * SLOT, slot_fraction=0.75, sync={sync!r}) as t:
        for i in range(100000):
            k = keys_of(6, base=(i % 50) * 1000)
            data = bf16_payloads(k)
            data[5] = noise(k[5:])[0]  # refused: its claim is given back on every round
            t.put_many(k, data)
            t.remove(k[:2]) if i % 3 == 0 else None
            if i == 2:
                print("running", flush=True)
""")


@pytest.mark.procs
@pytest.mark.parametrize("sync", ["none", "data"])
def test_sigkilled_compact_writer_leaves_only_sound_blocks(tmp_path, sync):
    code = _WRITER.format(tests=os.path.dirname(__file__), root=str(tmp_path), sync=sync)
    kill_writer_and_check(code, tmp_path, 3, longest=5)  # the incompressible sixth block is never stored
    with WarmTier(SPEC, tmp_path) as t:
        assert t.slot_bytes == COMPACT


def test_a_truncated_compact_slab_keeps_the_blocks_before_the_cut(tmp_path):
    """Repair at open counts in compact slots: the blocks whose slots are whole stay, the rest go."""
    k = keys_of(10)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        t.put_many(k, data)
    slab = tmp_path / SPEC.namespace / "slab-0000.bin"
    os.truncate(slab, 6 * COMPACT + 100)  # slots 0-5 whole, slot 6 cut
    with pytest.warns(UserWarning, match="dropped 4 block"):
        t = WarmTier(SPEC, tmp_path)
    with t:
        assert t.contains_many(k).tolist() == [True] * 6 + [False] * 4
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 6
        np.testing.assert_array_equal(out[:6], data[:6])
        assert os.path.getsize(slab) == 21 * COMPACT  # restored to its full size
        assert (t.put_many(k[6:], data[6:]) == PutResult.STORED).all()
    assert admin.verify(str(tmp_path / SPEC.namespace))["ok"]


def test_a_directory_made_before_compact_tiers_opens_and_reads_unchanged(tmp_path):
    """tests/data/warm-v1.tar.gz was written by tieredkv before compact tiers existed (format version
    1): two raw blocks, three zstd frames and an incompressible block stored raw, 4 KiB blocks in 8
    slots. This version reads every block, and writing into it (compact option or not) keeps it a
    version-1 tier of full slots that the older tieredkv still opens."""
    import tarfile

    from tieredkv import KVSpec, chunk_keys

    with tarfile.open(os.path.join(os.path.dirname(__file__), "data", "warm-v1.tar.gz")) as tar:
        tar.extractall(tmp_path, filter="data")
    spec = KVSpec(model_id="test/v1-fixture", num_layers=1, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                  chunk_tokens=16)
    tier_dir = tmp_path / spec.namespace
    for d, _, names in os.walk(tier_dir):  # the modes a tier keeps (tar's "data" filter widens some)
        os.chmod(d, 0o700)
        for name in names:
            os.chmod(os.path.join(d, name), 0o600)
    k = chunk_keys(spec, np.arange(6 * 16))
    data = np.empty((6, 4096), np.uint8)
    for i in range(5):
        f = np.random.default_rng(i).standard_normal(2048).astype(np.float32)
        data[i] = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    data[5] = np.random.default_rng(99).integers(0, 256, 4096, dtype=np.uint8)
    meta_before = (tier_dir / "meta.json").read_bytes()
    assert json.loads(meta_before)["format_version"] == 1 and admin.verify(str(tier_dir))["ok"]
    # 0.75 of a 4 KiB block rounds up to a full slot: nothing to warn about, nothing changes
    with WarmTier(spec, tmp_path, slot_fraction=0.75, compress="zstd") as t:
        assert t.slot_bytes == 4096 and t.n_slots == 8 and t.stats().used_blocks == 6
        assert (lengths_of(t, k[2:5]) < 4096).all() and lengths_of(t, k[:2]).tolist() == [4096, 4096]
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 6
        np.testing.assert_array_equal(out, data)
        more = chunk_keys(spec, np.arange(2 * 16) + 5000)
        assert (t.put_many(more, data[:2]) == PutResult.STORED).all()
    assert (tier_dir / "meta.json").read_bytes() == meta_before
    assert admin.verify(str(tier_dir))["ok"]


def test_verify_repair_restores_a_compact_meta_and_drops_a_damaged_frame(tmp_path):
    """``tieredkv verify --repair``: a damaged meta.json comes back from the index's copy still
    compact (version 2), and a damaged frame's record is removed; the rest reads back."""
    k = keys_of(6)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        t.put_many(k, data)
        lengths = lengths_of(t, k)
    tier_dir = tmp_path / SPEC.namespace
    (tier_dir / "meta.json").write_text("{ damaged")
    flip(tier_dir / "slab-0000.bin", 2 * COMPACT + lengths[2] // 3)
    report = admin.verify(str(tier_dir), repair=True)
    assert [b["slot"] for b in report["bad_blocks"]] == [2] and report["removed"] == 1
    assert mt.read_meta(str(tier_dir))["compact"] is True
    assert admin.verify(str(tier_dir))["ok"]
    with WarmTier(SPEC, tmp_path) as t:
        assert t.slot_bytes == COMPACT and t.contains_many(k).tolist() == [i != 2 for i in range(6)]
        out = np.zeros_like(data)
        assert t.get_many(k[3:], out[:3]) == 3
        np.testing.assert_array_equal(out[:3], data[3:])


def test_a_refused_block_evicts_nothing_from_a_full_tier(tmp_path):
    """A block that cannot fit is known before slots are claimed: a full tier keeps all its blocks."""
    with WarmTier(SPEC, tmp_path, BUDGET, slot_fraction=0.75) as t:
        k, data = fill(t, 21)
        odd = keys_of(2, base=50_000)
        payload = bf16_payloads(odd)
        payload[1] = noise(odd[1:])[0]
        assert t.put_many(odd, payload).tolist() == [PutResult.STORED, PutResult.NO_SPACE]
        assert t.stats().evictions == 1  # for the block that fits, none for the one that does not
        assert int(t.contains_many(k).sum()) == 20 and t.stats().extra["too_big"] == 1
