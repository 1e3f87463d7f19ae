"""``xsp run``: profile an unmodified Python script."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import os
import re
import runpy
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Final

from xsp.cli._common import (
    CliError,
    ProgressLine,
    add_otlp_options,
    check_output,
    console,
    error_console,
    xsp_warnings_to_stderr,
)
from xsp.cli.left_running import LeftRunning, join_children
from xsp.core import schema as col
from xsp.core.errors import XspError
from xsp.core.figures import counted as count_of
from xsp.core.levels import parse_levels
from xsp.core.metadata import service_name_from_environment
from xsp.core.options import checked_layer_depth, checked_output_name, checked_span_budget
from xsp.core.rank import rank_info
from xsp.core.schema import DEFAULT_OUTPUT, Level, SpanKind
from xsp.record.sampling import DEFAULT_SLOW_FACTOR
from xsp.record.schedule import Schedule

if TYPE_CHECKING:
    from xsp.io.trace import Trace
    from xsp.session.options import TraceOptions
    from xsp.session.session import Session


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "run", help="profile a Python script without changing it",
        description="Run SCRIPT under xsp and write its trace. Everything after -- goes to the script.",
        usage="xsp run [options] -- SCRIPT [ARGS...]")
    parser.add_argument("--levels", default="model,layer",
                        help="levels to record, comma separated (default: model,layer)")
    parser.add_argument("-o", "--output", default=None,
                        help=f"trace file to write (default: {DEFAULT_OUTPUT})")
    parser.add_argument("--layer-depth", type=int, default=None, metavar="N",
                        help="record layers down to module call depth N only (1: the calls the model makes itself); "
                             "deeper calls run unrecorded (default: every depth)")
    parser.add_argument("--nvtx", action="store_true", default=None,
                        help="push an NVTX range for each model call, layer and user span as it runs (domain xsp), "
                             "for Nsight Systems: nsys profile --trace nvtx,cuda xsp run --nvtx -- SCRIPT "
                             "(default: XSP_NVTX)")
    parser.add_argument("--sample", metavar="RATE", default=None,
                        help="always on, for services and long jobs: time every step at the model level and record "
                             "this fraction of steps (0 to 1), and those after a slow step, at every level asked for; "
                             "steps inside an OpenTelemetry request span join its trace (default: XSP_SAMPLE, else "
                             "every step at every level)")
    parser.add_argument("--slow-factor", metavar="X", type=float, default=None,
                        help="with --sample: a step slower than X times the running median is slow, and the next "
                             f"steps are recorded deep; 0: no such rule (default: {DEFAULT_SLOW_FACTOR:g})")
    parser.add_argument("--rotate", metavar="WHEN", default=None,
                        help="with --dataset, for a program that runs for days: write the trace as parts "
                             "(DIR/run=ID/rank=N/part-K.xsp.parquet), each sealed and readable after this long or "
                             "this large: 1h, 500MB, or 1h,500MB")
    parser.add_argument("--dataset", metavar="DIR", default=None,
                        help="write the trace into this folder of runs instead, as "
                             "DIR/run=ID/rank=N/SCRIPT.xsp.parquet (one Parquet dataset for DuckDB, Spark or Trino; "
                             "ID: XSP_RUN_ID, else the job's id)")
    add_otlp_options(parser, "also send spans to this OTLP endpoint, e.g. http://localhost:4317",
                     "the script's name", budget_when="with --otlp: ")
    parser.add_argument("--schedule", metavar="SPEC", default=None,
                        help="record only some steps, as torch.profiler's schedule: "
                             "skip_first=N,wait=N,warmup=N,active=N,repeat=N (any of them; repeat=0: until the end)")
    parser.add_argument("--leveled", action="store_true",
                        help="run the script once per level prefix (model; model,layer at each module depth; "
                             "...) and merge the runs so that each span's time comes from the run that traced "
                             "nothing deeper")
    parser.add_argument("--warmup", type=int, default=None,
                        help="with --leveled: steps at the start of each run left out of the figures "
                             f"(default: {DEFAULT_WARMUP})")
    parser.add_argument("--rounds", type=int, default=None,
                        help="with --leveled: repeat the runs this many times, interleaved, and pool them (default: "
                             "until the model latency and top-level layers are within --target, at least 5 rounds, "
                             "as xsp.leveled)")
    parser.add_argument("--target", type=float, default=None, metavar="PERCENT",
                        help="with --leveled: the 95%% interval's half-width, in percent of a figure, that is precise "
                             f"enough (default: {DEFAULT_TARGET_PERCENT:g})")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="with --leveled: how long past the first round more rounds may run, even below the "
                             "minimum of 5 (default: the 5, then more while one second per run of a round lasts)")
    parser.add_argument("--no-depth", action="store_true",
                        help="with --leveled: run the layer level once, at every module depth, and take the "
                             "calibrated cost of the layers below each one out of its figure instead")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure what one span of each level costs here first (about a second) and keep it "
                             "in the trace, for xsp.analysis.compensated")
    parser.add_argument("--no-compensate", action="store_true",
                        help="with --leveled: keep xsp's own calibrated cost in the figures")
    parser.add_argument("--report", action="store_true", help="print the report after the run")
    parser.add_argument("--top", type=int, default=10, help="layers in the report's top list")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]")
    parser.set_defaults(handler=run)


_PYTHON_NAME = re.compile(r"python[0-9.]*(\.exe)?")


def main_file(script: Path) -> Path:
    """The file that runs for ``script``: itself, or a folder's ``__main__.py`` (``python app/``
    runs it, the folder first on ``sys.path``)."""
    return script / "__main__.py" if script.is_dir() else script


def _script_and_args(command: list[str]) -> tuple[Path, list[str]]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("no script given: use xsp run [options] -- SCRIPT [ARGS...]")
    names_interpreter = _PYTHON_NAME.fullmatch(Path(command[0]).name) is not None
    if names_interpreter and (not Path(command[0]).is_file() or command[1:2] and command[1].endswith(".py")):
        # `xsp run -- python train.py` as users type it: the script runs in this interpreter anyway
        if len(command) > 1 and command[1].startswith("-"):
            raise CliError(f"xsp run takes the script itself, not interpreter options ({command[1]}): "
                           "use xsp run [options] -- SCRIPT [ARGS...]")
        command = command[1:]
        if not command:
            raise CliError("no script given: use xsp run [options] -- SCRIPT [ARGS...]")
    script = Path(command[0])
    if script.name in LAUNCHERS and not script.exists():
        # its ranks are new programs it starts, which no session follows: the trace held one span
        raise CliError(f"xsp run -- {script.name} would trace {script.name} itself, not the ranks it starts: put xsp "
                       f"inside it: {script.name} [its options] -m xsp run [options] -- SCRIPT [ARGS...]")
    if not script.exists() and os.sep not in command[0]:
        script = installed_command(command[0]) or script
    runs = main_file(script)
    if not runs.is_file():
        raise CliError(f"{script} is a folder with no __main__.py: python would not run it either" if script.is_dir()
                       else f"no such script: {script}")
    try:
        source = runs.read_bytes()
        compile(source, os.path.abspath(runs), "exec", dont_inherit=True)
    except SyntaxError as exc:
        interpreter = source.split(b"\n", 1)[0] if source.startswith(b"#!") else b""
        if interpreter and b"python" not in interpreter:  # a shell script, say: xsp runs Python scripts only
            raise CliError(f"{script} is not a Python script ({interpreter.decode(errors='replace')})") from None
        raise ScriptSyntaxError(exc) from None  # a Python script that does not compile: as python says it
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {script}: {exc}") from None
    return script, command[1:]


LAUNCHERS: Final = frozenset({"torchrun"})
"""Installed commands that start the program as new processes of their own (a job's ranks)."""


def installed_command(name: str) -> Path | None:
    """The console script ``name`` (``uvicorn``, ``torchrun``) that ``xsp run -- NAME`` means when no
    file of that name is here: this interpreter's own first (a shell's PATH may hold a wrapper, as
    pyenv's shims are), else the first on PATH; None where there is none."""
    import shutil
    import sysconfig

    own = Path(sysconfig.get_path("scripts")) / name
    if own.is_file():
        return own
    found = shutil.which(name)
    return None if found is None else Path(found)


def _exit_status(code: Any) -> int:
    """The status python exits with for ``SystemExit(code)`` (printing a non-integer code, as it does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _own_code() -> tuple[str, ...]:
    """Where xsp's code (and runpy's, which runs the script) lives: prefixes of file names."""
    import xsp
    import xsp.analysis
    import xsp.tracers

    folders = {str(Path(module.__file__).resolve().parent) + os.sep for module in (xsp, xsp.tracers, xsp.analysis)
               if module.__file__}
    return (*folders, str(Path(runpy.__file__).resolve()), "<frozen runpy>")


def _without_own_frames(tb: TracebackType | None, own: tuple[str, ...]) -> TracebackType | None:
    """The traceback without the frames of xsp (its CLI, its wrappers) and runpy."""
    kept: list[TracebackType] = []
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (filename.startswith(own) or str(Path(filename).resolve()).startswith(own)):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def _print_script_error(error: BaseException) -> None:
    """Report the script's uncaught exception as python would: through ``sys.excepthook``, with
    the frames of xsp and runpy left out of it and of the exceptions chained to it."""
    own, seen = _own_code(), set()
    chained: BaseException | None = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = _without_own_frames(chained.__traceback__, own)
        chained = chained.__cause__ or chained.__context__
    sys.excepthook(type(error), error, error.__traceback__)


class ScriptSyntaxError(Exception):
    """The script does not compile: the CLI says so as python would (its own lines, exit 1),
    and nothing runs."""

    def __init__(self, error: SyntaxError) -> None:
        super().__init__(str(error))
        self.error = error

    def print(self) -> None:
        error = self.error.with_traceback(None)  # xsp's own frames are not the script's
        sys.excepthook(type(error), error, None)  # python's "File ..., line N", the caret, the message


class ScriptInterrupted(Exception):
    """The script was interrupted (Ctrl-C): the CLI exits as python would, by SIGINT."""


def _run_as_main(path: str, stays_main: bool) -> None:
    """Run the script at ``path`` (absolute) as ``python script.py`` does: as module ``__main__``,
    with its absolute path as ``__file__`` and in its tracebacks, and ``sys.argv[0]`` as the user
    typed it (``runpy.run_path`` would set it to the path it was given). Where ``stays_main``, it
    stays ``__main__`` after it has run, as in a plain run: its threads and exit functions may
    still pickle its classes, or start processes that import it; else xsp's own ``__main__`` is
    put back (the script runs again)."""
    code = compile(Path(path).read_bytes(), path, "exec", dont_inherit=True)
    module = ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - running the user's script is this command's job
    finally:
        if saved is not None and not stays_main:
            sys.modules["__main__"] = saved


class LineEnds:
    """Whether the script left a line open on stdout or stderr (its last write there did not
    end in a newline): xsp's first line after the script then starts on a line of its own, so
    that ``grep '^xsp: '`` finds it. Follows writes through ``sys.stdout`` and ``sys.stderr``
    (``print``); what the script writes to the descriptors directly is not seen."""

    def __init__(self) -> None:
        self.open_line = {"stdout": False, "stderr": False}
        self.last = "stderr"
        self._followed: list[Any] = []

    def follow(self) -> None:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            try:
                stream.write = self._noting(name, stream.write)
            except (AttributeError, TypeError):  # a stream without an instance dict: not followed
                continue
            self._followed.append(stream)

    def _noting(self, name: str, write: Callable[[str], int]) -> Callable[[str], int]:
        open_line = self.open_line

        def noted(text: str) -> int:
            if isinstance(text, str) and text:
                open_line[name] = text[-1] != "\n"
                self.last = name
            return write(text)

        return noted

    def stop(self) -> None:
        for stream in self._followed:
            try:
                del stream.write
            except AttributeError:  # the script put its own in place: left as it is
                pass
        self._followed = []

    def end_line(self) -> None:
        """Start a new line on stderr where the script left one open there (or on stdout, when
        both go to the same place)."""
        try:
            together = os.path.sameopenfile(1, 2)
        except OSError:
            together = False
        if self.open_line[self.last] if together else self.open_line["stderr"]:
            sys.stdout.flush()
            sys.stderr.write("\n")
            sys.stderr.flush()
        self.open_line = {"stdout": False, "stderr": False}


@dataclasses.dataclass
class _LeftOpen:
    """The session of a script whose main thread ended while threads or child processes it started
    still ran. Python waits for them before it exits, and they may go on calling the model: the
    session ends after them, at exit (:class:`_EndAtExit`), so that their steps are in the trace too."""

    session_end: contextlib.ExitStack
    line_ends: LineEnds
    failure: BaseException | None = None
    """What ended the main thread (not SystemExit): the session ends with it, as it would have."""

    def end(self) -> None:
        self.line_ends.stop()
        self.line_ends.end_line()  # before the session's own lines (writing the trace, warnings)
        failure = self.failure
        if failure is None:
            self.session_end.close()
        else:
            self.session_end.__exit__(type(failure), failure, failure.__traceback__)


def _run_script(script: Path, script_args: list[str], session: Session,
                may_leave_open: bool = True) -> tuple[int, _LeftOpen | None]:
    """Run the script once inside ``session``; its exit status (its traceback printed as python
    would), and, where ``may_leave_open``, the session left open where threads the script started
    still run when its main thread ends (the caller ends it at exit, after them), else None.

    Raises:
        ScriptInterrupted: a KeyboardInterrupt ended the script (after the trace was written).
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve() if script.is_dir() else script.resolve().parent))
    status = 0
    failure: BaseException | None = None
    said = False
    line_ends = LineEnds()
    left_open: _LeftOpen | None = None
    still_running = False
    try:
        line_ends.follow()
        with contextlib.ExitStack() as stack:
            stack.enter_context(session)
            interrupted = False
            left_running = LeftRunning()
            try:
                _run_as_main(os.path.abspath(main_file(script)), stays_main=may_leave_open)
            except SystemExit:
                raise
            except Exception as error:
                failure = error
                # said now, as python says it, before the trace is written: a stopping signal
                # meanwhile (torchrun ending the other ranks when one fails) left it unsaid
                _print_script_error(error)
                said = True
                raise
            except BaseException:  # Ctrl-C, or a stopping signal (Terminated): the process ends now
                interrupted = True
                raise
            finally:
                still_running = not interrupted and (left_running.any() if may_leave_open else left_running.working())
                if may_leave_open and still_running:
                    left_open = _LeftOpen(stack.pop_all(), line_ends, failure)
                else:
                    line_ends.stop()
                    line_ends.end_line()  # before the session's own lines (writing the trace, warnings)
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except _LeveledTerminated:  # a signal stopped a leveled run: not the script's failure
        raise
    except BaseException as error:  # the script's own failure: report it like python does
        failure = error
        status = 1
    finally:
        if left_open is None:  # else the script's threads run on: they see its argv and path, as in a plain run
            sys.argv, sys.path[:] = saved_argv, saved_path
    if failure is not None:
        if not said:
            _print_script_error(failure)
        if isinstance(failure, KeyboardInterrupt):
            raise ScriptInterrupted() from None
    if still_running and not may_leave_open:
        raise CliError(f"{script} left threads running when its main thread returned: "
                       "--leveled runs it several times in one process, and they would run on into the next run "
                       "(join them before the script ends, or profile it without --leveled)")
    return status, left_open


