"""Baseline summaries: what ``xsp diff`` needs of a run, small enough to commit to a repository.

``xsp summary TRACE -o baseline.xsp-summary.parquet`` (or :func:`summarize` and
:meth:`Summary.save`) keeps, for every key of the run (by path and by name), its level, kind,
parent key, count, total, input shapes and dtypes, kernels per step, and per-step samples: at
most :data:`QUANTILES` of them (evenly spaced quantiles when the key had more, the middle one
its median; :func:`xsp.diff` reads as many samples back off them as the key had).

The file is Parquet (zstd): one row per key, the way it was keyed in ``by``, the samples a list
column, and the summary's own facts (format, version, the run's metadata) as JSON under the
schema's ``xsp.summary`` metadata: pandas, DuckDB and Polars read it as it is. It is three to five
times the size of the packed JSON earlier versions wrote, and loads 4 to 24 times faster
(``benchmarks/results/summary_formats.md``, ``summary_formats_codec.md``). Summaries written as
JSON rows (version 1) still load; packed ones (version 2) fail with a line that says how to make
them again.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, TraceTooLargeError
from xsp.core.levels import missing_levels
from xsp.core.rank import rank_path
from xsp.core.schema import Level
from xsp.gate import diff_columns as dcol
from xsp.gate import key_samples as keyed
from xsp.gate.significance import sample_stats
from xsp.io.outputs import write_output
from xsp.io.parquet import dictionary_columns, gunzip_bounded
from xsp.io.trace import Trace
from xsp.io.tree_windows import TreeWindows, scratch_folder
from xsp.record.compiled_kernels import kernel_sources

FORMAT: Final = "xsp-summary"
FORMAT_VERSION: Final = 3
"""3: Parquet; 2: keys packed in JSON (no longer read: make the summary again); 1: keys as JSON rows (still read)."""
SUFFIX: Final = ".xsp-summary.parquet"
LEGACY_SUFFIXES: Final = (".xsp.json", ".xsp.json.gz")
"""What summaries were named before they were Parquet (read where they are version 1)."""
QUANTILES: Final = 5
"""Samples a key keeps at most (its evenly spaced quantiles when it had more). Odd, so that
the middle one is the key's median."""
BY: Final = "by"
"""The column saying how each row's key was made (a :class:`~xsp.gate.diff_columns.KeyBy` value)."""
SCHEMA_KEY: Final = col.SUMMARY_METADATA_KEY
__all__ = ["QUANTILES", "SUFFIX", "Summary", "is_summary_path", "summarize"]
MAX_BYTES: Final = 64 * 1024 * 1024
"""Largest summary read (a baseline is kilobytes to a megabyte; anything bigger is not one)."""
_ROW: Final = ("level", "kind", "name", "key", "parent", "count", "total_ns", "sample_count", "median_ns",
               "samples_permille", "input_shapes", "kernels_per_step", "input_dtypes")
_OPTIONAL: Final = ("input_dtypes",)
"""Columns a version 1 summary may lack (read as None)."""
_METADATA_KEPT: Final = ("xsp_version", "torch_version", "python_version", "device", "host", "created_at", "levels",
                         "source", "machine_speed", "contention")
"""What a summary keeps of its trace's metadata: what ran where, and when (to the second)."""
_REGENERATE: Final = ("was written by an older xsp in a packed format no longer read: make it again with "
                      "`xsp summary TRACE -o NAME{suffix}`")


