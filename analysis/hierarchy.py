"""Rebuilding the parent/child tree of a span table.

Parents are never trusted from the recorders. On one host thread, a span's parent is the
innermost span that encloses it in time (``a.start <= b.start and b.end <= a.end``) and whose
level is the same or shallower (a layer never hangs below an operator). Spans on different
threads never parent each other. The sweep sorts once (O(n log n)) and walks a stack.

Spans that two candidates enclose equally (same interval, level and call depth) and spans that
overlap without nesting are counted in :class:`HierarchyDiagnostics` instead of being
resolved silently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.schema import Level

_RANK = {level.value: level.rank for level in Level}
NO_PARENT = -1


@dataclass
class HierarchyDiagnostics:
    """What the tree builder could not place unambiguously."""

    spans: int = 0
    roots: int = 0
    overlapping: int = 0
    """Spans that started inside another span on their thread but ended after it."""
    ambiguous: int = 0
    """Spans whose parent had exactly the same interval, level and call depth."""
    without_thread: int = 0
    """Spans with no host thread, which inclusion cannot place."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def inclusion_parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray, rank: np.ndarray,
                      tiebreak: np.ndarray) -> tuple[np.ndarray, HierarchyDiagnostics]:
    """Parent position of every span by interval inclusion, per thread.

    Args:
        thread: thread of each span; spans with the same value can nest.
        start, end: interval of each span (any integer unit).
        rank: level depth (0 = model); a parent's rank is never higher than its child's.
        tiebreak: among equal intervals and levels, the smaller value is the outer span
            (the call depth for module calls).

    Returns:
        ``parents`` (position of the parent, or -1) and the diagnostics.
    """
    count = len(start)
    parents = np.full(count, NO_PARENT, dtype=np.int64)
    diagnostics = HierarchyDiagnostics(spans=count)
    if count == 0:
        return parents, diagnostics
    order = np.lexsort((tiebreak, -end, rank, start, thread))
    threads, starts, ends = thread[order].tolist(), start[order].tolist(), end[order].tolist()
    ranks, ties, positions = rank[order].tolist(), tiebreak[order].tolist(), order.tolist()
    stack: list[int] = []
    current_thread = None
    overlapping = ambiguous = 0
    for p in range(count):
        if threads[p] != current_thread:
            stack.clear()
            current_thread = threads[p]
        span_start, span_end, span_rank = starts[p], ends[p], ranks[p]
        while stack and ends[stack[-1]] < span_end:
            if ends[stack.pop()] > span_start:
                overlapping += 1
        for q in reversed(stack):
            if ranks[q] <= span_rank:
                parents[positions[p]] = positions[q]
                if (starts[q] == span_start and ends[q] == span_end and ranks[q] == span_rank
                        and ties[q] == ties[p]):
                    ambiguous += 1
                break
        stack.append(p)
    diagnostics.overlapping = overlapping
    diagnostics.ambiguous = ambiguous
    return parents, diagnostics


def parent_positions(spans: pd.DataFrame) -> tuple[np.ndarray, HierarchyDiagnostics]:
    """Parent position (row number, or -1) of every row of a span table."""
    count = len(spans)
    thread = spans[col.THREAD_ID]
    has_thread = thread.notna().to_numpy()
    rank = spans[col.LEVEL].map(_RANK).fillna(len(_RANK)).to_numpy(dtype=np.int64)
    tiebreak = (spans[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64)
                if col.CALL_DEPTH in spans else np.zeros(count, dtype=np.int64))
    rows = np.flatnonzero(has_thread)
    sub_parents, diagnostics = inclusion_parents(
        thread[has_thread].to_numpy(dtype=np.int64),
        spans[col.START_NS].to_numpy(dtype=np.int64)[rows],
        spans[col.END_NS].to_numpy(dtype=np.int64)[rows],
        rank[rows], tiebreak[rows])
    parents = np.full(count, NO_PARENT, dtype=np.int64)
    parents[rows] = np.where(sub_parents >= 0, rows[np.maximum(sub_parents, 0)], NO_PARENT)
    diagnostics.spans = count
    diagnostics.without_thread = int(count - len(rows))
    diagnostics.roots = int((parents == NO_PARENT).sum())
    return parents, diagnostics


def build(spans: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``spans`` with ``parent_id`` rebuilt; diagnostics in ``.attrs["hierarchy"]``."""
    parents, diagnostics = parent_positions(spans)
    out = spans.copy()
    ids = out[col.SPAN_ID].to_numpy(dtype=np.int64)
    out[col.PARENT_ID] = pd.array(np.where(parents >= 0, ids[np.maximum(parents, 0)], 0),
                                  dtype="Int64")
    out.loc[parents < 0, col.PARENT_ID] = pd.NA
    out.attrs["hierarchy"] = diagnostics.as_dict()
    return out