@dataclasses.dataclass
class _EndAtExit:
    """Ends a session left open for what the script left running, at ``atexit`` (after Python
    has waited for the threads) once its child processes that are not daemons have ended too, or
    at a stopping signal meanwhile (:meth:`stopped`), and says what was written. The exit status
    stays the script's: Python has taken it already."""

    left_open: _LeftOpen
    session: Session
    script: Path
    options: argparse.Namespace
    status: int
    started_in: str
    ended: bool = False

    def __call__(self) -> None:
        if self.ended:
            return
        join_children()  # a stopping signal meanwhile ends the session (stopped)
        self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        with xsp_warnings_to_stderr():
            try:
                self.left_open.end()
                _summarise(self.session, self.script, self.options, self.status, self.started_in)
            except Exception as exc:  # never a traceback at exit
                error_console().print(f"xsp: error: ending the trace after the script's threads failed: {exc}",
                                      markup=False)

    def stopped(self, signum: int) -> None:
        """A stopping signal came while Python waited for the threads: the trace ends now. Then
        SIGTERM or SIGHUP ends the process (as it would have ended a plain run), and Ctrl-C
        raises KeyboardInterrupt where Python waits, as in a plain run (Python prints it as an
        exception ignored, stops waiting and exits with the script's status)."""
        from xsp.session.signals import end_by_signal

        self.end()
        if signum == signal.SIGINT:
            _unraisable_without_own_frames()
            raise KeyboardInterrupt
        end_by_signal(signum)


