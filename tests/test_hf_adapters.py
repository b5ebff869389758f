"""CachedPrefill with peft adapters: KV computed under one adapter is never restored under another,
under the base model, or after the adapter's weights changed; the same adapter hits its own prefix.

Each test wraps a tiny random-weight Llama in real peft LoRA layers on the K/V projections (random
non-zero B, so an adapter really changes the KV) and runs CachedPrefill against a real hot tier.
"""

from __future__ import annotations

import pytest
from test_hf import CHUNK, full_logits, open_cache, prompt

from helpers import LazyModule

pytestmark = pytest.mark.slow
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")
hf_adapters = LazyModule("tieredkv.integrations.hf_adapters")
peft = LazyModule("peft")

N = 4 * CHUNK + 5  # four full chunks and a tail


def lora(seed: int):
    """A LoRA config on q/k/v whose B is random (peft's default B=0 would leave the KV unchanged)."""
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                           init_lora_weights=False, lora_dropout=0.0)


@pytest.fixture
def base():
    torch.set_num_threads(1)
    return hf_models.random_model(hf_models.tiny_llama_config(), seed=0, dtype=torch.float32)


@pytest.fixture
def two_adapters(base):
    """The base model wrapped with adapters "one" and "two" (seeded: reproducible weights); "one" active."""
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora(1), adapter_name="one")
    torch.manual_seed(2)
    model.add_adapter("two", lora(2))
    model.set_adapter("one")
    model.eval()
    return model


def assert_logits_close(res, model, ids):
    ref = full_logits(model, ids)[:, -1:]
    err = (res.logits.float() - ref.float()).abs().max().item()
    assert err <= 1e-5, f"max |logit diff| {err}: KV of another identity was restored"


def test_adapter_changes_the_kv(two_adapters):
    """Control: the adapters really change the logits, so a wrong restore would show."""
    ids = prompt(N)
    a = full_logits(two_adapters, ids)
    two_adapters.set_adapter("two")
    b = full_logits(two_adapters, ids)
    with two_adapters.disable_adapter():
        plain = full_logits(two_adapters, ids)
    assert (a - b).abs().max() > 1e-3 and (a - plain).abs().max() > 1e-3


def test_identity_is_none_without_active_adapters(base, two_adapters):
    assert hf_adapters.adapter_identity(hf_models.random_model(hf_models.tiny_llama_config(), seed=0)) is None
    with two_adapters.disable_adapter():
        assert hf_adapters.adapter_identity(two_adapters) is None
    a = hf_adapters.adapter_identity(two_adapters)
    two_adapters.set_adapter("two")
    b = hf_adapters.adapter_identity(two_adapters)
    assert a is not None and b is not None and a != b and len(a) == 16


def test_base_model_prefix_is_not_restored_under_an_adapter(two_adapters, namespace, tmp_path):
    ids = prompt(N)
    with open_cache(two_adapters, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(two_adapters, cache)
        with two_adapters.disable_adapter():
            first = runner.prefill(ids)
            assert first.stored_blocks == 4
            assert runner.prefill(ids).cached_tokens == 4 * CHUNK  # the base model hits its own prefix
        res = runner.prefill(ids)  # adapter "one" active: must compute, not restore the base model's KV
        assert res.cached_tokens == 0
        assert_logits_close(res, two_adapters, ids)
        again = runner.prefill(ids)  # ... and then hits what it stored under "one"
        assert again.cached_tokens == 4 * CHUNK
        assert_logits_close(again, two_adapters, ids)


def test_one_adapter_never_gets_another_adapters_prefix(two_adapters, namespace, tmp_path):
    ids = prompt(N)
    with open_cache(two_adapters, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(two_adapters, cache)
        assert runner.prefill(ids).stored_blocks == 4  # under "one"
        two_adapters.set_adapter("two")
        res = runner.prefill(ids)
        assert res.cached_tokens == 0
        assert_logits_close(res, two_adapters, ids)
        two_adapters.set_adapter("one")
        res = runner.prefill(ids)
        assert res.cached_tokens == 4 * CHUNK
        assert_logits_close(res, two_adapters, ids)


def test_edited_adapter_weights_miss(two_adapters, namespace, tmp_path):
    """An in-place edit through ``.data`` moves no version counter: the identity still changes."""
    ids = prompt(N)
    with open_cache(two_adapters, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(two_adapters, cache)
        assert runner.prefill(ids).stored_blocks == 4
        layer = two_adapters.base_model.model.model.layers[0].self_attn.k_proj
        layer.lora_B["one"].weight.data.mul_(3.0)
        res = runner.prefill(ids)
        assert res.cached_tokens == 0
        assert_logits_close(res, two_adapters, ids)


def test_merged_adapter_keeps_its_identity(two_adapters, namespace, tmp_path):
    """Merging "one" into the base weights computes the same KV as running it unmerged: it may hit."""
    ids = prompt(N)
    with open_cache(two_adapters, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(two_adapters, cache)
        assert runner.prefill(ids).stored_blocks == 4
        unmerged = hf_adapters.adapter_identity(two_adapters)
        two_adapters.base_model.merge_adapter(["one"])
        assert hf_adapters.adapter_identity(two_adapters) == unmerged
        res = runner.prefill(ids)
        assert res.cached_tokens == 4 * CHUNK
        ref = full_logits(two_adapters, ids)[:, -1:]
        assert (res.logits.float() - ref.float()).abs().max().item() <= 1e-4  # merged weights round
