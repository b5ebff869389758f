"""The ``tieredkv`` command: demo, estimate, ls, stats, rm, verify, simulate, bench.

Every subcommand takes ``--json OUT`` (``-`` for standard output) and ``--help`` with an example.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import json
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tieredkv.errors import InvalidInput, TieredKVError, UsageError
from tieredkv.spec import KVSpec


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
        raise UsageError(f"give --config PATH or all of {', '.join(missing)}")
    return KVSpec(model_id=args.model_id, num_layers=args.layers, num_kv_heads=args.kv_heads,
                  head_dim=args.head_dim, dtype=args.dtype or "float16", chunk_tokens=args.chunk_tokens)


def cmd_estimate(args: argparse.Namespace) -> int:
    from tieredkv.estimate import estimate

    for flag in ("prefix_tokens", "prompt_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0, got {value}")
    try:
        spec = _spec_from_args(args)
        doc = estimate(spec, prompt_tokens=args.prompt_tokens or args.prefix_tokens,
                       prefix_tokens=args.prefix_tokens, concurrency=args.concurrency, workers=args.workers,
                       prefill_ms_per_token=args.prefill_ms_per_token)
    except ValueError as e:  # a bad size or geometry: say which, as a usage error
        raise UsageError(str(e)) from None
    doc["spec"] = spec.to_dict()

    def text() -> str:
        rows = [["bytes per token", f"{doc['bytes_per_token']:,}"],
                [f"block (chunk of {spec.chunk_tokens} tokens)", human(doc["block_bytes"])],
                ["KV per request", human(doc["kv_per_request_bytes"])],
                [f"KV per worker (x{args.concurrency} concurrent)", human(doc["kv_per_worker_bytes"])],
                [f"KV in total (x{args.workers} workers)", human(doc["kv_total_bytes"])],
                ["shared prefix, one copy", human(doc["prefix_kv_bytes"])],
                ["duplicate prefix bytes (upper bound)", human(doc["duplicate_prefix_bytes"])],
                ["removed by sharing (one copy kept)", human(doc["saved_by_sharing_bytes"])],
                ["KV in total, prefix shared", human(doc["kv_total_shared_bytes"])]]
        if "prefill_saved_ms_per_request" in doc:
            rows.append(["prefill saved per request", f"{doc['prefill_saved_ms_per_request']:.1f} ms"])
        rows += [["set hot_bytes (TieredCache)", human(doc["hot_bytes"])],
                 ["set /dev/shm size (2 x hot_bytes)", human(doc["shm_size_bytes"])]]
        return (f"{spec.model_id}: {spec.num_layers} layers x 2 x {spec.num_kv_heads} kv heads x "
                f"{spec.head_dim} x {spec.dtype_bytes} B\n" + _table(rows, ["", "size"]) +
                f"\n\nTieredCache(spec, hot_bytes={doc['hot_bytes']})   # {doc['hot_blocks']:,} blocks: the prefix "
                f"once + each concurrent request's own chunks\n"
                f"docker run --shm-size={doc['shm_size_bytes'] >> 20}m ...   # or a Kubernetes emptyDir "
                f"(medium: Memory) of sizeLimit {doc['shm_size_bytes'] >> 20}Mi; see docs/deploy.md")

    _emit(args, doc, text)
    return 0


# ---- ls / stats / rm / verify -------------------------------------------------------------------
def _matching(segments: list[dict], pattern: str | None) -> list[dict]:
    """Segments whose name (with or without the leading '/') matches the shell pattern ``--match``."""
    if not pattern:
        return segments
    return [d for d in segments if fnmatch.fnmatchcase(d["name"], pattern)
            or fnmatch.fnmatchcase(d["name"].lstrip("/"), pattern)]


def cmd_ls(args: argparse.Namespace) -> int:
    from tieredkv import numa
    from tieredkv.hot import admin

    if args.warm_dir and not os.path.isdir(args.warm_dir):
        raise UsageError(f"--warm-dir {args.warm_dir}: " + ("not a directory; give the warm tiers' root directory"
                                                            if os.path.exists(args.warm_dir) else "does not exist"))
    segments = _matching(admin.list_segments(), args.match)
    warm = []
    if args.warm_dir:
        from tieredkv.warm.admin import list_warm_tiers

        warm = list_warm_tiers(args.warm_dir)
    remote = _remote_namespaces(args.remote) if args.remote else None
    nodes = numa.nodes()
    from tieredkv.hot import segment as seg

    where, huge = seg.shm_dir(), seg.huge_page_policy()

    def text() -> str:
        rows = [[d["name"], d.get("model_id") or "-", human(d.get("size_bytes", 0)),
                 f"{d.get('ready_slots', 0)}/{d.get('n_slots', 0)}", d.get("hits", 0), d.get("misses", 0),
                 f"{100 * d.get('prefix_hit_rate', 0):.1f}%", d.get("live_handles", 0),
                 d.get("huge_pages", "-"), d["reason"] or ""] for d in segments]
        out = f"hot tier segments ({where}, huge pages: {huge}):\n" + (
            _table(rows, ["segment", "model", "size", "used/slots", "hits", "misses", "prefix hit", "handles",
                          "huge", "note"]) + "\n" + _LS_LEGEND if rows else "  none")
        if args.warm_dir:
            wrows = [[w.get("path"), w.get("model") or "-", human(w.get("size_bytes") or 0),
                      f"{w.get('blocks', 0)}/{w.get('capacity_blocks', 0)}", w.get("error") or ""] for w in warm]
            out += f"\nwarm tiers under {args.warm_dir}:\n" + (
                _table(wrows, ["path", "model", "size", "blocks/capacity", "note"]) if wrows else "  none")
        if remote is not None:
            out += "\n" + _remote_text(remote)
        if len(nodes) > 1:
            out += f"\nNUMA: {len(nodes)} nodes; use one segment per node (docs/tuning.md, NUMA)"
        return out

    doc = {"hot": segments, "warm": warm, "numa_nodes": {str(n): c for n, c in nodes.items()},
           "shm_dir": str(where), "huge_pages": huge}
    if remote is not None:
        doc["remote"] = remote
    _emit(args, doc, text)
    return 0


#: What the columns of ``tieredkv ls`` count (printed under the table).
_LS_LEGEND = ("  hits / misses: blocks the hot tier delivered / could not deliver to loads, over the segment's "
              "life;\n  prefix hit: prompt tokens served from cache / prompt tokens looked up; handles: "
              "processes that have it open; huge: whether its pages are huge pages (docs/tuning.md)")


def _remote_namespaces(url: str) -> dict:
    """The store's namespaces and numbers; a store that cannot list names still shows its numbers."""
    from tieredkv.errors import Unsupported
    from tieredkv.remote import admin

    try:
        return admin.namespaces(url)
    except InvalidInput as e:  # a bad URL
        raise UsageError(str(e)) from None
    except Unsupported as e:  # the store cannot enumerate its names (Mooncake)
        store, _ = admin.connect(url)
        try:
            return {"url": store.url, "server": store.info(), "namespaces": None, "note": str(e)}
        finally:
            store.close()


