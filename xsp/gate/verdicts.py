"""What a comparison says as a whole: the overall verdict, a regression broken down into its
keys, the changes of structure between the runs, and the keys too noisy to judge."""

from __future__ import annotations

import bisect

import numpy as np
import pandas as pd

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
    NEW_CV,
    NEW_VALUE,
    NOTE,
    PARENT_KEY,
    SAMPLE_COUNT,
    TEST,
    VERDICT,
    Change,
    Test,
    Verdict,
)
from xsp.gate.significance import parent_rows


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
