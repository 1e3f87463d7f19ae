"""Where a running session listens for ``xsp capture``: a Unix-domain socket per process, in a
folder only its user can open, and what is said over it (one JSON object per line).

The folder is ``$XDG_RUNTIME_DIR/xsp`` where that variable names a folder, else
``/tmp/xsp-<uid>``; it is made with mode 0700 and refused when another user owns it or others
can enter it. The socket is ``<pid>.sock`` there, mode 0600, and the session also checks each
caller's user id (``SO_PEERCRED``)."""

from __future__ import annotations

import enum
import os
import stat
import tempfile
from pathlib import Path
from typing import Final

CONTROL_VARIABLE: Final = "XSP_CONTROL"
"""``XSP_CONTROL=0``: sessions open no control socket (``xsp capture`` cannot reach them)."""
SOCKET_SUFFIX: Final = ".sock"
MAKE_TRIES: Final = 5
"""How often the folder is made again when another session removes it just as it is made."""


class Op(str, enum.Enum):
    """What a request asks (its ``op``)."""

    STATUS = "status"
    CAPTURE = "capture"


class Reply(str, enum.Enum):
    """The key that says what a reply is."""

    STATUS = "status"
    ACCEPTED = "accepted"
    DONE = "done"
    ERROR = "error"


def control_folder() -> Path:
    """The folder of this user's control sockets (not made here)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "xsp"
    return Path(tempfile.gettempdir()) / f"xsp-{os.getuid()}"


def socket_path(pid: int, folder: Path | None = None) -> Path:
    """Where process ``pid`` of this user listens."""
    return (folder or control_folder()) / f"{pid}{SOCKET_SUFFIX}"


def private_folder(folder: Path) -> str | None:
    """Make ``folder`` (mode 0700) if needed; a sentence saying why it cannot be used, or None."""
    for _ in range(MAKE_TRIES):
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"cannot make {folder}: {exc.strerror or exc}"
        try:
            found = os.lstat(folder)
            break
        except FileNotFoundError:
            # another session of this user's, ending, removed it (empty) between the two calls:
            # the workers of one server start and end together
            continue
        except OSError as exc:
            return f"cannot look at {folder}: {exc.strerror or exc}"
    else:
        return f"cannot make {folder}: it was removed each time it was made ({MAKE_TRIES} times)"
    if not stat.S_ISDIR(found.st_mode):
        return f"{folder} is not a folder"
    if found.st_uid != os.getuid():
        return f"{folder} belongs to another user"
    if found.st_mode & 0o077:
        return f"{folder} can be opened by other users (mode {stat.S_IMODE(found.st_mode):o}; 700 is needed)"
    return None
