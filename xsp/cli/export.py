"""``xsp export``: write a trace in another format."""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Any

from xsp.cli._common import check_output, error_console


class Format(str, Enum):
    CHROME = "chrome"


def register(commands: Any) -> None:
    parser = commands.add_parser("export", help="write a trace as Chrome/Perfetto JSON",
                                 description="Convert a .xsp.parquet trace to another format.")
    parser.add_argument("file", help="a .xsp.parquet trace")
    parser.add_argument("--format", choices=[f.value for f in Format], default=Format.CHROME.value,
                        help="output format (default: chrome, for chrome://tracing and ui.perfetto.dev)")
    parser.add_argument("-o", "--output", required=True, help="file to write")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.export.chrome import write_chrome
    from xsp.io.loading import load
    check_output(options.output, options.file)
    trace = load(options.file)
    target = write_chrome(trace, options.output)
    error_console().print(f"xsp: wrote {len(trace.spans)} spans to {target}", markup=False)
    return 0
