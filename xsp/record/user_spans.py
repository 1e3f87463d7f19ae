"""User spans and explicit steps at the model level: ``xsp.span`` and ``xsp.step``."""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, ClassVar, TypeVar

from xsp.core import state as _state
from xsp.core.clock import now_ns
from xsp.record.columns import COMPACT_AT
from xsp.record.marks import MarkKind
from xsp.record.nvtx import RangeKind
from xsp.record.sites import NO_SITE

_getframe = sys._getframe

AttributeValue = str | bool | int | float | list[str] | list[bool] | list[int] | list[float]
F = TypeVar("F", bound=Callable[..., Any])


class span:  # noqa: N801 - used like a function: ``with xsp.span("preprocess"):``
    """A user span at the model level, as a context manager or a decorator.

    Outside an active :func:`xsp.trace` block it records nothing and costs well under a
    microsecond. Keyword arguments become span attributes (strings, numbers, booleans,
    or lists of them; anything else is stored as its ``str``). The span records its call site
    (``call_file``, ``call_line``, ``call_function``): the ``with`` statement, or for a
    decorated function the user's line that called it (see :mod:`xsp.record.sites`).

    Example:
        >>> import xsp
        >>> with xsp.span("preprocess", images=8):
        ...     pass
    """

    __slots__ = ("name", "attributes", "_start", "_recording", "_site", "_ranged")
    _kind: ClassVar[int] = MarkKind.USER
    _range_kind: ClassVar[RangeKind] = RangeKind.USER

    def __init__(self, name: str, **attributes: AttributeValue) -> None:
        self.name = name
        self.attributes = attributes

    def __enter__(self) -> span:
        recording = self._recording = _state.recording
        # the with statement's frame, or (decorated) the traced function's, which is xsp's: the walk skips it
        self._site = NO_SITE if recording is None else recording.sites.of_frame(_getframe(1))
        ranges = None if recording is None else recording.nvtx
        self._ranged = ranges is not None
        if ranges is not None:  # Nsight's range, named as the span
            ranges.push(ranges.message(self.name, self._range_kind))
        if recording is not None and not hasattr(recording.local, "b"):
            recording.buffer()  # the thread's first: its buffer waits for the session's imports, untimed
        self._start = now_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        end = now_ns()
        recording = self._recording
        if recording is None:
            return
        if self._ranged and recording.nvtx is not None:
            recording.nvtx.pop()
        try:
            buffer = recording.local.b
        except AttributeError:
            buffer = recording.buffer()
        error = None if exc is None else f"{type(exc).__name__}: {exc}"
        buffer.marks.append((self._kind, self._start, end, self.name, self.attributes or None, error, self._site))
        if len(buffer.marks) >= COMPACT_AT:
            buffer.compact()

    def __call__(self, function: F) -> F:
        """Use as a decorator: every call of ``function`` is one span."""
        kind, name, attributes = type(self), self.name, self.attributes

        @functools.wraps(function)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with kind(name, **attributes):
                return function(*args, **kwargs)

        return traced  # type: ignore[return-value]


CONCURRENT_TASKS_NOTE = (
    "xsp.step() blocks of asyncio tasks that run at once on one thread overlapped: a thread's "
    "steps nest, so each took the model calls the others made meanwhile, and their steps are "
    "not the requests. For a step per request of an asyncio server, leave the steps to an "
    "always-on session (xsp.trace(sample=...): each model call under a request's OpenTelemetry "
    "span is a step of that request, docs/production.md), or give each request a thread of its own")
"""Said once, at the session's end, when an explicit step opened inside another one of another task."""

_opened_in_task: dict[int, int] = {}
"""Per thread's buffer (its ``id``) with an open explicit step: the asyncio task (its ``id``, 0
for none) its outermost open step began in."""


def _task_now() -> int:
    """The ``id`` of the asyncio task running on this thread, or 0 outside any."""
    try:
        return id(asyncio.current_task())
    except RuntimeError:  # no event loop runs on this thread
        return 0


def _note_if_tasks_overlap(recording: Any, buffer: Any) -> None:
    """An explicit step opens inside another one of this thread: in another asyncio task, the
    two are not nested, but interleaved; the user hears of it once."""
    task = _task_now()
    if task and task != _opened_in_task.get(id(buffer), task) and CONCURRENT_TASKS_NOTE not in recording.notes:
        recording.notes.append(CONCURRENT_TASKS_NOTE)


class step(span):  # noqa: N801
    """An explicit step: one training iteration or one request, with everything inside it.

    Everything inside an explicit step belongs to it: model calls, input waits and optimizer
    steps start or end no steps of their own (see :mod:`xsp.record.steps` for the automatic
    steps it overrides). A training iteration, a request: one step, one OTel trace.

    Example:
        >>> import xsp
        >>> with xsp.step("train_step"):
        ...     pass
    """

    __slots__ = ()
    _kind: ClassVar[int] = MarkKind.STEP
    _range_kind: ClassVar[RangeKind] = RangeKind.STEP

    def __init__(self, name: str = "step", **attributes: AttributeValue) -> None:
        super().__init__(name, **attributes)

    def __enter__(self) -> step:
        super().__enter__()
        if self._recording is not None:
            recording = self._recording
            buffer = recording.buffer()
            buffer.steps.finish()  # the automatic step before it ends here
            if buffer.open_steps:
                _note_if_tasks_overlap(recording, buffer)
            else:
                _opened_in_task[id(buffer)] = _task_now()
            buffer.open_steps += 1
            sampler = recording.sampler
            if sampler is not None and buffer.open_steps == 1 and not buffer.depth:
                sampler.step_begins(buffer, self._start)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, traceback)
        recording = self._recording
        if recording is None:
            return
        buffer = recording.buffer()
        buffer.open_steps -= 1
        if not buffer.open_steps:
            _opened_in_task.pop(id(buffer), None)
        end_ns = now_ns()
        duration_ns = end_ns - self._start
        outermost = not buffer.open_steps and not buffer.depth
        if (outermost and recording.on_long_step is not None
                and (duration_ns >= recording.long_step_ns or end_ns >= recording.report_after_ns)):
            recording.on_long_step(duration_ns)  # (an always-on session's sampler hears it there)
        elif outermost and recording.sampler is not None:
            recording.sampler.step_ended(duration_ns, buffer)
