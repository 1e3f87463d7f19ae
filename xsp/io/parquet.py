"""The canonical ``.xsp.parquet`` file: the span table plus metadata in Parquet key-value metadata."""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.errors import SchemaVersionError, TraceFormatError, TraceNotFoundError, XspWarning, warn
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.lazy import pyarrow_compute as pc
from xsp.core.lazy import pyarrow_parquet as pq
from xsp.io.outputs import beside, describe_os_error, write_output
from xsp.table.validation import impossible_spans, parents_not_in_the_table, session_span_elsewhere
from xsp.table.walks import arrow_strings, categorical, parent_positions

if TYPE_CHECKING:
    import concurrent.futures

_PARQUET_MAGIC = b"PAR1"
ARROW_SCHEMA_KEY: Final = b"ARROW:schema"
CHECKSUM_KEY = b"xsp.checksum"
"""Parquet key-value metadata key of the footer checksum (see :func:`_footer_checksum`)."""


GZIP_MAGIC: Final = b"\x1f\x8b"
"""The first bytes of a gzip member."""


def gunzip_bounded(data: bytes, cap_bytes: int) -> tuple[bytes, bool]:
    """Inflate gzip ``data``, stopping past ``cap_bytes`` (a decompression bomb never takes the
    machine's memory). Returns what was inflated (longer than ``cap_bytes`` when stopped there)
    and whether the gzip stream was complete; a damaged stream raises ``zlib.error``. Members
    one after another (files concatenated, blocked gzip) are one text, as gzip reads them;
    bytes after the last member that begin no other are ignored."""
    pieces: list[bytes] = []
    size = 0
    rest = data
    while True:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        piece = inflater.decompress(rest, cap_bytes + 1 - size)
        pieces.append(piece)
        size += len(piece)
        rest = inflater.unused_data
        if size > cap_bytes or not inflater.eof or not rest.startswith(GZIP_MAGIC):
            return b"".join(pieces), inflater.eof


TEXT_DTYPES: Final = frozenset({"string", col.CATEGORY})
"""Schema dtypes stored as text in the file (a categorical's texts are written out: readers of
the file, and Arrow consumers of its tables, see plain strings)."""


def canonical_type(name: str, kind: pa.DataType) -> pa.DataType:
    """The Arrow type a column of the span schema is stored as (others keep ``kind``)."""
    dtype = col.COLUMNS.get(name)
    if dtype is None:
        return kind
    return pa.large_string() if dtype in TEXT_DTYPES else pa.int64()


PANDAS_KEY = b"pandas"


def pandas_metadata(columns: pa.Schema) -> bytes:
    """What ``pandas.read_parquet`` reads the schema's dtypes from: without it a nullable integer
    column becomes float64, and 63-bit span ids in ``parent_id`` lose their last digits."""
    return _pandas_metadata(tuple(name for name in columns.names if name in col.COLUMNS))


@functools.lru_cache(maxsize=8)
def _pandas_metadata(known: tuple[str, ...]) -> bytes:
    """:func:`pandas_metadata` of the schema's columns ``known`` (made once: it takes tens of
    milliseconds, a short child process's whole trace)."""
    from xsp.table.build import empty_table

    # the file holds the categoricals' texts: pandas reads them as the "string" columns they are
    empty = empty_table()[list(known)].astype({name: "string" for name in known if col.COLUMNS[name] == col.CATEGORY})
    return pa.Schema.from_pandas(empty, preserve_index=False).metadata[PANDAS_KEY]  # type: ignore[no-any-return]


def arrow_table(spans: pd.DataFrame, in_order: bool = False, dictionaries: bool = False) -> pa.Table:
    """``spans`` as an Arrow table with the schema's storage types and no pandas metadata;
    ``in_order``: its rows sorted by start, outer module calls first (:func:`in_start_order`),
    before the categoricals' codes become texts (a text column costs far more to sort).
    ``dictionaries``: categoricals stay Arrow dictionaries (a session's windows on disk, which
    :func:`canonical_table` makes texts when they are read back)."""
    try:
        table = pa.Table.from_pandas(spans, preserve_index=False)
    except RuntimeError:  # Python refuses thread-pool work once it has begun to exit: converted on this thread
        table = pa.Table.from_pandas(spans, preserve_index=False, nthreads=1)
    if in_order:
        table = in_start_order(table)
    schema = pa.schema([pa.field(f.name, f.type if dictionaries and pa.types.is_dictionary(f.type)
                                 else canonical_type(f.name, f.type)) for f in table.schema])
    return table.replace_schema_metadata(None).cast(schema)


