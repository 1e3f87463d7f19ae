"""The samples of each key of a run: what two runs are compared on.

A *key* names "the same thing" in both runs: a span's ``path`` (``by=KeyBy.PATH``), or its level
and name (``by=KeyBy.NAME``, the way HolisticTraceAnalysis compares). A key's *samples* are its
duration per step (the sum of its spans in that step); spans outside every step are one sample
each. Functions here take and return DataFrames; :func:`xsp.diff` puts them together.
"""

from __future__ import annotations

import json
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from xsp.analysis.lines import fused_line_rows, line_keys
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
    if not len(spans):
        return _empty_keys()
    if by is KeyBy.LINE and kernel_sources:
        fused = fused_line_rows(spans, kernel_sources)
        if len(fused):
            spans = pd.concat([spans, fused], ignore_index=True)
    parents = parent_positions(spans)
    kept = np.ones(len(spans), dtype=bool)
    if levels is not None:
        kept &= spans[col.LEVEL].isin([level.value for level in levels]).to_numpy()
    step = spans[col.STEP]
    if steps is not None:
        kept &= step.isin(_chosen_steps(step, steps)).fillna(False).to_numpy(dtype=bool)
    if by is KeyBy.LINE:
        key_text = line_keys(spans, parents)
    else:
        key_text = _step_free_paths(spans[col.PATH]) if by is KeyBy.PATH else spans[col.NAME]
    kept &= key_text.notna().to_numpy()
    if not kept.any():
        return _empty_keys()
    parents = nearest_ancestor(spans, kept, parents)  # the parent among the kept spans
    level_codes, level_names = pd.factorize(spans[col.LEVEL])
    text_codes, texts = pd.factorize(key_text)
    combined = np.where(kept, text_codes.astype(np.int64) * (len(level_names) + 1) + level_codes, -1)
    rows = np.flatnonzero(kept)
    code, _ = pd.factorize(combined[rows])  # keys numbered from 0 in order of their first span
    key_count = int(code.max()) + 1 if len(code) else 0
    duration = spans[col.DURATION_NS].to_numpy(dtype=np.int64)[rows]
    step_values = step.to_numpy(dtype=np.float64, na_value=np.nan)[rows]
    in_step = ~np.isnan(step_values)
    # a key seen in steps takes its samples from its steps only; others, one sample per span
    stepped_key = np.zeros(key_count, dtype=bool)
    stepped_key[code[in_step]] = True
    counted = in_step | ~stepped_key[code]
    unit = np.where(in_step, np.nan_to_num(step_values).astype(np.int64), -1 - np.arange(len(rows)))
    frame = pd.DataFrame({"code": code[counted], "unit": unit[counted], "d": duration[counted]})
    per_unit = frame.groupby(["code", "unit"], sort=True, observed=True)["d"].sum()
    unit_codes = per_unit.index.get_level_values(0).to_numpy()
    values = per_unit.to_numpy(dtype=np.int64)
    order = np.lexsort((values, unit_codes))  # by key, then by value: each key's samples sorted
    values, unit_codes = values[order], unit_codes[order]
    bounds = np.searchsorted(unit_codes, np.arange(key_count + 1))
    samples = [values[bounds[i]:bounds[i + 1]] for i in range(key_count)]
    first = np.full(key_count, -1, dtype=np.int64)
    first[code[::-1]] = rows[::-1]  # each key's first span
    parent_row = parents[first]
    key_of_row = np.full(len(spans), -1, dtype=np.int64)
    key_of_row[rows] = code
    parent_code = np.where(parent_row >= 0, key_of_row[np.maximum(parent_row, 0)], -1)
    key_strings = texts.to_numpy(dtype=object)[text_codes[first]]
    table = pd.DataFrame({
        col.LEVEL: spans[col.LEVEL].to_numpy(dtype=object)[first],
        col.KIND: spans[col.KIND].to_numpy(dtype=object)[first],
        col.NAME: spans[col.NAME].to_numpy(dtype=object)[first],
        KEY: key_strings,
        PARENT_KEY: np.where(parent_code >= 0, key_strings[np.maximum(parent_code, 0)], None),
        COUNT: np.bincount(code, minlength=key_count),
        TOTAL_NS: np.bincount(code, weights=duration, minlength=key_count).astype(np.int64),
        SAMPLES_NS: samples,
        SAMPLE_COUNT: np.diff(bounds),
        col.INPUT_SHAPES: _first_values(spans, col.INPUT_SHAPES, rows, code, key_count),
        KERNELS_PER_STEP: _kernels_per_step(spans, parents, rows, code, unit, key_count),
        INPUT_DTYPES: _input_dtypes(spans, rows, code, key_count),
        CI_NS: _intervals(spans, rows[counted], code[counted], np.diff(bounds), key_count),
    })
    return table


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


