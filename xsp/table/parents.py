"""Rebuilding the parent/child tree of a span table.

Parents are never trusted from the recorders. On one host thread, a span's parent is the
innermost span that encloses it in time (``a.start <= b.start and b.end <= a.end``) and whose
level is the same or shallower (a layer never hangs below an operator). Spans on different
threads never parent each other. The sweep sorts once (O(n log n)) and walks a stack.

A GPU activity (kernel, memcpy, memset, sync) runs asynchronously, so time says nothing about
who launched it: its parent is the CUDA API call with the same correlation id, whose own
parent came from inclusion on its host thread. So a kernel has the operator, layer, step
and model of its launch as ancestors.

What cannot be placed unambiguously is counted in :class:`HierarchyDiagnostics` (and listed
by :func:`diagnostics_table`), never guessed: spans that overlap without nesting, spans that
two candidates enclose equally, activities whose launch is missing, correlation ids that
more than one API call carries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.memory_release import LARGE_TABLE_ROWS, release_freed_memory
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import chain_ends, depth_of, ids_at, nearest_before, position_type

_RANK = {level.value: level.rank for level in Level}
NO_PARENT = -1
MAX_DEPTH = 128
"""The deepest a span hangs in the tree (ancestors above it). A model's tree is a few tens deep;
a trace of intervals nested 30,000 deep is no program's call tree."""


