"""Exceptions that xsp raises to its callers, and how it warns them."""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any, Final

INTERRUPTED: Final = 130
"""Exit status of a command interrupted by Ctrl-C (128 + SIGINT), where the process cannot end by
the signal itself."""


class XspError(Exception):
    """Base class of every error xsp raises on purpose."""


class UnknownLevelError(XspError, ValueError):
    """A level name that is not one of model, layer, operator, cuda_api, kernel."""


class TraceFormatError(XspError):
    """A file that is not a readable xsp trace (wrong format, truncated, corrupt)."""


class SchemaVersionError(TraceFormatError):
    """A trace written by a newer xsp whose span table this version cannot read."""


class TraceNotFoundError(XspError, FileNotFoundError):
    """No trace file at the given path."""


class TraceTooLargeError(XspError, MemoryError):
    """A trace that would not fit in the machine's free memory if it were loaded whole."""


def first_line(exc: BaseException) -> str:
    """An exception's message as one line: its first (a library's error may run to a page), or the
    exception's type where it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


HELD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals held while DuckDB loads (:func:`imported_duckdb`)."""


def imported_duckdb() -> ModuleType:
    """DuckDB's module, loaded with Ctrl-C (and SIGTERM and SIGHUP, where Python handles them) held
    until it is done: a KeyboardInterrupt inside its extension's set-up aborts the process
    (nanobind's "Critical nanobind error") or leaves the module half made. A signal that came
    meanwhile is handled as soon as the module is loaded."""
    if "duckdb" in sys.modules or threading.current_thread() is not threading.main_thread():
        import duckdb

        return duckdb
    came: list[tuple[int, FrameType | None]] = []
    previous: dict[int, Callable[[int, FrameType | None], Any]] = {}
    for held in HELD_SIGNALS:
        handler = signal.getsignal(held)
        if callable(handler):  # a Python handler (KeyboardInterrupt's, or xsp's own): not the system's
            previous[held] = handler
            signal.signal(held, lambda number, frame: came.append((number, frame)))
    try:
        import duckdb
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
    if came:
        number, frame = came[0]
        previous[number](number, frame)
    return duckdb


@contextmanager
def duckdb_interrupts() -> Iterator[None]:
    """Ctrl-C inside a DuckDB query raised as KeyboardInterrupt, as anywhere else: DuckDB raises its
    own InterruptException, or, where its result is read through Arrow, a RuntimeError saying so."""
    duckdb = imported_duckdb()

    try:
        yield
    except duckdb.InterruptException:
        raise KeyboardInterrupt from None
    except RuntimeError as exc:
        if "interrupt" in str(exc).lower():
            raise KeyboardInterrupt from None
        raise


class XspWarning(UserWarning):
    """Something xsp could not do; the user's program carries on regardless."""


OWN_PACKAGES = ("xsp", "xsp.tracers", "xsp.analysis")
"""xsp's packages (``tracers`` and ``analysis`` live in folders of their own)."""


THREADS_FILE: Final = os.path.realpath(threading.__file__)
NO_LINE_OF_YOURS: Final = ("xsp", 0)
"""Where a warning from one of xsp's own threads is said (``xsp:0: XspWarning: ...``): no line of
the program's made it, and Python's ``threading.py`` is no place to send the user to."""


def warn(warning: XspWarning) -> None:
    """Say ``warning`` at the user's line: the innermost calling frame outside xsp's packages; in
    xsp's own threads, where there is none, at :data:`NO_LINE_OF_YOURS`."""
    folders = tuple(os.path.join(os.path.realpath(folder), "") for name in OWN_PACKAGES
                    if (package := sys.modules.get(name)) is not None for folder in getattr(package, "__path__", ()))
    frame, level = sys._getframe(1), 2  # 1 is this function's caller, as warnings.warn counts
    while frame.f_back is not None and os.path.realpath(frame.f_code.co_filename).startswith(folders):
        frame, level = frame.f_back, level + 1
    where = os.path.realpath(frame.f_code.co_filename)
    if where == THREADS_FILE or (frame.f_back is None and where.startswith(folders)):
        warnings.warn_explicit(warning, XspWarning, *NO_LINE_OF_YOURS, module="xsp")
        return
    warnings.warn(warning, stacklevel=level)
