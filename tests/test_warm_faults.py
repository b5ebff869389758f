"""Injected faults: ENOSPC / EIO on write and sync, LMDB map full, read-only tiers."""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tieredkv import CapacityError, KVSpec, PutResult, WarmTierUnavailable, chunk_keys
from tieredkv.warm import WarmTier, admin
from tieredkv.warm.testing import check_index, payload_for

SPEC = KVSpec(model_id="test/warm-tiny", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
SLOT = 4096


def keys(start, n):
    return chunk_keys(SPEC, np.arange(start, start + n * SPEC.chunk_tokens))


def read_all(t, k):
    out = np.zeros((len(k), SPEC.block_bytes), np.uint8)
    n = t.get_many(k, out)
    np.testing.assert_array_equal(out[:n], payload_for(k[:n], SPEC.block_bytes))
    return n


@pytest.mark.parametrize("code,call", [(errno.ENOSPC, "pwritev"), (errno.EIO, "pwritev"),
                                       (errno.EIO, "fdatasync")])
def test_write_errors_are_clear_and_leave_no_trace(tmp_path, monkeypatch, code, call):
    good, more = keys(0, 4), keys(10_000, 4)
    with WarmTier(SPEC, tmp_path, capacity_bytes=16 * SLOT, sync="data") as t:
        t.put_many(good, payload_for(good, SPEC.block_bytes))

        def fail(*args, **kw):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, call, fail)
        with pytest.raises(WarmTierUnavailable, match=os.strerror(code)):
            t.put_many(more, payload_for(more, SPEC.block_bytes))
        assert read_all(t, good) == 4  # still readable
        assert t.match(more) == 0      # nothing half-stored
        assert t.stats().extra["inflight"] == 0  # claims given back
        monkeypatch.undo()
        assert (t.put_many(more, payload_for(more, SPEC.block_bytes)) == PutResult.STORED).all()
        assert read_all(t, more) == 4
    check_index(str(tmp_path / SPEC.namespace))
    assert admin.verify(tmp_path)["ok"]


