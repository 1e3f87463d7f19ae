"""``xsp.diff``: did a change make the model slower, where, and by how much.

Two runs (traces, Kineto traces, leveled traces or baseline summaries) are compared key by
key with the statistics of :mod:`xsp.gate.comparison`; :class:`Diff` holds the result and
writes it as text, Markdown (pull-request comments), JUnit XML or JSON.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import contention
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError
from xsp.core.figures import change_percent as _ratio
from xsp.core.figures import percent as _pct
from xsp.core.levels import missing_levels, parse_levels
from xsp.core.machine_speed import METADATA_KEY as MACHINE_SPEED
from xsp.core.machine_speed import SAME_SPEED, machine_spread, speed_ratio, steady
from xsp.core.schema import Level, SpanKind
from xsp.gate import comparison, significance, verdicts
from xsp.gate import diff_columns as dcol
from xsp.gate import key_samples as keyed
from xsp.gate.baseline import Summary, is_summary_path, one_process, summarize, summarize_file
from xsp.gate.diff_columns import KeyBy, Verdict
from xsp.io.trace import Trace

Source = Trace | Summary | str | os.PathLike[str]
"""One run ``xsp.diff`` compares: a trace, a file ``xsp.load`` reads, or a baseline summary."""
Side = Source | Sequence[Source]
"""One side of a diff: a run, several runs of the same program (a list, or a folder holding
their files), pooled."""
RUN_SUFFIXES: Final = (".parquet", ".json", ".json.gz", ".sqlite")
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
        verdict: ``regressed`` if any key regressed; else ``inconclusive`` if a change of the
            threshold at a top-level key (a model call, a step) could not have been detected
            (:attr:`inconclusive` says why); else ``improved`` if any improved; else ``unchanged``.
        warnings: what makes the comparison less trustworthy (noise above the threshold,
            levels only one run has, too few steps).
    """

    table: pd.DataFrame
    changes: pd.DataFrame
    breakdown: pd.DataFrame
    verdict: Verdict
    warnings: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    inconclusive: list[str] = field(default_factory=list)
    """Why the comparison could not have detected a change of the threshold at a top-level key,
    and what would make it conclusive (empty where it could)."""
    base: dict[str, Any] = field(default_factory=dict)
    """What the base run was (its name, steps, device, versions)."""
    new: dict[str, Any] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """Any key regressed, improved, added or removed."""
        return bool((self.table[dcol.VERDICT] != Verdict.UNCHANGED.value).any())

    def nothing_judged(self) -> str | None:
        """Why no key was judged (the runs share none, or have too few steps a side), or None
        where some was: a verdict of ``unchanged`` then means only that nothing was compared."""
        table = self.table
        both = table[(table[dcol.BASE_SAMPLES] > 0) & (table[dcol.NEW_SAMPLES] > 0)]
        if (both[dcol.TEST] != dcol.Test.NONE.value).any():
            return None
        if table.empty and self.settings.get("by") == dcol.KeyBy.LINE.value:
            return ("neither run recorded the lines of code that made its calls (xsp records them with the layers "
                    "it traces; an imported trace has none): compare by name or path")
        if table.empty:
            return "neither run has spans at the levels compared: there is nothing to compare"
        shared = both[both[col.KIND] != SpanKind.SESSION.value] if col.KIND in both else both
        if shared.empty:  # (the session's own span: one a run, in any two)
            return (f"the runs share no key at the levels compared but the session ({len(table)} keys, the others "
                    "each in one run only): are they runs of one program?")
        return (f"{len(shared)} keys are in both runs, but too few steps a side to judge any "
                f"(base {self.base.get('steps', '?')}, new {self.new.get('steps', '?')}): record at least "
                f"{dcol.MIN_RANK_SAMPLES} steps a side")

    def rows(self, verdict: Verdict | str) -> pd.DataFrame:
        """The rows with one verdict, largest change first."""
        value = Verdict(verdict).value
        rows = self.table[self.table[dcol.VERDICT] == value]
        return rows.iloc[np.argsort(-np.abs(rows[dcol.DELTA_NS].to_numpy(dtype=np.float64)), kind="stable")]


    def models(self, limit: int | None = LISTED) -> pd.DataFrame:
        """The model-level keys compared in both runs, at most ``limit`` (all with None)."""
        table = self.table
        chosen = table[(table[col.LEVEL] == Level.MODEL.value) & table[dcol.PARENT_KEY].isna()
                       & (table[col.KIND] != col.SpanKind.SESSION.value)
                       & (table[dcol.BASE_SAMPLES] > 0) & (table[dcol.NEW_SAMPLES] > 0)]
        return chosen if limit is None else chosen.head(limit)


