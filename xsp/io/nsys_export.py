"""An Nsight Systems SQLite export (``nsys export --type sqlite``) opened and checked: the
export's facts and schema, its tables and their columns, and the numeric columns of its event
tables read in C on threads of their own (:class:`TableReads`). :mod:`xsp.io.nsys` makes span
rows of them."""

from __future__ import annotations

import os
import sqlite3
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core.errors import TraceFormatError
from xsp.record.hotpath import optional_extension

SQLITE_MAGIC: Final = b"SQLite format 3\x00"
PRODUCT: Final = "NVIDIA Nsight Systems"
KNOWN_SCHEMA_MAJORS: Final = (2, 3)
"""Export schema majors read: 2 (Nsight Systems 2021.5-2022.3: 2.7.1, 2.9.1) and 3 (2022.4 on:
3.0.0; 2023.4: 3.7.2; 2024.2: 3.11.1; 2024.5: 3.13.2; 2025.4: 3.22.1), whose tables and columns
used here are the same (3.7 added ``greenContextId`` to the GPU tables, which xsp does not read);
each table's columns are checked all the same."""
METADATA_TABLES: Final = ("META_DATA_EXPORT", "EXPORT_META_DATA")
"""Where an export names its product and schema: ``META_DATA_EXPORT`` from Nsight Systems 2023.4
(schema 3.7.2; beside ``META_DATA_CAPTURE``, the capture's settings, which xsp never reads: it
holds the profiled process's whole environment), ``EXPORT_META_DATA`` from 2021.5 to 2023.2
(schema 2.7.1 to 3.1.7). Releases before 2021.5 wrote none."""
SQLITE_COLUMNS: Any = optional_extension("xsp.io._sqlite")
"""xsp/io/_sqlite: numeric columns of a query read in C, or None where it is not built."""

READ_COLUMNS: Final[dict[str, tuple[str, ...]]] = {
    "NVTX_EVENTS": ("start", "end", "eventType", "textId", "globalTid", "domainId"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "end", "globalTid", "correlationId", "nameId"),
    "CUPTI_ACTIVITY_KIND_DRIVER": ("start", "end", "globalTid", "correlationId", "nameId"),
    "CUPTI_ACTIVITY_KIND_KERNEL": ("start", "end", "deviceId", "streamId", "correlationId", "demangledName",
                                   "registersPerThread", "gridX", "gridY", "gridZ", "blockX", "blockY", "blockZ",
                                   "staticSharedMemory", "dynamicSharedMemory"),
    "CUPTI_ACTIVITY_KIND_MEMCPY": ("start", "end", "deviceId", "streamId", "correlationId", "bytes", "copyKind",
                                   "srcKind", "dstKind"),
    "CUPTI_ACTIVITY_KIND_MEMSET": ("start", "end", "deviceId", "streamId", "correlationId", "bytes"),
}
"""The numeric columns read from each event table (an API table's ``eventClass`` as well, where it has one)."""

REQUIRED_COLUMNS: Final[dict[str, tuple[str, ...]]] = {
    **READ_COLUMNS, "NVTX_EVENTS": (*READ_COLUMNS["NVTX_EVENTS"], "text"), "StringIds": ("id", "value")}
"""The columns xsp reads from each table it reads (any table may be absent: nothing recorded there)."""


def is_nsys_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an SQLite file (by its first bytes): an Nsight Systems export or not,
    :func:`xsp.io.nsys.load_nsys` says."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def connect(source: Path) -> sqlite3.Connection:
    try:
        connection = sqlite3.connect(f"{source.resolve().as_uri()}?mode=ro", uri=True)
        # names as recorded, with bytes that are not UTF-8 (an odd thread or file name) replaced
        connection.text_factory = lambda raw: raw.decode("utf-8", "replace")
        connection.execute("select count(*) from sqlite_master").fetchone()
    except sqlite3.DatabaseError as exc:
        raise TraceFormatError(f"{source} is not an SQLite database xsp can read: {exc}") from None
    return connection


def table_names(connection: sqlite3.Connection) -> set[str]:
    return {name for (name,) in connection.execute("select name from sqlite_master where type in ('table', 'view')")}


def column_names(connection: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in connection.execute(f"pragma table_info([{table}])")}


