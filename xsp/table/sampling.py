"""An always-on session's notes of its steps (:mod:`xsp.record.sampling`) put into the span table:
each step root's ``sampling`` reason, the request span it joined (``remote_parent_id``, and that
request's trace id for every span of the step), the slow steps, and nothing below the model
level in the steps that were not sampled."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.lazy import pyarrow_compute as pc
from xsp.record.columns import NOTE_FIELDS, NoteField, note_rows
from xsp.record.sampling import DEEP_REASONS, REASONS, DepthPlan, NoteKind
from xsp.record.window import WindowBuffer
from xsp.table.walks import arrow_strings, categories_at, plain_strings

MODEL_RUN: str = "model"
"""The leveled run the steps timed at the model level only make up."""
KEPT_LEVELS: frozenset[str] = frozenset({col.Level.MODEL.value, col.Level.INPUT.value, col.Level.SYSTEM.value})
"""Levels every step keeps, however deep it was recorded (the model level, its input waits, the
system's samples)."""
SHALLOW_DROPPED_LEVELS: frozenset[str] = frozenset(level.value for level in col.Level) - KEPT_LEVELS
"""Levels a step that was not sampled keeps none of."""


@dataclass
class StepNotes:
    """One window's step notes as arrays, times on the epoch clock; decisions and slow steps apart."""

    thread: np.ndarray
    time_ns: np.ndarray
    reason: np.ndarray
    plan: np.ndarray
    """1 + the index of the decision's depth plan in :attr:`plans` (0: none)."""
    plans: Sequence[DepthPlan]
    trace_high: np.ndarray
    """The high 64 bits of each decision's trace id (uint64; 0 with :attr:`trace_low`: none)."""
    trace_low: np.ndarray
    span_id: np.ndarray
    slow_thread: np.ndarray
    slow_time_ns: np.ndarray
    slow_duration_ns: np.ndarray
    slow_median_ns: np.ndarray

    @classmethod
    def of(cls, buffers: Iterable[WindowBuffer], host_to_epoch_ns: int,
           plans: Sequence[DepthPlan] = ()) -> StepNotes | None:
        """The notes of a window's buffers (None when it has none); ``plans``: the sampler's."""
        threads: list[np.ndarray] = []
        parts: list[np.ndarray] = []
        for buffer in buffers:
            # by columns, not a Python call a note: an always-on window holds a note for every step
            for rows in (np.frombuffer(note_rows(buffer.packed_notes), dtype=np.int64).reshape(-1, NOTE_FIELDS),
                         _note_rows(buffer.step_notes)):
                if len(rows):
                    threads.append(np.full(len(rows), buffer.thread_id, dtype=np.int64))
                    parts.append(rows)
        if not parts:
            return None
        notes = np.concatenate(parts)
        thread = np.concatenate(threads)
        time_ns = notes[:, NoteField.TIME_NS] + host_to_epoch_ns
        decision = notes[:, NoteField.KIND] == NoteKind.DECISION
        slow = np.flatnonzero(~decision)
        decisions = np.flatnonzero(decision)
        decisions = decisions[np.lexsort((time_ns[decisions], thread[decisions]))]
        decided, slow_notes = notes[decisions], notes[slow]
        return cls(thread=thread[decisions], time_ns=time_ns[decisions], reason=decided[:, NoteField.REASON],
                   plan=decided[:, NoteField.PLAN_OR_DURATION_NS], plans=list(plans),
                   trace_high=decided[:, NoteField.TRACE_HIGH].view(np.uint64),
                   trace_low=decided[:, NoteField.TRACE_LOW].view(np.uint64), span_id=decided[:, NoteField.SPAN_ID],
                   slow_thread=thread[slow], slow_time_ns=time_ns[slow],
                   slow_duration_ns=slow_notes[:, NoteField.PLAN_OR_DURATION_NS],
                   slow_median_ns=slow_notes[:, NoteField.MEDIAN_NS])

    def decision_of(self, threads: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """For each step root (its thread, start and end), the position of its decision (the
        first one on its thread from its start to its end: the step's first top-level call), or -1.
        A step with no decision of its own (a model's calls that joined the step before, then
        became steps of their own when that model went on alone) was recorded as the decision
        before it on its thread said: that one."""
        found = np.full(len(threads), -1, dtype=np.int64)
        for thread in np.unique(threads).tolist():
            mine = np.flatnonzero(threads == thread)
            notes = np.flatnonzero(self.thread == thread)
            if not len(notes):
                continue
            times = self.time_ns[notes]
            at = np.searchsorted(times, starts[mine], side="left")
            inside = at < len(notes)
            inside[inside] &= times[at[inside]] <= ends[mine][inside]
            found[mine[inside]] = notes[at[inside]]
            before = ~inside & (at > 0)
            found[mine[before]] = notes[at[before] - 1]
        return found

    def joined_trace_ids(self, threads: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[str | None]:
        """For each step root, the trace id (32 hex digits) of the request span it began in, or None."""
        found = self.decision_of(threads, starts, ends)
        joined = found >= 0
        high = np.zeros(len(found), dtype=np.uint64)
        low = np.zeros(len(found), dtype=np.uint64)
        high[joined], low[joined] = self.trace_high[found[joined]], self.trace_low[found[joined]]
        return hex_trace_ids(high, low)


_LOW_64: Final = (1 << 64) - 1
_BITS: Final = frozenset({NoteField.TRACE_HIGH, NoteField.TRACE_LOW, NoteField.SPAN_ID})
"""Fields held as 64 bits (unsigned in a tuple note, their bits as int64 packed)."""


def _note_rows(notes: list[tuple[int, ...]]) -> np.ndarray:
    """Step notes kept as tuples (:attr:`WindowBuffer.step_notes`) as packed notes' rows (the
    trace id's bits past 128 dropped)."""
    if not notes:
        return np.empty((0, NOTE_FIELDS), dtype=np.int64)
    times, kinds, reasons, trace_ids, span_ids, fifth, sixth = zip(*notes)
    columns = {NoteField.TIME_NS: times, NoteField.KIND: kinds, NoteField.REASON: reasons,
               NoteField.TRACE_HIGH: [trace_id >> 64 & _LOW_64 for trace_id in trace_ids],
               NoteField.TRACE_LOW: [trace_id & _LOW_64 for trace_id in trace_ids],
               NoteField.SPAN_ID: [span_id & _LOW_64 for span_id in span_ids],
               NoteField.PLAN_OR_DURATION_NS: fifth, NoteField.MEDIAN_NS: sixth}
    return np.column_stack([np.array(columns[field], dtype=np.uint64 if field in _BITS else np.int64).view(np.int64)
                            for field in NoteField])


def hex_trace_ids(high: np.ndarray, low: np.ndarray) -> list[str | None]:
    """Each trace id, given as its high and low 64 bits, as 32 hex digits (None for 0): one hex
    text of them all, cut in pieces (an always-on window has a trace a request)."""
    halves = np.empty((len(high), 2), dtype=">u8")
    halves[:, 0], halves[:, 1] = high, low
    text = halves.tobytes().hex()
    none = ((high == 0) & (low == 0)).tolist()
    return [None if none[row] else text[at:at + 32] for row, at in enumerate(range(0, 32 * len(none), 32))]


def step_roots(spans: pd.DataFrame) -> np.ndarray:
    """Positions of the roots of steps: spans with no parent in the table and a step number, of a
    step's kind (a model call that is its own step, an automatic or explicit ``step`` span, an
    imported ``ProfilerStep#N``; a root of a helper thread's work placed in a step is not one).
    The one rule for what a step root is: every other module asks here."""
    return np.flatnonzero((spans[col.PARENT_ID].isna() & spans[col.STEP].notna()
                           & spans[col.KIND].isin([kind.value for kind in col.STEP_KINDS])).to_numpy(dtype=bool))


def deep_roots(spans: pd.DataFrame) -> np.ndarray:
    """Which spans (bool per row) are roots an always-on session recorded below the model level
    (their ``sampling`` a deep reason): their steps are its steps recorded deep. The one rule for
    those steps: the report and its windowed twin both ask here."""
    return (spans[col.PARENT_ID].isna() & spans[col.SAMPLING].isin(
        [reason.value for reason in DEEP_REASONS])).to_numpy(dtype=bool)


def apply_step_notes(spans: pd.DataFrame, notes: StepNotes) -> pd.DataFrame:
    """``spans`` (one window's table, built with ``notes`` deciding the joined trace ids) with
    each step root's ``sampling`` and ``remote_parent_id``, the slow steps' ratio to the median
    in their attributes, and without the levels below the model of the steps not sampled."""
    roots = step_roots(spans)
    if not len(roots):
        return spans
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.int64, na_value=-1)
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    found = notes.decision_of(threads[roots], starts[roots], ends[roots])
    decided = roots[found >= 0]
    found = found[found >= 0]
    codes = np.full(len(spans), -1, dtype=np.int64)
    codes[decided] = notes.reason[found]
    spans[col.SAMPLING] = categories_at(codes, [reason.value for reason in REASONS])
    remote = notes.span_id[found]
    joined = remote != 0
    if joined.any():
        values = np.zeros(len(spans), dtype=np.int64)
        present = np.zeros(len(spans), dtype=bool)
        values[decided[joined]] = remote[joined]
        present[decided[joined]] = True
        spans[col.REMOTE_PARENT_ID] = pd.arrays.IntegerArray(values, ~present)
    _mark_slow(spans, roots, threads, ends, notes)
    deep_codes = [code for code, reason in enumerate(REASONS) if reason in DEEP_REASONS]
    shallow_roots = decided[~np.isin(notes.reason[found], deep_codes)]
    steps = spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)
    dropped = _runs_of_plans(spans, decided, notes.plan[found], notes, steps)
    if len(shallow_roots):
        dropped |= spans[col.LEVEL].isin(SHALLOW_DROPPED_LEVELS).to_numpy(dtype=bool) & np.isin(
            steps, steps[shallow_roots])
    if not dropped.any():
        return spans
    return spans[~dropped].reset_index(drop=True)


def _mark_slow(spans: pd.DataFrame, roots: np.ndarray, threads: np.ndarray, ends: np.ndarray,
               notes: StepNotes) -> None:
    """The step root that ended last on its thread before each slow note gets its ratio to the median."""
    if not len(notes.slow_time_ns):
        return
    ordered = roots[np.lexsort((ends[roots], threads[roots]))]  # by thread, then end
    ordered_threads, ordered_ends = threads[ordered], ends[ordered]
    slow_threads = notes.slow_thread
    at = np.full(len(slow_threads), -1, dtype=np.int64)  # each note's root among ``ordered``
    for thread in np.unique(slow_threads).tolist():
        low, high = np.searchsorted(ordered_threads, [thread, thread + 1])
        mine = np.flatnonzero(slow_threads == thread)
        at[mine] = low + np.searchsorted(ordered_ends[low:high], notes.slow_time_ns[mine], side="right") - 1
        at[mine[at[mine] < low]] = -1
    marked = (at >= 0) & (notes.slow_median_ns > 0)
    if not marked.any():
        return
    # only the rows marked are read and written as Python strings: the column stays in Arrow
    rows = ordered[at[marked]]
    texts = dict(zip(rows.tolist(), spans[col.ATTRIBUTES].iloc[rows].astype(object).tolist()))
    for row, duration_ns, median_ns in zip(rows.tolist(), notes.slow_duration_ns[marked].tolist(),
                                           notes.slow_median_ns[marked].tolist()):
        text = texts[row]
        attributes = json.loads(text) if isinstance(text, str) else {}
        attributes[col.ATTR_STEP_SLOW] = round(duration_ns / median_ns, 3)
        texts[row] = json.dumps(attributes, ensure_ascii=False)
    changed = np.zeros(len(spans), dtype=bool)
    changed[list(texts)] = True
    column = pc.replace_with_mask(plain_strings(spans[col.ATTRIBUTES]), pa.array(changed),
                                  pa.array([texts[row] for row in np.flatnonzero(changed).tolist()],
                                           type=pa.large_string()))
    spans[col.ATTRIBUTES] = pd.array(arrow_strings(column), dtype="string")


def _runs_of_plans(spans: pd.DataFrame, roots: np.ndarray, plan_codes: np.ndarray, notes: StepNotes,
                   steps: np.ndarray) -> np.ndarray:
    """Each decided step root's ``leveled_run`` (its depth plan's label; the steps recorded at the
    model level only: ``model``), in place; returns the rows of levels a deep step's plan does not keep."""
    dropped = np.zeros(len(spans), dtype=bool)
    if not len(roots) or spans[col.LEVELED_RUN].notna().any():  # (a leveled merge's own runs are kept)
        return dropped
    labels = np.array([MODEL_RUN, *(plan.label for plan in notes.plans)], dtype=object)
    known = plan_codes <= len(notes.plans)
    runs = np.full(len(spans), None, dtype=object)
    runs[roots[known]] = labels[plan_codes[known]]
    spans[col.LEVELED_RUN] = pd.array(runs, dtype="string")
    for code in np.unique(plan_codes[known & (plan_codes > 0)]).tolist():
        plan = notes.plans[code - 1]
        planned_steps = steps[roots[known & (plan_codes == code)]]
        # by category, not a text a row (a row without a level is in no plan's levels either)
        dropped |= np.isin(steps, planned_steps) & ~spans[col.LEVEL].isin(list(plan.levels | KEPT_LEVELS)).to_numpy(
            dtype=bool)
    return dropped
