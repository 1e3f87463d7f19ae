"""The renderers of a diff (``xsp diff --format``): text that fits a terminal, Markdown for a
pull-request comment, JSON, and JUnit XML for a CI system. Each takes a :class:`Diff`."""

from __future__ import annotations

import json
import math
import re
import textwrap
import xml.etree.ElementTree as ET
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.figures import change_percent as _ratio
from xsp.core.figures import counted
from xsp.core.safe_text import capped, markdown_code, markdown_text, one_line, within, xml_text
from xsp.gate import diff_columns as dcol
from xsp.gate.diff import LISTED, TEXT_WIDTH, Diff
from xsp.gate.diff_columns import Judged, Verdict
from xsp.reports.terminal import distinct_middles


def text(result: Diff, width: int = TEXT_WIDTH) -> str:
    """A plain-text report that fits ``width`` columns."""
    lines = [_wrap(f"xsp diff: {_headline(result).upper()}  ({_counts(result.table)})", width, "  "),
             _clip(f"base: {_describe(result.base)}", width), _clip(f"new:  {_describe(result.new)}", width),
             _wrap(_settings_line(result.settings), width, "  ")]
    models = result.models(None)
    if len(models):
        lines += ["", "Model (median per step):"] + _key_lines(models.head(LISTED), width, verdicts=True)
        if len(models) > LISTED:
            lines.append(f"  ... and {len(models) - LISTED} more")
    if len(result.breakdown):
        lines += ["", f"Where it lives (change per step{_judged_suffix(result.settings)}):"]
        lines += _tree_lines(result.breakdown, width)
    for verdict in (Verdict.REGRESSED, Verdict.IMPROVED):
        rows = result.rows(verdict)
        if len(rows):
            lines += ["", f"{verdict.value.capitalize()} ({len(rows)}):"]
            lines += _key_lines(rows.head(LISTED), width)
            if len(rows) > LISTED:
                lines.append(f"  ... and {len(rows) - LISTED} more")
    if len(result.changes):
        lines += ["", "Changes of structure:"]
        lines += _change_lines(result.changes.head(LISTED), width)
        if len(result.changes) > LISTED:
            lines.append(f"  ... and {len(result.changes) - LISTED} more")
    if result.warnings:
        lines += ["", "Warnings:"] + [_wrap(f"- {one_line(w)}", width, "  ") for w in result.warnings]
    return "\n".join(lines) + "\n"


def markdown(result: Diff) -> str:
    """A Markdown report for a pull-request comment or a CI step summary."""
    moved = result.rows(Verdict.REGRESSED)
    improved = result.rows(Verdict.IMPROVED)
    out = [f"## xsp diff: **{_headline(result)}**", "",
           f"{_counts(result.table)}. Base: {markdown_text(_describe(result.base))}. "
           f"New: {markdown_text(_describe(result.new))}.", "",
           f"_{markdown_text(_settings_line(result.settings))}_", ""]
    models = result.models()
    if len(models):
        out += ["| model | base | new | ratio | verdict |", "| --- | ---: | ---: | ---: | --- |"]
        out += [f"| {markdown_code(row.key)} | {_time(row.base_median_ns)} | {_time(row.new_median_ns)} | "
                f"{_ratio(row.ratio)} | {shown_verdict(row)} |" for row in models.itertuples(index=False)]
        out.append("")
    if len(result.breakdown):
        tree = _tree_lines(result.breakdown, 100)
        fence = "`" * max(3, 1 + max((len(run) for line in tree for run in re.findall("`+", line)), default=0))
        out += [f"### Where it lives (change per step{_judged_suffix(result.settings)})", "", fence]
        out += [*tree, fence, ""]
    for title, rows in (("Regressed", moved), ("Improved", improved)):
        if not len(rows):
            continue
        judged = result.settings.get("judged", Judged.RAW.value) != Judged.RAW.value
        judged_head, judged_rule = (" judged |", " ---: |") if judged else ("", "")
        out += [f"### {title} ({len(rows)})", "",
                f"| key | level | base | new | delta | ratio |{judged_head} vs common shift | q | explains |",
                f"| --- | --- | ---: | ---: | ---: | ---: |{judged_rule} ---: | ---: | ---: |"]
        for row in rows.head(LISTED).itertuples(index=False):
            out.append(f"| {markdown_code(row.key)} | {row.level} | {_time(row.base_median_ns)} | "
                       f"{_time(row.new_median_ns)} | {_signed_time(row.delta_ns)} | {_ratio(row.ratio)} | "
                       + (f"{_ratio(row.adjusted_ratio)} | " if judged else "")
                       + f"{_ratio(row.relative_ratio)} | {_p(row.q_value)} | {_share(row.explains)} |")
        if len(rows) > LISTED:
            out.append(f"\n... and {len(rows) - LISTED} more.")
        out.append("")
    if len(result.changes):
        out += ["### Changes of structure", ""]
        out += [f"- {markdown_text(_change_text(row))}"
                for row in result.changes.head(LISTED).itertuples(index=False)]
        out.append("")
    if result.warnings:
        out += ["### Warnings", ""] + [f"- {markdown_text(w, 2000)}" for w in result.warnings] + [""]
    return "\n".join(within(out))