@dataclass
class HierarchyDiagnostics:
    """What the tree builder could not place unambiguously."""

    spans: int = 0
    roots: int = 0
    overlapping: int = 0
    """Spans that started inside another span on their thread but ended after it."""
    ambiguous: int = 0
    """Spans whose parent had exactly the same interval, level and call depth."""
    gpu_activities: int = 0
    """Kernels, copies, sets and syncs, placed by launch correlation."""
    launched: int = 0
    """GPU activities whose launching CUDA API call was found."""
    launch_missing: int = 0
    """GPU activities whose correlation id no CUDA API call in the trace carries."""
    without_correlation: int = 0
    """GPU activities with no correlation id at all."""
    duplicate_correlation: int = 0
    """GPU activities whose correlation id several CUDA API calls carry (left unlinked)."""
    other_without_thread: int = 0
    """Other spans with no host thread (GPU annotations, counter ranges): roots. System samples,
    which have none by design, are not counted."""
    external_linked: int = 0
    """CUDA API calls whose external correlation id names the span that made them."""
    flattened: int = 0
    """Spans nested deeper than :data:`MAX_DEPTH` levels: hung from their ancestor at that level
    (their own parent would have made paths and every walk of the tree grow with the square of
    the nesting). Their self times stay true: :mod:`xsp.table.self_time` counts a span that lies
    inside a sibling as that sibling's child."""
    external_reparented: int = 0
    """Of those, calls whose interval put them outside that span (clocks disagreeing by more
    than the gap between calls): placed under the span their id names."""
    late_linked: int = 0
    """CUDA API calls and GPU activities that CUPTI handed over after the window of the layer
    call (or launch) that made them: placed under it all the same (:mod:`xsp.table.late_records`)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def inclusion_parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray, rank: np.ndarray,
                      tiebreak: np.ndarray, rows: np.ndarray | None = None) -> tuple[np.ndarray, HierarchyDiagnostics]:
    """Parent position of every span by interval inclusion, per thread.

    Args:
        thread: thread of each span; spans with the same value can nest.
        start, end: interval of each span (any integer unit); with ``rows``, of every row of a
            table, the spans being those ``rows`` (no copy of the columns).
        rank: level depth (0 = model); a parent's rank is never higher than its child's.
        tiebreak: among equal intervals and levels, the smaller value is the outer span
            (the call depth for module calls).
        rows: where the spans are in ``start`` and ``end`` (all of them by default).

    Returns:
        ``parents`` (position of the parent, or -1) and the diagnostics.

    In order of (thread, start, longest first, rank, tiebreak), the spans that enclose a span
    are the chain of "nearest earlier span that ends no sooner" from it; its parent is the
    first of that chain whose rank is not deeper than its own. A span that ends after the next
    longer span begins, but before that span ends, overlaps it without nesting.
    """
    count = len(thread)
    diagnostics = HierarchyDiagnostics(spans=count)
    if count == 0:
        return np.full(count, NO_PARENT, dtype=np.int64), diagnostics
    # at millions of spans each array here is tens of megabytes: each is let go once used
    at = np.arange(count) if rows is None else rows  # each span's row in start and end
    order = np.lexsort((tiebreak, -end[at], rank, start[at], thread)).astype(position_type(count), copy=False)
    ends = end[at[order]]
    # chains never cross threads: rows of one thread are contiguous, so a link that leaves the
    # thread means no span of the thread encloses this one
    enclosing = nearest_before(ends, strict=False)
    run = _thread_runs(thread[order])
    enclosing[(enclosing >= 0) & (run[np.maximum(enclosing, 0)] != run)] = NO_PARENT
    ranks = rank[order].astype(np.int8 if int(rank.max()) < 127 else np.int64)
    candidate = enclosing.copy()
    pending = np.flatnonzero(candidate >= 0)
    pending = pending[ranks[candidate[pending]] > ranks[pending]]
    while len(pending):  # a shallower span inside a deeper one: walk further out
        candidate[pending] = enclosing[candidate[pending]]
        pending = pending[candidate[pending] >= 0]
        pending = pending[ranks[candidate[pending]] > ranks[pending]]
    del enclosing, pending
    found = np.flatnonzero(candidate >= 0)
    outer = candidate[found]
    del candidate
    parents = np.full(count, NO_PARENT, dtype=np.int64)
    parents[order[found]] = order[outer]
    outer_rows, found_rows = order[outer], order[found]
    diagnostics.ambiguous = int(((start[at[outer_rows]] == start[at[found_rows]]) & (ends[outer] == ends[found])
                                 & (ranks[outer] == ranks[found])
                                 & (tiebreak[outer_rows] == tiebreak[found_rows])).sum())
    del found, outer, outer_rows, found_rows, ranks
    if count >= LARGE_TABLE_ROWS:
        release_freed_memory()
    # a span is left (popped) by the first later span of its thread that ends after it
    reversed_next = nearest_before(ends[::-1], strict=True)
    following = np.where(reversed_next >= 0, count - 1 - reversed_next, -1)[::-1]
    del reversed_next
    for chunk in range(0, count, OVERLAP_CHUNK):  # a chunk at a time: a few megabytes, not tens
        positions = np.arange(chunk, min(chunk + OVERLAP_CHUNK, count))
        nxt = following[positions]
        positions, nxt = positions[nxt >= 0], nxt[nxt >= 0]
        diagnostics.overlapping += int(((run[nxt] == run[positions]) & (ends[positions] > start[at[order[nxt]]])).sum())
    return parents, diagnostics


OVERLAP_CHUNK = 1 << 18


def _thread_runs(threads: np.ndarray) -> np.ndarray:
    """For threads in sorted order, which run of one thread each row is in."""
    changes = np.empty(len(threads), dtype=bool)
    changes[:1] = True
    np.not_equal(threads[1:], threads[:-1], out=changes[1:])
    return np.cumsum(changes, dtype=position_type(len(threads)))


def launch_parents(spans: pd.DataFrame, diagnostics: HierarchyDiagnostics) -> np.ndarray:
    """Position of the launching CUDA API call of every GPU activity (-1 elsewhere)."""
    parents = np.full(len(spans), NO_PARENT, dtype=np.int64)
    correlation = spans[col.CORRELATION_ID]
    kinds = spans[col.KIND]
    activity = (kinds.isin([kind.value for kind in col.GPU_ACTIVITY_KINDS]) & spans[col.THREAD_ID].isna()).to_numpy()
    api = ((spans[col.LEVEL] == Level.CUDA_API.value) & correlation.notna()).to_numpy()
    diagnostics.gpu_activities = int(activity.sum())
    if not activity.any():
        return parents
    api_rows = np.flatnonzero(api)
    del api
    # matched in sorted order (no hash table or float copy of millions of ids)
    api_correlation = correlation.iloc[api_rows].to_numpy(dtype=np.int64)
    by_id = np.argsort(api_correlation, kind="stable")
    sorted_ids = api_correlation[by_id]
    del api_correlation
    repeated = np.zeros(len(sorted_ids), dtype=bool)
    same = sorted_ids[1:] == sorted_ids[:-1]
    repeated[1:] |= same
    repeated[:-1] |= same
    del same
    activity_rows = np.flatnonzero(activity)
    wanted = correlation.iloc[activity_rows]
    has_id = wanted.notna().to_numpy()
    found = np.full(len(activity_rows), NO_PARENT, dtype=np.int64)
    if has_id.any():
        ids = wanted[has_id].to_numpy(dtype=np.int64)
        at = np.minimum(np.searchsorted(sorted_ids, ids), max(len(sorted_ids) - 1, 0))
        known = (sorted_ids[at] == ids) if len(sorted_ids) else np.zeros(len(ids), dtype=bool)
        duplicated = known & repeated[at] if len(sorted_ids) else known
        launched = known & ~duplicated
        found[np.flatnonzero(has_id)[launched]] = api_rows[by_id[at[launched]]]
        diagnostics.duplicate_correlation = int(duplicated.sum())
        diagnostics.launch_missing = int((~known).sum())
    parents[activity_rows] = found
    diagnostics.without_correlation = int((~has_id).sum())
    diagnostics.launched = int((parents[activity_rows] >= 0).sum())
    return parents


def external_parents(spans: pd.DataFrame, parents: np.ndarray, diagnostics: HierarchyDiagnostics) -> None:
    """Check (and where needed correct) the parents of CUDA API calls by external correlation id.

    A call whose ``external_id`` is the ``external_id`` of a span on its thread was made inside
    that span. Its parent by inclusion is kept when it is that span or lies inside it; else the
    clocks disagree, and the call is moved under the span its id names (and counted).
    """
    external = spans[col.EXTERNAL_ID]
    if not external.notna().any():
        return
    is_api = (spans[col.LEVEL] == Level.CUDA_API.value).to_numpy()
    known = external.notna().to_numpy() & spans[col.THREAD_ID].notna().to_numpy()
    calls, owners = np.flatnonzero(is_api & known), np.flatnonzero(~is_api & known)
    if not len(calls) or not len(owners):
        return
    ids = external.to_numpy(dtype=np.float64, na_value=np.nan)
    threads = spans[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    owner_of = pd.Series(owners, index=pd.MultiIndex.from_arrays([threads[owners], ids[owners]]))
    owner_of = owner_of[~owner_of.index.duplicated(keep=False)]
    found = owner_of.reindex(pd.MultiIndex.from_arrays([threads[calls], ids[calls]])).to_numpy()
    linked = ~np.isnan(found)
    calls, owner = calls[linked], found[linked].astype(np.int64)
    diagnostics.external_linked = int(len(calls))
    start = spans[col.START_NS].to_numpy(dtype=np.int64)
    end = spans[col.END_NS].to_numpy(dtype=np.int64)
    parent = parents[calls]
    safe = np.maximum(parent, 0)
    inside_owner = (parent >= 0) & (start[owner] <= start[safe]) & (end[safe] <= end[owner]) & (
        threads[safe] == threads[owner])
    wrong = ~inside_owner
    parents[calls[wrong]] = owner[wrong]
    diagnostics.external_reparented = int(wrong.sum())


def cap_depth(parents: np.ndarray, max_depth: int = MAX_DEPTH) -> int:
    """Hang every span deeper than ``max_depth`` from its ancestor at depth ``max_depth - 1``
    (in place); returns how many moved."""
    depth = depth_of(parents)
    too_deep = np.flatnonzero(depth > max_depth)
    if not len(too_deep):
        return 0
    pointer = np.where(depth <= max_depth - 1, NO_PARENT, parents)
    parents[too_deep] = chain_ends(pointer)[too_deep]
    return int(len(too_deep))


def infer_parent_positions(spans: pd.DataFrame,
                           check_external_ids: bool = True) -> tuple[np.ndarray, HierarchyDiagnostics]:
    """Parent position (row number, or -1) of every row of a span table without parents yet,
    inferred from interval inclusion, launch correlation and (with ``check_external_ids``,
    :func:`external_parents`) external ids (a table with ``parent_id`` filled in is read with
    :func:`xsp.table.walks.parent_positions`)."""
    count = len(spans)
    thread = spans[col.THREAD_ID]
    has_thread = thread.notna().to_numpy()
    rows = np.flatnonzero(has_thread)
    # only the host rows, as narrow as they go: at millions of spans each array is megabytes
    level_codes, levels = pd.factorize(spans[col.LEVEL].iloc[rows])  # no Python string per row
    rank = np.array([*(_RANK.get(level, len(_RANK)) for level in levels), len(_RANK)], dtype=np.int8)[level_codes]
    del level_codes
    depth = spans[col.CALL_DEPTH] if col.CALL_DEPTH in spans else None
    tiebreak = (depth.to_numpy(dtype=np.int64, na_value=0)[rows] if depth is not None and depth.notna().any()
                else np.zeros(len(rows), dtype=np.int8))  # an import has no call depths: -2..0 fit a byte
    del depth
    # a step (or the session) spanning exactly what it holds (a closure optimizer's first step is
    # its optimizer call) is the outer one
    if col.KIND in spans:
        kinds = spans[col.KIND].iloc[rows]
        tiebreak[(kinds == SpanKind.STEP.value).to_numpy(dtype=bool)] = -1
        tiebreak[(kinds == SpanKind.SESSION.value).to_numpy(dtype=bool)] = -2
        del kinds
    sub_parents, diagnostics = inclusion_parents(
        thread.iloc[rows].to_numpy(dtype=np.int64), spans[col.START_NS].to_numpy(dtype=np.int64),
        spans[col.END_NS].to_numpy(dtype=np.int64), rank, tiebreak, rows)
    del rank, tiebreak
    if count >= LARGE_TABLE_ROWS:
        release_freed_memory()
    parents = launch_parents(spans, diagnostics)
    parents[rows] = np.where(sub_parents >= 0, rows[np.maximum(sub_parents, 0)], NO_PARENT)
    if check_external_ids and col.EXTERNAL_ID in spans:
        external_parents(spans, parents, diagnostics)
    diagnostics.flattened = cap_depth(parents)
    diagnostics.spans = count
    # roots by design: no thread, no step (the system level's garbage collections have a thread)
    samples = int(((spans[col.LEVEL] == Level.SYSTEM.value).to_numpy(dtype=bool) & ~has_thread).sum())
    diagnostics.other_without_thread = int(count - len(rows) - diagnostics.gpu_activities - samples)
    diagnostics.roots = int((parents == NO_PARENT).sum())
    return parents, diagnostics


_DIAGNOSTIC_MEANING = {
    "overlapping": "spans that started inside another span on their thread but ended after it",
    "ambiguous": "spans whose candidate parent had exactly the same interval, level and depth",
    "launch_missing": "GPU activities whose correlation id no CUDA API call in the trace carries",
    "without_correlation": "GPU activities without a correlation id",
    "duplicate_correlation": "GPU activities whose correlation id several API calls carry (unlinked)",
    "other_without_thread": "spans with neither a thread nor a launch (GPU annotations, counter ranges)",
    "flattened": f"nested over {MAX_DEPTH} deep: hung side by side, self time kept",
    "external_reparented": "CUDA API calls outside the layer their external correlation id names (clock "
                           "disagreement); placed under that layer",
}


def diagnostics_table(diagnostics: dict[str, int]) -> pd.DataFrame:
    """The hierarchy diagnostics of a trace (``trace.metadata["hierarchy"]``) as a table.

    Columns: ``problem``, ``spans`` (how many), ``share`` (of all spans, or of GPU activities
    for the launch problems), ``meaning``.
    """
    total = max(diagnostics.get("spans", 0), 1)
    activities = max(diagnostics.get("gpu_activities", 0), 1)
    rows = []
    for problem, meaning in _DIAGNOSTIC_MEANING.items():
        count = int(diagnostics.get(problem, 0))
        base = activities if problem in ("launch_missing", "without_correlation", "duplicate_correlation") else total
        rows.append({"problem": problem, "spans": count, "share": count / base, "meaning": meaning})
    return pd.DataFrame(rows, columns=["problem", "spans", "share", "meaning"])


def build(spans: pd.DataFrame) -> pd.DataFrame:
    """A copy of ``spans`` with ``parent_id`` rebuilt; diagnostics in ``.attrs["hierarchy"]``."""
    parents, diagnostics = infer_parent_positions(spans)
    out = spans.copy()
    out[col.PARENT_ID] = ids_at(out[col.SPAN_ID].to_numpy(dtype=np.int64), parents)
    out.attrs["hierarchy"] = diagnostics.as_dict()
    return out
