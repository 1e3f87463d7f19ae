"""Baseline summaries: what ``xsp diff`` needs of a run, small enough to commit to a repository.

``xsp summary TRACE -o baseline.xsp.json`` (or :func:`summarize` and :meth:`Summary.save`)
keeps, for every key of the run (by path and by name), its level, kind, parent key, count,
total, input shapes and dtypes, kernels per step, and per-step samples: at most
:data:`QUANTILES` of them (evenly spaced quantiles when the key had more, the middle one its
median; :func:`xsp.diff` reads as many samples back off them as the key had). The file is
JSON: the run's metadata as it is, and the keys packed by :mod:`xsp.gate.summary_codec` (a few
bytes per key; medians within 0.1% or a 24th of the key's interquartile range, totals
within 0.5%, samples within a sixth of the key's interquartile range). A name ending in
``.gz`` is gzip-compressed too. Summaries written by the first format (rows of JSON) still
load; those packed by xsp's first packed encoding must be made again.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError
from xsp.core.schema import Level
from xsp.gate import columns as dcol
from xsp.gate import statistics as keyed
from xsp.gate.summary_codec import QUANTILES, decode, encode
from xsp.io.parquet import gunzip_bounded, write_output
from xsp.io.trace import Trace

FORMAT: Final = "xsp-summary"
FORMAT_VERSION: Final = 2
"""2: keys packed by :mod:`xsp.gate.summary_codec`; 1: keys as JSON rows (still read)."""
SUFFIX: Final = ".xsp.json"
__all__ = ["QUANTILES", "Summary", "is_summary_path", "summarize"]
MAX_BYTES: Final = 64 * 1024 * 1024
"""Largest summary read (a baseline is kilobytes; anything bigger is not one)."""
_ROW: Final = ("level", "kind", "name", "key", "parent", "count", "total_ns", "sample_count", "median_ns",
               "samples_permille", "input_shapes", "kernels_per_step", "input_dtypes")
_OPTIONAL: Final = ("input_dtypes",)
"""Columns a summary written by an older xsp may lack (read as None)."""
_METADATA_KEPT: Final = ("xsp_version", "torch_version", "python_version", "device", "host", "created_at", "levels",
                         "source", "machine_speed")
"""What a summary keeps of its trace's metadata: what ran where, and when (to the second); the
OS's kernel string and the OpenTelemetry service name would cost a baseline 3% of its bytes."""


