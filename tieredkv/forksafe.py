"""Fresh locks in a forked child.

``fork`` copies a process with one thread, the one that forked, but with every lock in the state it had
at that instant. A lock held by another thread then (the write-behind writer inside a warm write, the
remote writer inside a send, a reader inside ``WarmTier``) stays held in the child forever, and the
child's first ``lookup`` waits on it for ever. Servers fork after their caches are open
(multiprocessing's "fork" start method, gunicorn's pre-fork workers, some of vLLM's worker paths).

Objects that own locks register here; in the child, right after ``fork`` and before any other code of
the child runs, every lock, condition and event in a registered object's attributes is re-initialised
unlocked, then the object's ``_after_fork_in_child()`` runs, if it has one (to drop queues and
forget threads that did not survive; a child starts its own lazily). The parent is untouched.

Some state cannot be renewed that way: an LMDB environment with a transaction open on another thread
cannot even be closed in the child (py-lmdb waits for that thread's transaction to end, for ever). An
object that owns such state defines ``_before_fork()``, which runs in the parent just before ``fork``
and may wait (bounded) for its in-flight work to end, and ``_after_fork_in_parent()``, which lets the
parent go on. numba's compiler lock (policy kernels compile on first use, on a writer thread too) is
treated the same way: ``fork`` waits for a compilation under way, and the child's copy is unlocked.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event)
_objects: weakref.WeakSet = weakref.WeakSet()
_functions: list[Callable[[], None]] = []
_quiesced: list = []  # objects whose _before_fork ran for the fork under way (strong refs until after)


def register(obj: object) -> None:
    """Renew ``obj``'s locks in every forked child of this process (held weakly: no leak)."""
    _objects.add(obj)


def register_function(fn: Callable[[], None]) -> None:
    """Call ``fn`` in every forked child (module-level locks)."""
    _functions.append(fn)


def renew(lock) -> None:
    """Re-initialise one lock, condition or event unlocked (the interpreter's own at-fork way)."""
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


#: How long ``fork`` waits for a JIT compilation under way (numba, which the policies may use).
JIT_WAIT_S = 60.0
_jit_held = False


def _jit_lock():
    """numba's process-wide compiler lock, if numba is loaded (a policy kernel compiles on first use, on
    whatever thread runs it: a writer's). Held by another thread at fork, it stays held in the child,
    and the child's first eviction waits on it for ever."""
    module = sys.modules.get("numba.core.compiler_lock")
    return getattr(getattr(module, "global_compiler_lock", None), "_lock", None)


def _before() -> None:
    global _jit_held
    lock = _jit_lock()
    # Wait for a compilation under way to end rather than copy numba half way through one.
    _jit_held = lock is not None and lock.acquire(timeout=JIT_WAIT_S)
    _quiesced.clear()
    for obj in list(_objects):
        hook = getattr(obj, "_before_fork", None)
        if hook is not None:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a fork must happen whatever one object says
                continue
            _quiesced.append(obj)


def _in_parent() -> None:
    global _jit_held
    if _jit_held:
        _jit_held = False
        _jit_lock().release()
    for obj in reversed(_quiesced):
        try:
            obj._after_fork_in_parent()
        except Exception:  # noqa: BLE001 - see _before
            pass
    _quiesced.clear()


def _in_child() -> None:
    global _jit_held
    _jit_held = False
    lock = _jit_lock()
    if lock is not None:
        renew(lock)
    _quiesced.clear()
    for fn in list(_functions):
        try:
            fn()
        except Exception:  # noqa: BLE001 - one object failing must not leave the others locked
            pass
    for obj in list(_objects):
        try:
            for value in list(vars(obj).values()):
                if isinstance(value, _LOCK_TYPES):
                    renew(value)
            hook = getattr(obj, "_after_fork_in_child", None)
            if hook is not None:
                hook()
        except Exception:  # noqa: BLE001 - see above
            pass


os.register_at_fork(before=_before, after_in_parent=_in_parent, after_in_child=_in_child)
