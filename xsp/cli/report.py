"""``xsp report``: print the analyses of a trace."""

from __future__ import annotations

import argparse
from typing import Any

from xsp.cli._common import TRACE_FILE_HELP, CliError, check_output, console, error_console, progress


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
    from xsp.io.loading import load
    if options.top < 1:
        raise CliError("--top must be at least 1")
    if options.html is not None:
        check_output(options.html, options.file)
    with progress(f"reading {options.file}"):
        trace = load(options.file)
    if options.rank is not None and options.rank not in trace.ranks:
        raise CliError(f"{options.file} holds no rank {options.rank} (ranks: "
                       f"{', '.join(map(str, trace.ranks)) or 'none, it is one process'})")
    from xsp.reports.terminal import render_report  # the analyses, only for this command

    with progress("analysing"):  # the analyses run before the first table is printed
        out = console()
        with out.capture() as captured:
            render_report(trace, out, top=options.top, rank=options.rank, lines=options.lines)
    out.file.write(captured.get())  # printed once the spinner is gone: as rendered, colours included
    if options.html:
        from xsp.reports.html import write_html

        with progress(f"writing the HTML report {options.html}"):
            target = write_html(trace, options.html, rank=options.rank)
        error_console().print(f"xsp: wrote the HTML report to {target}", markup=False)
    return 0