def _to_the_second(stamp: str) -> str:
    """An ISO time stamp without its fractions of a second (unchanged if it is not one)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp).replace(microsecond=0).isoformat()
    except ValueError:
        return stamp


def kept_samples(samples: np.ndarray) -> np.ndarray:
    """At most :data:`QUANTILES` of a key's samples: all of them, sorted, or evenly spaced
    quantiles (as ``np.quantile`` interpolates them) where it had more."""
    ordered = np.sort(np.asarray(samples, dtype=np.int64))
    if len(ordered) <= QUANTILES:
        return ordered
    return np.rint(np.quantile(ordered, (np.arange(QUANTILES) + 0.5) / QUANTILES)).astype(np.int64)


@dataclass
class Summary:
    """Per-key samples of one run, by path and by name (what :func:`xsp.diff` compares)."""

    keys: dict[dcol.KeyBy, pd.DataFrame]
    """Key-samples frames (:func:`xsp.gate.key_samples.key_samples`) for each way of matching."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the run was: versions, device, levels, the trace it came from, its steps."""

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the summary as Parquet (keys with at most :data:`QUANTILES` samples each).

        Raises:
            ValueError: ``path`` has the name of the JSON format that is no longer written.
        """
        if str(path).endswith(LEGACY_SUFFIXES):
            raise ValueError(f"{path}: summaries are Parquet files now; name it with {SUFFIX}")
        frames = []
        for by, frame in self.keys.items():
            # an optional column only where it holds something (a leveled trace's intervals)
            optional = [c for c in dcol.OPTIONAL_KEY_COLUMNS if c in frame and frame[c].notna().any()]
            frame = frame.loc[:, [*dcol.KEY_COLUMNS, *optional]].copy()
            if dcol.STEP_CV not in frame:  # (a summary saved again keeps the figure it was made with)
                frame[dcol.STEP_CV] = sample_stats(list(frame[dcol.SAMPLES_NS]))[2]
            frame[dcol.SAMPLES_NS] = [kept_samples(samples) for samples in frame[dcol.SAMPLES_NS]]
            frames.append(frame.assign(**{BY: by.value}))
        table = pa.Table.from_pandas(pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=[*dcol.KEY_COLUMNS, BY]), preserve_index=False)
        facts = {"format": FORMAT, "version": FORMAT_VERSION, "quantiles": QUANTILES, "metadata": self.metadata,
                 "keys": {by.value: len(frame) for by, frame in self.keys.items()}}
        table = table.replace_schema_metadata({SCHEMA_KEY: json.dumps(facts, allow_nan=False).encode()})
        text = dictionary_columns(table.schema)  # numbers without a dictionary pack smaller
        return write_output(path, lambda temporary: pq.write_table(
            table, temporary, compression="zstd", compression_level=19, use_dictionary=text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Summary:
        """Read a summary written by :meth:`save` (or a version 1 JSON one).

        Raises:
            xsp.TraceNotFoundError: no such file.
            xsp.TraceFormatError: the file is not an xsp summary, is damaged, or was written in the
                packed JSON format (version 2), which must be made again; the message says how.
        """
        try:
            with open(path, "rb") as handle:
                raw = handle.read(MAX_BYTES + 1)
        except FileNotFoundError:
            raise TraceNotFoundError(f"{path}: no such file") from None
        except OSError as exc:
            raise TraceFormatError(f"{path} could not be read: {exc.strerror or exc}") from None
        try:
            if len(raw) > MAX_BYTES:
                raise ValueError("larger than any summary")
            if raw[:4] == b"PAR1":
                return _from_parquet(raw)
            return _from_json(raw)
        except _OlderFormat:
            raise TraceFormatError(f"{path} " + _REGENERATE.format(suffix=SUFFIX)) from None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError, OSError, zlib.error,
                OverflowError, pa.ArrowException) as exc:
            raise TraceFormatError(f"{path} is not a readable xsp summary: {exc}") from None
        except RecursionError:
            raise TraceFormatError(f"{path} is not a readable xsp summary: its JSON is nested too deeply") from None


class _OlderFormat(Exception):
    """A summary in the packed JSON format of version 2."""


def _facts(document: Any) -> dict[str, Any]:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError("not an xsp summary (no \"format\": \"xsp-summary\")")
    if int(document.get("version", 0)) > FORMAT_VERSION:
        raise ValueError(f"written by a newer xsp (summary version {document['version']})")
    metadata = document.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError("its metadata is not an object")
    return document


def _from_parquet(raw: bytes) -> Summary:
    table = pq.read_table(io.BytesIO(raw))
    facts = _facts(json.loads((table.schema.metadata or {}).get(SCHEMA_KEY, b"null")))
    frame = table.to_pandas()
    missing = {*dcol.KEY_COLUMNS, BY} - set(frame.columns)
    if missing:
        raise ValueError(f"no column {', '.join(sorted(missing))}")
    keys = {}
    for by in dcol.KeyBy:
        part = frame[frame[BY] == by.value].drop(columns=BY).reset_index(drop=True)
        if part[dcol.KEY].isna().any():
            raise ValueError("a key that is null")
        if len(part) or by.value in facts.get("keys", {}):
            part[dcol.SAMPLES_NS] = [_samples(samples) for samples in part[dcol.SAMPLES_NS]]
            keys[by] = part.loc[:, [*dcol.KEY_COLUMNS, *(c for c in dcol.OPTIONAL_KEY_COLUMNS if c in part)]]
    return Summary(keys=keys, metadata=facts.get("metadata") or {})


_LARGEST_NS: Final = float(2**62)
"""Past any duration a summary holds (146 years), and within int64 once rounded."""


def _samples(samples: Any) -> np.ndarray:
    """A key's samples as nanoseconds (int64).

    Raises:
        ValueError: not a list of whole nanoseconds a duration can be (a number, or one past int64)."""
    values = np.asarray(samples, dtype=np.float64)
    if values.ndim != 1 or not np.isfinite(values).all() or (np.abs(values) > _LARGEST_NS).any():
        raise ValueError("samples that are not a list of durations in nanoseconds")
    return np.rint(values).astype(np.int64)


def _from_json(raw: bytes) -> Summary:
    """A summary of the JSON formats (version 1 read, version 2 refused with how to remake it)."""
    if raw[:2] == b"\x1f\x8b":
        raw, complete = gunzip_bounded(raw, MAX_BYTES)
        if len(raw) > MAX_BYTES or not complete:
            raise ValueError("a gzip stream that is truncated or inflates past any summary's size")
    document = _facts(json.loads(raw))
    if "packed_keys" in document:
        raise _OlderFormat()
    columns = document["columns"]
    keys = {dcol.KeyBy(by): _frame_v1(rows, columns) for by, rows in document["keys"].items()}
    return Summary(keys=keys, metadata=document.get("metadata") or {})


def summarize(trace: Trace, levels: tuple[Level, ...] | None = None, steps: slice | list[int] | None = None,
              source: str | None = None, only: dcol.KeyBy | None = None) -> Summary:
    """The summary of ``trace`` (keys at ``levels``, samples of ``steps``; see :func:`xsp.diff`),
    by path and by name, or by ``only`` one of them."""
    spans = trace.spans
    present = trace.steps
    recorded = set(spans[col.LEVEL].dropna().astype(str)) if levels is not None else set()
    compared = _compared(present, recorded, levels, steps, source)
    sources = kernel_sources(trace.metadata)
    keys = {by: keyed.key_samples(spans, by, levels, steps, sources) for by in _key_kinds(only)}
    return _summary(trace.metadata, keys, len(compared), len(spans), levels, source)


def summarize_windows(windows: TreeWindows, levels: tuple[Level, ...] | None = None,
                      steps: slice | list[int] | None = None, source: str | None = None,
                      only: dcol.KeyBy | None = None) -> Summary:
    """:func:`summarize` of a trace file too large to load, from its windows of whole trees
    (:func:`xsp.io.tree_windows.tree_windows`): the same summary, in memory bounded by the
    largest window and the keys' samples. The file is read once."""
    compared = _compared(windows.steps, windows.levels, levels, steps, source)
    sources = kernel_sources(windows.metadata)
    chosen = keyed.chosen_steps(windows.steps, steps)
    kinds = _key_kinds(only)
    with tempfile.TemporaryDirectory(prefix=".xsp-summary-", dir=scratch_folder(windows.source)) as scratch:
        added = {by: keyed.KeySamplesSum(by, spill=Path(scratch) / by.value) for by in kinds}
        for spans, order in windows.frames():
            for by in kinds:
                added[by].add(keyed.key_parts(spans, order, by, levels, chosen, sources))
            del spans
        keys = {by: added[by].result() for by in kinds}
    return _summary(windows.metadata, keys, len(compared), windows.spans, levels, source)


