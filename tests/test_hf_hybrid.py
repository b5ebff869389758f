"""CachedPrefill on hybrid models (attention layers plus linear-attention / mamba layers): the attention
K/V of ``[0, P)`` and the recurrent state at ``P`` restored from the tiers give what a prefill without
a cache gives. Tiny random-weight models built in code, float32.

Exactness: a prefill in pieces of a linear-attention / mamba model is not bitwise a one-shot prefill
(the chunked scan adds in another order, and the attention's matmuls see other shapes): up to 3e-4
on logits of magnitude ~10 here. So a restored prefix is compared bitwise with a reference computed in
the same pieces without any cache (the state at ``P`` is then the very state the cold run stored), and
with a one-shot prefill and ``model.generate`` within that tolerance and token for token.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from helpers import LazyModule
from tieredkv.errors import InvalidInput, SpecMismatch

# Every test here runs a transformers model (torch and transformers imports, about 9 s in all): `slow`.
pytestmark = pytest.mark.slow

torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_state = LazyModule("tieredkv.integrations.hf_state")
hf_models = LazyModule("tieredkv.integrations.models")

CHUNK = 16


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def pieces_logits(model, ids, ends):
    """All logits of ``ids`` prefilled without a tiered cache, one forward per piece ending at ``ends``."""
    from transformers.cache_utils import DynamicCache

    kv, out, start = DynamicCache(config=model.config), [], 0
    with torch.inference_mode():
        for end in [*ends, ids.shape[1]]:
            out.append(model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None],
                             past_key_values=kv, use_cache=True).logits)
            start = end
    return torch.cat(out, dim=1)


def generate(model, ids, new: int) -> list[int]:
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def build(config):
    torch.set_num_threads(1)
    return hf_models.random_model(config)


def open_cache(spec, tmp_path, **kwargs):
    from tieredkv import TieredCache

    return TieredCache(spec, hot_bytes=256 * spec.block_bytes + (1 << 20), hot_name=f"/{spec.model_id}",
                       warm_dir=str(tmp_path / "warm"), warm_bytes=512 * spec.block_bytes,
                       demotion="write_through", **kwargs)


def state_pieces(runner, cache, ids, boundary):
    from tieredkv.keys import chunk_keys, state_keys

    keys = chunk_keys(cache.spec, ids[0, :boundary].numpy())
    return state_keys(keys[len(keys) - 1:], runner._hybrid.pieces)


QWEN3_NEXT = dict(initializer_range=0.2, linear_key_head_dim=32, linear_value_head_dim=32)


def test_qwen3_next_hit_restores_kv_and_state_exactly(tmp_path):
    model = build(hf_models.tiny_qwen3_next_config(**QWEN3_NEXT))
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=f"test-hybrid-{uuid.uuid4().hex[:8]}")
    # The spec: the 2 attention layers' K/V; the namespace names every state tensor's shape and dtype.
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 64)
    assert spec.extra == "state=mama:hf:c0=128x4float32+r0=2x32x32float32"
    a = prompt(5 * CHUNK + 5, seed=1)
    b = torch.cat([a[:, :5 * CHUNK], prompt(20, seed=2)], dim=1)  # shares 5 chunks with a
    cache = open_cache(spec, tmp_path)
    try:
        runner = hf.CachedPrefill(model, cache)
        cold = runner.prefill(a)
        assert (cold.cached_tokens, cold.stored_blocks) == (0, 5)
        assert len(cache.resident_run(state_pieces(runner, cache, a, 5 * CHUNK))) == runner._hybrid.pieces
        warm = runner.prefill(b, all_logits=True)
        assert warm.cached_tokens == 5 * CHUNK
        # Bitwise what a cache-less prefill in the same pieces computes (cold run: [0, 80); this one
        # stores the state at 96, b's last boundary: [80, 96), [96, 100)) ...
        ref = pieces_logits(model, b, [80, 96])
        assert torch.equal(warm.logits, ref[:, 80:])
        # ... and within float rounding of a one-shot prefill, token for token with generate.
        one_shot = pieces_logits(model, b, [])
        assert torch.allclose(warm.logits, one_shot[:, 80:], atol=1e-3, rtol=0)
        assert runner.decode(runner.prefill(b), 8) == generate(model, b, 8)
        # A zero-filled state at 80 is restored like the real one, and changes the logits.
        cache.hot.remove(state_pieces(runner, cache, a, 80))
        zero_state = state_pieces(runner, cache, a, 80)
        cache.hot.put_many(zero_state, np.zeros((len(zero_state), spec.block_bytes), np.uint8))
        c = torch.cat([a[:, :80], prompt(10, seed=3)], dim=1)
        zeroed = runner.prefill(c, store=False)
        assert zeroed.cached_tokens == 80
        assert not torch.allclose(zeroed.logits[0, -1], pieces_logits(model, c, [80])[0, -1], atol=1e-2)
    finally:
        cache.unlink_hot()
        cache.close()
    # A restart: a new hot tier, the warm tier from disk; b's prefix (K/V and the state at 96) is read
    # from warm and gives generate's tokens. The zeroed state at 80 went to warm too (write-through of
    # the hot put_many): never mind, the hit is at 96.
    cache = open_cache(spec, tmp_path)
    try:
        runner = hf.CachedPrefill(model, cache)
        assert cache.lookup(b[0].numpy(), count=False).blocks_in(1) == 6  # all six chunks from warm
        again = runner.prefill(b)
        assert again.cached_tokens == 96
        assert runner.decode(again, 8) == generate(model, b, 8)
    finally:
        cache.unlink_hot()
        cache.close()


def test_a_pending_store_stores_the_prompts_kv_whatever_the_caller_did_to_the_cache_since(tmp_path):
    """``prefill(a, store=False)``, then the caller resets the cache and runs 64 other tokens through it,
    then ``store``: the prompt's own attention KV is stored (copied at prefill). Before, the store read
    the cache when it ran and filed the other tokens' KV under a's keys."""
    model = build(hf_models.tiny_qwen3_next_config(**QWEN3_NEXT))
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=f"test-hybrid-{uuid.uuid4().hex[:8]}")
    a, other = prompt(4 * CHUNK, seed=11), prompt(4 * CHUNK, seed=12)
    cache = open_cache(spec, tmp_path)
    try:
        runner = hf.CachedPrefill(model, cache)
        pending = runner.prefill(a, store=False)
        with torch.inference_mode():
            pending.cache.reset()
            model(input_ids=other, position_ids=torch.arange(4 * CHUNK)[None], past_key_values=pending.cache,
                  use_cache=True)
        assert runner.store(pending) == 4
        b = torch.cat([a, prompt(5, seed=13)], dim=1)
        hit = hf.CachedPrefill(model, cache).prefill(b, all_logits=True)
        assert hit.cached_tokens == 4 * CHUNK
        # Within the rounding of a prefill in other pieces (the module docstring); the other tokens' KV
        # gave differences of order 1.
        assert torch.allclose(hit.logits, pieces_logits(model, b, [])[:, 4 * CHUNK:], atol=1e-3, rtol=0)
    finally:
        cache.unlink_hot()
        cache.close()


def test_no_hit_beyond_the_last_boundary_with_a_state(tmp_path):
    model = build(hf_models.tiny_hybrid_config("granitemoehybrid", initializer_range=0.2))
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=f"test-hybrid-{uuid.uuid4().hex[:8]}")
    ids = prompt(6 * CHUNK + 3, seed=4)
    from tieredkv import TieredCache

    with TieredCache(spec, hot_bytes=256 * spec.block_bytes + (1 << 20), hot_name=f"/{spec.model_id}") as cache:
        try:
            runner = hf.CachedPrefill(model, cache, state_boundaries="every")
            assert runner.prefill(ids).cached_tokens == 0
            # Every boundary has a state: the same prompt hits at its last one (96).
            assert runner.prefill(ids, store=False).cached_tokens == 96
            # Without the states at 96 and 80, the K/V of all 6 chunks is there but the hit is 64.
            cache.hot.remove(state_pieces(runner, cache, ids, 96))
            cache.hot.remove(state_pieces(runner, cache, ids, 80))
            assert cache.lookup(ids[0].numpy()).tokens == 96
            res = runner.prefill(ids, all_logits=True)
            assert res.cached_tokens == 64
            assert torch.equal(res.logits, pieces_logits(model, ids, [16, 32, 48, 64, 80, 96])[:, 64:])
            # That prefill stored the states again ("every" boundary of its tail): 96 is a hit again.
            assert runner.prefill(ids).cached_tokens == 96
        finally:
            cache.unlink_hot()


#: Every verified model type but Qwen3-Next (tested above with more cases).
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "granitemoehybrid", "nemotron_h", "bamba", "falcon_h1", "lfm2",
            "lfm2_moe", "olmo_hybrid", "zamba2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_verified_family_restores_exactly(family, tmp_path):
    assert family in hf_state.VERIFIED
    from tieredkv import TieredCache

    model = build(hf_models.tiny_hybrid_config(family, initializer_range=0.2))
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=f"test-hybrid-{uuid.uuid4().hex[:8]}")
    assert spec.extra.startswith("state=") and ":hf:" in spec.extra
    a = prompt(3 * CHUNK + 4, seed=5)
    b = torch.cat([a[:, :3 * CHUNK], prompt(9, seed=6)], dim=1)
    with TieredCache(spec, hot_bytes=256 * spec.block_bytes + (1 << 20), hot_name=f"/{spec.model_id}") as cache:
        try:
            runner = hf.CachedPrefill(model, cache)
            assert runner.prefill(a).cached_tokens == 0
            warm = runner.prefill(b, all_logits=True)
            assert warm.cached_tokens == 3 * CHUNK
            assert torch.equal(warm.logits, pieces_logits(model, b, [48])[:, 48:])
            assert torch.allclose(warm.logits, pieces_logits(model, b, [])[:, 48:], atol=1e-3, rtol=0)
            # A store left for later (prefill(store=False)) runs in decode, before the first step.
            assert runner.decode(runner.prefill(b, store=False), 6) == generate(model, b, 6)
        finally:
            cache.unlink_hot()


def test_the_namespace_covers_the_state_layout():
    base = hf.spec_for_model(build(hf_models.tiny_qwen3_next_config()), chunk_tokens=CHUNK, model_id="m")
    kernel = hf.spec_for_model(build(hf_models.tiny_qwen3_next_config(linear_conv_kernel_dim=3)),
                               chunk_tokens=CHUNK, model_id="m")
    heads = hf.spec_for_model(build(hf_models.tiny_qwen3_next_config(linear_num_value_heads=4)),
                              chunk_tokens=CHUNK, model_id="m")
    bf16 = hf.spec_for_model(hf_models.random_model(hf_models.tiny_qwen3_next_config(), dtype="bfloat16"),
                             chunk_tokens=CHUNK, model_id="m")
    # Same attention geometry, other states: other namespaces.
    assert len({base.namespace, kernel.namespace, heads.namespace, bf16.namespace}) == 4
    assert (base.num_layers, base.num_kv_heads, base.head_dim) == (kernel.num_layers, kernel.num_kv_heads,
                                                                   kernel.head_dim)
    assert "c0=512x3float32" in kernel.extra and "r0=4x128x128float32" in heads.extra
    assert "c0=512x4bfloat16+r0=2x128x128" in bf16.extra
    with pytest.raises(SpecMismatch, match="state layout"):
        hf.CachedPrefill(build(hf_models.tiny_qwen3_next_config(linear_conv_kernel_dim=3)), None, spec=base)


def test_jamba_pieces_are_not_a_prefill_so_it_is_refused():
    # The reason is real: Jamba's mamba layers restart from a zero state on a multi-token forward.
    model = build(hf_models.tiny_hybrid_config("jamba", initializer_range=0.2))
    ids = prompt(40, seed=7)
    assert (pieces_logits(model, ids, [16, 32]) - pieces_logits(model, ids, [])).abs().max() > 0.1
    with pytest.raises(InvalidInput, match="jamba.*restart their SSM state from zero"):
        hf.CachedPrefill(model, None)
    with pytest.raises(InvalidInput, match="zamba.*restart their SSM state from zero"):
        hf.spec_for_model(build(hf_models.tiny_hybrid_config("zamba")))


def test_other_state_models_are_refused_by_name():
    from transformers import MiniMaxConfig

    minimax = build(MiniMaxConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                  layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(InvalidInput, match="MiniMaxCache"):
        hf.CachedPrefill(minimax, None)
    from transformers import Mamba2Config

    config = Mamba2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                          state_size=16, n_groups=1, chunk_size=16)
    config._attn_implementation = "eager"  # a model without attention takes no sdpa
    mamba2 = build(config)
    with pytest.raises(InvalidInput, match="without attention layers"):
        hf.spec_for_model(mamba2)
    gemma = build(hf_models.tiny_gemma3_config())
    gemma.config.layer_types = ["linear_attention", "full_attention"] * 2
    with pytest.raises(InvalidInput, match=r"gemma3_text.*\['linear_attention'\].*not verified"):
        hf.CachedPrefill(gemma, None)
    with pytest.raises(InvalidInput, match="state_boundaries"):
        hf.CachedPrefill(build(hf_models.tiny_hybrid_config("lfm2")), None, state_boundaries="some")
    with pytest.raises(InvalidInput, match="state_boundaries"):  # checked for any model
        hf.CachedPrefill(build(hf_models.tiny_llama_config()), None, state_boundaries="all")


def test_a_transformers_without_per_layer_state_is_refused(monkeypatch):
    # Releases before the unified hybrid cache keep the state in model-specific caches, which
    # DynamicCache(config) does not build: such a model must not run as if it had attention only.
    monkeypatch.setattr("tieredkv.integrations.hf_state.has_state_layers", lambda model: False)
    model = build(hf_models.tiny_qwen3_next_config(**QWEN3_NEXT))
    with pytest.raises(InvalidInput, match=r"\['linear_attention'\].*keeps no linear-attention or mamba state"):
        hf.CachedPrefill(model, None)



def test_every_verified_type_is_tested_here():
    assert set(hf_state.VERIFIED) == {*FAMILIES, "qwen3_next"}
