"""The SGLang HiCache storage backend, built by SGLang's own ``StorageBackendFactory`` from the dynamic
config, over host pools with SGLang's own page arithmetic.

SGLang's host-pool classes do not construct on this CPU-only machine (their package imports every model
config, and one needs torchvision built for CUDA torch), so the pools here are faithful stand-ins:
buffers with the exact shapes of ``MHATokenToKVPoolHost.init_kv_buffer`` / ``MLATokenToKVPoolHost``
for each layout, carrying SGLang's OWN ``get_data_page``, ``set_from_flat_data_page``,
``get_dummy_flat_data_page`` and ``get_page_buffer_meta`` (compiled from the installed sglang's
source), so every byte this backend moves is checked against SGLang's own idea of a page.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (.ci/setup installs it)")

import torch
from sglang.srt.mem_cache import hicache_storage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from tieredkv import InvalidInput
from tieredkv.integrations.sglang import LAYOUTS, TieredKVStorage

PAGE, PAGES, LAYERS, HEADS, HEAD_DIM = 4, 12, 2, 2, 8
LORA_RANK, ROPE = 16, 8  # MLA: kv_cache_dim = LORA_RANK + ROPE


def _sglang_methods(module_file: str, class_name: str, names: tuple[str, ...]) -> dict:
    """SGLang's own methods ``names`` of ``class_name``, compiled from the installed source."""
    tree = ast.parse(open(module_file).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    funcs = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {f.name for f in funcs} == set(names)
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), module_file, "exec"), namespace)
    return {name: namespace[name] for name in names}


_POOL_HOST = os.path.join(os.path.dirname(hicache_storage.__file__), "pool_host")
_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page", "get_page_buffer_meta")
MHA_METHODS = _sglang_methods(os.path.join(_POOL_HOST, "mha.py"), "MHATokenToKVPoolHost", _METHODS)
MLA_METHODS = _sglang_methods(os.path.join(_POOL_HOST, "mla.py"), "MLATokenToKVPoolHost", _METHODS)


class HostPool:
    """A host pool with SGLang's buffer shapes for ``layout`` and SGLang's own page methods."""

    def __init__(self, layout: str, *, mla: bool = False, dtype=torch.bfloat16, seed: int = 0):
        self.layout, self.page_size, self.dtype, self.device, self.pin_memory = layout, PAGE, dtype, "cpu", False
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.page_num, self.size = PAGES, PAGES * PAGE
        self.logical_page_size, self.dcp_size = PAGE, 1
        self._methods = MLA_METHODS if mla else MHA_METHODS
        P, L, H, D, n = PAGE, LAYERS, HEADS, HEAD_DIM, PAGES * PAGE
        if mla:
            self.kv_lora_rank, self.qk_rope_head_dim = LORA_RANK, ROPE
            self.kv_cache_dim = C = LORA_RANK + ROPE
            dims = {"layer_first": (L, n, 1, C), "page_first": (n, L, 1, C),
                    "page_first_direct": (PAGES, L, P, 1, C)}
            if layout == "page_first_kv_split":
                self.k_buffer = self._random((PAGES, L, P, 1, LORA_RANK), seed)
                self.v_buffer = self._random((PAGES, L, P, 1, ROPE), seed + 1)
                self.kv_buffer = self.k_buffer
            else:
                self.kv_buffer = self._random(dims.get(layout, (n, L, 1, C)), seed)
        else:
            dims = {"layer_first": (2, L, n, H, D), "page_first": (2, n, L, H, D),
                    "page_first_direct": (2, PAGES, L, P, H, D), "page_head": (2, PAGES, H, P, L, D)}
            self.kv_buffer = self._random(dims.get(layout, (2, n, L, H, D)), seed)

    def _random(self, shape, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(-(2 ** 15), 2 ** 15, shape, generator=g, dtype=torch.int16).view(self.dtype)

    def _storage_page_index(self, index):  # SGLang's DCP page mapping; identity without DCP
        return index

    def __getattr__(self, name):
        if name in _METHODS:
            return self._methods[name].__get__(self)
        raise AttributeError(name)

    def page_bytes(self, page: int) -> bytes:
        """The page's bytes by SGLang's own flat data page (page_first_kv_split has none in SGLang: its
        pointer table's regions)."""
        if self.layout == "page_first_kv_split":
            return self.region_bytes(page, mla=True)
        return self.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()

    def region_bytes(self, page: int, mla: bool) -> bytes:
        """The page's bytes by SGLang's own zero-copy pointer table, K regions first, then V."""
        ptrs, sizes = self.get_page_buffer_meta(torch.arange(page * PAGE, (page + 1) * PAGE))
        regions = [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes)]
        return b"".join(regions if mla else regions[0::2] + regions[1::2])


