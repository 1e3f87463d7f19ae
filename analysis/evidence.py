"""What the recommendations' rules (:mod:`xsp.analysis.recommend`) read of the spans a trace ran
in its steps (all its spans where it has no steps), as sums by key that add up over parts of the
trace: :func:`evidence_of` a part (the whole trace, or a window of whole trees of it), and
:func:`added_evidence` of several parts. The rules then decide alike on a trace loaded whole and
on one read a window at a time.

Each table keeps its keys in the order their first span comes in the loaded trace
(:mod:`xsp.analysis.in_order`), so that names of equal weight are listed alike either way.
Times are whole nanoseconds, whose sums are exact in any order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from xsp.analysis.gpu import SYNC_CALLS, kernel_table, whole_ns
from xsp.analysis.in_order import PLACE, added_in_order, grouped_in_order, row_places
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import nearest_ancestor, of_level, parent_positions

KERNEL_KEYS = ["name", "operator", "layer", "grid"]
KERNEL_SUMS = ["count", "duration_ns", "launched", "launch_ns", "short", "short_launch_ns"]
COPY_KEYS = ["path", "direction"]
COPY_SUMS = ["count", "ns", "bytes"]
CALL_KEYS = ["call", "path"]
CALL_SUMS = ["count", "ns"]
OPTIMIZER_CALL_COLUMNS = ["name", "ns", "operators", "fused"]
BLOCKING_CALLS = tuple(call for call in SYNC_CALLS if "WaitEvent" not in call)
"""Synchronising CUDA calls that block the host (waiting on an event is the device's)."""
OPTIMIZER_ANNOTATION = "Optimizer.step#"
"""How PyTorch's profiler names an optimizer step (``Optimizer.step#Adam.step``)."""
FUSED_OPTIMIZER = re.compile(r"_foreach_|_fused_|multi_tensor_apply", re.IGNORECASE)


@dataclass
class Evidence:
    """What the rules read (see the module's text)."""

    kernels: pd.DataFrame
    """The kernels by ``name``, ``operator`` (the innermost operator's name above the launch),
    ``layer`` and ``grid``: ``count``, ``duration_ns``, ``launched`` (those with a launch call),
    ``launch_ns`` (their calls' time), ``short`` (those shorter than their call) and
    ``short_launch_ns`` (those calls' time)."""
    pageable: pd.DataFrame
    """Copies from or to pageable host memory by ``path`` (of the innermost operator, else the
    copy's) and ``direction``: ``count``, ``ns``, ``bytes``."""
    blocking: pd.DataFrame
    """Host calls that block on the GPU (synchronising calls, ``cudaMemcpy``) by ``call`` and
    ``path`` (of the innermost operator, else the call's): ``count``, ``ns``."""
    to_host_copies: int
    """Device-to-host copies."""
    optimizer_calls: pd.DataFrame
    """Each optimizer step at the model level: ``name``, ``ns``, ``operators`` (on its thread
    within its time), ``fused`` (whether one of them is foreach or fused)."""
    operators: bool
    """Whether the trace recorded operators (of all its spans, in its steps or not)."""
    batch_sizes: np.ndarray
    """Every batch size recorded, of all spans."""
    kernel_medians_us: tuple[float, float] = field(default=(np.nan, np.nan))
    """The median duration of the kernels that have a launch call, and of those calls (µs).
    :func:`evidence_of` finds them; :func:`added_evidence` cannot (the caller sets them)."""


def evidence_of(spans: pd.DataFrame, in_steps: np.ndarray, order: np.ndarray | None = None,
                kernels: pd.DataFrame | None = None) -> Evidence:
    """The evidence of ``spans`` (whole trees), of the rows ``in_steps`` (the steps' work);
    ``order``: each row's place in the loaded trace (N x 3), where ``spans`` is part of a trace;
    ``kernels``: its :func:`xsp.analysis.kernel_table`, where the caller has it."""
    places = order if order is not None else row_places(len(spans))
    parents = parent_positions(spans)
    kernel_groups, medians = _kernels(spans, kernel_table(spans) if kernels is None else kernels, in_steps, places)
    level = spans[col.LEVEL]
    kind = spans[col.KIND]
    copies = ((level == Level.KERNEL.value) & (kind == SpanKind.MEMCPY.value)).to_numpy(dtype=bool) & in_steps
    pageable = copies & spans[col.NAME].str.contains("Pageable", case=False, na=False).to_numpy(dtype=bool)
    directions = spans[col.COPY_KIND].astype(object).where(spans[col.COPY_KIND].notna(), None)
    to_host = copies & directions.fillna("").astype(str).str.startswith("DtoH").to_numpy(dtype=bool)
    names = spans[col.NAME].astype(str)
    api = (level == Level.CUDA_API.value).to_numpy(dtype=bool) & in_steps
    blocking = api & (names.str.startswith(BLOCKING_CALLS) | (names == "cudaMemcpy")
                      | names.str.startswith("cuMemcpyDtoH")).to_numpy(dtype=bool)
    paths = _operator_paths(spans, parents)
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    rows = np.flatnonzero(pageable)
    pageable_table = grouped_in_order(pd.DataFrame({
        "path": paths[rows], "direction": directions.fillna("?").astype(str).to_numpy(dtype=object)[rows],
        "count": 1, "ns": durations[rows],
        "bytes": spans[col.BYTES].fillna(0).to_numpy(dtype=np.float64)[rows]}), places[rows], COPY_KEYS, COPY_SUMS)
    rows = np.flatnonzero(blocking)
    blocking_table = grouped_in_order(pd.DataFrame({
        "call": names.to_numpy(dtype=object)[rows], "path": paths[rows], "count": 1, "ns": durations[rows]}),
        places[rows], CALL_KEYS, CALL_SUMS)
    return Evidence(kernels=kernel_groups, pageable=pageable_table, blocking=blocking_table,
                    to_host_copies=int(to_host.sum()), optimizer_calls=_optimizer_calls(spans, in_steps, places),
                    operators=bool(((level == Level.OPERATOR.value) & (kind == SpanKind.OPERATOR.value)).any()),
                    batch_sizes=spans[col.BATCH_SIZE].dropna().to_numpy(dtype=np.float64),
                    kernel_medians_us=medians)


def added_evidence(parts: list[Evidence]) -> Evidence:
    """The evidence of the trace whose parts (whole trees each) are ``parts``; its kernel
    medians unknown (NaN)."""
    calls = pd.concat([part.optimizer_calls for part in parts], ignore_index=True) if parts else \
        pd.DataFrame(columns=[*OPTIMIZER_CALL_COLUMNS, *PLACE])
    calls = calls.sort_values(PLACE, kind="stable").reset_index(drop=True)
    return Evidence(
        kernels=added_in_order([part.kernels for part in parts], KERNEL_KEYS, KERNEL_SUMS),
        pageable=added_in_order([part.pageable for part in parts], COPY_KEYS, COPY_SUMS),
        blocking=added_in_order([part.blocking for part in parts], CALL_KEYS, CALL_SUMS),
        to_host_copies=sum(part.to_host_copies for part in parts), optimizer_calls=calls,
        operators=any(part.operators for part in parts),
        batch_sizes=np.concatenate([part.batch_sizes for part in parts]) if parts else np.zeros(0))


def _kernels(spans: pd.DataFrame, table: pd.DataFrame, in_steps: np.ndarray, places: np.ndarray
             ) -> tuple[pd.DataFrame, tuple[float, float]]:
    """The kernels' table of :attr:`Evidence.kernels` (``table``: the spans' kernel table), and
    their medians."""
    rows = np.flatnonzero((spans[col.LEVEL] == Level.KERNEL.value).to_numpy()
                          & (spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    chosen = in_steps[rows]
    table, rows = table[chosen], rows[chosen]
    duration_ns = whole_ns(table["duration_us"]).to_numpy(dtype=np.float64)
    launch_ns = whole_ns(table["launch_duration_us"]).to_numpy(dtype=np.float64)
    launched = ~np.isnan(launch_ns)
    short = launched & (duration_ns < np.where(launched, launch_ns, 0.0))
    frame = pd.DataFrame({
        "name": table["name"].astype(object).to_numpy(), "operator": table["operator"].to_numpy(dtype=object),
        "layer": table["layer"].to_numpy(dtype=object), "grid": table["grid"].astype(object).to_numpy(),
        "count": 1, "duration_ns": duration_ns, "launched": launched.astype(np.int64),
        "launch_ns": np.where(launched, launch_ns, 0.0), "short": short.astype(np.int64),
        "short_launch_ns": np.where(short, launch_ns, 0.0)})
    medians = (float(np.median(duration_ns[launched])) / 1e3, float(np.median(launch_ns[launched])) / 1e3) \
        if launched.any() else (np.nan, np.nan)
    return grouped_in_order(frame, places[rows], KERNEL_KEYS, KERNEL_SUMS), medians


def _operator_paths(spans: pd.DataFrame, parents: np.ndarray) -> np.ndarray:
    """For each span, the path (else name) of its innermost operator (else its own)."""
    operators = nearest_ancestor(spans, of_level(spans, Level.OPERATOR), parents)
    paths = spans[col.PATH].to_numpy(dtype=object, na_value=None)
    names = spans[col.NAME].to_numpy(dtype=object, na_value=None)
    at = np.where(operators >= 0, operators, np.arange(len(spans)))
    chosen = np.where(pd.isna(paths[at]) | (paths[at] == ""), names[at], paths[at])
    return np.array([str(value) for value in chosen], dtype=object)


def _optimizer_calls(spans: pd.DataFrame, in_steps: np.ndarray, places: np.ndarray) -> pd.DataFrame:
    """:attr:`Evidence.optimizer_calls`, with their places."""
    model = (spans[col.LEVEL] == Level.MODEL.value).to_numpy() & in_steps
    is_call = model & ((spans[col.KIND] == SpanKind.OPTIMIZER.value).to_numpy()
                       | spans[col.NAME].str.startswith(OPTIMIZER_ANNOTATION).fillna(False).to_numpy(dtype=bool))
    rows = np.flatnonzero(is_call)
    operators = spans[((spans[col.LEVEL] == Level.OPERATOR.value) & (spans[col.KIND] == SpanKind.OPERATOR.value))]
    op_start = operators[col.START_NS].to_numpy(dtype=np.int64)
    op_end = operators[col.END_NS].to_numpy(dtype=np.int64)
    op_thread = operators[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    op_names = operators[col.NAME].astype(str).to_numpy(dtype=object)
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    counts, fused = [], []
    for row in rows.tolist():
        thread = threads[row]
        inside = (op_start >= starts[row]) & (op_end <= ends[row]) & ((op_thread == thread) | np.isnan(thread))
        counts.append(int(inside.sum()))
        fused.append(any(FUSED_OPTIMIZER.search(name) for name in op_names[inside]))
    calls = pd.DataFrame({"name": spans[col.NAME].astype(str).to_numpy(dtype=object)[rows],
                          "ns": spans[col.DURATION_NS].to_numpy(dtype=np.float64)[rows],
                          "operators": np.array(counts, dtype=np.int64), "fused": np.array(fused, dtype=bool)})
    return calls.assign(**{name: places[rows, at] for at, name in enumerate(PLACE)})


__all__ = ["Evidence", "added_evidence", "evidence_of"]
