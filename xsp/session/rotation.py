"""An always-on trace's leveled figures: its drawn steps rotated through the depth plans
(:func:`xsp.session.leveled_plans.depth_plans`), merged as the runs of a leveled experiment."""

from __future__ import annotations

from typing import Final

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.levels import parse_levels
from xsp.core.schema import Level, SpanKind, StepSampling
from xsp.io.trace import Trace
from xsp.session.leveled_merge import LeveledResult, LeveledRun, merge_runs
from xsp.table.sampling import step_roots

LEVELED_SAMPLINGS: Final = frozenset({StepSampling.SAMPLED.value, StepSampling.MODEL_ONLY.value})
"""The steps whose runs are leveled: the drawn ones, each recorded by its depth plan in turn, and
the ones not drawn (the model-only run). A step recorded deep after a slow one, or for a capture,
was chosen by what happened (slow steps come in slow stretches) or by when: it is left out, so
that the runs differ only in their depth, as a leveled experiment's do."""


MAX_LEVELED_MODELS: Final = 3
"""Models whose steps :func:`leveled_by_model` levels, the busiest first."""


def leveled_over_steps(trace: Trace, model: str | None = None) -> LeveledResult | None:
    """The leveled figures of an always-on trace: its drawn steps, each recorded by one depth plan,
    merged as the runs of a leveled experiment (the steps timed at the model level only are the
    model-only run), so each layer's time comes from steps that recorded nothing below it. Steps
    recorded deep after a slow step or for a capture are left out (:data:`LEVELED_SAMPLINGS`).

    The steps of one model only (``model``: the name of the model a step called first; None: the
    model whose steps took the most time): a service's endpoints each run their own model, and the
    runs of a leveled experiment must repeat one piece of work. None where the trace has no such
    runs (not always on, or no step drawn)."""
    found = leveled_by_model(trace, limit=None if model is not None else 1, only=model)
    return found[0][1] if found else None


def leveled_by_model(trace: Trace, limit: int | None = MAX_LEVELED_MODELS,
                     only: str | None = None) -> list[tuple[str, LeveledResult]]:
    """:func:`leveled_over_steps` for each model that leads steps (the busiest ``limit`` of them
    whose steps make at least two runs, or the model ``only``), with its name, busiest first."""
    spans = trace.spans
    if col.SAMPLING not in spans or not spans[col.SAMPLING].notna().any():
        return []
    roots = spans.iloc[step_roots(spans)]
    roots = roots[(roots[col.LEVELED_RUN].notna() & roots[col.SAMPLING].isin(list(LEVELED_SAMPLINGS))).fillna(False)
                  .to_numpy(dtype=bool)]
    if roots.empty:
        return []
    models = roots[col.STEP].map(_first_models(spans)).fillna(roots[col.NAME]).astype(str)
    busiest = roots.groupby(models.to_numpy())[col.DURATION_NS].sum().sort_values(ascending=False, kind="stable")
    steps = spans[col.STEP]
    found: list[tuple[str, LeveledResult]] = []
    for model in busiest.index.tolist():
        if only is not None and model != only:
            continue
        members = roots[(models == model).to_numpy()]
        labels = members[col.LEVELED_RUN].astype(str)
        if labels.nunique() < 2:
            continue
        runs = []
        for label, run_roots in members.groupby(labels, sort=False):
            levels, depth = _run_of_label(str(label))
            chosen = spans[steps.isin(run_roots[col.STEP]).fillna(False).to_numpy(dtype=bool)].reset_index(drop=True)
            runs.append(LeveledRun(levels, Trace(spans=chosen, metadata=dict(trace.metadata)), depth))
        found.append((str(model), merge_runs(runs)))
        if limit is not None and len(found) >= limit:
            break
    return found


def _first_models(spans: pd.DataFrame) -> pd.Series:
    """The name of the first model each step called, by step."""
    calls = spans[(spans[col.KIND] == SpanKind.PREDICT.value).to_numpy(dtype=bool)
                  & spans[col.STEP].notna().to_numpy(dtype=bool)]
    return calls.sort_values(col.START_NS, kind="stable").groupby(col.STEP, observed=True)[col.NAME].first()


def _run_of_label(label: str) -> tuple[tuple[Level, ...], int | None]:
    """The levels and layer depth a run's label names (:func:`xsp.session.leveled_plans.run_label`)."""
    names, _, depth = label.partition("<=")
    levels = parse_levels(names.replace("+", ","))
    return levels, int(depth) if depth else None