def _unraisable_without_own_frames() -> None:
    """Have the next exception Python prints as ignored (the KeyboardInterrupt raised where it
    waits for the threads) printed without xsp's frames (its signal handler), as a plain run
    prints it: from Python's own wait."""
    previous = sys.unraisablehook
    own = _own_code()

    def hook(unraisable: Any) -> None:
        sys.unraisablehook = previous
        error = unraisable.exc_value
        if isinstance(error, KeyboardInterrupt):
            error.__traceback__ = _without_own_frames(error.__traceback__, own)
            unraisable = type(unraisable)((unraisable.exc_type, error, error.__traceback__, unraisable.err_msg,
                                           unraisable.object))
        previous(unraisable)

    sys.unraisablehook = hook


def run(options: argparse.Namespace) -> int:
    from xsp.io.outputs import check_writable
    from xsp.session.options import SAMPLE_VARIABLE, TraceOptions

    # Everything the command line says is checked before torch, pandas and pyarrow are imported:
    # a mistyped script name is answered at once.
    levels = parse_levels(options.levels)
    _check_plain_options(options)
    schedule = None if options.schedule is None else Schedule.parse(options.schedule)
    if schedule is not None and options.leveled:
        raise CliError("--schedule and --leveled cannot be combined (--leveled chooses its own steps: --warmup)")
    script, script_args = _script_and_args(options.command)
    checked_span_budget(options.span_budget, "--span-budget")
    checked_layer_depth(options.layer_depth, "--layer-depth")
    if options.dataset == "":
        raise CliError("the --dataset folder is empty")
    if options.dataset:
        if options.leveled:
            raise CliError("--dataset and --leveled cannot be combined (a leveled run writes one merged file: -o)")
        if options.output:
            raise CliError("give -o FILE or --dataset DIR, not both (--dataset names the file itself)")
        if Path(options.dataset).exists() and not Path(options.dataset).is_dir():
            raise CliError(f"--dataset {options.dataset} is a file, not a folder")
        try:
            Path(options.dataset).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"cannot make the folder {options.dataset}: {exc.strerror or exc}") from None
        check_writable(Path(options.dataset) / "probe.xsp.parquet")
    else:
        if options.output is None:
            options.output = DEFAULT_OUTPUT
        check_output(options.output, str(script))  # "" (empty) or the script itself, said before it runs
        check_writable(options.output)  # fail before the script runs, not after
    # a trace already there is replaced: said in the closing line (`xsp diff` needs two names)
    options.replaces = bool(options.output) and not options.dataset and os.path.isfile(options.output)
    if options.slow_factor is not None and options.sample is None and not os.environ.get(SAMPLE_VARIABLE):
        raise CliError("--slow-factor applies to always-on sessions only: give --sample too")
    from xsp.session.options import environment_sampling_set, without_environment_sampling

    leveled_ignores_environment = without_environment_sampling() if options.leveled else contextlib.nullcontext()
    if options.leveled and options.sample is None and environment_sampling_set():
        error_console().print(f"xsp: {SAMPLE_VARIABLE} is not used by --leveled: each run records every step at "
                              "every level it runs", markup=False)
    try:
        with leveled_ignores_environment:
            trace_options = TraceOptions.parse(levels, output=options.output, otlp_endpoint=options.otlp,
                                               service_name=_service_name(options, script),
                                               otlp_protocol=options.otlp_protocol, schedule=schedule,
                                               calibrate=options.calibrate, span_budget=options.span_budget,
                                               dataset=options.dataset, layer_depth=options.layer_depth,
                                               nvtx=options.nvtx, sample=options.sample,
                                               slow_factor=options.slow_factor, rotate=options.rotate)
    except ValueError as exc:
        raise CliError(str(exc).replace("sample must", "--sample must").replace("slow_factor", "--slow-factor")
                       .replace("rotate must", "--rotate must").replace("dataset=DIR too (xsp run --dataset)",
                                                                        "--dataset DIR too")) from None
    from xsp.core.lazy import import_in_background

    if options.leveled:
        if options.layer_depth is not None:
            raise CliError("--layer-depth and --leveled cannot be combined (--leveled runs every depth in turn)")
        if options.sample is not None:
            raise CliError("--sample and --leveled cannot be combined (--leveled runs the script once per level)")
        import_in_background()  # beside the script's own imports, not beside its first steps
        return _run_leveled(options, trace_options, script, script_args)
    import_in_background()
    from xsp.session.session import Session

    started_in = os.getcwd()
    with xsp_warnings_to_stderr():
        session = Session(options=trace_options)
        # a script ending with os._exit, or by a stopping signal, ends the session there: say what
        # was written before it exits
        session.on_exit_now.append(lambda code: _say_what_was_written(session, script, options, code, started_in))
        writing = ProgressLine()
        session.on_finishing.append(lambda busy: writing.show("xsp: writing the trace") if busy else writing.hide())
        status, left_open = _run_script(script, script_args, session)
        if left_open is not None:  # its threads still run: the trace ends after them, as Python exits
            ending = _EndAtExit(left_open, session, script, options, status, started_in)
            session.left_open(ending.stopped)
            atexit.register(ending)
            return status
        status = _summarise(session, script, options, status, started_in)
    return status


