"""Model-level analyses: latency and throughput per step."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind, Status
from xsp.io.trace import Trace
from xsp.record.steps import GENERATE_SUFFIX
from xsp.table.sampling import step_roots as step_root_positions
from xsp.table.walks import nearest_marked, parent_positions, union_length

INPUT_LEVELS = (Level.INPUT.value, Level.MODEL.value)
"""Where input waits live (the model level in traces recorded before the input level)."""
STEP_WORK_KINDS = (SpanKind.PREDICT.value, SpanKind.BACKWARD.value, SpanKind.OPTIMIZER.value)
"""The model-level parts of a step whose failure fails the step, caught by the program or not:
a training step whose backward pass raised updated nothing."""
NUMBERED_STEP = re.compile(r"^(.*)#\d+$")
"""Names that number their step (Kineto's ``ProfilerStep#12``): steps of one kind."""
TRIM_FRACTION = 0.2
"""Trimmed mean drops this fraction at each end (as XSP does)."""


def spans_of(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """The span table of ``source``: a trace's, or the table itself (every analysis takes either)."""
    return source.spans if isinstance(source, Trace) else source


def within_steps(source: Trace | pd.DataFrame, extents: pd.DataFrame | None = None) -> np.ndarray:
    """Which spans are a step's work (bool per row): under a step's root, or in a step and
    overlapping its root's time (another thread's work meanwhile). A span numbered with a step
    but run before its root began (an inference loop's ``torch.ones`` before the model call
    that is the step) is between steps: it is not in the step's time, so not in its shares.
    ``extents``: the steps' times (:func:`step_extents`) where ``source`` is part of a trace
    (a window of whole trees of it) whose other parts hold step roots too."""
    spans = spans_of(source)
    steps = spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)
    within = np.zeros(len(spans), dtype=bool)
    roots = step_root_positions(spans)
    if not len(roots) and (extents is None or extents.empty):
        return within
    is_root = np.zeros(len(spans), dtype=bool)
    is_root[roots] = True
    within |= nearest_marked(parent_positions(spans), is_root, include_self=True) >= 0
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    extent = step_extents(spans) if extents is None else extents
    numbered = ~np.isnan(steps)
    first = extent["start"].reindex(steps[numbered]).to_numpy(dtype=np.float64, na_value=np.nan)
    last = extent["end"].reindex(steps[numbered]).to_numpy(dtype=np.float64, na_value=np.nan)
    within[numbered] |= (starts[numbered] < last) & (ends[numbered] > first)
    return within


@dataclass
class OutsideSteps:
    """The spans of one level that ran outside every step of a trace with steps, by where."""

    count: int
    before_ms: float
    between_ms: float
    after_ms: float


def outside_steps(starts_ns: np.ndarray, ends_ns: np.ndarray, first_ns: int, last_ns: int) -> OutsideSteps:
    """The spans outside every step (their starts and ends) by where they ran: before the steps'
    work began at ``first_ns``, after it ended at ``last_ns``, or between steps; the time of each
    is the time they covered, spans inside others counted once (an operator's nested operators
    added up to more than the whole session)."""
    before, after = starts_ns < first_ns, starts_ns >= last_ns
    between = ~before & ~after

    def covered_ms(chosen: np.ndarray) -> float:
        return float(union_length(starts_ns[chosen], ends_ns[chosen])) / 1e6 if chosen.any() else 0.0

    return OutsideSteps(count=len(starts_ns), before_ms=covered_ms(before), between_ms=covered_ms(between),
                        after_ms=covered_ms(after))


def step_extents(spans: pd.DataFrame) -> pd.DataFrame:
    """Each step's time: from its roots' first start to their last end (``start``, ``end``, by
    step number)."""
    roots = step_root_positions(spans)
    steps = spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)[roots]
    return pd.DataFrame({"step": steps, "start": spans[col.START_NS].to_numpy(dtype=np.int64)[roots],
                         "end": spans[col.END_NS].to_numpy(dtype=np.int64)[roots]}).groupby("step").agg(
        start=("start", "min"), end=("end", "max"))


def step_roots(spans: pd.DataFrame) -> pd.DataFrame:
    """The root span of each step: a model call that is its own step, an automatic or explicit
    ``step`` span, or an imported ``ProfilerStep#N``."""
    return spans.iloc[step_root_positions(spans)]


