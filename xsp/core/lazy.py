"""Heavy libraries imported on first use, so that entering a session costs the user's program
next to nothing: pandas, pyarrow and OpenTelemetry's SDK take most of a second to import, and a
session needs them only when it interprets what it recorded (in its window thread, or at its
end).

A module that needs pandas only inside its functions takes its stand-in from here, which type
checkers see as the module itself::

    from xsp.core.lazy import pandas as pd

The first attribute read imports the module; each attribute read is then kept on the stand-in,
so later reads cost what a module's attribute read costs. Nothing is put in ``sys.modules``:
the program's own ``import pandas`` is untouched.

The session's window thread imports them as it starts, beside the program: :func:`forks_wait`
keeps that from harming the program (its forks wait for the imports; its threads get the GIL
back quickly meanwhile).
"""

from __future__ import annotations

import contextlib
import importlib
import logging  # noqa: F401  (its fork hook is registered before this module's: see below)
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from xsp.core.threads import start_thread


class LazyModule(types.ModuleType):
    """A stand-in for the module of its name, imported when an attribute is first read."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and inspect probing dunders import nothing
        background_imports_done()  # (two threads importing pandas at once can each get it half made)
        value = getattr(importlib.import_module(self.__name__), attribute)
        setattr(self, attribute, value)
        return value


HEAVY_MODULES: Final = ("pandas", "pyarrow", "pyarrow.compute", "pyarrow.parquet", "pyarrow.ipc")
"""What interpreting a session's records needs: the window thread imports them as it starts."""

IMPORT_SWITCH_S: Final = 1e-4
"""The GIL's switch interval while xsp imports beside the program: a thread of the program that
wants the GIL back (after a torch operator released it) waits about this long for it, not
Python's 5 ms, so the imports do not slow the steps they overlap."""
_switch_s: float | None = None
"""The program's switch interval while xsp's imports run with :data:`IMPORT_SWITCH_S`."""
_ours_s = IMPORT_SWITCH_S
""":data:`IMPORT_SWITCH_S` as Python keeps it (whole microseconds)."""
_IMPORTING = threading.RLock()
"""Held while a thread of xsp imports beside the program; a fork waits for it (:func:`forks_wait`),
and so do xsp's own imports on other threads (:func:`background_imports_done`)."""


@contextlib.contextmanager
def forks_wait() -> Iterator[None]:
    """While the block runs (imports on a thread of xsp's), a fork of the process waits for it.

    A child forked while another thread is inside an import inherits that module's import lock,
    held by a thread it does not have: its own import of the module then waits forever (a
    DataLoader worker, a Pool's, xsp's own end in the child). The program's forks wait instead,
    at most as long as the imports take, and only while they run. Nothing in the block may fork.
    Meanwhile the GIL changes hands every :data:`IMPORT_SWITCH_S`, so that the program's threads
    are not held up by the imports."""
    global _switch_s, _ours_s
    with _IMPORTING:
        _switch_s = sys.getswitchinterval()
        sys.setswitchinterval(IMPORT_SWITCH_S)
        _ours_s = sys.getswitchinterval()
        try:
            yield
        finally:
            _restore_switch()


def background_imports_done() -> None:
    """Wait until xsp's imports beside the program (on another thread) are done, at most
    :data:`FORK_WAIT_S`. Two threads importing pandas or pyarrow at once can deadlock on their
    modules' import locks, which Python breaks by handing one of them a module half made (the
    session's end then failed: ``partially initialized module 'pandas'``). So xsp imports them on
    one thread at a time: the stand-ins' first reads wait, and so does a session's end. So does a
    ``torch.compile`` that begins meanwhile: dynamo iterates numpy's module dicts, which the imports
    grow."""
    if _IMPORTING.acquire(timeout=FORK_WAIT_S):
        _IMPORTING.release()


def _restore_switch() -> None:
    global _switch_s
    if _switch_s is not None and sys.getswitchinterval() == _ours_s:  # unless the program set its own
        sys.setswitchinterval(_switch_s)
    _switch_s = None


def import_modules(names: tuple[str, ...]) -> None:
    """Import ``names`` now (inside :func:`forks_wait` when beside the program)."""
    for name in names:
        importlib.import_module(name)


SESSION_MODULES: Final = (*HEAVY_MODULES, "xsp.export.otlp")
"""What a session imports beside the program: what its windows are interpreted and exported with."""


def import_in_background(names: tuple[str, ...] = SESSION_MODULES) -> None:
    """Start importing ``names`` on a thread of xsp's (:func:`forks_wait` holds meanwhile).

    ``xsp run`` calls this before the script runs: the script's own ``import torch`` and model
    building then overlap the imports, where a session's window thread would otherwise import
    them beside its first steps (and slow them: p90 of a small CNN's steps 7 ms instead of 1.5)."""

    def run() -> None:
        with contextlib.suppress(Exception), forks_wait():  # what fails here fails again where it is used
            import_modules(names)

    start_thread(run, "xsp-imports")


FORK_WAIT_S: Final = 10.0
"""The longest a fork waits for xsp's imports: past it, the fork goes on (never a hang of the
program's own; the child may then wait on a module those imports held)."""
_fork = threading.local()


def _hold_for_fork() -> None:
    _fork.held = _IMPORTING.acquire(timeout=FORK_WAIT_S)


def _free_in_parent() -> None:
    if getattr(_fork, "held", False):
        _fork.held = False
        _IMPORTING.release()


def _fresh_in_child() -> None:
    global _IMPORTING
    _fork.held = False
    _IMPORTING = threading.RLock()  # no thread of the parent's imports here
    _restore_switch()  # (forked past the wait: the block's end is not the child's)


# Hooks run before a fork in the reverse order of their registration, and logging's takes
# logging's lock, which an import on xsp's thread needs (getLogger): registered after it, this
# hook waits for the imports before logging's lock is taken.
os.register_at_fork(before=_hold_for_fork, after_in_parent=_free_in_parent, after_in_child=_fresh_in_child)


def lazy_module(name: str) -> Any:
    """A stand-in for the module ``name`` (such as ``"pyarrow.compute"``), imported on first use."""
    return LazyModule(name)


if TYPE_CHECKING:
    import pandas
    import pyarrow
    import pyarrow.compute as pyarrow_compute
    import pyarrow.parquet as pyarrow_parquet
    from opentelemetry.sdk.trace import export as otel_span_export
else:
    pandas = lazy_module("pandas")
    pyarrow = lazy_module("pyarrow")
    pyarrow_compute = lazy_module("pyarrow.compute")
    pyarrow_parquet = lazy_module("pyarrow.parquet")
    otel_span_export = lazy_module("opentelemetry.sdk.trace.export")