def canonical_schema(schema: pa.Schema) -> pa.Schema:
    """The storage types of ``schema``'s columns: dictionaries made their texts."""
    return pa.schema([pa.field(f.name, canonical_type(f.name, f.type.value_type if pa.types.is_dictionary(f.type)
                                                      else f.type)) for f in schema])


def canonical_table(table: pa.Table) -> pa.Table:
    """``table`` with the storage types of :func:`canonical_schema`."""
    schema = canonical_schema(table.schema)
    return table if schema.equals(table.schema) else table.cast(schema)


def in_start_order(table: pa.Table) -> pa.Table:
    """Spans sorted by start, outer module calls first (sorted in Arrow, without Python's lock)."""
    keys = {name: pc.fill_null(table[name], -1)  # spans without a call depth first
            for name in (col.START_NS, col.CALL_DEPTH) if name in table.column_names}
    order = pc.sort_indices(pa.table(keys), sort_keys=[(name, "ascending") for name in keys])
    if pc.all(pc.equal(order, pa.array(np.arange(len(order), dtype=np.uint64)))).as_py() is not False:
        return table  # in order already (a window built in order): nothing to take
    return table.take(order)


def write_trace(path: str | os.PathLike[str], spans: pd.DataFrame, metadata: dict[str, Any]) -> Path:
    """Write ``spans`` and ``metadata`` atomically (a partial file never replaces a good one),
    with page checksums that :func:`read_trace` verifies.

    Raises:
        OutputError: the file could not be written.
    """
    return write_trace_tables(path, iter([arrow_table(spans)]), metadata)


