"""``xsp summary``: a run's per-key samples, small enough to commit as a CI baseline."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from xsp.cli._common import (
    TRACE_FILE_HELP,
    CliError,
    add_step_selection,
    beside,
    check_not_a_trace_name,
    check_output,
    error_console,
    steps_kept,
)
from xsp.core.levels import parse_levels
from xsp.core.options import checked_output_name


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "summary", help="write a small baseline of a run for xsp diff",
        description="Keep what xsp diff needs of a run (every key's count, total and per-step samples, at most "
                    "5 quantiles each) in a small Parquet file to commit as the baseline of a CI check: "
                    "xsp diff baseline.xsp-summary.parquet new.xsp.parquet.")
    parser.add_argument("file", help=TRACE_FILE_HELP)
    parser.add_argument("-o", "--output", default=None,
                        help="where to write it (default: FILE with .xsp-summary.parquet in place of its suffix)")
    add_step_selection(parser, "keep only these levels (default: all recorded)", "leave out the first N steps")
    parser.set_defaults(handler=run)


def default_output(path: str, summary_suffix: str) -> str:
    name = Path(path).name
    for suffix in (".xsp.parquet", ".json.gz", ".json", ".parquet", ".sqlite"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return str(beside(path, name + summary_suffix))


def run(options: argparse.Namespace) -> int:
    from xsp.gate.baseline import LEGACY_SUFFIXES, SUFFIX, summarize_file  # the analyses, only for this command

    output = default_output(options.file, SUFFIX) if options.output is None else options.output
    if output.endswith(LEGACY_SUFFIXES):
        raise CliError(f"{output}: summaries are Parquet files now; name it with {SUFFIX}")
    check_output(output, options.file)
    check_not_a_trace_name(output, f"a summary (name it with {SUFFIX})")
    # a .json name: xsp diff would read it as a PyTorch profiler trace (a ValueError: the one line main() says)
    checked_output_name(output, "-o", writes="a Parquet summary", suffix=SUFFIX)
    steps = steps_kept(options)
    levels = parse_levels(options.levels) if options.levels else None
    summary = summarize_file(options.file, levels=levels, steps=steps, source=Path(options.file).name)
    written = summary.save(output)
    size, trace_size = os.path.getsize(written), trace_bytes(options.file)
    keys = len(next(iter(summary.keys.values())))
    share = "" if not trace_size else f", {size / trace_size:.1%} of the trace"
    error_console().print(f"xsp: summary of {keys} keys -> {written} ({size / 1024:.1f} KiB{share})", markup=False)
    return 0


def trace_bytes(path: str) -> int:
    """The bytes of the files the trace at ``path`` is read from: the file; a folder's traces (a
    dataset, a job's ranks); a job's rank files beside the name it was given (0: none found)."""
    from xsp.core.rank import rank_files
    from xsp.io.loading import traces_in

    try:
        if os.path.isdir(path):
            files = traces_in(Path(path))
        elif os.path.isfile(path):
            files = [Path(path)]
        else:
            files = list(rank_files(path).values())
        return sum(file.stat().st_size for file in files)
    except OSError:  # (a TraceNotFoundError too)
        return 0
