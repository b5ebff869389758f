"""Lossless compression of warm and remote blocks (tieredkv.codec, tieredkv.warm.packed, codec 2 of the
remote value): round trips, mixed raw/compressed data, damaged frames, and a process without the codec.

The data is bf16 bit patterns of normally distributed floats, which compress about like real KV (their
high bytes take few values, their low bytes are close to random); random bytes would not compress.
"No codec here" is simulated by configuration (``TIEREDKV_DISABLE_CODECS=blosc2``), not by uninstalling.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import flip
from tieredkv import KVSpec, TieredCache, chunk_keys
from tieredkv import codec as cd
from tieredkv.config import WarmConfig
from tieredkv.errors import InvalidInput, MissingDependency
from tieredkv.tier import PutResult
from tieredkv.warm import WarmTier, admin, packed
from tieredkv.warm.testing import check_index

pytest.importorskip("blosc2", reason="compression needs blosc2 (tieredkv[compress]; .ci/setup installs it)")

# 4 layers x 2 x 2 heads x 16 tokens x 64 dims x 2 bytes = 32 KiB blocks, 8 per 4 KiB-aligned slab row
SPEC = KVSpec(model_id="test/compress", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
              chunk_tokens=16)
SLOT = SPEC.block_bytes  # already a multiple of 4096


def bf16_payloads(keys, block_bytes=SPEC.block_bytes) -> np.ndarray:
    """``(n, block_bytes)`` uint8: bf16 patterns of normal floats, a pure function of each key."""
    out = np.empty((len(keys), block_bytes), np.uint8)
    for i in range(len(keys)):
        rng = np.random.default_rng(int(keys.keys[i, 0]))
        f = rng.standard_normal(block_bytes // 2).astype(np.float32)
        out[i] = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return out


def noise(keys, block_bytes=SPEC.block_bytes) -> np.ndarray:
    """Incompressible payloads (random bytes), a pure function of each key."""
    return np.stack([np.random.default_rng(int(k) ^ 0x5A5A).integers(0, 256, block_bytes, dtype=np.uint8)
                     for k in keys.keys[:, 0]])


def keys_of(n, base=0):
    return chunk_keys(SPEC, np.arange(n * SPEC.chunk_tokens) + base)


def lengths_of(tier, keys):
    raw = tier._raw(keys)
    recs, found = tier._index.read(lambda txn: tier._lookup(txn, raw, keys, len(keys), False))
    assert found.all()
    return recs["length"].astype(int)


@pytest.fixture
def no_blosc2(monkeypatch):
    """This process behaves as if blosc2 were not installed."""
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")


# ---- the codec ------------------------------------------------------------------------------------
def kv_of_width(dtype_bytes: int) -> np.ndarray:
    """One block of normal floats as fp32 (4), bf16 (2) or their top byte, fp8-like (1)."""
    f = np.random.default_rng(dtype_bytes).standard_normal(SPEC.block_bytes // 4).astype(np.float32)
    if dtype_bytes == 4:
        return f.view(np.uint8)
    bf16 = np.concatenate([f, -f]).view(np.uint32) >> 16
    return (bf16.astype(np.uint16) if dtype_bytes == 2 else (bf16 >> 8).astype(np.uint8)).view(np.uint8)[
        :SPEC.block_bytes]


@pytest.mark.parametrize("name", ["zstd", "lz4", "zlib"])
@pytest.mark.parametrize("dtype_bytes", [1, 2, 4])
def test_codec_round_trip_every_typesize(name, dtype_bytes):
    raw = np.ascontiguousarray(kv_of_width(dtype_bytes))
    comp = cd.Compressor(name, dtype_bytes)
    assert comp.typesize == dtype_bytes  # the shuffle's element size is the KV dtype's
    body = comp.compress(raw)
    if body is None:  # LZ4 codes no entropy: fp8 and fp32 patterns save it too little
        assert name == "lz4" and dtype_bytes != 2
        return
    assert len(body) <= raw.nbytes * (1 - cd.MIN_SAVING)
    out = np.zeros_like(raw)
    assert cd.decompress_into(comp.id, body, out, comp.typesize)
    np.testing.assert_array_equal(out, raw)


def test_zstd_reaches_the_ratio_of_byte_planes():
    raw = bf16_payloads(keys_of(4)).reshape(-1)
    ratio = raw.nbytes / len(cd.Compressor("zstd", 2).compress(raw))
    assert ratio > 1.3, ratio  # the low plane is random: about 16 / (3 + 8) bits is the bound


def test_incompressible_blocks_are_not_compressed():
    assert cd.Compressor("zstd", 2).compress(noise(keys_of(1))[0]) is None


def test_decompress_checks_sizes_before_touching_the_destination():
    raw = bf16_payloads(keys_of(1))[0]
    body = cd.Compressor("zstd", 2).compress(raw)
    small = np.zeros(raw.nbytes // 2, np.uint8)  # blosc2 itself would write past it
    assert not cd.decompress_into(cd.BLOSC2, body, small, 2)
    assert not small.any()
    out = np.zeros_like(raw)
    assert not cd.decompress_into(cd.BLOSC2, body[:-1], out, 2)  # truncated
    assert not cd.decompress_into(cd.BLOSC2, b"not a chunk at all", out, 2)
    assert not cd.decompress_into(cd.BLOSC2, b"", out, 2)
    with pytest.raises(MissingDependency, match="codec 99"):  # a codec added later: not damage
        cd.decompress_into(99, body, out, 2)


def test_choices_are_checked():
    assert cd.choice(None) == cd.choice(False) == cd.choice("0") == "none"
    assert cd.choice(True) == cd.choice("1") == "zstd"
    with pytest.raises(InvalidInput, match="compress must be one of"):
        cd.choice("brotli")
    with pytest.raises(InvalidInput, match="too slow"):
        WarmTier(SPEC, "/nonexistent-never-made", 1 << 20, compress="zlib")


def test_missing_codec_raises_with_the_pip_command(no_blosc2, tmp_path):
    with pytest.raises(MissingDependency, match=r"pip install 'tieredkv\[compress\]'"):
        cd.Compressor("zstd", 2)
    with pytest.raises(MissingDependency, match="blosc2"):
        WarmTier(SPEC, tmp_path, 8 * SLOT, compress="zstd")
    with pytest.raises(MissingDependency, match="blosc2"):
        WarmConfig(dir=tmp_path, bytes="1M", compress="lz4")
    with pytest.raises(MissingDependency, match="blosc2"):
        TieredCache(SPEC, hot_bytes=1 << 20, hot_name=f"/tkv-test-{secrets.token_hex(4)}",
                    warm_dir=tmp_path, warm_bytes="1M", warm_compress="zstd")
    assert cd.Compressor("zlib", 2).compress(bf16_payloads(keys_of(1))[0]) is not None  # needs nothing


# ---- warm --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_warm_round_trip_compressed(tmp_path, name):
    k = keys_of(12)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, 16 * SLOT, compress=name) as t:
        assert (t.put_many(k, data) == PutResult.STORED).all()
        assert (lengths_of(t, k) < SPEC.block_bytes).all()  # every block went to disk framed
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 12
        np.testing.assert_array_equal(out, data)
        assert t.stats().extra["compress"] == name
        # eviction hands the raw bytes on (the hook to a lower tier)
        ev = t.evict(3)
        assert len(ev.keys) == 3
        for key, payload in zip(ev.keys.keys, ev.payloads):
            np.testing.assert_array_equal(payload, data[int(np.flatnonzero((k.keys == key).all(1))[0])])
    check_index(str(tmp_path / SPEC.namespace))
    assert admin.verify(str(tmp_path / SPEC.namespace))["ok"]


def test_sink_sees_decompressed_rows(tmp_path):
    k = keys_of(40)
    data = bf16_payloads(k)
    seen = np.zeros_like(data)

    def sink(i, rows):
        seen[i:i + len(rows)] = rows

    with WarmTier(SPEC, tmp_path, 48 * SLOT, compress="zstd") as t:
        t.put_many(k, data)
        out = np.zeros_like(data)
        assert t.get_many(k, out, sink=sink) == 40  # 40 x 32 KiB: several read groups
    np.testing.assert_array_equal(seen, data)


def test_mixed_raw_and_compressed_in_one_directory(tmp_path):
    """Old raw blocks, compressed ones and incompressible ones (stored raw by a compressing writer)
    in one tier; readers configured either way read all of them in one call."""
    k = keys_of(24)
    data = bf16_payloads(k)
    data[16:] = noise(k[16:])
    with WarmTier(SPEC, tmp_path, 32 * SLOT) as t:  # a tier written before compression existed
        t.put_many(k[:8], data[:8])
    with WarmTier(SPEC, tmp_path, compress="zstd") as t:
        t.put_many(k[8:], data[8:])  # 8..15 compress, 16..23 do not
        lengths = lengths_of(t, k)
    assert (lengths[:8] == SPEC.block_bytes).all() and (lengths[8:16] < SPEC.block_bytes).all()
    assert (lengths[16:] == SPEC.block_bytes).all()
    for compress in ("none", "zstd", "lz4"):
        with WarmTier(SPEC, tmp_path, compress=compress, verify="never") as t:
            out = np.zeros_like(data)
            assert t.get_many(k, out) == 24, compress
            np.testing.assert_array_equal(out, data)
            assert t.stats().corrupt == 0
    assert admin.verify(str(tmp_path / SPEC.namespace))["ok"]


@pytest.mark.parametrize("verify", ["always", "never"])
def test_a_damaged_frame_is_a_counted_miss_never_served(tmp_path, verify):
    k = keys_of(8)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, 8 * SLOT, slab_bytes=8 * SLOT, compress="zstd") as t:
        t.put_many(k, data)
        lengths = lengths_of(t, k)
    slab = tmp_path / SPEC.namespace / "slab-0000.bin"
    flip(slab, 3 * SLOT + lengths[3] // 2)          # inside block 3's compressed body
    flip(slab, 5 * SLOT + 6)                        # block 5's frame header (reserved byte)
    flip(slab, 6 * SLOT + lengths[6] + 100)         # past block 6's frame: unused, harmless
    report = admin.verify(str(tmp_path / SPEC.namespace))
    assert sorted((b["slot"], b["reason"]) for b in report["bad_blocks"]) == [(3, "checksum"), (5, "checksum")]
    # verify="never" too: a frame is always checked before it reaches the decompressor
    with WarmTier(SPEC, tmp_path, verify=verify) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 3
        np.testing.assert_array_equal(out[:3], data[:3])
        assert t.stats().corrupt == 2  # every frame read was checked: 3 and 5 are both caught
        assert t.contains_many(k).tolist() == [i not in (3, 5) for i in range(8)]  # removed from the index
        assert t.get_many(k[4:], out[:4]) == 1  # 4 good, 5 gone
        np.testing.assert_array_equal(out[0], data[4])
        assert t.get_many(k[6:], out[:2]) == 2  # the damaged tail past 6's frame is not its bytes
        np.testing.assert_array_equal(out[:2], data[6:])
        assert t.stats().corrupt == 2


def test_a_frame_that_does_not_decompress_is_damaged(tmp_path):
    """A frame whose checksum holds but whose body is not a valid stream (a codec bug, a writer that
    lied): never served, counted, removed."""
    k = keys_of(2)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, 8 * SLOT, compress="zstd") as t:
        t.put_many(k[:1], data[:1])
        # block 1: a frame of the right checksum over a body of the right length that is not blosc2
        t._packer.compressor.compress = lambda raw: b"\x00" * (raw.nbytes // 2)
        t.put_many(k[1:], data[1:])
        assert lengths_of(t, k)[1] < SPEC.block_bytes
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 1
        assert t.stats().corrupt == 1 and t.contains_many(k).tolist() == [True, False]


def test_a_reader_without_the_codec_misses_and_keeps_the_block(tmp_path, monkeypatch):
    k = keys_of(6)
    data = bf16_payloads(k)
    data[:2] = noise(k[:2])  # stored raw even by a compressing writer
    with WarmTier(SPEC, tmp_path, 8 * SLOT, compress="zstd") as t:
        t.put_many(k, data)
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 2  # the raw ones; the first framed one ends the run
        np.testing.assert_array_equal(out[:2], data[:2])
        # lookups do not promise what this process cannot load; nothing is dropped or counted corrupt
        assert t.match(k) == 2 and t.contains_many(k).tolist() == [True, True] + [False] * 4
        assert t.stats().corrupt == 0 and t.stats().used_blocks == 6
    monkeypatch.delenv("TIEREDKV_DISABLE_CODECS")
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 6
        np.testing.assert_array_equal(out, data)


def test_tiered_cache_warm_compress(tmp_path):
    k = keys_of(6)
    tokens = np.arange(6 * SPEC.chunk_tokens + 1)
    data = bf16_payloads(k)
    kv = data.view(np.uint16).reshape(6, *SPEC.block_shape).transpose(1, 2, 3, 0, 4, 5).reshape(
        SPEC.num_layers, 2, SPEC.num_kv_heads, 6 * SPEC.chunk_tokens, SPEC.head_dim)
    name = f"/tkv-test-{secrets.token_hex(4)}"
    with TieredCache(SPEC, hot_bytes=1 << 20, hot_name=name, warm_dir=tmp_path, warm_bytes=8 * SLOT,
                     demotion="write_through", warm_compress="zstd") as cache:
        cache.store(tokens, np.ascontiguousarray(kv))
    with WarmTier(SPEC, tmp_path) as t:
        assert (lengths_of(t, k) < SPEC.block_bytes).all()
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 6
        np.testing.assert_array_equal(out, data)
    try:
        import posix_ipc
        posix_ipc.unlink_shared_memory(name)
    except Exception:  # noqa: BLE001 - already gone
        pass


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_compression import SPEC, SLOT, bf16_payloads, keys_of
    from tieredkv.warm import WarmTier
    with WarmTier(SPEC, {root!r}, 24 * SLOT, compress="zstd") as t:
        for i in range(100000):
            k = keys_of(6, base=(i % 50) * 1000)
            t.put_many(k, bf16_payloads(k))
            t.remove(k[:2]) if i % 3 == 0 else None
            if i == 2:
                print("running", flush=True)
""")


