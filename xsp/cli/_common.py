"""Helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

TRACE_FILE_HELP = ("a trace: an .xsp.parquet file, a PyTorch profiler trace (.json, .json.gz) or an Nsight Systems "
                   "SQLite export (.sqlite); a folder of them is one distributed job")
"""How a command's trace argument is described: every command reads all three (``xsp.load``)."""


def beside(source: str | os.PathLike[str], name: str) -> Path:
    """Where a command writes its default output for ``source``: beside it, named ``name``; in
    the current folder where the source's folder is marked read-only (no write permission for
    anyone: a shared folder of traces, which root could otherwise write into)."""
    folder = Path(source).parent
    try:
        read_only = not folder.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    except OSError:
        read_only = False
    return Path(name) if read_only else folder / name


def add_step_selection(parser: argparse.ArgumentParser, levels_help: str, skip_steps_help: str) -> None:
    """``--levels`` and ``--skip-steps``, as the commands that summarise or compare a trace's steps
    read them (:func:`steps_kept`)."""
    parser.add_argument("--levels", default=None, help=levels_help)
    parser.add_argument("--skip-steps", type=int, default=0, metavar="N", help=skip_steps_help)


def steps_kept(options: argparse.Namespace) -> slice | None:
    """The steps ``--skip-steps`` leaves (None: all of them).

    Raises:
        CliError: ``--skip-steps`` is negative.
    """
    if options.skip_steps < 0:
        raise CliError("--skip-steps must not be negative")
    return slice(options.skip_steps, None) if options.skip_steps else None


def add_otlp_options(parser: argparse.ArgumentParser, endpoint_help: str, service_name_last: str,
                     budget_when: str = "") -> None:
    """The options of the commands that send spans to a collector (run, push), defined once:
    ``--otlp`` (described by ``endpoint_help``), ``--otlp-protocol``, ``--service-name`` (whose last
    fallback is ``service_name_last``) and ``--span-budget`` (``budget_when``: when it applies)."""
    from xsp.export.target import DEFAULT_SPAN_BUDGET, Protocol

    parser.add_argument("--otlp", metavar="URL", default=None, help=endpoint_help)
    parser.add_argument("--otlp-protocol", choices=[protocol.value for protocol in Protocol] + ["http"], default=None,
                        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    parser.add_argument("--service-name", default=None,
                        help="OTel service.name (default: OTEL_SERVICE_NAME, else service.name in "
                             f"OTEL_RESOURCE_ATTRIBUTES, else {service_name_last})")
    parser.add_argument("--span-budget", type=int, default=None, metavar="N",
                        help=f"{budget_when}most spans per trace (step) sent; a step over it has its deepest levels "
                             "folded into aggregate spans so that Jaeger can open it (default: XSP_SPAN_BUDGET, "
                             f"else {DEFAULT_SPAN_BUDGET}; 0: no limit)")


class CliError(Exception):
    """A user error the CLI reports in one line with exit status 2."""


def check_output(output: str, source: str) -> None:
    """Refuse an output path that is empty or names the input file (it would be overwritten)."""
    from xsp.io.outputs import same_file

    if not output:
        raise CliError("the output path is empty")
    if same_file(output, source):
        raise CliError(f"{output} is the input file; choose another output path")


def check_not_a_trace_name(output: str, writes: str) -> None:
    """Refuse to write what is no trace (``writes``: what is written, in words) under an xsp
    trace's name: it replaced a trace there, which ``xsp report`` then failed to read."""
    from xsp.core.schema import FILE_SUFFIX

    if str(output).lower().endswith(FILE_SUFFIX):
        raise CliError(f"{output} names an xsp trace ({FILE_SUFFIX}), but this writes {writes}: give it another name")


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def error_console() -> Console:
    """The console of xsp's own lines (warnings, errors, what was written), on stderr: wrapped
    at the terminal's width, so that each fits an 80-column terminal; one line per message into
    a pipe or a log, where grep and CI systems read them whole. ($COLUMNS alone decides nothing:
    GNU readline exports it into every child of a process that loaded it, pipes included.)"""
    return Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())


LINE_BREAKS = re.compile(r"\s*[\r\n]+\s*")


def error_line(text: object) -> str:
    """An error or warning as the one line the CLI prints: a message that came with line breaks
    (a server's error page, an exception of a library) is joined with spaces."""
    return LINE_BREAKS.sub(" ", str(text)).strip()


@contextmanager
def xsp_warnings_to_stderr() -> Iterator[list[str]]:
    """Show each xsp warning once, as one plain line on stderr, and collect them."""
    from xsp.core.errors import XspWarning

    seen: list[str] = []
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if issubclass(category, XspWarning):
            text = error_line(message)
            if text not in seen:
                seen.append(text)
                error_console().print(f"warning: {text}", markup=False)
            return
        original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always", XspWarning)
        warnings.showwarning = show
        try:
            yield seen
        finally:
            warnings.showwarning = original


class ProgressLine:
    """A transient spinner with the elapsed time on stderr while slow work runs (reading a large
    trace, writing a long run's file, sending spans); nothing at all when stderr is no terminal,
    so logs and pipes see only the final lines."""

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: object = None

    def show(self, description: str) -> None:
        console = error_console()
        if not console.is_terminal:
            return
        if self._progress is None:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(description, total=None)
        else:
            self._progress.update(self._task, description=description)  # type: ignore[arg-type]

    def hide(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


@contextmanager
def progress(description: str) -> Iterator[Callable[[str], None]]:
    """Show ``description`` with a spinner while the block runs; yields a function that changes
    the description as the work moves on."""
    line = ProgressLine()
    line.show(description)
    try:
        yield line.show
    finally:
        line.hide()
