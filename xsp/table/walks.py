"""Walking the span tree: parent positions and nearest ancestors, vectorised."""

from __future__ import annotations

import functools
import mmap
import re
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.core.lazy import pyarrow_compute as pc
from xsp.core.schema import Level

NONE = -1

@functools.cache
def memory_pool() -> pa.MemoryPool:
    """Where xsp's own Arrow columns are allocated. Arrow's default (mimalloc) hands out fresh
    pages that fault on first touch; on the virtual machines we measured, taking 10 MB of paths
    cost 60-110 ms from it and 23 ms from the system allocator, which reuses memory Python freed.
    Passed explicitly to each call, so the process's default pool is left alone."""
    return pa.system_memory_pool()


def parent_positions(spans: pd.DataFrame) -> np.ndarray:
    """Row position of each span's parent (-1 for roots and parents outside the table)."""
    ids = spans[col.SPAN_ID].to_numpy(dtype=np.int64)
    parent = spans[col.PARENT_ID]
    has_parent = parent.notna().to_numpy()
    positions = np.full(len(spans), NONE, dtype=np.int64)
    if not has_parent.any():
        return positions
    sorter = np.argsort(ids)
    wanted = parent[has_parent].to_numpy(dtype=np.int64)
    found = sorter[np.minimum(np.searchsorted(ids, wanted, sorter=sorter), len(ids) - 1)]
    positions[has_parent] = np.where(ids[found] == wanted, found, NONE)
    return positions


def untouched_zeros(count: int, dtype: Any = np.int64) -> np.ndarray:
    """``count`` zeros in memory of their own that the system provides only when written.

    A span table has many columns that are null in most traces (an imported trace has no module
    types, a CPU run no kernels): their zeros cost the process nothing until something writes
    them, whatever the allocator did before (``np.zeros`` only sometimes gets fresh pages).
    """
    size = count * np.dtype(dtype).itemsize
    if size < 1 << 20:
        return np.zeros(count, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, size), dtype=dtype, count=count)


def nullable_ints(values: np.ndarray, missing: np.ndarray) -> pd.arrays.IntegerArray:
    """An Int64 column of ``values`` in which the ``missing`` rows are null."""
    missing = np.asarray(missing, dtype=bool)
    if missing.all():
        return pd.arrays.IntegerArray(untouched_zeros(len(missing)), missing)
    return pd.arrays.IntegerArray(np.where(missing, 0, values).astype(np.int64), missing)


def arrow_strings(array: pa.Array | pa.ChunkedArray) -> pd.api.extensions.ExtensionArray:
    """Wrap an Arrow string array as pandas' "string" dtype without converting element by element."""
    if array.type != pa.large_string():
        array = pc.cast(array, pa.large_string(), memory_pool=memory_pool())
    return pd.arrays.ArrowStringArray(array)


def strings_at(codes: np.ndarray, values: Any) -> pd.api.extensions.ExtensionArray:
    """``values[code]`` for each code (null for a negative one) as a string column, expanded by
    Arrow: no Python string per row."""
    table = pa.array(list(values), type=pa.large_string())
    return arrow_strings(pc.take(table, pa.array(codes, mask=codes < 0), memory_pool=memory_pool()))


def _smallest_codes(codes: np.ndarray, categories: int) -> np.ndarray:
    """Category codes in the narrowest integer type that holds ``categories`` (and -1)."""
    for kind in (np.int8, np.int16, np.int32):
        if categories <= np.iinfo(kind).max:
            return codes.astype(kind, copy=False)
    return codes.astype(np.int64, copy=False)


def _categorical(codes: np.ndarray, texts: pa.Array) -> pd.Categorical:
    """``texts[code]`` for each code (null for -1) as a categorical whose categories are the
    texts used, sorted (so that sorting by the column sorts by text)."""
    used = np.zeros(len(texts) + 1, dtype=bool)
    used[codes] = True  # -1 marks the extra last slot
    kept = np.flatnonzero(used[:-1])
    values = texts.take(pa.array(kept)) if len(kept) < len(texts) else texts
    order = pc.sort_indices(values).to_numpy()
    rank = np.full(len(texts) + 1, -1, dtype=np.int64)
    rank[kept[order]] = np.arange(len(kept))
    categories = pd.Index(arrow_strings(values.take(pa.array(order))))
    # narrowed before it is taken a row: a million rows' codes are megabytes, not eight of them
    return pd.Categorical.from_codes(_smallest_codes(rank, len(kept))[codes], dtype=pd.CategoricalDtype(categories),
                                     validate=False)


