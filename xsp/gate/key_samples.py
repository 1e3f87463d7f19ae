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
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from xsp.analysis.lines import fused_line_rows, line_keys, relative_files
from xsp.core import schema as col
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
    TOTAL_NS,
    KeyBy,
)
from xsp.gate.significance import from_quantiles
from xsp.io.kineto import STEP_NAME
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
    parts = key_parts(spans, order, by, levels, chosen_steps(present, steps), kernel_sources)
    return keys_from_parts([parts], by)


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
    """What one part of a run (a window of whole trees, or all of it) tells of its keys: added
    up over the parts by :func:`keys_from_parts`, it gives :func:`key_samples` of the whole."""

    keys: pd.DataFrame
    """Per key: its first span's place, level, kind, name and parent's key; count, total; the
    sums for its interval in and outside steps; its first shapes and dtypes, with their places."""
    in_steps: pd.DataFrame
    """Per key and step: the time of its spans in the step."""
    outside_steps: pd.DataFrame
    """Per span outside steps: its key and time (one sample each, for keys never in a step)."""
    kernel_units: pd.DataFrame
    """Per layer key and unit (a step, or a layer span outside steps): kernels launched under it."""
    layer_keys: pd.DataFrame
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
        in_steps=_named(in_steps, keys),
        outside_steps=_named(pd.DataFrame({"code": code[~in_step], "d": duration[~in_step]}), keys),
        kernel_units=_named(_kernel_units(spans, parents, rows, code, unit), keys),
        layer_keys=keys.loc[np.unique(code[(level_values[rows] == Level.LAYER.value)]), _LEVEL_KEY],
        line_files=line_files)


