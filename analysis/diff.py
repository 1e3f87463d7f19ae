"""Comparing two runs key by key: per-step samples, rank tests under false-discovery control,
the top-down breakdown of a delta, and the changes of structure between the runs.

A *key* names "the same thing" in both runs: a span's ``path`` (``by=KeyBy.PATH``), or its level
and name (``by=KeyBy.NAME``, the way HolisticTraceAnalysis compares). A key's *samples* are its
duration per step (the sum of its spans in that step); spans outside every step are one sample
each. Functions here take and return DataFrames; :func:`xsp.diff` puts them together.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, Final

import numpy as np
import pandas as pd
from scipy import stats

from xsp import schema as col
from xsp.schema import Level, SpanKind
from xsp.tree import nearest_ancestor, parent_positions


class KeyBy(str, enum.Enum):
    """How spans of two runs are matched."""

    PATH = "path"
    """By ``path``: one key per place in the model (``predict[0]/layer1.0.conv1[0]``)."""
    NAME = "name"
    """By level and name: every ``aten::conv2d`` together."""


class Verdict(str, enum.Enum):
    """What happened to a key (and, for the first three, to the whole run)."""

    REGRESSED = "regressed"
    IMPROVED = "improved"
    UNCHANGED = "unchanged"
    ADDED = "added"
    REMOVED = "removed"


class Test(str, enum.Enum):
    """The statistic behind a key's verdict."""

    RANK = "mann-whitney"
    """Mann-Whitney U on the per-step samples, Benjamini-Hochberg over all keys tested."""
    RUNS = "runs"
    """Several runs on each side but too few steps for a rank test (a span outside steps, one
    per run): the between-run t test on the runs' values alone."""
    RANK_AND_RUNS = "mann-whitney+runs"
    """Several runs on each side: the rank test on the pooled steps *and* a t test on the runs'
    medians (their logarithms, the variance moderated across keys) must both reject; the
    larger p-value is the key's."""
    OVERLAP = "interval-overlap"
    """Too few samples for a rank test: the two sides' ranges must not overlap."""
    NONE = "none"
    """One sample on a side: noise cannot be told from change, so no verdict is given."""


MIN_RANK_SAMPLES: Final = 5
"""Samples each side needs for the rank test (with 5 and 5, its smallest p is 0.008)."""
MIN_OVERLAP_SAMPLES: Final = 2
"""Samples each side needs for the interval-overlap fallback."""
MIN_RUNS: Final = 2
"""Runs each side needs (a key present in each) for the between-run test."""

# columns of a key-samples frame (one row per key of one run)
KEY: Final = "key"
PARENT_KEY: Final = "parent_key"
COUNT: Final = "count"
TOTAL_NS: Final = "total_ns"
SAMPLES_NS: Final = "samples_ns"
"""Sorted per-step durations (an int64 array per key)."""
SAMPLE_COUNT: Final = "sample_count"
"""Steps (or lone spans) the samples came from; more than ``len(samples_ns)`` in a summary
that kept quantiles only."""
KERNELS_PER_STEP: Final = "kernels_per_step"
"""Median count of kernel-level spans under a layer per step (NaN: no kernels recorded)."""
INPUT_DTYPES: Final = "input_dtypes"
"""The dtypes of a key's tensor inputs, as text (from the operator level: xsp's ``input_dtypes``
attribute, a Kineto trace's ``Input type``), or None."""
DTYPE_ATTRIBUTES: Final = ("input_dtypes", "Input type")
"""Attribute keys that hold an operator's input dtypes, in xsp's traces and in Kineto's."""
_DTYPE_PATTERN: Final = "|".join(re.escape(name) for name in DTYPE_ATTRIBUTES)
RUN_MEDIANS_NS: Final = "run_medians_ns"
"""Of a frame pooled from several runs (:func:`pool_runs`): the median of each run the key
appeared in (a float array); what the between-run test compares."""
RUNS: Final = "runs"
"""Of a pooled frame: the runs it was pooled from (the same in every row)."""
KEY_COLUMNS: Final = (col.LEVEL, col.KIND, col.NAME, KEY, PARENT_KEY, COUNT, TOTAL_NS, SAMPLES_NS, SAMPLE_COUNT,
                      col.INPUT_SHAPES, KERNELS_PER_STEP, INPUT_DTYPES)

