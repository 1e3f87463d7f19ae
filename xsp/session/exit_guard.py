"""``os._exit`` while a session runs: end the session first (its file written), then exit.

``os._exit`` runs no exit hook (no ``atexit`` callback, no ``finally`` block, no ``with``
exit), so a program that ends with it would leave only the windows closed so far, and a
hidden folder for ``xsp recover``. While a session runs, ``os._exit`` is replaced by a
function that first ends the session in the process that started it, then exits with the
status asked for. Elsewhere (a child forked by the program, a DataLoader worker, xsp's own
helpers) it exits at once, as the original does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, NoReturn

_ORIGINAL_EXIT: Callable[[int], NoReturn] = os._exit
_lock = threading.Lock()
_ending: Callable[[int], None] | None = None
_owner_pid = 0
_replaced: Any = None
"""What ``os._exit`` was when xsp replaced it (the original, or another tool's replacement)."""


def guard(ending: Callable[[int], None]) -> None:
    """Have ``os._exit(status)`` in this process call ``ending(status)`` first (once)."""
    global _ending, _owner_pid, _replaced
    with _lock:
        _ending, _owner_pid = ending, os.getpid()
        if os._exit is not _guarded_exit:
            _replaced = os._exit
            os._exit = _guarded_exit


def unguard() -> None:
    """``os._exit`` as it was (unless something replaced xsp's since)."""
    global _ending, _replaced
    with _lock:
        _ending = None
        if os._exit is _guarded_exit and _replaced is not None:
            os._exit = _replaced
            _replaced = None


def _guarded_exit(status: int) -> NoReturn:
    global _ending
    with _lock:
        ending = _ending if os.getpid() == _owner_pid else None
        _ending = None
    if ending is not None:
        try:
            ending(status)
        except BaseException:  # noqa: S110  (the exit asked for happens whatever the session did)
            pass
    exit_now = _replaced if _replaced is not None else _ORIGINAL_EXIT
    exit_now(status)
    raise SystemExit(status)  # for a replacement that returned (os._exit never does)
