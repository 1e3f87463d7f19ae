"""``xsp import``: convert a PyTorch profiler (Kineto) trace or an Nsight Systems SQLite export
into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, beside, check_output, error_console, progress
from xsp.core.figures import counted
from xsp.core.schema import FILE_SUFFIX

HELD_WHOLE_EVENTS = 1 << 20
"""A window larger than this is said: memory is bounded by the longest step, not by the trace."""


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
    from xsp.io.kineto_json import is_kineto_path  # the importers, only for this command
    from xsp.io.nsys_export import is_nsys_path

    if not is_kineto_path(source) and not is_nsys_path(source):
        if source.exists():
            raise CliError(f"{source} is neither a Kineto trace (.json, .json.gz) nor an SQLite file (an Nsight "
                           "Systems export)")
        raise CliError(f"no such trace file: {source}")
    output = beside(source, source.name.split(".")[0] + FILE_SUFFIX) if options.output is None else options.output
    check_output(str(output), str(source))
    if is_kineto_path(source):
        from xsp.io.kineto_stream import import_kineto

        with progress(f"importing {source}"):
            imported = import_kineto(source, output)  # a window at a time: a trace of any size
        spans, steps, metadata = imported.spans, imported.steps, imported.metadata
        if imported.read_whole_because is not None:
            error_console().print(f"xsp: {source} was read whole, not a window at a time: "
                                  f"{imported.read_whole_because}", markup=False)
        elif (imported.largest_window_events or 0) > HELD_WHOLE_EVENTS:
            error_console().print(f"xsp: {imported.largest_window_events:,} events were held at once: a window "
                                  "cannot cut a step (or spans that overlap across threads), so memory grows with "
                                  "the largest step", markup=False)
    else:
        from xsp.io.nsys import load_nsys

        with progress(f"reading {source}") as say:
            trace = load_nsys(source)
            say(f"writing {output}")
            trace.save(output)
        spans, steps, metadata = len(trace.spans), len(trace.steps), trace.metadata
    hierarchy = metadata["hierarchy"]
    error_console().print(
        f"xsp: {spans} spans, {counted(steps, 'step')}, {hierarchy['launched']} of "
        f"{hierarchy['gpu_activities']} GPU activities linked to their launch -> {output}", markup=False)
    return 0