def kill_writer_and_check(code: str, root, rounds: int, longest: int = 6) -> None:
    """Run the writer ``code`` (prompts of 6 blocks, ``base=p * 1000`` for p < 50) and SIGKILL it while
    it writes, ``rounds`` times; after each kill the index keeps its invariants, every block passes
    ``verify``, and every block served (runs of at most ``longest``) is exactly what was written."""
    tier_dir = str(root / SPEC.namespace)
    for round_ in range(rounds):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        counts = check_index(tier_dir, allow_claims=True)
        report = admin.verify(tier_dir)
        assert report["bad_blocks"] == [] and report["blocks_checked"] == counts["used"]
        served = 0
        with WarmTier(SPEC, root, verify="never") as t:
            for p in range(50):
                k = keys_of(6, base=p * 1000)
                out = np.zeros((6, SPEC.block_bytes), np.uint8)
                got = t.get_many(k, out)
                assert got <= longest
                np.testing.assert_array_equal(out[:got], bf16_payloads(k[:got]))
                served += got
            assert t.stats().corrupt == 0
        assert served > 0, round_


@pytest.mark.procs
def test_sigkilled_compressing_writer_leaves_only_sound_blocks(tmp_path):
    kill_writer_and_check(_WRITER.format(tests=os.path.dirname(__file__), root=str(tmp_path)), tmp_path, 4)


