"""Merging leveled runs: each span's time from the shallowest run that records it, its children's
from the deeper runs, per-path statistics pooled over rounds, and each run's overhead."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xsp.analysis.model import TRIM_FRACTION, model_latency, step_roots, trimmed_mean, trimmed_mean_ci
from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import LEVELS, Level
from xsp.io.trace import Trace
from xsp.session.leveled_plans import LabelledRun
from xsp.table.build import concat_spans
from xsp.table.level_costs import LevelCost, compensation_ns
from xsp.table.walks import depth_of, parent_positions, sum_into_ancestors


@dataclass
class LeveledRun(LabelledRun):
    """One traced run of a leveled experiment."""

    levels: tuple[Level, ...]
    trace: Trace
    layer_depth: int | None = None
    """The module call depth its layer level recorded down to (None: every depth)."""


def _depth_order(run: LeveledRun) -> tuple[int, float]:
    """Shallower runs first: fewer levels, then a lower layer depth (every depth last)."""
    return len(run.levels), float("inf") if run.layer_depth is None else run.layer_depth


def _layer_source(timing: Sequence[LeveledRun], depth: int) -> LeveledRun | None:
    """The run a layer call at ``depth`` takes its time from: of the runs whose deepest level
    is the layer level, the one that recorded down to its depth and no deeper."""
    layer_runs = [run for run in timing if run.levels[-1] is Level.LAYER]
    deep_enough = [run for run in layer_runs if run.layer_depth is None or run.layer_depth >= depth]
    return min(deep_enough, key=_depth_order) if deep_enough else None


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
"""Rounds from which a figure is taken across rounds (:func:`across_rounds`), not pooled."""


def across_rounds(values: np.ndarray) -> float:
    """One figure from per-round figures: the mean of the middle ones, at least the lowest and
    the highest round dropped (the median of three). A round that the machine disturbed from
    end to end (another process's burst lasting seconds) then moves nothing; pooled, its steps
    filled a share of the trimmed mean and put the top-level layers 6-16% off the model call
    in one call of ten on ResNet-50."""
    data = np.sort(np.asarray(values, dtype=np.float64))
    cut = max(1, int(len(data) * TRIM_FRACTION))
    return float(data[cut:len(data) - cut].mean())


def _by_rounds(keys: np.ndarray, rounds: np.ndarray, values: np.ndarray, trim: float) -> pd.DataFrame:
    """Per key, from its rounds: ``figure``, :func:`across_rounds` of its per-round trimmed
    means (NaN below :data:`MIN_ROUNDS_ACROSS` rounds), and ``ci``, the half-width of a 95%
    interval from the spread of its per-round medians (NaN below two rounds). Steps of one run
    share the machine's state while it ran, so the spread between rounds, not between steps,
    is what tells how far a pooled figure can move."""
    from scipy import stats

    per_round = pd.DataFrame({"key": keys, "round": rounds, "value": values}).groupby(
        ["key", "round"], sort=False, observed=True)["value"]
    medians = per_round.median().groupby(level=0, sort=False, observed=True)
    spread = medians.agg(["std", "count"])
    count = spread["count"].to_numpy(dtype=np.float64)
    t = stats.t.ppf(0.975, np.maximum(count - 1, 1))
    half_width = t * spread["std"].to_numpy(dtype=np.float64) / np.sqrt(np.maximum(count, 1))
    figures = per_round.agg(lambda v: trimmed_mean(v.to_numpy(), trim)).groupby(level=0, sort=False, observed=True).agg(
        lambda v: across_rounds(v.to_numpy()) if len(v) >= MIN_ROUNDS_ACROSS else np.nan)
    return pd.DataFrame({"figure": figures.reindex(spread.index),
                         "ci": np.where(count >= 2, half_width, np.nan)}, index=spread.index)


def _rounds_of(steps: pd.Series, round_starts: Sequence[int] | None) -> np.ndarray | None:
    """The round of each step (None when the steps are not pooled rounds)."""
    if not round_starts or len(round_starts) < 2:
        return None
    return np.searchsorted(np.asarray(round_starts), steps.to_numpy(dtype=np.int64), side="right") - 1


def _durations_by_path(spans: pd.DataFrame, trim: float, round_starts: Sequence[int] | None = None,
                       scale: np.ndarray | None = None) -> pd.DataFrame:
    """Per path: the trimmed mean duration, its 95% interval's half-width, and whether it
    appears once in every step. With the rounds of a pooled trace, the interval is the wider of
    the one from its steps and the one from its rounds, and from three rounds on the figure
    comes from the rounds (:func:`_by_rounds`). ``scale`` multiplies each row's duration first
    (:meth:`StepSpeed.scale`)."""
    if scale is not None:
        spans = spans.assign(**{col.DURATION_NS: spans[col.DURATION_NS].to_numpy(dtype=np.float64) * scale})
    steps = spans[col.STEP].nunique()
    grouped = spans.groupby(col.PATH, sort=False, observed=True)[col.DURATION_NS]
    counts = spans.groupby(col.PATH, sort=False, observed=True)[col.STEP].agg(["size", "nunique"])
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
    sums = frame.groupby(col.PATH, sort=False, observed=True)[["flops", "bytes"]].mean()
    return sums[(sums["flops"] > 0) | (sums["bytes"] > 0)]


def _latency_ms(spans: pd.DataFrame, trim: float, round_starts: Sequence[int] | None = None) -> tuple[float, float]:
    """The trimmed mean of the steps' latencies and its 95% interval's half-width (with rounds,
    the wider of the steps' and the rounds' intervals, as for :func:`_durations_by_path`)."""
    latencies = model_latency(spans)
    return _step_figure(latencies["latency_ms"].to_numpy(dtype=np.float64), latencies["step"], trim, round_starts)


def _step_figure(values: np.ndarray, steps: pd.Series, trim: float,
                 round_starts: Sequence[int] | None) -> tuple[float, float]:
    """One figure from one value a step, and its 95% interval's half-width: the trimmed mean of
    the steps, or with rounds, taken across them (:func:`_by_rounds`)."""
    interval = trimmed_mean_ci(values, trim)
    rounds = _rounds_of(steps, round_starts) if len(values) else None
    figure = trimmed_mean(values, trim)
    if rounds is not None:
        between = _by_rounds(np.zeros(len(values), dtype=np.int64), rounds, values, trim).iloc[0]
        interval = float(np.fmax(interval, between["ci"]))
        figure = figure if np.isnan(between["figure"]) else float(between["figure"])
    return figure, interval


def compensated_step_ns(spans: pd.DataFrame, costs: dict[Level, LevelCost] | None) -> pd.Series:
    """Per step of one run: its root span's duration less the calibrated cost of everything its
    run recorded inside it (the step's own length as if nothing had been traced), by step."""
    frame = spans.reset_index(drop=True)
    roots = step_roots(frame)
    if roots.empty:
        return pd.Series(dtype=np.float64)
    taken = compensation_ns(frame, parent_positions(frame), costs or {})
    positions = roots.index.to_numpy()
    durations = frame[col.DURATION_NS].to_numpy(dtype=np.float64)[positions] - taken[positions]
    return pd.Series(durations, index=roots[col.STEP].to_numpy(dtype=np.int64)).groupby(level=0, observed=True).sum()


FAST_STEPS_QUANTILE = 0.1
"""Each run's fastest steps, compared with the model-only run's, give what tracing added to its
steps: the quantile of step lengths that stands for them."""


def _fastest_by_round(lengths: pd.Series, round_starts: Sequence[int] | None) -> pd.Series:
    """Per round (a single round 0 when the steps are not pooled rounds), the length of its
    fastest steps (:data:`FAST_STEPS_QUANTILE`)."""
    rounds = _rounds_of(pd.Series(lengths.index), round_starts)
    keys = np.zeros(len(lengths), dtype=np.int64) if rounds is None else rounds
    return pd.Series(lengths.to_numpy(dtype=np.float64)).groupby(keys, observed=True).quantile(FAST_STEPS_QUANTILE)


def inflation_of(lengths: pd.Series, round_starts: Sequence[int] | None, base: pd.Series) -> float:
    """How much longer a run's steps (``lengths``) were than the model-only run's fastest steps
    (``base``, per round from :func:`_fastest_by_round`): compared round by round, since the
    runs of one round ran back to back, and the median of the rounds kept (the machine can be
    slow through a whole run; a round where one run was and the other was not is outvoted)."""
    fastest = _fastest_by_round(lengths, round_starts)
    shared = fastest.index.intersection(base.index)
    if shared.empty:
        return float(fastest.median() / base.median())
    return float((fastest[shared] / base[shared]).median())


@dataclass(frozen=True)
class StepSpeed:
    """The machine's speed in each step of each run, against one reference: what
    :func:`merge_runs` divides out of every host duration before pooling."""

    reference_ns: float
    """The model-only run's step, compensated, taken across its rounds: every run's host
    durations are expressed at the speed that gave this figure."""
    reference_ci_ns: float
    """The half-width of its 95% interval."""
    per_step_ns: dict[str, pd.Series]
    """Per run label, each step's length as if nothing had been traced, at that step's speed."""
    inflation: dict[str, float]
    """Per run label, how much longer its steps were than the model-only run's, compared at
    their fastest (:data:`FAST_STEPS_QUANTILE`): what its tracing added, as a factor."""
    slowdown: float
    """The reference over the model-only run's fastest steps: how much slower than at its
    fastest the machine ran at the reference's speed (costs calibrated where the machine ran
    fastest are scaled by it)."""

    def costs_at_reference(self, costs: dict[Level, LevelCost]) -> dict[Level, LevelCost]:
        """``costs`` as they were at the reference's speed."""
        return {level: cost.scaled(self.slowdown) if cost.fastest else cost for level, cost in costs.items()}

    def scale(self, label: str, spans: pd.DataFrame) -> np.ndarray:
        """Per row of a run's spans: the reference over its step's length on the host, 1 for GPU
        activities (which the host's speed does not time)."""
        lengths = spans[col.STEP].map(self.per_step_ns[label]).to_numpy(dtype=np.float64, na_value=np.nan)
        return np.where(spans[col.THREAD_ID].notna().to_numpy(), self.reference_ns / lengths, 1.0)


def _step_lengths(spans: pd.DataFrame, costs: dict[Level, LevelCost] | None = None) -> pd.Series | None:
    """Per step, its root spans' length (less ``costs``, :func:`compensated_step_ns`); None where
    some step has no root of a positive length."""
    lengths = compensated_step_ns(spans, costs)
    steps = spans[col.STEP].dropna().unique()
    if not len(steps) or not (lengths.reindex(steps) > 0).all():
        return None
    return lengths


def step_speed(timing: Sequence[LeveledRun], measured: dict[str, pd.DataFrame], costs: dict[Level, LevelCost] | None,
               trim: float) -> StepSpeed | None:
    """The step speeds of the timing runs (shallowest first), or None where some step of some
    run has no root span of a positive length (nothing to measure speed by).

    A virtual machine's speed jumps by up to 2x for tens to thousands of milliseconds (another
    tenant, a migrated core): pooled as they are, the runs of one round land on different
    speeds, and the top-level layers of one call summed 14% under to 26% over the model call on
    a 0.5 ms model. Within one step, though, the model call and its layers ran at one speed:
    each span's share of its own step is what its run measures, and the model-only run's step
    sets the scale for all.

    A step's share needs the step's length as if nothing had been traced. For the model-only
    run, that is its root less the calibrated cost of the model call. For the others, it is
    their root divided by what their tracing added, measured by comparing each run's fastest
    steps with the model-only run's. It is not taken from calibration there: in a real model,
    a layer span cost its parent about twice what the calibration's tight loop measures (colder
    caches), 1.2 µs against 0.56 µs on a 0.5 ms model of 40 blocks, and the layers summed 4-8%
    short of the model call."""
    base = timing[0]
    base_lengths = _step_lengths(measured[base.label], costs)
    if base_lengths is None:
        return None
    fastest = _fastest_by_round(base_lengths, base.trace.metadata.get(ROUND_STARTS))
    per_step: dict[str, pd.Series] = {base.label: base_lengths}
    inflation: dict[str, float] = {base.label: 1.0}
    for run in timing[1:]:
        lengths = _step_lengths(measured[run.label])
        if lengths is None:
            return None
        inflation[run.label] = inflation_of(lengths, run.trace.metadata.get(ROUND_STARTS), fastest)
        per_step[run.label] = lengths / inflation[run.label]
    figure, interval = _step_figure(base_lengths.to_numpy(dtype=np.float64), pd.Series(base_lengths.index), trim,
                                    base.trace.metadata.get(ROUND_STARTS))
    if not figure > 0:
        return None
    return StepSpeed(reference_ns=figure, reference_ci_ns=interval, per_step_ns=per_step, inflation=inflation,
                     slowdown=figure / float(fastest.median()))


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
               costs: dict[Level, LevelCost] | None = None, target: float = DEFAULT_TARGET,
               by_depth: bool | None = None, normalize_speed: bool = True) -> LeveledResult:
    """Merge the runs of a leveled experiment (see the module's docstring).

    Args:
        runs: traced runs; the timing runs' levels must be prefixes of one another.
        warmup_steps: steps at the start of each run that are left out (``xsp run --leveled``;
            :func:`leveled` warms up outside its runs).
        trim: fraction dropped at each end for the trimmed means.
        costs: the calibrated cost of one span per level (:func:`xsp.session.calibration.calibrate`):
            taken out of each figure (``overhead_ns``); None leaves the figures raw.
        target: the relative half-width of a 95% interval above which a figure is flagged.
        by_depth: the layer level was run once per module depth (see :func:`level_runs`), so
            each figure is compensated only inside its own clock readings; None: whether any
            run recorded layers down to a depth only.
        normalize_speed: express each host duration at one machine speed, that of the model-only
            run (:func:`step_speed`): its share of its own step, times that run's step; the
            intervals then add the model-only step's own. Where a step has no root span to
            measure by, durations are pooled as they are.
    """
    timing = sorted((r for r in runs if not r.is_metric), key=_depth_order)
    if not timing:
        raise ValueError("a leveled experiment needs at least one run that is not a metric run")
    deepest = timing[-1]
    if by_depth is None:
        by_depth = any(run.layer_depth is not None for run in timing)
    source_of: dict[Level, LeveledRun] = {}
    for run in timing:  # a level's figures come from the first (shallowest) run that traced it at every depth
        for level in run.levels:
            if run.layer_depth is None or level is not Level.LAYER:
                source_of.setdefault(level, run)
    measured = {run.label: measured_steps(run.trace.spans, warmup_steps) for run in runs}
    speed = step_speed(timing, measured, costs, trim) if normalize_speed else None
    by_path = {run.label: _durations_by_path(measured[run.label], trim, run.trace.metadata.get(ROUND_STARTS),
                                             None if speed is None else speed.scale(run.label, measured[run.label]))
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
    call_depths = merged[col.CALL_DEPTH].astype("Int64").to_numpy(dtype=np.float64, na_value=np.nan) \
        if col.CALL_DEPTH in merged else np.full(len(merged), np.nan)
    for i, (path, level_name, name) in enumerate(zip(merged[col.PATH], merged[col.LEVEL], merged[col.NAME])):
        level = Level(level_name)
        run = source_of.get(level, deepest)
        if by_depth and level is Level.LAYER and not np.isnan(call_depths[i]):
            run = _layer_source(timing, int(call_depths[i])) or run
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
    on_host = merged[col.THREAD_ID].notna().to_numpy()
    if speed is not None:  # a share of the step, times a reference that is itself only so precise
        relative = speed.reference_ci_ns / speed.reference_ns
        intervals = np.where(on_host, np.hypot(intervals, durations * relative), intervals)
    # by depth, a model call's or layer's figure comes from a run that recorded nothing below it:
    # only its own recording is taken out, never an estimate for what lies below it (the calls
    # that passed through the wrapper unrecorded did so in the model-only run as well)
    host_calls = merged[col.LEVEL].isin([Level.MODEL.value, Level.LAYER.value]).to_numpy()
    at_speed = speed.costs_at_reference(costs or {}) if speed is not None else costs or {}
    taken = compensation_ns(merged, parent_positions(merged), at_speed, own_run, same_level_only=True,
                            own_only=host_calls if by_depth else None)
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
            "by_depth": by_depth,
            "step_speed": None if speed is None else {
                "reference_step_ms": speed.reference_ns / 1e6, "reference_step_ci_ms": speed.reference_ci_ns / 1e6,
                "inflation": speed.inflation, "slowdown": speed.slowdown},
            "layer_depths": max((run.layer_depth or 0 for run in timing), default=0) + 1 if by_depth else None,
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
    return Trace(spans=concat_spans(frames), metadata={**traces[-1].metadata, ROUND_STARTS: starts})
