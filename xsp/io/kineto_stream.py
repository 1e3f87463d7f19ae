"""Importing a PyTorch profiler (Kineto) trace of any size in bounded memory (``xsp import``).

The in-memory import (:func:`xsp.io.kineto.load_kineto`) holds a trace's events and spans whole:
about 400 B an event, 16 GB for a 10 GB trace. This one holds a window of them at a time:

1. The C scanner reads the file once, piece by piece (gzip inflated as it goes), into raw event
   tables written to scratch files beside the output (Arrow IPC; the columns that cut the trace
   also as one Parquet file).
2. DuckDB, under a memory limit (it spills to disk past it), finds the times where the trace can
   be cut: where every host span that started earlier has ended, so that no span's parent by
   inclusion lies across the cut. It cuts at the first such time past every ``window_events``
   events (never between two launches that carry one correlation id), and gives each GPU activity
   the window of its launch (the CUDA call with its correlation id). The raw events are then
   sorted into their windows' files.
3. Each window becomes span rows and its tree exactly as the in-memory import makes them, the
   steps carried from window to window (each thread's latest step, the step numbers), and is
   written as row groups of the trace file as it comes. A window's rows that start after the
   next window begins (kernels that ran after their launch's window ended) wait for it, so that
   the file is in start order.

A window holds whole steps, since nothing can be cut inside one: memory is bounded by the largest
step (about 400 B an event of it), not by the trace. :class:`KinetoImport` says how large the
largest window was.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import duckdb  # loaded with this module: an extension interrupted as it loads aborts the process
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, duckdb_interrupts, first_line
from xsp.core.memory_release import release_freed_memory
from xsp.core.schema import Level
from xsp.io.kineto import (
    CATEGORIES,
    CATEGORY_NAMES,
    DEVICE_CATEGORIES,
    LAUNCH_LINKED,
    imported_metadata,
    kineto_rows,
    load_kineto,
    microseconds_to_ns,
    unreadable_as_format_error,
)
from xsp.io.kineto_events import FILE_ORDER, MISSING, EventScan, LeftToMsgspec, events_from_table
from xsp.io.kineto_json import collector_paused
from xsp.io.loading import with_rank
from xsp.io.memory_needed import check_fits, kineto_memory_bytes
from xsp.io.outputs import OutputError, describe_os_error, destination
from xsp.io.parquet import arrow_table, in_start_order, write_trace_tables
from xsp.io.trace import Trace
from xsp.table.build import build_table, new_step_state
from xsp.table.validation import LATEST_NS

WINDOW_EVENTS: Final = 1 << 17
"""How many events a window holds, about (more where the trace cannot be cut sooner)."""
RAW_ROWS: Final = 1 << 19
"""How many events the scanner hands over at a time."""
DUCKDB_MEMORY_MB: Final = 512
"""DuckDB's memory limit while it cuts the trace into windows (past it, it spills to disk)."""
CUT_MARGIN_US: Final = 0.002
"""A cut lies this far (2 ns) past the latest end before it: microseconds become nanoseconds
by rounding, and a span ending at a cut's nanosecond could still enclose one starting there."""

_DEVICE_CODES = [i for i, name in enumerate(CATEGORY_NAMES) if name in DEVICE_CATEGORIES]
_LAUNCH_CODES = [i for i, name in enumerate(CATEGORY_NAMES)
                 if CATEGORIES[name][0] is Level.CUDA_API and name in LAUNCH_LINKED]
_WINDOW = "xsp_window"


@dataclass
class KinetoImport:
    """What :func:`import_kineto` wrote."""

    path: Path
    spans: int
    steps: int
    metadata: dict[str, Any]
    events: int | None
    """The events the file holds, of every phase (None where it was read whole)."""
    windows: int
    largest_window_events: int | None
    """The most events one window held (None where the file was read whole)."""
    read_whole_because: str | None = None
    """Why the file was read whole, not a window at a time (it holds what only msgspec's reader
    reads, or the C scanner is not built); None where it was not."""

    @property
    def bounded(self) -> bool:
        """Whether it was read a window at a time."""
        return self.read_whole_because is None


