"""Where a step's time went, how much of the session the steps cover, and the user's spans.

A step (see :mod:`xsp.record.steps`) holds the model-level spans of one iteration: model calls
(forward), backward passes, optimizer steps, input waits and compilations. They follow each
other on the step's thread, so their times add up; what is left of the step is ``other``
(loss code, logging, Python between the calls).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of, step_kind, step_roots
from xsp.core import schema as col
from xsp.core.schema import CLOSURE_SUFFIX, Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.walks import nearest_marked, parent_positions, union_length

PARTS: dict[str, SpanKind] = {
    "forward": SpanKind.PREDICT,
    "backward": SpanKind.BACKWARD,
    "optimizer": SpanKind.OPTIMIZER,
    "input": SpanKind.INPUT,
    "compile": SpanKind.COMPILE,
}
"""Each part of a step, and the kind of the model-level spans that make it."""
BREAKDOWN_COLUMNS = ["step", "name", "latency_ms", *(f"{part}_ms" for part in PARTS), "other_ms"]


def step_breakdown(source: Trace | pd.DataFrame, parts: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per step: its time in forward (model calls, less their compilation), backward,
    optimizer, input (DataLoader waits) and compile, and the ``other`` rest.

    Columns: ``step``, ``name``, ``latency_ms`` (the step's whole duration), ``forward_ms``,
    ``backward_ms``, ``optimizer_ms``, ``input_ms``, ``compile_ms``, ``other_ms``. Each moment
    counts once, for the innermost part it lies in (a closure optimizer's forwards and
    backwards are forward and backward, not optimizer too), so the parts add up to at most
    ``latency_ms`` and ``other_ms`` is the rest.

    ``parts``: :func:`part_times` of the whole trace, where ``source`` holds only some of its
    spans (its steps' roots: a trace read a window at a time).
    """
    spans = spans_of(source)
    roots = step_roots(spans)
    out = pd.DataFrame({"step": roots[col.STEP].astype("int64").to_numpy(), "name": roots[col.NAME].to_numpy(),
                        "latency_ms": roots[col.DURATION_NS].to_numpy(dtype=np.float64) / 1e6})
    own_ns = part_times(spans) if parts is None else parts
    for part, kind in PARTS.items():
        per_step = own_ns[own_ns["kind"] == kind.value].groupby("step", observed=True)["ns"].sum() / 1e6
        out[f"{part}_ms"] = out["step"].map(per_step).fillna(0.0).to_numpy()
    part_columns = [f"{part}_ms" for part in PARTS]
    total = out[part_columns].sum(axis=1).to_numpy()
    over = total > out["latency_ms"].to_numpy()  # parts reaching past their step (a span cut at its edge)
    if over.any():
        scale = np.where(over, out["latency_ms"].to_numpy() / np.where(total > 0, total, 1.0), 1.0)
        out[part_columns] = out[part_columns].to_numpy() * scale[:, None]
    out["other_ms"] = np.maximum(out["latency_ms"] - out[part_columns].sum(axis=1), 0.0)
    return out.sort_values("step").reset_index(drop=True)[BREAKDOWN_COLUMNS]


def part_times(spans: pd.DataFrame) -> pd.DataFrame:
    """Each model-level part span's own time: its duration less the part spans inside it (at
    any depth, through spans of other kinds). Made of whole trees each, these tables add up
    (concatenated) to the whole trace's. An optimizer step's closure (``SGD.step.closure``, kind
    ``user``) is a part too: the program's own code, whose time outside the forwards and
    backwards in it is no part's (``other`` in :func:`step_breakdown`), not the optimizer's.

    Columns: ``kind``, ``step``, ``ns``.
    """
    kinds = spans[col.KIND].to_numpy(dtype=object)
    closures = (kinds == SpanKind.USER.value) & spans[col.NAME].astype(str).str.endswith(CLOSURE_SUFFIX).to_numpy()
    is_part = (spans[col.LEVEL].isin([Level.MODEL.value, Level.INPUT.value]).to_numpy()
               & (np.isin(kinds, [kind.value for kind in PARTS.values()]) | closures)
               & spans[col.STEP].notna().to_numpy())
    duration = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    outer = nearest_marked(parent_positions(spans), is_part)
    inside = np.zeros(len(spans))
    nested = is_part & (outer >= 0)
    np.add.at(inside, outer[nested], duration[nested])
    rows = np.flatnonzero(is_part)
    # whole nanoseconds: their sums are exact in any order, a trace's parts add up to its own
    return pd.DataFrame({"kind": kinds[rows], "step": spans[col.STEP].to_numpy()[rows],
                         "ns": np.maximum(duration[rows] - inside[rows], 0.0)})


def step_summary(source: Trace | pd.DataFrame, parts: pd.DataFrame | None = None) -> pd.DataFrame:
    """:func:`step_breakdown` over all steps of each name (numbered steps such as
    ``ProfilerStep#N`` together): the mean of every part, and its share of the step
    (``parts`` as :func:`step_breakdown` takes them).

    Columns: ``name``, ``steps``, ``latency_ms`` (mean), then ``<part>_ms`` and
    ``<part>_share`` for forward, backward, optimizer, input, compile and other.
    """
    breakdown = step_breakdown(source, parts)
    named = [*PARTS, "other"]
    rows = []
    for name, group in breakdown.groupby(breakdown["name"].map(step_kind), sort=False, observed=True):
        latency = float(group["latency_ms"].sum())
        row: dict[str, object] = {"name": name, "steps": len(group), "latency_ms": latency / len(group)}
        for part in named:
            total = float(group[f"{part}_ms"].sum())
            row[f"{part}_ms"] = total / len(group)
            row[f"{part}_share"] = total / latency if latency else np.nan
        rows.append(row)
    columns = ["name", "steps", "latency_ms", *(f"{p}_ms" for p in named), *(f"{p}_share" for p in named)]
    return pd.DataFrame(rows, columns=columns)


