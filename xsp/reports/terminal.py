"""The terminal report: rich tables of the analyses that apply to a trace."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from xsp import analysis
from xsp.analysis.gpu import replay_sums, replay_table_of
from xsp.analysis.layers import TopLevelLayers, step_time_ms, top_level_layers
from xsp.analysis.lines import compiled_kernel_lines, relative_files
from xsp.analysis.model import OutsideSteps, outside_steps, within_steps
from xsp.analysis.roofline import GpuPeak, trace_peak
from xsp.analysis.windowed import WindowedReport
from xsp.core import contention
from xsp.core import schema as col
from xsp.core.figures import counted, milliseconds
from xsp.core.safe_text import one_line
from xsp.core.schema import Level, SpanKind, Status
from xsp.io.kineto_json import IGNORED_WITHOUT_LOSS
from xsp.io.loading import EMPTY_RANKS, RANKS_APART
from xsp.io.trace import Trace
from xsp.record.compiled_kernels import kernel_layers, kernel_sources, stale_traces
from xsp.record.sampling import DEEP_REASONS
from xsp.reports.advice import recommendation_lines
from xsp.reports.source import line_text
from xsp.session.rotation import leveled_by_model
from xsp.table.sampling import deep_roots, step_roots

STEPS_SHOWN = 20
RANKS_SHOWN = 16
"""A job's per-rank table shows at most this many ranks: the latest."""
Format = Callable[[object], str]


MISSING = "-"
"""How a cell with no value reads."""


def missing(value: object) -> bool:
    """Whether a cell has no value: None, pandas' NA or NaN."""
    return value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value))


def number(digits: int = 3) -> Format:
    def render(value: object) -> str:
        if missing(value):
            return MISSING
        return f"{float(value):,.{digits}f}"  # type: ignore[arg-type]
    return render


def time_unit(*columns_us: pd.Series) -> tuple[float, str, Format]:
    """The unit a table's microsecond figures read best in, chosen by the largest of them (µs
    below 10 ms, ms below 10,000 s, else s): its divisor, its name for the headings, and the
    format of a figure in it."""
    largest = max((float(column.max()) for column in columns_us if len(column)), default=0.0)
    if largest < 1e4:
        return 1.0, "us", number(1)
    if largest < 1e10:
        return 1e3, "ms", number(3)
    return 1e6, "s", number(3)


def in_time_unit(frame: pd.DataFrame, columns_us: Sequence[str]) -> tuple[pd.DataFrame, str, Format]:
    """``frame`` with its microsecond ``columns_us`` in the unit :func:`time_unit` chooses for
    them (same names), that unit's name, and the format of a figure in it."""
    scale, unit, figure = time_unit(*(frame[name] for name in columns_us))
    return frame.assign(**{name: frame[name] / scale for name in columns_us}), unit, figure


CI_HEADING: Final = "95% CI"
"""The heading of a column of 95% intervals' half-widths, each as a share of its figure (±6.6%)."""


def plus_minus_share(value: object) -> str:
    """A 95% interval's half-width as a share of its figure: ``±6.6%``."""
    return MISSING if missing(value) else f"±{share(value)}"


def yes_no(value: object) -> str:
    """A flag as a reader says it: ``yes`` or blank (unknown: ``-``)."""
    if missing(value):
        return MISSING
    return "yes" if bool(value) else ""


def share(value: object) -> str:
    if missing(value):
        return MISSING
    return f"{100 * float(value):.1f}%"  # type: ignore[arg-type]


def text(value: object) -> str:
    """A cell's text: on one line, with no control character a terminal would act on."""
    if missing(value):
        return MISSING
    return one_line(str(value))


def display_width(value: str) -> int:
    """How many terminal columns ``value`` takes: two for each wide character (CJK, most emoji)."""
    return cell_len(value)


def head_cells(value: str, room: int) -> str:
    """The longest start of ``value`` that fits ``room`` terminal columns."""
    taken = 0
    for at, char in enumerate(value):
        taken += cell_len(char)
        if taken > room:
            return value[:at]
    return value


def tail_cells(value: str, room: int) -> str:
    """The longest end of ``value`` that fits ``room`` terminal columns."""
    return head_cells(value[::-1], room)[::-1]


def middle(value: str, limit: int) -> str:
    """``value`` shortened to ``limit`` terminal columns by replacing its middle with "…" (the start
    and the end of a layer path or kernel name say the most)."""
    if display_width(value) <= limit:
        return value
    if limit <= 1:
        return "…"[:limit]
    head = (limit - 1 + 1) // 2
    return head_cells(value, head) + "…" + tail_cells(value, limit - 1 - head)


PATH_SEPARATORS: Final = "./"
"""What separates the parts of a layer path (``model.encoder.layers.0``) or a diff key (``model[0]/conv[0]``)."""


def is_path(value: str) -> bool:
    """Whether ``value`` reads as a path of parts (a layer's, a diff key), not a kernel or operator
    signature (spaces, brackets of arguments or templates)."""
    return any(separator in value for separator in PATH_SEPARATORS) and not any(
        char.isspace() or char in "(<," for char in value)


def path_tail(value: str, room: int) -> str:
    """The longest end of ``value`` made of whole parts that fits ``room`` characters ("" where
    not even its last part does)."""
    for at, char in enumerate(value):
        if char in PATH_SEPARATORS and display_width(value[at + 1:]) <= room:
            return value[at + 1:]
    return ""


def shorten(value: str, limit: int, head: int = 0) -> str:
    """``value`` in at most ``limit`` characters: a path keeps its last parts whole after "…"
    (``…stages.3.layers.0.convolution``), with its first ``head`` characters before it; any other
    name, and a path whose last part alone is too long, loses its middle (:func:`middle`)."""
    if display_width(value) <= limit:
        return value
    if limit <= 1:
        return "…"[:limit]
    head = min(max(head, 0), limit - 2)
    if is_path(value):
        tail = path_tail(value, limit - 1 - head)
        if tail:
            return head_cells(value, head) + "…" + tail
    if not head:
        return middle(value, limit)
    return head_cells(value, head) + "…" + tail_cells(value, limit - 1 - head)


def short(limit: int) -> Format:
    def render(value: object) -> str:
        return shorten(text(value), limit)
    return render


MIN_TEXT_WIDTH = 12
"""A text column is never shortened below this many characters."""
WIDTH = 80
"""Tables fit this many columns unless the console is wider (a terminal wraps nothing)."""


COLUMN_GAP = 2
"""Spaces between two columns (the tables have no vertical rules)."""


MIN_NUMBER_WIDTH = 4
"""A number column's heading may wrap inside a word down to this many characters."""
LAST_TEXT_WIDTH = 4
"""When numbers still do not fit, text columns give up characters down to this many."""


def _shrink(widths: list[int], columns: list[int], floors: list[int], excess: int) -> int:
    """Take up to ``excess`` characters from ``columns``, the widest first, none below its floor;
    returns what is still in excess."""
    while excess > 0:
        shrinkable = [i for i in columns if widths[i] > floors[i]]
        if not shrinkable:
            break
        widest = max(shrinkable, key=widths.__getitem__)
        second = max((widths[i] for i in shrinkable if i != widest), default=floors[widest])
        target = max(floors[widest], min(second, widths[widest] - 1), widths[widest] - excess)
        excess -= widths[widest] - target
        widths[widest] = target
    return excess


def _fit(rows: list[list[str]], headings: list[str], numeric: list[bool], width: int) -> list[int]:
    """Column widths that fit ``width`` while every column stays: text columns give up characters
    (the widest first) down to ``MIN_TEXT_WIDTH``; then number headings wrap inside words (a
    number itself is never cut); then text goes down to ``LAST_TEXT_WIDTH``."""
    values = [max((display_width(row[i]) for row in rows), default=0) for i in range(len(headings))]
    widths = [max(found, *(len(word) for word in heading.split())) for found, heading in zip(values, headings)]
    widths = [found if is_number else max(found, min(len(heading), MIN_TEXT_WIDTH))
              for found, heading, is_number in zip(widths, headings, numeric)]
    excess = sum(widths) - (width - COLUMN_GAP * (len(headings) - 1))
    text_columns = [i for i, is_number in enumerate(numeric) if not is_number]
    number_columns = [i for i, is_number in enumerate(numeric) if is_number]
    excess = _shrink(widths, text_columns, [min(w, MIN_TEXT_WIDTH) for w in widths], excess)
    excess = _shrink(widths, number_columns, [min(w, max(v, MIN_NUMBER_WIDTH)) for w, v in zip(widths, values)],
                     excess)
    _shrink(widths, text_columns, [min(w, LAST_TEXT_WIDTH) for w in widths], excess)
    return widths


