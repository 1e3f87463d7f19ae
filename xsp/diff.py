"""``xsp.diff``: did a change make the model slower, where, and by how much.

Two runs (traces, Kineto traces, leveled traces or baseline summaries) are compared key by
key with the statistics of :mod:`xsp.analysis.diff`; :class:`Diff` holds the result and
writes it as text, Markdown (pull-request comments), JUnit XML or JSON.
"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.analysis import diff as d
from xsp.analysis.diff import KeyBy, Verdict
from xsp.baseline import Summary, is_summary_path, summarize
from xsp.distributed import rank_path
from xsp.errors import TraceFormatError, TraceNotFoundError
from xsp.levels import parse_levels
from xsp.loading import load
from xsp.machine_speed import METADATA_KEY as MACHINE_SPEED
from xsp.machine_speed import SAME_SPEED, speed_ratio
from xsp.safe_text import markdown_code, markdown_text, one_line, within, xml_text
from xsp.schema import Level
from xsp.trace import Trace

Source = Trace | Summary | str | os.PathLike[str]
"""One run ``xsp.diff`` compares: a trace, a file ``xsp.load`` reads, or a baseline summary."""
Side = Source | Sequence[Source]
"""One side of a diff: a run, several runs of the same program (a list, or a folder holding
their files), pooled."""
RUN_SUFFIXES: Final = (".parquet", ".json", ".json.gz")
"""Files of a folder given as one side that are taken as its runs (traces and summaries)."""
TEXT_WIDTH: Final = 80
LISTED: Final = 15
"""Keys listed per verdict in the text and Markdown reports."""
MOVED: Final = (Verdict.REGRESSED.value, Verdict.IMPROVED.value)


@dataclass
class Diff:
    """The comparison of two runs.

    Attributes:
        table: one row per key of either run; columns ``level, kind, key, base_count,
            new_count, base_total_ns, new_total_ns, base_median_ns, new_median_ns, delta_ns,
            ratio, p_value, verdict, explains`` and, after them, ``name, parent_key, q_value
            (Benjamini-Hochberg), test, base_samples, new_samples, base_cv, new_cv, note``.
        changes: changes of structure (``change, level, key, base, new, note``).
        breakdown: the rows of ``table`` that explain the delta, top-down, with a ``depth``.
        verdict: ``regressed`` if any key regressed, else ``improved`` if any improved, else
            ``unchanged``.
        warnings: what makes the comparison less trustworthy (noise above the threshold,
            levels only one run has, too few steps).
    """

    table: pd.DataFrame
    changes: pd.DataFrame
    breakdown: pd.DataFrame
    verdict: Verdict
    warnings: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)
    """What the base run was (its name, steps, device, versions)."""
    new: dict[str, Any] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """Any key regressed, improved, added or removed."""
        return bool((self.table[d.VERDICT] != Verdict.UNCHANGED.value).any())

    def rows(self, verdict: Verdict | str) -> pd.DataFrame:
        """The rows with one verdict, largest change first."""
        value = Verdict(verdict).value
        rows = self.table[self.table[d.VERDICT] == value]
        return rows.iloc[np.argsort(-np.abs(rows[d.DELTA_NS].to_numpy(dtype=np.float64)), kind="stable")]

    def to_text(self, width: int = TEXT_WIDTH) -> str:
        """A plain-text report that fits ``width`` columns."""
        lines = [f"xsp diff: {self.verdict.value.upper()}  ({_counts(self.table)})",
                 _clip(f"base: {_describe(self.base)}", width), _clip(f"new:  {_describe(self.new)}", width),
                 _wrap(_settings_line(self.settings), width, "  ")]
        models = self._models()
        if len(models):
            lines += ["", "Model (median per step):"] + [_key_line(row, width - 11) + f" {row.verdict:>10}"
                                                         for row in models.itertuples(index=False)]
        if len(self.breakdown):
            lines += ["", f"Where it lives (change per step{_judged_suffix(self.settings)}):"]
            lines += [_tree_line(row, width) for row in self.breakdown.itertuples(index=False)]
        for verdict in (Verdict.REGRESSED, Verdict.IMPROVED):
            rows = self.rows(verdict)
            if len(rows):
                lines += ["", f"{verdict.value.capitalize()} ({len(rows)}):"]
                lines += [_key_line(row, width) for row in rows.head(LISTED).itertuples(index=False)]
                if len(rows) > LISTED:
                    lines.append(f"  ... and {len(rows) - LISTED} more")
        if len(self.changes):
            lines += ["", "Changes of structure:"]
            listed = self.changes.head(LISTED).itertuples(index=False)
            lines += [_clip(f"  {_change_text(row)}", width) for row in listed]
            if len(self.changes) > LISTED:
                lines.append(f"  ... and {len(self.changes) - LISTED} more")
        if self.warnings:
            lines += ["", "Warnings:"] + [_wrap(f"- {one_line(w)}", width, "  ") for w in self.warnings]
        return "\n".join(lines) + "\n"

    def _models(self) -> pd.DataFrame:
        """The model-level keys compared in both runs, at most :data:`LISTED`."""
        table = self.table
        chosen = table[(table[col.LEVEL] == Level.MODEL.value) & table[d.PARENT_KEY].isna()
                       & (table[col.KIND] != col.SpanKind.SESSION.value)
                       & (table[d.BASE_SAMPLES] > 0) & (table[d.NEW_SAMPLES] > 0)]
        return chosen.head(LISTED)

    def to_markdown(self) -> str:
        """A Markdown report for a pull-request comment or a CI step summary."""
        moved = self.rows(Verdict.REGRESSED)
        improved = self.rows(Verdict.IMPROVED)
        out = [f"## xsp diff: **{self.verdict.value}**", "",
               f"{_counts(self.table)}. Base: {markdown_text(_describe(self.base))}. "
               f"New: {markdown_text(_describe(self.new))}.", "",
               f"_{markdown_text(_settings_line(self.settings))}_", ""]
        models = self._models()
        if len(models):
            out += ["| model | base | new | ratio | verdict |", "| --- | ---: | ---: | ---: | --- |"]
            out += [f"| {markdown_code(row.key)} | {_time(row.base_median_ns)} | {_time(row.new_median_ns)} | "
                    f"{_ratio(row.ratio)} | {row.verdict} |" for row in models.itertuples(index=False)]
            out.append("")
        if len(self.breakdown):
            tree = [_tree_line(row, 100) for row in self.breakdown.itertuples(index=False)]
            fence = "`" * max(3, 1 + max((len(run) for line in tree for run in re.findall("`+", line)), default=0))
            out += [f"### Where it lives (change per step{_judged_suffix(self.settings)})", "", fence]
            out += [*tree, fence, ""]
        for title, rows in (("Regressed", moved), ("Improved", improved)):
            if not len(rows):
                continue
            judged = self.settings.get("judged", "raw times") != "raw times"
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
        if len(self.changes):
            out += ["### Changes of structure", ""]
            out += [f"- {markdown_text(_change_text(row))}"
                    for row in self.changes.head(LISTED).itertuples(index=False)]
            out.append("")
        if self.warnings:
            out += ["### Warnings", ""] + [f"- {markdown_text(w, 2000)}" for w in self.warnings] + [""]
        return "\n".join(within(out))

    def to_json(self) -> str:
        """``{"verdict": ..., "rows": [...], ...}``: each row holds the columns of ``table``."""
        document = {
            "verdict": self.verdict.value,
            "rows": _records(self.table),
            "changes": _records(self.changes),
            "breakdown": _records(self.breakdown[[d.DEPTH, col.LEVEL, d.KEY, d.DELTA_NS, d.RATIO, d.EXPLAINS,
                                                  d.VERDICT]] if len(self.breakdown) else self.breakdown),
            "warnings": self.warnings,
            "settings": self.settings,
            "base": self.base,
            "new": self.new,
        }
        return json.dumps(document, indent=1, allow_nan=False, default=str) + "\n"

    def to_junit(self) -> str:
        """JUnit XML: one testcase per compared key, a failure for each regression."""
        suite = ET.Element("testsuite", name="xsp diff", tests=str(len(self.table)),
                           failures=str(int((self.table[d.VERDICT] == Verdict.REGRESSED.value).sum())),
                           errors="0", skipped="0")
        properties = ET.SubElement(suite, "properties")
        for name, value in self.settings.items():
            shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            ET.SubElement(properties, "property", name=name, value=xml_text(shown))
        for row in self.table.itertuples(index=False):
            case = ET.SubElement(suite, "testcase", classname=f"xsp.{xml_text(str(row.level))}",
                                 name=xml_text(str(row.key)), time=f"{_seconds(row.new_median_ns):.6f}")
            if row.verdict == Verdict.REGRESSED.value:
                failure = ET.SubElement(case, "failure", type="regression",
                                        message=f"{_signed_time(row.delta_ns)} ({_ratio(row.ratio)}) per step, "
                                                f"q={_p(row.q_value)}")
                failure.text = xml_text(_key_line(row, 200).strip())
            else:
                ET.SubElement(case, "system-out").text = f"{row.verdict}: {_signed_time(row.delta_ns)}"
        suites = ET.Element("testsuites")
        suites.append(suite)
        ET.indent(suites)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def diff(base: Side, new: Side, by: KeyBy | str = "path", levels: Iterable[str | Level] | str | None = None,
         threshold: float = 0.05, min_delta_us: float = 20.0, alpha: float = 0.01,
         steps: slice | list[int] | None = None, normalize: bool = False, machine_speed: bool = True) -> Diff:
    """Compare two runs: which keys got slower or faster, where the delta lives, what changed shape.

    Args:
        base: the reference run: a :class:`xsp.Trace`, a path ``xsp.load`` reads (xsp,
            Kineto or leveled traces), or a baseline summary (``xsp summary``, ``.xsp.json``).
        new: the run under test, the same kinds of things. Either side may be several runs
            of the same program (a list, or a folder of their files): their steps are pooled,
            and a key must then also move between the runs' medians beyond their spread (see
            :func:`xsp.analysis.diff.compare`), which keeps a process that happened to run
            slower from failing a check. Three runs a side is a good start on a shared machine.
        by: ``"path"`` matches spans by their place in the model; ``"name"`` aggregates
            by level and name (as HolisticTraceAnalysis compares).
        levels: the levels compared (default: every level both runs recorded).
        threshold: the smallest relative change of a key's median per-step time reported.
        min_delta_us: the smallest absolute change reported, in microseconds per step.
        alpha: the false-discovery rate of the rank tests over all keys.
        steps: the steps compared, as step numbers or a slice of each run's steps in order
            (``slice(5, None)`` leaves out five warm-up steps). Default: every span, in
            steps or not. Summaries keep the steps they were made from.
        normalize: judge each key against the new run's common shift (the median change of all
            keys) instead of absolutely. A view for attribution (which keys moved more than the
            rest): it cannot see a change that slows every key alike.
        machine_speed: where both runs timed xsp's fixed work on their machine
            (:mod:`xsp.machine_speed`) and the times differ by more than 5%, divide the new run's
            times by their ratio before judging (the output says so); False judges raw times.

    Every key, the model's first, is judged on its own times: a uniform slowdown (every layer
    slower) is a regression, and only the measured speed of the two machines, not how many
    keys moved together, tells a slower CI runner from slower code.

    Raises:
        xsp.XspError: a run could not be read.
        ValueError: a setting out of range.
    """
    key_by = KeyBy(by)
    if not 0 <= threshold < 10:
        raise ValueError(f"threshold must be a fraction such as 0.05, not {threshold}")
    if min_delta_us < 0:
        raise ValueError("min_delta_us must not be negative")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1, not {alpha}")
    chosen = parse_levels(levels) if levels is not None else None
    (base_keys, base_info), (new_keys, new_info) = _side(base, steps, key_by), _side(new, steps, key_by)
    warnings: list[str] = []
    recorded = [set(keys[col.LEVEL].dropna().tolist()) for keys in (base_keys, new_keys)]
    if chosen is None:
        only = recorded[0] ^ recorded[1]
        if only:
            warnings.append(f"level(s) {', '.join(sorted(only))} recorded in one run only: left out "
                            f"(name them in levels= to compare them anyway)")
        kept = recorded[0] & recorded[1]
    else:
        kept = {level.value for level in chosen}
    base_keys = base_keys[base_keys[col.LEVEL].isin(kept)]
    new_keys = new_keys[new_keys[col.LEVEL].isin(kept)]
    measured_speed = speed_ratio(base_info.get(MACHINE_SPEED), new_info.get(MACHINE_SPEED))
    speed = measured_speed if (machine_speed and not normalize and measured_speed is not None
                               and abs(math.log(measured_speed)) >= math.log1p(SAME_SPEED)) else 1.0
    table = d.compare(base_keys, new_keys, threshold=threshold, min_delta_ns=round(min_delta_us * 1000), alpha=alpha,
                      normalize=normalize, speed=speed)
    shift = float(table.attrs.get(d.COMMON_SHIFT, 1.0))
    warnings += _speed_warnings(shift, measured_speed, speed, normalize)
    level_rank = {level.value: level.rank for level in Level}
    rank = table[col.LEVEL].map(level_rank).fillna(len(Level))
    order = np.lexsort((-np.abs(table[d.DELTA_NS].to_numpy(dtype=np.float64)), rank.to_numpy(dtype=np.int64)))
    table = table.iloc[order].reset_index(drop=True)
    for row in d.noisy_keys(table, threshold).itertuples(index=False):
        worst = max(v for v in (row.base_cv, row.new_cv) if not math.isnan(v))
        warnings.append(f"{row.key} varies {worst:.0%} between steps (coefficient of variation; base "
                        f"{_pct(row.base_cv)}, new {_pct(row.new_cv)}), more than the {threshold:.0%} threshold: "
                        f"small changes cannot be told from noise (warm up, pin threads, run more steps)")
    tested = table[table[d.TEST].isin([d.Test.RANK.value, d.Test.RANK_AND_RUNS.value])]
    unjudged_top = ((table[d.VERDICT] == Verdict.UNCHANGED.value) & table[d.PARENT_KEY].isna()
                    & (table[d.BASE_SAMPLES] > 0))
    if not len(tested) and unjudged_top.any():
        warnings.append(f"fewer than {d.MIN_RANK_SAMPLES} steps on a side: no rank test was possible "
                        "(record more steps for a verdict that holds)")
    elif len(tested):
        smallest = d.smallest_p(int(tested[d.BASE_SAMPLES].min()), int(tested[d.NEW_SAMPLES].min()))
        if smallest * len(tested) > alpha:
            warnings.append(f"with {int(tested[d.BASE_SAMPLES].min())} and {int(tested[d.NEW_SAMPLES].min())} "
                            f"samples, even a complete separation (p={smallest:.2g}) may not pass a "
                            f"false-discovery rate of {alpha} over {len(tested)} keys: record more steps")
    settings = {"by": key_by.value, "threshold": threshold, "min_delta_us": min_delta_us, "alpha": alpha,
                "levels": sorted(kept, key=lambda v: level_rank.get(v, len(Level))),
                "keys_tested": len(tested), "normalize": normalize,
                "common_shift": round(shift, 4),
                "machine_speed_ratio": None if measured_speed is None else round(measured_speed, 4),
                "judged_factor": round(float(table.attrs.get(d.JUDGED_FACTOR, 1.0)), 4),
                "judged": "against the common shift" if normalize else (
                    "at equal machine speed" if speed != 1.0 else "raw times"),
                "base_runs": int(base_info.get("runs") or 1),
                "new_runs": int(new_info.get("runs") or 1)}
    return Diff(table=table, changes=d.structure_changes(base_keys, new_keys, table), breakdown=d.breakdown(table),
                verdict=d.overall_verdict(table), warnings=warnings, settings=settings,
                base=base_info, new=new_info)


def _speed_warnings(shift: float, measured: float | None, speed: float, normalize: bool) -> list[str]:
    """What the reader must know of the two machines' speeds and of keys moving together."""
    said = []
    if speed != 1.0:
        said.append(f"the new run's machine took {measured:.2f}x the base's time for xsp's fixed work "
                    f"(machine_speed in each run's metadata): the new run's times were divided by {measured:.2f} "
                    "before they were judged; the medians shown are as measured")
    if abs(shift - 1.0) < 0.01:
        return said
    moved = f"most keys moved together by {_ratio(shift)} (the new run's common shift)"
    if normalize:
        said.append(f"{moved}; keys were judged against that shift, which hides any change that slows every "
                    "key alike: judge raw times for a check")
    elif measured is None:
        said.append(f"{moved}; one run has no machine speed recorded (an older or imported trace), so a slower "
                    "machine cannot be told from slower code: record both runs with this xsp")
    elif speed == 1.0:
        said.append(f"{moved}, and both machines ran xsp's fixed work at the same speed (within "
                    f"{SAME_SPEED:.0%}): the change is the program's")
    return said


