"""A trace as stacks of frames: speedscope's evented JSON and folded ("collapsed") stacks.

Each thread's host spans become a call stack by their intervals (a span inside another on its
thread is called by it), each span a frame named as in the span table (``model``,
``model.blocks.0``, ``aten::addmm``). Where a span was made at a line of the user's code
(``call_file``/``call_line``) other than the line of the nearest frame below it, a frame for
that line (``train.py:42 Net.forward``) is put under it: so the frames read, from the root,
the line that called the model, the model, the line that called a layer, the layer... and a
flame graph of lines shows where in the user's code the time went. Kernels run on the GPU,
not on a thread's stack, and are left out.

* speedscope (https://www.speedscope.app, file format ``evented``): one profile per thread,
  times in nanoseconds from the first span; line frames carry ``file`` and ``line``.
* collapsed: one line per distinct stack, ``frame;frame;frame value``, the value the stack's
  self time in nanoseconds (flamegraph.pl, inferno, speedscope and others read it). A ``;`` in
  a frame's name becomes ``:``, and the first frame is the thread where a trace has several.

Spans that overlap without nesting (an imported trace's) are cut at their enclosing frame's end,
so every frame closes before its caller does: the stacks never hold more time than ran.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np
import pandas as pd

from xsp import __version__
from xsp.analysis.lines import line_label, relative_files, texts
from xsp.core import schema as col
from xsp.core.safe_text import one_line
from xsp.core.schema import Level
from xsp.io.outputs import write_output, write_text_output
from xsp.io.trace import Trace

SPEEDSCOPE_SCHEMA: Final = "https://www.speedscope.app/file-format-schema.json"


@dataclass(frozen=True)
class Frame:
    """One frame: a span's name, or a line of the user's code (with its file and line)."""

    name: str
    file: str | None = None
    line: int | None = None


@dataclass
class Event:
    """A frame opened (``opened``) or closed at ``at_ns`` on a thread (``(rank, thread_id)``,
    rank None for one process)."""

    thread: tuple[int | None, int]
    opened: bool
    frame: Frame
    at_ns: int


def frame_events(trace: Trace | pd.DataFrame) -> Iterator[Event]:
    """Every thread's frames opening and closing in order of time, balanced (each thread's in a
    block, threads in order of their first span)."""
    spans = trace.spans if isinstance(trace, Trace) else trace
    host = spans[(spans[col.LEVEL] != Level.KERNEL.value) & spans[col.THREAD_ID].notna()]
    if host.empty:
        return
    # a thread is (rank, thread id): two processes of a job may reuse an id
    ranks = (host[col.RANK].to_numpy(dtype=np.float64, na_value=-1) if col.RANK in host
             else np.full(len(host), -1.0)).astype(np.int64)
    thread_ids = host[col.THREAD_ID].to_numpy(dtype=np.int64)
    keys, threads = np.unique(np.stack([ranks, thread_ids], axis=1), axis=0, return_inverse=True)
    threads = threads.reshape(-1)
    labels = [(None if rank < 0 else int(rank), int(thread)) for rank, thread in keys]
    starts = host[col.START_NS].to_numpy(dtype=np.int64)
    ends = np.maximum(host[col.END_NS].to_numpy(dtype=np.int64), starts)
    depth = (host[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64) if col.CALL_DEPTH in host
             else np.zeros(len(host), dtype=np.int64))
    level_rank = host[col.LEVEL].map({level.value: level.rank for level in Level}).fillna(len(Level)).to_numpy(np.int64)
    names = texts(host, col.NAME)
    has_lines = col.CALL_LINE in host
    files = texts(host, col.CALL_FILE) if has_lines else np.full(len(host), None, dtype=object)
    numbers = (host[col.CALL_LINE].astype("Int64").to_numpy(dtype=np.float64, na_value=np.nan) if has_lines
               else np.full(len(host), np.nan))
    functions = texts(host, col.CALL_FUNCTION) if has_lines else np.full(len(host), None, dtype=object)
    shown = relative_files(files)
    first_seen = pd.unique(threads)
    order = np.lexsort((depth, level_rank, -ends, starts, pd.Categorical(threads, categories=first_seen).codes))
    stack: list[tuple[int, Frame, tuple[Any, Any] | None]] = []  # (end, frame, line of the frame or above)
    thread = -1  # an index into labels; none yet
    for i in order.tolist():
        if threads[i] != thread:
            while stack:
                end, frame, _ = stack.pop()
                yield Event(labels[thread], False, frame, end)
            thread = int(threads[i])
        start, end = int(starts[i]), int(ends[i])
        while stack and stack[-1][0] <= start:
            closed_at, frame, _ = stack.pop()
            yield Event(labels[thread], False, frame, closed_at)
        if stack:
            end = min(end, stack[-1][0])  # overlapping without nesting: cut at the caller's end
        line_above = stack[-1][2] if stack else None
        site = (files[i], numbers[i]) if files[i] is not None and not np.isnan(numbers[i]) else None
        if site is not None and site != line_above:
            label = line_label(shown[files[i]], int(numbers[i]), functions[i])
            line_frame = Frame(one_line(label), str(files[i]), int(numbers[i]))
            yield Event(labels[thread], True, line_frame, start)
            stack.append((end, line_frame, site))
        frame = Frame(one_line(str(names[i])))
        yield Event(labels[thread], True, frame, start)
        stack.append((end, frame, site if site is not None else line_above))
    while stack:  # (a stack holds frames only once a thread was met)
        end, frame, _ = stack.pop()
        yield Event(labels[thread], False, frame, end)


def _thread_label(thread: tuple[int | None, int], names: dict[tuple[int | None, int], str]) -> str:
    rank, thread_id = thread
    name = names.get(thread)
    return (f"rank {rank} " if rank is not None else "") + f"thread {thread_id}" + (f" ({name})" if name else "")


def speedscope_document(trace: Trace) -> dict[str, Any]:
    """The speedscope file of ``trace`` (see the module's docs), as a JSON-ready dict: what
    :func:`write_speedscope` writes, read back."""
    out = io.BytesIO()
    _write_speedscope(trace, out)
    return dict(json.loads(out.getvalue()))


def collapsed_stacks(trace: Trace) -> Counter[str]:
    """Each distinct stack (frames joined by ``;``) and its self time in nanoseconds."""
    totals: Counter[str] = Counter()
    several = len(trace.spans) > 0 and len(trace.spans[[col.RANK, col.THREAD_ID] if col.RANK in trace.spans
                                                       else [col.THREAD_ID]].dropna(subset=[col.THREAD_ID])
                                           .drop_duplicates()) > 1
    names = trace.thread_names()
    path: list[str] = []
    opened_at: list[int] = []
    inner_ns: list[int] = []
    for event in frame_events(trace):
        if event.opened:
            if not path and several:
                path.append(_thread_label(event.thread, names).replace(";", ":"))
                opened_at.append(event.at_ns)
                inner_ns.append(0)
            path.append(event.frame.name.replace(";", ":"))
            opened_at.append(event.at_ns)
            inner_ns.append(0)
            continue
        length = event.at_ns - opened_at[-1]
        own = length - inner_ns[-1]
        if own > 0:
            totals[";".join(path)] += own
        path.pop()
        opened_at.pop()
        inner_ns.pop()
        if inner_ns:
            inner_ns[-1] += length
        if len(path) == 1 and several:  # the thread's frame closes with its last frame
            path.pop()
            opened_at.pop()
            inner_ns.pop()
    return totals


EVENTS_PER_WRITE: Final = 65_536
"""Events of a profile encoded and written at a time: the file is written as the events come,
with no document of millions of events in memory."""


def write_speedscope(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as a speedscope file (open it at https://www.speedscope.app), atomically,
    profile by profile as the frames' events come (each thread's are in a block), the shared
    frames last (JSON's fields have no order), so that memory does not grow with the events.

    Raises:
        xsp.io.outputs.OutputError: the file could not be written (nothing is left at ``path``).
    """
    def write(temporary: Path) -> None:
        with open(temporary, "wb") as out:
            _write_speedscope(trace, out)

    return write_output(path, write)


def _write_speedscope(trace: Trace, out: BinaryIO) -> None:
    origin = int(trace.spans[col.START_NS].min()) if len(trace.spans) else 0
    names = trace.thread_names()
    service = trace.metadata.get("service_name") or "xsp trace"

    def encode(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    frames: dict[Frame, int] = {}
    out.write(b'{"$schema":' + encode(SPEEDSCOPE_SCHEMA) + b',"profiles":[')
    thread: tuple[int | None, int] | None = None
    end = 0
    batch: list[bytes] = []
    written = 0  # events of the open profile written so far

    def flush() -> None:
        nonlocal written
        if batch:
            out.write((b"," if written else b"") + b",".join(batch))
            written += len(batch)
            batch.clear()

    for event in frame_events(trace):
        at = event.at_ns - origin
        if event.thread != thread:
            if thread is not None:
                flush()
                out.write(b'],"endValue":' + encode(end) + b"},")
            thread, end, written = event.thread, at, 0
            out.write(b'{"type":"evented","name":' + encode(_thread_label(thread, names))
                      + b',"unit":"nanoseconds","startValue":' + encode(at) + b',"events":[')
        index = frames.setdefault(event.frame, len(frames))
        batch.append(b'{"type":"%s","frame":%d,"at":%d}' % (b"O" if event.opened else b"C", index, at))
        end = max(end, at)
        if len(batch) >= EVENTS_PER_WRITE:
            flush()
    if thread is not None:
        flush()
        out.write(b'],"endValue":' + encode(end) + b"}")
    shared = [{"name": f.name, **({"file": f.file} if f.file else {}), **({"line": f.line} if f.line else {})}
              for f in frames]
    out.write(b'],"shared":' + encode({"frames": shared}) + b',"name":' + encode(str(service))
              + b',"activeProfileIndex":0,"exporter":' + encode(f"xsp {__version__}") + b"}")


def write_collapsed(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace``'s folded stacks (``flamegraph.pl FILE > flame.svg``)."""
    stacks = collapsed_stacks(trace)
    return write_text_output(path, "".join(f"{stack} {value}\n" for stack, value in sorted(stacks.items())))


__all__ = ["frame_events", "speedscope_document", "collapsed_stacks", "write_speedscope", "write_collapsed",
           "Frame", "Event", "SPEEDSCOPE_SCHEMA"]