PATH_PART: Final = re.compile(r"[./]")
"""Splits a layer path or diff key into its parts."""


def distinct_middles(values: Sequence[str], limit: int) -> dict[str, str]:
    """Each of ``values`` shortened to ``limit`` characters (see :func:`shorten`: a path keeps its
    last parts whole) such that different values stay different: where two would read the same,
    the shortest start that tells them apart is kept before the "…", and failing that they are
    numbered."""
    shortened = {value: shorten(value, limit) for value in dict.fromkeys(values)}
    if len(set(shortened.values())) == len(shortened):
        return shortened
    by_text: dict[str, list[str]] = {}
    for value, text_ in shortened.items():
        by_text.setdefault(text_, []).append(value)
    for group in (group for group in by_text.values() if len(group) > 1):
        for head in range(1, max(limit - 1, 1)):
            tails = {value: shorten(value, limit, head) for value in group}
            # a start kept before the "…" never leaves a path without its last part whole (a long
            # start read "model.resnet.encoder.stages.0…n"): the number below says more then
            if len(set(tails.values())) == len(group) and all(
                    not is_path(value) or tails[value].endswith(PATH_PART.split(value)[-1]) for value in group):
                shortened.update(tails)
                break
    # what still reads alike keeps, before its end, the parts where it differs from the others
    # ("…stages.3…layer.1.convolution"): siblings of a deep model differ far from both ends
    counts = Counter(shortened.values())
    alike = [value for value, text_ in shortened.items() if counts[text_] > 1]
    if alike:
        groups: dict[str, list[str]] = {}
        for value in alike:
            groups.setdefault(shortened[value], []).append(value)
        windowed = {value: with_difference(value, groups[shortened[value]], limit) for value in alike}
        taken = Counter(text_ for value, text_ in shortened.items() if value not in windowed)
        taken.update(text_ for text_ in windowed.values() if text_ is not None)
        shortened.update({value: text_ for value, text_ in windowed.items() if text_ is not None and taken[text_] == 1})
    # what still reads alike (a group no start told apart, or a start kept above that equals
    # another name's shortening) is numbered, each name its own number in this table
    counts = Counter(shortened.values())
    alike = [value for value, text_ in shortened.items() if counts[text_] > 1]
    for number_, value in enumerate(alike, 1):
        mark = f"#{number_}"
        shortened[value] = shorten(value, max(limit - len(mark), 1)) + mark
    return shortened


def with_difference(value: str, others: Sequence[str], limit: int) -> str | None:
    """``value``, a path, in at most ``limit`` characters as "…" + the part where it first
    differs from the nearest of ``others`` (with the part before it: ``stages.3``) + "…" + its
    last parts whole; None where that does not fit or ``value`` is no path."""
    if not is_path(value):
        return None
    tokens = re.split(f"({PATH_PART.pattern})", value)  # parts at even places, their separators between
    parts = tokens[::2]
    differ = 0
    for other in others:
        if other == value or not is_path(other):
            continue
        theirs = PATH_PART.split(other)
        same = next((at for at, (mine, their) in enumerate(zip(parts, theirs)) if mine != their),
                    min(len(parts), len(theirs)))
        differ = max(differ, same)  # past the parts it shares with the nearest
    if differ >= len(parts) - 1:
        return None  # it differs in its last part: the end already tells it apart
    first = max(differ - 1, 0)
    window = "".join(tokens[2 * first:2 * differ + 1])
    for start in range(differ + 1, len(parts)):
        tail = "".join(tokens[2 * start:])
        joined = window + tokens[2 * start - 1] + tail if start == differ + 1 else window + "…" + tail
        text_ = ("" if first == 0 else "…") + joined
        if display_width(text_) <= limit:
            return text_
    return None