class _ScriptFailed(Exception):
    """A leveled run's script exited with a non-zero status: the CLI exits with it."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _LeveledTerminated(BaseException):
    """SIGTERM or SIGHUP during ``--leveled``: the rounds that finished are written, then the
    process ends by the signal, as a plain run would. (Raised by xsp's handler as the program's
    own, so that a session passes it on instead of ending the process itself.)"""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _leveled_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`_LeveledTerminated` in the main thread while the
    leveled runs go on (where their default action, ending the process, was in place)."""
    import signal

    def stop(signum: int, _frame: Any) -> None:
        raise _LeveledTerminated(signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) is signal.SIG_DFL:
                saved[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


def _stop_text(cause: BaseException) -> str:
    """What stopped a leveled run, in words."""
    from xsp.session.signals import signal_name

    if isinstance(cause, _ScriptFailed):
        return f"the script's exit status {cause.status}"
    if isinstance(cause, (ScriptInterrupted, KeyboardInterrupt)):
        return "SIGINT"
    if isinstance(cause, _LeveledTerminated):
        return signal_name(cause.signum)
    return f"{type(cause).__name__}: {cause}"


def _end_as_stopped(cause: BaseException) -> int:
    """Once what finished is written: exit as the stopped script would have."""
    from xsp.session.signals import end_by_signal

    if isinstance(cause, _ScriptFailed):
        return cause.status
    if isinstance(cause, _LeveledTerminated):
        end_by_signal(cause.signum)  # the process ends here
    raise cause


LEVELED_ONLY: Final = ("warmup", "rounds", "target", "budget", "no_depth", "no_compensate")
"""Options of ``--leveled`` runs only (given without it, they would change nothing)."""
DEFAULT_WARMUP: Final = 2
DEFAULT_TARGET_PERCENT: Final = 2.0


def _check_plain_options(options: argparse.Namespace) -> None:
    """What a run takes whether leveled or not: refused before anything runs, one line each."""
    if options.top < 1:
        raise CliError("--top must be at least 1")
    if options.otlp is not None and not options.otlp.strip():
        raise CliError("--otlp is empty: give the collector's URL (http://localhost:4317), or leave --otlp out")
    if options.output:
        checked_output_name(options.output, "-o")
    given = ["--" + name.replace("_", "-") for name in LEVELED_ONLY if getattr(options, name) not in (None, False)]
    if given and not options.leveled:
        raise CliError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to leveled runs only: "
                       "add --leveled, or leave " + ("it" if len(given) == 1 else "them") + " out")
    if options.warmup is None:
        options.warmup = DEFAULT_WARMUP
    if options.target is None:
        options.target = DEFAULT_TARGET_PERCENT


