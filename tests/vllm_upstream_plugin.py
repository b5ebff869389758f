"""A pytest plugin that runs vLLM's own connector tests with ``TieredKVConnector`` in their mock's place.

Loaded by tests/test_vllm_upstream.py (``-p vllm_upstream_plugin``) into a pytest run over the files of
vLLM's test suite that ``.ci/fetch-vllm-tests`` fetched. vLLM's scheduler tests swap the engine's
connector for ``create_mock_connector()``, a ``Mock`` on which each test scripts what the connector
"matched" (``get_num_new_matched_tokens``) and returns from ``request_finished``. Here that helper
returns a ``Mock`` that *wraps a real scheduler-side TieredKVConnector* instead: the scripted answers
stay the test's, every other call (``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output`` with the invalid blocks, ``get_external_cache_hit_sources``, ...) runs
tieredkv's code against vLLM's real ``Scheduler``, and the test's own assertions must still hold.

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
            json.dump({"connectors": len(_made), "calls": dict(_calls)}, f)