def as_json(result: Diff) -> str:
    """``{"verdict": ..., "rows": [...], ...}``: each row holds the columns of ``table`` (a text
    longer than :data:`~xsp.core.safe_text.CI_NAME_CHARACTERS` is cut in its middle, saying so),
    and ``verdict_shown``, its verdict as the text and markdown show it (``unjudged`` where it is
    ``unchanged`` only because it was not judged: :func:`shown_verdict`)."""
    rows = _records(result.table)
    for row, shown in zip(rows, (shown_verdict(row) for row in result.table.itertuples(index=False))):
        row["verdict_shown"] = shown
    document = {
        "verdict": result.verdict.value,
        "rows": rows,
        "changes": _records(result.changes),
        "breakdown": _records(result.breakdown[[dcol.DEPTH, col.LEVEL, dcol.KEY, dcol.DELTA_NS, dcol.RATIO,
                                                dcol.EXPLAINS,
                                              dcol.VERDICT]] if len(result.breakdown) else result.breakdown),
        "warnings": result.warnings,
        "inconclusive": result.inconclusive,
        "settings": result.settings,
        "base": result.base,
        "new": result.new,
    }
    return json.dumps(document, indent=1, allow_nan=False, default=str) + "\n"


def junit(result: Diff) -> str:
    """JUnit XML: one testcase per compared key, a failure for each regression; an inconclusive
    comparison adds a testcase ``whole run`` with an error saying why (no evidence to pass)."""
    shown = [shown_verdict(row) for row in result.table.itertuples(index=False)]
    inconclusive = result.verdict in (Verdict.INCONCLUSIVE, Verdict.NO_VERDICT)
    suite = ET.Element("testsuite", name="xsp diff", tests=str(len(result.table) + inconclusive),
                       failures=str(int((result.table[dcol.VERDICT] == Verdict.REGRESSED.value).sum())),
                       errors=str(int(inconclusive)), skipped=str(shown.count(UNJUDGED)))
    properties = ET.SubElement(suite, "properties")
    for name, value in result.settings.items():
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        ET.SubElement(properties, "property", name=name, value=xml_text(text))
    for row, verdict in zip(result.table.itertuples(index=False), shown):
        case = ET.SubElement(suite, "testcase", classname=f"xsp.{xml_text(str(row.level))}",
                             name=xml_text(capped(str(row.key))), time=f"{_seconds(row.new_median_ns):.6f}")
        if row.verdict == Verdict.REGRESSED.value:
            failure = ET.SubElement(case, "failure", type="regression",
                                    message=f"{_signed_time(row.delta_ns)} ({_ratio(row.ratio)}) per step, "
                                            f"q={_p(row.q_value)}")
            failure.text = xml_text(f"{one_line(capped(str(row.key)))}: {' '.join(_figures(row).split())}")
        elif verdict == UNJUDGED:  # a test that could not be run: JUnit's skipped, with the reason
            ET.SubElement(case, "skipped", message=xml_text(f"unjudged: {row.note}"))
        else:
            ET.SubElement(case, "system-out").text = f"{verdict}: {_signed_time(row.delta_ns)}"
    if inconclusive:  # no evidence to pass: the whole run is an error
        reasons = result.inconclusive if result.verdict is Verdict.INCONCLUSIVE else [str(result.nothing_judged())]
        case = ET.SubElement(suite, "testcase", classname="xsp.diff", name="whole run", time="0")
        error = ET.SubElement(case, "error", type=result.verdict.value.replace(" ", "_"),
                              message=xml_text(one_line(reasons[0])))
        error.text = xml_text("\n".join(one_line(reason) for reason in reasons[1:]))
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


