"""The docs a user reads stay true: every ```python block in README.md and docs/*.md runs, the
docstring examples pass, and docs/api.md is what docs/gen_api.py generates from the docstrings."""

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

import posix_ipc
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

#: Names the prose around a block defines ("With a HuggingFace model, ..."): set up before it runs.
PRELUDES = {
    ("README.md", "from tieredkv.integrations.hf import CachedPrefill"): (
        "import torch\n"
        "from tieredkv import TieredCache\n"
        "from tieredkv.integrations.hf import spec_for_model\n"
        "from tieredkv.integrations.models import random_model, tiny_llama_config\n"
        "model = random_model(tiny_llama_config())\n"
        "cache = TieredCache(spec_for_model(model, chunk_tokens=16), hot_bytes=16 << 20,\n"
        "                    hot_name='/tieredkv-readme-hf')\n"
        "input_ids = torch.arange(40)\n",
        "assert res.cached_tokens == 0 and res.logits.shape[-1] == 512\n"
        "assert runner.prefill(input_ids).cached_tokens == 32\n"
        "cache.hot.unlink()\n"),
    ("policies.md", "from tieredkv.policies import demotion, promotion"): (
        "import numpy as np\n"
        "warm_hits = np.array([0, 1, 2, 5])\n"
        "hot_hits = np.array([0, 1, 3])\n", ""),
}

#: Blocks in pages other engineers own that cannot run as written (they open system paths such as
#: /var/cache/tieredkv, reserve tens of GiB, or load a model from a placeholder path). They are not run;
#: the owners should make them runnable or start them with `# not run: <why>`. An entry whose block
#: is gone fails test_excused_blocks_still_exist, so that the excuse is removed with the problem.
EXCUSED = {
    ("integration.md", "import torch"): "loads 'path/to/model' and reserves 4 GiB of /dev/shm and 64 GiB of disk",
    ("warm-tier.md", "from tieredkv import KVSpec, chunk_keys"): "opens /var/cache/tieredkv with 64 GiB; "
                                                                   "prompt_tokens, out and kv come from prose",
}


def blocks() -> list[tuple[str, int, str]]:
    """(file name, line number, code) of every ```python block."""
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            out.append((path.name, text.count("\n", 0, m.start()) + 2, m.group(1)))
    return out


def _first_line(code: str) -> str:
    return next((line.strip() for line in code.splitlines() if line.strip()), "")


def _not_run_reason(code: str) -> str | None:
    m = re.match(r"#\s*not run:\s*(.*)", _first_line(code))
    return m.group(1).strip() if m else None


def _runnable() -> list:
    params = []
    for name, line, code in blocks():
        key = (name, _first_line(code))
        if _not_run_reason(code) is not None or key in EXCUSED:
            continue
        params.append(pytest.param(name, code, id=f"{name}:{line}"))
    return params


def _unlink_matching(token: str) -> None:
    for entry in os.listdir("/dev/shm"):
        if token in entry:
            try:
                posix_ipc.unlink_shared_memory("/" + entry)
            except posix_ipc.ExistentialError:
                pass


@pytest.mark.procs
@pytest.mark.parametrize("name,code", _runnable())
def test_code_block_runs(name, code, tmp_path):
    """Each block runs in a fresh interpreter, in an empty directory. Segment names and model ids are
    made unique to this run (so that parallel test runs do not meet in /dev/shm) and removed after."""
    token = f"doc{os.getpid()}x{secrets.token_hex(3)}"
    prelude, epilogue = PRELUDES.get((name, _first_line(code)), ("", ""))
    source = prelude + code + epilogue
    source = source.replace("'/tieredkv-", f"'/tieredkv-{token}-").replace('"/tieredkv-', f'"/tieredkv-{token}-')
    source = re.sub(r'model_id="([^"]+)"', rf'model_id="\1-{token}"', source)
    script = tmp_path / "example.py"
    script.write_text(source)
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    finally:
        _unlink_matching(token)
    assert proc.returncode == 0, f"{name} example failed:\n{proc.stderr[-3000:]}"


def test_every_block_is_run_or_explains_why():
    found = blocks()
    assert len(found) >= 8                                   # README, quickstart, tuning, operations...
    for name, line, code in found:
        reason = _not_run_reason(code)
        if reason is not None:
            assert len(reason) > 5, f"{name}:{line}: '# not run:' needs a reason"
    not_run = [(n, line) for n, line, c in found if _not_run_reason(c) is not None]
    assert len(not_run) <= 2, f"keep examples that do not run rare: {not_run}"


def test_excused_blocks_still_exist():
    keys = {(name, _first_line(code)) for name, _, code in blocks()}
    stale = [k for k in EXCUSED if k not in keys]
    assert not stale, f"these blocks changed or are gone; drop them from EXCUSED (and let them run): {stale}"


def test_preludes_match_blocks():
    keys = {(name, _first_line(code)) for name, _, code in blocks()}
    assert set(PRELUDES) <= keys


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_md_is_up_to_date():
    gen = _gen_api()
    assert (ROOT / "docs" / "api.md").read_text() == gen.generate(), \
        "docs/api.md is out of date: run `python docs/gen_api.py` and commit the result"


def test_api_md_covers_the_public_names():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in ("tieredkv.TieredCache(", "tieredkv.TieredCache.lookup(", "tieredkv.KVSpec(",
                 "tieredkv.metrics.serve_metrics(", "tieredkv.numa.pin_to_node(", "tieredkv.warm.WarmTier(",
                 "tieredkv.hot.HotTier("):
        assert name in text, name
    assert " at 0x" not in text                                # no memory addresses: output is stable


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
