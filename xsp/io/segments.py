"""Segments: a session's closed windows on disk while it runs, and the trace file built from them.

A session that writes a file interprets each closed window (about once a second, at a step
boundary) and writes its spans at once as a *segment*: a complete Parquet file in a hidden
folder beside the output (``.NAME.xsp-segments.PID``), written under a temporary name and
renamed, so that every segment present is whole. Memory then holds one window, not the run.

At the session's end the segments are copied, one at a time, into the trace file (one Parquet
row group each) and the folder is removed. If the process dies first (SIGKILL, an OOM kill, a
power cut), the folder stays: :func:`recover` (``xsp recover PATH``) builds the trace file
from it, with a session span closed at the last recorded span and marked as unfinished, and
``xsp.load(PATH)`` reads it directly while no file exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError
from xsp.core.figures import seconds_text
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.lazy import pyarrow_compute as pc
from xsp.core.lazy import pyarrow_parquet as pq
from xsp.core.rank import PART_FILE, next_free_part
from xsp.io.output_claim import forget_dead_claim
from xsp.io.outputs import OutputError, atomic_output
from xsp.io.parquet import (
    arrow_table,
    canonical_table,
    check_span_columns,
    in_start_order,
    pandas_metadata,
    spans_from_arrow,
    write_trace_tables,
    writer_options,
)
from xsp.table.steps import SESSION_NAME

SEGMENT_DIR_INFIX: Final = ".xsp-segments."
START_FILE: Final = "session.json"
FINAL_FILE: Final = "final.json"
"""The finished session's metadata, written when its trace file could not be: recover then
writes the file as the session meant to, not as a killed one."""
SEALING_FILE: Final = "sealing.json"
"""In a segment folder while a part is sealed: the part's path and the windows it holds."""
SEGMENT_PATTERN: Final = "window-*.arrow"
UNFINISHED_MESSAGE: Final = ("the process ended before its session did (a kill, a crash or os._exit: xsp cannot "
                             "tell which); recovered from its closed windows")
UNFINISHED: Final = "ended_before_session"
"""``metadata["interrupted"]`` of a recovered trace: how the process ended is not known."""
LOST_AT_END: Final = "spans of windows no folder could take when the run ended"
SPOOL_ENV: Final = "XSP_SPOOL_DIR"
"""Where windows go when the output's folder cannot take them (default: the system's temporary folder)."""
FOLLOW_POLL_S: Final = 0.01
"""How often :meth:`SegmentWriter.follow` looks for the next window while none is written."""


class WindowsMoved(Exception):
    """A window is not where :meth:`SegmentWriter.follow` reads them (it waits in memory or went
    to the spool), or following was cancelled: the trace is written from :meth:`SegmentWriter.tables`."""


SEGMENT_COMPRESSION: Final = "lz4"
"""Windows are written as Arrow IPC files with LZ4 buffers, their texts as dictionaries, not as
Parquet: they live until the end of the run, which reads them back once into the trace file.
Side by side on an operator window (220k spans): Parquet with LZ4 took 0.54 µs/span to write and
0.32 to read; Arrow IPC 0.11 and 0.09 (36 bytes a span on disk; with zstd 0.21 and 0.10, 13
bytes). A helper process writes a window beside the user's loop, and must keep pace with it."""
SEGMENT_TRAILER: Final = b"XSPW"
"""After a segment's Arrow bytes: this, then the CRC-32 of those bytes (Arrow IPC has no checksum
of its own; Parquet's page checksums covered the windows before)."""