def diff(base: Side, new: Side, by: KeyBy | str = "path", levels: Iterable[str | Level] | str | None = None,
         threshold: float = 0.05, min_delta_us: float = 20.0, alpha: float = 0.01,
         steps: slice | list[int] | None = None, normalize: bool = False, machine_speed: bool = True) -> Diff:
    """Compare two runs: which keys got slower or faster, where the delta lives, what changed shape.

    Args:
        base: the reference run: a :class:`xsp.Trace`, a path ``xsp.load`` reads (xsp,
            Kineto or leveled traces), or a baseline summary (``xsp summary``, ``.xsp-summary.parquet``).
        new: the run under test, the same kinds of things. Either side may be several runs
            of the same program (a list, or a folder of their files): their steps are pooled,
            and a key must then also move between the runs' medians beyond their spread (see
            :func:`xsp.gate.comparison.compare_keys`), which keeps a process that happened to run
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
            (:mod:`xsp.core.machine_speed`) and the times differ by more than 5%, divide the new run's
            times by their ratio before judging (the output says so); False judges raw times.

    Every key, the model's first, is judged on its own times: a uniform slowdown (every layer
    slower) is a regression, and only the measured speed of the two machines, not how many
    keys moved together, tells a slower CI runner from slower code.

    Raises:
        xsp.XspError: a run could not be read.
        ValueError: a setting out of range, or a level asked for that neither run recorded.
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
    if steps is not None and (base_info.get(SUMMARY_SIDE) or new_info.get(SUMMARY_SIDE)):
        side = "base" if base_info.get(SUMMARY_SIDE) else "new"
        warnings.append(f"the steps chosen (--skip-steps) leave steps out of traces only: the {side} side is a "
                        "summary, which keeps the steps it was made from; make it with the same choice (xsp summary "
                        "--skip-steps N) to compare like with like")
        # the session's own span lies outside every step: a trace's chosen steps leave it out, a
        # summary made of all of them keeps it, and it would read as removed (or added)
        base_keys = base_keys[base_keys[col.KIND] != col.SpanKind.SESSION.value]
        new_keys = new_keys[new_keys[col.KIND] != col.SpanKind.SESSION.value]
    recorded = [set(keys[col.LEVEL].dropna().tolist()) for keys in (base_keys, new_keys)]
    if chosen is None:
        only = recorded[0] ^ recorded[1]
        asked = [set(info.get("levels") or ()) for info in (base_info, new_info)]
        # a level both runs recorded, whose spans only one has: compiled code runs no module call
        empty = {level for level in only if all(level in levels for levels in asked)}
        if only - empty:
            warnings.append(f"level(s) {', '.join(sorted(only - empty))} recorded in one run only: left out "
                            f"(name them in levels= to compare them anyway)")
        if empty:
            side = "base" if all(level not in recorded[0] for level in empty) else "new"
            warnings.append(f"level(s) {', '.join(sorted(empty))} recorded in both runs, with spans in one only (the "
                            f"{side} run's code called no module there: torch.compile'd or scripted code runs none): "
                            "left out (name them in levels= to compare them anyway)")
        kept = recorded[0] & recorded[1]
    else:
        kept = {level.value for level in chosen}
        unrecorded = missing_levels(chosen, recorded[0] | recorded[1])
        if unrecorded:
            # a gate that asked for a level neither run has would judge the others and pass
            raise ValueError(f"level(s) {', '.join(unrecorded)} asked for but recorded in neither run "
                             f"(they have {', '.join(sorted(recorded[0] | recorded[1])) or 'no spans'}): "
                             "record them (xsp run --levels) or leave them out of the levels compared")
        for side, other, found in (("base", "new", recorded[0]), ("new", "base", recorded[1])):
            one_sided = missing_levels(chosen, found)
            if one_sided:
                # its spans would all read as removed (or added): a change of structure, not of the program
                raise ValueError(f"level(s) {', '.join(one_sided)} asked for but recorded in the {other} run only "
                                 f"(the {side} run has {', '.join(sorted(found)) or 'no spans'}): record them in both "
                                 "(xsp run --levels) or leave them out of the levels compared")
    base_keys = base_keys[base_keys[col.LEVEL].isin(kept)]
    new_keys = new_keys[new_keys[col.LEVEL].isin(kept)]
    measured_speed = speed_ratio(base_info.get(MACHINE_SPEED), new_info.get(MACHINE_SPEED))
    unsteady = [side for side, info in (("base", base_info), ("new", new_info)) if not steady(info.get(MACHINE_SPEED))]
    speed = measured_speed if (machine_speed and not normalize and measured_speed is not None and not unsteady
                               and abs(math.log(measured_speed)) >= math.log1p(SAME_SPEED)) else 1.0
    # the runs' threads waited for a CPU for different shares of the run (a busy runner): the
    # kernel's count over the whole run, which a probe of milliseconds under the same load is not
    waited = contention.contention_ratio(base_info.get(contention.METADATA_KEY), new_info.get(contention.METADATA_KEY))
    busier = machine_speed and not normalize and contention.is_noticeable(waited, SAME_SPEED)
    if busier and waited is not None:
        speed = waited
    # a machine whose own fixed work varied by X% during the runs cannot tell a change under X%
    # from its noise: the threshold is raised to it (and said), never lowered
    machine_noise = machine_spread(base_info.get(MACHINE_SPEED)) + machine_spread(new_info.get(MACHINE_SPEED))
    judged_threshold = max(threshold, machine_noise) if machine_speed and not normalize else threshold
    waits_ns = (0.0, 0.0)  # judging raw times, or against the common shift: no key is left unjudged for waits
    if machine_speed and not normalize:
        waits_ns = (contention.wait_per_step_ns(base_info.get(contention.METADATA_KEY), base_info.get("steps"),
                                                _step_ns(base_keys, base_info.get("steps"))),
                    contention.wait_per_step_ns(new_info.get(contention.METADATA_KEY), new_info.get("steps"),
                                                _step_ns(new_keys, new_info.get("steps"))))
    table = comparison.compare_keys(base_keys, new_keys, threshold=judged_threshold,
                               min_delta_ns=round(min_delta_us * 1000), alpha=alpha,
                               normalize=normalize, speed=speed, waits_ns=waits_ns)
    waited_keys = int(table.attrs.get(dcol.WAITED_KEYS, 0))
    shift = float(table.attrs.get(dcol.COMMON_SHIFT, 1.0))
    unjudged_shift = float(table.attrs.get(dcol.UNJUDGED_SHIFT, 1.0))
    one_run_a_side = min(int(base_info.get("runs") or 1), int(new_info.get("runs") or 1)) == 1
    warnings += _speed_warnings(shift, measured_speed, speed, normalize, unjudged_shift != 1.0,
                                steady=not unsteady, one_run_a_side=one_run_a_side, by_waits=busier)
    if busier:
        shares = [contention.waited_share(info.get(contention.METADATA_KEY)) for info in (base_info, new_info)]
        warnings.append(f"the runs' threads waited for a CPU {shares[0]:.0%} (base) and {shares[1]:.0%} (new) of the "
                        f"time they were ready to run (a busy machine, as the kernel counted it): the new run's times "
                        f"were divided by {speed:.2f} before they were judged, which can explain a change away, "
                        "never make one")
    if judged_threshold > threshold:
        digits = next((d for d in range(1, 4) if f"{judged_threshold:.{d}%}" != f"{threshold:.{d}%}"), 3) if (
            f"{judged_threshold:.0%}" == f"{threshold:.0%}") else 0  # never "under 5%, not 5%"
        warnings.append(f"the machines' own timing of xsp's fixed work varied by up to {machine_noise:.{digits}%} "
                        f"during these runs (busy machines): changes under {judged_threshold:.{digits}%}, not "
                        f"{threshold:.{digits}%}, "
                        "cannot be told from that noise and are not judged (run on a quieter machine, or pass --raw "
                        "to judge at the threshold given)")
    scatter_floor = float(table.attrs.get(dcol.SCATTER_FLOOR, 0.0))
    if scatter_floor > judged_threshold:
        scatter = float(table.attrs[dcol.KEY_SCATTER])
        warnings.append(f"the keys of these two runs moved against each other by {_pct(scatter)} (robust spread "
                        "of their ratios; processes of one program differ that much here): from one run a side, "
                        f"changes under {scatter_floor:.0%} cannot be told from that and are not judged "
                        "(compare several runs a side for finer verdicts)")
    if unjudged_shift != 1.0:
        warnings.append(f"the whole run moved by {unjudged_shift - 1:+.1%} (its keys' common shift), which the "
                        f"machines' own timing does not explain: separate processes of one program differ by that "
                        f"much on a busy machine, so from one run a side the keys that moved with it (a run's move "
                        f"under {dcol.UNIFORM_SHIFT_FLOOR:.0%}) are not judged; it may be the program's (a library, "
                        "a dtype): compare several runs a side to tell")
    if waited_keys:
        limit_us = contention.PREEMPTION_FACTOR * max(waits_ns) / 1e3
        warnings.append(f"the runs' threads waited for a CPU {waits_ns[0] / 1e3:.0f} µs (base) and "
                        f"{waits_ns[1] / 1e3:.0f} µs (new) a step (a busy machine, as the kernel counted it): "
                        f"{waited_keys} key(s) that changed by less than {limit_us:.0f} µs a step are not judged, "
                        "since a preemption met at the same point of every step of one process looks the same "
                        "(compare several runs a side, or run on a quieter machine; --raw judges them)")
    if unsteady and machine_speed and not normalize and measured_speed is not None:
        whose = "both runs' machines were" if len(unsteady) == 2 else f"the {unsteady[0]} run's machine was"
        warnings.append(f"{whose} too busy to time xsp's fixed work steadily (its rounds disagreed): "
                        + ("no correction for the machines' speed was made (only for the threads' waits, above)"
                           if busier else "times were judged raw, with no machine-speed correction"))
    level_rank = {level.value: level.rank for level in Level}
    rank = table[col.LEVEL].map(level_rank).fillna(len(Level))
    order = np.lexsort((-np.abs(table[dcol.DELTA_NS].to_numpy(dtype=np.float64)), rank.to_numpy(dtype=np.int64)))
    table = table.iloc[order].reset_index(drop=True)
    for row in verdicts.noisy_keys(table, threshold).itertuples(index=False):
        worst = max(v for v in (row.base_cv, row.new_cv) if not math.isnan(v))
        warnings.append(f"{row.key} varies {worst:.0%} between steps (coefficient of variation; base "
                        f"{_pct(row.base_cv)}, new {_pct(row.new_cv)}), more than the {threshold:.0%} threshold: "
                        f"small changes cannot be told from noise (warm up, pin threads, run more steps)")
    tested = table[table[dcol.TEST].isin([dcol.Test.RANK.value, dcol.Test.RANK_AND_RUNS.value])]
    by_interval = int((table[dcol.TEST] == dcol.Test.INTERVAL.value).sum())
    # the session is one sample a run whatever the steps: its being untested says nothing of them
    unjudged_top = ((table[dcol.VERDICT] == Verdict.UNCHANGED.value) & table[dcol.PARENT_KEY].isna()
                    & (table[dcol.BASE_SAMPLES] > 0) & (table[dcol.NEW_SAMPLES] > 0)
                    & (table[col.KIND] != SpanKind.SESSION.value) & (table[dcol.TEST] != dcol.Test.INTERVAL.value))
    if by_interval:
        warnings.append(f"leveled traces: {by_interval} keys judged by their leveled figures' 95% intervals (one "
                        "figure a side; a z test on the difference)")
    by_ranges = int(((table[dcol.TEST] == dcol.Test.OVERLAP.value) & table[dcol.VERDICT].isin(MOVED)).sum())
    if by_ranges:
        warnings.append(f"fewer than {dcol.MIN_RANK_SAMPLES} steps on a side: {by_ranges} key(s) were judged by their "
                        "ranges alone (every step of one run beyond every step of the other), with no rank test "
                        "(record more steps for a verdict that holds)")
    if not len(tested) and unjudged_top.any() and not by_ranges:
        warnings.append(f"fewer than {dcol.MIN_RANK_SAMPLES} steps on a side: no rank test was possible "
                        "(record more steps for a verdict that holds)")
    elif len(tested):
        smallest = significance.smallest_p(int(tested[dcol.BASE_SAMPLES].min()), int(tested[dcol.NEW_SAMPLES].min()))
        family = int(table.attrs.get(dcol.LARGEST_FAMILY, len(tested)))
        if smallest * family > alpha:
            warnings.append(f"with {int(tested[dcol.BASE_SAMPLES].min())} and {int(tested[dcol.NEW_SAMPLES].min())} "
                            f"samples, even a complete separation (p={smallest:.2g}) may not pass a "
                            f"false-discovery rate of {alpha} among {family} keys judged together (the keys below "
                            "one key): record more steps")
    settings: dict[str, Any] = {
                "by": key_by.value, "threshold": threshold, "judged_threshold": round(judged_threshold, 4),
                "min_delta_us": min_delta_us, "alpha": alpha,
                "levels": sorted(kept, key=lambda v: level_rank.get(v, len(Level))),
                "keys_tested": len(tested) + by_interval, "normalize": normalize,
                "common_shift": round(shift, 4),
                "key_scatter": _measured(float(table.attrs.get(dcol.KEY_SCATTER, 0.0))),
                "scatter_floor": round(scatter_floor, 4),
                "unjudged_shift": round(unjudged_shift, 4),
                "machine_speed_ratio": None if measured_speed is None else round(measured_speed, 4),
                "contention_ratio": None if waited is None else round(waited, 4),
                "wait_per_step_us": [round(wait / 1e3, 1) for wait in waits_ns],
                "keys_within_wait": waited_keys,
                "judged_factor": round(float(table.attrs.get(dcol.JUDGED_FACTOR, 1.0)), 4),
                "judged": (dcol.Judged.COMMON_SHIFT if normalize else dcol.Judged.CPU_WAITS if busier
                           else dcol.Judged.MACHINE_SPEED if speed != 1.0 else dcol.Judged.RAW).value,
                "base_runs": int(base_info.get("runs") or 1),
                "new_runs": int(new_info.get("runs") or 1)}
    inconclusive = _inconclusive(table, threshold, alpha, judged_threshold, machine_noise, scatter_floor)
    settings["root_family"] = int(table.attrs.get(dcol.ROOT_FAMILY, 0))
    result = Diff(table=table, changes=verdicts.structure_changes(base_keys, new_keys, table),
                  breakdown=verdicts.breakdown(table),
                  verdict=verdicts.overall_verdict(table, inconclusive=bool(inconclusive)), warnings=warnings,
                  settings=settings, base=base_info, new=new_info, inconclusive=inconclusive)
    if result.verdict is Verdict.INCONCLUSIVE:  # why, and what would make it conclusive: said first
        warnings[:0] = inconclusive
    unjudged = result.nothing_judged()
    if unjudged is not None:  # "unchanged" would read as a verdict (JSON, JUnit, the API): nothing was compared
        result.verdict = Verdict.NO_VERDICT
        warnings.insert(0, f"no key could be judged, so there is no verdict: {unjudged}")
    return result


def _step_ns(keys: pd.DataFrame, steps: object) -> float | None:
    """A run's mean time a step in its top-level spans (its steps, or its model calls where it
    marks none; not the session's), from its keys; None where it cannot be told."""
    if not isinstance(steps, (int, float)) or steps < 1 or keys.empty:
        return None
    top = keys[keys[dcol.PARENT_KEY].isna() & (keys[col.KIND] != SpanKind.SESSION.value)]
    total = float(top[dcol.TOTAL_NS].sum())
    return total / float(steps) if total > 0 else None


