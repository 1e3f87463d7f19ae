"""Steps, OTel traces and execution order, derived from the tree.

* A **step** starts at every outermost ``xsp.step()`` or top-level module call (``predict``).
  Steps are numbered 0, 1, 2... in start order, and each is the root of its own OTel trace.
* A span belongs to the step of its root. A root that is not a step (a backward pass
  after a forward, on the same thread) joins the latest step its thread started before it,
  else the step running on another thread when it started (autograd and NCCL threads), whose
  root becomes its parent; a step in a request's trace (an always-on session's) takes no root
  that began after it ended (the next request's input, before its model call);
  model-level roots outside every step (``xsp.span("preprocess")`` before the model call),
  and garbage collections outside every step, hang from the session span in the session's own
  trace, with no step.
* The **execution index** numbers each step's spans in the order they began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.rank import step_trace_id
from xsp.core.schema import PROFILER_STEP_NAME, STEP_KINDS, Level, SpanKind
from xsp.table.sampling import StepNotes
from xsp.table.walks import (
    category_values,
    chain_ends,
    nearest_before,
    nearest_marked,
)

NONE = -1


SESSION_NAME = "session"


SESSION_PATH = f"{SESSION_NAME}[0]"


NUMBERED_PROFILER_STEP: Final = rf"^{PROFILER_STEP_NAME}[0-9]+$"
"""PyTorch's profiler's name of its step N (``ProfilerStep#3``), an RE2 pattern."""


ANY_PROFILER_STEP: Final = f"{PROFILER_STEP_NAME}*"
"""What such a name is in a path: the same in every step."""


ROOT_LEVELS = (Level.MODEL.value, Level.INPUT.value)
"""Levels whose spans outside every step stay outside (the others join the step before them)."""
ROOT_KINDS = (SpanKind.GC.value,)
"""Kinds of the other levels whose spans outside every step stay outside too: a garbage
collection between two requests delays neither of them."""


def outermost_step(is_step: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Position of the outermost step-kind span (``is_step``) among each span and its ancestors, or -1."""
    nearest = nearest_marked(parents, is_step, include_self=True)
    step_above = np.where(is_step, nearest_marked(parents, is_step), NONE)
    outermost = chain_ends(step_above)
    return np.where(nearest >= 0, outermost[np.maximum(nearest, 0)], NONE)


def root_of(parents: np.ndarray) -> np.ndarray:
    """Position of each span's root (itself for roots)."""
    return chain_ends(parents)


@dataclass
class StepState:
    """What one window of spans hands to the next (see :func:`assign_steps`)."""

    session_trace_id: str
    session_span_id: int
    session_parent_id: int | None = None
    """The span the session's own span hangs below (None: none): a followed child process's session,
    below its parent's session span, in its trace. In the child's own file it is a root (the
    parent's session span is not there); the parent makes it a child of its own as it reads it,
    and sends it so with the child's last window."""
    steps: int = 0
    """Steps numbered so far."""
    latest_step: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    """Per thread, the latest step's (start_ns, step, trace id)."""
    request_step_ends: dict[int, int] = field(default_factory=dict)
    """Per thread, where the latest step ended, when it joined a request's trace."""
    occurrences: tuple[np.ndarray, np.ndarray, np.ndarray] = field(default_factory=lambda: (
        np.zeros(0, dtype=object), np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64)))
    """For ``path``: the scopes, names and counts to go on from, of the names seen so far below
    the session (scope ``session``) and at the root of each trace (scope: its id) of the last two windows."""
    recent_traces: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))
    """The traces the last window counted names at the root of."""
    layers_in_step: dict[int, int] = field(default_factory=dict)
    """Layer spans numbered so far in steps that a later window may continue."""
    attach_to_session: bool = True
    """Hang roots outside every step below the session span (False for imported traces,
    which have no session span)."""
    job_id: str | None = None
    """In a distributed job: step ``k``'s trace id is derived from the job and ``k``, the same
    on every rank (:func:`xsp.core.rank.step_trace_id`)."""
    window_owners: dict[tuple[int, int], tuple[int, Any, str]] = field(default_factory=dict)
    """The last window's layer calls by (thread, external id): (span id, step, trace id)."""
    window_launches: dict[int, tuple[int, Any, str]] = field(default_factory=dict)
    """The last window's CUDA API calls by correlation id: (span id, step, trace id)."""
    recent_owners: dict[tuple[int, int], tuple[int, Any, str]] = field(default_factory=dict)
    """Those of the last two windows, for CUDA records that come late (:mod:`xsp.table.late_records`)."""
    recent_launches: dict[int, tuple[int, Any, str]] = field(default_factory=dict)

    def forget_thread(self, thread_id: int) -> None:
        """A thread ended: no later window has spans of its to place in its latest step."""
        self.latest_step.pop(thread_id, None)
        self.request_step_ends.pop(thread_id, None)


