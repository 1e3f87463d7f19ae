"""``xsp capture PID``: record the next steps of a process running under xsp at every level its
session has, into a file, while it runs on (over the session's control socket,
:mod:`xsp.core.control`). A process that runs no session itself but whose children do (``torchrun``'s
launcher) has each child captured at the same steps, one file per rank."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from xsp.cli._common import CliError, error_console
from xsp.core.control import CONTROL_VARIABLE, Op, Reply, socket_path
from xsp.core.figures import counted
from xsp.core.options import checked_output_name

DEFAULT_STEPS: Final = 10
DEFAULT_TIMEOUT_S: Final = 600.0
STEP_MARGIN: Final = 2
"""Steps ahead of the furthest rank that a job's capture begins at (the request reaches each
rank at a slightly different moment)."""
CONNECT_TIMEOUT_S: Final = 10.0


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "capture", help="record the next steps of a running process at every level",
        description="Make PID, a process running under xsp (xsp run, xsp.trace()), record its next N steps at "
                    "every level its session records, and write them to FILE while it keeps running. Exits 0 once "
                    "FILE is complete. For a process that runs no xsp session but whose children do (torchrun's "
                    "launcher), every child is captured at the same steps, into one file per rank. Only your own "
                    "processes can be captured (docs/production.md).")
    parser.add_argument("pid", type=int, help="the process to capture")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                        help=f"steps to record (default: {DEFAULT_STEPS})")
    parser.add_argument("--levels", default=None,
                        help="levels to keep, comma separated, of those the process records (default: all of them)")
    parser.add_argument("-o", "--output", default=None,
                        help="the trace file to write (default: capture-PID.xsp.parquet)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help=f"give up after S seconds without every step (default: {DEFAULT_TIMEOUT_S:g})")
    parser.set_defaults(handler=run)


@dataclass
class Target:
    """One process to capture: its socket, its rank, where its file goes."""

    pid: int
    path: Path
    rank: int | None = None
    steps_begun: int = 0
    output: Path | None = None
    connection: socket.socket | None = None
    received: bytes = b""


def run(options: argparse.Namespace) -> int:
    if options.pid < 1:
        raise CliError(f"PID must be a process id above 0, not {options.pid}")
    if options.output is not None and not options.output.strip():
        raise CliError("-o must name a file, not an empty string")
    checked_output_name(options.output, "-o")  # (a ValueError: the one line main() says)
    if options.steps < 1:
        raise CliError(f"--steps must be 1 or more, not {options.steps}")
    if options.timeout <= 0:
        raise CliError(f"--timeout must be above 0, not {options.timeout:g}")
    targets = find_targets(options.pid)
    output = Path(options.output or f"capture-{options.pid}.xsp.parquet").absolute()
    levels = None if options.levels is None else [part.strip() for part in options.levels.split(",") if part.strip()]
    first = None
    for target in targets:  # (for a job, every rank from the same step on; for any, what a timeout says)
        status = ask(target, {"op": Op.STATUS.value})
        target.rank, target.steps_begun = status.get("rank"), int(status.get("steps_begun", 0))
    if len(targets) > 1:
        first = max(target.steps_begun for target in targets) + STEP_MARGIN
    from xsp.core.rank import rank_path

    for index, target in enumerate(targets):
        rank = target.rank if target.rank is not None else index
        target.output = output if len(targets) == 1 else rank_path(output, rank)
    deadline = time.monotonic() + options.timeout
    written: list[str] = []
    try:
        for target in targets:
            start(target, options.steps, levels, first)
        out = error_console()
        for target in targets:
            try:
                done = wait_done(target, deadline, options.steps, options.timeout)
            except CliError as exc:
                also = f" ({', '.join(written)} written)" if written else ""
                raise CliError(f"{exc}{also}") from None
            written.append(str(done["output"]))
            who = f"process {target.pid}" + ("" if target.rank is None else f" (rank {target.rank})")
            out.print(f"xsp: captured {counted(int(done['steps']), 'step')} of {who} -> {done['output']}",
                      markup=False, highlight=False)
    finally:
        for target in targets:
            if target.connection is not None:
                target.connection.close()
    return 0


def find_targets(pid: int) -> list[Target]:
    """The process's own session, else its children's; a one-line error where there is none."""
    import psutil

    try:
        process = psutil.Process(pid)
        owner = process.uids().real
    except psutil.NoSuchProcess:
        raise CliError(f"no process {pid} is running") from None
    except psutil.AccessDenied:
        raise CliError(f"process {pid} belongs to another user: xsp capture reaches only your own processes") from None
    if owner != os.getuid():
        raise CliError(f"process {pid} belongs to another user: xsp capture reaches only your own processes")
    own = socket_path(pid)
    if own.exists():
        return [Target(pid, own)]
    try:
        children = process.children(recursive=True)
    except psutil.Error:
        children = []
    found = [Target(child.pid, socket_path(child.pid)) for child in children
             if socket_path(child.pid).exists() and _is_rank(child)]
    if not found:
        listening = [child.pid for child in children if socket_path(child.pid).exists()]
        if listening:  # a pre-forking server's workers, each with a session of its own (gunicorn)
            shown = ", ".join(str(child) for child in listening[:8]) + (", ..." if len(listening) > 8 else "")
            which = f"child processes {shown} do" if len(listening) > 1 else f"child process {shown} does"
            raise CliError(f"process {pid} runs no xsp session, but its {which} (a server's workers, each a session "
                           f"of its own): capture one with `xsp capture {listening[0]}`")
        parent = _listening_parent(process)
        if parent is not None:  # a worker its xsp session may follow: those listen where it is always on
            raise CliError(f"process {pid} runs no xsp session that listens, but process {parent}, which started it, "
                           f"does: the child processes an xsp session follows answer a capture only where the session "
                           f"is always on (xsp run --sample, xsp.trace(sample=...)); `xsp capture {parent}` captures "
                           "that process's own steps")
        try:
            closed = process.environ().get(CONTROL_VARIABLE) == "0"
        except psutil.Error:
            closed = False
        if closed:  # it may well run a session: one that opens no channel
            raise CliError(f"process {pid} was started with {CONTROL_VARIABLE}=0: an xsp session there opens no "
                           "channel for xsp capture (start it without that setting to capture its steps)")
        raise CliError(f"process {pid} runs no xsp session (nothing listens at {own}; a session listens unless "
                       f"{CONTROL_VARIABLE}=0, from when the program's xsp.trace() starts), and is no launcher of a "
                       "job's ranks that do")
    return found


def _listening_parent(process: Any) -> int | None:
    """The nearest ancestor of ``process`` that runs an xsp session (its socket listens), if any."""
    try:
        ancestors = process.parents()
    except Exception:  # it ended, or cannot be read
        return None
    return next((ancestor.pid for ancestor in ancestors if socket_path(ancestor.pid).exists()), None)


def _is_rank(process: Any) -> bool:
    """A process a launcher (torchrun) started as one rank of a job: it has ``RANK`` set."""
    try:
        return "RANK" in process.environ()
    except Exception:  # it ended, or cannot be read
        return False


def _connect(target: Target) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(CONNECT_TIMEOUT_S)
    try:
        connection.connect(str(target.path))
    except OSError as exc:
        connection.close()
        raise CliError(f"cannot reach process {target.pid} at {target.path}: {exc.strerror or exc} (its session "
                       "may have ended)") from None
    return connection


def _read_reply(target: Target, connection: socket.socket, deadline: float | None) -> dict[str, Any]:
    while b"\n" not in target.received:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            connection.settimeout(min(left, 1.0))
        try:
            chunk = connection.recv(65_536)
        except TimeoutError:
            continue
        except OSError as exc:
            raise CliError(f"process {target.pid} stopped answering: {exc.strerror or exc}") from None
        if not chunk:
            raise CliError(f"process {target.pid} hung up before answering (its session may have ended)")
        target.received += chunk
    line, target.received = target.received.split(b"\n", 1)
    reply = json.loads(line)
    if not isinstance(reply, dict):
        raise CliError(f"process {target.pid} answered something xsp capture does not understand")
    if reply.get(Reply.ERROR.value):
        raise CliError(f"process {target.pid}: {reply.get('message', 'refused')}")
    return reply


def ask(target: Target, request: dict[str, Any]) -> dict[str, Any]:
    """One request and its one reply, on a connection of its own."""
    connection = _connect(target)
    try:
        connection.sendall((json.dumps(request) + "\n").encode())
        return _read_reply(target, connection, time.monotonic() + CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise CliError(f"process {target.pid} did not answer in {CONNECT_TIMEOUT_S:g} s") from None
    finally:
        target.received = b""
        connection.close()


def start(target: Target, steps: int, levels: list[str] | None, first: int | None) -> None:
    """Ask ``target`` to capture; its connection stays open for the answer that the file is written."""
    connection = _connect(target)
    target.connection = connection
    request = {"op": Op.CAPTURE.value, "steps": steps, "output": str(target.output), "levels": levels,
               "from_step": first}
    connection.sendall((json.dumps(request) + "\n").encode())
    try:
        _read_reply(target, connection, time.monotonic() + CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise CliError(f"process {target.pid} did not answer in {CONNECT_TIMEOUT_S:g} s") from None


def wait_done(target: Target, deadline: float, steps: int, timeout_s: float) -> dict[str, Any]:
    """The reply that the capture's file is written; past ``deadline``, a line that says how many
    of the ``steps`` asked for the process began meanwhile."""
    assert target.connection is not None
    try:
        return _read_reply(target, target.connection, deadline)
    except TimeoutError:
        seen = ""
        try:
            began = int(ask(target, {"op": Op.STATUS.value}).get("steps_begun", 0)) - target.steps_begun
            seen = f" {began:,} of the {steps:,} steps asked for began in {timeout_s:g} s;"
        except (CliError, OSError, ValueError, TypeError):
            pass
        raise CliError(f"process {target.pid} did not complete the capture in time:{seen} no file was written (it may "
                       "serve too few steps: try a larger --timeout)") from None