def statistics_columns(schema: pa.Schema) -> list[str]:
    """The columns whose min and max are kept in the footer: numbers (times, ids), which readers
    filter on; the min and max of JSON and path text would only swell the footer."""
    return [field.name for field in schema if not _is_text(field.type)]


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The columns written dictionary-encoded: text (names, kinds, paths repeat). Numbers are
    not: times and ids are nearly all distinct, and trying a dictionary for each page of them
    before giving up cost a quarter of the write (and zstd packs them smaller without one)."""
    return [field.name for field in schema if _is_text(field.type)]


def writer_options(schema: pa.Schema) -> dict[str, Any]:
    """How every xsp Parquet file of spans is written (the trace, its windows): zstd, page
    checksums that :func:`read_trace` verifies, statistics of the numbers, dictionaries of text."""
    return {"compression": "zstd", "write_page_checksum": True, "write_statistics": statistics_columns(schema),
            "use_dictionary": dictionary_columns(schema)}


def read_ahead(tables: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """``tables``, each read on a thread of its own while the one before it is written (Arrow
    lets Python's lock go as it reads and writes Parquet): the two take turns on two cores
    instead of one after the other. At most two tables are held at a time."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="xsp-read-ahead") as pool:
        upcoming = _read_next(pool, tables)
        while True:
            table = next(tables, None) if upcoming is None else upcoming.result()
            if table is None:
                return
            upcoming = _read_next(pool, tables)
            yield table


def _read_next(pool: concurrent.futures.ThreadPoolExecutor,
               tables: Iterator[pa.Table]) -> concurrent.futures.Future[pa.Table | None] | None:
    """The next of ``tables``, being read on ``pool``; None where Python refuses new thread-pool
    work (it has begun to exit: a session of ``xsp run`` that ends after the script's threads),
    and the caller reads it on its own thread."""
    try:
        return pool.submit(next, tables, None)
    except RuntimeError:
        return None


def write_trace_tables(path: str | os.PathLike[str], tables: Iterator[pa.Table],
                       metadata: dict[str, Any] | Callable[[], dict[str, Any]]) -> Path:
    """Write a trace from Arrow tables of spans, one row group each, holding one table at a time
    (and the next one being read: :func:`read_ahead`).

    The first table's columns are the file's; later tables are cast to them. Written
    atomically, with page checksums and the footer checksum, like :func:`write_trace`.
    ``metadata`` may be a function, called once ``tables`` are exhausted: the file is then
    written while the tables are still being made (the end of a run writes its windows while
    the last ones are interpreted), and the metadata put in its footer at the end (see
    :func:`_late_footer`).

    Raises:
        OutputError: the file could not be written.
    """
    tables = read_ahead(tables)
    first = next(tables, None)
    if first is None:
        from xsp.table.build import empty_table  # only for a trace with no span at all

        first = arrow_table(empty_table())
    columns = canonical_schema(first.schema)
    named = folder_named_columns(Path(path))
    if named:
        columns = pa.schema([field for field in columns if field.name not in named])
    pandas_json = pandas_metadata(columns)

    def footer(metadata_json: bytes, checksum: bytes | None = None) -> dict[bytes, bytes]:
        return {col.METADATA_KEY: metadata_json, PANDAS_KEY: pandas_json,
                CHECKSUM_KEY: checksum or _footer_checksum(metadata_json, columns, pandas_json)}

    if not callable(metadata):
        schema = columns.with_metadata(footer(json.dumps(metadata, default=str).encode()))
        return write_output(path, lambda temporary: _write_tables(temporary, schema, first, tables))
    known_late = metadata
    placeholder = footer(LATE_METADATA_PLACEHOLDER, LATE_CHECKSUM_PLACEHOLDER)

    def write(temporary: Path) -> None:
        _write_tables(temporary, columns.with_metadata(placeholder), first, tables)
        final = footer(json.dumps(known_late(), default=str).encode())
        if len(final[col.METADATA_KEY]) <= len(LATE_METADATA_PLACEHOLDER):
            final = footer(final[col.METADATA_KEY].ljust(len(LATE_METADATA_PLACEHOLDER)))  # JSON may end in spaces
            if _late_footer(temporary, placeholder, final):
                return
        rewritten = beside(temporary, "footer")  # larger than the room kept for it: the file is written again
        try:
            parquet = pq.ParquetFile(temporary)
            _write_tables(rewritten, columns.with_metadata(final), parquet.read_row_group(0),
                          (parquet.read_row_group(i) for i in range(1, parquet.num_row_groups)))
            os.replace(rewritten, temporary)
        finally:
            with contextlib.suppress(OSError):
                rewritten.unlink()

    return write_output(path, write)


def folder_named_columns(path: Path) -> set[str]:
    """The span columns that ``path``'s folders name, Hive style (``rank=0`` in a dataset of runs):
    a file there leaves them out. Readers of the dataset (pandas, pyarrow, Spark) take a column
    from the folder, and refused the file's own as another type (int64 against the folder's
    int32); ``xsp.load`` gives a rank's spans their rank from the file's metadata."""
    return {part.split("=", 1)[0] for part in path.parent.parts
            if "=" in part and part.split("=", 1)[0] in col.COLUMNS}


LATE_METADATA_PLACEHOLDER: Final = b'{"xsp": "metadata written at the end"}'.ljust(1 << 14)
"""The room kept in a footer for metadata known only once the spans are written (16 KiB: the
metadata of an operator-level run of millions of spans is a few KiB)."""
LATE_CHECKSUM_PLACEHOLDER: Final = b"@@@@@@@@"


def _write_tables(temporary: Path, schema: pa.Schema, first: pa.Table, tables: Iterator[pa.Table]) -> None:
    with pq.ParquetWriter(temporary, schema, **writer_options(schema)) as writer:
        writer.write_table(first.select(schema.names).cast(schema))
        for table in tables:
            if len(table):
                writer.write_table(table.select(schema.names).cast(schema))


def _late_footer(path: Path, placeholder: dict[bytes, bytes], final: dict[bytes, bytes]) -> bool:
    """Put ``final``'s values in ``path``'s footer where ``placeholder``'s are (each the same
    length): in the footer's key-value metadata and in the Arrow schema stored beside it (which
    pyarrow reads the schema's metadata from). Parquet writes its footer only when the file is
    closed, and pyarrow takes the schema's metadata when it is opened; the bytes are swapped in
    place, and the result read back. False (the file left unreadable as a trace) where the
    footer is not as expected."""
    try:
        stored = pq.read_metadata(path).metadata or {}
        arrow_schema = base64.b64decode(stored[ARROW_SCHEMA_KEY])
        with open(path, "r+b") as file:
            file.seek(-8, os.SEEK_END)
            length = int.from_bytes(file.read(4), "little")
            file.seek(-8 - length, os.SEEK_END)
            start = file.tell()
            footer = file.read(length)
            for key, old in placeholder.items():
                new = final[key]
                if old == new:
                    continue
                if len(new) != len(old) or arrow_schema.count(old) != 1 or footer.count(old) != 1:
                    return False
                arrow_schema = arrow_schema.replace(old, new)
                footer = footer.replace(old, new)
            encoded = base64.b64encode(arrow_schema)
            if len(encoded) != len(stored[ARROW_SCHEMA_KEY]) or footer.count(stored[ARROW_SCHEMA_KEY]) != 1:
                return False
            file.seek(start)
            file.write(footer.replace(stored[ARROW_SCHEMA_KEY], encoded))
        read_back = pq.ParquetFile(path)
        return ((read_back.schema_arrow.metadata or {}).get(col.METADATA_KEY) == final[col.METADATA_KEY]
                and (read_back.metadata.metadata or {}).get(col.METADATA_KEY) == final[col.METADATA_KEY])
    except (pa.ArrowException, OSError, ValueError, KeyError):
        return False


def _read_parquet(source: Path) -> tuple[pq.ParquetFile, dict[bytes, bytes]]:
    if source.is_dir():
        raise TraceFormatError(f"{source} is a directory, not a trace file")
    if not source.is_file():
        raise TraceNotFoundError(f"no such trace file: {source}")
    try:
        _check_parquet_framing(source)
        parquet = pq.ParquetFile(source, page_checksum_verification=True)
        return parquet, parquet.schema_arrow.metadata or {}
    except (pa.ArrowException, OSError, ValueError) as exc:  # a damaged footer fails in many ways
        raise TraceFormatError(f"{source} is corrupt: {exc}") from None


def _read_table(source: Path, parquet: pq.ParquetFile) -> pa.Table:
    try:
        table = parquet.read()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise TraceFormatError(f"{source} is corrupt: {exc}") from None
    check_span_columns(source, table.schema)
    return table


def read_arrow_trace(path: str | os.PathLike[str]) -> pa.Table:
    """The spans of a Parquet file of spans (a trace, or a session's segment) as Arrow, checked.

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: truncated, corrupt, or not a table of spans.
    """
    source = Path(path)
    parquet, _ = _read_parquet(source)
    return _read_table(source, parquet)


def _checked_metadata(source: Path, footer: dict[bytes, bytes]) -> dict[str, Any]:
    raw = footer.get(col.METADATA_KEY)
    if raw is None and col.SUMMARY_METADATA_KEY in footer:
        raise TraceFormatError(f"{source} is an xsp summary, which xsp diff reads as a run to compare (xsp diff "
                               f"{source} NEW): it holds per-key samples, not spans")
    if raw is None:
        raise TraceFormatError(f"{source} is a Parquet file but not an xsp trace (no xsp metadata)")
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError):
        raise TraceFormatError(f"{source} has unreadable xsp metadata") from None
    if not isinstance(metadata, dict):
        raise TraceFormatError(f"{source} has xsp metadata that is not a JSON object")
    version = metadata.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise TraceFormatError(f"{source} has no schema version in its xsp metadata")
    if version > col.SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{source} uses span schema {version}, newer than this xsp's {col.SCHEMA_VERSION}: "
            "upgrade xsp to read it")
    return metadata