@dataclass
class Structure:
    parents: np.ndarray  # positions; the session (or a virtual row past the end) for session children
    step: np.ndarray  # -1 for no step
    trace_codes: np.ndarray  # each row's trace, as a position in trace_values
    trace_values: list[str]  # the distinct 32-hex trace ids
    session: int  # position of the session row, len(spans) when it is not in this window

    @property
    def trace_ids(self) -> np.ndarray:
        """Each row's trace id (an object array)."""
        return np.array(self.trace_values, dtype=object)[self.trace_codes]


class _TraceCodes:
    """Trace ids as small integer codes (a table of millions of rows has a few hundred traces)."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._codes: dict[str, int] = {}
        self._indexed = 0
        """How many of :attr:`values` are in ``_codes`` (those added at once are looked up only if asked)."""

    def code(self, trace_id: str) -> int:
        found = self._codes.get(trace_id)
        if found is None and self._indexed < len(self.values):
            self._codes.update(zip(self.values[self._indexed:], range(self._indexed, len(self.values))))
            self._indexed = len(self.values)
            found = self._codes.get(trace_id)
        if found is None:
            found = self._codes[trace_id] = len(self.values)
            self.values.append(trace_id)
            self._indexed = len(self.values)
        return found

    def codes(self, trace_ids: list[str]) -> np.ndarray:
        """The codes of many trace ids at once (an always-on window has a trace a request)."""
        if not trace_ids:
            return np.zeros(0, dtype=np.int64)
        # the known ids first, in one pass: they keep their codes, and the new ones take the next
        # codes in order of first appearance
        known = len(self.values)
        positions, distinct = pd.factorize(np.array([*self.values, *trace_ids], dtype=object))
        self.values.extend(np.asarray(distinct, dtype=object)[known:].tolist())
        return positions[known:].astype(np.int64, copy=False)


def assign_steps(spans: pd.DataFrame, parents: np.ndarray, session_row: int | None, state: StepState,
                 new_trace_ids: Callable[[int], list[str]], step_numbers: list[int] | None = None,
                 notes: StepNotes | None = None) -> Structure:
    """Cut each step out as its own tree and give every span its step and trace.

    ``step_numbers`` numbers the steps in order of start, when the recorder kept only some of
    them (a schedule); else steps are counted on from ``state``.

    ``state`` carries step numbers and each thread's latest step from earlier windows of the
    same session, and is updated for the next one. ``notes``: an always-on session's; a step
    that began inside a request's span takes that request's trace id.
    """
    count = len(spans)
    parents = parents.copy()
    session = count if session_row is None else session_row
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.int64, na_value=-1)
    # by category code, not a text a row: at millions of rows each array here is tens of megabytes
    outer = outermost_step(spans[col.KIND].isin([kind.value for kind in STEP_KINDS]).to_numpy(dtype=bool), parents)
    step_roots = np.flatnonzero(outer == np.arange(count))
    del outer
    parents[step_roots] = NONE
    step_roots = step_roots[np.lexsort((threads[step_roots], starts[step_roots]))]
    step_of = np.full(count, NONE, dtype=np.int64)
    traces = _TraceCodes()
    trace_of = np.full(count, traces.code(state.session_trace_id), dtype=np.int64)
    if step_numbers is not None and len(step_numbers) == len(step_roots):
        step_of[step_roots] = step_numbers
    else:
        step_of[step_roots] = state.steps + np.arange(len(step_roots))
    if col.STEP in spans:  # numbers the recorder already knew (ProfilerStep#N)
        preset = spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)[step_roots]
        known = ~np.isnan(preset)
        step_of[step_roots[known]] = preset[known].astype(np.int64)
    job = state.job_id
    joined = (notes.joined_trace_ids(threads[step_roots], starts[step_roots], ends[step_roots]) if notes is not None
              else [None] * len(step_roots))
    if job is None:  # drawn together: one at a time was a third of an always-on window's work
        fresh = iter(new_trace_ids(sum(not request_trace for request_trace in joined)))
        step_traces = [request_trace or next(fresh) for request_trace in joined]
    else:
        step_traces = [request_trace or step_trace_id(job, step)
                       for step, request_trace in zip(step_of[step_roots].tolist(), joined)]
    trace_of[step_roots] = traces.codes(step_traces)
    loose = np.flatnonzero((parents < 0) & (step_of < 0))
    if session_row is not None:
        loose = loose[loose != session_row]
    below_model = loose[~(spans[col.LEVEL].iloc[loose].isin(ROOT_LEVELS).to_numpy(dtype=bool)
                          | spans[col.KIND].iloc[loose].isin(ROOT_KINDS).to_numpy(dtype=bool))]
    found = _latest_step_on_thread(step_roots, threads, starts, below_model)
    # a step in a request's trace takes no work after it: a service's next request begins there
    # (its input's operators, before its model call), and the request's own post-processing is
    # no part of the step's tree either; the session's trace keeps both
    in_request = np.zeros(count, dtype=bool)
    in_request[step_roots] = [request_trace is not None for request_trace in joined]
    found_at = np.maximum(found, 0)
    hit = (found >= 0) & ~(in_request[found_at] & (starts[below_model] > ends[found_at]))
    step_of[below_model[hit]] = step_of[found[hit]]
    trace_of[below_model[hit]] = trace_of[found[hit]]
    # without a step anywhere (an import of a trace with none), no root below the model level
    # can be placed in one: skip the loop, one lookup a root
    unplaced_roots = below_model[found < 0] if len(step_roots) or state.latest_step else below_model[:0]
    running_steps = running_step_roots(step_roots, starts, ends, starts[unplaced_roots])
    for root, running in zip(unplaced_roots.tolist(), running_steps.tolist()):
        thread = int(threads[root])
        prior = state.latest_step.get(thread)
        if prior is not None and prior[0] <= starts[root]:
            if starts[root] <= state.request_step_ends.get(thread, starts[root]):
                step_of[root], trace_of[root] = prior[1], traces.code(prior[2])
            continue
        if running >= 0:  # work on a helper thread (autograd, NCCL) during another thread's step
            step_of[root], trace_of[root] = step_of[running], trace_of[running]
            parents[root] = running  # in that step's tree: no second root in its OTel trace
    if state.attach_to_session:
        unplaced = loose[step_of[loose] < 0]
        parents[unplaced] = session
    # each thread's latest step (the roots are in order of start): one a thread, not one a step
    latest = step_roots[::-1][np.unique(threads[step_roots][::-1], return_index=True)[1]]
    for root in latest.tolist():
        state.latest_step[int(threads[root])] = (int(starts[root]), int(step_of[root]),
                                                   traces.values[trace_of[root]])
        if in_request[root]:
            state.request_step_ends[int(threads[root])] = int(ends[root])
        else:
            state.request_step_ends.pop(int(threads[root]), None)
    if len(step_roots):
        state.steps = max(state.steps + len(step_roots), int(step_of[step_roots].max()) + 1)
    del threads, loose, below_model, found, found_at, hit, in_request
    inside = parents.copy()
    inside[inside == count] = NONE
    top = root_of(inside)
    return Structure(parents=parents, step=step_of[top], trace_codes=trace_of[top], trace_values=traces.values,
                     session=session)


def running_step_roots(step_roots: np.ndarray, starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each time of ``at``, the position of the latest-starting step root, on any thread,
    running then (started at or before it, ended at or after it), or -1; of step roots that
    started together, the first in ``step_roots``' order.

    In O((steps + times) log steps), not a scan of every step a time: an import of 28,000 steps
    had 85,000 roots on helper threads to place. The roots are sorted by start; a time's search
    begins at the last root started by then and, while that root ended before the time, jumps to
    the nearest earlier root that ended later than it (the roots in between ended earlier still).
    """
    found = np.full(len(at), NONE, dtype=np.int64)
    if not len(step_roots) or not len(at):
        return found
    roots = step_roots[np.argsort(starts[step_roots], kind="stable")]
    root_starts, root_ends = starts[roots], ends[roots]
    later_ending = nearest_before(root_ends, strict=True)  # the nearest earlier root that ended later
    position = np.searchsorted(root_starts, at, side="right") - 1
    pending = np.flatnonzero(position >= 0)
    while len(pending):
        ended = root_ends[position[pending]] < at[pending]
        pending = pending[ended]
        position[pending] = later_ending[position[pending]]
        pending = pending[position[pending] >= 0]
    placed = np.flatnonzero(position >= 0)
    found[placed] = roots[position[placed]]
    # roots that started together: the first of them running, as ``step_roots`` orders them
    first_of_start = np.searchsorted(root_starts, root_starts[position[placed]], side="left")
    for k in np.flatnonzero(first_of_start < position[placed]).tolist():
        row = placed[k]
        tied = np.arange(first_of_start[k], position[row] + 1)
        running = tied[root_ends[tied] >= at[row]]
        found[row] = roots[running[0]]
    return found


