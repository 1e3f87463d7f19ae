"""Importing Nsight Systems SQLite exports (``nsys export --type sqlite``) into the span table.

Mapping:

==================================  =========  ==========  ======================================
Nsight Systems table                level      kind        notes
==================================  =========  ==========  ======================================
``NVTX_EVENTS`` push/pop, start/end  model      user        the range's text; its domain in
                                                           ``attributes`` (``nvtx.domain``)
``CUPTI_ACTIVITY_KIND_RUNTIME``     cuda_api   runtime     name without its ``_v7000`` suffix,
                                                           correlation id
``CUPTI_ACTIVITY_KIND_DRIVER``      cuda_api   driver      as the runtime's
``CUPTI_ACTIVITY_KIND_KERNEL``      kernel     kernel      demangled name, device, stream, grid,
                                                           block, registers, shared memory
``CUPTI_ACTIVITY_KIND_MEMCPY``      kernel     memcpy      bytes, copy kind (``HtoD``...)
``CUPTI_ACTIVITY_KIND_MEMSET``      kernel     memset      bytes
==================================  =========  ==========  ======================================

xsp's own ranges (``xsp run --nvtx``: domain ``xsp``, the span's kind as NVTX category) come back
as the spans they stand for: model calls (model, predict), layers (layer, forward), layers'
backward (layer, backward), user spans and explicit steps.

Times are nanoseconds from the session's start (``TARGET_INFO_SESSION_START_TIME``), made epoch
nanoseconds. A host row's thread is the OS thread id of its ``globalTid`` (which packs the process
id in bits 24-47 and the thread id in bits 0-23); the threads are named from ``ThreadNames`` (and
NVTX's ``nvtxNameOsThread``), the GPU from ``TARGET_INFO_GPU``, the rank from the job's
environment (``RANK``, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``SLURM_PROCID``) or an NVTX thread
name ``MPI Rank N``. A GPU activity is linked to its launch by ``correlationId``, and the tree is
rebuilt by inclusion as for every other source. The export's schema version
(``META_DATA_EXPORT``, or ``EXPORT_META_DATA`` before Nsight Systems 2023.4) and the columns each
table has are checked first: an export xsp cannot read is one clear error, never a wrong table.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp._version import __version__
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspWarning, warn
from xsp.core.schema import Level, SpanKind
from xsp.io.nsys_export import (
    NAME_IDS,
    TableReads,
    column_names,
    connect,
    export_facts,
    schema_version,
    table_names,
)
from xsp.io.trace import Trace
from xsp.record.nvtx import DOMAIN as XSP_DOMAIN
from xsp.record.nvtx import RangeKind
from xsp.table.build import build_table, new_step_state
from xsp.table.validation import LATEST_NS
from xsp.table.walks import nullable_ints, strings_at

GPU_TABLES: Final = ("TARGET_INFO_GPU", "TARGET_INFO_CUDA_GPU")
"""The GPUs of the target: ``TARGET_INFO_CUDA_GPU`` in Nsight Systems 2021.1-2021.3, then ``TARGET_INFO_GPU``."""

NVTX_PUSH_POP: Final = 59
NVTX_START_END: Final = 60
NVTX_DOMAIN_CREATE: Final = 75
NVTX_NAME_THREAD: Final = 39
DRIVER_EVENT_CLASS: Final = 1
"""``eventClass`` of a CUDA driver call (Nsight Systems' ``TRACE_PROCESS_EVENT_CUDA_DRIVER``)."""
"""``NVTX_EVENTS.eventType`` codes (Nsight Systems' ``ENUM_NSYS_EVENT_TYPE``)."""

COPY_KINDS: Final = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
                     9: "HtoH", 10: "PtoP"}
"""CUPTI's ``CUpti_ActivityMemcpyKind``, named as PyTorch's profiler names copies."""
MEMORY_KINDS: Final = {0: "Pageable", 1: "Pinned", 2: "Device", 3: "Array", 4: "Managed", 5: "Device Static",
                       6: "Managed Static"}
