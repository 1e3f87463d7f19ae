"""The report's tables of a trace too large to load, read a window of whole trees at a time
(:class:`xsp.io.tree_windows.TreeWindows`), each equal to the table of the trace loaded whole:

* the span counts per level;
* the steps' latency (:func:`xsp.analysis.model_latency`, :func:`xsp.analysis.model_summary`):
  they read only the steps' roots, the model calls, torch.compile's spans and the waits for
  input, which are kept from each window (few: a handful a step) and analysed together;
* the operators by self time over the steps' work (:func:`xsp.analysis.operator_table` of the
  spans :func:`xsp.analysis.model.within_steps` keeps, the steps' times known beforehand), and
  what ran outside every step;
* the kernels by name (:func:`xsp.analysis.kernels_by_name`).

Each window's table is made by the function the whole trace's is, and the tables are added up by
name: counts and times summed, means and shares made again, and names in the order they first
ran, so that equal times are listed as the whole trace lists them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from xsp.analysis.gpu import kernels_by_name
from xsp.analysis.model import OutsideSteps, outside_steps, step_extents, within_steps
from xsp.analysis.operators import operator_table
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.io.tree_windows import TreeWindows
from xsp.table.build import concat_spans
from xsp.table.sampling import step_roots as step_root_positions

STEP_TRACE_KINDS = (SpanKind.PREDICT.value, SpanKind.COMPILE.value, SpanKind.INPUT.value)
"""The kinds of span the steps' latency reads, beside the steps' roots."""


@dataclass
class WindowedReport:
    """What :func:`windowed_report` found (see the module's text)."""

    metadata: dict[str, Any]
    spans: int
    steps: list[int]
    level_counts: dict[str, int]
    """Spans per level."""
    steps_trace: Trace
    """The spans the steps' latency reads: :func:`xsp.analysis.model_latency` of it is the whole trace's."""
    operators: pd.DataFrame
    """:func:`xsp.analysis.operator_table` of the steps' work (of the whole trace where it has no steps)."""
    operators_outside: OutsideSteps | None
    """The operators outside every step (None where the trace has no steps, or none ran outside)."""
    kernels: pd.DataFrame
    """:func:`xsp.analysis.kernels_by_name` of the whole trace."""


def windowed_report(windows: TreeWindows) -> WindowedReport:
    """The report's tables of the trace ``windows`` reads, in one reading of the file.

    Raises:
        TraceFormatError: the file is corrupt.
    """
    extents = _step_extents(windows)
    levels: Counter[str] = Counter()
    kept: list[pd.DataFrame] = []
    kept_order: list[np.ndarray] = []
    operators = _ByName(("count", "total_us", "self_us"))
    kernels = _ByName(("count", "total_us"), smallest=("min_us",), largest=("max_us",))
    outside: list[np.ndarray] = []
    first_ns, last_ns = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    for spans, order in windows.frames():
        levels.update(spans[col.LEVEL].dropna().astype(str).tolist())
        wanted = np.zeros(len(spans), dtype=bool)
        wanted[step_root_positions(spans)] = True
        wanted |= spans[col.KIND].isin(STEP_TRACE_KINDS).to_numpy(dtype=bool)
        if wanted.any():
            kept.append(_own_rows(spans[wanted]))
            kept_order.append(order[wanted])
        kernels.add(kernels_by_name(spans), _first_places(spans, order, _is_kind(spans, SpanKind.KERNEL)))
        if windows.steps:
            within = within_steps(spans, extents)
            if within.any():
                first_ns = min(first_ns, int(spans[col.START_NS].to_numpy()[within].min()))
                last_ns = max(last_ns, int(spans[col.END_NS].to_numpy()[within].max()))
            operator = (spans[col.LEVEL] == Level.OPERATOR.value).to_numpy(dtype=bool) & ~within
            outside.append(np.column_stack([spans[col.START_NS].to_numpy(dtype=np.int64)[operator],
                                            spans[col.END_NS].to_numpy(dtype=np.int64)[operator]]))
            view = spans[within].reset_index(drop=True)
            view_order = order[within]
        else:
            view, view_order = spans, order
        is_operator = ((view[col.LEVEL] == Level.OPERATOR.value) & (view[col.KIND] == SpanKind.OPERATOR.value))
        operators.add(operator_table(view), _first_places(view, view_order, is_operator.to_numpy(dtype=bool)))
    steps_trace = _in_loaded_order(kept, kept_order, windows.metadata)
    operator_figures = operators.result()
    operator_figures["mean_us"] = operator_figures["total_us"] / operator_figures["count"]
    total = operator_figures["self_us"].sum()
    operator_figures["share"] = operator_figures["self_us"] / total if total else np.nan
    operator_figures = operator_figures.sort_values("self_us", ascending=False, kind="stable").reset_index(drop=True)
    kernel_figures = kernels.result()
    kernel_figures["mean_us"] = kernel_figures["total_us"] / kernel_figures["count"]
    total = kernel_figures["total_us"].sum()
    kernel_figures["share"] = kernel_figures["total_us"] / total if total else np.nan
    kernel_figures = kernel_figures[["name", "count", "total_us", "mean_us", "min_us", "max_us", "share"]]
    kernel_figures = kernel_figures.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)
    return WindowedReport(
        metadata=windows.metadata, spans=windows.spans, steps=windows.steps, level_counts=dict(levels),
        steps_trace=steps_trace,
        operators=operator_figures[["name", "count", "total_us", "self_us", "mean_us", "share"]],
        operators_outside=_outside(outside, first_ns, last_ns) if windows.steps else None,
        kernels=kernel_figures)


