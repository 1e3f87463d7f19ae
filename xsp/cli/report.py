"""``xsp report``: print the analyses of a trace."""

from __future__ import annotations

import argparse
from typing import Any

from xsp.cli._common import CliError, console
from xsp.reports.terminal import render_report
from xsp.trace import load


def register(commands: Any) -> None:
    parser = commands.add_parser("report", help="print the analyses of a trace",
                                 description="Print model latency per step, the top layers and the time "
                                             "per layer type of a trace file.")
    parser.add_argument("file", help="a .xsp.parquet trace")
    parser.add_argument("--top", type=int, default=10, help="layers in the top list (default: 10)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    if options.top < 1:
        raise CliError("--top must be at least 1")
    render_report(load(options.file), console(), top=options.top)
    return 0