def read_trace_metadata(path: str | os.PathLike[str]) -> tuple[dict[str, Any], pq.ParquetFile]:
    """A trace file's metadata, checked as :func:`read_trace` checks it, and the file, open to read
    columns from; its spans are not read.

    Raises:
        TraceNotFoundError: no such file.
        TraceFormatError: not an xsp trace, truncated or corrupt.
        SchemaVersionError: written by a newer xsp with a newer span schema.
    """
    source = Path(path)
    parquet, footer = _read_parquet(source)
    metadata = _checked_metadata(source, footer)
    expected = footer.get(CHECKSUM_KEY)
    if expected is not None and expected != _footer_checksum(footer[col.METADATA_KEY], parquet.schema_arrow,
                                                             footer.get(PANDAS_KEY, b"")):
        raise TraceFormatError(f"{source} is corrupt: its xsp metadata or column list fails its checksum")
    return metadata, parquet


def read_trace(path: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read a trace written by :func:`write_trace`.

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: not an xsp trace, truncated or corrupt.
        SchemaVersionError: written by a newer xsp with a newer span schema.
    """
    source = Path(path)
    metadata, parquet = read_trace_metadata(source)
    # the categoricals' texts are read as Arrow dictionaries: each distinct text once, never a string a row
    stored = parquet.schema_arrow  # the types as written (a text column read as a dictionary is text there)
    categories = [name for name in stored.names if col.COLUMNS.get(name) == col.CATEGORY]
    if categories:
        try:
            parquet = pq.ParquetFile(source, page_checksum_verification=True, read_dictionary=categories)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceFormatError(f"{source} is corrupt: {exc}") from None
    table = _read_table(source, parquet)
    owner = [table]
    del table
    spans = spans_from_owned_arrow(source, owner)
    parents = parent_positions(spans)  # once, for both checks (an argsort of every id)
    refuse_impossible_spans(source, spans, parents)
    orphans = parents_not_in_the_table(spans, parents, session_span_elsewhere(metadata))
    if orphans:
        warn(XspWarning(f"{source}: {orphans} spans name a parent that is not in the file (cut short, or "
                                 "spans left out of it): they are read as roots"))
    return spans, metadata


def refuse_impossible_spans(source: Path, spans: pd.DataFrame, parents: np.ndarray) -> None:
    """Refuse a table of spans that no recording can hold (``parents``: its
    :func:`xsp.table.walks.parent_positions`).

    Raises:
        TraceFormatError: one line, saying what is impossible.
    """
    impossible = impossible_spans(spans, parents)
    if impossible:
        raise TraceFormatError(f"{source} holds spans no recording can ({'; '.join(impossible)}): damaged, or "
                               "not written by xsp as it is; not read")


def _footer_checksum(metadata_json: bytes, schema: pa.Schema, pandas_json: bytes = b"") -> bytes:
    """CRC-32 of the xsp metadata, the column names and types and the pandas metadata (files
    written before it had none): the parts of the footer that Parquet's page checksums do not
    cover and that readers rely on."""
    columns = "\n".join(f"{field.name}:{field.type}" for field in schema).encode()
    return b"%08x" % zlib.crc32(pandas_json, zlib.crc32(columns, zlib.crc32(metadata_json)))


def spans_from_arrow(source: Path, table: pa.Table) -> pd.DataFrame:
    """The span table with the schema's dtypes, from the Arrow types alone (the pandas metadata
    in the footer is ignored: a damaged copy of it would change dtypes or names unnoticed),
    sorted by start (a file written window by window is sorted within each window only)."""
    return spans_from_owned_arrow(source, [table])


def spans_from_owned_arrow(source: Path, owner: list[pa.Table]) -> pd.DataFrame:
    """:func:`spans_from_arrow` of the one table in ``owner``, which it takes out: each Arrow
    column is let go once converted (the numbers are copied out of Arrow's read-only buffers, so
    that the table can be changed in place), so no column is held twice. Hand it a table
    nothing else refers to."""
    table = owner.pop()
    for position, field in enumerate(table.schema):  # a column of nulls only, typed so by another writer
        if pa.types.is_null(field.type) and field.name in col.COLUMNS:
            kind = pa.large_string() if col.COLUMNS[field.name] in TEXT_DTYPES else pa.int64()
            table = table.set_column(position, field.name, pa.nulls(len(table), kind))
    starts = table[col.START_NS].to_numpy() if col.START_NS in table.column_names else np.zeros(0)
    if len(starts) > 1 and not (starts[1:] >= starts[:-1]).all():
        table = in_start_order(table)
    del starts
    names, arrow_columns = table.column_names, table.columns
    del table
    columns = {}
    for index, name in enumerate(names):
        column, arrow_columns[index] = arrow_columns[index], None
        dtype = col.COLUMNS.get(name)
        if dtype == col.CATEGORY:
            columns[name] = categorical(column)
        elif dtype == "string" or (dtype is None and _is_text(column.type)):
            columns[name] = arrow_strings(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0))
        elif dtype == "int64":
            if column.null_count:
                raise TraceFormatError(f"{source} is corrupt: column {name} has missing values")
            columns[name] = np.array(column.to_numpy(), dtype=np.int64)  # a copy of its own: writable
        elif dtype == "Int64":
            if not pa.types.is_integer(column.type):
                raise TraceFormatError(f"{source} is corrupt: column {name} holds {column.type}, not integers")
            values = column.to_numpy(zero_copy_only=False) if not column.null_count else (
                column.fill_null(0).to_numpy())
            columns[name] = pd.arrays.IntegerArray(np.array(values, dtype=np.int64),
                                                   np.array(column.is_null().to_numpy(zero_copy_only=False)))
        else:
            columns[name] = column.to_pandas()
        del column
    left_out = [name for name in col.COLUMNS if name not in columns]
    if left_out:  # known columns another writer left out: null, as xsp writes them
        from xsp.table.build import null_column

        count = len(next(iter(columns.values()))) if columns else 0
        for name in left_out:
            columns[name] = null_column(col.COLUMNS[name], count)
    return pd.DataFrame(columns, copy=False)


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def check_span_columns(source: Path, schema: pa.Schema) -> None:
    """Every required column present, every known column of its schema type.

    Raises:
        TraceFormatError: a column is missing or of another type.
    """
    missing = [name for name in col.REQUIRED_COLUMNS if name not in schema.names]
    if missing:
        raise TraceFormatError(f"{source} lacks span columns: {', '.join(missing)}")
    for name in schema.names:
        dtype = col.COLUMNS.get(name)
        if dtype is None:
            continue
        kind = schema.field(name).type
        fits = pa.types.is_null(kind) or (_is_text(kind) if dtype in TEXT_DTYPES else pa.types.is_integer(kind))
        if not fits:
            raise TraceFormatError(f"{source} is corrupt: column {name} holds {kind}, not {dtype}")


APPENDED_SEARCH_BYTES: Final = 64 << 20
"""How far back from a file's end the end of its Parquet data is looked for (something appended)."""