def step_coverage(source: Trace | pd.DataFrame, extent_ns: tuple[int, int] | None = None) -> pd.DataFrame:
    """How much of the session the steps cover: one row.

    Columns: ``session_ms`` (the traced block, or the trace's extent when it has no session
    span), ``steps``, ``steps_ms`` (time inside at least one step), ``coverage`` (their
    ratio), ``outside_ms`` (the rest), and that rest by where: ``before_ms`` (before the first
    step: start-up, model construction), ``between_ms`` (between steps: input, evaluation outside
    steps, the program's own work), ``after_ms`` (after the last step: the end of the run), and
    ``compile_outside_ms``: of the time outside every step, what ``torch.compile`` spent compiling
    (a compiled function's first call before its step began, a compiled optimizer step).

    ``extent_ns``: the first start and last end of every span of the trace, where ``source``
    holds only some of them (its session spans and steps' roots: a trace read a window at a time).
    """
    spans = spans_of(source)
    session = spans[spans[col.KIND] == SpanKind.SESSION.value]
    if len(session):
        start, end = int(session[col.START_NS].min()), int(session[col.END_NS].max())
    elif extent_ns is not None:
        start, end = extent_ns
    elif len(spans):
        start, end = int(spans[col.START_NS].min()), int(spans[col.END_NS].max())
    else:
        start = end = 0
    roots = step_roots(spans)
    starts, ends = roots[col.START_NS].to_numpy(dtype=np.int64), roots[col.END_NS].to_numpy(dtype=np.int64)
    inside = union_length(starts, ends)
    # in whole nanoseconds, then ms: a difference of ms figures left 5e-16 ms "between" steps
    outside_ns = max(end - start - int(inside), 0)
    before_ns = max(int(starts.min()) - start, 0) if len(roots) else outside_ns
    after_ns = max(end - int(ends.max()), 0) if len(roots) else 0
    session_ms, steps_ms = (end - start) / 1e6, inside / 1e6
    compiles = spans[spans[col.KIND] == SpanKind.COMPILE.value]
    compile_outside_ns = 0
    if len(compiles):  # the union of compiles and steps, less the steps': compiling outside every step
        both_starts = np.concatenate([starts, compiles[col.START_NS].to_numpy(dtype=np.int64)])
        both_ends = np.concatenate([ends, compiles[col.END_NS].to_numpy(dtype=np.int64)])
        compile_outside_ns = max(int(union_length(both_starts, both_ends)) - int(inside), 0)
    return pd.DataFrame([{"session_ms": session_ms, "steps": len(roots), "steps_ms": steps_ms,
                          "coverage": steps_ms / session_ms if session_ms else np.nan,
                          "outside_ms": outside_ns / 1e6, "before_ms": before_ns / 1e6, "after_ms": after_ns / 1e6,
                          "between_ms": max(outside_ns - before_ns - after_ns, 0) / 1e6,
                          "compile_outside_ms": compile_outside_ns / 1e6}])


def user_spans(source: Trace | pd.DataFrame, extent_ns: tuple[int, int] | None = None) -> pd.DataFrame:
    """The user's own spans (``xsp.span``), by name.

    Columns: ``name``, ``count``, ``total_ms``, ``mean_ms``, ``in_steps`` (how many of them
    ran inside a step), ``threads`` (on how many threads they ran), ``share`` (the session's time
    during which at least one of them ran, over the session's: spans of one name that overlap,
    on several threads, are counted once, so that it never exceeds 1; ``total_ms`` adds them).
    ``extent_ns`` as :func:`step_coverage` takes it.
    """
    spans = spans_of(source)
    user = spans[(spans[col.KIND] == SpanKind.USER.value) & (spans[col.LEVEL] == Level.MODEL.value)]
    columns = ["name", "count", "total_ms", "mean_ms", "in_steps", "threads", "share"]
    if user.empty:
        return pd.DataFrame(columns=columns)
    session_ms = float(step_coverage(spans, extent_ns)["session_ms"].iloc[0])
    frame = pd.DataFrame({"name": user[col.NAME].to_numpy(), "ms": user[col.DURATION_NS].to_numpy() / 1e6,
                          "in_step": user[col.STEP].notna().to_numpy(), "thread": user[col.THREAD_ID].to_numpy(),
                          "start": user[col.START_NS].to_numpy(dtype=np.int64),
                          "end": user[col.END_NS].to_numpy(dtype=np.int64)})
    groups = frame.groupby("name", sort=False, observed=True)
    table = groups.agg(count=("ms", "size"), total_ms=("ms", "sum"), mean_ms=("ms", "mean"),
                       in_steps=("in_step", "sum"), threads=("thread", "nunique")).reset_index()
    covered_ms = groups.apply(lambda g: union_length(g["start"].to_numpy(), g["end"].to_numpy()) / 1e6,
                              include_groups=False)
    table["share"] = table["name"].map(covered_ms) / session_ms if session_ms else np.nan
    return table.sort_values("total_ms", ascending=False, kind="stable").reset_index(drop=True)[columns]