def _check_leveled(options: argparse.Namespace) -> None:
    if options.warmup < 0:
        raise CliError("--warmup must be 0 or more")
    if options.rounds is not None and options.rounds < 1:
        raise CliError("--rounds must be 1 or more")
    if not 0 < options.target < 100:
        raise CliError("--target must be a percentage between 0 and 100")
    if options.budget is not None and options.budget < 0:
        raise CliError("--budget must be 0 or more seconds")
    if options.otlp:
        raise CliError("--leveled writes one merged trace file; send it with xsp export afterwards, not --otlp")
    ranked = rank_info()
    if ranked is not None:
        # each run of the script makes its process group and DDP model again in one process: the
        # ranks then wait for each other in DDP's constructor, for good (a job of 2 ranks hung)
        raise CliError(f"--leveled runs the script several times in one process, which a rank of a distributed job "
                       f"(rank {ranked.rank} of {ranked.world_size}) cannot do: profile the job without --leveled, "
                       "or run --leveled on one process of it")


def _run_leveled(options: argparse.Namespace, trace_options: TraceOptions, script: Path,
                 script_args: list[str]) -> int:
    """``--leveled``: one run of the script per level prefix, merged into one trace.

    Interrupted (Ctrl-C, SIGTERM, SIGHUP) or ended by the script's failure, it writes the rounds
    that finished, marked partial, or says that none did and writes nothing; the exit status
    is then the script's (or the signal's)."""
    from xsp.session.leveled_rounds import RoundsStopped

    _check_leveled(options)
    out = error_console()
    with xsp_warnings_to_stderr(), _leveled_signals():
        try:
            result, rounds = _leveled_rounds(options, trace_options, script, script_args)
        except RoundsStopped as stopped:
            if stopped.result is None:
                out.print(f"xsp: stopped by {_stop_text(stopped.cause)}: {stopped.why_none}, so nothing was "
                          "written", markup=False)
            else:
                _write_leveled(stopped.result, options, stopped.log.rounds)
            return _end_as_stopped(stopped.cause)
        except (_ScriptFailed, ScriptInterrupted, KeyboardInterrupt, _LeveledTerminated) as cause:
            out.print(f"xsp: stopped by {_stop_text(cause)} before the leveled rounds began, so nothing was "
                      "written", markup=False)
            return _end_as_stopped(cause)
    _write_leveled(result, options, rounds)
    return 0


