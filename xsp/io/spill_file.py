"""A scratch Parquet file written a table at a time, for DuckDB to read at the end: how the
analyses of a trace too large to load keep on disk what they cannot hold."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class SpillFile:
    """Tables of one schema written to ``path`` as they come, uncompressed (DuckDB reads it once,
    soon): the file (and its folder) is made at the first table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: pq.ParquetWriter | None = None
        self._written = False

    def add(self, table: pa.Table) -> None:
        """Append ``table``."""
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="none")
        self._writer.write_table(table)
        self._written = True

    def close(self) -> bool:
        """Finish the file; whether it holds any table (none: no file)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self._written


__all__ = ["SpillFile"]
