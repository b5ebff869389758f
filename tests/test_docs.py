"""The docs a user reads stay true: every ```python block in README.md and docs/*.md runs as written (no
exemptions, no hidden set-up: a block that needs a model, a directory or a size makes its own, small and
temporary), the docstring examples pass, and docs/api.md is what docs/gen_api.py generates from the
docstrings."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import unlink_segments_matching

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

def blocks() -> list[tuple[str, int, str]]:
    """(file name, line number, code) of every ```python block."""
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            out.append((path.name, text.count("\n", 0, m.start()) + 2, m.group(1)))
    return out


def _every_block() -> list:
    """Every block; those that load the real SmolLM2 weights (a download the first time, then seconds of
    model work) are marked ``slow`` like the other real-weights tests: CI runs them, ``-m "not slow"``
    does not."""
    return [pytest.param(name, code, id=f"{name}:{line}",
                         marks=[pytest.mark.slow] if 'load_model("smollm2")' in code else [])
            for name, line, code in blocks()]


@pytest.mark.procs
@pytest.mark.parametrize("name,code", _every_block())
def test_code_block_runs(name, code, tmp_path):
    """Each block runs as written in a fresh interpreter, in an empty directory. Segment names and model
    ids are made unique to this run (so that parallel test runs do not meet in /dev/shm) and removed
    after: the only change made to the text."""
    token = f"doc{os.getpid()}x{secrets.token_hex(3)}"
    source = code
    source = source.replace("'/tieredkv-", f"'/tieredkv-{token}-").replace('"/tieredkv-', f'"/tieredkv-{token}-')
    source = re.sub(r'model_id="([^"]+)"', rf'model_id="\1-{token}"', source)
    script = tmp_path / "example.py"
    script.write_text(source)
    temp = tmp_path / "tmp"  # the block's temporary files: a copied example must clean up after itself
    temp.mkdir()
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "TMPDIR": str(temp)})
    finally:
        unlink_segments_matching(token)
    assert proc.returncode == 0, f"{name} example failed:\n{proc.stderr[-3000:]}"
    # torch keeps its compile cache there (torchinductor_USER, shared by every run): not the example's.
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"{name} example left {left} in its TMPDIR"


def test_every_page_with_code_is_covered():
    """Every page is scanned (README.md and all of docs/), and the blocks are many: a fence typo that
    hid a page's examples from this test would show here."""
    found = blocks()
    assert len(found) >= 15
    pages = {name for name, _, _ in found}
    assert {"README.md", "quickstart.md", "warm-tier.md", "integration.md", "policies.md", "models.md",
            "deploy.md"} <= pages


def test_no_block_reserves_more_than_a_few_mib():
    """Examples size their tiers in MiB (a copied example must not reserve tens of GiB of disk or
    /dev/shm): sizes written as ``N << 30`` (GiB) are kept for prose, never code."""
    for name, line, code in blocks():
        assert not re.search(r"<<\s*(3\d|[4-9]\d)\b", code), f"{name}:{line}: GiB-sized tier in an example"


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # imports every integration, vLLM's and SGLang's too (10-15 s): the full suite runs it
def test_api_md_is_up_to_date():
    gen = _gen_api()
    assert (ROOT / "docs" / "api.md").read_text() == gen.generate(), \
        "docs/api.md is out of date: run `python docs/gen_api.py` and commit the result"


def test_api_md_covers_the_public_names():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in ("tieredkv.TieredCache(", "tieredkv.TieredCache.lookup(", "tieredkv.KVSpec(",
                 "tieredkv.metrics.serve_metrics(", "tieredkv.numa.pin_to_node(", "tieredkv.warm.WarmTier(",
                 "tieredkv.hot.HotTier(", "tieredkv.integrations.models.load_model(",
                 "tieredkv.integrations.models.converted_gguf_dir("):
        assert name in text, name
    assert " at 0x" not in text                                # no memory addresses: output is stable


@pytest.mark.slow  # imports every module api.md documents, the integrations (torch) too: about 6 s
def test_docstring_examples():
    """The ``>>>`` examples in docstrings (shown as pycon blocks in api.md) pass as doctests."""
    attempted = {}
    for modname, *_ in _gen_api().MODULES:
        mod = importlib.import_module(modname)
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, modname
        attempted[modname] = result.attempted
    assert attempted["tieredkv.metrics"] > 0 and attempted["tieredkv.numa"] > 0


def test_docs_link_to_existing_pages():
    """Relative links between our pages point at files that exist (or are announced in the README)."""
    owned = ["quickstart.md", "tuning.md", "operations.md"]
    for page in owned:
        for target in re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]+)?\)", (ROOT / "docs" / page).read_text()):
            assert (ROOT / "docs" / target).exists() or target in ("benchmarks.md", "reliability.md"), \
                f"{page} links to a missing {target}"
