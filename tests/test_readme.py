"""README.md's shell commands run as written, from a clone: the quickstart's first example is run first
(it leaves the segment and the warm tier the commands look at), then every command of every ```bash
block, in a directory that has what a clone has (`.venv`, `benchmarks/`), with the venv on PATH.

Commands that cannot run here get their own tests, named in ``ELSEWHERE``; commands that run until
Ctrl-C are run here and interrupted once they printed their first screen.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import unlink_segments_matching

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(bash|python)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

#: Commands not run by this test, and the test that covers each instead.
ELSEWHERE = {
    "bash .ci/setup && .venv/bin/tieredkv demo": "builds .venv (.ci/run runs .ci/setup first on every CI run), "
                                                 "then minutes of model runs: tests/test_demo.py runs the "
                                                 "demo small",
    "bash .ci/setup && .venv/bin/python -m pytest -q -n 2 --dist loadfile": "this suite itself, as .ci/run "
                                                                            "runs it",
    "python -m pytest -q -m quick -n auto": "this suite itself (the inner loop)",
    "tieredkv stats --prometheus 9400": "a fixed port may be taken on a shared machine; "
                                        "tests/test_cli.py::test_stats_prometheus_serves_until_interrupted "
                                        "runs the same command on a free port",
}
#: Commands that run until Ctrl-C, and what their first screen must show.
UNTIL_INTERRUPTED = {"tieredkv stats readme --watch 2": "PREFIX HIT RATE"}


def blocks(kind: str) -> list[str]:
    return [m.group(2) for m in _FENCE.finditer(README.read_text()) if m.group(1) == kind]


def commands() -> list[str]:
    """Every command line of the README's bash blocks, comments stripped."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_every_command_is_run_or_covered_elsewhere():
    found = commands()
    assert len(found) >= 12
    assert set(ELSEWHERE) | set(UNTIL_INTERRUPTED) <= set(found), "README changed: update ELSEWHERE"
    assert "source .venv/bin/activate" in found            # how `tieredkv` gets on PATH


def test_ci_runs_the_readmes_test_command():
    """.ci/run runs the README's test command exactly (with coverage added through PYTEST_ADDOPTS)."""
    [readme] = [c for c in commands() if " -m pytest " in c and c.startswith("bash .ci/setup && ")]
    command = readme.removeprefix("bash .ci/setup && ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if " -m pytest" in line]
    assert ci == [f'PYTEST_ADDOPTS="--cov --cov-report=term" {command}'], ci


@pytest.fixture
def clone(tmp_path):
    """A working directory that looks like a clone to the commands (``.venv``, ``benchmarks/``), and a token
    that makes this run's segment names its own (parallel runs share /dev/shm)."""
    for name in (".venv", "benchmarks", ".ci"):
        (tmp_path / name).symlink_to(ROOT / name)
    token = secrets.token_hex(3)
    yield tmp_path, token
    unlink_segments_matching(token)


@pytest.mark.procs
def test_readme_commands_run_as_written(clone):
    cwd, token = clone
    own = lambda text: text.replace("readme", f"readme{token}")   # noqa: E731 - this run's segment names
    quickstart = blocks("python")[0]
    (cwd / "quickstart.py").write_text(own(quickstart))
    env = {**os.environ, "PYTHONPATH": ""}
    run = subprocess.run([sys.executable, "quickstart.py"], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert os.path.exists(f"/dev/shm/tieredkv-readme{token}")   # left for the commands below
    failures = []
    for cmd in commands():
        if cmd in ELSEWHERE:
            continue
        shell = f"source .venv/bin/activate && {own(cmd)}"
        if cmd in UNTIL_INTERRUPTED:
            proc = subprocess.Popen(["bash", "-c", shell], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            first = proc.stdout.readline()
            while first and UNTIL_INTERRUPTED[cmd] not in first:
                first = proc.stdout.readline()
            os.killpg(proc.pid, signal.SIGINT)
            proc.communicate(timeout=60)
            if UNTIL_INTERRUPTED[cmd] not in first:
                failures.append((cmd, "its first screen lacks " + UNTIL_INTERRUPTED[cmd]))
            continue
        done = subprocess.run(["bash", "-c", shell], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            failures.append((cmd, done.returncode, done.stderr[-800:]))
    assert not failures, failures
    assert not os.path.exists(f"/dev/shm/tieredkv-readme{token}")   # `tieredkv rm /tieredkv-readme` ran
