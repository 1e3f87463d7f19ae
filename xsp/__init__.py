"""xsp: across-stack profiling of PyTorch models.

``with xsp.trace():`` around inference or training code records the model, layer (and,
where tracers exist, operator, CUDA API and kernel) levels as one span tree, writes it to a
``.xsp.parquet`` file and optionally sends it to an OpenTelemetry collector such as Jaeger.
"""

from xsp import analysis
from xsp._version import __version__
from xsp.baseline import Summary, summarize
from xsp.diff import Diff, diff
from xsp.errors import SchemaVersionError, TraceFormatError, TraceNotFoundError, UnknownLevelError, XspError
from xsp.leveled import LeveledResult, leveled
from xsp.loading import load
from xsp.schedule import Schedule, ScheduleError
from xsp.schema import Level, SpanKind, Status
from xsp.session import Session, XspWarning, trace
from xsp.trace import Trace
from xsp.user_spans import span, step

__all__ = [
    "__version__", "analysis", "trace", "span", "step", "load", "Trace", "Session", "Level", "SpanKind",
    "Status", "leveled", "LeveledResult", "XspError", "XspWarning", "UnknownLevelError", "TraceFormatError",
    "TraceNotFoundError", "Schedule", "ScheduleError",
    "SchemaVersionError", "diff", "Diff", "Summary", "summarize",
]
