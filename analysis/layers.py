"""Layer-level analyses: the layer table, the top layers, time per layer type.

Layers nest (``encoder`` contains ``encoder.layer.0``), so summing their durations counts
time twice. Every table therefore carries ``self_ms``: a layer's time minus the time of the
layers directly inside it (:mod:`xsp.table.self_time`). Self times add up to the time spent in
layers, once.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of, step_roots
from xsp.core import schema as col
from xsp.core.schema import BACKWARD_SUFFIX, Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.self_time import self_ns

LAYER_COLUMNS = ["step", "path", "name", "kind", "module_type", "call_depth", "exec_index", "start_ns",
                 "duration_ms", "duration_ci_ms", "self_ms", "param_count", "input_shapes", "output_shapes", "source"]


def layer_table(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per layer span (forward and backward calls), in execution order.

    Columns: ``step``, ``path``, ``name`` (module path), ``kind`` (forward/backward),
    ``module_type``, ``call_depth``, ``exec_index``, ``start_ns``, ``duration_ms``,
    ``duration_ci_ms`` (of a leveled trace: the half-width of the duration's 95% interval; NaN
    elsewhere), ``self_ms`` (duration minus layers directly inside), ``param_count``, ``input_shapes``,
    ``output_shapes``, ``source`` (file:line of the module's class).
    """
    spans = spans_of(source)
    is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
    own_ns = self_ns(spans, is_layer)[is_layer]
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
    })
    return table.sort_values(["start_ns", "call_depth"], kind="stable").reset_index(drop=True)[LAYER_COLUMNS]


def _step_time_ms(spans: pd.DataFrame) -> float:
    return float(step_roots(spans)[col.DURATION_NS].sum()) / 1e6


def top_layers(source: Trace | pd.DataFrame, k: int = 10, by: str = "self_ms") -> pd.DataFrame:
    """The ``k`` layers (by module path and kind, over all steps) with the most time.

    Columns: ``name``, ``kind``, ``module_type``, ``calls``, ``total_ms``, ``mean_ms``,
    ``mean_ci_ms`` (of a leveled trace: the half-width of ``mean_ms``'s 95% interval, its
    calls' intervals added in quadrature; NaN elsewhere), ``total_self_ms``, ``mean_self_ms``,
    ``share`` (total self time over the steps' time).
    ``by`` is ``self_ms`` (default: where time is spent, not double counted) or ``total_ms``.
    """
    spans = spans_of(source)
    table = layer_table(spans)
    grouped = table.groupby(["name", "kind"], sort=False, observed=True).agg(
        module_type=("module_type", "first"), calls=("duration_ms", "size"),
        total_ms=("duration_ms", "sum"), mean_ms=("duration_ms", "mean"),
        total_self_ms=("self_ms", "sum"), mean_self_ms=("self_ms", "mean"),
        mean_ci_ms=("duration_ci_ms", lambda v: float(np.sqrt((v.to_numpy() ** 2).sum())) / len(v)
                    if v.notna().all() else np.nan)).reset_index()
    step_ms = _step_time_ms(spans)
    grouped["share"] = grouped["total_self_ms"] / step_ms if step_ms else np.nan
    key = "total_self_ms" if by == "self_ms" else by
    return grouped.sort_values(key, ascending=False, kind="stable").head(k).reset_index(drop=True)


def layer_type_summary(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Time per module type (``Conv2d``, ``Linear``...), from self times.

    Columns: ``module_type``, ``layers`` (distinct modules: a module's forward and backward
    spans are one), ``calls`` (forward and backward spans), ``total_self_ms``, ``mean_self_ms``
    (per call), ``mean_ms`` (mean inclusive duration per call), ``share`` (of the steps' time).
    """
    spans = spans_of(source)
    table = layer_table(spans)
    backward = (table["kind"] == SpanKind.BACKWARD.value).to_numpy()
    names = table["name"].astype(str)
    table = table.assign(module=names.where(~backward, names.str.removesuffix(BACKWARD_SUFFIX)))
    grouped = table.groupby("module_type", sort=False, observed=True).agg(
        layers=("module", "nunique"), calls=("duration_ms", "size"), total_self_ms=("self_ms", "sum"),
        mean_self_ms=("self_ms", "mean"), mean_ms=("duration_ms", "mean")).reset_index()
    step_ms = _step_time_ms(spans)
    grouped["share"] = grouped["total_self_ms"] / step_ms if step_ms else np.nan
    return grouped.sort_values("total_self_ms", ascending=False, kind="stable").reset_index(drop=True)