def export_facts(connection: sqlite3.Connection, source: Path) -> dict[str, str]:
    """The export's metadata (``META_DATA_EXPORT``, or ``EXPORT_META_DATA`` before Nsight Systems
    2023.4) as a dict, after checking that this is an Nsight Systems export of a schema xsp reads,
    whose tables have the columns xsp reads. An export of a release before 2021.5, which wrote no
    metadata, is known by its tables (``StringIds`` and an event table xsp reads): its facts are
    empty, its schema unknown."""
    tables = table_names(connection)
    table = next((name for name in METADATA_TABLES if name in tables), None)
    if table is None:
        if "StringIds" in tables and tables & set(READ_COLUMNS):
            _check_columns(connection, tables, source, "unknown (no metadata table: before 2021.5)")
            return {}
        raise TraceFormatError(f"{source} is an SQLite file but no Nsight Systems export (no META_DATA_EXPORT or "
                               "EXPORT_META_DATA table, and none of its event tables)")
    if not {"name", "value"} <= column_names(connection, table):
        raise TraceFormatError(f"{source}: its {table} table has no name and value columns: not an export xsp can read")
    facts = {str(name): str(value) for name, value in connection.execute(f"select name, value from {table}")}
    if facts.get("EXPORT_PRODUCT_NAME", PRODUCT) != PRODUCT:
        raise TraceFormatError(f"{source} was exported by {facts['EXPORT_PRODUCT_NAME']}, not {PRODUCT}")
    version = schema_version(facts) or ""
    major = facts.get("EXPORT_SCHEMA_VERSION_MAJOR") or version.split(".")[0]
    if not major.isdigit() or int(major) not in KNOWN_SCHEMA_MAJORS:
        raise TraceFormatError(
            f"{source}: Nsight Systems export schema {version or 'unknown'} is not one xsp reads "
            f"(it reads {', '.join(f'{m}.x' for m in KNOWN_SCHEMA_MAJORS)}); export it with a release that writes one")
    _check_columns(connection, tables, source, version)
    return facts


def schema_version(facts: dict[str, str]) -> str | None:
    """The export's schema version, ``3.13.2``: its ``EXPORT_SCHEMA_VERSION``, or made of the
    ``_MAJOR``, ``_MINOR`` and ``_MICRO`` keys where only those were written (None: neither)."""
    whole = facts.get("EXPORT_SCHEMA_VERSION")
    if whole:
        return whole
    parts = [facts.get(f"EXPORT_SCHEMA_VERSION_{part}") for part in ("MAJOR", "MINOR", "MICRO")]
    if not parts[0]:
        return None
    return ".".join(part for part in parts if part)


def _check_columns(connection: sqlite3.Connection, tables: set[str], source: Path, version: str) -> None:
    """Each table xsp reads has the columns it reads (see :data:`REQUIRED_COLUMNS`)."""
    for table, needed in REQUIRED_COLUMNS.items():
        if table in tables:
            missing = sorted(set(needed) - column_names(connection, table))
            if missing:
                raise TraceFormatError(f"{source}: table {table} of export schema {version} lacks "
                                       f"{', '.join(missing)}: not an export xsp can read")




NAME_IDS: Final = {"NVTX_EVENTS": "textId", "CUPTI_ACTIVITY_KIND_RUNTIME": "nameId",
                   "CUPTI_ACTIVITY_KIND_DRIVER": "nameId", "CUPTI_ACTIVITY_KIND_KERNEL": "demangledName"}
"""The column of each table that names a row by its id in ``StringIds``."""


MAX_CODED_TEXTS: Final = 64
"""A text column of at most this many distinct texts is read in C as the number of each row's text
(:meth:`TableReads.texts`); SQLite tries the texts in turn on every row."""
CODED_TEXTS: Final = {"NVTX_EVENTS": "text"}
"""The text columns read as numbers where they hold few distinct texts."""


