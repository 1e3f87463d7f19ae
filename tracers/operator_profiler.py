"""The operator and memory levels read from PyTorch's profiler (the :class:`xsp.tracers.operator.OperatorTracer`'s
way where xsp's operator observer is not available).

PyTorch's profiler runs in CPU-only mode (no CUDA activities, so it never holds CUPTI, which
the cuda_api and kernel levels need) with shapes recorded and every thread profiled. When the
session ends, its events are read directly (``kineto_results.events()``: no JSON round trip)
and become spans: the operator's name, input shapes and dtypes, thread and autograd sequence
number (a backward operator carries the sequence number of the forward operator it
differentiates). Nested operators (``aten::linear`` > ``aten::addmm``) nest by time like every
other span; they run inside the model level's own optimizer-step spans, so PyTorch's
``Optimizer.step#...`` annotations are left out.

Two things are matched up with markers the tracer records through the profiler itself:

* **Clock.** The profiler stamps events in epoch nanoseconds from its own approximate clock.
  At start the tracer brackets a marker between readings of xsp's host clock; the tightest
  bracket gives the offset (and its uncertainty, kept in the metadata).
* **Threads.** The profiler numbers threads in the order they first record (1, 2, ...). Each
  thread that records a module call leaves a marker naming its OS thread id, so operators
  land on the same ``thread_id`` as the layers around them. Threads that never record a
  module call (autograd's device threads) keep the profiler's number, negated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.core.threads import start_thread
from xsp.record.operator_lines import LineChanges, operator_sites
from xsp.record.sites import NO_SITE, CallSites

CLOCK_MARKER = "xsp::clock"
THREAD_MARKER = "xsp::thread#"
SKIPPED_PREFIXES = ("xsp::", "ProfilerStep#", "Optimizer.step#", "Optimizer.zero_grad#")
"""xsp's own markers, and annotations the model level records itself (steps, optimizer steps)."""
MEMORY_EVENT = "[memory]"
MEMORY_NAMES = {False: {True: "alloc", False: "free"}, True: {True: "cuda alloc", False: "cuda free"}}
_THREAD = re.compile(re.escape(THREAD_MARKER) + r"(\d+)$")

KINETO_CHATTER = b"USDT:"
"""What libkineto prints on stderr when the profiler starts and stops (``USDT:... profiler_start``)."""

_active = threading.Event()
"""Set while xsp's own CPU-only profiler runs (so the CUDA levels know it is not a rival)."""


@contextlib.contextmanager
def without_kineto_chatter() -> Iterator[None]:
    """Keep libkineto's start and stop lines off the program's stderr: while the profiler starts
    or stops, file descriptor 2 is a pipe, drained by a thread, and everything else written to it
    meanwhile is passed on to the real stderr afterwards, in order."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError, AttributeError):  # no fd 2 to speak of: nothing to keep clean
        yield
        return
    chunks: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)

    reader = start_thread(drain, "xsp-stderr")
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the reader sees its end
        os.close(saved)
        reader.join(5.0)
        if not reader.is_alive():
            os.close(read_end)
        kept = [line for line in b"".join(chunks).splitlines(keepends=True) if not line.startswith(KINETO_CHATTER)]
        if kept:
            with contextlib.suppress(OSError):
                os.write(2, b"".join(kept))


def own_profiler_active() -> bool:
    """True while the operator tracer's CPU-only profiler is the one running."""
    return _active.is_set()


def own_profiler_running(running: bool) -> None:
    """The operator tracer's CPU-only profiler has started (True) or stopped (False)."""
    if running:
        _active.set()
    else:
        _active.clear()


def _mark(name: str) -> None:
    from torch.autograd.profiler import record_function

    with record_function(name):
        pass


def mark_thread() -> None:
    """Leave a marker naming this thread's OS id in the profiler's events."""
    _mark(f"{THREAD_MARKER}{threading.get_native_id()}")


def measure_profiler_offset(tries: int = 9) -> tuple[int, list[tuple[int, int]]]:
    """Bracket markers between host-clock readings; returns the number of markers and the brackets."""
    brackets = []
    for _ in range(tries):
        before = now_ns()
        _mark(CLOCK_MARKER)
        brackets.append((before, now_ns()))
    return tries, brackets


def clock_offset(markers: list[tuple[int, int]], brackets: list[tuple[int, int]]) -> tuple[int, int]:
    """``(offset_ns, uncertainty_ns)`` with host time = profiler time - offset.

    Each marker ``(start, end)`` on the profiler's clock ran inside its bracket ``(before,
    after)`` on the host clock, so the offset lies in ``[end - after, start - before]``; the
    intersection over all markers is far tighter than any one bracket's midpoint.
    """
    low = max(end - after for (_, end), (_, after) in zip(markers, brackets))
    high = min(start - before for (start, _), (before, _) in zip(markers, brackets))
    if low > high:  # the clocks disagree with every bracket: fall back to the tightest midpoint
        (start, end), (before, after) = min(zip(markers, brackets), key=lambda pair: pair[1][1] - pair[1][0])
        return (start + end) // 2 - (before + after) // 2, (after - before) // 2
    return (low + high) // 2, (high - low) // 2


