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
  steps) in the run where its level was deepest, and notes that run in ``leveled_run``,
* keeps the tree (parents, order, attributes) of the deepest run's last measured step, with
  ``end_ns = start_ns + duration_ns``,
* takes FLOPs and bytes from the metric runs (``flops``, ``gpu_metrics``), never durations,
* reports spans that do not appear once in every step of the runs it needs (data-dependent
  control flow) instead of matching them wrongly: they keep the deepest run's own figure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.analysis.model import TRIM_FRACTION, model_latency, trimmed_mean
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
            (trimmed mean over the measured steps), ``overhead`` (against the model-only run),
            ``metric`` (a metric run, whose durations are never used).
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


def _durations_by_path(spans: pd.DataFrame, trim: float) -> pd.DataFrame:
    """Per path: the trimmed mean duration, and whether it appears once in every step."""
    steps = spans[col.STEP].nunique()
    grouped = spans.groupby(col.PATH, sort=False)[col.DURATION_NS]
    counts = spans.groupby(col.PATH, sort=False)[col.STEP].agg(["size", "nunique"])
    means = grouped.agg(lambda values: trimmed_mean(values.to_numpy(), trim))
    return pd.DataFrame({"duration_ns": means, "regular": (counts["size"] == steps) & (counts["nunique"] == steps)})


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


def _latency_ms(spans: pd.DataFrame, trim: float) -> float:
    return trimmed_mean(model_latency(spans)["latency_ms"].to_numpy(dtype=np.float64), trim)


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