@dataclass
class _Totals:
    """What the windows found, summed as they go, for the file's metadata."""

    hierarchy: Counter[str] = field(default_factory=Counter)
    not_imported: Counter[str] = field(default_factory=Counter)
    levels: set[str] = field(default_factory=set)
    threads: dict[str, str] = field(default_factory=dict)
    spans: int = 0
    steps: set[int] = field(default_factory=set)
    metadata: dict[str, Any] = field(default_factory=dict)


NARROW_COLUMNS: Final = ("category", "ts", "dur", "correlation", FILE_ORDER)
"""The raw events' columns that cutting the trace reads (DuckDB reads these only)."""
OPEN_WINDOW_FILES: Final = 128
"""At most this many windows' files are open at a time while the events are sorted into them."""


@dataclass
class _Raw:
    """The raw events in scratch files: each table the scanner gave as an Arrow IPC file (its
    texts' dictionaries its own), and the columns that cut the trace as one Parquet file."""

    folder: Path
    tables: list[Path] = field(default_factory=list)
    narrow: Path | None = None
    schema: pa.Schema | None = None


@dataclass
class _Windows:
    """The windows' raw events (Arrow IPC streams, a few per window), and the first start of each
    (microseconds, as recorded)."""

    schema: pa.Schema
    """The raw events' columns (an empty window has them too)."""
    files: dict[int, list[Path]] = field(default_factory=dict)
    first_start_us: dict[int, float] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)

    def numbers(self) -> list[int]:
        """The windows in order of time; a trace with no events has one, empty."""
        return sorted(self.files) or [0]

    def read(self, number: int) -> pa.Table:
        """The window's raw events, in file order (its files removed once read)."""
        parts = [self.schema.empty_table()]
        for path in self.files.pop(number, []):
            with pa.OSFile(str(path)) as file:
                parts.append(pa.ipc.open_stream(file).read_all())
            path.unlink()
        table = pa.concat_tables(parts).unify_dictionaries().combine_chunks()
        return table.take(pc.sort_indices(table[FILE_ORDER]))


def import_kineto(source: str | os.PathLike[str], output: str | os.PathLike[str],
                  window_events: int = WINDOW_EVENTS, memory_mb: int = DUCKDB_MEMORY_MB) -> KinetoImport:
    """Import a Kineto trace into ``output`` (``.xsp.parquet``) a window at a time: the same spans,
    tree and metadata as ``xsp.load(source).save(output)``, in memory bounded by the largest step.

    Scratch files are written beside ``output`` (about half the size of the inflated trace) and
    removed.

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: not a Chrome trace, or truncated or corrupt.
        OutputError: ``output`` could not be written.
    """
    source, output = Path(source), Path(output)
    if source.is_dir():
        raise TraceFormatError(f"{source} is a directory, not a trace file")
    if not source.is_file():
        raise TraceNotFoundError(f"no such trace file: {source}")
    scan = EventScan(source, CATEGORY_NAMES, LAUNCH_LINKED, DEVICE_CATEGORIES, rows_per_table=RAW_ROWS)
    target, in_place = destination(output)  # the output's folder made, or why it cannot be said here
    try:
        scratch_folder = tempfile.TemporaryDirectory(prefix=".xsp-import-", dir=None if in_place else target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {output}: {describe_os_error(exc)}") from None
    with collector_paused(), scratch_folder as scratch_name:
        raw = _Raw(Path(scratch_name))
        try:
            with unreadable_as_format_error(source), _scratch_errors(output, raw.folder):
                _write_raw(scan.tables(), raw)
        except LeftToMsgspec as left:
            check_fits(source, kineto_memory_bytes(source), "it holds what only the complete reader reads "
                       f"({left.reason}), which reads a file whole")
            trace = load_kineto(source)
            return KinetoImport(trace.save(output), len(trace.spans), len(trace.steps), trace.metadata,
                                events=None, windows=1, largest_window_events=None, read_whole_because=left.reason)
        base_ns = int(scan.fields.baseTimeNanoseconds or 0)
        with _scratch_errors(output, raw.folder):
            windows = _windows(raw, base_ns, window_events, memory_mb)
        totals = _Totals()
        tables = _window_tables(source, windows, scan, base_ns, totals)
        found: list[dict[str, Any]] = []

        def metadata() -> dict[str, Any]:
            known = dict(totals.metadata)
            known["not_imported"] = dict(totals.not_imported + scan.counts)
            known["threads"] = totals.threads
            found.append(imported_metadata(source, known, dict(totals.hierarchy), totals.levels))
            return found[-1]

        with _scratch_errors(output, raw.folder):
            written = write_trace_tables(output, tables, metadata)
        return KinetoImport(written, totals.spans, len(totals.steps), found[-1], events=scan.events,
                            windows=max(len(windows.sizes), 1),
                            largest_window_events=max(windows.sizes.values(), default=0))


@contextmanager
def _scratch_errors(output: Path, scratch: Path) -> Iterator[None]:
    """What fails in the scratch folder (a full disk, DuckDB out of memory or spill space) as one
    :class:`OutputError` line."""
    try:
        with duckdb_interrupts():
            yield
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write {output}: its scratch files in {scratch.parent} failed "
                          f"({describe_os_error(exc)})") from None
    except duckdb.Error as exc:
        raise OutputError(f"cannot write {output}: cutting the trace into windows failed ({first_line(exc)})") \
            from None


