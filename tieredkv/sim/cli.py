"""The ``tieredkv simulate`` subcommand: argument wiring and the text table.

``tieredkv/cli.py`` registers it as ``add_arguments(subparser)`` plus ``main(args)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tieredkv import policies
from tieredkv.errors import InvalidInput, TieredKVError

from . import fastloop
from .plot import plot_mrc
from .replay import run_simulation
from .synthetic import synthetic_trace
from .trace import Trace, read_trace

__all__ = ["add_arguments", "main", "format_table", "request_slice"]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` options to ``parser``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="trace file: Mooncake JSONL (hash_ids), our JSONL (blocks) or CSV")
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="generate N synthetic requests (system prompts, sessions, one-offs) instead")
    parser.add_argument("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    parser.add_argument("--format", choices=["jsonl", "csv"], help="trace format (default: from the suffix)")
    parser.add_argument("--requests", metavar="A:B",
                        help="replay only requests A to B-1 (Python slice, e.g. :6015 or 6015:), from a cold "
                             "cache: a tuning split and a held-out split; N%% then counts the slice's unique "
                             "blocks, so give blocks to compare splits at one size")
    parser.add_argument("--policy", default="lru",
                        help=f"comma-separated eviction policies (valid: {', '.join(policies.names())}; "
                             "prefix_aware:BASE wraps BASE; package.module:Class imports your own, from the "
                             "current directory too; installed packages add names through the "
                             f"'{policies.ENTRY_POINT_GROUP}' entry-point group)")
    parser.add_argument("--capacity", default="1%,5%,10%,20%",
                        help="comma-separated sizes in blocks, or N%% of the trace's unique blocks")
    parser.add_argument("--hot", help="two-level replay: comma-separated hot sizes (blocks or N%%)")
    parser.add_argument("--warm", help="two-level replay: warm size(s), one or one per hot size")
    parser.add_argument("--promotion", default="always", help="two-level: promotion rule (always, never, on_nth_hit:N)")
    parser.add_argument("--demotion", default="on_evict",
                        help="two-level: demotion rule (on_evict, write_through, on_nth_hit:N)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    parser.add_argument("--plot", metavar="OUT.png", help="draw the miss-ratio curves into OUT.png (matplotlib)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="worker processes for the policy x capacity replays (default 0: one per CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-optimal", action="store_true",
                        help="skip Belady's MIN (the optimum) and the gap-closed column")
    parser.add_argument("--baseline", default="lru",
                        help="policy the gap to the optimum is measured from (default lru)")


def request_slice(trace: Trace, spec: str) -> Trace:
    """Requests ``A:B`` of ``trace`` (Python slice syntax, steps refused) as a trace of their own.

    Raises:
        InvalidInput: ``spec`` is not ``A:B`` with integer (or empty) bounds, or selects no request.
    """
    a, sep, b = spec.partition(":")
    try:
        if not sep or ":" in b:
            raise ValueError
        bounds = slice(int(a) if a.strip() else None, int(b) if b.strip() else None)
    except ValueError:
        raise InvalidInput(f"--requests takes A:B (e.g. :6015 or 6015:), got {spec!r}") from None
    picked = range(trace.n_requests)[bounds]
    if not len(picked):
        raise InvalidInput(f"--requests {spec} selects no request of the {trace.n_requests:,} in {trace.name}")
    ts = None if trace.timestamps_ms is None else trace.timestamps_ms[picked.start:picked.stop].tolist()
    return Trace.from_requests((trace.request(i).tolist() for i in picked), name=f"{trace.name}[{spec}]",
                               timestamps_ms=ts)


def format_table(result: dict) -> str:
    """The results as an aligned text table.

    With the optimum (``run_simulation(..., optimal=True)``, the CLI's default) each capacity also
    gets a ``belady`` row (the block and prefix optimum) and every policy the fraction of the
    baseline-to-optimum gap in block hit ratio it closes.
    """
    two_level = any("hot_blocks" in r for r in result["results"])
    optimal = result.get("optimal") or []
    head = ["policy", "hot", "warm"] if two_level else ["policy", "capacity"]
    head += ["% unique", "block hit"] + (["hot hit", "warm hit"] if two_level else []) + ["prefix hit"]
    head += (["gap closed"] if optimal else []) + ["req/s"]
    rows = []
    shown = result["results"]
    if optimal:  # per capacity: the policies, then the optimum
        shown = sorted(shown + optimal, key=lambda r: (r["capacity_blocks"], r["policy"] == "belady"))
    for r in shown:
        size = [r["hot_blocks"], r["warm_blocks"]] if two_level else [r["capacity_blocks"]]
        split = [f"{r['hot_hit_ratio']:.4f}", f"{r['warm_hit_ratio']:.4f}"] if two_level else []
        if r["policy"] == "belady":
            gap = ["1.00"]
        elif optimal:
            gap = ["-" if r.get("gap_closed") is None else f"{r['gap_closed']:.2f}"]
        else:
            gap = []
        speed = "-" if r["policy"] == "belady" else f"{r['requests_per_s'] or 0:.0f}"
        name = "belady (optimum)" if r["policy"] == "belady" else r["policy"]
        rows.append([name, *map(str, size), f"{100 * r['capacity_fraction']:.1f}",
                     f"{r['block_hit_ratio']:.4f}", *split, f"{r['prefix_hit_ratio']:.4f}", *gap, speed])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = [f"trace {result['trace']}: {result['requests']} requests, {result['accesses']} block accesses, "
             f"{result['unique_blocks']} unique blocks"]
    lines += ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths)))
              for row in [head, *rows]]
    if optimal:
        base = (result.get("baseline") or [{}])[0].get("policy", "lru")
        exact = all(o.get("exact_prefix") for o in optimal)
        lines.append(f"gap closed: (block hit - {base}) / (belady - {base}) at the same capacity; belady is "
                     "Belady's MIN with bypass, " + ("also the exact prefix optimum on this prefix-tree trace"
                                                     if exact else "an upper bound of the prefix optimum"))
    return "\n".join(lines)


#: The most requests ``--synthetic`` generates: a larger count is a slip (it would run for days).
MAX_SYNTHETIC = 10_000_000


def main(args: argparse.Namespace) -> int:
    """Run ``tieredkv simulate``; print the table; write ``--json`` / ``--plot``. Returns the exit code."""
    if bool(args.warm) != bool(args.hot):
        print("tieredkv simulate: --hot and --warm go together", file=sys.stderr)
        return 2
    if args.synthetic is not None and not 1 <= args.synthetic <= MAX_SYNTHETIC:
        print(f"tieredkv simulate: --synthetic must be positive and at most {MAX_SYNTHETIC:,} (requests), got "
              f"{args.synthetic:,}", file=sys.stderr)
        return 2
    if args.trace and not os.path.isfile(args.trace):
        print(f"tieredkv simulate: --trace {args.trace}: " + ("not a file" if os.path.exists(args.trace)
              else "no such file"), file=sys.stderr)
        return 2
    # "module:Class" policies are found in the current directory too, as `python -m` would.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        trace = (read_trace(args.trace, fmt=args.format) if args.trace
                 else synthetic_trace(args.synthetic, seed=args.seed))
        if args.requests:
            trace = request_slice(trace, args.requests)
        if trace.n_accesses == 0:
            print(f"tieredkv simulate: {trace.name} holds no block accesses; nothing to replay", file=sys.stderr)
            return 2
        if fastloop.needs_compiling(_csv(args.policy)):
            print("tieredkv simulate: compiling the replay loop (numba; once after an install or upgrade, about "
                  "a minute on 2 cores, cached afterwards)", file=sys.stderr, flush=True)
        result = run_simulation(trace, _csv(args.policy), _csv(args.capacity),
                                hot=_csv(args.hot) if args.hot else None,
                                warm=_csv(args.warm) if args.warm else None,
                                promotion=args.promotion, demotion=args.demotion,
                                progress=not args.no_progress and sys.stderr.isatty(), jobs=args.jobs,
                                optimal=not args.no_optimal, baseline=args.baseline)
    except (policies.UnknownPolicy, TieredKVError, OSError) as e:
        print(f"tieredkv simulate: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_mrc(result, args.plot)
    return 0
