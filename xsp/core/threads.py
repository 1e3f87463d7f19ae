"""xsp's own background threads, started with the stopping signals blocked in them, each named
in the operating system as in Python (``top -H``, ``ps -L``, ``perf`` and ``/proc/PID/task/*/comm``
then tell xsp's threads from the program's, where every thread of Python's own is ``python``).

The kernel gives a signal sent to the process to any thread that does not block it. Python runs
the handler only in the main thread, and a main thread waiting in a semaphore (an idle ``Pool``
worker) never runs it when the signal landed elsewhere: where a session handles SIGTERM, a worker
would then outlive ``Pool.terminate()``. No thread of xsp's takes these signals, nor do the
threads those start (Arrow's pool, started from a helper's first write, inherits the mask).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

STOPPING_SIGNALS: Final = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT")
                                if hasattr(signal, name))
"""The signals a session handles while it runs (:mod:`xsp.session.signals`)."""


OS_NAME_BYTES: Final = 15
"""The longest thread name Linux keeps (16 bytes with its terminating zero)."""
_PR_SET_NAME: Final = 15


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here, at the first thread's start: what imports this module (every command) need not

    try:
        # the process's own symbols, libc's among them (find_library would run ldconfig in a subprocess)
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the operating system (its first 15 bytes; Linux
    only, and nothing where it cannot be set)."""
    prctl = _prctl()
    if prctl is not None:
        with contextlib.suppress(Exception):
            prctl(_PR_SET_NAME, name.encode()[:OS_NAME_BYTES], 0, 0, 0)


_own_threads: set[int] = set()
"""The idents of the threads :func:`start_thread` started that are running."""


def on_own_thread() -> bool:
    """Whether the calling thread is one of xsp's (started by :func:`start_thread`): what it
    does is xsp's work, not the program's."""
    return threading.get_ident() in _own_threads


def _named(target: Callable[..., Any], name: str) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        ident = threading.get_ident()
        _own_threads.add(ident)
        try:
            name_this_thread(name)
            return target(*args)
        finally:
            _own_threads.discard(ident)

    return run


def start_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """Start a daemon thread of xsp's that never takes a stopping signal, named ``name`` in Python
    and in the operating system."""
    thread = threading.Thread(target=_named(target, name), args=args, name=name, daemon=True)
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return thread
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING_SIGNALS)  # a new thread inherits the mask
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