def storage_config(extra: dict, *, mla=False, tp_rank=0, tp_size=1, model="test-model") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model, extra_config=dict(extra))


def dynamic(**cache) -> dict:
    return {"backend_name": "tieredkv", "module_path": "tieredkv.integrations.sglang",
            "class_name": "TieredKVStorage", "interface_v1": 1, **cache}


def backend(pool, extra, **cfg) -> TieredKVStorage:
    """Built the way SGLang's cache controller attaches a backend."""
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg), pool)
    made.register_mem_pool_host(pool)
    made.on_host_pools_registered()
    assert isinstance(made, TieredKVStorage)
    return made


class Key(list):
    """What SGLang hashes: token ids with the request's extra_key (LoRA id appended) and cache_salt."""

    def __init__(self, tokens, extra_key=None, cache_salt=None):
        super().__init__(tokens)
        self.extra_key, self.cache_salt = extra_key, cache_salt


def page_keys(tokens, **identity) -> list[str]:
    return get_storage_hash_str(Key(tokens, **identity), None, page_size=PAGE)


def indices(pages) -> torch.Tensor:
    """Host token indices of whole pages, as SGLang's controller passes them."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


@pytest.fixture
def extra(seg_name):
    return dynamic(hot_bytes="8M", hot_name=seg_name)


ALL_LAYOUTS = [(layout, False) for layout in LAYOUTS["mha"]] + [(layout, True) for layout in LAYOUTS["mla"]]


@pytest.mark.parametrize("layout,mla", ALL_LAYOUTS, ids=[f"{'mla' if m else 'mha'}-{x}" for x, m in ALL_LAYOUTS])
def test_zero_copy_round_trip_in_every_layout_matches_sglangs_own_pages(layout, mla, extra, request):
    src, dst = HostPool(layout, mla=mla, seed=1), HostPool(layout, mla=mla, seed=2)
    store = backend(src, extra, mla=mla)
    request.addfinalizer(store.close)
    keys = page_keys(list(range(3 * PAGE)))
    assert store.batch_set_v1(keys, indices([3, 7, 9])) == [True] * 3
    assert store.batch_exists(keys) == 3
    load = backend(dst, extra, mla=mla)  # another instance of the host, same namespace
    request.addfinalizer(load.close)
    assert load.batch_get_v1(keys, indices([1, 5, 0])) == [True] * 3
    for a, b in ((3, 1), (7, 5), (9, 0)):
        assert dst.page_bytes(b) == src.page_bytes(a)
        assert src.region_bytes(a, mla) == src.page_bytes(a)  # our block order == SGLang's zero-copy regions
    untouched = HostPool(layout, mla=mla, seed=2)
    assert dst.page_bytes(2) == untouched.page_bytes(2)  # nothing written beyond the asked pages
    if layout == "page_first_kv_split":  # SGLang offers no flat data page (generic path) for it
        return
    # The generic path reads and writes the same blocks as SGLang's flat data pages.
    flat = load.get(keys[1], src.get_dummy_flat_data_page())
    assert flat is not None and flat.view(torch.uint8).numpy().tobytes() == src.page_bytes(7)
    other = page_keys(list(range(100, 100 + PAGE)))
    assert load.set(other[0], src.get_data_page(4 * PAGE, flat=True))
    dst.set_from_flat_data_page(6 * PAGE, load.get(other[0], dst.get_dummy_flat_data_page()))
    assert dst.page_bytes(6) == src.page_bytes(4)
    assert load.get(page_keys(list(range(500, 500 + PAGE)))[0], dst.get_dummy_flat_data_page()) is None


def test_exists_is_the_leading_run_and_a_miss_ends_a_get(extra):
    pool = HostPool("page_first")
    store = backend(pool, extra)
    keys = page_keys(list(range(4 * PAGE)))
    store.batch_set_v1([keys[0], keys[1], keys[3]], indices([0, 1, 3]))
    assert store.batch_exists(keys) == 2
    assert store.exists(keys[3]) and not store.exists(keys[2])
    assert store.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True, True, False, False]
    assert store.get_stats().hits_by_tier == {"hot": 2, "warm": 0, "miss": 2}
    store.close()


def test_unsupported_layouts_and_side_pools_are_refused_at_start_up(extra):
    with pytest.raises(InvalidInput, match="page_unified"):
        backend(HostPool("page_unified"), extra)
    with pytest.raises(InvalidInput, match="page_first_kv_split"):
        backend(HostPool("page_first_kv_split"), extra)  # an MLA (NPU) layout: no MHA pool has it
    with pytest.raises(InvalidInput, match="page_head"):
        backend(HostPool("page_head", mla=True), extra, mla=True)
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra), HostPool("page_first"))
    made.register_mem_pool_host(HostPool("page_first"))
    made.register_mem_host_pool_v2(HostPool("page_first"), "mamba")
    with pytest.raises(InvalidInput, match="side pools"):
        made.on_host_pools_registered()
    made.close()
    with pytest.raises(InvalidInput, match="unknown hicache storage extra config keys"):
        backend(HostPool("page_first"), {**extra, "hot_size": "1G"})


def test_salts_lora_and_ranks_never_share_pages(extra):
    pool = HostPool("page_first")
    store = backend(pool, extra)
    tokens = list(range(2 * PAGE))
    mine = page_keys(tokens, cache_salt="tenant-a")
    store.batch_set_v1(mine, indices([0, 1]))
    assert store.batch_exists(page_keys(tokens, cache_salt="tenant-a")) == 2
    assert store.batch_exists(page_keys(tokens, cache_salt="tenant-b")) == 0
    assert store.batch_exists(page_keys(tokens)) == 0
    # SGLang appends the LoRA id to extra_key: another adapter is another chain.
    lora = page_keys(tokens, extra_key="adapter-1", cache_salt="tenant-a")
    assert lora != mine and store.batch_exists(lora) == 0
    # Another TP shard of an MHA model holds other heads: its own namespace.
    # (a segment per namespace: an explicit hot_name is shared only within one)
    rank1 = backend(HostPool("page_first"), {**extra, "hot_name": extra["hot_name"] + "-r1"}, tp_rank=1, tp_size=2)
    assert rank1.batch_exists(mine) == 0
    other_model = backend(HostPool("page_first"), {**extra, "hot_name": extra["hot_name"] + "-m2"},
                          model="another-model")
    assert other_model.batch_exists(mine) == 0
    assert len({b.spec.namespace for b in (store, rank1, other_model)}) == 3
    for b in (rank1, other_model):
        b.cache.unlink_hot()
    store.close()


def test_mla_has_one_writer_and_every_rank_reads_its_pages(extra):
    writer = backend(HostPool("page_first", mla=True, seed=3), extra, mla=True, tp_rank=0, tp_size=2)
    reader = backend(HostPool("page_first", mla=True, seed=4), extra, mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(list(range(2 * PAGE)))
    assert reader.batch_set_v1(keys, indices([0, 1])) == [True, True]  # accepted, not written
    assert writer.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert reader.batch_get_v1(keys, indices([5, 6])) == [True, True]
    assert reader.mem_pool_host.page_bytes(5) == writer.mem_pool_host.page_bytes(0)
    writer.close()
    reader.close()


def model_dir(path, weights: bytes):
    """A local model directory: a config.json and one weight file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def launched_with(monkeypatch, model_path, revision=None, quantization=None, overrides=None):
    """Publish SGLang's ``model`` config namespace (its own bag class) as a server launched with
    ``--model-path model_path`` has it; the storage config carries only the served name."""
    from sglang.srt.runtime_context import _ConfigBag, get_context

    bag = _ConfigBag("model")
    bag._set("model_path", str(model_path))
    bag._set("revision", revision)
    bag._set("quantization", quantization)
    bag._set("json_model_override_args", overrides or "{}")
    monkeypatch.setattr(get_context(), "_config_bags", {"model": bag})


