"""xsp's own background threads, started with the stopping signals blocked in them.

The kernel gives a signal sent to the process to any thread that does not block it. Python runs
the handler only in the main thread, and a main thread waiting in a semaphore (an idle ``Pool``
worker) never runs it when the signal landed elsewhere: where a session handles SIGTERM, a worker
would then outlive ``Pool.terminate()``. No thread of xsp's takes these signals, nor do the
threads those start (Arrow's pool, started from a helper's first write, inherits the mask).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any, Final

STOPPING_SIGNALS: Final = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT")
                                if hasattr(signal, name))
"""The signals a session handles while it runs (:mod:`xsp.session.signals`)."""


def start_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """Start a daemon thread of xsp's that never takes a stopping signal."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return thread
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING_SIGNALS)  # a new thread inherits the mask
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
