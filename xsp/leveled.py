"""Leveled experimentation: every span's duration from the run that traced nothing deeper.

Tracing a level adds host time to every span above it: the layer wrapper's few hundred
nanoseconds per call lengthen the model's latency; the profiler behind the operator level
lengthens every layer. XSP's remedy is to run the same work once per level prefix (model;
model+layer; model+layer+operator; then the GPU levels) and to take each span's duration from
the run in which its own level was the deepest traced, where nothing below it was recorded.

:func:`leveled` does that for a function; ``xsp run --leveled`` for a script. Both hand their
traced runs to :func:`merge_runs`, which

* matches spans across runs by ``path`` (the same for "the same span" in every step and run),
* gives each span of the deepest run the trimmed mean of its durations (over the measured
  steps) in the run where its level was deepest, and notes that run in ``leveled_run``;
  from three rounds on, the trimmed mean of each round, and across rounds the mean of the
  middle ones (a round the machine disturbed throughout is dropped, not pooled),
* keeps the tree (parents, order, attributes) of the deepest run's last measured step, with
  ``end_ns = start_ns + duration_ns``,
* takes FLOPs and bytes from the metric runs (``flops``, ``gpu_metrics``), never durations,
* reports spans that do not appear once in every step of the runs it needs (data-dependent
  control flow) instead of matching them wrongly: they keep the deepest run's own figure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.analysis.model import TRIM_FRACTION, model_latency, trimmed_mean, trimmed_mean_ci
from xsp.compensation import LevelCost, compensation_ns
from xsp.levels import LevelsArg, parse_levels
from xsp.schema import LEVELS, METRIC_LEVELS, Level
from xsp.trace import Trace
from xsp.tree import depth_of, parent_positions, sum_into_ancestors

STEP_NAME = "leveled"
"""Each call of the function under :func:`leveled` is one step of this name."""


def run_label(levels: Sequence[Level]) -> str:
    """``model+layer+operator``: how a run is named in tables and in ``leveled_run`` (the
    input level, which always comes with the model level, goes unnamed)."""
    return "+".join(level.value for level in levels if level is not Level.INPUT)


def level_runs(levels: LevelsArg) -> list[tuple[Level, ...]]:
    """The runs of a leveled experiment: each timing prefix, then one run per metric level.

    ``("model", "layer", "operator", "flops")`` gives model; model+layer;
    model+layer+operator; model+layer+flops (FLOPs are counted under the layers, without the
    operator level's profiler, so that their paths match the operators').
    """
    parsed = parse_levels(levels)
    # system samples are not spans of a step: they make no run (a leveled trace has none)
    timing = [level for level in parsed if level not in METRIC_LEVELS and level is not Level.SYSTEM]
    first = 2 if Level.INPUT in timing else 1  # the input level comes with the model level
    runs: list[tuple[Level, ...]] = [tuple(timing[: i + 1]) for i in range(first - 1, len(timing))]
    base = [level for level in timing if level in (Level.MODEL, Level.INPUT, Level.LAYER)]
    if Level.FLOPS in parsed:
        runs.append((*base, Level.FLOPS))
    if Level.GPU_METRICS in parsed:
        gpu = [level for level in timing if level in (Level.CUDA_API, Level.KERNEL)]
        runs.append((*base, *gpu, Level.GPU_METRICS))
    return runs


@dataclass
class LeveledRun:
    """One traced run of a leveled experiment."""

    levels: tuple[Level, ...]
    trace: Trace

    @property
    def label(self) -> str:
        return run_label(self.levels)

    @property
    def is_metric(self) -> bool:
        return any(level in METRIC_LEVELS for level in self.levels)


@dataclass
class LeveledResult:
    """What :func:`leveled` returns.

    Attributes:
        trace: the merged trace (one step: the deepest run's tree with leveled durations).
        overhead: one row per run: ``run``, ``levels``, ``steps``, ``model_latency_ms``
            (trimmed mean over the measured steps), ``model_latency_ci_ms`` (the half-width of
            its 95% interval), ``overhead`` (against the model-only run), ``metric`` (a metric
            run, whose durations are never used).
        unmatched: spans that did not repeat identically: ``path``, ``level``, ``name``,
            ``run`` (where its duration should have come from), ``reason``.
        runs: every traced run.
    """

    trace: Trace
    overhead: pd.DataFrame
    unmatched: pd.DataFrame
    runs: list[LeveledRun] = field(default_factory=list)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the merged trace (with the overhead table in its metadata)."""
        return self.trace.save(path)


def measured_steps(spans: pd.DataFrame, warmup_steps: int) -> pd.DataFrame:
    """Spans of the steps after the first ``warmup_steps``."""
    steps = sorted(int(s) for s in spans[col.STEP].dropna().unique())
    kept = set(steps[warmup_steps:])
    return spans[spans[col.STEP].isin(kept)]


ROUND_STARTS = "leveled_round_starts"
"""Metadata of a pooled trace (:func:`pooled`): the first step of each round it pools."""


MIN_ROUNDS_ACROSS = 3
"""Rounds from which a figure is taken across rounds (:func:`_across_rounds`), not pooled."""


def _across_rounds(values: np.ndarray) -> float:
    """One figure from per-round figures: the mean of the middle ones, at least the lowest and
    the highest round dropped (the median of three). A round that the machine disturbed from
    end to end (another process's burst lasting seconds) then moves nothing; pooled, its steps
    filled a share of the trimmed mean and put the top-level layers 6-16% off the model call
    in one call of ten on ResNet-50."""
    data = np.sort(np.asarray(values, dtype=np.float64))
    cut = max(1, int(len(data) * TRIM_FRACTION))
    return float(data[cut:len(data) - cut].mean())


def _by_rounds(keys: np.ndarray, rounds: np.ndarray, values: np.ndarray, trim: float) -> pd.DataFrame:
    """Per key, from its rounds: ``figure``, :func:`_across_rounds` of its per-round trimmed
    means (NaN below :data:`MIN_ROUNDS_ACROSS` rounds), and ``ci``, the half-width of a 95%
    interval from the spread of its per-round medians (NaN below two rounds). Steps of one run
    share the machine's state while it ran, so the spread between rounds, not between steps,
    is what tells how far a pooled figure can move."""
    from scipy import stats

    per_round = pd.DataFrame({"key": keys, "round": rounds, "value": values}).groupby(
        ["key", "round"], sort=False)["value"]
    medians = per_round.median().groupby(level=0, sort=False)
    spread = medians.agg(["std", "count"])
    count = spread["count"].to_numpy(dtype=np.float64)
    t = stats.t.ppf(0.975, np.maximum(count - 1, 1))
    half_width = t * spread["std"].to_numpy(dtype=np.float64) / np.sqrt(np.maximum(count, 1))
    figures = per_round.agg(lambda v: trimmed_mean(v.to_numpy(), trim)).groupby(level=0, sort=False).agg(
        lambda v: _across_rounds(v.to_numpy()) if len(v) >= MIN_ROUNDS_ACROSS else np.nan)
    return pd.DataFrame({"figure": figures.reindex(spread.index),
                         "ci": np.where(count >= 2, half_width, np.nan)}, index=spread.index)


def _rounds_of(steps: pd.Series, round_starts: Sequence[int] | None) -> np.ndarray | None:
    """The round of each step (None when the steps are not pooled rounds)."""
    if not round_starts or len(round_starts) < 2:
        return None
    return np.searchsorted(np.asarray(round_starts), steps.to_numpy(dtype=np.int64), side="right") - 1


def _durations_by_path(spans: pd.DataFrame, trim: float, round_starts: Sequence[int] | None = None) -> pd.DataFrame:
    """Per path: the trimmed mean duration, its 95% interval's half-width, and whether it
    appears once in every step. With the rounds of a pooled trace, the interval is the wider of
    the one from its steps and the one from its rounds, and from three rounds on the figure
    comes from the rounds (:func:`_by_rounds`)."""
    steps = spans[col.STEP].nunique()
    grouped = spans.groupby(col.PATH, sort=False)[col.DURATION_NS]
    counts = spans.groupby(col.PATH, sort=False)[col.STEP].agg(["size", "nunique"])
    means = grouped.agg(lambda values: trimmed_mean(values.to_numpy(), trim))
    intervals = grouped.agg(lambda values: trimmed_mean_ci(values.to_numpy(), trim))
    rounds = _rounds_of(spans[col.STEP], round_starts)
    if rounds is not None:
        between = _by_rounds(spans[col.PATH].to_numpy(dtype=object), rounds,
                             spans[col.DURATION_NS].to_numpy(dtype=np.float64), trim).reindex(means.index)
        intervals = pd.Series(np.fmax(intervals.to_numpy(dtype=np.float64), between["ci"].to_numpy(dtype=np.float64)),
                              index=intervals.index)
        means = between["figure"].fillna(means)
    return pd.DataFrame({"duration_ns": means, "ci_ns": intervals,
                         "regular": (counts["size"] == steps) & (counts["nunique"] == steps)})


def _inclusive_counts(spans: pd.DataFrame) -> pd.DataFrame:
    """Per path: mean FLOPs and bytes per step, each span's own plus everything below it."""
    flops = spans[col.FLOPS].astype("float64").to_numpy(na_value=np.nan)
    moved = spans[col.BYTES].astype("float64").to_numpy(na_value=np.nan)
    counted = np.flatnonzero(~np.isnan(flops) | ~np.isnan(moved))
    below_flops, below_bytes = sum_into_ancestors(parent_positions(spans), counted, flops, moved)
    total_flops, total_bytes = np.nan_to_num(flops) + below_flops, np.nan_to_num(moved) + below_bytes
    frame = pd.DataFrame({col.PATH: spans[col.PATH].to_numpy(dtype=object), "flops": total_flops,
                          "bytes": total_bytes})
    sums = frame.groupby(col.PATH, sort=False)[["flops", "bytes"]].mean()
    return sums[(sums["flops"] > 0) | (sums["bytes"] > 0)]


def _latency_ms(spans: pd.DataFrame, trim: float, round_starts: Sequence[int] | None = None) -> tuple[float, float]:
    """The trimmed mean of the steps' latencies and its 95% interval's half-width (with rounds,
    the wider of the steps' and the rounds' intervals, as for :func:`_durations_by_path`)."""
    latencies = model_latency(spans)
    values = latencies["latency_ms"].to_numpy(dtype=np.float64)
    interval = trimmed_mean_ci(values, trim)
    rounds = _rounds_of(latencies["step"], round_starts) if len(latencies) else None
    figure = trimmed_mean(values, trim)
    if rounds is not None:
        between = _by_rounds(np.zeros(len(values), dtype=np.int64), rounds, values, trim).iloc[0]
        interval = float(np.fmax(interval, between["ci"]))
        figure = figure if np.isnan(between["figure"]) else float(between["figure"])
    return figure, interval


DEFAULT_TARGET = 0.02
"""A leveled figure is precise enough when its 95% interval is within ±2% of it."""


def imprecise_paths(spans: pd.DataFrame, target: float) -> list[str]:
    """Paths of the leveled figures whose 95% interval is wider than ``target`` of the figure
    (or unknown: too few steps)."""
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    intervals = spans[col.DURATION_CI_NS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)
    host = spans[col.THREAD_ID].notna().to_numpy()
    wide = host & (np.isnan(intervals) | (intervals > target * np.maximum(durations, 1.0)))
    return [str(path) for path in spans[col.PATH].to_numpy(dtype=object)[wide]]


def nest_in_parents(parents: np.ndarray, starts: np.ndarray, ends: np.ndarray, durations: np.ndarray,
                    on_host: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Place host spans with their leveled ``durations`` so that every child lies inside its
    parent: top-down, a child keeps its relative position in the parent (the gaps of the
    deepest run shrink or grow with the parent), moves earlier if it would end after the
    parent, and in the rare case it is longer than its parent (figures from two runs), is
    cut to the parent's length (counted). Returns new starts, durations and that count.

    Args:
        parents: parent positions (-1 for roots); starts/ends: the deepest run's times;
        durations: the leveled durations; on_host: spans with a host thread (GPU activities
        run asynchronously and keep their times).
    """
    new_starts, new_durations = starts.copy(), durations.astype(np.int64).copy()
    depth = depth_of(parents)
    clamped = 0
    for level in range(1, int(depth.max()) + 1 if len(depth) else 0):
        rows = np.flatnonzero((depth == level) & on_host & (parents >= 0))
        rows = rows[on_host[parents[rows]]]
        if not len(rows):
            continue
        parent = parents[rows]
        old_length = np.maximum(ends[parent] - starts[parent], 1).astype(np.float64)
        scale = new_durations[parent] / old_length
        placed = new_starts[parent] + np.round((starts[rows] - starts[parent]) * scale).astype(np.int64)
        parent_end = new_starts[parent] + new_durations[parent]
        too_long = new_durations[rows] > new_durations[parent]
        clamped += int(too_long.sum())
        new_durations[rows] = np.minimum(new_durations[rows], new_durations[parent])
        placed = np.minimum(placed, parent_end - new_durations[rows])
        new_starts[rows] = np.maximum(placed, new_starts[parent])
    return new_starts, new_durations, clamped


def merge_runs(runs: Sequence[LeveledRun], warmup_steps: int = 0, trim: float = TRIM_FRACTION,
               costs: dict[Level, LevelCost] | None = None, target: float = DEFAULT_TARGET) -> LeveledResult:
    """Merge the runs of a leveled experiment (see the module's docstring).

    Args:
        runs: traced runs; the timing runs' levels must be prefixes of one another.
        warmup_steps: steps at the start of each run that are left out (``xsp run --leveled``;
            :func:`leveled` warms up outside its runs).
        trim: fraction dropped at each end for the trimmed means.
        costs: the calibrated cost of one span per level (:func:`xsp.calibration.calibrate`):
            taken out of each figure (``overhead_ns``); None leaves the figures raw.
        target: the relative half-width of a 95% interval above which a figure is flagged.
    """
    timing = sorted((r for r in runs if not r.is_metric), key=lambda r: len(r.levels))
    if not timing:
        raise ValueError("a leveled experiment needs at least one run that is not a metric run")
    deepest = timing[-1]
    source_of: dict[Level, LeveledRun] = {}
    for run in timing:  # a level's figures come from the first (shallowest) run that traced it
        for level in run.levels:
            source_of.setdefault(level, run)
    measured = {run.label: measured_steps(run.trace.spans, warmup_steps) for run in runs}
    by_path = {run.label: _durations_by_path(measured[run.label], trim, run.trace.metadata.get(ROUND_STARTS))
               for run in timing}

    deep = measured[deepest.label]
    if deep.empty:
        raise ValueError(f"the run {deepest.label} has no measured steps (steps: {len(deepest.trace.steps)}, "
                         f"warm-up: {warmup_steps})")
    last_step = int(deep[col.STEP].max())
    merged = deep[deep[col.STEP] == last_step].copy()
    durations = merged[col.DURATION_NS].to_numpy(dtype=np.int64).copy()
    intervals = np.full(len(merged), np.nan)
    own_run = np.zeros(len(merged), dtype=bool)
    sources = np.empty(len(merged), dtype=object)
    unmatched = []
    for i, (path, level_name, name) in enumerate(zip(merged[col.PATH], merged[col.LEVEL], merged[col.NAME])):
        level = Level(level_name)
        run = source_of.get(level, deepest)
        figures = by_path[run.label]
        own = by_path[deepest.label]
        reason = None
        if path not in figures.index:
            reason = "absent from the run"
        elif not figures.at[path, "regular"]:
            reason = "not once in every step of the run"
        elif not own.at[path, "regular"]:
            reason = "not once in every step of the deepest run"
        if reason is None:
            durations[i] = int(round(figures.at[path, "duration_ns"]))
            intervals[i] = figures.at[path, "ci_ns"]
            own_run[i] = True
            sources[i] = run.label
        else:
            unmatched.append({"path": path, "level": level_name, "name": name, "run": run.label, "reason": reason})
            if path in own.index:
                durations[i] = int(round(own.at[path, "duration_ns"]))
                intervals[i] = own.at[path, "ci_ns"]
            sources[i] = deepest.label
    merged = merged.reset_index(drop=True)
    taken = compensation_ns(merged, parent_positions(merged), costs or {}, own_run, same_level_only=True)
    taken = np.minimum(taken, durations)  # never a negative duration
    durations = durations - taken
    starts, durations, clamped = nest_in_parents(parent_positions(merged), merged[col.START_NS].to_numpy(
        dtype=np.int64), merged[col.END_NS].to_numpy(dtype=np.int64), durations,
        merged[col.THREAD_ID].notna().to_numpy())
    merged[col.START_NS] = starts
    merged[col.DURATION_NS] = durations
    merged[col.END_NS] = starts + durations
    merged[col.LEVELED_RUN] = pd.array(sources.tolist(), dtype="string")
    merged[col.DURATION_CI_NS] = pd.array([None if np.isnan(v) else int(round(v)) for v in intervals], dtype="Int64")
    merged[col.OVERHEAD_NS] = pd.array([int(v) if own else None for v, own in zip(taken, own_run)], dtype="Int64")
    for run in runs:
        if run.is_metric:
            counts = _inclusive_counts(measured[run.label])
            for column, key in ((col.FLOPS, "flops"), (col.BYTES, "bytes")):
                found = merged[col.PATH].map(counts[key]).round().astype("Int64")
                merged[column] = merged[column].fillna(found.where(found > 0))
    overhead = _overhead_table(runs, measured, trim)
    unmatched_table = pd.DataFrame(unmatched, columns=["path", "level", "name", "run", "reason"])
    metadata = {
        **{key: value for key, value in deepest.trace.metadata.items() if key != ROUND_STARTS},
        "levels": sorted({level.value for run in runs for level in run.levels}, key=[v.value for v in LEVELS].index),
        "leveled": {
            "runs": [run.label for run in runs], "warmup_steps": warmup_steps, "trim_fraction": trim,
            "merged_step": last_step, "overhead": overhead.to_dict(orient="records"),
            "unmatched": len(unmatched_table),
            "clamped": clamped,
            "calibration": {level.value: cost.as_dict() for level, cost in (costs or {}).items()},
            "target": target,
            "imprecise": imprecise_paths(merged, target),
        },
    }
    trace = Trace(spans=merged.reset_index(drop=True), metadata=metadata)
    return LeveledResult(trace=trace, overhead=overhead, unmatched=unmatched_table, runs=list(runs))


def _overhead_table(runs: Sequence[LeveledRun], measured: dict[str, pd.DataFrame], trim: float) -> pd.DataFrame:
    rows = []
    for run in runs:
        spans = measured[run.label]
        latency, interval = _latency_ms(spans, trim, run.trace.metadata.get(ROUND_STARTS))
        rows.append({"run": run.label, "levels": [level.value for level in run.levels],
                     "steps": int(spans[col.STEP].nunique()), "model_latency_ms": latency,
                     "model_latency_ci_ms": interval, "metric": run.is_metric})
    table = pd.DataFrame(rows, columns=["run", "levels", "steps", "model_latency_ms", "model_latency_ci_ms", "metric"])
    base = table[table["run"] == Level.MODEL.value]["model_latency_ms"]
    table["overhead"] = table["model_latency_ms"] / float(base.iloc[0]) - 1 if len(base) else np.nan
    return table[["run", "levels", "steps", "model_latency_ms", "model_latency_ci_ms", "overhead", "metric"]]


def pooled(traces: Sequence[Trace]) -> Trace:
    """One trace holding the steps of several runs with the same levels, renumbered in order;
    its metadata notes where each run's steps begin (:data:`ROUND_STARTS`)."""
    frames, offset, starts = [], 0, []
    for trace in traces:
        spans = trace.spans.copy()
        first = spans[col.STEP].min() if spans[col.STEP].notna().any() else None
        spans[col.STEP] = spans[col.STEP] + offset
        if first is not None:
            starts.append(int(first) + offset)
        offset = int(spans[col.STEP].max()) + 1 if spans[col.STEP].notna().any() else offset
        frames.append(spans)
    return Trace(spans=pd.concat(frames, ignore_index=True), metadata={**traces[-1].metadata, ROUND_STARTS: starts})


MAX_ROUNDS = 30
"""Adaptive repetition stops after this many rounds whatever the intervals say."""
MIN_ROUNDS = 5
"""Adaptive repetition runs at least this many rounds: interleaving is what cancels the
machine's drift, and a figure taken across rounds (:func:`_across_rounds`) then drops a
disturbed round at each end and averages three. Twelve calls on ResNet-50 (batch 1), merged
from their first three rounds (the median of three), put the top-level layers 3.5% off the
model call in one of them; merged from their first five, all were within 0.5%. Models whose
round outlasts the time budget stop here."""
DEFAULT_BUDGET_S = 3.0
"""Adaptive repetition goes on for at most this long past the first round."""


def precise_enough(result: LeveledResult, target: float) -> bool:
    """True when the model latency (model run) and every top-level layer of the merged trace
    have a 95% interval within ``target`` of their figure."""
    overhead = result.overhead
    model = overhead[overhead["run"] == Level.MODEL.value]
    if model.empty or not (model["model_latency_ci_ms"] <= target * model["model_latency_ms"]).all():
        return False
    spans = result.trace.spans
    parents = parent_positions(spans)
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    layer = levels == Level.LAYER.value
    top = layer & ~((parents >= 0) & layer[np.maximum(parents, 0)])
    if not top.any():
        return True
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)[top]
    intervals = spans[col.DURATION_CI_NS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)[top]
    return bool((intervals <= target * np.maximum(durations, 1.0)).all())


RUN_S = 0.03
"""With ``repeat=None``, each run measures about this long (at least MIN_REPEAT, at most
MAX_REPEAT calls): a run's fixed costs (starting and stopping a session) then no longer
outweigh its steps, and short functions get enough samples for tight intervals."""
MIN_REPEAT, MAX_REPEAT = 5, 200


def steps_per_run(fn: Callable[[], Any], run_s: float = RUN_S) -> int:
    """How many calls of ``fn`` (untraced, after one warm call) fill ``run_s``."""
    import math
    import time

    fn()
    began = time.perf_counter()
    for _ in range(3):
        fn()
    per_call = max((time.perf_counter() - began) / 3, 1e-9)
    return int(min(max(math.ceil(run_s / per_call), MIN_REPEAT), MAX_REPEAT))


@dataclass(frozen=True)
class Autograd:
    """What autograd does in one call of the function under study."""

    records: bool
    """Its models are called while autograd records a graph (no ``torch.no_grad``)."""
    runs_backward: bool
    """It runs a backward pass."""


def autograd_of(fn: Callable[[], Any]) -> Autograd:
    """One call of ``fn`` traced at the model level, which notes each model call's grad mode
    and each backward pass."""
    from xsp.session import trace

    with trace(levels=("model",), output=None, schedule=None) as session:
        fn()
    return autograd_in(session.trace)


def autograd_in(found: Trace | None) -> Autograd:
    """What autograd did in a trace with the model level: grad mode of its model calls, backward passes."""
    spans = found.spans if found is not None else None
    if spans is None or not len(spans):
        return Autograd(records=False, runs_backward=False)
    records = False
    for text in spans[spans[col.KIND] == col.SpanKind.PREDICT.value][col.ATTRIBUTES]:
        try:
            attributes = json.loads(text) if isinstance(text, str) else {}
        except ValueError:
            continue
        records |= isinstance(attributes, dict) and attributes.get(col.ATTR_MODEL_GRAD) is True
    return Autograd(records=records, runs_backward=bool((spans[col.KIND] == col.SpanKind.BACKWARD.value).any()))


def leveled(fn: Callable[[], Any], levels: LevelsArg = ("model", "layer", "operator"), repeat: int | None = None,
            warmup: int = 2, output: str | os.PathLike[str] | None = None, trim: float = TRIM_FRACTION,
            rounds: int | None = None, target: float = DEFAULT_TARGET, budget_s: float = DEFAULT_BUDGET_S,
            compensate: bool = True, **trace_options: Any) -> LeveledResult:
    """Run ``fn`` under each level prefix and merge the runs (see the module's docstring).

    Each run calls ``fn`` ``warmup + repeat`` times, each call one step; the first ``warmup``
    steps of each run are left out (right after a session starts, its buffers and hooks are
    cold, and the first steps run 20-80% slower). The whole sequence of runs is a round;
    rounds are interleaved, each starting one run later than the one before (model,
    model+layer, ...; model+layer, ..., model; ...), and each run's steps are pooled over
    the rounds: slow drifts of the machine, and whatever running first costs, then spread
    over every run instead of landing on one.

    By default the rounds go on until the model latency and every top-level layer have a 95%
    confidence interval within ``target`` (±2%) of their figure, or ``budget_s`` seconds past
    the first round have gone by (at least ``MIN_ROUNDS``, five, at most ``MAX_ROUNDS``); ``rounds=``
    forces a count. First, one call of ``fn`` traced at the model level finds whether it
    records an autograd graph and whether it runs backward: a function that records one but
    never runs backward (inference without ``torch.no_grad``) is traced without backward hooks.
    Before the runs, each level's own cost per span is calibrated
    (:mod:`xsp.calibration`) and taken out of every figure (``compensate=False`` keeps them
    raw). Levels that cannot be recorded here (no GPU, no CUPTI) are left out, with the reason
    in ``trace.metadata["leveled"]["skipped"]``.

    Args:
        fn: the work to measure, called with no arguments (a closure over model and inputs).
        levels: the deepest set of levels; every prefix of it is run (and each metric level
            once, under model and layer).
        repeat: measured calls per run and round; None measures ``fn`` once and takes as many
            as fill about 0.03 s (5 to 200).
        warmup: steps at the start of each run that are traced and left out.
        output: write the merged trace here (``.xsp.parquet``); None writes nothing.
        trim: fraction dropped at each end of the trimmed means.
        rounds: how many rounds to run; None repeats until the figures are precise enough.
        target: the relative half-width of the 95% intervals that stops the rounds, and above
            which a figure is flagged (``metadata["leveled"]["imprecise"]``).
        budget_s: seconds past the first round that adaptive repetition may take (the
            ``MIN_ROUNDS`` rounds run whatever it says).
        compensate: take each level's calibrated cost out of the figures.
        trace_options: passed to each run's :func:`xsp.trace` (``max_events``, ...).

    Returns:
        A :class:`LeveledResult`: ``.trace`` (merged), ``.overhead`` (per run), ``.unmatched``.

    Example:
        >>> import torch, xsp
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
        >>> x = torch.randn(4, 8)
        >>> with torch.no_grad():
        ...     result = xsp.leveled(lambda: model(x), levels="model,layer", repeat=3, warmup=1, rounds=2)
        >>> list(result.overhead["run"])
        ['model', 'model+layer']
    """
    import time

    from xsp.calibration import calibrate
    from xsp.session import trace
    from xsp.tracers.registry import tracers_for
    from xsp.user_spans import step

    if (repeat is not None and repeat < 1) or (rounds is not None and rounds < 1):
        raise ValueError("repeat and rounds must be at least 1")
    if repeat is None:
        repeat = steps_per_run(fn)
    _, unavailable = tracers_for(parse_levels(levels))
    wanted = [level for level in parse_levels(levels) if level not in unavailable]
    plan = level_runs(wanted)
    # a function that records a graph but never runs backward (inference without no_grad): its
    # layer runs hook no backward (which would cost each layer call several microseconds and
    # disturb the figures), and the calibration measures what that costs
    autograd = autograd_of(fn) if compensate or "backward" not in trace_options else None
    if autograd is not None:
        trace_options.setdefault("backward", autograd.runs_backward)
    costs = calibrate(wanted, grad=autograd is not None and autograd.records and bool(trace_options["backward"])
                      ) if compensate else {}
    traces: dict[tuple[Level, ...], list[Trace]] = {run_levels: [] for run_levels in plan}
    result: LeveledResult | None = None
    first_round_end = None
    round_number = 0
    while True:
        turn = round_number % len(plan)  # each round starts one run later: no run always goes first
        for run_levels in plan[turn:] + plan[:turn]:
            with trace(levels=run_levels, output=None, **trace_options) as session:
                # the first steps after a session starts run cold (its buffers and hooks are
                # fresh): they are traced like the others and left out
                for _ in range(warmup + repeat):
                    with step(STEP_NAME):
                        fn()
            if session.trace is None:
                raise RuntimeError(f"the {run_label(run_levels)} run produced no trace: {session.warnings}")
            traces[run_levels].append(Trace(spans=measured_steps(session.trace.spans, warmup),
                                            metadata=session.trace.metadata))
        round_number += 1
        first_round_end = first_round_end or time.monotonic()
        if rounds is not None:
            if round_number >= rounds:
                break
            continue
        if round_number < MIN_ROUNDS:
            continue
        result = merge_runs([LeveledRun(r, pooled(traces[r])) for r in plan], warmup_steps=0, trim=trim,
                            costs=costs, target=target)
        if (precise_enough(result, target) or round_number >= MAX_ROUNDS
                or time.monotonic() - first_round_end > budget_s):
            break
        result = None
    if result is None:
        result = merge_runs([LeveledRun(r, pooled(traces[r])) for r in plan], warmup_steps=0, trim=trim,
                            costs=costs, target=target)
    details = result.trace.metadata["leveled"]
    details["rounds"] = round_number
    details["adaptive"] = rounds is None
    details["repeat"] = repeat
    details["precise"] = precise_enough(result, target)
    details["backward_hooks"] = bool(trace_options.get("backward", True))
    details["records_autograd"] = None if autograd is None else autograd.records
    details["skipped"] = {level.value: reason for level, reason in unavailable.items()}
    if output is not None:
        result.save(output)
    return result
