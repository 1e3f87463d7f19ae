"""Running one function in a forked child process and getting its result back.

A session that streams to its file interprets each closed window of records (names, paths,
module facts, the span tree, the Parquet segment). In a thread of the user's process that work
holds the GIL for 7-8 µs per span, and the user's loop waits for it; a child forked at the
window's close does the same work beside the loop. Forking copies nothing up front (the child
shares the parent's pages until either writes), costs the parent about 10 ms per 500 MB of
memory, and gives the child every Python object the window refers to (modules, interned shapes)
without pickling any of them. Only the result (small: counts, the step state, warnings) comes
back, pickled through a pipe.

The child runs only the function: it ignores SIGINT (Ctrl-C reaches the whole process group; the
parent decides what happens), dies of SIGTERM and SIGHUP as a process without handlers does, and
leaves with ``os._exit`` whatever happens, so that nothing of the parent (``atexit`` handlers,
buffered output, the rest of the user's program) ever runs in it. The parent waits without the
GIL and gives up on a child past its deadline (a lock that another thread held at the fork), unless
the child is still runnable then (given a low priority on a busy machine, it waits for a CPU): it
gets the deadline again, a few times. An alarm ends such a child even when its parent is gone.

The result is read by its length, not to the pipe's end: a process the program forks on another
thread while the pipe is open holds a copy of its write end (fork copies every descriptor), and
the end would not come until that process exits.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

T = TypeVar("T")

READ_CHUNK: Final = 1 << 20
LENGTH: Final = struct.Struct("<Q")
"""The result's length in bytes, written before it: the parent knows when it has all of it."""
EXIT_CHECK_S: Final = 0.25
"""How often the parent, waiting for data, checks whether the child has died."""
STALLED_S: Final = 2.0
"""While the program ends (and waits for it), a helper whose CPU time has not moved for this long,
asleep or stopped, is stuck (a lock another thread held at the fork): it is stopped then rather
than at its deadline, which would hold the program's exit for a minute (past a scheduler's grace
period, and its SIGKILL would lose the trace file's end)."""
RUNNABLE_EXTENSIONS: Final = 4
"""A child still runnable at its deadline (waiting for a CPU, or on one: a helper of low priority
on a machine kept busy) is not stuck on a lock: it is given the deadline again, this many times."""


class ForkFailed(Exception):
    """The child could not run the function to the end; the message says why."""


