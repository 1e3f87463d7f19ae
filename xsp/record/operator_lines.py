"""The line of the user's code that issued each operator.

While the operator level records, a C trace function (``xsp.record._lines``) follows the frames
of the user's code on every thread (library frames report only their call and return, never
their lines) and writes down, with the clock, each change of the thread's *current line*: the
line the innermost user frame runs. An operator that started on a thread at time ``t`` was
issued by the line current there at ``t``, whether it came from a call (``torch.relu(x)``, a
module call) or from tensor arithmetic (``x * 2 + 1``), which no call event sees. Lines are sites
of the recording's :class:`xsp.record.sites.CallSites`, resolved to text at the end like the
call sites of module calls.

It follows lines only where nothing else traces: a thread that has a trace function already (a
debugger, coverage) keeps it and its operators take the line of the call they ran under. An
operator of the backward pass runs on autograd's threads, where no user frame is; it takes the
line of the forward operator that made its autograd node (by sequence number).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from xsp.record.hotpath import optional_extension
from xsp.record.sites import NO_SITE, CallSites

LINES: Any = optional_extension("xsp.record._lines")
"""The C trace function's extension, or None (not built, or ``XSP_PURE_PYTHON`` set)."""

MAX_CHANGES_PER_THREAD: Final = 4 << 20
"""Changes of the current line a thread keeps (16 bytes each: 64 MiB); past it, the later ones
are counted as dropped and the operators after them take the line of the call they ran under."""

OPERATOR_LINES_VARIABLE: Final = "XSP_OPERATOR_LINES"
"""``XSP_OPERATOR_LINES=0`` switches the lines of operators off (``XSP_CALL_SITES=0`` switches off
every line); what they cost: benchmarks/operator_lines.py."""

_PERF_COUNTER_CLOCK: Final = "clock_gettime(CLOCK_MONOTONIC)"
"""What the C trace function reads, and what xsp's host clock (time.perf_counter_ns) must read too."""


def unavailable(sites: CallSites) -> str | None:
    """Why the lines of operators cannot be followed here, or None."""
    if LINES is None:
        return "xsp's C extension for lines (xsp.record._lines) is not built or XSP_PURE_PYTHON is set"
    if not sites.enabled:
        return "call sites are switched off (XSP_CALL_SITES=0)"
    if os.environ.get(OPERATOR_LINES_VARIABLE, "1").strip() == "0":
        return f"{OPERATOR_LINES_VARIABLE}=0"
    if time.get_clock_info("perf_counter").implementation != _PERF_COUNTER_CLOCK:
        return "this platform's perf_counter is not CLOCK_MONOTONIC"
    if sys.gettrace() is not None:
        return "a trace function is set already (a debugger or coverage)"
    return None


@dataclass
class LineChanges:
    """Each thread's changes of its current line: times (host clock, ns) and site ids, in order."""

    times_ns: dict[int, np.ndarray] = field(default_factory=dict)
    sites: dict[int, np.ndarray] = field(default_factory=dict)
    dropped: int = 0
    """Changes not kept (past :data:`MAX_CHANGES_PER_THREAD` on a thread)."""
    refused: int = 0
    """Threads left alone: another tool's trace function was on them."""

    def sites_at(self, thread_ids: np.ndarray, at_ns: np.ndarray) -> np.ndarray:
        """The site current on each ``thread_ids[i]`` at ``at_ns[i]`` (``NO_SITE`` where none)."""
        found = np.full(len(at_ns), NO_SITE, dtype=np.int64)
        for thread, times in self.times_ns.items():
            rows = np.flatnonzero(thread_ids == thread)
            if not len(rows) or not len(times):
                continue
            position = np.searchsorted(times, at_ns[rows], side="right") - 1
            known = position >= 0
            found[rows[known]] = self.sites[thread][position[known]]
        return found


