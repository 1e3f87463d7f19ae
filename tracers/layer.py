"""The layer-level tracer: one span per nn.Module forward call, and per backward."""

from __future__ import annotations

from typing import ClassVar

import pandas as pd
from xsp.tracers._module_calls import INTERCEPTOR, Mode
from xsp.tracers._module_rows import backward_rows, module_call_rows

from xsp import schema as col
from xsp.recording import Recording
from xsp.schema import Level, SpanKind


class LayerTracer:
    """Records every nn.Module call below the top-level one, with shapes and module facts.

    While autograd records a graph, each module's backward is recorded as
    ``<module path>.backward`` (the top-level module's as ``predict.backward``).
    """

    name: ClassVar[str] = "layer"
    level: ClassVar[Level] = Level.LAYER

    def __init__(self) -> None:
        self._recording: Recording | None = None

    def available(self) -> str | None:
        return None

    def start(self, recording: Recording) -> None:
        self._recording = recording
        INTERCEPTOR.acquire(self.name, recording, Mode.ALL)

    def stop(self) -> None:
        INTERCEPTOR.release(self.name)

    def collect(self) -> pd.DataFrame:
        assert self._recording is not None
        calls = module_call_rows(self._recording)
        frames = []
        if not calls.empty:
            layers = calls[calls[col.CALL_DEPTH] > 0].copy()
            layers[col.LEVEL] = Level.LAYER.value
            layers[col.KIND] = SpanKind.FORWARD.value
            layers = layers.drop(columns=[col.BATCH_SIZE])
            frames.append(layers)
        backward = backward_rows(self._recording)
        if not backward.empty:
            backward[col.LEVEL] = Level.LAYER.value
            backward[col.KIND] = SpanKind.BACKWARD.value
            frames.append(backward)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
