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

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from xsp.analysis.model import TRIM_FRACTION
from xsp.core import schema as col
from xsp.core.errors import XspWarning, warn
from xsp.core.figures import counted
from xsp.core.levels import LevelsArg, parse_levels
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.session.leveled_merge import (
    DEFAULT_TARGET,
    LeveledResult,
    LeveledRun,
    measured_steps,
    merge_runs,
    pooled,
)
from xsp.session.leveled_plans import RunPlan, level_runs
from xsp.session.leveled_rounds import RoundsLog, RoundsStopped, note_rounds, run_rounds
from xsp.session.options import environment_sampling_set, without_environment_sampling

STEP_NAME = "leveled"
"""Each call of the function under :func:`leveled` is one step of this name."""


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
    return autograd_in(_Calls(fn, repeat=1, warmup=0, trace_options={}).probed((Level.MODEL,), "of autograd_of"))


def layer_depths_in(found: Trace | None) -> int:
    """The deepest module call depth of a trace's forward layer calls (1: only the model's own
    calls; 0: none), the number of layer runs a leveled experiment by depth needs."""
    spans = found.spans if found is not None else None
    if spans is None or not len(spans) or col.CALL_DEPTH not in spans:
        return 0
    layers = spans[(spans[col.LEVEL] == Level.LAYER.value) & (spans[col.KIND] == SpanKind.FORWARD.value)]
    depths = layers[col.CALL_DEPTH].dropna()
    return int(depths.max()) if len(depths) else 0


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


