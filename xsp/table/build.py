"""Building the canonical span table from the rows tracers collected."""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.memory_release import LARGE_TABLE_ROWS, release_freed_memory
from xsp.core.rank import session_trace_id
from xsp.table import late_records, paths, steps
from xsp.table import parents as hierarchy
from xsp.table.sampling import StepNotes, apply_step_notes
from xsp.table.step_samples import annotate_steps
from xsp.table.walks import (
    arrow_strings,
    categorical,
    categories_at,
    ids_at,
    memory_pool,
    nearest_marked,
    null_categories,
    nullable_ints,
    plain_strings,
    set_texts,
    untouched_zeros,
)


def empty_table() -> pd.DataFrame:
    """A span table with no rows and every column typed."""
    return _empty_table().copy()


@functools.cache
def _empty_table() -> pd.DataFrame:
    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in col.COLUMNS.items()})


def string_array(values: Any) -> pd.api.extensions.ExtensionArray:
    """Python strings (or None) as pandas' "string" dtype, converted by Arrow in one go."""
    try:
        return arrow_strings(pa.array(values, type=pa.large_string(), memory_pool=memory_pool()))
    except (pa.ArrowException, TypeError):
        return pd.array([None if v is None or v is pd.NA else str(v) for v in values], dtype="string")