def _one_rank(trace: Trace, name: object) -> Trace:
    """A trace of one process: the steps of several ranks would pool into one sample."""
    if len(trace.ranks) > 1:
        example = rank_path(name, trace.ranks[0]).name if isinstance(name, (str, os.PathLike)) else "a rank's file"
        raise ValueError(f"{name} holds {len(trace.ranks)} ranks of a distributed job: compare one rank's file "
                         f"({example}) or trace.for_rank(r)")
    return trace


def _side(side: Side, steps: slice | list[int] | None, by: KeyBy) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The key-samples frame of one side (its runs pooled) and what it was."""
    folder = None
    if isinstance(side, (str, os.PathLike)) and Path(side).is_dir():
        folder = Path(side)
        runs: list[Source] = [path for path in sorted(folder.iterdir()) if path.is_file()
                              and not path.name.startswith(".") and path.name.endswith(RUN_SUFFIXES)]
        if not runs:
            raise TraceNotFoundError(f"{folder} holds no traces or summaries (files ending in "
                                     f"{', '.join(RUN_SUFFIXES)})")
    elif isinstance(side, Sequence) and not isinstance(side, (str, Trace)):
        runs = list(side)
        if not runs:
            raise ValueError("a side of the diff given as a list needs at least one run")
    else:
        runs = [side]
    summaries = [_summary(run, steps, by) for run in runs]
    if len(summaries) == 1:
        return summaries[0].keys[by], summaries[0].metadata
    info = dict(summaries[0].metadata)
    info["runs"] = len(summaries)
    info["source"] = folder.name if folder is not None else f"{info.get('source') or 'trace'} and others"
    info["steps"] = sum(int(summary.metadata.get("steps") or 0) for summary in summaries) or None
    info[MACHINE_SPEED] = _pooled_speed([summary.metadata.get(MACHINE_SPEED) for summary in summaries])
    return d.pool_runs([summary.keys[by] for summary in summaries]), info


def _pooled_speed(speeds: list[Any]) -> dict[str, Any] | None:
    """The machine times of several runs: each probe's median, when every run has the same probes."""
    if not speeds or not all(isinstance(speed, dict) for speed in speeds):
        return None
    if len({speed.get("version") for speed in speeds}) != 1:
        return None
    pooled: dict[str, Any] = {"version": speeds[0].get("version")}
    for name in speeds[0]:
        values = [speed.get(name) for speed in speeds]
        if name != "version" and all(isinstance(value, (int, float)) for value in values):
            pooled[name] = float(np.median(values))
    return pooled