# columns of a diff table (one row per key of either run)
BASE_COUNT: Final = "base_count"
NEW_COUNT: Final = "new_count"
BASE_TOTAL_NS: Final = "base_total_ns"
NEW_TOTAL_NS: Final = "new_total_ns"
BASE_MEDIAN_NS: Final = "base_median_ns"
NEW_MEDIAN_NS: Final = "new_median_ns"
DELTA_NS: Final = "delta_ns"
"""Change of the median per-step duration, new minus base."""
RATIO: Final = "ratio"
P_VALUE: Final = "p_value"
Q_VALUE: Final = "q_value"
"""``p_value`` adjusted by Benjamini-Hochberg over every key tested."""
VERDICT: Final = "verdict"
EXPLAINS: Final = "explains"
"""Share of the parent key's delta that this key's delta accounts for."""
TEST: Final = "test"
BASE_SAMPLES: Final = "base_samples"
NEW_SAMPLES: Final = "new_samples"
BASE_CV: Final = "base_cv"
NEW_CV: Final = "new_cv"
"""Coefficient of variation (standard deviation over mean) of each side's samples."""
NOTE: Final = "note"
RUN_P_VALUE: Final = "run_p_value"
"""With several runs per side: the t test of the runs' medians (NaN otherwise)."""
BASE_RUNS: Final = "base_runs"
NEW_RUNS: Final = "new_runs"
"""Runs pooled on each side (1 for a single trace or summary)."""
ADJUSTED_RATIO: Final = "adjusted_ratio"
"""What the verdict judged: ``ratio``, or, where the new run's times were divided by a factor
(its machine's speed against the base's, or with ``normalize`` the common shift), the ratio
after that division."""
ADJUSTED_DELTA_NS: Final = "adjusted_delta_ns"
"""``delta_ns`` as the verdict judged it (see ``adjusted_ratio``); ``explains`` and the
breakdown are in these terms."""
RELATIVE_RATIO: Final = "relative_ratio"
"""``ratio`` over the new run's common shift: a secondary view of which keys moved more (or less)
than the run as a whole, never what the verdict judged unless ``normalize`` was asked for."""
COMMON_SHIFT: Final = "common_shift"
"""Key of ``table.attrs`` that holds the new run's common shift."""
JUDGED_FACTOR: Final = "judged_factor"
"""Key of ``table.attrs`` that holds what the new run's times were divided by before judging."""
MIN_SHIFT_KEYS: Final = 3
"""Keys below the model level a common shift needs."""
DIFF_COLUMNS: Final = (col.LEVEL, col.KIND, KEY, BASE_COUNT, NEW_COUNT, BASE_TOTAL_NS, NEW_TOTAL_NS, BASE_MEDIAN_NS,
                       NEW_MEDIAN_NS, DELTA_NS, RATIO, P_VALUE, VERDICT, EXPLAINS, col.NAME, PARENT_KEY, Q_VALUE,
                       TEST, BASE_SAMPLES, NEW_SAMPLES, BASE_CV, NEW_CV, ADJUSTED_RATIO, ADJUSTED_DELTA_NS, NOTE,
                       RUN_P_VALUE, BASE_RUNS, NEW_RUNS, RELATIVE_RATIO)

# columns of a changes frame
CHANGE: Final = "change"
BASE_VALUE: Final = "base"
NEW_VALUE: Final = "new"


class Change(str, enum.Enum):
    """A change of structure between two runs."""

    ADDED = "added"
    """Spans present only in the new run (the root of an added subtree, with its size)."""
    REMOVED = "removed"
    INPUT_SHAPES = "input shapes"
    INPUT_DTYPES = "input dtypes"
    """An operator's inputs changed dtype (float32 to bfloat16 under autocast, say)."""
    KERNEL_COUNT = "kernel count"
    """A layer launches a different number of kernels per step (a fusion lost or gained)."""
    MEMORY_COPIES = "memory copies"
    SYNCHRONISATIONS = "synchronisations"


# ---------------------------------------------------------------------------------------------
# samples