def fork_available() -> bool:
    """True where a forked child can do the work: Linux (on macOS, system frameworks are unsafe
    in a child forked without ``exec``; Windows has no fork)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def run_forked(function: Callable[[], T], deadline_s: float, ending: threading.Event | None = None) -> T:
    """Run ``function()`` in a forked child and return what it returned.

    Once ``ending`` is set (the program is ending, and waits for this), a child that makes no
    progress for :data:`STALLED_S` (asleep or stopped, its CPU time unchanged) is stuck: it is
    killed then, not at its deadline.

    Raises:
        ForkFailed: the fork failed, ``function`` raised (the message names the exception), the
            child died, ran past ``deadline_s`` or stalled while the program ends (it is then killed).
    """
    read_fd, write_fd = os.pipe()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on any fork of a multi-threaded process; the child below only
            # runs code that takes no lock another thread of the user's may hold
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        raise ForkFailed(f"fork failed: {exc}") from None
    if pid == 0:
        _child(function, read_fd, write_fd, deadline_s)  # never returns
    os.close(write_fd)
    try:
        payload = _read_result(read_fd, pid, deadline_s, ending)
    finally:
        os.close(read_fd)
    try:
        succeeded, value = pickle.loads(payload)
    except Exception:
        raise ForkFailed("the helper process ended without a result") from None
    if not succeeded:
        raise ForkFailed(str(value))
    return value  # type: ignore[no-any-return]


def _child(function: Callable[[], object], read_fd: int, write_fd: int, deadline_s: float) -> None:
    status = 1
    try:
        os.close(read_fd)
        # a stopping signal sent to the program's process group (a scheduler's SIGTERM, Ctrl-C)
        # is the program's: the helper finishes its window, which the program's end then writes
        # (its alarm, and the parent's deadline, still bound it)
        for signum, action in ((signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, signal.SIG_IGN),
                               (signal.SIGHUP, signal.SIG_IGN), (signal.SIGALRM, signal.SIG_DFL)):
            signal.signal(signum, action)
        # ends the child past its last deadline even if the parent died
        signal.alarm(math.ceil(deadline_s * (1 + RUNNABLE_EXTENSIONS)) + 1)
        # the parent's objects are never garbage here: a collection would walk every one of them
        # (the program's, the model's), and its writes to their headers copy their pages
        gc.freeze()
        try:
            payload = pickle.dumps((True, function()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001 (the parent says what went wrong)
            payload = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
        view = memoryview(LENGTH.pack(len(payload)) + payload)
        while view:
            view = view[os.write(write_fd, view):]
        status = 0
    finally:
        os._exit(status)


def _read_result(read_fd: int, pid: int, deadline_s: float, ending: threading.Event | None = None) -> bytes:
    """The child's result, once all of it is read; the child is reaped. Empty where the child
    ended without writing it all.

    Raises:
        ForkFailed: ``deadline_s`` past, the child not runnable (it waits on something that never
            comes), or past its :data:`RUNNABLE_EXTENSIONS`; or, ``ending`` set, the child stalled
            (the child is then killed).
    """
    received = bytearray()
    expected: int | None = None
    exited = False
    deadline, extensions = time.monotonic() + deadline_s, 0
    progress: tuple[int, float] | None = None  # (the child's CPU ticks, when they last changed), while ending
    while expected is None or len(received) < expected:
        if ending is not None and ending.is_set() and not exited:
            progress = _progress(pid, progress)
            if progress is not None and time.monotonic() - progress[1] >= STALLED_S:
                _kill(pid)
                raise ForkFailed(f"the helper process made no progress for {STALLED_S:g} s while the program ended, "
                                 "and was stopped")
        remaining = deadline - time.monotonic()
        if remaining <= 0 and extensions < RUNNABLE_EXTENSIONS and _runnable(pid):
            deadline, extensions = deadline + deadline_s, extensions + 1
            continue
        if remaining <= 0:
            _kill(pid)
            raise ForkFailed("the helper process took too long and was stopped")
        ready, _, _ = select.select([read_fd], [], [], min(remaining, EXIT_CHECK_S))
        if not ready:
            if exited:  # what it wrote before it ended is all read: the rest never comes
                return b""
            exited = _ended(pid)
            continue
        chunk = os.read(read_fd, READ_CHUNK)
        if not chunk:  # every copy of the write end is closed
            break
        received += chunk
        if expected is None and len(received) >= LENGTH.size:
            (expected,) = LENGTH.unpack_from(received)
            del received[:LENGTH.size]
    if not exited:
        _reap(pid)
    return bytes(received) if expected is not None and len(received) == expected else b""


def _stat(pid: int) -> list[str] | None:
    """The child's ``/proc`` stat fields after its name (its state first); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _progress(pid: int, last: tuple[int, float] | None) -> tuple[int, float] | None:
    """The child's CPU ticks and when they last changed (``last``: as seen before), or None while
    it is running, waiting for a CPU or for the disk (state ``R`` or ``D``: not stuck), or ended."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("R", "D", "Z"):
        return None
    ticks = int(fields[11]) + int(fields[12])
    if last is None or last[0] != ticks:
        return ticks, time.monotonic()
    return last


def _runnable(pid: int) -> bool:
    """Whether the child is running or waiting for a CPU (its state in ``/proc``: ``R``)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "R"


def _ended(pid: int) -> bool:
    """True once the child has ended (it is then reaped)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped by someone else (a SIGCHLD handler of the program's)
        return True
    return done != 0


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return
    _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # reaped by someone else (a SIGCHLD handler of the program's)
        pass
