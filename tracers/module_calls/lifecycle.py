"""The lifecycle the model and layer tracers share: both record through the interceptor."""

from __future__ import annotations

from typing import ClassVar

from xsp.core.schema import Level
from xsp.record.recording import Recording
from xsp.tracers.module_calls.call_context import Mode
from xsp.tracers.module_calls.interceptor import INTERCEPTOR


class ModuleCallTracer:
    """A tracer that records ``nn.Module`` calls in at least ``mode``."""

    name: ClassVar[str]
    level: ClassVar[Level]
    mode: ClassVar[Mode]
    interprets_in_child: ClassVar[bool] = True
    """``collect`` reads only the window and the modules it names: a forked child can run it."""

    def available(self) -> str | None:
        return None

    def start(self, recording: Recording) -> None:
        INTERCEPTOR.acquire(self.name, recording, self.mode)

    def stop(self) -> None:
        INTERCEPTOR.release(self.name)
