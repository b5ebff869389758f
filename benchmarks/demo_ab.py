"""The demo (``tieredkv demo``) of this tree against a baseline tree, alternately, in one command.

Each round runs ``python -m tieredkv.demo --rounds 1`` once with this tree's ``tieredkv`` and once with
the baseline's (``--baseline DIR``: a checkout of an older commit, e.g. ``git worktree add
/tmp/speed-base main``), in alternating order, so both see the same load. Per run it prints the shared
cache's TTFT p50 against private caches and against no cache, the same for the workers' PSS, and the
load average beside them; then the median of each ratio over the rounds, baseline and this tree.

    python benchmarks/demo_ab.py --baseline /tmp/speed-base                  # 2 workers x 4, 3 rounds
    python benchmarks/demo_ab.py --baseline /tmp/speed-base --workers 8 --rounds 2
    python benchmarks/demo_ab.py --workers 2 --rounds 3 --keep /tmp/ab   # this tree only; keep the JSONs

Each run's line also gives the workers' PSS per configuration (MiB) and the share of the CPUs other
programs used while it served (``others``: above ~25% the wall-clock ratios are mostly noise), then the
demo's per-phase breakdown of each configuration (CPU per phase, waiting, decoding, the workers busy
beside a request, page faults, a worker's first hit against its later ones) and its account of shared
against private: ``shared/private busy`` is the ratio of workers busy at once (above one per CPU), which
with ``shared/private CPU`` predicts the TTFT ratio on a machine the demo has to itself.

Without ``--baseline`` only this tree runs. Not a test: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One demo run of ``tree``'s tieredkv; its JSON document."""
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "tieredkv.demo", "--workers", str(args.workers), "--requests-per-worker",
           str(args.requests_per_worker), "--prefix-tokens", str(args.prefix_tokens), "--no-progress",
           "--configs", "no_cache,private,shared", "--json", str(out)]
    if "--rounds" in subprocess.run([sys.executable, "-m", "tieredkv.demo", "--help"], env=env, cwd=tree,
                                    capture_output=True, text=True).stdout:
        cmd += ["--rounds", "1"]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"demo failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def ratios(doc: dict) -> dict:
    c = doc["configs"]
    out = {"shared/private TTFT": c["shared"]["ttft_p50_ms"] / c["private"]["ttft_p50_ms"],
           "shared/no_cache TTFT": c["shared"]["ttft_p50_ms"] / c["no_cache"]["ttft_p50_ms"],
           "shared/private PSS": c["shared"]["pss_bytes"] / c["private"]["pss_bytes"],
           "shared/no_cache PSS": c["shared"]["pss_bytes"] / c["no_cache"]["pss_bytes"]}
    if c["private"].get("ttft_cpu_p50_ms"):
        out["shared/private CPU"] = c["shared"]["ttft_cpu_p50_ms"] / c["private"]["ttft_cpu_p50_ms"]
    # Waiting for a core scales with the workers busy at once (above one per CPU): shared keeps more
    # requests in flight, so its TTFT is about CPU ratio x this ratio of private's. Beside the hits, where
    # the p50 lies, when the JSON has it (an older demo's has the mean over every request only).
    field = "busy_workers_hits_mean" if c["private"].get("busy_workers_hits_mean") else "busy_workers_mean"
    if c["private"].get(field) and c["shared"].get(field):
        cpus = doc["settings"].get("cpu_count") or os.cpu_count() or 1
        out["shared/private busy"] = max(c["shared"][field], cpus) / max(c["private"][field], cpus)
    return out


def breakdown(doc: dict) -> list[str]:
    """The demo's own account of where the time to the first token went (this tree's wording, for
    either tree's JSON: fields an older demo did not write are left out)."""
    sys.path.insert(0, str(ROOT))
    from tieredkv.demo import where_time_went

    return [line for line in where_time_went(doc) if not line.startswith("where the time")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of the tree to compare against")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests-per-worker", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write each run's JSON document into this directory")
    args = parser.parse_args()
    trees = [("this", ROOT)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    got: dict[str, list[dict]] = {name: [] for name, _ in trees}
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tieredkv-demo-ab-") as tmp:
        for r in range(args.rounds):
            for name, tree in (trees if r % 2 == 0 else trees[::-1]):
                load = os.getloadavg()[0]
                out = (args.keep or Path(tmp)) / f"{name}{r}.json"
                doc = run_once(tree, args, out)
                row = ratios(doc)
                got[name].append(row)
                c = doc["configs"]
                ttft = "  ".join(f"{k} {c[k]['ttft_p50_ms']:8.1f} ms" for k in ("shared", "private", "no_cache"))
                names = ("shared", "private", "no_cache")
                pss = "  ".join(f"{k} {c[k]['pss_bytes'] / (1 << 20):6.1f} MiB" for k in names)
                others = max(c[k].get("others_busy", float("nan")) for k in names)
                print(f"round {r + 1} {name:<8} load {load:5.1f} others {100 * others:3.0f}%  TTFT p50 {ttft}  "
                      f"PSS {pss}  " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
                for line in breakdown(doc):
                    print("    " + line.strip(), flush=True)
    print(f"median over {args.rounds} rounds ({args.workers} workers x {args.requests_per_worker} requests, "
          f"{args.prefix_tokens}-token prefix; load average now {os.getloadavg()[0]:.1f}):")
    for name, rows in got.items():
        keys = [k for k in rows[0] if all(k in row for row in rows)]
        print(f"  {name:<8} " + "  ".join(f"{k} {statistics.median(row[k] for row in rows):.2f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