def key_samples(spans: pd.DataFrame, by: KeyBy = KeyBy.PATH, levels: tuple[Level, ...] | None = None,
                steps: slice | list[int] | None = None) -> pd.DataFrame:
    """One row per key of one run: its spans' count and total, and its per-step samples.

    Args:
        spans: a canonical span table.
        by: how keys are made (see :class:`KeyBy`).
        levels: the levels to keep (all when None). A key's parent is its nearest ancestor at
            a kept level.
        steps: the steps to keep, as step numbers or as a slice of the run's steps in order
            (``slice(5, None)`` leaves out the first five); spans outside steps are kept only
            when this is None.
    """
    if not len(spans):
        return _empty_keys()
    parents = parent_positions(spans)
    kept = np.ones(len(spans), dtype=bool)
    if levels is not None:
        kept &= spans[col.LEVEL].isin([level.value for level in levels]).to_numpy()
    step = spans[col.STEP]
    if steps is not None:
        kept &= step.isin(_chosen_steps(step, steps)).fillna(False).to_numpy(dtype=bool)
    key_text = spans[col.PATH] if by is KeyBy.PATH else spans[col.NAME]
    kept &= key_text.notna().to_numpy()
    if not kept.any():
        return _empty_keys()
    parents = nearest_ancestor(spans, kept, parents)  # the parent among the kept spans
    level_codes, level_names = pd.factorize(spans[col.LEVEL])
    text_codes, texts = pd.factorize(key_text)
    combined = np.where(kept, text_codes.astype(np.int64) * (len(level_names) + 1) + level_codes, -1)
    codes, _ = pd.factorize(combined)  # 0 is the first kept key unless row 0 was dropped
    rows = np.flatnonzero(kept)
    code = codes[rows]
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
    per_unit = frame.groupby(["code", "unit"], sort=True)["d"].sum()
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
    })
    return table


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
        rebuilt = _from_quantiles(list(frame[SAMPLES_NS]), frame[SAMPLE_COUNT].to_numpy(dtype=np.int64))
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
    naming = texts.str.contains(_DTYPE_PATTERN, regex=True).fillna(False).to_numpy(dtype=bool)
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
    medians = per_unit.groupby(level=0).median()
    layer_codes = np.unique(code[is_layer[rows]])
    result[layer_codes] = 0.0  # a layer whose kernels are all gone launches 0
    result[medians.index.to_numpy(dtype=np.int64)] = medians.to_numpy(dtype=np.float64)
    return result


# ---------------------------------------------------------------------------------------------
# comparison


