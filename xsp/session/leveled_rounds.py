"""The rounds of a leveled experiment (:mod:`xsp.session.leveled`): every run of the plan once
a round, rounds interleaved, runs hit by a burst of noise run again, until the figures are
precise enough or the time budget is spent; what they did is noted in the merged trace."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xsp.analysis.model import TRIM_FRACTION, model_latency, trimmed_mean, trimmed_mean_ci
from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.io.trace import Trace
from xsp.session.leveled_merge import DEFAULT_TARGET, LeveledResult
from xsp.session.leveled_plans import RunPlan
from xsp.table.walks import parent_positions

MAX_ROUNDS = 30
"""Adaptive repetition stops after this many rounds whatever the intervals say."""
MIN_ROUNDS = 5
"""Adaptive repetition runs at least this many rounds: interleaving is what cancels the
machine's drift, and a figure taken across rounds (:func:`across_rounds`) then drops a
disturbed round at each end and averages three. Twelve calls on ResNet-50 (batch 1), merged
from their first three rounds (the median of three), put the top-level layers 3.5% off the
model call in one of them; merged from their first five, all were within 0.5%. Models whose
round outlasts the time budget stop here."""


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


BURST_FACTOR = 4.0
"""A run whose model latency varies this many times more between its steps than the runs
before it did (the median of their relative 95% intervals) was hit by a burst of the machine's
noise: it is run again, while the budget allows."""
MAX_REPEATS = 2
"""A run hit by a burst is run again at most this many times in a round (then kept)."""
MIN_RUNS_FOR_BURSTS = 3
"""Bursts are told apart once this many runs have set what a run's spread is."""


def step_spread(found: Trace) -> float:
    """A run's noise: the half-width of the 95% interval of its steps' model latency, relative
    to the latency (NaN below two steps)."""
    values = model_latency(found.spans)["latency_ms"].to_numpy(dtype=np.float64)
    if len(values) < 2:
        return float("nan")
    figure = trimmed_mean(values, TRIM_FRACTION)
    return float(trimmed_mean_ci(values, TRIM_FRACTION) / figure) if figure > 0 else float("nan")


@dataclass
class RoundsLog:
    """What :func:`run_rounds` did besides running the plan: runs hit by bursts of noise and
    repeated, and what the time budget made it give up."""

    rounds: int = 0
    bursts: list[dict[str, Any]] = field(default_factory=list)
    """Per run set aside: ``run``, ``round``, ``spread`` (its relative 95% interval) and
    ``typical`` (the median of the runs before it)."""
    given_up: list[str] = field(default_factory=list)
    """What the budget cut short, in words."""
    seconds: float = 0.0
    """How long the rounds took."""
    stopped: dict[str, Any] | None = None
    """When the rounds stopped before their end (:class:`RoundsStopped`): ``by`` (what stopped
    them, in words), ``rounds_finished``, ``round`` (the one cut short), ``runs_finished`` of
    its ``runs_per_round`` (left out of the figures), ``cut`` (all that, in words)."""

    def as_dict(self) -> dict[str, Any]:
        return {"bursts": self.bursts, "repeated": len(self.bursts), "given_up": self.given_up,
                "seconds": round(self.seconds, 3), "partial": self.stopped}


@dataclass(frozen=True)
class RunProgress:
    """Where the rounds are, as a run begins: what :func:`run_rounds` tells its ``progress``."""

    round_number: int
    """This run's round, from 1."""
    rounds: int
    """The rounds planned: the count asked for, or (adaptive) the minimum, :data:`MIN_ROUNDS`."""
    adaptive: bool
    """More rounds may follow the planned ones, while the figures are not precise enough."""
    run_number: int
    """This run's place in its round, from 1."""
    runs: int
    """Runs a round."""
    label: str
    """The run's levels (``model+layer<=2``)."""
    seconds_left: float | None
    """Estimated time to the end of the planned rounds (or of this round, past them), from the
    runs so far; None before the first run has ended."""
    again: bool = False
    """The run is run again (its last try was hit by a burst of noise)."""

    def text(self) -> str:
        """``leveled round 2 of 5, run 3 of 9: model+layer<=2; about 1 min 20 s left``."""
        if not self.adaptive:
            rounds = f"round {self.round_number} of {self.rounds}"
        elif self.round_number <= self.rounds:
            rounds = f"round {self.round_number} of at least {self.rounds}"
        else:
            rounds = f"round {self.round_number} (past {self.rounds}: until the figures are precise)"
        again = " again (a burst of noise)" if self.again else ""
        left = ""
        if self.seconds_left is not None:
            until = "" if not self.adaptive else (
                f" for {self.rounds} rounds" if self.round_number <= self.rounds else " for this round")
            text = duration_text(self.seconds_left)
            left = f"; {text if text.startswith('under') else f'about {text}'} left{until}"
        return f"leveled {rounds}, run {self.run_number} of {self.runs}: {self.label}{again}{left}"


