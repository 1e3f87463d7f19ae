"""Taking xsp's own recording cost out of span durations.

:mod:`xsp.session.calibration` measures, per level, what recording one span costs (:class:`LevelCost`);
:func:`compensation_ns` turns those costs into the time to take out of each span: its own
``inside_ns``, and ``parent_ns`` for every recorded span below it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import sum_into_ancestors

COMPENSATED_KINDS: Final = frozenset({SpanKind.PREDICT.value, SpanKind.FORWARD.value, SpanKind.BACKWARD.value,
                                      SpanKind.OPERATOR.value})
"""Kinds whose own recording costs what calibration measures (a step or user span costs less)."""


@dataclass(frozen=True)
class LevelCost:
    """The calibrated cost of recording one span of a level, in nanoseconds."""

    level: str
    inside_ns: float
    """What falls inside the span it records (the hook work between its two clock readings)."""
    parent_ns: float
    """What one recorded span adds to its parent's duration (inside and outside it)."""
    events: int
    """Spans recorded to measure it."""
    nested_ns: float = 0.0
    """What a module call inside one of its spans costs when the layer level is not recorded
    (the model level's wrapper lets nested calls pass through, but not for free)."""
    untimed_ns: float = 0.0
    """What a caller pays for a call of the level beyond the span's duration, untraced: the
    Python call into ``nn.Module.__call__`` and back, before the first clock reading and after
    the last, which no span can time (given back to each span, so that a layer's figure is what
    calling it costs; its ``inside_ns`` is then 0, since only the difference shows)."""

    fastest: bool = False
    """Measured where the machine ran fastest during calibration (its fastest steps' speed),
    not at its typical speed: a figure taken at another speed scales it (:meth:`scaled`)."""

    def scaled(self, factor: float) -> LevelCost:
        """The same costs on a machine running ``factor`` times slower."""
        return replace(self, inside_ns=self.inside_ns * factor, parent_ns=self.parent_ns * factor,
                       nested_ns=self.nested_ns * factor, untimed_ns=self.untimed_ns * factor)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def costs_from_metadata(found: dict[str, Any] | None) -> dict[Level, LevelCost]:
    """The costs a trace's metadata holds (``{"layer": {"inside_ns": ...}, ...}``)."""
    return {Level(level): LevelCost(**cost) for level, cost in (found or {}).items()}


def compensation_ns(spans: pd.DataFrame, parents: np.ndarray, costs: dict[Level, LevelCost],
                    own_run: np.ndarray | None = None, same_level_only: bool = False,
                    own_only: np.ndarray | None = None) -> np.ndarray:
    """Per span, the calibrated cost of recording it and what was recorded below it.

    A span of a calibrated level loses its ``inside_ns`` and gains its ``untimed_ns`` (for
    kinds whose recording it is: model calls, layers, operators); every span loses
    ``parent_ns`` of each level for every span of that level below it, or, with
    ``same_level_only`` (a leveled figure, from a run that recorded nothing deeper than its own
    level), only for spans of its own level, and then also ``nested_ns`` for each module call
    (layer span of the merged tree) below it. Zero where ``own_run`` is false (a figure that did
    not come from its own run). Where ``own_only`` is true (a figure from a run that recorded
    nothing below it at all: a layer level run one module depth at a time), only the span's
    own ``inside_ns`` and ``untimed_ns`` count, nothing for what lies below it.
    """
    taken = np.zeros(len(spans))  # for what lies below each span first, then its own
    if not costs or not len(spans):
        return taken.astype(np.int64)
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    recorded = np.isin(spans[col.KIND].to_numpy(dtype=object), list(COMPENSATED_KINDS))
    for level, cost in costs.items():
        mine = levels == level.value
        if not mine.any():
            continue
        (below,) = sum_into_ancestors(parents, np.flatnonzero(mine & recorded), np.ones(len(spans)),
                                      only=mine if same_level_only else None)
        taken += below * cost.parent_ns
        if same_level_only and cost.nested_ns:  # its run recorded no layers: each nested call passed through
            layers = np.flatnonzero((levels == Level.LAYER.value) & recorded)
            (nested,) = sum_into_ancestors(parents, layers, np.ones(len(spans)), only=mine)
            taken += nested * cost.nested_ns
    if own_only is not None:
        taken = np.where(own_only, 0.0, taken)
    for level, cost in costs.items():
        taken[(levels == level.value) & recorded] += cost.inside_ns - cost.untimed_ns
    if own_run is not None:
        taken = np.where(own_run, taken, 0.0)
    return np.round(taken).astype(np.int64)