def _write_raw(tables: Iterator[pa.Table], raw: _Raw) -> None:
    """The scanner's tables written as they come, each on a thread of its own while the scanner
    reads on (both let Python's lock go): at most one table waits to be written."""
    import concurrent.futures

    narrow: list[pq.ParquetWriter] = []

    def write(table: pa.Table, path: Path) -> None:
        raw.schema = table.schema
        with pa.OSFile(str(path), "wb") as file, pa.ipc.new_file(file, table.schema) as writer:
            writer.write_table(table)
        columns = table.select(NARROW_COLUMNS)
        if not narrow:
            raw.narrow = raw.folder / "narrow.parquet"
            narrow.append(pq.ParquetWriter(raw.narrow, columns.schema, compression="none"))
        narrow[0].write_table(columns)

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="xsp-import-write") as pool:
            writing: concurrent.futures.Future[None] | None = None
            for table in tables:
                path = raw.folder / f"events-{len(raw.tables)}.arrow"
                raw.tables.append(path)
                if writing is not None:
                    writing.result()
                writing = pool.submit(write, table, path)
                del table
            if writing is not None:
                writing.result()
    finally:
        for writer in narrow:
            writer.close()
    release_freed_memory()


def _fine(base_ns: int, table: str = "") -> str:
    """SQL: the events whose times :func:`xsp.io.kineto.kineto_rows` keeps (the others are counted
    there), reckoned as it reckons them; ``table``: the prefix that names their columns."""
    ts, dur = f"{table}ts", f"{table}dur"
    return (f"isfinite({ts}) AND isfinite({dur}) AND {dur} >= 0 AND {ts} * 1e3 + {base_ns} >= 0 "
            f"AND {ts} * 1e3 + {base_ns} + {dur} * 1e3 <= {LATEST_NS}")


def _codes(codes: list[int]) -> str:
    """SQL: a list of category codes."""
    return ", ".join(map(str, codes)) or "NULL"


