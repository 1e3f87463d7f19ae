"""The model-level tracer: predict calls, user spans and explicit steps."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pandas as pd
from xsp.tracers._module_calls import Mode
from xsp.tracers._module_rows import as_numpy, module_call_rows
from xsp.tracers._module_tracer import ModuleCallTracer

from xsp import schema as col
from xsp.recording import MARK_STEP, Window
from xsp.schema import Level, SpanKind, Status


class ModelTracer(ModuleCallTracer):
    """Records each call of a top-level nn.Module as a ``predict`` span, plus user spans."""

    name: ClassVar[str] = "model"
    level: ClassVar[Level] = Level.MODEL
    mode: ClassVar[Mode] = Mode.ROOTS

    def collect(self, window: Window) -> pd.DataFrame:
        return pd.concat([_predict_rows(window), mark_rows(window)], ignore_index=True)


def _predict_rows(window: Window) -> pd.DataFrame:
    calls = module_call_rows(window)
    if calls.empty:
        return calls
    roots = calls[calls[col.CALL_DEPTH] == 0].copy()
    roots[col.LEVEL] = Level.MODEL.value
    roots[col.KIND] = SpanKind.PREDICT.value
    return roots


def _attributes_json(attributes: dict[str, Any] | None) -> str | None:
    if not attributes:
        return None
    return json.dumps({key: _attribute_value(value) for key, value in attributes.items()})


def _attribute_value(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float)) for v in value):
        return list(value)
    return str(value)


def mark_rows(window: Window) -> pd.DataFrame:
    """User spans and explicit steps of every thread."""
    frames = []
    for buffer in window.buffers:
        cols = buffer.mark_columns
        if not len(cols):
            continue
        errors = [buffer.string(i) for i in as_numpy(cols.error).tolist()]
        frames.append(pd.DataFrame({
            col.START_NS: as_numpy(cols.start),
            col.END_NS: as_numpy(cols.end),
            col.THREAD_ID: buffer.thread_id,
            col.LEVEL: Level.MODEL.value,
            col.KIND: [SpanKind.STEP.value if k == MARK_STEP else SpanKind.USER.value
                       for k in as_numpy(cols.kind).tolist()],
            col.NAME: [buffer.strings.values[i] for i in as_numpy(cols.name).tolist()],
            col.ATTRIBUTES: [_attributes_json(a) for a in cols.attributes],
            col.STATUS: [Status.OK.value if e is None else Status.ERROR.value for e in errors],
            col.STATUS_MESSAGE: errors,
        }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