def compare(base: pd.DataFrame, new: pd.DataFrame, threshold: float = 0.05, min_delta_ns: int = 20_000,
            alpha: float = 0.01, normalize: bool = False, speed: float = 1.0) -> pd.DataFrame:
    """The diff table of two key-samples frames (:func:`key_samples`), one row per key.

    A key present in both is ``regressed`` (or ``improved``) only when its median per-step
    duration changed by at least ``threshold`` (relative) *and* ``min_delta_ns`` *and* the
    change is significant: Mann-Whitney U with the Benjamini-Hochberg false-discovery rate at
    ``alpha`` over every key tested, or, with fewer than :data:`MIN_RANK_SAMPLES` samples on a
    side, ranges that do not overlap. With one sample on a side no verdict is given. Where
    both sides were pooled from several runs (:func:`pool_runs`, at least :data:`MIN_RUNS` with
    the key on each side), the runs' medians must also differ by a t test: steps of one
    run share that run's machine state, so only the spread between runs tells a process that
    ran a little slower from a change. A key is never called regressed when its measured median
    fell, nor improved when it rose.

    Times are judged as measured, except that the new run's are first divided by ``speed``:
    how much longer its machine took for the same fixed work than the base's
    (:mod:`xsp.machine_speed`), the evidence that the two ran on machines of different speeds.
    With ``normalize``, they are divided by the run's *common shift* instead: the median ratio
    over the keys below the model level (see :func:`common_shift`). That hides every change
    that moves all keys alike (a model moved to float64), so it is a view for attribution, not
    a check. The ``ratio`` and ``delta_ns`` columns keep what was measured; ``adjusted_ratio``
    is the ratio the verdict judged; ``relative_ratio`` is the ratio over the common shift.
    """
    merged = base.merge(new, on=[col.LEVEL, KEY], how="outer", suffixes=("_base", "_new"), sort=False)
    count = len(merged)
    in_base = merged[SAMPLES_NS + "_base"].notna().to_numpy()
    in_new = merged[SAMPLES_NS + "_new"].notna().to_numpy()
    empty = np.zeros(0, dtype=np.int64)
    base_samples = [s if isinstance(s, np.ndarray) else empty for s in merged[SAMPLES_NS + "_base"]]
    new_samples = [s if isinstance(s, np.ndarray) else empty for s in merged[SAMPLES_NS + "_new"]]
    n_base, base_median, base_cv = _sample_stats(base_samples)
    n_new, new_median, new_cv = _sample_stats(new_samples)
    both = in_base & in_new
    delta, ratio = _change(base_median, new_median, both)
    delta = np.where(both, delta, np.where(in_new, new_median, -base_median))  # added: all of it; removed: minus
    ranked = both & (n_base >= MIN_RANK_SAMPLES) & (n_new >= MIN_RANK_SAMPLES)
    shift = common_shift(merged[col.LEVEL].to_numpy(dtype=object), ratio, ranked)
    factor = shift if normalize else speed
    adjusted_delta, adjusted_ratio = _change(base_median, new_median / factor, both)
    adjusted_delta = np.where(both, adjusted_delta, delta)
    relative_ratio = _change(base_median, new_median / shift, both)[1]
    judged_samples = new_samples if factor == 1.0 else [s / factor for s in new_samples]
    p_values = np.full(count, np.nan)
    base_counts = merged[SAMPLE_COUNT + "_base"].fillna(0).to_numpy(dtype=np.int64)
    new_counts = merged[SAMPLE_COUNT + "_new"].fillna(0).to_numpy(dtype=np.int64)
    _rank_tests(_from_quantiles(base_samples, base_counts), _from_quantiles(judged_samples, new_counts),
                np.flatnonzero(ranked), p_values)
    base_runs, base_run_medians = _run_medians(merged, "_base")
    new_runs, new_run_medians = _run_medians(merged, "_new")
    between = both & (np.fromiter(map(len, base_run_medians), np.int64, count) >= MIN_RUNS) & (
        np.fromiter(map(len, new_run_medians), np.int64, count) >= MIN_RUNS)
    run_p_values = np.full(count, np.nan)
    _run_tests(base_run_medians, [m / factor for m in new_run_medians], np.flatnonzero(between), run_p_values)
    # both must reject (an intersection-union test: the larger p-value is a valid one)
    p_values[between] = np.fmax(np.nan_to_num(p_values[between], nan=0.0), run_p_values[between])
    tested = ranked | between
    q_values = np.full(count, np.nan)
    q_values[tested] = benjamini_hochberg(p_values[tested])
    overlap = both & ~tested & (n_base >= MIN_OVERLAP_SAMPLES) & (n_new >= MIN_OVERLAP_SAMPLES)
    apart = np.zeros(count, dtype=bool)
    for i in np.flatnonzero(overlap).tolist():
        b, n = base_samples[i], judged_samples[i]
        apart[i] = n[0] > b[-1] or n[-1] < b[0]
    significant = (tested & (q_values <= alpha)) | (overlap & apart)
    large = ((np.abs(np.nan_to_num(adjusted_ratio, nan=1.0) - 1.0) >= threshold)
             & (np.abs(adjusted_delta) >= min_delta_ns))
    verdict = np.full(count, Verdict.UNCHANGED.value, dtype=object)
    # against the common shift, never against what was measured: a key whose median fell is not
    # called slower because the rest of its run slowed down more. A machine's measured speed is
    # evidence: a regression a faster machine hid is still one
    slower, faster = adjusted_delta > 0, adjusted_delta < 0
    if normalize:
        slower, faster = slower & (delta > 0), faster & (delta < 0)
    verdict[both & large & significant & slower] = Verdict.REGRESSED.value
    verdict[both & large & significant & faster] = Verdict.IMPROVED.value
    verdict[in_new & ~in_base] = Verdict.ADDED.value
    verdict[in_base & ~in_new] = Verdict.REMOVED.value
    test = np.full(count, Test.NONE.value, dtype=object)
    test[ranked], test[overlap] = Test.RANK.value, Test.OVERLAP.value
    test[between] = Test.RUNS.value
    test[between & ranked] = Test.RANK_AND_RUNS.value
    note = np.full(count, None, dtype=object)
    note[both & ~tested & ~overlap] = "one sample on a side: no verdict"
    note[overlap] = "few samples: ranges compared"
    table = pd.DataFrame({
        col.LEVEL: merged[col.LEVEL].to_numpy(dtype=object),
        col.KIND: merged[col.KIND + "_new"].fillna(merged[col.KIND + "_base"]).to_numpy(dtype=object),
        KEY: merged[KEY].to_numpy(dtype=object),
        BASE_COUNT: merged[COUNT + "_base"].fillna(0).to_numpy(dtype=np.int64),
        NEW_COUNT: merged[COUNT + "_new"].fillna(0).to_numpy(dtype=np.int64),
        BASE_TOTAL_NS: merged[TOTAL_NS + "_base"].fillna(0).to_numpy(dtype=np.int64),
        NEW_TOTAL_NS: merged[TOTAL_NS + "_new"].fillna(0).to_numpy(dtype=np.int64),
        BASE_MEDIAN_NS: base_median,
        NEW_MEDIAN_NS: new_median,
        DELTA_NS: delta,
        RATIO: ratio,
        P_VALUE: p_values,
        VERDICT: verdict,
        EXPLAINS: np.nan,
        col.NAME: merged[col.NAME + "_new"].fillna(merged[col.NAME + "_base"]).to_numpy(dtype=object),
        PARENT_KEY: merged[PARENT_KEY + "_new"].fillna(merged[PARENT_KEY + "_base"]).to_numpy(dtype=object),
        Q_VALUE: q_values,
        TEST: test,
        BASE_SAMPLES: merged[SAMPLE_COUNT + "_base"].fillna(0).to_numpy(dtype=np.int64),
        NEW_SAMPLES: merged[SAMPLE_COUNT + "_new"].fillna(0).to_numpy(dtype=np.int64),
        BASE_CV: base_cv,
        NEW_CV: new_cv,
        ADJUSTED_RATIO: adjusted_ratio,
        ADJUSTED_DELTA_NS: adjusted_delta,
        NOTE: note,
        RUN_P_VALUE: run_p_values,
        BASE_RUNS: base_runs,
        NEW_RUNS: new_runs,
        RELATIVE_RATIO: relative_ratio,
    })
    table.attrs[COMMON_SHIFT] = shift
    table.attrs[JUDGED_FACTOR] = factor
    table[EXPLAINS] = _explains(table)
    return table