def model_latency(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per step: the step's latency, batch size and throughput.

    Columns: ``step``, ``name`` (the model's name for a step that is one model call, else the
    step's: ``train_step``, ``inference_step``, ``<model>.generate``, an ``xsp.step()`` name or
    ``ProfilerStep#N``), ``latency_ms`` (the step's duration less the time torch.compile spent
    compiling inside it), ``compile_ms``, ``input_ms`` (the time the step waited for its data,
    see :func:`xsp.analysis.input_waits`), ``batch_size`` (the samples of the step's first model:
    summed over its calls made by the step itself, so that k accumulated micro-batches count k
    times, while calls made inside an optimizer step (a closure's) or a ``generate()`` count
    once; null when unknown), ``throughput_per_s`` (``batch_size / latency``; null for a step an
    exception ended), ``status`` (``error`` when the step's model call, backward pass or
    optimizer step raised, even where the program caught it).
    """
    spans = spans_of(source)
    roots = step_roots(spans)
    batch = _step_batches(spans, roots)
    compiles = spans[spans[col.KIND] == SpanKind.COMPILE.value].groupby(col.STEP, observed=True)[col.DURATION_NS].sum()
    out = pd.DataFrame({
        "step": roots[col.STEP].astype("Int64").to_numpy(),
        "name": roots[col.NAME].to_numpy(),
        "latency_ms": roots[col.DURATION_NS].to_numpy(dtype=np.float64) / 1e6,
        "status": _step_status(spans, roots),
    })
    out["compile_ms"] = out["step"].map(compiles).fillna(0).astype("float64").to_numpy() / 1e6
    out["latency_ms"] = out["latency_ms"] - out["compile_ms"]
    waits = spans[(spans[col.KIND] == SpanKind.INPUT.value) & spans[col.LEVEL].isin(INPUT_LEVELS)]
    out["input_ms"] = out["step"].map(waits.groupby(col.STEP, observed=True)[col.DURATION_NS].sum()).fillna(0).astype(
        "float64").to_numpy() / 1e6
    out["batch_size"] = out["step"].map(batch).astype("Int64")
    throughput = out["batch_size"].astype("Float64") / (out["latency_ms"] / 1e3)
    # a step ended by an exception delivered no items: no throughput (its latency stays)
    out["throughput_per_s"] = throughput.mask(out["status"].astype(object) == Status.ERROR.value)
    return out.sort_values("step").reset_index(drop=True)[
        ["step", "name", "latency_ms", "compile_ms", "input_ms", "batch_size", "throughput_per_s", "status"]]


def _step_status(spans: pd.DataFrame, roots: pd.DataFrame) -> np.ndarray:
    """Each root's step's status: ``error`` where the root or a model call, backward pass or
    optimizer step of the step failed (a ``train_step`` span itself never records an error)."""
    status = roots[col.STATUS].to_numpy(dtype=object).copy()
    failed = ((spans[col.LEVEL] == Level.MODEL.value) & spans[col.KIND].isin(STEP_WORK_KINDS)
              & (spans[col.STATUS] == Status.ERROR.value)).to_numpy(dtype=bool, na_value=False)
    if failed.any():
        failed_steps = pd.unique(spans[col.STEP][failed].dropna())
        status[roots[col.STEP].isin(failed_steps).to_numpy(dtype=bool, na_value=False)] = Status.ERROR.value
    return status


def _step_batches(spans: pd.DataFrame, roots: pd.DataFrame) -> pd.Series:
    """Samples per step (see :func:`model_latency`), by step."""
    predicts = spans[spans[col.KIND] == SpanKind.PREDICT.value].sort_values(col.START_NS, kind="stable")
    if predicts.empty:
        return pd.Series(dtype="Int64")
    first_name = predicts.groupby(col.STEP, observed=True)[col.NAME].first()
    first_batch = predicts.groupby(col.STEP, observed=True)[col.BATCH_SIZE].first()
    # a generate() step calls the model once per token on the same samples: counted once
    counted = roots[~roots[col.NAME].astype(str).str.endswith(GENERATE_SUFFIX)]
    own = predicts[predicts[col.PARENT_ID].isna() | predicts[col.PARENT_ID].isin(counted[col.SPAN_ID])]
    own = own[own[col.NAME].to_numpy() == own[col.STEP].map(first_name).to_numpy()]
    summed = own.groupby(col.STEP, observed=True)[col.BATCH_SIZE].sum(min_count=1)
    batches = summed.reindex(first_batch.index).fillna(first_batch)
    # a step's generate() calls (the step itself, or spans of an xsp.step) count the sequences they
    # were given: their model calls run on one a beam (3x with 3 beams), an encoder-decoder's
    # encoder on the prompts alone, and one call a token
    generates = spans[spans[col.KIND].isin([SpanKind.STEP.value, SpanKind.USER.value]).to_numpy()
                      & spans[col.NAME].astype(str).str.endswith(GENERATE_SUFFIX).to_numpy()
                      & spans[col.STEP].notna().to_numpy()]
    for step, group in generates.groupby(col.STEP, observed=True):
        given = [span_attribute(text, col.ATTR_GENERATE_SAMPLES) for text in group[col.ATTRIBUTES].tolist()]
        if step in batches.index and all(isinstance(samples, int) for samples in given):
            batches.loc[step] = sum(given)
    return batches


def span_attribute(attributes: object, key: str) -> Any:
    """One attribute of a span's ``attributes`` (its JSON text), or None (none there, or text
    that is not a JSON object)."""
    if not isinstance(attributes, str):
        return None
    try:
        found = json.loads(attributes)
    except ValueError:
        return None
    return found.get(key) if isinstance(found, dict) else None


def step_kind(name: object) -> str:
    """The kind of step a step name stands for: ``ProfilerStep#12`` -> ``ProfilerStep``; other
    names are their own kind."""
    text = str(name)
    found = NUMBERED_STEP.match(text)
    return found.group(1) if found else text


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


def trimmed_mean_ci(values: np.ndarray, fraction: float = TRIM_FRACTION, confidence: float = 0.95) -> float:
    """Half-width of the ``confidence`` interval of :func:`trimmed_mean` (Tukey and McLaughlin:
    the winsorized variance, and Student's t with the trimmed sample's degrees of freedom);
    NaN below 3 values."""
    from scipy import stats

    data = np.sort(np.asarray(values, dtype=np.float64))
    count = len(data)
    if count < 3:
        return float("nan")
    cut = int(count * fraction) if count > 3 else 0
    kept = count - 2 * cut
    winsorized = data.copy()
    if cut:
        winsorized[:cut], winsorized[count - cut:] = data[cut], data[count - cut - 1]
    spread = float(np.std(winsorized, ddof=1))
    error = spread / ((kept / count) * np.sqrt(count))
    return float(stats.t.ppf(0.5 + confidence / 2, max(kept - 1, 1)) * error)


def model_summary(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Latency statistics over the steps that completed, one row per kind of step (its name;
    numbered steps such as Kineto's ``ProfilerStep#N`` together as ``ProfilerStep``).

    A step an exception ended (status ``error``: a request that failed, a batch that raised) is
    no latency of the model's: it is counted in ``failed`` and left out of every figure, so
    fast failures never flatter the latency nor slow ones inflate it.

    Columns: ``name``, ``steps`` (completed), ``failed``, ``mean_ms``, ``p50_ms``, ``p90_ms``,
    ``p99_ms``, ``trimmed_mean_ms``, ``min_ms``, ``max_ms``, ``throughput_per_s`` (mean batch
    size over trimmed-mean latency); the figures are NaN for a kind whose every step failed.
    """
    latency = model_latency(source)
    rows = []
    for name, group in latency.groupby(latency["name"].map(step_kind), sort=False, observed=True):
        failed = (group["status"].astype(object) == Status.ERROR.value).to_numpy()
        completed = group[~failed]
        values = completed["latency_ms"].to_numpy()
        batch = completed["batch_size"].dropna()
        row: dict[str, object] = {"name": name, "steps": len(values), "failed": int(failed.sum())}
        if len(values):
            trimmed = trimmed_mean(values)
            row.update({
                "mean_ms": values.mean(), "p50_ms": np.percentile(values, 50), "p90_ms": np.percentile(values, 90),
                "p99_ms": np.percentile(values, 99), "trimmed_mean_ms": trimmed,
                "min_ms": values.min(), "max_ms": values.max(),
                "throughput_per_s": (batch.mean() / (trimmed / 1e3)) if len(batch) else np.nan,
            })
        rows.append(row)
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS).astype({"steps": "int64", "failed": "int64"})


SUMMARY_COLUMNS = ["name", "steps", "failed", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "trimmed_mean_ms", "min_ms",
                   "max_ms", "throughput_per_s"]