def test_valid_length():
    lengths = np.array([SPEC.block_bytes, SPEC.block_bytes - 1, packed.FRAME.size + 1, packed.FRAME.size, 0,
                        SPEC.block_bytes + 1])
    assert packed.valid_length(lengths, SPEC.block_bytes).tolist() == [True, True, True, False, False, False]


# ---- remote (a real valkey-server on 127.0.0.1) --------------------------------------------------------
@pytest.fixture(scope="module")
def valkey_server():
    pytest.importorskip("valkey", reason="the remote tests need the valkey client (tieredkv[remote])")
    from tieredkv.remote import testing as servers

    with servers.ValkeyServer(maxmemory="256mb") as server:
        yield server


@pytest.fixture
def rspec():
    # A fresh namespace per test in the shared server.
    return KVSpec(model_id=f"test/compress-{secrets.token_hex(4)}", num_layers=4, num_kv_heads=2, head_dim=64,
                  dtype="bfloat16", chunk_tokens=16)


def remote(url, spec, **kw):
    from tieredkv.remote import RemoteTier

    return RemoteTier(spec, url + ("&" if "?" in url else "?") + "deadline_ms=30000", **kw)


def client_of(server):
    import valkey

    from tieredkv.remote import testing as servers

    return valkey.Valkey(host=servers.LOOPBACK, port=server.port)


