"""Output files written whole or not at all: a temporary file beside the destination, renamed
over it on success. Light on purpose (no pandas, no pyarrow): the CLI checks its output paths
with these before anything heavy is imported."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from xsp.core.errors import XspError

COPY_CHUNK_BYTES: Final = 1 << 20


class OutputError(XspError, OSError):
    """An output file could not be written (nothing was left at its destination)."""


def describe_os_error(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def destination(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """The file ``path`` names, with its directory made, and whether it is written in place (a
    device or a pipe, such as /dev/null or /dev/stdout).

    A symbolic link is never written through: replacing a regular file it points at would
    turn someone's file (a text file, a config) into a trace. Only a link to a device or a pipe
    (/dev/stdout) is followed, and written in place.

    Raises:
        OutputError: an empty path, a directory, a link to a file, or a directory that cannot
            be made.
    """
    if not str(path):
        raise OutputError("cannot write an empty path")
    given = Path(os.path.abspath(path))
    if given.is_symlink():
        try:
            mode = os.stat(given).st_mode  # what the link leads to, through /proc/self/fd/N too
        except OSError:
            mode = 0
        if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISBLK(mode):
            return given, True  # /dev/stdout and the like: written in place
        raise OutputError(f"cannot write {path}: it is a symbolic link (to {os.readlink(given)}), and xsp never "
                          "writes through one; give the path of the file itself, or remove the link")
    if given.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory")
    if given.exists() and not given.is_file():
        return given, True
    try:
        given.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocking = next((folder for folder in given.parents if folder.exists()), None)
        if blocking is not None and not blocking.is_dir():
            raise OutputError(f"cannot write {path}: {blocking} is a file, not a directory") from None
        raise OutputError(f"cannot write {path}: cannot create its directory "
                          f"({describe_os_error(exc)})") from None
    return given, False


def beside(target: Path, suffix: str) -> Path:
    """A hidden name beside ``target``, unique to this process and call."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` in one rename.

    A failed or interrupted write leaves the destination as it was (no truncated file) and no
    temporary file behind. The temporary name is unique to the process, so a forked child
    writing at the same time never mixes its bytes with the parent's. A device or a pipe
    (/dev/stdout) gets the bytes once they are complete, and is never removed, whatever fails.

    Raises:
        OutputError: the destination is a directory, lies below a file, or cannot be written
            (full disk, no permission), in one line naming the path.
    """
    target, in_place = destination(path)
    if in_place:
        # A device or a pipe is never handed to a writer: some (pyarrow's write_table) remove the
        # path they were given when a write fails, and /dev/full would be gone. The bytes are
        # staged in a private folder, then copied in.
        with tempfile.TemporaryDirectory(prefix="xsp-output-") as folder:
            staged = Path(folder) / target.name
            try:
                yield staged
                with open(staged, "rb") as source, open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink, COPY_CHUNK_BYTES)
            except OSError as exc:
                raise OutputError(f"cannot write {path}: {describe_os_error(exc)}") from None
        return
    temporary = beside(target, "partial")
    try:
        _create_new(temporary)  # a file of its own, never a link someone put there
        yield temporary
        os.replace(temporary, target)  # replaces the name: a link put there meanwhile, not what it points at
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {describe_os_error(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


def _create_new(path: Path) -> None:
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
    os.close(descriptor)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Fail now, as writing ``path`` later would: a directory, a path below a file, no permission.

    Raises:
        OutputError: in one line naming the path.
    """
    target, in_place = destination(path)
    if in_place:
        return
    try:
        probe = beside(target, "probe")
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {describe_os_error(exc)}") from None


def write_output(path: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """``write(temporary_path)``, then move the result to ``path`` atomically (see :func:`atomic_output`)."""
    with atomic_output(path) as temporary:
        write(temporary)
    return Path(path)


def write_text_output(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return write_output(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one existing file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