def memory_rows(events: Iterable[Any], offset: int, thread: Any) -> list[dict[str, Any]]:
    """``alloc``/``free`` rows (memory level) from the profiler's ``[memory]`` events: an instant
    each, ``bytes`` its size, ``device_id`` the CUDA device (null for host memory)."""
    rows = []
    for e in events:
        size = int(e.nbytes())
        if size == 0:
            continue
        at = e.start_ns() - offset
        on_gpu = str(e.device_type()).endswith("CUDA")
        rows.append({
            col.LEVEL: Level.MEMORY.value, col.KIND: (SpanKind.ALLOC if size > 0 else SpanKind.FREE).value,
            col.NAME: MEMORY_NAMES[on_gpu][size > 0], col.START_NS: at, col.END_NS: at,
            col.THREAD_ID: thread(e.start_thread_id()), col.BYTES: abs(size),
            col.DEVICE_ID: max(int(e.device_index()), 0) if on_gpu else None,
        })
    return rows


def operator_rows(events: Iterable[Any], brackets: list[tuple[int, int]], operators: bool = True,
                  memory: bool = False, lines: LineChanges | None = None,
                  sites: CallSites | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Span rows from PyTorch profiler events (``_KinetoEvent``-like objects), and the clock
    and thread facts used: the operators, and the memory events when ``memory``. With
    ``lines`` (and the ``sites`` they index), each operator carries the user's line that issued
    it (:func:`operator_sites`)."""
    events = list(events)
    allocations = [e for e in events if e.name() == MEMORY_EVENT] if memory else []
    events = [e for e in events if str(e.device_type()).endswith("CPU") and e.name() != MEMORY_EVENT]
    markers = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == CLOCK_MARKER]
    offset, uncertainty = clock_offset(markers, brackets) if markers and brackets else (0, -1)
    native_of: dict[int, int] = {}
    for e in events:
        found = _THREAD.match(e.name())
        if found:
            native_of[e.start_thread_id()] = int(found.group(1))

    def thread(profiler_thread: int) -> int:
        return native_of.get(profiler_thread, -profiler_thread)

    rows = memory_rows(allocations, offset, thread)
    first_operator = len(rows)
    forward_threads: list[int] = []
    for e in events if operators else ():
        name = e.name()
        if name.startswith(SKIPPED_PREFIXES):
            continue
        level, kind = Level.OPERATOR, SpanKind.USER if e.is_user_annotation() else SpanKind.OPERATOR
        start = e.start_ns() - offset
        shapes = e.shapes()
        sequence = e.sequence_nr()
        attributes: dict[str, Any] = {}
        dtypes = e.dtypes()
        if any(dtypes):
            attributes["input_dtypes"] = list(dtypes)
        forward_thread = thread(e.fwd_thread_id()) if sequence >= 0 and e.fwd_thread_id() > 0 else 0
        if forward_thread:
            attributes["forward_thread_id"] = forward_thread
        forward_threads.append(forward_thread)
        rows.append({
            col.LEVEL: level.value, col.KIND: kind.value, col.NAME: name,
            col.START_NS: start, col.END_NS: start + max(e.duration_ns(), 0),
            col.THREAD_ID: thread(e.start_thread_id()),
            col.INPUT_SHAPES: json.dumps(shapes) if any(shapes) else None,
            col.SEQUENCE_NUMBER: sequence if sequence >= 0 else None,
            col.ATTRIBUTES: json.dumps(attributes) if attributes else None,
        })
    facts = {"profiler_to_host_offset_ns": offset, "uncertainty_ns": uncertainty,
             "threads": {str(k): v for k, v in sorted(native_of.items())}}
    frame = pd.DataFrame(rows) if rows else pd.DataFrame()
    if lines is not None and len(rows) > first_operator:
        from xsp.tracers.module_calls.rows import site_columns

        ops = frame.iloc[first_operator:]
        ids = np.full(len(frame), NO_SITE, dtype=np.int64)
        ids[first_operator:] = operator_sites(
            lines, ops[col.THREAD_ID].to_numpy(dtype=np.int64), ops[col.START_NS].to_numpy(dtype=np.int64),
            ops[col.END_NS].to_numpy(dtype=np.int64),
            ops[col.SEQUENCE_NUMBER].to_numpy(dtype=np.float64, na_value=np.nan),
            np.asarray(forward_threads, dtype=np.int64))
        frame = frame.assign(**site_columns(sites, ids))
    return frame, facts


THREAD_ROLES: Final = (("gloo:", "gloo worker"), ("nccl:", "NCCL"), ("autograd::engine", "autograd engine"),
                       ("c10d::", "c10d"))
"""What a thread that recorded no module call is named after: the prefix most of its operators have."""


def unmarked_thread_names(rows: pd.DataFrame) -> dict[int, str]:
    """Names for the threads known only by the profiler's number (negated ids): after what most
    of their operators are (``gloo worker (profiler thread 2)``), else the number alone."""
    threads = rows[col.THREAD_ID].to_numpy()
    names = rows[col.NAME].astype(str).to_numpy()
    found: dict[int, str] = {}
    for thread in sorted({int(t) for t in threads.tolist() if t is not None and t == t and int(t) < 0}):
        mine = names[threads == thread]
        counts = {role: sum(1 for name in mine.tolist() if name.startswith(prefix)) for prefix, role in THREAD_ROLES}
        role, count = max(counts.items(), key=lambda item: item[1])
        label = f"profiler thread {-thread}"
        found[thread] = f"{role} ({label})" if count and count * 4 >= len(mine) else label
    return found


def profiler_conflict() -> str | None:
    """Why PyTorch's profiler cannot be started here, or None."""
    try:
        import torch

        if not torch.autograd.profiler.kineto_available():
            return "this PyTorch build has no Kineto profiler"
        if torch.autograd.profiler._is_profiler_enabled:
            return "PyTorch's profiler is already running in this process (one profiler at a time)"
    except Exception as exc:
        return f"PyTorch's profiler cannot be queried: {exc}"
    return None
