"""The code in docs/policies.md runs: the custom-policy example registers and replays a trace."""

from __future__ import annotations

import os
import re

from tieredkv import policies
from tieredkv.policies import base

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "policies.md")


def _section_code(title: str) -> str:
    text = open(DOC, encoding="utf-8").read()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"no python block under '## {title}'"
    return "\n".join(blocks)


def test_custom_policy_example_runs(capsys):
    try:
        exec(compile(_section_code("Add your own policy"), DOC, "exec"), {"__name__": "doc_example"})
        out = capsys.readouterr().out.split("\n")
        assert out[0].startswith("lru ") and out[1].startswith("keep_system_prompts ")
        assert "keep_system_prompts" in policies.names()
        # It keeps the leading chunks: with 2 slots and a deep block present, the shallow one stays.
        p = policies.make("keep_system_prompts", protect=1)
        import numpy as np
        st = policies.SlotState.private(p, 2)
        policies.insert(p, st, np.array([0, 1]), np.array([10, 11]), np.array([-1, 0]), np.array([0, 1]))
        assert policies.evict(p, st, 1).tolist() == [1]
    finally:
        base._REGISTRY.pop("keep_system_prompts", None)


def test_doc_names_every_registered_policy():
    text = open(DOC, encoding="utf-8").read()
    for name in policies.names():
        assert f"`{name}" in text, name
