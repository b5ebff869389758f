"""What a new user gets wrong at the command line: every mistake is one line in the CLI's own words and a
non-zero exit, never a traceback. Also the friendlier forms: a segment named by a prefix of its name or
by its model id, and eviction policies of one's own (``--policy module:Class`` and entry points)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tieredkv import InvalidInput, KVSpec, TieredCache, cli, numa

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str, *words: str) -> None:
    """A single line on stderr, in the CLI's words (``tieredkv CMD: ...``), naming what was wrong."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tieredkv "), err
    assert "Traceback" not in err and "Errno" not in err, err
    for w in words:
        assert w in lines[0], (w, err)


@pytest.mark.parametrize("argv,words", [
    (["ls", "--warm-dir", "FILE"], ["--warm-dir", "not a directory"]),
    (["ls", "--warm-dir", "MISSING"], ["--warm-dir", "does not exist"]),
    (["ls", "--json", "MISSING/out.json"], ["--json", "does not exist"]),
    (["ls", "--json", "DIR"], ["--json", "is a directory"]),
    (["estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--prefix-tokens", "8", "--json", "DIR"],
     ["--json", "is a directory"]),
    (["simulate", "--synthetic", "50", "--json", "MISSING/r.json"], ["--json", "does not exist"]),
    (["simulate", "--synthetic", "50", "--plot", "DIR"], ["--plot", "is a directory"]),
    (["stats", "--prometheus", "99999999"], ["--prometheus", "0..65535"]),
    (["stats", "--prometheus", "-5"], ["--prometheus", "0..65535"]),
    (["stats", "--watch", "-1"], ["--watch", "> 0"]),
    (["stats", "--watch", "0"], ["--watch", "> 0"]),
    (["simulate", "--trace", "BINARY"], ["not a text trace"]),
    (["simulate", "--trace", "EMPTY"], ["no block accesses"]),
    (["simulate", "--trace", "MISSING/t.jsonl"], ["--trace", "no such file"]),
    (["simulate", "--synthetic", "0"], ["must be positive"]),
    (["simulate", "--trace", "BADSTAMP"], ["'timestamp' must be a number"]),
    (["estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--prefix-tokens", "-1"],
     ["--prefix-tokens must be >= 0"]),
])
def test_a_mistake_is_one_line_and_a_nonzero_exit(capsys, tmp_path, argv, words):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    (tmp_path / "BINARY.jsonl").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "EMPTY.jsonl").write_text("\n")
    (tmp_path / "BADSTAMP.jsonl").write_text('{"timestamp": "noon", "hash_ids": [1, 2]}\n')
    subst = {"FILE": tmp_path / "FILE", "DIR": tmp_path / "DIR", "BINARY": tmp_path / "BINARY.jsonl",
             "EMPTY": tmp_path / "EMPTY.jsonl", "BADSTAMP": tmp_path / "BADSTAMP.jsonl",
             "MISSING": tmp_path / "missing"}
    argv = [str(subst[a]) if a in subst else a.replace("MISSING", str(tmp_path / "missing")) for a in argv]
    status, out, err = run(capsys, *argv)
    assert status == 2, (status, out, err)
    one_line(err, *words)
    assert not list((tmp_path / "DIR").iterdir())            # nothing was written where it must not be


@pytest.mark.parametrize("addr,words", [
    ("10.254.254.1", ["not an address of this host"]),        # a foreign address: EADDRNOTAVAIL
    ("no-such-host.invalid", ["does not resolve"]),
])
def test_prometheus_bad_address_is_one_line(capsys, addr, words):
    pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")
    status, _, err = run(capsys, "stats", "--prometheus", "0", "--addr", addr)
    assert status == 1
    one_line(err, *words)


def test_prometheus_busy_port_is_one_line(capsys):
    pytest.importorskip("prometheus_client", reason="the 'metrics' extra is not installed")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, _, err = run(capsys, "stats", "--prometheus", str(port))
    assert status == 1
    one_line(err, f"port {port} is in use")