def summarize_file(path: str | os.PathLike[str], levels: tuple[Level, ...] | None = None,
                   steps: slice | list[int] | None = None, source: str | None = None,
                   only: dcol.KeyBy | None = None, what: str = "summarise") -> Summary:
    """:func:`summarize` of the trace file ``path`` (:func:`xsp.load` reads it), of one process: an
    ``.xsp.parquet`` file too large to load whole is summarised a window of whole trees at a time
    (:func:`summarize_windows`), to the same summary.

    Raises:
        xsp.XspError: the file could not be read, or (not an ``.xsp.parquet`` file) is too large.
        ValueError: it holds several ranks (``what``: what to do with one rank's file instead),
            or ``steps`` or ``levels`` leave nothing.
    """
    from xsp.io.loading import load_to_analyse
    from xsp.io.tree_windows import tree_windows

    try:
        trace = load_to_analyse(path)
    except TraceTooLargeError:
        if not str(path).endswith(col.FILE_SUFFIX):
            raise
        windows = tree_windows(path)
        one_process(path, windows.ranks, what)
        return summarize_windows(windows, levels, steps, source, only)
    one_process(path, trace.ranks, what)
    return summarize(trace, levels, steps, source, only)


def one_process(name: object, ranks: list[int], what: str) -> None:
    """Refuse a trace of several ranks (the steps of several ranks would pool into one sample);
    ``name``: its file, or what it is; ``what``: what to do with one rank instead.

    Raises:
        ValueError: it holds several ranks."""
    if len(ranks) > 1:
        raise ValueError(f"{name} holds {len(ranks)} ranks of a distributed job: {what} {_one_rank(name, ranks[0])}")