def _summary(source: Source, steps: slice | list[int] | None, by: KeyBy) -> Summary:
    if isinstance(source, Summary):
        summary = source
    elif isinstance(source, Trace):
        summary = summarize(_one_rank(source, "the trace"), steps=steps,
                            source=source.source.name if source.source else None, only=by)
    elif is_summary_path(source):
        summary = Summary.load(source)
    else:
        summary = summarize(_one_rank(load(source), source), steps=steps, source=Path(source).name, only=by)
    if by not in summary.keys:
        raise TraceFormatError(f"the summary of {summary.metadata.get('source', 'a run')} has no keys by {by.value}")
    return summary


# --- formatting ------------------------------------------------------------------------------


def _counts(table: pd.DataFrame) -> str:
    verdicts = table[d.VERDICT].value_counts()
    parts = [f"{int(verdicts.get(v.value, 0))} {v.value}" for v in Verdict if verdicts.get(v.value, 0)]
    return f"{len(table)} keys: " + ", ".join(parts) if parts else "no keys"


def _describe(info: dict[str, Any]) -> str:
    parts = [one_line(str(info.get("source") or "trace"))]
    if info.get("runs"):
        parts.append(f"{info['runs']} runs")
    if info.get("steps"):
        parts.append(f"{info['steps']} steps")
    if info.get("device"):
        parts.append(str(info["device"]))
    return ", ".join(parts)


