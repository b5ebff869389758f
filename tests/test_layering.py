"""Imports go down only (docs/architecture.md, "Layers"): read from the source, lazy imports included.

integrations / cli / demo / metrics -> cache -> levels, config -> tiers, tensors, background, cuda
-> tier, counters -> keys, layout, spec, errors, hashtable; policies sees only itself, the hash table and
the errors.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Layer of each module (by its dotted-name prefix; the longest prefix wins). Higher imports lower only.
LAYERS = {
    "tieredkv.errors": 0, "tieredkv.forksafe": 0, "tieredkv.model_identity": 0, "tieredkv.spec": 1,
    "tieredkv.hashtable": 0, "tieredkv.policies": 1,
    "tieredkv.keys": 2, "tieredkv.layout": 2, "tieredkv.counters": 2, "tieredkv.numa": 2, "tieredkv.codec": 2,
    "tieredkv.halves": 2,
    "tieredkv.tier": 3,
    "tieredkv.background": 4, "tieredkv.cuda": 4, "tieredkv.tensors": 4, "tieredkv.memory": 4,
    "tieredkv.hot": 4, "tieredkv.warm": 4, "tieredkv.remote": 4, "tieredkv.journal": 4,
    "tieredkv.config": 5, "tieredkv.hit": 5, "tieredkv.levels": 6, "tieredkv.loading": 6, "tieredkv.writeback": 6,
    "tieredkv.storing": 6,
    "tieredkv.cache": 7,
    "tieredkv.integrations": 8, "tieredkv.blocks": 8, "tieredkv.estimate": 8, "tieredkv.metrics": 8, "tieredkv.sim": 8,
    "tieredkv.demo": 9, "tieredkv.cli": 10, "tieredkv.__main__": 11,
}
#: Never imported by the core (only tieredkv.integrations may).
SERVING_ENGINES = ("vllm", "sglang")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for base, prefix in ((ROOT / "tieredkv", "tieredkv"), (ROOT / "policies", "tieredkv.policies")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules ``name`` imports (any depth of the file), resolved to known module names."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for alias in node.names:
                found.add(f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in known else mod)
    return found


def layer(name: str) -> int | None:
    if name == "tieredkv":
        return 3  # the package: errors, keys, spec and tier by import; the rest lazily, by name, on use
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len, default=None)
    return LAYERS[best] if best is not None else None


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def test_every_module_has_a_layer():
    assert [name for name in GRAPH if layer(name) is None] == []


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_go_down_only(name):
    mine = layer(name)
    assert mine is not None
    up = sorted(dep for dep in GRAPH[name] if dep.startswith("tieredkv") and (layer(dep) or 0) > mine)
    assert up == [], f"{name} (layer {mine}) imports higher layers: {up}"
    if not name.startswith("tieredkv.integrations"):
        engines = sorted(dep for dep in GRAPH[name] if dep.split(".")[0] in SERVING_ENGINES)
        assert engines == [], f"{name} imports a serving engine: {engines}"


def test_policies_see_only_themselves_the_hash_table_and_the_errors():
    for name, deps in GRAPH.items():
        if name.startswith("tieredkv.policies"):
            outside = {d for d in deps if d.startswith("tieredkv") and not d.startswith("tieredkv.policies")}
            assert outside <= {"tieredkv.hashtable", "tieredkv.errors"}, f"{name}: {outside}"


def test_no_cycles_between_modules():
    """No two modules of different layers import each other, and within a layer no cycle
    (a package's ``__init__`` re-exporting its own modules is not a cycle)."""
    def deps(name: str) -> set[str]:
        return {d for d in GRAPH[name] if d in GRAPH and d != name and not name_is_parent(name, d)}

    def name_is_parent(name: str, dep: str) -> bool:
        return dep.startswith(name + ".") or name.startswith(dep + ".")

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(deps(name)):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)