class TableReads:
    """The numeric columns of an export's event tables (:data:`READ_COLUMNS`), read by
    xsp/io/_sqlite (which lets Python's lock go while SQLite steps through the rows) on threads
    that leave the import one core, while it works on the tables read first."""

    def __init__(self, connection: sqlite3.Connection, tables: set[str]) -> None:
        self.connection = connection
        self.columns = {table: READ_COLUMNS[table] + (("eventClass",) if table.endswith(("RUNTIME", "DRIVER"))
                                                      and "eventClass" in column_names(connection, table) else ())
                        for table in READ_COLUMNS if table in tables}
        self.pending: dict[str, Future[tuple[bytearray, int]]] = {}
        self.distinct: dict[str, list[bytes]] = {}
        self.pool: ThreadPoolExecutor | None = None
        uri = _file_uri(connection)
        if SQLITE_COLUMNS is not None and uri is not None and self.columns:
            self.pool = ThreadPoolExecutor(max_workers=max(min(len(self.columns), (os.cpu_count() or 1) - 1), 1),
                                           thread_name_prefix="xsp-nsys-read")
            for table in self.columns:  # in the order the import takes them
                self.pending[table] = self.pool.submit(SQLITE_COLUMNS.read_floats, uri, self._query(table))
                query = self._text_query(table, CODED_TEXTS[table]) if table in CODED_TEXTS else None
                if query is not None:
                    self.pending[f"{table}.{CODED_TEXTS[table]}"] = self.pool.submit(
                        SQLITE_COLUMNS.read_floats, uri, query)

    def _text_query(self, table: str, column: str) -> str | None:
        """The query giving each row the number of its text among the column's distinct ones (NULL
        for none); None where there are too many to try each on every row."""
        distinct = [bytes(raw) for (raw,) in self.connection.execute(
            f"select distinct cast({column} as blob) from {table} where {column} is not null "
            f"limit {MAX_CODED_TEXTS + 1}")]
        if len(distinct) > MAX_CODED_TEXTS:
            return None
        self.distinct[f"{table}.{column}"] = distinct
        if not distinct:
            return f"select null from {table}"
        cases = " ".join(f"when x'{raw.hex()}' then {number}" for number, raw in enumerate(distinct))
        return f"select case cast({column} as blob) {cases} end from {table}"

    def _read(self, key: str) -> tuple[bytearray, int] | None:
        """What the thread reading ``key`` found; None where none read it or it failed (the caller
        reads through Python then)."""
        future = self.pending.pop(key, None)
        try:
            return None if future is None else future.result()
        except OSError:
            return None

    def texts(self, table: str, column: str) -> np.ndarray:
        """A text column as an object array (None where null): where it holds few distinct texts
        (an NVTX range's own text is most often one of a few names), from the numbers read in C,
        each distinct text made once; else row by row through Python."""
        key = f"{table}.{column}"
        found = self._read(key)
        if found is not None:
            numbers = np.frombuffer(found[0], dtype=np.float64)
            distinct = self.distinct[key]
            values = np.array([raw.decode("utf-8", "replace") for raw in distinct] + [None], dtype=object)
            return values[np.where(np.isnan(numbers), len(distinct), numbers).astype(np.int64)]
        return np.array([text for (text,) in self.connection.execute(f"select {column} from {table}")], dtype=object)

    def _query(self, table: str) -> str:
        return f"select {', '.join(self.columns[table])} from {table}"

    def frame(self, table: str) -> pd.DataFrame:
        """The table's numeric columns as float64 columns (NaN where null): one array of all the
        rows, read in C where xsp's extension is built, else made by numpy from SQLite's tuples;
        never kept as a Python object a value. Exact for what is read here (times from the
        session's start, ids, sizes: all below 2**53)."""
        columns = self.columns[table]
        found = self._read(table)
        data = None if found is None or found[1] != len(columns) else \
            np.frombuffer(found[0], dtype=np.float64).reshape(-1, len(columns))
        if data is None:
            rows = self.connection.execute(self._query(table)).fetchall()
            data = np.array(rows, dtype=np.float64).reshape(-1, len(columns)) if rows else np.empty((0, len(columns)))
        return pd.DataFrame(data, columns=list(columns), copy=False)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _file_uri(connection: sqlite3.Connection) -> str | None:
    """The read-only URI of the connection's file, for xsp/io/_sqlite to open it again (None: no file)."""
    found = connection.execute("pragma database_list").fetchone()
    return f"{Path(found[2]).as_uri()}?mode=ro" if found and found[2] else None
