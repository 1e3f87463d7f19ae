"""When an always-on session starts the work of a closed window: in the first pause of the
program's steps, so that the helper process (its fork, which holds the interpreter's lock while
the page tables are copied; its CPU time; the pages the program copies while it lives) falls
between a service's requests instead of among them.

A window comes due at a step's end, so in a service loaded in bursts it was always taken, and
its helper forked, in the middle of a burst: measured on the example service
(benchmarks/production.py), windows cost 1-2.6 points of the median latency and most of the
99th percentile's 8-27%. The window is still taken at the step's end (a fraction of a
millisecond); only its interpretation waits, for a pause (no step begun for :data:`PAUSE_S` and
none under way, seen twice with no step begun between) or until :data:`WAIT_FRACTION` of the
window interval has passed, whichever comes first, or until the next window is taken
(windows that come due by their size, every few seconds under a heavy load, do not pile up).
A service that never pauses has its windows interpreted as before, that much later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

from xsp.core.clock import now_ns

PAUSE_S: Final = 0.25
"""No step begun for this long, and none under way: the program has paused (a service between
bursts of requests)."""
LOOKS_PER_PAUSE: Final = 5
"""While a step longer than :data:`PAUSE_S` is under way, how often it is looked at again, per
:data:`PAUSE_S`."""
CONFIRM_FRACTION: Final = 0.2
"""A pause seen once is looked at again this fraction of :data:`PAUSE_S` later, and is one only if
no step began in between: slow steps back to back (requests of 0.4 s, one after another) leave a
gap of microseconds between one step's end and the next one's start, milliseconds on a busy
machine, and a look that falls in it would otherwise take it for a pause."""
WAIT_FRACTION: Final = 0.5
"""A closed window waits for a pause at most this fraction of the window interval after it was
taken: its spans reach the file (and the collector) at most 1.5 intervals after they happened."""


class PauseWait:
    """Waits for a pause in the program's steps, told by when the last step began and whether a
    step is under way. It looks when a pause could first be seen (:data:`PAUSE_S` after the last
    step began): while steps keep coming, about four times a second.

    Args:
        last_begun_ns: when the last step began, on any thread (host clock, as
            :func:`xsp.core.clock.now_ns`; the always-on sampler's).
        step_running: whether a step is under way now (a thread inside a module call).
        longest_wait_s: the longest a window waits after it was taken.
        pause_s: how long without a step begun makes a pause.
    """

    def __init__(self, last_begun_ns: Callable[[], int], step_running: Callable[[], bool], longest_wait_s: float,
                 pause_s: float = PAUSE_S) -> None:
        self.last_begun_ns = last_begun_ns
        self.step_running = step_running
        self.longest_wait_ns = int(longest_wait_s * 1e9)
        self.pause_ns = int(pause_s * 1e9)
        self.confirm_ns = max(1, int(self.pause_ns * CONFIRM_FRACTION))
        self.hurry = threading.Event()
        """Set: no more waiting (the session ends)."""
        self.after_pause = 0
        """Windows whose work started in a pause of the steps."""
        self.past_wait = 0
        """Windows whose work started with the steps going on: their longest wait was over, or
        the next window was taken."""
        self.at_once = 0
        """Windows whose work started without waiting: a capture was being recorded, or the
        session was ending."""

    def as_metadata(self) -> dict[str, int]:
        """How many windows' work began each way (the file's ``window_waits``)."""
        return {"after_pause": self.after_pause, "past_wait": self.past_wait, "at_once": self.at_once}

    def wait(self, taken_ns: int, skip: Callable[[], bool], next_taken: Callable[[], bool]) -> None:
        """Return once the steps pause, ``longest_wait_s`` after ``taken_ns`` (the window's
        taking, host clock), once ``next_taken()`` says the next window is taken, when
        :attr:`hurry` is set, or when ``skip()`` says not to wait (a capture is being recorded:
        its caller waits for the file). Each way is counted."""
        deadline_ns = taken_ns + self.longest_wait_ns
        pause_began_after_ns: int | None = None  # the last step's start when a pause was first seen
        while not self.hurry.is_set() and not skip():
            now = now_ns()
            if now >= deadline_ns or next_taken():
                self.past_wait += 1
                return
            begun_ns = self.last_begun_ns()
            quiet_ns = now - begun_ns
            if quiet_ns < self.pause_ns:  # look again when this quiet could have become a pause
                pause_began_after_ns = None
                sleep_ns = self.pause_ns - quiet_ns
            elif self.step_running():  # a long step under way
                pause_began_after_ns = None
                sleep_ns = self.pause_ns // LOOKS_PER_PAUSE
            elif pause_began_after_ns == begun_ns:  # seen twice, no step begun between: a pause
                self.after_pause += 1
                return
            else:  # maybe only the gap between two long steps: look once more
                pause_began_after_ns = begun_ns
                sleep_ns = self.confirm_ns
            self.hurry.wait(min(sleep_ns, deadline_ns - now) / 1e9)
        self.at_once += 1