"""Nsight Systems' ``ENUM_CUDA_MEM_KIND`` (``srcKind``, ``dstKind``; 7 and others: unknown)."""

RANK_VARIABLES: Final = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")
MPI_RANK_THREAD: Final = re.compile(r"MPI Rank (\d+)$")
API_VERSION_SUFFIX: Final = re.compile(r"_v\d+$")

IMPOSSIBLE_TIMES: Final = "rows with impossible times"
"""What the rows left out are counted as, after their table's name: no start or end, an end
before the start, or a time before 1970 or after 2116 (what no recording can hold)."""


def _possible(frame: pd.DataFrame, base_ns: int) -> np.ndarray:
    """Which rows have times a recording can: a start and an end, the end not before the start,
    both between 1970 and 2116 once on the epoch."""
    start, end = frame["start"].to_numpy(dtype=np.float64), frame["end"].to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore"):  # NaN (a null) compares False: left out
        return (end >= start) & (start + base_ns >= 0) & (end + base_ns <= LATEST_NS)


def _with_possible_times(frame: pd.DataFrame, table: str, base_ns: int, counts: dict[str, int]) -> pd.DataFrame:
    """``frame`` without the rows of impossible times, counted in ``counts``."""
    fine = _possible(frame, base_ns)
    if fine.all():
        return frame
    counts[f"{table} {IMPOSSIBLE_TIMES}"] = int((~fine).sum())
    return frame[fine].reset_index(drop=True)


def _ints(values: pd.Series) -> np.ndarray:
    return values.to_numpy(dtype=np.int64)


def _nullable(values: pd.Series) -> np.ndarray:
    """A column of integers that may be null, as float64 (NaN: null) until the rows are sorted
    (:func:`_sorted_frame` makes it an Int64 column then)."""
    return values.to_numpy(dtype=np.float64)


@dataclass(frozen=True)
class Coded:
    """A string column of one table as codes into its distinct values (-1: null): the texts are
    made once per distinct value, and Arrow expands them once, after every table's rows are
    sorted (taking strings into order cost as much as reading them)."""

    codes: np.ndarray
    values: list[str | None]

    def filled(self, text: str) -> Coded:
        """The column with ``text`` wherever it is null."""
        values: list[str | None] = [text if value is None else value for value in self.values]
        values.append(text)
        return Coded(np.where(self.codes < 0, len(values) - 1, self.codes), values)


def _constant(text: str, count: int) -> Coded:
    values: list[str | None] = [text]
    return Coded(np.zeros(count, dtype=np.int64), values)


def _coded(texts: np.ndarray) -> Coded:
    """An object array of texts (None or NaN: null) as codes."""
    codes, distinct = pd.factorize(texts, use_na_sentinel=True)
    values: list[str | None] = [str(value) for value in distinct]
    return Coded(codes.astype(np.int64), values)


def _per_distinct(keys: np.ndarray, make: Any) -> Coded:
    """``make(*key)`` for each row's key (the rows of integer ``keys``), made once per distinct key."""
    count = len(keys)
    if not count:
        return Coded(np.empty(0, dtype=np.int64), [])
    combined = np.zeros(count, dtype=np.int64)
    for column in keys.T:  # each column's codes (a hash each), folded into one code a row
        codes, uniques = pd.factorize(column)
        combined = combined * len(uniques) + codes
    codes, distinct = pd.factorize(combined)
    first = np.empty(len(distinct), dtype=np.int64)
    first[codes[::-1]] = np.arange(count - 1, -1, -1)  # each distinct key's first row
    return Coded(codes.astype(np.int64), [make(*row) for row in keys[first].tolist()])


def _strings(connection: sqlite3.Connection, tables: set[str]) -> dict[int, str]:
    if "StringIds" not in tables:
        return {}
    return {int(key): str(value) for key, value in connection.execute("select id, value from StringIds")}


