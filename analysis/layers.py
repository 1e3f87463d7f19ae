"""Layer-level analyses: the layer table, the top layers, time per layer type.

Layers nest (``encoder`` contains ``encoder.layer.0``), so summing their durations counts
time twice. Every table therefore carries ``self_ms``: a layer's time minus the time of the
layers directly inside it (:mod:`xsp.table.self_time`). Self times add up to the time spent in
layers, once.

Code that ``torch.compile`` compiled runs no layer of its own: its modules were traced into
kernels. Given a trace (not a bare table), the layer table adds a row per layer of the compiled
module per compiled call (``compiled`` true), holding that layer's share of the kernels
inductor generated and of the operators compiled code calls as they are (``aten::addmm`` for a
``Linear``); the rule: :func:`xsp.record.compiled_kernels.layers_of_metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from xsp.analysis.compiled import compiled_callers, compiled_keys, compiled_layer_name
from xsp.analysis.in_order import grouped_in_order, row_places
from xsp.analysis.model import spans_of, step_roots
from xsp.core import schema as col
from xsp.core.schema import BACKWARD_SUFFIX, Level, SpanKind
from xsp.io.trace import Trace
from xsp.record.compiled_kernels import LayerShare, kernel_layers
from xsp.table.self_time import self_ns
from xsp.table.walks import parent_positions, ranges, texts_at

LAYER_COLUMNS = ["step", "path", "name", "kind", "module_type", "call_depth", "exec_index", "start_ns",
                 "duration_ms", "duration_ci_ms", "self_ms", "param_count", "input_shapes", "output_shapes", "source",
                 "compiled"]


def compiled_layer_rows(spans: pd.DataFrame, layers_of_kernel: dict[str, list[LayerShare]]
                        ) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """The layers of compiled code, from the spans of its work (:mod:`xsp.analysis.compiled`:
    the CPU kernels inductor generated, run as operators, and the operators it calls as they are)
    and their layers (:func:`xsp.record.compiled_kernels.kernel_layers`).

    Returns the rows (:data:`LAYER_COLUMNS`, ``compiled`` true): one per layer per call of the
    layer or model that ran the compiled code (the *caller*), named under the caller
    (``model.blocks.0``); ``self_ms`` the layer's share of the kernels, ``duration_ms`` that and
    its sub-layers' (``blocks.0`` holds ``blocks.0.fc``). Then, for the callers that are layers,
    their positions in ``spans`` and the time (ns) the compiled layers take off their self time.
    """
    nothing = np.zeros(0, dtype=np.int64)
    empty = pd.DataFrame({name: pd.Series(dtype=object) for name in LAYER_COLUMNS})
    if not layers_of_kernel or spans.empty:
        return empty, nothing, np.zeros(0)
    parents = parent_positions(spans)
    operators = np.flatnonzero((spans[col.LEVEL] == Level.OPERATOR.value).to_numpy())
    codes, names = compiled_keys(spans, operators, parents)
    shares_of = [layers_of_kernel.get(name, []) if isinstance(name, str) else [] for name in names]
    counts = np.array([len(shares) for shares in shares_of], dtype=np.int64)
    if not len(codes) or not counts.any():
        return empty, nothing, np.zeros(0)
    # one entry per (span, layer), read from a table of the distinct (name, layer) pairs
    pairs = [(code, *share) for code, shares in enumerate(shares_of) for share in shares]
    positions = np.repeat(operators, counts[codes])
    pair_at = ranges((np.cumsum(counts) - counts)[codes], counts[codes])
    is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
    callers, is_module, backward = compiled_callers(spans, parents)
    pair_paths = np.array([pair[1] for pair in pairs], dtype=object)
    pair_types = np.array([pair[2] for pair in pairs], dtype=object)
    pair_shares = np.array([pair[3] for pair in pairs], dtype=np.float64)
    entries = pd.DataFrame({
        "caller": callers[positions], "backward": backward[positions],
        "path": pair_paths[pair_at], "module_type": pair_types[pair_at],
        "own_ns": spans[col.DURATION_NS].to_numpy(dtype=np.float64)[positions] * pair_shares[pair_at],
        "start_ns": spans[col.START_NS].to_numpy(dtype=np.int64)[positions]})
    entries = entries[entries["caller"] >= 0]
    rows = entries.groupby(["caller", "backward", "path"], sort=False).agg(
        module_type=("module_type", "first"), own_ns=("own_ns", "sum"), start_ns=("start_ns", "min")).reset_index()
    if rows.empty:
        return empty, nothing, np.zeros(0)
    # a layer's inclusive time: its own and its sub-layers' (of the same call, same direction):
    # each row adds its own time to the rows of its path's prefixes that the call has
    keys = rows[["caller", "backward", "path"]]
    ancestry = pd.DataFrame([(path, path.rsplit(".", cut)[0]) for path in keys["path"].drop_duplicates().tolist()
                             for cut in range(1, path.count(".") + 1)], columns=["path", "prefix"], dtype=object)
    nested = rows[["caller", "backward", "path", "own_ns"]].merge(ancestry, on="path").merge(
        keys.rename(columns={"path": "prefix"}), on=["caller", "backward", "prefix"])
    index = pd.MultiIndex.from_frame(keys)
    below = nested.groupby(["caller", "backward", "prefix"])["own_ns"].sum().reindex(index, fill_value=0.0)
    above = nested.groupby(["caller", "backward", "path"]).size().reindex(index, fill_value=0).to_numpy()
    inclusive_ns = rows["own_ns"].to_numpy() + below.to_numpy(dtype=np.float64)
    caller = rows["caller"].to_numpy(dtype=np.int64)
    depth = spans[col.CALL_DEPTH].to_numpy(dtype=np.float64, na_value=0.0)[caller] if col.CALL_DEPTH in spans \
        else np.zeros(len(rows))
    caller_name = texts_at(spans[col.NAME], np.where(is_module[caller], caller, -1))
    name = [compiled_layer_name(owner, path, bool(back))
            for owner, path, back in zip(caller_name, rows["path"], rows["backward"])]
    table = pd.DataFrame({
        "step": spans[col.STEP].to_numpy()[caller], "path": [n if at is None else f"{at}/{n}" for at, n in
                                                             zip(texts_at(spans[col.PATH], caller), name)],
        "name": name,
        "kind": np.where(rows["backward"].to_numpy(dtype=bool), SpanKind.BACKWARD.value, SpanKind.FORWARD.value),
        "module_type": rows["module_type"].to_numpy(),
        "call_depth": (depth + 1 + above).astype(np.int64),
        "exec_index": pd.array([pd.NA] * len(rows), dtype="Int64"), "start_ns": rows["start_ns"].to_numpy(),
        "duration_ms": inclusive_ns / 1e6, "duration_ci_ms": np.full(len(rows), np.nan),
        "self_ms": rows["own_ns"].to_numpy() / 1e6, "param_count": pd.array([pd.NA] * len(rows), dtype="Int64"),
        "input_shapes": None, "output_shapes": None, "source": None, "compiled": True})
    outermost = (above == 0) & is_layer[caller]
    return table[LAYER_COLUMNS], caller[outermost], inclusive_ns[outermost]


def layer_table(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per layer span (forward and backward calls), in execution order.

    Columns: ``step``, ``path``, ``name`` (module path), ``kind`` (forward/backward),
    ``module_type``, ``call_depth``, ``exec_index``, ``start_ns``, ``duration_ms``,
    ``duration_ci_ms`` (of a leveled trace: the half-width of the duration's 95% interval; NaN
    elsewhere), ``self_ms`` (duration minus layers directly inside), ``param_count``, ``input_shapes``,
    ``output_shapes``, ``source`` (file:line of the module's class), ``compiled`` (a layer of
    compiled code: its share of the kernels inductor generated; see the module's text).
    """
    spans = spans_of(source)
    is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
    compiled, callers, taken_ns = compiled_layer_rows(
        spans, kernel_layers(source.metadata) if isinstance(source, Trace) else {})
    # a compile inside a layer's first call is the compiler's time (step_breakdown's compile), not the layer's
    own_all = self_ns(spans, is_layer | (spans[col.KIND] == SpanKind.COMPILE.value).to_numpy())
    np.subtract.at(own_all, callers, taken_ns)
    own_ns = own_all[is_layer]
    layers = spans[is_layer]
    duration = layers[col.DURATION_NS].to_numpy(dtype=np.float64)
    table = pd.DataFrame({
        "step": layers[col.STEP].to_numpy(), "path": layers[col.PATH].to_numpy(),
        "name": layers[col.NAME].to_numpy(), "kind": layers[col.KIND].to_numpy(),
        "module_type": layers[col.MODULE_TYPE].to_numpy(), "call_depth": layers[col.CALL_DEPTH].to_numpy(),
        "exec_index": layers[col.EXEC_INDEX].to_numpy(), "start_ns": layers[col.START_NS].to_numpy(),
        "duration_ms": duration / 1e6,
        "duration_ci_ms": layers[col.DURATION_CI_NS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)
        / 1e6 if col.DURATION_CI_NS in layers else np.full(len(layers), np.nan),
        "self_ms": own_ns / 1e6,
        "param_count": layers[col.PARAM_COUNT].to_numpy(), "input_shapes": layers[col.INPUT_SHAPES].to_numpy(),
        "output_shapes": layers[col.OUTPUT_SHAPES].to_numpy(), "source": layers[col.SOURCE].to_numpy(),
        "compiled": False,
    })
    if len(compiled):
        table = pd.concat([table, compiled], ignore_index=True)
    return table.sort_values(["start_ns", "call_depth"], kind="stable").reset_index(drop=True)[LAYER_COLUMNS]