def top_level(table: pd.DataFrame) -> pd.DataFrame:
    """The keys a verdict on the whole run rests on: the model calls and steps in both runs
    (the keys without a parent), the session's one sample a run aside."""
    return table[table[dcol.PARENT_KEY].isna() & (table[col.KIND] != col.SpanKind.SESSION.value)
                 & (table[dcol.BASE_SAMPLES] > 0) & (table[dcol.NEW_SAMPLES] > 0)]


def _inconclusive(table: pd.DataFrame, threshold: float, alpha: float, judged_threshold: float,
                  machine_noise: float, scatter_floor: float) -> list[str]:
    """Why a change of ``threshold`` at a top-level key could not have been detected, and what
    would make it detectable (one sentence per key that could not; none: the comparison had
    the evidence it needed). Keys that moved were detected, and need none."""
    reasons = []
    for row in top_level(table).itertuples(index=False):
        if row.verdict in MOVED or row.test == dcol.Test.NONE.value:
            continue  # detected; or one sample a side (no verdict at all, said elsewhere)
        note = row.note if isinstance(row.note, str) else ""
        detectable = float(getattr(row, dcol.DETECTABLE))
        key = f"{row.key} ({row.base_samples} and {row.new_samples} steps)"
        if note.startswith((dcol.WITH_RUN_NOTE, dcol.WAITED_NOTE)):
            reasons.append(f"{key} was not judged ({note.split(':')[0]}): compare several runs a side, or run on a "
                           "quieter machine")
        elif math.isnan(detectable) or detectable <= threshold * (1 + 1e-9):
            continue
        elif math.isinf(detectable):
            enough = next(n for n in range(2, 100) if significance.smallest_p(n, n) <= alpha)
            fewest = max(dcol.MIN_RANK_SAMPLES, enough)
            reasons.append(f"{key}: too few steps to tell a {threshold:.0%} change from noise: record at least "
                           f"{fewest} steps a side")
        elif judged_threshold > threshold and detectable <= judged_threshold * (1 + 1e-9):
            reasons.append(f"{key}: changes under {judged_threshold:.0%} cannot be told from this machine's noise "
                           f"(its own timing of xsp's fixed work varied by {machine_noise:.0%}): run on a quieter "
                           "machine, or pass --raw to judge at the threshold")
        elif scatter_floor > threshold and detectable <= scatter_floor * (1 + 1e-9):
            reasons.append(f"{key}: from one run a side, changes under {scatter_floor:.0%} cannot be told from how "
                           "far processes of this program sit apart: compare several runs a side (3 is a good start)")
        else:
            steps = min(int(row.base_samples), int(row.new_samples))
            needed = math.ceil(steps * (math.log1p(detectable) / math.log1p(threshold)) ** 2)
            reasons.append(f"{key}: its steps vary too much for a {threshold:.0%} change to show (the smallest "
                           f"it could show is {detectable:.0%}): record about {needed:,} steps a side, compare "
                           "several runs a side, or run on a quieter machine")
    if reasons:
        reasons.insert(0, f"INCONCLUSIVE: nothing regressed, but a change of {threshold:.0%} could not have been "
                          "detected here, so this is no evidence that nothing did")
    return reasons