@pytest.mark.parametrize("name", ["zstd", "lz4", "zlib"])
def test_remote_round_trip_compressed(valkey_server, rspec, name):
    from tieredkv.remote.value import HEADER_BYTES

    k = chunk_keys(rspec, np.arange(8 * rspec.chunk_tokens))
    data = bf16_payloads(k, rspec.block_bytes)
    data[6:] = noise(k[6:], rspec.block_bytes)  # these travel raw
    with remote(f"{valkey_server.url}?compress={name}", rspec) as tier:
        assert tier.compress and tier.stats().extra["compress"] == name
        assert (tier.put_many(k, data) == PutResult.STORED).all()
        client = client_of(valkey_server)
        values = [client.get(n) for n in tier.names(k)]
        client.close()
        codec_id = cd.ZLIB if name == "zlib" else cd.BLOSC2
        assert [v[6] for v in values] == [codec_id] * 6 + [cd.RAW] * 2  # the header's codec byte
        assert all(len(v) < HEADER_BYTES + rspec.block_bytes for v in values[:6])
        assert tier.counts["wire_bytes_in"] < tier.counts["bytes_in"]
        # the store's capacity in blocks counts the values' real (mean) size
        assert tier.stats().capacity_blocks > (256 << 20) // tier.codec.max_bytes
    with remote(valkey_server.url, rspec) as reader:  # configured without compression: reads them all
        assert reader.stats().capacity_blocks == (256 << 20) // reader.codec.max_bytes
        out = np.zeros_like(data)
        assert reader.get_many(k, out) == 8
        np.testing.assert_array_equal(out, data)