class _SyncSpy:
    """Forwards to an LMDB environment, logging its explicit syncs."""

    def __init__(self, env, log):
        self._env, self._log = env, log

    def sync(self, force=False):
        self._log.append("index fsync")
        return self._env.sync(force)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_with_sync_data_a_put_that_reuses_slots_makes_its_claim_durable_before_writing_them(tmp_path, monkeypatch):
    """``sync="data"`` commits with ``MDB_NOMETASYNC``: a commit's meta page reaches the disk only with
    the next commit's fsync. A put that evicts (or takes slots blocks were removed from) must make the
    claim that dropped their records durable before it overwrites those slots: otherwise a power loss
    in between brings the old records back over the new bytes (an emulated power loss served 4 wrong
    blocks with ``verify="never"``). A put into never-used slots pays nothing more."""
    log: list[str] = []
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset, *args):
        log.append("slab write")
        return real_pwritev(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with WarmTier(SPEC, tmp_path, capacity_bytes=4 * SLOT, sync="data") as t:
        t._index.env = _SyncSpy(t._index.env, log)
        first, second, third = keys(0, 4), keys(10_000, 3), keys(20_000, 1)
        t.put_many(first, payload_for(first, SPEC.block_bytes))
        assert "index fsync" not in log  # fresh slots: nothing to undo
        log.clear()
        assert (t.put_many(second, payload_for(second, SPEC.block_bytes)) == PutResult.STORED).all()  # evicts 3
        assert log and log[0] == "index fsync" and "slab write" in log
        t.remove(second[:1])
        log.clear()
        t.put_many(third, payload_for(third, SPEC.block_bytes))  # the removed block's slot
        assert log and log[0] == "index fsync"
        assert read_all(t, second[1:]) == 2 and read_all(t, third) == 1


def test_map_full_grows_the_map(tmp_path):
    with WarmTier(SPEC, tmp_path, capacity_bytes=4096 * SLOT, map_size_bytes=64 << 10,
                  map_max_bytes=64 << 20) as t:
        first = t.stats().extra["map_size"]
        k = keys(0, 1500)
        assert (t.put_many(k, payload_for(k, SPEC.block_bytes)) == PutResult.STORED).all()
        assert t.stats().extra["map_size"] > first
        assert read_all(t, k) == 1500
    check_index(str(tmp_path / SPEC.namespace))


def test_map_full_at_the_limit_is_a_clear_error(tmp_path):
    with WarmTier(SPEC, tmp_path, capacity_bytes=4096 * SLOT, map_size_bytes=64 << 10,
                  map_max_bytes=128 << 10) as t:
        stored = keys(0, 20)
        t.put_many(stored, payload_for(stored, SPEC.block_bytes))
        k = keys(100_000, 2000)
        with pytest.raises(CapacityError, match="map limit"):
            t.put_many(k, payload_for(k, SPEC.block_bytes))
        assert read_all(t, stored) == 20 and t.match(k) == 0
    with WarmTier(SPEC, tmp_path) as t:  # a new handle (default map size) writes again
        assert (t.put_many(k[:100], payload_for(k[:100], SPEC.block_bytes)) == PutResult.STORED).all()
    check_index(str(tmp_path / SPEC.namespace))
    assert admin.verify(tmp_path)["ok"]


def test_readonly_handle(tmp_path):
    k = keys(0, 4)
    with WarmTier(SPEC, tmp_path, capacity_bytes=8 * SLOT) as t:
        t.put_many(k, payload_for(k, SPEC.block_bytes))
    with WarmTier(SPEC, tmp_path, readonly=True) as t:
        assert read_all(t, k) == 4
        for call in (lambda: t.put_many(k, payload_for(k, SPEC.block_bytes)), lambda: t.remove(k),
                     lambda: t.evict(1)):
            with pytest.raises(WarmTierUnavailable, match="read-only"):
                call()
        assert read_all(t, k) == 4


_RO_SCRIPT = r"""
import os, sys, numpy as np
from tieredkv import KVSpec, WarmTierUnavailable, chunk_keys
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import payload_for
root, step = sys.argv[1], sys.argv[2]
spec = KVSpec(model_id="test/warm-tiny", num_layers=2, num_kv_heads=1, head_dim=8, chunk_tokens=4)
k = chunk_keys(spec, np.arange(16))
if step == "make":
    with WarmTier(spec, root, capacity_bytes=8 * 4096) as t:
        t.put_many(k, payload_for(k, spec.block_bytes))
    sys.exit(0)
d = os.path.join(root, spec.namespace)
if os.geteuid() != 0:
    for dirpath, dirs, files in os.walk(d):  # make everything read-only, as its owner
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o400)
        os.chmod(dirpath, 0o500)
try:
    open(os.path.join(d, "probe"), "w")
    sys.exit("the directory is still writable: the test set-up failed")
except OSError:
    pass
t = WarmTier(spec, root)
assert t.readonly, "a read-only directory must open read-only"
out = np.zeros((4, spec.block_bytes), np.uint8)
assert t.get_many(k, out) == 4 and (out == payload_for(k, spec.block_bytes)).all()
try:
    t.put_many(chunk_keys(spec, np.arange(100, 116)), np.zeros((4, spec.block_bytes), np.uint8))
except WarmTierUnavailable as exc:
    print("refused:", exc)
else:
    sys.exit("put_many on a read-only tier did not raise")
assert t.get_many(k, out) == 4
t.close()
"""


@pytest.mark.procs
def test_readonly_directory_for_real(tmp_path):
    """A tier on a read-only filesystem (root: a read-only bind mount in a private mount namespace,
    since root ignores file modes) or without write permission (other users: chmod)."""
    root = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _RO_SCRIPT, root, "make"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    check = [sys.executable, "-c", _RO_SCRIPT, root, "check"]
    if os.geteuid() == 0:
        d = shlex.quote(root)
        cmd = " ".join(shlex.quote(c) for c in check)
        check = ["unshare", "-m", "sh", "-c",
                 f"mount --bind {d} {d} && mount -o remount,bind,ro {d} && exec {cmd}"]
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "read-only" in r.stdout
