"""``xsp recover``: the trace file of a run that was killed before it could write it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from xsp.cli._common import CliError, check_output, error_console
from xsp.core.errors import TraceNotFoundError


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "recover", help="write the trace file of a run killed before it finished",
        description="A run that writes a trace file streams each closed window (about one a second; an "
                    "always-on run, --sample, every 60 s or XSP_WINDOW_S) to "
                    "a hidden folder beside it, .FILE.xsp-segments.PID (or, when that folder takes no writes, to "
                    "a spool folder in the temporary folder or $XSP_SPOOL_DIR), and builds FILE from them at its "
                    "end. If the process was killed first (SIGKILL, the OOM killer), or FILE could not be written "
                    "(a full disk), recover builds FILE from what is there: every window closed. The folders are "
                    "removed afterwards. A run written in parts (--rotate) puts every window in its first part's "
                    "folder: the windows after its last sealed part become the part after it (a sealed part is "
                    "never written over); give the run's folder (run=ID/rank=N) to recover all there.")
    parser.add_argument("file", help="the trace file the run was writing (its -o / output=), or the folder it "
                                     "was writing in (a dataset's run=ID/rank=N): every unfinished run there")
    parser.add_argument("-o", "--output", default=None, help="write the recovered trace here instead")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.io.segments import unfinished_outputs

    if not os.path.isdir(options.file):
        return _recover_one(options.file, options.output)
    outputs = unfinished_outputs(Path(options.file))  # a run's folder (a dataset's rank=N, for one)
    if not outputs:
        raise CliError(f"nothing to recover in {options.file}: no unfinished run left its windows there")
    if options.output is not None and len(outputs) > 1:
        raise CliError(f"{len(outputs)} unfinished runs left windows in {options.file}: recover them one at a time "
                       f"(xsp recover {outputs[0]} -o ...)")
    for output in outputs:
        _recover_one(str(output), options.output)
    return 0


def _recover_one(file: str, output: str | None) -> int:
    from xsp.io.segments import recover, unfinished_sessions

    found = unfinished_sessions(file)
    if not found:
        raise CliError(f"nothing to recover for {file}: no unfinished run left its windows beside it")
    if output is not None:
        check_output(output, str(found[0][0]))
    try:
        written, metadata = recover(file, into=output)
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