UNJUDGED = "unjudged"
"""How a key left unchanged only because it was not judged reads (:func:`shown_verdict`)."""


def _counts(table: pd.DataFrame) -> str:
    """The keys by verdict as the rows show them (``unjudged`` apart from ``unchanged``)."""
    verdicts = pd.Series([shown_verdict(row) for row in table.itertuples(index=False)], dtype=object).value_counts()
    names = [v.value for v in Verdict]
    names.insert(names.index(Verdict.UNCHANGED.value) + 1, UNJUDGED)
    parts = [f"{int(verdicts.get(name, 0))} {name}" for name in names if verdicts.get(name, 0)]
    return f"{len(table)} keys: " + ", ".join(parts) if parts else "no keys"


def _describe(info: dict[str, Any]) -> str:
    parts = [one_line(str(info.get("source") or "trace"))]
    if info.get("runs"):
        parts.append(f"{info['runs']} runs")
    if info.get("steps"):
        parts.append(counted(int(info['steps']), "step"))
    if info.get("device"):
        parts.append(str(info["device"]))
    return ", ".join(parts)


def _headline(result: Diff) -> str:
    return result.verdict.value


def _settings_line(settings: dict[str, Any]) -> str:
    shift = settings.get("common_shift", 1.0)
    factor = settings.get("judged_factor", 1.0)
    how = settings.get("judged", Judged.RAW.value)
    if settings.get("normalize"):
        judged = f"; judged against the common shift {_ratio(shift)}"
    elif how == Judged.RAW.value or factor == 1.0:
        judged = "; raw times judged"
    else:
        judged = f"; judged {how} (new times / {factor:.2f})"
    speed = settings.get("machine_speed_ratio")
    machines = (f"; new machine {speed:.2f}x the base's time for xsp's fixed work" if speed is not None
                else "; machine speed not recorded in both runs")
    return (f"by {settings.get('by')} at {', '.join(settings.get('levels', [])) or 'no level'}; threshold "
            f"{settings.get('threshold', 0):.0%}, min delta {settings.get('min_delta_us'):g} µs, "
            f"FDR {settings.get('alpha')} ({settings.get('keys_tested')} keys tested){judged}{machines}")


def _judged_suffix(settings: dict[str, Any]) -> str:
    if settings.get("normalize"):
        return ", against the common shift"
    how = settings.get("judged", Judged.RAW.value)
    return "" if how == Judged.RAW.value or settings.get("judged_factor", 1.0) == 1.0 else f", {how}"


MOST_SHOWN_SHARE: Final = 10.0
"""The largest share of its parent's change a key's change is shown as (1,000%): past it the two
moved apart, not one inside the other."""


def _tree_lines(breakdown: pd.DataFrame, width: int) -> list[str]:
    """The breakdown as an indented tree in ``width`` columns, each key by its last part, shortened
    in the middle and kept apart from its neighbours'."""
    rows = list(breakdown.itertuples(index=False))
    tails, indents = [], []
    for row in rows:
        depth = int(row.depth)
        # a child moved far more than its parent (a compile beside a model call's latency, which leaves
        # compiling out): no share of the parent's change to speak of ("-9953551% of parent")
        shown = depth and not (isinstance(row.explains, float) and abs(row.explains) > MOST_SHOWN_SHARE)
        share = f"{_share(row.explains)} of parent" if shown else ""
        tails.append(f"{_signed_time(row.adjusted_delta_ns):>10} {_ratio(row.adjusted_ratio):>7} {share:>13} "
                     f"{shown_verdict(row):<9}")
        indents.append("  " * (depth - 1) + "└ " if depth else "")
    room = max(width - max((len(tail) for tail in tails), default=0) - 3, KEY_ROOM)
    keys = _kept_apart([one_line(_short_key(str(row.key))) for row in rows],
                       [max(room - len(indent), 1) for indent in indents])
    return [f"  {indent + key:<{room}} {tail}".rstrip() for key, indent, tail in zip(keys, indents, tails)]


def _kept_apart(keys: list[str], rooms: list[int]) -> list[str]:
    """Each key shortened in the middle to its room, keys given the same room kept apart
    (:func:`~xsp.reports.terminal.distinct_middles`)."""
    shown: dict[tuple[str, int], str] = {}
    for room in set(rooms):
        alike = [key for key, its_room in zip(keys, rooms) if its_room == room]
        shown.update({(key, room): text for key, text in distinct_middles(alike, room).items()})
    return [shown[key, room] for key, room in zip(keys, rooms)]


