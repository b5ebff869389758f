"""Faults seen through TieredCache: the warm tier failing (ENOSPC, EIO, short reads, LMDB map full,
directory turned read-only) degrades to a warning and misses while the hot tier keeps serving;
/dev/shm too small is a clear error at start-up; a segment unlinked under its users does not kill them.
In every case, nothing already stored is corrupted.

Tier-level write faults are in test_warm_faults.py; these go through the cache and real mounts.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for, same_bytes
from tieredkv import CapacityError, HotTier, KVSpec, TieredCache, chunk_keys
from tieredkv.hot import segment as seg
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import check_index, payload_for

SPEC = KVSpec(model_id="test/faults", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
MiB = 1 << 20
FORK = mp.get_context("fork")  # hot tier only in these children: no LMDB environment crosses a fork


def prompt(seed, n=4 * 6 + 1):
    return np.random.default_rng(seed).integers(0, 30_000, n)


def loads_right(cache, tokens, salt=b""):
    """Load tokens' hit; assert the bytes are right; return the tokens loaded."""
    kv = kv_for(SPEC, tokens, salt)
    out = np.zeros_like(kv)
    n = cache.load(cache.lookup(tokens, salt=salt), out)
    assert same_bytes(out[:, :, :, :n], kv[:, :, :, :n])
    return n


@pytest.fixture
def cache(seg_name, tmp_path):
    c = TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=MiB,
                    demotion="write_through")
    yield c
    c.close()


def warm_dir(tmp_path):
    return str(tmp_path / "warm" / SPEC.namespace)


@pytest.mark.parametrize("code,call", [(errno.ENOSPC, "pwritev"), (errno.EIO, "pwritev"), (errno.EIO, "fdatasync")])
def test_warm_write_error_degrades_to_hot_only(cache, tmp_path, monkeypatch, code, call):
    cache.warm.sync = "data"  # so fdatasync runs
    before = prompt(1)
    cache.store(before, kv_for(SPEC, before))
    assert cache.warm.stats().used_blocks == 6

    def fail(*a, **k):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, call, fail)
    during = prompt(2)
    with pytest.warns(RuntimeWarning, match=f"warm tier failed.*{os.strerror(code)}.*hot tier"):
        assert cache.store(during, kv_for(SPEC, during)) == 6  # the hot tier took them
    assert cache.stats()["warm_errors"] == 1
    assert loads_right(cache, during) == 24 and cache.lookup(during).hot_blocks == 6
    assert loads_right(cache, before) == 24
    monkeypatch.undo()
    assert cache.warm.match(chunk_keys(SPEC, during[:24])) == 0  # nothing half-stored
    assert cache.warm.stats().extra["inflight"] == 0
    cache.close()
    report = admin.verify(warm_dir(tmp_path))
    assert report["ok"] and report["blocks_checked"] == 6
    check_index(warm_dir(tmp_path))