def _intervals(spans: pd.DataFrame, rows: np.ndarray, code: np.ndarray, sample_count: np.ndarray,
               count: int) -> np.ndarray:
    """Per key of one sample (a leveled trace's one merged step), the half-width of its figure's
    95% interval: its spans' ``duration_ci_ns`` added in quadrature (NaN where a span has none,
    where the key has several samples, or where the trace holds no intervals)."""
    intervals = np.full(count, np.nan)
    if col.DURATION_CI_NS not in spans or not len(rows):
        return intervals
    found = spans[col.DURATION_CI_NS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan)[rows]
    if np.isnan(found).all():
        return intervals
    squares = np.bincount(code, weights=np.nan_to_num(found) ** 2, minlength=count)
    unknown = np.bincount(code, weights=np.isnan(found).astype(np.float64), minlength=count) > 0
    return np.where((sample_count == 1) & ~unknown, np.sqrt(squares), np.nan)


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


def _chosen_steps(step: pd.Series, steps: slice | list[int]) -> list[int]:
    if isinstance(steps, slice):
        return sorted(int(s) for s in step.dropna().unique())[steps]
    return [int(s) for s in steps]


def _first_values(spans: pd.DataFrame, column: str, rows: np.ndarray, code: np.ndarray, count: int) -> np.ndarray:
    """The first non-null value of ``column`` among each key's spans (None where all are null)."""
    result = np.full(count, None, dtype=object)
    if column not in spans:
        return result
    values = spans[column].to_numpy(dtype=object, na_value=None)[rows]
    present = np.flatnonzero(pd.notna(values))
    result[code[present[::-1]]] = values[present[::-1]]
    return result


def _input_dtypes(spans: pd.DataFrame, rows: np.ndarray, code: np.ndarray, count: int) -> np.ndarray:
    """Each operator key's input dtypes as text (``"float, float"``), from the first of its spans
    whose attributes name them (None for other keys)."""
    result = np.full(count, None, dtype=object)
    if col.ATTRIBUTES not in spans:
        return result
    operator = (spans[col.LEVEL].to_numpy(dtype=object)[rows] == Level.OPERATOR.value)
    if not operator.any():
        return result
    texts = spans[col.ATTRIBUTES].iloc[rows[operator]]
    # only the spans whose attributes name input dtypes are parsed (found by a vectorised search)
    naming = texts.str.contains(DTYPE_PATTERN, regex=True).fillna(False).to_numpy(dtype=bool)
    candidates = np.flatnonzero(naming)
    codes = code[operator][candidates]
    for key_code, text in zip(codes.tolist(), texts.iloc[candidates].tolist()):  # the first span wins
        if result[key_code] is not None or not isinstance(text, str):
            continue
        try:
            found = json.loads(text)
        except ValueError:
            continue
        dtypes = next((found[name] for name in DTYPE_ATTRIBUTES if isinstance(found, dict) and name in found), None)
        if isinstance(dtypes, list) and any(dtypes):
            result[key_code] = ", ".join(str(dtype) for dtype in dtypes)
    return result


def _kernels_per_step(spans: pd.DataFrame, parents: np.ndarray, rows: np.ndarray, code: np.ndarray,
                      unit: np.ndarray, count: int) -> np.ndarray:
    """Median kernels launched per step under each layer key (NaN for other keys, or no kernels)."""
    result = np.full(count, np.nan)
    kernels = (spans[col.KIND] == SpanKind.KERNEL.value).to_numpy()
    if not kernels.any():
        return result
    is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
    owner = nearest_ancestor(spans, is_layer, parents)[kernels]  # the innermost layer of each kernel
    owner = owner[owner >= 0]
    position = np.full(len(spans), -1, dtype=np.int64)
    position[rows] = np.arange(len(rows))
    owner = position[owner]
    owner = owner[owner >= 0]
    per_unit = pd.DataFrame({"code": code[owner], "unit": unit[owner]}).value_counts()
    medians = per_unit.groupby(level=0, observed=True).median()
    layer_codes = np.unique(code[is_layer[rows]])
    result[layer_codes] = 0.0  # a layer whose kernels are all gone launches 0
    result[medians.index.to_numpy(dtype=np.int64)] = medians.to_numpy(dtype=np.float64)
    return result

__all__ = ["key_samples", "pool_runs"]