def write_segment(table: pa.Table, path: Path | None) -> None:
    """One window's spans as a segment file at ``path`` (see :data:`SEGMENT_COMPRESSION`; None:
    made in memory only)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=SEGMENT_COMPRESSION)) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    trailer = SEGMENT_TRAILER + zlib.crc32(data).to_bytes(4, "little")
    if path is None:
        return
    with open(path, "wb") as file:
        file.write(data)
        file.write(trailer)


def read_segment(path: Path) -> pa.Table:
    """The spans of a segment file, checked.

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: truncated, damaged (its checksum fails), or not a table of spans.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceNotFoundError(f"no such window: {path}") from None
    except OSError as exc:
        raise TraceFormatError(f"{path} cannot be read: {exc.strerror or exc}") from None
    arrow_bytes = memoryview(data)[:-8]
    if (len(data) < 8 or data[-8:-4] != SEGMENT_TRAILER
            or zlib.crc32(arrow_bytes) != int.from_bytes(data[-4:], "little")):
        raise TraceFormatError(f"{path} is damaged (truncated, or its checksum fails)")
    try:
        table = pa.ipc.open_file(pa.py_buffer(arrow_bytes)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceFormatError(f"{path} is corrupt: {exc}") from None
    check_span_columns(path, table.schema)
    return canonical_table(table)


def segment_name(number: int) -> str:
    return f"window-{number:06d}.arrow"


MEMORY_BOUND_BYTES: Final = 256 << 20
"""Windows kept in memory while the output's folder cannot take them, at most (Arrow bytes);
past it they go to the spool folder."""


def segment_dir(output: Path, pid: int) -> Path:
    """The folder where process ``pid`` keeps the segments of its session writing ``output``."""
    return output.parent / f".{output.name}{SEGMENT_DIR_INFIX}{pid}"


def spool_root() -> Path:
    return Path(os.environ.get(SPOOL_ENV) or tempfile.gettempdir()) / "xsp-spool"


def spool_dir(output: Path, pid: int) -> Path:
    """Where process ``pid`` spools the windows of ``output`` that its own folder cannot take."""
    where = hashlib.sha1(str(output.absolute()).encode()).hexdigest()[:12]
    return spool_root() / f"{where}-{output.name}{SEGMENT_DIR_INFIX}{pid}"


def _pid_of(folder: Path) -> str:
    return folder.name.rsplit(".", 1)[-1]


def unfinished_sessions(output: str | os.PathLike[str]) -> list[list[Path]]:
    """The segment folders left for ``output`` by sessions that never wrote it, newest first:
    per session, its folder beside the output and its spool folder, those that exist."""
    target = Path(output)
    found: list[Path] = []
    for pattern_root, pattern in ((target.parent, f".{target.name}{SEGMENT_DIR_INFIX}*"),
                                  (spool_root(), f"*-{target.name}{SEGMENT_DIR_INFIX}*")):
        try:
            found += [p for p in pattern_root.glob(pattern) if p.is_dir() and _belongs_to(p, target)]
        except OSError:
            continue
    sessions: dict[str, list[Path]] = {}
    for folder in found:
        sessions.setdefault(_pid_of(folder), []).append(folder)
    return sorted(sessions.values(), key=lambda folders: max(_mtime(p) for p in folders), reverse=True)


def unfinished_outputs(folder: Path) -> list[Path]:
    """The trace files that unfinished sessions left windows for in ``folder`` (their hidden
    ``.NAME.xsp-segments.PID`` folders there): ``folder/NAME`` each, in name order."""
    names = set()
    try:
        for child in folder.iterdir():
            name, infix, pid = child.name.rpartition(SEGMENT_DIR_INFIX)
            if infix and name.startswith(".") and pid.isdigit() and child.is_dir():
                names.add(name[1:])
    except OSError:
        return []
    return [folder / name for name in sorted(names)]


def _belongs_to(folder: Path, output: Path) -> bool:
    if folder.parent == output.parent:
        return True
    try:
        recorded = json.loads((folder / START_FILE).read_text()).get("output")
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    return recorded == str(output.absolute())


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def warm_up() -> None:
    """Write one span as a segment and as the trace file are written, in memory: Arrow, its LZ4
    codec and Parquet set up their C++ statics in this process, at a moment of xsp's choosing.

    A forked helper that set one up itself would register its destructor with glibc
    (``__cxa_atexit``) under a lock that ``fork`` copies as it stands: had another thread of
    the program held it at that moment (PyTorch sets up statics of its own at an op's first
    use), the helper would wait for it forever. Helpers forked after this register none."""
    from xsp.table.build import conform  # the table builder: only once a session streams

    row = {col.TRACE_ID: "0" * 32, col.SPAN_ID: 1, col.LEVEL: col.Level.MODEL.value,
           col.KIND: col.SpanKind.SESSION.value, col.NAME: SESSION_NAME, col.START_NS: 0, col.END_NS: 1,
           col.DURATION_NS: 1, col.STATUS: col.Status.OK.value}
    spans = conform(pd.DataFrame([row]))
    table = in_start_order(arrow_table(spans))
    pandas_metadata(table.schema)  # made once per process: a child forked later has it too
    pq.write_table(table, io.BytesIO(), **writer_options(table.schema))  # the trace file, at the end
    write_segment(arrow_table(spans, in_order=True, dictionaries=True), None)


class SegmentWriter:
    """Writes one session's windows as segments (the session builds the trace file from them).

    A window that the output's folder cannot take (a full disk, a quota) is never lost while
    memory holds: it is kept in memory and written at the next window, once the folder takes
    writes again; past :data:`MEMORY_BOUND_BYTES` of such windows they go to a spool folder
    elsewhere (:func:`spool_dir`). Only when that fails too is a window dropped, and counted.
    What happened is said through :meth:`take_notes`, once per change.
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.pid = os.getpid()
        """The session's process (a helper forked to write a window spools under its parent's)."""
        self.directory = segment_dir(output, self.pid)
        self.spool: Path | None = None
        """The spool folder, once windows went there."""
        self.count = 0
        self.started = False
        """True once the session streams its windows (to its folder, memory, or the spool)."""
        self.pending: list[tuple[int, pa.Table]] = []
        """Windows (by number) no folder has taken yet, in order."""
        self.dropped_windows = 0
        self.dropped_spans = 0
        self._start_metadata: dict[str, Any] = {}
        self._notes: list[str] = []
        self._folder_failed = False

    @property
    def degraded(self) -> bool:
        """Windows wait in memory or went to the spool: the output's folder failed."""
        return bool(self.pending) or self.spool is not None

    def start(self, start_metadata: dict[str, Any]) -> None:
        """Create the folder with what a recovery needs to know of the session (where it
        cannot be made, windows go to the spool from the start).

        Raises:
            OSError: neither the folder nor the spool folder can be made.
        """
        self._start_metadata = {**start_metadata, "output": str(self.output.absolute()),
                                PID_NAMESPACE_KEY: pid_namespace()}
        if self._to_a_device():
            self._make(self._spool_folder())
            self.started = True
            return
        try:
            self._make(self.directory)
        except OSError as exc:
            self._make(self._spool_folder())
            self._notes.append(f"windows cannot be written beside the output ({exc}); they go to {self.spool} "
                               f"(`xsp recover {self.output}` finds them there)")
        self.started = True

    def _to_a_device(self) -> bool:
        """The output is a device or a pipe (-o /dev/null): its folder (/dev) is no place for a run's
        windows, which go to the spool."""
        return self.output.exists() and not self.output.is_file()

    def _make(self, folder: Path) -> None:
        if folder.exists():  # a recycled pid's leftovers: they are not this session's
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=folder != self.directory)
        with atomic_output(folder / START_FILE) as temporary:
            temporary.write_text(json.dumps(self._start_metadata, default=str))

    def _spool_folder(self) -> Path:
        if self.spool is None:
            self.spool = spool_dir(self.output, self.pid)
        return self.spool

    def write(self, spans: pd.DataFrame) -> None:
        """Write one window's spans as the next segment, or keep them until a folder takes them.
        Never raises: what could not be kept is counted in :attr:`dropped_windows`."""
        if not len(spans):
            return
        self.count += 1
        self.pending.append((self.count, arrow_table(spans, in_order=True, dictionaries=True)))
        self.flush()

    def keep(self, tables: list[tuple[int, pa.Table]]) -> None:
        """Windows a helper process could not write (and has said so): kept here as the writer's own."""
        self._folder_failed = True
        self.pending.extend(tables)
        self.pending.sort(key=lambda item: item[0])
        self.flush()

    def flush(self) -> None:
        """Write the windows waiting, in order: to the output's folder, else (past the memory
        bound) to the spool; past both, the oldest are dropped and counted."""
        while self.pending:
            number, table = self.pending[0]
            target = self.spool if self.spool is not None else self.directory
            if not self._write(target, number, table):
                break
            self.pending.pop(0)
        if sum(table.nbytes for _, table in self.pending) <= MEMORY_BOUND_BYTES:
            return
        try:
            folder = self._spool_folder()
            if not (folder / START_FILE).exists():
                self._make(folder)
        except OSError as exc:
            self._drop_over_bound(f"the spool folder {self.spool} cannot be made either ({exc})")
            return
        self._notes.append(f"{len(self.pending)} window(s) waiting in memory went to {folder}; windows go there "
                           f"from now on (`xsp recover {self.output}` finds them if the trace file cannot be written)")
        while self.pending:
            number, table = self.pending[0]
            if not self._write(folder, number, table):
                self._drop_over_bound(f"the spool folder {folder} takes no writes either")
                return
            self.pending.pop(0)

    def _write(self, folder: Path, number: int, table: pa.Table) -> bool:
        try:
            with atomic_output(folder / segment_name(number)) as temporary:
                write_segment(table, temporary)
        except OSError as exc:
            if not self._folder_failed:
                self._folder_failed = True
                spool = self.spool or spool_dir(self.output, self.pid)
                self._notes.append(f"windows can no longer be written to {folder} ({exc}); they are kept in "
                                   f"memory (up to {MEMORY_BOUND_BYTES >> 20} MiB), then in {spool}")
            return False
        if self._folder_failed and folder == self.directory:
            self._folder_failed = False
            self._notes.append(f"windows are written to {folder} again")
        return True

    def _drop_over_bound(self, why: str) -> None:
        while self.pending and sum(table.nbytes for _, table in self.pending) > MEMORY_BOUND_BYTES:
            _, table = self.pending.pop(0)
            self.dropped_windows += 1
            self.dropped_spans += len(table)
        self._notes.append(f"{why}: windows past {MEMORY_BOUND_BYTES >> 20} MiB in memory are dropped "
                           f"({self.dropped_windows} so far, counted in the trace)")

    def take_notes(self) -> list[str]:
        notes, self._notes = self._notes, []
        return notes

    def folders(self) -> list[Path]:
        return [folder for folder in (self.directory, self.spool) if folder is not None and folder.is_dir()]

    def tables(self) -> Iterator[pa.Table]:
        """Every window, in order: those in the folders, read one at a time, and those waiting."""
        written = sorted((path.name, path) for folder in self.folders() for path in folder.glob(SEGMENT_PATTERN))
        pending = iter(self.pending)
        waiting = next(pending, None)
        for name, path in written:
            while waiting is not None and segment_name(waiting[0]) < name:
                yield canonical_table(waiting[1])
                waiting = next(pending, None)
            yield read_segment(path)
        while waiting is not None:
            yield canonical_table(waiting[1])
            waiting = next(pending, None)

    def follow(self, done: threading.Event, cancelled: threading.Event) -> Iterator[pa.Table]:
        """Every window in order, each as soon as it is written, until ``done`` is set and every
        window written by then is read: the end of a run writes its trace file while the windows
        still queued are interpreted.

        Raises:
            WindowsMoved: a window is not in the output's folder (it failed: see :attr:`degraded`), or
                ``cancelled`` was set.
        """
        number = 1
        while not cancelled.is_set():
            finished = done.is_set()
            if self.spool is not None or self._folder_failed:  # (windows wait in `pending` only while written)
                raise WindowsMoved(f"windows of {self.output} wait in memory or went to the spool")
            path = self.directory / segment_name(number)
            if number <= self.count and path.is_file():
                yield read_segment(path)
                number += 1
            elif finished:
                if cancelled.is_set():
                    break
                if number > self.count:
                    return
                raise WindowsMoved(f"{path} is missing")
            else:  # none written yet, or the count is ahead of the file being written now
                done.wait(FOLLOW_POLL_S)
        raise WindowsMoved("cancelled")

    def keep_finished(self, metadata: dict[str, Any]) -> list[Path]:
        """The trace file could not be written: put every window still in memory in a folder,
        and the session's final metadata beside them, so that ``xsp recover`` writes the file the
        session meant to. Returns the folders holding the windows."""
        self.flush()
        for folder in (self.directory, self._spool_folder())[self._to_a_device():]:
            try:
                if not (folder / START_FILE).exists():
                    self._make(folder)
                while self.pending and self._write(folder, *self.pending[0]):
                    self.pending.pop(0)
                if not self.pending:
                    break
            except OSError:
                continue
        lost = sum(len(table) for _, table in self.pending)
        if lost:
            self.dropped_windows += len(self.pending)
            self.dropped_spans += lost
            self.pending = []
            dropped = metadata.setdefault("dropped", {})
            dropped[LOST_AT_END] = dropped.get(LOST_AT_END, 0) + lost
        written: list[Path] = []
        for folder in self.folders():
            try:
                with atomic_output(folder / FINAL_FILE) as temporary:
                    temporary.write_text(json.dumps(metadata, default=str))
            except OSError:
                continue
            written.append(folder)
        # the folders that hold windows: one that took none (beside an output on a disk that
        # became read-only) is not said to keep them
        holding = [folder for folder in self.folders() if any(folder.glob(SEGMENT_PATTERN))]
        return holding or written

    def seal(self, path: Path, metadata: dict[str, Any]) -> Path:
        """Write every window so far as the trace file ``path`` (one part of a long session's
        trace) and forget them: the windows after are the next part's.

        Raises:
            OSError: the file could not be written (the windows are all still here).
        """
        self.flush()
        written = sorted((path.name, path) for folder in self.folders() for path in folder.glob(SEGMENT_PATTERN))
        waiting = [table for _, table in self.pending]

        def tables() -> Iterator[pa.Table]:
            for _, segment in written:
                yield read_segment(segment)
            for table in waiting:
                yield canonical_table(table)

        # which windows the part holds, until they are gone: a kill after the part is in place and
        # before its windows are deleted left them to `xsp recover`, which wrote them again
        markers = [folder / SEALING_FILE for folder in self.folders()]
        note = json.dumps({"part": str(path), "segments": [name for name, _ in written]})
        for marker in markers:  # each written whole: a kill leaves none, never half of one
            with atomic_output(marker) as temporary:
                temporary.write_text(note)
        try:
            sealed = write_trace_tables(path, tables(), metadata)
        except BaseException:
            for marker in markers:
                marker.unlink(missing_ok=True)
            raise
        for _, segment in written:
            segment.unlink(missing_ok=True)
        for marker in markers:
            marker.unlink(missing_ok=True)
        self.pending = self.pending[len(waiting):]
        return sealed

    def written_bytes(self) -> int:
        """What the windows written so far take on disk (and in memory, waiting)."""
        on_disk = 0
        for folder in self.folders():
            for segment in folder.glob(SEGMENT_PATTERN):
                try:
                    on_disk += segment.stat().st_size
                except OSError:
                    pass
        return on_disk + sum(table.nbytes for _, table in self.pending)

    def discard(self) -> None:
        for folder in (self.directory, self.spool):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def segment_tables(directory: Path | list[Path], skipped: list[str] | None = None) -> Iterator[pa.Table]:
    """The segments of ``directory`` (or of several folders of one session, merged) in order,
    one at a time; unreadable ones are listed in ``skipped`` (or raise, when it is None)."""
    folders = [directory] if isinstance(directory, Path) else directory
    sealed = already_sealed(folders)
    for _, path in sorted((path.name, path) for folder in folders for path in folder.glob(SEGMENT_PATTERN)
                          if path.name not in sealed):
        try:
            yield read_segment(path)
        except (TraceFormatError, OSError) as exc:
            if skipped is None:
                raise
            skipped.append(f"{path.name}: {exc}")