def duration_text(seconds: float) -> str:
    """``45 s``, ``3 min 20 s``, ``1 h 05 min``: a time left, as a person reads it."""
    whole = max(int(round(seconds)), 0)
    if whole < 1:
        return "under 1 s"
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


class RoundsStopped(Exception):
    """The rounds stopped before their end: a run raised (a signal, Ctrl-C, the script's own
    exit with a failure), and no more can run.

    Attributes:
        result: the runs of the rounds that finished, merged (None when no round finished, or
            they could not be merged: :attr:`why_none` says which).
        log: the rounds' log, its ``stopped`` filled in (what was cut).
        cause: what the run raised (re-raise it, or exit with its status, once the partial
            result is written).
    """

    def __init__(self, result: LeveledResult | None, log: RoundsLog, cause: BaseException, why_none: str) -> None:
        super().__init__(log.stopped["cut"] if log.stopped else "stopped")
        self.result = result
        self.log = log
        self.cause = cause
        self.why_none = why_none


def run_rounds(plan: Sequence[RunPlan], run: Callable[[RunPlan], Trace],
               merge: Callable[[dict[RunPlan, list[Trace]]], LeveledResult], rounds: int | None = None,
               target: float = DEFAULT_TARGET, budget_s: float | None = None,
               log: RoundsLog | None = None, progress: Callable[[RunProgress], None] | None = None,
               describe_stop: Callable[[BaseException], str] | None = None) -> tuple[LeveledResult, int]:
    """The leveled rounds, for :func:`leveled` and ``xsp run --leveled`` alike: each round runs
    every run of ``plan`` once (``run`` records one and returns its measured steps), each round
    starting one run later than the one before, so that no run always goes first.
    ``rounds`` rounds, or (None) at least :data:`MIN_ROUNDS` and then until ``merge`` of the
    runs pooled so far is precise to ``target``, or :data:`MAX_ROUNDS` have run; and in both
    cases no more once ``budget_s`` seconds have passed since the first round ended (None: the
    :data:`MIN_ROUNDS` rounds whatever they take, then more while :func:`default_budget_s` of the
    plan lasts). A run hit by a burst of noise (:data:`BURST_FACTOR`)
    is run again, at most :data:`MAX_REPEATS` times, while the budget allows. ``log``
    receives what was repeated and what the budget cut short; ``progress`` hears of each run
    as it begins (:class:`RunProgress`). Returns the merged result and the rounds run.

    Raises:
        RoundsStopped: a run raised anything (Ctrl-C, a signal turned into an exception, the
            program's exit): the rounds that finished are merged into its ``result`` (the
            unfinished round's runs are left out, so that every run keeps the same rounds), and
            what stopped them is its ``cause``; ``describe_stop`` says it in words.
    """
    import time

    budget = default_budget_s(plan) if budget_s is None else budget_s
    log = log if log is not None else RoundsLog()
    traces: dict[RunPlan, list[Trace]] = {entry: [] for entry in plan}
    spreads: list[float] = []
    began = time.monotonic()
    first_round_end: float | None = None
    runs_done = 0
    planned = rounds if rounds is not None else MIN_ROUNDS

    def tell(entry: RunPlan, position: int, again: bool = False) -> None:
        if progress is None:
            return
        left = None
        if runs_done:
            per_run = (time.monotonic() - began) / runs_done
            remaining = (max(planned - log.rounds, 1) * len(plan) if log.rounds < planned else len(plan)) - position
            left = per_run * remaining
        progress(RunProgress(round_number=log.rounds + 1, rounds=planned, adaptive=rounds is None,
                             run_number=position + 1, runs=len(plan), label=entry.label, seconds_left=left,
                             again=again))

    def stopped(cause: BaseException, position: int) -> RoundsStopped:
        finished = log.rounds
        how = describe_stop(cause) if describe_stop is not None else f"{type(cause).__name__}: {cause}"
        cut = (f"stopped by {how} in round {finished + 1}, after {position} of its {len(plan)} runs"
               + (f": {finished} round{'s' if finished != 1 else ''} merged, the runs of the unfinished one left out"
                  if finished else ": no round finished"))
        log.stopped = {"by": how, "rounds_finished": finished, "round": finished + 1, "runs_finished": position,
                       "runs_per_round": len(plan), "cut": cut}
        log.seconds = time.monotonic() - began
        if not finished:
            return RoundsStopped(None, log, cause, f"no leveled round finished ({position} of {len(plan)} runs "
                                                   "of the first)")
        try:
            result = merge({entry: found[:finished] for entry, found in traces.items()})
        except Exception as exc:  # what finished cannot be merged: said, never claimed written
            return RoundsStopped(None, log, cause, f"the {finished} finished round(s) could not be merged: {exc}")
        return RoundsStopped(result, log, cause, "")

    def out_of_time() -> bool:
        if budget_s is None and log.rounds < MIN_ROUNDS:  # by default, the minimum rounds always run
            return False
        return first_round_end is not None and time.monotonic() - first_round_end > budget

    def measured(entry: RunPlan, position: int) -> Trace:
        nonlocal runs_done
        tell(entry, position)
        found = run(entry)
        runs_done += 1
        spread = step_spread(found)
        known = [value for value in spreads if not np.isnan(value)]
        typical = float(np.median(known)) if len(known) >= MIN_RUNS_FOR_BURSTS else float("nan")
        for _ in range(MAX_REPEATS):
            if not spread > BURST_FACTOR * typical or out_of_time():
                break
            log.bursts.append({"run": entry.label, "round": log.rounds + 1, "spread": round(spread, 4),
                               "typical": round(typical, 4)})
            tell(entry, position, again=True)
            found = run(entry)
            runs_done += 1
            spread = step_spread(found)
        spreads.append(spread)
        return found

    while True:
        turn = log.rounds % len(plan)
        for position, entry in enumerate([*plan[turn:], *plan[:turn]]):
            try:
                found = measured(entry, position)
            except BaseException as cause:  # the finished rounds are still worth their file
                raise stopped(cause, position) from cause
            traces[entry].append(found)
        log.rounds += 1
        first_round_end = first_round_end or time.monotonic()
        log.seconds = time.monotonic() - began
        if rounds is not None:  # a count asked for is run whatever the budget says
            if log.rounds >= rounds:
                return merge(traces), log.rounds
            continue
        if log.rounds < MIN_ROUNDS:
            if not out_of_time():
                continue
            log.given_up.append(f"rounds: {log.rounds} of {MIN_ROUNDS} ran in the budget of {budget:.3g} s past "
                                f"the first round (a round took {log.seconds / log.rounds:.3g} s); fewer rounds "
                                "leave figures more exposed to the machine's bursts of noise")
            return merge(traces), log.rounds
        result = merge(traces)
        if precise_enough(result, target) or log.rounds >= MAX_ROUNDS:
            return result, log.rounds
        if out_of_time():
            log.given_up.append(f"precision: after {log.rounds} rounds the budget of {budget:.3g} s past the first "
                                f"round was spent with figures wider than ±{target:.0%}")
            return result, log.rounds


