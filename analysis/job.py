"""A distributed job's cross-rank tables, read from its rank files without loading them.

A job of 1,024 ranks is 1,024 trace files; loaded whole it would need the memory of all of them.
Its cross-rank figures (:func:`xsp.analysis.stragglers`, :func:`xsp.analysis.rank_steps`,
:func:`xsp.analysis.communication`, :func:`xsp.analysis.clock_offsets`,
:func:`xsp.analysis.collective_skew`)
read few of its spans: the collectives, each step's root and, for the overlap of communication
with computation, only where each rank computed. DuckDB reads those from the files (their
columns, without the rest) into a small table of the same columns:

* every collective span (Python calls, enqueueing calls, the backend's work, NCCL kernels), whole;
* each step's root, whole;
* where each rank computed while it communicated, in each step: the union of its computing spans
  (kernels other than NCCL's where it has some, else operators other than communication) cut to
  its collectives' time, as ``kernel`` spans ``xsp.busy`` (the overlap of communication with
  computation is all that the tables read of computing time), and one empty one saying that the
  rank computed at all;
* each rank's first span, and its first ``DistributedDataParallel`` span, so that every rank and
  what it ran are known.

The functions above give the same figures on this table as on the whole job (the tests compare
them), in memory that grows with the ranks and collectives, not with the spans. Each file's pages
are checked against their checksums as it is read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp.analysis.distributed import BACKEND_WORK, ENQUEUE, NCCL_KERNEL, collectives
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, first_line, imported_duckdb
from xsp.core.rank import PART_FILE, rank_files
from xsp.io.loading import (
    JobMember,
    job_layout,
    noting_missing_ranks,
    rank_of_metadata,
    traces_in,
)
from xsp.io.parquet import check_span_columns, read_trace_metadata
from xsp.io.trace import Trace
from xsp.table.build import conform

BUSY: Final = "xsp.busy"
"""The name of a stretch of a rank's computing time in a job's table."""
DUCKDB_MEMORY_MB: Final = 1024
_STEP_KIND_VALUES = sorted(kind.value for kind in col.STEP_KINDS)
JOB_COLUMNS: Final = (col.SPAN_ID, col.PARENT_ID, col.RANK, col.LEVEL, col.KIND, col.NAME, col.STEP, col.THREAD_ID,
                      col.START_NS, col.END_NS, col.DURATION_NS, col.BYTES, col.INPUT_SHAPES, col.ATTRIBUTES,
                      col.MODULE_TYPE, col.CALL_DEPTH)
"""The columns of a job's table: what its cross-rank tables read."""


def job_files(path: str | os.PathLike[str]) -> tuple[list[Path], bool] | None:
    """The trace files of the job ``path`` names, and whether only the newest job's are meant: a
    folder of xsp traces, or the name a job's ranks wrote their files beside (``ddp.xsp.parquet``
    for ``ddp.rank0.xsp.parquet``, ...). None where it names no job of several xsp trace files (one
    file, a folder of profiler traces, a trace written in parts)."""
    given = Path(path)
    if given.is_dir():
        try:
            files, newest = traces_in(given), False
        except TraceFormatError:
            return None
    elif not given.exists():
        files, newest = list(rank_files(given).values()), True
    else:
        return None
    if len(files) < 2 or not all(f.name.endswith(col.FILE_SUFFIX) and not PART_FILE.match(f.name) for f in files):
        return None
    return files, newest


def _member(file: Path) -> tuple[JobMember, list[str]]:
    """What joining ``file`` into its job takes from it, and its columns; its pages' checksums
    verified on the way (DuckDB, which reads it next, verifies none)."""
    metadata, parquet = read_trace_metadata(file)
    schema = parquet.schema_arrow
    check_span_columns(file, schema)
    first_start = last_end = None
    ranks: set[int] = set()
    try:
        for batch in parquet.iter_batches(columns=[c for c in JOB_COLUMNS if c in schema.names], batch_size=1 << 16):
            if batch.num_rows:
                low, high = pc.min(batch[col.START_NS]).as_py(), pc.max(batch[col.END_NS]).as_py()
                first_start = low if first_start is None else min(first_start, low)
                last_end = high if last_end is None else max(last_end, high)
            if col.RANK in batch.schema.names:
                ranks.update(int(rank) for rank in pc.unique(batch[col.RANK].drop_null()).to_pylist())
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceFormatError(f"{file} is corrupt: {exc}") from None
    in_spans = sorted(ranks) if rank_of_metadata(metadata) is None else []
    return JobMember(file, metadata, in_spans, first_start, last_end), schema.names