def _short_key(key: str) -> str:
    """A path's last part (the span's name and index); a name as it is."""
    return key.rsplit("/", 1)[-1]


KEY_ROOM = 10
"""The fewest columns a key keeps beside its figures; with less, the figures go on a line of their own."""


def _figures(row: Any, suffix: str = "") -> str:
    judged = "" if row.adjusted_ratio == row.ratio or math.isnan(row.adjusted_ratio) else (
        f" ({_ratio(row.adjusted_ratio)} judged)")
    return (f"{_time(row.base_median_ns):>9} -> {_time(row.new_median_ns):>9} {_ratio(row.ratio):>7}{judged} "
            f"q={_p(row.q_value)}{suffix}")


def _key_lines(rows: pd.DataFrame, width: int, verdicts: bool = False, suffix: str = "") -> list[str]:
    """One line per key and its figures (then its verdict, or ``suffix``) in ``width`` columns,
    the keys of the listing shortened in the middle to one room and kept apart (kernels of one
    template, layers of one block read alike at either end): on one line each where the keys keep
    :data:`KEY_ROOM` columns, else each key's figures on the line below it."""
    listed = list(rows.itertuples(index=False))
    tails = [_figures(row, f" {shown_verdict(row):>10}" if verdicts else suffix) for row in listed]
    room = width - max((len(tail) for tail in tails), default=0) - 3
    keys = _kept_apart([one_line(str(row.key)) for row in listed],
                       [room if room >= KEY_ROOM else width - 2] * len(listed))
    if room >= KEY_ROOM:
        return [f"  {key:<{room}} {tail}" for key, tail in zip(keys, tails)]
    return [f"  {key}\n  {_clip(tail.strip(), width - 4):>{width - 4}}" for key, tail in zip(keys, tails)]


def _change_lines(changes: pd.DataFrame, width: int) -> list[str]:
    """One line per change of structure in ``width`` columns: the keys shortened in the middle,
    kept apart, so that what changed and its figures stay in view."""
    listed = list(changes.itertuples(index=False))
    keys = _kept_apart([one_line(str(row.key)) for row in listed],
                       [max(width - 2 - len(_change_text(row, "")), KEY_ROOM) for row in listed])
    return [_clip(f"  {_change_text(row, key)}", width) for row, key in zip(listed, keys)]


def shown_verdict(row: Any) -> str:
    """A key's verdict as a reader should take it: ``unjudged`` where it is ``unchanged`` only
    because it was not judged (its note says why: one sample, a wait for a CPU, a move with the
    whole run), whatever its ratio and q-value."""
    note = getattr(row, "note", None)
    if row.verdict == Verdict.UNCHANGED.value and isinstance(note, str) and note.startswith(dcol.UNJUDGED_NOTES):
        return UNJUDGED
    return str(row.verdict)


def _change_text(row: Any, key: str | None = None) -> str:
    """A change of structure in words, its key as given (``key``) or whole."""
    text = f"{row.change}: {row.key if key is None else key} ({row.level})"
    if _present(row.base) or _present(row.new):
        text += f" {row.base} -> {row.new}"
    if isinstance(row.note, str):
        text += f", {row.note}"
    return one_line(text)


def _present(value: Any) -> bool:
    """A value of a changes frame that was given (a merged frame turns None into NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _time(ns: float) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "-"
    value = abs(float(ns))
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if value >= scale:
            return f"{ns / scale:.2f} {unit}"
    return f"{ns:.0f} ns"


def _signed_time(ns: float) -> str:
    text = _time(ns)
    return text if text == "-" or text.startswith("-") else "+" + text


def _share(share: float) -> str:
    return "-" if share is None or math.isnan(share) else f"{share:.0%}"


def _p(p: float) -> str:
    return "-" if p is None or math.isnan(p) else f"{p:.2g}"


def _seconds(ns: float) -> float:
    return 0.0 if ns is None or math.isnan(ns) else float(ns) / 1e9


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _wrap(text: str, width: int, indent: str) -> str:

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent))


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    records = []
    for record in frame.to_dict(orient="records"):
        records.append({key: _plain(value) for key, value in record.items()})
    return records


def _plain(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str):
        return capped(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if math.isinf(value):  # JSON has no infinity: said as text (a detectable change no steps could show)
            return "inf" if value > 0 else "-inf"
        return None if math.isnan(value) else float(value)
    if value is pd.NA:
        return None
    return value