def test_remote_reader_without_the_codec_misses_cleanly(valkey_server, rspec, monkeypatch):
    k = chunk_keys(rspec, np.arange(4 * rspec.chunk_tokens))
    data = bf16_payloads(k, rspec.block_bytes)
    data[:1] = noise(k[:1], rspec.block_bytes)
    with remote(f"{valkey_server.url}?compress=zstd", rspec) as tier:
        assert (tier.put_many(k, data) == PutResult.STORED).all()
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")
    with pytest.raises(MissingDependency, match="blosc2"):
        remote(f"{valkey_server.url}?compress=zstd", rspec)
    with remote(valkey_server.url, rspec) as reader:
        out = np.zeros_like(data)
        assert reader.get_many(k, out) == 1  # the raw block; the first compressed one is a miss
        np.testing.assert_array_equal(out[:1], data[:1])
        assert reader.counts["corrupt"] == 0 and reader.stats().extra["undecodable"] == 1
        assert reader.contains_many(k).all()  # not deleted: other hosts can read it
    monkeypatch.delenv("TIEREDKV_DISABLE_CODECS")
    with remote(valkey_server.url, rspec) as reader:
        out = np.zeros_like(data)
        assert reader.get_many(k, out) == 4
        np.testing.assert_array_equal(out, data)


