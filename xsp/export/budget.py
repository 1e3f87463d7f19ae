"""Traces Jaeger can open: at most a span budget per exported trace, the deepest levels folded.

Jaeger's UI slows to a crawl past a couple of thousand spans in one trace and fails to load
traces of tens of thousands (jaeger-ui #645, jaeger #2183), while one training step of a GPU
model holds ten thousand kernels and CUDA calls. Before export, each trace (one step) over the
budget has its deepest levels folded: every span at or below the cut level becomes part of one
*aggregate* span per (nearest ancestor above the cut, level, thread or stream), which carries
how many spans it stands for, their total time and their most frequent names. The cut moves up
a level at a time (kernel, CUDA API, operator, layer) until the trace fits. The trace file
keeps every raw span; only what is sent is folded.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.export.target import DEFAULT_SPAN_BUDGET
from xsp.table.build import string_array
from xsp.table.walks import NONE, depth_of, nearest_marked, parent_positions

TOP_NAMES: Final = 5
ATTR_AGGREGATED_COUNT: Final = "xsp.aggregated.count"
ATTR_AGGREGATED_TOTAL_NS: Final = "xsp.aggregated.total_ns"
ATTR_AGGREGATED_TOP: Final = "xsp.aggregated.top_names"
ATTR_AGGREGATED_LEVEL: Final = "xsp.aggregated.level"
ATTR_BUDGET: Final = "xsp.span_budget"
"""On a trace's root span when its trace was folded: the budget, the spans it held and the cut."""
ATTR_BUDGET_RAW_SPANS: Final = "xsp.span_budget.raw_spans"
ATTR_BUDGET_CUT: Final = "xsp.span_budget.cut_level"
ATTR_BUDGET_DROPPED: Final = "xsp.span_budget.dropped"
_LEVEL_RANK: Final = {level.value: level.rank for level in Level}
_ROOT_RANK: Final = Level.INPUT.rank
"""Model and input spans are never folded: they are the step itself."""


@dataclass
class Folded:
    """What fitting a table into the budget did."""

    spans: pd.DataFrame
    traces_folded: int = 0
    raw_spans_folded: int = 0
    """Spans of the input now represented by aggregates."""
    aggregates: int = 0
    dropped: int = 0
    """Spans left out altogether (a trace over budget even with only its model and layer levels)."""


def within_budget(spans: pd.DataFrame, budget: int = DEFAULT_SPAN_BUDGET) -> Folded:
    """``spans`` with every trace (``trace_id``) of more than ``budget`` spans folded to fit.

    Rows of traces within the budget are returned untouched; ``budget <= 0`` folds nothing.
    """
    if budget <= 0 or len(spans) <= budget:
        return Folded(spans)
    sizes = spans[col.TRACE_ID].value_counts()
    over = sizes[sizes > budget].index.tolist()
    if not over:
        return Folded(spans)
    in_over = spans[col.TRACE_ID].isin(over).to_numpy()
    parts = [spans[~in_over]]
    result = Folded(spans)
    for trace_id in over:
        trace = spans[(spans[col.TRACE_ID] == trace_id).to_numpy()].reset_index(drop=True)
        folded, aggregates, dropped = _fold_trace(trace, budget)
        parts.append(folded)
        result.traces_folded += 1
        result.aggregates += aggregates
        result.dropped += dropped
        result.raw_spans_folded += len(trace) - (len(folded) - aggregates) - dropped
    result.spans = pd.concat(parts, ignore_index=True)
    return result


