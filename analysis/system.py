"""The system level: sampled CPU, memory, GPU utilisation, power and energy, and their share
of each step; and the garbage collections of CPython's collector (:func:`gc_collections`).

Samples are intervals (see :mod:`xsp.record.samples`); a metric's value at ``time_ns`` is its value
over the interval that ends there (its average for rates such as CPU percent or power, its
state at that moment for memory).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of, step_roots
from xsp.core import schema as col
from xsp.io.trace import Trace
from xsp.record.samples import STEP_ATTRIBUTE_PREFIX, UNITS, EnergyMethod, SystemMetric, sample_table

METRIC_COLUMNS = ["time_ns", "source", "device", "metric", "value", "unit"]
STEP_COLUMNS = ["step", "name", "device", "metric", "value", "unit"]
GC_COLUMNS = ["generation", "collections", "total_ms", "mean_ms", "max_ms", "collected", "wall_share"]
ENERGY_COLUMNS = ["step", "name", "device", "energy_j", "method", "batch_size", "energy_per_item_j"]
_UNIT_OF = {metric.value: unit for metric, unit in UNITS.items()}


def system_metrics(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Every sampled value: ``time_ns`` (the end of its interval), ``source`` (process, host,
    gpu), ``device`` (``gpu0``...; the source's name for the others), ``metric``, ``value``,
    ``unit``. Empty when the system level was not recorded."""
    samples = sample_table(spans_of(source))
    if samples.empty:
        return pd.DataFrame(columns=METRIC_COLUMNS)
    out = pd.DataFrame({"time_ns": samples["end_ns"].to_numpy(dtype=np.int64), "source": samples["source"],
                        "device": samples["device"], "metric": samples["metric"],
                        "value": samples["value"].to_numpy(dtype=np.float64),
                        "unit": samples["metric"].map(_UNIT_OF).fillna("")})
    return out.sort_values(["time_ns", "device", "metric"], kind="stable").reset_index(drop=True)[METRIC_COLUMNS]


def gc_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """The ``gc`` spans (system level) of a span table, with their ``generation`` and ``collected``."""
    found = spans[(spans[col.LEVEL] == col.Level.SYSTEM.value) & (spans[col.KIND] == col.SpanKind.GC.value)]
    attributes = [json.loads(text) if isinstance(text, str) else {} for text in found[col.ATTRIBUTES].tolist()]
    out = found[[col.START_NS, col.END_NS, col.DURATION_NS]].copy()
    out["generation"] = np.array([a.get(col.ATTR_GC_GENERATION, -1) for a in attributes], dtype=np.int64)
    out["collected"] = np.array([a.get(col.ATTR_GC_COLLECTED, 0) for a in attributes], dtype=np.int64)
    return out


