"""One writer per trace file: a session claims its output name for as long as it runs.

Two runs given the same output (two terminals, two CI jobs sharing a folder) would each write
the file at their end, and the one that finished first would vanish without a word. A session
therefore claims the name with a small file beside it (``.NAME.xsp-writer``, made with
``O_EXCL``: only one process can) holding its host and process id. A second session that finds
the name claimed by a live process writes ``NAME-2.xsp.parquet`` (or the next free number)
instead, and says so. A claim left by a process that died is taken over.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from xsp.core.schema import FILE_SUFFIX

WRITER_SUFFIX: Final = ".xsp-writer"
MAX_NUMBER: Final = 1000
PARTIAL_CLAIM_S: Final = 10.0
"""A claim without its holder written yet is another process's in the making, this long."""


def writer_file(output: Path) -> Path:
    return output.parent / f".{output.name}{WRITER_SUFFIX}"


def numbered(output: Path, number: int) -> Path:
    """``run.xsp.parquet`` -> ``run-2.xsp.parquet`` (``trace.json`` -> ``trace-2.json``)."""
    name = output.name
    suffix = FILE_SUFFIX if name.endswith(FILE_SUFFIX) else "".join(output.suffixes[-1:])
    stem = name[: len(name) - len(suffix)] if suffix else name
    return output.with_name(f"{stem}-{number}{suffix}")


@dataclass
class Claim:
    """The name a session writes, and the claim it holds on it (None where none could be made)."""

    requested: Path
    """The name the session was given."""
    path: Path
    writer: Path | None
    other_pid: int | None = None
    """The live process that holds the name asked for, when the session writes another."""
    awaiting: Path | None = None
    """The name asked for, when the session writes another because a killed run's windows wait
    there for ``xsp recover`` (the killed run's own file, which this run's would replace)."""

    def release(self) -> None:
        """Give the name up (only a claim that is still this process's)."""
        if self.writer is not None and _holder(self.writer) == (socket.gethostname(), os.getpid()):
            try:
                os.unlink(self.writer)
            except OSError:
                pass
        self.writer = None


def _holder(writer: Path) -> tuple[str, int] | None:
    try:
        host, pid = writer.read_text().split("\n")[:2]
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _alive(host: str, pid: int) -> bool:
    if host != socket.gethostname():
        return True  # another machine's process (a shared folder): it cannot be checked, so it is respected
    if pid == os.getpid():
        return False  # this process's own, left by a session that is over
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _take(writer: Path) -> bool:
    try:
        descriptor = os.open(writer, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"{socket.gethostname()}\n{os.getpid()}\n")
    return True


def forget_dead_claim(output: Path) -> bool:
    """Remove the claim on ``output`` that a process which died left behind (a killed run's, once
    ``xsp recover`` wrote its file); a live or unknown holder's claim stays. True when one was removed."""
    writer = writer_file(output)
    holder = _holder(writer)
    if holder is None or _alive(*holder) or holder == (socket.gethostname(), os.getpid()):
        return False
    try:
        os.unlink(writer)
    except OSError:
        return False
    return True


def claim(output: Path, awaits_recovery: Callable[[Path], bool] = lambda path: False) -> Claim:
    """Claim ``output`` for this process, or the first free numbered name beside it: free of a
    live claim, and of a killed run's windows waiting for ``xsp recover`` (``awaits_recovery``:
    a process restarted with the same id, a container's PID 1, would otherwise take the name and
    its windows' folder over).

    Never raises: where no claim can be made (a read-only folder: the file fails later, and
    says so), the session writes ``output`` unclaimed.
    """
    other: int | None = None
    awaiting: Path | None = None
    for number in range(1, MAX_NUMBER):
        path = output if number == 1 else numbered(output, number)
        try:
            if awaits_recovery(path):
                awaiting = awaiting or path
                continue
        except OSError:
            pass
        writer = writer_file(path)
        for _ in range(3):  # a dead holder's claim is removed, then taken
            try:
                if _take(writer):
                    return Claim(output, path, writer, other, awaiting)
            except OSError:
                return Claim(output, output, None)
            holder = _holder(writer)
            if holder is None and _age_s(writer) < PARTIAL_CLAIM_S:  # being written this moment
                break
            if holder is not None and _alive(*holder):
                other = other if other is not None else holder[1]
                break
            try:
                os.unlink(writer)
            except FileNotFoundError:
                pass
            except OSError:
                return Claim(output, output, None)
    return Claim(output, output, None)
