"""The ``xsp`` command: ``main(argv) -> int`` dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xsp._version import __version__
from xsp.cli import doctor, export, import_, report, run
from xsp.cli._common import CliError, error_console
from xsp.errors import XspError

SUBCOMMANDS = (run, report, import_, export, doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xsp", description="Across-stack profiler for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"xsp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status instead of exiting."""
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        options = parser.parse_args(arguments)
    except SystemExit as stop:  # argparse already printed its one-line usage error
        return int(stop.code or 0)
    try:
        return int(options.handler(options))
    except (CliError, XspError, FileNotFoundError, ValueError) as exc:
        error_console().print(f"xsp: error: {exc}", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        error_console().print("xsp: interrupted", markup=False)
        return 130


def entry_point() -> None:
    sys.exit(main())