def null_column(dtype: str, count: int) -> Any:
    """A column of ``count`` nulls of a schema dtype."""
    if dtype == "string":
        offsets = pa.py_buffer(untouched_zeros(count + 1))
        validity = pa.py_buffer(untouched_zeros((count + 7) // 8, np.uint8))
        return arrow_strings(pa.LargeStringArray.from_buffers(count, offsets, pa.py_buffer(b""), validity, count))
    if dtype == col.CATEGORY:
        return null_categories(count)
    if dtype == "int64":  # only ids and times, which build_table fills in
        return np.zeros(count, dtype=np.int64)
    return pd.arrays.IntegerArray(untouched_zeros(count), np.ones(count, dtype=bool))


def _as_strings(series: pd.Series) -> pd.api.extensions.ExtensionArray:
    """A column as pandas' "string" dtype: by Arrow in one go where it holds strings and nulls
    (pandas 3's default ``str`` columns are Arrow already), else string by string."""
    try:
        return arrow_strings(plain_strings(series))
    except (pa.ArrowException, TypeError):
        return string_array(series.astype(object).where(series.notna(), None).tolist())


def conform(frame: pd.DataFrame, names: Iterable[str] | None = None) -> pd.DataFrame:
    """``frame`` with exactly the schema's columns (or those of them ``names`` says), in order,
    with the schema's dtypes."""
    out = {}
    kept = None if names is None else set(names)
    for name, dtype in col.COLUMNS.items():
        if kept is not None and name not in kept:
            continue
        if name in frame:
            series = frame[name]
            if str(series.dtype) == dtype:
                out[name] = series.reset_index(drop=True)
                continue
            if dtype == "string":
                series = pd.Series(_as_strings(series), index=series.index)
            elif dtype == col.CATEGORY:
                series = pd.Series(categorical(pa.array(_as_strings(series))), index=series.index)
            else:
                series = series.astype(dtype)
            out[name] = series.reset_index(drop=True)
        else:
            out[name] = pd.Series(null_column(dtype, len(frame)), copy=False)
    return pd.DataFrame(out, copy=False)  # pandas would copy every column: a table of millions of rows twice


def _conformed(table: pd.DataFrame) -> pd.DataFrame:
    """``conform(table)`` for a table of build_table's own, which nothing else holds: itself where
    it has the schema's columns in order, its dtypes and a plain index already (a window's
    table always has), not a new frame of the same columns."""
    index = table.index
    if (isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1
            and list(table.columns) == list(col.COLUMNS)
            and all(str(dtype) == col.COLUMNS[name] for name, dtype in table.dtypes.items())):
        return table
    return conform(table)


def concat_spans(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Span tables one after another (their columns' union, in the order first seen), their
    :data:`xsp.core.schema.CATEGORY` columns categorical: pandas turns categoricals of different
    categories into text when it concatenates them (a Python string a row), so these are joined
    by their categories (a part without the column adds nulls; one with it as text, its texts)."""
    parts = list(frames)
    if not parts:
        return empty_table()
    names = list(dict.fromkeys(name for part in parts for name in part.columns))
    joined_by_category = [name for name in names if col.COLUMNS.get(name) == col.CATEGORY
                          and any(name in part and isinstance(part[name].dtype, pd.CategoricalDtype)
                                  for part in parts)]
    # a text column that is categorical (or objects) in some part: pandas would make each row a
    # Python string (a quarter of an operator window's interpretation); Arrow joins them instead
    joined_as_text = [name for name in names if col.COLUMNS.get(name) == "string"
                      and len({str(part[name].dtype) for part in parts if name in part}) > 1]
    apart = set(joined_by_category) | set(joined_as_text)
    joined = pd.concat([part.drop(columns=[name for name in apart if name in part]) for part in parts],
                       ignore_index=True)
    for name in joined_as_text:
        joined[name] = arrow_strings(pa.concat_arrays([
            plain_strings(part[name]) if name in part else pa.nulls(len(part), pa.large_string()) for part in parts]))
    for name in joined_by_category:
        arrays = [_as_categorical(part, name) for part in parts]
        present = next(array.categories for array in arrays if len(array.categories))[:0] if any(
            len(array.categories) for array in arrays) else None
        if present is not None:  # the empty ones take the others' dtype of categories
            arrays = [array if len(array.categories) else pd.Categorical.from_codes(
                array.codes, dtype=pd.CategoricalDtype(present)) for array in arrays]
        try:
            values = pd.api.types.union_categoricals(arrays, sort_categories=True)
        except TypeError:  # categories of different dtypes (text and objects): joined as text
            values = categorical(pa.concat_arrays([plain_strings(pd.Series(array)) for array in arrays]))
        joined[name] = values
    return joined[names]


def _as_categorical(part: pd.DataFrame, name: str) -> pd.Categorical:
    """``part[name]`` as a categorical: itself, its texts as one, or nulls where the part lacks it."""
    if name not in part:
        return pd.Categorical.from_codes(np.full(len(part), -1, dtype=np.int8), categories=pd.Index([], dtype=object))
    column = part[name]
    if isinstance(column.dtype, pd.CategoricalDtype):
        return column.array  # type: ignore[no-any-return]
    return categorical(pa.array(_as_strings(column)))


def new_span_ids(count: int) -> np.ndarray:
    """``count`` distinct positive 63-bit span ids (OTel forbids 0)."""
    return secrets.randbits(62) + np.arange(1, count + 1, dtype=np.int64)


def new_trace_ids(count: int) -> list[str]:
    """``count`` random 128-bit trace ids, as 32 hex digits each (the kernel's randomness, as
    :func:`secrets.token_hex`'s, drawn at once)."""
    digits = os.urandom(16 * count).hex()
    return [digits[start:start + 32] for start in range(0, 32 * count, 32)]


def widen_backward_layers(table: pd.DataFrame) -> None:
    """Widen each backward layer span to the outermost operators it cuts, in place.

    A module's backward is timed by hooks on autograd graph nodes, and the autograd engine
    runs those hooks inside its ``evaluate_function`` operator for the node: with the
    operator level on, a backward layer span would begin (or end) inside that operator and
    end (begin) outside it, and could neither contain it nor sit inside it. Its bounds move
    out to the operator's. Outermost operators on one thread never overlap, so a span that
    contained another still does. A span that ends at the next layer's backward begin
    (:attr:`~xsp.core.schema.BackwardEnd.NEXT_BACKWARD`) ends where that layer's node's operator
    begins instead: the operator is the next layer's.
    """
    levels = table[col.LEVEL]  # compared by category: no text a row
    backward = np.flatnonzero(((levels == col.Level.LAYER.value)
                               & (table[col.KIND] == col.SpanKind.BACKWARD.value)).to_numpy(dtype=bool))
    operators = np.flatnonzero((levels == col.Level.OPERATOR.value).to_numpy(dtype=bool))
    if not len(backward) or not len(operators):
        return
    threads = table[col.THREAD_ID].to_numpy(dtype=np.int64, na_value=0)
    starts = table[col.START_NS].to_numpy(dtype=np.int64).copy()
    ends = table[col.END_NS].to_numpy(dtype=np.int64).copy()
    ends_at_next = np.zeros(len(table), dtype=bool)
    ends_at_next[backward] = (table[col.ATTRIBUTES].iloc[backward]
                              == col.BACKWARD_END_ATTRIBUTES[col.BackwardEnd.NEXT_BACKWARD]).to_numpy(dtype=bool,
                                                                                                 na_value=False)
    for thread in np.unique(threads[backward]).tolist():
        ops = operators[threads[operators] == thread]
        ops = ops[np.lexsort((-ends[ops], starts[ops]))]
        outermost = ops[ends[ops] > np.maximum.accumulate(np.concatenate([[np.iinfo(np.int64).min], ends[ops][:-1]]))]
        op_starts, op_ends = starts[outermost], ends[outermost]
        for row in backward[threads[backward] == thread].tolist():
            before = np.searchsorted(op_starts, starts[row], side="right") - 1
            if before >= 0 and op_ends[before] > starts[row]:
                starts[row] = op_starts[before]
            before = np.searchsorted(op_starts, ends[row], side="left") - 1
            if before >= 0 and op_ends[before] > ends[row]:
                ends[row] = max(op_starts[before], starts[row]) if ends_at_next[row] else op_ends[before]
    table[col.START_NS], table[col.END_NS] = starts, ends


@dataclass
class TableResult:
    spans: pd.DataFrame
    diagnostics: dict[str, int]


def new_step_state(attach_to_session: bool = True, job_id: str | None = None,
                   below: tuple[str, int] | None = None) -> steps.StepState:
    """Ids of a session's root span, fixed before any window is built; one rank of the
    distributed job ``job_id`` shares its session spans' trace id with every other rank. ``below``:
    the (trace id, span id) of the span the session's own is exported below, in that span's trace
    (a followed child process's session, below its parent's)."""
    if below is not None:
        trace_id = below[0]
    else:
        trace_id = new_trace_ids(1)[0] if job_id is None else session_trace_id(job_id)
    return steps.StepState(session_trace_id=trace_id, session_span_id=int(new_span_ids(1)[0]),
                           session_parent_id=None if below is None else int(below[1]),
                           attach_to_session=attach_to_session, job_id=job_id)


def mark_recomputation(table: pd.DataFrame, parents: np.ndarray) -> None:
    """Module forwards run inside a backward pass (activation checkpointing recomputing them)
    are ``recompute`` spans, not forwards: in place."""
    kinds = table[col.KIND]
    forward = (kinds == col.SpanKind.FORWARD.value).to_numpy(dtype=bool)  # by code: no text a row
    backward = (kinds == col.SpanKind.BACKWARD.value).to_numpy(dtype=bool)
    if not forward.any() or not backward.any():
        return
    recompute = forward & (nearest_marked(parents, backward) >= 0)
    if recompute.any():
        set_texts(table, recompute, col.KIND, col.SpanKind.RECOMPUTE.value)


def build_table(frames: Iterable[pd.DataFrame], host_to_epoch_ns: int, state: steps.StepState,
                session_row: dict[str, Any] | None = None, sort: bool = True,
                step_numbers: list[int] | None = None, live_records: bool = True,
                step_notes: StepNotes | None = None) -> TableResult:
    """Concatenate one window's tracer rows, move them onto epoch time and derive the tree.

    Args:
        frames: rows from tracers, times on xsp's host clock.
        host_to_epoch_ns: offset from the host clock to epoch nanoseconds.
        state: the session's ids, step count and latest steps, from earlier windows; updated.
        session_row: the session span, in the session's last window only.
        sort: sort the rows by start time (nothing below needs them sorted; a session sorts
            its windows in Arrow as it writes them, where sorting holds no lock of Python's).
        step_numbers: the numbers of the window's steps in order of start, when the session
            kept only some steps (a schedule).
        live_records: the rows are xsp's own tracers' records: CUDA API calls are moved under
            the span their external correlation id names where the clocks disagree
            (:func:`xsp.table.parents.external_parents`), and records that came a window late
            are placed (:mod:`xsp.table.late_records`). False for an imported trace, recorded
            whole on one clock.
        step_notes: an always-on session's notes of the window's steps (their depth, the
            request each joined: :mod:`xsp.table.sampling`).

    Returns:
        The window's span table (sorted by start time, if asked), and the hierarchy diagnostics.
    """
    parts = [frame for frame in frames if len(frame)]
    if session_row is not None:
        parts.append(pd.DataFrame([session_row]))
    if not parts:
        return TableResult(empty_table(), hierarchy.HierarchyDiagnostics().as_dict())
    # one frame (an import) is taken as it is: concatenating it alone copies its columns
    raw = parts[0].reset_index(drop=True) if len(parts) == 1 else concat_spans(parts)
    del parts
    if host_to_epoch_ns:  # an import's times are epoch times already
        raw[col.START_NS] = raw[col.START_NS].to_numpy(dtype=np.int64) + host_to_epoch_ns
        raw[col.END_NS] = raw[col.END_NS].to_numpy(dtype=np.int64) + host_to_epoch_ns
    if all(name in raw for name in (col.LEVEL, col.KIND, col.THREAD_ID)):
        widen_backward_layers(raw)
    depth = (raw[col.CALL_DEPTH].to_numpy(dtype=np.float64, na_value=-1).astype(np.int64) if col.CALL_DEPTH in raw
             else np.full(len(raw), -1, dtype=np.int64))
    order = np.lexsort((depth, raw[col.START_NS].to_numpy(dtype=np.int64)))
    if sort and not (order == np.arange(len(order))).all():  # importers hand rows over already in order
        raw = raw.take(order).reset_index(drop=True)  # before conform: the columns no tracer gave are not taken
    del depth, order
    table = conform(raw)
    del raw
    large = len(table) >= LARGE_TABLE_ROWS
    if large:
        release_freed_memory()
    is_session = (table[col.KIND] == col.SpanKind.SESSION.value).to_numpy()
    session_position = int(np.flatnonzero(is_session)[0]) if is_session.any() else None
    if session_position is None:  # an import: no row to leave out, so no copy of the table
        parents, diagnostics = hierarchy.infer_parent_positions(table, live_records)
    else:
        host_rows = np.flatnonzero(~is_session)
        sub_parents, diagnostics = hierarchy.infer_parent_positions(table.iloc[host_rows], live_records)
        parents = np.full(len(table), -1, dtype=np.int64)
        parents[host_rows] = np.where(sub_parents >= 0, host_rows[np.maximum(sub_parents, 0)], -1)
    if large:
        release_freed_memory()
    mark_recomputation(table, parents)
    shape = steps.assign_steps(table, parents, session_position, state, new_trace_ids,
                               step_numbers, step_notes)
    del parents  # the tree is in shape now; at millions of rows every array counts
    roots = int((shape.parents < 0).sum())
    if large:
        release_freed_memory()
    # the paths first: the largest column, made while the table is smallest
    table[col.PATH] = paths.assign_paths(table, shape, state)
    if large:
        release_freed_memory()
    # ids and durations last: the tree is made while the table is smallest
    table[col.DURATION_NS] = table[col.END_NS] - table[col.START_NS]
    table[col.SPAN_ID] = new_span_ids(len(table))
    if session_position is not None:
        table.loc[session_position, col.SPAN_ID] = state.session_span_id
    ids = np.append(table[col.SPAN_ID].to_numpy(dtype=np.int64), state.session_span_id)
    table[col.PARENT_ID] = ids_at(ids, shape.parents)
    del ids
    table[col.STEP] = nullable_ints(shape.step, shape.step < 0)
    exec_index = steps.execution_index(table, shape.step, state)
    table[col.EXEC_INDEX] = nullable_ints(exec_index, exec_index < 0)
    del exec_index
    trace_codes, trace_values = shape.trace_codes, shape.trace_values
    del shape
    if large:
        release_freed_memory()
    table[col.TRACE_ID] = categories_at(trace_codes, trace_values)
    del trace_codes
    unset = table[col.STATUS].isna().to_numpy()
    if unset.any():
        set_texts(table, unset, col.STATUS, col.Status.OK.value)
    diagnostics.spans = len(table)
    table = _conformed(table)
    if large:
        release_freed_memory()
    late_calls, late_activities = late_records.adopt_late(table, state) if live_records else (0, 0)
    if live_records:
        late_records.remember(table, state)
    diagnostics.late_linked = late_calls + late_activities
    diagnostics.launch_missing = max(diagnostics.launch_missing - late_activities, 0)
    diagnostics.launched += late_activities
    diagnostics.roots = roots - diagnostics.late_linked
    if step_notes is not None:
        table = apply_step_notes(table, step_notes)
    annotate_steps(table)
    return TableResult(table, diagnostics.as_dict())