@dataclasses.dataclass(frozen=True)
class _ScriptRuns:
    """``--leveled``'s work: the script run once per run, under a session of the run's levels."""

    script: Path
    script_args: list[str]
    options: argparse.Namespace
    trace_options: TraceOptions
    """The options of each run (its levels, depth and backward hooks are the run's own)."""

    def traced(self, levels: tuple[Level, ...], label: str, backward: bool, layer_depth: int | None) -> Trace:
        from xsp.session.leveled import run_cut_short_unsaid
        from xsp.session.session import Session

        session = Session(options=dataclasses.replace(self.trace_options, levels=levels, output=None, calibrate=False,
                                                      backward=backward, layer_depth=layer_depth))
        with run_cut_short_unsaid():
            status, _ = _run_script(self.script, self.script_args, session, may_leave_open=False)  # each run ends here
        if status != 0:
            raise _ScriptFailed(status)
        warmup = self.options.warmup
        if session.trace is None or len(session.trace.steps) <= warmup:
            raise CliError(f"{self.script} made no steps after the {warmup} warm-up steps in its run ({label}), so "
                           "there was nothing to measure (is it a PyTorch script that calls its model more than "
                           "--warmup times?)")
        return session.trace

    def probed(self, levels: tuple[Level, ...], label: str) -> Trace:
        """A whole run of the script (its steps are what shows what it does)."""
        return self.traced(levels, label, False, None)