def _windows(raw: _Raw, base_ns: int, window_events: int, memory_mb: int) -> _Windows:
    """Cut the raw events into windows (DuckDB, within ``memory_mb``) and sort them into their
    windows' files."""

    schema = raw.schema if raw.schema is not None else pa.schema([])
    if raw.narrow is None:
        return _Windows(schema)
    connection = duckdb.connect(config={"memory_limit": f"{memory_mb}MB", "threads": min(os.cpu_count() or 1, 4),
                                        "temp_directory": str(raw.folder / "spill"),
                                        "preserve_insertion_order": True})  # an ORDER BY's rows in order
    try:
        connection.execute("SET enable_progress_bar = false")  # the library prints nothing
        connection.read_parquet(str(raw.narrow)).create_view("events")
        device, launch, fine = _codes(_DEVICE_CODES), _codes(_LAUNCH_CODES), _fine(base_ns)
        cuts = sorted(row[0] for row in connection.execute(f"""
            WITH timed AS (SELECT ts, CASE WHEN category IN ({device}) THEN NULL ELSE ts + dur END AS end_us
                           FROM events WHERE {fine}),
            by_start AS (SELECT ts, max(end_us) AS end_us, count(*) AS n FROM timed GROUP BY ts),
            running AS (SELECT ts, max(end_us) OVER earlier AS open_until, coalesce(sum(n) OVER earlier, 0) AS before
                        FROM by_start
                        WINDOW earlier AS (ORDER BY ts ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING))
            SELECT min(ts) AS cut FROM running
            WHERE before >= {window_events} AND (open_until IS NULL OR open_until < ts - {CUT_MARGIN_US})
            GROUP BY before // {window_events}""").fetchall())
        # launches that share a correlation id stay in one window, so that their activities are
        # left unlinked as the in-memory import leaves them (which launched it cannot be said)
        for first, last in connection.execute(f"""
                SELECT min(ts), max(ts) FROM events WHERE category IN ({launch}) AND correlation <> {MISSING}
                AND {fine} GROUP BY correlation HAVING count(*) > 1 AND min(ts) < max(ts)""").fetchall():
            cuts = [cut for cut in cuts if not first < cut <= last]
        connection.register("cuts", pa.table({"ts": pa.array(cuts, type=pa.float64()),
                                              _WINDOW: pa.array(range(1, len(cuts) + 1), type=pa.int32())}))
        # a GPU activity goes with its launch: the window of the first CUDA call with its correlation
        # id, -1 where none has it (the activity then goes by its own start); host rows go by their
        # start, which numpy places among the cuts as the scatter goes
        result = connection.sql(f"""
            WITH launches AS (SELECT correlation, min(coalesce(c.{_WINDOW}, 0)) AS launch
                              FROM events e ASOF LEFT JOIN cuts c ON e.ts >= c.ts
                              WHERE category IN ({launch}) AND correlation <> {MISSING} AND {_fine(base_ns, "e.")}
                              GROUP BY correlation)
            SELECT coalesce(l.launch, -1) AS launch FROM events e LEFT JOIN launches l
              ON e.correlation = l.correlation
            WHERE e.category IN ({device}) ORDER BY {FILE_ORDER}""")
        # the result's batches as they come (DuckDB 1 names the reader fetch_arrow_reader, which 2 deprecates)
        read: Callable[[int], pa.RecordBatchReader] = (getattr(result, "to_arrow_reader", None)
                                                       or result.fetch_arrow_reader)
        return _sorted_into_windows(raw, schema, np.asarray(cuts, dtype=np.float64), read(RAW_ROWS), base_ns)
    finally:
        connection.close()