def _settings_line(settings: dict[str, Any]) -> str:
    shift = settings.get("common_shift", 1.0)
    factor = settings.get("judged_factor", 1.0)
    if settings.get("normalize"):
        judged = f"; judged against the common shift {_ratio(shift)}"
    elif factor != 1.0:
        judged = f"; judged at equal machine speed (new times / {factor:.2f})"
    else:
        judged = "; raw times judged"
    speed = settings.get("machine_speed_ratio")
    machines = (f"; new machine {speed:.2f}x the base's time for xsp's fixed work" if speed is not None
                else "; machine speed not recorded in both runs")
    return (f"by {settings.get('by')} at {', '.join(settings.get('levels', []))}; threshold "
            f"{settings.get('threshold', 0):.0%}, min delta {settings.get('min_delta_us'):g} µs, "
            f"FDR {settings.get('alpha')} ({settings.get('keys_tested')} keys tested){judged}{machines}")


def _judged_suffix(settings: dict[str, Any]) -> str:
    if settings.get("normalize"):
        return ", against the common shift"
    return ", at equal machine speed" if settings.get("judged_factor", 1.0) != 1.0 else ""


def _tree_line(row: Any, width: int) -> str:
    depth = int(row.depth)
    label = ("  " * (depth - 1) + "└ " if depth else "") + one_line(_short_key(str(row.key)))
    share = f"{_share(row.explains)} of parent" if depth else ""
    tail = f"{_signed_time(row.adjusted_delta_ns):>10} {_ratio(row.adjusted_ratio):>7} {share:>13} {row.verdict:<9}"
    room = max(width - len(tail) - 3, 10)
    return f"  {_clip(label, room):<{room}} {tail}".rstrip()


