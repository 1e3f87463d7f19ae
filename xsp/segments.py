"""Segments: a session's closed windows on disk while it runs, and the trace file built from them.

A session that writes a file interprets each closed window (about once a second, at a step
boundary) and writes its spans at once as a *segment*: a complete Parquet file in a hidden
folder beside the output (``.NAME.xsp-segments.PID``), written under a temporary name and
renamed, so that every segment present is whole. Memory then holds one window, not the run.

At the session's end the segments are copied, one at a time, into the trace file (one Parquet
row group each) and the folder is removed. If the process dies first (SIGKILL, an OOM kill, a
power cut), the folder stays: :func:`recover` (``xsp recover PATH``) builds the trace file
from it, with a session span closed at the last recorded span and marked as killed, and
``xsp.load(PATH)`` reads it directly while no file exists.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from xsp import schema as col
from xsp.errors import TraceFormatError, TraceNotFoundError
from xsp.fileio import (
    arrow_table,
    atomic_output,
    in_start_order,
    read_arrow_trace,
    spans_from_arrow,
    write_trace_tables,
)
from xsp.structure import SESSION_NAME

SEGMENT_DIR_INFIX: Final = ".xsp-segments."
START_FILE: Final = "session.json"
SEGMENT_PATTERN: Final = "window-*.parquet"
KILLED_MESSAGE: Final = "the process ended before the session did (killed?); recovered from its closed windows"


def segment_dir(output: Path, pid: int) -> Path:
    """The folder where process ``pid`` keeps the segments of its session writing ``output``."""
    return output.parent / f".{output.name}{SEGMENT_DIR_INFIX}{pid}"


def unfinished_sessions(output: str | os.PathLike[str]) -> list[Path]:
    """Segment folders left for ``output`` by sessions that never finished, newest first."""
    target = Path(output)
    try:
        found = [p for p in target.parent.glob(f".{target.name}{SEGMENT_DIR_INFIX}*") if p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


class SegmentWriter:
    """Writes one session's windows as segments (the session builds the trace file from them)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self.directory = segment_dir(output, os.getpid())
        self.count = 0
        self.started = False
        """True once the folder exists: windows are written to it."""

    def start(self, start_metadata: dict[str, Any]) -> None:
        """Create the folder with what a recovery needs to know of the session.

        Raises:
            OSError: the folder cannot be made or written.
        """
        if self.directory.exists():  # a recycled pid's leftovers: they are not this session's
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir()
        with atomic_output(self.directory / START_FILE) as temporary:
            temporary.write_text(json.dumps(start_metadata, default=str))
        self.started = True

    def write(self, spans: pd.DataFrame) -> None:
        """Write one window's spans as the next segment (whole, or not at all)."""
        if not len(spans):
            return
        table = in_start_order(arrow_table(spans))
        self.count += 1
        with atomic_output(self.directory / f"window-{self.count:06d}.parquet") as temporary:
            pq.write_table(table, temporary, compression="zstd", write_page_checksum=True)

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def segment_tables(directory: Path, skipped: list[str] | None = None) -> Iterator[pa.Table]:
    """The segments of ``directory`` in order, one at a time; unreadable ones are listed in
    ``skipped`` (or raise, when it is None)."""
    for path in sorted(directory.glob(SEGMENT_PATTERN)):
        try:
            yield read_arrow_trace(path)
        except (TraceFormatError, OSError) as exc:
            if skipped is None:
                raise
            skipped.append(f"{path.name}: {exc}")


def _start_metadata(directory: Path) -> dict[str, Any]:
    try:
        metadata = json.loads((directory / START_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise TraceFormatError(f"{directory} is not a session's segment folder: {exc}") from None
    if not isinstance(metadata, dict):
        raise TraceFormatError(f"{directory} is not a session's segment folder")
    return metadata


def _session_row(metadata: dict[str, Any], last_end_ns: int) -> pa.Table:
    """The session span the killed process never wrote: from its start to its last span's end."""
    ids = metadata.get("session_ids") or {}
    start_ns = int(metadata.get("session_start_ns") or last_end_ns)
    end_ns = max(last_end_ns, start_ns)
    row = {
        col.TRACE_ID: ids.get("trace_id"), col.SPAN_ID: int(ids.get("span_id") or 1),
        col.LEVEL: col.Level.MODEL.value, col.KIND: col.SpanKind.SESSION.value, col.NAME: SESSION_NAME,
        col.START_NS: start_ns, col.END_NS: end_ns, col.DURATION_NS: end_ns - start_ns,
        col.THREAD_ID: metadata.get("session_thread_id"), col.STATUS: col.Status.ERROR.value,
        col.STATUS_MESSAGE: KILLED_MESSAGE,
    }
    from xsp.spans import conform  # the table builder, only when a session span must be made

    return arrow_table(conform(pd.DataFrame([row])))


def _recovered(directory: Path) -> tuple[list[pa.Table], dict[str, Any]]:
    metadata = _start_metadata(directory)
    skipped: list[str] = []
    tables = list(segment_tables(directory, skipped))
    last_end_ns = max((int(pc.max(t[col.END_NS]).as_py() or 0) for t in tables if len(t)), default=0)
    tables.append(_session_row(metadata, last_end_ns))
    metadata.pop("session_ids", None)
    metadata["recovered"] = {"from": str(directory), "windows": len(tables) - 1, "unreadable_segments": skipped,
                             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    metadata["interrupted"] = "killed"
    metadata.setdefault("warnings", []).append(
        f"recovered from {len(tables) - 1} closed windows: the process ended before the session did; "
        "spans of its last second or so are missing")
    return tables, metadata


def recover(output: str | os.PathLike[str], into: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the trace file of a session that never finished from its segments, newest session first.

    Writes ``into`` (default ``output``), removes the segment folder, and returns the path and
    the file's metadata (``metadata["recovered"]`` says from what).

    Raises:
        TraceNotFoundError: no unfinished session wrote ``output``.
        OutputError: the file could not be written (the segments are kept).
    """
    found = unfinished_sessions(output)
    if not found:
        raise TraceNotFoundError(f"no unfinished session to recover for {output}")
    tables, metadata = _recovered(found[0])
    written = write_trace_tables(Path(into) if into is not None else Path(output), iter(tables), metadata)
    shutil.rmtree(found[0], ignore_errors=True)
    return written, metadata


def load_unfinished(output: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]] | None:
    """The spans and metadata of the newest unfinished session that wrote ``output`` (None if none)."""
    found = unfinished_sessions(output)
    if not found:
        return None
    tables, metadata = _recovered(found[0])
    return spans_from_arrow(found[0], pa.concat_tables(tables)), metadata