def _to_the_second(stamp: str) -> str:
    """An ISO time stamp without its fractions of a second (unchanged if it is not one)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp).replace(microsecond=0).isoformat()
    except ValueError:
        return stamp


@dataclass
class Summary:
    """Per-key samples of one run, by path and by name (what :func:`xsp.diff` compares)."""

    keys: dict[dcol.KeyBy, pd.DataFrame]
    """Key-samples frames (:func:`xsp.gate.statistics.key_samples`) for each way of matching."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the run was: versions, device, levels, the trace it came from, its steps."""

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the summary as JSON (gzip-compressed when the name ends in ``.gz``)."""
        packed = encode({by.value: frame for by, frame in self.keys.items()})
        document = {"format": FORMAT, "version": FORMAT_VERSION, "metadata": self.metadata,
                    "keys": {by.value: len(frame) for by, frame in self.keys.items()},
                    "packed_keys": base64.b85encode(packed).decode("ascii")}
        text = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
        if str(path).endswith(".gz"):
            text = gzip.compress(text, mtime=0)
        return write_output(path, lambda temporary: temporary.write_bytes(text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Summary:
        """Read a summary written by :meth:`save`.

        Raises:
            xsp.TraceNotFoundError: no such file.
            xsp.TraceFormatError: the file is not an xsp summary (or is damaged).
        """
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_BYTES + 1)
        except FileNotFoundError:
            raise TraceNotFoundError(f"{path}: no such file") from None
        except OSError as exc:
            raise TraceFormatError(f"{path} could not be read: {exc.strerror or exc}") from None
        try:
            if raw[:2] == b"\x1f\x8b":
                raw, complete = gunzip_bounded(raw, MAX_BYTES)
                if len(raw) > MAX_BYTES or not complete:
                    raise ValueError("a gzip stream that is truncated or inflates past any summary's size")
            if len(raw) > MAX_BYTES:
                raise ValueError("larger than any summary")
            document = json.loads(raw)
            if not isinstance(document, dict) or document.get("format") != FORMAT:
                raise ValueError("not an xsp summary (no \"format\": \"xsp-summary\")")
            if int(document.get("version", 0)) > FORMAT_VERSION:
                raise ValueError(f"written by a newer xsp (summary version {document['version']})")
            if "packed_keys" in document:
                packed = base64.b85decode(document["packed_keys"])
                keys = {dcol.KeyBy(by): frame for by, frame in decode(packed, MAX_BYTES).items()}
            else:  # version 1
                columns = document["columns"]
                keys = {dcol.KeyBy(by): _frame_v1(rows, columns) for by, rows in document["keys"].items()}
            metadata = document.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("its metadata is not an object")
        except (ValueError, KeyError, TypeError, IndexError, EOFError, OSError, zlib.error, binascii.Error) as exc:
            raise TraceFormatError(f"{path} is not a readable xsp summary: {exc}") from None
        except RecursionError:
            raise TraceFormatError(f"{path} is not a readable xsp summary: its JSON is nested too deeply") from None
        return cls(keys=keys, metadata=metadata)


def summarize(trace: Trace, levels: tuple[Level, ...] | None = None, steps: slice | list[int] | None = None,
              source: str | None = None, only: dcol.KeyBy | None = None) -> Summary:
    """The summary of ``trace`` (keys at ``levels``, samples of ``steps``; see :func:`xsp.diff`),
    by path and by name, or by ``only`` one of them."""
    spans = trace.spans
    keys = {by: keyed.key_samples(spans, by, levels, steps) for by in dcol.KeyBy if only is None or by is only}
    metadata: dict[str, Any] = {key: trace.metadata[key] for key in _METADATA_KEPT if key in trace.metadata}
    if isinstance(metadata.get("created_at"), str):
        metadata["created_at"] = _to_the_second(metadata["created_at"])
    metadata["steps"] = len(trace.steps)
    metadata["spans"] = len(spans)
    if source is not None:
        metadata["source"] = source
    if levels is not None:
        metadata["levels"] = [level.value for level in levels]
    return Summary(keys=keys, metadata=metadata)


def is_summary_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a summary file (``.xsp.json``, or that gzip-compressed)."""
    name = str(path)
    return name.endswith(SUFFIX) or name.endswith(SUFFIX + ".gz")


def _frame_v1(rows: list[list[Any]], columns: list[str]) -> pd.DataFrame:
    """Key frames of a version 1 summary (rows of JSON, samples as per-mille offsets)."""
    at = {name: columns.index(name) for name in _ROW if name in columns or name not in _OPTIONAL}
    keys = [row[at["key"]] for row in rows]
    samples = []
    for row in rows:
        median, offsets = float(row[at["median_ns"]]), row[at["samples_permille"]]
        values = (np.asarray(offsets, dtype=np.float64) / 1000 + 1.0) * median if median > 0 else np.asarray(
            offsets, dtype=np.float64)
        samples.append(np.sort(np.rint(values).astype(np.int64)))
    parents = [row[at["parent"]] for row in rows]
    return pd.DataFrame({
        col.LEVEL: [row[at["level"]] for row in rows],
        col.KIND: [row[at["kind"]] for row in rows],
        col.NAME: [row[at["name"]] for row in rows],
        dcol.KEY: keys,
        dcol.PARENT_KEY: [keys[p] if isinstance(p, int) and 0 <= p < len(keys) else None for p in parents],
        dcol.COUNT: np.array([row[at["count"]] for row in rows], dtype=np.int64),
        dcol.TOTAL_NS: np.array([row[at["total_ns"]] for row in rows], dtype=np.int64),
        dcol.SAMPLES_NS: samples,
        dcol.SAMPLE_COUNT: np.array([row[at["sample_count"]] for row in rows], dtype=np.int64),
        col.INPUT_SHAPES: [row[at["input_shapes"]] for row in rows],
        dcol.KERNELS_PER_STEP: np.array([np.nan if row[at["kernels_per_step"]] is None else row[at["kernels_per_step"]]
                                      for row in rows], dtype=np.float64),
        dcol.INPUT_DTYPES: [row[at["input_dtypes"]] if "input_dtypes" in at else None for row in rows],
    }, columns=list(dcol.KEY_COLUMNS))