def _change(base_median: np.ndarray, new_median: np.ndarray, both: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Delta and ratio of the medians where a key is in both runs (NaN elsewhere)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.where(both, new_median - base_median, np.nan),
                np.where(both & (base_median > 0), new_median / base_median, np.nan))


def common_shift(levels: np.ndarray, ratio: np.ndarray, tested: np.ndarray) -> float:
    """The ratio by which the whole new run moved: the median ratio of the keys below the
    model level that were rank-tested (1.0 with fewer than :data:`MIN_SHIFT_KEYS` of them).

    A median over keys, not over time: a change confined to a minority of the keys leaves it
    alone however much time those keys take, and a change in most keys looks like the whole
    run moving (which is reported, but is no key's regression).
    """
    chosen = tested & ~np.isin(levels, [Level.MODEL.value, Level.INPUT.value]) & np.isfinite(ratio) & (ratio > 0)
    if int(chosen.sum()) < MIN_SHIFT_KEYS:
        return 1.0
    return float(np.exp(np.median(np.log(ratio[chosen]))))


MAX_REBUILT_SAMPLES: Final = 200
"""Samples rebuilt from a summary's quantiles for a rank test, at most."""


def _from_quantiles(samples: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    """Each key's samples for the rank test: as they are, or, where a baseline summary kept
    only evenly spaced quantiles of more samples (``counts`` above their number), that many
    samples (at most :data:`MAX_REBUILT_SAMPLES`) read off the quantiles. A test of the
    quantiles alone would judge a key of 40 steps as if it had 9, and miss changes the run
    itself shows; the rebuilt samples rank against the new run's as the originals did."""
    rebuilt = list(samples)
    for i in np.flatnonzero(counts > np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))):
        kept = samples[i]
        if len(kept) < 2:
            continue
        size = int(min(counts[i], MAX_REBUILT_SAMPLES))
        levels = (np.arange(len(kept)) + 0.5) / len(kept)  # where baseline.summarize took them
        rebuilt[i] = np.interp(np.arange(size) / (size - 1), levels, kept.astype(np.float64))
    return rebuilt


def _rank_tests(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray, p_values: np.ndarray) -> None:
    """Two-sided Mann-Whitney U p-values for ``rows``, one vectorised call per pair of sample sizes."""
    if not len(rows):
        return
    sizes = pd.DataFrame({"row": rows, "nb": [len(base[i]) for i in rows], "nn": [len(new[i]) for i in rows]})
    for _, group in sizes.groupby(["nb", "nn"]):
        members = group["row"].to_numpy()
        x = np.stack([base[i] for i in members]).astype(np.float64)
        y = np.stack([new[i] for i in members]).astype(np.float64)
        same = (x.min(axis=1) == x.max(axis=1)) & (x.max(axis=1) == y.min(axis=1)) & (y.min(axis=1) == y.max(axis=1))
        with np.errstate(invalid="ignore", divide="ignore"):
            result = stats.mannwhitneyu(x, y, alternative="two-sided", axis=1)
        p = np.asarray(result.pvalue, dtype=np.float64)
        p_values[members] = np.where(same | np.isnan(p), 1.0, p)  # identical constant samples: no change


