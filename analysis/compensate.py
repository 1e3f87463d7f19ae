"""xsp's own recording cost taken out of a plain trace's durations, in columns of their own."""

from __future__ import annotations

import pandas as pd

from xsp.analysis.model import spans_of
from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.io.trace import Trace
from xsp.table.level_costs import LevelCost, compensation_ns, costs_from_metadata
from xsp.table.walks import parent_positions

COMPENSATED_NS = "compensated_ns"


def compensated(source: Trace, costs: dict[Level, LevelCost] | None = None) -> pd.DataFrame:
    """The span table with xsp's calibrated cost per span taken out, raw times kept.

    Adds ``overhead_ns`` (the cost of recording the span itself and every host span recorded
    below it: layers, operators, model calls) and ``compensated_ns`` (``duration_ns`` less it,
    never below zero). The costs come from ``trace.metadata["calibration"]``
    (``xsp.trace(calibrate=True)``, ``xsp run --calibrate``) unless given.

    Raises:
        ValueError: the trace holds no calibration and none was given.
    """
    spans = spans_of(source).copy()
    found = costs if costs is not None else costs_from_metadata(source.metadata.get("calibration"))
    if not found:
        raise ValueError("this trace has no calibration: record it with xsp.trace(calibrate=True) "
                         "(xsp run --calibrate), or pass costs=")
    taken = compensation_ns(spans, parent_positions(spans), found)
    durations = spans[col.DURATION_NS].to_numpy()
    taken = taken.clip(0, durations)
    spans[col.OVERHEAD_NS] = pd.array(taken, dtype="Int64")
    spans[COMPENSATED_NS] = durations - taken
    return spans
