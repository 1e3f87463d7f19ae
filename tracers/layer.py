"""The layer-level tracer: one span per nn.Module forward call, and per backward."""

from __future__ import annotations

from typing import ClassVar

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.record.window import Window
from xsp.tracers.module_calls.call_context import Mode
from xsp.tracers.module_calls.lifecycle import ModuleCallTracer
from xsp.tracers.module_calls.rows import backward_rows, module_call_rows


class LayerTracer(ModuleCallTracer):
    """Records every nn.Module call below the top-level one, with shapes and module facts.

    While autograd records a graph, each module's backward is recorded as
    ``<module path>.backward`` (the top-level module's as ``predict.backward``).
    """

    name: ClassVar[str] = "layer"
    level: ClassVar[Level] = Level.LAYER
    mode: ClassVar[Mode] = Mode.ALL

    def collect(self, window: Window) -> pd.DataFrame:
        calls = module_call_rows(window)
        frames = []
        if not calls.empty:
            layers = calls[calls[col.CALL_DEPTH] > 0].copy()
            layers[col.LEVEL] = Level.LAYER.value
            layers[col.KIND] = SpanKind.FORWARD.value
            layers = layers.drop(columns=[col.BATCH_SIZE])
            frames.append(layers)
        backward = backward_rows(window)
        if not backward.empty:
            backward[col.LEVEL] = Level.LAYER.value
            backward[col.KIND] = SpanKind.BACKWARD.value
            frames.append(backward)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
