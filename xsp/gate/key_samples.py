"""The samples of each key of a run: what two runs are compared on.

A *key* names "the same thing" in both runs: a span's ``path`` (``by=KeyBy.PATH``), or its level
and name (``by=KeyBy.NAME``, the way HolisticTraceAnalysis compares). A key's *samples* are its
duration per step (the sum of its spans in that step); spans outside every step are one sample
each. Functions here take and return DataFrames; :func:`xsp.diff` puts them together.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp.analysis.lines import fused_line_rows, line_keys, relative_files
from xsp.core import schema as col
from xsp.core.errors import duckdb_interrupts, first_line, imported_duckdb
from xsp.core.schema import Level, SpanKind
from xsp.gate.diff_columns import (
    CI_NS,
    COUNT,
    DTYPE_ATTRIBUTES,
    DTYPE_PATTERN,
    INPUT_DTYPES,
    KERNELS_PER_STEP,
    KEY,
    KEY_COLUMNS,
    PARENT_KEY,
    RUN_MEDIANS_NS,
    RUNS,
    SAMPLE_COUNT,
    SAMPLES_NS,
    STEP_CV,
    TOTAL_NS,
    KeyBy,
)
from xsp.gate.significance import from_quantiles
from xsp.io.kineto import STEP_NAME
from xsp.io.outputs import OutputError
from xsp.io.spill_file import SpillFile
from xsp.record.compiled_kernels import Frame
from xsp.table.walks import arrow_strings, nearest_ancestor, parent_positions, plain_strings


def key_samples(spans: pd.DataFrame, by: KeyBy = KeyBy.PATH, levels: tuple[Level, ...] | None = None,
                steps: slice | list[int] | None = None,
                kernel_sources: dict[str, list[list[Frame]]] | None = None) -> pd.DataFrame:
    """One row per key of one run: its spans' count and total, and its per-step samples.

    Args:
        spans: a canonical span table.
        by: how keys are made (see :class:`KeyBy`).
        levels: the levels to keep (all when None). A key's parent is its nearest ancestor at
            a kept level.
        steps: the steps to keep, as step numbers or as a slice of the run's steps in order
            (``slice(5, None)`` leaves out the first five); spans outside steps are kept only
            when this is None.
        kernel_sources: by line, the sources of the kernels ``torch.compile`` generated (the
            trace's :func:`xsp.record.compiled_kernels.kernel_sources`): each such kernel's time
            is then a key of each line of the operators it fuses too, a share each, under the
            line that called the compiled code (:func:`xsp.analysis.lines.fused_line_rows`).
    """
    present = sorted(int(s) for s in spans[col.STEP].dropna().unique()) if len(spans) else []
    order = np.zeros((len(spans), 3), dtype=np.int64)
    order[:, 2] = np.arange(len(spans))
    added = KeySamplesSum(by)
    added.add(key_parts(spans, order, by, levels, chosen_steps(present, steps), kernel_sources))
    return added.result()


def chosen_steps(present: list[int], steps: slice | list[int] | None) -> list[int] | None:
    """The step numbers ``steps`` keeps of a run whose steps are ``present`` (None: every span)."""
    if steps is None:
        return None
    if isinstance(steps, slice):
        return present[steps]
    return [int(s) for s in steps]


_ORDER: Final = ("_o0", "_o1", "_o2", "_o3", "_o4")
"""A row's place in the run: real spans before rows made for fused kernels, then the span's place
(or the fused kernel's) in the loaded trace, then the row's among one kernel's lines."""
_LEVEL_KEY: Final = [col.LEVEL, KEY]
_FILE_MARK: Final = "\x00"
_MARKED_FILE: Final = re.compile("\x00([^\x00]*)\x00")


@dataclass
class KeyParts:
    """What one part of a run (a window of whole trees, or all of it) tells of its keys, each
    numbered from 0 in the part (its *code*): added up over the parts by :class:`KeySamplesSum`,
    it gives :func:`key_samples` of the whole."""

    keys: pd.DataFrame
    """Per key, by code: its level and text; its first span's place, kind, name and parent's key;
    count, total; the sums for its interval in and outside steps; its first shapes and dtypes,
    with their places."""
    in_steps: pd.DataFrame
    """Per key and step: the time of its spans in the step (``code``, ``step``, ``d``)."""
    outside_steps: pd.DataFrame
    """Per span outside steps: its key, unit (a number of its own) and time (one sample each, for
    keys never in a step)."""
    kernel_units: pd.DataFrame
    """Per layer key and unit (a step, or a layer span outside steps): kernels launched under it."""
    layer_codes: np.ndarray
    """The keys of layer spans."""
    line_files: set[object] = field(default_factory=set)
    """The files of the part's lines (keys by line name them marked, to be shown once all are known)."""


def key_parts(spans: pd.DataFrame, order: np.ndarray, by: KeyBy, levels: tuple[Level, ...] | None,
              chosen: list[int] | None, kernel_sources: dict[str, list[list[Frame]]] | None = None) -> KeyParts:
    """:class:`KeyParts` of ``spans``: a whole run, or a window of whole trees of it (every span's
    parent in it). ``order``: each row's place in the whole run (three integers, compared in
    turn); ``chosen``: the steps kept (:func:`chosen_steps` of the whole run), None for all."""
    if not len(spans):
        return _empty_parts()
    place = np.zeros((len(spans), len(_ORDER)), dtype=np.int64)
    place[:, 1:4] = order
    fused_count = 0
    if by is KeyBy.LINE and kernel_sources:
        fused = fused_line_rows(spans, kernel_sources)
        fused_count = len(fused)
        if fused_count:
            spans = pd.concat([spans, fused], ignore_index=True)
    parents = parent_positions(spans)
    if fused_count:  # after every span, in the order of their kernels, as they were made
        made = np.zeros((fused_count, len(_ORDER)), dtype=np.int64)
        made[:, 0] = 1
        made[:, 1:4] = order[parents[len(order):]]
        made[:, 4] = np.arange(fused_count)
        place = np.concatenate([place, made])
    kept = np.ones(len(spans), dtype=bool)
    if levels is not None:
        kept &= spans[col.LEVEL].isin([level.value for level in levels]).to_numpy()
    step = spans[col.STEP]
    if chosen is not None:
        kept &= step.isin(chosen).fillna(False).to_numpy(dtype=bool)
    line_files: set[object] = set()
    if by is KeyBy.LINE:
        def marked(files: Any) -> dict[object, str]:
            line_files.update(files)
            return {f: f"{_FILE_MARK}{f}{_FILE_MARK}" for f in set(files)}

        key_text = line_keys(spans, parents, marked)
    else:
        key_text = _step_free_paths(spans[col.PATH]) if by is KeyBy.PATH else spans[col.NAME]
    kept &= key_text.notna().to_numpy()
    if not kept.any():
        parts = _empty_parts()
        parts.line_files = line_files
        return parts
    parents = nearest_ancestor(spans, kept, parents)  # the parent among the kept spans
    rows = np.flatnonzero(kept)
    level_values = spans[col.LEVEL].to_numpy(dtype=object)
    key_values = key_text.to_numpy(dtype=object)
    level_codes, level_names = pd.factorize(spans[col.LEVEL])
    text_codes, _ = pd.factorize(key_text)
    combined = text_codes.astype(np.int64)[rows] * (len(level_names) + 1) + level_codes[rows]
    code, _ = pd.factorize(combined)  # keys numbered from 0 in order of their first span
    key_count = int(code.max()) + 1
    duration = spans[col.DURATION_NS].to_numpy(dtype=np.int64)[rows]
    step_values = step.to_numpy(dtype=np.float64, na_value=np.nan)[rows]
    in_step = ~np.isnan(step_values)
    first = np.full(key_count, -1, dtype=np.int64)
    first[code[::-1]] = np.arange(len(rows))[::-1]  # each key's first kept span, as a position in rows
    first_row = rows[first]
    parent_row = parents[first_row]
    key_of_row = np.full(len(spans), -1, dtype=np.int64)
    key_of_row[rows] = code
    parent_code = np.where(parent_row >= 0, key_of_row[np.maximum(parent_row, 0)], -1)
    key_strings = key_values[first_row]
    ci = (spans[col.DURATION_CI_NS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)[rows]
          if col.DURATION_CI_NS in spans else np.full(len(rows), np.nan))
    keys = pd.DataFrame({
        col.LEVEL: level_values[first_row],
        KEY: key_strings,
        **{name: place[first_row, i] for i, name in enumerate(_ORDER)},
        col.KIND: spans[col.KIND].to_numpy(dtype=object)[first_row],
        col.NAME: spans[col.NAME].to_numpy(dtype=object)[first_row],
        PARENT_KEY: np.where(parent_code >= 0, key_strings[np.maximum(parent_code, 0)], None),
        COUNT: np.bincount(code, minlength=key_count),
        TOTAL_NS: np.bincount(code, weights=duration, minlength=key_count).astype(np.int64),
        "_ci_in": np.bincount(code[in_step], weights=np.nan_to_num(ci[in_step]) ** 2, minlength=key_count),
        "_unknown_in": np.bincount(code[in_step], weights=np.isnan(ci[in_step]), minlength=key_count) > 0,
        "_ci_out": np.bincount(code[~in_step], weights=np.nan_to_num(ci[~in_step]) ** 2, minlength=key_count),
        "_unknown_out": np.bincount(code[~in_step], weights=np.isnan(ci[~in_step]), minlength=key_count) > 0,
    })
    for column, (values, at) in {col.INPUT_SHAPES: _first_values(spans, col.INPUT_SHAPES, rows, code, key_count),
                                 INPUT_DTYPES: _input_dtypes(spans, rows, code, key_count)}.items():
        keys[column] = values
        keys[[f"{column}{name}" for name in _ORDER]] = np.where(
            at[:, None] >= 0, place[rows[np.maximum(at, 0)]], np.iinfo(np.int64).max)
    in_steps = pd.DataFrame({"code": code[in_step], col.STEP: step_values[in_step].astype(np.int64),
                             "d": duration[in_step]}).groupby(["code", col.STEP], sort=True)["d"].sum().reset_index()
    unit = np.where(in_step, np.nan_to_num(step_values).astype(np.int64), -1 - place[rows, 3])
    return KeyParts(
        keys=keys,
        in_steps=in_steps,
        outside_steps=pd.DataFrame({"code": code[~in_step], "unit": unit[~in_step], "d": duration[~in_step]}),
        kernel_units=_kernel_units(spans, parents, rows, code, unit),
        layer_codes=np.unique(code[(level_values[rows] == Level.LAYER.value)]),
        line_files=line_files)


SPILLED_MEMORY_MB: Final = 512
"""DuckDB's memory for adding up the samples of a run kept on disk."""
_FIRSTS: Final = (col.LEVEL, KEY, col.KIND, col.NAME, PARENT_KEY)
_SUMS: Final = (COUNT, TOTAL_NS, "_ci_in", "_ci_out")
_ANY: Final = ("_unknown_in", "_unknown_out")
_FIRST_VALUES: Final = (col.INPUT_SHAPES, INPUT_DTYPES)


class KeySamplesSum:
    """:func:`key_samples` of a run added up from the :class:`KeyParts` of its parts, one at a
    time (:meth:`add`), in memory that grows with the keys and their samples, not with the spans:
    each key's rows are added up, its first span the earliest in the run."""

    def __init__(self, by: KeyBy, spill: Path | None = None) -> None:
        """``spill``: a folder where the samples are kept until the end (a run too large to hold),
        instead of memory."""
        self.by = by
        self._samples: _HeldSamples | _SpilledSamples = _HeldSamples() if spill is None else _SpilledSamples(spill)
        self._codes: dict[tuple[object, object], int] = {}
        self._firsts: dict[str, list[object]] = {name: [] for name in _FIRSTS}
        self._places = np.zeros((0, len(_ORDER)), dtype=np.int64)
        self._sums = np.zeros((0, len(_SUMS)), dtype=np.float64)
        self._counts = np.zeros((0, 2), dtype=np.int64)
        self._unknown = np.zeros((0, len(_ANY)), dtype=bool)
        self._values: dict[str, list[object]] = {name: [] for name in _FIRST_VALUES}
        self._value_places = {name: np.zeros((0, len(_ORDER)), dtype=np.int64) for name in _FIRST_VALUES}
        self._units: list[np.ndarray] = []
        self._layers: list[np.ndarray] = []
        self._files: set[object] = set()

    def add(self, parts: KeyParts) -> None:
        """Add one part's keys."""
        self._files |= parts.line_files
        keys = parts.keys
        if not len(keys):
            return
        known = len(self._codes)
        codes = np.array([self._codes.setdefault(pair, len(self._codes))
                          for pair in zip(keys[col.LEVEL].tolist(), keys[KEY].tolist())], dtype=np.int64)
        new = codes >= known
        self._grow(len(self._codes))
        places = keys[list(_ORDER)].to_numpy(dtype=np.int64)
        earlier = new | _earlier(places, self._places[codes])
        for name in _FIRSTS:
            column = self._firsts[name]
            column.extend([None] * (len(self._codes) - len(column)))
            for code, value in zip(codes[earlier].tolist(), keys[name].to_numpy(dtype=object)[earlier].tolist()):
                column[code] = value
        self._places[codes[earlier]] = places[earlier]
        np.add.at(self._counts, codes, keys[[COUNT, TOTAL_NS]].to_numpy(dtype=np.int64))
        np.add.at(self._sums, codes, keys[list(_SUMS)].to_numpy(dtype=np.float64))
        self._unknown[codes] |= keys[list(_ANY)].to_numpy(dtype=bool)
        for name in _FIRST_VALUES:
            values = self._values[name]
            values.extend([None] * (len(self._codes) - len(values)))
            found = keys[[f"{name}{order}" for order in _ORDER]].to_numpy(dtype=np.int64)
            held = self._value_places[name]
            better = keys[name].notna().to_numpy() & _earlier(found, held[codes])
            for code, value in zip(codes[better].tolist(), keys[name].to_numpy(dtype=object)[better].tolist()):
                values[code] = value
            held[codes[better]] = found[better]
        steps, outside = parts.in_steps, parts.outside_steps
        self._samples.add(
            codes[np.concatenate([steps["code"].to_numpy(dtype=np.int64),
                                  outside["code"].to_numpy(dtype=np.int64)])].astype(np.int32),
            np.concatenate([steps[col.STEP].to_numpy(dtype=np.int64), outside["unit"].to_numpy(dtype=np.int64)]),
            np.arange(len(steps) + len(outside)) < len(steps),
            np.concatenate([steps["d"].to_numpy(dtype=np.int64), outside["d"].to_numpy(dtype=np.int64)]))
        units = parts.kernel_units
        self._units.append(np.column_stack([codes[units["code"].to_numpy(dtype=np.int64)],
                                            units["unit"].to_numpy(dtype=np.int64),
                                            units["kernels"].to_numpy(dtype=np.int64)]))
        self._layers.append(codes[parts.layer_codes])

    def _grow(self, count: int) -> None:
        """Room for ``count`` keys."""
        extra = count - len(self._places)
        if extra <= 0:
            return
        latest = np.full((extra, len(_ORDER)), np.iinfo(np.int64).max, dtype=np.int64)
        self._places = np.concatenate([self._places, latest])
        self._sums = np.concatenate([self._sums, np.zeros((extra, len(_SUMS)))])
        self._counts = np.concatenate([self._counts, np.zeros((extra, 2), dtype=np.int64)])
        self._unknown = np.concatenate([self._unknown, np.zeros((extra, len(_ANY)), dtype=bool)])
        for name in _FIRST_VALUES:
            self._value_places[name] = np.concatenate([self._value_places[name], latest])

    def result(self) -> pd.DataFrame:
        """The key-samples frame of every part added (see :func:`key_samples`)."""
        count = len(self._codes)
        if not count:
            return _empty_keys()
        order = np.lexsort(self._places.T[::-1])  # keys in order of their first span, as it ran
        stepped, values, bounds = self._samples.by_key(count)
        sample_count = np.diff(bounds)[order]
        squares = np.where(stepped, self._sums[:, 2], self._sums[:, 3])[order]
        unknown = np.where(stepped, self._unknown[:, 0], self._unknown[:, 1])[order]
        firsts = {name: np.array(self._firsts[name], dtype=object)[order] for name in _FIRSTS}
        table = pd.DataFrame({
            col.LEVEL: firsts[col.LEVEL],
            col.KIND: firsts[col.KIND],
            col.NAME: firsts[col.NAME],
            KEY: firsts[KEY],
            PARENT_KEY: firsts[PARENT_KEY],
            COUNT: self._counts[order, 0],
            TOTAL_NS: self._counts[order, 1],
            SAMPLES_NS: [values[bounds[code]:bounds[code + 1]] for code in order.tolist()],
            SAMPLE_COUNT: sample_count,
            col.INPUT_SHAPES: np.array(self._values[col.INPUT_SHAPES], dtype=object)[order],
            KERNELS_PER_STEP: self._kernels_per_step()[order],
            INPUT_DTYPES: np.array(self._values[INPUT_DTYPES], dtype=object)[order],
            CI_NS: np.where((sample_count == 1) & ~unknown, np.sqrt(squares), np.nan),
        })
        if self.by is KeyBy.LINE and self._files:
            shown = relative_files(self._files)
            for column in (KEY, PARENT_KEY):
                table[column] = [_MARKED_FILE.sub(lambda found: shown.get(found.group(1), found.group(1)), text)
                                 if isinstance(text, str) else text for text in table[column]]
        return table

    def _kernels_per_step(self) -> np.ndarray:
        """Median kernels launched per step under each layer key (NaN for other keys, or no kernels)."""
        result = np.full(len(self._codes), np.nan)
        units = _table(self._units, 3)
        if not len(units):  # no kernel at all: no figure, as for a trace without the kernel level
            return result
        result[np.concatenate(self._layers)] = 0.0  # a layer whose kernels are all gone launches 0
        per_unit = pd.DataFrame(units).groupby([0, 1], sort=False)[2].sum()
        medians = per_unit.groupby(level=0, sort=False).median()
        result[medians.index.to_numpy(dtype=np.int64)] = medians.to_numpy(dtype=np.float64)
        return result


class _HeldSamples:
    """The rows of each key's samples (:meth:`add`), held in memory, and the samples they make."""

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, codes: np.ndarray, units: np.ndarray, in_step: np.ndarray, durations: np.ndarray) -> None:
        """Rows: a key's time in a step (``in_step``, ``units`` the step), or a span's time outside
        every step (``units`` a number of its own)."""
        self._parts.append((codes, units, in_step, durations))

    def by_key(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether each key ran in steps, and its samples: ``values[bounds[k]:bounds[k + 1]]``,
        sorted. A key seen in steps takes its samples from its steps only (its times in a step
        added up over the parts), another one sample a span."""
        codes, units, in_step, durations = (np.concatenate(column) for column in zip(*self._parts)) if self._parts \
            else (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool),
                  np.zeros(0, dtype=np.int64))
        self._parts = []
        stepped = np.zeros(count, dtype=bool)
        stepped[codes[in_step]] = True
        kept = in_step | ~stepped[codes]
        codes, units, in_step, durations = codes[kept], units[kept], in_step[kept], durations[kept]
        sorting = np.lexsort((units, ~in_step, codes))
        codes, units, in_step, durations = codes[sorting], units[sorting], in_step[sorting], durations[sorting]
        first = np.ones(len(codes), dtype=bool)
        first[1:] = (codes[1:] != codes[:-1]) | (units[1:] != units[:-1]) | (in_step[1:] != in_step[:-1])
        starts = np.flatnonzero(first)
        codes, values = codes[starts], np.add.reduceat(durations, starts) if len(starts) else durations[:0]
        sorting = np.lexsort((values, codes))  # by key, then by value: each key's samples sorted
        values = values[sorting]
        bounds = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=count))])
        return stepped, values, bounds


class _SpilledSamples:
    """:class:`_HeldSamples` kept in a Parquet file in ``folder`` and added up by DuckDB (within
    :data:`SPILLED_MEMORY_MB`, spilling there too): for a run whose samples are too many to hold
    twice (a trace of millions of spans, each a key of its own in each step)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._file = SpillFile(folder / "samples.parquet")

    def add(self, codes: np.ndarray, units: np.ndarray, in_step: np.ndarray, durations: np.ndarray) -> None:
        """As :meth:`_HeldSamples.add`."""
        self._file.add(pa.table({"code": codes, "unit": units, "in_step": in_step, "d": durations}))

    def by_key(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`_HeldSamples.by_key`."""
        duckdb = imported_duckdb()

        stepped = np.zeros(count, dtype=bool)
        if not self._file.close():
            return stepped, np.zeros(0, dtype=np.int64), np.zeros(count + 1, dtype=np.int64)
        connection = duckdb.connect(config={"memory_limit": f"{SPILLED_MEMORY_MB}MB", "threads": 2,
                                            "temp_directory": str(self._folder / "duckdb"),
                                            "preserve_insertion_order": True})
        try:
            with duckdb_interrupts():
                return self._added_up(connection, count)
        except duckdb.Error as exc:  # out of memory or of spill space: the machine's
            raise OutputError(f"adding up the samples in {self._folder} failed ({first_line(exc)})") from None
        finally:
            connection.close()
            self._file.path.unlink(missing_ok=True)

    def _added_up(self, connection: Any, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`by_key`, by DuckDB on ``connection``."""
        stepped = np.zeros(count, dtype=bool)
        connection.execute("SET enable_progress_bar = false")
        connection.read_parquet(str(self._file.path)).create_view("rows")
        connection.execute("CREATE TABLE sums AS SELECT code, in_step, sum(d)::BIGINT AS d FROM rows "
                           "GROUP BY code, in_step, unit")
        found = connection.sql("SELECT DISTINCT code FROM sums WHERE in_step").fetchnumpy()["code"]
        stepped[np.asarray(found, dtype=np.int64)] = True
        kept = "FROM sums WHERE in_step OR code NOT IN (SELECT code FROM sums WHERE in_step)"
        total = int(connection.execute(f"SELECT count(*) {kept}").fetchall()[0][0])
        values = np.zeros(total, dtype=np.int64)
        per_key = np.zeros(count, dtype=np.int64)
        result = connection.sql(f"SELECT code, d {kept} ORDER BY code, d")
        reader = result.to_arrow_reader() if hasattr(result, "to_arrow_reader") else result.fetch_arrow_reader()
        at = 0
        for batch in reader:
            values[at:at + batch.num_rows] = batch.column(1).to_numpy()
            per_key += np.bincount(batch.column(0).to_numpy(), minlength=count)
            at += batch.num_rows
        return stepped, values, np.concatenate([[0], np.cumsum(per_key)])


def _table(parts: list[np.ndarray], columns: int) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, columns), dtype=np.int64)


def _earlier(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, whether place ``a`` comes before place ``b`` (compared column by column)."""
    result = np.zeros(len(a), dtype=bool)
    decided = np.zeros(len(a), dtype=bool)
    for column in range(a.shape[1]):
        less, more = a[:, column] < b[:, column], a[:, column] > b[:, column]
        result |= ~decided & less
        decided |= less | more
    return result


NUMBERED_STEP: Final = rf"^{STEP_NAME}[0-9]+\["
"""The part of a path that names PyTorch's profiler step N (``ProfilerStep#3[0]/...``)."""


ANY_STEP: Final = f"{STEP_NAME}*["
"""What it becomes in a key: one key for every step."""


def _step_free_paths(paths: pd.Series) -> pd.Series:
    """Paths as keys: the step's number taken out of a step named after it (PyTorch's profiler
    names step N ``ProfilerStep#N``), so that a layer is one key over every step of a run and
    over runs whose steps were numbered differently, as in xsp's own traces."""
    texts = plain_strings(paths)
    if not pc.any(pc.match_substring_regex(texts, NUMBERED_STEP)).as_py():
        return paths
    return pd.Series(arrow_strings(pc.replace_substring_regex(texts, NUMBERED_STEP, ANY_STEP)), index=paths.index)


def pool_runs(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """One key-samples frame from several runs of the same program (one side of a diff).

    Each key's samples are the steps of every run it appeared in (a summary's quantiles are
    first read back into samples, as for the rank test); ``count`` and ``total_ns`` are per run
    (their mean over the runs, a run without the key counting 0), so that a side of three runs
    reads like one; ``run_medians_ns`` keeps each run's median for the between-run test.
    Shapes, dtypes and kernel counts come from the first run that has the key (kernel counts:
    their median over the runs).
    """
    if len(frames) == 1:
        return frames[0]
    runs = len(frames)
    rows: dict[tuple[object, object], list[dict[str, Any]]] = {}
    for frame in frames:
        rebuilt = from_quantiles(list(frame[SAMPLES_NS]), frame[SAMPLE_COUNT].to_numpy(dtype=np.int64))
        for row, samples in zip(frame.to_dict("records"), rebuilt):
            row[SAMPLES_NS] = np.rint(samples).astype(np.int64)
            rows.setdefault((row[col.LEVEL], row[KEY]), []).append(row)
    pooled = []
    for seen in rows.values():
        first = dict(seen[0])
        samples = np.sort(np.concatenate([row[SAMPLES_NS] for row in seen]))
        first[SAMPLES_NS] = samples
        first[SAMPLE_COUNT] = len(samples)
        first[COUNT] = round(sum(int(row[COUNT]) for row in seen) / runs)
        first[TOTAL_NS] = round(sum(int(row[TOTAL_NS]) for row in seen) / runs)
        first[RUN_MEDIANS_NS] = np.array([float(np.median(row[SAMPLES_NS])) for row in seen if len(row[SAMPLES_NS])])
        first[CI_NS] = np.nan  # an interval is one run's: pooled runs are judged by their spread
        first[STEP_CV] = np.nan  # so is a summary's spread: the pooled samples give theirs
        for column in (col.INPUT_SHAPES, INPUT_DTYPES, PARENT_KEY):
            present = [row.get(column) for row in seen if isinstance(row.get(column), str)]
            first[column] = present[0] if present else first.get(column)
        kernels = [float(row[KERNELS_PER_STEP]) for row in seen if not pd.isna(row.get(KERNELS_PER_STEP, np.nan))]
        first[KERNELS_PER_STEP] = float(np.median(kernels)) if kernels else np.nan
        pooled.append(first)
    table = pd.DataFrame(pooled).reset_index(drop=True) if pooled else _empty_keys()
    table[RUNS] = runs
    return table


def _empty_keys() -> pd.DataFrame:
    return pd.DataFrame({name: pd.Series(dtype=object) for name in KEY_COLUMNS})


def _empty_parts() -> KeyParts:
    nothing = pd.DataFrame({name: pd.Series(dtype=object) for name in _LEVEL_KEY})
    return KeyParts(keys=nothing, in_steps=nothing, outside_steps=nothing, kernel_units=nothing,
                    layer_codes=np.zeros(0, dtype=np.int64))


def _first_values(spans: pd.DataFrame, column: str, rows: np.ndarray, code: np.ndarray,
                  count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first non-null value of ``column`` among each key's spans (None where all are null),
    and its position in ``rows`` (-1: none)."""
    result = np.full(count, None, dtype=object)
    at = np.full(count, -1, dtype=np.int64)
    if column not in spans:
        return result, at
    values = spans[column].to_numpy(dtype=object, na_value=None)[rows]
    present = np.flatnonzero(pd.notna(values))
    result[code[present[::-1]]] = values[present[::-1]]
    at[code[present[::-1]]] = present[::-1]
    return result, at


def _input_dtypes(spans: pd.DataFrame, rows: np.ndarray, code: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Each operator key's input dtypes as text (``"float, float"``), from the first of its spans
    whose attributes name them (None for other keys), and that span's position in ``rows`` (-1: none)."""
    result = np.full(count, None, dtype=object)
    at = np.full(count, -1, dtype=np.int64)
    if col.ATTRIBUTES not in spans:
        return result, at
    operator = (spans[col.LEVEL].to_numpy(dtype=object)[rows] == Level.OPERATOR.value)
    if not operator.any():
        return result, at
    texts = spans[col.ATTRIBUTES].iloc[rows[operator]]
    # only the spans whose attributes name input dtypes are parsed (found by a vectorised search)
    naming = texts.str.contains(DTYPE_PATTERN, regex=True).fillna(False).to_numpy(dtype=bool)
    candidates = np.flatnonzero(naming)
    codes = code[operator][candidates]
    positions = np.flatnonzero(operator)[candidates]
    for key_code, text, position in zip(codes.tolist(), texts.iloc[candidates].tolist(), positions.tolist()):
        if result[key_code] is not None or not isinstance(text, str):  # the first span wins
            continue
        try:
            found = json.loads(text)
        except ValueError:
            continue
        dtypes = next((found[name] for name in DTYPE_ATTRIBUTES if isinstance(found, dict) and name in found), None)
        if isinstance(dtypes, list) and any(dtypes):
            result[key_code] = ", ".join(str(dtype) for dtype in dtypes)
            at[key_code] = position
    return result, at


def _kernel_units(spans: pd.DataFrame, parents: np.ndarray, rows: np.ndarray, code: np.ndarray,
                  unit: np.ndarray) -> pd.DataFrame:
    """Per layer key (as codes) and unit: the kernels whose innermost layer is one of its spans."""
    kernels = (spans[col.KIND] == SpanKind.KERNEL.value).to_numpy()
    if not kernels.any():
        return pd.DataFrame({"code": np.zeros(0, dtype=np.int64), "unit": np.zeros(0, dtype=np.int64),
                             "kernels": np.zeros(0, dtype=np.int64)})
    is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
    owner = nearest_ancestor(spans, is_layer, parents)[kernels]  # the innermost layer of each kernel
    owner = owner[owner >= 0]
    position = np.full(len(spans), -1, dtype=np.int64)
    position[rows] = np.arange(len(rows))
    owner = position[owner]
    owner = owner[owner >= 0]
    counted = pd.DataFrame({"code": code[owner], "unit": unit[owner]}).value_counts(sort=False)
    return counted.rename("kernels").reset_index()


__all__ = ["KeyParts", "chosen_steps", "key_parts", "key_samples", "KeySamplesSum", "pool_runs"]
