"""Security defaults: private modes, refusing other users' segments and directories, tenant isolation in
every tier, and names derived from hostile model ids that stay inside their directory.

The suite runs as root here: "another user" is made with ``os.chown`` to a uid nobody uses.
"""

from __future__ import annotations

import os
import re
import stat

import numpy as np
import posix_ipc
import pytest

from helpers import kv_for, same_bytes
from tieredkv import HotTier, KVSpec, PermissionDenied, TieredCache, chunk_keys
from tieredkv.hot import segment as seg
from tieredkv.warm import WarmTier
from tieredkv.warm.testing import payload_for

OTHER_UID = 54321
MiB = 1 << 20
SPEC = KVSpec(model_id="test/security", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16",
              chunk_tokens=4)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_modes_segment_0600_directories_0700_files_0600(seg_name, tmp_path):
    old = os.umask(0)  # even with a permissive umask
    try:
        with TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path / "w", warm_bytes=MiB,
                         demotion="write_through") as c:
            tokens = np.arange(40)
            c.store(tokens, kv_for(SPEC, tokens))
            assert mode_of("/dev/shm" + seg_name) == 0o600
            tier = tmp_path / "w" / SPEC.namespace
            for dirpath, _, files in os.walk(tmp_path / "w"):
                assert mode_of(dirpath) == 0o700, dirpath
                for f in files:
                    assert mode_of(os.path.join(dirpath, f)) == 0o600, f
            assert (tier / "index.lmdb" / "data.mdb").exists() and list(tier.glob("slab-*.bin"))
    finally:
        os.umask(old)


@needs_root
def test_segment_owned_by_another_user_is_refused(seg_name):
    with HotTier(SPEC, n_slots=8, name=seg_name):
        pass
    os.chown("/dev/shm" + seg_name, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionDenied, match=f"owned by uid {OTHER_UID}.*another user"):
        HotTier(SPEC, n_slots=8, name=seg_name)
    with pytest.raises(PermissionDenied):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name)
    assert os.stat("/dev/shm" + seg_name).st_uid == OTHER_UID  # refused, not taken over


@needs_root
def test_warm_directory_owned_by_another_user_is_refused(tmp_path, seg_name):
    with WarmTier(SPEC, tmp_path, capacity_bytes=8 * 4096):
        pass
    d = tmp_path / SPEC.namespace
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionDenied, match=f"belongs to uid {OTHER_UID}"):
        WarmTier(SPEC, tmp_path)
    # Through TieredCache: refused at construction, not degraded into silently using it.
    with pytest.raises(PermissionDenied):
        TieredCache(SPEC, hot_bytes=MiB, hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB)


@needs_root
@pytest.mark.parametrize("planted", ["meta.json", "slab-0000.bin", "index.lmdb/data.mdb", "index.lmdb"])
def test_file_of_another_user_inside_our_warm_directory_is_refused(tmp_path, planted):
    """Regression: only the directory's owner was checked; a slab, meta or index file planted by another
    user (able to read our prompts or feed us KV) was used silently."""
    with WarmTier(SPEC, tmp_path, capacity_bytes=8 * 4096):
        pass
    target = tmp_path / SPEC.namespace / planted
    os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionDenied, match=f"{re.escape(str(target))} belongs to uid {OTHER_UID}"):
        WarmTier(SPEC, tmp_path)
    os.chown(target, 0, 0)
    WarmTier(SPEC, tmp_path).close()


def test_symlink_inside_the_warm_directory_is_refused(tmp_path):
    """Regression: a slab replaced by a symlink made the tier write prompts' KV wherever it points."""
    with WarmTier(SPEC, tmp_path, capacity_bytes=8 * 4096):
        pass
    slab = tmp_path / SPEC.namespace / "slab-0000.bin"
    elsewhere = tmp_path / "elsewhere.bin"
    os.rename(slab, elsewhere)
    os.symlink(elsewhere, slab)
    with pytest.raises(PermissionDenied, match="symbolic link"):
        WarmTier(SPEC, tmp_path)


