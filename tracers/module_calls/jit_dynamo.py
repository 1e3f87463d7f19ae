"""Stepping aside for torch.jit and dynamo: dynamo starts tracing past the wrapper, and a
thread's buffer is set aside while the jit tracer runs."""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Final

import torch

import xsp.core
import xsp.tracers
from xsp.record.recording import (
    Recording,
)
from xsp.tracers.module_calls.call_context import (
    JIT_TRACE_ENTRIES,
)


def _folder(path: str) -> str:
    """The folder ``path`` is in, with a trailing separator (as dynamo's SKIP_DIRS has them)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), "")


XSP_FOLDERS: Final = tuple(dict.fromkeys((_folder(os.path.dirname(xsp.core.__file__)), _folder(xsp.tracers.__file__))))
"""The folders of xsp's code, with a trailing separator: ``xsp/`` and its ``tracers/``
(``xsp.tracers``, a folder of its own in a development install)."""


def let_dynamo_start_past_the_wrapper(trace_rules: ModuleType) -> None:
    """Give xsp's code the rule dynamo gives ``nn.Module.__call__``: inlined where traced code
    calls it, skipped where it would be a compiled frame of its own.

    A compiled module calls ``_orig_mod.__call__``, which is the wrapper while xsp runs; left
    to the default rule, dynamo would compile the wrapper's frame into an empty graph and count
    a graph break where the model breaks its graph, one frame further than without xsp. The
    same holds for every Python function of xsp's that runs where dynamo's frame hook is set
    without tracing (the part of a compiled call after a graph break runs eagerly): the
    wrapper's bookkeeping (``Interner.intern``, ``ThreadBuffer.record_backward``), the backward
    hooks. So the rule is given to the folders of xsp's code (:data:`XSP_FOLDERS`), not to one
    file: traced code inlines xsp's as before, and no frame of xsp's is dynamo's to compile.
    Dynamo keeps such rules for the process; so does xsp (they concern xsp's files only).
    """
    skip_dirs = getattr(trace_rules, "SKIP_DIRS", None)
    inline_when_called = getattr(trace_rules, "BUILTIN_INLINE_WHEN_CALLED", None)
    recompile = getattr(trace_rules, "_recompile_re", None)
    if not isinstance(skip_dirs, list) or not isinstance(inline_when_called, set) or recompile is None:
        return  # another PyTorch: compiled frames of the wrapper cost an empty graph, nothing worse
    added = [folder for folder in XSP_FOLDERS if folder not in skip_dirs]
    if added:
        inline_when_called.update(added)
        skip_dirs.extend(added)
        recompile()


def set_aside_while_jit_traces(recording: Recording) -> list[tuple[Any, str, Any, Any]]:
    """Make each of ``JIT_TRACE_ENTRIES`` set its thread's buffer ``aside`` while it runs; the
    patches made (the entries this PyTorch has)."""
    buffer_of = recording.buffer
    patches = []
    for owner, name in JIT_TRACE_ENTRIES:
        original = owner.__dict__.get(name)
        if original is None:
            continue

        def tracing(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            buffer = buffer_of()
            buffer.aside += 1
            try:
                return _original(*args, **kwargs)
            finally:
                buffer.aside -= 1

        tracing.__name__ = tracing.__qualname__ = name
        try:
            setattr(owner, name, tracing)
        except (AttributeError, TypeError):
            continue
        patches.append((owner, name, original, tracing))
    return patches


def dynamo_traces() -> bool:
    """True while dynamo (or export) traces code, on this thread or any."""
    flag = getattr(torch.compiler, "_is_compiling_flag", None)
    if flag is not None:  # PyTorch 2.13 on: held True through every dynamo compile and export
        return bool(flag)
    guards = sys.modules.get("torch._guards")
    context = getattr(guards, "TracingContext", None)
    try_get = getattr(context, "try_get", None)
    if try_get is not None and try_get() is not None:
        return True
    compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(compiling is not None and compiling())