def test_remote_damaged_compressed_value_is_refused_and_deleted(valkey_server, rspec):
    from tieredkv.remote.value import HEADER_BYTES

    k = chunk_keys(rspec, np.arange(4 * rspec.chunk_tokens))
    data = bf16_payloads(k, rspec.block_bytes)
    with remote(f"{valkey_server.url}?compress=zstd", rspec) as tier:
        tier.put_many(k, data)
        names = tier.names(k)
        client = client_of(valkey_server)
        damaged = bytearray(client.get(names[2]))
        damaged[HEADER_BYTES + len(damaged) // 3] ^= 0x10  # inside the blosc2 body
        client.set(names[2], bytes(damaged))
        out = np.zeros_like(data)
        assert tier.get_many(k, out) == 2
        np.testing.assert_array_equal(out[:2], data[:2])
        assert tier.counts["corrupt"] == 1
        assert client.exists(names[2]) == 0  # deleted: the next writer replaces it
        client.close()


def test_remote_value_codec_byte_and_offline_check(monkeypatch):
    """``Codec`` (the remote value format) with codec 2, and ``check_value`` (``tieredkv verify
    --remote``) on sound, undecodable-here and MAC-valid-but-broken values."""
    from tieredkv.remote.auth import FleetKey
    from tieredkv.remote.value import HEADER, HEADER_BYTES, Codec, check_value

    key = FleetKey.from_secret(b"c" * 32, "test")
    k = keys_of(2)
    data = bf16_payloads(k)
    codec = Codec(SPEC, key, compress="zstd")
    digest = codec.digests(k)[0]
    value = np.frombuffer(bytes(codec.encode(digest, data[0])), np.uint8)
    assert value[6] == cd.BLOSC2 and len(value) < HEADER_BYTES + SPEC.block_bytes
    out = np.zeros(SPEC.block_bytes, np.uint8)
    assert Codec(SPEC, key).decode_into(value, digest, out)  # a reader set to "none" decodes it
    np.testing.assert_array_equal(out, data[0])
    assert check_value(value, digest.hex(), key) is None
    # A value whose MAC holds but whose body is not a blosc2 chunk of the block's length (an insider's
    # bug): refused by the reader and by verify.
    broken = value.copy()
    broken[HEADER_BYTES:] = 7
    HEADER.pack_into(broken.data, 0, b"TKVR", 2, cd.BLOSC2, 0, SPEC.chunk_tokens, 0, len(broken) - HEADER_BYTES,
                     SPEC.block_bytes, digest)
    mac = key.mac()
    mac.update(broken[:48].data)
    mac.update(broken[HEADER_BYTES:].data)
    broken[48:HEADER_BYTES] = np.frombuffer(mac.digest(), np.uint8)
    assert not Codec(SPEC, key).decode_into(broken, digest, out)
    assert "does not decompress" in check_value(broken, digest.hex(), key)
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")
    with pytest.raises(MissingDependency):
        Codec(SPEC, key).decode_into(value, digest, out)
    assert check_value(value, digest.hex(), key) is None  # sound as far as this host can tell


def test_remote_value_in_a_later_codec_is_left_alone():
    """A value a newer tieredkv wrote in a codec this one does not know, with a MAC that holds, is
    undecodable here (a miss the tier counts, value kept), never a corruption it would delete."""
    from tieredkv.remote.auth import FleetKey
    from tieredkv.remote.value import HEADER, HEADER_BYTES, Codec, check_value

    key = FleetKey.from_secret(b"c" * 32, "test")
    k = keys_of(1)
    codec = Codec(SPEC, key)
    digest = codec.digests(k)[0]
    value = np.frombuffer(bytes(codec.encode(digest, bf16_payloads(k)[0])), np.uint8).copy()
    body = len(value) - HEADER_BYTES
    HEADER.pack_into(value.data, 0, b"TKVR", 2, 9, 0, SPEC.chunk_tokens, 0, body, SPEC.block_bytes, digest)
    mac = key.mac()
    mac.update(value[:48].data)
    mac.update(value[HEADER_BYTES:].data)
    value[48:HEADER_BYTES] = np.frombuffer(mac.digest(), np.uint8)
    out = np.zeros(SPEC.block_bytes, np.uint8)
    with pytest.raises(MissingDependency, match="codec 9"):
        codec.decode_into(value, digest, out)
    assert check_value(value, digest.hex(), key) is None
    forged = value.copy()
    forged[-1] ^= 1  # the same value with its MAC broken is still refused as damaged
    assert not codec.decode_into(forged, digest, out)
    assert check_value(forged, digest.hex(), key) is not None


# ---- blocks this process cannot decode are misses, never damage -------------------------------------
def test_a_warm_frame_in_a_codec_this_version_does_not_know_is_kept(tmp_path):
    """A frame a newer tieredkv sharing the directory wrote in a codec added later (checksum sound): a
    miss here, counted undecodable, and the block stays for the processes that can read it."""
    k = keys_of(3)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, 8 * SLOT, compress="zstd") as t:
        t.put_many(k[:1], data[:1])
        t._packer.compressor.id = 9  # the newer writer's codec byte; the tier checksums the frame as stored
        t.put_many(k[1:], data[1:])
        assert (lengths_of(t, k) < SPEC.block_bytes).all()
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 1
        np.testing.assert_array_equal(out[:1], data[:1])
        s = t.stats()
        assert s.corrupt == 0 and s.extra["undecodable"] == 1 and s.used_blocks == 3
        assert t.contains_many(k).tolist() == [True, True, True]