def already_sealed(folders: list[Path]) -> set[str]:
    """The windows of ``folders`` that a part already holds: a run killed as it sealed the part,
    after the part was in place and before its windows were deleted (:data:`SEALING_FILE`)."""
    names: set[str] = set()
    for folder in folders:
        sealing = _read_json(folder / SEALING_FILE)
        if sealing is None:
            continue
        part, segments = sealing.get("part"), sealing.get("segments")
        if isinstance(part, str) and isinstance(segments, list) and Path(part).is_file():
            names.update(str(name) for name in segments)
    return names


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        metadata = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise TraceFormatError(f"{path} is unreadable: {exc}") from None
    if not isinstance(metadata, dict):
        raise TraceFormatError(f"{path} is not a session's metadata")
    return metadata


def _start_metadata(folders: list[Path]) -> dict[str, Any]:
    for folder in folders:
        metadata = _read_json(folder / START_FILE)
        if metadata is not None:
            return metadata
    raise TraceFormatError(f"{folders[0]} is not a session's segment folder (no {START_FILE})")


def _session_row(metadata: dict[str, Any], last_end_ns: int) -> pa.Table:
    """The session span the ended process never wrote: from its start to its last span's end."""
    ids = metadata.get("session_ids") or {}
    start_ns = int(metadata.get("session_start_ns") or last_end_ns)
    end_ns = max(last_end_ns, start_ns)
    row = {
        col.TRACE_ID: ids.get("trace_id"), col.SPAN_ID: int(ids.get("span_id") or 1),
        col.LEVEL: col.Level.MODEL.value, col.KIND: col.SpanKind.SESSION.value, col.NAME: SESSION_NAME,
        col.START_NS: start_ns, col.END_NS: end_ns, col.DURATION_NS: end_ns - start_ns,
        col.THREAD_ID: metadata.get("session_thread_id"), col.STATUS: col.Status.ERROR.value,
        col.STATUS_MESSAGE: UNFINISHED_MESSAGE,
    }
    from xsp.table.build import conform  # the table builder, only when a session span must be made

    return arrow_table(conform(pd.DataFrame([row])))


