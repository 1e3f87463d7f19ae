"""``xsp recover``: the trace file of a run that was killed before it could write it."""

from __future__ import annotations

import argparse
from typing import Any

from xsp.cli._common import CliError, check_output, error_console
from xsp.core.errors import TraceNotFoundError


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "recover", help="write the trace file of a run killed before it finished",
        description="A run that writes a trace file streams each closed window (about one a second) to "
                    "a hidden folder beside it, .FILE.xsp-segments.PID (or, when that folder takes no writes, to "
                    "a spool folder in the temporary folder or $XSP_SPOOL_DIR), and builds FILE from them at its "
                    "end. If the process was killed first (SIGKILL, the OOM killer), or FILE could not be written "
                    "(a full disk), recover builds FILE from what is there: every window closed. The folders are "
                    "removed afterwards.")
    parser.add_argument("file", help="the trace file the run was writing (its -o / output=)")
    parser.add_argument("-o", "--output", default=None, help="write the recovered trace here instead")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.io.segments import recover, unfinished_sessions
    found = unfinished_sessions(options.file)
    if not found:
        raise CliError(f"nothing to recover for {options.file}: no unfinished run left its windows beside it")
    if options.output is not None:
        check_output(options.output, str(found[0][0]))
    try:
        written, metadata = recover(options.file, into=options.output)
    except TraceNotFoundError as exc:
        raise CliError(str(exc)) from None
    out = error_console()
    recovered = metadata["recovered"]
    others = f"; {len(found) - 1} older unfinished run(s) remain, run again for them" if len(found) > 1 else ""
    unreadable = recovered["unreadable_segments"]
    damaged = f"; {len(unreadable)} damaged window(s) left out" if unreadable else ""
    what = ("of a run that did not finish" if metadata.get("interrupted")
            else "of a run that ended but could not write its file")
    out.print(f"xsp: recovered {recovered['windows']} window(s) {what} -> {written}{damaged}{others}", markup=False)
    return 0
