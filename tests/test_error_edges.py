"""Errors at the edges are tieredkv errors, told apart by type, never by their message text."""

from __future__ import annotations

import errno
import sys

import pytest

from tieredkv import InvalidInput, TieredKVError, WarmTierUnavailable, policies
from tieredkv.errors import CapacityError, MissingDependency, Unsupported, UsageError


def test_policies_raise_tieredkv_errors():
    with pytest.raises(policies.UnknownPolicy, match="valid"):
        policies.make("no-such-policy")
    assert issubclass(policies.UnknownPolicy, InvalidInput) and issubclass(policies.UnknownPolicy, KeyError)
    with pytest.raises(InvalidInput, match="takes no parameters"):
        policies.make("lru", bogus=1)
    with pytest.raises(InvalidInput, match="small_ratio"):
        policies.make("s3fifo", small_ratio=2.0)
    with pytest.raises(InvalidInput, match="on_nth_hit"):
        policies.promotion.make("on_nth_hit:0")
    with pytest.raises(InvalidInput):
        policies.demotion.make(3)


def test_a_missing_client_library_is_a_missing_dependency_with_the_extra_to_install(monkeypatch):
    from tieredkv.remote.valkey_store import ValkeyStore

    monkeypatch.setitem(sys.modules, "valkey", None)  # import valkey -> ImportError
    with pytest.raises(MissingDependency, match=r"pip install 'tieredkv\[remote\]'") as e:
        ValkeyStore("127.0.0.1", 6379, {})
    assert isinstance(e.value, ImportError) and isinstance(e.value, TieredKVError)


def test_a_store_that_cannot_list_says_so_by_type():
    from tieredkv.remote.store import Store

    class Blind(Store):  # a store with none of the optional calls (Mooncake cannot list its names)
        scheme = "blind"

        def exists_many(self, names): ...
        def get_many(self, names, max_bytes, sink): ...
        def put_many(self, names, max_bytes, encode): ...
        def delete_many(self, names): ...
        def info(self): ...
        def close(self): ...

    with pytest.raises(Unsupported, match="cannot list its names"):
        list(Blind("127.0.0.1", 1, {}).scan("tkv"))
    assert not issubclass(Unsupported, InvalidInput)  # not a mistake in the call
    assert issubclass(UsageError, InvalidInput)


def test_a_full_disk_at_creation_is_a_capacity_error_by_errno_not_by_message():
    from tieredkv.warm.files import _disk_error as creation_error

    full = WarmTierUnavailable("cannot write to slab-0000.bin: (nothing a text check could match)",
                               errno=errno.ENOSPC)
    assert isinstance(creation_error("/x", full), CapacityError)
    other = WarmTierUnavailable("the disk is full, says the message, but no errno says so")
    assert creation_error("/x", other) is other