def known_categories(codes: np.ndarray, texts: pa.LargeStringArray) -> pd.Categorical:
    """``texts[code]`` for each code (-1: null) as a categorical, ``texts`` being already
    distinct and sorted: pandas is not asked to check that (it would make a Python string of
    each, hundreds of megabytes for the paths of a trace without steps)."""
    categories = pd.Index(arrow_strings(texts))
    try:  # pandas' own constructor without the check; a pandas without it checks
        dtype = pd.CategoricalDtype._from_fastpath(categories, False)  # noqa: SLF001
    except AttributeError:
        dtype = pd.CategoricalDtype(categories)
    return pd.Categorical.from_codes(_smallest_codes(np.asarray(codes), len(texts)), dtype=dtype, validate=False)


def arrow_codes(array: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.LargeStringArray]:
    """Arrow strings (plain or dictionary-encoded) as codes (int64, -1 for null) into their
    distinct texts, dictionary-encoded by Arrow: no string per row."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if not pa.types.is_dictionary(array.type):
        if array.type != pa.large_string():
            array = pc.cast(array, pa.large_string(), memory_pool=memory_pool())
        array = pc.dictionary_encode(array, memory_pool=memory_pool())
    texts = array.dictionary
    if texts.type != pa.large_string():
        texts = pc.cast(texts, pa.large_string(), memory_pool=memory_pool())
    return array.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64, copy=False), texts


def categorical(array: pa.Array | pa.ChunkedArray) -> pd.Categorical:
    """Arrow strings (plain or dictionary-encoded) as a pandas categorical, without a Python
    string per row: the :data:`xsp.core.schema.CATEGORY` columns."""
    return _categorical(*arrow_codes(array))


def categories_at(codes: np.ndarray, values: Any) -> pd.Categorical:
    """``values[code]`` for each code (null for a negative one) as a categorical (the
    :data:`xsp.core.schema.CATEGORY` columns), built from the codes: no string per row.
    ``values``: distinct texts, as an Arrow array or any sequence."""
    codes = np.asarray(codes)
    texts = values if isinstance(values, pa.LargeStringArray) else pa.array(list(values), type=pa.large_string())
    return _categorical(np.where(codes < 0, -1, codes) if len(codes) and codes.min() < -1 else codes, texts)


def text_codes(column: pd.Series) -> tuple[np.ndarray, pa.LargeStringArray]:
    """A text column as codes (int64, -1 for null) into its distinct texts: a categorical's own
    codes and categories, or a string column dictionary-encoded by Arrow. No string per row."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        texts = pa.array(column.cat.categories.array)
        if isinstance(texts, pa.ChunkedArray):  # categories joined from Arrow-backed ones
            texts = texts.combine_chunks()
        if texts.type != pa.large_string():
            texts = pc.cast(texts, pa.large_string(), memory_pool=memory_pool())
        return column.cat.codes.to_numpy().astype(np.int64), texts
    return arrow_codes(plain_strings(column))


def set_texts(table: pd.DataFrame, rows: Any, column: str, texts: Any) -> None:
    """``table.loc[rows, column] = texts`` for a :data:`xsp.core.schema.CATEGORY` column, in
    place: a categorical refuses a text it lacks, so the texts new to it are added to its
    categories first (kept sorted). ``texts``: one text, or one per row."""
    values = [texts] if isinstance(texts, str) else list(texts)
    known = table[column].cat.categories
    extra = {text for text in values if text not in known}
    if extra:
        table[column] = table[column].cat.set_categories(pd.Index(sorted({*known, *extra}), dtype="string"))
    table.loc[rows, column] = texts


def null_categories(count: int) -> pd.Categorical:
    """A :data:`xsp.core.schema.CATEGORY` column of ``count`` nulls."""
    return pd.Categorical.from_codes(np.full(count, -1, dtype=np.int8),
                                     dtype=pd.CategoricalDtype(pd.Index([], dtype="string")), validate=False)


def category_values(column: pd.Series) -> np.ndarray:
    """A column of few distinct strings (levels, kinds) as an object array (None for missing),
    built from its distinct values: no Python string is made per row."""
    codes, uniques = pd.factorize(column)
    return np.array([*uniques, None], dtype=object)[codes]


