"""The end of the session a followed child process runs (:mod:`xsp.session.children`): as the
process ends, its function returned or raised (``multiprocessing``'s exit hooks, or after the
traceback is printed), or a stopping signal with its default action came (``Pool.terminate``),
which then ends the process; abandoned where the parent's session has ended first."""

from __future__ import annotations

import multiprocessing.util
import os
import signal
import sys
import threading
from types import TracebackType
from typing import Any, Protocol

from xsp.session.children import ChildPlan
from xsp.session.signals import StopSignals, Terminated, end_by_signal

CHILD_END_DEADLINE_S = 30
"""A child process's session ended by a signal has this long to write its trace."""


class ChildSession(Protocol):
    """What ending a child's session takes of :class:`xsp.session.session.Session`."""

    running: threading.Event
    signals: StopSignals

    @property
    def active(self) -> bool: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Any: ...

    def abandon(self) -> None: ...


def end_with_process(session: ChildSession, plan: ChildPlan) -> None:
    """End ``session`` with the child process (``multiprocessing``'s exit hooks run when its
    function has returned or raised)."""
    multiprocessing.util.Finalize(session, end, args=(session, plan), exitpriority=100)


def end(session: ChildSession, plan: ChildPlan, signum: int | None = None) -> None:
    """End a child process's session: at its exit (the exception it is ending by, if any), or
    by the stopping signal ``signum`` (the process then ends by it)."""
    if not session.active:
        return
    try:
        if _unclaimed(session, plan):
            if signum is not None:
                end_by_signal(signum)
            return
        if signum is not None:
            if not session.running.is_set():  # still starting, here on this thread: nothing recorded yet
                end_by_signal(signum)
            signal.alarm(CHILD_END_DEADLINE_S)  # a lock held where the signal came would hang it: it dies instead
            session.__exit__(Terminated, Terminated(signum), None)  # ends the process by the signal
            return
        exc = sys.exc_info()[1]
        if exc is not None and not isinstance(exc, SystemExit) and _after_traceback(session, plan, exc):
            return
        session.__exit__(None if exc is None else type(exc), exc, None)
    except Exception:  # the child's exit is the program's: its trace is lost, and the session says so
        pass


def _unclaimed(session: ChildSession, plan: ChildPlan) -> bool:
    """The parent's session has ended (it removed its children folder): the child's trace would
    be no one's, and a file in a folder made again for it would be left behind. Its session is
    abandoned instead."""
    if os.path.isdir(plan.folder):
        return False
    session.abandon()
    return True


def _after_traceback(session: ChildSession, plan: ChildPlan, exc: BaseException) -> bool:
    """A child process ending by an exception writes its trace after ``multiprocessing`` has
    printed the traceback, as threads are shut down: a plain run prints it at once, and
    ``Pool.terminate`` after a Ctrl-C would otherwise kill the worker before it does. A stopping
    signal that comes meanwhile is dropped (the process is ending with its exit code already).
    False where that hook is missing (the trace is then written now)."""
    register = getattr(threading, "_register_atexit", None)  # CPython's hook before joining threads
    if register is None:
        return False
    try:
        register(_end_after_traceback, session, plan, exc)
    except Exception:  # threads already shutting down
        return False
    session.signals.hold_until_exit()
    return True


def _end_after_traceback(session: ChildSession, plan: ChildPlan, exc: BaseException) -> None:
    if not session.active:
        return
    program_alarm_s = signal.alarm(CHILD_END_DEADLINE_S)  # a lock left held would hang it: it dies instead
    try:
        if not _unclaimed(session, plan):
            session.__exit__(type(exc), exc, None)
    except Exception:  # the child's exit is the program's: its trace is lost, and the session says so
        pass
    finally:
        signal.alarm(program_alarm_s)
