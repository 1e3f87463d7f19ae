"""Steps, OTel traces, structural paths and execution order, derived from the tree.

* A **step** starts at every outermost ``xsp.step()`` or top-level module call (``predict``).
  Steps are numbered 0, 1, 2... in start order, and each is the root of its own OTel trace.
* A span belongs to the step of its root. A root that is not a step (a backward pass
  after a forward, on the same thread) joins the latest step its thread started before it,
  else the step running on another thread when it started (autograd and NCCL threads), whose
  root becomes its parent;
  model-level roots outside every step (``xsp.span("preprocess")`` before the model call)
  hang from the session span in the session's own trace, with no step.
* ``path`` is described in :mod:`xsp.core.schema`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp.core import schema as col
from xsp.core.memory_release import LARGE_TABLE_ROWS, release_freed_memory
from xsp.core.rank import step_trace_id
from xsp.core.schema import PROFILER_STEP_NAME, STEP_KINDS, Level
from xsp.record.hotpath import optional_extension
from xsp.table.walks import (
    MEMORY_POOL,
    arrow_codes,
    arrow_strings,
    categories_at,
    category_values,
    chain_ends,
    known_categories,
    nearest_before,
    nearest_marked,
    plain_strings,
    text_codes,
    untouched_zeros,
)

NONE = -1
SESSION_NAME = "session"
SESSION_PATH = f"{SESSION_NAME}[0]"
NUMBERED_PROFILER_STEP: Final = rf"^{PROFILER_STEP_NAME}[0-9]+$"
"""PyTorch's profiler's name of its step N (``ProfilerStep#3``), an RE2 pattern."""
ANY_PROFILER_STEP: Final = f"{PROFILER_STEP_NAME}*"
"""What such a name is in a path: the same in every step."""


def outermost_step(is_step: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Position of the outermost step-kind span (``is_step``) among each span and its ancestors, or -1."""
    nearest = nearest_marked(parents, is_step, include_self=True)
    step_above = np.where(is_step, nearest_marked(parents, is_step), NONE)
    outermost = chain_ends(step_above)
    return np.where(nearest >= 0, outermost[np.maximum(nearest, 0)], NONE)


def root_of(parents: np.ndarray) -> np.ndarray:
    """Position of each span's root (itself for roots)."""
    return chain_ends(parents)


@dataclass
class StepState:
    """What one window of spans hands to the next (see :func:`assign_steps`)."""

    session_trace_id: str
    session_span_id: int
    steps: int = 0
    """Steps numbered so far."""
    latest_step: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    """Per thread, the latest step's (start_ns, step, trace id)."""
    occurrences: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Names seen so far below the session and at the root of each trace, for ``path``."""
    layers_in_step: dict[int, int] = field(default_factory=dict)
    """Layer spans numbered so far in steps that a later window may continue."""
    attach_to_session: bool = True
    """Hang roots outside every step below the session span (False for imported traces,
    which have no session span)."""
    job_id: str | None = None
    """In a distributed job: step ``k``'s trace id is derived from the job and ``k``, the same
    on every rank (:func:`xsp.core.rank.step_trace_id`)."""
    window_owners: dict[tuple[int, int], tuple[int, Any, str]] = field(default_factory=dict)
    """The last window's layer calls by (thread, external id): (span id, step, trace id)."""
    window_launches: dict[int, tuple[int, Any, str]] = field(default_factory=dict)
    """The last window's CUDA API calls by correlation id: (span id, step, trace id)."""
    recent_owners: dict[tuple[int, int], tuple[int, Any, str]] = field(default_factory=dict)
    """Those of the last two windows, for CUDA records that come late (:mod:`xsp.table.late_records`)."""
    recent_launches: dict[int, tuple[int, Any, str]] = field(default_factory=dict)


@dataclass
class Structure:
    parents: np.ndarray  # positions; the session (or a virtual row past the end) for session children
    step: np.ndarray  # -1 for no step
    trace_codes: np.ndarray  # each row's trace, as a position in trace_values
    trace_values: list[str]  # the distinct 32-hex trace ids
    session: int  # position of the session row, len(spans) when it is not in this window

    @property
    def trace_ids(self) -> np.ndarray:
        """Each row's trace id (an object array)."""
        return np.array(self.trace_values, dtype=object)[self.trace_codes]


class _TraceCodes:
    """Trace ids as small integer codes (a table of millions of rows has a few hundred traces)."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, trace_id: str) -> int:
        found = self._codes.get(trace_id)
        if found is None:
            found = self._codes[trace_id] = len(self.values)
            self.values.append(trace_id)
        return found


def assign_steps(spans: pd.DataFrame, parents: np.ndarray, session_row: int | None, state: StepState,
                 new_trace_id: Callable[[], str], step_numbers: list[int] | None = None) -> Structure:
    """Cut each step out as its own tree and give every span its step and trace.

    ``step_numbers`` numbers the steps in order of start, when the recorder kept only some of
    them (a schedule); else steps are counted on from ``state``.

    ``state`` carries step numbers and each thread's latest step from earlier windows of the
    same session, and is updated for the next one.
    """
    count = len(spans)
    parents = parents.copy()
    session = count if session_row is None else session_row
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.int64, na_value=-1)
    # by category code, not a text a row: at millions of rows each array here is tens of megabytes
    outer = outermost_step(spans[col.KIND].isin([kind.value for kind in STEP_KINDS]).to_numpy(dtype=bool), parents)
    step_roots = np.flatnonzero(outer == np.arange(count))
    del outer
    parents[step_roots] = NONE
    step_roots = step_roots[np.lexsort((threads[step_roots], starts[step_roots]))]
    step_of = np.full(count, NONE, dtype=np.int64)
    traces = _TraceCodes()
    trace_of = np.full(count, traces.code(state.session_trace_id), dtype=np.int64)
    if step_numbers is not None and len(step_numbers) == len(step_roots):
        step_of[step_roots] = step_numbers
    else:
        step_of[step_roots] = state.steps + np.arange(len(step_roots))
    if col.STEP in spans:  # numbers the recorder already knew (ProfilerStep#N)
        preset = spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan)[step_roots]
        known = ~np.isnan(preset)
        step_of[step_roots[known]] = preset[known].astype(np.int64)
    job = state.job_id
    for root in step_roots.tolist():
        trace_of[root] = traces.code(new_trace_id() if job is None else step_trace_id(job, int(step_of[root])))
    loose = np.flatnonzero((parents < 0) & (step_of < 0))
    if session_row is not None:
        loose = loose[loose != session_row]
    below_model = loose[~spans[col.LEVEL].iloc[loose].isin(ROOT_LEVELS).to_numpy(dtype=bool)]
    found = _latest_step_on_thread(step_roots, threads, starts, below_model)
    hit = found >= 0
    step_of[below_model[hit]] = step_of[found[hit]]
    trace_of[below_model[hit]] = trace_of[found[hit]]
    # without a step anywhere (an import of a trace with none), no root below the model level
    # can be placed in one: skip the loop, one lookup a root
    unplaced_roots = below_model[~hit] if len(step_roots) or state.latest_step else below_model[:0]
    running_steps = running_step_roots(step_roots, starts, ends, starts[unplaced_roots])
    for root, running in zip(unplaced_roots.tolist(), running_steps.tolist()):
        prior = state.latest_step.get(int(threads[root]))
        if prior is not None and prior[0] <= starts[root]:
            step_of[root], trace_of[root] = prior[1], traces.code(prior[2])
            continue
        if running >= 0:  # work on a helper thread (autograd, NCCL) during another thread's step
            step_of[root], trace_of[root] = step_of[running], trace_of[running]
            parents[root] = running  # in that step's tree: no second root in its OTel trace
    if state.attach_to_session:
        unplaced = loose[step_of[loose] < 0]
        parents[unplaced] = session
    for root in step_roots.tolist():
        state.latest_step[int(threads[root])] = (int(starts[root]), int(step_of[root]),
                                                   traces.values[trace_of[root]])
    if len(step_roots):
        state.steps = max(state.steps + len(step_roots), int(step_of[step_roots].max()) + 1)
    del threads, loose, below_model, found, hit
    inside = parents.copy()
    inside[inside == count] = NONE
    top = root_of(inside)
    return Structure(parents=parents, step=step_of[top], trace_codes=trace_of[top], trace_values=traces.values,
                     session=session)


def running_step_roots(step_roots: np.ndarray, starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each time of ``at``, the position of the latest-starting step root, on any thread,
    running then (started at or before it, ended at or after it), or -1; of step roots that
    started together, the first in ``step_roots``' order.

    In O((steps + times) log steps), not a scan of every step a time: an import of 28,000 steps
    had 85,000 roots on helper threads to place. The roots are sorted by start; a time's search
    begins at the last root started by then and, while that root ended before the time, jumps to
    the nearest earlier root that ended later than it (the roots in between ended earlier still).
    """
    found = np.full(len(at), NONE, dtype=np.int64)
    if not len(step_roots) or not len(at):
        return found
    roots = step_roots[np.argsort(starts[step_roots], kind="stable")]
    root_starts, root_ends = starts[roots], ends[roots]
    later_ending = nearest_before(root_ends, strict=True)  # the nearest earlier root that ended later
    position = np.searchsorted(root_starts, at, side="right") - 1
    pending = np.flatnonzero(position >= 0)
    while len(pending):
        ended = root_ends[position[pending]] < at[pending]
        pending = pending[ended]
        position[pending] = later_ending[position[pending]]
        pending = pending[position[pending] >= 0]
    placed = np.flatnonzero(position >= 0)
    found[placed] = roots[position[placed]]
    # roots that started together: the first of them running, as ``step_roots`` orders them
    first_of_start = np.searchsorted(root_starts, root_starts[position[placed]], side="left")
    for k in np.flatnonzero(first_of_start < position[placed]).tolist():
        row = placed[k]
        tied = np.arange(first_of_start[k], position[row] + 1)
        running = tied[root_ends[tied] >= at[row]]
        found[row] = roots[running[0]]
    return found


def _latest_step_on_thread(step_roots: np.ndarray, threads: np.ndarray, starts: np.ndarray,
                           rows: np.ndarray) -> np.ndarray:
    """For each of ``rows``, the latest step root on its thread that started at or before it, or -1."""
    found = np.full(len(rows), NONE, dtype=np.int64)
    for thread in np.unique(threads[rows]).tolist():
        mine = threads[rows] == thread
        candidates = step_roots[threads[step_roots] == thread]
        if not len(candidates):
            continue
        candidates = candidates[np.argsort(starts[candidates], kind="stable")]
        before = np.searchsorted(starts[candidates], starts[rows[mine]], side="right") - 1
        found[mine] = np.where(before >= 0, candidates[np.maximum(before, 0)], NONE)
    return found


SKIPPING_LEVELS = (Level.LAYER.value, Level.OPERATOR.value)
ROOT_LEVELS = (Level.MODEL.value, Level.INPUT.value)
"""Levels whose spans outside every step stay outside (the others join the step before them)."""
"""Levels whose spans skip enclosing spans of their own level when anchoring their path."""


def anchors(levels: np.ndarray, parents: np.ndarray, skipping: np.ndarray | None = None) -> np.ndarray:
    """The parent, except that a layer (operator) skips over enclosing layers (operators).

    ``levels`` may be the levels' texts or any codes of them, with ``skipping`` then saying
    which rows are layers or operators."""
    skipping = np.isin(levels, SKIPPING_LEVELS) if skipping is None else skipping
    same_level_parent = skipping & (parents >= 0) & (levels[np.maximum(parents, 0)] == levels)
    top_of_run = chain_ends(np.where(same_level_parent, parents, NONE))
    del same_level_parent
    anchor = parents[top_of_run]
    del top_of_run
    np.copyto(anchor, parents, where=~skipping)
    return anchor


def occurrence_index(group_keys: list[np.ndarray], order_keys: list[np.ndarray]) -> np.ndarray:
    """For each row, how many rows of its group (equal ``group_keys``) come before it in
    the order of ``order_keys`` (ties keep row order)."""
    count = len(group_keys[0])
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    # narrow and in place: at millions of rows each array here is tens of megabytes
    order = _narrow(np.lexsort([*reversed(order_keys), *reversed(group_keys)]))
    new_group = np.ones(count, dtype=bool)
    for key in group_keys:
        sorted_key = key[order]
        new_group[1:] &= sorted_key[1:] == sorted_key[:-1]
        del sorted_key
    np.logical_not(new_group, out=new_group)
    new_group[0] = True
    first = _narrow(np.flatnonzero(new_group))
    sizes = np.diff(np.append(first, count))
    del new_group
    position = np.arange(count, dtype=order.dtype)
    position -= np.repeat(first, sizes)
    del first, sizes
    occurrence = np.empty(count, dtype=order.dtype)
    occurrence[order] = position
    return occurrence


def _carry_occurrences(occurrence: np.ndarray, rows: np.ndarray, scopes: np.ndarray, names: np.ndarray,
                       state: StepState) -> None:
    """Continue the counts of ``rows`` (keyed by scope and name) from earlier windows; update them."""
    if not len(rows):
        return
    scope_codes, scope_values = pd.factorize(scopes)
    name_codes, name_values = pd.factorize(names)
    groups, first, inverse = np.unique(scope_codes.astype(np.int64) * (len(name_values) + 1) + name_codes,
                                       return_index=True, return_inverse=True)
    keys = [(scope_values[scope_codes[i]], name_values[name_codes[i]]) for i in first.tolist()]
    occurrence[rows] += np.array([state.occurrences[key] for key in keys], dtype=np.int64)[inverse]
    highest = np.full(len(groups), -1, dtype=np.int64)
    np.maximum.at(highest, inverse, occurrence[rows])
    for key, value in zip(keys, highest.tolist()):
        state.occurrences[key] = max(state.occurrences[key], value + 1)


def _text(value: str) -> pa.Scalar:
    return pa.scalar(value, pa.large_string())


def _own_texts(names: pa.Array, occurrence: np.ndarray) -> pa.Array:
    """Each own part of a path, ``name[k]``, as text."""
    return pc.binary_join_element_wise(
        names, _text("["), pc.cast(pa.array(occurrence), pa.large_string(), memory_pool=MEMORY_POOL), _text("]"),
        _text(""), memory_pool=MEMORY_POOL)


def _take(array: pa.Array | pa.ChunkedArray, positions: np.ndarray) -> pa.Array | pa.ChunkedArray:
    return pc.take(array, pa.array(positions), memory_pool=MEMORY_POOL)


def _narrow(positions: np.ndarray) -> np.ndarray:
    """Positions or codes as int32 where they fit (at millions of rows, tens of megabytes less)."""
    if len(positions) and (positions.max() >= np.iinfo(np.int32).max or positions.min() < np.iinfo(np.int32).min):
        return positions
    return positions.astype(np.int32, copy=False)


def _tree_layers(anchor: np.ndarray) -> np.ndarray:
    """Distance of each row from its root along ``anchor`` (-1 where no root is reached)."""
    layer = np.where(anchor < 0, 0, NONE).astype(anchor.dtype, copy=False)
    pending = _narrow(np.flatnonzero(anchor >= 0))
    while len(pending):
        ready = layer[anchor[pending]] >= 0
        if not ready.any():  # cannot happen in a tree; stop rather than loop forever
            break
        layer[pending[ready]] = layer[anchor[pending[ready]]] + 1
        pending = pending[~ready]
    return layer


def assign_paths(spans: pd.DataFrame, shape: Structure, state: StepState) -> pd.Categorical:
    """``anchor_path/name[k]`` for every span (see :mod:`xsp.core.schema`), as a categorical.

    A path repeats in every step, so each row's path is found as a code among the distinct
    paths, a tree layer at a time: a span's path is its anchor's path and its own part, so two
    spans whose anchors have the same path and whose own parts are equal share it. Only the
    distinct paths are ever written out (by C, ``_paths.c``, or by Arrow where it is not built):
    a trace of millions of spans has a few thousand. PyTorch's profiler numbers its steps
    (``ProfilerStep#3``): the number is left out of the path (``ProfilerStep#*[0]/...``), so that
    the same span has the same path in every step, as in xsp's own traces.
    """
    count = len(spans)
    levels = spans[col.LEVEL]
    level_codes = (levels.cat.codes.to_numpy() if isinstance(levels.dtype, pd.CategoricalDtype)
                   else pd.factorize(levels)[0])  # codes, not a text a row; the session row: -2
    skipping = np.append(levels.isin(SKIPPING_LEVELS).to_numpy(dtype=bool), False)
    parents = np.append(shape.parents, NONE)  # row ``count`` stands for a session outside the window
    anchor = _narrow(anchors(np.append(level_codes, -2), parents, skipping))
    del levels, level_codes, skipping, parents
    large = count >= LARGE_TABLE_ROWS
    if large:  # what was freed is handed back before the next arrays are made
        release_freed_memory()
    name_codes, name_texts = _name_codes(spans[col.NAME])
    name_codes = _narrow(name_codes)
    session = shape.session
    depth = spans[col.CALL_DEPTH] if col.CALL_DEPTH in spans else None
    order_keys = [spans[col.START_NS].to_numpy(dtype=np.int64)]
    if depth is not None and depth.fillna(0).ne(0).any():
        order_keys.append(depth.fillna(0).to_numpy(dtype=np.int64))
    occurrence = _narrow(occurrence_index([shape.trace_codes, anchor[:count], name_codes], order_keys))
    del order_keys
    # names below the session and at trace roots recur across windows: continue their counts
    carried = (anchor[:count] < 0) | (anchor[:count] == session)
    if session < count:
        carried[session] = False
    rows = np.flatnonzero(carried)
    scopes = np.where(anchor[rows] == session, "session",
                      np.array(shape.trace_values, dtype=object)[shape.trace_codes[rows]])
    _carry_occurrences(occurrence, rows, scopes, name_texts.take(pa.array(name_codes[rows])).to_numpy(
        zero_copy_only=False), state)
    occurrence = np.append(occurrence, 0)
    occurrence[session] = 0  # the session row is named SESSION_NAME, so its own part is SESSION_PATH
    anchor[session] = NONE
    if session < count or not (anchor[:count] == count).any():
        anchor[count] = count  # no row stands for a session outside the window: not a path (a cycle)
    del depth, carried, rows, scopes
    own_part, part_texts = _name_parts(name_codes, name_texts)
    del name_codes  # each array a row is tens of megabytes at millions of spans
    if large:
        release_freed_memory()
    path_codes, representative, own_anchor, bounds = _distinct_paths(own_part, occurrence, anchor)
    part_codes, own_occurrence = own_part[representative], np.append(occurrence[representative], 0).astype(np.int64)
    del own_part, occurrence, anchor
    if large:
        release_freed_memory()
    distinct = len(part_codes)
    order = np.arange(distinct + 1)  # the distinct paths come layer by layer, anchors first
    # categories sorted as every categorical column's are; the paths are written once, in text
    # order, where the tree gives that order, else written, sorted and written again (a trace
    # without steps has as many paths as spans: a sorted copy would be hundreds of megabytes)
    rank = _text_ranks(part_codes, part_texts, own_occurrence[:distinct], own_anchor[:distinct], bounds)
    reused = None
    if rank is None:
        texts = plain_strings(pd.Series(_written_paths(part_codes, part_texts, own_occurrence, own_anchor, order,
                                                       bounds), copy=False))
        in_text_order = pc.sort_indices(texts, memory_pool=MEMORY_POOL).to_numpy()
        if _repeats(texts, in_text_order):
            # a name holding "/" spelt another span's path: one category for both
            text_of, unique_texts = arrow_codes(texts)
            return categories_at(np.where(path_codes < 0, NONE, text_of[np.maximum(path_codes, 0)]), unique_texts)
        rank = np.empty(distinct, dtype=np.int64)
        rank[in_text_order] = np.arange(distinct)
        # written again over the first writing, which nothing reads any more
        reused = np.frombuffer(texts.buffers()[2], dtype=np.uint8) if len(texts) and texts.buffers()[2] else None
        if reused is not None and not reused.flags.writeable:
            reused = None
        del texts, in_text_order
    if large:
        release_freed_memory()
    # the forest relabelled by rank (its one more slot kept last), the first labels let go as they go
    by_rank_part = np.empty(distinct, dtype=np.int64)
    by_rank_part[rank] = part_codes
    del part_codes
    by_rank_occurrence = np.zeros(distinct + 1, dtype=np.int64)
    by_rank_occurrence[rank] = own_occurrence[:distinct]
    del own_occurrence
    by_rank_anchor = np.full(distinct + 1, NONE, dtype=np.int64)
    by_rank_anchor[rank] = own_anchor[:distinct]
    del own_anchor
    placed = by_rank_anchor >= 0
    by_rank_anchor[placed] = rank[by_rank_anchor[placed]]
    del placed
    if large:
        release_freed_memory()
    sorted_texts = _written_paths(by_rank_part, part_texts, by_rank_occurrence, by_rank_anchor,
                                  np.append(rank, distinct), bounds, reused)
    del by_rank_part, by_rank_occurrence, by_rank_anchor
    return known_categories(np.where(path_codes < 0, NONE, rank[np.maximum(path_codes, 0)]),
                            plain_strings(pd.Series(sorted_texts, copy=False)))


PLAIN_NAMES_BREAK: Final = r"/|\[[0-9]+\]."
"""In a name, what can make one path another's prefix or spelling: the tree no longer gives text order."""


def _text_ranks(part_codes: np.ndarray, part_texts: pa.LargeStringArray, occurrence: np.ndarray,
                anchor: np.ndarray, bounds: np.ndarray) -> np.ndarray | None:
    """Each distinct path's place in text order, found from the tree, or None where its names
    may break that order (:data:`PLAIN_NAMES_BREAK`).

    Where no name holds "/" nor "[k]" followed by more, no own part ``name[k]`` is another's
    prefix, so paths sort as the tree's depth-first walk does with siblings in the order of their
    own parts: only the distinct own parts (short) are sorted, never the paths (long, and as many
    as spans in a trace without steps)."""
    count = len(part_codes)
    if pc.any(pc.match_substring_regex(part_texts, PLAIN_NAMES_BREAK)).as_py():
        return None
    if not count:
        return np.zeros(0, dtype=np.int64)
    occurrences = int(occurrence.max(initial=0)) + 1
    own_of_node, owns = pd.factorize(part_codes.astype(np.int64) * occurrences + occurrence)
    own_texts = _own_texts(part_texts.take(pa.array(owns // occurrences)), owns % occurrences)
    own_rank = np.empty(len(owns), dtype=np.int64)
    own_rank[pc.sort_indices(own_texts).to_numpy()] = np.arange(len(owns))
    node_own = own_rank[own_of_node]
    del own_of_node, own_rank, own_texts
    layers = len(bounds) - 1
    size = np.ones(count, dtype=np.int64)  # each path's subtree, counted from the deepest layer up
    for current in range(layers - 1, 0, -1):
        members = np.arange(bounds[current], bounds[current + 1])
        size += np.bincount(anchor[members], weights=size[members], minlength=count).astype(np.int64)
    position = np.empty(count, dtype=np.int64)
    for current in range(layers):
        members = np.arange(bounds[current], bounds[current + 1])
        parents = anchor[members] if current else np.full(len(members), NONE, dtype=np.int64)
        in_order = np.lexsort((node_own[members], parents))
        members, parents = members[in_order], parents[in_order]
        before = np.cumsum(size[members]) - size[members]  # the subtrees of earlier siblings
        first = np.ones(len(members), dtype=bool)
        first[1:] = parents[1:] != parents[:-1]
        before -= before[np.maximum.accumulate(np.where(first, np.arange(len(members)), 0))]
        position[members] = before if not current else position[parents] + 1 + before
    return position


def _repeats(texts: pa.LargeStringArray, in_text_order: np.ndarray, chunk: int = 1 << 16) -> bool:
    """Whether any text is there twice (equal neighbours in text order), compared in place (by C
    where it is built, else a chunk at a time): no sorted copy of them all is made."""
    module = optional_extension("xsp.table._paths")
    if module is not None and len(texts):
        _, offsets, data = texts.buffers()
        at = np.frombuffer(offsets, dtype=np.int64)[texts.offset:texts.offset + len(texts) + 1]
        order = np.ascontiguousarray(in_text_order, dtype=np.int64)
        return bool(module.equal_neighbours(order, np.ascontiguousarray(at), data or b""))
    for begin in range(0, max(len(in_text_order) - 1, 0), chunk):
        window = texts.take(pa.array(in_text_order[begin:begin + chunk + 1]))
        if pc.any(pc.equal(window[1:], window[:-1])).as_py():
            return True
    return False


def _written_paths(part_codes: np.ndarray, part_texts: pa.LargeStringArray, occurrence: np.ndarray,
                   anchor: np.ndarray, order: np.ndarray, bounds: np.ndarray,
                   into: np.ndarray | None = None) -> pd.api.extensions.ExtensionArray:
    """The paths of a forest (see :func:`_distinct_paths`) as text, by C where it is built (into
    ``into``'s memory where it is given and large enough)."""
    filler = _path_filler()
    if filler is not None:
        return _filled_paths(filler, part_codes, part_texts, occurrence, anchor, order, bounds, into)
    return _joined_paths(part_texts.take(pa.array(part_codes)), occurrence, anchor, order, bounds)


def _name_parts(name_codes: np.ndarray, name_texts: pa.LargeStringArray) -> tuple[np.ndarray, pa.LargeStringArray]:
    """Each row's name as it is in a path (a code among ``part_texts``: the names, a profiler
    step's without its number); the row past the end: the session's own name."""
    part_names = pc.replace_substring_regex(name_texts, NUMBERED_PROFILER_STEP, ANY_PROFILER_STEP)
    part_names = pa.concat_arrays([part_names.cast(pa.large_string()), pa.array([SESSION_NAME], pa.large_string())])
    name_part, part_texts = arrow_codes(part_names)
    return _narrow(name_part)[np.append(name_codes, len(name_texts))], part_texts


def _distinct_paths(own_part: np.ndarray, occurrence: np.ndarray,
                    anchor: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each row's path as a code among the distinct paths (-1 for rows on a cycle), and the
    distinct paths as a forest of their own, layer by layer (``bounds``), for writing out: a row
    that has it (whose own part, ``own_part[k]``, it ends in) and its anchor (a distinct path
    before it; one more, unused, slot at the end: the row that stands for a session outside the
    window in the writers). Two rows share a path where their anchors do and their own parts are
    equal."""
    count = len(own_part) - 1
    parts = int(own_part.max(initial=0)) + 1
    occurrences = int(occurrence.max(initial=0)) + 1
    layer = _tree_layers(anchor)
    order = _narrow(np.argsort(layer, kind="stable"))
    layer_bounds = np.searchsorted(layer[order], np.arange(layer.max(initial=0) + 2))
    del layer
    path_codes = np.full(count + 1, NONE, dtype=anchor.dtype)
    # a path is (its anchor's path, name, k): one integer where the product fits (it nearly always does)
    fits = (count + 2) * parts * occurrences < np.iinfo(np.int64).max
    forest_rows: list[np.ndarray] = []
    forest_anchor: list[np.ndarray] = []
    bounds = [0]
    for current in range(len(layer_bounds) - 1):
        members = order[layer_bounds[current]:layer_bounds[current + 1]]
        above = path_codes[anchor[members]] if current else np.full(len(members), NONE, dtype=path_codes.dtype)
        if fits:
            key = (above.astype(np.int64) + 1) * parts + own_part[members]
            key *= occurrences
            key += occurrence[members]
        else:  # the own parts as codes first
            own_code = pd.factorize(own_part[members].astype(np.int64) * occurrences + occurrence[members])[0]
            key = (above.astype(np.int64) + 1) * (len(members) + 1) + own_code
        codes, keys = pd.factorize(key)
        del key
        first = np.empty(len(keys), dtype=np.int64)
        first[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)
        path_codes[members] = bounds[-1] + codes
        forest_rows.append(members[first])
        forest_anchor.append(above[first])
        bounds.append(bounds[-1] + len(keys))
    empty = np.zeros(0, dtype=np.int64)
    representative = np.concatenate(forest_rows) if forest_rows else empty
    anchor_of_path = np.append(np.concatenate(forest_anchor) if forest_anchor else empty, NONE).astype(np.int64)
    return path_codes[:count], representative, anchor_of_path, np.array(bounds, dtype=np.int64)


def _name_codes(names: pd.Series) -> tuple[np.ndarray, pa.LargeStringArray]:
    """Each row's name as a code into the distinct names (a categorical's own codes: no string a
    row), a missing name as the empty one."""
    codes, texts = text_codes(names)
    missing = codes < 0
    if missing.any():
        empty = np.flatnonzero(texts.to_numpy(zero_copy_only=False) == "") if len(texts) else np.zeros(0)
        if not len(empty):
            texts = pa.concat_arrays([texts, pa.array([""], type=pa.large_string())])
            empty = np.array([len(texts) - 1])
        codes[missing] = int(empty[0])
    return codes, texts


def _path_filler() -> Any:
    """``xsp.table._paths.fill_paths``, or None where it is not built or ``XSP_PURE_PYTHON`` is set."""
    module = optional_extension("xsp.table._paths")
    return None if module is None else module.fill_paths


def _digits(values: np.ndarray) -> np.ndarray:
    """How many characters ``str(value)`` has, for each value."""
    digits = np.ones(len(values), dtype=np.int64)  # in place: millions of values at a time
    digits += values < 0
    rest = np.abs(values)
    rest //= 10
    while (rest > 0).any():
        digits += rest > 0
        rest //= 10
    return digits


def _filled_paths(fill: Any, name_codes: np.ndarray, names: pa.LargeStringArray, occurrence: np.ndarray,
                  anchor: np.ndarray, order: np.ndarray, bounds: np.ndarray,
                  into: np.ndarray | None = None) -> pd.api.extensions.ExtensionArray:
    """The paths written by C into one buffer of their exact size (see ``_paths.c``; ``into``,
    where it is given and large enough): a path's length is its anchor's, one for '/', and its
    own part's, computed a tree layer at a time. ``name_codes`` give each row's name among the
    distinct ``names``."""
    count = len(name_codes)
    if not count:
        return arrow_strings(pa.array([], type=pa.large_string()))
    if not len(names):
        names = pa.array([""], type=pa.large_string())
    _, offsets_buffer, text_buffer = names.buffers()
    name_offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[names.offset:names.offset + len(names) + 1]
    own_length = np.empty(count + 1, dtype=np.int64)
    own_length[:count] = np.diff(name_offsets)[name_codes]
    own_length[count] = len(SESSION_NAME.encode())
    own_length += 2
    own_length += _digits(occurrence)
    length = np.zeros(count + 1, dtype=np.int64)
    roots = order[bounds[0]:bounds[1]]
    length[roots] = own_length[roots]
    for current in range(1, len(bounds) - 1):
        members = order[bounds[current]:bounds[current + 1]]
        length[members] = length[anchor[members]] + 1 + own_length[members]
    del own_length
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(length[:count], out=offsets[1:])
    del length
    total = int(offsets[-1])
    # fresh pages of their own, not numpy's (which asks for huge pages: the kernel compacted memory
    # for them at each fault, 0.4 s for the 230 MB of paths of a trace without steps, not 0.13)
    data = into[:total] if into is not None and len(into) >= total else untouched_zeros(total, np.uint8)
    fill(order[bounds[0]:], anchor, offsets, data,
         np.ascontiguousarray(name_codes, dtype=np.int64), np.ascontiguousarray(name_offsets), text_buffer or b"",
         occurrence, SESSION_NAME.encode(), count)
    unplaced = order[:bounds[0]]  # rows on a cycle get no path
    unplaced = unplaced[unplaced < count]
    validity = None
    if len(unplaced):
        placed = np.ones(count, dtype=bool)
        placed[unplaced] = False
        validity = pa.py_buffer(np.packbits(placed, bitorder="little"))
    return arrow_strings(pa.LargeStringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(data),
                                                          validity, len(unplaced)))


def _joined_paths(name_column: pa.LargeStringArray, occurrence: np.ndarray, anchor: np.ndarray,
                  order: np.ndarray, bounds: np.ndarray) -> pd.api.extensions.ExtensionArray:
    """The paths joined in Arrow one tree layer at a time (where the C filler is not built)."""
    count = len(name_column)
    own = _own_texts(pa.concat_arrays([name_column, pa.array([SESSION_NAME], type=pa.large_string())],
                                      memory_pool=MEMORY_POOL), occurrence)
    position = np.empty(count + 1, dtype=np.int64)
    position[order] = np.arange(count + 1)
    unplaced = int(bounds[0])  # rows on a cycle (layer -1) get no path
    chunks = [pa.nulls(unplaced, pa.large_string()), _take(own, order[unplaced:bounds[1]])]
    for current in range(1, len(bounds) - 1):
        members = order[bounds[current]:bounds[current + 1]]
        above = position[anchor[members]] - bounds[current - 1]
        chunks.append(pc.binary_join_element_wise(_take(chunks[-1], above), _take(own, members), _text("/"),
                                                  memory_pool=MEMORY_POOL))
    # the last take is the largest moment: Arrow takes from layers as chunks by joining them
    # first, so join them here and let the layers go before taking
    del own
    in_layer_order = pa.concat_arrays(chunks, memory_pool=MEMORY_POOL)
    del chunks
    if count >= LARGE_TABLE_ROWS:
        release_freed_memory()
    return arrow_strings(_take(in_layer_order, position[:count]))


def execution_index(spans: pd.DataFrame, step: np.ndarray, state: StepState | None = None) -> np.ndarray:
    """Order of each layer span within its step (forward and backward), -1 elsewhere.

    With ``state``, counting goes on from where earlier windows of the same step stopped.
    """
    levels = category_values(spans[col.LEVEL])
    mask = (levels == Level.LAYER.value) & (step >= 0)
    index = np.full(len(spans), NONE, dtype=np.int64)
    if not mask.any():
        return index
    depth = (spans[col.CALL_DEPTH].fillna(0).to_numpy(dtype=np.int64)
             if col.CALL_DEPTH in spans else np.zeros(len(spans), dtype=np.int64))
    frame = pd.DataFrame({"step": step[mask], "start": spans[col.START_NS].to_numpy()[mask],
                          "depth": depth[mask]}, index=np.flatnonzero(mask))
    ordered = frame.sort_values(["start", "depth"], kind="stable")
    order = ordered.groupby("step", sort=False, observed=True).cumcount().to_numpy()
    if state is not None:
        steps = ordered["step"].to_numpy()
        order = order + np.array([state.layers_in_step.get(int(s), 0) for s in steps.tolist()], dtype=np.int64)
        open_steps = {latest[1] for latest in state.latest_step.values()}
        for step_number, last in zip(steps.tolist(), order.tolist()):
            if step_number in open_steps:
                state.layers_in_step[int(step_number)] = max(state.layers_in_step.get(int(step_number), 0), last + 1)
        for step_number in list(state.layers_in_step):
            if step_number not in open_steps:
                del state.layers_in_step[step_number]
    index[ordered.index.to_numpy()] = order
    return index
