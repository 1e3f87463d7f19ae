"""``xsp.load``: a trace from any file xsp reads (its own, or a PyTorch profiler trace)."""

from __future__ import annotations

import os

from xsp.errors import TraceFormatError, XspError
from xsp.fileio import read_trace
from xsp.segments import load_unfinished
from xsp.trace import Trace


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace: xsp's ``.xsp.parquet``, or a PyTorch profiler (Kineto) ``.json``/``.json.gz``.

    Where no file exists but a run writing it was killed before it finished, the windows it
    closed are read instead (``metadata["recovered"]`` says so; ``xsp recover`` writes the file).
    Every failure is an :class:`xsp.XspError`.

    Raises:
        xsp.TraceNotFoundError: the file does not exist (also a ``FileNotFoundError``).
        xsp.TraceFormatError: the file is not a trace xsp reads, or is truncated or corrupt.
        xsp.SchemaVersionError: the file was written by a newer xsp.
    """
    from xsp.analysis.kineto import is_kineto_path, load_kineto  # the importer, only when asked for

    try:
        if is_kineto_path(path):
            return load_kineto(path)
        if not os.path.lexists(path):
            unfinished = load_unfinished(path)
            if unfinished is not None:
                return Trace(spans=unfinished[0], metadata=unfinished[1])
        spans, metadata = read_trace(path)
    except XspError:
        raise
    except Exception as exc:  # whatever else a damaged file provokes: still the caller's one error type
        raise TraceFormatError(f"{path} could not be read: {type(exc).__name__}: {exc}") from None
    return Trace(spans=spans, metadata=metadata)