def _fold_trace(trace: pd.DataFrame, budget: int) -> tuple[pd.DataFrame, int, int]:
    """One trace folded as little as fits; (spans, aggregates made, spans dropped).

    Cuts are tried from the least folding on: all of the deepest level, then the next level
    from its deepest spans up (nested operators before the outer ones), and so on, a level at
    a time; the first cut that fits is taken.
    """
    ranks = np.array([_LEVEL_RANK.get(level, 0) for level in trace[col.LEVEL].tolist()], dtype=np.int64)
    parents = parent_positions(trace)
    depth = depth_of(parents)
    lanes = _lanes(trace)
    levels = trace[col.LEVEL].to_numpy(dtype=object)
    chosen: np.ndarray | None = None
    cut_level: str | None = None
    coarse = False
    for mask, level in _cuts(ranks, depth, levels):
        chosen, cut_level = mask, level
        for coarse in (False, True):
            if _count_after(mask, parents, levels, lanes, coarse) <= budget:
                break
        else:
            continue
        break
    folded, aggregates = (trace, 0) if chosen is None else _fold(trace, chosen, parents, lanes, coarse)
    dropped = 0
    if len(folded) > budget:  # even the shallowest levels do not fit: keep the shallowest spans, count the rest
        folded, dropped = _keep_shallowest(folded, budget)
    _mark_root(folded, budget, len(trace), cut_level, dropped)
    return folded, aggregates, dropped


def _cuts(ranks: np.ndarray, depth: np.ndarray, levels: np.ndarray) -> Iterator[tuple[np.ndarray, str]]:
    """Which spans to fold, least first: all of the deepest level; then the next level from its
    deepest spans up (nested operators before the outer ones); and so on."""
    for level_rank in sorted({int(r) for r in ranks if r > _ROOT_RANK}, reverse=True):
        deeper = ranks > level_rank
        at_level = ranks == level_rank
        level = str(levels[np.flatnonzero(at_level)[0]])
        for min_depth in sorted({int(d) for d in depth[at_level]}, reverse=True):
            yield deeper | (at_level & (depth >= min_depth)), level


def _lanes(trace: pd.DataFrame) -> np.ndarray:
    """GPU work is grouped by stream, host work by thread."""
    threads = trace[col.THREAD_ID].fillna(-1).to_numpy(dtype=np.int64)
    streams = trace[col.STREAM_ID].fillna(-1).to_numpy(dtype=np.int64)
    return np.where(streams >= 0, -2 - streams, threads)


