"""xsp: across-stack profiling of PyTorch models.

``with xsp.trace():`` around inference or training code records the model, layer (and,
where tracers exist, operator, CUDA API and kernel) levels as one span tree, writes it to a
``.xsp.parquet`` file and optionally sends it to an OpenTelemetry collector such as Jaeger.

The analyses, diffs, summaries and leveled experiments are imported when first used, so that
starting a session (every rank of a distributed job does) does not pay for scipy and the
analysis package.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from xsp._version import __version__
from xsp.errors import SchemaVersionError, TraceFormatError, TraceNotFoundError, UnknownLevelError, XspError, XspWarning
from xsp.schedule import Schedule, ScheduleError
from xsp.schema import Level, SpanKind, Status

if TYPE_CHECKING:
    from xsp import analysis
    from xsp.baseline import Summary, summarize
    from xsp.diff import Diff, diff
    from xsp.leveled import LeveledResult, leveled
    from xsp.loading import load
    from xsp.session import Session, trace
    from xsp.trace import Trace
    from xsp.user_spans import span, step

_LAZY = {
    # pandas and pyarrow: when a trace is read (``xsp --help`` reads none)
    "load": ("xsp.loading", "load"), "Trace": ("xsp.trace", "Trace"),
    # recording imports torch: only when a session is asked for (reading a trace never does)
    "trace": ("xsp.session", "trace"), "Session": ("xsp.session", "Session"),
    "span": ("xsp.user_spans", "span"), "step": ("xsp.user_spans", "step"),
    "analysis": ("xsp.analysis", None),
    "Summary": ("xsp.baseline", "Summary"), "summarize": ("xsp.baseline", "summarize"),
    "Diff": ("xsp.diff", "Diff"), "diff": ("xsp.diff", "diff"),
    "LeveledResult": ("xsp.leveled", "LeveledResult"), "leveled": ("xsp.leveled", "leveled"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'xsp' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``xsp.trace``, ``xsp.diff`` and ``xsp.leveled`` are functions, although modules of the
    same names exist: importing those modules (``from xsp.trace import Trace``) must not put the
    module in the function's place, as the import system would."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("trace", "diff", "leveled") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "__version__", "analysis", "trace", "span", "step", "load", "Trace", "Session", "Level", "SpanKind",
    "Status", "leveled", "LeveledResult", "XspError", "XspWarning", "UnknownLevelError", "TraceFormatError",
    "TraceNotFoundError", "Schedule", "ScheduleError",
    "SchemaVersionError", "diff", "Diff", "Summary", "summarize",
]
