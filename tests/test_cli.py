"""The tieredkv command: every subcommand's output, exit status, --json and --help."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for
from tieredkv import KVSpec, TieredCache, cli
from tieredkv.hot import admin
from tieredkv.hot import segment as seg

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
SEED_GEOMETRY = ["--layers", "28", "--kv-heads", "2", "--head-dim", "128", "--dtype", "float16"]


@pytest.fixture
def spec():
    return KVSpec(model_id="test/cli", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)


@pytest.fixture
def names():
    """A unique name prefix for this test's segments; every segment under it is unlinked afterwards."""
    prefix = f"/tieredkv-test-cli-{os.getpid()}-{secrets.token_hex(3)}"
    yield prefix
    for name in os.listdir("/dev/shm"):
        if ("/" + name).startswith(prefix):
            try:
                posix_ipc.unlink_shared_memory("/" + name)
            except posix_ipc.ExistentialError:
                pass


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``tieredkv ARGV`` in this process: (exit status, stdout, stderr)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def traffic(cache: TieredCache, spec: KVSpec) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 30_000, 17), rng.integers(0, 30_000, 9)
    cache.store(a, kv_for(spec, a))
    for p in (a, b):
        cache.load(cache.lookup(p), np.zeros((2, 2, 2, len(p), 8), np.float16))


# ---- estimate -------------------------------------------------------------------------------------
def test_estimate_seed_geometry(capsys, tmp_path):
    out_file = tmp_path / "est.json"
    status, out, _ = run(capsys, "estimate", *SEED_GEOMETRY, "--prefix-tokens", "4096", "--concurrency", "4",
                         "--workers", "8", "--json", str(out_file))
    assert status == 0
    doc = json.loads(out_file.read_text())
    assert doc["bytes_per_token"] == 28 * 2 * 2 * 128 * 2 == 28_672
    assert doc["concurrent_requests"] == 32
    assert doc["duplicate_prefix_bytes"] == 4096 * 32 * 28_672 == int(3.5 * GiB)
    assert doc["saved_by_sharing_bytes"] == 4096 * 31 * 28_672
    assert "28,672" in out
    assert "duplicate prefix bytes (upper bound)    3.50 GiB" in out


