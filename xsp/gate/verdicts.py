"""From samples to verdicts: rank tests on pooled step samples, tests across run medians,
samples rebuilt from a summary's quantiles, the false-discovery correction; then what a
comparison says as a whole (the overall verdict, a regression broken down into its keys,
structure changes, keys too noisy to judge)."""

from __future__ import annotations

import bisect
from typing import Final

import numpy as np
import pandas as pd
from scipy import stats

from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.gate.diff_columns import (
    ADJUSTED_DELTA_NS,
    BASE_CV,
    BASE_VALUE,
    CHANGE,
    COUNT,
    DEPTH,
    INPUT_DTYPES,
    KERNELS_PER_STEP,
    KEY,
    MIN_SHIFT_KEYS,
    NEW_CV,
    NEW_VALUE,
    NOTE,
    PARENT_KEY,
    RUN_MEDIANS_NS,
    RUNS,
    SAMPLE_COUNT,
    TEST,
    VERDICT,
    Change,
    Test,
    Verdict,
)

MAX_REBUILT_SAMPLES: Final = 200
"""Samples rebuilt from a summary's quantiles for a rank test, at most."""


def from_quantiles(samples: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
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


def rank_tests(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray, p_values: np.ndarray) -> None:
    """Two-sided Mann-Whitney U p-values for ``rows``, one vectorised call per pair of sample sizes."""
    if not len(rows):
        return
    sizes = pd.DataFrame({"row": rows, "nb": [len(base[i]) for i in rows], "nn": [len(new[i]) for i in rows]})
    for _, group in sizes.groupby(["nb", "nn"], observed=True):
        members = group["row"].to_numpy()
        x = np.stack([base[i] for i in members]).astype(np.float64)
        y = np.stack([new[i] for i in members]).astype(np.float64)
        same = (x.min(axis=1) == x.max(axis=1)) & (x.max(axis=1) == y.min(axis=1)) & (y.min(axis=1) == y.max(axis=1))
        with np.errstate(invalid="ignore", divide="ignore"):
            result = stats.mannwhitneyu(x, y, alternative="two-sided", axis=1)
        p = np.asarray(result.pvalue, dtype=np.float64)
        p_values[members] = np.where(same | np.isnan(p), 1.0, p)  # identical constant samples: no change


def run_medians(merged: pd.DataFrame, side: str) -> tuple[np.ndarray, list[np.ndarray]]:
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


def run_tests(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray, p_values: np.ndarray) -> None:
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


def parent_rows(keys: pd.Series, parent_keys: pd.Series) -> np.ndarray:
    """Each row's parent row: the first row whose key is the row's parent key (-1 for none).
    A parent is found by its key alone, as :func:`explains` does."""
    count = len(keys)
    codes, uniques = pd.factorize(pd.concat([keys, parent_keys], ignore_index=True))
    key_codes, parent_codes = codes[:count], codes[count:]
    first_row = np.full(len(uniques) + 1, -1, dtype=np.int64)  # the last: for parents of no key at all
    keyed = np.flatnonzero(key_codes >= 0)[::-1]  # a row without a key (a damaged summary) is no one's parent
    first_row[key_codes[keyed]] = keyed
    found = first_row[np.where(parent_codes >= 0, parent_codes, len(uniques))]
    return np.where(found == np.arange(count), -1, found)  # a key that names itself its parent: a root


MAX_TREE_DEPTH: Final = 256
"""Parent links followed at most, whatever a damaged summary's keys say (no loop runs forever)."""


ROOT: Final = -1
"""The parent of the keys at the top of the tree (model calls, steps): their family is tested first."""
DEVICE_ROOT: Final = -2
"""The parent given to GPU activities (kernels, copies, sets, synchronisations) launched from the
host: a kernel's time is not part of the CUDA call that launched it, nor of the layer around
that call, so a slower kernel need not show above it. They are a tree of their own, whose first
family is tested beside the host's."""


def family_heads(parents: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """Each row's nearest tested ancestor (:data:`ROOT` or :data:`DEVICE_ROOT`: none; those rows
    are a first family)."""
    family = np.asarray(parents, dtype=np.int64).copy()
    for _ in range(MAX_TREE_DEPTH):
        climbing = (family >= 0) & ~tested[np.maximum(family, 0)]
        if not climbing.any():
            break
        family[climbing] = parents[family[climbing]]
    return family


def hierarchical_q_values(parents: np.ndarray, p_values: np.ndarray, tested: np.ndarray,
                          alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Yekutieli's hierarchical false-discovery control (JASA 2008) over the keys' tree.

    The tested keys are arranged in families by their nearest tested ancestor: the keys with
    none (the model calls and steps; and apart from them the GPU activities under keys of the
    host, :data:`DEVICE_ROOT`) are the first families. Each family is tested with
    Benjamini-Hochberg at ``alpha``, the first one first, and the family below a key is tested
    only when that key was found to change (its q-value at most ``alpha``). So a model call
    compared over 5 steps a side, every step of one run beyond every step of the other
    (p = 0.0079), is judged among the few top-level keys, not among the hundreds of keys of its
    layers; and no layer of a model whose time did not change is judged at all. The false
    discovery rate over the whole tree stays below 2 x 1.44 x ``alpha`` (Yekutieli's bound).

    Returns each row's q-value within its family (NaN where not reached) and whether it was
    reached (its family was tested).
    """
    count = len(parents)
    family = family_heads(parents, tested)
    q_values = np.full(count, np.nan)
    reached = np.zeros(count, dtype=bool)
    order = np.argsort(family, kind="stable")
    sorted_family = family[order]
    frontier = [ROOT, DEVICE_ROOT]
    while frontier:
        following: list[int] = []
        for head in frontier:
            lo, hi = np.searchsorted(sorted_family, [head, head + 1])
            members = order[lo:hi]
            members = members[tested[members] & ~reached[members]]
            if not len(members):
                continue
            reached[members] = True
            q_values[members] = stats.false_discovery_control(p_values[members])
            following.extend(members[q_values[members] <= alpha].tolist())
        frontier = following
    return q_values, reached


POWER: Final = 0.8
"""The chance a change of the detectable size is found (:func:`detectable_changes`)."""
RANK_EFFICIENCY: Final = 3 / np.pi
"""The Mann-Whitney test's efficiency against the t test on normal samples (Pitman's): it
needs about 1/0.955 times the samples to see the same shift."""


def robust_log_spread(samples: np.ndarray) -> float:
    """A sample's spread on a ratio scale: 1.4826 times the median absolute deviation of its
    logarithms (a standard deviation that a few preempted steps do not inflate)."""
    logs = np.log(np.maximum(np.asarray(samples, dtype=np.float64), 1.0))
    return float(1.4826 * np.median(np.abs(logs - np.median(logs)))) if len(logs) else float("nan")


def detectable_changes(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray,
                       p_needed: np.ndarray) -> np.ndarray:
    """For ``rows``, the smallest relative change of the median that the rank test would find
    with :data:`POWER` at ``p_needed`` (each row's), from the two samples' spreads and sizes:
    ``exp((z(1 - p/2) + z(power)) * sqrt(s_b²/n_b + s_n²/n_n) / sqrt(efficiency)) - 1``;
    infinite where even every step of one side beyond every step of the other could not reach
    ``p_needed`` (too few steps). NaN for the other rows."""
    result = np.full(len(base), np.nan)
    for row, needed in zip(rows.tolist(), p_needed.tolist()):
        x, y = base[row], new[row]
        if len(x) < 2 or len(y) < 2:
            continue
        if smallest_p(len(x), len(y)) > needed:
            result[row] = np.inf
            continue
        spread = np.sqrt(robust_log_spread(x) ** 2 / len(x) + robust_log_spread(y) ** 2 / len(y))
        z = stats.norm.isf(needed / 2) + stats.norm.ppf(POWER)
        result[row] = float(np.expm1(z * spread / np.sqrt(RANK_EFFICIENCY)))
    return result


def detectable_between_runs(base: list[np.ndarray], new: list[np.ndarray], rows: np.ndarray,
                            p_needed: np.ndarray) -> np.ndarray:
    """For ``rows`` (keys pooled from several runs a side), the smallest relative change the
    test between the runs' medians would find with :data:`POWER` at ``p_needed``, from the
    spread of their logarithms (NaN for the other rows, and where a side has one run)."""
    result = np.full(len(base), np.nan)
    for row, needed in zip(rows.tolist(), p_needed.tolist()):
        x, y = (np.log(np.maximum(np.asarray(side[row], dtype=np.float64), 1.0)) for side in (base, new))
        if len(x) < 2 or len(y) < 2:
            continue
        spread = np.sqrt(((len(x) - 1) * x.var(ddof=1) + (len(y) - 1) * y.var(ddof=1)) / (len(x) + len(y) - 2))
        # the test borrows PRIOR_DF degrees of freedom from the other keys (:func:`run_tests`)
        z = stats.t.isf(needed / 2, len(x) + len(y) - 2 + PRIOR_DF) + stats.norm.ppf(POWER)
        result[row] = float(np.expm1(z * spread * np.sqrt(1 / len(x) + 1 / len(y))))
    return result


def smallest_p(base_samples: int, new_samples: int) -> float:
    """The smallest two-sided p-value a Mann-Whitney U test of these sample sizes can give
    (every sample of one side above every sample of the other)."""
    from math import comb

    return min(1.0, 2.0 / comb(base_samples + new_samples, base_samples))


def sample_stats(samples: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def explains(table: pd.DataFrame) -> np.ndarray:
    """Each key's delta over its parent key's delta (NaN for roots and for parents that did not move)."""
    parent_row = parent_rows(table[KEY], table[PARENT_KEY])
    has_parent = parent_row >= 0
    delta = table[ADJUSTED_DELTA_NS].to_numpy(dtype=np.float64)
    parent_delta = delta[np.maximum(parent_row, 0)]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(has_parent & (parent_delta != 0), delta / parent_delta, np.nan)
    return share


def overall_verdict(table: pd.DataFrame, inconclusive: bool = False) -> Verdict:
    """``regressed`` if any key regressed; else ``inconclusive`` when the comparison could not
    have seen a regression (``inconclusive``); else ``improved`` if any improved; else ``unchanged``."""
    verdicts = set(table[VERDICT].tolist()) if len(table) else set()
    if Verdict.REGRESSED.value in verdicts:
        return Verdict.REGRESSED
    if inconclusive:
        return Verdict.INCONCLUSIVE
    if Verdict.IMPROVED.value in verdicts:
        return Verdict.IMPROVED
    return Verdict.UNCHANGED


# ---------------------------------------------------------------------------------------------
# where it lives, and what changed shape

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
        in_order = sorted(map(str, moved_keys))  # the keys below a key: one range of them, found by bisection
        for level, key, parent in zip(moved[col.LEVEL], moved[KEY], moved[PARENT_KEY]):
            if parent in moved_keys:
                continue
            below = str(key) + "/"
            inside = bisect.bisect_left(in_order, below[:-1] + "0") - bisect.bisect_left(in_order, below)
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