def test_two_model_directories_under_one_served_name_never_share_pages(extra, tmp_path, monkeypatch):
    a, b = model_dir(tmp_path / "a" / "model", b"weights of A"), model_dir(tmp_path / "b" / "model", b"weights of B")
    keys = page_keys(list(range(2 * PAGE)))
    launched_with(monkeypatch, a)
    store_a = backend(HostPool("page_first"), extra, model="alias")
    assert store_a.batch_set_v1(keys, indices([0, 1])) == [True, True]
    assert store_a.spec.model_id.startswith("model@local-")
    launched_with(monkeypatch, b)
    store_b = backend(HostPool("page_first"), {**extra, "hot_name": extra["hot_name"] + "-b"}, model="alias")
    assert store_b.spec.namespace != store_a.spec.namespace
    assert store_b.batch_exists(keys) == 0 and store_b.batch_get_v1(keys, indices([4, 5])) == [False, False]
    store_b.cache.unlink_hot()
    # Without a published model path the served name is the identity: a directory's is its files too.
    monkeypatch.undo()
    by_name = backend(HostPool("page_first"), extra, model=str(a))
    assert by_name.spec.namespace == store_a.spec.namespace and by_name.batch_exists(keys) == 2
    by_name.close()
    store_a.close()


def test_load_time_quantisation_and_config_overrides_never_share_pages(extra, tmp_path, monkeypatch):
    """One model directory launched plain, with ``--quantization fp8`` and with a RoPE override
    (``--json-model-override-args``): each computes other KV, so each has a namespace of its own."""
    d = model_dir(tmp_path / "model", b"the weights")
    keys = page_keys(list(range(PAGE)))
    seen = []
    for i, launch in enumerate([{}, {"quantization": "fp8"}, {"overrides": '{"rope_theta": 12345.0}'},
                                {"overrides": '{"rope_scaling": {"rope_type": "linear", "factor": 4.0}}'}]):
        launched_with(monkeypatch, d, **launch)
        store = backend(HostPool("page_first"), {**extra, "hot_name": f"{extra['hot_name']}-{i}"}, model="served")
        seen.append(store.spec.namespace)
        if i == 0:
            assert store.batch_set_v1(keys, indices([0])) == [True]
        store.cache.unlink_hot()
        store.close()
    assert len(set(seen)) == 4
    launched_with(monkeypatch, d, quantization="fp8")
    store = backend(HostPool("page_first"), extra, model="served")
    assert "quant=fp8" in store.spec.extra
    store.close()