def _named(frame: pd.DataFrame, keys: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its key codes replaced by the keys' level and text."""
    codes = frame.pop("code").to_numpy(dtype=np.int64)
    frame.insert(0, KEY, keys[KEY].to_numpy(dtype=object)[codes])
    frame.insert(0, col.LEVEL, keys[col.LEVEL].to_numpy(dtype=object)[codes])
    return frame


def keys_from_parts(parts: list[KeyParts], by: KeyBy = KeyBy.PATH) -> pd.DataFrame:
    """:func:`key_samples` of a run from the :class:`KeyParts` of its parts (each key's rows
    added up, its first span the earliest in the run)."""
    keyed = [part for part in parts if len(part.keys)]
    if not keyed:
        return _empty_keys()
    every = pd.concat([part.keys for part in keyed], ignore_index=True)
    every = every.sort_values(list(_ORDER), kind="stable")
    group = every.groupby(_LEVEL_KEY, sort=False, dropna=False)
    keys = group.head(1).reset_index(drop=True)  # in order of their first span, as it ran
    index = pd.MultiIndex.from_frame(keys[_LEVEL_KEY])
    summed = group[[COUNT, TOTAL_NS, "_ci_in", "_ci_out"]].sum().reindex(index)
    unknown = group[["_unknown_in", "_unknown_out"]].any().reindex(index)
    firsts = {}
    for column in (col.INPUT_SHAPES, INPUT_DTYPES):
        places = [f"{column}{name}" for name in _ORDER]
        found = every[every[column].notna()].sort_values(places, kind="stable")
        firsts[column] = found.groupby(_LEVEL_KEY, sort=False, dropna=False)[column].first().reindex(index)
    position = pd.Series(np.arange(len(keys)), index=index)
    in_steps = pd.concat([part.in_steps for part in keyed], ignore_index=True)
    in_steps = in_steps.groupby([*_LEVEL_KEY, col.STEP], sort=False, dropna=False)["d"].sum().reset_index()
    stepped = np.zeros(len(keys), dtype=bool)
    step_code = position.reindex(pd.MultiIndex.from_frame(in_steps[_LEVEL_KEY])).to_numpy(dtype=np.int64)
    stepped[step_code] = True
    outside = pd.concat([part.outside_steps for part in keyed], ignore_index=True)
    outside_code = position.reindex(pd.MultiIndex.from_frame(outside[_LEVEL_KEY])).to_numpy(dtype=np.int64)
    alone = ~stepped[outside_code]  # a key seen in steps takes its samples from its steps only
    sample_code = np.concatenate([step_code, outside_code[alone]])
    values = np.concatenate([in_steps["d"].to_numpy(dtype=np.int64), outside["d"].to_numpy(dtype=np.int64)[alone]])
    sorting = np.lexsort((values, sample_code))  # by key, then by value: each key's samples sorted
    values, sample_code = values[sorting], sample_code[sorting]
    bounds = np.searchsorted(sample_code, np.arange(len(keys) + 1))
    sample_count = np.diff(bounds)
    squares = np.where(stepped, summed["_ci_in"].to_numpy(), summed["_ci_out"].to_numpy())
    unknowns = np.where(stepped, unknown["_unknown_in"].to_numpy(), unknown["_unknown_out"].to_numpy())
    table = pd.DataFrame({
        col.LEVEL: keys[col.LEVEL].to_numpy(dtype=object),
        col.KIND: keys[col.KIND].to_numpy(dtype=object),
        col.NAME: keys[col.NAME].to_numpy(dtype=object),
        KEY: keys[KEY].to_numpy(dtype=object),
        PARENT_KEY: keys[PARENT_KEY].to_numpy(dtype=object),
        COUNT: summed[COUNT].to_numpy(dtype=np.int64),
        TOTAL_NS: summed[TOTAL_NS].to_numpy(dtype=np.int64),
        SAMPLES_NS: [values[bounds[i]:bounds[i + 1]] for i in range(len(keys))],
        SAMPLE_COUNT: sample_count,
        col.INPUT_SHAPES: _objects(firsts[col.INPUT_SHAPES]),
        KERNELS_PER_STEP: _kernels_per_step(keyed, position),
        INPUT_DTYPES: _objects(firsts[INPUT_DTYPES]),
        CI_NS: np.where((sample_count == 1) & ~unknowns, np.sqrt(squares), np.nan),
    })
    files = set().union(*(part.line_files for part in parts))
    if by is KeyBy.LINE and files:
        shown = relative_files(files)
        for column in (KEY, PARENT_KEY):
            table[column] = [_MARKED_FILE.sub(lambda found: shown.get(found.group(1), found.group(1)), text)
                             if isinstance(text, str) else text for text in table[column]]
    return table


def _objects(values: pd.Series) -> np.ndarray:
    """Values as objects, None where missing."""
    return np.array([None if pd.isna(value) else value for value in values], dtype=object)


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
    return KeyParts(keys=nothing.iloc[0:0], in_steps=nothing, outside_steps=nothing, kernel_units=nothing,
                    layer_keys=nothing)


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


def _kernels_per_step(parts: list[KeyParts], position: pd.Series) -> np.ndarray:
    """Median kernels launched per step under each layer key (NaN for other keys, or no kernels)."""
    result = np.full(len(position), np.nan)
    layers = pd.concat([part.layer_keys for part in parts], ignore_index=True)
    if not len(layers):
        return result
    units = pd.concat([part.kernel_units for part in parts], ignore_index=True)
    if not len(units):  # no kernel at all: no figure, as for a trace without the kernel level
        return result
    result[position.reindex(pd.MultiIndex.from_frame(layers)).to_numpy(dtype=np.int64)] = 0.0
    per_unit = units.groupby([*_LEVEL_KEY, "unit"], sort=False, dropna=False)["kernels"].sum()
    medians = per_unit.groupby(level=[0, 1], sort=False, dropna=False).median()
    result[position.reindex(medians.index).to_numpy(dtype=np.int64)] = medians.to_numpy(dtype=np.float64)
    return result


__all__ = ["KeyParts", "chosen_steps", "key_parts", "key_samples", "keys_from_parts", "pool_runs"]
