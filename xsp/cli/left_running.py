"""What a script leaves running when its main thread ends, which Python waits for at exit.

Python does not exit when the main module returns. It runs ``threading``'s exit callbacks
(``concurrent.futures`` shuts its thread pools down in one, after their queued work), joins
every thread that is not a daemon, then runs ``atexit``'s functions, among them
``multiprocessing``'s, which joins the child processes that are not daemons. A script may
leave its work to any of these (a worker started and never joined, a serving loop, workers
that wait for the main thread to end, a pool's queued jobs, child processes): ``xsp run``
traces them to their end, and ends the trace at ``atexit``, after them. By then Python refuses
new thread-pool work: what writes and exports the trace does without one there
(:mod:`xsp.io.parquet`, :mod:`xsp.export.otlp`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class LeftRunning:
    """What was started since this object was made and that Python waits for at exit."""

    def __init__(self) -> None:
        self.threads_before: frozenset[threading.Thread] = frozenset(threading.enumerate())

    def threads(self, pool_workers: bool = True) -> list[threading.Thread]:
        """The threads started since that run still and are not daemons (xsp's own are daemons).
        ``pool_workers``: the workers of ``concurrent.futures`` thread pools too (Python runs
        their queued jobs at exit); an idle one never ends before that, and does nothing meanwhile."""
        current = threading.current_thread()
        workers = set() if pool_workers else _pool_workers()
        return [thread for thread in threading.enumerate()
                if thread not in self.threads_before and thread is not current and not thread.daemon
                and thread not in workers and thread.is_alive()]

    def any(self) -> bool:
        """Whether Python will wait for something the script started: a thread, or a child process."""
        return bool(self.threads()) or bool(_children())

    def working(self) -> bool:
        """Whether threads the script started run on that are neither daemons nor pool workers
        (which may sit idle until exit)."""
        return bool(self.threads(pool_workers=False))


def _pool_workers() -> set[threading.Thread]:
    """The worker threads of ``concurrent.futures``' thread pools, told apart as Python's own exit
    hook tells them (no public API lists them); none where the pools were never imported."""
    pools = sys.modules.get("concurrent.futures.thread")
    workers: Any = getattr(pools, "_threads_queues", None)
    try:
        return set(workers.keys()) if workers is not None else set()
    except Exception:  # a later Python's internals: no worker is told apart
        return set()


def _children() -> list[Any]:
    """``multiprocessing``'s child processes that run still and are not daemons (none where the
    script never imported it)."""
    if "multiprocessing" not in sys.modules:
        return []
    import multiprocessing

    try:
        return [child for child in multiprocessing.active_children() if not child.daemon]
    except Exception:  # an unusual start method or state: Python's own exit deals with them
        return []


def join_children() -> None:
    """Wait for the child processes that are not daemons, as ``multiprocessing``'s exit function
    would after xsp's (``atexit`` runs the latest first): their traces are collected at the end
    of the session, which comes after them."""
    for child in _children():
        child.join()