def _groups(mask: np.ndarray, parents: np.ndarray, levels: np.ndarray, lanes: np.ndarray,
            coarse: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows folded, their anchors, their group codes) when the spans of ``mask`` are folded:
    one group per anchor, level and thread or stream, or with ``coarse`` one per anchor."""
    anchors = nearest_marked(parents, ~mask)
    rows = np.flatnonzero(mask & (anchors != NONE))
    if coarse:
        codes, _ = pd.factorize(anchors[rows])
    else:
        codes, _ = pd.MultiIndex.from_arrays([anchors[rows], levels[rows], lanes[rows]]).factorize()
    return rows, anchors[rows], codes


def _count_after(mask: np.ndarray, parents: np.ndarray, levels: np.ndarray, lanes: np.ndarray,
                 coarse: bool) -> int:
    rows, _, codes = _groups(mask, parents, levels, lanes, coarse)
    return len(parents) - len(rows) + (int(codes.max()) + 1 if len(codes) else 0)


def _fold(trace: pd.DataFrame, mask: np.ndarray, parents: np.ndarray, lanes: np.ndarray,
          coarse: bool) -> tuple[pd.DataFrame, int]:
    rows, anchors, codes = _groups(mask, parents, trace[col.LEVEL].to_numpy(dtype=object), lanes, coarse)
    if not len(rows):
        return trace, 0
    starts = trace[col.START_NS].to_numpy(dtype=np.int64)[rows]
    ends = trace[col.END_NS].to_numpy(dtype=np.int64)[rows]
    members = pd.DataFrame({"code": codes, "row": rows, "anchor": anchors, "start": starts, "end": ends,
                            "total": ends - starts, "name": trace[col.NAME].to_numpy(dtype=object)[rows]})
    grouped = members.groupby("code", sort=True, observed=True)
    summary = grouped.agg(start=("start", "min"), end=("end", "max"), total=("total", "sum"),
                          count=("row", "size"), anchor=("anchor", "first"))
    summary["first"] = members.loc[grouped["start"].idxmin().to_numpy(), "row"].to_numpy()
    tops = members.groupby(["code", "name"], sort=False,
                           observed=True).size().sort_values(ascending=False, kind="stable")
    top_names: dict[int, list[str]] = {}
    for (code, name), count in tops.items():
        names = top_names.setdefault(int(code), [])
        if len(names) < TOP_NAMES:
            names.append(f"{name} x{count}")
    first = summary["first"].to_numpy()
    made = trace.iloc[first].reset_index(drop=True)
    ids = trace[col.SPAN_ID].to_numpy(dtype=np.int64)
    level_of = made[col.LEVEL].astype(object).tolist()
    distinct = members.groupby("code", observed=True)["name"].nunique().to_numpy()
    made[col.PARENT_ID] = pd.array(ids[summary["anchor"].to_numpy()], dtype="Int64")
    made[col.START_NS] = summary["start"].to_numpy()
    made[col.END_NS] = summary["end"].to_numpy()
    made[col.DURATION_NS] = made[col.END_NS] - made[col.START_NS]
    counts = summary["count"].to_numpy()
    made[col.NAME] = string_array([
        f"{count} spans" if coarse and kinds > 1 else f"{count} {level} spans" if kinds > 1 else f"{name} x{count}"
        for count, level, kinds, name in zip(counts.tolist(), level_of, distinct.tolist(), made[col.NAME].tolist())])
    for column in (col.PATH, col.CORRELATION_ID, col.EXTERNAL_ID):
        made[column] = pd.Series([None] * len(made), dtype=trace[column].dtype)
    made[col.ATTRIBUTES] = string_array([
        json.dumps({ATTR_AGGREGATED_COUNT: count, ATTR_AGGREGATED_TOTAL_NS: total, ATTR_AGGREGATED_TOP: top_names[code],
                    ATTR_AGGREGATED_LEVEL: level})
        for code, count, total, level in zip(summary.index.tolist(), counts.tolist(), summary["total"].tolist(),
                                             level_of)])
    kept = trace[~np.isin(np.arange(len(trace)), rows)]
    return pd.concat([kept, made], ignore_index=True), len(made)


def _keep_shallowest(trace: pd.DataFrame, budget: int) -> tuple[pd.DataFrame, int]:
    depth = depth_of(parent_positions(trace))
    order = np.lexsort((trace[col.START_NS].to_numpy(dtype=np.int64), depth))
    keep = np.zeros(len(trace), dtype=bool)
    keep[order[:budget]] = True
    return trace[keep].reset_index(drop=True), _spans_standing_for(trace[col.ATTRIBUTES].to_numpy(dtype=object)[~keep])


def _spans_standing_for(attributes: np.ndarray) -> int:
    """How many recorded spans the given rows stand for: an aggregate its count, any other one."""
    total = 0
    for text in attributes.tolist():
        count = 1
        if isinstance(text, str) and ATTR_AGGREGATED_COUNT in text:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                count = int(json.loads(text).get(ATTR_AGGREGATED_COUNT, 1))
        total += count
    return total


def _mark_root(trace: pd.DataFrame, budget: int, raw: int, cut: str | None, dropped: int) -> None:
    roots = np.flatnonzero(trace[col.PARENT_ID].isna().to_numpy())
    if not len(roots):
        return
    row = int(roots[np.argmin(trace[col.START_NS].to_numpy()[roots])])
    text = trace[col.ATTRIBUTES].iloc[row]
    attributes = json.loads(text) if isinstance(text, str) else {}
    attributes.update({ATTR_BUDGET: budget, ATTR_BUDGET_RAW_SPANS: raw, ATTR_BUDGET_CUT: cut,
                       ATTR_BUDGET_DROPPED: dropped})
    column = trace[col.ATTRIBUTES].astype(object).tolist()
    column[row] = json.dumps(attributes)
    trace[col.ATTRIBUTES] = string_array(column)
