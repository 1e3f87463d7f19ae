"""What no trace can hold: spans checked when a file is read, before anything is computed.

A trace file that was damaged, edited or made by another tool may hold values no recording
can: a span that ends before it starts, a time past the year 2116, two spans with one id, a
span that is its own parent or ancestor, a layer that runs past the span it is in. Read as
they are, they turn into a latency of -0.001 ms and steps that cover 300% of a run.
:func:`impossible_spans` names each kind found.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import parent_positions

LATEST_NS: Final = 1 << 62
"""The latest time a span may have (epoch ns, early 2116)."""


def in_a_cycle(parents: np.ndarray) -> np.ndarray:
    """Which positions are their own ancestor, or lead to one that is (by pointer jumping: a
    chain shorter than the table ends within log2 of its length doublings; a cycle never)."""
    ahead = parents.copy()
    for _ in range(max(len(parents), 1).bit_length() + 1):
        moving = ahead >= 0
        if not moving.any():
            return moving
        ahead[moving] = ahead[ahead[moving]]
    return ahead >= 0


def impossible_spans(spans: pd.DataFrame, parents: np.ndarray | None = None) -> list[str]:
    """One phrase per kind of impossible span found (empty: none). ``parents``:
    :func:`xsp.table.walks.parent_positions` of ``spans``, if already computed."""
    if not len(spans):
        return []
    start = spans[col.START_NS].to_numpy(dtype=np.int64)
    end = spans[col.END_NS].to_numpy(dtype=np.int64)
    found = []
    checks = [(end < start, "end before they start"),
              ((start < 0) | (end > LATEST_NS), "have times before 1970 or after 2116")]
    if col.DURATION_NS in spans:
        duration = spans[col.DURATION_NS].to_numpy(dtype=np.int64)
        checks.append((duration != end - start, "have a duration that is not their end minus their start"))
    ids = spans[col.SPAN_ID].to_numpy(dtype=np.int64)
    checks.append((pd.Series(ids).duplicated(keep=False).to_numpy(), "share their span id with another"))
    parent = spans[col.PARENT_ID]
    has_parent = parent.notna().to_numpy()
    self_parent = np.zeros(len(spans), dtype=bool)
    self_parent[has_parent] = parent[has_parent].to_numpy(dtype=np.int64) == ids[has_parent]
    checks.append((self_parent, "are their own parent"))
    for wrong, what in checks:
        if wrong.any():
            found.append(f"{int(wrong.sum())} spans {what}")
    if has_parent.any() and not self_parent.any() and not checks[3][0].any():
        parents = parent_positions(spans) if parents is None else parents
        cycle = in_a_cycle(parents)
        if cycle.any():
            found.append(f"{int(cycle.sum())} spans are their own ancestor (a cycle of parents)")
        else:
            outside = outside_their_parent(spans, parents)
            if outside.any():
                found.append(f"{int(outside.sum())} spans run outside their parent on their thread")
    return found


def outside_their_parent(spans: pd.DataFrame, parents: np.ndarray) -> np.ndarray:
    """Which host spans start before or end after their parent on the same thread.

    xsp hangs a host span only from a span that encloses it on its thread (interval inclusion),
    so no recording holds one. Left out: CUDA API calls and GPU activities (placed by
    correlation ids, which clocks may disagree with), spans whose parent runs on another
    thread (a backward pass hung from the step running when it started) and the session's
    children (spans closed when the program exits).
    """
    outside = np.zeros(len(spans), dtype=bool)
    child = np.flatnonzero(parents >= 0)
    if not len(child):
        return outside
    parent = parents[child]
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    is_api = (spans[col.LEVEL] == Level.CUDA_API.value).fillna(False).to_numpy(dtype=bool)
    is_session = ((spans[col.KIND] == SpanKind.SESSION.value).fillna(False).to_numpy(dtype=bool) if col.KIND in spans
                  else np.zeros(len(spans), dtype=bool))
    checked = (threads[child] == threads[parent]) & ~is_api[child] & ~is_session[parent]
    child, parent = child[checked], parent[checked]
    start = spans[col.START_NS].to_numpy(dtype=np.int64)
    end = spans[col.END_NS].to_numpy(dtype=np.int64)
    outside[child] = (start[child] < start[parent]) | (end[child] > end[parent])
    return outside


def parents_not_in_the_table(spans: pd.DataFrame, parents: np.ndarray | None = None,
                             elsewhere: int | None = None) -> int:
    """How many spans name a parent that no span of the table has (a file cut short, or spans
    left out of it): they are read as roots. ``elsewhere``: a span id known to be in another
    file (a sealed part's session span, written with the last part), not counted."""
    if col.PARENT_ID not in spans or not len(spans):
        return 0
    parents = parent_positions(spans) if parents is None else parents
    missing = spans[col.PARENT_ID].notna().to_numpy() & (parents < 0)
    if elsewhere is not None:
        missing &= (spans[col.PARENT_ID] != elsewhere).fillna(True).to_numpy(dtype=bool)
    return int(missing.sum())


def session_span_elsewhere(metadata: dict[str, Any]) -> int | None:
    """The session span's id where a file is a sealed part of a trace written in parts (the
    session span is in its last part), else None."""
    part = metadata.get("part")
    ids = metadata.get("session_ids")
    if not isinstance(part, dict) or part.get("last", True) or not isinstance(ids, dict):
        return None
    span_id = ids.get("span_id")
    return span_id if isinstance(span_id, int) else None
