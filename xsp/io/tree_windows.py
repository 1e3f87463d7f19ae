"""A trace file read a window of whole trees at a time, for analyses of a trace too large to load.

A *window* is a run of the trace's trees (each root span with all of its descendants, kernels
included), about :data:`WINDOW_SPANS` spans, never part of a tree: every span's parent is in its
window, so the in-memory analyses that walk the tree (parents, nearest ancestors, the paths of
keys) give on a window what they give on the whole trace for its spans. Memory is bounded by the
largest window, so by the largest tree: a root span around the whole run (a ``record_function``
around the loop) is held whole.

DuckDB pairs each span with its parent's row without loading the trace (in
:data:`DUCKDB_MEMORY_MB`, spilling beside the trace); the roots are found by pointer jumping on
one integer a span; the file is then read once, in its own order, a row group at a time, and each
window handed over as soon as its last span is read.

Each window's rows are in the order :func:`xsp.load` puts the whole trace in, restricted to the
window, and :attr:`TreeWindows.order` gives each row's place in that order, so that "the first
span of ..." means the same on windows as on the whole.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, XspWarning, duckdb_interrupts, first_line, imported_duckdb, warn
from xsp.core.memory_release import release_freed_memory
from xsp.io.outputs import OutputError
from xsp.io.parquet import (
    check_span_columns,
    in_start_order,
    read_trace_metadata,
    refuse_impossible_spans,
    spans_from_owned_arrow,
)
from xsp.table.validation import session_span_elsewhere
from xsp.table.walks import parent_positions

WINDOW_SPANS: Final = 1 << 16
"""Spans a window holds, about: whole trees are added until it holds this many."""
DUCKDB_MEMORY_MB: Final = 512
READ_ROWS: Final = 1 << 16
"""Rows read from the file at a time."""
MAX_JUMPS: Final = 64
"""Pointer-jumping rounds: 2**64 levels of nesting; a file still unresolved names parents in a loop."""
RELEASE_EVERY: Final = 8
"""Windows after which the memory they freed is given back to the system (glibc and Arrow keep
it otherwise, and a long trace's peak grows with its windows)."""
ORDER_KEYS: Final = ("start_ns", "call_depth_or_minus_one", "file_row")
"""The columns of :attr:`TreeWindows.order`: a span's place in the loaded trace, compared in this order."""
_FILE_ROW: Final = "__xsp_file_row"


@dataclass
class TreeWindows:
    """A trace file cut into windows of whole trees (see the module's text)."""

    source: Path
    metadata: dict[str, Any]
    spans: int
    steps: list[int]
    """The step numbers present, as :attr:`xsp.Trace.steps` gives them."""
    levels: set[str]
    """The levels recorded."""
    ranks: list[int]
    """The ranks present, as :attr:`xsp.Trace.ranks` gives them."""
    in_file_order: bool
    """The file's spans are in start order, so :func:`xsp.load` keeps its order."""
    window_of_row: np.ndarray = field(repr=False)
    last_row: np.ndarray = field(repr=False)
    """Per window, the file row of its last span."""
    columns: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """How many windows."""
        return len(self.last_row)

    def frames(self, columns: list[str] | None = None) -> Iterator[tuple[pd.DataFrame, np.ndarray]]:
        """Each window as a span table with the dtypes of :func:`xsp.load`, in its order, and the
        rows' places in the loaded trace (:data:`ORDER_KEYS`, one row each). Windows come as they
        are completed by the file's order. ``columns``: the columns read (all by default; the
        tree's and the order's are always read).

        Raises:
            TraceFormatError: the file is corrupt, or holds spans no recording can.
        """
        import pyarrow.parquet as pq

        wanted = list(self.columns) if columns is None else [
            name for name in self.columns if name in set(columns) | {col.SPAN_ID, col.PARENT_ID, col.START_NS,
                                                                       col.END_NS, col.DURATION_NS, col.CALL_DEPTH}]
        pending: dict[int, list[pa.RecordBatch]] = {}
        completing = np.argsort(self.last_row, kind="stable")
        done = 0
        cursor = 0
        try:
            parquet = pq.ParquetFile(self.source, page_checksum_verification=True)
            for batch in parquet.iter_batches(batch_size=READ_ROWS, columns=wanted, use_threads=False):
                rows = np.arange(cursor, cursor + batch.num_rows, dtype=np.int64)
                batch = batch.append_column(_FILE_ROW, pa.array(rows))
                windows = self.window_of_row[cursor:cursor + batch.num_rows]
                cursor += batch.num_rows
                if len(windows) and windows[0] == windows[-1] and (windows == windows[0]).all():
                    pending.setdefault(int(windows[0]), []).append(batch)
                else:
                    order = np.argsort(windows, kind="stable")
                    cuts = np.flatnonzero(np.diff(windows[order])) + 1
                    for part in np.split(order, cuts):
                        pending.setdefault(int(windows[part[0]]), []).append(batch.take(pa.array(part)))
                while done < len(completing) and self.last_row[completing[done]] < cursor:
                    number = int(completing[done])
                    done += 1
                    yield self._frame(pending.pop(number, []))
                    if done % RELEASE_EVERY == 0:  # what the windows before freed, given back
                        release_freed_memory()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceFormatError(f"{self.source} is corrupt: {exc}") from None
        if cursor != self.spans:
            raise TraceFormatError(f"{self.source} changed while it was read ({cursor} spans, not {self.spans})")

    def _frame(self, batches: list[pa.RecordBatch]) -> tuple[pd.DataFrame, np.ndarray]:
        table = pa.Table.from_batches(batches)
        if not self.in_file_order:
            table = in_start_order(table)
        rows = table[_FILE_ROW].to_numpy()
        order = np.empty((len(rows), len(ORDER_KEYS)), dtype=np.int64)
        order[:, 0] = table[col.START_NS].to_numpy() if not self.in_file_order else 0
        depth = table[col.CALL_DEPTH] if col.CALL_DEPTH in table.column_names else None
        order[:, 1] = pc.fill_null(depth, -1).to_numpy() if depth is not None and not self.in_file_order else 0
        order[:, 2] = rows
        owner = [table.drop_columns([_FILE_ROW])]
        del table
        spans = spans_from_owned_arrow(self.source, owner)
        refuse_impossible_spans(self.source, spans, parent_positions(spans))
        return spans, order


def tree_windows(path: str | os.PathLike[str], window_spans: int = WINDOW_SPANS,
                 memory_mb: int = DUCKDB_MEMORY_MB) -> TreeWindows:
    """Cut the trace file ``path`` (``.xsp.parquet``) into windows of whole trees, reading only its
    tree's columns (see the module's text).

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: not an xsp trace, corrupt, or its spans name their parents in a loop.
        SchemaVersionError: written by a newer xsp.
    """
    duckdb = imported_duckdb()

    source = Path(path)
    metadata, parquet = read_trace_metadata(source)
    check_span_columns(source, parquet.schema_arrow)
    names = parquet.schema_arrow.names
    spill = tempfile.TemporaryDirectory(prefix=".xsp-windows-", dir=scratch_folder(source))
    with spill as spill_name:
        connection = duckdb.connect(config={"memory_limit": f"{memory_mb}MB", "threads": min(os.cpu_count() or 1, 4),
                                            "temp_directory": spill_name, "preserve_insertion_order": True})
        try:
            with duckdb_interrupts():
                connection.execute("SET enable_progress_bar = false")
                facts, up = _parents(connection, source, names, session_span_elsewhere(metadata))
        except (duckdb.OutOfMemoryException, duckdb.IOException) as exc:  # the machine's, not the file's
            raise OutputError(f"{source} could not be cut into windows in {spill_name}: {first_line(exc)}") from None
        except duckdb.Error as exc:
            raise TraceFormatError(f"{source} could not be cut into windows: {first_line(exc)}") from None
        finally:
            connection.close()  # its memory let go before the roots are found
    root = _roots(source, up)
    del up
    window_of_row, last_row = _windows(root, window_spans)
    return TreeWindows(source=source, metadata=metadata, window_of_row=window_of_row, last_row=last_row,
                       columns=names, **facts)


def scratch_folder(source: Path) -> str | None:
    """Where to spill what a trace too large to load needs: beside the trace where that can be
    written (a trace too large for memory is large), else the system's temporary folder."""
    folder = source.resolve().parent
    return str(folder) if os.access(folder, os.W_OK) else None


def _parents(connection: Any, source: Path, names: list[str],
             elsewhere: int | None = None) -> tuple[dict[str, Any], np.ndarray]:
    """What :class:`TreeWindows` says of the whole trace, and each span's parent's row (its own for
    a root). ``elsewhere``: a parent known to be in another file (a sealed part's session span),
    not said to be missing."""
    spans = "read_parquet($path, file_row_number = true)"
    given = {"path": str(source)}
    count = int(connection.execute(f"SELECT count(*) FROM {spans}", given).fetchall()[0][0])
    steps = sorted(int(row[0]) for row in connection.execute(
        f"SELECT DISTINCT {col.STEP} FROM {spans} WHERE {col.STEP} IS NOT NULL", given).fetchall()) \
        if col.STEP in names else []
    levels = {str(row[0]) for row in connection.execute(
        f"SELECT DISTINCT {col.LEVEL} FROM {spans} WHERE {col.LEVEL} IS NOT NULL", given).fetchall()}
    ranks = sorted(int(row[0]) for row in connection.execute(
        f"SELECT DISTINCT {col.RANK} FROM {spans} WHERE {col.RANK} IS NOT NULL", given).fetchall()) \
        if col.RANK in names else []
    # each span's parent's row (a parent named by several rows: the first), else its own
    relation = connection.sql(
        f"WITH s AS (SELECT file_row_number AS row, {col.SPAN_ID} AS id, {col.PARENT_ID} AS parent FROM {spans}), "
        "ids AS (SELECT id, min(row) AS row FROM s GROUP BY id) "
        "SELECT s.row, coalesce(ids.row, s.row) AS up, (s.parent IS NOT NULL AND ids.row IS NULL "
        "AND s.parent IS DISTINCT FROM $elsewhere) AS orphan "
        "FROM s LEFT JOIN ids ON s.parent = ids.id", params={**given, "elsewhere": elsewhere})
    up = np.zeros(count, dtype=np.int64 if count >= 1 << 31 else np.int32)
    orphans = 0
    reader = relation.to_arrow_reader() if hasattr(relation, "to_arrow_reader") else relation.fetch_arrow_reader()
    for batch in reader:  # in no order (none asked for: no sort of every row)
        up[batch.column(0).to_numpy()] = batch.column(1).to_numpy()
        orphans += int(pc.sum(batch.column(2)).as_py() or 0)
    if orphans:
        warn(XspWarning(f"{source}: {orphans} spans name a parent that is not in the file (cut short, or spans "
                        "left out of it): they are read as roots"))
    return {"spans": count, "steps": steps, "levels": levels, "ranks": ranks,
            "in_file_order": _in_start_order(source)}, up


def _in_start_order(source: Path) -> bool:
    """Whether the file's spans are in start order (read a column at a time)."""
    import pyarrow.parquet as pq

    latest = None
    for batch in pq.ParquetFile(source).iter_batches(batch_size=1 << 20, columns=[col.START_NS], use_threads=False):
        starts = batch.column(0).to_numpy(zero_copy_only=False)
        if not len(starts):
            continue
        if (latest is not None and starts[0] < latest) or not (starts[1:] >= starts[:-1]).all():
            return False
        latest = starts[-1]
    return True


def _roots(source: Path, up: np.ndarray) -> np.ndarray:
    """Each row's root row, by pointer jumping: ``up`` becomes ``up[up]`` until nothing moves.

    Raises:
        TraceFormatError: the spans name their parents in a loop."""
    parent = up
    for _ in range(MAX_JUMPS):
        higher = up[up]
        if np.array_equal(higher, up):
            if np.array_equal(parent[up], up):  # each a root indeed: no loop jumped onto itself
                return up
            break
        up = higher
    raise TraceFormatError(f"{source} holds spans whose parents form a loop: damaged, or not written by xsp as it "
                           "is; not read")


def _windows(root: np.ndarray, window_spans: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's window, and each window's last row: trees in the order of their roots' rows,
    whole, ``window_spans`` spans a window about."""
    if not len(root):
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64)
    sizes = np.bincount(root, minlength=len(root))
    roots = np.flatnonzero(sizes)  # in row order
    sizes = sizes[roots]
    numbers = ((np.cumsum(sizes) - sizes) // max(window_spans, 1)).astype(np.int64)
    del sizes
    _, numbers = np.unique(numbers, return_inverse=True)  # numbered without gaps
    window_of_root = np.zeros(len(root), dtype=np.int32)
    window_of_root[roots] = numbers
    window_of_row = window_of_root[root]
    del window_of_root
    # each window's last row: the first met reading the rows backwards
    windows, from_the_end = np.unique(window_of_row[::-1], return_index=True)
    last_row = np.full(int(numbers.max()) + 1, -1, dtype=np.int64)
    last_row[windows] = len(root) - 1 - from_the_end
    return window_of_row, last_row


__all__ = ["ORDER_KEYS", "TreeWindows", "WINDOW_SPANS", "scratch_folder", "tree_windows"]