@contextlib.contextmanager
def run_cut_short_unsaid() -> Iterator[None]:
    """Around one leveled run's session: an interruption leaves that run out of the figures,
    so the session's "interrupted ...: the trace holds what was recorded" is not said (what is
    written is said once the rounds stop)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"xsp: interrupted by")
        yield


def plan_text(plan: Sequence[RunPlan], depths: int | None) -> str:
    """One line saying what a leveled experiment will run, before it does."""
    nesting = "" if depths is None else f"the model's module calls nest {depths} deep: "
    return f"leveled: {nesting}{len(plan)} runs a round ({', '.join(entry.label for entry in plan)})"




class LeveledWork(Protocol):
    """The work a leveled experiment measures, as :func:`run_leveled` runs it: a function called
    in a loop (:func:`leveled`) or a script (``xsp run --leveled``)."""

    def traced(self, levels: tuple[Level, ...], label: str, backward: bool, layer_depth: int | None) -> Trace:
        """One run of the work traced at ``levels`` (``label`` names the run in messages), its
        warm-up steps included.

        Raises:
            Exception: the run failed; the rounds stop (:class:`RoundsStopped`).
        """
        ...

    def probed(self, levels: tuple[Level, ...], label: str) -> Trace:
        """The shortest run of the work that shows what autograd does in it and how deep its
        module calls nest, traced at ``levels`` without backward hooks (the model level notes
        backward passes itself, and work that never runs backward would be hooked for nothing)."""
        ...


@dataclass(frozen=True)
class LeveledSettings:
    """How a leveled experiment runs (see :func:`leveled` for each)."""

    levels: tuple[Level, ...]
    warmup: int = 2
    rounds: int | None = None
    target: float = DEFAULT_TARGET
    budget_s: float | None = None
    compensate: bool = True
    by_depth: bool = True
    trim: float = TRIM_FRACTION
    backward: bool | None = None
    """Backward hooks in the runs; None: where the first run saw a backward pass."""


def run_leveled(work: LeveledWork, settings: LeveledSettings, progress: Callable[[str], None] | None = None,
                describe_stop: Callable[[BaseException], str] | None = None) -> tuple[LeveledResult, int]:
    """A leveled experiment on ``work``, for :func:`leveled` and ``xsp run --leveled`` alike: the
    levels that can be recorded here, a first run that finds what autograd does and how deep the
    module calls nest, the plan, each level's calibrated cost, the rounds, the merge. ``progress``
    hears each step in a line of text. Returns the merged result (its ``metadata["leveled"]``
    says what the rounds did) and the rounds run.

    Raises:
        RoundsStopped: a run raised: the rounds that finished are merged and noted in its
            ``result`` (see :func:`xsp.session.leveled_rounds.run_rounds`).
        ValueError: the runs cannot be merged.
    """
    from xsp.session.calibration import calibrate
    from xsp.session.session import calibration_session
    from xsp.tracers.registry import tracers_for

    def tell(line: str) -> None:
        if progress is not None:
            progress(line)

    _, unavailable = tracers_for(settings.levels)
    for level, reason in unavailable.items():
        tell(f"leveled: level {level.value} left out of the runs: {reason}")
    wanted = [level for level in settings.levels if level not in unavailable]
    by_depth = settings.by_depth and Level.LAYER in wanted
    autograd: Autograd | None = None
    depths = 0
    if by_depth or settings.compensate or settings.backward is None:
        label = "to find the model's depth" if by_depth else "to find what autograd does"
        tell(f"leveled: a first run {label}")
        found = work.probed((Level.MODEL, Level.LAYER) if by_depth else (Level.MODEL,), label)
        autograd, depths = autograd_in(found), layer_depths_in(found)
    # work that records a graph but never runs backward (inference without no_grad) is traced
    # without backward hooks, which would cost each layer call microseconds and disturb the figures
    backward = settings.backward if settings.backward is not None else autograd is not None and autograd.runs_backward
    plan = level_runs(wanted, layer_depths=depths if by_depth else 1)
    tell(plan_text(plan, depths if by_depth else None))
    records_autograd = autograd is not None and autograd.records
    costs = calibrate(wanted, calibration_session, grad=records_autograd and backward) if settings.compensate else {}

    def run(entry: RunPlan) -> Trace:
        found = work.traced(entry.levels, entry.label, backward, entry.layer_depth)
        return Trace(spans=measured_steps(found.spans, settings.warmup), metadata=found.metadata)

    def merge(traces: dict[RunPlan, list[Trace]]) -> LeveledResult:
        return merge_runs([LeveledRun(entry.levels, pooled(traces[entry]), entry.layer_depth) for entry in plan],
                          trim=settings.trim, costs=costs, target=settings.target, by_depth=by_depth)

    def noted(result: LeveledResult) -> LeveledResult:
        note_rounds(result, plan, log, settings.target, settings.rounds, settings.budget_s)
        result.trace.metadata["leveled"].update(
            backward_hooks=backward, records_autograd=None if autograd is None else autograd.records,
            warmup_steps=settings.warmup, skipped={level.value: reason for level, reason in unavailable.items()})
        return result

    log = RoundsLog()
    try:
        result, rounds = run_rounds(plan, run, merge, rounds=settings.rounds, target=settings.target,
                                    budget_s=settings.budget_s, log=log,
                                    progress=None if progress is None else lambda where: progress(where.text()),
                                    describe_stop=describe_stop)
    except RoundsStopped as stopped:  # the rounds that finished, noted as the whole would be
        if stopped.result is not None:
            noted(stopped.result)
        raise
    return noted(result), rounds


def leveled(fn: Callable[[], Any], levels: LevelsArg = ("model", "layer", "operator"), repeat: int | None = None,
            warmup: int = 2, output: str | os.PathLike[str] | None = None, trim: float = TRIM_FRACTION,
            rounds: int | None = None, target: float = DEFAULT_TARGET, budget_s: float | None = None,
            compensate: bool = True, by_depth: bool = True, progress: Callable[[str], None] | None = None,
            **trace_options: Any) -> LeveledResult:
    """Run ``fn`` under each level prefix and merge the runs (see the module's docstring).

    Each run calls ``fn`` ``warmup + repeat`` times, each call one step; the first ``warmup``
    steps of each run are left out (right after a session starts, its buffers and hooks are
    cold, and the first steps run 20-80% slower). The whole sequence of runs is a round;
    rounds are interleaved, each starting one run later than the one before (model,
    model+layer, ...; model+layer, ..., model; ...), and each run's steps are pooled over
    the rounds: slow drifts of the machine, and whatever running first costs, then spread
    over every run instead of landing on one.

    Modules nest: with ``by_depth`` (the default) the layer level is run once per module call
    depth (layers of depth 1 only, then depths 1-2, ..., then every depth), and each layer's
    duration comes from the run in which its own depth was the deepest recorded, so that no
    figure holds the cost of recording anything below it; the operator level follows the run
    of every depth. A model whose calls nest D deep then needs D + 2 runs a round instead of 3.
    ``by_depth=False`` runs the layer level once, at every depth, and takes the calibrated cost
    of the layers recorded below each one out of its figure instead.

    By default the rounds go on until the model latency and every top-level layer have a 95%
    confidence interval within ``target`` (±2%) of their figure (at least ``MIN_ROUNDS``, five,
    at most ``MAX_ROUNDS``); ``rounds=`` forces a count. Past the first round, no more than
    ``budget_s`` seconds are spent, even below the minimum (default: the minimum rounds, then
    more while one second per run of a round lasts); what the budget cut short is in
    ``metadata["leveled"]["given_up"]``. A run hit by a burst of the machine's
    noise (its steps spread :data:`BURST_FACTOR` times wider than the runs' before it) is
    set aside and run again, within the budget (``metadata["leveled"]["bursts"]``).

    First, one call of ``fn`` traced at the model and layer levels finds whether it records an
    autograd graph, whether it runs backward and how deep its module calls nest: a function that
    records a graph but never runs backward (inference without ``torch.no_grad``) is traced
    without backward hooks. Before the runs, each level's own cost per span is calibrated
    (:mod:`xsp.session.calibration`) and taken out of every figure (``compensate=False`` keeps them
    raw). Levels that cannot be recorded here (no GPU, no CUPTI) are left out, with the reason
    in ``trace.metadata["leveled"]["skipped"]``. Where a figure is not precise to ``target``,
    ``metadata["leveled"]["imprecise"]`` lists it and ``["why_imprecise"]`` says why.

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
        budget_s: seconds past the first round that more rounds and repeated runs may take,
            even below ``MIN_ROUNDS``; None: the minimum rounds whatever they take, then more
            while one second per run of a round lasts.
        compensate: take each level's calibrated cost out of the figures.
        by_depth: run the layer level once per module call depth (see above).
        progress: called with a line of text at each stage: the first run, the plan (how many
            runs a round takes), each run as it begins, and after the last round; xsp itself
            prints nothing (``xsp run --leveled`` prints the same lines).
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
    if (repeat is not None and repeat < 1) or (rounds is not None and rounds < 1):
        raise ValueError("repeat and rounds must be at least 1")
    settings = LeveledSettings(parse_levels(levels), warmup=warmup, rounds=rounds, target=target, budget_s=budget_s,
                               compensate=compensate, by_depth=by_depth, trim=trim,
                               backward=trace_options.pop("backward", None))
    if environment_sampling_set():
        warn(XspWarning("xsp: XSP_SAMPLE is not used by a leveled experiment: each of its runs records every step "
                        "at every level it runs"))
    work = _Calls(fn, steps_per_run(fn) if repeat is None else repeat, warmup, trace_options)
    try:
        result, _ = run_leveled(work, settings, progress)
    except RoundsStopped as stop:
        # the rounds that finished are written (marked partial, with what was cut); then the
        # interruption or failure goes on to the caller as it came
        if stop.result is not None:
            _finished(stop.result, work.repeat, settings.target, output, progress)
        elif progress is not None:
            progress(f"leveled: {stop.why_none}: nothing written")
        raise stop.cause from None
    _finished(result, work.repeat, settings.target, output, progress)
    return result


@dataclass(frozen=True)
class _Calls:
    """:func:`leveled`'s work: ``fn`` called ``warmup + repeat`` times a run, each call a step."""

    fn: Callable[[], Any]
    repeat: int
    warmup: int
    trace_options: dict[str, Any]

    def traced(self, levels: tuple[Level, ...], label: str, backward: bool, layer_depth: int | None) -> Trace:
        from xsp.record.user_spans import step
        from xsp.session.tracing import trace

        with without_environment_sampling():  # each run records every step: XSP_SAMPLE is the service's
            session = trace(levels=levels, output=None, layer_depth=layer_depth, backward=backward,
                            **self.trace_options)
        with run_cut_short_unsaid(), session:
            # the first steps after a session starts run cold (its buffers and hooks are
            # fresh): they are traced like the others and left out
            for _ in range(self.warmup + self.repeat):
                with step(STEP_NAME):
                    self.fn()
        if session.trace is None:
            raise RuntimeError(f"the {label} run produced no trace: {session.warnings}")
        return session.trace

    def probed(self, levels: tuple[Level, ...], label: str) -> Trace:
        """One call of ``fn``."""
        from xsp.session.tracing import trace

        with without_environment_sampling():
            session = trace(levels=levels, output=None, schedule=None, backward=False)
        with session:
            self.fn()
        if session.trace is None:
            raise RuntimeError(f"the run {label} produced no trace: {session.warnings}")
        return session.trace


def _finished(result: LeveledResult, repeat: int, target: float, output: str | os.PathLike[str] | None,
              progress: Callable[[str], None] | None) -> None:
    """:func:`leveled`'s end: the repeat noted, the last line said, the file written."""
    details = result.trace.metadata["leveled"]
    details["repeat"] = repeat
    if progress is not None:
        progress(f"leveled: {counted(details['rounds'], 'round')} in {details['seconds']:.1f} s"
                 + ("" if details["precise"] else f"; not precise to ±{target:.0%}: {details['why_imprecise']}"))
    if output is not None:
        result.save(output)