@pytest.mark.procs
def test_estimate_through_python_m_with_json_on_stdout():
    proc = subprocess.run([sys.executable, "-m", "tieredkv", "estimate", *SEED_GEOMETRY, "--prefix-tokens", "4096",
                           "--prompt-tokens", "5000", "--prefill-ms-per-token", "0.5", "--json", "-"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # nothing but the JSON on stdout
    assert doc["kv_per_request_bytes"] == 5000 * 28_672
    assert doc["prefill_saved_ms_per_request"] == 2048.0
    assert doc["spec"]["num_layers"] == 28


@pytest.mark.parametrize("argv,message", [
    (["--layers", "28", "--prefix-tokens", "10"], "--kv-heads, --head-dim"),
    ([*SEED_GEOMETRY, "--prefix-tokens", "10", "--workers", "0"], "workers must be positive"),
    ([*SEED_GEOMETRY, "--prefix-tokens", "10", "--prompt-tokens", "5"], "cannot exceed"),
])
def test_estimate_bad_input_is_a_usage_error(capsys, argv, message):
    status, out, err = run(capsys, "estimate", *argv)
    assert status == 2
    assert message in err and err.startswith("tieredkv estimate: ")
    assert "Traceback" not in err


# ---- ls / stats --------------------------------------------------------------------------------------
def test_ls_lists_the_segment(capsys, spec, names):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-a") as cache:
        traffic(cache, spec)
        status, out, _ = run(capsys, "ls", "--match", names + "*", "--json", "-")
        assert status == 0
        doc = json.loads(out)
        [seg] = doc["hot"]
        assert seg["name"] == names + "-a"
        assert seg["model_id"] == "test/cli"
        assert seg["live_handles"] == 1 and not seg["stale"]
        assert seg["ready_slots"] == 4
        assert seg["prefix_hit_rate"] == pytest.approx(16 / 26)
        assert "numa_nodes" in doc
        status, out, _ = run(capsys, "ls", "--match", names + "*")
        row = next(line for line in out.splitlines() if line.startswith(names + "-a"))
        assert "test/cli" in row and "61.5%" in row and "4/" in row


def test_ls_with_warm_dir(capsys, spec, names, tmp_path):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-w", warm_dir=tmp_path, warm_bytes=4 * MiB,
                     demotion="write_through") as cache:
        traffic(cache, spec)
        status, out, _ = run(capsys, "ls", "--match", names + "*", "--warm-dir", str(tmp_path), "--json", "-")
    assert status == 0
    [warm] = json.loads(out)["warm"]
    assert warm["blocks"] == 4 and warm["model"] == "test/cli"


def test_stats_matches_the_cache_and_puts_the_hit_rate_first(capsys, spec, names):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-s") as cache:
        traffic(cache, spec)
        st = cache.stats()
        status, out, _ = run(capsys, "stats", names + "-s", "--json", "-")
        assert status == 0
        doc = json.loads(out)
        assert doc["cache"]["lookups"] == st["lookups"] == 2
        assert doc["cache"]["hit_tokens"] == st["hit_tokens"] == 16
        assert doc["prefix_hit_rate"] == pytest.approx(st["prefix_hit_rate"])
        status, out, _ = run(capsys, "stats", names + "-s")
        lines = out.splitlines()
        assert lines[0].startswith(names + "-s  (test/cli, policy lru, 1 handles)")
        assert lines[1].split()[:4] == ["PREFIX", "HIT", "RATE", "61.5%"]
        assert "(16 of 26 prompt tokens served from cache)" in lines[1]


def test_stats_watch_prints_json_lines_with_interval_deltas(capsys, spec, names):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-j") as cache:
        traffic(cache, spec)
        status, out, _ = run(capsys, "stats", names + "-j", "--watch", "0.01", "--count", "3", "--json", "-")
    assert status == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert len(docs) == 3
    assert docs[0]["interval"] is None
    assert docs[2]["interval"]["lookups"] == 0            # no traffic between refreshes
    assert docs[2]["interval"]["prefix_hit_rate"] is None  # nothing looked up: no rate, not 0%


def test_interval_deltas(spec, names):
    """What `stats --watch` shows for the last interval: the counters' differences and their hit rate."""
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-d") as cache:
        traffic(cache, spec)
        before = admin.inspect(names + "-d")
        tokens = np.random.default_rng(0).integers(0, 30_000, 17)   # the stored prompt: 16 of 17 cached
        cache.lookup(tokens)
        after = admin.inspect(names + "-d")
    d = cli._interval(after, before, 2.0)
    assert (d["lookups"], d["prompt_tokens"], d["hit_tokens"], d["seconds"]) == (1, 17, 16, 2.0)
    assert d["prefix_hit_rate"] == pytest.approx(16 / 17)
    text = cli._stats_text(names + "-d", after, d)
    lines = text.splitlines()
    assert lines[1].startswith("  PREFIX HIT RATE   74.4%")          # lifetime first, interval under it
    assert lines[2].startswith("  last 2 s          94.1%   (16 of 17 prompt tokens; 1 lookups")


def test_stats_without_a_name_needs_exactly_one_segment(capsys, monkeypatch):
    from tieredkv.hot import segment as seg

    monkeypatch.setattr(seg, "list_segment_names", lambda **_: ["/tieredkv-a", "/tieredkv-b"])
    status, _, err = run(capsys, "stats")
    assert status == 2 and "2 segments exist; name one of: /tieredkv-a, /tieredkv-b" in err


def test_stats_of_a_missing_segment(capsys, names):
    status, _, err = run(capsys, "stats", names + "-none")
    assert status == 1 and "no segment named" in err and "Errno" not in err


@pytest.mark.procs
def test_stats_prometheus_serves_until_interrupted(spec, names):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-p") as cache:
        traffic(cache, spec)
        proc = subprocess.Popen([sys.executable, "-m", "tieredkv", "stats", names + "-p", "--prometheus", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            first = proc.stdout.readline()
            assert first.startswith("serving Prometheus metrics on http://127.0.0.1:"), proc.stderr.read()
            url = first.split()[4]
            with urllib.request.urlopen(url, timeout=30) as r:
                body = r.read().decode()
            assert f'tieredkv_prefix_hit_rate{{model="test/cli",segment="{names}-p"}} 0.615' in body
            assert f'tieredkv_lookups_total{{model="test/cli",segment="{names}-p"}} 2.0' in body
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()


# ---- rm ---------------------------------------------------------------------------------------------
def _foreign(name: str) -> None:
    """A file in /dev/shm under our prefix that is not a tieredkv segment (wrong magic)."""
    with open(f"/dev/shm{name}", "wb") as f:
        f.write(b"\x01" * 8192)


def test_rm_names(capsys, spec, names):
    TieredCache(spec, hot_bytes=MiB, hot_name=names + "-x").close()
    status, out, _ = run(capsys, "rm", names + "-x", "--dry-run")
    assert status == 0 and out.strip() == f"would remove {names}-x"
    assert os.path.exists(f"/dev/shm{names}-x")
    status, out, _ = run(capsys, "rm", names + "-x", "--json", "-")
    assert status == 0
    assert json.loads(out)["removed"] == [{"name": names + "-x", "reason": "named"}]
    assert not os.path.exists(f"/dev/shm{names}-x")
    status, _, err = run(capsys, "rm", names + "-x")
    assert status == 1 and f"no segment {names}-x" in err


@pytest.mark.procs
def test_rm_stale_removes_foreign_and_dead_leftovers_and_idle_ones_only_with_idle(capsys, spec, names):
    _foreign(names + "-foreign")
    TieredCache(spec, hot_bytes=MiB, hot_name=names + "-closed").close()      # no process has it open
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()                                                               # a pid that is dead now
    leftover = f"/tieredkv-tmp-{child.pid}-{secrets.token_hex(4)}"  # the format seg.temp_name writes
    assert seg.temp_owner(leftover) == child.pid
    try:
        with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-live"):
            _foreign(leftover)  # after the creation above, which would have reaped it
            status, out, _ = run(capsys, "rm", "--stale", "--match", names + "*", "--dry-run", "--json", "-")
            assert status == 0
            doc = json.loads(out)
            assert doc["dry_run"] is True
            assert {d["name"] for d in doc["removed"]} == {names + "-foreign"}  # idle between restarts: kept
            assert os.path.exists(f"/dev/shm{names}-foreign")
            status, out, _ = run(capsys, "rm", "--stale", "--match", names + "*")
            assert status == 0
            assert out.strip().startswith(f"removed {names}-foreign: unusable")
            status, out, _ = run(capsys, "rm", "--stale", "--idle", "--match", names + "*")
            assert status == 0
            assert out.strip() == f"removed {names}-closed: no process has it open"
            assert sorted(n for n in os.listdir("/dev/shm") if ("/" + n).startswith(names)) == \
                [names.lstrip("/") + "-live"]
            # Any segment creation on the host reaps a dead creator's leftover too (another process's
            # between our _foreign and rm): then make it again, a few times.
            for _ in range(5):
                status, out, _ = run(capsys, "rm", "--stale", "--match", leftover)
                if out.strip() != "no stale segments":
                    break
                _foreign(leftover)
            assert status == 0 and out.strip() == f"removed {leftover}: leftover of a creator that died"
            assert not os.path.exists(f"/dev/shm{leftover}")
    finally:
        if os.path.exists(f"/dev/shm{leftover}"):
            os.unlink(f"/dev/shm{leftover}")


def test_rm_removes_only_what_is_tieredkvs_and_reports_every_name(capsys, spec, names, tmp_path):
    """``rm NAME`` removed any file of the segment directory (another program's shared memory: "removed",
    exit 0), and stopped at the first name it could not unlink with a bare traceback, the names removed
    before it unreported and those after it never tried."""
    foreign = "/audit-" + names.split("-", 2)[-1]  # another program's name: no tieredkv- prefix, no header
    with open(f"/dev/shm{foreign}", "wb") as f:
        f.write(b"\x00" * 4096)
    try:
        status, _, err = run(capsys, "rm", foreign)
        assert status == 1 and "not a tieredkv segment" in err and os.path.exists(f"/dev/shm{foreign}")
        status, _, err = run(capsys, "rm", foreign, "--dry-run")
        assert status == 1 and "would not be removed" in err
    finally:
        os.unlink(f"/dev/shm{foreign}")
    # A custom-named segment carries tieredkv's header: it is removed.
    TieredCache(spec, hot_bytes=MiB, hot_name="/custom-" + names.split("-", 2)[-1]).close()
    status, _, _ = run(capsys, "rm", "/custom-" + names.split("-", 2)[-1])
    assert status == 0
    # A name that cannot be unlinked (a directory) between two segments: both segments go, all reported.
    for tag in ("-a", "-c"):
        TieredCache(spec, hot_bytes=MiB, hot_name=names + tag).close()
    os.mkdir(f"/dev/shm{names}-b")
    try:
        status, out, err = run(capsys, "rm", names + "-a", names + "-b", names + "-c", "--json", "-")
        assert status == 1 and f"{names}-b" in err
        doc = json.loads(out)
        assert [d["name"] for d in doc["removed"]] == [names + "-a", names + "-c"]
        assert doc["failed"] == [names + "-b"]
    finally:
        os.rmdir(f"/dev/shm{names}-b")


def test_a_segment_with_a_damaged_fingerprint_is_listed_and_removed_as_stale(capsys, spec, names):
    """One non-ASCII byte in a segment header's fingerprint made ``ls``, ``stats`` and ``rm --stale``
    end in a bare ``UnicodeDecodeError``, so ``rm --stale`` cleaned up nothing at all."""
    TieredCache(spec, hot_bytes=MiB, hot_name=names + "-d").close()
    off = seg.HEADER_DTYPE.fields["fingerprint"][1]
    with open(f"/dev/shm{names}-d", "r+b") as f:
        f.seek(off)
        f.write(b"\xff")
    status, out, _ = run(capsys, "ls", "--json", "-")
    assert status == 0 and any(d["name"] == names + "-d" for d in json.loads(out)["hot"])
    status, out, _ = run(capsys, "rm", "--stale", "--match", names + "*")
    assert status == 0 and out.startswith(f"removed {names}-d: unusable")


def test_rm_needs_names_or_stale(capsys):
    status, _, err = run(capsys, "rm")
    assert status == 2 and "NAMEs or --stale" in err


# ---- verify -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["slab-0000.bin", "meta.json"])
def test_a_fifo_in_a_tier_directory_is_refused_not_waited_on(capsys, spec, names, tmp_path, what):
    """A FIFO under a slab's or the meta file's name made ``verify`` (and ``ls --warm-dir``) block for
    ever on its open, and ``verify --repair`` changed its mode first. Now each says what it is."""
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-f", warm_dir=tmp_path, warm_bytes=4 * MiB,
                     demotion="write_through") as cache:
        traffic(cache, spec)
    [tier] = [p for p in tmp_path.iterdir() if p.is_dir()]
    os.unlink(tier / what)
    os.mkfifo(tier / what, 0o600)
    status, out, err = run(capsys, "verify", str(tmp_path))
    assert status in (1, 2) and "not a regular file" in out + err
    status, out, err = run(capsys, "verify", str(tier), "--repair")
    assert status in (1, 2) and "not a regular file" in out + err
    assert stat.S_IMODE(os.stat(tier / what).st_mode) == 0o600
    if what == "meta.json":
        status, out, err = run(capsys, "ls", "--warm-dir", str(tmp_path))
        assert "not a regular file" in out + err


def test_verify_finds_a_corrupted_slab_and_repairs_it(capsys, spec, names, tmp_path):
    with TieredCache(spec, hot_bytes=MiB, hot_name=names + "-v", warm_dir=tmp_path, warm_bytes=4 * MiB,
                     demotion="write_through") as cache:
        traffic(cache, spec)                                   # 4 blocks in the warm tier
    [tier] = [p for p in tmp_path.iterdir() if p.is_dir()]
    status, out, _ = run(capsys, "verify", str(tmp_path))
    assert status == 0 and "4 blocks checked, 0 bad" in out
    with open(tier / "slab-0000.bin", "r+b") as f:             # damage the first block's bytes
        f.seek(100)
        f.write(b"\xff" * 64)
    report_file = tmp_path / "report.json"
    status, out, _ = run(capsys, "verify", str(tmp_path), "--json", str(report_file))
    assert status == 2
    assert "4 blocks checked, 1 bad" in out and "DAMAGED" in out and "checksum" in out
    report = json.loads(report_file.read_text())
    assert report["ok"] is False
    [bad] = report["tiers"][0]["bad_blocks"]
    assert (bad["slab"], bad["slot"], bad["reason"]) == (0, 0, "checksum")
    shutil.copytree(tier, tmp_path / "copy" / tier.name)      # the same damage, repaired by text below
    status, out, _ = run(capsys, "verify", str(tier), "--repair", "--json", "-")
    assert status == 0 and json.loads(out)["removed"] == 1    # exit 0: the damage found was repaired
    status, out, _ = run(capsys, "verify", str(tier))
    assert status == 0 and "3 blocks checked, 0 bad" in out
    status, out, _ = run(capsys, "verify", str(tmp_path / "copy"), "--repair")
    assert status == 0 and "damaged, repaired" in out and "DAMAGED" not in out


def test_verify_of_a_missing_directory(capsys, tmp_path):
    """No warm tier there: exit 1 (as for an empty directory), not 2, which says damage (a cron job
    alerting on 2 must not page for a new host). A path that is not a directory is bad usage (2)."""
    status, _, err = run(capsys, "verify", str(tmp_path / "nope"))
    assert status == 1 and "no warm tier at" in err and "does not exist" in err
    (tmp_path / "file").write_text("x")
    status, _, err = run(capsys, "verify", str(tmp_path / "file"))
    assert status == 2 and "is not a directory" in err


# ---- simulate / bench / help -----------------------------------------------------------------------
def test_simulate_json_on_stdout(capsys):
    status, out, err = run(capsys, "simulate", "--synthetic", "300", "--policy", "lru,fifo", "--capacity", "10%",
                           "--no-progress", "--json", "-")
    assert status == 0
    doc = json.loads(out)                                      # the table went to stderr
    assert [r["policy"] for r in doc["results"]] == ["lru", "fifo"]
    assert "block hit" in err


def test_bench_unknown_name(capsys):
    status, _, err = run(capsys, "bench", "no_such_bench")
    assert status == 2 and "choose one of:" in err and "hot_tier" in err


def _commands() -> list[str]:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return list(sub.choices)


def test_the_issue_commands_exist():
    assert set(_commands()) >= {"demo", "estimate", "ls", "stats", "rm", "verify", "simulate", "bench"}


@pytest.mark.parametrize("command", _commands())
def test_every_help_has_an_example_and_json(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:\n" in out
    examples = out.split("examples:\n", 1)[1]
    assert f"  tieredkv {command}" in examples
    assert "--json OUT" in out
    # Every example parses with this very parser (no stale flags in the help).
    for line in cli.EXAMPLES[command]:
        argv = line.split("#")[0].split()[1:]
        argv = [a.strip("'") for a in argv]
        args = cli.build_parser().parse_args(argv)
        assert args.command == command


def test_top_level_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "estimate", "ls", "stats", "rm", "verify", "simulate", "bench"):
        assert command in out
    assert "example:" in out


@pytest.mark.procs
def test_a_segments_journal_files_are_not_segments_and_go_with_it(capsys, spec, names):
    """A journaling cache (KV events) keeps NAME.journal and NAME.journal.lock beside its segment: they
    are not segments. Listed as unusable ones, they made ``stats`` without a name refuse, put a
    ``segment_up 0`` series (an alert firing forever) in the exporter, and ``rm --stale`` removed the
    lock file from under the journal's live writers. ``rm NAME`` removes them with the segment."""
    from tieredkv import metrics

    name = names + "-j"
    journal_files = [f"/dev/shm{name}.journal", f"/dev/shm{name}.journal.lock"]
    with TieredCache(spec, hot_bytes=MiB, hot_name=name, journal=True) as cache:
        traffic(cache, spec)
        assert all(os.path.exists(p) for p in journal_files)
        assert [n for n in seg.list_segment_names() if n.startswith(names)] == [name]
        assert [d["name"] for d in admin.list_segments() if d["name"].startswith(names)] == [name]
        status, out, _ = run(capsys, "rm", "--stale", "--match", names + "*", "--dry-run", "--json", "-")
        assert status == 0 and json.loads(out)["removed"] == []
        try:
            import prometheus_client  # noqa: F401  (the metrics extra; .ci/setup installs it)
        except ImportError:
            pass
        else:
            assert ".journal" not in metrics.render()
    status, out, _ = run(capsys, "rm", name)
    assert status == 0 and out.strip() == f"removed {name}"
    assert not any(os.path.exists(p) for p in journal_files + [f"/dev/shm{name}"])