def _short_key(key: str) -> str:
    """A path's last part (the span's name and index); a name as it is."""
    return key.rsplit("/", 1)[-1]


def _key_line(row: Any, width: int) -> str:
    judged = "" if row.adjusted_ratio == row.ratio or math.isnan(row.adjusted_ratio) else (
        f" ({_ratio(row.adjusted_ratio)} judged)")
    tail = (f"{_time(row.base_median_ns):>9} -> {_time(row.new_median_ns):>9} {_ratio(row.ratio):>7}{judged} "
            f"q={_p(row.q_value)}")
    room = max(width - len(tail) - 3, 10)
    return f"  {_clip_left(one_line(str(row.key)), room):<{room}} {tail}"


def _change_text(row: Any) -> str:
    text = f"{row.change}: {row.key} ({row.level})"
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


def _ratio(ratio: float) -> str:
    return "-" if ratio is None or math.isnan(ratio) else f"{(ratio - 1) * 100:+.1f}%"


def _share(share: float) -> str:
    return "-" if share is None or math.isnan(share) else f"{share:.0%}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _p(p: float) -> str:
    return "-" if p is None or math.isnan(p) else f"{p:.2g}"


def _seconds(ns: float) -> float:
    return 0.0 if ns is None or math.isnan(ns) else float(ns) / 1e9


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _clip_left(text: str, width: int) -> str:
    """The end of ``text`` (a path's end names the span) in ``width`` characters."""
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _wrap(text: str, width: int, indent: str) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent))


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    records = []
    for record in frame.to_dict(orient="records"):
        records.append({key: _plain(value) for key, value in record.items()})
    return records


def _plain(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if value is pd.NA:
        return None
    return value