def _step_extents(windows: TreeWindows) -> pd.DataFrame:
    """Every step's time, from the roots of every window (a first reading of the tree's columns)."""
    found = [step_extents(spans) for spans, _ in windows.frames(
        columns=[col.STEP, col.KIND, col.PARENT_ID, col.START_NS, col.END_NS])]
    if not found:
        return pd.DataFrame({"start": [], "end": []})
    every = pd.concat(found)
    return every.groupby(level=0).agg(start=("start", "min"), end=("end", "max"))


def _own_rows(spans: pd.DataFrame) -> pd.DataFrame:
    """Rows kept past their window, with only their own categories: a window's categorical
    column holds every text of the window (its paths: one a span), which a few rows kept of each
    window would otherwise hold on to."""
    return spans.assign(**{name: spans[name].cat.remove_unused_categories() for name in spans.columns
                           if isinstance(spans[name].dtype, pd.CategoricalDtype)})


def _is_kind(spans: pd.DataFrame, kind: SpanKind) -> np.ndarray:
    return (spans[col.KIND] == kind.value).to_numpy(dtype=bool)


def _first_places(spans: pd.DataFrame, order: np.ndarray, rows: np.ndarray) -> pd.DataFrame:
    """Per name among ``rows``, the place of its first span in the loaded trace."""
    names = spans[col.NAME].to_numpy(dtype=object)[rows]
    places = pd.DataFrame(order[rows], columns=["o0", "o1", "o2"])
    places.insert(0, "name", names)
    return places.groupby("name", sort=False).first()


class _ByName:
    """Tables by name of the windows, added up: ``summed`` columns summed, ``smallest`` and
    ``largest`` the least and most of the windows'; names in the order they first ran."""

    def __init__(self, summed: tuple[str, ...], smallest: tuple[str, ...] = (), largest: tuple[str, ...] = ()):
        self.summed, self.smallest, self.largest = summed, smallest, largest
        self.parts: list[pd.DataFrame] = []

    def add(self, table: pd.DataFrame, places: pd.DataFrame) -> None:
        if len(table):
            self.parts.append(table[["name", *self.summed, *self.smallest, *self.largest]].join(places, on="name"))
        if len(self.parts) > 64:  # a long trace: its names added up as it goes
            self.parts = [self._added()]

    def _added(self) -> pd.DataFrame:
        every = pd.concat(self.parts, ignore_index=True)
        group = every.groupby("name", sort=False)
        figures = {name: "sum" for name in self.summed} | {name: "min" for name in self.smallest} | {
            name: "max" for name in self.largest}
        added = group.agg(figures)
        places = every.sort_values(["o0", "o1", "o2"], kind="stable").groupby("name", sort=False)[
            ["o0", "o1", "o2"]].first()
        return added.join(places).reset_index()

    def result(self) -> pd.DataFrame:
        """The names' figures, in the order they first ran."""
        if not self.parts:
            return pd.DataFrame({name: pd.Series(dtype="float64" if name != "name" else object)
                                 for name in ("name", *self.summed, *self.smallest, *self.largest)})
        added = self._added().sort_values(["o0", "o1", "o2"], kind="stable")
        return added.drop(columns=["o0", "o1", "o2"]).reset_index(drop=True)


def _in_loaded_order(frames: list[pd.DataFrame], orders: list[np.ndarray], metadata: dict[str, Any]) -> Trace:
    """The rows kept of every window as one trace, in the order :func:`xsp.load` gives them."""
    if not frames:
        from xsp.table.build import empty_table

        return Trace(spans=empty_table(), metadata=metadata)
    spans = concat_spans(frames).reset_index(drop=True)
    order = np.concatenate(orders)
    return Trace(spans=spans.iloc[np.lexsort(order.T[::-1])].reset_index(drop=True), metadata=metadata)


def _outside(parts: list[np.ndarray], first_ns: int, last_ns: int) -> OutsideSteps | None:
    """:func:`xsp.analysis.model.outside_steps` of each window's spans of the level outside every
    step (their starts and ends), the steps' work from ``first_ns`` to ``last_ns``; None where none."""
    times = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)
    if not len(times) or first_ns > last_ns:
        return None
    return outside_steps(times[:, 0], times[:, 1], first_ns, last_ns)


__all__ = ["WindowedReport", "windowed_report"]
