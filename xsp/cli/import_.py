"""``xsp import``: convert a PyTorch profiler (Kineto) trace or an Nsight Systems SQLite export
into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, beside, check_output, error_console, progress
from xsp.core.figures import counted
from xsp.core.schema import FILE_SUFFIX


def register(commands: Any) -> None:
    parser = commands.add_parser("import", help="convert a PyTorch profiler trace or an Nsight Systems export "
                                                "to .xsp.parquet",
                                 description="Read a PyTorch profiler (Kineto) Chrome trace (.json or .json.gz) or an "
                                             "Nsight Systems SQLite export (nsys export --type sqlite), rebuild its "
                                             "tree and write it as an xsp trace.")
    parser.add_argument("trace", help="a Kineto trace (.json, .json.gz) or an Nsight Systems export (.sqlite)")
    parser.add_argument("-o", "--output", default=None,
                        help=f"file to write (default: the trace's name with {FILE_SUFFIX}, beside it, or here where "
                             "its folder is read-only)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    source = Path(options.trace)
    from xsp.io.kineto import load_kineto  # the importers, only for this command
    from xsp.io.kineto_json import is_kineto_path
    from xsp.io.nsys import load_nsys
    from xsp.io.nsys_export import is_nsys_path

    if is_kineto_path(source):
        load = load_kineto
    elif is_nsys_path(source):
        load = load_nsys
    elif source.exists():
        raise CliError(f"{source} is neither a Kineto trace (.json, .json.gz) nor an SQLite file (an Nsight "
                       "Systems export)")
    else:
        raise CliError(f"no such trace file: {source}")
    output = beside(source, source.name.split(".")[0] + FILE_SUFFIX) if options.output is None else options.output
    check_output(str(output), str(source))
    with progress(f"reading {source}") as say:
        trace = load(source)
        say(f"writing {output}")
        trace.save(output)
    hierarchy = trace.metadata["hierarchy"]
    error_console().print(
        f"xsp: {len(trace.spans)} spans, {counted(len(trace.steps), 'step')}, {hierarchy['launched']} of "
        f"{hierarchy['gpu_activities']} GPU activities linked to their launch -> {output}", markup=False)
    return 0
