"""API misuse through TieredCache and the tiers: every mistake is a TieredKVError subclass whose message
says how to fix the call, and none of them changes what is stored. (Basic cases are in test_cache.py
and test_hot_tier.py; these add the rest of the matrix.)"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import kv_for, same_bytes
from helpers import payload_for as kv_payload
from tieredkv import HotTier, InvalidInput, InvalidPayload, KVSpec, TieredCache, TieredKVError, chunk_keys

SPEC = KVSpec(model_id="test/misuse", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
MiB = 1 << 20
TOKENS = np.arange(100, 125)


@pytest.fixture
def cache(seg_name, tmp_path):
    with TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB,
                     demotion="write_through") as c:
        c.store(TOKENS, kv_for(SPEC, TOKENS))
        yield c
        # Whatever was thrown at it, the stored prefix is intact in both tiers.
        kv = kv_for(SPEC, TOKENS)
        out = np.zeros_like(kv)
        assert c.load(c.lookup(TOKENS), out) == 24 and same_bytes(out[:, :, :, :24], kv[:, :, :, :24])
        keys = chunk_keys(SPEC, TOKENS[:24])
        buf = np.zeros((6, SPEC.block_bytes), np.uint8)
        assert c.warm.get_many(keys, buf) == 6 and np.array_equal(buf, kv_payload(SPEC, keys))


KV = kv_for(SPEC, TOKENS)
BAD_KV = [
    (KV[:, :, :, :, :4], InvalidPayload, r"head_dim=8"),                     # wrong shape
    (KV[0], InvalidPayload, r"shaped \(num_layers=2"),                        # missing a dimension
    (np.zeros(KV.shape, np.float32), InvalidPayload, r"dtype float32 != the spec's float16"),
    (np.zeros(KV.shape, np.int16), InvalidPayload, r"dtype"),
    (KV.tolist(), InvalidPayload, r"numpy array or a torch tensor"),
    ("not an array", InvalidPayload, r"numpy array or a torch tensor"),
    (np.zeros((2, 2, 2, 40, 8), np.float16), InvalidInput, r"40 tokens but only 25 token ids"),
]


@pytest.mark.parametrize("kv,err,msg", BAD_KV, ids=range(len(BAD_KV)))
def test_store_rejects_bad_kv(cache, kv, err, msg):
    with pytest.raises(err, match=msg):
        cache.store(TOKENS, kv)


def test_store_accepts_non_contiguous_kv_and_copies_the_right_bytes(cache):
    """A strided view (a slice of a bigger cache) is a legal input: stored by value, bytes checked."""
    tokens = np.arange(500, 525)
    big = np.zeros((2, 2, 2, 64, 8), np.float16)
    big[:, :, :, :25] = kv_for(SPEC, tokens)
    view = big[:, :, :, :25]
    assert not view.flags.c_contiguous
    assert cache.store(tokens, view) == 6
    out = np.zeros((2, 2, 2, 25, 8), np.float16)
    assert cache.load(cache.lookup(tokens), out) == 24
    assert same_bytes(out[:, :, :, :24], kv_for(SPEC, tokens)[:, :, :, :24])


BAD_TOKENS = [
    ([-1, 2, 3, 4, 5], r">= 0"),
    ([2**32, 1, 2, 3, 4], r"uint32"),
    ([1.5, 2.0, 3.0, 4.0, 5.0], r"integers"),
    (np.zeros((2, 5), np.int64), r"1-D"),
    ("hello", r"not bytes or str"),
    (b"\x00\x01", r"not bytes or str"),
    ([[1, 2], [3]], r"1-D sequence of integer token ids"),  # ragged: was a bare numpy ValueError
]


@pytest.mark.parametrize("tokens,msg", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_bad_token_ids(cache, tokens, msg):
    with pytest.raises(TieredKVError, match=msg):
        cache.lookup(tokens)


@pytest.mark.parametrize("tokens", [[], np.zeros(0, np.int64), [7], np.arange(4)])
def test_empty_and_short_prompts_are_misses_not_errors(cache, tokens):
    hit = cache.lookup(tokens)
    assert hit.tokens == 0 and hit.blocks == 0
    assert cache.load(hit, np.zeros((2, 2, 2, 0, 8), np.float16)) == 0
    # Only full chunks are stored: a 4-token prompt stores its one chunk, which lookup can never use
    # whole (one token must be left to compute).
    assert cache.store(tokens, np.zeros((2, 2, 2, len(tokens), 8), np.float16)) == len(tokens) // 4
    assert cache.lookup(tokens).tokens == 0


@pytest.mark.parametrize("salt,msg", [("tenant", r"encode a tenant id"), (42, r"salt must be bytes, got int"),
                                      (None, r"got NoneType"), (["a"], r"got list")])
def test_salt_of_the_wrong_type(cache, salt, msg):
    for call in (lambda: cache.lookup(TOKENS, salt=salt), lambda: cache.store(TOKENS, KV, salt=salt)):
        with pytest.raises(InvalidInput, match=msg):
            call()


def test_bytearray_and_memoryview_salts_equal_bytes(cache):
    assert cache.lookup(TOKENS, salt=bytearray(b"")).tokens == 24
    assert cache.lookup(TOKENS, salt=memoryview(b"")).tokens == 24


@pytest.mark.parametrize("make_out,err,msg", [
    (lambda: np.zeros((2, 2, 2, 25, 8), np.float32), InvalidPayload, "dtype"),
    (lambda: np.zeros((2, 2, 2, 25, 4), np.float16), InvalidPayload, "head_dim=8"),
    (lambda: np.zeros((2, 2, 2, 10, 8), np.float16), InvalidPayload, "holds 10 tokens; the hit needs 24"),
    (lambda: np.broadcast_to(np.zeros(8, np.float16), (2, 2, 2, 25, 8)), InvalidPayload, "read-only"),
    (lambda: [[0.0]], InvalidPayload, "numpy array or a torch tensor"),
])
def test_load_rejects_bad_out(cache, make_out, err, msg):
    with pytest.raises(err, match=msg):
        cache.load(cache.lookup(TOKENS), make_out())


def test_load_takes_only_a_prefix_hit(cache):
    with pytest.raises(InvalidInput, match="PrefixHit returned by lookup"):
        cache.load(chunk_keys(SPEC, TOKENS), np.zeros((2, 2, 2, 25, 8), np.float16))


def test_torch_wrong_dtype_and_device(cache):
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidPayload, match="dtype torch.float32 != the spec's float16"):
        cache.store(torch.as_tensor(TOKENS), torch.zeros(2, 2, 2, 25, 8))
    with pytest.raises(InvalidPayload, match="dtype"):
        cache.load(cache.lookup(TOKENS), torch.zeros(2, 2, 2, 25, 8, dtype=torch.bfloat16))
    with pytest.raises(InvalidPayload, match="shaped"):
        cache.store(TOKENS, torch.zeros(2, 2, 25, 8, dtype=torch.float16))
    meta = torch.zeros(2, 2, 2, 25, 8, dtype=torch.float16, device="meta")
    with pytest.raises((TieredKVError, NotImplementedError, RuntimeError)):
        cache.store(TOKENS, meta)  # a device that holds no data cannot be stored


def test_bad_constructor_arguments(seg_name, tmp_path):
    with pytest.raises(InvalidInput, match="KVSpec"):
        TieredCache({"model_id": "x"}, hot_bytes=MiB)
    with pytest.raises(InvalidInput, match="hot_bytes must be a positive integer"):
        TieredCache(SPEC, hot_bytes=-1, hot_name=seg_name)
    with pytest.raises(InvalidInput, match="invalid segment name"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name="../x")
    with pytest.raises(InvalidInput, match="sync must be one of"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB, warm_sync="always")
    with pytest.raises(InvalidInput, match="demotion|valid"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, demotion="sometimes")
    for bad in (0, -5, 3.5, "8", True):
        with pytest.raises(InvalidInput, match="positive integer"):
            KVSpec(model_id="m", num_layers=bad, num_kv_heads=1, head_dim=8)
    with pytest.raises(InvalidInput, match="unsupported KV dtype"):
        KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float64")


def test_unknown_policy_names_are_invalid_input_listing_the_valid_ones(tmp_path, seg_name):
    from tieredkv import InvalidInput, KVSpec
    from tieredkv.warm import WarmTier

    spec = KVSpec(model_id="test/policy-name", num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    with pytest.raises(InvalidInput, match="valid: .*lru"):
        HotTier(spec, n_slots=4, name=seg_name, policy="lruu")
    with pytest.raises(InvalidInput, match="valid: .*lru"):
        WarmTier(spec, tmp_path, 1 << 20, policy="lruu")