def load_job(path: str | os.PathLike[str]) -> Trace | None:
    """The job ``path`` names (:func:`job_files`) as a trace of the spans its cross-rank tables
    read (see the module's docstring), with the metadata :func:`xsp.load` gives the whole job;
    None where ``path`` names no job of several xsp trace files, or where one file of it is left.

    Raises:
        TraceFormatError: a file is not a readable trace, or the files hold several jobs (a
            folder), or two files of one rank.
    """
    found = job_files(path)
    if found is None:
        return None
    files, newest = found
    read = [_member(file) for file in files]
    layout = job_layout([member for member, _ in read], newest_job=newest)
    if len(layout.members) < 2:
        return None
    kept = {id(member) for member in layout.members.values()}
    present = {name for member, names in read if id(member) in kept for name in names}
    duckdb = imported_duckdb()

    try:
        spans = _job_rows({rank: member.file for rank, member in layout.members.items()}, present)
    except duckdb.Error as exc:
        raise TraceFormatError(f"{path}: its rank files could not be read together ({first_line(exc)})") from None
    return noting_missing_ranks(Trace(spans=spans, metadata=layout.metadata), sorted(layout.members))


def _regex(pattern: Any) -> str:
    return "'" + str(pattern.pattern).replace("'", "''") + "'"


_COMM_PREFIXES: Final = ("nccl", "c10d::", "gloo:", "mpi:", "ucc:", "xccl:", "hccl:")
"""What every communication span's name begins with (the patterns are tried on those alone)."""


def _job_rows(files: dict[int, Path], present: set[str]) -> pd.DataFrame:
    """The rows of the job's files that its cross-rank tables read (DuckDB, within its memory
    limit, spilling past it): the collectives, step roots and each rank's first and DDP spans
    whole, and the stretches of time each rank computed."""
    import tempfile

    import duckdb  # only for a job read from its files

    with tempfile.TemporaryDirectory(prefix="xsp-job-") as spill:
        connection = duckdb.connect(config={"memory_limit": f"{DUCKDB_MEMORY_MB}MB",
                                            "threads": min(os.cpu_count() or 1, 4), "temp_directory": spill,
                                            "preserve_insertion_order": False})
        try:
            connection.execute("SET enable_progress_bar = false")  # the library prints nothing
            return _rows_read(connection, files, present)
        finally:
            connection.close()


