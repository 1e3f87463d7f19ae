"""``xsp export``: write a trace in another format."""

from __future__ import annotations

import argparse
from enum import Enum
from typing import Any, Final

from xsp.cli._common import TRACE_FILE_HELP, check_not_a_trace_name, check_output, error_console

LARGE_JSON_BYTES: Final = 2**30
"""Past this, a Chrome JSON file is more than the Perfetto UI reliably parses in a browser tab."""


class Format(str, Enum):
    CHROME = "chrome"
    SPEEDSCOPE = "speedscope"
    COLLAPSED = "collapsed"
    PERFETTO = "perfetto"


def register(commands: Any) -> None:
    parser = commands.add_parser("export", help="write a trace as Chrome/Perfetto JSON, Perfetto protobuf, speedscope "
                                                "or folded stacks",
                                 description="Convert a trace (.xsp.parquet, PyTorch profiler .json/.json.gz or "
                                             "Nsight Systems .sqlite) to another format.")
    parser.add_argument("file", help=TRACE_FILE_HELP)
    parser.add_argument("--format", choices=[f.value for f in Format], default=Format.CHROME.value,
                        help="output format: chrome (default; chrome://tracing and ui.perfetto.dev), perfetto "
                             "(Perfetto's protobuf for ui.perfetto.dev: a seventh of the size, for traces too large "
                             "for JSON), speedscope (speedscope.app) or collapsed (folded stacks for "
                             "flamegraph.pl), the last two with the lines of your code as frames")
    parser.add_argument("-o", "--output", required=True, help="file to write")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.export.chrome import write_chrome
    from xsp.export.perfetto import write_perfetto
    from xsp.export.stacks import write_collapsed, write_speedscope
    from xsp.io.loading import load
    check_output(options.output, options.file)
    chosen = Format(options.format)
    check_not_a_trace_name(options.output, f"a {chosen.value} file")
    trace = load(options.file)
    if chosen is Format.PERFETTO:
        target, written, cut = write_perfetto(trace, options.output)
        error_console().print(f"xsp: wrote {written} spans to {target}" + (
            f" ({cut} cut at the end of a span they overlap on their thread or stream)" if cut else ""),
            markup=False)
        return 0
    writer = {Format.CHROME: write_chrome, Format.SPEEDSCOPE: write_speedscope,
              Format.COLLAPSED: write_collapsed}[chosen]
    target = writer(trace, options.output)
    error_console().print(f"xsp: wrote {len(trace.spans)} spans to {target}", markup=False)
    size = target.stat().st_size if chosen is Format.CHROME and target.is_file() else 0
    if size > LARGE_JSON_BYTES:
        error_console().print(f"xsp: {target} is {size / 2**30:.1f} GiB: the Perfetto UI may fail to open JSON "
                              "this large; --format perfetto writes the spans in Perfetto's protobuf, a fraction "
                              "of the size", markup=False)
    return 0
