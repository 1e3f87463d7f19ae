"""``xsp.load``: a trace from any file xsp reads (its own, or a PyTorch profiler trace)."""

from __future__ import annotations

import os

from xsp.fileio import read_trace
from xsp.trace import Trace


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace: xsp's ``.xsp.parquet``, or a PyTorch profiler (Kineto) ``.json``/``.json.gz``.

    Raises:
        FileNotFoundError: the file does not exist.
        xsp.TraceFormatError: the file is not a trace xsp reads, or is truncated or corrupt.
        xsp.SchemaVersionError: the file was written by a newer xsp.
    """
    from xsp.analysis.kineto import is_kineto_path, load_kineto  # the importer, only when asked for

    if is_kineto_path(path):
        return load_kineto(path)
    spans, metadata = read_trace(path)
    return Trace(spans=spans, metadata=metadata)