def test_demotion_failing_does_not_stop_eviction(seg_name, tmp_path, monkeypatch):
    """The hot tier is full and every demotion fails: stores still succeed (evicting), loads stay right."""
    from tieredkv import policies
    from tieredkv.hot import segment as seg

    hot_bytes = seg.Layout.compute(SPEC, 8, policies.StateLayout.for_policy(policies.make("lru"), 8).nbytes).total_bytes
    with TieredCache(SPEC, hot_bytes=hot_bytes, hot_name=seg_name, warm_dir=tmp_path / "warm", warm_bytes=MiB,
                     demotion="on_evict") as c:  # demotion on the request path (write-behind: test_restart.py)
        monkeypatch.setattr(os, "pwritev", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with pytest.warns(RuntimeWarning, match="warm tier failed"):
            for s in range(5):
                assert c.store(prompt(s), kv_for(SPEC, prompt(s))) == 6
        assert c.stats()["demotions"] == 0 and c.stats()["warm_errors"] >= 1
        assert loads_right(c, prompt(4)) == 24
        assert c.hot.slot_census()["writing_live"] == 0


def test_short_reads_end_the_run_and_serve_no_wrong_bytes(cache, monkeypatch):
    tokens = prompt(3)
    cache.store(tokens, kv_for(SPEC, tokens))
    cache.hot.remove(chunk_keys(SPEC, tokens[:24]))  # now only warm holds them
    real = os.preadv

    def short(fd, buffers, offset):
        got = real(fd, buffers, offset)
        return max(0, got - 5000)  # the kernel returned less than asked (e.g. a file cut meanwhile)

    monkeypatch.setattr(os, "preadv", short)
    n = loads_right(cache, tokens)
    assert n < 24
    monkeypatch.undo()
    assert cache.warm.stats().corrupt >= 1  # counted, and those blocks were dropped, not served
    assert loads_right(cache, tokens) == n  # what is left is right
    cache.store(tokens, kv_for(SPEC, tokens))
    assert loads_right(cache, tokens) == 24


def test_lmdb_map_full_degrades_and_keeps_what_was_stored(cache, tmp_path):
    first = prompt(4)
    cache.store(first, kv_for(SPEC, first))
    # Swap in a handle whose LMDB map may not grow: the next big store fills it.
    cache.warm.close()
    cache.level("warm").tier = WarmTier(SPEC, tmp_path / "warm", map_size_bytes=64 << 10, map_max_bytes=64 << 10)
    big = np.arange(100_000, 100_000 + 4 * 200 + 1)
    with pytest.warns(RuntimeWarning, match="map limit"):
        assert cache.store(big, kv_for(SPEC, big)) > 0
    assert loads_right(cache, big) > 0
    assert loads_right(cache, first) == 24
    cache.hot.remove(chunk_keys(SPEC, first[:24]))
    assert cache.lookup(first).warm_blocks == 6 and loads_right(cache, first) == 24
    cache.close()
    assert admin.verify(warm_dir(tmp_path))["ok"]
    check_index(warm_dir(tmp_path))


def test_dev_shm_fallocate_failure_is_a_capacity_error_and_leaves_nothing(seg_name, tmp_path, monkeypatch):
    def enospc(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    WarmTier(SPEC, tmp_path / "w", capacity_bytes=MiB).close()  # exists already: only the segment is new
    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(CapacityError, match=r"cannot reserve .* /dev/shm"):
        TieredCache(SPEC, hot_bytes=4 * MiB, hot_name=seg_name, warm_dir=tmp_path / "w", warm_bytes=MiB)
    assert not os.path.exists("/dev/shm" + seg_name)
    assert not [p for p in os.listdir("/dev/shm") if seg.temp_owner(p) == os.getpid()]


_SMALL_SHM = r"""
import os, sys
from tieredkv import CapacityError, KVSpec, TieredCache, HotTier
spec = KVSpec(model_id="test/faults", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
free = os.statvfs("/dev/shm").f_bavail * 4096
assert free <= 2 << 20, f"/dev/shm has {free} bytes: the private small tmpfs is not in place"
try:
    TieredCache(spec, hot_bytes=16 << 20, hot_name="/tieredkv-small", warm_dir=sys.argv[1], warm_bytes=1 << 20)
except CapacityError as exc:
    print("refused:", exc)
else:
    sys.exit("a 16 MiB segment was created in a 2 MiB /dev/shm")
assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
with HotTier(spec, capacity_bytes=1 << 20, name="/tieredkv-small") as h:  # what fits still works
    print("fits:", h.n_slots)
"""


@pytest.mark.procs
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a private small /dev/shm needs root")
def test_dev_shm_too_small_for_real(tmp_path):
    """A private mount namespace with a 2 MiB tmpfs on /dev/shm: a 16 MiB cache is a clear CapacityError."""
    cmd = " ".join(shlex.quote(c) for c in [sys.executable, "-c", _SMALL_SHM, str(tmp_path / "w")])
    r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs /dev/shm && exec {cmd}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "refused:" in r.stdout and "lower hot_bytes or enlarge /dev/shm" in r.stdout
    assert "fits:" in r.stdout


_RO_WHILE_IN_USE = r"""
import os, subprocess, sys, warnings, numpy as np
sys.path.insert(0, sys.argv[2])
from helpers import kv_for, same_bytes
from tieredkv import KVSpec, TieredCache, chunk_keys
from tieredkv.warm import WarmTier
spec = KVSpec(model_id="test/faults", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
root = sys.argv[1]
def load(c, t):
    kv = kv_for(spec, t); out = np.zeros_like(kv); n = c.load(c.lookup(t), out)
    assert same_bytes(out[:, :, :, :n], kv[:, :, :, :n]); return n
a, b = np.arange(25), np.arange(1000, 1025)
with TieredCache(spec, hot_bytes=1 << 20, hot_name=sys.argv[3], warm_dir=root, warm_bytes=1 << 20,
                 demotion="write_through") as c:
    c.store(a, kv_for(spec, a))
    for dirpath, dirs, files in os.walk(root):  # the owner takes write permission away
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o400)
        os.chmod(dirpath, 0o500)
    try:
        open(os.path.join(root, "probe"), "w"); sys.exit("still writable")
    except OSError:
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        c.store(b, kv_for(spec, b))             # files opened before keep working, or warn: never raise
        print("warnings:", [str(x.message)[:120] for x in w])
    assert load(c, a) == 24 and load(c, b) == 24
    c.hot.remove(chunk_keys(spec, a[:24]))
    assert load(c, a) == 24                     # from warm
# A process opening it now gets a read-only tier that serves what is there.
r = subprocess.run([sys.executable, "-c", '''
import sys, numpy as np
from tieredkv import KVSpec, chunk_keys
from tieredkv.warm import WarmTier
spec = KVSpec(model_id="test/faults", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=4)
with WarmTier(spec, sys.argv[1]) as t:
    print("readonly", t.readonly, "match", t.match(chunk_keys(spec, np.arange(24))))
''', root], capture_output=True, text=True)
print(r.stdout, r.stderr)
assert "readonly True match 6" in r.stdout
print("done")
"""


@pytest.mark.procs
@pytest.mark.skipif(os.geteuid() != 0, reason="root without CAP_DAC_OVERRIDE is how to make modes bind root")
def test_warm_directory_made_read_only_while_in_use(tmp_path, seg_name):
    """The owner removes write permission from the whole tier while a cache uses it. (A read-only
    remount is refused by the kernel while files are open for writing, so permissions are how a tier
    turns read-only under a running process.) The child runs without the capabilities that let root
    ignore file modes."""
    root = tmp_path / "warm"
    r = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", sys.executable,
                        "-c", _RO_WHILE_IN_USE, str(root), os.path.dirname(__file__), seg_name],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done" in r.stdout
    report = admin.verify(str(root / SPEC.namespace))
    assert report["ok"] and report["blocks_checked"] == 12


# ---- a segment unlinked while others use it ----------------------------------------------------------
def _reader(name, keys_seed, stop, results):
    keys = chunk_keys(SPEC, prompt(keys_seed))
    want = payload_for(keys, SPEC.block_bytes)
    wrong = reads = errors = 0
    saw_new = False
    with HotTier(SPEC, name=name, create=False, policy=None) as h:
        out = np.zeros((len(keys), SPEC.block_bytes), np.uint8)
        marker = chunk_keys(SPEC, prompt(999))
        while not stop.is_set():
            try:
                n = h.get_many(keys, out)
                wrong += int(not np.array_equal(out[:n], want[:n]))
                reads += 1
                saw_new = saw_new or h.match(marker) > 0
            except Exception:  # noqa: BLE001 - counted: must stay 0
                errors += 1
            time.sleep(0.01)
    results.put((wrong, reads, errors, saw_new))


@pytest.mark.procs
def test_segment_unlinked_while_others_use_it(seg_name):
    """Regression: an attach-only handle (a worker that did not create the segment) whose segment was
    unlinked raised posix_ipc.ExistentialError once and was closed for good after that. Now it keeps
    serving from its mapping and reattaches when a creator makes a new segment."""
    creator = HotTier(SPEC, n_slots=16, name=seg_name)
    keys = chunk_keys(SPEC, prompt(5))
    creator.put_many(keys, payload_for(keys, SPEC.block_bytes))
    stop, results = FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=_reader, args=(seg_name, 5, stop, results)) for _ in range(3)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    posix_ipc.unlink_shared_memory(seg_name)  # e.g. an operator's `tieredkv rm`
    time.sleep(2.5)                           # > the 1 s re-check: every reader noticed
    creator.close()
    fresh = HotTier(SPEC, n_slots=16, name=seg_name)  # a creating process makes a new one
    marker = chunk_keys(SPEC, prompt(999))
    fresh.put_many(marker, payload_for(marker, SPEC.block_bytes))
    time.sleep(2.5)
    stop.set()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    fresh.close()
    assert sum(g[0] for g in got) == 0, "wrong bytes"
    assert sum(g[2] for g in got) == 0, "a reader's call raised"
    assert all(g[1] > 100 for g in got)
    assert all(g[3] for g in got), "a reader never reattached to the new segment"

