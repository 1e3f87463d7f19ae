"""The base class every level's tracer derives from.

Threading contract: ``start`` and ``stop`` are called on the session's thread; the tracer's
own callbacks may run on any thread and must only append to the :class:`~xsp.record.recording.Recording`
(or the tracer's own buffers) without locks or allocation beyond one tuple. ``collect`` is
called once per *window*: on a background thread while the session runs (when a long step
ends and spans are exported early) and once after ``stop``. Each call returns the spans
recorded since the previous one.

The optional hooks have no-op defaults here, so that the session calls them on every tracer
and mypy checks each tracer's against them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pandas as pd

    from xsp.core.schema import Level
    from xsp.record.recording import Recording
    from xsp.record.window import Window


class Tracer(ABC):
    """A source of spans at one level.

    ``collect`` returns a DataFrame whose columns are a subset of
    :data:`xsp.core.schema.COLUMNS` (at least level, kind, name, start_ns, end_ns, thread_id),
    with times on xsp's host clock (:func:`xsp.core.clock.now_ns`). Ids, parents, steps and
    paths are assigned afterwards by the session, so tracers never have to agree on them.
    A tracer installed as a plugin (the ``xsp.tracers`` entry-point group) derives from it too.
    """

    name: ClassVar[str]
    level: ClassVar[Level]
    also_records: ClassVar[tuple[Level, ...]] = ()
    """Levels besides ``level`` whose spans it writes (the model tracer's input waits)."""
    starts_first: ClassVar[bool] = False
    """It starts (and stops) before the others: the CUDA levels take CUPTI's one subscription
    before the operator level's profiler can."""
    collects_at_end: bool = False
    """Its records only exist after ``stop``: the session then exports no step early, so that no
    step leaves without its spans."""
    interprets_in_child: bool = False
    """``collect`` reads only the window and plain Python objects (no CUDA, no profiler state),
    so that a forked helper can run it (a streaming session then interprets windows beside the
    user's loop, see :mod:`xsp.session.forked`)."""

    def available(self) -> str | None:
        """None when the tracer can run here, else the reason it cannot."""
        return None

    @abstractmethod
    def start(self, recording: Recording) -> None:
        """Begin recording into ``recording``."""

    @abstractmethod
    def stop(self) -> None:
        """Stop recording; must not raise."""

    @abstractmethod
    def collect(self, window: Window) -> pd.DataFrame:
        """Span rows for what was recorded since the previous ``collect``.

        ``window`` holds what the shared :class:`~xsp.record.recording.Recording` drained from each
        thread; a tracer with buffers of its own drains those instead.
        """

    def prepare(self, window: Window) -> None:
        """Called in the session's process before ``collect`` (which may then run in a forked
        helper): take what only this process holds into the window (CUPTI's buffers)."""
        return None  # nothing to take, by default

    def step_end_hook(self) -> Callable[[], None] | None:
        """What to call (on the recording thread) when a step ends, a cheap hint to flush; None
        for nothing (asked once, as the session starts)."""
        return None

    def metadata(self) -> dict[str, Any] | None:
        """Facts for ``trace.metadata["tracer_details"][name]`` (clock offsets); None: none."""
        return None