BUDGET_PER_RUN_S = 1.0
"""With ``budget_s=None``, once the :data:`MIN_ROUNDS` rounds have run, adaptive repetition may go
on until this long per run of a round has passed since the first round: 3 s for model, layer
and operator runs, more for a model whose modules nest (one layer run per depth). Twelve calls
on ResNet-50 (batch 1), merged from their first three rounds, put the top-level layers 3.5% off
the model call in one of them; from five, all within 0.5%: the minimum is not cut by default."""


def default_budget_s(plan: Sequence[RunPlan]) -> float:
    """The default time budget of a plan: :data:`BUDGET_PER_RUN_S` per run of a round."""
    return BUDGET_PER_RUN_S * len(plan)


def note_rounds(result: LeveledResult, plan: Sequence[RunPlan], log: RoundsLog, target: float, rounds: int | None,
                budget_s: float | None) -> None:
    """Write what the rounds did into ``result``'s ``metadata["leveled"]`` (for :func:`leveled`
    and ``xsp run --leveled`` alike): rounds, whether chosen adaptively, runs a round, the
    budget, bursts and cuts, and whether the figures are precise (and if not, why)."""
    details = result.trace.metadata["leveled"]
    details.update(rounds=log.rounds, adaptive=rounds is None, runs_per_round=len(plan),
                   budget_s=default_budget_s(plan) if budget_s is None else budget_s, **log.as_dict())
    details["precise"] = precise_enough(result, target)
    details["why_imprecise"] = None if details["precise"] else why_imprecise(result, log, target)


def why_imprecise(result: LeveledResult, log: RoundsLog, target: float) -> str:
    """Why figures of a leveled result are not precise to ``target``, in words."""
    reasons = ([log.stopped["cut"]] if log.stopped else []) + list(log.given_up)
    if log.bursts:
        count = len(log.bursts)
        reasons.append(f"{count} run{' was' if count == 1 else 's were'} hit by a burst of noise and run again")
    if not reasons:
        reasons.append(f"the machine's noise kept figures wider than ±{target:.0%} through {log.rounds} rounds")
    model = result.overhead[result.overhead["run"] == Level.MODEL.value]
    if len(model) and model["model_latency_ms"].iloc[0] > 0:
        spread = float(model["model_latency_ci_ms"].iloc[0] / model["model_latency_ms"].iloc[0])
        reasons.append(f"the model-only latency itself moved ±{spread:.1%} between rounds and steps (95% interval)")
    return "; ".join(reasons)
