"""Self time: a span's time not spent in the spans directly inside it, counted once.

Every analysis that says "self" (layers, operators, the aggregated tree) takes it from here, so
the three agree and none of them can print more time than ran:

* Children's intervals are **clipped** to their parent's (a damaged or edited file may hold a
  layer that lasts past its parent) and their **union** is taken, not their sum (an imported
  trace may hold siblings that overlap; their shared time is taken off the parent once).
* A span that lies inside a sibling on its thread counts as that sibling's child here. So the
  chain a depth cap hung side by side (:data:`xsp.table.parents.MAX_DEPTH`: each sibling inside
  the one before it) keeps its true self times: the cap loses depth, never time. Not in a
  leveled merge (its ``duration_ci_ns`` is set): its spans were placed with durations from
  several runs, so siblings may overlap by where they were placed, while the merge's parents
  are what ran inside what (a leaf layer's self time is then its whole time).

So a span's self time is never negative and never more than its duration, and where siblings on
a thread do not overlap without nesting (as in any call stack), the self times of a tree add up
to no more than its root's duration.
"""

from __future__ import annotations

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.table.parents import inclusion_parents
from xsp.table.walks import parent_positions

_RESTACKS = 16
"""Passes over siblings that a first pass gave new siblings (spans of identical intervals, one
a parent's child and one beside it); a cut chain needs none."""


def self_ns(spans: pd.DataFrame, counted: np.ndarray, parents: np.ndarray | None = None) -> np.ndarray:
    """Each span's duration minus the union of the ``counted`` spans directly inside it (ns).

    Args:
        spans: a span table.
        counted: boolean per row: the spans whose time is taken off their parent (the layers
            for layer self time, the host spans for the tree).
        parents: :func:`xsp.table.walks.parent_positions` of ``spans``, if already computed.

    Returns:
        A float array, one value per row of ``spans`` (for rows not counted too).
    """
    parents = parent_positions(spans) if parents is None else parents
    start = spans[col.START_NS].to_numpy(dtype=np.int64)
    end = spans[col.END_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    counted = np.asarray(counted, dtype=bool)
    stacked = parents
    placed = col.DURATION_CI_NS in spans and bool(spans[col.DURATION_CI_NS].notna().any())
    for _ in range(0 if placed else 1 + _RESTACKS):  # a span moved in beside the sibling's own children may nest in one
        again = stacked_parents(stacked, counted, threads, start, end)
        if again is stacked:  # (in a call stack's tree, the first pass already: nothing moved)
            break
        stacked = again
    # a parent takes all its children's time off its own (their union); a sibling, the time of
    # those inside it
    children = np.flatnonzero(counted & (parents >= 0))
    moved = children[stacked[children] != parents[children]]
    owner = np.concatenate([parents[children], stacked[moved]])
    inner = np.concatenate([children, moved])
    covered = _covered_ns(owner, start[inner], end[inner], start, end)
    duration = (end - start).astype(np.float64)
    return np.maximum(duration - covered, 0.0)


def stacked_parents(parents: np.ndarray, counted: np.ndarray, threads: np.ndarray, start: np.ndarray,
                    end: np.ndarray) -> np.ndarray:
    """``parents``, with every counted span that lies inside a counted sibling on its thread moved
    under the innermost such sibling (the chain a depth cap hung side by side)."""
    rows = np.flatnonzero(counted & (parents >= 0) & ~np.isnan(threads))
    if len(rows) < 2:
        return parents
    thread_code, thread_values = pd.factorize(threads[rows])
    key = parents[rows] * len(thread_values) + thread_code  # (parent, thread) as one integer
    order = np.lexsort((-end[rows], start[rows], key))
    rows, key = rows[order], key[order]
    ends = end[rows]
    first = np.r_[True, key[1:] != key[:-1]]
    group = np.cumsum(first) - 1
    # a sibling ending no later than the latest end before it (in start order) lies inside one
    latest = pd.Series(ends).groupby(group, observed=True).cummax().to_numpy()
    inside = ~first & (ends <= np.r_[0, latest[:-1]])
    if not inside.any():  # the common case: siblings one after another
        return parents
    in_nesting_group = np.isin(group, np.unique(group[inside]))
    involved = rows[in_nesting_group]
    sibling, _ = inclusion_parents(group[in_nesting_group], start[involved], end[involved],
                                   np.zeros(len(involved), dtype=np.int64), np.zeros(len(involved), dtype=np.int64))
    moved = parents.copy()
    has = sibling >= 0
    moved[involved[has]] = involved[sibling[has]]
    return moved


def _covered_ns(parent: np.ndarray, child_start: np.ndarray, child_end: np.ndarray, start: np.ndarray,
                end: np.ndarray) -> np.ndarray:
    """Per position, the length of the union of its children's intervals clipped to its own."""
    covered = np.zeros(len(start), dtype=np.float64)
    if not len(parent):
        return covered
    lo = np.maximum(child_start, start[parent])
    hi = np.minimum(child_end, end[parent])
    keep = hi > lo
    parent, lo, hi = parent[keep], lo[keep], hi[keep]
    if not len(parent):
        return covered
    order = np.lexsort((lo, parent))
    parent, lo, hi = parent[order], lo[order], hi[order]
    first = np.r_[True, parent[1:] != parent[:-1]]
    reach = pd.Series(hi).groupby(parent, observed=True).cummax().to_numpy()
    before = np.where(first, np.iinfo(np.int64).min, np.r_[0, reach[:-1]])
    added = np.maximum(hi - np.maximum(lo, before), 0)
    return np.bincount(parent, weights=added.astype(np.float64), minlength=len(start))