def _run_medians(merged: pd.DataFrame, side: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per row of a merged frame: the runs pooled on ``side`` and the key's per-run medians
    (empty where the side is one run, or lacks the key)."""
    empty = np.zeros(0)
    runs_column, medians_column = RUNS + side, RUN_MEDIANS_NS + side
    if medians_column not in merged:
        return np.ones(len(merged), dtype=np.int64), [empty] * len(merged)
    runs = merged[runs_column].fillna(merged[runs_column].max()).to_numpy(dtype=np.int64)
    return runs, [m if isinstance(m, np.ndarray) else empty for m in merged[medians_column]]


PRIOR_DF: Final = 8
"""Degrees of freedom the between-run test borrows from the other keys' spread (a moderated t
test): three runs a side leave a key 4 of its own, too few to tell a 20% change from noise
after the false-discovery correction."""


COPIES_VARIANCE: Final = 1e-16
"""A variance of log run medians at most this is rounding (the mean of equal numbers is not
always that number in floating point): the runs are copies of one run."""


def _run_tests(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray, p_values: np.ndarray) -> None:
    """A t test of the logarithms of each row's per-run medians (a ratio scale: a run 5% slower
    is as far from the others on a fast key as on a slow one), its variance moderated towards
    the typical spread of the keys tested (empirical Bayes, as limma does for gene expression:
    each key has few runs, but every key of the run shares the machine's noise)."""
    if not len(rows):
        return
    logs = [(np.log(np.maximum(base[i], 1.0)), np.log(np.maximum(new[i], 1.0))) for i in rows.tolist()]
    df = np.array([len(x) + len(y) - 2 for x, y in logs], dtype=np.float64)
    variance = np.array([((len(x) - 1) * x.var(ddof=1) if len(x) > 1 else 0.0)
                         + ((len(y) - 1) * y.var(ddof=1) if len(y) > 1 else 0.0) for x, y in logs])
    with np.errstate(invalid="ignore", divide="ignore"):
        variance = np.where(df > 0, variance / np.maximum(df, 1), np.nan)
    usable = np.isfinite(variance) & (df > 0)
    prior_df = PRIOR_DF if int(usable.sum()) >= MIN_SHIFT_KEYS else 0
    if prior_df:
        typical_df = float(np.median(df[usable]))
        # the median of a variance estimate with few degrees of freedom lies below its mean
        prior = float(np.median(variance[usable])) / (stats.chi2.ppf(0.5, typical_df) / typical_df)
        moderated = np.where(usable, (prior_df * prior + df * variance) / (prior_df + df), prior)
        # a key clearly noisier than the typical one (beyond what its few runs would make of a
        # typical spread one time in a hundred) keeps its own spread and degrees of freedom: a
        # whole model call under a machine's bursts varies far more than its layers' medians
        own = usable & (variance > prior * stats.chi2.ppf(0.99, np.maximum(df, 1)) / np.maximum(df, 1))
        variance = np.where(own, variance, moderated)
        df = np.where(own, df, df + prior_df)
    for row, (x, y), v, freedom in zip(rows.tolist(), logs, variance, df):
        gap = float(y.mean() - x.mean())
        if not np.isfinite(v) or v <= COPIES_VARIANCE or freedom <= 0:
            # runs that agree to the nanosecond are copies of one run, not several: no spread
            # to judge by, so no evidence of a change either
            p_values[row] = 1.0
            continue
        t = gap / np.sqrt(v * (1 / len(x) + 1 / len(y)))
        p_values[row] = float(2 * stats.t.sf(abs(t), freedom))


def smallest_p(base_samples: int, new_samples: int) -> float:
    """The smallest two-sided p-value a Mann-Whitney U test of these sample sizes can give
    (every sample of one side above every sample of the other)."""
    from math import comb

    return min(1.0, 2.0 / comb(base_samples + new_samples, base_samples))


def benjamini_hochberg(p_values: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values): reject where ``q <= alpha`` to keep the
    expected share of false discoveries among the rejected keys at ``alpha``."""
    p = np.asarray(p_values, dtype=np.float64)
    count = len(p)
    if not count:
        return p.copy()
    order = np.argsort(p)
    scaled = p[order] * count / np.arange(1, count + 1)
    adjusted = np.minimum.accumulate(scaled[::-1])[::-1]
    result = np.empty(count)
    result[order] = np.minimum(adjusted, 1.0)
    return result


def _sample_stats(samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Size, median and coefficient of variation of each (sorted) sample array, vectorised."""
    sizes = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
    flat = np.concatenate(samples).astype(np.float64) if len(samples) else np.zeros(0)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(samples) else sizes
    present = sizes > 0
    lo = np.minimum(starts + (sizes - 1) // 2, max(len(flat) - 1, 0))
    hi = np.minimum(starts + sizes // 2, max(len(flat) - 1, 0))
    median = np.where(present, (flat[lo] + flat[hi]) / 2 if len(flat) else 0.0, np.nan)
    safe = np.maximum(sizes, 1)
    total = np.add.reduceat(flat, np.minimum(starts, max(len(flat) - 1, 0))) if len(flat) else np.zeros(len(sizes))
    mean = np.where(present, total / safe, np.nan)
    squares = np.add.reduceat(flat ** 2, np.minimum(starts, max(len(flat) - 1, 0))) if len(flat) else total
    with np.errstate(invalid="ignore", divide="ignore"):
        variance = np.maximum(squares - safe * mean ** 2, 0.0) / np.maximum(sizes - 1, 1)
        cv = np.where((sizes >= 2) & (mean > 0), np.sqrt(variance) / mean, np.nan)
    return sizes, median, cv


def _explains(table: pd.DataFrame) -> np.ndarray:
    """Each key's delta over its parent key's delta (NaN for roots and for parents that did not move)."""
    count = len(table)
    # keys and parent keys factorized together; a parent is found by its key alone (its first row)
    codes, uniques = pd.factorize(pd.concat([table[KEY], table[PARENT_KEY]], ignore_index=True))
    key_codes, parent_codes = codes[:count], codes[count:]
    first_row = np.full(len(uniques), -1, dtype=np.int64)
    first_row[key_codes[::-1]] = np.arange(count - 1, -1, -1)
    parent_row = np.where(parent_codes >= 0, first_row[np.maximum(parent_codes, 0)], -1)
    has_parent = parent_row >= 0
    delta = table[ADJUSTED_DELTA_NS].to_numpy(dtype=np.float64)
    parent_delta = delta[np.maximum(parent_row, 0)]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(has_parent & (parent_delta != 0), delta / parent_delta, np.nan)
    return share


def overall_verdict(table: pd.DataFrame) -> Verdict:
    """``regressed`` if any key regressed, else ``improved`` if any improved, else ``unchanged``."""
    verdicts = set(table[VERDICT].tolist()) if len(table) else set()
    if Verdict.REGRESSED.value in verdicts:
        return Verdict.REGRESSED
    if Verdict.IMPROVED.value in verdicts:
        return Verdict.IMPROVED
    return Verdict.UNCHANGED


# ---------------------------------------------------------------------------------------------
# where it lives, and what changed shape

DEPTH: Final = "depth"


def breakdown(table: pd.DataFrame, min_share: float = 0.1, max_children: int = 3, max_depth: int = 4,
              max_roots: int = 3) -> pd.DataFrame:
    """The delta broken down top-down: the top-level keys that moved, the child keys that explain
    most of each one's delta (at least ``min_share`` of it), and so on down to kernels.

    Returns the rows of ``table`` in tree order with a ``depth`` column (0 for top-level keys).
    """
    if not len(table):
        return table.assign(**{DEPTH: pd.Series(dtype=np.int64)})
    present = table
    # each key's child rows, in table order, found through the sorted parent codes when asked
    parent_codes, parent_keys = pd.factorize(present[PARENT_KEY])
    parent_index = pd.Index(parent_keys)
    by_parent = np.argsort(parent_codes, kind="stable")
    sorted_codes = parent_codes[by_parent]

    def children(key: str | None) -> list[int]:
        code = -1 if key is None else int(parent_index.get_indexer([key])[0])
        if key is not None and code < 0:
            return []
        lo, hi = np.searchsorted(sorted_codes, [code, code + 1])
        return by_parent[lo:hi].tolist()

    delta = present[ADJUSTED_DELTA_NS].to_numpy(dtype=np.float64)
    moved = (present[VERDICT] != Verdict.UNCHANGED.value).to_numpy()
    keys = present[KEY].tolist()
    tested = (present[TEST] != Test.NONE.value).to_numpy()
    top = children(None)
    roots = [row for row in top if moved[row] and tested[row]] or [row for row in top if tested[row]]
    # a session's delta is the whole run's (one sample a run), not a step's: it would always
    # outrank the model call it holds many times, so it comes after the per-step keys
    whole_run = (present[col.KIND] == SpanKind.SESSION.value).to_numpy()
    roots = sorted(roots, key=lambda row: (bool(whole_run[row]), -abs(delta[row])))[:max_roots]
    order: list[tuple[int, int]] = []

    def walk(row: int, depth: int) -> None:
        order.append((row, depth))
        if depth >= max_depth or delta[row] == 0:
            return
        below = [r for r in children(keys[row]) if np.sign(delta[r]) == np.sign(delta[row])
                 and abs(delta[r]) >= min_share * abs(delta[row])]
        for child in sorted(below, key=lambda r: -abs(delta[r]))[:max_children]:
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    rows = [row for row, _ in order]
    return present.iloc[rows].assign(**{DEPTH: [depth for _, depth in order]}).reset_index(drop=True)


def structure_changes(base: pd.DataFrame, new: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Changes of structure between two runs: added and removed subtrees (their root key, with
    how many keys they hold), changed input shapes and (operators') input dtypes, layers whose
    kernel count per step changed, and more memory copies or synchronisations per step."""
    rows: list[dict[str, object]] = []
    for verdict, change in ((Verdict.ADDED, Change.ADDED), (Verdict.REMOVED, Change.REMOVED)):
        moved = table[table[VERDICT] == verdict.value]
        moved_keys = set(moved[KEY].tolist())
        for level, key, parent in zip(moved[col.LEVEL], moved[KEY], moved[PARENT_KEY]):
            if parent in moved_keys:
                continue
            inside = int(sum(1 for k in moved_keys if k != key and str(k).startswith(str(key) + "/")))
            rows.append({CHANGE: change.value, col.LEVEL: level, KEY: key, BASE_VALUE: None, NEW_VALUE: None,
                         NOTE: f"with {inside} key(s) below it" if inside else None})
    both = base.merge(new, on=[col.LEVEL, KEY], suffixes=("_base", "_new"))
    shapes = both[(both[col.INPUT_SHAPES + "_base"].notna() | both[col.INPUT_SHAPES + "_new"].notna())
                  & (both[col.INPUT_SHAPES + "_base"].astype(object) != both[col.INPUT_SHAPES + "_new"].astype(object))]
    for level, key, was, now in zip(shapes[col.LEVEL], shapes[KEY], shapes[col.INPUT_SHAPES + "_base"],
                                    shapes[col.INPUT_SHAPES + "_new"]):
        rows.append({CHANGE: Change.INPUT_SHAPES.value, col.LEVEL: level, KEY: key, BASE_VALUE: was, NEW_VALUE: now,
                     NOTE: None})
    dtypes = both[both[INPUT_DTYPES + "_base"].notna() & both[INPUT_DTYPES + "_new"].notna()
                  & (both[INPUT_DTYPES + "_base"].astype(object) != both[INPUT_DTYPES + "_new"].astype(object))]
    for level, key, was, now in zip(dtypes[col.LEVEL], dtypes[KEY], dtypes[INPUT_DTYPES + "_base"],
                                    dtypes[INPUT_DTYPES + "_new"]):
        rows.append({CHANGE: Change.INPUT_DTYPES.value, col.LEVEL: level, KEY: key, BASE_VALUE: was, NEW_VALUE: now,
                     NOTE: None})
    kernels_before = both[KERNELS_PER_STEP + "_base"].to_numpy(dtype=np.float64)
    kernels_after = both[KERNELS_PER_STEP + "_new"].to_numpy(dtype=np.float64)
    changed = ~np.isnan(kernels_before) & ~np.isnan(kernels_after) & (kernels_before != kernels_after)
    for i in np.flatnonzero(changed).tolist():
        fewer = kernels_after[i] < kernels_before[i]
        rows.append({CHANGE: Change.KERNEL_COUNT.value, col.LEVEL: both[col.LEVEL].iat[i], KEY: both[KEY].iat[i],
                     BASE_VALUE: _number(kernels_before[i]), NEW_VALUE: _number(kernels_after[i]),
                     NOTE: "fewer kernels per step (more fused)" if fewer else
                     "more kernels per step (a fusion lost?)"})
    for kind, change in ((SpanKind.MEMCPY, Change.MEMORY_COPIES), (SpanKind.SYNC, Change.SYNCHRONISATIONS)):
        before, after = _per_step(base, kind), _per_step(new, kind)
        if after > before:
            rows.append({CHANGE: change.value, col.LEVEL: Level.KERNEL.value, KEY: kind.value,
                         BASE_VALUE: _number(before), NEW_VALUE: _number(after), NOTE: "per step"})
    return pd.DataFrame(rows, columns=[CHANGE, col.LEVEL, KEY, BASE_VALUE, NEW_VALUE, NOTE])


def _per_step(keys: pd.DataFrame, kind: SpanKind) -> float:
    """Spans of ``kind`` per step in a key-samples frame."""
    of_kind = keys[keys[col.KIND] == kind.value]
    if not len(of_kind):
        return 0.0
    steps = max(int(keys[SAMPLE_COUNT].max()), 1) if len(keys) else 1
    return float(of_kind[COUNT].sum()) / steps


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 2)


def noisy_keys(table: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """The top-level keys (steps, model calls) whose samples vary more than ``threshold`` on either side."""
    top = table[table[PARENT_KEY].isna() & table[col.KIND].isin([k.value for k in (SpanKind.STEP, SpanKind.PREDICT)])]
    return top[(top[BASE_CV] > threshold) | (top[NEW_CV] > threshold)]


__all__ = ["KeyBy", "Verdict", "Test", "Change", "key_samples", "pool_runs", "compare", "benjamini_hochberg",
           "breakdown", "structure_changes", "overall_verdict", "noisy_keys"]
