"""The user's current line on every thread (xsp/record/_lines/lines.c): what
:mod:`xsp.record.operator_lines` loads where the extension is built."""

from typing import Any

class LineTracer:
    """The user's current line on every thread, as it changes, while installed."""

    refused: int
    """Threads left alone: another tool's trace function was there."""
    installed: bool
    def __init__(self, sites: Any, max_changes: int = ..., on_thread: Any = ...) -> None: ...
    def install(self) -> None: ...
    def on_new_thread(self, *args: Any) -> None: ...
    def uninstall(self) -> None: ...
    def take(self) -> list[tuple[int, bytes, int]]: ...
    def take_before(self, cut_ns: int) -> list[tuple[int, bytes, int]]: ...

def traced_here() -> bool:
    """Whether this thread's trace function is a LineTracer's."""