def _recovered(folders: list[Path]) -> tuple[list[pa.Table], dict[str, Any]]:
    skipped: list[str] = []
    tables = list(segment_tables(folders, skipped))
    finished = next((metadata for folder in folders if (metadata := _read_json(folder / FINAL_FILE)) is not None),
                    None)
    recovered = {"from": [str(folder) for folder in folders], "windows": len(tables), "unreadable_segments": skipped,
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if finished is not None:  # the session ended and said everything; only its file could not be written
        finished["recovered"] = recovered
        finished.setdefault("warnings", []).append(
            f"written by xsp recover from {len(tables)} windows: the trace file could not be written when the run "
            "ended")
        return tables, finished
    metadata = _start_metadata(folders)
    last_end_ns = max((int(pc.max(t[col.END_NS]).as_py() or 0) for t in tables if len(t)), default=0)
    tables.append(_session_row(metadata, last_end_ns))
    metadata.pop("session_ids", None)
    metadata.pop("output", None)
    metadata["recovered"] = recovered
    metadata["interrupted"] = UNFINISHED
    window_s = metadata.pop("window_s", None)
    windows_lost = ALWAYS_ON_WINDOWS_LOST if metadata.get("sampling") else WINDOWS_LOST
    lost = (f"up to about {seconds_text(windows_lost * window_s)}" if isinstance(window_s, (int, float))
            else "up to about a window")
    metadata.setdefault("warnings", []).append(
        f"recovered from {len(tables) - 1} closed windows: the process ended before the session did; "
        f"the steps of its last window ({lost} before it ended) are missing")
    return tables, metadata


WINDOWS_LOST: Final = 1.0
"""What a killed run loses, in windows: the one open (those waiting to be written are written
together, docs/cli.md)."""
ALWAYS_ON_WINDOWS_LOST: Final = 1.5
"""What a killed always-on run loses, in windows: the one open, and the one closed but waiting
for a pause of its steps (at most half a window) to be written."""


def recovered_path(output: Path) -> Path:
    """Where :func:`recover` writes the windows left for ``output``: ``output`` itself, unless it
    is a part of a trace written in parts that was already sealed (the run's windows all go to its
    first part's folder, and follow its last sealed part): then the part after the last one."""
    if PART_FILE.match(output.name) is not None and output.exists():
        return next_free_part(output)
    return output


def recover(output: str | os.PathLike[str], into: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the trace file of a session that never wrote it from its segments, newest session first.

    Writes ``into`` (default ``output``, or for a part already sealed the part after the last:
    :func:`recovered_path`), removes the session's segment folders (beside the
    output, and in the spool), and returns the path and the file's metadata
    (``metadata["recovered"]`` says from what).

    Raises:
        TraceNotFoundError: no unfinished session wrote ``output``.
        OutputError: the session is still running (:func:`still_running`), or the file could not
            be written (the segments are kept).
    """
    found = unfinished_sessions(output)
    if not found:
        raise TraceNotFoundError(f"no unfinished session to recover for {output}")
    running = still_running(found[0])
    if running is not None:  # its windows are its own: taken, they were lost, and its file overwrote ours
        raise OutputError(f"the run writing {output} (process {running}) is still running: it writes the file "
                          "itself when it ends; xsp recover is for a run that was killed")
    tables, metadata = _recovered(found[0])
    target = Path(into) if into is not None else recovered_path(Path(output))
    found_part = PART_FILE.match(target.name)
    if found_part is not None:
        metadata["part"] = {"index": int(found_part.group(1)), "last": True}
    written = write_trace_tables(target, iter(tables), metadata)
    for folder in found[0]:
        shutil.rmtree(folder, ignore_errors=True)
    killed = _pid_of(found[0][0])
    if killed.isdigit():  # a file it was writing as it was killed (a part being sealed): never to be finished
        for leftover in target.parent.glob(f".*.{killed}.*.partial"):
            leftover.unlink(missing_ok=True)
    forget_dead_claim(Path(output))  # the killed run's claim on its name: nobody holds it now
    return written, metadata


PID_NAMESPACE_KEY: Final = "pid_namespace"


def pid_namespace() -> int | None:
    """This process's PID namespace (its inode; None where there is no telling): a process id
    means the same process only inside one (a container's PID 1 is not the machine's)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def killed_run_left(output: Path) -> bool:
    """Whether a run that no longer runs left windows for ``output`` (``xsp recover`` writes them there)."""
    return any(still_running(folders) is None for folders in unfinished_sessions(output))


def still_running(folders: list[Path]) -> int | None:
    """The process id of the session that left ``folders`` (one session's segment folders) where it
    still runs on this machine; None where it has ended, its id now being another process's (one
    started after the session), or it ran on another machine or in another PID namespace (another
    container's: neither can be asked)."""
    pid = _pid_of(folders[0])
    if not pid.isdigit() or int(pid) == os.getpid():
        return None
    started_ns = None
    for folder in folders:
        try:
            facts = json.loads((folder / START_FILE).read_text())
        except (OSError, ValueError, AttributeError, RecursionError):
            continue
        if isinstance(facts.get("host"), str) and facts["host"] != socket.gethostname():
            return None
        namespace = facts.get(PID_NAMESPACE_KEY)
        if isinstance(namespace, int) and namespace != pid_namespace():
            return None
        if isinstance(facts.get("session_start_ns"), int):
            started_ns = facts["session_start_ns"]
    import psutil

    try:
        created_s = psutil.Process(int(pid)).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # another user's process: alive
        return int(pid)
    if started_ns is not None and created_s > started_ns / 1e9 + 1:  # the id was given to a later process
        return None
    return int(pid)


def unsealed_windows(first_part: Path) -> tuple[pd.DataFrame, dict[str, Any], int | None] | None:
    """The windows of a run in parts written after its last sealed part (they all wait beside its
    first part), their metadata, and the process that writes them where it still runs (else the
    run was killed before its last part); None where there are none."""
    found = unfinished_sessions(first_part)
    if not found:
        return None
    sealed = already_sealed(found[0])
    if not any(path.name not in sealed for folder in found[0] for path in folder.glob(SEGMENT_PATTERN)):
        return None
    tables, metadata = _recovered(found[0])
    return spans_from_arrow(found[0][0], pa.concat_tables(tables)), metadata, still_running(found[0])


def load_unfinished(output: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]] | None:
    """The spans and metadata of the newest unfinished session that wrote ``output`` (None if none)."""
    found = unfinished_sessions(output)
    if not found:
        return None
    tables, metadata = _recovered(found[0])
    return spans_from_arrow(found[0][0], pa.concat_tables(tables)), metadata