def _one_rank(name: object, rank: int) -> str:
    """How to take one rank of the trace ``name``: its own file where the job wrote one, else the
    Python that writes it (a file of ranks merged, or an import, has none beside it)."""
    if not isinstance(name, (str, os.PathLike)):
        return "trace.for_rank(r)"
    own = rank_path(name, rank)
    if own.is_file():
        return f"one rank's file ({own.name})"
    return (f"one rank at a time: python -c \"import xsp; xsp.load('{name}').for_rank({rank}).save('{own}')\" "
            "writes that of rank " + str(rank))


def _key_kinds(only: dcol.KeyBy | None) -> list[dcol.KeyBy]:
    return [by for by in dcol.KeyBy if only is None or by is only]


def _compared(present: list[int], recorded: set[str], levels: tuple[Level, ...] | None,
              steps: slice | list[int] | None, source: str | None) -> list[int]:
    """The steps compared of a run whose steps are ``present`` and levels ``recorded``.

    Raises:
        ValueError: ``steps`` leaves none, or a level of ``levels`` was not recorded."""
    compared = present if steps is None else (present[steps] if isinstance(steps, slice) else
                                              sorted(set(present) & {int(s) for s in steps}))
    if present and not compared:
        raise ValueError(f"{source or 'the trace'}: the steps asked for leave none of its {len(present)} steps "
                         f"({present[0]}-{present[-1]}) to compare")
    if levels is not None:
        missing = missing_levels(levels, recorded)
        if missing:
            raise ValueError(f"{source or 'the trace'} has no {', '.join(missing)} level (it has "
                             f"{', '.join(sorted(recorded)) or 'no spans'}): a summary of it would be empty there")
    return compared


def _summary(trace_metadata: dict[str, Any], keys: dict[dcol.KeyBy, pd.DataFrame], steps: int, spans: int,
             levels: tuple[Level, ...] | None, source: str | None) -> Summary:
    metadata: dict[str, Any] = {key: trace_metadata[key] for key in _METADATA_KEPT if key in trace_metadata}
    if isinstance(metadata.get("created_at"), str):
        metadata["created_at"] = _to_the_second(metadata["created_at"])
    metadata["steps"] = steps
    metadata["spans"] = spans
    if source is not None:
        metadata["source"] = source
    if levels is not None:
        metadata["levels"] = [level.value for level in levels]
    return Summary(keys=keys, metadata=metadata)


def is_summary_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a summary file (``.xsp-summary.parquet``; ``.xsp.json`` and
    ``.xsp.json.gz`` for those of earlier versions)."""
    return str(path).endswith((SUFFIX, *LEGACY_SUFFIXES))


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