def plain_strings(column: pd.Series) -> pa.LargeStringArray:
    """A string column as one contiguous Arrow array (no Python string per row for Arrow-backed columns)."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        array = pa.array(column.array)
        array = array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array
        return pc.cast(array, pa.large_string(), memory_pool=memory_pool())
    array = pa.array(column.array, type=pa.large_string(), from_pandas=True)
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def texts_at(column: pd.Series, positions: np.ndarray) -> np.ndarray:
    """``column``'s text at each position, as an object array (``None`` where the position is -1
    or the row has none). For a categorical only the distinct texts become Python strings."""
    found = np.full(len(positions), None, dtype=object)
    hit = positions >= 0
    if isinstance(column.dtype, pd.CategoricalDtype):
        distinct = np.array([*column.cat.categories.tolist(), None], dtype=object)
        found[hit] = distinct[column.cat.codes.to_numpy()[positions[hit]]]  # code -1 is the None after them
        return found
    chosen = column.iloc[positions[hit]]
    found[hit] = chosen.astype(object).where(chosen.notna(), None).to_numpy(dtype=object)
    return found


def text_matches(column: pd.Series, pattern: re.Pattern[str], anywhere: bool = False) -> np.ndarray:
    """Whether each row's text matches ``pattern`` at its start (``re.match``; with ``anywhere``,
    ``re.search``; ``False`` where the row has none), the pattern tried once per distinct text."""
    codes, texts = text_codes(column)
    test = pattern.search if anywhere else pattern.match
    matched = np.array([test(text) is not None for text in texts.to_pylist()] + [False], dtype=bool)
    return matched[codes]  # code -1 is the False after them


def ids_at(ids: np.ndarray, positions: np.ndarray) -> pd.arrays.IntegerArray:
    """The span id at each position (a parent column), null where the position is -1."""
    missing = positions < 0
    values = ids.take(positions, mode="clip")  # a new array, zeroed where null in place
    values[missing] = 0
    return pd.arrays.IntegerArray(values.astype(np.int64, copy=False), missing)


def chain_ends(pointer: np.ndarray) -> np.ndarray:
    """Where following ``pointer`` (-1: stop) from each position ends (the position itself if
    its pointer is -1).

    By pointer jumping, so a chain of length d costs log2(d) vectorised passes, not d: a trace
    of identical microsecond intervals nests 20,000 deep.
    """
    jump = np.where(pointer >= 0, pointer, np.arange(len(pointer)))
    for _ in range(max(len(pointer), 1).bit_length() + 1):
        further = jump[jump]
        if np.array_equal(further, jump):
            break
        jump = further
    return jump


def ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The runs ``firsts[i], firsts[i] + 1, ..., firsts[i] + counts[i] - 1``, one after the other,
    without a Python loop (the items of each row of a ragged table, read row by row)."""
    counts = np.asarray(counts, dtype=np.int64)
    return (np.repeat(np.asarray(firsts, dtype=np.int64), counts)
            + np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts))


def depth_of(parents: np.ndarray) -> np.ndarray:
    """Number of ancestors of each span, from :func:`parent_positions` (by pointer jumping)."""
    depth = (parents >= 0).astype(np.int64)
    ahead = parents.copy()
    for _ in range(max(len(parents), 1).bit_length() + 1):
        moving = np.flatnonzero(ahead >= 0)
        if not len(moving):
            break
        depth[moving] += depth[ahead[moving]]
        ahead[moving] = ahead[ahead[moving]]
    return depth


def sum_into_ancestors(parents: np.ndarray, rows: np.ndarray, *weights: np.ndarray,
                       only: np.ndarray | None = None) -> list[np.ndarray]:
    """For each weight array, every position's sum of the weights of ``rows`` below it.

    Each of ``rows`` adds its weight (NaN counts as 0) to every proper ancestor, or only to
    the ancestors for which ``only`` is true.
    """
    totals = [np.zeros(len(parents)) for _ in weights]
    ancestor = parents[rows]
    keep = ancestor >= 0
    rows, ancestor = rows[keep], ancestor[keep]
    while len(rows):
        hit = np.ones(len(rows), dtype=bool) if only is None else only[ancestor]
        for total, weight in zip(totals, weights):
            np.add.at(total, ancestor[hit], np.nan_to_num(weight[rows[hit]]))
        ancestor = parents[ancestor]
        keep = ancestor >= 0
        rows, ancestor = rows[keep], ancestor[keep]
    return totals


def inside_any(threads: np.ndarray, starts: np.ndarray, ends: np.ndarray, containers: np.ndarray,
               candidates: np.ndarray) -> np.ndarray:
    """Which ``candidates`` lie inside some ``containers`` span of their own thread (a span
    lies inside itself). A span is enclosed exactly when, among the containers of its thread
    that started no later, the latest end is no earlier than its end."""
    inside = np.zeros(len(threads), dtype=bool)
    if not containers.any() or not candidates.any():
        return inside
    for thread in np.unique(threads[candidates & np.isin(threads, threads[containers])]).tolist():
        mine = np.flatnonzero(containers & (threads == thread))
        mine = mine[np.argsort(starts[mine], kind="stable")]
        latest_end = np.maximum.accumulate(ends[mine])
        rows = np.flatnonzero(candidates & (threads == thread))
        before = np.searchsorted(starts[mine], starts[rows], side="right") - 1
        inside[rows] = (before >= 0) & (latest_end[np.maximum(before, 0)] >= ends[rows])
    return inside