class _Launches:
    """The windows of the GPU activities' launches, in file order, taken a table's worth at a time."""

    def __init__(self, reader: pa.RecordBatchReader) -> None:
        self.reader = reader
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` activities' launch windows."""
        if not count:
            return np.zeros(0, dtype=np.int64)
        while self.pending_rows < count:
            try:
                batch = self.reader.read_next_batch()
            except StopIteration:
                raise RuntimeError("xsp: fewer launch windows than GPU activities (a bug)") from None
            self.pending.append(batch.column(0).to_numpy(zero_copy_only=False).astype(np.int64))
            self.pending_rows += len(batch)
        joined = np.concatenate(self.pending) if len(self.pending) != 1 else self.pending[0]
        taken, rest = joined[:count], joined[count:]
        self.pending, self.pending_rows = [rest], len(rest)
        return taken

    def check_all_taken(self) -> None:
        """Raises: RuntimeError where the activities and their launch windows did not pair up."""
        if self.pending_rows or any(len(batch) for batch in self.reader):
            raise RuntimeError("xsp: more launch windows than GPU activities (a bug)")


def _sorted_into_windows(raw: _Raw, schema: pa.Schema, cuts: np.ndarray, launches: pa.RecordBatchReader,
                         base_ns: int) -> _Windows:
    """Each raw table's rows appended to their windows' files, each raw file removed once sorted:
    a host row goes by its start among the ``cuts`` (after the k-th cut: window k), a GPU activity
    with its launch (``launches``: their windows, in file order)."""
    windows = _Windows(schema)
    open_files: dict[int, tuple[pa.NativeFile, pa.ipc.RecordBatchStreamWriter]] = {}  # least recently written first
    taken = _Launches(launches)
    device_codes = np.asarray(_DEVICE_CODES, dtype=np.int8)
    try:
        for path in raw.tables:
            with pa.OSFile(str(path)) as file:
                table = pa.ipc.open_file(file).read_all()
            path.unlink()
            if not len(table):
                continue
            starts = table["ts"].to_numpy()
            durations = table["dur"].to_numpy()
            numbers = np.searchsorted(cuts, starts, side="right")
            on_device = np.isin(table["category"].to_numpy(), device_codes)
            launch = taken.take(int(on_device.sum()))
            numbers[on_device] = np.where(launch >= 0, launch, numbers[on_device])
            # a window's first start may be said early (rows the import leaves out for their times
            # count here), never late: rows of an earlier window from there on wait for it
            with np.errstate(invalid="ignore", over="ignore"):
                timed = np.isfinite(starts) & np.isfinite(durations) & (durations >= 0) & (starts * 1e3 + base_ns >= 0)
            order = np.argsort(numbers, kind="stable")
            ordered = numbers[order]
            bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), len(ordered)]
            for low, high in zip(bounds[:-1], bounds[1:]):
                number = int(ordered[low])
                rows = order[low:high]
                windows.sizes[number] = windows.sizes.get(number, 0) + len(rows)
                kept = rows[timed[rows]]
                if len(kept):
                    first = float(starts[kept].min())
                    known = windows.first_start_us.get(number)
                    windows.first_start_us[number] = first if known is None else min(known, first)
                if number in open_files:
                    open_files[number] = open_files.pop(number)  # now the most recently written
                else:
                    if len(open_files) >= OPEN_WINDOW_FILES:  # the least recently written: a new file later
                        old_file, old_writer = open_files.pop(next(iter(open_files)))
                        try:
                            old_writer.close()
                        finally:
                            old_file.close()
                    target = raw.folder / f"window-{number}-{len(windows.files.get(number, []))}.arrows"
                    windows.files.setdefault(number, []).append(target)
                    file = pa.OSFile(str(target), "wb")
                    open_files[number] = (file, pa.ipc.new_stream(file, table.schema))
                open_files[number][1].write_table(table.take(pa.array(rows)))
            del table
            release_freed_memory()
        taken.check_all_taken()
    finally:
        for file, writer in open_files.values():
            try:
                writer.close()
            finally:
                file.close()
    return windows


def _first_start_ns(start_us: float, base_ns: int) -> int:
    """The first start of a window in epoch nanoseconds, converted as its rows' are."""
    return int(microseconds_to_ns([start_us])[0]) + base_ns


def _window_tables(source: Path, windows: _Windows, scan: EventScan, base_ns: int,
                   totals: _Totals) -> Iterator[pa.Table]:
    """Each window's spans, in start order across windows; ``totals`` summed as they go."""
    state = new_step_state(attach_to_session=False)
    numbers = windows.numbers()
    # where the windows after each one begin (the earliest of them): its rows from there on wait
    next_start_us: list[float | None] = [None] * len(numbers)
    for at in range(len(numbers) - 2, -1, -1):
        starts = [s for s in (next_start_us[at + 1], windows.first_start_us.get(numbers[at + 1])) if s is not None]
        next_start_us[at] = min(starts) if starts else None
    held: pa.Table | None = None
    for at, number in enumerate(numbers):
        events = events_from_table(windows.read(number), scan.fields, scan.thread_names, Counter())
        with unreadable_as_format_error(source):
            rows, found = kineto_rows(events)
        del events
        totals.not_imported.update(found.pop("not_imported"))
        totals.threads.update(found.pop("threads"))
        totals.metadata = found
        result = build_table(iter([rows]), 0, state, live_records=False)
        del rows
        spans = with_rank(Trace(spans=result.spans, metadata=found)).spans  # as xsp.load gives it, and saves it
        totals.hierarchy.update(result.diagnostics)
        totals.levels.update(str(level) for level in spans[col.LEVEL].dropna().unique())
        totals.spans += len(spans)
        totals.steps.update(int(step) for step in spans[col.STEP].dropna().unique())
        table = arrow_table(spans)
        del spans, result
        release_freed_memory()
        if held is not None and len(held):
            table = in_start_order(pa.concat_tables([held, table], promote_options="permissive"))
        held = None
        later = next_start_us[at]
        if later is not None:
            late = pc.greater_equal(table[col.START_NS], _first_start_ns(later, base_ns))
            held = table.filter(late)
            table = table.filter(pc.invert(late))
        yield table
    if held is not None and len(held):
        yield held
