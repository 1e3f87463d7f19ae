"""Comparing two runs key by key (:func:`compare_keys`): each key's change, judged by the rank
tests and the false-discovery control of :mod:`xsp.gate.significance`, against the noise of the
runs (a shift common to every key, the scatter of the keys, the machine's waits).
Functions here take and return DataFrames; :func:`xsp.diff` puts them together.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from xsp.core import schema as col
from xsp.core.contention import PREEMPTION_FACTOR
from xsp.core.schema import GPU_ACTIVITY_KINDS, Level
from xsp.gate.diff_columns import (
    ADJUSTED_DELTA_NS,
    ADJUSTED_RATIO,
    BASE_CI_NS,
    BASE_COUNT,
    BASE_CV,
    BASE_MEDIAN_NS,
    BASE_RUNS,
    BASE_SAMPLES,
    BASE_TOTAL_NS,
    BELOW_UNCHANGED_NOTE,
    CI_NS,
    COMMON_SHIFT,
    COUNT,
    DELTA_NS,
    DETECTABLE,
    EXPLAINS,
    JUDGED_FACTOR,
    KEY,
    KEY_SCATTER,
    LARGEST_FAMILY,
    MAX_SCATTER_FLOOR,
    MIN_OVERLAP_SAMPLES,
    MIN_RANK_SAMPLES,
    MIN_RUNS,
    MIN_SCATTER_KEYS,
    MIN_SHIFT_KEYS,
    NEW_CI_NS,
    NEW_COUNT,
    NEW_CV,
    NEW_MEDIAN_NS,
    NEW_RUNS,
    NEW_SAMPLES,
    NEW_TOTAL_NS,
    NOT_SIGNIFICANT_NOTE,
    NOTE,
    ONE_SAMPLE_NOTE,
    P_VALUE,
    PARENT_KEY,
    Q_VALUE,
    RATIO,
    RELATIVE_RATIO,
    ROOT_FAMILY,
    RUN_P_VALUE,
    SAMPLE_COUNT,
    SAMPLES_NS,
    SCATTER_FACTOR,
    SCATTER_FLOOR,
    STEP_CV,
    TEST,
    TOTAL_NS,
    UNIFORM_SHIFT_FLOOR,
    UNJUDGED_SHIFT,
    VERDICT,
    WAITED_KEYS,
    WAITED_NOTE,
    WITH_RUN_NOTE,
    WITHIN_SCATTER_NOTE,
    Test,
    Verdict,
)
from xsp.gate.significance import (
    DEVICE_ROOT,
    POWER,
    ROOT,
    detectable_between_runs,
    detectable_changes,
    family_heads,
    from_quantiles,
    hierarchical_q_values,
    parent_rows,
    rank_tests,
    run_medians,
    run_tests,
    sample_stats,
)
from xsp.gate.verdicts import explains


def _summarised_cv(merged: pd.DataFrame, suffix: str, side: pd.DataFrame, from_samples: np.ndarray) -> np.ndarray:
    """A side's coefficients of variation: a summary's, taken of all its samples where it kept them
    (:data:`~xsp.gate.diff_columns.STEP_CV`), else those of the samples at hand."""
    if STEP_CV not in side:
        return from_samples
    kept = merged[STEP_CV + suffix if STEP_CV + suffix in merged else STEP_CV].to_numpy(dtype=np.float64)
    return np.where(np.isnan(kept), from_samples, kept)


def compare_keys(base: pd.DataFrame, new: pd.DataFrame, threshold: float = 0.05, min_delta_ns: int = 20_000,
                 alpha: float = 0.01, normalize: bool = False, speed: float = 1.0,
                 waits_ns: tuple[float, float] = (0.0, 0.0)) -> pd.DataFrame:
    """The diff table of two key-samples frames (:func:`key_samples`), one row per key.

    A key present in both is ``regressed`` (or ``improved``) only when its median per-step
    duration changed by at least ``threshold`` (relative) *and* ``min_delta_ns`` *and* the
    change is significant: Mann-Whitney U with the Benjamini-Hochberg false-discovery rate at
    ``alpha`` over every key tested, or, with fewer than :data:`MIN_RANK_SAMPLES` samples on a
    side, ranges that do not overlap. With one sample on a side no verdict is given. Where
    both sides were pooled from several runs (:func:`pool_runs`, at least :data:`MIN_RUNS` with
    the key on each side), the runs' medians must also differ by a t test: steps of one
    run share that run's machine state, so only the spread between runs tells a process that
    ran a little slower from a change. With one run a side that spread cannot be measured per
    key, so it is read across keys instead: the change must also pass :data:`SCATTER_FACTOR`
    times the keys' scatter (:func:`key_scatter`), how far the keys of these two runs moved
    against each other (up to :data:`MAX_SCATTER_FLOOR`); and where the whole run moved alike
    (its keys' common shift, left over after any machine-speed correction) by less than
    :data:`UNIFORM_SHIFT_FLOOR`, the keys that moved with it (within :data:`MAX_SCATTER_FLOOR` of
    it where too few keys measure the scatter) are not judged from one run a side
    (processes of one program differ that much on a busy machine; a note says so). A key is
    never called regressed when its measured median fell, nor improved when it rose.

    Times are judged as measured, except that the new run's are first divided by ``speed``:
    how much longer its machine took for the same fixed work than the base's
    (:mod:`xsp.core.machine_speed`), the evidence that the two ran on machines of different speeds.
    With ``normalize``, they are divided by the run's *common shift* instead: the median ratio
    over the keys below the model level (see :func:`common_shift`). That hides every change
    that moves all keys alike (a model moved to float64), so it is a view for attribution, not
    a check. The ``ratio`` and ``delta_ns`` columns keep what was measured; ``adjusted_ratio``
    is the ratio the verdict judged; ``relative_ratio`` is the ratio over the common shift.

    ``waits_ns``: how long each run's threads waited for a CPU per step (base, new; see
    :func:`xsp.core.contention.wait_per_step_ns`). From one run a side, a key that changed by less
    than :data:`~xsp.core.contention.PREEMPTION_FACTOR` times the longer of the two may have met a
    preemption in every step of one process: it stays unchanged, with a note saying so.
    """
    merged = base.merge(new, on=[col.LEVEL, KEY], how="outer", suffixes=("_base", "_new"), sort=False)
    count = len(merged)
    in_base = merged[SAMPLES_NS + "_base"].notna().to_numpy()
    in_new = merged[SAMPLES_NS + "_new"].notna().to_numpy()
    empty = np.zeros(0, dtype=np.int64)
    base_samples = [s if isinstance(s, np.ndarray) else empty for s in merged[SAMPLES_NS + "_base"]]
    new_samples = [s if isinstance(s, np.ndarray) else empty for s in merged[SAMPLES_NS + "_new"]]
    n_base, base_median, base_cv = sample_stats(base_samples)
    n_new, new_median, new_cv = sample_stats(new_samples)
    base_cv = _summarised_cv(merged, "_base", base, base_cv)
    new_cv = _summarised_cv(merged, "_new", new, new_cv)
    both = in_base & in_new
    delta, ratio = _change(base_median, new_median, both)
    delta = np.where(both, delta, np.where(in_new, new_median, -base_median))  # added: all of it; removed: minus
    ranked = both & (n_base >= MIN_RANK_SAMPLES) & (n_new >= MIN_RANK_SAMPLES)
    levels = merged[col.LEVEL].to_numpy(dtype=object)
    shift = common_shift(levels, ratio, ranked)
    factor = shift if normalize else speed
    adjusted_delta, adjusted_ratio = _change(base_median, new_median / factor, both)
    adjusted_delta = np.where(both, adjusted_delta, delta)
    relative_ratio = _change(base_median, new_median / shift, both)[1]
    judged_samples = new_samples if factor == 1.0 else [s / factor for s in new_samples]
    p_values = np.full(count, np.nan)
    base_counts = merged[SAMPLE_COUNT + "_base"].fillna(0).to_numpy(dtype=np.int64)
    new_counts = merged[SAMPLE_COUNT + "_new"].fillna(0).to_numpy(dtype=np.int64)
    rank_tests(from_quantiles(base_samples, base_counts), from_quantiles(judged_samples, new_counts),
                np.flatnonzero(ranked), p_values)
    base_runs, base_run_medians = run_medians(merged, "_base")
    new_runs, new_run_medians = run_medians(merged, "_new")
    between = both & (np.fromiter(map(len, base_run_medians), np.int64, count) >= MIN_RUNS) & (
        np.fromiter(map(len, new_run_medians), np.int64, count) >= MIN_RUNS)
    run_p_values = np.full(count, np.nan)
    run_tests(base_run_medians, [m / factor for m in new_run_medians], np.flatnonzero(between), run_p_values)
    # both must reject (an intersection-union test: the larger p-value is a valid one)
    p_values[between] = np.fmax(np.nan_to_num(p_values[between], nan=0.0), run_p_values[between])
    base_ci, new_ci = _key_intervals(merged, "_base"), _key_intervals(merged, "_new")
    interval = both & ~(ranked | between) & (n_base == 1) & (n_new == 1) & np.isfinite(base_ci) & \
        np.isfinite(new_ci)
    p_values[interval] = interval_p_values(base_median[interval], new_median[interval] / factor,
                                           base_ci[interval], new_ci[interval] / factor)
    tested = ranked | between | interval
    keys = merged[KEY]
    parent_keys = merged[PARENT_KEY + "_new"].fillna(merged[PARENT_KEY + "_base"])
    parents = parent_rows(keys, parent_keys)
    kinds = merged[col.KIND + "_new"].fillna(merged[col.KIND + "_base"]).to_numpy(dtype=object)
    on_device = np.isin(kinds, [kind.value for kind in GPU_ACTIVITY_KINDS])
    parents[on_device & ~on_device[np.maximum(parents, 0)]] = DEVICE_ROOT  # (a root's parent too)
    overlap = both & ~tested & (n_base >= MIN_OVERLAP_SAMPLES) & (n_new >= MIN_OVERLAP_SAMPLES)
    apart = np.zeros(count, dtype=bool)
    for i in np.flatnonzero(overlap).tolist():
        b, n = base_samples[i], judged_samples[i]
        apart[i] = n[0] > b[-1] or n[-1] < b[0]
    large = ((np.abs(np.nan_to_num(adjusted_ratio, nan=1.0) - 1.0) >= threshold)
             & (np.abs(adjusted_delta) >= min_delta_ns))
    one_run_a_side = ranked & ~between
    scatter = key_scatter(levels, ratio, one_run_a_side, base_median, min_delta_ns)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log(np.nan_to_num(adjusted_ratio, nan=1.0))
    run_shift = shift / factor
    shift_measured = int(_below_model(levels, ratio, ranked).sum()) >= MIN_SHIFT_KEYS
    floor = 0.0 if scatter is None else min(SCATTER_FACTOR * scatter, float(np.log1p(MAX_SCATTER_FLOOR)))
    past_threshold = large.copy()
    large[one_run_a_side] &= np.abs(logs[one_run_a_side]) >= floor
    within_scatter = one_run_a_side & past_threshold & ~large
    # the whole run moved alike, by less than processes of one program can: from one run a side
    # no key that moved with it is judged (see UNIFORM_SHIFT_FLOOR)
    with_run = np.zeros(count, dtype=bool)
    if not normalize and shift_measured and abs(np.log(run_shift)) < np.log1p(UNIFORM_SHIFT_FLOOR):
        along = max(float(np.log1p(threshold)), floor)
        if scatter is None and abs(np.log(run_shift)) >= np.log1p(threshold):
            # too few keys to measure how far the keys of two processes sit apart around the run's
            # move: as far as such processes can (a model of 3 layers, run twice unchanged, failed
            # the gate: its layers +23% alike, its model call, glue between them, +34%)
            along = float(np.log1p(MAX_SCATTER_FLOOR))
        with_run = one_run_a_side & large & (np.abs(logs - np.log(run_shift)) < along)
        large &= ~with_run
    # against the common shift, never against what was measured: a key whose median fell is not
    # called slower because the rest of its run slowed down more
    slower, faster = adjusted_delta > 0, adjusted_delta < 0
    if normalize:
        slower, faster = slower & (delta > 0), faster & (delta < 0)
    wait_limit = PREEMPTION_FACTOR * max(waits_ns)  # either run's process may have met the preemption
    within_wait = one_run_a_side & (np.abs(adjusted_delta) <= wait_limit)
    # the keys below a key are judged only when it changed significantly (hierarchical testing):
    # a change confined to a layer still moves the model call around it, which 40 steps show,
    # while the keys of a model call that did not move are not searched for chance changes
    q_values, reached = hierarchical_q_values(parents, p_values, tested, alpha)
    root_family = tested & reached & (family_heads(parents, tested) == ROOT)
    significant = (tested & reached & (q_values <= alpha)) | (overlap & apart)
    verdict = np.full(count, Verdict.UNCHANGED.value, dtype=object)
    verdict[both & large & significant & slower] = Verdict.REGRESSED.value
    verdict[both & large & significant & faster] = Verdict.IMPROVED.value
    explained_only = np.zeros(count, dtype=bool)
    raw_waited = np.zeros(count, dtype=bool)
    if factor != 1.0 and not normalize:  # a correction explains a change away; it never makes one
        raw = compare_keys(base, new, threshold=threshold, min_delta_ns=min_delta_ns, alpha=alpha, waits_ns=waits_ns)
        raw_rows = raw.set_index([col.LEVEL, KEY]).reindex(pd.MultiIndex.from_arrays([merged[col.LEVEL], merged[KEY]]))
        raw_verdict = raw_rows[VERDICT].to_numpy(dtype=object)
        judged = np.isin(verdict, [Verdict.REGRESSED.value, Verdict.IMPROVED.value])
        explained_only = judged & (raw_verdict != verdict)
        # as measured, too close to what the threads waited for a CPU to be judged: that is why,
        # not the correction (it is unjudged, not unchanged)
        raw_waited = explained_only & raw_rows[NOTE].str.startswith(WAITED_NOTE, na=False).to_numpy(dtype=bool)
        explained_only &= ~raw_waited
        verdict[explained_only] = Verdict.UNCHANGED.value
    waited = raw_waited | (within_wait & np.isin(verdict, [Verdict.REGRESSED.value, Verdict.IMPROVED.value]))
    verdict[waited] = Verdict.UNCHANGED.value
    verdict[in_new & ~in_base] = Verdict.ADDED.value
    verdict[in_base & ~in_new] = Verdict.REMOVED.value
    test = np.full(count, Test.NONE.value, dtype=object)
    test[ranked], test[overlap] = Test.RANK.value, Test.OVERLAP.value
    test[between] = Test.RUNS.value
    test[between & ranked] = Test.RANK_AND_RUNS.value
    test[interval] = Test.INTERVAL.value
    # the smallest change each key could have shown: at the p-value its family asks of one key
    # (alpha over the family's size), then no finer than the floors that keep noise from verdicts
    family_size = _family_sizes(parents, tested)
    detectable = detectable_changes(from_quantiles(base_samples, base_counts),
                                    from_quantiles(judged_samples, new_counts), np.flatnonzero(ranked),
                                    alpha / np.maximum(family_size[ranked], 1))
    runs_detectable = detectable_between_runs(base_run_medians, [m / factor for m in new_run_medians],
                                              np.flatnonzero(between), alpha / np.maximum(family_size[between], 1))
    detectable[between] = np.fmax(detectable[between], runs_detectable[between])
    z = stats.norm.isf(alpha / np.maximum(family_size[interval], 1) / 2) + stats.norm.ppf(POWER)
    detectable[interval] = z * np.hypot(base_ci[interval], new_ci[interval]) / stats.norm.ppf(0.975) / np.maximum(
        base_median[interval], 1.0)
    detectable[overlap] = np.inf  # ranges compared: too few steps for a test that holds its error rate
    judged_keys = tested | ranked
    detectable[judged_keys] = np.fmax(detectable[judged_keys], threshold)  # judged at the (raised) threshold
    detectable[one_run_a_side] = np.fmax(detectable[one_run_a_side], float(np.expm1(floor)))
    note = np.full(count, None, dtype=object)
    note[both & ~tested & ~overlap] = ONE_SAMPLE_NOTE
    note[tested & ~reached] = BELOW_UNCHANGED_NOTE
    not_shown = tested & reached & large & ~significant & (verdict == Verdict.UNCHANGED.value)
    note[not_shown] = [f"{NOT_SIGNIFICANT_NOTE} (q={q:.2g}; the smallest change it could show: {d:.0%})"
                       for q, d in zip(q_values[not_shown], detectable[not_shown])]
    note[within_scatter & (verdict == Verdict.UNCHANGED.value)] = (
        f"{WITHIN_SCATTER_NOTE} ({float(np.expm1(floor)):.0%}): one run a side cannot tell such a move from "
        "another process of the same program")
    note[overlap] = "few samples: ranges compared"
    note[explained_only] = "unchanged as measured: the machine-speed correction alone never makes a change"
    note[waited] = (f"{WAITED_NOTE} {PREEMPTION_FACTOR:g}x what a run's threads waited for a CPU per step "
                    f"({max(waits_ns) / 1e3:.0f} µs): from one run a side, a preemption met at the same point of every "
                    "step looks the same")
    note[with_run] = (f"{WITH_RUN_NOTE} ({run_shift - 1:+.1%}): one run a side cannot tell that from "
                      "another process of the same program")
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
        BASE_CI_NS: base_ci,
        NEW_CI_NS: new_ci,
        DETECTABLE: detectable,
    })
    table.attrs[ROOT_FAMILY] = int(root_family.sum())
    table.attrs[LARGEST_FAMILY] = int(family_size[tested & reached].max()) if (tested & reached).any() else 0
    table.attrs[COMMON_SHIFT] = shift
    table.attrs[JUDGED_FACTOR] = factor
    table.attrs[KEY_SCATTER] = float("nan") if scatter is None else scatter
    table.attrs[SCATTER_FLOOR] = float(np.expm1(floor))
    table.attrs[UNJUDGED_SHIFT] = float(run_shift) if with_run.any() else 1.0
    table.attrs[WAITED_KEYS] = int(waited.sum())
    table[EXPLAINS] = explains(table)
    return table


def _family_sizes(parents: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """Per row, how many tested keys share its family (its nearest tested ancestor)."""
    heads = family_heads(parents, tested)
    codes = np.where(tested, heads - DEVICE_ROOT, -1)  # -1 for rows not tested; 0 and 1 for the first families
    sizes = np.bincount(codes[codes >= 0], minlength=len(parents) - DEVICE_ROOT)
    return np.where(tested, sizes[np.maximum(codes, 0)], 0)


def _key_intervals(merged: pd.DataFrame, side: str) -> np.ndarray:
    """One side's ``ci_ns`` per key of a merged frame (NaN where it has none)."""
    column = CI_NS + side
    if column not in merged:
        return np.full(len(merged), np.nan)
    return pd.to_numeric(merged[column], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def interval_p_values(base: np.ndarray, new: np.ndarray, base_ci: np.ndarray, new_ci: np.ndarray) -> np.ndarray:
    """Two-sided p-values of a z test that two figures differ, each given with the half-width
    of its 95% interval (a standard error of half-width / 1.96; at least 1 ns together)."""
    standard_error = np.maximum(np.hypot(base_ci, new_ci) / stats.norm.ppf(0.975), 1.0)
    return 2 * stats.norm.sf(np.abs(new - base) / standard_error)


def _change(base_median: np.ndarray, new_median: np.ndarray, both: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Delta and ratio of the medians where a key is in both runs (NaN elsewhere)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.where(both, new_median - base_median, np.nan),
                np.where(both & (base_median > 0), new_median / base_median, np.nan))


def _below_model(levels: np.ndarray, ratio: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """The tested keys below the model (and input) level with a usable ratio: those a run's
    common shift and its keys' scatter are read from."""
    return tested & ~np.isin(levels, [Level.MODEL.value, Level.INPUT.value]) & np.isfinite(ratio) & (ratio > 0)


def common_shift(levels: np.ndarray, ratio: np.ndarray, tested: np.ndarray) -> float:
    """The ratio by which the whole new run moved: the median ratio of the keys below the
    model level that were rank-tested (1.0 with fewer than :data:`MIN_SHIFT_KEYS` of them).

    A median over keys, not over time: a change confined to a minority of the keys leaves it
    alone however much time those keys take, and a change in most keys looks like the whole
    run moving (which is reported, but is no key's regression).
    """
    chosen = _below_model(levels, ratio, tested)
    if int(chosen.sum()) < MIN_SHIFT_KEYS:
        return 1.0
    return float(np.exp(np.median(np.log(ratio[chosen]))))


def key_scatter(levels: np.ndarray, ratio: np.ndarray, tested: np.ndarray, base_median: np.ndarray,
                min_delta_ns: float) -> float | None:
    """How far the keys of two runs moved against each other: the robust standard deviation
    (1.4826 times the median absolute deviation) of their log ratios, over the keys below the
    model level that were rank-tested and last at least ``min_delta_ns`` in the base run (None,
    not measured, with fewer than :data:`MIN_SCATTER_KEYS` of them).

    Steps of one run share one process: its memory layout, the cores its threads got, the load
    it met. So a key can sit some percent off in one process and not in the next, the same in
    every step, where a test over the steps of one run sees a certain change. Most keys of two
    runs of one program do not change, and a change confined to a few keys leaves a median-based
    spread alone, so the keys' scatter is the size of those offsets between these two runs; a
    change that moves every key alike leaves it alone too.
    """
    chosen = _below_model(levels, ratio, tested) & (base_median >= min_delta_ns)
    if int(chosen.sum()) < MIN_SCATTER_KEYS:
        return None
    logs = np.log(ratio[chosen])
    return float(1.4826 * np.median(np.abs(logs - np.median(logs))))


__all__ = ["compare_keys", "common_shift", "key_scatter"]
