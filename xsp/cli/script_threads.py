"""The threads a script leaves running when its main thread ends, which Python waits for.

Python does not exit when the main module returns: it first runs ``threading``'s exit
callbacks (``concurrent.futures`` shuts its thread pools down in one), then joins every thread
that is not a daemon, then runs ``atexit``'s functions. A script may leave its work to such
threads (a worker started and never joined, a serving loop, workers that wait for the main
thread to end): ``xsp run`` traces them to their end, and ends the trace at ``atexit``, after
them. By then Python refuses new thread-pool work: what writes and exports the trace does
without one there (:mod:`xsp.io.parquet`, :mod:`xsp.export.otlp`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any


class ScriptThreads:
    """The threads started since this object was made that Python waits for at exit.

    Left out: daemon threads (Python does not wait for them), xsp's own (daemons too), and the
    workers of ``concurrent.futures`` thread pools: an idle pool that the script never shut down
    is common, and Python ends its workers at once at exit.
    """

    def __init__(self) -> None:
        self.before: frozenset[threading.Thread] = frozenset(threading.enumerate())

    def running(self) -> list[threading.Thread]:
        """The threads the script started that still run and that Python waits for at exit."""
        pool_workers = _pool_workers()
        current = threading.current_thread()
        return [thread for thread in threading.enumerate()
                if thread not in self.before and thread is not current and not thread.daemon
                and thread not in pool_workers and thread.is_alive()]


def _pool_workers() -> Collection[threading.Thread]:
    """The worker threads of ``concurrent.futures``' thread pools, told apart as Python's own exit
    hook tells them (no public API lists them); none where the pools were never imported."""
    import sys

    pools = sys.modules.get("concurrent.futures.thread")
    workers: Any = getattr(pools, "_threads_queues", None)
    try:
        return set(workers.keys()) if workers is not None else set()
    except Exception:  # a later Python's internals: no worker is told apart
        return set()
