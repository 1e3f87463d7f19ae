"""xsp's C accelerator, where it was built: ``xsp.record._hotpath`` (``xsp/record/_hotpath/``).

Three things run there when it is available: the common cases of the ``nn.Module.__call__``
wrapper (:mod:`xsp.tracers.module_calls.interceptor`), the packing of raw records into columns
(:func:`xsp.record.recording.extend_columns`), and an always-on session's decision of each step's
depth (:class:`xsp.record.sampling.StepSampler`'s core). Each has a Python twin that does the same (tests run
both), so xsp works where the extension could not be built (no C compiler at install time),
only with a dearer module call.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Final

PURE_PYTHON_ENV: Final = "XSP_PURE_PYTHON"
"""Set (to anything but empty) to run everything in Python even where the C part is built."""


def optional_extension(module: str) -> Any:
    """One of xsp's optional C extensions (``xsp.record._hotpath``, ``xsp.io._kineto``...), or None
    when it is not built or ``XSP_PURE_PYTHON`` is set. Imported by name: the import contracts
    cannot see into an extension module."""
    if os.environ.get(PURE_PYTHON_ENV):
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def load() -> Any:
    """``xsp.record._hotpath``, or None when it is not built or ``XSP_PURE_PYTHON`` is set."""
    return optional_extension("xsp.record._hotpath")


def mismatch_note(error: Exception) -> str:
    """What to say when the C part refuses this Python code: it finds every ``__slots__`` member of
    ``ThreadBuffer`` and ``AutoSteps`` it reads or writes by name and type as it starts, so a slot
    renamed or retyped without the C side is refused there, never read at a stale offset."""
    return (f"xsp's C module-call wrapper does not match this installation ({error}): module calls and step "
            "hooks are recorded in Python, at a higher cost per call (reinstall xsp to rebuild it)")


HOTPATH: Any = load()
"""The loaded extension, or None. Read at use (tests switch it off by setting it to None)."""
