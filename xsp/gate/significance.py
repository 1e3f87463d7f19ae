"""From samples to significance: rank tests on pooled step samples, tests across run medians,
samples rebuilt from a summary's quantiles, the hierarchical false-discovery correction, and the
smallest change each key's samples could have shown (what makes a verdict inconclusive)."""

from __future__ import annotations

from typing import Final

import numpy as np
import pandas as pd
from scipy import stats

from xsp.gate.diff_columns import (
    MIN_SHIFT_KEYS,
    RUN_MEDIANS_NS,
    RUNS,
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
    from math import exp, lgamma

    # 2 / comb(n + m, n), in logarithms: the binomial of a few thousand steps a side is past any float
    log_ways = lgamma(base_samples + new_samples + 1) - lgamma(base_samples + 1) - lgamma(new_samples + 1)
    return min(1.0, 2.0 * exp(-log_ways))


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
