"""Ending a session well when the process is told to stop (SIGTERM, SIGHUP, Ctrl-C).

A scheduler stops a job with SIGTERM (or SIGHUP when its terminal goes); left to the default
action, the process would die on the spot and the trace of a long run would be lost. While a
session runs in the main thread, xsp handles these signals itself:

* where the program left a signal's default action in place, the handler raises
  :class:`Terminated` in the main thread: the session's block unwinds, its file is written
  with everything recorded (the session span marked with the signal), and the session then
  delivers the signal again with its default action, so the process ends as it would have
  (but in a PID namespace's init, a container's PID 1, where the default is to ignore the
  signal: the handler does nothing, and the program goes on as it would have);
* where the program installed its own handler, that handler runs, as it would have; the
  session only notes the signal in its metadata;
* Ctrl-C keeps Python's behaviour (a ``KeyboardInterrupt``); while the session writes its
  file, a second Ctrl-C (or SIGTERM, SIGHUP) is held back until the file is complete.

Signals can only be handled in the main thread: a session that runs in another thread leaves
them alone. A signal the kernel gives to another thread is sent on to the main one
(:mod:`xsp.session._signals`): Python would only note it there, and a main thread waiting in a
semaphore (an idle ``Pool`` worker that ``Pool.terminate()`` stops) would never run the handler.
Where the main thread took the signal while it ran another signal's handler, CPython can leave it
noted and unhandled; the main thread is then woken until the handler runs (the same module).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Final

from xsp.core.threads import STOPPING_SIGNALS

try:
    from xsp.session._signals import give_up_after, handled, send_to_main_thread
except ImportError:  # not built: a signal that lands on another thread than xsp's is only noted there
    def send_to_main_thread(signum: int, /) -> bool:
        return False

    def handled() -> None:
        pass

    def give_up_after(signum: int, message: bytes | None, /) -> None:
        pass

GIVE_UP_S: Final = 5.0
"""How long a stopping signal left at its default waits for the main thread (xsp.session._signals:
its C code's ``GIVE_UP_NS``): a main thread waiting in native code that retries when a signal
interrupts it (a process group's rendezvous, a collective, a C++ queue) never runs the Python
handler; the process then ends by the signal as it would have at once without xsp, and not 125 s
later, when the wait timed out (or by the SIGKILL a launcher sends after its grace period)."""


class Terminated(BaseException):
    """The process received a stopping signal whose default action was to end it.

    Raised in the main thread so that ``with xsp.trace():`` can write its file; the session
    then ends the process by the same signal. A ``BaseException``, so that the program's
    ``except Exception`` blocks do not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """The stopping-signal handlers of one session (see the module docs).

    Args:
        on_default: where given, called with a stopping signal (not SIGINT) whose default action
            was to end the process, instead of raising :class:`Terminated`; it ends the process.
            A child process's session ends this way: the exception would unwind through
            ``multiprocessing``, which would print it.
    """

    def __init__(self, on_default: Callable[[int], None] | None = None) -> None:
        self.on_default = on_default
        self.pid = os.getpid()
        """The process the handlers are installed in (a child forked meanwhile inherits them)."""
        self.received: list[str] = []
        """Names of the stopping signals that arrived while the session ran, in order."""
        self._saved: dict[int, Any] = {}
        self._held: list[int] = []
        self._holding = False
        self._exiting = False
        self._on_stop: Callable[[int], None] | None = None

    def install(self, recover: Path | None = None) -> None:
        """Handle the stopping signals (main thread only; elsewhere a no-op). ``recover``: the
        trace file whose closed windows are on disk, which ``xsp recover`` writes where the process
        ends by a signal before the session could (see :data:`GIVE_UP_S`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.pid = os.getpid()
        for signum in STOPPING_SIGNALS:
            with contextlib.suppress(ValueError, OSError, TypeError):
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN or previous is None:  # ignored, or set outside Python
                    continue
                signal.signal(signum, self._on_signal)
                self._saved[signum] = previous
                if send_to_main_thread(signum) and previous is signal.SIG_DFL and signum != signal.SIGINT:
                    give_up_after(signum, _give_up_message(signum, recover))

    def _stop_giving_up(self) -> None:
        for signum in self._saved:
            with contextlib.suppress(ValueError, OSError, TypeError):
                give_up_after(signum, None)

    def end_by(self, on_stop: Callable[[int], None]) -> None:
        """From now on, a stopping signal whose action was the default (Ctrl-C's included) calls
        ``on_stop(signum)``, which ends the session and then the process by the signal, instead of
        raising in the main thread: the main thread has left the session's block (Python waits
        for the program's threads at exit, where an exception would be ignored and the process
        finalised with its threads still running)."""
        self._on_stop = on_stop

    def hold(self) -> None:
        """From now on, keep stopping signals for :meth:`release` (the file is being written)."""
        self._holding = True

    def hold_until_exit(self) -> None:
        """Hold stopping signals from now on, and drop them at :meth:`release`: the process is
        ending already (its exit code decided, its traceback printed), as a plain run would have
        before they came."""
        self._holding = self._exiting = True

    def release(self, ending_by: BaseException | None, before_delivery: Callable[[list[str]], None] | None = None
                ) -> None:
        """Put the program's own handlers back, then deliver what was held back, unless the
        process is already ending by that kind of signal (``ending_by``) or by its own exit
        (:meth:`hold_until_exit`); ``before_delivery`` is told the names of those delivered
        first (the process may end by them, before the caller could say anything)."""
        self._stop_giving_up()
        for signum, previous in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                if signal.getsignal(signum) == self._on_signal:  # the program may have replaced ours
                    signal.signal(signum, previous)
        self._saved.clear()
        held, self._held, self._holding = self._held, [], False
        if self._exiting:
            return
        delivered = [signum for signum in dict.fromkeys(held) if not (isinstance(ending_by, Terminated) or (
            isinstance(ending_by, KeyboardInterrupt) and signum == signal.SIGINT))]
        if delivered and before_delivery is not None:
            with contextlib.suppress(Exception):
                before_delivery([signal_name(signum) for signum in delivered])
        for signum in delivered:
            os.kill(os.getpid(), signum)

    def forget(self) -> None:
        """In a child forked while these handlers were installed: put the program's own back
        (the child's stopping signals are its own, as in a plain run)."""
        self._stop_giving_up()
        for signum, previous in self._saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                if signal.getsignal(signum) == self._on_signal:
                    signal.signal(signum, previous)
        self._saved.clear()
        self._held, self._holding = [], False

    def _on_signal(self, signum: int, frame: FrameType | None) -> Any:
        handled()  # the main thread ran this: it needs no more waking for it (xsp.session._signals)
        if os.getpid() != self.pid:  # a child forked before it could forget them (an at-fork hook still ran)
            self.forget()
            os.kill(os.getpid(), signum)  # the program's own action, as in a plain run
            return None
        self.received.append(signal_name(signum))
        if self._holding:
            self._held.append(signum)
            return None
        previous = self._saved.get(signum, signal.SIG_DFL)
        if previous is signal.SIG_DFL and signum != signal.SIGINT and init_ignores_default():
            return None  # the process is its namespace's init (a container's PID 1): its default is to go on
        if self._on_stop is not None and (previous is signal.SIG_DFL or previous is signal.default_int_handler):
            _children_unheard()
            self._on_stop(signum)
            return None
        if previous is signal.SIG_DFL:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            _children_unheard()
            if self.on_default is not None:
                self.on_default(signum)
            raise Terminated(signum)
        if callable(previous):
            return previous(signum, frame)
        return None


def _give_up_message(signum: int, recover: Path | None) -> bytes:
    """What is said where the process ends by ``signum`` before its handler could run."""
    what = (f"the trace file is not written (`xsp recover {recover}` writes it from the windows closed before)"
            if recover is not None else "its trace is lost")
    return (f"xsp: {signal_name(signum)} came while the main thread waited in native code that did not come back "
            f"within {GIVE_UP_S:g} s; the process ends by it now, as it would have without xsp, and {what}\n"
            ).encode(errors="replace")


_HANDLER_CODE = StopSignals._on_signal.__code__


def drop_handler_frames(error: BaseException) -> None:
    """Take the frames of xsp's signal handler out of ``error``'s traceback (in place): a Ctrl-C
    then shows the line the program was at, as in a plain run, not a line of xsp's it never wrote
    (the handler calls Python's own, which raises ``KeyboardInterrupt`` inside it)."""
    kept = None
    entry = error.__traceback__
    while entry is not None:
        if entry.tb_frame.f_code is not _HANDLER_CODE:
            kept = entry
        elif kept is None:
            error.__traceback__ = entry.tb_next
        else:
            kept.tb_next = entry.tb_next
        entry = entry.tb_next


def _children_unheard() -> None:
    """The program ends here by a stopping signal, as it would have at once without xsp: what its
    child processes do from now on is no longer its to hear. (A DataLoader's workers die by the
    same SIGTERM sent to the process group, and PyTorch's SIGCHLD handler would raise a
    ``RuntimeError`` into whatever the main thread runs next: the unwinding, xsp writing the
    file. A plain run never gets there.) The handler becomes a Python one that does nothing,
    not ``SIG_DFL``: a SIGCHLD already caught but not yet run would otherwise find no Python
    handler and print "Signal 17 ignored due to race condition"."""
    chld = getattr(signal, "SIGCHLD", None)
    if chld is None:
        return
    with contextlib.suppress(ValueError, OSError, TypeError):
        if callable(signal.getsignal(chld)):
            signal.signal(chld, _unheard)


def _unheard(signum: int, frame: FrameType | None) -> None:
    """A child's end the program no longer listens for (see ``_children_unheard``)."""


def init_ignores_default() -> bool:
    """Whether this process is the init of its PID namespace (PID 1: a container's program run
    without an init), to which the kernel delivers no signal whose action is the default: a
    SIGTERM it leaves at its default is ignored, and the program goes on as if none came."""
    return os.getpid() == 1


def end_by_signal(signum: int) -> None:
    """End the process by ``signum`` with its default action (after flushing Python's output);
    where the kernel does not deliver it (:func:`init_ignores_default`), with the status a shell
    gives a process that signal ended (128 + its number)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # reached only where the signal was not delivered
