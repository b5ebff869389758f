"""Hardening round 3 (issue 19): the items outside the remote tier and fork safety (those are in
test_remote_hardening.py and test_fork_safety.py)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import kv_for
from tieredkv import InvalidInput, KVSpec, TieredCache


# ---- 6: tokens on torch's meta device ------------------------------------------------------------------
def test_tokens_on_the_meta_device_are_a_clear_mistake(tiny_spec, seg_name):
    torch = pytest.importorskip("torch")
    cache = TieredCache(tiny_spec, hot_bytes=1 << 20, hot_name=seg_name)
    try:
        meta = torch.arange(9, device="meta")
        for call in (lambda: cache.lookup(meta), lambda: cache.store(meta, np.zeros((2, 2, 1, 9, 8), np.float32))):
            with pytest.raises(InvalidInput, match="meta device"):
                call()
        assert cache.lookup(torch.arange(9)).blocks == 0  # a real tensor still works
    finally:
        cache.close()


# ---- 12: warm_queue_bytes bounds the memory queued jobs keep ---------------------------------------------
def test_queued_warm_writes_keep_no_more_than_the_bound(tmp_path, seg_name, monkeypatch):
    import gc
    import threading
    import tracemalloc

    spec = KVSpec(model_id="test/queue-bound", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                  chunk_tokens=16)  # 64 KiB blocks
    bound = 4 * spec.block_bytes
    cache = TieredCache(spec, hot_bytes=8 << 20, hot_name=seg_name, warm_dir=tmp_path / "warm",
                        warm_bytes=64 << 20, warm_queue_bytes=bound)
    # The store path's first call imports what it needs and makes its staging buffer (a bounded one,
    # kept for every later store, tieredkv.writeback): not measured. 100 blocks, as the measured store.
    warm_up = np.arange(16 * 100 + 1)
    cache.store(warm_up, kv_for(spec, warm_up))
    assert cache.flush(60)
    before = cache.stats()  # how many of its blocks the queue took depends on the writer's pace
    started, release = threading.Event(), threading.Event()
    real_put = cache.warm.put_many

    def stuck_put(keys, payloads):  # the warm write cannot finish (a peer holds the LMDB lock)
        started.set()
        assert release.wait(60)
        return real_put(keys, payloads)

    monkeypatch.setattr(cache.warm, "put_many", stuck_put)
    try:
        tokens = np.random.default_rng(0).integers(0, 30_000, 16 * 100 + 1)  # 100 blocks, 25x the bound
        kv = kv_for(spec, tokens)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        cache.store(tokens, kv)
        assert started.wait(60)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        st = cache.stats()
        assert st["warm_queued_blocks"] - before["warm_queued_blocks"] == 4
        assert st["warm_dropped_blocks"] - before["warm_dropped_blocks"] == 96
        # What the queued job keeps alive is its own 4 blocks (plus small change), not the store's 100.
        assert kept < 2 * bound, f"queued jobs keep {kept / bound:.1f}x warm_queue_bytes alive"
    finally:
        release.set()
        cache.close()


# ---- 16: the CLI: every mistake one line and a non-zero exit ------------------------------------------------
_FUZZ_VALUES = ["", "-1", "0", "1", "nan", "inf", "-inf", "1e309", "abc", "/nonexistent/x", "/dev/null", "empty",
                "adir", "junk.json", "trace.csv", "x" * 300, "é\u2603", "8G", "-", "valkey://127.0.0.1:1", "ftp://x:1",
                "1.5", "999999999999999999999", "-x", "--", "lru", "s3fifo", "a,b", "0x10", "/tieredkv-nope", "%s",
                "\\", "valkey://127.0.0.1:1?insecure=1&deadline_ms=1", "mooncake://127.0.0.1:1"]


def test_cli_fuzz_every_mistake_is_one_line_and_a_non_zero_exit(tmp_path, monkeypatch):
    """Random command lines (every subcommand but the long-running demo and bench; ``rm`` only with
    --dry-run, so nothing of anyone's is removed): no traceback, no hang, and a failure says why.
    Before the fix, ``simulate --synthetic 999999999999999999999`` ran for ever."""
    import argparse
    import contextlib
    import io
    import random
    import signal

    from tieredkv import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").touch()
    (tmp_path / "adir").mkdir()
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "trace.csv").write_text("a,b\n1,2\n")
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    # --watch and --prometheus serve until stopped, by design: not part of the fuzz.
    commands = {n: [(a.option_strings[-1], a.nargs != 0) for a in sp._actions
                    if a.option_strings and not {"-h", "--watch", "--prometheus"} & set(a.option_strings)]
                for n, sp in sub.choices.items() if n not in ("demo", "bench")}

    class Hang(Exception):
        pass

    def hang(*_):
        raise Hang()

    old = signal.signal(signal.SIGALRM, hang)
    rng = random.Random(19)
    problems = []
    try:
        # The cases found by hand first (they ran for ever, or crashed on a remote store), then random ones.
        fixed = [["simulate", "--synthetic", "999999999999999999999"], ["simulate", "--synthetic", "0"],
                 ["ls", "--remote", "valkey://127.0.0.1:1?insecure=1&timeout_s=0.2"],
                 ["verify", "--remote", "valkey://127.0.0.1:1?timeout_s=0.2"],
                 ["stats", "--remote", "valkey://x:y@127.0.0.1:1/z"]]
        for i in range(len(fixed) + 250):
            name = fixed[i][0] if i < len(fixed) else rng.choice(sorted(commands))
            argv = list(fixed[i]) if i < len(fixed) else [name] + (["--dry-run"] if name == "rm" else [])
            for _ in range(0 if i < len(fixed) else rng.randint(0, 4)):
                if rng.random() < 0.6:
                    opt, takes = rng.choice(commands[name])
                    argv += [opt, rng.choice(_FUZZ_VALUES)] if takes else [opt]
                else:
                    argv.append(rng.choice(_FUZZ_VALUES))
            err = io.StringIO()
            signal.alarm(20)
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    status = cli.main(argv)
            except SystemExit as e:  # argparse's own usage errors: "usage: ..." and status 2
                status = e.code
            except Hang:
                problems.append((argv, "hang"))
                continue
            except BaseException as e:  # noqa: BLE001 - what the test looks for
                problems.append((argv, f"{type(e).__name__}: {e}"))
                continue
            finally:
                signal.alarm(0)
            said = [line for line in err.getvalue().splitlines() if line.strip()]
            if status not in (0, None) and not said:
                problems.append((argv, f"exit {status} without a word"))
            if "Traceback" in err.getvalue():
                problems.append((argv, "traceback on stderr"))
    finally:
        signal.signal(signal.SIGALRM, old)
    assert not problems, problems[:5]


@pytest.mark.procs  # a fresh interpreter without transformers
def test_demo_without_the_hf_extra_says_how_to_install_it():
    import os
    import subprocess
    import sys

    code = ("import sys\nsys.modules['transformers'] = None  # as if the hf extra were not installed\n"
            "from tieredkv.cli import main\nsys.exit(main(['demo']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "pip install 'tieredkv[hf]'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- 13 + 14: default segment names carry the layout version and the uid -----------------------------------
_OLD_WORKER = """
import sys
import numpy as np
import tieredkv.hot.segment as seg
seg.LAYOUT_VERSION = 2  # a release with another segment layout
from tieredkv import KVSpec, chunk_keys
from tieredkv.hot import HotTier
spec = KVSpec(model_id=sys.argv[1], num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
tier = HotTier(spec, n_slots=8)
keys = chunk_keys(spec, np.arange(9))
tier.put_many(keys, np.ones((2, spec.block_bytes), np.uint8))
print(tier.name, flush=True)
sys.stdin.read()  # serve until told to drain
tier.close()
"""


@pytest.mark.procs
def test_the_documented_upgrade_runs_old_and_new_workers_side_by_side(capsys):
    """docs/deploy.md "Upgrading tieredkv": new workers start while old ones (another layout) still
    serve; `rm --stale` leaves the old segment while it is in use and removes it once they drained.
    Before: both used one name, and new workers failed with FormatError until the old ones were gone."""
    import os
    import secrets
    import subprocess
    import sys

    from tieredkv import chunk_keys
    from tieredkv.cli import main
    from tieredkv.hot import HotTier
    from tieredkv.hot import segment as seg

    model = f"test/upgrade-{secrets.token_hex(4)}"
    spec = KVSpec(model_id=model, num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
    old = subprocess.Popen([sys.executable, "-c", _OLD_WORKER, model], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=os.environ)
    new = None
    try:
        old_name = old.stdout.readline().strip()
        assert old_name == f"/tieredkv-v2-u{os.getuid()}-{spec.namespace}"
        new = HotTier(spec, n_slots=8)  # a worker of the new release, while the old one serves
        assert new.name == seg.default_name(spec) != old_name and f"-u{os.getuid()}-" in new.name
        keys = chunk_keys(spec, np.arange(9))
        assert new.put_many(keys, np.ones((2, spec.block_bytes), np.uint8)).tolist() == [0, 0]
        assert main(["rm", "--stale", "--match", old_name]) == 0
        assert os.path.exists("/dev/shm" + old_name)  # in use by the old worker: kept
        old.stdin.close()  # the old worker drains and exits
        assert old.wait(60) == 0
        capsys.readouterr()
        assert main(["rm", "--stale", "--match", old_name]) == 0
        assert not os.path.exists("/dev/shm" + old_name) and "layout version 2" in capsys.readouterr().out
        assert new.match(keys) == 2  # the new release's segment is untouched
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()
        if new is not None:
            new.close()
            new.unlink()
        for name in (f"/tieredkv-v2-u{os.getuid()}-{spec.namespace}", seg.default_name(spec)):
            if os.path.exists("/dev/shm" + name):
                os.unlink("/dev/shm" + name)


# ---- 11: a damaged owners file never frees a live writer's claim -------------------------------------------
_LIVE_WRITER = """
import sys
from tieredkv import KVSpec
from tieredkv.warm import WarmTier
spec = KVSpec(model_id="test/owners", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", chunk_tokens=4)
tier = WarmTier(spec, sys.argv[1], capacity_bytes=16 * 4096)
print(*tier._index.identity, flush=True)
sys.stdin.read()  # alive, mid-write as far as its claims say, until told to go
tier.close()
"""


@pytest.mark.procs
@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_a_damaged_owners_file_never_frees_a_live_writers_claim(tmp_path, damage):
    """A writer's claim (a slot it is copying into) must stay claimed while it lives, even when the
    owners file that names it is zeroed or truncated: freed, the slot would be reused and the writer's
    late copy would land on another block. Before the fix the claim was reaped at once."""
    import os
    import subprocess
    import sys

    from tieredkv.warm import WarmTier
    from tieredkv.warm import index as ix

    spec = KVSpec(model_id="test/owners", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
                  chunk_tokens=4)
    writer = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        owner, token = map(int, writer.stdout.readline().split())
        with WarmTier(spec, tmp_path, capacity_bytes=16 * 4096) as tier:
            def claim(txn):  # what put_many leaves between claiming a slot and publishing the block
                slot = tier._pop_free(txn, 1)[0]
                txn.put(b"\x01" * 16, ix.CLAIM.pack(slot, owner, token, 1), db=tier._index.inflight)

            tier._index.write(claim)
            owners = tier.path / "owners"
            if damage == "zeroed":
                owners.write_bytes(bytes(owners.stat().st_size))
            else:
                os.truncate(owners, 0)
            assert tier._reap_claims() == 0  # the file cannot vouch for the claim: it is kept
            writer.stdin.close()
            assert writer.wait(60) == 0
            assert tier._reap_claims() == 1  # its writer is gone: now it is freed
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


# ---- 5: a reader repairs an index an interrupted critical section left empty --------------------------------
def test_a_reader_repairs_an_index_left_empty_by_an_interrupted_critical_section(tiny_spec, seg_name):
    """The state an interrupt storm left (16 of 16 slots READY, the index emptied by a rebuild that
    never finished, ``dirty`` still set, the lock free): before, every reader missed every block until
    some writer entered a critical section; now the first reader scrubs it."""
    import warnings

    from tieredkv import chunk_keys
    from tieredkv.hot import HotTier

    keys = chunk_keys(tiny_spec, np.arange(16 * 4 + 1))
    payloads = np.arange(16 * tiny_spec.block_bytes, dtype=np.uint32).astype(np.uint8).reshape(16, -1)
    with HotTier(tiny_spec, n_slots=16, name=seg_name) as writer, HotTier(tiny_spec, name=seg_name) as reader:
        writer.put_many(keys, payloads)
        assert reader.match(keys) == 16
        # The interrupted critical section: inside (dirty = who was inside), index cleared, lock dropped.
        writer._h["dirty"] = writer._owner + 1
        writer._index.rebuild(np.zeros(0, dtype=np.int64))
        assert int((writer._slots["state"] == 2).sum()) == 16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = np.zeros_like(payloads)
            assert reader.match(keys) == 16  # the reader's own call scrubbed first
            assert reader.get_many(keys, out) == 16 and (out == payloads).all()
        assert int(writer._h["dirty"]) == 0
        writer.unlink()