def _measured(value: float) -> float | None:
    """A figure for the settings, rounded; None where it was not measured (NaN)."""
    return None if math.isnan(value) else round(value, 4)


def _speed_warnings(shift: float, measured: float | None, speed: float, normalize: bool,
                    unjudged: bool = False, steady: bool = True, one_run_a_side: bool = False,
                    by_waits: bool = False) -> list[str]:
    """What the reader must know of the two machines' speeds and of keys moving together
    (``unjudged``: the move was left unjudged, which its own warning says; ``steady``: both
    machines timed their fixed work steadily, so that ``measured`` can be trusted;
    ``one_run_a_side``: no side pooled several runs, so the spread between processes is unknown;
    ``by_waits``: ``speed`` is the runs' CPU-wait factor, which its own warning says, not
    ``measured``)."""
    said = []
    same_speed = measured is not None and abs(math.log(measured)) < math.log1p(SAME_SPEED)
    if speed != 1.0 and not by_waits:
        said.append(f"the new run's machine took {measured:.2f}x the base's time for xsp's fixed work "
                    f"(machine_speed in each run's metadata): the new run's times were divided by {measured:.2f} "
                    "before they were judged; the medians shown are as measured")
    if by_waits and measured is not None and not same_speed:
        said.append(f"the new run's machine took {measured:.2f}x the base's time for xsp's fixed work, but the runs "
                    "also waited for a CPU for different shares of their time: the new run's times were corrected "
                    "by those waits (below), not by that ratio")
    if abs(shift - 1.0) < 0.01 or unjudged:
        return said
    moved = f"most keys moved together by {_ratio(shift)} (the new run's common shift)"
    if normalize:
        said.append(f"{moved}; keys were judged against that shift, which hides any change that slows every "
                    "key alike: judge raw times for a check")
    elif measured is None:
        said.append(f"{moved}; one run has no machine speed recorded (an older or imported trace), so a slower "
                    "machine cannot be told from slower code: record both runs with this xsp")
    elif not steady:
        said.append(f"{moved}; the machines were too busy to time their own speed, so a slower machine cannot be "
                    "told from slower code")
    elif by_waits:
        said.append(f"{moved}, after the correction for the runs' CPU waits: it is the program's, or how busy the "
                    "machines were, or how one of these processes fell (compare several runs a side to tell)")
    elif speed == 1.0 and one_run_a_side:  # two processes of one program can sit apart as a whole
        said.append(f"{moved}, and both machines ran xsp's fixed work at the same speed (within "
                    f"{SAME_SPEED:.0%}): the machines do not explain it; it is the program's, or how one of these "
                    "processes fell (compare several runs a side to tell)")
    elif speed == 1.0:
        said.append(f"{moved}, and both machines ran xsp's fixed work at the same speed (within "
                    f"{SAME_SPEED:.0%}): the change is the program's")
    return said