def test_evicting_frames_this_process_cannot_decode_counts_no_corruption(tmp_path, monkeypatch):
    """Victims in a codec this process lacks are evicted (their slots are needed) and cannot be handed
    on decoded: counted undecodable, not corrupt (they are sound)."""
    k = keys_of(4)
    with WarmTier(SPEC, tmp_path, 4 * SLOT, compress="zstd") as t:
        assert (t.put_many(k, bf16_payloads(k)) == PutResult.STORED).all()
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")
    handed = []
    with WarmTier(SPEC, tmp_path, on_evict=handed.append) as t:
        assert len(t.evict(2).keys) == 0
        more = keys_of(4, base=10_000)  # two into the freed slots, two evicting the other frames
        assert (t.put_many(more, noise(more)) == PutResult.STORED).all()  # raw: no codec needed
        s = t.stats()
        assert s.evictions == 4 and s.corrupt == 0 and s.extra["undecodable"] == 4
        assert sum(len(e.keys) for e in handed) == 0


def test_a_compact_tier_opens_where_this_process_cannot_compress(tmp_path, monkeypatch):
    """A compact tier (every block a frame) opened read-write by a process without blosc2: it opens
    with a warning instead of failing the process's start; it reads nothing and every put is refused
    (nothing fits a slot uncompressed)."""
    k = keys_of(4)
    data = bf16_payloads(k)
    with WarmTier(SPEC, tmp_path, 8 * SLOT, slot_fraction=0.75) as t:
        assert (t.put_many(k[:2], data[:2]) == PutResult.STORED).all()
    monkeypatch.setenv("TIEREDKV_DISABLE_CODECS", "blosc2")
    with pytest.warns(UserWarning, match="cannot compress"), WarmTier(SPEC, tmp_path) as t:
        assert t.match(k) == 0
        assert (t.put_many(k[2:], data[2:]) == PutResult.NO_SPACE).all()
        s = t.stats()
        assert s.extra["too_big"] == 2 and s.used_blocks == 2 and s.corrupt == 0
    monkeypatch.delenv("TIEREDKV_DISABLE_CODECS")
    with WarmTier(SPEC, tmp_path) as t:
        out = np.zeros_like(data)
        assert t.get_many(k, out) == 2
        np.testing.assert_array_equal(out[:2], data[:2])
