"""The runs of a leveled experiment, before they run: which levels each records, and how deep
its layer level goes; and the depth plans an always-on session's drawn steps rotate through.
Light on purpose: a session plans its runs as it starts, before anything heavy is imported."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xsp.core.levels import LevelsArg, parse_levels
from xsp.core.schema import METRIC_LEVELS, Level
from xsp.record.sampling import EVERY_DEPTH, MODEL_ONLY_LIMIT, DepthPlan


def run_label(levels: Sequence[Level], layer_depth: int | None = None) -> str:
    """``model+layer+operator``: how a run is named in tables and in ``leveled_run`` (the
    input level, which always comes with the model level, goes unnamed); a run that records
    layers down to a depth only is ``model+layer<=2``."""
    label = "+".join(level.value for level in levels if level is not Level.INPUT)
    return label if layer_depth is None else f"{label}<={layer_depth}"


class LabelledRun:
    """What a run's levels and layer depth say about it (for :class:`RunPlan` and :class:`LeveledRun`)."""

    levels: tuple[Level, ...]
    layer_depth: int | None

    @property
    def label(self) -> str:
        return run_label(self.levels, self.layer_depth)

    @property
    def is_metric(self) -> bool:
        return any(level in METRIC_LEVELS for level in self.levels)


@dataclass(frozen=True)
class RunPlan(LabelledRun):
    """One run of a leveled experiment, before it runs: its levels, and for a run whose deepest
    level is the layer level, the module call depth it records down to (None: every depth)."""

    levels: tuple[Level, ...]
    layer_depth: int | None = None


def level_runs(levels: LevelsArg, layer_depths: int = 1) -> list[RunPlan]:
    """The runs of a leveled experiment: each timing prefix, then one run per metric level.

    ``("model", "layer", "operator", "flops")`` gives model; model+layer;
    model+layer+operator; model+layer+flops (FLOPs are counted under the layers, without the
    operator level's profiler, so that their paths match the operators'). With
    ``layer_depths`` above 1 (the deepest module call depth of the model), the layer level is
    run once per depth: model+layer<=1, ..., model+layer<=D-1, then model+layer at every
    depth, so that each layer's time comes from a run that recorded nothing below it.
    """
    parsed = parse_levels(levels)
    # system samples are not spans of a step: they make no run (a leveled trace has none)
    timing = [level for level in parsed if level not in METRIC_LEVELS and level is not Level.SYSTEM]
    first = 2 if Level.INPUT in timing else 1  # the input level comes with the model level
    runs: list[RunPlan] = []
    for i in range(first - 1, len(timing)):
        prefix = tuple(timing[: i + 1])
        if prefix[-1] is Level.LAYER:
            runs.extend(RunPlan(prefix, depth) for depth in range(1, max(layer_depths, 1)))
        runs.append(RunPlan(prefix))
    base = [level for level in timing if level in (Level.MODEL, Level.INPUT, Level.LAYER)]
    if Level.FLOPS in parsed:
        runs.append(RunPlan((*base, Level.FLOPS)))
    if Level.GPU_METRICS in parsed:
        gpu = [level for level in timing if level in (Level.CUDA_API, Level.KERNEL)]
        runs.append(RunPlan((*base, *gpu, Level.GPU_METRICS)))
    return runs


def depth_plans(levels: tuple[Level, ...], deepest: int) -> list[DepthPlan]:
    """The plans for ``levels``, the layer level run once per module call depth down to
    ``deepest`` (the deepest seen so far; 1 before any)."""
    plans = []
    for run in level_runs(levels, max(deepest, 1)):
        if run.is_metric or run.levels[-1] in (Level.MODEL, Level.INPUT):
            continue
        if Level.LAYER in run.levels:
            limit = EVERY_DEPTH if run.layer_depth is None else run.layer_depth
        else:
            limit = MODEL_ONLY_LIMIT
        kept = frozenset({level.value for level in run.levels} | {Level.MODEL.value, Level.INPUT.value})
        plans.append(DepthPlan(run.label, limit, kept))
    return plans