# ---- tenant isolation -------------------------------------------------------------------------------
def test_a_prefix_stored_under_one_salt_is_found_under_no_other_in_any_tier(seg_name, tmp_path):
    tenants = [b"", b"alice", b"bob", b"alice\x00"]
    tokens = np.arange(1000, 1000 + 4 * 6 + 1)
    with TieredCache(SPEC, hot_bytes=MiB,
                     hot_name=seg_name, warm_dir=tmp_path, warm_bytes=MiB, demotion="write_through") as c:
        c.store(tokens, kv_for(SPEC, tokens, b"alice"), salt=b"alice")
        # alice's blocks are in both tiers (write-through)
        k_alice = chunk_keys(SPEC, tokens[:24], b"alice")
        assert c.hot.contains_many(k_alice).all() and c.warm.contains_many(k_alice).all()
        for other in tenants:
            if other == b"alice":
                continue
            k = chunk_keys(SPEC, tokens[:24], other)
            assert not c.hot.contains_many(k).any() and not c.warm.contains_many(k).any()
            assert c.lookup(tokens, salt=other).tokens == 0
        # Now only in warm: drop the hot copies; still alice's alone.
        c.hot.remove(k_alice)
        hit = c.lookup(tokens, salt=b"alice")
        assert (hit.tokens, hit.warm_blocks) == (24, 6)
        out = np.zeros_like(kv_for(SPEC, tokens))
        assert c.load(hit, out) == 24
        assert same_bytes(out[:, :, :, :24], kv_for(SPEC, tokens, b"alice")[:, :, :, :24])
        for other in (b"", b"bob", b"alice\x00"):
            assert c.lookup(tokens, salt=other).tokens == 0


# ---- hostile model ids ---------------------------------------------------------------------------------
HOSTILE = ["../../etc", "a/b", "../", "..", "модель/模型-😀", "x" * 300, "evil\x00name", "a b/c\td",
           "/abs/path/..", "C:\\Windows\\..\\x", "-rf", ".hidden"]


@pytest.mark.parametrize("model_id", HOSTILE)
def test_names_from_hostile_model_ids_are_sanitised(model_id, tmp_path):
    spec = KVSpec(model_id=model_id, num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*-[a-z0-9]+-tp0of1-[0-9a-f]{16}", spec.namespace), spec.namespace
    name = seg.default_name(spec)
    assert seg.check_name(name) == name and len(name) <= 100
    root = tmp_path / "root"
    root.mkdir()
    before = set(os.listdir(tmp_path))
    with WarmTier(spec, root, capacity_bytes=4 * 4096) as t:
        assert t.path.parent == root and os.path.realpath(t.path).startswith(str(root) + os.sep)
    assert os.listdir(root) == [spec.namespace]
    assert set(os.listdir(tmp_path)) == before  # nothing created beside the root
    try:
        with HotTier(spec, n_slots=4) as h:
            assert os.path.exists("/dev/shm/" + h.name.lstrip("/"))
            assert "/" not in h.name[1:] and re.fullmatch(r"/tieredkv-[a-z0-9-]+", h.name)
    finally:
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass


def test_two_hostile_ids_that_slug_alike_stay_apart(tmp_path):
    """Two orgs' models named alike share a slug; the fingerprint keeps segments and directories apart."""
    a = KVSpec(model_id="org-one/llama", num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    b = KVSpec(model_id="../org-two/Llama", num_layers=1, num_kv_heads=1, head_dim=8, chunk_tokens=4)
    assert a.slug == b.slug and a.namespace != b.namespace
    assert seg.default_name(a) != seg.default_name(b)
    ka, kb = chunk_keys(a, np.arange(8)), chunk_keys(b, np.arange(8))
    assert not (ka.keys == kb.keys).all(axis=1).any()
    with WarmTier(a, tmp_path, capacity_bytes=4 * 4096) as t:
        t.put_many(ka, payload_for(ka, a.block_bytes))
    with WarmTier(b, tmp_path, capacity_bytes=4 * 4096) as t:
        assert t.contains_many(kb).tolist() == [False, False]
    assert sorted(os.listdir(tmp_path)) == sorted([a.namespace, b.namespace])