def frame_table(frame: pd.DataFrame, title: str, columns: Sequence[tuple[str, str, Format]],
                width: int = WIDTH) -> Table:
    """A rich table of ``frame``: (column, heading, formatter) per shown column, fitted to
    ``width``: long text is shortened in the middle, so no row wraps onto a second line."""
    numeric = [pd.api.types.is_numeric_dtype(frame[name]) if name in frame else False for name, _, _ in columns]
    cells = [[render(values[name]) for name, _, render in columns]
             for values in (row._asdict() for row in frame.itertuples(index=False))]
    headings = [heading for _, heading, _ in columns]
    widths = _fit(cells, headings, numeric, width)
    table = Table(title=title or None, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    for heading, is_number, column_width in zip(headings, numeric, widths):
        label = "\n".join(textwrap.wrap(heading, column_width)) or heading
        table.add_column(label, justify="right" if is_number else "left", no_wrap=True, overflow="ellipsis",
                         min_width=column_width, max_width=column_width)
    shown = [None if is_number else distinct_middles([one_line(row[i]) for row in cells], column_width)
             for i, (is_number, column_width) in enumerate(zip(numeric, widths))]
    for row in cells:  # Text: a name such as "[param|cuda]" is not rich markup
        table.add_row(*(Text(one_line(value) if names is None else names[one_line(value)])
                        for value, names in zip(row, shown)))
    return table


def _show(console: Console, frame: pd.DataFrame, title: str, columns: Sequence[tuple[str, str, Format]]) -> None:
    _say(console, title, "bold")  # above the table: a table's title wraps at the table's width
    console.print(frame_table(frame, "", columns, width=console.width))


def _say(console: Console, line: str, style: str | None = None) -> None:
    """A line of prose, wrapped at the console's width with an indented continuation."""
    line = one_line(line)  # names from the trace: no escape sequence reaches the terminal
    for part in textwrap.wrap(line, width=console.width, subsequent_indent="  ", break_on_hyphens=False) or [""]:
        console.print(Text(part, style=style or ""), no_wrap=True, overflow="ellipsis")


def _header(trace: Trace, console: Console) -> None:
    levels = {str(level): int(count) for level, count in trace.spans[col.LEVEL].value_counts().items() if count}
    _header_of(trace.metadata, levels, len(trace.spans), len(trace.steps), console)


_LEVEL_ORDER: Final = {level.value: place for place, level in enumerate(Level)}


def _most_first(levels: dict[str, int]) -> list[tuple[str, int]]:
    """Levels by their spans, most first; equal counts in the levels' order, model first."""
    return sorted(levels.items(), key=lambda item: (-item[1], _LEVEL_ORDER.get(item[0], len(_LEVEL_ORDER)), item[0]))


def _header_of(meta: dict[str, object], levels: dict[str, int], spans: int, steps: int, console: Console) -> None:
    """The report's first lines: what ran where, the spans per level, the steps."""
    console.print(Text("xsp report", style="bold"), no_wrap=True)
    _say(console, f"service={meta.get('service_name', '?')}  device={meta.get('device', '?')}  "
                  f"torch={meta.get('torch_version', '?')}")
    if meta.get("imported_from"):
        _say(console, "imported from " + middle(str(meta["imported_from"]), console.width - 16))
        counts = meta.get("not_imported")
        left_out = {what: count for what, count in (counts.items() if isinstance(counts, dict) else ())
                    if what not in IGNORED_WITHOUT_LOSS}
        if left_out:  # a profiler's memory events among them: the memory analyses have none
            _say(console, "not imported from the file: " + ", ".join(
                f"{count:,} {what.removeprefix('ignored ')}" if isinstance(count, int) else f"{count} {what}"
                for what, count in left_out.items())
                + " (metadata 'not_imported')", "yellow")
    recorded = meta.get("levels")
    _say(console, f"{spans:,} spans ({', '.join(f'{k} {v:,}' for k, v in _most_first(levels))}), "
                  f"{counted(steps, 'step')}, levels recorded: "
                  f"{', '.join(map(str, recorded)) if isinstance(recorded, list) else ''}")
    unavailable = meta.get("unavailable")
    for level, reason in (unavailable.items() if isinstance(unavailable, dict) else []):
        _say(console, f"level {level} not recorded: {reason}", "yellow")
    dropped = meta.get("dropped")
    if isinstance(dropped, dict) and dropped:
        counts = (f"{v:,} {k}" if isinstance(v, int) else f"{v} {k}" for k, v in dropped.items())
        _say(console, f"dropped: {', '.join(counts)}", "yellow")
    for line in recovered_lines(meta):
        _say(console, line, "yellow")
    busy = busy_machine_line(meta)
    if busy is not None:
        _say(console, busy, "yellow")
    export = export_line(meta)
    if export is not None:
        _say(console, export, "yellow")


RECOVERED_SIGNS: Final = ("recovered from ", "written by xsp recover", " are read from the windows beside ")
"""How the warnings a recovery (or a read of a run's windows) leaves in the metadata begin or say
(:mod:`xsp.io.segments`, :mod:`xsp.io.loading`)."""


def recovered_lines(meta: dict[str, object]) -> list[str]:
    """That the trace was recovered from a killed run's windows, or holds windows not yet in a
    part, and what that leaves out: its metadata's warnings that say so."""
    warnings = meta.get("warnings")
    if not meta.get("recovered") or not isinstance(warnings, list):
        return []
    return [str(warning) for warning in warnings if any(sign in str(warning) for sign in RECOVERED_SIGNS)]


def export_line(meta: dict[str, object]) -> str | None:
    """What the run's export to a collector failed to send (``metadata["export"]``), in a line;
    None where it sent everything or sent nothing anywhere."""
    export = meta.get("export")
    if not isinstance(export, dict) or not export.get("failed"):
        return None
    failed, exported, to_send = (int(export.get(key) or 0) for key in ("failed", "exported", "to_send"))
    why = f": {export['error']}" if export.get("error") else ""
    return (f"export to {export.get('target') or 'the collector'}: {failed:,} of {max(to_send, failed + exported):,} "
            f"spans not sent{why} (this file has them all: `xsp push` sends them)")


def _latency_tables(trace: Trace, console: Console) -> None:
    latency = analysis.model_latency(trace)
    if latency.empty:
        console.print("no steps in this trace (no top-level model call, xsp.step() or ProfilerStep)")
        return
    summary = analysis.model_summary(trace)
    failed = int(summary["failed"].sum())
    columns: list[tuple[str, str, Format]] = [("name", "step name", text), ("steps", "steps", number(0))]
    if failed:
        columns.append(("failed", "failed", number(0)))
    columns += [("mean_ms", "mean", number()), ("p50_ms", "p50", number()), ("p90_ms", "p90", number()),
                ("p99_ms", "p99", number()), ("trimmed_mean_ms", "trimmed mean", number()),
                ("throughput_per_s", "items/s", number(1))]
    _show(console, summary, "Model latency over steps (ms)" + (", completed steps only" if failed else ""), columns)
    if failed:
        errors = latency[latency["status"].astype(object) == Status.ERROR.value]["latency_ms"]
        _say(console, f"{counted(failed, 'step')} ended by an exception (status error), left out of latency and "
                      f"throughput: mean {errors.mean():,.3f} ms, {errors.sum():,.3f} ms in all", "yellow")
    many = len(latency) > STEPS_SHOWN
    shown = pd.concat([latency.head(STEPS_SHOWN // 2), latency.tail(STEPS_SHOWN // 2)]) if many else latency
    columns = [("step", "step", number(0)), ("name", "name", text), ("latency_ms", "latency ms", number())]
    if latency["compile_ms"].sum() > 0:
        columns.append(("compile_ms", "compile ms (not latency)", number()))
    columns += [("batch_size", "batch", number(0)), ("throughput_per_s", "items/s", number(1)),
                ("status", "status", text)]
    _show(console, shown, f"Latency per step ({counted(len(latency), 'step')}"
          + (f", first and last {STEPS_SHOWN // 2})" if many else ")"), columns)


def _step_tables(trace: Trace, console: Console, extent_ns: tuple[int, int] | None = None,
                 parts: pd.DataFrame | None = None) -> None:
    """What share of the session the steps cover, where the step time went, the user's spans
    (``extent_ns`` and ``parts`` as :func:`xsp.analysis.step_coverage` and
    :func:`xsp.analysis.step_summary` take them, for a trace that holds only some spans)."""
    coverage = analysis.step_coverage(trace, extent_ns).iloc[0]
    if coverage["steps"]:
        waited_ms = float(trace.metadata.get("imports_wait_ms") or 0.0)
        before = "before the first step (start-up, model construction)"
        if waited_ms >= 1 and coverage["before_ms"] >= waited_ms:  # xsp's own start, not the program's
            before = (f"before the first step (start-up, model construction; {waited_ms:,.3f} ms of it xsp's own: "
                      "the first recorded call waited for the modules xsp imports beside the program)")
        rest = ", ".join(f"{coverage[key]:,.3f} ms {where}" for key, where in (
            ("before_ms", before), ("between_ms", "between steps"),
            ("after_ms", "after the last")) if coverage[key] > 0)
        compiled = float(coverage["compile_outside_ms"])
        compiling = (f"; {compiled:,.3f} ms of the time outside the steps was torch.compile compiling"
                     if compiled >= 0.001 else "")
        _say(console, f"Steps cover {share(coverage['coverage'])} of the session "
              f"({coverage['steps_ms']:,.3f} of {coverage['session_ms']:,.3f} ms); "
              f"{coverage['outside_ms']:,.3f} ms ran outside every step" + (f": {rest}" if rest else "")
             + compiling)
        summary = analysis.step_summary(trace, parts)
        shown = [p for p in ("forward", "backward", "optimizer", "input", "compile", "other")
                 if summary[f"{p}_ms"].sum() > 0]
        columns: list[tuple[str, str, Format]] = [("name", "step name", text), ("steps", "steps", number(0)),
                                                  ("latency_ms", "mean ms", number())]
        columns += [(f"{p}_share", p, share) for p in shown]
        _show(console, summary, "Where the step time went (share of step time, all steps)", columns)
    spans = analysis.user_spans(trace, extent_ns)
    if not spans.empty:
        _show(console, spans, "Your spans (xsp.span, profiler annotations), share of the session they cover", [
            ("name", "span", text), ("count", "count", number(0)), ("total_ms", "total ms", number()),
            ("mean_ms", "mean ms", number()), ("in_steps", "in steps", number(0)), ("threads", "threads", number(0)),
            ("share", "share", share)])


WHOLE_TRACE: Final = "whole trace"
ALL_STEPS: Final = "all steps"


StepView = tuple[Trace, str]
"""What :func:`deep_steps` gives: made once per report and handed to each section that counts steps."""


def deep_steps(trace: Trace) -> StepView:
    """The spans the per-step tables count, and how a title names them: an always-on trace's
    steps recorded below the model level (the only ones with layers: shares of all steps' time
    would mean nothing); another trace's steps (what ran outside them, model construction,
    start-up, between steps, is said apart: :func:`outside_steps_line`); a trace without steps,
    whole."""
    spans = trace.spans
    if not trace.metadata.get("sampling") or col.SAMPLING not in spans:
        if not spans[col.STEP].notna().any():
            return trace, WHOLE_TRACE
        in_step = within_steps(spans)
        if in_step.all():
            return trace, ALL_STEPS
        return Trace(spans=spans[in_step].reset_index(drop=True), metadata=trace.metadata), ALL_STEPS
    roots = spans[deep_roots(spans)]
    kept = spans[spans[col.STEP].isin(roots[col.STEP]).fillna(False).to_numpy(dtype=bool)]
    return Trace(spans=kept.reset_index(drop=True), metadata=trace.metadata), f"the {counted(len(roots), 'step')} " \
        "recorded deep"


WARMUP_FACTOR: Final = 3.0
"""A first step slower than this many times the median of the others is called warm-up."""


def warmup_line(trace: Trace) -> str | None:
    """What a slow first step (warm-up: lazy initialisation, caches, kernels chosen on first
    use) does to the figures over all steps, and how to record without it; None where the first
    step is not slow, or there are fewer than 3 steps, or the trace is always on (its tables
    count the steps recorded deep), or a capture of a running process (its first step is no
    warm-up, and no schedule applies to it)."""
    if trace.metadata.get("sampling") or trace.metadata.get("leveled") or trace.metadata.get("capture"):
        return None
    latency = analysis.model_latency(trace)
    if len(latency) < 3:
        return None
    # against steps of its own kind: training steps are no warm-up beside evaluation steps 10x shorter
    names = latency["name"].astype(object)
    kind = names.iloc[0]
    alike = latency[(names == kind).to_numpy()]
    if len(alike) < 3:
        return None
    times = alike["latency_ms"].to_numpy(dtype=np.float64)
    first, rest = float(times[0]), float(np.median(times[1:]))
    if not rest > 0 or first < WARMUP_FACTOR * rest:
        return None
    mixed = len(alike) < len(latency)
    steps_word = f"{kind} steps" if mixed else "steps"

    def skipped(first: int) -> int:
        """The schedule's skip_first that leaves out the first ``first`` steps of this kind (it
        counts every step)."""
        return int(alike["step"].iloc[first - 1]) + 1 if mixed else first

    # the steps at the start that are as slow: skipping the first alone would leave the next (a
    # ResNet on a busy machine: 2,627 then 2,652 ms, then 580, 222, 40)
    slow = int(np.argmin(np.append(times, 0.0) >= WARMUP_FACTOR * rest))
    if slow > 1 and slow <= len(times) - 2:
        skip = skipped(slow)
        shown = (" and ".join(f"{ms:,.3f}" for ms in times[:slow]) if slow == 2
                 else f"{times[:slow].min():,.3f} to {times[:slow].max():,.3f}")
        others = float(np.median(times[slow:]))
        return (f"The first {slow} {steps_word} took {shown} ms, each {WARMUP_FACTOR:g}x or more the median of the "
                f"others ({others:,.3f} ms): their warm-up is in these figures. To record without it: xsp run "
                f"--schedule skip_first={skip} (or xsp.trace(schedule=\"skip_first={skip}\")), or run more steps")
    first_word = f"first {kind} step" if mixed else "first step"
    skip = skipped(1)
    return (f"The {first_word} took {first:,.3f} ms, {first / rest:.1f}x the median of the others ({rest:,.3f} ms): "
            f"its warm-up is in these figures. To record without it: xsp run --schedule skip_first={skip} (or "
            f"xsp.trace(schedule=\"skip_first={skip}\")), or run more steps")


BUSY_SHARE: Final = 0.10
"""The share of their ready time a run's threads waited for a CPU from which the report says the
machine was busy."""


def busy_machine_line(metadata: dict[str, object]) -> str | None:
    """That the machine was busy while the run recorded, from the kernel's count of the time its
    threads waited for a CPU (:mod:`xsp.core.contention`); None where they waited little, or it
    was not kept."""
    waited = contention.waited_share(metadata.get(contention.METADATA_KEY))  # type: ignore[arg-type]
    if waited is None or waited < BUSY_SHARE:
        return None
    return (f"The machine was busy: the program's threads waited for a CPU {waited:.0%} of the time they were ready "
            "to run (the kernel's count). Its times are longer than on a quiet machine, and vary more")


def _layer_tables(trace: Trace, console: Console, top: int, step_view: StepView | None = None) -> None:
    layers = trace.spans[trace.spans[col.LEVEL] == Level.LAYER.value]
    if layers.empty and not kernel_layers(trace.metadata):
        recorded = trace.metadata.get("levels")
        compiled = bool((trace.spans[col.KIND] == SpanKind.COMPILE.value).any())
        if compiled and isinstance(recorded, list) and Level.LAYER.value in recorded \
                and Level.OPERATOR.value not in recorded:
            _say(console, "No layer table: torch.compile'd code calls no module, so its layers are not seen at the "
                          "layer level; record the operator level too (--levels model,layer,operator) and each "
                          "layer gets its share of the kernels inductor made (docs/analyses.md, \"Compiled code\")",
                 "yellow")
        return
    warmup = warmup_line(trace)
    trace, which = step_view or deep_steps(trace)
    table = analysis.layer_table(trace)
    step_ms = step_time_ms(trace.spans)
    _layer_section(warmup, analysis.layer_sums(table), analysis.module_sums(table), int(table["compiled"].sum()),
                   step_ms, which, console, top)
    stale = stale_traces(trace.metadata)
    if stale:
        _say(console, f"{counted(stale, 'stack trace')} that torch.compile's cache gave its kernels named code that "
                      "is not there (a file edited since it was compiled, or another machine's): left out, so those "
                      "kernels' time stays on the layer and line that called the compiled code", "yellow")


def _layer_section(warmup: str | None, layers: pd.DataFrame, modules: pd.DataFrame, compiled_calls: int,
                   step_ms: float, which: str, console: Console, top: int) -> None:
    """The warm-up note, the top layers and the time per layer type (from
    :func:`xsp.analysis.layer_sums` and :func:`xsp.analysis.module_sums` of the steps' layers,
    ``compiled_calls`` of them in compiled code)."""
    if warmup:
        _say(console, warmup, "yellow")
    best = analysis.top_layers_of(layers, step_ms, k=top)
    if best.empty:
        return
    leveled = best["mean_ci_ms"].notna().any()  # a leveled trace: each figure with its 95% interval
    best = best.assign(mean_ci_share=best["mean_ci_ms"] / best["mean_ms"])
    # both times per call (a total beside a mean read as self larger than inclusive); the share is
    # the layer's self time over all its calls, of the steps' time
    # one kind in every row (forward, in inference) says nothing a row: its room goes to the names
    kinds = best["kind"].astype(str).unique()
    kind_column = [("kind", "kind", text)] if len(kinds) > 1 else []
    one_kind = f"; {kinds[0]}" if len(kinds) == 1 and kinds[0] != SpanKind.FORWARD.value else ""
    _show(console, best, f"Top {counted(len(best), 'layer')} by self time ({which}{one_kind}; ms per call)", [
        ("name", "layer", text), *kind_column, ("module_type", "type", text), ("calls", "calls", number(0)),
        ("mean_self_ms", "self ms/call", number()), ("mean_ms", "incl. ms/call", number()),
        *([("mean_ci_share", CI_HEADING, plus_minus_share)] if leveled else []), ("share", "self share", share)])
    _show(console, analysis.layer_type_summary_of(modules, step_ms),
          f"Time per layer type (by self time, {which}; ms per call)", [
              ("module_type", "type", text), ("layers", "modules", number(0)), ("calls", "calls", number(0)),
              ("mean_self_ms", "self ms/call", number()), ("mean_ms", "incl. ms/call", number()),
              ("share", "self share", share)])
    if compiled_calls:
        _say(console, f"{counted(compiled_calls, 'call')} of layers inside compiled code hold their shares of "
                      "the kernels torch.compile made: equal shares where one kernel serves several operators "
                      "or layers (docs/analyses.md, \"Compiled code\")")


def _gpu_tables(trace: Trace, console: Console, top: int, step_view: StepView | None = None) -> None:
    kernels = analysis.kernels_by_name(trace)
    if kernels.empty:
        return
    # per device, as the recommendations count it: a device is idle only while all its streams are
    _gpu_line(kernels, analysis.gpu_utilization(trace, per_stream=False), console)
    _kernel_table(kernels, console, top)
    _per_operator_table(analysis.kernel_time_per_operator(trace), console, top)
    _replay_table(replay_table_of(replay_sums(analysis.replayed_layers(trace))), console, top)
    in_steps, which = step_view or deep_steps(trace)
    _gpu_vs_cpu_table(analysis.gpu_vs_cpu_sums(analysis.gpu_vs_cpu_per_layer(in_steps)), which, console, top)
    _transfer_tables(analysis.memory_operations(trace), analysis.synchronization(trace),
                     analysis.launch_overhead(trace), console, top)
    _roofline_table(analysis.kernel_roofline(trace), analysis.trace_peak(trace), console, top)


def _replay_table(replays: pd.DataFrame, console: Console, top: int) -> None:
    """A replayed graph's kernels, on the layers that captured them."""
    if replays.empty:
        return
    shown, unit, figure = in_time_unit(replays.head(top), ["kernel_us"])
    _show(console, shown, "CUDA graph replays by the layer that captured them", [
        ("layer", "layer", short(50)), ("replays", "replays", number(0)), ("kernels", "kernels", number(0)),
        ("kernel_us", f"kernel {unit}", figure)])


def _gpu_vs_cpu_table(sums: pd.DataFrame, which: str, console: Console, top: int) -> None:
    """The layers' wall, GPU busy and other time (:func:`xsp.analysis.gpu_vs_cpu_sums`), longest first."""
    if sums.empty or not (sums["kernels"] > 0).any():
        return
    grouped = pd.DataFrame({"name": sums["name"], "duration_us": sums["duration_ns"] / 1e3,
                            "gpu_us": sums["gpu_ns"] / 1e3, "cpu_us": sums["cpu_ns"] / 1e3, "kernels": sums["kernels"]})
    grouped = grouped.sort_values("duration_us", ascending=False, kind="stable").head(top).reset_index(drop=True)
    shown, unit, figure = in_time_unit(grouped, ["duration_us", "gpu_us", "cpu_us"])
    _show(console, shown, f"GPU vs CPU time per layer ({which})", [
        ("name", "layer", text), ("duration_us", f"wall {unit}", figure),
        ("gpu_us", f"GPU busy {unit}", figure), ("cpu_us", f"non-GPU {unit}", figure),
        ("kernels", "kernels", number(0))])


def _gpu_line(kernels: pd.DataFrame, utilization: pd.DataFrame, console: Console) -> None:
    """The kernels' count and time, and the GPU's busy and idle time (``utilization``: per device)."""
    busy, window = utilization["busy_us"].sum(), utilization["window_us"].sum()
    _say(console, f"GPU: {int(kernels['count'].sum()):,} kernels, "
                  f"{kernels['total_us'].sum() / 1e3:,.3f} ms of kernel time; the GPU busy "
                  f"{100 * busy / window if window else 0:.1f}% of its active window, idle "
                  f"{utilization['host_bound_idle_us'].sum() / 1e3:,.3f} ms waiting for the host and "
                  f"{utilization['other_idle_us'].sum() / 1e3:,.3f} ms on other waits")


def _per_operator_table(per_operator: pd.DataFrame, console: Console, top: int) -> None:
    if per_operator.empty:
        return
    shown, unit, figure = in_time_unit(per_operator.head(top), ["kernel_us"])
    _show(console, shown, "Kernel time per operator", [
        ("operator", "operator", short(60)), ("kernels", "kernels", number(0)),
        ("kernel_us", f"kernel {unit}", figure), ("share", "share", share)])


def _transfer_tables(memory: pd.DataFrame, sync: pd.DataFrame, launch: pd.DataFrame, console: Console,
                     top: int) -> None:
    """Copies and sets, synchronisation and launch overhead per step."""
    if not memory.empty:
        shown, unit, figure = in_time_unit(memory, ["total_us"])
        _show(console, shown, "Memory copies and sets", [
            ("kind", "kind", text), ("direction", "direction", text), ("count", "count", number(0)),
            ("total_us", f"total {unit}", figure), ("bytes", "bytes", number(0)),
            ("bandwidth_gb_s", "GB/s", number(2))])
    if not sync.empty:
        shown, unit, figure = in_time_unit(sync.head(top), ["total_us", "mean_us"])
        _show(console, shown, "Synchronisation", [
            ("where", "where", text), ("name", "name", text), ("count", "count", number(0)),
            ("total_us", f"total {unit}", figure), ("mean_us", f"mean {unit}", figure)])
    shown, unit, figure = in_time_unit(launch.head(STEPS_SHOWN), ["launch_us", "kernel_us", "mean_launch_delay_us"])
    _show(console, shown, "Launch overhead per step", [
        ("step", "step", number(0)), ("kernels", "kernels", number(0)), ("launch_us", f"launch {unit}", figure),
        ("kernel_us", f"kernel {unit}", figure), ("launch_to_kernel", "launch/kernel", number(2)),
        ("kernels_shorter_than_launch", "kernels < launch", number(0)),
        ("mean_launch_delay_us", f"mean delay {unit}", figure)])


def _kernel_table(kernels: pd.DataFrame, console: Console, top: int) -> None:
    shown, unit, figure = in_time_unit(kernels.head(top), ["total_us", "mean_us"])
    _show(console, shown, f"Top {counted(min(top, len(kernels)), 'kernel')} by total time", [
        ("name", "kernel", short(70)), ("count", "count", number(0)), ("total_us", f"total {unit}", figure),
        ("mean_us", f"mean {unit}", figure), ("share", "share", share)])


def lines_table(trace: Trace, console: Console, top: int, step_view: StepView | None = None) -> None:
    """The hottest lines of the user's code (``xsp report --lines``), each with its text
    (``step_view``: :func:`deep_steps` of ``trace``, where the caller has it already)."""
    trace, which = step_view or deep_steps(trace)
    found = analysis.lines(trace)
    if found.empty:
        _say(console, "no line of your code in this trace: it was recorded without call sites (an xsp older "
                      "than call sites, or an imported trace)", "yellow")
        return
    hottest = found.head(top)
    paths = relative_files(hottest["file"].tolist())
    hottest = hottest.assign(
        where=[f"{paths[f]}:{n}" for f, n in zip(hottest["file"], hottest["line"])],
        code=[line_text(f, n) or "" for f, n in zip(hottest["file"], hottest["line"])])
    gpu = bool(found["kernel_ms"].sum() > 0)
    _show(console, hottest, f"Top {counted(len(hottest), 'line')} of your code by self time ({which})", [
        ("where", "line", text), ("calls", "calls", number(0)), ("self_ms", "self ms", number()),
        ("inclusive_ms", "incl ms", number()), *([("kernel_ms", "GPU ms", number())] if gpu else []),
        ("self_share", "share", share), ("code", "code", text)])
    sources = kernel_sources(trace.metadata)
    if sources and not len(compiled_kernel_lines(trace.spans, sources)[0]):
        _say(console, f"{counted(len(sources), 'compiled kernel')} with known source lines, but none ran as a span "
                      "of this trace, so their time stays on the line that called the compiled code: on a CPU, "
                      "inductor shows its kernels to the profiler only with TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 "
                      "(xsp sets it for the compiles a session with the operator level makes)", "yellow")


def outside_steps_line(trace: Trace, level: Level, what: str) -> str | None:
    """What of ``level`` ran outside every step of a trace that has steps, by where: before the
    first step (model construction, weight initialisation, start-up), between steps, after the
    last; None when nothing did (or the trace has no steps)."""
    spans = trace.spans
    steps = within_steps(spans)
    outside = spans[(spans[col.LEVEL] == level.value).to_numpy(dtype=bool) & ~steps]
    if outside.empty or not steps.any():
        return None
    in_steps = spans[steps]
    first_ns, last_ns = int(in_steps[col.START_NS].min()), int(in_steps[col.END_NS].max())
    return _outside_text(outside_steps(outside[col.START_NS].to_numpy(dtype=np.int64),
                                       outside[col.END_NS].to_numpy(dtype=np.int64), first_ns, last_ns), what)


def _outside_text(outside: OutsideSteps, what: str) -> str:
    parts = [f"{ms:,.3f} ms {where}" for ms, where in ((outside.before_ms, "before the first step (model "
                                                                           "construction, start-up)"),
                                                       (outside.between_ms, "between steps"),
                                                       (outside.after_ms, "after the last step")) if ms > 0]
    return (f"Outside every step, not in these figures: {counted(outside.count, what)}, "
            + ", ".join(parts or ["0.000 ms"]))


def _operator_tables(trace: Trace, console: Console, top: int, step_view: StepView | None = None) -> None:
    whole = trace
    trace, which = step_view or deep_steps(trace)
    ops = analysis.operator_table(trace)
    if ops.empty:
        return
    _operator_table(ops, which, outside_steps_line(whole, Level.OPERATOR, "operator"), console, top)
    _backward_table(analysis.backward_time_per_layer(trace), console, top)


def _backward_table(backward: pd.DataFrame, console: Console, top: int) -> None:
    """Backward time per forward layer (:func:`xsp.analysis.backward_time_per_layer`)."""
    if not backward.empty and backward["backward_operators"].sum() > 0:
        shown, unit, figure = in_time_unit(backward.head(top), ["backward_layer_us", "backward_operator_us"])
        _show(console, shown, "Backward time per forward layer (by autograd sequence number)", [
            ("forward_layer", "forward layer", text), ("backward_layer_us", f"backward span {unit}", figure),
            ("backward_operator_us", f"backward operators {unit}", figure),
            ("backward_operators", "operators", number(0))])


def _operator_table(ops: pd.DataFrame, which: str, outside: str | None, console: Console, top: int) -> None:
    shown, unit, figure = in_time_unit(ops.head(top), ["self_us", "total_us"])
    _show(console, shown, f"Top {counted(min(top, len(ops)), 'operator')} by self time ({which})", [
        ("name", "operator", short(60)), ("count", "calls", number(0)), ("self_us", f"self {unit}", figure),
        ("total_us", f"total {unit}", figure), ("share", "share", share)])
    if outside:
        _say(console, outside)


def _flops_table(flops: pd.DataFrame, console: Console, top: int) -> None:
    """The layers' FLOPs (:func:`xsp.analysis.layer_flops`), most first."""
    flops = flops.dropna(subset=["flops"])
    if flops.empty:
        return
    _show(console, flops.head(top), "FLOPs per layer (each layer includes the layers inside it)", [
        ("name", "layer", text), ("calls", "calls", number(0)), ("flops_per_call", "FLOPs per call", number(0)),
        ("bytes", "bytes (all calls)", number(0)), ("arithmetic_intensity", "FLOP/byte", number(2))])


def top_level_check(metadata: dict[str, Any], top_level: TopLevelLayers) -> str:
    """How the top-level layers of a leveled trace (``metadata``'s; their sums, ``top_level``)
    add up against the model-only run's latency: the check that leveled figures are consistent
    (their gap is the model's own code)."""
    leveled = metadata.get("leveled") or {}
    runs = pd.DataFrame(leveled.get("overhead") or [])
    model_only = runs[runs["run"] == Level.MODEL.value] if len(runs) else runs
    if model_only.empty or not top_level.calls:
        return "no model-only run or no top-level layers: nothing to check the leveled figures against"
    latency_ms = float(model_only["model_latency_ms"].iloc[0])
    interval_ms = float(model_only.get("model_latency_ci_ms", pd.Series([np.nan])).iloc[0])
    total_ms = top_level.ns / 1e6
    return (f"Top-level layers add up to {total_ms:.3f} ms, {total_ms / latency_ms - 1:+.1%} off the model-only "
            f"latency of {latency_ms:.3f} ms (± {interval_ms:.3f} ms); the rest is the model's own code")


def _always_on_line(metadata: dict[str, Any], console: Console, in_file: dict[str, int] | None = None) -> bool:
    """An always-on trace's line (how its steps were recorded); False: not always on. ``in_file``:
    the trace's steps counted by how they were recorded (:func:`_steps_by_sampling`), said instead
    of the session's counts where it never wrote them (a killed run: its counts are all 0)."""
    sampling = metadata.get("sampling")
    if not sampling:
        return False
    steps = sampling.get("steps") or {}
    ended = sum(steps.values()) > 0 or not in_file
    if not ended:
        steps = in_file or {}
    deep = sum(steps.get(reason.value, 0) for reason in DEEP_REASONS)
    total = sum(steps.values())
    counts = (f"{counted(total, 'step')} timed, {deep:,} recorded deep ({steps.get('sampled', 0):,} drawn, "
              f"{steps.get('after_slow', 0):,} after a slow step, {steps.get('capture', 0):,} captured); "
              f"{steps.get('request_not_sampled', 0):,} in requests the application did not sample")
    if ended:
        factor = sampling.get("slow_factor", 0)
        slow = (f"{sampling.get('slow_steps_found', 0):,} slow steps (over {factor:g}x the running median of recent "
                f"steps, {sampling.get('median_step_ns', 0) / 1e6:.3f} ms at the end)" if factor
                else "no slow-step rule")
        _say(console, f"Always on (sample {sampling.get('rate', 0):g}): {counts}; {slow}", "bold")
    else:
        _say(console, f"Always on (sample {sampling.get('rate', 0):g}), the steps in this file (the session did not "
                      f"end, so its own counts were never written): {counts}", "bold")
    return True


def _steps_by_sampling(spans: pd.DataFrame) -> dict[str, int]:
    """The step roots of ``spans`` counted by how each was recorded (the ``sampling`` column)."""
    if col.SAMPLING not in spans.columns:
        return {}
    reasons = spans[col.SAMPLING].iloc[step_roots(spans)].dropna().astype(str)
    return {str(reason): int(count) for reason, count in reasons.value_counts().items()}


def _always_on_section(trace: Trace, console: Console, top: int) -> None:
    """An always-on trace: how its steps were recorded, and its layers leveled over the drawn steps."""
    if _always_on_line(trace.metadata, console, _steps_by_sampling(trace.spans)):
        _leveled_over_steps_tables(trace, console, top)


def _leveled_over_steps_tables(trace: Trace, console: Console, top: int) -> None:
    """An always-on trace's layers leveled over its drawn steps (``trace``: the trace, or the spans
    of the steps its leveled runs recorded), for each model that leads steps (a service's
    endpoints), the busiest first."""
    found = leveled_by_model(trace)
    for model, result in found:
        of = f" of {model}" if len(found) > 1 else ""
        runs = result.overhead
        runs = runs.assign(model_latency_ci_share=runs["model_latency_ci_ms"] / runs["model_latency_ms"])
        _show(console, runs, f"Leveled over the drawn steps{of} (each depth a run of its own; nothing run twice)", [
            ("run", "run", text), ("steps", "steps", number(0)), ("model_latency_ms", "model ms", number()),
            ("model_latency_ci_share", CI_HEADING, plus_minus_share), ("overhead", "overhead vs model", share)])
        best = analysis.top_layers(result.trace, k=top)
        if best.empty:
            continue
        spans = result.trace.spans
        source = spans.drop_duplicates(col.NAME).set_index(col.NAME)[col.LEVELED_RUN].astype(str)
        steps_of = dict(zip(runs["run"], runs["steps"]))
        best = best.assign(run=best["name"].map(source), steps=best["name"].map(source).map(steps_of),
                           mean_ci_share=best["mean_ci_ms"] / best["mean_ms"])
        _show(console, best, f"Top {counted(len(best), 'layer')}{of} by self time, leveled (free of xsp's own "
                             "overhead)", [
            ("name", "layer", text), ("mean_ms", "incl. ms/call", number()),
            ("mean_ci_share", CI_HEADING, plus_minus_share), ("run", "from run", text), ("steps", "steps", number(0)),
            ("share", "share", share)])


def _leveled_table(metadata: dict[str, Any], top_level: TopLevelLayers, console: Console) -> None:
    leveled = metadata.get("leveled")
    if not leveled:
        return
    runs = pd.DataFrame(leveled.get("overhead") or [])
    if runs.empty:
        return
    if "model_latency_ci_ms" not in runs:  # results from before the intervals
        runs["model_latency_ci_ms"] = np.nan
    runs["model_latency_ci_share"] = runs["model_latency_ci_ms"] / runs["model_latency_ms"]
    _show(console, runs, f"Leveled runs (durations merged from each span's own run; "
                         f"{leveled.get('unmatched', 0)} spans did not repeat; "
                         f"{counted(int(leveled.get('rounds', 1)), 'round')})", [
        ("run", "run", text), ("steps", "steps", number(0)), ("model_latency_ms", "model latency ms", number()),
        ("model_latency_ci_share", CI_HEADING, plus_minus_share), ("overhead", "overhead vs model", share),
        ("metric", "metric run", yes_no)])
    if leveled.get("by_depth"):
        _say(console, f"Layers leveled by module depth: {counted(int(leveled.get('layer_depths') or 0), 'depth')}, "
                      f"{leveled.get('runs_per_round', len(runs))} runs a round; each layer's time from the run that "
                      "recorded nothing below it")
    _say(console, top_level_check(metadata, top_level))
    for burst in leveled.get("bursts") or []:
        _say(console, f"run {burst['run']} of round {burst['round']} was hit by a burst of noise (its steps spread "
                      f"±{burst['spread']:.1%}, the runs before it ±{burst['typical']:.1%}): run again", "yellow")
    for cut in leveled.get("given_up") or []:
        _say(console, f"the time budget cut short the {cut}", "yellow")
    target = float(leveled.get("target") or 0.02)
    imprecise = leveled.get("imprecise") or []
    if imprecise:
        _say(console, f"{len(imprecise)} leveled figures have a 95% interval wider than ±{target:.0%} (more rounds "
                      f"would narrow them), e.g. {middle(str(imprecise[0]), 50)}", "yellow")
    costs = leveled.get("calibration") or {}
    if costs and leveled.get("by_depth"):
        _say(console, "xsp's own cost inside each span's clock readings, taken out of its figure: " + ", ".join(
            f"{level} {(cost['inside_ns'] - cost.get('untimed_ns', 0.0)) / 1e3:+.2f} µs"
            for level, cost in costs.items()))
    elif costs:
        _say(console, "xsp's own cost per span, taken out of the figures: " + ", ".join(
            f"{level} {cost['inside_ns'] / 1e3:.2f} µs inside, {cost['parent_ns'] / 1e3:.2f} µs to its parent"
            + (f", {cost['untimed_ns'] / 1e3:.2f} µs untimed call given back" if cost.get("untimed_ns") else "")
            for level, cost in costs.items()))


def _roofline_table(roofline: pd.DataFrame, peak: GpuPeak | None, console: Console, top: int) -> None:
    roof = roofline.dropna(subset=["flops"])
    if roof.empty:
        return
    title = "FLOPs per kernel" + (f" (roofline ridge {peak.ridge_point():.1f} FLOP/byte on {peak.name})"
                                  if peak else "")
    _show(console, roof.sort_values("flops", ascending=False).head(top), title, [
        ("name", "kernel", short(60)), ("count", "count", number(0)), ("flops", "FLOPs", number(0)),
        ("arithmetic_intensity", "FLOP/byte", number(1)), ("achieved_tflops", "TFLOP/s", number(2)),
        ("bound", "bound", text)])


def _memory_tables(trace: Trace, console: Console, top: int, step_view: StepView | None = None) -> None:
    in_steps, which = step_view or deep_steps(trace)
    _memory_table(analysis.memory_by_layer_type(in_steps), which, console, top)


def _memory_table(by_type: pd.DataFrame, which: str, console: Console, top: int) -> None:
    if by_type.empty:
        return
    _show(console, by_type.head(top), f"Memory allocated per layer type (forward calls, {which})", [
        ("module_type", "type", text), ("device", "device", text), ("layers", "calls", number(0)),
        ("mean_allocated_bytes", "bytes per call", number(0)), ("max_peak_bytes", "max peak bytes", number(0))])


def _system_tables(trace: Trace, console: Console) -> None:
    _gc_table(trace, console)
    metrics = analysis.system_metrics(trace)
    if metrics.empty:
        return
    summary = metrics.groupby(["device", "metric", "unit"], sort=False,
                              observed=True)["value"].agg(["mean", "max"]).reset_index()
    _show(console, summary, "System metrics over the session (system level)", [
        ("device", "device", text), ("metric", "metric", text), ("unit", "unit", text),
        ("mean", "mean", number(1)), ("max", "max", number(1))])
    energy = analysis.energy_per_step(trace)
    measured = energy[energy["energy_j"].notna()]
    if not measured.empty:
        per_device = measured.groupby("device", observed=True).agg(
            steps=("step", "size"), energy_j=("energy_j", "mean"), per_item_j=("energy_per_item_j", "mean"),
            method=("method", lambda m: ", ".join(sorted(set(m)))))
        _show(console, per_device.reset_index(), "Energy per step", [
            ("device", "device", text), ("steps", "steps", number(0)), ("energy_j", "J per step", number(3)),
            ("per_item_j", "J per item", number(4)), ("method", "how", text)])


def _gc_table(trace: Trace, console: Console) -> None:
    collections = analysis.gc_collections(trace)
    if collections.empty:
        return
    _show(console, collections, "Garbage collections (system level; every Python thread waits while one runs)", [
        ("generation", "generation", number(0)), ("collections", "collections", number(0)),
        ("total_ms", "total ms", number(3)), ("mean_ms", "mean ms", number(3)), ("max_ms", "max ms", number(3)),
        ("wall_share", "of wall time", share)])
    details = (trace.metadata.get("tracer_details") or {}).get("system") or {}
    own = details.get("gc_collections_by_xsp")
    if isinstance(own, int) and own:
        _say(console, f"Not in the table: {counted(own, 'collection')} on xsp's own threads (its imports and "
                      f"windows), {milliseconds(float(details.get('gc_ms_by_xsp') or 0))}: xsp's cost, not the "
                      "program's")


def _diagnostics(trace: Trace, console: Console) -> None:
    table = analysis.diagnostics_table(trace.metadata.get("hierarchy") or {})
    problems = table[table["spans"] > 0]
    if problems.empty:
        return
    # prose, not a table: the meanings are sentences, which a table column clips at 80 columns
    _say(console, "Hierarchy diagnostics (what the tree builder could not place)", "bold")
    for row in problems.itertuples():
        _say(console, f"{row.problem}: {counted(int(row.spans), 'span')} ({100 * float(row.share):.1f}%): "
                      f"{row.meaning}")


def _recommendations(table: pd.DataFrame, console: Console) -> None:
    """The recommendations (:func:`xsp.analysis.recommend`'s ``table``), most at stake first."""
    if table.empty:
        return
    console.print("[bold]Recommendations[/bold] (most at stake first; details: xsp recommend FILE)")
    for line in recommendation_lines(table, width=min(console.width, 100)):
        console.print(one_line(line), markup=False)


def _ranks_section(trace: Trace, console: Console) -> None:
    """A distributed job: each rank's step latency, communication and lateness, and the steps'
    stragglers. With one rank, its communication only (when it made collectives)."""
    if not _communication_section(trace.metadata, trace.ranks, analysis.rank_steps(trace), console):
        return
    _clocks_and_skew(trace, console)
    stragglers = analysis.stragglers(trace)
    stragglers = stragglers[stragglers["step"] >= 0]
    if not stragglers.empty:
        counts = stragglers["straggler"].dropna().value_counts()
        if len(counts):
            most = sorted(int(rank) for rank in counts.index[counts == counts.iloc[0]])
            who = (f"Rank {most[0]}" if len(most) == 1 else "Ranks " + ", ".join(map(str, most[:5]))
                   + (f" and {len(most) - 5} more" if len(most) > 5 else "") + " each")
            _say(console, f"{who} entered the collectives last in {int(counts.iloc[0])} of "
                          f"{counted(len(stragglers), 'step')} (late ms: the time the other ranks waited for it)")
        else:
            _say(console, f"No rank held the others up in any of {len(stragglers)} steps (none was 50 µs late)")
        if (stragglers["entry"] == "python").all() and _ddp_buckets_unseen(trace):
            _say(console, "DDP's gradient all-reduces were not recorded (its communication hook was registered "
                          "before xsp started), so the latest rank may be misjudged: record the operator level "
                          "too (--levels model,layer,operator)", "yellow")
        worst = stragglers.sort_values("late_ms", ascending=False).head(STEPS_SHOWN)
        _show(console, worst.sort_values("step"), "Stragglers: the latest rank per step (worst steps)", [
            ("step", "step", number(0)), ("straggler", "rank", number(0)), ("late_ms", "late ms", number()),
            ("next_late_ms", "next latest ms", number()), ("collectives", "collectives", number(0))])


def job_file_lines(metadata: dict[str, Any]) -> list[str]:
    """What a job's files leave out of its tables, a line each: ranks with no file, files of an
    earlier job, files with no span."""
    def listed(ranks: list[int]) -> str:
        return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")

    missing, ignored = metadata.get("missing_ranks") or [], metadata.get("ignored_files") or []
    empty = metadata.get(EMPTY_RANKS) or []
    lines = []
    if missing:
        lines.append(f"no file of rank(s) {listed(missing)} of this job was found: the tables leave them out")
    if ignored:
        lines.append(f"{len(ignored)} rank file(s) of an earlier job left out: {', '.join(ignored)}")
    if empty:
        lines.append(f"the file of rank(s) {listed(empty)} holds no spans (its process ended before its first window "
                     "was written, or recorded nothing): the tables have nothing of it")
    return lines


def _communication_section(metadata: dict[str, Any], ranks: list[int], per_step: pd.DataFrame,
                           console: Console) -> bool:
    """The ranks missing or left out, and each rank's step latency, communication and lateness
    (``per_step``: :func:`xsp.analysis.rank_steps`); whether the ranks' collectives can be put
    side by side (a table was shown and their times overlap)."""
    for line in job_file_lines(metadata):
        _say(console, line, "yellow")
    communication = analysis.communication_of_steps(per_step)
    if len(ranks) < 2 and (communication.empty or not communication["collectives_per_step"].sum()):
        return False
    job = metadata.get("distributed") or {}
    if len(ranks) > 1:
        _say(console, f"Distributed job {job.get('job_id', '?')}: {len(ranks)} ranks of world size "
                      f"{job.get('world_size', '?')}, backend {job.get('backend') or '?'}", "bold")
    apart = bool(metadata.get(RANKS_APART))
    title = "Communication per rank (medians over steps)"
    if len(communication) > RANKS_SHOWN:  # the ranks that held the others up most, over all steps
        late_total = per_step.groupby("rank")["late_ms"].sum(min_count=1)
        ordered = communication.assign(late_total=communication["rank"].map(late_total).fillna(0.0))
        communication = ordered.sort_values(["late_total", "step_ms"], ascending=False, kind="stable").head(
            RANKS_SHOWN).sort_values("rank").drop(columns="late_total")
        title = (f"Communication per rank (medians over steps): the {RANKS_SHOWN} of {len(ranks)} ranks latest over "
                 "all steps (xsp.analysis.communication has them all)")
    _show(console, communication, title, [
        ("rank", "rank", number(0)), ("steps", "steps", number(0)), ("step_ms", "step ms", number()),
        ("comm_ms", "comm ms", number()), ("comm_share", "comm", share),
        ("overlap_share", "overlapped", share), ("collectives_per_step", "colls", number(0)),
        *([] if apart else [("late_ms", "late ms", number())])])
    if apart:
        _say(console, "The ranks' times do not overlap (files of different runs?): who waited for whom is not shown",
             "yellow")
        return False
    return True


def _clocks_and_skew(trace: Trace, console: Console) -> None:
    """How the ranks' clocks were put on one, and how far apart the ranks entered each collective."""
    _clock_line(trace.metadata, lambda: analysis.clock_offsets(trace), console)
    if len(trace.ranks) < 2:  # one rank's file: no other to be apart from
        return
    skew = analysis.collective_skew(trace)
    skew = skew[skew["step"] >= 0]
    if len(skew) and skew["skew_ns"].max() > 0:
        worst = skew.sort_values("skew_ns", ascending=False, kind="stable").iloc[0]
        _say(console, f"Collective skew (the last rank's entry less the first's): median "
                      f"{float(skew['skew_ns'].median()) / 1e3:,.1f} µs over {len(skew)} collectives, largest "
                      f"{float(worst['skew_ns']) / 1e3:,.1f} µs ({worst['op']} {int(worst['k'])} of step "
                      f"{int(worst['step'])}, rank {int(worst['latest_rank'])} last)")


def _clock_line(metadata: dict[str, Any], offsets_of: Callable[[], dict[int, int]], console: Console) -> None:
    """How the ranks' clocks were put on one, where they ran on several hosts (``offsets_of``:
    :func:`xsp.analysis.clock_offsets` of the trace)."""
    hosts = {str(meta.get("host")) for meta in (metadata.get("ranks") or {}).values()}
    if len(hosts) > 1:
        offsets = offsets_of()
        if offsets:
            reference = min(offsets)
            _say(console, f"Clocks: {len(hosts)} hosts; every rank put on rank {reference}'s clock by the ends of the "
                          f"blocking collectives (offsets {min(offsets.values()) / 1e3:,.0f} to "
                          f"{max(offsets.values()) / 1e3:,.0f} µs)")


def _ddp_buckets_unseen(trace: Trace) -> bool:
    """A DDP model ran, and none of its bucket all-reduces was recorded."""
    spans = trace.spans
    if not (spans[col.MODULE_TYPE] == "DistributedDataParallel").any():
        return False
    collectives = spans[spans[col.KIND] == SpanKind.COLLECTIVE.value][col.ATTRIBUTES].dropna().astype(str)
    return not collectives.str.contains(col.ATTR_COLLECTIVE_BUCKET, regex=False).any()


def render_report(trace: Trace, console: Console, top: int = 10, rank: int | None = None,
                  lines: bool = False) -> None:
    """Print every analysis that applies to ``trace``, recommendations first: GPU sections only
    when it has GPU activity; with ``lines``, the hottest lines of the user's code after the
    layers. A trace of several ranks gets the cross-rank tables first, then the report of one
    rank (``rank``, default the first).

    Raises:
        KeyError: ``rank`` is not a rank of the trace.
    """
    ranks = trace.ranks
    if len(ranks) > 1:
        chosen = _chosen_rank(ranks, rank)
        _job_section(trace, console, chosen)
        trace = trace.for_rank(chosen)
        _header(trace, console)
    else:
        if rank is not None and rank not in ranks:
            raise KeyError(f"the trace holds no rank {rank} (ranks: {', '.join(map(str, ranks)) or 'none'})")
        _header(trace, console)  # the title first, then one rank's communication
        if trace.metadata.get("distributed"):
            _ranks_section(trace, console)
    _rank_sections(trace, console, top, lines)


def render_job_report(job: Trace, rank: int, rank_trace: Trace, console: Console, top: int = 10,
                      lines: bool = False) -> None:
    """:func:`render_report` of a distributed job read without loading it: its cross-rank tables
    from ``job`` (:func:`xsp.analysis.job.load_job`), then the report of ``rank`` from
    ``rank_trace``, that rank's own file.

    Raises:
        KeyError: ``rank`` is not a rank of the job."""
    _job_section(job, console, _chosen_rank(job.ranks, rank))
    _header(rank_trace, console)
    _rank_sections(rank_trace, console, top, lines)


def render_windowed_report(report: WindowedReport, console: Console, top: int = 10) -> None:
    """The report of a trace too large to load, from its tables read a window of whole trees at a
    time (:func:`xsp.analysis.windowed.windowed_report`), each section as :func:`render_report`
    prints it; then what is not shown."""
    _header_of(report.metadata, report.level_counts, report.spans, len(report.steps), console)
    ranks = report.communication
    if ranks is not None and _communication_section(report.metadata, report.kept.ranks, ranks.per_step, console):
        _clock_line(report.metadata, lambda: ranks.clock_offsets, console)
    _recommendations(report.recommendations, console)
    _latency_tables(report.kept, console)
    _step_tables(report.kept, console, report.extent_ns, report.parts)
    if _always_on_line(report.metadata, console) and report.leveled_steps is not None:
        _leveled_over_steps_tables(report.leveled_steps, console, top)
    if report.top_level is not None:
        _leveled_table(report.metadata, report.top_level, console)
    in_steps, which = deep_steps(report.kept)  # the steps' work, as the trace loaded whole names it
    layers = report.layers
    if report.level_counts.get(Level.LAYER.value) or kernel_layers(report.metadata):
        _layer_section(warmup_line(report.kept), layers.layers, layers.modules, layers.compiled_calls,
                       step_time_ms(in_steps.spans), which, console, top)
    if len(report.operators):
        outside = report.operators_outside
        _operator_table(report.operators, which,
                        _outside_text(outside, "operator") if outside is not None else None, console, top)
        _backward_table(report.backward, console, top)
    if report.layer_flops is not None:
        _flops_table(analysis.layer_flops_of(report.layer_flops), console, top)
    if len(report.kernels):
        _gpu_line(report.kernels, report.utilization, console)
        _kernel_table(report.kernels, console, top)
        _per_operator_table(report.kernels_per_operator, console, top)
        _replay_table(report.graph_replays, console, top)
        _gpu_vs_cpu_table(layers.gpu_vs_cpu, which, console, top)
        _transfer_tables(report.memory, report.synchronization, report.launch, console, top)
        _roofline_table(report.roofline, trace_peak(report.kept), console, top)
    _memory_table(report.layer_memory, which, console, top)
    _system_tables(report.kept, console)
    _diagnostics(report.kept, console)
    console.print()
    left_out = "; ".join(section.value for section in report.left_out)
    _say(console, "This trace is too large to load here, so it was read a part at a time (each step with everything "
                  "under it), to the same figures as the trace loaded whole" + (
                      f". Left out, as they need it whole: {left_out}" if left_out else "") +
                  ". xsp.analysis.windowed.windowed_report gives these tables in Python.", "yellow")


def _chosen_rank(ranks: list[int], rank: int | None) -> int:
    """``rank``, else the first of ``ranks``.

    Raises:
        KeyError: ``rank`` is not one of them."""
    if rank is not None and rank not in ranks:
        raise KeyError(f"the trace holds no rank {rank} (ranks: {', '.join(map(str, ranks)) or 'none'})")
    return ranks[0] if rank is None else rank


def _job_section(trace: Trace, console: Console, chosen: int) -> None:
    console.print(Text("xsp report of a distributed job", style="bold"), no_wrap=True)
    _ranks_section(trace, console)
    console.print()
    _say(console, f"Rank {chosen} in detail (xsp report --rank N for another)", "bold")


def _rank_sections(trace: Trace, console: Console, top: int, lines: bool) -> None:
    _recommendations(analysis.recommend(trace), console)
    step_view = deep_steps(trace)
    _latency_tables(trace, console)
    _step_tables(trace, console)
    _always_on_section(trace, console, top)
    if trace.metadata.get("leveled"):
        _leveled_table(trace.metadata, top_level_layers(trace.spans), console)
    _layer_tables(trace, console, top, step_view)
    if lines:
        lines_table(trace, console, top, step_view)
    _operator_tables(trace, console, top, step_view)
    _flops_table(analysis.layer_flops(trace), console, top)
    _gpu_tables(trace, console, top, step_view)
    _memory_tables(trace, console, top, step_view)
    _system_tables(trace, console)
    _diagnostics(trace, console)
