"""What no trace can hold: spans checked when a file is read, before anything is computed.

A trace file that was damaged, edited or made by another tool may hold values no recording
can: a span that ends before it starts, a time past the year 2116, two spans with one id, a
span that is its own parent or ancestor. Read as they are, they turn into a latency of -0.001
ms and steps that cover 300% of a run. :func:`impossible_spans` names each kind found.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
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


def impossible_spans(spans: pd.DataFrame) -> list[str]:
    """One phrase per kind of impossible span found (empty: none)."""
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
        cycle = in_a_cycle(parent_positions(spans))
        if cycle.any():
            found.append(f"{int(cycle.sum())} spans are their own ancestor (a cycle of parents)")
    return found