def test_one_model_directory_spelled_two_ways_is_one_namespace(extra, tmp_path, monkeypatch):
    d = model_dir(tmp_path / "model", b"the weights")
    keys = page_keys(list(range(2 * PAGE)))
    launched_with(monkeypatch, d)
    store = backend(HostPool("page_first"), extra, model="served-one")
    store.batch_set_v1(keys, indices([2, 3]))
    monkeypatch.chdir(tmp_path)
    launched_with(monkeypatch, "./model/")
    other = backend(HostPool("page_first"), extra, model="served-two")
    assert other.spec.namespace == store.spec.namespace
    assert other.batch_get_v1(keys, indices([6, 7])) == [True, True]
    assert other.mem_pool_host.page_bytes(6) == store.mem_pool_host.page_bytes(2)
    other.close()
    store.close()


def test_an_explicit_model_id_overrides_the_model_path(extra, tmp_path, monkeypatch):
    launched_with(monkeypatch, model_dir(tmp_path / "model", b"weights"))
    store = backend(HostPool("page_first"), {**extra, "model_id": "my-finetune@v3"}, model="alias")
    assert store.spec.model_id == "my-finetune@v3"
    store.close()
    launched_with(monkeypatch, "Qwen/Qwen3-8B", revision="abc123")  # a hub name: the name and its revision
    hub = backend(HostPool("page_first"), {**extra, "hot_name": extra["hot_name"] + "-hub"}, model="alias")
    assert hub.spec.model_id == "Qwen/Qwen3-8B@abc123"
    hub.cache.unlink_hot()


