"""``xsp.Trace``: a span table with its metadata (``xsp.load`` reads one: :mod:`xsp.loading`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from xsp import schema as col
from xsp.fileio import write_trace
from xsp.schema import Level


@dataclass
class Trace:
    """One profiling session: ``spans`` (the canonical span table) and ``metadata``.

    Attributes:
        spans: one row per span, columns as in :mod:`xsp.schema`.
        metadata: versions, host, device, levels, clock offsets, dropped counts, warnings.
    """

    spans: pd.DataFrame
    metadata: dict[str, Any] = field(default_factory=dict)

    def level(self, level: Level | str) -> pd.DataFrame:
        """The spans of one level."""
        value = Level(level).value
        return self.spans[self.spans[col.LEVEL] == value]

    @property
    def steps(self) -> list[int]:
        """Step numbers present in the trace."""
        return sorted(int(s) for s in self.spans[col.STEP].dropna().unique())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the canonical ``.xsp.parquet`` file."""
        return write_trace(path, self.spans, self.metadata)

    def __repr__(self) -> str:
        levels = self.spans[col.LEVEL].value_counts().to_dict() if len(self.spans) else {}
        return f"Trace({len(self.spans)} spans, {len(self.steps)} steps, levels={levels})"