def _remote_text(doc: dict) -> str:
    server = doc["server"]
    facts = ", ".join(f"{k} {human(v) if k.endswith('_bytes') else v}" for k, v in server.items() if k != "url")
    out = f"remote store {doc['url']}: {facts}"
    if doc.get("namespaces") is None:
        return out + f"\n  ({doc.get('note', 'names not listed')})"
    rows = [[n["tag"], n["blocks"]] for n in doc["namespaces"]]
    return out + "\n" + (_table(rows, ["namespace tag", "blocks"]) if rows else "  no tieredkv blocks")


def _pick_segment(name: str | None) -> str:
    """The segment ``stats`` should show: ``name`` exactly, else the one segment whose name starts with
    ``name`` (``/`` and ``tieredkv-`` optional) or whose model id is ``name``; no name: the only one."""
    from tieredkv.hot import segment as seg

    names = seg.list_segment_names(published_only=True)
    if not name:
        if not names:  # nothing to show yet, not a mistake in the command: exit 1, like a missing NAME
            raise TieredKVError("no tieredkv segment on this host yet (a worker creates one when it opens a "
                                "TieredCache; `tieredkv ls` lists them, --watch waits for one)")
        if len(names) != 1:
            raise UsageError(f"{len(names)} segments exist; name one of: {', '.join(names)}")
        return names[0]
    bare = name.lstrip("/")
    if "/" + bare in names or os.path.exists(seg.shm_dir() / bare):
        return seg.check_name(name)
    found = [n for n in names if n[1:].startswith(bare) or n[1:].startswith(seg.PREFIX + bare)]
    if not found:
        from tieredkv.hot import admin

        found = [n for n in names if admin.inspect(n).get("model_id") == name]
    if len(found) == 1:
        return found[0]
    if found:
        raise UsageError(f"{name!r} matches {len(found)} segments ({', '.join(found)}); give more of the name")
    raise TieredKVError(f"no segment named {name!r}, starting with it, or caching model {name!r}; "
                     f"segments (`tieredkv ls` describes them): {', '.join(names) or 'none'}")