def test_new_weights_at_the_same_path_do_not_find_the_old_pages(seg_name, tmp_path, monkeypatch):
    d = model_dir(tmp_path / "model", b"fine-tune one")
    extra = dynamic(hot_bytes="8M", hot_name=seg_name, warm_dir=str(tmp_path / "warm"), warm_bytes="16M")
    keys = page_keys(list(range(3 * PAGE)))
    launched_with(monkeypatch, d)

    def restart() -> TieredKVStorage:
        return backend(HostPool("page_first", seed=11), extra, model="alias")

    store = restart()
    assert store.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    store.cache.flush()
    store.cache.unlink_hot()
    store.cache = None
    same = restart()  # same weights, same warm_dir: the pages are found
    assert same.spec.namespace == store.spec.namespace and same.batch_exists(keys) == 3
    same.cache.unlink_hot()
    same.cache = None
    new = tmp_path / "new.safetensors"
    new.write_bytes(b"fine-tune two")  # a new fine-tune: same file name and size, other bytes
    os.replace(new, d / "model.safetensors")
    after = restart()
    assert after.spec.namespace != store.spec.namespace
    assert after.batch_exists(keys) == 0
    assert after.batch_get_v1(keys, indices([5, 6, 7])) == [False] * 3
    after.close()


_WRITER = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from test_sglang import HostPool, backend, indices, page_keys
    store = backend(HostPool("page_first", seed=7), json.loads(sys.argv[1]))
    ok = store.batch_set_v1(page_keys(list(range(3 * {page}))), indices([2, 4, 6]))
    store.cache.flush()
    print(json.dumps(ok))
    store.close()