def _rows_read(connection: Any, files: dict[int, Path], present: set[str]) -> pd.DataFrame:
    connection.register("ranks", pa.table({"file": [str(path) for path in files.values()],
                                           "job_rank": pa.array(list(files), type=pa.int64())}))
    connection.read_parquet([str(path) for path in files.values()], filename=True, file_row_number=True,
                            union_by_name=True).create_view("raw")
    prefixed = " OR ".join(f"starts_with(name, '{prefix}')" for prefix in _COMM_PREFIXES)
    comm = (f"coalesce(kind = '{col.SpanKind.COLLECTIVE.value}' OR (({prefixed}) AND ("
            f"regexp_matches(name, {_regex(BACKEND_WORK)}) OR regexp_matches(name, {_regex(ENQUEUE)}) "
            f"OR regexp_matches(name, {_regex(NCCL_KERNEL)}))), false)")
    kernel = f"coalesce(level = '{col.Level.KERNEL.value}' AND kind = '{col.SpanKind.KERNEL.value}', false)"
    operator = f"coalesce(level = '{col.Level.OPERATOR.value}' AND kind = '{col.SpanKind.OPERATOR.value}', false)"
    root = (f"coalesce({col.PARENT_ID} IS NULL AND {col.STEP} IS NOT NULL AND kind IN "
            f"({', '.join(repr(k) for k in _STEP_KIND_VALUES)}), false)")
    ranked = "raw JOIN ranks ON raw.filename = ranks.file"
    whole = ", ".join([*(f"raw.{name}" if name in present else f"NULL AS {name}" for name in JOB_COLUMNS
                         if name != col.RANK), f"ranks.job_rank AS {col.RANK}", "file_row_number"])
    kept = connection.sql(f"SELECT {whole} FROM {ranked} WHERE {comm} OR {root} OR file_row_number = 0"
                          ).to_arrow_table()
    ddp = connection.sql(f"SELECT {whole} FROM {ranked} LIMIT 0").to_arrow_table() if col.MODULE_TYPE not in present \
        else connection.sql(f"""
        SELECT {whole} FROM {ranked}
        WHERE {col.MODULE_TYPE} = 'DistributedDataParallel' AND NOT ({comm} OR {root} OR file_row_number = 0)
        QUALIFY row_number() OVER (PARTITION BY ranks.job_rank ORDER BY file_row_number) = 1""").to_arrow_table()
    whole_rows = pa.concat_tables([kept, ddp], promote_options="permissive")
    # where each rank computed matters only where it communicated (the overlap of the two): its
    # computing time is kept where it meets a collective of its step, whichever way the report
    # times communication, and one empty stretch says that the rank computed at all
    communicated = collectives(_frame(whole_rows))
    connection.register("communicated", pa.table({
        col.RANK: pa.array(communicated["rank"].to_numpy(dtype=np.int64)),
        "step_key": pa.array(communicated["step"].to_numpy(dtype=np.int64)),
        col.START_NS: pa.array(communicated["start_ns"].to_numpy(dtype=np.int64)),
        col.END_NS: pa.array(communicated["end_ns"].to_numpy(dtype=np.int64))}))
    stretches = connection.sql(f"""
        WITH narrow AS (SELECT ranks.job_rank AS {col.RANK}, coalesce({col.STEP}, -1) AS step_key,
                               {col.START_NS}, {col.END_NS}, {comm} AS comm, {kernel} AS kernel, {operator} AS operator
                        FROM {ranked}),
        computes AS (SELECT {col.RANK}, bool_or(kernel AND NOT comm) AS on_gpu FROM narrow GROUP BY {col.RANK}),
        busy AS (SELECT n.{col.RANK}, n.step_key, n.{col.START_NS}, n.{col.END_NS} FROM narrow n
                 JOIN computes c ON n.{col.RANK} = c.{col.RANK}
                 WHERE NOT n.comm AND ((c.on_gpu AND n.kernel) OR (NOT c.on_gpu AND n.operator))),
        {_stretches("busy", "busy_stretch")},
        {_stretches("communicated", "comm_stretch")},
        met AS (SELECT b.{col.RANK}, b.step_key, greatest(b.{col.START_NS}, c.{col.START_NS}) AS {col.START_NS},
                       least(b.{col.END_NS}, c.{col.END_NS}) AS {col.END_NS}
                FROM busy_stretch b JOIN comm_stretch c ON b.{col.RANK} = c.{col.RANK} AND b.step_key = c.step_key
                 AND b.{col.START_NS} < c.{col.END_NS} AND c.{col.START_NS} < b.{col.END_NS}),
        computed AS (SELECT {col.RANK}, arg_min(step_key, {col.START_NS}) AS step_key,
                            min({col.START_NS}) AS {col.START_NS}, min({col.START_NS}) AS {col.END_NS}
                     FROM busy GROUP BY {col.RANK})
        SELECT {col.RANK}, CASE WHEN step_key = -1 THEN NULL ELSE step_key END AS {col.STEP}, {col.START_NS},
               {col.END_NS}
        FROM (SELECT * FROM met UNION ALL SELECT * FROM computed)""").to_arrow_table()
    count = len(stretches)
    stretches = stretches.append_column(col.LEVEL, pa.array([col.Level.KERNEL.value] * count)).append_column(
        col.KIND, pa.array([col.SpanKind.KERNEL.value] * count)).append_column(
        col.NAME, pa.array([BUSY] * count)).append_column(
        col.PARENT_ID, pa.array(np.full(count, -1, dtype=np.int64))).append_column(
        col.SPAN_ID, pa.array(-1 - np.arange(count, dtype=np.int64))).append_column(
        col.DURATION_NS, pc.subtract(stretches[col.END_NS], stretches[col.START_NS]))
    table = pa.concat_tables([whole_rows, stretches], promote_options="permissive")
    # in the order of the whole job's table: by start, then rank, then each file's own order
    keys = pa.table({"start": table[col.START_NS], "rank": table[col.RANK],
                     "depth": pc.fill_null(pc.cast(table[col.CALL_DEPTH], pa.int64()), -1),
                     "row": pc.fill_null(table["file_row_number"], np.iinfo(np.int64).max)})
    order = pc.sort_indices(keys, sort_keys=[("start", "ascending"), ("rank", "ascending"), ("depth", "ascending"),
                                             ("row", "ascending")])
    return _frame(table.take(order))


def _stretches(source: str, name: str) -> str:
    """SQL: the union of the intervals of ``source`` per rank and step, as the CTE ``name``."""
    return f"""{name} AS (
        SELECT {col.RANK}, step_key, min({col.START_NS}) AS {col.START_NS}, max({col.END_NS}) AS {col.END_NS}
        FROM (SELECT *, sum(CASE WHEN reach IS NULL OR {col.START_NS} > reach THEN 1 ELSE 0 END) OVER (
                            PARTITION BY {col.RANK}, step_key ORDER BY {col.START_NS}, {col.END_NS}
                            ROWS UNBOUNDED PRECEDING) AS stretch
              FROM (SELECT *, max({col.END_NS}) OVER (
                                  PARTITION BY {col.RANK}, step_key ORDER BY {col.START_NS}, {col.END_NS}
                                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach FROM {source}))
        GROUP BY {col.RANK}, step_key, stretch)"""


def _frame(table: pa.Table) -> pd.DataFrame:
    """Rows read as a span table of the job's columns, the schema's dtypes."""
    frame = table.drop_columns([c for c in table.column_names if c not in JOB_COLUMNS]).to_pandas(
        types_mapper={pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int64Dtype()}.get)
    return conform(frame, JOB_COLUMNS)