def nearest_marked(parents: np.ndarray, marked: np.ndarray, include_self: bool = False) -> np.ndarray:
    """Position of the nearest (proper, or with ``include_self`` also the span itself) ancestor
    for which ``marked`` is true, or -1."""
    climb = np.where(marked, NONE, parents)
    end = chain_ends(climb)
    start = np.arange(len(parents)) if include_self else parents
    found = end[np.maximum(start, 0)]
    return np.where((start >= 0) & marked[found], found, NONE)


def nearest_ancestor(spans: pd.DataFrame, matches: np.ndarray, parents: np.ndarray | None = None,
                     include_self: bool = False) -> np.ndarray:
    """Position of the nearest ancestor for which ``matches`` is true, or -1.

    Args:
        spans: a span table.
        matches: boolean per row: which spans count as the ancestor wanted.
        parents: :func:`parent_positions` of ``spans``, if already computed.
        include_self: a matching span is its own answer.
    """
    parents = parent_positions(spans) if parents is None else parents
    return nearest_marked(parents, np.asarray(matches, dtype=bool), include_self)


def of_level(spans: pd.DataFrame, level: Level) -> np.ndarray:
    return (spans[col.LEVEL] == level.value).to_numpy()


def union_length(starts: np.ndarray, ends: np.ndarray) -> int:
    """Total length covered by the intervals (overlaps counted once)."""
    if len(starts) == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    gaps = np.maximum(starts[1:] - ends[:-1], 0)
    return int(ends[-1] - starts[0] - gaps.sum())


STUCK_AFTER_ROUNDS: Final = 32
"""Pointer-jumping rounds after which the few positions still unresolved are searched for directly."""


def position_type(count: int) -> type[np.signedinteger[Any]]:
    """The integer type for positions among ``count`` rows: int32 where they fit (at millions of
    rows, half the memory of int64)."""
    return np.int32 if count < np.iinfo(np.int32).max else np.int64


def nearest_before(values: np.ndarray, strict: bool) -> np.ndarray:
    """For each position, the nearest earlier position whose value is >= its own (``> `` when
    ``strict``), or -1 (int32 where the positions fit): the classic stack walk, done for all
    positions at once by pointer jumping.

    Each pointer starts at the position before; while the value it points at is too small, it
    jumps to that position's own pointer (everything skipped is smaller still). Every round
    shortens the chains, so the rounds are usually few (about the nesting depth). A position whose
    answer lies past a long run of falling values walks that run two positions a round, though (a
    CPU-only trace of 1M spans took 333,000 rounds, 2.4 s): after :data:`STUCK_AFTER_ROUNDS`
    rounds, when few positions are left, each is searched for directly, backwards in growing
    windows from where its pointer stopped.
    """
    count = len(values)
    positions = position_type(count)
    pointer = np.arange(-1, count - 1, dtype=positions)
    # a position past every earlier value has no answer: settled at once (spans one after another,
    # a service's requests, would otherwise each walk back through all the earlier ones)
    earlier_max = np.maximum.accumulate(values[:-1])
    past_all = values[1:] >= earlier_max if strict else values[1:] > earlier_max
    pointer[1:][past_all] = NONE
    active = (np.flatnonzero(~past_all) + 1).astype(positions, copy=False)
    del earlier_max, past_all
    rounds = 0
    few = max(256, count >> 10)
    while len(active):
        rounds += 1
        if rounds > STUCK_AFTER_ROUNDS and len(active) <= few:
            for position in active.tolist():
                pointer[position] = _search_back(values, int(pointer[position]) + 1, values[position], strict)
            break
        target = pointer[active]
        mine = values[active]
        too_small = values[target] <= mine if strict else values[target] < mine
        active = active[too_small]
        target = pointer[pointer[active]]
        pointer[active] = target
        active = active[target >= 0]
    return pointer


def _search_back(values: np.ndarray, stop: int, value: Any, strict: bool) -> int:
    """The last position before ``stop`` whose value is >= ``value`` (> when ``strict``), or -1."""
    window = 1024
    while stop > 0:
        begin = max(0, stop - window)
        chunk = values[begin:stop]
        hits = np.flatnonzero(chunk > value if strict else chunk >= value)
        if len(hits):
            return begin + int(hits[-1])
        stop, window = begin, window * 2
    return -1