def gc_time_within(gc: pd.DataFrame, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The garbage collection time (of :func:`gc_spans` ``gc``) inside each interval ``starts[i]``
    to ``ends[i]``, in ns: what a step or request in flight then waited for."""
    gc_starts = gc[col.START_NS].to_numpy(dtype=np.int64)
    gc_ends = gc[col.END_NS].to_numpy(dtype=np.int64)
    if not len(gc_starts):
        return np.zeros(len(starts), dtype=np.int64)
    order = np.argsort(gc_starts, kind="stable")
    gc_starts, gc_ends = gc_starts[order], np.maximum.accumulate(gc_ends[order])
    # merged into disjoint runs (collections of several processes may overlap), then the time
    # covered before each moment: covered(t) = runs' lengths before t's run + t's part of it
    new_run = np.concatenate(([True], gc_starts[1:] > gc_ends[:-1]))
    run_starts = gc_starts[new_run]
    run_ends = np.maximum.reduceat(gc_ends, np.flatnonzero(new_run))
    before = np.concatenate(([0], np.cumsum(run_ends - run_starts)))

    def covered(at: np.ndarray) -> np.ndarray:
        run = np.searchsorted(run_starts, at, side="right") - 1
        inside = np.clip(at - run_starts[np.maximum(run, 0)], 0, (run_ends - run_starts)[np.maximum(run, 0)])
        return np.where(run >= 0, before[np.maximum(run, 0)] + inside, 0)

    return covered(np.asarray(ends, dtype=np.int64)) - covered(np.asarray(starts, dtype=np.int64))


def gc_collections(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """What CPython's garbage collector took, per generation (recorded with the system level):
    ``generation`` (0, 1, 2: 2 is a full collection, which walks every object the program
    keeps), ``collections``, ``total_ms``, ``mean_ms``, ``max_ms``, ``collected`` (objects
    freed) and ``wall_share`` (``total_ms`` over the trace's wall time: the session's, else first
    span's start to last span's end). Every Python thread waits while a collection runs, so a collection inside
    a step or request is part of its latency. Empty when none was recorded."""
    spans = spans_of(source)
    found = gc_spans(spans)
    if found.empty:
        return pd.DataFrame(columns=GC_COLUMNS)
    sessions = spans[spans[col.KIND] == col.SpanKind.SESSION.value]
    timed = sessions if len(sessions) else spans  # the session's time, where it has a span
    wall_ns = float(timed[col.END_NS].max() - timed[col.START_NS].min())
    grouped = found.groupby("generation")
    out = pd.DataFrame({
        "collections": grouped.size(),
        "total_ms": grouped[col.DURATION_NS].sum() / 1e6,
        "mean_ms": grouped[col.DURATION_NS].mean() / 1e6,
        "max_ms": grouped[col.DURATION_NS].max() / 1e6,
        "collected": grouped["collected"].sum(),
    }).reset_index()
    out["wall_share"] = out["total_ms"] * 1e6 / wall_ns if wall_ns > 0 else 0.0
    return out.astype({"generation": "int64", "collections": "int64", "collected": "int64"})[GC_COLUMNS]


def _step_attributes(spans: pd.DataFrame) -> list[tuple[int, str, dict[str, object]]]:
    roots = step_roots(spans)
    found = []
    for step, name, text in zip(roots[col.STEP].tolist(), roots[col.NAME].tolist(), roots[col.ATTRIBUTES].tolist()):
        attributes = json.loads(text) if isinstance(text, str) else {}
        ours = {key[len(STEP_ATTRIBUTE_PREFIX):]: value for key, value in attributes.items()
                if key.startswith(STEP_ATTRIBUTE_PREFIX)}
        found.append((int(step), str(name), ours))
    return found


def system_per_step(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Each step's averages of the sampled metrics (the step spans' ``xsp.system.*``
    attributes): ``step``, ``name``, ``device``, ``metric``, ``value``, ``unit``. Energy is the
    step's total (``energy_j``), see :func:`energy_per_step` for how it was obtained."""
    rows = []
    for step, name, values in _step_attributes(spans_of(source)):
        for key, value in values.items():
            device, _, metric = key.partition(".")
            if metric == "energy_method" or not isinstance(value, (int, float)):
                continue
            rows.append((step, name, device, metric, float(value), _UNIT_OF.get(metric, "")))
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


def energy_per_step(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Energy each step used on each measured device: ``step``, ``name``, ``device`` (``gpu0``,
    ``host`` for the CPU packages), ``energy_j`` (null when unavailable), ``method`` (counter,
    polled, estimated or unavailable, see :class:`xsp.record.samples.EnergyMethod`), ``batch_size``
    and ``energy_per_item_j`` (per inference or training sample, when the batch is known)."""
    spans = spans_of(source)
    predicts = spans[spans[col.KIND] == col.SpanKind.PREDICT.value].sort_values(col.START_NS)
    batch = predicts.groupby(col.STEP, observed=True)[col.BATCH_SIZE].first()
    rows = []
    for step, name, values in _step_attributes(spans):
        for key, method in values.items():
            device, _, what = key.partition(".")
            if what != "energy_method":
                continue
            energy = values.get(f"{device}.{SystemMetric.ENERGY_J.value}")
            size = batch.get(step)
            size = None if size is None or pd.isna(size) else int(size)
            joules = None if method == EnergyMethod.UNAVAILABLE.value or energy is None else float(energy)  # type: ignore[arg-type]
            rows.append((step, name, device, joules, method, size,
                         None if joules is None or not size else joules / size))
    out = pd.DataFrame(rows, columns=ENERGY_COLUMNS)
    out["energy_j"] = out["energy_j"].astype("Float64")
    out["energy_per_item_j"] = out["energy_per_item_j"].astype("Float64")
    out["batch_size"] = out["batch_size"].astype("Int64")
    return out
