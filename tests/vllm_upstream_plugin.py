"""A pytest plugin that runs vLLM's own connector tests with ``TieredKVConnector`` in their mock's place.

Loaded by tests/test_vllm_upstream.py (``-p vllm_upstream_plugin``) into a pytest run over the files of
vLLM's test suite that ``.ci/fetch-vllm-tests`` fetched. vLLM's scheduler tests swap the engine's
connector for ``create_mock_connector()``, a ``Mock`` on which each test scripts what the connector
"matched" (``get_num_new_matched_tokens``) and returns from ``request_finished``. Here that helper
returns a ``Mock`` that *wraps a real scheduler-side TieredKVConnector* instead: the scripted answers
stay the test's, every other call (``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output`` with the invalid blocks, ``get_external_cache_hit_sources``, ...) runs
tieredkv's code against vLLM's real ``Scheduler``, and the test's own assertions must still hold.

vLLM's core scheduler tests (``tests/v1/core/test_scheduler.py``) instead name ``MockKVConnector`` in
their config, with a fixed ``matched_tokens`` / ``is_async`` / ``num_defers_before_matching`` script.
The plugin registers, under that name, a ``TieredKVConnector`` subclass that answers that script from
``get_num_new_matched_tokens`` (after running tieredkv's own lookup) and adds the ``requests`` list the
mock's metadata carries; everything else is tieredkv's code.

At the end the plugin writes, to the file named by ``$TIEREDKV_UPSTREAM_REPORT``, how many connectors
it made and how often each real method ran, so the caller can check the swap happened.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any
from unittest.mock import Mock

REPORT_ENV = "TIEREDKV_UPSTREAM_REPORT"
LAYER = "model.layers.0.self_attn.attn"  # one attention layer with an index, as a model registers it

_made: list[Any] = []
_calls: collections.Counter[str] = collections.Counter()


def _counted(real: Any, name: str) -> Any:
    method = getattr(real, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        _calls[name] += 1
        return method(*args, **kwargs)

    return call


def tieredkv_mock_connector() -> Mock:
    """A ``Mock`` wrapping a real scheduler-side ``TieredKVConnector`` (block size 16, as the tests')."""
    import torch
    from tests.v1.kv_connector.unit.utils import create_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from tieredkv.integrations.vllm import TieredKVConnector

    block = 16
    extra = {"hot_bytes": "4M", "hot_name": f"/tieredkv-upstream-{os.getpid()}-{len(_made)}", "chunk_tokens": block}
    cfg = create_vllm_config(kv_connector="TieredKVConnector", kv_connector_module_path="tieredkv.integrations.vllm",
                             kv_role="kv_both", kv_connector_extra_config=extra, block_size=block,
                             kv_load_failure_policy="recompute")
    kv_cache_config = KVCacheConfig(num_blocks=10000, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYER], FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                                                    dtype=torch.float32))])
    real = TieredKVConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config)
    _made.append(real)
    mock = Mock(wraps=real)
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "get_external_cache_hit_sources"):
        setattr(mock, name, Mock(wraps=_counted(real, name)))
    return mock


SCRIPT_KEYS = ("matched_tokens", "is_async", "num_defers_before_matching", "supports_divergent_local_hybrid_hits")


def _mock_kv_connector_class() -> type:
    """``TieredKVConnector`` answering ``MockKVConnector``'s script (see the module docstring)."""
    import dataclasses
    from itertools import chain

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    from tieredkv.integrations.vllm import TieredKVConnector

    class TieredMockKVConnector(TieredKVConnector):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            ktc = vllm_config.kv_transfer_config
            extra = dict(ktc.kv_connector_extra_config or {})
            script = {key: extra.pop(key) for key in SCRIPT_KEYS if key in extra}
            block = vllm_config.cache_config.block_size
            extra.update(hot_bytes="4M", hot_name=f"/tieredkv-upstream-{os.getpid()}-{len(_made)}",
                         chunk_tokens=block)
            ktc.kv_connector_extra_config = extra
            if kv_cache_config is not None:  # the tests name their one layer "layer": give it an index
                kv_cache_config = dataclasses.replace(kv_cache_config, kv_cache_groups=[
                    KVCacheGroupSpec([LAYER], group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups])
            super().__init__(vllm_config, role, kv_cache_config)
            self._script = script
            self._defers_left = collections.defaultdict(lambda: script.get("num_defers_before_matching", 0))
            _made.append(self)

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return bool(self._script.get("supports_divergent_local_hybrid_hits", False))

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            _calls["get_num_new_matched_tokens"] += 1
            super().get_num_new_matched_tokens(request, num_computed_tokens)  # tieredkv's lookup runs
            if self._defers_left[request.request_id] > 0:
                self._defers_left[request.request_id] -= 1
                return None, False
            return self._script["matched_tokens"], self._script["is_async"]

        def update_state_after_alloc(self, *args: Any, **kwargs: Any) -> Any:
            _calls["update_state_after_alloc"] += 1
            return super().update_state_after_alloc(*args, **kwargs)

        def update_connector_output(self, *args: Any, **kwargs: Any) -> Any:
            _calls["update_connector_output"] += 1
            return super().update_connector_output(*args, **kwargs)

        def request_finished(self, *args: Any, **kwargs: Any) -> Any:
            _calls["request_finished"] += 1
            return super().request_finished(*args, **kwargs)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            _calls["build_connector_meta"] += 1
            meta = super().build_connector_meta(scheduler_output)
            cached = scheduler_output.scheduled_cached_reqs
            meta.requests = [{"req_id": req_id} for req_id in chain(
                (req.req_id for req in scheduler_output.scheduled_new_reqs),
                (req_id for req_id in cached.req_ids if req_id in cached.resumed_req_ids))]
            return meta

    return TieredMockKVConnector


TieredMockKVConnector: Any = None


def pytest_configure(config: Any) -> None:
    """Register the ``MockKVConnector`` stand-in under vLLM's name (before vLLM's test helpers do)."""
    global TieredMockKVConnector
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    TieredMockKVConnector = _mock_kv_connector_class()
    KVConnectorFactory.register_connector("MockKVConnector", __name__, "TieredMockKVConnector")
    # vLLM's helpers register their own mock under the same name when imported: keep ours.
    register = KVConnectorFactory.register_connector.__func__  # type: ignore[attr-defined]

    def keep_ours(cls: Any, name: str, module_path: str, class_name: str) -> None:
        if name != "MockKVConnector":
            register(cls, name, module_path, class_name)

    KVConnectorFactory.register_connector = classmethod(keep_ours)  # type: ignore[method-assign]


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Swap the helper in every collected module that imported it (and in the helpers' module)."""
    modules = {item.module for item in items if getattr(item, "module", None) is not None}
    try:
        from tests.v1.kv_connector.unit import utils

        modules.add(utils)
    except ImportError:
        pass
    for module in modules:
        if hasattr(module, "create_mock_connector"):
            module.create_mock_connector = tieredkv_mock_connector


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    for real in _made:
        try:
            real.cache.unlink_hot()
        except Exception:  # a test may have closed it already; the report still matters
            pass
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            json.dump({"connectors": len(_made), "calls": dict(_calls),
                       "named_mock_connectors": sum(isinstance(c, TieredMockKVConnector) for c in _made)}, f)
