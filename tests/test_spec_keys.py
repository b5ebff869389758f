"""KVSpec sizing and config parsing; chained keys: determinism, prefix sensitivity, salt isolation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from tieredkv import InvalidInput, KVSpec, chunk_keys
from tieredkv.keys import root_key

SEED = dict(model_id="seed/7b", num_layers=28, num_kv_heads=2, head_dim=128, dtype="float16")


def test_seed_geometry_sizes():
    spec = KVSpec(**SEED)
    assert spec.bytes_per_token == 28_672
    assert spec.block_bytes == 28_672 * 64 == 1_835_008
    assert spec.block_shape == (28, 2, 2, 64, 128)
    # The targets' model (docs/architecture.md): 4096 tokens ~ 112 MiB per request, 8 concurrent ~ 896 MiB.
    assert round(spec.bytes_per_token * 4096 / 1e6) == 117  # 117.4 MB = 112 MiB
    assert spec.bytes_per_token * 4096 * 8 / 2**20 == pytest.approx(896, rel=0.01)


def test_fingerprint_changes_with_everything_that_changes_bytes():
    base = KVSpec(**SEED)
    variants = [KVSpec(**{**SEED, "dtype": "bfloat16"}), KVSpec(**{**SEED, "chunk_tokens": 32}),
                KVSpec(**{**SEED, "tp_size": 2, "tp_rank": 1}), KVSpec(**{**SEED, "model_id": "other"}),
                KVSpec(**{**SEED, "extra": "kv-fp8"})]
    prints = {v.fingerprint for v in variants} | {base.fingerprint}
    assert len(prints) == len(variants) + 1
    assert KVSpec(**SEED).fingerprint == base.fingerprint


@pytest.mark.slow  # imports transformers for its config classes
def test_from_hf_config_dict_path_folder_and_object(tmp_path):
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 2,
           "hidden_size": 2048, "torch_dtype": "bfloat16", "_name_or_path": "Qwen/Qwen2-1.5B"}
    spec = KVSpec.from_hf_config(cfg)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (28, 2, 128, "bfloat16")
    assert spec.model_id == "Qwen/Qwen2-1.5B"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # A local directory is identified by its own files (model_identity), whatever name its config carries.
    from_file, from_dir = KVSpec.from_hf_config(tmp_path / "config.json"), KVSpec.from_hf_config(str(tmp_path))
    assert from_file == from_dir and from_dir.model_id.startswith(f"{tmp_path.name}@local-")
    assert dataclasses.replace(from_dir, model_id=spec.model_id) == spec
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                     hidden_size=64)
    got = KVSpec.from_hf_config(llama, chunk_tokens=16, dtype="float32", model_id="tiny-llama")
    assert (got.num_layers, got.num_kv_heads, got.head_dim, got.chunk_tokens) == (3, 2, 16, 16)


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=-1), dict(dtype="float13"),
                                 dict(model_id=""), dict(tp_rank=2, tp_size=2), dict(chunk_tokens=1.5)])
def test_spec_rejects_bad_fields(bad):
    with pytest.raises(InvalidInput):
        KVSpec(**{**SEED, **bad})


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(InvalidInput, match="no config.json"):
        KVSpec.from_hf_config(tmp_path)
    with pytest.raises(InvalidInput, match="num_hidden_layers"):
        KVSpec.from_hf_config({"vocab_size": 10})


@pytest.mark.procs
def test_keys_deterministic_across_processes():
    spec = KVSpec(**SEED)
    tokens = list(range(1000, 1000 + 64 * 5 + 7))
    here = [k.hex() for k in chunk_keys(spec, tokens, salt=b"tenant-a")]
    code = ("import sys,json; from tieredkv import KVSpec, chunk_keys; "
            f"spec=KVSpec(**{SEED!r}); "
            f"print(json.dumps([k.hex() for k in chunk_keys(spec, {tokens!r}, salt=b'tenant-a')]))")
    there = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True, env={"PYTHONHASHSEED": "12345"}).stdout)
    assert here == there
    assert len(here) == 5  # the trailing 7 tokens are not a full chunk


def test_keys_cover_the_whole_prefix():
    spec = KVSpec(**SEED)
    a = np.arange(64 * 3)
    b = a.copy()
    b[5] += 1  # change one token of the first chunk
    ka, kb = chunk_keys(spec, a), chunk_keys(spec, b)
    # Chunks 1 and 2 have identical tokens but follow a different prefix: every key differs.
    assert np.array_equal(ka.tokens[1:], kb.tokens[1:])
    assert all(x != y for x, y in zip(ka, kb))
    # Extending a prompt keeps the keys of its prefix.
    assert list(chunk_keys(spec, np.arange(64 * 5)))[:3] == list(ka)
    # The chain: each key's parent is the previous key.
    assert np.array_equal(ka.parents[1:], ka.keys[:-1])
    assert ka.parents[0].tobytes() == root_key(spec)


def test_salt_and_namespace_isolate():
    spec = KVSpec(**SEED)
    tokens = np.arange(64 * 4)
    k0, k1, k2 = (set(chunk_keys(spec, tokens, salt=s)) for s in (b"", b"a", b"b"))
    assert not (k0 & k1) and not (k1 & k2) and not (k0 & k2)
    other = KVSpec(**{**SEED, "dtype": "bfloat16"})
    assert not set(chunk_keys(other, tokens)) & k0


@pytest.mark.parametrize("tokens, match", [([[1, 2], [3, 4]], "1-D"), ([-1, 2], ">= 0"),
                                           ([2**33], "uint32"), ([1.5, 2.0], "integers"),
                                           ("hello", "not bytes")])
def test_keys_reject_bad_tokens(tokens, match):
    with pytest.raises(InvalidInput, match=match):
        chunk_keys(KVSpec(**SEED), tokens)


def test_keys_reject_str_salt_and_accept_empty():
    spec = KVSpec(**SEED)
    with pytest.raises(InvalidInput, match="encode"):
        chunk_keys(spec, [1, 2, 3], salt="tenant")
    assert len(chunk_keys(spec, [])) == 0
    torch = pytest.importorskip("torch")
    assert list(chunk_keys(spec, torch.arange(128))) == list(chunk_keys(spec, np.arange(128)))


def test_take_reads_a_bool_mask_as_a_mask():
    """``keys.take(mask)`` (e.g. ``cache.locate(keys) < 0``) picks the masked keys; it once read the
    mask as the indices 0 and 1, and ``put_blocks`` then stored chunk 0's bytes under chunk 1's key."""
    spec = KVSpec(model_id="test/take", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=4)
    keys = chunk_keys(spec, np.arange(12))
    every = keys.take(np.ones(3, dtype=bool))
    assert every.positions.tolist() == [0, 1, 2] and np.array_equal(every.keys, keys.keys)
    some = keys.take(np.array([False, True, True]))
    assert some.positions.tolist() == [1, 2] and np.array_equal(some.keys, keys.keys[1:])
    assert keys.take([2, 0]).positions.tolist() == [2, 0]
    with pytest.raises(InvalidInput, match="needs 3 entries"):
        keys.take(np.ones(2, dtype=bool))


def test_extra_may_be_any_iterable():
    spec = KVSpec(model_id="test/extra", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=4)
    extra = [b"image-1", None]
    assert np.array_equal(chunk_keys(spec, np.arange(8), extra=(e for e in extra)).keys,
                          chunk_keys(spec, np.arange(8), extra=extra).keys)
