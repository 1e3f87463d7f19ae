"""Operator-level analyses: time per operator, and the backward pass attributed to forward layers.

In a training step the backward pass runs operators that no forward layer encloses in time.
Autograd ties them to the forward pass: a backward node (``AddmmBackward0``, and
``autograd::engine::evaluate_function: AddmmBackward0`` around it) carries the sequence number
of the forward operator that created it (``aten::addmm``). :func:`backward_attribution`
follows that number back to the forward operator and its layer; backward layer spans
(``<path>.backward``) name their forward layer already.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from xsp.analysis.in_order import row_places
from xsp.analysis.model import spans_of
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.self_time import self_ns
from xsp.table.walks import category_values, nearest_ancestor, of_level, parent_positions, text_matches

BACKWARD_NODE = re.compile(r"Backward\d*$")
"""Autograd node names: ``AddmmBackward0`` (``BackwardHookFunction`` is a forward operator)."""
ENGINE_PREFIX = "autograd::engine::evaluate_function: "
"""The outermost span of one backward node: summing these counts each node's time once."""


def operator_table(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Operators aggregated by name, most time first.

    Columns: ``name``, ``count``, ``total_us`` (inclusive), ``self_us`` (minus the operators
    directly inside), ``mean_us``, ``share`` (of all self time, which adds up once).

    What ``torch.compile`` did while compiling is not the model's: the operators it ran inside a
    ``compile`` span (tracing with fake tensors) are left out, and a compile inside an operator
    (the backward graph compiled at its first call) is not that operator's own time.
    """
    spans = spans_of(source)
    is_op = ((spans[col.LEVEL] == Level.OPERATOR.value) & (spans[col.KIND] == SpanKind.OPERATOR.value)).to_numpy()
    compiling = (spans[col.KIND] == SpanKind.COMPILE.value).to_numpy()
    if compiling.any():
        own_all = self_ns(spans, is_op) - compiles_inside_ns(spans, is_op, compiling)
        is_op = is_op & (nearest_ancestor(spans, compiling, parent_positions(spans)) < 0)
        own_ns = np.maximum(own_all[is_op], 0.0)
    else:
        own_ns = self_ns(spans, is_op)[is_op]
    ops = spans[is_op]
    duration = ops[col.DURATION_NS].to_numpy(dtype=np.float64)
    # sums of whole nanoseconds, exact in any order: the tables of parts of a trace add up to its own
    frame = pd.DataFrame({"name": ops[col.NAME].to_numpy(dtype=object), "total_us": duration,
                          "self_us": np.asarray(own_ns, dtype=np.float64)})
    table = frame.groupby("name", sort=False,
                          observed=True).agg(count=("total_us", "size"), total_us=("total_us", "sum"),
                                                  self_us=("self_us", "sum")).reset_index()
    table[["total_us", "self_us"]] /= 1e3
    table["mean_us"] = table["total_us"] / table["count"]
    total = table["self_us"].sum()
    table["share"] = table["self_us"] / total if total else np.nan
    return table.sort_values("self_us", ascending=False, kind="stable").reset_index(drop=True)


def compiles_inside_ns(spans: pd.DataFrame, within: np.ndarray, compiling: np.ndarray) -> np.ndarray:
    """Per row, the time of the ``compiling`` spans that lie inside it on its thread, for the
    innermost ``within`` span around each: by interval, not by parent (the backward graph
    compiled at its first call hangs below the model's backward span, inside the
    ``CompiledFunctionBackward`` operator only by its interval)."""
    taken = np.zeros(len(spans), dtype=np.float64)
    start = spans[col.START_NS].to_numpy(dtype=np.int64)
    end = spans[col.END_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    candidates = np.flatnonzero(within)
    for row in np.flatnonzero(compiling).tolist():
        around = candidates[(threads[candidates] == threads[row]) & (start[candidates] <= start[row])
                            & (end[candidates] >= end[row])]
        if len(around):
            taken[int(around[np.argmax(start[around])])] += end[row] - start[row]
    return taken


class _Autograd:
    """What backward attribution reads of a span table: each span's parent, innermost layer, name,
    step, sequence number and duration; which spans are forward and backward operators (those with
    a sequence number) and backward layer spans."""

    def __init__(self, spans: pd.DataFrame) -> None:
        self.parents = parent_positions(spans)
        self.layer_of = nearest_ancestor(spans, of_level(spans, Level.LAYER), self.parents)
        self.names = spans[col.NAME].to_numpy(dtype=object)
        levels = category_values(spans[col.LEVEL])
        kinds = category_values(spans[col.KIND])
        self.steps = spans[col.STEP].astype("float64").to_numpy(na_value=np.nan)
        self.sequence = spans[col.SEQUENCE_NUMBER].astype("float64").to_numpy(na_value=np.nan)
        self.duration = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
        is_op = (levels == Level.OPERATOR.value) & (kinds == SpanKind.OPERATOR.value) & ~np.isnan(self.sequence)
        self.backward_operators = is_op & text_matches(spans[col.NAME], BACKWARD_NODE, anywhere=True)
        self.forward_operators = is_op & ~self.backward_operators
        self.backward_layers = (levels == Level.LAYER.value) & (kinds == SpanKind.BACKWARD.value)


def backward_attribution(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Every backward span with the forward layer (and operator) that produced it.

    Rows: backward layer spans (``kind`` = layer) and backward operators (``kind`` =
    operator: autograd nodes and the engine spans around them).

    Columns: ``span_id``, ``step``, ``kind``, ``name``, ``duration_us``, ``sequence_number``,
    ``forward_operator`` (the forward operator with the same sequence number in the step),
    ``forward_layer`` (its innermost layer; for a backward layer span, the layer it is the
    backward of), ``outermost`` (an engine span, or a node without one: sum these).
    """
    spans = spans_of(source)
    found = _Autograd(spans)
    parents, layer_of, names, steps, sequence, duration = (
        found.parents, found.layer_of, found.names, found.steps, found.sequence, found.duration)
    is_backward_op, forward_ops = found.backward_operators, np.flatnonzero(found.forward_operators)
    first_forward = (pd.DataFrame({"step": steps[forward_ops], "seq": sequence[forward_ops], "row": forward_ops})
                     .groupby(["step", "seq"], dropna=False, observed=True)["row"].min())
    rows = []
    for row in np.flatnonzero(is_backward_op).tolist():
        forward = first_forward.get((steps[row], sequence[row]))
        forward_layer = names[layer_of[forward]] if forward is not None and layer_of[forward] >= 0 else None
        engine_parent = parents[row] >= 0 and str(names[parents[row]]).startswith(ENGINE_PREFIX)
        rows.append({"span_id": int(spans[col.SPAN_ID].iat[row]), "step": steps[row], "kind": "operator",
                     "name": names[row], "duration_us": duration[row] / 1e3, "sequence_number": sequence[row],
                     "forward_operator": None if forward is None else names[forward],
                     "forward_layer": forward_layer, "outermost": not engine_parent})
    for row in np.flatnonzero(found.backward_layers).tolist():
        rows.append({"span_id": int(spans[col.SPAN_ID].iat[row]), "step": steps[row], "kind": "layer",
                     "name": names[row], "duration_us": duration[row] / 1e3, "sequence_number": np.nan,
                     "forward_operator": None, "forward_layer": str(names[row]).removesuffix(col.BACKWARD_SUFFIX),
                     "outermost": True})
    columns = ["span_id", "step", "kind", "name", "duration_us", "sequence_number", "forward_operator",
               "forward_layer", "outermost"]
    return pd.DataFrame(rows, columns=columns)


@dataclass
class BackwardParts:
    """What :func:`backward_time_per_layer` reads of (a part of) a trace: tables that add up over
    parts (windows of whole trees) by concatenation."""

    forward: pd.DataFrame
    """Forward operators with a sequence number: ``step`` (NaN outside steps), ``seq``, ``layer``
    (the innermost layer's name, None without one), and the operator's place (``o0``, ``o1``,
    ``o2``: :mod:`xsp.analysis.in_order`); the first of each step and sequence number only."""
    backward: pd.DataFrame
    """The outermost backward operators: ``step``, ``seq``, ``ns``."""
    layers: pd.DataFrame
    """The backward layer spans: ``forward_layer``, ``ns``."""


def backward_parts(spans: pd.DataFrame, places: np.ndarray | None = None) -> BackwardParts:
    """:class:`BackwardParts` of ``spans`` (whole trees; ``places``: each row's place in the
    loaded trace, N x 3, default its position)."""
    found = _Autograd(spans)
    parents, layer_of, names, steps, sequence, duration = (
        found.parents, found.layer_of, found.names, found.steps, found.sequence, found.duration)
    at = places if places is not None else row_places(len(spans))
    forward = np.flatnonzero(found.forward_operators)
    forward_table = pd.DataFrame({
        "step": steps[forward], "seq": sequence[forward],
        "layer": np.where(layer_of[forward] >= 0, names[np.maximum(layer_of[forward], 0)], None),
        "o0": at[forward, 0], "o1": at[forward, 1], "o2": at[forward, 2]})
    forward_table = forward_table.sort_values(["o0", "o1", "o2"], kind="stable").drop_duplicates(
        ["step", "seq"]).reset_index(drop=True)
    backward = np.flatnonzero(found.backward_operators)
    engine = np.array([parents[row] >= 0 and str(names[parents[row]]).startswith(ENGINE_PREFIX)
                       for row in backward.tolist()], dtype=bool)
    outermost = backward[~engine] if len(backward) else backward
    layers = np.flatnonzero(found.backward_layers)
    return BackwardParts(
        forward=forward_table,
        backward=pd.DataFrame({"step": steps[outermost], "seq": sequence[outermost], "ns": duration[outermost]}),
        layers=pd.DataFrame({"forward_layer": [str(name).removesuffix(col.BACKWARD_SUFFIX) for name in names[layers]],
                             "ns": duration[layers]}))


def backward_table_of(layer_ns: pd.Series, operators: pd.DataFrame) -> pd.DataFrame:
    """:func:`backward_time_per_layer` from the backward layer spans' time per forward layer
    (``layer_ns``) and the attributed backward operators' (``operators``: ``ns`` and ``count``
    per forward layer)."""
    out = pd.DataFrame({"backward_layer_us": layer_ns / 1e3, "backward_operator_us": operators["ns"] / 1e3,
                        "backward_operators": operators["count"]}).fillna({"backward_operator_us": 0.0,
                                                                          "backward_operators": 0})
    out["backward_operators"] = out["backward_operators"].astype("int64")
    return out.rename_axis("forward_layer").reset_index().sort_values(
        "backward_operator_us", ascending=False, kind="stable").reset_index(drop=True)


def backward_time_per_layer(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Backward time per forward layer, over all steps.

    Columns: ``forward_layer``, ``backward_layer_us`` (its ``.backward`` spans),
    ``backward_operator_us`` (outermost backward operators attributed to it, by sequence
    number), ``backward_operators``.
    """
    parts = backward_parts(spans_of(source))
    joined = parts.backward.merge(parts.forward[["step", "seq", "layer"]], on=["step", "seq"])
    joined = joined[joined["layer"].notna()]
    operators = joined.groupby("layer").agg(ns=("ns", "sum"), count=("ns", "size"))
    return backward_table_of(parts.layers.groupby("forward_layer")["ns"].sum(), operators)
