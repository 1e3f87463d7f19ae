"""``xsp import``: convert a PyTorch profiler (Kineto) trace or an Nsight Systems SQLite export
into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, beside, check_output, error_console, progress
from xsp.core.figures import counted
from xsp.core.schema import FILE_SUFFIX

HELD_WHOLE_EVENTS = 1 << 20
"""A window larger than this is said: memory is bounded by the longest step, not by the trace."""


@contextmanager
def _ended_by_signals_as_interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP (a scheduler, a closed terminal) end the import as Ctrl-C does: its scratch
    files and the partial output are removed, and it says it was interrupted."""
    def interrupt(signum: int, frame: Any) -> None:
        # as SIGINT, not an exception raised here: DuckDB, inside a query, stops on SIGINT alone
        # (an exception from this handler it would clear, and go on)
        signal.raise_signal(signal.SIGINT)

    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, interrupt)
        except (ValueError, OSError):  # not the main thread: left as they are
            pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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

        with progress(f"importing {source}"), _ended_by_signals_as_interrupts():
            imported = import_kineto(source, output)  # a window at a time: a trace of any size
        spans, steps, metadata = imported.spans, imported.steps, imported.metadata
        if imported.read_whole_because is not None:
            error_console().print(f"xsp: {source} was read whole, not a window at a time: "
                                  f"{imported.read_whole_because}", markup=False)
        elif (imported.largest_window_events or 0) > HELD_WHOLE_EVENTS:
            error_console().print(f"xsp: {imported.largest_window_events:,} events were held at once: the trace "
                                  "cannot be cut while a span is open (a step, or a record_function around the "
                                  "whole loop), so memory grows with the longest such stretch", markup=False)
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