def _parquet_end_before(handle: Any, size: int) -> int | None:
    """Where a Parquet file's data ends, when more was written after it: the last "PAR1" within
    :data:`APPENDED_SEARCH_BYTES` of the end whose footer length before it fits the file. None
    where there is none (then the file is cut short, not added to)."""
    start = max(size - APPENDED_SEARCH_BYTES, 0)
    handle.seek(start)
    tail = handle.read(size - start)
    at = len(tail)
    while (at := tail.rfind(_PARQUET_MAGIC, 0, at)) >= 0:
        end = start + at + 4
        if at >= 4:
            footer_bytes = int.from_bytes(tail[at - 4:at], "little")
            if 0 < footer_bytes <= at - 4 and _is_footer(tail[at - 4 - footer_bytes:at + 4]):
                return end
    return None


def _is_footer(footer: bytes) -> bool:
    """Whether ``footer`` (the metadata, its length, "PAR1") is a Parquet file's footer: parsed,
    not guessed from its magic alone."""
    try:
        pq.read_metadata(pa.BufferReader(_PARQUET_MAGIC + footer))
    except (pa.ArrowException, OSError, ValueError):
        return False
    return True


def _check_parquet_framing(source: Path) -> None:
    try:
        size = source.stat().st_size
        handle = source.open("rb")
    except OSError as exc:
        raise TraceFormatError(f"{source} cannot be read: {describe_os_error(exc)}") from None
    with handle:
        head = handle.read(4)
        if head != _PARQUET_MAGIC:
            raise TraceFormatError(f"{source} is not an xsp trace (not a Parquet file)")
        handle.seek(max(size - 8, 0))
        last = handle.read(8)
        footer_fits = size >= 12 and 0 < int.from_bytes(last[:4], "little") <= size - 12
        if size < 12 or last[4:] != _PARQUET_MAGIC or not footer_fits:
            end = _parquet_end_before(handle, size)
            if end is not None:
                raise TraceFormatError(f"{source} has {size - end:,} bytes after the end of its Parquet data "
                                       f"(at byte {end:,}): something was appended to the trace")
            raise TraceFormatError(f"{source} is truncated (no Parquet footer)")
