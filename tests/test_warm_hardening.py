"""The warm tier under attack: containers, stopped writers, damaged and replaced index files, full disks,
hostile directories and bad arguments (issue 11's warm-tier items, issue 14's verify exit codes).

Everything here is real: processes in another PID namespace (``unshare``), SIGSTOP and SIGKILL, files
truncated or replaced on disk, a small tmpfs for disk-full. Tests that need root say so when they skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tieredkv import (
    InvalidInput,
    KVSpec,
    LockTimeout,
    PutResult,
    TieredCache,
    TieredKVError,
    WarmTierUnavailable,
    chunk_keys,
)
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import TEST_SPEC_ARGS, check_index, payload_for

SPEC = KVSpec(**TEST_SPEC_ARGS)
SLOT = 4096
ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare / mount / chown)")


def keys(start, n):
    return chunk_keys(SPEC, np.arange(start, start + n * SPEC.chunk_tokens))


def fill(tier, k):
    return tier.put_many(k, payload_for(k, SPEC.block_bytes))


def served(tier, k) -> int:
    out = np.zeros((len(k), SPEC.block_bytes), np.uint8)
    n = tier.get_many(k, out)
    np.testing.assert_array_equal(out[:n], payload_for(k[:n], SPEC.block_bytes))
    return n


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tieredkv", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


# ---- 17: bad arguments name the argument --------------------------------------------------------------
@pytest.mark.parametrize("kw,arg", [(dict(tp_rank="0"), "tp_rank"), (dict(tp_rank=0.5), "tp_rank"),
                                    (dict(tp_rank=True), "tp_rank"), (dict(extra=object()), "extra"),
                                    (dict(extra=None), "extra")])
def test_bad_spec_fields_are_invalid_input_naming_the_field(kw, arg):
    with pytest.raises(InvalidInput, match=arg):
        KVSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=8, **kw)


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_key_value_heads", "hidden_size", "head_dim"])
def test_from_hf_config_with_a_string_count_names_the_field(field):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 16}
    cfg[field] = "2"
    with pytest.raises(InvalidInput, match=field):
        KVSpec.from_hf_config(cfg)
    with pytest.raises(InvalidInput, match="tp_size"):
        KVSpec.from_hf_config({**cfg, field: 2}, tp_size="1")


@pytest.mark.parametrize("bad", [5, "", b"/tmp", object()])
def test_bad_warm_dir_is_invalid_input_naming_it(bad, seg_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" must not mean "here": nothing may appear in the cwd
    with pytest.raises(InvalidInput, match="warm_dir"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=bad, warm_bytes=MiB)
    with pytest.raises(InvalidInput, match="directory"):
        WarmTier(SPEC, bad, capacity_bytes=MiB)
    assert os.listdir(tmp_path) == []


# ---- issue 14 item 5: verify's exit status ---------------------------------------------------------------
@pytest.mark.procs
def test_verify_exit_codes(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("verify", str(empty))
    assert proc.returncode == 1 and "no warm tier" in proc.stderr
    root = tmp_path / "warm"
    k = keys(0, 4)
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, k)
    assert cli("verify", str(root)).returncode == 0
    slab = root / SPEC.namespace / "slab-0000.bin"
    with open(slab, "r+b") as f:  # damage one block's bytes on disk
        f.seek(SLOT + 7)
        f.write(b"\xff\xfe")
    assert cli("verify", str(root)).returncode == 2
    proc = cli("verify", "--repair", str(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # repaired: `verify --repair && start` works
    assert "1 dropped" in proc.stdout
    assert cli("verify", str(root)).returncode == 0


# ---- 6: TieredCache starts hot-only when the warm tier cannot open ------------------------------------
def test_cache_starts_hot_only_when_warm_cannot_open(tmp_path, seg_name):
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT) as t:
        fill(t, keys(0, 2))
    (tmp_path / SPEC.namespace / "meta.json").write_text("{ not json")
    with pytest.warns(RuntimeWarning, match="hot-only"):
        cache = TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=16 * SLOT)
    try:
        assert cache.warm is None
        tokens = np.arange(4 * SPEC.chunk_tokens + 1)
        kv = np.ones((2, 2, 1, len(tokens), 8), np.float16)
        cache.store(tokens, kv)
        assert cache.lookup(tokens).tokens == 4 * SPEC.chunk_tokens  # the hot tier serves
        assert cache.stats()["warm_errors"] == 1
    finally:
        cache.close()


def wait_until(cond, polls: int = 3000) -> None:
    """Poll ``cond`` (a state change in another process) until true; fail after ``polls`` tries."""
    for _ in range(polls):
        if cond():
            return
        time.sleep(0.01)
    assert cond()


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _child(code: str, *prefix: str) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)


_BLOCKED_WRITER = """
import sys, time, numpy as np
from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS, payload_for
spec = KVSpec(**TEST_SPEC_ARGS)
t = WarmTier(spec, {root!r}, capacity_bytes=4 * 4096)
def stuck(*a, **k):  # the claims are committed; the data copy never finishes while we live
    print("claimed", flush=True)
    time.sleep(600)
