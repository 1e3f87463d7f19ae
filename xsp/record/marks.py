"""Kinds of the model-level records kept as "marks": ``(kind, start, end, name, attributes, error)``.

User spans, explicit and automatic steps, DataLoader waits, optimizer steps, backward
passes, torch.compile compilations and torch.distributed collectives are few per iteration, so they share one record
layout; each kind becomes one :class:`~xsp.core.schema.SpanKind` at the model level.
"""

from __future__ import annotations

import enum
from typing import Final

from xsp.core.schema import SpanKind


class MarkKind(enum.IntEnum):
    USER = 0
    STEP = 1
    INPUT = 2
    OPTIMIZER = 3
    BACKWARD = 4
    COMPILE = 5
    COLLECTIVE = 6
    COLLECTIVE_WAIT = 7


SPAN_KIND_OF_MARK: Final[dict[int, str]] = {
    MarkKind.USER: SpanKind.USER.value,
    MarkKind.STEP: SpanKind.STEP.value,
    MarkKind.INPUT: SpanKind.INPUT.value,
    MarkKind.OPTIMIZER: SpanKind.OPTIMIZER.value,
    MarkKind.BACKWARD: SpanKind.BACKWARD.value,
    MarkKind.COMPILE: SpanKind.COMPILE.value,
    MarkKind.COLLECTIVE: SpanKind.COLLECTIVE.value,
    MarkKind.COLLECTIVE_WAIT: SpanKind.COLLECTIVE_WAIT.value,
}
