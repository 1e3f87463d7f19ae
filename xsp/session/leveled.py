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
from dataclasses import dataclass
from typing import Any

import numpy as np

from xsp.analysis.model import TRIM_FRACTION
from xsp.core import schema as col
from xsp.core.levels import LevelsArg, parse_levels
from xsp.core.schema import Level
from xsp.io.trace import Trace
from xsp.session.leveled_merge import (
    DEFAULT_TARGET,
    LeveledResult,
    LeveledRun,
    level_runs,
    measured_steps,
    merge_runs,
    pooled,
    run_label,
)
from xsp.table.walks import parent_positions

STEP_NAME = "leveled"
"""Each call of the function under :func:`leveled` is one step of this name."""


MAX_ROUNDS = 30
"""Adaptive repetition stops after this many rounds whatever the intervals say."""
MIN_ROUNDS = 5
"""Adaptive repetition runs at least this many rounds: interleaving is what cancels the
machine's drift, and a figure taken across rounds (:func:`across_rounds`) then drops a
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
    from xsp.session.session import trace

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


def run_rounds(plan: Sequence[tuple[Level, ...]], run: Callable[[tuple[Level, ...]], Trace],
               merge: Callable[[dict[tuple[Level, ...], list[Trace]]], LeveledResult], rounds: int | None = None,
               target: float = DEFAULT_TARGET, budget_s: float = DEFAULT_BUDGET_S) -> tuple[LeveledResult, int]:
    """The leveled rounds, for :func:`leveled` and ``xsp run --leveled`` alike: each round runs
    every level prefix of ``plan`` once (``run`` records one and returns its measured steps),
    each round starting one run later than the one before, so that no run always goes first.
    ``rounds`` rounds, or (None) at least :data:`MIN_ROUNDS` and then until ``merge`` of the
    runs pooled so far is precise to ``target``, :data:`MAX_ROUNDS` have run or ``budget_s``
    seconds have passed since the first round. Returns the merged result and the rounds run."""
    import time

    traces: dict[tuple[Level, ...], list[Trace]] = {levels: [] for levels in plan}
    first_round_end: float | None = None
    round_number = 0
    while True:
        turn = round_number % len(plan)
        for levels in [*plan[turn:], *plan[:turn]]:
            traces[levels].append(run(levels))
        round_number += 1
        first_round_end = first_round_end or time.monotonic()
        if rounds is not None:
            if round_number >= rounds:
                return merge(traces), round_number
            continue
        if round_number < MIN_ROUNDS:
            continue
        result = merge(traces)
        if (precise_enough(result, target) or round_number >= MAX_ROUNDS
                or time.monotonic() - first_round_end > budget_s):
            return result, round_number


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
    (:mod:`xsp.session.calibration`) and taken out of every figure (``compensate=False`` keeps them
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
    from xsp.record.user_spans import step
    from xsp.session.calibration import calibrate
    from xsp.session.session import trace
    from xsp.tracers.registry import tracers_for

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

    def run(run_levels: tuple[Level, ...]) -> Trace:
        with trace(levels=run_levels, output=None, **trace_options) as session:
            # the first steps after a session starts run cold (its buffers and hooks are
            # fresh): they are traced like the others and left out
            for _ in range(warmup + repeat):
                with step(STEP_NAME):
                    fn()
        if session.trace is None:
            raise RuntimeError(f"the {run_label(run_levels)} run produced no trace: {session.warnings}")
        return Trace(spans=measured_steps(session.trace.spans, warmup), metadata=session.trace.metadata)

    def merge(traces: dict[tuple[Level, ...], list[Trace]]) -> LeveledResult:
        return merge_runs([LeveledRun(r, pooled(traces[r])) for r in plan], warmup_steps=0, trim=trim,
                          costs=costs, target=target)

    result, round_number = run_rounds(plan, run, merge, rounds=rounds, target=target, budget_s=budget_s)
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
