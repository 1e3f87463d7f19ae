"""``xsp import``: convert a PyTorch profiler (Kineto) trace or an Nsight Systems SQLite export
into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, beside, check_output, error_console, progress
from xsp.core.figures import counted
from xsp.core.schema import FILE_SUFFIX

HELD_WHOLE_EVENTS = 1 << 20
"""A window larger than this is said: memory is bounded by the longest step, not by the trace."""


@dataclass
class _Stopping:
    """Whether a signal asked the import to stop, and which."""

    signal_number: int | None = None


@contextmanager
def _ended_by_signals_as_interrupts() -> Iterator[_Stopping]:
    """SIGINT, SIGTERM and SIGHUP (Ctrl-C, a scheduler, a closed terminal) end the import alike:
    its scratch files and the partial output are removed, and it says it was interrupted.

    The first signal raises KeyboardInterrupt; later ones are ignored, so that the clean-up is
    not itself interrupted (DuckDB, stopped inside a query, may send the process SIGINT again).
    The first is also remembered: an interrupt that a library swallowed still ends the import.
    """
    stopping = _Stopping()

    def stop(signum: int, frame: Any) -> None:
        if stopping.signal_number is None:
            stopping.signal_number = signum
            # raised here, inside DuckDB's check for signals too: it stops its query on it
            raise KeyboardInterrupt

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[signum] = signal.signal(signum, stop)
        except (ValueError, OSError):  # not the main thread: left as they are
            pass
    try:
        yield stopping
    except BaseException:
        if stopping.signal_number is not None:  # whatever the interrupt became on its way out
            raise KeyboardInterrupt from None
        raise
    finally:
        for signum, handler in previous.items():  # once stopping, ignored to the end of the process
            signal.signal(signum, handler if stopping.signal_number is None else signal.SIG_IGN)


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

        with progress(f"importing {source}"), _ended_by_signals_as_interrupts() as stopping:
            imported = import_kineto(source, output)  # a window at a time: a trace of any size
            if stopping.signal_number is not None:  # the interrupt was swallowed on its way
                Path(output).unlink(missing_ok=True)
                raise KeyboardInterrupt
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