t._slabs.write = stuck
k = chunk_keys(spec, np.arange(7000, 7000 + 4 * spec.chunk_tokens))
t.put_many(k, payload_for(k, spec.block_bytes))
"""


# ---- 1: claims of a writer in another PID namespace ----------------------------------------------------
@pytest.mark.procs
@needs_root
def test_claims_of_a_writer_in_another_pid_namespace_are_live_until_it_dies(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    root = tmp_path / "warm"
    WarmTier(SPEC, root, capacity_bytes=4 * SLOT).close()
    # The writer is pid 1 of its own PID namespace with its own /proc: its pid and start time mean
    # nothing here. It claims all 4 slots and stays inside its data copy.
    child = _child(_BLOCKED_WRITER.format(root=str(root)), "unshare", "--pid", "--fork", "--mount-proc",
                   "--kill-child")
    try:
        assert child.stdout.readline().strip() == "claimed"
        mine = keys(0, 4)
        with WarmTier(SPEC, root) as t:
            codes = fill(t, mine)
            # Its claims are live: never reaped, so our blocks find no room (before: all 4 reaped,
            # stored, and its late copy would land on our blocks).
            assert (codes == PutResult.NO_SPACE).all(), codes
            assert t.stats().extra["inflight"] == 4
            assert admin.verify(root)["tiers"][0]["dead_claims"] == 0
            child.kill()  # SIGKILL unshare; --kill-child takes the namespace's pid 1 with it
            child.wait(timeout=30)
            wait_until(lambda: admin.verify(root)["tiers"][0]["dead_claims"] == 4)
            codes = fill(t, mine)  # a dead container's claims are reaped
            assert (codes == PutResult.STORED).all(), codes
            assert served(t, mine) == 4
        check_index(str(root / SPEC.namespace))
    finally:
        child.kill()
        child.wait(timeout=30)


# ---- 7: a writer stopped inside a write transaction --------------------------------------------------
_STOPPED_WRITER = """
import os, signal, numpy as np
from tieredkv import KVSpec
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
t = WarmTier(KVSpec(**TEST_SPEC_ARGS), {root!r})
def body(txn):
    txn.put(b"x", b"y", db=t._index.info)
    print("inside", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, docker pause, a frozen cgroup
t._index.write(body)
"""

_STOPPED_OPENER = """
import os, signal
from tieredkv.warm import files
with files.init_lock({tier_dir!r}):
    print("inside", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""

_OTHER_PROCESS = """
import numpy as np
from tieredkv import KVSpec, LockTimeout, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS, payload_for
spec = KVSpec(**TEST_SPEC_ARGS)
try:
    WarmTier(spec, {root!r}, lock_timeout_s=0.5)
    print("opened")
except LockTimeout as e:
    print("open: LockTimeout")
import os, warnings
from tieredkv import TieredCache
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = TieredCache(spec, hot_bytes=1 << 20, hot_name=f"/tieredkv-test-stopped-{{os.getpid()}}",
                        warm_dir={root!r}, warm_bytes=1 << 20, lock_timeout_s=0.5)
try:
    print("cache:", "hot-only" if cache.warm is None else "with warm",
          sum("hot-only" in str(w.message) for w in caught))
finally:
    cache.unlink_hot()
"""


@pytest.mark.procs
def test_a_writer_stopped_inside_a_write_transaction_blocks_nobody_without_bound(tmp_path):
    root = tmp_path / "warm"
    stored = keys(0, 4)
    t = WarmTier(SPEC, root, capacity_bytes=16 * SLOT, lock_timeout_s=0.5)
    fill(t, stored)
    child = _child(_STOPPED_WRITER.format(root=str(root)))
    try:
        assert child.stdout.readline().strip() == "inside"
        wait_until(lambda: _proc_state(child.pid) == "T")
        # Lookups and reads do not wait behind the writer (before: they did not either, but puts and
        # every opener hung for good).
        assert t.match(stored) == 4
        for _ in range(3):  # enough hits to flush bookkeeping: it must not wait either
            assert served(t, stored) == 4
        t.flush_every = 1
        assert served(t, stored) == 4
        with pytest.raises(TieredKVError, match="writer lock"):
            fill(t, keys(1000, 2))
        with pytest.raises(TieredKVError, match="writer lock"):
            t.remove(stored[:1])
        # Another process: opening is bounded too (a TieredCache then starts hot-only).
        other = subprocess.run([sys.executable, "-c", _OTHER_PROCESS.format(root=str(root))],
                               capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert other.stdout.split("\n")[:2] == ["open: LockTimeout", "cache: hot-only 1"], \
            other.stdout + other.stderr
        child.send_signal(signal.SIGCONT)  # it commits and exits
        assert child.wait(timeout=60) == 0
        # The same for a process stopped while it opens (holding the tier's init lock).
        child = _child(_STOPPED_OPENER.format(tier_dir=str(root / SPEC.namespace)))
        assert child.stdout.readline().strip() == "inside"
        wait_until(lambda: _proc_state(child.pid) == "T")
        with pytest.raises(LockTimeout, match="stopped"):
            WarmTier(SPEC, root, lock_timeout_s=0.5)
        child.send_signal(signal.SIGCONT)
        assert child.wait(timeout=60) == 0
        assert (fill(t, keys(1000, 2)) == PutResult.STORED).all()
    finally:
        child.kill()
        child.wait(timeout=30)
        t.close()
    check_index(str(root / SPEC.namespace))


# ---- 2: index.lmdb/lock.mdb deleted or replaced under a live worker ------------------------------------
_OPENER = """
from tieredkv import KVSpec, WarmTierUnavailable
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
try:
    WarmTier(KVSpec(**TEST_SPEC_ARGS), {root!r}).close()
    print("opened")
except WarmTierUnavailable as e:
    print("refused:", e)
"""


@pytest.mark.procs
@pytest.mark.parametrize("how", ["delete", "replace", "delete owners"])
def test_a_replaced_lock_file_never_makes_two_writers(tmp_path, how):
    root = tmp_path / "warm"
    lock = root / SPEC.namespace / "index.lmdb" / "lock.mdb"
    first = keys(0, 4)
    t = WarmTier(SPEC, root, capacity_bytes=16 * SLOT)
    try:
        fill(t, first)
        if how == "delete":
            lock.unlink()
        elif how == "replace":
            shutil.copy(lock, str(lock) + ".new")
            os.replace(str(lock) + ".new", lock)
        else:  # the owner registry: a new one would not know the running worker (its claims look dead)
            (root / SPEC.namespace / "owners").unlink()
        # A new opener (another worker starting) would make a second LMDB lock table, or a second
        # registry: refused.
        other = subprocess.run([sys.executable, "-c", _OPENER.format(root=str(root))], capture_output=True,
                               text=True, cwd=ROOT, timeout=120)
        assert other.stdout.startswith("refused:") and "deleted or replaced" in other.stdout, \
            other.stdout + other.stderr
        if how != "delete owners":
            # The worker that had it open stops writing, with a clear error; reads go on.
            with pytest.raises(WarmTierUnavailable, match="deleted or replaced"):
                fill(t, keys(1000, 2))
        assert served(t, first) == 4
    finally:
        t.close()
    # Once the old worker is gone, the tier opens again with everything committed.
    with WarmTier(SPEC, root) as t:
        assert served(t, first) == 4
        assert (fill(t, keys(1000, 2)) == PutResult.STORED).all()
    check_index(str(root / SPEC.namespace))


# ---- 5: a truncated data.mdb ------------------------------------------------------------------------------
_READER = """
import sys, numpy as np
from tieredkv import KVSpec, CorruptState, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
spec = KVSpec(**TEST_SPEC_ARGS)
k = chunk_keys(spec, np.arange(0, 8 * spec.chunk_tokens))
out = np.zeros((8, spec.block_bytes), np.uint8)
try:
    t = WarmTier(spec, {root!r})
except CorruptState as e:
    print("open: CorruptState", e, flush=True)
    sys.exit(0)
print("open", t.get_many(k, out), flush=True)
sys.stdin.readline()  # the test truncates data.mdb now
for call in (lambda: t.get_many(k, out), lambda: t.match(k), lambda: t.put_many(k, out)):
    try:
        call()
        print("served", flush=True)
    except CorruptState as e:
        print("CorruptState", flush=True)
"""


def _truncate_index(root, size):
    data = root / SPEC.namespace / "index.lmdb" / "data.mdb"
    os.truncate(data, size)


@pytest.mark.procs
def test_a_truncated_data_file_is_detected_before_lmdb_touches_it(tmp_path):
    root = tmp_path / "warm"
    with WarmTier(SPEC, root, capacity_bytes=64 * SLOT) as t:
        fill(t, keys(0, 8))
        for i in range(40):  # a few hundred records: an index of many pages
            fill(t, keys(10_000 + 100 * i, 1))
    # A reader that has the index open when it is truncated under it: errors, never SIGBUS.
    reader = subprocess.Popen([sys.executable, "-c", _READER.format(root=str(root))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert reader.stdout.readline().split() == ["open", "8"]
    _truncate_index(root, 8192)
    reader.stdin.write("go\n")
    reader.stdin.flush()
    lines = [reader.stdout.readline().strip() for _ in range(3)]
    assert reader.wait(timeout=60) == 0, "the reader died (SIGBUS is -7)"
    assert lines == ["CorruptState"] * 3
    # A new opener, verify and verify --repair all see it without dying.
    for size in (8192, 4096 + 100, 0 + 17):
        _truncate_index(root, size)
        proc = subprocess.run([sys.executable, "-c", _READER.format(root=str(root))], capture_output=True,
                              text=True, cwd=ROOT, timeout=60, input="")
        assert proc.returncode == 0 and proc.stdout.startswith("open: CorruptState"), proc
        assert "verify --repair" in proc.stdout
        report = cli("verify", str(root))
        assert report.returncode == 2 and "truncated" in report.stdout, report
    repaired = cli("verify", "--repair", str(root))
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "rebuilt" in repaired.stdout
    with WarmTier(SPEC, root) as t:  # an empty index again: every block a miss, stores work
        assert t.match(keys(0, 8)) == 0
        assert (fill(t, keys(0, 8)) == PutResult.STORED).all()
        assert served(t, keys(0, 8)) == 8
    check_index(str(root / SPEC.namespace))
    assert cli("verify", str(root)).returncode == 0


# ---- 10: a damaged slot field in a record -----------------------------------------------------------------
def _damage_record_slot(root, key: bytes, new_slot: int) -> int:
    """Rewrite the slot field of ``key``'s record inside data.mdb itself; return how many copies."""
    from tieredkv.warm import index as ix

    tier_dir = root / SPEC.namespace
    index = ix.Index(str(tier_dir / "index.lmdb"), sync="none", map_size=1 << 20, map_max=1 << 30,
                     readonly=True)
    try:
        rec = index.read(lambda txn: txn.get(key, db=index.blocks))
    finally:
        index.close()
    data = tier_dir / "index.lmdb" / "data.mdb"
    blob = bytearray(data.read_bytes())
    needle = key + rec
    at, copies = blob.find(needle), 0
    while at >= 0:
        blob[at + 16:at + 20] = new_slot.to_bytes(4, "little")
        copies += 1
        at = blob.find(needle, at + 1)
    data.write_bytes(bytes(blob))
    return copies


@pytest.mark.procs
@pytest.mark.parametrize("verify", ["never", "sampled", "always"])
@pytest.mark.parametrize("slot", ["out of range", "another block's"])
def test_a_record_with_a_damaged_slot_is_dropped_and_counted(tmp_path, slot, verify):
    root = tmp_path / "warm"
    k = keys(0, 4)
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, k)
    raw = np.ascontiguousarray(k.keys, dtype="<u8").tobytes()
    assert _damage_record_slot(root, raw[32:48], 0x7F000001 if slot == "out of range" else 0) >= 1
    # With "never" the index invariants alone must keep block 0's bytes from being served as block 2.
    with WarmTier(SPEC, root, verify=verify) as t:
        assert t.match(k) == 2 if slot == "out of range" else True
        for _ in range(2):  # every load is a clean, shorter hit (before: IndexError on every load)
            assert served(t, k) == 2
        assert t.stats().corrupt == 1  # dropped once, counted once
        assert t.stats().extra["corrupt_total"] == 1
        assert t.match(k) == 2
        assert (fill(t, k[2:]) == [PutResult.STORED, PutResult.EXISTS]).all()
        assert served(t, k) == 4
    # The dropped record's own slot is owned by nobody: verify finds it, --repair frees it.
    assert admin.verify(root)["tiers"][0]["lost_slots"] == 1
    assert cli("verify", "--repair", str(root)).returncode == 0
    check_index(str(root / SPEC.namespace))
    with WarmTier(SPEC, root, verify=verify) as t:
        assert len(t.evict(16).keys) == 4  # every block evictable, each once
    check_index(str(root / SPEC.namespace))


# ---- 6: a lost or emptied index ------------------------------------------------------------------------------
@pytest.mark.procs
@pytest.mark.parametrize("how", ["deleted", "emptied", "data.mdb zeroed"])
def test_a_lost_or_emptied_index_is_rebuilt_empty_with_a_warning(tmp_path, how):
    root = tmp_path / "warm"
    index_dir = root / SPEC.namespace / "index.lmdb"
    k = keys(0, 4)
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, k)
    if how == "deleted":
        shutil.rmtree(index_dir)
    elif how == "emptied":
        for f in index_dir.iterdir():
            f.unlink()
    else:
        os.truncate(index_dir / "data.mdb", 0)
    proc = cli("verify", str(root))
    assert proc.returncode == 2 and "index" in proc.stdout, proc.stdout  # before: exit 0, "0 bad"
    with pytest.warns(UserWarning, match="rebuilt an empty one"):
        t = WarmTier(SPEC, root)  # before: CorruptState on every open, forever
    with t:
        assert t.match(k) == 0
        assert (fill(t, k) == PutResult.STORED).all()
        assert served(t, k) == 4
    check_index(str(root / SPEC.namespace))
    assert cli("verify", str(root)).returncode == 0


@pytest.mark.procs
def test_verify_repair_rebuilds_a_lost_index_and_refuses_while_the_tier_is_open(tmp_path):
    root = tmp_path / "warm"
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, keys(0, 4))
    tier_dir = root / SPEC.namespace
    _truncate_index(root, 5000)
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom tieredkv.warm.owners import Owners\n"
                               f"o = Owners({str(tier_dir)!r}, writable=True)\no.register((0, 0, 0))\n"
                               "print('in', flush=True)\nsys.stdin.readline()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "in"
        proc = cli("verify", "--repair", str(root))
        assert proc.returncode == 2 and "stop them" in proc.stdout, proc.stdout
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    proc = cli("verify", "--repair", str(root))
    assert proc.returncode == 0 and "rebuilt" in proc.stdout, proc.stdout
    assert cli("verify", str(root)).returncode == 0


# ---- 12: creating a tier on a full disk ----------------------------------------------------------------------
_CREATE = """
import os, sys
from tieredkv import KVSpec, TieredKVError
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
try:
    WarmTier(KVSpec(**TEST_SPEC_ARGS), {root!r}, capacity_bytes={cap}).close()
    print("created")
except TieredKVError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.procs
@needs_root
def test_a_failed_create_on_a_full_disk_leaves_nothing_and_says_so(tmp_path, seg_name):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root in a mount namespace that allows it)")
    try:
        def create(cap: int) -> str:
            proc = subprocess.run([sys.executable, "-c", _CREATE.format(root=str(mnt / "warm"), cap=cap)],
                                  capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert proc.returncode == 0, f"died: {proc.returncode} {proc.stderr[-500:]}"  # SIGBUS is -7
            return proc.stdout.strip()

        def used() -> int:
            st = os.statvfs(mnt)
            return (st.f_blocks - st.f_bfree) * st.f_frsize

        for cap in (16 * MiB, 8 * MiB - 16 * 1024):  # the slabs do not fit / the slabs fit, the index not
            for _ in range(2):  # and the retry, which used to die of SIGBUS on the leftovers
                out = create(cap)
                assert out.startswith("CapacityError") and "disk is full" in out, out
                tier = mnt / "warm" / SPEC.namespace
                left = sorted(p.name for p in tier.iterdir()) if tier.exists() else []
                assert not [n for n in left if n.startswith("slab-") or n in ("index.lmdb", "meta.json")], left
                assert used() < 64 << 10, used()
        # A worker's TieredCache on that disk still starts, hot-only, and says so.
        with pytest.warns(RuntimeWarning, match="hot-only"):
            cache = TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=mnt / "warm", warm_bytes=16 * MiB)
        assert cache.warm is None
        cache.close()
        assert create(2 * MiB) == "created"
        with WarmTier(SPEC, mnt / "warm") as t:
            assert (fill(t, keys(0, 4)) == PutResult.STORED).all()
            assert served(t, keys(0, 4)) == 4
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# ---- 16: hostile modes and a symlinked tier directory ------------------------------------------------------
def test_open_modes_are_restricted_with_a_warning(tmp_path):
    root = tmp_path / "warm"
    tier_dir = root / SPEC.namespace
    with WarmTier(SPEC, root, capacity_bytes=16 * SLOT) as t:
        fill(t, keys(0, 2))
    os.chmod(tier_dir, 0o777)
    os.chmod(tier_dir / "slab-0000.bin", 0o666)
    os.chmod(tier_dir / "index.lmdb" / "data.mdb", 0o644)
    with pytest.warns(UserWarning, match="open to other users"):
        t = WarmTier(SPEC, root)
    with t:
        assert served(t, keys(0, 2)) == 2
    assert tier_dir.stat().st_mode & 0o777 == 0o700
    assert (tier_dir / "slab-0000.bin").stat().st_mode & 0o777 == 0o600
    assert (tier_dir / "index.lmdb" / "data.mdb").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("target", ["elsewhere", "dangling"])
def test_a_symlinked_tier_directory_is_never_followed(tmp_path, target, seg_name):
    from tieredkv import PermissionDenied

    root = tmp_path / "warm"
    root.mkdir()
    elsewhere = tmp_path / "attacker"
    if target == "elsewhere":
        elsewhere.mkdir()
    (root / SPEC.namespace).symlink_to(elsewhere)
    with pytest.raises(PermissionDenied, match="symbolic link"):
        WarmTier(SPEC, root, capacity_bytes=16 * SLOT)
    with pytest.raises(PermissionDenied, match="symbolic link"):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=root, warm_bytes=16 * SLOT)
    assert not elsewhere.exists() or list(elsewhere.iterdir()) == []  # nothing created through the link


_SCAN_ALL = """
import sys, numpy as np
from tieredkv import KVSpec, CorruptState, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS
spec = KVSpec(**TEST_SPEC_ARGS)
try:
    t = WarmTier(spec, {root!r})
except CorruptState:
    print("refused")
    sys.exit(0)
out = np.zeros((50, spec.block_bytes), np.uint8)
n = sum(t.get_many(chunk_keys(spec, np.arange(i * 100_000, i * 100_000 + 50 * spec.chunk_tokens)), out)
        for i in range(30))
print("served", n)
"""


@pytest.mark.procs
def test_a_data_file_cut_by_a_few_pages_is_refused_not_a_signal(tmp_path):
    root = tmp_path / "warm"
    with WarmTier(SPEC, root, capacity_bytes=2048 * SLOT) as t:
        for i in range(30):  # ~1,500 records: an index of a few hundred pages
            fill(t, chunk_keys(SPEC, np.arange(i * 100_000, i * 100_000 + 50 * SPEC.chunk_tokens)))
        for j in range(300):  # small commits reuse freed pages: the roots move down, leaves stay at the end
            k = keys(9_000_000 + 10 * j, 1)
            fill(t, k)
            t.remove(k)
    data = root / SPEC.namespace / "index.lmdb" / "data.mdb"
    whole = data.read_bytes()
    outcomes = []
    for cut_pages in (1, 2, 3, 5, 8, 13, 21, 40):  # fewer pages than a quick size check can see
        data.write_bytes(whole[:len(whole) - cut_pages * 4096])
        proc = subprocess.run([sys.executable, "-c", _SCAN_ALL.format(root=str(root))], capture_output=True,
                              text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, f"cut {cut_pages} pages: died with {proc.returncode}"  # SIGBUS is -7
        outcomes.append(" ".join(proc.stdout.split()))
        if outcomes[-1] == "refused" and outcomes.count("refused") == 1:
            report = cli("verify", str(root))  # reads every record: must see the cut first
            assert report.returncode == 2 and "truncated" in report.stdout, report
    # Cut pages that held nothing (free pages at the end) cost nothing; a cut into used pages is refused.
    assert set(outcomes) <= {"refused", "served 1500"}, outcomes
    assert "refused" in outcomes, outcomes
    data.write_bytes(whole)
    proc = subprocess.run([sys.executable, "-c", _SCAN_ALL.format(root=str(root))], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.split() == ["served", "1500"], proc.stdout + proc.stderr


_FORKING_WRITER = """
import os, sys, time, numpy as np
from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import TEST_SPEC_ARGS, payload_for
spec = KVSpec(**TEST_SPEC_ARGS)
t = WarmTier(spec, {root!r}, capacity_bytes=4 * 4096)
def stuck(*a, **k):
    child = os.fork()
    if child == 0:  # a helper process that never touches the tier
        os.write(1, b"forked\\n")  # fork's after-in-child handlers have run (one write: lines never mix)
        time.sleep(600)
        os._exit(0)
    os.write(1, f"claimed {{child}}\\n".encode())
    time.sleep(600)
t._slabs.write = stuck
k = chunk_keys(spec, np.arange(7000, 7000 + 4 * spec.chunk_tokens))
t.put_many(k, payload_for(k, spec.block_bytes))
"""


@pytest.mark.procs
def test_a_forked_child_does_not_keep_a_dead_writer_alive(tmp_path):
    root = tmp_path / "warm"
    WarmTier(SPEC, root, capacity_bytes=4 * SLOT).close()
    writer = _child(_FORKING_WRITER.format(root=str(root)))
    helper = None
    try:
        # Both lines, in whichever order they come: the helper is running only once it says so (on a
        # busy host the writer may be killed before the child ran its fork handlers otherwise).
        said = dict((line.split() + [""])[:2] for line in (writer.stdout.readline(), writer.stdout.readline()))
        assert set(said) == {"claimed", "forked"}, said
        helper = int(said["claimed"])
        assert admin.verify(root)["tiers"][0]["dead_claims"] == 0  # the writer lives
        writer.kill()
        writer.wait(timeout=30)
        # Its child inherited the registry's descriptor (and so the lock) but dropped it at fork.
        assert _proc_state(helper) in "SR"
        assert admin.verify(root)["tiers"][0]["dead_claims"] == 4
        with WarmTier(SPEC, root) as t:
            assert (fill(t, keys(0, 4)) == PutResult.STORED).all()
    finally:
        writer.kill()
        writer.wait(timeout=30)
        if helper is not None:
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.procs
def test_a_slab_deleted_under_a_running_worker_is_not_recreated_beside_it(tmp_path):
    root = tmp_path / "warm"
    k = keys(0, 4)
    t = WarmTier(SPEC, root, capacity_bytes=16 * SLOT, verify="never")
    try:
        fill(t, k)
        (root / SPEC.namespace / "slab-0000.bin").unlink()
        # A new opener would make a fresh slab-0000.bin: its writes and the running worker's would land
        # in two different files under one index. Refused while the worker lives.
        other = subprocess.run([sys.executable, "-c", _OPENER.format(root=str(root)).replace(
            "WarmTierUnavailable", "TieredKVError")], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert other.stdout.startswith("refused:") and "deleted while 1 process" in other.stdout, \
            other.stdout + other.stderr
        assert not (root / SPEC.namespace / "slab-0000.bin").exists()
        assert served(t, k) == 4  # the worker still reads (and writes) the deleted file, consistently
        assert (fill(t, keys(100, 2)) == PutResult.STORED).all()
        assert served(t, keys(100, 2)) == 2
    finally:
        t.close()
    with pytest.warns(UserWarning, match="missing"):  # alone now: repaired as before
        t = WarmTier(SPEC, root)
    with t:
        assert t.match(k) == 0 and (fill(t, k) == PutResult.STORED).all() and served(t, k) == 4
    check_index(str(root / SPEC.namespace))
