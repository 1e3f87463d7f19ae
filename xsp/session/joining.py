"""Which session holds the process, and the blocks that joined it.

One session at a time records a process: its recording is the one the tracers and
:func:`xsp.span` write into (:mod:`xsp.core.state`). An ``xsp.trace()`` entered while it runs,
nested or on another thread, joins it instead: its calls go into that session's recording (and
a copy of its own thread's records makes its own trace). If such a block is still inside when
the session ends, the first of them takes the recording over, without a gap (docs/steps.md).

:class:`ProcessClaim` is that state, under one lock: the session that holds the process, and
the blocks waiting to take over from it. A session takes the process, joins, leaves and hands
over through it alone.
"""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar

from xsp.core import state
from xsp.record.recording import Recording


class Joiner(Protocol):
    """What the claim asks of a block that joined the active session."""

    def adopt(self, recording: Recording | None) -> None:
        """Take the ended session's recording over (see ``Session.adopt``)."""
        ...


B = TypeVar("B", bound=Joiner)


class ProcessClaim(Generic[B]):
    """The session that holds the process (:attr:`active`) and the blocks that joined it and are
    still inside (:attr:`waiting`, in the order they joined). Read and changed under :attr:`lock`,
    which the caller holds for each method but :meth:`after_fork`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Held while a session checks for an active one and takes its place (two threads at once)."""
        self.active: B | None = None
        self.waiting: list[B] = []

    def take(self, session: B, recording: Recording) -> None:
        """``session`` holds the process from now on, recording into ``recording``."""
        self.active = session
        state.recording = recording

    def join(self, block: B) -> None:
        """``block`` joined the active session: it may take over when that one ends."""
        self.waiting.append(block)

    def leave(self, block: B) -> None:
        """``block`` ended before the session it joined: it takes nothing over."""
        if block in self.waiting:
            self.waiting.remove(block)

    def hand_over(self, recording: Recording | None, allowed: bool = True) -> B | None:
        """The active session ends: the first block still waiting takes ``recording`` over and
        holds the process (returned), or, with none waiting (or ``allowed`` False: the process is
        ending), no session holds it."""
        successor = self.waiting.pop(0) if allowed and self.waiting else None
        if successor is not None:
            successor.adopt(recording)
        self.active = successor
        if successor is None:
            state.recording = None
        return successor

    def release(self, session: B) -> None:
        """``session`` gives the process up without handing it over (it could not start, or it
        was abandoned)."""
        if self.active is session:
            self.active = None
            state.recording = None

    def forget(self) -> None:
        """No session holds the process, and none waits (a test that left one behind)."""
        self.active = None
        state.recording = None
        self.waiting.clear()

    def after_fork(self) -> B | None:
        """In a child just forked: a lock of its own (another thread of the parent may have held
        this one at the fork), and no session; returns the one that held the parent."""
        self.lock = threading.Lock()
        held = self.active
        self.forget()
        return held
