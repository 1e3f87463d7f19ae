"""The ``xsp`` command: ``main(argv) -> int`` dispatches to one module per subcommand."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final, NoReturn

from xsp._version import __version__
from xsp.cli import capture, diff, doctor, export, import_, pull, push, recommend, recover, report, run, summary
from xsp.cli._common import CliError, error_console, error_line, xsp_warnings_to_stderr
from xsp.cli.run import ScriptInterrupted, ScriptSyntaxError
from xsp.core.errors import INTERRUPTED, XspError

SCRIPT_SYNTAX_ERROR = 1
"""What python exits with when the script does not compile."""
SUBCOMMANDS = (run, report, recommend, diff, summary, import_, export, push, pull, recover, capture, doctor)
SCRIPT_INTERRUPTED = -2
"""What ``main`` returns when the profiled script was interrupted: the entry point then ends
the process by SIGINT, as python does."""


class _ParseFailed(Exception):
    """What argparse would have said, raised while a command line is tried (see ``parse_args``)."""


UNIT_VALUED: Final = ("--rotate", "--threshold", "--min-delta")
"""Options whose value has a unit (``5s``, ``500MB``): argparse takes ``-5s`` for an option, and says
"expected one argument" instead of what is wrong with the value."""


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, saying a command line it cannot parse in one line (with where help is), as every
    other bad input is said, instead of its usage block and then the error. Its subcommands'
    parsers are of this class too."""

    commands: dict[str, argparse.ArgumentParser] | None = None
    """The subcommands' parsers by name (the top-level parser's)."""
    trying: bool = False
    """A command line is being tried: an error is raised (:class:`_ParseFailed`), not said."""

    def error(self, message: str) -> NoReturn:
        if _OneLineErrors.trying:
            raise _ParseFailed(message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but an argument no parser knows is said by the subcommand it followed
        (``xsp report: ... (see xsp report --help)``), where argparse names the top-level one; and
        a value with a unit that begins with ``-`` (``--rotate -5s``) is said by its own check."""
        arguments = list(sys.argv[1:] if args is None else args)
        _OneLineErrors.trying = True
        try:
            known, extras = self.parse_known_args(arguments, namespace)
        except _ParseFailed as failed:
            _OneLineErrors.trying = False
            if str(failed) in {f"argument {option}: expected one argument" for option in UNIT_VALUED}:
                arguments = _negative_value_joined(arguments)
            known, extras = self.parse_known_args(arguments, namespace)  # says what is wrong, as argparse would
        finally:
            _OneLineErrors.trying = False
        if extras:
            # the first word that names a subcommand: `xsp run` keeps its script's words in `command`
            named = next((argument for argument in arguments if argument in (self.commands or {})), "")
            command = (self.commands or {}).get(named, self)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return known


READER_GONE: Final = 128 + 13
"""Exit status when the reader of xsp's output went away (``| head``): a shell's for SIGPIPE, none
of xsp's own statuses (1 would read as ``xsp diff``'s regression)."""


def _negative_value_joined(arguments: list[str]) -> list[str]:
    """The first ``--rotate -5s`` (or another of :data:`UNIT_VALUED`) before any ``--`` as
    ``--rotate=-5s`` (only where argparse found
    no value for it: a script's own arguments are never changed)."""
    for index, argument in enumerate(arguments[:-1]):
        if argument == "--":
            break
        following = arguments[index + 1]
        if argument in UNIT_VALUED and following[:1] == "-" and following[1:2].isdigit():
            return [*arguments[:index], f"{argument}={following}", *arguments[index + 2:]]
    return arguments


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="xsp", description="Across-stack profiler for PyTorch models.")
    parser.add_argument("--version", action="version", version=f"xsp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        module.register(commands)
    parser.commands = dict(commands.choices)
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
        with xsp_warnings_to_stderr():  # what went wrong without stopping the command: one line each
            return int(options.handler(options))
    except (CliError, XspError, FileNotFoundError, ValueError) as exc:
        error_console().print(f"xsp: error: {error_line(exc)}", markup=False, highlight=False)
        return 2
    except BrokenPipeError:  # the reader of our output went away (| head): nothing left to say
        _silence_stdout()
        return READER_GONE
    except OSError as exc:  # writing to the terminal or a file failed (a full disk)
        _silence_stdout()
        error_console().print(f"xsp: error: {exc.strerror or exc}", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        error_console().print("xsp: interrupted", markup=False)
        return INTERRUPTED
    except ScriptInterrupted:  # the script's traceback is printed; its trace file written
        return SCRIPT_INTERRUPTED
    except ScriptSyntaxError as exc:  # as `python script.py` says it, and exits
        exc.print()
        return SCRIPT_SYNTAX_ERROR


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit cannot fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def entry_point() -> None:
    status = main()
    if status == SCRIPT_INTERRUPTED:
        # end as python ends on Ctrl-C: it waits for the script's other (non-daemon) threads and
        # runs its atexit functions, then ends by SIGINT. An uncaught KeyboardInterrupt of the
        # main module does exactly that; the script's traceback is printed already, so this one's
        # is not (xsp had killed itself by SIGINT at once: the threads' work and output were lost)
        sys.excepthook = _quiet_for_interrupt(sys.excepthook)
        raise KeyboardInterrupt
    sys.exit(status)


def _quiet_for_interrupt(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, printing nothing for a KeyboardInterrupt."""

    def excepthook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            hook(kind, value, traceback)

    return excepthook