""")


@pytest.mark.procs
def test_two_instances_share_through_hot_and_a_restart_finds_warm(seg_name, tmp_path):
    import json

    extra = dynamic(hot_bytes="8M", hot_name=seg_name, warm_dir=str(tmp_path / "warm"), warm_bytes="16M")
    code = _WRITER.format(tests=os.path.dirname(__file__), page=PAGE)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(extra)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True] * 3
    keys = page_keys(list(range(3 * PAGE)))
    src = HostPool("page_first", seed=7)
    # A second instance (this process) finds the first one's pages in shared memory.
    pool = HostPool("page_first", seed=8)
    reader = backend(pool, extra)
    assert reader.batch_get_v1(keys, indices([0, 1, 3])) == [True] * 3
    assert [pool.page_bytes(p) for p in (0, 1, 3)] == [src.page_bytes(p) for p in (2, 4, 6)]
    assert reader.get_stats().hits_by_tier["hot"] == 3
    # A reboot removes the segment; the warm tier still has every page.
    reader.cache.unlink_hot()
    reader.cache = None
    again = backend(HostPool("page_first", seed=9), extra)
    assert again.batch_exists(keys) == 3
    assert again.batch_get_v1(keys, indices([5, 6, 7])) == [True] * 3
    assert [again.mem_pool_host.page_bytes(p) for p in (5, 6, 7)] == [src.page_bytes(p) for p in (2, 4, 6)]
    stats = again.get_stats()
    assert stats.hits_by_tier == {"hot": 0, "warm": 3, "miss": 0} and stats.prefetch_pgs == [3]
    assert again.batch_get_v1(keys, indices([8, 9, 10])) == [True] * 3  # promoted: hot now
    assert again.get_stats().hits_by_tier["hot"] == 3
    again.close()


def test_the_backend_signature_is_what_sglangs_factory_calls():
    params = list(inspect.signature(TieredKVStorage.__init__).parameters)
    assert params[:3] == ["self", "storage_config", "kwargs"]


class MXFP8Pool(HostPool):
    """SGLang's MXFP8 host pool keeps each page's UE8M0 scales beside ``kv_buffer``, in ``k_scale_host`` and
    ``v_scale_host`` ((pages, layers, bytes) uint8 each, as its ``_init_scale_buffers`` makes them)."""

    def __init__(self, seed: int):
        super().__init__("page_first", seed=seed)
        g = torch.Generator().manual_seed(seed + 100)
        self.k_scale_host = torch.randint(0, 255, (PAGES, LAYERS, 16), generator=g, dtype=torch.uint8)
        self.v_scale_host = torch.randint(0, 255, (PAGES, LAYERS, 16), generator=g, dtype=torch.uint8)


class LogicalPool:
    """The attributes of SGLang's ``LogicalHostPool`` (DeepSeek-V4's anchor pool): no KV tensor."""

    storage_format_tag = None

    def __init__(self):
        self.size, self.page_size, self.device, self.layout = PAGES * PAGE, PAGE, "cpu", "layer_first"
        self.dtype, self.layer_num, self.kv_buffer = torch.uint8, 0, None


def test_pools_whose_pages_are_not_all_in_their_kv_buffer_are_refused_at_start_up(extra):
    """An MXFP8 pool was accepted and only its payload stored: another instance then got the writer's
    payload with its own stale scales, as a hit. A logical pool (no KV tensor) crashed registration with
    a bare ``AttributeError``. Both are refused, saying why."""
    with pytest.raises(InvalidInput, match="k_scale_host, v_scale_host"):
        backend(MXFP8Pool(seed=1), extra)
    with pytest.raises(InvalidInput, match="no KV buffer"):
        backend(LogicalPool(), extra, mla=True)


def test_attention_context_parallelism_is_refused(extra):
    """Context-parallel ranks hold slices of a page; keyed like the whole page, a rank (or an instance
    without context parallelism) was served rank 0's slice."""
    config = dataclasses.replace(storage_config(extra, mla=True, tp_size=2), attn_cp_rank=1, attn_cp_size=2)
    with pytest.raises(InvalidInput, match="attn_cp_size"):
        StorageBackendFactory.create_backend("dynamic", config, HostPool("page_first", mla=True))


def test_pages_past_the_pool_and_missing_values_are_bad_input_and_store_nothing(extra, request):
    """``batch_set`` with fewer values than keys stored uninitialised memory for the rest (and said True);
    a ``batch_set_v1`` index past the pool stored the pool's last page under that key. Both raise
    ``InvalidInput`` now, and nothing is stored."""
    pool = HostPool("page_first", seed=3)
    store = backend(pool, extra)
    request.addfinalizer(store.close)
    keys = page_keys(list(range(2 * PAGE)))
    with pytest.raises(InvalidInput, match="2 keys and 1 values"):
        store.batch_set(keys, [pool.get_data_page(0, flat=True)])
    with pytest.raises(InvalidInput, match="2 keys and 0 values"):
        store.batch_set(keys, None)
    with pytest.raises(InvalidInput, match="past the host pool"):
        store.batch_set_v1(keys, indices([0, PAGES]))
    with pytest.raises(InvalidInput, match="past the host pool"):
        store.batch_get_v1(keys, indices([PAGES + 1, 0]))
    assert store.batch_exists(keys) == 0 and not store.exists(keys[1])
