"""Structural paths, derived from the tree and the steps (:mod:`xsp.table.steps`): ``path`` is
described in :mod:`xsp.core.schema`; C writes them where it is built (``xsp/table/_paths.c``).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.lazy import pyarrow_compute as pc
from xsp.core.memory_release import LARGE_TABLE_ROWS, release_freed_memory
from xsp.core.schema import Level
from xsp.record.hotpath import optional_extension
from xsp.table.steps import (
    ANY_PROFILER_STEP,
    NONE,
    NUMBERED_PROFILER_STEP,
    SESSION_NAME,
    StepState,
    Structure,
)
from xsp.table.walks import (
    arrow_codes,
    arrow_strings,
    categories_at,
    chain_ends,
    known_categories,
    memory_pool,
    plain_strings,
    text_codes,
    untouched_zeros,
)

SKIPPING_LEVELS = (Level.LAYER.value, Level.OPERATOR.value)
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


SESSION_SCOPE = "session"
"""The scope of the names right below the session (the others' is their trace's id)."""


def _carry_occurrences(occurrence: np.ndarray, rows: np.ndarray, scopes: np.ndarray, trace_values: list[str],
                       names: np.ndarray, name_texts: pa.LargeStringArray, state: StepState) -> None:
    """Continue the counts of ``rows`` (keyed by scope and name) from earlier windows; update them.
    ``scopes``: each row's trace code (a position in ``trace_values``), or ``len(trace_values)``
    for the session scope; ``names``: its name's code among ``name_texts``.

    By codes, not a Python step a name: an always-on service's window has a trace, and so a
    scope, for every request. Only the earlier windows' texts are matched to this window's, in
    one pass each; the window's own scopes and names are codes already."""
    if not len(rows):
        return
    prior_scopes, prior_names, prior_next = state.occurrences
    known = len(prior_scopes)
    traces = len(trace_values)
    lasting = [state.session_trace_id, *(trace for _, _, trace in state.latest_step.values())]
    recent = len(state.recent_traces)
    # every scope text as an id among the distinct ones (the window's traces and the session's
    # scope first): equal texts, equal ids, so the codes below are those of the texts themselves
    text_ids, texts = pd.factorize(np.concatenate([
        np.array([*trace_values, SESSION_SCOPE], dtype=object), np.asarray(prior_scopes, dtype=object),
        np.asarray(state.recent_traces, dtype=object), np.array(lasting, dtype=object)]))
    texts = np.asarray(texts, dtype=object)
    window_ids = text_ids[:traces + 1]
    scope_codes, scope_ids = pd.factorize(np.concatenate([text_ids[traces + 1:traces + 1 + known],
                                                          window_ids[scopes]]))
    scope_ids = np.asarray(scope_ids, dtype=np.int64)
    name_ids, name_values = pd.factorize(np.concatenate([np.asarray(name_texts.to_numpy(zero_copy_only=False),
                                                                    dtype=object),
                                                         np.asarray(prior_names, dtype=object)]))
    name_values = np.asarray(name_values, dtype=object)
    name_codes, name_of_code = pd.factorize(np.concatenate([name_ids[len(name_texts):], name_ids[names]]))
    key_codes, key_values = pd.factorize(scope_codes.astype(np.int64) * (len(name_of_code) + 1) + name_codes)
    next_of_key = np.zeros(len(key_values), dtype=np.int64)
    next_of_key[key_codes[:known]] = prior_next
    occurrence[rows] += next_of_key[key_codes[known:]]
    np.maximum.at(next_of_key, key_codes[known:], occurrence[rows].astype(np.int64) + 1)
    # a trace's counts go on only into the next window (a step whose records came late, a request
    # with a step in each): a session of days has millions of traces, and would keep them all
    kept_scope = np.zeros(len(scope_ids), dtype=bool)
    kept_scope[scope_codes[known:]] = True
    in_window = np.flatnonzero(kept_scope)  # in the order of the codes
    scope_of_id = np.full(len(texts), NONE, dtype=np.int64)
    scope_of_id[scope_ids] = np.arange(len(scope_ids))
    matched = scope_of_id[text_ids[traces + 1 + known:traces + 1 + known + recent]]
    kept_scope[matched[matched >= 0]] = True
    is_session = scope_ids == window_ids[traces]  # the distinct texts' ids: equal ids, equal texts
    kept_scope |= is_session
    # the session's own trace, and each thread's latest step's, can take roots any number of windows
    # later (an import's loose roots, work on a thread after its step): their counts go on too
    matched = scope_of_id[text_ids[traces + 1 + known + recent:]]
    kept_scope[matched[matched >= 0]] = True
    first = np.unique(key_codes, return_index=True)[1]  # a row of each key, in the order of the codes
    kept = kept_scope[scope_codes[first]]
    state.occurrences = (texts[scope_ids[scope_codes[first[kept]]]],
                         name_values[np.asarray(name_of_code, dtype=np.int64)[name_codes[first[kept]]]],
                         next_of_key[kept])
    window_traces = in_window[~is_session[in_window]]
    state.recent_traces = texts[scope_ids[window_traces]]


def _text(value: str) -> pa.Scalar:
    return pa.scalar(value, pa.large_string())


def _own_texts(names: pa.Array, occurrence: np.ndarray) -> pa.Array:
    """Each own part of a path, ``name[k]``, as text."""
    return pc.binary_join_element_wise(
        names, _text("["), pc.cast(pa.array(occurrence), pa.large_string(), memory_pool=memory_pool()), _text("]"),
        _text(""), memory_pool=memory_pool())


def _take(array: pa.Array | pa.ChunkedArray, positions: np.ndarray) -> pa.Array | pa.ChunkedArray:
    return pc.take(array, pa.array(positions), memory_pool=memory_pool())


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
    scopes = np.where(anchor[rows] == session, len(shape.trace_values), shape.trace_codes[rows])
    _carry_occurrences(occurrence, rows, scopes, shape.trace_values, name_codes[rows], name_texts, state)
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
        in_text_order = pc.sort_indices(texts, memory_pool=memory_pool()).to_numpy()
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
                                      memory_pool=memory_pool()), occurrence)
    position = np.empty(count + 1, dtype=np.int64)
    position[order] = np.arange(count + 1)
    unplaced = int(bounds[0])  # rows on a cycle (layer -1) get no path
    chunks = [pa.nulls(unplaced, pa.large_string()), _take(own, order[unplaced:bounds[1]])]
    for current in range(1, len(bounds) - 1):
        members = order[bounds[current]:bounds[current + 1]]
        above = position[anchor[members]] - bounds[current - 1]
        chunks.append(pc.binary_join_element_wise(_take(chunks[-1], above), _take(own, members), _text("/"),
                                                  memory_pool=memory_pool()))
    # the last take is the largest moment: Arrow takes from layers as chunks by joining them
    # first, so join them here and let the layers go before taking
    del own
    in_layer_order = pa.concat_arrays(chunks, memory_pool=memory_pool())
    del chunks
    if count >= LARGE_TABLE_ROWS:
        release_freed_memory()
    return arrow_strings(_take(in_layer_order, position[:count]))
