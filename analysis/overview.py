"""Where the time went at a glance: time per level, and the hierarchy aggregated over steps.

:func:`level_summary` says how much of the step time each level accounts for (the union of its
spans, so nested or parallel spans count once). :func:`aggregated_tree` folds every step into
one tree keyed by path (step, model, layers, operators, kernels) with the mean time per step
of each node: what an icicle or flame graph of "a typical step" draws.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of, step_kind, step_roots
from xsp.core import schema as col
from xsp.core.schema import GPU_ACTIVITY_KINDS, Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.self_time import self_ns
from xsp.table.walks import parent_positions, union_length

SUMMARY_COLUMNS = ["level", "spans", "time_ms", "share"]
TREE_COLUMNS = ["path", "parent_path", "name", "level", "self_ms", "total_ms", "calls"]
NUMBERED_ROOT = r"^([^/\[]*?)#(?:\d+|\*)\["
"""A path that starts at a numbered step's root (``ProfilerStep#*[0]/...``; older
files kept the number, ``ProfilerStep#12[0]/...``)."""
TIMED_LEVELS = (Level.MODEL, Level.INPUT, Level.LAYER, Level.OPERATOR, Level.CUDA_API, Level.KERNEL)
"""Levels whose spans are time on the host or the GPU (not instants, samples or counters)."""


def level_summary(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per level recorded, inside steps: ``level``, ``spans``, ``time_ms`` (the time covered
    by at least one of its spans; GPU activities per device) and ``share`` of the step time.
    The first row, ``steps``, is the steps themselves; the ``model`` row is the model-level
    spans inside them (model calls, backward passes, optimizer steps, your spans)."""
    spans = spans_of(source)
    roots = step_roots(spans)
    step_ms = union_length(roots[col.START_NS].to_numpy(dtype=np.int64),
                           roots[col.END_NS].to_numpy(dtype=np.int64)) / 1e6
    # graph-node marks are instants of the host, no GPU work: not counted among the kernel level's spans
    in_steps = spans[spans[col.STEP].notna() & (spans[col.KIND] != SpanKind.GRAPH_NODE.value)]
    rows = [{"level": "steps", "spans": len(roots), "time_ms": step_ms, "share": 1.0 if step_ms else np.nan}]
    for level in TIMED_LEVELS:
        mine = in_steps[in_steps[col.LEVEL] == level.value]
        if level is Level.MODEL:
            mine = mine[~mine[col.KIND].isin([k.value for k in col.STEP_KINDS]) | mine[col.PARENT_ID].notna()]
        if mine.empty:
            continue
        if level is Level.KERNEL:
            devices = mine[col.DEVICE_ID].fillna(-1).to_numpy(dtype=np.int64)
            covered = sum(union_length(mine[col.START_NS].to_numpy(dtype=np.int64)[devices == d],
                                       mine[col.END_NS].to_numpy(dtype=np.int64)[devices == d])
                          for d in np.unique(devices))
        else:
            covered = union_length(mine[col.START_NS].to_numpy(dtype=np.int64),
                                   mine[col.END_NS].to_numpy(dtype=np.int64))
        rows.append({"level": level.value, "spans": len(mine), "time_ms": covered / 1e6,
                     "share": covered / 1e6 / step_ms if step_ms else np.nan})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def aggregated_tree(source: Trace | pd.DataFrame, max_nodes: int = 2000) -> pd.DataFrame:
    """The spans of every step folded into one tree by path, with the mean per step.

    Columns: ``path``, ``parent_path`` (empty for a step's root), ``name``, ``level``,
    ``self_ms`` (time in the node and not in a host child; a kernel's is its whole duration),
    ``total_ms`` (self plus every descendant's self time, so a node's children never add up to
    more than it; an operator's kernels run on the GPU, so their time adds to the operator's
    host time), ``calls`` (per step). CUDA API calls are folded into the operator that made
    them, with their kernels below it. At most ``max_nodes`` nodes, the largest by ``total_ms``
    (with their ancestors).
    """
    spans = spans_of(source)
    chosen = (spans[col.STEP].notna() & spans[col.LEVEL].isin([level.value for level in TIMED_LEVELS])
              & (spans[col.KIND] != SpanKind.GRAPH_NODE.value)).to_numpy(copy=True)
    parents = parent_positions(spans)
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    # a CUDA API call's kernels hang from the call's parent instead
    is_api = levels == Level.CUDA_API.value
    parents = np.where((parents >= 0) & is_api[np.maximum(parents, 0)], parents[np.maximum(parents, 0)], parents)
    chosen &= ~is_api
    rows = np.flatnonzero(chosen)
    if not len(rows):
        return pd.DataFrame(columns=TREE_COLUMNS)
    duration = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    on_gpu = spans[col.KIND].isin([kind.value for kind in GPU_ACTIVITY_KINDS]).to_numpy()
    own = np.where(on_gpu, duration, self_ns(spans, chosen & ~on_gpu, parents))
    # numbered steps (ProfilerStep#12) are one kind of step: their trees fold together
    paths = spans[col.PATH].astype(object).str.replace(NUMBERED_ROOT, r"\1[", regex=True).to_numpy(dtype=object)
    parent_path = np.where(parents[rows] >= 0, paths[np.maximum(parents[rows], 0)], "")
    frame = pd.DataFrame({"path": paths[rows], "parent_path": parent_path, "name": spans[col.NAME].to_numpy(
        dtype=object)[rows], "level": levels[rows], "self_ns": own[rows]})
    steps = max(int(spans.loc[chosen, col.STEP].nunique()), 1)
    tree = frame.groupby("path", sort=False,
                         observed=True).agg(parent_path=("parent_path", "first"), name=("name", "first"),
                                                 level=("level", "first"), self_ns=("self_ns", "sum"),
                                                 calls=("name", "size"))
    tree["self_ms"] = tree["self_ns"] / steps / 1e6
    tree["calls"] = tree["calls"] / steps
    total = tree["self_ms"].copy()
    parent_of = tree["parent_path"].to_dict()
    depth = {}
    for path in tree.index:  # depth by walking up (paths are few compared with spans)
        d, at = 0, parent_of.get(path, "")
        while at and at in parent_of and d < 10_000:
            d, at = d + 1, parent_of[at]
        depth[path] = d
    for path in sorted(tree.index, key=depth.__getitem__, reverse=True):  # deepest first
        parent = parent_of[path]
        if parent and parent in total.index:
            total[parent] += total[path]
    tree["total_ms"] = total
    tree = tree.reset_index()
    if len(tree) > max_nodes:
        keep = set(tree.nlargest(max_nodes, "total_ms")["path"])
        for path in list(keep):
            at = parent_of.get(path, "")
            while at and at not in keep and at in parent_of:
                keep.add(at)
                at = parent_of[at]
        tree = tree[tree["path"].isin(keep)]
    known = set(tree["path"])
    tree.loc[~tree["parent_path"].isin(known), "parent_path"] = ""
    roots = tree["parent_path"] == ""
    tree.loc[roots, "name"] = tree.loc[roots, "name"].map(step_kind)
    return tree.sort_values("total_ms", ascending=False, kind="stable").reset_index(drop=True)[TREE_COLUMNS]
