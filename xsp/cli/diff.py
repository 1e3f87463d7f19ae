"""``xsp diff``: compare two runs and fail a CI check when one got slower."""

from __future__ import annotations

import argparse
import enum
import math
import os
import re
from typing import TYPE_CHECKING, Any, Final

from xsp.cli._common import (
    CliError,
    add_step_selection,
    check_not_a_trace_name,
    check_output,
    console,
    error_console,
    steps_kept,
)
from xsp.gate.diff_columns import Verdict

if TYPE_CHECKING:
    from xsp.gate.diff import Diff


class FailOn(str, enum.Enum):
    REGRESSION = "regression"
    CHANGE = "change"
    NEVER = "never"


class Format(str, enum.Enum):
    TEXT = "text"
    MARKDOWN = "markdown"
    JSON = "json"
    JUNIT = "junit"


REGRESSION_FOUND = 1
INCONCLUSIVE = 3
"""Nothing regressed, but a regression of the threshold could not have been seen (not a pass)."""
STEP_SUMMARY = "GITHUB_STEP_SUMMARY"
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ns|us|µs|ms|s)?\s*$")
_SCALE_US = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6, None: 1.0}


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "diff", help="compare two runs: what got slower, where, and whether it is real",
        description="Compare a base run with a new one key by key (a span's path, or its level and name). A key "
                    "is regressed only when its median per-step time changed by at least --threshold and "
                    "--min-delta and a Mann-Whitney U test says so at a false-discovery rate of --alpha over all "
                    "keys, the keys below a key judged only when it changed. Exit 0 when nothing fails, 1 when a "
                    "regression (or, with --fail-on change, any change) is found, 2 on bad input or when no key "
                    "could be judged, 3 when nothing regressed but a change of --threshold could not have been "
                    "detected (too few steps, too noisy a machine: the report says what would settle it).")
    parser.add_argument("base", help="the reference run: a trace (.xsp.parquet, Kineto .json[.gz], Nsight "
                                     ".sqlite) or a summary "
                                     "(.xsp-summary.parquet, from xsp summary); or a folder of several runs' files, "
                                     "pooled (a key must then also move beyond the spread between runs)")
    parser.add_argument("new", help="the run under test, the same kinds of file or folder")
    parser.add_argument("--by", choices=("path", "name", "line"), default="path",
                        help="match spans by their path in the model (default), by level and name, or by the line "
                             "of your code that made the calls")
    add_step_selection(parser, "levels compared, e.g. model,layer (default: those both runs recorded)",
                       "leave out each trace's first N steps (warm-up)")
    parser.add_argument("--threshold", default="5%", help="smallest relative change reported (default: 5%%)")
    parser.add_argument("--min-delta", default="20us", help="smallest change per step reported (default: 20us)")
    parser.add_argument("--alpha", type=float, default=0.01, help="false-discovery rate (default: 0.01)")
    parser.add_argument("--relative", action="store_true",
                        help="judge each key against the new run's common shift (the median change of all keys) "
                             "instead of its own times: shows which keys moved more than the rest, and cannot see a "
                             "change that slows every key alike, so it is no check")
    parser.add_argument("--raw", action="store_true",
                        help="judge raw times at the threshold given, even where the two machines' speeds differ "
                             "or varied (by default the new run's times are divided by how much slower its machine "
                             "ran xsp's fixed work, and the threshold is raised to how much that work varied)")
    parser.add_argument("--absolute", action="store_true", help=argparse.SUPPRESS)  # the default since 0.1
    parser.add_argument("--format", choices=[f.value for f in Format], default=Format.TEXT.value)
    parser.add_argument("-o", "--output", default=None, help="write the report here instead of to stdout")
    parser.add_argument("--fail-on", choices=[f.value for f in FailOn], default=FailOn.REGRESSION.value,
                        help="what makes the exit status 1 (default: regression)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.io.outputs import write_text_output
    if options.output is not None:
        for source in (options.base, options.new):
            check_output(options.output, source)
        check_not_a_trace_name(options.output, f"a {options.format} report")
    steps = steps_kept(options)
    from xsp.gate.diff import diff  # scipy and the analyses, only for this command

    result = diff(options.base, options.new, by=options.by, levels=options.levels,
                  threshold=parse_share(options.threshold), min_delta_us=parse_duration_us(options.min_delta),
                  alpha=options.alpha, steps=steps,
                  normalize=options.relative, machine_speed=not options.raw)
    form = Format(options.format)
    text = render(result, form)
    if options.output is not None:
        write_text_output(options.output, text)
        error_console().print(f"xsp diff: {result.verdict.value} -> {options.output} ({form.value})", markup=False)
    else:
        console().file.write(text)
    if form is Format.MARKDOWN and os.environ.get(STEP_SUMMARY):
        try:
            with open(os.environ[STEP_SUMMARY], "a", encoding="utf-8") as summary:
                summary.write(text if text.endswith("\n") else text + "\n")
        except OSError as exc:  # the verdict stands, and its status with it: the summary is a copy
            error_console().print(f"xsp: warning: the report could not be added to the step summary "
                                  f"(${STEP_SUMMARY}={os.environ[STEP_SUMMARY]}): {exc.strerror or exc}", markup=False)
    unjudged = result.nothing_judged()
    if unjudged is not None and FailOn(options.fail_on) is not FailOn.NEVER:
        # a gate that compared nothing must not pass: the report above says what there was
        raise CliError(f"no key could be judged, so there is no verdict: {unjudged}")
    fail_on = FailOn(options.fail_on)
    if fails(result, fail_on):
        return REGRESSION_FOUND
    # a gate without the evidence to pass does not pass (--fail-on never: the report only)
    return INCONCLUSIVE if result.verdict is Verdict.INCONCLUSIVE and fail_on is not FailOn.NEVER else 0


def render(result: Diff, form: Format) -> str:
    from xsp.reports import diff_formats

    if form is Format.MARKDOWN:
        return diff_formats.markdown(result)
    if form is Format.JSON:
        return diff_formats.as_json(result)
    if form is Format.JUNIT:
        return diff_formats.junit(result)
    return diff_formats.text(result)


def fails(result: Diff, fail_on: FailOn) -> bool:
    if fail_on is FailOn.NEVER:
        return False
    if fail_on is FailOn.CHANGE:
        return result.changed
    return result.verdict is Verdict.REGRESSED


MAX_THRESHOLD: Final = 10.0
"""The threshold :func:`xsp.gate.diff.diff` takes below (1000%)."""


def parse_share(text: str) -> float:
    """``5%`` or ``0.05`` -> 0.05; a bare number over 1 (``5``: 500% or 5%?) is refused."""
    value = text.strip()
    try:
        share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        raise CliError(f"--threshold {text!r} is not a share such as 5% or 0.05") from None
    if not math.isfinite(share) or share < 0:
        raise CliError(f"--threshold {text!r} is not a share such as 5% or 0.05")
    if share > 1 and not value.endswith("%"):
        raise CliError(f"--threshold {text} would be {share:.0%}: write {value}% for {value} percent, "
                       f"or {share / 100:g} as a fraction")
    if share >= MAX_THRESHOLD:
        raise CliError(f"--threshold {text} is not below {MAX_THRESHOLD:.0%}: no change would be reported")
    return share


def parse_duration_us(text: str) -> float:
    """``20us``, ``0.5ms``, ``20`` (microseconds) -> microseconds."""
    match = _DURATION.match(text)
    if not match:
        raise CliError(f"--min-delta {text!r} is not a duration such as 20us or 0.5ms")
    return float(match.group(1)) * _SCALE_US[match.group(2)]
