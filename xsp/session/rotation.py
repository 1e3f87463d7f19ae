"""An always-on trace's leveled figures: its drawn steps rotated through the depth plans
(:func:`xsp.session.leveled_plans.depth_plans`), merged as the runs of a leveled experiment."""

from __future__ import annotations

from typing import Final

from xsp.core import schema as col
from xsp.core.levels import parse_levels
from xsp.core.schema import Level, StepSampling
from xsp.io.trace import Trace
from xsp.session.leveled_merge import LeveledResult, LeveledRun, merge_runs
from xsp.table.sampling import step_roots

LEVELED_SAMPLINGS: Final = frozenset({StepSampling.SAMPLED.value, StepSampling.MODEL_ONLY.value})
"""The steps whose runs are leveled: the drawn ones, each recorded by its depth plan in turn, and
the ones not drawn (the model-only run). A step recorded deep after a slow one, or for a capture,
was chosen by what happened (slow steps come in slow stretches) or by when: it is left out, so
that the runs differ only in their depth, as a leveled experiment's do."""


def leveled_over_steps(trace: Trace) -> LeveledResult | None:
    """The leveled figures of an always-on trace: its drawn steps, each recorded by one depth plan,
    merged as the runs of a leveled experiment (the steps timed at the model level only are the
    model-only run), so each layer's time comes from steps that recorded nothing below it. Steps
    recorded deep after a slow step or for a capture are left out (:data:`LEVELED_SAMPLINGS`).
    None where the trace has no such runs (not always on, or no step drawn)."""
    spans = trace.spans
    if col.SAMPLING not in spans or not spans[col.SAMPLING].notna().any():
        return None
    roots = spans.iloc[step_roots(spans)]
    roots = roots[(roots[col.LEVELED_RUN].notna() & roots[col.SAMPLING].isin(list(LEVELED_SAMPLINGS))).fillna(False)
                  .to_numpy(dtype=bool)]
    labels = roots[col.LEVELED_RUN].astype(str)
    if labels.nunique() < 2:
        return None
    steps = spans[col.STEP]
    runs = []
    for label, members in roots.groupby(labels, sort=False):
        levels, depth = _run_of_label(str(label))
        chosen = spans[steps.isin(members[col.STEP]).fillna(False).to_numpy(dtype=bool)].reset_index(drop=True)
        runs.append(LeveledRun(levels, Trace(spans=chosen, metadata=dict(trace.metadata)), depth))
    return merge_runs(runs)


def _run_of_label(label: str) -> tuple[tuple[Level, ...], int | None]:
    """The levels and layer depth a run's label names (:func:`xsp.session.leveled_plans.run_label`)."""
    names, _, depth = label.partition("<=")
    levels = parse_levels(names.replace("+", ","))
    return levels, int(depth) if depth else None
