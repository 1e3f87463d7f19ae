"""``xsp import``: convert a PyTorch profiler (Kineto) trace into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, check_output, error_console, progress
from xsp.core.schema import FILE_SUFFIX


def register(commands: Any) -> None:
    parser = commands.add_parser("import", help="convert a PyTorch profiler trace to .xsp.parquet",
                                 description="Read a PyTorch profiler (Kineto) Chrome trace (.json or .json.gz), "
                                             "rebuild its tree and write it as an xsp trace.")
    parser.add_argument("trace", help="a Kineto trace: .json or .json.gz")
    parser.add_argument("-o", "--output", default=None,
                        help=f"file to write (default: the trace's name with {FILE_SUFFIX})")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    source = Path(options.trace)
    from xsp.io.kineto import load_kineto  # the importer, only for this command
    from xsp.io.kineto_json import is_kineto_path

    if not is_kineto_path(source):
        raise CliError(f"{source} is not a Kineto trace name (expected .json or .json.gz)")
    output = source.with_name(source.name.split(".")[0] + FILE_SUFFIX) if options.output is None else options.output
    check_output(str(output), str(source))
    with progress(f"reading {source}") as say:
        trace = load_kineto(source)
        say(f"writing {output}")
        trace.save(output)
    hierarchy = trace.metadata["hierarchy"]
    error_console().print(
        f"xsp: {len(trace.spans)} spans, {len(trace.steps)} steps, {hierarchy['launched']} of "
        f"{hierarchy['gpu_activities']} GPU activities linked to their launch -> {output}", markup=False)
    return 0