def merge_runs(runs: Sequence[LeveledRun], warmup_steps: int = 0, trim: float = TRIM_FRACTION) -> LeveledResult:
    """Merge the runs of a leveled experiment (see the module's docstring).

    Args:
        runs: traced runs; the timing runs' levels must be prefixes of one another.
        warmup_steps: steps at the start of each run that are left out (``xsp run --leveled``;
            :func:`leveled` warms up outside its runs).
        trim: fraction dropped at each end for the trimmed means.
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
    by_path = {run.label: _durations_by_path(measured[run.label], trim) for run in timing}

    deep = measured[deepest.label]
    if deep.empty:
        raise ValueError(f"the run {deepest.label} has no measured steps (steps: {len(deepest.trace.steps)}, "
                         f"warm-up: {warmup_steps})")
    last_step = int(deep[col.STEP].max())
    merged = deep[deep[col.STEP] == last_step].copy()
    durations = merged[col.DURATION_NS].to_numpy(dtype=np.int64).copy()
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
            sources[i] = run.label
        else:
            unmatched.append({"path": path, "level": level_name, "name": name, "run": run.label, "reason": reason})
            if path in own.index:
                durations[i] = int(round(own.at[path, "duration_ns"]))
            sources[i] = deepest.label
    merged = merged.reset_index(drop=True)
    starts, durations, clamped = nest_in_parents(parent_positions(merged), merged[col.START_NS].to_numpy(
        dtype=np.int64), merged[col.END_NS].to_numpy(dtype=np.int64), durations,
        merged[col.THREAD_ID].notna().to_numpy())
    merged[col.START_NS] = starts
    merged[col.DURATION_NS] = durations
    merged[col.END_NS] = starts + durations
    merged[col.LEVELED_RUN] = pd.array(sources.tolist(), dtype="string")
    for run in runs:
        if run.is_metric:
            counts = _inclusive_counts(measured[run.label])
            for column, key in ((col.FLOPS, "flops"), (col.BYTES, "bytes")):
                found = merged[col.PATH].map(counts[key]).round().astype("Int64")
                merged[column] = merged[column].fillna(found.where(found > 0))
    overhead = _overhead_table(runs, measured, trim)
    unmatched_table = pd.DataFrame(unmatched, columns=["path", "level", "name", "run", "reason"])
    metadata = {
        **deepest.trace.metadata,
        "levels": sorted({level.value for run in runs for level in run.levels}, key=[v.value for v in LEVELS].index),
        "leveled": {
            "runs": [run.label for run in runs], "warmup_steps": warmup_steps, "trim_fraction": trim,
            "merged_step": last_step, "overhead": overhead.to_dict(orient="records"),
            "unmatched": len(unmatched_table),
            "clamped": clamped,
        },
    }
    trace = Trace(spans=merged.reset_index(drop=True), metadata=metadata)
    return LeveledResult(trace=trace, overhead=overhead, unmatched=unmatched_table, runs=list(runs))


def _overhead_table(runs: Sequence[LeveledRun], measured: dict[str, pd.DataFrame], trim: float) -> pd.DataFrame:
    rows = []
    for run in runs:
        spans = measured[run.label]
        rows.append({"run": run.label, "levels": [level.value for level in run.levels],
                     "steps": int(spans[col.STEP].nunique()), "model_latency_ms": _latency_ms(spans, trim),
                     "metric": run.is_metric})
    table = pd.DataFrame(rows, columns=["run", "levels", "steps", "model_latency_ms", "metric"])
    base = table[table["run"] == Level.MODEL.value]["model_latency_ms"]
    table["overhead"] = table["model_latency_ms"] / float(base.iloc[0]) - 1 if len(base) else np.nan
    return table[["run", "levels", "steps", "model_latency_ms", "overhead", "metric"]]


def pooled(traces: Sequence[Trace]) -> Trace:
    """One trace holding the steps of several runs with the same levels, renumbered in order."""
    frames, offset = [], 0
    for trace in traces:
        spans = trace.spans.copy()
        spans[col.STEP] = spans[col.STEP] + offset
        offset = int(spans[col.STEP].max()) + 1 if spans[col.STEP].notna().any() else offset
        frames.append(spans)
    return Trace(spans=pd.concat(frames, ignore_index=True), metadata=traces[-1].metadata)


def leveled(fn: Callable[[], Any], levels: LevelsArg = ("model", "layer", "operator"), repeat: int = 5,
            warmup: int = 2, output: str | os.PathLike[str] | None = None, trim: float = TRIM_FRACTION,
            rounds: int = 1, **trace_options: Any) -> LeveledResult:
    """Run ``fn`` under each level prefix and merge the runs (see the module's docstring).

    Each run calls ``fn`` ``warmup`` times untraced, then ``repeat`` times traced, each call
    one step. With ``rounds`` above 1 the whole sequence of runs is repeated, interleaved, each
    round starting one run later than the one before (model, model+layer, ...; model+layer,
    ..., model; ...), and each run's steps are pooled over the rounds: slow drifts of the
    machine, and whatever running first costs, then spread over every run instead of landing
    on one. Levels that cannot be recorded here (no GPU, no CUPTI) are left out, with the reason
    in ``trace.metadata["leveled"]["skipped"]``.

    Args:
        fn: the work to measure, called with no arguments (a closure over model and inputs).
        levels: the deepest set of levels; every prefix of it is run (and each metric level
            once, under model and layer).
        repeat: measured calls per run.
        warmup: untraced calls before each run.
        output: write the merged trace here (``.xsp.parquet``); None writes nothing.
        trim: fraction dropped at each end of the trimmed means.
        rounds: how many times the sequence of runs is repeated (interleaved, then pooled).
        trace_options: passed to each run's :func:`xsp.trace` (``max_events``, ...).

    Returns:
        A :class:`LeveledResult`: ``.trace`` (merged), ``.overhead`` (per run), ``.unmatched``.

    Example:
        >>> import torch, xsp
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
        >>> x = torch.randn(4, 8)
        >>> with torch.no_grad():
        ...     result = xsp.leveled(lambda: model(x), levels="model,layer", repeat=3, warmup=1)
        >>> list(result.overhead["run"])
        ['model', 'model+layer']
    """
    from xsp.session import trace
    from xsp.tracers.registry import tracers_for
    from xsp.user_spans import step

    if repeat < 1 or rounds < 1:
        raise ValueError("repeat and rounds must be at least 1")
    _, unavailable = tracers_for(parse_levels(levels))
    wanted = [level for level in parse_levels(levels) if level not in unavailable]
    plan = level_runs(wanted)
    traces: dict[tuple[Level, ...], list[Trace]] = {run_levels: [] for run_levels in plan}
    for round_number in range(rounds):
        turn = round_number % len(plan)  # each round starts one run later: no run always goes first
        for run_levels in plan[turn:] + plan[:turn]:
            for _ in range(warmup):
                fn()
            with trace(levels=run_levels, output=None, **trace_options) as session:
                for _ in range(repeat):
                    with step(STEP_NAME):
                        fn()
            if session.trace is None:
                raise RuntimeError(f"the {run_label(run_levels)} run produced no trace: {session.warnings}")
            traces[run_levels].append(session.trace)
    runs = [LeveledRun(run_levels, pooled(traces[run_levels])) for run_levels in plan]
    result = merge_runs(runs, warmup_steps=0, trim=trim)
    result.trace.metadata["leveled"]["rounds"] = rounds
    result.trace.metadata["leveled"]["skipped"] = {level.value: reason for level, reason in unavailable.items()}
    if output is not None:
        result.save(output)
    return result
