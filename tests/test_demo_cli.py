"""`tieredkv demo` as a user drives it from a terminal: Ctrl-C while its workers start, `--json -`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = ["--workers", "2", "--requests-per-worker", "1", "--prefix-tokens", "64", "--new-tokens", "2",
        "--configs", "no_cache"]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except (OSError, IndexError):
            continue
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((p, cmd))
        todo.extend(children.get(p, []))
    return out


@pytest.mark.procs
def test_ctrl_c_while_the_workers_start_is_a_clean_stop():
    """The terminal sends SIGINT to the whole process group: the demo, its forkserver (importing torch
    for a few seconds) and its workers. Only the demo reports it (exit 130, no traceback from a child),
    and no child outlives it."""
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv", "demo", *TINY], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any("forkserver" in cmd for _, cmd in _descendants(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "the demo never started its workers"
            time.sleep(0.05)
        time.sleep(0.5)  # inside the forkserver's preload (torch, transformers)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "KeyboardInterrupt" not in err, err[-3000:]
    deadline = time.monotonic() + 30
    while (left := _descendants(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    # Orphans are re-parented away from proc.pid; look for them by session instead.
    strays = [p for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == proc.pid]
    assert not strays, f"processes of the demo still running: {strays} {left}"


def _session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[4])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.procs
def test_json_dash_prints_only_the_json_document(tmp_path):
    """`--json -` makes standard output one JSON document (for `| jq`); nothing else on it, and no file
    named '-' is written."""
    proc = subprocess.run([sys.executable, "-m", "tieredkv", "demo", *TINY, "--no-progress", "--json", "-"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert list(doc["configs"]) == ["no_cache"]
    from tieredkv import demo

    table = demo.format_table(doc).splitlines()
    assert table[0] not in proc.stderr and table[0] not in proc.stdout  # the table is not printed at all
    assert not (tmp_path / "-").exists()
