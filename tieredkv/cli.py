"""The ``tieredkv`` command: demo, estimate, ls, stats, rm, verify, simulate, bench.

Every subcommand takes ``--json OUT`` (``-`` for standard output) and ``--help`` with an example.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tieredkv.errors import TieredKVError
from tieredkv.spec import KVSpec

_SIZE_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def human(n: float) -> str:
    """Bytes as a short binary-unit string: 1,835,008 -> '1.75 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _emit(args: argparse.Namespace, doc: Any, text: Callable[[], str]) -> None:
    """Print ``text()`` for people, and write ``doc`` as JSON to ``--json`` (``-``: stdout)."""
    out = getattr(args, "json", None)
    if out == "-":
        json.dump(doc, sys.stdout, indent=2, default=str)
        print()
        return
    print(text())
    if out:
        Path(out).write_text(json.dumps(doc, indent=2, default=str))


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = [[str(c) for c in r] for r in [head, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


# ---- estimate ---------------------------------------------------------------------------------
def _spec_from_args(args: argparse.Namespace) -> KVSpec:
    if args.config:
        return KVSpec.from_hf_config(args.config, chunk_tokens=args.chunk_tokens, dtype=args.dtype)
    missing = [f"--{n.replace('_', '-')}" for n in ("layers", "kv_heads", "head_dim") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"tieredkv estimate: give --config PATH or all of {', '.join(missing)}")
    return KVSpec(model_id=args.model_id, num_layers=args.layers, num_kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=args.dtype or "float16", chunk_tokens=args.chunk_tokens)


def cmd_estimate(args: argparse.Namespace) -> int:
    from tieredkv.estimate import estimate

    spec = _spec_from_args(args)
    doc = estimate(spec, prompt_tokens=args.prompt_tokens or args.prefix_tokens, prefix_tokens=args.prefix_tokens,
                   concurrency=args.concurrency, workers=args.workers, prefill_ms_per_token=args.prefill_ms_per_token)
    doc["spec"] = spec.to_dict()

    def text() -> str:
        rows = [["bytes per token", f"{doc['bytes_per_token']:,}"],
                ["block (chunk of %d tokens)" % spec.chunk_tokens, human(doc["block_bytes"])],
                ["KV per request", human(doc["kv_per_request_bytes"])],
                ["KV per worker (x%d concurrent)" % args.concurrency, human(doc["kv_per_worker_bytes"])],
                ["KV in total (x%d workers)" % args.workers, human(doc["kv_total_bytes"])],
                ["shared prefix, one copy", human(doc["prefix_kv_bytes"])],
                ["duplicate prefix bytes (upper bound)", human(doc["duplicate_prefix_bytes"])],
                ["removed by sharing (one copy kept)", human(doc["saved_by_sharing_bytes"])],
                ["KV in total, prefix shared", human(doc["kv_total_shared_bytes"])]]
        if "prefill_saved_ms_per_request" in doc:
            rows.append(["prefill saved per request", f"{doc['prefill_saved_ms_per_request']:.1f} ms"])
        return f"{spec.model_id}: {spec.num_layers} layers x 2 x {spec.num_kv_heads} kv heads x " \
               f"{spec.head_dim} x {spec.dtype_bytes} B\n" + _table(rows, ["", "size"])

    _emit(args, doc, text)
    return 0


# ---- ls / stats / rm / verify -------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    from tieredkv.hot import admin

    segments = admin.list_segments()
    warm = []
    if args.warm_dir:
        from tieredkv.warm.admin import list_warm_tiers

        warm = list_warm_tiers(args.warm_dir)

    def text() -> str:
        rows = [[d["name"], d.get("model_id") or "-", human(d.get("size_bytes", 0)),
                 f"{d.get('ready_slots', 0)}/{d.get('n_slots', 0)}", d.get("hits", 0), d.get("misses", 0),
                 f"{100 * d.get('prefix_hit_rate', 0):.1f}%", d.get("live_handles", 0),
                 d["reason"] or ""] for d in segments]
        out = "hot tier segments (/dev/shm):\n" + (_table(rows, ["segment", "model", "size", "used/slots", "hits",
                                                                "misses", "prefix hit", "handles", "note"])
                                                   if rows else "  none")
        if args.warm_dir:
            wrows = [[w.get("path"), w.get("model") or "-", human(w.get("size_bytes") or 0),
                      f"{w.get('blocks', 0)}/{w.get('capacity_blocks', 0)}", w.get("error") or ""] for w in warm]
            out += f"\nwarm tiers under {args.warm_dir}:\n" + (
                _table(wrows, ["path", "model", "size", "blocks/capacity", "note"]) if wrows else "  none")
        return out

    _emit(args, {"hot": segments, "warm": warm}, text)
    return 0


def _pick_segment(name: str | None) -> str:
    from tieredkv.hot import segment as seg

    if name:
        return seg.check_name(name)
    names = [n for n in seg.list_segment_names() if "-tmp-" not in n]
    if len(names) != 1:
        raise SystemExit(f"tieredkv: {len(names)} segments exist; name one of: {', '.join(names) or '(none)'}")
    return names[0]


def cmd_stats(args: argparse.Namespace) -> int:
    from tieredkv.hot import admin

    name = _pick_segment(args.name)
    while True:
        doc = admin.inspect(name)
        if doc.get("error"):
            print(f"tieredkv stats: {name}: {doc['error']}", file=sys.stderr)
            return 1

        def text() -> str:
            c, k = doc["cache"], doc["counters"]
            lookups = max(c["lookups"], 1)
            lines = [f"{name}  ({doc['model_id']}, policy {doc['policy']}, {doc['live_handles']} handles)",
                     f"  PREFIX HIT RATE  {100 * doc['prefix_hit_rate']:.1f}%   "
                     f"({c['hit_tokens']:,} of {c['prompt_tokens']:,} prompt tokens served from cache)",
                     f"  tokens: hot hits {c['hot_hit_tokens']:,}  warm hits {c['warm_hit_tokens']:,}  "
                     f"prefilled {c['prefill_tokens']:,}",
                     f"  lookups {c['lookups']:,} (mean {c['lookup_ns'] / lookups / 1e3:.1f} us)  "
                     f"loads mean {c['load_ns'] / max(sum(doc['load_hist']), 1) / 1e6:.2f} ms",
                     f"  blocks: {doc['ready_slots']:,}/{doc['n_slots']:,} used, {k['evictions']:,} evicted, "
                     f"{c['promotions']:,} promoted, {c['demotions']:,} demoted, {c['lost_blocks']:,} lost",
                     f"  bytes: hot read {human(c['hot_bytes_read'])}, warm read {human(c['warm_bytes_read'])}, "
                     f"hot written {human(c['hot_bytes_written'])}, warm written {human(c['warm_bytes_written'])}",
                     f"  recoveries {k['recoveries']} (scrubs {doc['scrubs']}), reclaimed slots {k['reclaimed']}, "
                     f"warm errors {c['warm_errors']}"]
            return "\n".join(lines)

        _emit(args, doc, text)
        if not args.watch:
            return 0
        time.sleep(args.watch)
        print()


def cmd_rm(args: argparse.Namespace) -> int:
    from tieredkv.hot import admin

    if bool(args.names) == bool(args.stale):
        raise SystemExit("tieredkv rm: give segment NAMEs or --stale (not both)")
    if args.stale:
        gone = admin.remove_stale(dry_run=args.dry_run)
        doc = [{"name": d["name"], "reason": d["reason"]} for d in gone]
        verb = "would remove" if args.dry_run else "removed"
        _emit(args, {"removed": doc, "dry_run": args.dry_run},
              lambda: "\n".join(f"{verb} {d['name']}: {d['reason']}" for d in doc) or "no stale segments")
        return 0
    import posix_ipc

    status = 0
    for name in args.names:
        try:
            if not args.dry_run:
                admin.remove(name)
            print(f"{'would remove' if args.dry_run else 'removed'} {name}")
        except posix_ipc.ExistentialError:
            print(f"tieredkv rm: no segment {name}", file=sys.stderr)
            status = 1
    return status


def cmd_verify(args: argparse.Namespace) -> int:
    from tieredkv.warm.admin import verify

    report = verify(args.directory, repair=args.repair)
    tiers = report.get("tiers", [report])

    def text() -> str:
        lines = []
        for t in tiers:
            bad = t.get("bad_blocks", t.get("bad", []))
            n_bad = len(bad) if isinstance(bad, list) else int(bad or 0)
            lines.append(f"{t.get('path')}: {t.get('checked', t.get('blocks', '?'))} blocks checked, {n_bad} bad"
                         + (f", {t.get('repaired', t.get('dropped', 0))} dropped" if args.repair else "")
                         + ("" if t.get("ok", n_bad == 0) else "  <-- DAMAGED"))
        return "\n".join(lines) or f"no warm tier under {args.directory}"

    _emit(args, report, text)
    return 0 if report.get("ok", True) else 2


# ---- simulate / demo / bench -------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from tieredkv.sim import cli as sim_cli

    return sim_cli.main(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from tieredkv import demo

    return demo.main(args)


BENCHMARKS = ("hot_tier", "warm_tier", "tiered", "serving", "simulate", "chaos", "tenant_timing")


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"{args.name}.py"
    if not script.is_file():
        raise SystemExit(f"tieredkv bench: {script} not found; benchmarks run from a source checkout")
    sys.argv = [str(script), *args.rest]
    if args.json:
        sys.argv += ["--json", args.json]
    runpy.run_path(str(script), run_name="__main__")
    return 0


# ---- the parser ---------------------------------------------------------------------------------
_EXAMPLES = {
    "demo": "tieredkv demo --workers 8 --requests-per-worker 4 --json demo.json --plot demo.png",
    "estimate": "tieredkv estimate --layers 28 --kv-heads 2 --head-dim 128 --prefix-tokens 4096 "
                "--concurrency 4 --workers 8",
    "ls": "tieredkv ls --warm-dir /var/cache/tieredkv",
    "stats": "tieredkv stats --watch 2",
    "rm": "tieredkv rm --stale --dry-run",
    "verify": "tieredkv verify /var/cache/tieredkv --repair",
    "simulate": "tieredkv simulate --trace mooncake.jsonl --policy lru,s3fifo --capacity 1000,5% --plot mrc.png",
    "bench": "tieredkv bench hot_tier -- --quick",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tieredkv", description="Share the KV cache of common prompt prefixes across worker processes "
        "(shared memory) and keep it across restarts (SSD).",
        epilog="Run `tieredkv COMMAND --help` for a command's options and an example.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {_EXAMPLES[name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    from tieredkv import demo
    from tieredkv.sim import cli as sim_cli

    demo.add_arguments(add("demo", cmd_demo, "the multi-worker serving demo: no cache vs private vs shared vs "
                                             "restart, on an embedded model (or --model)"))
    sim_cli.add_arguments(add("simulate", cmd_simulate, "replay a block trace through eviction policies "
                                                         "(block and prefix hit ratios, miss-ratio curves)"))

    p = add("estimate", cmd_estimate, "size the KV cache and what sharing a prefix saves")
    p.add_argument("--config", help="a model's config.json (or its folder) instead of geometry flags")
    p.add_argument("--layers", type=int, help="decoder layers")
    p.add_argument("--kv-heads", type=int, help="KV heads (after GQA)")
    p.add_argument("--head-dim", type=int, help="elements per head")
    p.add_argument("--dtype", default=None, help="KV dtype (default: the config's, else float16)")
    p.add_argument("--model-id", default="model", help="a name for the output")
    p.add_argument("--chunk-tokens", type=int, default=64, help="tokens per cached block (default 64)")
    p.add_argument("--prefix-tokens", type=int, required=True, help="tokens of the shared prefix")
    p.add_argument("--prompt-tokens", type=int, default=None, help="tokens per request (default: the prefix)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent requests per worker (default 4)")
    p.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    p.add_argument("--prefill-ms-per-token", type=float, default=None, help="to estimate prefill time saved")
    p.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-': stdout)")

    p = add("ls", cmd_ls, "list hot-tier segments (and warm tiers with --warm-dir)")
    p.add_argument("--warm-dir", help="also list the warm tiers under this directory")
    p.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-': stdout)")

    p = add("stats", cmd_stats, "live counters of a segment, prefix hit rate first")
    p.add_argument("name", nargs="?", help="segment name (default: the only one)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-': stdout)")

    p = add("rm", cmd_rm, "remove segments by name, or the stale ones")
    p.add_argument("names", nargs="*", metavar="NAME", help="segment names, e.g. /tieredkv-...")
    p.add_argument("--stale", action="store_true",
                   help="remove segments of another layout version, a dead creator's leftovers, and segments "
                        "that no process has open")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed")
    p.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-': stdout)")

    p = add("verify", cmd_verify, "check every checksum of a warm tier (exit 2 if damaged)")
    p.add_argument("directory", help="a warm tier directory, or a root holding several")
    p.add_argument("--repair", action="store_true", help="drop the bad blocks from the index")
    p.add_argument("--json", metavar="OUT", help="write JSON to OUT ('-': stdout)")

    p = add("bench", cmd_bench, "run a benchmark from benchmarks/ (source checkout)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options, after --")
    p.add_argument("--json", metavar="OUT", help="passed to the benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "rest", None) and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    try:
        return args.func(args) or 0
    except TieredKVError as e:
        print(f"tieredkv {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