def step_time_ms(spans: pd.DataFrame) -> float:
    """The steps' time (ms): their roots' durations added up, what layer shares are of, less what
    ``torch.compile`` spent compiling in them (not the model's time, as in model latency: a
    compiled training step's layers read 0.0% beside 4 s of compiling in its first step)."""
    roots_ns = float(step_roots(spans)[col.DURATION_NS].sum())
    compiles = spans[(spans[col.KIND] == SpanKind.COMPILE.value).to_numpy() & spans[col.STEP].notna().to_numpy()]
    return max(roots_ns - float(compiles[col.DURATION_NS].sum()), 0.0) / 1e6


LAYER_KEYS = ["name", "kind"]
LAYER_SUMS = ["calls", "total_ns", "self_ns", "ci_squared_ms2", "ci_calls"]
MODULE_KEYS = ["module_type", "module"]
MODULE_SUMS = ["calls", "total_ns", "self_ns"]


def layer_sums(table: pd.DataFrame, places: np.ndarray | None = None) -> pd.DataFrame:
    """What :func:`top_layers` adds up of a :func:`layer_table`, per layer (``name`` and
    ``kind``, in the order they first ran): ``module_type`` (the first call's), ``calls``,
    ``total_ns`` and ``self_ns`` (whole nanoseconds: exact in any order), ``ci_squared_ms2``
    (the calls' 95% intervals squared, added) and ``ci_calls`` (the calls with one); with the
    first call's place (``places``: one per row, default its position; :mod:`xsp.analysis.in_order`).
    Added up by layer, the sums of parts of a trace are the whole trace's."""
    ci = table["duration_ci_ms"].astype("float64")
    rows = pd.DataFrame({
        "name": table["name"], "kind": table["kind"], "module_type": table["module_type"], "calls": 1,
        "total_ns": np.rint(table["duration_ms"].astype("float64") * 1e6),
        "self_ns": np.rint(table["self_ms"].astype("float64") * 1e6),
        "ci_squared_ms2": (ci ** 2).fillna(0.0), "ci_calls": ci.notna().astype(np.int64)})
    rows = rows[rows["name"].notna() & rows["kind"].notna()]
    chosen = (places if places is not None else row_places(len(table)))[rows.index.to_numpy()]
    return grouped_in_order(rows.reset_index(drop=True), chosen, LAYER_KEYS, LAYER_SUMS, ["module_type"])