def _leveled_rounds(options: argparse.Namespace, trace_options: TraceOptions, script: Path,
                    script_args: list[str]) -> tuple[Any, int]:
    """The leveled experiment on the script (:func:`xsp.session.leveled.run_leveled`), its
    progress printed: the merged result and the rounds run."""
    from xsp.session.leveled import LeveledSettings, run_leveled

    out = error_console()
    settings = LeveledSettings(trace_options.levels, warmup=options.warmup, rounds=options.rounds,
                               target=options.target / 100, budget_s=options.budget,
                               compensate=not options.no_compensate, by_depth=not options.no_depth)
    try:
        return run_leveled(_ScriptRuns(script, script_args, options, trace_options), settings,
                           progress=lambda line: out.print(f"xsp: {line}", markup=False), describe_stop=_stop_text)
    except ValueError as exc:
        raise CliError(f"the runs cannot be merged: {exc}") from None


def _write_leveled(result: Any, options: argparse.Namespace, rounds: int) -> None:
    """Write a leveled result (partial or whole) and say what it holds."""
    from xsp.reports.terminal import CI_HEADING, frame_table, number, plus_minus_share, share, text

    out = error_console()
    details = result.trace.metadata["leveled"]
    partial = details.get("partial")
    if not details["precise"] and not partial:
        out.print(f"xsp: leveled figures not precise to ±{options.target:g}%: {details['why_imprecise']}",
                  markup=False)
    if options.output:
        result.save(options.output)
    shown = console()
    runs = result.overhead.assign(run=[f"{r.run} (metrics)" if r.metric else r.run
                                       for r in result.overhead.itertuples()],
                                  model_latency_ci_share=result.overhead["model_latency_ci_ms"]
                                  / result.overhead["model_latency_ms"])
    shown.print(f"Leveled runs, {count_of(rounds, 'round')} (model latency: trimmed mean over the measured steps, "
                "with its 95% interval; a metrics run's durations are not used)", markup=False)
    shown.print(frame_table(runs, "", [("run", "run", text), ("steps", "steps", number(0)),
                                       ("model_latency_ms", "model latency ms", number()),
                                       ("model_latency_ci_share", CI_HEADING, plus_minus_share),
                                       ("overhead", "overhead vs model", share)], width=shown.width))
    where = f" -> {options.output}" if options.output else ""
    out.print(f"xsp: merged {count_of(len(result.trace.spans), 'span')} into one step, shaped as the deepest run's "
              f"step {details['merged_step']} and timed over every run's measured steps{where}; "
              f"{count_of(len(result.unmatched), 'span')} did not repeat identically and keep the deepest run's time",
              markup=False)
    if partial:
        out.print(f"warning: partial leveled trace: {partial['cut']}", markup=False)
    if options.report:
        from xsp.reports.terminal import render_report

        render_report(result.trace, console(), top=options.top)