SUMMARY_SIDE: Final = "summary_side"
"""Key of a side's information: it holds a summary made before, which keeps the steps it was made from."""


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
    made_before = any(isinstance(run, Summary) or (isinstance(run, (str, os.PathLike)) and is_summary_path(run))
                      for run in runs)
    if len(summaries) == 1:
        return summaries[0].keys[by], {**summaries[0].metadata, SUMMARY_SIDE: made_before}
    info = dict(summaries[0].metadata)
    info[SUMMARY_SIDE] = made_before
    info["runs"] = len(summaries)
    info["source"] = folder.name if folder is not None else f"{info.get('source') or 'trace'} and others"
    info["steps"] = sum(int(summary.metadata.get("steps") or 0) for summary in summaries) or None
    info[MACHINE_SPEED] = _pooled_speed([summary.metadata.get(MACHINE_SPEED) for summary in summaries])
    info[contention.METADATA_KEY] = contention.pooled([summary.metadata.get(contention.METADATA_KEY)
                                                       for summary in summaries])
    return keyed.pool_runs([summary.keys[by] for summary in summaries]), info


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
        one_process("the trace", source.ranks, "compare")
        summary = summarize(source, steps=steps, source=source.source.name if source.source else None, only=by)
    elif is_summary_path(source):
        summary = Summary.load(source)
        original = summary.metadata.get("source")
        summary.metadata["source"] = Path(source).name + (f" (summary of {original})" if original else "")
    else:
        summary = summarize_file(source, steps=steps, source=Path(source).name, only=by, what="compare")
    if by not in summary.keys:
        raise TraceFormatError(f"the summary of {summary.metadata.get('source', 'a run')} has no keys by {by.value}")
    return summary


# --- formatting ------------------------------------------------------------------------------


