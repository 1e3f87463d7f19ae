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
from typing import TYPE_CHECKING, Any

from xsp._version import __version__
from xsp.core.errors import (
    SchemaVersionError,
    TraceFormatError,
    TraceNotFoundError,
    TraceTooLargeError,
    UnknownLevelError,
    XspError,
    XspWarning,
)
from xsp.core.schema import Level, SpanKind, Status
from xsp.record.schedule import Schedule, ScheduleError

if TYPE_CHECKING:
    import xsp.analysis as analysis
    from xsp.core import schema
    from xsp.gate.baseline import Summary, summarize
    from xsp.gate.diff import Diff, diff
    from xsp.io.jaeger_query import pull
    from xsp.io.loading import load
    from xsp.io.trace import Trace
    from xsp.record.user_spans import span, step
    from xsp.session.leveled import leveled
    from xsp.session.leveled_merge import LeveledResult
    from xsp.session.session import Session
    from xsp.session.tracing import trace

_LAZY = {
    # pandas and pyarrow: when a trace is read (``xsp --help`` reads none)
    "load": ("xsp.io.loading", "load"), "Trace": ("xsp.io.trace", "Trace"),
    "pull": ("xsp.io.jaeger_query", "pull"),
    # recording imports torch: only when a session is asked for (reading a trace never does)
    "trace": ("xsp.session.tracing", "trace"), "Session": ("xsp.session.session", "Session"),
    "span": ("xsp.record.user_spans", "span"), "step": ("xsp.record.user_spans", "step"),
    "analysis": ("xsp.analysis", None),
    # the span table's column names and enums: ``from xsp import schema as col``
    "schema": ("xsp.core.schema", None),
    "Summary": ("xsp.gate.baseline", "Summary"), "summarize": ("xsp.gate.baseline", "summarize"),
    "Diff": ("xsp.gate.diff", "Diff"), "diff": ("xsp.gate.diff", "diff"),
    "LeveledResult": ("xsp.session.leveled_merge", "LeveledResult"), "leveled": ("xsp.session.leveled", "leveled"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'xsp' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = [
    "__version__", "analysis", "schema", "trace", "span", "step", "load", "pull", "Trace", "Session", "Level",
    "SpanKind",
    "Status", "leveled", "LeveledResult", "XspError", "XspWarning", "UnknownLevelError", "TraceFormatError",
    "TraceNotFoundError", "TraceTooLargeError", "Schedule", "ScheduleError",
    "SchemaVersionError", "diff", "Diff", "Summary", "summarize",
]