def _named(ids: pd.Series, strings: dict[int, str], shown: Any = None) -> Coded:
    """The strings of ``ids`` (null where null or unknown), each distinct id looked up (and
    passed through ``shown``) once."""
    codes, distinct = pd.factorize(ids, use_na_sentinel=True)
    texts = [strings.get(int(value)) for value in distinct]
    return Coded(codes.astype(np.int64), texts if shown is None else
                 [None if text is None else shown(text) for text in texts])


def _thread(global_tid: pd.Series) -> np.ndarray:
    return (global_tid.to_numpy(dtype=np.int64) & 0xFFFFFF)


def _process(global_id: pd.Series) -> np.ndarray:
    return (global_id.to_numpy(dtype=np.int64) >> 24) & 0xFFFFFF


Rows = dict[str, Any]
"""One table's rows by column: int64 arrays (times), float64 arrays of integers that may be null
(NaN), or :class:`Coded` texts."""


def _base_rows(frame: pd.DataFrame, level: Level, kind: SpanKind, names: Coded, base_ns: int,
               host: bool) -> Rows:
    count = len(frame)
    return {
        col.LEVEL: _constant(level.value, count),
        col.KIND: _constant(kind.value, count),
        col.NAME: names,
        col.START_NS: _ints(frame["start"]) + base_ns,
        col.END_NS: _ints(frame["end"]) + base_ns,
        col.THREAD_ID: _thread(frame["globalTid"]).astype(np.float64) if host else np.full(count, np.nan),
    }


def _nvtx_rows(reads: TableReads, strings: dict[int, str], base_ns: int,
               thread_names: dict[int, str], counts: dict[str, int]) -> Rows:
    connection = reads.connection
    frame = reads.frame("NVTX_EVENTS")
    texts = reads.texts("NVTX_EVENTS", "text")
    kinds = frame["eventType"].to_numpy()
    domain_column, thread_column = frame["domainId"].to_numpy(), frame["globalTid"].to_numpy()
    domains: dict[int, str] = {}
    for row in np.flatnonzero((kinds == NVTX_DOMAIN_CREATE) & ~np.isnan(domain_column)).tolist():
        if isinstance(texts[row], str):
            domains[int(domain_column[row])] = texts[row]
    for row in np.flatnonzero((kinds == NVTX_NAME_THREAD) & ~np.isnan(thread_column)).tolist():
        if isinstance(texts[row], str):
            thread_names.setdefault(int(thread_column[row]) & 0xFFFFFF, texts[row])
    ranges_ended = (np.isin(kinds, [NVTX_PUSH_POP, NVTX_START_END]) & ~np.isnan(frame["end"].to_numpy())
                    & ~np.isnan(frame["globalTid"].to_numpy()))
    keep = ranges_ended & _possible(frame, base_ns)
    impossible = int((ranges_ended & ~keep).sum())
    if impossible:
        counts[f"NVTX_EVENTS {IMPOSSIBLE_TIMES}"] = impossible
    ranges = frame[keep].reset_index(drop=True)
    texts = texts[keep]
    from_ids = _named(ranges["textId"], strings)
    by_id = np.array([*from_ids.values, None], dtype=object)[np.where(from_ids.codes < 0, len(from_ids.values),
                                                                      from_ids.codes)]
    names = _coded(np.where(pd.isna(texts), by_id, texts)).filled("(unnamed NVTX range)")
    rows = _base_rows(ranges, Level.MODEL, SpanKind.USER, names, base_ns, host=True)
    domain_ids = np.nan_to_num(ranges["domainId"].to_numpy(), nan=0).astype(np.int64)
    if "category" in column_names(connection, "NVTX_EVENTS"):
        _xsp_ranges(connection, rows, keep, domain_ids, domains)
    rows[col.ATTRIBUTES] = _per_distinct(
        domain_ids.reshape(-1, 1),
        lambda d: None if d == 0 else f'{{"nvtx.domain":{_json_text(domains.get(d, str(d)))}}}')
    return rows


