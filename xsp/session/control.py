"""A running session's control channel: the Unix-domain socket ``xsp capture`` talks to
(:mod:`xsp.core.control` says where it is and what is said). One thread of xsp's accepts each
caller, checks that it is this process's user, reads its one request and hands it to the
session's handler with a :class:`Caller` to answer through (now, or later from another thread)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from xsp.core.control import CONTROL_VARIABLE, SOCKET_SUFFIX, Reply, control_folder, private_folder, socket_path
from xsp.core.threads import start_thread

REQUEST_TIMEOUT_S: Final = 5.0
"""How long a caller may take to send its request."""
MAX_REQUEST_BYTES: Final = 65_536


class Caller:
    """One connection of ``xsp capture``: what the session says to it, one JSON object a line."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection

    def say(self, reply: Reply, **fields: Any) -> None:
        """Send ``{reply: true, **fields}`` (a caller that went away is not an error)."""
        line = json.dumps({reply.value: True, **fields}, default=str) + "\n"
        with contextlib.suppress(OSError):
            self.connection.sendall(line.encode())

    def gone(self) -> bool:
        """The caller hung up (it gave up waiting)."""
        try:
            data = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return data == b""

    def refuse(self, message: str) -> None:
        """Say why the request cannot be done, and hang up."""
        self.say(Reply.ERROR, message=message)
        self.end()

    def end(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.close()


Handler = Callable[[dict[str, Any], Caller], None]
"""The session's: does (or starts) what a request asks and answers through the caller."""


class ControlChannel:
    """The listening socket and its thread; :meth:`open` makes one."""

    def __init__(self, listener: socket.socket, path: Path, handle: Handler) -> None:
        self.listener = listener
        self.path = path
        self.handle = handle
        self.owner_pid = os.getpid()
        self.closed = False
        self.thread = start_thread(self._serve, "xsp-control")

    @classmethod
    def open(cls, handle: Handler, warn: Callable[[str], None]) -> ControlChannel | None:
        """Listen at this process's socket; None (said once) where it cannot be made, or
        ``XSP_CONTROL=0`` asks for none."""
        if os.environ.get(CONTROL_VARIABLE, "1") == "0" or not hasattr(socket, "AF_UNIX"):
            return None
        folder = control_folder()
        problem = private_folder(folder)
        path = socket_path(os.getpid(), folder)
        if problem is None:
            _forget_ended(folder)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # bound under another name and renamed once private: the socket never shows at its
            # path with the umask's mode (a caller that found it there saw 0755 for a moment)
            binding = path.with_suffix(".binding")
            try:
                for stale in (path, binding):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()  # an earlier process of the same id ended without removing it
                try:
                    listener.bind(str(binding))
                except FileNotFoundError:  # another session removed the folder, empty, just now
                    private_folder(folder)
                    listener.bind(str(binding))
                binding.chmod(0o600)
                listener.listen(4)
                os.replace(binding, path)
            except OSError as exc:
                listener.close()
                with contextlib.suppress(OSError):
                    binding.unlink()
                problem = f"cannot listen at {path}: {exc.strerror or exc}"
            else:
                return cls(listener, path, handle)
        warn(f"`xsp capture` cannot reach this process: {problem}")
        return None

    def close(self) -> None:
        """Stop listening and remove the socket (only the process that made it does)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.listener.close()
        if os.getpid() == self.owner_pid:
            with contextlib.suppress(OSError):
                self.path.unlink()
            with contextlib.suppress(OSError):  # the folder, where no other session listens in it
                self.path.parent.rmdir()

    def _serve(self) -> None:
        while not self.closed:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                self._answer(connection)
            except Exception as exc:  # one caller's trouble never ends the channel
                Caller(connection).refuse(f"the request failed: {type(exc).__name__}: {exc}")

    def _answer(self, connection: socket.socket) -> None:
        caller = Caller(connection)
        if _peer_uid(connection) not in (None, os.getuid()):
            caller.refuse("this process belongs to another user")
            return
        connection.settimeout(REQUEST_TIMEOUT_S)
        received = b""
        while b"\n" not in received and len(received) < MAX_REQUEST_BYTES:
            chunk = connection.recv(4096)
            if not chunk:
                break
            received += chunk
        connection.settimeout(None)
        try:
            request = json.loads(received.split(b"\n", 1)[0] or b"null")
        except ValueError:
            request = None
        if not isinstance(request, dict):
            caller.refuse("a request is one JSON object on one line")
            return
        self.handle(request, caller)


def _forget_ended(folder: Path) -> None:
    """Remove the sockets of processes that have ended without removing their own (killed)."""
    try:
        found = list(folder.glob(f"*{SOCKET_SUFFIX}"))
    except OSError:
        return
    for path in found:
        name = path.name[:-len(SOCKET_SUFFIX)]
        if not name.isdigit():
            continue
        try:
            os.kill(int(name), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
        except OSError:  # alive (another user's, which cannot be signalled): left
            pass


def _peer_uid(connection: socket.socket) -> int | None:
    """The user id of the process at the other end (None where the system cannot say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        _pid, uid, _gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return None
    return int(uid)