@pytest.mark.procs
def test_no_traceback_from_a_real_process(tmp_path):
    """The installed entry point, in a real process: a binary trace, one line, exit 2."""
    (tmp_path / "t.jsonl").write_bytes(b"\x00\xff" * 100)
    proc = subprocess.run([sys.executable, "-m", "tieredkv", "simulate", "--trace", str(tmp_path / "t.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    one_line(proc.stderr, "not a text trace")


def test_stats_of_a_missing_segment_is_one_line(capsys):
    status, _, err = run(capsys, "stats", "no-such-segment-" + secrets.token_hex(3))
    assert status == 1
    one_line(err, "no segment named", "tieredkv ls")


def test_stats_accepts_a_unique_prefix_or_the_model_id(capsys, seg_name):
    model = f"test/cli-edges-{secrets.token_hex(3)}"
    spec = KVSpec(model_id=model, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
    with TieredCache(spec, hot_bytes=4 * MiB, hot_name=seg_name):
        for name in (seg_name, seg_name[1:], seg_name[:-3], seg_name[len("/tieredkv-"):-2], model):
            status, out, err = run(capsys, "stats", name, "--json", "-")
            assert status == 0, (name, err)
            assert json.loads(out)["name"] == seg_name
        with TieredCache(spec, hot_bytes=4 * MiB, hot_name=seg_name + "x"):
            status, _, err = run(capsys, "stats", seg_name[:-3])      # now two segments start so
            assert status == 2
            one_line(err, "matches 2 segments", "give more of the name")
            TieredCache(spec, hot_name=seg_name + "x").hot.unlink()


def test_ls_explains_its_columns(capsys, seg_name):
    spec = KVSpec(model_id="test/cli-edges", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                  chunk_tokens=4)
    with TieredCache(spec, hot_bytes=4 * MiB, hot_name=seg_name):
        status, out, _ = run(capsys, "ls", "--match", seg_name)
    assert status == 0 and seg_name in out
    assert "hits / misses: blocks the hot tier delivered / could not deliver" in out
    assert "prefix hit: prompt tokens served from cache" in out


def test_two_level_simulate_prints_the_hot_warm_split(capsys):
    status, out, _ = run(capsys, "simulate", "--synthetic", "200", "--policy", "lru", "--hot", "5%", "--warm",
                         "20%", "--jobs", "1", "--no-progress")
    assert status == 0
    head, row = out.splitlines()[1:3]
    assert head.split()[:8] == ["policy", "hot", "warm", "%", "unique", "block", "hit", "hot"]
    cells = dict(zip(["block", "hot", "warm"], map(float, row.split()[4:7])))
    assert cells["block"] == pytest.approx(cells["hot"] + cells["warm"], abs=2e-4)
    assert cells["hot"] > 0 and cells["warm"] > 0


def test_numa_node_that_the_host_lacks_is_refused(seg_name):
    missing = max(numa.nodes() or {0: []}) + 1
    spec = KVSpec(model_id="test/numa", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
    with pytest.raises(InvalidInput, match=f"numa_node={missing} does not exist"):
        TieredCache(spec, hot_bytes=MiB, numa_node=missing)
    with pytest.raises(InvalidInput, match="numa_node must be an int"):
        TieredCache(spec, hot_bytes=MiB, hot_name=seg_name, numa_node="0")
    assert not [p for p in os.listdir("/dev/shm") if p.endswith(f"-numa{missing}")]


# ---- own policies ---------------------------------------------------------------------------------
POLICY_MODULE = textwrap.dedent("""
    import numpy as np
    from tieredkv import policies

    class NewestFirst(policies.EvictionPolicy):
        '''MRU: evicts the most recently used block (not registered: found by module:Class).'''
        name = "newest_first_{tag}"

        def choose(self, st, n, candidates):
            cand = np.flatnonzero(candidates)
            return cand[np.argsort(-st.last_access[cand], kind="stable")][:n]
""")


def write_policy(tmp_path: Path) -> tuple[str, str]:
    tag = secrets.token_hex(3)
    (tmp_path / f"my_policies_{tag}.py").write_text(POLICY_MODULE.format(tag=tag))
    return f"my_policies_{tag}", f"newest_first_{tag}"


def simulate_rows(stdout: str) -> dict[str, float]:
    """Each policy row's prefix hit ratio (the optimum's row and the footnote are not policies)."""
    rows = stdout.splitlines()[2:]
    return {r.split()[0]: float(r.split()[4]) for r in rows if r.strip() and not r.startswith(("belady", "gap closed"))}


@pytest.mark.procs
def test_simulate_policy_module_class_from_the_current_directory(tmp_path):
    module, _ = write_policy(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "tieredkv", "simulate", "--synthetic", "400", "--jobs", "1",
                           "--policy", f"lru,{module}:NewestFirst,prefix_aware:{module}:NewestFirst",
                           "--capacity", "200", "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr
    rows = simulate_rows(proc.stdout)
    own = f"{module}:NewestFirst"
    assert set(rows) == {"lru", own, f"prefix_aware:{own}"}   # labelled as given
    assert rows[own] != rows["lru"]                          # a different policy really ran


@pytest.mark.procs
def test_policy_from_an_entry_point_works_by_name_everywhere(tmp_path, seg_name):
    """An installed package declares ``[tieredkv.policies]``; its name then works in the CLI and in
    TieredCache, and a second process attaches to the segment by the recorded name."""
    module, name = write_policy(tmp_path)
    dist = tmp_path / "my_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[tieredkv.policies]\n{name} = {module}:NewestFirst\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "tieredkv", "simulate", "--synthetic", "300", "--jobs", "1",
                           "--policy", name, "--capacity", "100", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert name in simulate_rows(proc.stdout)
    code = textwrap.dedent(f"""
        from tieredkv import KVSpec, TieredCache
        spec = KVSpec(model_id="test/ep", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
        TieredCache(spec, hot_bytes=1 << 20, hot_name={seg_name!r}, eviction={name!r}).close()
        from tieredkv.hot import HotTier
        with HotTier(spec, name={seg_name!r}, policy=None, create=False) as h:
            print(h._policy.name)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == name


def test_attaching_with_another_policy_names_tieredcache_s_parameter(seg_name):
    spec = KVSpec(model_id="test/hint", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
    with TieredCache(spec, hot_bytes=MiB, hot_name=seg_name, eviction="lru"):
        with pytest.raises(InvalidInput, match="eviction='lru'") as e:
            TieredCache(spec, hot_bytes=MiB, hot_name=seg_name, eviction="fifo")
    assert "tieredkv rm" in str(e.value)


# ---- deployment sizes ----------------------------------------------------------------------------
@pytest.mark.parametrize("prefix,prompt,concurrency,workers", [(64, 80, 2, 3), (4096, 5000, 4, 8), (100, 100, 1, 1)])
def test_estimate_hot_bytes_hold_the_blocks_it_counts(capsys, seg_name, prefix, prompt, concurrency, workers):
    status, out, _ = run(capsys, "estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                         "--chunk-tokens", "4", "--prefix-tokens", str(prefix), "--prompt-tokens", str(prompt),
                         "--concurrency", str(concurrency), "--workers", str(workers), "--json", "-")
    assert status == 0
    doc = json.loads(out)
    assert doc["hot_blocks"] == prefix // 4 + concurrency * workers * (prompt // 4 - prefix // 4)
    spec = KVSpec(model_id="model", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
    with TieredCache(spec, hot_bytes=doc["hot_bytes"], hot_name=seg_name) as cache:
        assert cache.hot.n_slots >= doc["hot_blocks"]
        cache.hot.unlink()
    assert doc["shm_size_bytes"] >= 2 * doc["hot_bytes"] and doc["shm_size_bytes"] % (64 << 20) == 0
    status, text, _ = run(capsys, "estimate", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                          "--chunk-tokens", "4", "--prefix-tokens", str(prefix), "--prompt-tokens", str(prompt),
                          "--concurrency", str(concurrency), "--workers", str(workers))
    assert f"TieredCache(spec, hot_bytes={doc['hot_bytes']})" in text
    assert f"--shm-size={doc['shm_size_bytes'] >> 20}m" in text