XSP_RANGES: Final = {RangeKind.MODEL: (Level.MODEL, SpanKind.PREDICT), RangeKind.LAYER: (Level.LAYER, SpanKind.FORWARD),
                     RangeKind.BACKWARD: (Level.LAYER, SpanKind.BACKWARD), RangeKind.USER: (Level.MODEL, SpanKind.USER),
                     RangeKind.STEP: (Level.MODEL, SpanKind.STEP)}
"""The level and kind of the span each of xsp's own ranges (``xsp run --nvtx``: domain ``xsp``,
the span's kind as NVTX category) stands for."""


def _xsp_ranges(connection: sqlite3.Connection, rows: Rows, keep: np.ndarray, domain_ids: np.ndarray,
                domains: dict[int, str]) -> None:
    """xsp's own ranges back at their levels: a model call, a layer, a layer's backward..."""
    ours = [domain for domain, name in domains.items() if name == XSP_DOMAIN]
    if not ours:
        return
    categories = np.array([c for (c,) in connection.execute("select category from NVTX_EVENTS")], dtype=object)[keep]
    in_domain = np.isin(domain_ids, ours)
    levels, kinds = rows[col.LEVEL].codes.copy(), rows[col.KIND].codes.copy()
    level_values, kind_values = list(rows[col.LEVEL].values), list(rows[col.KIND].values)
    for category, (level, kind) in XSP_RANGES.items():
        chosen = in_domain & (categories == int(category))
        levels[chosen], kinds[chosen] = len(level_values), len(kind_values)
        level_values.append(level.value)
        kind_values.append(kind.value)
    rows[col.LEVEL], rows[col.KIND] = Coded(levels, level_values), Coded(kinds, kind_values)


def _json_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _api_rows(reads: TableReads, table: str, kind: SpanKind, strings: dict[int, str],
              base_ns: int, counts: dict[str, int]) -> Rows:
    """CUDA API calls. One call can be exported twice, with one correlation id: the call, and the
    call with the collection of its backtrace around it (``eventClass`` 67 in 2022.2, the longer
    interval): the shortest row of a correlation id on a thread is kept, the others counted. A row
    of ``eventClass`` 1 in the runtime's table is a driver call."""
    frame = _with_possible_times(reads.frame(table), table, base_ns, counts)
    has_class = "eventClass" in frame
    if len(frame):
        threads, correlation = frame["globalTid"].to_numpy(), frame["correlationId"].to_numpy()
        order = np.lexsort((frame["end"].to_numpy() - frame["start"].to_numpy(), correlation, threads))
        same = np.zeros(len(order), dtype=bool)  # the same call as the row before it, in that order
        same[1:] = (threads[order[1:]] == threads[order[:-1]]) & (correlation[order[1:]] == correlation[order[:-1]])
        repeated = np.zeros(len(order), dtype=bool)
        repeated[order[same]] = True
        if repeated.any():
            counts[f"{table} rows repeating a call (its backtrace's)"] = int(repeated.sum())
            frame = frame[~repeated].reset_index(drop=True)
    names = _named(frame["nameId"], strings, lambda text: API_VERSION_SUFFIX.sub("", text))
    rows = _base_rows(frame, Level.CUDA_API, kind, names, base_ns, host=True)
    if has_class and kind is SpanKind.RUNTIME:
        driver = frame["eventClass"].to_numpy() == DRIVER_EVENT_CLASS
        rows[col.KIND] = Coded(driver.astype(np.int64), [SpanKind.RUNTIME.value, SpanKind.DRIVER.value])
    rows[col.CORRELATION_ID] = _nullable(frame["correlationId"])
    return rows


def _dims(x: pd.Series, y: pd.Series, z: pd.Series) -> Coded:
    return _per_distinct(np.stack([_ints(x.fillna(0)), _ints(y.fillna(0)), _ints(z.fillna(0))], axis=1),
                         lambda a, b, c: f"[{a},{b},{c}]")


