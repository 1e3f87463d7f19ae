"""A window: the records drained from the recording's threads at once, each thread's share a
:class:`WindowBuffer` of columns. What tracers read to make span rows (``Tracer.collect``), and
what a forked helper process interprets beside the user's loop."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from xsp.record.columns import (
    BackwardColumns,
    CallColumns,
    Interner,
    MarkColumns,
    RootColumns,
    notes_buffer,
    split_packed_notes,
)
from xsp.record.sites import CallSites

HELD_WHOLLY: Final = -(2**62)
"""In :meth:`Window.held_since_ns`: every record of the thread belongs to a later window."""


@dataclass
class WindowBuffer:
    """The columns one thread recorded during one window (interners stay shared with the thread)."""

    thread_id: int
    thread_name: str
    call_columns: CallColumns
    mark_columns: MarkColumns
    backward_columns: BackwardColumns
    root_columns: RootColumns
    modules: Interner
    descriptors: Interner
    strings: Interner
    kept_steps: list[int] = field(default_factory=list)
    """Numbers of the scheduled steps in these columns, in order."""
    step_notes: list[tuple[int, ...]] = field(default_factory=list)
    """An always-on session's notes of these steps (:mod:`xsp.record.sampling`), by time."""
    packed_notes: bytearray = field(default_factory=notes_buffer)
    """More of them, packed (``ThreadBuffer.packed_notes``), by time."""

    def string(self, index: int) -> str | None:
        return None if index < 0 else self.strings.values[index]

    def since(self, start_ns: int) -> WindowBuffer:
        """The records of what started at or after ``start_ns`` (backward events: of calls that did)."""
        return dataclasses.replace(
            self, call_columns=split_columns(self.call_columns, self.call_columns.start, start_ns)[1],
            mark_columns=split_columns(self.mark_columns, self.mark_columns.start, start_ns)[1],
            backward_columns=split_columns(self.backward_columns, self.backward_columns.call, start_ns)[1],
            root_columns=split_columns(self.root_columns, self.root_columns.start, start_ns)[1],
            kept_steps=[], step_notes=[note for note in self.step_notes if note[0] >= start_ns],
            packed_notes=split_packed_notes(self.packed_notes, start_ns)[1])


@dataclass
class Window:
    """Records drained from the threads at once: what one round of ``Tracer.collect`` reads."""

    buffers: list[WindowBuffer]
    final: bool = False
    """True for the last window of a session (everything left at the end)."""
    derived: dict[str, Any] = field(default_factory=dict)
    """Results of interpreting the records, shared between tracers during collection."""
    dropped: Counter[str] = field(default_factory=Counter)
    """Records that could not be interpreted, by what they were."""
    external_ids: bool = False
    """Module calls pushed their start as a CUPTI external correlation id (CUDA levels on)."""
    model_names: dict[int, str] = field(default_factory=dict)
    """The name of each top-level model (by ``id``) recorded so far in the session."""
    step_numbers: list[int] | None = None
    """The numbers of the window's steps in order of their start, when the session numbers
    them itself (a schedule keeps only some steps)."""
    samples: list[Any] = field(default_factory=list)
    """The system level's records since the previous window: samples
    (:class:`xsp.record.samples.Sample`) and garbage collections (:class:`xsp.record.samples.GcPause`)."""
    ended_thread_ids: list[int] = field(default_factory=list)
    """Threads that have ended and recorded for the last time in this window: what the session
    keeps per thread for later windows is forgotten for them."""
    closed_ns: int | None = None
    """When the window was taken (host clock); None for the last one, which takes everything."""
    held_thread_ids: frozenset[int] = frozenset()
    """Threads whose records were left for a later window, all or those of their open step
    (inside a module call or a step): see :meth:`held_since_ns`."""
    held_from_ns: dict[int, int] = field(default_factory=dict)
    """Of :attr:`held_thread_ids`, the threads inside an automatic step whose decided steps this
    window took, each with where its open step began (``Recording.take_window``)."""
    sites: CallSites | None = None
    """The recording's call sites, which the site ids of the window's records index."""

    @classmethod
    def merged(cls, windows: list[Window]) -> Window:
        """Consecutive windows as one (a thread may then have several buffers, in order)."""
        dropped: Counter[str] = Counter()
        for window in windows:
            dropped.update(window.dropped)
        numbered = [window.step_numbers for window in windows if window.step_numbers is not None]
        last = windows[-1]
        return cls(buffers=[buffer for window in windows for buffer in window.buffers], final=last.final,
                   dropped=dropped, external_ids=any(window.external_ids for window in windows),
                   model_names={name: value for window in windows for name, value in window.model_names.items()},
                   step_numbers=[number for numbers in numbered for number in numbers] if numbered else None,
                   samples=[sample for window in windows for sample in window.samples],
                   ended_thread_ids=[thread for window in windows for thread in window.ended_thread_ids],
                   closed_ns=last.closed_ns, held_thread_ids=last.held_thread_ids, held_from_ns=last.held_from_ns,
                   sites=next((window.sites for window in windows if window.sites is not None), None))

    def held_since_ns(self) -> dict[int, int]:
        """For each held thread, from when its records belong to a later window: what was made
        elsewhere on it (CUPTI's records, the operator level's, garbage collections) that started
        at or after that time waits with its open step (:data:`HELD_WHOLLY`: all of it)."""
        return {thread: self.held_from_ns.get(thread, HELD_WHOLLY) for thread in self.held_thread_ids}

    @property
    def records(self) -> int:
        """Records of every kind in the window."""
        return sum(len(b.call_columns) + len(b.mark_columns) + len(b.backward_columns) for b in self.buffers)

    @property
    def empty(self) -> bool:
        """Nothing to interpret: no record, sample, drop count, ended thread or step number."""
        return not (self.records or self.samples or self.dropped or self.ended_thread_ids or self.step_numbers)


def split_columns(columns: Any, key: Any, cut_ns: int) -> tuple[Any, Any]:
    """``columns`` as two: the rows whose ``key`` is before ``cut_ns``, and the others."""
    before = [value < cut_ns for value in key]
    if all(before):
        return columns, type(columns)()
    if not any(before):
        return type(columns)(), columns
    first, second = type(columns)(), type(columns)()
    for name in type(columns).__slots__:
        values = getattr(columns, name)
        head = [value for value, early in zip(values, before) if early]
        tail = [value for value, early in zip(values, before) if not early]
        if isinstance(values, list):
            setattr(first, name, head)
            setattr(second, name, tail)
        else:
            getattr(first, name).fromlist(head)
            getattr(second, name).fromlist(tail)
    return first, second