def _shown(path: Path, started_in: str) -> str:
    """``path`` as the user gave it: relative to where xsp started, unless it lies elsewhere."""
    relative = os.path.relpath(path, started_in)
    return str(path) if relative.startswith(os.pardir) else relative


def _say_what_was_written(session: Session, script: Path, options: argparse.Namespace, status: int,
                          started_in: str) -> None:
    _summarise(session, script, options, status, started_in)


def _summarise(session: Session, script: Path, options: argparse.Namespace, status: int, started_in: str) -> int:
    from xsp.session.windows import EXIT_WAIT_S

    trace = session.trace
    out = error_console()
    if trace is None:  # a child the script forked (a server's worker) exits as it would have: the trace is the parent's
        return status if session.forked else status or 1
    written = session.output if session.write_error is None else None
    where = f" -> {_shown(written, started_in)}" if written is not None else ""
    try:
        counted = trace.columns([col.KIND, col.STEP])  # a long run's spans stay on disk unless the report is asked for
    except (OSError, XspError):  # written where it cannot be read back (-o /dev/null, /dev/stdout)
        out.print(f"xsp: trace written{where} (not a file it can be read back from, so its spans are not "
                  "counted here)", markup=False)
        return status
    parts = int((trace.metadata.get("part") or {}).get("index") or 0) + 1
    if written is not None and parts > 1:  # the whole run, not its last part
        from xsp.io.loading import load

        try:
            counted = load(written.parent).columns([col.KIND, col.STEP])
            where = f" in {parts} parts -> {_shown(written.parent, started_in)}{os.sep}"
        except Exception:  # the parts before could not be read back: the last one is named as such
            where = f" in the last of {parts} parts{where}"
    elif written is None and session.output is not None and parts > 1:  # its counts are the last part's alone
        where = (f" in the last of {parts} parts, not written (the {parts - 1} before it are in "
                 f"{_shown(session.output.parent, started_in)}{os.sep})")
    predicts = int((counted[col.KIND] == SpanKind.PREDICT.value).sum())
    steps = int(counted[col.STEP].dropna().nunique())
    if where and getattr(options, "replaces", False) and os.path.abspath(options.output) == str(session.output):
        where += " (replacing the earlier trace there)"
    out.print(f"xsp: {count_of(len(counted), 'span')}, {count_of(steps, 'step')}{where}", markup=False)
    export = session.export
    if export is not None:
        report = export.wait(EXIT_WAIT_S)
        export.abandon()  # one bounded wait: exit does not wait again
        if not report.done:
            out.print(f"warning: OTLP export to {report.target} still running after {EXIT_WAIT_S:.0f} s, left "
                      f"unfinished; the trace file keeps every span (send it with `xsp push`)", markup=False)
        elif report.error is None:  # a failure was the session's one warning, already shown
            out.print(f"xsp: {report.summary()}", markup=False)
    if predicts == 0 and steps == 0:  # (a compiled function's steps call no module xsp sees, and are steps)
        children = trace.metadata.get("child_processes") or {}
        untraced = len(children.get("untraced") or {})
        forked = int(children.get("forked_not_followed") or 0)
        if untraced:  # its children may have: what they did is not in the trace, as said above
            out.print(f"warning: {script} called no torch.nn.Module in its own process, and "
                      f"{count_of(untraced, 'child process', 'child processes')} ran untraced", markup=False)
        elif forked:  # a pre-forking server (gunicorn): its workers serve, and nothing starts their session
            out.print(f"warning: {script} called no torch.nn.Module in its own process; the "
                      f"{count_of(forked, 'process', 'processes')} it forked with os.fork() (a server's workers) are "
                      "not followed: start xsp.trace() in each worker (docs/processes.md)", markup=False)
        else:
            out.print(f"warning: {script} called no torch.nn.Module, so there was nothing to profile "
                      "(is it a PyTorch script?)", markup=False)
        return status
    if options.report:
        from xsp.reports.terminal import render_report

        render_report(trace, console(), top=options.top)
    return status


def _service_name(options: argparse.Namespace, script: Path) -> str:
    """The flag, then OpenTelemetry's standard variables, then the script's name."""
    return options.service_name or service_name_from_environment() or script.stem