def _latest_step_on_thread(step_roots: np.ndarray, threads: np.ndarray, starts: np.ndarray,
                           rows: np.ndarray) -> np.ndarray:
    """For each of ``rows``, the latest step root on its thread that started at or before it, or -1."""
    found = np.full(len(rows), NONE, dtype=np.int64)
    for thread in np.unique(threads[rows]).tolist():
        mine = threads[rows] == thread
        candidates = step_roots[threads[step_roots] == thread]
        if not len(candidates):
            continue
        candidates = candidates[np.argsort(starts[candidates], kind="stable")]
        before = np.searchsorted(starts[candidates], starts[rows[mine]], side="right") - 1
        found[mine] = np.where(before >= 0, candidates[np.maximum(before, 0)], NONE)
    return found


def execution_index(spans: pd.DataFrame, step: np.ndarray, state: StepState | None = None) -> np.ndarray:
    """Order of each layer span within its step (forward and backward), -1 elsewhere.

    With ``state``, counting goes on from where earlier windows of the same step stopped.
    """
    levels = category_values(spans[col.LEVEL])
    mask = (levels == Level.LAYER.value) & (step >= 0)
    index = np.full(len(spans), NONE, dtype=np.int64)
    if not mask.any():
        return index
    depth = (spans[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64)
             if col.CALL_DEPTH in spans else np.zeros(len(spans), dtype=np.int64))
    frame = pd.DataFrame({"step": step[mask], "start": spans[col.START_NS].to_numpy()[mask],
                          "depth": depth[mask]}, index=np.flatnonzero(mask))
    ordered = frame.sort_values(["start", "depth"], kind="stable")
    order = ordered.groupby("step", sort=False, observed=True).cumcount().to_numpy()
    if state is not None:
        steps = ordered["step"].to_numpy()
        order = order + np.array([state.layers_in_step.get(int(s), 0) for s in steps.tolist()], dtype=np.int64)
        open_steps = {latest[1] for latest in state.latest_step.values()}
        for step_number, last in zip(steps.tolist(), order.tolist()):
            if step_number in open_steps:
                state.layers_in_step[int(step_number)] = max(state.layers_in_step.get(int(step_number), 0), last + 1)
        for step_number in list(state.layers_in_step):
            if step_number not in open_steps:
                del state.layers_in_step[step_number]
    index[ordered.index.to_numpy()] = order
    return index