class OperatorLines:
    """Follows the user's current line on every thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, sites: CallSites, max_changes: int = MAX_CHANGES_PER_THREAD,
                 on_thread: Callable[[], object] | None = None) -> None:
        self.sites = sites
        self.max_changes = max_changes
        self.on_thread = on_thread
        """Called on each thread at the first line it runs while followed (its lines start then)."""
        self._tracer: Any = None
        self._thread_hook: Any = None

    def start(self) -> str | None:
        """Start following lines; returns why it cannot (nothing started then), or None."""
        why = unavailable(self.sites)
        if why is not None:
            return why
        tracer = LINES.LineTracer(self.sites, self.max_changes, self.on_thread)
        try:
            tracer.install()
        except RuntimeError as exc:  # another recording follows lines (a nested session)
            return str(exc)
        self._tracer = tracer
        if threading.gettrace() is None:  # threads started from now on follow lines too
            self._thread_hook = tracer.on_new_thread
            threading.settrace(self._thread_hook)
        return None

    def stop(self) -> None:
        """Stop following lines on every thread; what was written is kept for :meth:`take`."""
        if self._tracer is None:
            return
        if self._thread_hook is not None and threading.gettrace() is self._thread_hook:
            threading.settrace(None)  # type: ignore[arg-type]  # typeshed omits None
        self._thread_hook = None
        self._tracer.uninstall()

    def take(self) -> LineChanges:
        """What :meth:`start` to :meth:`stop` wrote (since the last :meth:`take_before`), once."""
        tracer, self._tracer = self._tracer, None
        if tracer is None:
            return LineChanges()
        return self._changes(tracer.take(), int(tracer.refused))

    def take_before(self, cut_ns: int) -> LineChanges:
        """While following: each thread's changes up to ``cut_ns`` (host clock), for the
        operators of a window that ends there. The last of them is taken again by the next
        call (it is the line current at the cut), so that windows need nothing of each other."""
        if self._tracer is None:
            return LineChanges()
        return self._changes(self._tracer.take_before(cut_ns), int(self._tracer.refused))

    @staticmethod
    def _changes(taken: list[tuple[int, bytes, int]], refused: int) -> LineChanges:
        changes = LineChanges()
        for thread, data, dropped in taken:
            pairs = np.frombuffer(data, dtype=np.int64).reshape(-1, 2)
            times, sites = pairs[:, 0].copy(), pairs[:, 1].copy()
            if int(thread) in changes.times_ns:  # an OS thread id reused by a later thread
                times = np.concatenate([changes.times_ns[int(thread)], times])
                sites = np.concatenate([changes.sites[int(thread)], sites])
                order = np.argsort(times, kind="stable")
                times, sites = times[order], sites[order]
            changes.times_ns[int(thread)], changes.sites[int(thread)] = times, sites
            changes.dropped += int(dropped)
        changes.refused = refused
        return changes


def operator_sites(lines: LineChanges, threads: np.ndarray, starts_ns: np.ndarray, ends_ns: np.ndarray,
                   sequence_numbers: np.ndarray, forward_threads: np.ndarray) -> np.ndarray:
    """The site of the user's line that issued each operator: the line current on its thread at
    the middle of its interval (the middle, so that a clock offset smaller than half the
    operator never moves it to a neighbouring line).

    The backward pass is the forward's, line by line: an operator of autograd's that runs a
    node (``forward_threads`` > 0: ``AddmmBackward0`` and its ``evaluate_function``) takes the
    site of the last forward operator on that thread with its sequence number (the one that made
    the node), and the operators it runs inside take its site, on whichever thread the backward
    runs (the caller's of ``backward()`` for the CPU, autograd's own for a GPU)."""
    sites = lines.sites_at(threads, starts_ns + (ends_ns - starts_ns) // 2)
    backward = forward_threads > 0
    if not backward.any():
        return sites
    numbered = ~np.isnan(sequence_numbers)
    forward = numbered & ~backward & (sites != NO_SITE)
    made: dict[tuple[int, int], int] = {}
    for position in np.flatnonzero(forward)[np.argsort(starts_ns[forward], kind="stable")].tolist():
        made[(int(threads[position]), int(sequence_numbers[position]))] = int(sites[position])
    nodes = np.flatnonzero(backward & numbered)
    for position in nodes.tolist():
        key = (int(forward_threads[position]), int(sequence_numbers[position]))
        sites[position] = made.get(key, int(sites[position]))
    # inside a node's operator: its site (the outermost of nested node operators, which agree)
    for thread in np.unique(threads[nodes]).tolist():
        mine = nodes[threads[nodes] == thread]
        mine = mine[np.argsort(starts_ns[mine], kind="stable")]
        outer_end = np.maximum.accumulate(ends_ns[mine])
        keep = np.concatenate([[True], starts_ns[mine][1:] >= outer_end[:-1]])  # not inside an earlier one
        outer = mine[keep]
        rows = np.flatnonzero((threads == thread) & ~(backward & numbered))
        at = np.searchsorted(starts_ns[outer], starts_ns[rows], side="right") - 1
        inside = (at >= 0) & (ends_ns[rows] <= ends_ns[outer[np.maximum(at, 0)]])
        sites[rows[inside]] = sites[outer[at[inside]]]
    return sites