def _device_rows(frame: pd.DataFrame, kind: SpanKind, names: Coded, base_ns: int) -> Rows:
    rows = _base_rows(frame, Level.KERNEL, kind, names, base_ns, host=False)
    rows[col.DEVICE_ID] = _nullable(frame["deviceId"])
    rows[col.STREAM_ID] = _nullable(frame["streamId"])
    rows[col.CORRELATION_ID] = _nullable(frame["correlationId"])
    return rows


def _kernel_rows(reads: TableReads, strings: dict[int, str], base_ns: int, counts: dict[str, int]) -> Rows:
    frame = _with_possible_times(reads.frame("CUPTI_ACTIVITY_KIND_KERNEL"), "CUPTI_ACTIVITY_KIND_KERNEL", base_ns,
                                 counts)
    names = _named(frame["demangledName"], strings).filled("(unnamed kernel)")
    rows = _device_rows(frame, SpanKind.KERNEL, names, base_ns)
    rows[col.GRID] = _dims(frame["gridX"], frame["gridY"], frame["gridZ"])
    rows[col.BLOCK] = _dims(frame["blockX"], frame["blockY"], frame["blockZ"])
    rows[col.REGISTERS_PER_THREAD] = _nullable(frame["registersPerThread"])
    rows[col.SHARED_MEMORY_BYTES] = _nullable(frame["staticSharedMemory"].fillna(0)
                                              + frame["dynamicSharedMemory"].fillna(0))
    return rows


def _copy_kind(code: int) -> str:
    return COPY_KINDS.get(code, "unknown" if code < 0 else f"kind {code}")


def _memcpy_rows(reads: TableReads, base_ns: int, counts: dict[str, int]) -> Rows:
    frame = _with_possible_times(reads.frame("CUPTI_ACTIVITY_KIND_MEMCPY"), "CUPTI_ACTIVITY_KIND_MEMCPY", base_ns,
                                 counts)
    codes = np.stack([_ints(frame[c].fillna(-1)) for c in ("copyKind", "srcKind", "dstKind")], axis=1)
    kinds = _per_distinct(codes[:, :1], _copy_kind)
    names = _per_distinct(codes, lambda kind, source, target: f"Memcpy {_copy_kind(kind)} "
                          f"({MEMORY_KINDS.get(source, 'Unknown')} -> {MEMORY_KINDS.get(target, 'Unknown')})")
    rows = _device_rows(frame, SpanKind.MEMCPY, names, base_ns)
    rows[col.BYTES] = _nullable(frame["bytes"])
    rows[col.COPY_KIND] = kinds
    return rows


def _memset_rows(reads: TableReads, base_ns: int, counts: dict[str, int]) -> Rows:
    frame = _with_possible_times(reads.frame("CUPTI_ACTIVITY_KIND_MEMSET"), "CUPTI_ACTIVITY_KIND_MEMSET", base_ns,
                                 counts)
    rows = _device_rows(frame, SpanKind.MEMSET, _constant("Memset", len(frame)), base_ns)
    rows[col.BYTES] = _nullable(frame["bytes"])
    return rows


def _session_start_ns(connection: sqlite3.Connection, tables: set[str]) -> int:
    if "TARGET_INFO_SESSION_START_TIME" in tables and "utcEpochNs" in column_names(connection,
                                                                                "TARGET_INFO_SESSION_START_TIME"):
        found = connection.execute("select utcEpochNs from TARGET_INFO_SESSION_START_TIME").fetchone()
        if found and found[0] is not None:
            return int(found[0])
    return 0


def _gpu_names(connection: sqlite3.Connection, tables: set[str]) -> list[str]:
    table = next((name for name in GPU_TABLES if name in tables), None)
    if table is None or "name" not in column_names(connection, table):
        return []
    return sorted({str(name) for (name,) in connection.execute(f"select name from {table}") if name})


