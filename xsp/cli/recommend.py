"""``xsp recommend``: what to change, with the evidence."""

from __future__ import annotations

import argparse
import json
from typing import Any

from xsp.cli._common import TRACE_FILE_HELP, console
from xsp.core.safe_text import one_line


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "recommend", help="say what to change, with the numbers that say so",
        description="Run the recommendation rules (input-bound, DataLoader workers, GPU idle, small kernels, "
                    "pageable copies, blocking syncs, TF32, AMP, channels_last, unfused optimizer, small "
                    "batches, memory near capacity, CPU threads) over a trace and print those that fire, most "
                    "at stake first. See docs/recommendations.md for every rule's threshold and source.")
    parser.add_argument("file", help=TRACE_FILE_HELP)
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.analysis.recommend import recommend  # the analyses, only for this command
    from xsp.io.loading import load
    from xsp.reports.advice import recommendation_lines, recommendation_records

    table = recommend(load(options.file))
    out = console()
    if options.format == "json":
        out.print(json.dumps({"file": options.file, "recommendations": recommendation_records(table)}, indent=2),
                  markup=False, soft_wrap=True)
    else:
        for line in recommendation_lines(table):
            out.print(one_line(line), markup=False)
    return 0
