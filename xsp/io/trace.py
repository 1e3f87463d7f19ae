"""``xsp.Trace``: a span table with its metadata (``xsp.load`` reads one: :mod:`xsp.io.loading`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.io.parquet import read_trace, write_trace, write_trace_tables


class Trace:
    """One profiling session: ``spans`` (the canonical span table) and ``metadata``.

    Attributes:
        spans: one row per span, columns as in :mod:`xsp.core.schema`. A session that streamed its
            windows to its file reads them from there the first time they are asked for, so a
            long run's spans take memory only when used.
        metadata: versions, host, device, levels, clock offsets, dropped counts, warnings.
    """

    def __init__(self, spans: pd.DataFrame | None = None, metadata: dict[str, Any] | None = None, *,
                 source: str | os.PathLike[str] | None = None) -> None:
        if spans is None and source is None:
            raise ValueError("a Trace needs its spans or the file that holds them")
        self._spans = spans
        self.source = None if source is None else Path(source)
        """The file the spans are read from when first asked for (None: they are in memory)."""
        self.metadata: dict[str, Any] = {} if metadata is None else metadata

    @property
    def spans(self) -> pd.DataFrame:
        if self._spans is None:
            assert self.source is not None
            self._spans = read_trace(self.source)[0]
        return self._spans

    @spans.setter
    def spans(self, value: pd.DataFrame) -> None:
        self._spans = value

    def columns(self, names: list[str]) -> pd.DataFrame:
        """Some columns of the span table; read alone from the file (in one read) while the spans
        are not in memory: counting a long run's steps does not load its millions of spans."""
        if self._spans is not None or self.source is None:
            return self.spans[names]
        import pyarrow.parquet as pq

        return pq.read_table(self.source, columns=names).to_pandas()

    def level(self, level: Level | str) -> pd.DataFrame:
        """The spans of one level."""
        value = Level(level).value
        return self.spans[self.spans[col.LEVEL] == value]

    @property
    def steps(self) -> list[int]:
        """Step numbers present in the trace."""
        return sorted(int(s) for s in self.spans[col.STEP].dropna().unique())

    @property
    def ranks(self) -> list[int]:
        """The ranks of a distributed job whose spans the trace holds (empty for one process)."""
        spans = self.spans
        if col.RANK not in spans:
            return []
        return sorted(int(r) for r in spans[col.RANK].dropna().unique())

    def for_rank(self, rank: int) -> Trace:
        """The trace of one rank of a distributed job (as its own file holds it).

        Raises:
            KeyError: the trace holds no spans of ``rank``.
        """
        if rank not in self.ranks:
            raise KeyError(f"the trace holds no spans of rank {rank} (ranks: {self.ranks or 'none'})")
        spans = self.spans[self.spans[col.RANK] == rank].reset_index(drop=True)
        metadata = self.metadata.get("ranks", {}).get(str(rank), self.metadata)
        return Trace(spans=spans, metadata=metadata)

    def thread_names(self) -> dict[tuple[int | None, int], str]:
        """Each recorded thread's name, by ``(rank, thread_id)`` (rank None for one process):
        as Python named it, as an imported profiler trace named it, or, for a thread only
        PyTorch's profiler saw, after what it ran (``gloo worker (profiler thread 2)``)."""
        ranks = self.metadata.get("ranks") or {}
        per_rank = ({int(rank): meta.get("threads") or {} for rank, meta in ranks.items()} if ranks
                    else {None: self.metadata.get("threads") or {}})
        return {(rank, int(thread)): str(name) for rank, names in per_rank.items() for thread, name in names.items()}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the canonical ``.xsp.parquet`` file."""
        if self._spans is None and self.source is not None:  # rewrite from the file, a row group at a time
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(self.source)
            # the source stays readable while its replacement is written under a temporary name
            return write_trace_tables(path, (parquet.read_row_group(i) for i in range(parquet.num_row_groups)),
                                      self.metadata)
        return write_trace(path, self.spans, self.metadata)

    def __repr__(self) -> str:
        levels = {level: count for level, count in self.spans[col.LEVEL].value_counts().items() if count}
        return f"Trace({len(self.spans)} spans, {len(self.steps)} steps, levels={levels})"
