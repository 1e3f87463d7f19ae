"""Model-level analyses: latency and throughput per step."""

from __future__ import annotations

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.schema import SpanKind
from xsp.trace import Trace

TRIM_FRACTION = 0.2
"""Trimmed mean drops this fraction at each end (as XSP does)."""


def _spans(source: Trace | pd.DataFrame) -> pd.DataFrame:
    return source.spans if isinstance(source, Trace) else source


def model_latency(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per step: the step's latency, batch size and throughput.

    Columns: ``step``, ``name`` (``predict`` or the explicit step's name), ``latency_ms``,
    ``batch_size`` (from the step's first predict call, null when unknown),
    ``throughput_per_s`` (``batch_size / latency``), ``status``.
    """
    spans = _spans(source)
    roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()
                  & spans[col.KIND].isin([k.value for k in (SpanKind.PREDICT, SpanKind.STEP)])]
    predicts = spans[spans[col.KIND] == SpanKind.PREDICT.value].sort_values(col.START_NS)
    batch = predicts.groupby(col.STEP)[col.BATCH_SIZE].first()
    out = pd.DataFrame({
        "step": roots[col.STEP].astype("Int64").to_numpy(),
        "name": roots[col.NAME].to_numpy(),
        "latency_ms": roots[col.DURATION_NS].to_numpy(dtype=np.float64) / 1e6,
        "status": roots[col.STATUS].to_numpy(),
    })
    out["batch_size"] = out["step"].map(batch).astype("Int64")
    out["throughput_per_s"] = (out["batch_size"].astype("Float64") / (out["latency_ms"] / 1e3))
    return out.sort_values("step").reset_index(drop=True)[
        ["step", "name", "latency_ms", "batch_size", "throughput_per_s", "status"]]


def trimmed_mean(values: np.ndarray, fraction: float = TRIM_FRACTION) -> float:
    """Mean after dropping ``fraction`` of the values at each end; plain mean below 3 values,
    median at exactly 3 (as XSP's evaluation does)."""
    data = np.sort(np.asarray(values, dtype=np.float64))
    if len(data) == 0:
        return float("nan")
    if len(data) < 3:
        return float(data.mean())
    if len(data) == 3:
        return float(np.median(data))
    cut = int(len(data) * fraction)
    return float(data[cut:len(data) - cut].mean())


def model_summary(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Latency statistics over all steps, one row per step name.

    Columns: ``name``, ``steps``, ``mean_ms``, ``p50_ms``, ``p90_ms``, ``p99_ms``,
    ``trimmed_mean_ms``, ``min_ms``, ``max_ms``, ``throughput_per_s`` (mean batch size over
    trimmed-mean latency).
    """
    latency = model_latency(source)
    rows = []
    for name, group in latency.groupby("name", sort=False):
        values = group["latency_ms"].to_numpy()
        batch = group["batch_size"].dropna()
        trimmed = trimmed_mean(values)
        rows.append({
            "name": name, "steps": len(values), "mean_ms": values.mean(),
            "p50_ms": np.percentile(values, 50), "p90_ms": np.percentile(values, 90),
            "p99_ms": np.percentile(values, 99), "trimmed_mean_ms": trimmed,
            "min_ms": values.min(), "max_ms": values.max(),
            "throughput_per_s": (batch.mean() / (trimmed / 1e3)) if len(batch) else np.nan,
        })
    return pd.DataFrame(rows, columns=["name", "steps", "mean_ms", "p50_ms", "p90_ms", "p99_ms",
                                       "trimmed_mean_ms", "min_ms", "max_ms", "throughput_per_s"])
