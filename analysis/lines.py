"""Where in my code: time by the line of the user's program that made each call.

A model call, a layer call, a user span (``xsp.span``, ``xsp.step``), an input wait (the loop's
``for`` line), a backward pass and an optimizer step carry the line of the user's code that
made it (``call_file``, ``call_line``, ``call_function``: the first frame outside torch, xsp and
other libraries; see :mod:`xsp.record.sites`). A span without a line of its own
(an operator, a CUDA API call, a kernel through its launch) takes the line of the nearest span
above it that has one: a kernel is the line's that called the layer that launched it.

A line's time is then counted the way a profiler of a call stack counts a function's:

* **inclusive**: the time of the outermost spans of that line (a layer called inside
  ``nn.Sequential`` has the line that called the ``Sequential``: it is inside it, not beside
  it, and is counted once);
* **self**: the host time of the line's spans not spent in spans of another line (a layer whose
  ``forward`` is the user's own code hands the time of the calls it makes to their lines).

Nesting is taken from the spans' intervals on each thread (and a kernel's launch), not from
the stored tree, in which each step is a root: a ``with xsp.span(...)`` around a model call
holds that call. Self times of all lines add up to the host time spent under a line, once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import pandas as pd

from xsp.analysis.compiled import compiled_keys
from xsp.analysis.model import spans_of, step_roots
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.record.compiled_kernels import Frame, kernel_sources
from xsp.table.parents import infer_parent_positions
from xsp.table.self_time import self_ns
from xsp.table.walks import category_values, nearest_ancestor, nearest_marked, parent_positions, ranges

Site = tuple[str, float, str]
"""A line as the table groups them: file, line number, function."""
LINE_COLUMNS = ["file", "line", "function", "calls", "self_ms", "inclusive_ms", "kernel_ms", "share",
                "self_share", "threads"]


def _empty() -> pd.DataFrame:
    frame = pd.DataFrame({name: pd.Series(dtype=object if name in ("file", "function") else np.float64)
                          for name in LINE_COLUMNS})
    return frame.astype({"line": "Int64", "calls": np.int64, "threads": np.int64})


def line_of_each_span(spans: pd.DataFrame, parents: np.ndarray | None = None) -> np.ndarray:
    """For each span, the position of the span whose line it is counted on: itself when it
    has a line, else the nearest span above it that has one (-1: none). What runs inside a
    ``compile`` span is the compiler's work, whatever frames it ran in (the functions PyTorch
    makes with ``exec``, ``<string>``): it is counted on the line that made the compiled call."""
    if col.CALL_LINE not in spans:
        return np.full(len(spans), -1, dtype=np.int64)
    has_line = (spans[col.CALL_FILE].notna() & spans[col.CALL_LINE].notna()).to_numpy()
    compiling = (spans[col.KIND] == SpanKind.COMPILE.value).to_numpy() if col.KIND in spans else None
    if compiling is not None and compiling.any():
        parents = parent_positions(spans) if parents is None else parents
        has_line = has_line & (nearest_ancestor(spans, compiling, parents) < 0)
    return nearest_ancestor(spans, has_line, parents, include_self=True)


def line_keys(spans: pd.DataFrame, parents: np.ndarray,
              shown_files: Callable[[Iterable[object]], Mapping[object, str]] | None = None) -> pd.Series:
    """Per span, ``"file:line function"`` where it is the outermost span of its line (it has a
    line, and the nearest span above it with a line has another one), else None: what
    ``xsp diff --by line`` compares. The file is given relative to the folder that holds every
    file of the run's lines, so two checkouts of one project in different places match
    (``shown_files``: how the files are shown instead, given them all; the default is
    :func:`relative_files`)."""
    keys = pd.Series(np.full(len(spans), None, dtype=object), index=spans.index)
    if col.CALL_LINE not in spans or spans.empty:
        return keys
    owner = line_of_each_span(spans, parents)
    has_line = owner == np.arange(len(spans))
    if not has_line.any():
        return keys
    files, functions = texts(spans, col.CALL_FILE), texts(spans, col.CALL_FUNCTION)
    numbers = spans[col.CALL_LINE].astype("Int64").to_numpy(dtype=np.float64, na_value=np.nan)
    above = np.where(parents >= 0, owner[np.maximum(parents, 0)], -1)
    rows = np.flatnonzero(has_line)
    outer = rows[(above[rows] < 0) | (files[np.maximum(above[rows], 0)] != files[rows])
                 | (numbers[np.maximum(above[rows], 0)] != numbers[rows])]
    shown = (relative_files if shown_files is None else shown_files)(files[rows])
    text = [line_label(shown[files[i]], int(numbers[i]), functions[i]) for i in outer]
    values = np.full(len(spans), None, dtype=object)
    values[outer] = text
    return pd.Series(values, index=spans.index, dtype=object)


def texts(spans: pd.DataFrame, column: str) -> np.ndarray:
    """A text column of few distinct values (files, functions) as objects, None where missing
    (never pandas' NA, which refuses comparisons), or all None without the column."""
    return category_values(spans[column]) if column in spans else np.full(len(spans), None, dtype=object)


def line_label(shown_file: str, line: int, function: object) -> str:
    """``train.py:42 Net.forward``: a line as keys and frames name it."""
    return f"{shown_file}:{line}" + (f" {function}" if isinstance(function, str) and function else "")


def relative_files(files: Iterable[object]) -> dict[object, str]:
    """Each distinct file relative to the folder that holds all of them (the file name alone
    when they share their folder); names such as ``<stdin>``, and paths that share no folder
    (relative and absolute ones together), as they are."""
    distinct = set(files)
    real = sorted(f for f in distinct if isinstance(f, str) and not f.startswith("<"))
    shown = {f: str(f) for f in distinct}
    try:
        common = os.path.commonpath([os.path.dirname(f) for f in real]) if real else ""
    except ValueError:
        return shown
    if common:
        shown.update({f: os.path.relpath(f, common) for f in real})
    return shown


def lines(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per line of the user's code that made a recorded call, hottest (self time) first.

    Columns: ``file``, ``line``, ``function`` (the code's qualified name, ``Net.forward``),
    ``calls`` (the line's outermost spans: how many calls it made), ``self_ms`` (host time of
    the line's spans not spent under another line), ``inclusive_ms`` (time of its outermost
    spans), ``kernel_ms`` (GPU kernel time launched under the line; 0 without the kernel
    level), ``share`` (the part of ``inclusive_ms`` inside steps, over the steps' time; NaN
    without steps), ``self_share`` (the same of ``self_ms``), ``threads`` (threads it ran on).
    Time outside every step (building the model, loading data before the loop) counts in the
    milliseconds, never in the shares: a share is of the steps, so they add up to at most 1.
    """
    spans = spans_of(source)
    if spans.empty or col.CALL_LINE not in spans:
        return _empty()
    # nesting as it ran on each thread: a step is a root of the stored tree, but a user span
    # around a model call, on the line that called it, holds it
    parents, _ = infer_parent_positions(spans)
    owner = line_of_each_span(spans, parents)
    fused, fused_codes, fused_sites = compiled_kernel_lines(
        spans, kernel_sources(source.metadata) if isinstance(source, Trace) else {}, inside=True)
    if not (owner >= 0).any() and not len(fused):
        return _empty()
    files, functions = texts(spans, col.CALL_FILE), texts(spans, col.CALL_FUNCTION)
    numbers = spans[col.CALL_LINE].astype("Int64").to_numpy(dtype=np.float64, na_value=np.nan)
    fused_rows = np.unique(fused)
    owned = np.setdiff1d(np.flatnonzero(owner >= 0), fused_rows)
    # a compiled kernel is counted on the lines of the operators it fuses, a share each (see lines())
    shares = fused_shares(fused, len(spans))
    rows = np.concatenate([owned, fused])
    weights = np.concatenate([np.ones(len(owned)), shares])
    fused_files, fused_numbers, fused_functions = (np.array([site[i] for site in fused_sites], dtype=dtype)[fused_codes]
                                                   for i, dtype in enumerate((object, np.float64, object)))
    sites = pd.MultiIndex.from_arrays([
        np.concatenate([files[owner[owned]], fused_files]),
        np.concatenate([numbers[owner[owned]], fused_numbers]),
        np.concatenate([pd.Series(functions[owner[owned]]).fillna("").to_numpy(dtype=object), fused_functions])])
    codes, keys = pd.factorize(sites)
    line = np.full(len(spans), -1, dtype=np.int64)
    line[owned] = codes[:len(owned)]
    line[fused_rows] = -2  # on lines of their own, below; never the line of a span under them
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    on_gpu = levels == Level.KERNEL.value
    host = ~on_gpu
    own_time = self_ns(spans, host, parents)
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    parent_line = np.where(parents >= 0, line[np.maximum(parents, 0)], -1)
    is_kernel = on_gpu & (spans[col.KIND] == SpanKind.KERNEL.value).to_numpy()
    outermost = host[rows] & (parent_line[rows] != line[rows])  # (a placed span under a placed one is inside it)
    kernels = is_kernel[rows]
    counted = host[rows]
    count = len(keys)
    self_total = np.bincount(codes[counted], weights=(own_time[rows] * weights)[counted], minlength=count)
    inclusive = np.bincount(codes[outermost], weights=(durations[rows] * weights)[outermost], minlength=count)
    calls = np.bincount(codes[outermost], minlength=count)
    kernel_total = np.bincount(codes[kernels], weights=(durations[rows] * weights)[kernels], minlength=count)
    threads = pd.Series(spans[col.THREAD_ID].to_numpy()[rows][counted]).groupby(codes[counted], observed=True).nunique()
    in_steps = spans[col.STEP].notna().to_numpy(dtype=bool)[rows] if col.STEP in spans else np.zeros(len(rows), bool)
    self_in_steps = np.bincount(codes[counted & in_steps], weights=(own_time[rows] * weights)[counted & in_steps],
                                minlength=count)
    inclusive_in_steps = np.bincount(codes[outermost & in_steps],
                                     weights=(durations[rows] * weights)[outermost & in_steps], minlength=count)
    step_ns = float(step_roots(spans)[col.DURATION_NS].sum())
    file_of, number_of, function_of = (keys.get_level_values(i) for i in range(3))
    table = pd.DataFrame({
        "file": np.asarray(file_of, dtype=object), "line": pd.array(np.asarray(number_of), dtype="Int64"),
        "function": pd.Series(np.asarray(function_of, dtype=object)).replace("", None).to_numpy(dtype=object),
        "calls": calls.astype(np.int64), "self_ms": self_total / 1e6, "inclusive_ms": inclusive / 1e6,
        "kernel_ms": kernel_total / 1e6,
        "share": inclusive_in_steps / step_ns if step_ns else np.full(count, np.nan),
        "self_share": self_in_steps / step_ns if step_ns else np.full(count, np.nan),
        "threads": threads.reindex(range(count), fill_value=0).to_numpy(dtype=np.int64),
    })
    return table.sort_values(["self_ms", "inclusive_ms"], ascending=False, kind="stable").reset_index(drop=True)


def compiled_kernel_lines(spans: pd.DataFrame, sources: dict[str, list[list[Frame]]], inside: bool = False
                          ) -> tuple[np.ndarray, np.ndarray, list[Site]]:
    """The spans of kernels that ``torch.compile`` generated, and the lines they are counted on:
    positions (a span once per line of its own), each one's line as a position in the list of
    distinct lines, and that list (file, line, function). A kernel's lines are those of the
    operators it fuses (inductor's provenance, kept in the trace's metadata:
    :func:`xsp.record.compiled_kernels.kernel_sources`)."""
    nothing = np.zeros(0, dtype=np.int64)
    if not sources or col.NAME not in spans or spans.empty:
        return nothing, nothing, []
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    candidates = np.flatnonzero((levels == Level.OPERATOR.value) | (levels == Level.KERNEL.value))
    parents = parent_positions(spans)
    name_codes, names = compiled_keys(spans, candidates, parents)
    distinct: dict[Site, int] = {}
    lines_of_name = []  # per distinct key: its kernel's lines, as positions in ``distinct``
    for name in names:
        chains = sources.get(name, []) if isinstance(name, str) else []
        sites = dict.fromkeys((chain[-1][0], float(chain[-1][1]), chain[-1][2]) for chain in chains)
        lines_of_name.append([distinct.setdefault(site, len(distinct)) for site in sites])
    counts = np.array([len(found) for found in lines_of_name], dtype=np.int64)
    if not len(name_codes) or not counts.any():
        return nothing, nothing, []
    # each matched span's lines, in span order, read from all names' lines one after the other
    flat = np.array([code for found in lines_of_name for code in found], dtype=np.int64)
    first = np.cumsum(counts) - counts
    positions = np.repeat(candidates, counts[name_codes])
    site_codes = flat[ranges(first[name_codes], counts[name_codes])]
    if inside:
        positions, site_codes = _with_spans_inside(positions, site_codes, parents)
    return positions, site_codes, list(distinct)


def _with_spans_inside(positions: np.ndarray, site_codes: np.ndarray, parents: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The placements (span positions, sorted, and their lines) with each span under a placed
    one placed on the lines of its nearest placed ancestor."""
    placed = np.zeros(len(parents), dtype=bool)
    placed[positions] = True
    ancestor = nearest_marked(parents, placed)
    inner = np.flatnonzero((ancestor >= 0) & ~placed)
    if not len(inner):
        return positions, site_codes
    per_span = np.bincount(positions, minlength=len(parents))
    first = np.cumsum(per_span) - per_span  # where each span's placements begin
    counts = per_span[ancestor[inner]]
    return (np.concatenate([positions, np.repeat(inner, counts)]),
            np.concatenate([site_codes, site_codes[ranges(first[ancestor[inner]], counts)]]))


def fused_shares(positions: np.ndarray, count: int) -> np.ndarray:
    """Each of :func:`compiled_kernel_lines`'s placements' share of its kernel span's time (of
    ``count`` spans): equal, one over the kernel's lines."""
    return 1.0 / np.bincount(positions, minlength=count)[positions] if len(positions) else np.zeros(0)


def fused_line_rows(spans: pd.DataFrame, sources: dict[str, list[list[Frame]]]) -> pd.DataFrame:
    """Rows that put the time of each kernel ``torch.compile`` generated on the lines of the
    operators it fuses, for comparisons by line (``xsp diff --by line``): per kernel span and per
    line of it, an operator row on that line, a child of the kernel span, holding its share of
    the kernel's time (equal shares, as :func:`lines` counts them), at the kernel's start, in its
    step. Empty where the trace has no compiled kernel with a known source."""
    positions, codes, sites = compiled_kernel_lines(spans, sources)
    if not len(positions):
        return spans.iloc[0:0]
    shares = fused_shares(positions, len(spans))
    rows = spans.iloc[positions].reset_index(drop=True)
    durations = np.rint(rows[col.DURATION_NS].to_numpy(dtype=np.float64) * shares).astype(np.int64)
    first_id = int(spans[col.SPAN_ID].max()) + 1 if len(spans) else 1
    rows[col.PARENT_ID] = pd.array(spans[col.SPAN_ID].to_numpy(dtype=np.int64)[positions], dtype="Int64")
    rows[col.SPAN_ID] = np.arange(first_id, first_id + len(rows), dtype=np.int64)
    rows[col.DURATION_NS] = durations
    rows[col.END_NS] = rows[col.START_NS].to_numpy(dtype=np.int64) + durations
    rows[col.LEVEL] = Level.OPERATOR.value
    rows[col.KIND] = SpanKind.OPERATOR.value
    rows[col.CALL_FILE] = [sites[code][0] for code in codes]
    rows[col.CALL_LINE] = pd.array([int(sites[code][1]) for code in codes], dtype="Int64")
    rows[col.CALL_FUNCTION] = [sites[code][2] for code in codes]
    return rows


__all__ = ["compiled_kernel_lines", "fused_line_rows", "fused_shares", "lines", "line_of_each_span", "line_keys",
           "line_label", "relative_files", "texts", "LINE_COLUMNS"]