def top_layers_of(sums: pd.DataFrame, step_ms: float, k: int = 10, by: str = "self_ms") -> pd.DataFrame:
    """:func:`top_layers` from :func:`layer_sums` and the steps' time."""
    calls = sums["calls"].to_numpy(dtype=np.float64)
    grouped = pd.DataFrame({
        "name": sums["name"], "kind": sums["kind"], "module_type": sums["module_type"], "calls": sums["calls"],
        "total_ms": sums["total_ns"] / 1e6, "mean_ms": sums["total_ns"] / 1e6 / calls,
        "total_self_ms": sums["self_ns"] / 1e6, "mean_self_ms": sums["self_ns"] / 1e6 / calls,
        "mean_ci_ms": np.where(sums["ci_calls"] == sums["calls"], np.sqrt(sums["ci_squared_ms2"]) / calls, np.nan)})
    grouped = grouped[["name", "kind", "module_type", "calls", "total_ms", "mean_ms", "total_self_ms", "mean_self_ms",
                       "mean_ci_ms"]]
    grouped["share"] = grouped["total_self_ms"] / step_ms if step_ms else np.nan
    key = "total_self_ms" if by == "self_ms" else by
    return grouped.sort_values(key, ascending=False, kind="stable").head(k).reset_index(drop=True)


