"""The lifecycle the model and layer tracers share: both record through the interceptor."""

from __future__ import annotations

from typing import ClassVar

from xsp.core.schema import Level
from xsp.record.recording import Recording
from xsp.record.window import Window
from xsp.tracers.base import Tracer
from xsp.tracers.module_calls.call_context import Mode
from xsp.tracers.module_calls.interceptor import INTERCEPTOR
from xsp.tracers.module_calls.rows import remember_module_facts


class ModuleCallTracer(Tracer):
    """A tracer that records ``nn.Module`` calls in at least ``mode``."""

    name: ClassVar[str]
    level: ClassVar[Level]
    mode: ClassVar[Mode]
    interprets_in_child = True
    """``collect`` reads only the window and the modules it names: a forked child can run it."""

    def available(self) -> str | None:
        return None

    def start(self, recording: Recording) -> None:
        INTERCEPTOR.acquire(self.name, recording, self.mode)

    def stop(self) -> None:
        INTERCEPTOR.release(self.name)

    def prepare(self, window: Window) -> None:
        """In the session's process: the facts of the window's modules (parameters, class) worked
        out once for the whole run, before a helper forked for the window needs them."""
        remember_module_facts(window)
