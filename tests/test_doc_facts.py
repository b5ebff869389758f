"""Facts the docs state that a reader acts on: every `page.md#anchor` link lands on a heading, and
worked sizing examples are the arithmetic of the geometry they name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tieredkv import KVSpec

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (but - and _), spaces to -."""
    text = re.sub(r"`|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # a "# comment" in code is no heading
    return {github_anchor(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_every_anchor_link_lands_on_a_heading():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(((?:[\w./-]+\.md)?)#([\w-]+)\)", text):
            dest = (page.parent / target).resolve() if target else page
            if dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest):
                broken.append(f"{page.name} -> {target or page.name}#{anchor}")
    assert not broken, broken


def test_github_anchor_rules():
    assert github_anchor("4. The warm tier: durability and checksums") == "4-the-warm-tier-durability-and-checksums"
    assert github_anchor("Restart-safe by default (with `TieredCache`)") == "restart-safe-by-default-with-tieredcache"


def test_fleet_sizing_example_is_its_own_arithmetic():
    """fleet.md's worked example: bytes per token from the geometry it names, the prompt's size from
    that, and the hundred prompts from that (it once said 56 KiB for a geometry of 28 KiB)."""
    text = " ".join((ROOT / "docs" / "fleet.md").read_text().split())
    m = re.search(r"(\d+) layers, (\d+) KV heads of (\d+) in bf16(?: \([^)]*\))? caches (\d+) KiB per token, "
                  r"so a (\d+)k-token system prompt is (\d+) MiB; (\d+) such prompts are (\d+) GiB", text)
    assert m, "the sizing example's sentence changed: update this test with it"
    layers, heads, dim, kib, k_tokens, mib, count, gib = map(int, m.groups())
    spec = KVSpec(model_id="x", num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype="bfloat16")
    per_token = spec.block_bytes // spec.chunk_tokens
    assert per_token == kib * 1024
    assert k_tokens * 1024 * per_token == mib << 20
    assert round(count * mib / 1024) == gib


@pytest.mark.procs
def test_quickstart_watch_step_has_something_to_watch(tmp_path):
    """Step 7's python leaves a segment, and its shell commands show it with the numbers the page
    states (run in a segment directory of the test's own: TIEREDKV_SHM_DIR)."""
    import json
    import os
    import subprocess
    import sys

    text = (ROOT / "docs" / "quickstart.md").read_text()
    step = text[text.index("## 7. Watch it"):]
    code = re.search(r"```python\n(.*?)```", step, re.S).group(1)
    shell = re.search(r"```bash\n(.*?)```", step, re.S).group(1)
    env = {**os.environ, "TIEREDKV_SHM_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    tool = [sys.executable, "-m", "tieredkv"]
    listed = subprocess.run([*tool, "ls"], capture_output=True, text=True, env=env, timeout=60)
    assert "/tieredkv-quickstart-watch" in listed.stdout
    name = re.search(r"tieredkv stats (\S+)\s", shell).group(1)
    doc = json.loads(subprocess.run([*tool, "stats", name, "--json", "-"], capture_output=True, text=True,
                                    env=env, timeout=60, check=True).stdout)
    hit, total = map(int, re.search(r"(\d+) of (\d+) prompt tokens", shell).groups())
    assert (doc["cache"]["hit_tokens"], doc["cache"]["prompt_tokens"]) == (hit, total)
    rm = re.search(r"tieredkv rm (\S+)", shell).group(1)
    assert subprocess.run([*tool, "rm", rm], env=env, timeout=60).returncode == 0
    assert not list(tmp_path.iterdir())
