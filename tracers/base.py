"""The Tracer protocol every level's tracer implements.

Threading contract: ``start`` and ``stop`` are called on the session's thread; the tracer's
own callbacks may run on any thread and must only append to the :class:`~xsp.record.recording.Recording`
(or the tracer's own buffers) without locks or allocation beyond one tuple. ``collect`` is
called once per *window*: on a background thread while the session runs (when a long step
ends and spans are exported early) and once after ``stop``. Each call returns the spans
recorded since the previous one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import pandas as pd

    from xsp.core.schema import Level
    from xsp.record.recording import Recording, Window


@runtime_checkable
class Tracer(Protocol):
    """A source of spans at one level.

    ``collect`` returns a DataFrame whose columns are a subset of
    :data:`xsp.core.schema.COLUMNS` (at least level, kind, name, start_ns, end_ns, thread_id),
    with times on xsp's host clock (:func:`xsp.core.clock.now_ns`). Ids, parents, steps and
    paths are assigned afterwards by the session, so tracers never have to agree on them.
    """

    name: ClassVar[str]
    level: ClassVar[Level]

    def available(self) -> str | None:
        """None when the tracer can run here, else the reason it cannot."""

    def start(self, recording: Recording) -> None:
        """Begin recording into ``recording``."""

    def stop(self) -> None:
        """Stop recording; must not raise."""

    # Optional members a tracer may have:
    #   also_records: ClassVar[tuple[Level, ...]] -- levels besides ``level`` whose spans it writes
    #       (the model tracer's input waits);
    #   starts_first: ClassVar[bool] -- True when it must start (and stop) before the others (the CUDA
    #       levels: they take CUPTI's one subscription before the operator level's profiler can);
    #   collects_at_end: ClassVar[bool] -- True when its records only exist after ``stop``
    #       (the session then exports no step early, so no step leaves without its spans);
    #   interprets_in_child: ClassVar[bool] -- True when ``collect`` reads only the window and
    #       plain Python objects (no CUDA, no profiler state), so that a forked child can run it
    #       (a streaming session then interprets windows beside the user's loop, see xsp.session.forked);
    #   prepare(window) -- called in the session's process before ``collect`` (which may then run
    #       in a forked helper): take what only this process holds into the window (CUPTI's buffers);
    #   on_step_end() -- called (on the recording thread) when a step ends: a cheap hint to flush;
    #   metadata() -> dict -- facts for ``trace.metadata["tracer_details"][name]`` (clock offsets).

    def collect(self, window: Window) -> pd.DataFrame:
        """Span rows for what was recorded since the previous ``collect``.

        ``window`` holds what the shared :class:`~xsp.record.recording.Recording` drained from each
        thread; a tracer with buffers of its own drains those instead.
        """
