"""``xsp report``: print the analyses of a trace."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from xsp.cli._common import (
    TRACE_FILE_HELP,
    CliError,
    check_not_a_trace_name,
    check_output,
    console,
    error_console,
    progress,
)


def register(commands: Any) -> None:
    parser = commands.add_parser("report", help="print the analyses of a trace",
                                 description="Print the analyses that apply to a trace (an .xsp.parquet file, a "
                                             "PyTorch profiler .json/.json.gz or an Nsight Systems .sqlite "
                                             "export): model latency per step, layers, "
                                             "kernels, copies, syncs, idle time, launch overhead, FLOPs.")
    parser.add_argument("file", help=TRACE_FILE_HELP)
    parser.add_argument("--top", type=int, default=10, help="rows in the top lists (default: 10)")
    parser.add_argument("--html", metavar="FILE", default=None,
                        help="also write a self-contained HTML report with charts (works offline)")
    parser.add_argument("--lines", action="store_true",
                        help="also the hottest lines of your code: the line that made each call, its time and text")
    parser.add_argument("--rank", type=int, default=None,
                        help="in a trace of several ranks (a distributed job), the rank reported in detail "
                             "(default: the first)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.io.loading import load_to_analyse
    from xsp.io.trace import Trace
    if options.top < 1:
        raise CliError("--top must be at least 1")
    if options.html is not None:
        from xsp.io.outputs import check_writable

        check_output(options.html, options.file)
        check_not_a_trace_name(options.html, "an HTML report")
        check_writable(options.html)  # before the report is rendered, not after
    job = None
    if options.html is None:  # a job's cross-rank tables, read without loading the job
        from xsp.analysis.job import load_job

        with progress(f"reading the job {options.file}"):
            job = load_job(options.file)
    from xsp.reports.terminal import (  # the analyses, only for this command
        render_job_report,
        render_report,
        render_windowed_report,
    )

    render: Callable[[Any], None]
    if job is not None:
        if options.rank is not None and options.rank not in job.ranks:
            raise CliError(f"{options.file} holds no rank {options.rank} (ranks: {_listed(job.ranks)})")
        chosen = job.ranks[0] if options.rank is None else options.rank
        with progress(f"reading rank {chosen}"):
            rank_trace = load_to_analyse(job.metadata["ranks"][str(chosen)]["file"])

        def render(out: Any) -> None:
            render_job_report(job, chosen, rank_trace, out, top=options.top, lines=options.lines)
    else:
        with progress(f"reading {options.file}"):
            loaded = _loaded(options)
        if isinstance(loaded, Trace):
            trace = loaded
            if options.rank is not None and options.rank not in trace.ranks:
                raise CliError(f"{options.file} holds no rank {options.rank} (ranks: "
                               f"{_listed(trace.ranks) or 'none, it is one process'})")

            def render(out: Any) -> None:
                render_report(trace, out, top=options.top, rank=options.rank, lines=options.lines)
        else:  # too large to load: its tables read a window at a time

            def render(out: Any) -> None:
                render_windowed_report(loaded, out, top=options.top)
    with progress("analysing"):  # the analyses run before the first table is printed
        out = console()
        with out.capture() as captured:
            render(out)
    out.file.write(captured.get())  # printed once the spinner is gone: as rendered, colours included
    if options.html:
        from xsp.reports.html import write_html

        with progress(f"writing the HTML report {options.html}"):
            target = write_html(trace, options.html, rank=options.rank)
        error_console().print(f"xsp: wrote the HTML report to {target}", markup=False)
    return 0


def _loaded(options: argparse.Namespace) -> Any:
    """The trace ``options.file`` names, loaded; or, an .xsp.parquet file too large to load (and no
    --html, --lines or --rank asked for, which need it whole), the report's tables read a window of
    whole trees at a time (:func:`xsp.analysis.windowed.windowed_report`).

    Raises:
        xsp.TraceTooLargeError: too large to load, and not to be read a window at a time."""
    from xsp.core.errors import TraceTooLargeError
    from xsp.core.schema import FILE_SUFFIX
    from xsp.io.loading import load_to_analyse

    try:
        return load_to_analyse(options.file)
    except TraceTooLargeError as refused:
        if not options.file.endswith(FILE_SUFFIX):
            raise
        whole = [option for option, given in (("--html", options.html), ("--lines", options.lines),
                                              ("--rank", options.rank is not None)) if given]
        if whole:
            raise CliError(f"{refused}; {' and '.join(whole)} need{'s' if len(whole) == 1 else ''} it loaded whole: "
                           f"without {' and '.join(whole)}, xsp report prints its main tables reading it a window "
                           "at a time") from None
    from xsp.analysis.windowed import windowed_report
    from xsp.io.tree_windows import tree_windows

    windows = tree_windows(options.file)
    if len(windows.ranks) > 1:
        raise CliError(f"{options.file} is too large to load here and holds {len(windows.ranks)} ranks: the report "
                       "of several ranks in one file needs it loaded whole (a job written a file a rank, as "
                       "torchrun's ranks write them, is reported without loading it)")
    return windowed_report(windows)


def _listed(ranks: list[int]) -> str:
    """Ranks for one line: a job of a thousand is not listed whole."""
    if len(ranks) <= 12:
        return ", ".join(map(str, ranks))
    return f"{', '.join(map(str, ranks[:8]))}, ... {ranks[-1]} ({len(ranks)} ranks)"
