"""The canonical ``.xsp.parquet`` file: the span table plus metadata in Parquet key-value metadata."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from xsp import schema as col
from xsp.errors import SchemaVersionError, TraceFormatError

_PARQUET_MAGIC = b"PAR1"


def write_trace(path: str | os.PathLike[str], spans: pd.DataFrame, metadata: dict[str, Any]) -> Path:
    """Write ``spans`` and ``metadata`` atomically (a partial file never replaces a good one)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(spans, preserve_index=False)
    existing = table.schema.metadata or {}
    table = table.replace_schema_metadata(
        {**existing, col.METADATA_KEY: json.dumps(metadata, default=str).encode()})
    partial = target.with_name(target.name + ".partial")
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, target)
    return target


def read_trace(path: str | os.PathLike[str]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Read a trace written by :func:`write_trace`.

    Raises:
        FileNotFoundError: no such file.
        TraceFormatError: not an xsp trace, truncated or corrupt.
        SchemaVersionError: written by a newer xsp with a newer span schema.
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no such trace file: {source}")
    _check_parquet_framing(source)
    try:
        parquet = pq.ParquetFile(source)
        raw = (parquet.schema_arrow.metadata or {}).get(col.METADATA_KEY)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{source} is corrupt: {exc}") from None
    if raw is None:
        raise TraceFormatError(f"{source} is a Parquet file but not an xsp trace (no xsp metadata)")
    try:
        metadata = json.loads(raw)
    except ValueError:
        raise TraceFormatError(f"{source} has unreadable xsp metadata") from None
    version = metadata.get("schema_version")
    if not isinstance(version, int):
        raise TraceFormatError(f"{source} has no schema version in its xsp metadata")
    if version > col.SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{source} uses span schema {version}, newer than this xsp's {col.SCHEMA_VERSION}: "
            "upgrade xsp to read it")
    try:
        spans = parquet.read().to_pandas()
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"{source} is corrupt: {exc}") from None
    missing = [name for name in col.REQUIRED_COLUMNS if name not in spans]
    if missing:
        raise TraceFormatError(f"{source} lacks span columns: {', '.join(missing)}")
    return spans, metadata


def _check_parquet_framing(source: Path) -> None:
    size = source.stat().st_size
    with source.open("rb") as handle:
        head = handle.read(4)
        if head != _PARQUET_MAGIC:
            raise TraceFormatError(f"{source} is not an xsp trace (not a Parquet file)")
        handle.seek(max(size - 4, 0))
        if size < 12 or handle.read(4) != _PARQUET_MAGIC:
            raise TraceFormatError(f"{source} is truncated (no Parquet footer)")
