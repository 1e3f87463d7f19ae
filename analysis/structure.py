"""Steps, OTel traces, structural paths and execution order, derived from the tree.

* A **step** starts at every outermost ``xsp.step()`` or top-level module call (``predict``).
  Steps are numbered 0, 1, 2... in start order, and each is the root of its own OTel trace.
* A span belongs to the step of its root. A root that is not a step (a backward pass
  after a forward, on the same thread) joins the latest step its thread started before it;
  model-level roots outside every step (``xsp.span("preprocess")`` before the model call)
  hang from the session span in the session's own trace, with no step.
* ``path`` is described in :mod:`xsp.schema`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.schema import STEP_KINDS, Level

NONE = -1


def _climb_until_done(parents: np.ndarray, visit: Callable[[np.ndarray, np.ndarray], None]) -> None:
    """Call ``visit(rows, ancestor)`` for every (row, proper ancestor) pair, nearest first."""
    rows = np.flatnonzero(parents >= 0)
    ancestor = parents[rows]
    while len(rows):
        visit(rows, ancestor)
        ancestor = parents[ancestor]
        keep = ancestor >= 0
        rows, ancestor = rows[keep], ancestor[keep]


def outermost_step(kinds: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Position of the outermost step-kind span among each span and its ancestors, or -1."""
    is_step = np.isin(kinds, [kind.value for kind in STEP_KINDS])
    outer = np.where(is_step, np.arange(len(kinds)), NONE)

    def visit(rows: np.ndarray, ancestor: np.ndarray) -> None:
        hit = is_step[ancestor]
        outer[rows[hit]] = ancestor[hit]

    _climb_until_done(parents, visit)
    return outer


def root_of(parents: np.ndarray) -> np.ndarray:
    """Position of each span's root (itself for roots)."""
    root = np.arange(len(parents))

    def visit(rows: np.ndarray, ancestor: np.ndarray) -> None:
        root[rows] = ancestor

    _climb_until_done(parents, visit)
    return root


@dataclass
class Structure:
    parents: np.ndarray
    step: np.ndarray  # -1 for no step
    trace_index: np.ndarray  # 0 = session trace, k + 1 = step k


def assign_steps(spans: pd.DataFrame, parents: np.ndarray, session_row: int | None) -> Structure:
    """Cut each step out as its own tree and give every span its step and trace."""
    parents = parents.copy()
    kinds = spans[col.KIND].to_numpy(dtype=object)
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].fillna(-1).to_numpy(dtype=np.int64)
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    count = len(spans)
    positions = np.arange(count)
    outer = outermost_step(kinds, parents)
    step_roots = np.flatnonzero(outer == positions)
    parents[step_roots] = NONE
    step_roots = step_roots[np.lexsort((threads[step_roots], starts[step_roots]))]
    step_of_root = np.full(count, NONE, dtype=np.int64)
    step_of_root[step_roots] = np.arange(len(step_roots))
    roots = np.flatnonzero(parents < 0)
    for root in roots.tolist():
        if step_of_root[root] >= 0 or root == session_row:
            continue
        if levels[root] != Level.MODEL.value:
            step_of_root[root] = _latest_step(step_roots, threads, starts, threads[root], starts[root])
        if step_of_root[root] < 0 and session_row is not None:
            parents[root] = session_row
    top = root_of(parents)
    step = step_of_root[top]
    trace_index = np.where(step >= 0, step + 1, 0)
    return Structure(parents=parents, step=step, trace_index=trace_index)


def _latest_step(step_roots: np.ndarray, threads: np.ndarray, starts: np.ndarray, thread: int,
                 start: int) -> int:
    same_thread = step_roots[threads[step_roots] == thread]
    earlier = same_thread[starts[same_thread] <= start]
    if not len(earlier):
        return NONE
    latest = earlier[np.argmax(starts[earlier])]
    return int(np.flatnonzero(step_roots == latest)[0])


def anchors(levels: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """The parent, except that a layer skips over enclosing layers."""
    is_layer = levels == Level.LAYER.value
    anchor = parents.copy()
    pending = np.flatnonzero(is_layer & (anchor >= 0))
    while len(pending):
        climb = is_layer[anchor[pending]]
        pending = pending[climb]
        anchor[pending] = parents[anchor[pending]]
        pending = pending[anchor[pending] >= 0]
    return anchor


def assign_paths(spans: pd.DataFrame, parents: np.ndarray, trace_index: np.ndarray) -> np.ndarray:
    """``anchor_path/name[k]`` for every span (see :mod:`xsp.schema`)."""
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    names = spans[col.NAME].astype(str).to_numpy(dtype=object)
    anchor = anchors(levels, parents)
    depth = (spans[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64)
             if col.CALL_DEPTH in spans else np.zeros(len(spans), dtype=np.int64))
    keys = pd.DataFrame({"trace": trace_index, "anchor": anchor, "name": names,
                         "start": spans[col.START_NS].to_numpy(dtype=np.int64), "depth": depth})
    ordered = keys.sort_values(["start", "depth"], kind="stable")
    occurrence = ordered.groupby(["trace", "anchor", "name"], sort=False).cumcount()
    own = (names + "[" + occurrence.reindex(keys.index).astype(str).to_numpy(dtype=object) + "]")
    paths = np.full(len(spans), None, dtype=object)
    done = anchor < 0
    paths[done] = own[done]
    while not done.all():
        ready = ~done & (anchor >= 0) & done[np.maximum(anchor, 0)]
        if not ready.any():  # a cycle cannot happen in a tree; stop rather than loop forever
            break
        paths[ready] = paths[anchor[ready]] + "/" + own[ready]
        done |= ready
    return paths


def execution_index(spans: pd.DataFrame, step: np.ndarray) -> np.ndarray:
    """Order of each layer span within its step (forward and backward), -1 elsewhere."""
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    mask = (levels == Level.LAYER.value) & (step >= 0)
    index = np.full(len(spans), NONE, dtype=np.int64)
    if not mask.any():
        return index
    depth = (spans[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64)
             if col.CALL_DEPTH in spans else np.zeros(len(spans), dtype=np.int64))
    frame = pd.DataFrame({"step": step[mask], "start": spans[col.START_NS].to_numpy()[mask],
                          "depth": depth[mask]}, index=np.flatnonzero(mask))
    ordered = frame.sort_values(["start", "depth"], kind="stable")
    index[ordered.index.to_numpy()] = ordered.groupby("step", sort=False).cumcount().to_numpy()
    return index