def _rank(connection: sqlite3.Connection, tables: set[str], thread_names: dict[int, str]) -> int | None:
    if "TARGET_INFO_SYSTEM_ENV" in tables and {"name", "value"} <= column_names(connection, "TARGET_INFO_SYSTEM_ENV"):
        found = dict(connection.execute("select name, value from TARGET_INFO_SYSTEM_ENV"))
        for variable in RANK_VARIABLES:
            value = str(found.get(variable, "")).strip()
            if value.isdigit():
                return int(value)
    for name in thread_names.values():
        match = MPI_RANK_THREAD.match(name)
        if match:
            return int(match.group(1))
    return None


def _thread_names(connection: sqlite3.Connection, tables: set[str], strings: dict[int, str]) -> dict[int, str]:
    if "ThreadNames" not in tables or not {"nameId", "globalTid"} <= column_names(connection, "ThreadNames"):
        return {}
    return {int(tid) & 0xFFFFFF: strings.get(int(name_id), str(name_id))
            for name_id, tid in connection.execute("select nameId, globalTid from ThreadNames") if tid is not None}


def nsys_rows(connection: sqlite3.Connection, source: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Span rows (epoch ns, no ids or parents yet) and metadata of an opened export."""
    facts = export_facts(connection, source)
    tables = table_names(connection)
    strings = _strings(connection, tables)
    base_ns = _session_start_ns(connection, tables)
    lacking = []  # what the export lacks that the table would have needed, in words
    if not base_ns:
        lacking.append("no session start time (TARGET_INFO_SESSION_START_TIME): its times are counted from the "
                       "session's start, as if it began on 1 January 1970")
    named_by_id = [table for table, column in NAME_IDS.items() if not strings and table in tables and
                   connection.execute(f"select exists(select 1 from {table} where {column} is not null)").fetchone()[0]]
    if named_by_id:
        lacking.append(f"no StringIds table: the names its {', '.join(named_by_id)} give by id are unknown")
    thread_names = _thread_names(connection, tables, strings)
    parts: list[Rows] = []
    counts: dict[str, int] = {}

    def add(table: str, make: Any) -> None:
        if table in tables:
            part = make()
            counts[table] = len(part[col.START_NS])
            if counts[table]:
                parts.append(part)

    repeated: dict[str, int] = {}  # rows not imported, by why
    reads = TableReads(connection, tables)
    try:
        add("NVTX_EVENTS", lambda: _nvtx_rows(reads, strings, base_ns, thread_names, repeated))
        add("CUPTI_ACTIVITY_KIND_RUNTIME",
            lambda: _api_rows(reads, "CUPTI_ACTIVITY_KIND_RUNTIME", SpanKind.RUNTIME, strings, base_ns, repeated))
        add("CUPTI_ACTIVITY_KIND_DRIVER",
            lambda: _api_rows(reads, "CUPTI_ACTIVITY_KIND_DRIVER", SpanKind.DRIVER, strings, base_ns, repeated))
        add("CUPTI_ACTIVITY_KIND_KERNEL", lambda: _kernel_rows(reads, strings, base_ns, repeated))
        add("CUPTI_ACTIVITY_KIND_MEMCPY", lambda: _memcpy_rows(reads, base_ns, repeated))
        add("CUPTI_ACTIVITY_KIND_MEMSET", lambda: _memset_rows(reads, base_ns, repeated))
    finally:
        reads.close()
    rows = _sorted_frame(parts)
    parts.clear()  # the frame holds its own arrays: the tables' are let go before the tree is built
    host = set() if not len(rows) else set(np.unique(rows[col.THREAD_ID].dropna().to_numpy(dtype=np.int64)).tolist())
    gpus = _gpu_names(connection, tables)
    rank = _rank(connection, tables, thread_names)
    metadata: dict[str, Any] = {
        "source": "nsys",
        "nsys": {"product_version": facts.get("EXPORT_PRODUCT_VERSION"),
                 "schema_version": schema_version(facts), "session_start_ns": base_ns,
                 "rows": counts, "not_imported": repeated, "lacking": lacking},
        "device": ", ".join(gpus) if gpus else "unknown",
        "rank": rank,
        "threads": {str(tid): name for tid, name in sorted(thread_names.items()) if tid in host},
    }
    if rank is not None:
        metadata["distributed"] = {"rank": rank}
    return rows, metadata


def _sorted_frame(parts: Sequence[Rows]) -> pd.DataFrame:
    """Every table's rows in one frame, sorted by start (stable): numbers and codes are put in
    order, and each text column is expanded by Arrow once, already in order."""
    if not parts:
        return pd.DataFrame()
    starts = np.concatenate([part[col.START_NS] for part in parts])
    order = np.argsort(starts, kind="stable")
    columns: dict[str, Any] = {}
    sizes = [len(part[col.START_NS]) for part in parts]
    for name in dict.fromkeys(name for part in parts for name in part):
        found = [part.get(name) for part in parts]
        if any(isinstance(values, Coded) for values in found):
            codes, values, offset = [], [], 0
            for size, column in zip(sizes, found):
                if column is None:
                    codes.append(np.full(size, -1, dtype=np.int64))
                    continue
                codes.append(np.where(column.codes < 0, -1, column.codes + offset))
                values.extend(column.values)
                offset += len(column.values)
            columns[name] = strings_at(np.concatenate(codes)[order], values)
        elif all(isinstance(values, np.ndarray) and values.dtype == np.int64 for values in found):  # times
            columns[name] = np.concatenate([np.asarray(values) for values in found])[order]
        else:  # integers that may be null, as float64 with NaN for null (exact below 2**53)
            floats = np.concatenate([np.full(size, np.nan) if column is None else np.asarray(column, dtype=np.float64)
                                     for size, column in zip(sizes, found)])[order]
            missing = np.isnan(floats)
            columns[name] = nullable_ints(np.where(missing, 0, floats).astype(np.int64), missing)
    return pd.DataFrame(columns, copy=False)


def load_nsys(path: str | os.PathLike[str]) -> Trace:
    """Read an Nsight Systems SQLite export into an :class:`xsp.Trace`.

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: not an SQLite file, not an Nsight Systems export, or one of a schema
            xsp does not read.
    """
    source = Path(path)
    if source.is_dir():
        raise TraceFormatError(f"{source} is a directory, not a trace file")
    if not source.is_file():
        raise TraceNotFoundError(f"no such trace file: {source}")
    with closing(connect(source)) as connection:
        try:
            rows, metadata = nsys_rows(connection, source)
        except sqlite3.DatabaseError as exc:
            raise TraceFormatError(f"{source} is not an Nsight Systems export xsp can read: {exc}") from None
    frames: Iterator[pd.DataFrame] = iter([rows])
    del rows
    result = build_table(frames, 0, new_step_state(attach_to_session=False), live_records=False)
    spans = result.spans
    present = set(spans[col.LEVEL].unique()) if len(spans) else set()
    not_imported = metadata["nsys"]["not_imported"]
    lost = {f"Nsight Systems {what}": count for what, count in not_imported.items() if what.endswith(IMPOSSIBLE_TIMES)}
    metadata = {**metadata, "schema_version": col.SCHEMA_VERSION, "xsp_version": __version__,
                "imported_from": str(source), "levels": [level.value for level in Level if level.value in present],
                "hierarchy": result.diagnostics, "dropped": lost, "service_name": source.name.split(".")[0]}
    if lost:  # every command that reads the export says so, not only xsp import
        warn(XspWarning(f"{source}: {', '.join(f'{count} {what}' for what, count in lost.items())} "
                                 "were left out"))
    for lack in metadata["nsys"]["lacking"] if len(spans) else []:
        warn(XspWarning(f"{source} has {lack}"))
    return Trace(spans=spans, metadata=metadata)