def top_layers(source: Trace | pd.DataFrame, k: int = 10, by: str = "self_ms") -> pd.DataFrame:
    """The ``k`` layers (by module path and kind, over all steps) with the most time.

    Columns: ``name``, ``kind``, ``module_type``, ``calls``, ``total_ms``, ``mean_ms``,
    ``total_self_ms``, ``mean_self_ms``, ``mean_ci_ms`` (of a leveled trace: the half-width of
    ``mean_ms``'s 95% interval, its calls' intervals added in quadrature; NaN elsewhere),
    ``share`` (total self time over the steps' time).
    ``by`` is ``self_ms`` (default: where time is spent, not double counted) or ``total_ms``.
    """
    return top_layers_of(layer_sums(layer_table(source)), step_time_ms(spans_of(source)), k, by)


def module_sums(table: pd.DataFrame, places: np.ndarray | None = None) -> pd.DataFrame:
    """What :func:`layer_type_summary` adds up of a :func:`layer_table`, per module type and
    module (a module's forward and backward calls are one), in the order they first ran:
    ``calls``, ``total_ns``, ``self_ns`` (``places`` as :func:`layer_sums` takes them). Added up
    by module, the sums of parts of a trace are the whole trace's."""
    backward = (table["kind"] == SpanKind.BACKWARD.value).to_numpy()
    names = table["name"].astype(str)
    rows = pd.DataFrame({
        "module_type": table["module_type"], "module": names.where(~backward, names.str.removesuffix(BACKWARD_SUFFIX)),
        "calls": 1, "total_ns": np.rint(table["duration_ms"].astype("float64") * 1e6),
        "self_ns": np.rint(table["self_ms"].astype("float64") * 1e6)})
    rows = rows[rows["module_type"].notna()]
    chosen = (places if places is not None else row_places(len(table)))[rows.index.to_numpy()]
    return grouped_in_order(rows.reset_index(drop=True), chosen, MODULE_KEYS, MODULE_SUMS)


def layer_type_summary_of(sums: pd.DataFrame, step_ms: float) -> pd.DataFrame:
    """:func:`layer_type_summary` from :func:`module_sums` and the steps' time."""
    grouped = sums.groupby("module_type", sort=False, observed=True).agg(
        layers=("module", "nunique"), calls=("calls", "sum"), total_self_ns=("self_ns", "sum"),
        total_ns=("total_ns", "sum")).reset_index()
    calls = grouped["calls"].to_numpy(dtype=np.float64)
    grouped = pd.DataFrame({
        "module_type": grouped["module_type"], "layers": grouped["layers"], "calls": grouped["calls"],
        "total_self_ms": grouped["total_self_ns"] / 1e6, "mean_self_ms": grouped["total_self_ns"] / 1e6 / calls,
        "mean_ms": grouped["total_ns"] / 1e6 / calls})
    grouped["share"] = grouped["total_self_ms"] / step_ms if step_ms else np.nan
    return grouped.sort_values("total_self_ms", ascending=False, kind="stable").reset_index(drop=True)


def layer_type_summary(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Time per module type (``Conv2d``, ``Linear``...), from self times.

    Columns: ``module_type``, ``layers`` (distinct modules: a module's forward and backward
    spans are one), ``calls`` (forward and backward spans), ``total_self_ms``, ``mean_self_ms``
    (per call), ``mean_ms`` (mean inclusive duration per call), ``share`` (of the steps' time).
    """
    return layer_type_summary_of(module_sums(layer_table(source)), step_time_ms(spans_of(source)))


@dataclass(frozen=True)
class TopLevelLayers:
    """The forward calls of a trace's top-level layers (call depth 1): how many, and their time."""

    calls: int
    ns: int

    def __add__(self, other: TopLevelLayers) -> TopLevelLayers:
        return TopLevelLayers(self.calls + other.calls, self.ns + other.ns)


def top_level_layers(spans: pd.DataFrame) -> TopLevelLayers:
    """The forward calls of the top-level layers in ``spans`` (of parts of a trace, added up:
    the whole trace's)."""
    top = ((spans[col.LEVEL] == Level.LAYER.value) & (spans[col.KIND] == SpanKind.FORWARD.value)
           & (spans[col.CALL_DEPTH] == 1)).to_numpy(dtype=bool, na_value=False)
    return TopLevelLayers(int(top.sum()), int(spans[col.DURATION_NS].to_numpy(dtype=np.int64)[top].sum()))