def _quantile_bound(hist: list[int], q: float) -> float | None:
    """Upper bound (seconds) of the histogram bucket holding the ``q`` quantile; None when empty."""
    from tieredkv.counters import LATENCY_BUCKETS_S

    total = sum(hist)
    if not total:
        return None
    seen = 0
    for bound, n in zip(LATENCY_BUCKETS_S, hist):
        seen += n
        if seen >= q * total:
            return bound
    return LATENCY_BUCKETS_S[-1]


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return "> 2.5 s"
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:g} ms"


def _interval(doc: dict, prev: dict | None, seconds: float | None) -> dict | None:
    """Counter deltas since ``prev`` (an earlier inspect of the same segment), with the interval's hit rate."""
    if prev is None or prev.get("cache") is None:
        return None
    c, p = doc["cache"], prev["cache"]
    d = {k: c[k] - p[k] for k in ("lookups", "prompt_tokens", "hit_tokens", "hot_hit_tokens", "warm_hit_tokens",
                                  "prefill_tokens", "promotions", "demotions", "lost_blocks")}
    d["evictions"] = doc["counters"]["evictions"] - prev["counters"]["evictions"]
    d["prefix_hit_rate"] = d["hit_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] > 0 else None
    d["seconds"] = seconds
    if d["lookups"] < 0:  # the segment was recreated meanwhile: its counters restarted
        return None
    return d


def _stats_text(name: str, doc: dict, delta: dict | None) -> str:
    c, k = doc["cache"], doc["counters"]
    lookups = max(c["lookups"], 1)
    lines = [f"{name}  ({doc['model_id']}, policy {doc['policy']}, {doc['live_handles']} handles)",
             f"  {'PREFIX HIT RATE':<17}{100 * doc['prefix_hit_rate']:5.1f}%   "
             f"({c['hit_tokens']:,} of {c['prompt_tokens']:,} prompt tokens served from cache)"]
    if delta is not None:
        rate = "    - " if delta["prefix_hit_rate"] is None else f"{100 * delta['prefix_hit_rate']:5.1f}%"
        last = f"last {round(delta['seconds'], 1):g} s"
        lines.append(f"  {last:<17}{rate}   ({delta['hit_tokens']:,} of "
                     f"{delta['prompt_tokens']:,} prompt tokens; {delta['lookups']:,} lookups, "
                     f"{delta['evictions']:,} evicted, {delta['promotions']:,} promoted, "
                     f"{delta['demotions']:,} demoted)")
    lines += [f"  tokens: hot hits {c['hot_hit_tokens']:,}  warm hits {c['warm_hit_tokens']:,}  "
              f"prefilled {c['prefill_tokens']:,}",
              f"  lookups {c['lookups']:,} (mean {c['lookup_ns'] / lookups / 1e3:.1f} us, "
              f"p99 <= {_fmt_s(_quantile_bound(doc['lookup_hist'], 0.99))})  "
              f"loads {sum(doc['load_hist']):,} (mean {c['load_ns'] / max(sum(doc['load_hist']), 1) / 1e6:.2f} ms, "
              f"p99 <= {_fmt_s(_quantile_bound(doc['load_hist'], 0.99))})",
              f"  blocks: {doc['ready_slots']:,}/{doc['n_slots']:,} used, {k['evictions']:,} evicted, "
              f"{c['promotions']:,} promoted, {c['demotions']:,} demoted, {c['lost_blocks']:,} lost "
              f"({c['corrupt_blocks']:,} of them corrupt)",
              f"  bytes: hot read {human(c['hot_bytes_read'])}, warm read {human(c['warm_bytes_read'])}, "
              f"hot written {human(c['hot_bytes_written'])}, warm written {human(c['warm_bytes_written'])}",
              f"  recoveries {k['recoveries']} (scrubs {doc['scrubs']}), reclaimed slots {k['reclaimed']}, "
              f"torn reads {k['torn_reads']}, warm errors {c['warm_errors']}",
              f"  write-behind to warm: {c['warm_queued_blocks']:,} blocks queued, "
              f"{c['warm_dropped_blocks']:,} dropped (queue full)"]
    if any(c.get(f, 0) for f in ("remote_hit_tokens", "remote_misses", "remote_errors", "remote_drops",
                                 "remote_bytes_written")):
        lines.append(f"  remote: hit tokens {c['remote_hit_tokens']:,}, misses {c['remote_misses']:,}, errors "
                     f"{c['remote_errors']:,}, dropped writes {c['remote_drops']:,} blocks, refused values "
                     f"{c['remote_corrupt']:,}; read {human(c['remote_bytes_read'])}, written "
                     f"{human(c['remote_bytes_written'])}")
    return "\n".join(lines)


def _wait_for_segment(args: argparse.Namespace) -> str:
    """``_pick_segment``; with --watch, a segment that does not exist yet is waited for (a watcher
    started before the workers), saying so once on stderr."""
    waiting = False
    while True:
        try:
            return _pick_segment(args.name)
        except UsageError:
            raise
        except TieredKVError as e:
            if not args.watch:
                raise
            if not waiting:
                print(f"tieredkv stats: {e}; waiting for it (Ctrl-C stops)", file=sys.stderr, flush=True)
                waiting = True
            time.sleep(args.watch)


def cmd_stats(args: argparse.Namespace) -> int:
    from tieredkv.hot import admin

    if args.count is not None and args.count < 1:
        raise UsageError("--count must be >= 1")
    if args.watch is not None and not args.watch > 0:
        raise UsageError(f"--watch SECONDS must be > 0, got {args.watch:g}")
    if args.prometheus is not None and not 0 <= args.prometheus <= 65535:
        raise UsageError(f"--prometheus PORT must be in 0..65535 (0: any free port), got {args.prometheus}")
    if args.warm_dir and not os.path.isdir(args.warm_dir):
        raise UsageError(f"--warm-dir {args.warm_dir}: not a directory")
    if args.remote:
        if args.name or args.watch or args.prometheus is not None:
            raise UsageError("--remote shows the store's own numbers; give it without a NAME, --watch or --prometheus")
        doc = _remote_namespaces(args.remote)
        _emit(args, doc, lambda: _remote_text(doc))
        return 0
    if args.prometheus is not None:
        from tieredkv import metrics

        names = [_pick_segment(args.name)] if args.name else None
        server = metrics.serve_metrics(args.prometheus, names, warm_dir=args.warm_dir, addr=args.addr)
        host = args.addr if args.addr != "0.0.0.0" else "localhost"
        announce = (f"serving Prometheus metrics on http://{host}:{server.server_port}/metrics "
                    f"({args.name or 'every segment'}); Ctrl-C stops")
        if args.watch:
            print(announce, flush=True)
        else:
            try:  # the announcement inside: a Ctrl-C right after it is a clean stop too
                print(announce, flush=True)
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                return 0
            finally:
                server.shutdown()
                server.server_close()
    name = _wait_for_segment(args)
    prev, prev_t, shown = None, None, 0
    watching_json = bool(args.watch) and args.json == "-"
    while True:
        doc = admin.inspect(name)
        now = time.monotonic()
        if doc.get("error"):
            print(f"tieredkv stats: {name}: {doc['error']}", file=sys.stderr)
            return 1
        doc["interval"] = _interval(doc, prev, None if prev_t is None else round(now - prev_t, 3))
        if watching_json:  # one JSON document per line, per refresh
            print(json.dumps(doc, default=str), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[J", end="")  # clear the screen between refreshes
            _emit(args, doc, functools.partial(_stats_text, name, doc, doc["interval"]))
        shown += 1
        if not args.watch or (args.count is not None and shown >= args.count):
            return 0
        prev, prev_t = doc, now
        sys.stdout.flush()
        time.sleep(args.watch)
        if not sys.stdout.isatty() and not watching_json:
            print()


def cmd_rm(args: argparse.Namespace) -> int:
    from tieredkv.hot import admin

    if bool(args.names) == bool(args.stale):
        raise UsageError("give segment NAMEs or --stale (not both)")
    if args.idle and not args.stale:
        raise UsageError("--idle goes with --stale")
    verb = "would remove" if args.dry_run else "removed"
    if args.stale:
        import posix_ipc

        gone, failed = [], []
        for d in _matching(admin.list_segments(), args.match):
            wanted = d["stale"] or (args.idle and d["idle"])
            if not wanted:
                continue
            if args.dry_run:
                gone.append({"name": d["name"], "reason": d["reason"]})
                continue
            try:
                # Judged again under the segment's lock: it may have come to life since the listing.
                reason = admin.remove_if_stale(d["name"], idle=args.idle)
            except (OSError, posix_ipc.Error, TieredKVError) as e:  # one odd entry must not stop the others
                failed.append(d["name"])
                print(f"tieredkv rm: {d['name']}: {e}", file=sys.stderr)
                continue
            if reason is not None:
                _remove_journal(d["name"])
                gone.append({"name": d["name"], "reason": reason})
        _emit(args, {"removed": gone, "missing": [], "failed": failed, "dry_run": args.dry_run},
              lambda: "\n".join(f"{verb} {d['name']}: {d['reason']}" for d in gone) or "no stale segments")
        return 1 if failed else 0
    import posix_ipc

    from tieredkv.hot import segment as seg

    removed, missing, refused = [], [], []
    for name in args.names:
        name = seg.check_name(name)
        try:
            if args.dry_run:
                admin.check_ours(name)
            else:
                admin.remove(name)
                _remove_journal(name)
            removed.append({"name": name, "reason": "named"})
        except (posix_ipc.ExistentialError, FileNotFoundError):
            missing.append(name)
        except (OSError, posix_ipc.Error, TieredKVError) as e:  # one name must not stop (or hide) the others
            refused.append(name)
            print(f"tieredkv rm: {name}: {e}", file=sys.stderr)
    for name in missing:
        print(f"tieredkv rm: no segment {name}", file=sys.stderr)
    _emit(args, {"removed": removed, "missing": missing, "failed": refused, "dry_run": args.dry_run},
          lambda: "\n".join(f"{verb} {d['name']}" for d in removed))
    return 1 if missing or refused else 0


def _remove_journal(segment_name: str) -> None:
    """Remove the host journal files of a segment just removed (``tieredkv.journal``), if it had any: a
    process that opens the namespace again starts a new journal, and readers keep what they opened."""
    from tieredkv import journal

    try:
        journal.remove(journal.journal_path(segment_name))
    except OSError as e:
        print(f"tieredkv rm: {segment_name}: its journal stays: {e}", file=sys.stderr)


def cmd_verify(args: argparse.Namespace) -> int:
    from tieredkv.warm.admin import verify

    if bool(args.directory) == bool(args.remote):
        raise UsageError("give a warm tier DIRECTORY or --remote URL (one of them)")
    if args.remote:
        return _verify_remote(args)
    if args.repair and not os.path.exists(args.directory):
        return _nothing_to_verify(args, "does not exist yet")
    if not os.path.lexists(args.directory):
        # No warm tier there (exit 1, as for an empty directory): exit 2 is for damage.
        print(f"tieredkv verify: no warm tier at {args.directory} (it does not exist)", file=sys.stderr)
        return 1
    if not os.path.isdir(args.directory):
        raise UsageError(f"{args.directory} is not a directory")
    report = verify(args.directory, repair=args.repair)
    tiers = report.get("tiers", [report])
    if args.repair and not tiers:
        return _nothing_to_verify(args, "holds no warm tier yet")

    def text() -> str:
        lines = []
        for t in tiers:
            bad_slabs = [f"{s['name']} {s['status']}" for s in t.get("slabs", []) if s["status"] != "ok"]
            line = (f"{t['path']}: {t['blocks_checked']:,} blocks checked, {len(t['bad_blocks']):,} bad"
                    + (f", {t['dead_claims']} dead claims" if t["dead_claims"] else "")
                    + (f", {t['lost_slots']} lost slots" if t.get("lost_slots") else "")
                    + (f", slabs: {'; '.join(bad_slabs)}" if bad_slabs else "")
                    + (f", meta.json {t['meta']}" if t["meta"] != "ok" else "")
                    + (f", index {t['index']}" if t.get("index", "ok") != "ok" else "")
                    + (f", {t['removed']:,} dropped" if args.repair else "")
                    + (f", error: {t['error']}" if t.get("error") else "")
                    + ("" if t["ok"] else "  <-- damaged, repaired" if args.repair and t["repaired"]
                       and not t.get("error") else "  <-- DAMAGED"))
            lines.append(line)
            for b in t["bad_blocks"][:10]:
                lines.append(f"    slab {b['slab']} slot {b['slot']} key {b['key']}: {b['reason']}")
            if len(t["bad_blocks"]) > 10:
                lines.append(f"    ... {len(t['bad_blocks']) - 10} more (all of them in --json)")
        return "\n".join(lines) or f"no warm tier under {args.directory}"

    _emit(args, report, text)
    if not tiers:
        print(f"tieredkv verify: no warm tier under {args.directory}", file=sys.stderr)
        return 1  # a typo in the path must not pass as "nothing damaged"
    if args.repair:
        # Damage found and repaired is a success: `verify --repair && start-workers` must work.
        return 0 if all(t["repaired"] and not t.get("error") for t in tiers) else 2
    return 0 if report.get("ok", True) else 2


def _nothing_to_verify(args: argparse.Namespace, why: str) -> int:
    """``verify --repair`` of a new host's warm directory: a success, so that the pre-start check
    (``verify --repair DIR && start-workers``, systemd's ``Requires=``) lets the first workers start;
    they create the tier. A plain ``verify`` of such a path stays an error (a typo is no clean scrub)."""
    note = f"{args.directory} {why}: nothing to check (the workers create the warm tier there)"
    _emit(args, {"ok": True, "tiers": [], "note": note}, lambda: note)
    return 0


def _verify_remote(args: argparse.Namespace) -> int:
    from tieredkv.errors import Unsupported
    from tieredkv.remote import admin

    try:
        report = admin.verify(args.remote, repair=args.repair)
    except (InvalidInput, Unsupported) as e:  # a bad URL; a store that cannot list what to verify
        raise UsageError(str(e)) from None

    def text() -> str:
        lines = [f"{report['url']}: {report['checked']:,} values checked, {len(report['bad']):,} bad"
                 + (f", {report['removed']:,} removed" if args.repair else "")
                 + ("" if report["ok"] else "  <-- DAMAGED")]
        lines += [f"    {b['name']}: {b['reason']}" for b in report["bad"][:10]]
        if len(report["bad"]) > 10:
            lines.append(f"    ... {len(report['bad']) - 10} more (all of them in --json)")
        return "\n".join(lines)

    _emit(args, report, text)
    if args.repair:  # every bad value deleted is a success, as for a warm tier
        return 0 if report["removed"] == len(report["bad"]) else 2
    return 0 if report["ok"] else 2


# ---- simulate / demo / bench -------------------------------------------------------------------
def _delegate(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    """Run a command whose module writes ``--json`` to a file; make ``--json -`` mean stdout as elsewhere.

    With ``--json -`` the command writes its JSON into a temporary file and its text goes to stderr, so
    standard output carries only the JSON document.
    """
    if args.json != "-":
        return run(args)
    fd, tmp = tempfile.mkstemp(prefix="tieredkv-", suffix=".json")
    os.close(fd)
    try:
        args.json = tmp
        with contextlib.redirect_stdout(sys.stderr):
            status = run(args)
        text = Path(tmp).read_text()
        if text.strip():
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return status
    finally:
        args.json = "-"
        os.unlink(tmp)


def cmd_simulate(args: argparse.Namespace) -> int:
    from tieredkv.sim import cli as sim_cli

    return _delegate(args, sim_cli.main)


def cmd_demo(args: argparse.Namespace) -> int:
    from tieredkv import demo

    return demo.main(args)  # `--json -`: the demo prints the JSON alone (progress goes to stderr)


_BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmarks() -> list[str]:
    """Benchmark scripts of a source checkout (empty in an installed package)."""
    return sorted(p.stem for p in _BENCH_DIR.glob("*.py") if not p.name.startswith("_"))


def cmd_bench(args: argparse.Namespace) -> int:
    available = _benchmarks()
    if args.name not in available:
        raise UsageError(f"no benchmark {args.name!r}; " + (f"choose one of: {', '.join(available)}" if available
                         else f"benchmarks run from a source checkout ({_BENCH_DIR} is missing)"))
    script = _BENCH_DIR / f"{args.name}.py"

    def run(a: argparse.Namespace) -> int:
        argv = sys.argv
        sys.argv = [str(script), *a.rest] + (["--json", a.json] if a.json else [])
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:  # a benchmark's own exit (argparse errors included)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = argv
        return 0

    return _delegate(args, run)


# ---- the parser ---------------------------------------------------------------------------------
#: Examples shown at the end of each command's --help (the tests check that every command has one).
EXAMPLES = {
    "demo": ["tieredkv demo --workers 8 --requests-per-worker 4 --json demo.json --plot demo.png",
             "tieredkv demo --workers 2 --prefix-tokens 512 --configs no_cache,shared    # a quick run"],
    "estimate": ["tieredkv estimate --layers 28 --kv-heads 2 --head-dim 128 --prefix-tokens 4096 "
                 "--concurrency 4 --workers 8",
                 "tieredkv estimate --config path/to/config.json --prefix-tokens 2048 --prompt-tokens 3000 --json -"],
    "ls": ["tieredkv ls", "tieredkv ls --warm-dir /var/cache/tieredkv --json -",
           "tieredkv ls --remote valkey://10.0.0.5:6379"],
    "stats": ["tieredkv stats --watch 2                  # the only segment, refreshed every 2 s",
              "tieredkv stats /tieredkv-NAME --json -",
              "tieredkv stats --prometheus 9400 --addr 0.0.0.0 --warm-dir /var/cache/tieredkv",
              "tieredkv stats --remote valkey://10.0.0.5:6379    # the shared store's own numbers"],
    "rm": ["tieredkv rm --stale --dry-run", "tieredkv rm --stale --idle", "tieredkv rm /tieredkv-NAME",
           "tieredkv rm --stale --match '/tieredkv-test-*'"],
    "verify": ["tieredkv verify /var/cache/tieredkv", "tieredkv verify /var/cache/tieredkv --repair --json report.json",
               "tieredkv verify --remote valkey://10.0.0.5:6379 --repair"],
    "simulate": ["tieredkv simulate --trace mooncake.jsonl --policy lru,s3fifo --capacity 1000,5% --plot mrc.png",
                 "tieredkv simulate --synthetic 20000 --policy lru,arc --hot 5% --warm 20% --json -"],
    "bench": ["tieredkv bench hot_tier -- --quick", "tieredkv bench --json warm.json warm_tier -- --quick"],
}

_EXIT_CODES = "exit status: 0 ok, 1 failed (see the message), 2 bad usage or damage found"


def _add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", metavar="OUT",
                   help=f"also write {what} as JSON to OUT; '-': only the JSON, on standard output")


def build_parser() -> argparse.ArgumentParser:
    """The ``tieredkv`` argument parser, one subparser per command (each with ``--json`` and examples)."""
    parser = argparse.ArgumentParser(
        prog="tieredkv", description="Share the KV cache of common prompt prefixes across worker processes "
        "(shared memory) and keep it across restarts (SSD).",
        epilog="Run `tieredkv COMMAND --help` for a command's options and examples.\n"
               "example:\n  tieredkv ls\n" + _EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_: str, more: str = "") -> argparse.ArgumentParser:
        lines = "\n".join(f"  {e}" for e in EXAMPLES[name])
        p = sub.add_parser(name, help=help_, description=help_ + (f"\n\n{more}" if more else ""),
                           epilog=f"examples:\n{lines}\n\n{_EXIT_CODES}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    from tieredkv import demo
    from tieredkv.sim import cli as sim_cli

    # demo and simulate own their flags (tieredkv/demo.py, tieredkv/sim/cli.py), --json included.
    demo.add_arguments(add("demo", cmd_demo, "the multi-worker serving demo: no cache vs private vs shared vs "
                                             "restart, on an embedded model (or --model)"))
    sim_cli.add_arguments(add("simulate", cmd_simulate, "replay a block trace through eviction policies "
                                                         "(block and prefix hit ratios, miss-ratio curves)"))

    p = add("estimate", cmd_estimate, "size the KV cache and what sharing a prefix saves",
            "bytes per token = layers x 2 (K,V) x kv heads x head dim x dtype bytes; the duplicate prefix bytes\n"
            "(upper bound) = prefix tokens x concurrent requests (concurrency x workers) x bytes per token.")
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
    _add_json(p, "the sizes")

    p = add("ls", cmd_ls, "list hot-tier segments (and warm tiers with --warm-dir)")
    p.add_argument("--warm-dir", help="also list the warm tiers under this directory")
    p.add_argument("--match", metavar="PATTERN", help="only segments whose name matches this shell pattern")
    p.add_argument("--remote", metavar="URL", help="also list what a remote store holds, per namespace "
                                                   "(valkey://host:port; a mooncake:// store shows its numbers only)")
    _add_json(p, "every segment's description")

    p = add("stats", cmd_stats, "counters of a segment, prefix hit rate first (live with --watch, or for "
                                "Prometheus with --prometheus)",
            "Counters are per host: every process's handle keeps its row in the segment and the rows are summed.\n"
            "With --watch, each refresh also shows the last interval (hit rate, lookups, evictions...).\n"
            "No segment yet (no worker has opened a TieredCache): exit 1; with --watch it waits for one.")
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="segment name (default: the only one; with --prometheus: every segment)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--prometheus", type=int, metavar="PORT",
                   help="serve Prometheus metrics on PORT (0: any free port) until Ctrl-C; needs the "
                        "'metrics' extra")
    p.add_argument("--addr", default="127.0.0.1",
                   help="with --prometheus: address to bind (default 127.0.0.1; 0.0.0.0: every interface)")
    p.add_argument("--warm-dir", help="with --prometheus: also expose the usage of the warm tiers under this "
                                      "directory")
    p.add_argument("--remote", metavar="URL", help="instead of a segment: the remote store's own numbers and "
                                                   "blocks per namespace")
    _add_json(p, "the counters (with --watch: '-' prints one JSON document per line and refresh)")

    p = add("rm", cmd_rm, "remove segments by name, or the stale ones",
            "Stale: no process has it open and it is dead: another layout version, damaged or not ours, or\n"
            "a leftover of a creator that died. A segment with a live handle is never stale. Idle (no process\n"
            "has it open, but usable: workers between restarts) goes only with --idle, since its blocks are\n"
            "lost when removed. Processes that map a removed segment keep their mapping until they close it.")
    p.add_argument("names", nargs="*", metavar="NAME", help="segment names, e.g. /tieredkv-...")
    p.add_argument("--stale", action="store_true",
                   help="remove segments of another layout version, damaged ones and a dead creator's leftovers")
    p.add_argument("--idle", action="store_true",
                   help="with --stale: also remove usable segments that no process has open right now")
    p.add_argument("--match", metavar="PATTERN", help="with --stale: only segments whose name matches this "
                                                      "shell pattern")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed")
    _add_json(p, "what was removed")

    p = add("verify", cmd_verify, "check every checksum of a warm tier or a remote store (exit 2 if damaged, 1 if "
            "no tier; with --repair 0 once repaired)",
            "Safe while workers use the tier. --repair drops bad blocks from the index, reaps dead writers'\n"
            "claims, restores slab sizes and rewrites a damaged meta.json (see docs/warm-tier.md).\n"
            "With --remote URL: fetch every tieredkv value of the store and check its framing, checksum,\n"
            "namespace and key against its name; --repair deletes the bad ones (see docs/fleet.md).")
    p.add_argument("directory", nargs="?", help="a warm tier directory, or a root holding several")
    p.add_argument("--remote", metavar="URL", help="check a remote store instead (valkey://host:port)")
    p.add_argument("--repair", action="store_true", help="drop the bad blocks from the index (or the store)")
    _add_json(p, "the full report (every bad block)")

    p = add("bench", cmd_bench, "run a benchmark from benchmarks/ (source checkout)",
            "Benchmarks: " + (", ".join(_benchmarks()) or "(none: not a source checkout)") +
            ". Their own options go after --.")
    p.add_argument("name", metavar="NAME", help="the benchmark (a script in benchmarks/)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options, after --")
    _add_json(p, "the benchmark's results (passed to it)")
    return parser


def _check_output(flag: str, path: str | None) -> None:
    """Refuse an output path that cannot be written before any work is done."""
    if not path or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name, e.g. {p / 'out.json'}")
    if not p.parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {p.parent} does not exist; create it first")


def main(argv: list[str] | None = None) -> int:
    """Run the ``tieredkv`` command with ``argv`` (default: ``sys.argv[1:]``). Returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "rest", None) and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    try:
        _check_output("--json", getattr(args, "json", None))
        _check_output("--plot", getattr(args, "plot", None))
        return args.func(args) or 0
    except UsageError as e:
        print(f"tieredkv {args.command}: {e}", file=sys.stderr)
        return 2
    except TieredKVError as e:  # the command could not do its job (a missing or damaged segment...)
        print(f"tieredkv {args.command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the system refused (a file that cannot be written, a full disk...)
        where = f": {e.filename}" if e.filename else ""
        print(f"tieredkv {args.command}: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
