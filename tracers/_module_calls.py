"""Intercepting nn.Module calls: the shared mechanism of the model and layer tracers.

xsp wraps ``torch.nn.Module.__call__`` instead of registering global forward hooks. Global
hooks push *every* module call onto the slow path of ``Module._call_impl`` (about 1.2 µs per
call on a 2-core x86 machine, before any hook body runs); the wrapper keeps ``_call_impl`` on
its fast path, sees keyword arguments (Hugging Face models are called with ``input_ids=...``)
and sees exceptions. benchmarks/overhead.py measures both side by side.

Two wrappers exist. In ``ROOTS`` mode (model level only) the wrapper only counts call depth
and records top-level calls. In ``ALL`` mode (layer level) it records every call with its
input and output shapes, and while autograd is recording it installs global full backward
hooks so that each module's backward becomes a span too.

Each finished call appends one tuple ``(start, end, module, depth, in_desc, out_desc, error)``
to its thread's buffer; a descriptor is a ``torch.Size`` (one tensor) or a tuple of them.

While the CUDA levels run, each recorded call also pushes its start onto CUPTI's external
correlation stack (and pops it on return), so that every CUDA call made inside it names it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from enum import IntEnum
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from xsp.clock import now_ns
from xsp.recording import COMPACT_AT, Recording

_TENSOR = torch.Tensor
_OWN_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"
"""PyTorch's warning for modules whose inputs need no gradient: caused by xsp's hooks, so
hidden from the user while they are installed."""
Descriptor = tuple[Any, ...] | None
Correlation = tuple[Callable[[int], Any], Callable[[], Any]]
"""``(push, pop)`` of CUPTI external correlation ids around each module call."""


class Mode(IntEnum):
    """How much the wrapper records; a higher mode includes the lower."""

    ROOTS = 1
    ALL = 2


def describe(value: Any) -> Descriptor:
    """Shapes of the tensors in ``value`` (one level into tuples, lists and dicts)."""
    if type(value) is _TENSOR or isinstance(value, _TENSOR):
        return value.shape
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        return None
    shapes = tuple(item.shape for item in items if isinstance(item, _TENSOR))
    return shapes or None


def describe_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Descriptor:
    """Shapes of the tensor arguments, positional first, one level into containers."""
    shapes: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _TENSOR):
            shapes.append(value.shape)
        elif isinstance(value, (tuple, list)):
            shapes.extend(item.shape for item in value if isinstance(item, _TENSOR))
    return tuple(shapes) or None


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _make_roots_wrapper(recording: Recording, original: Callable[..., Any],
                        correlation: Correlation | None = None) -> Callable[..., Any]:
    local, new_buffer = recording.local, recording.buffer
    long_step_ns, step_ended = recording.long_step_ns, recording.on_long_step
    push, pop = correlation if correlation is not None else (None, None)

    def xsp_module_call(self: nn.Module, *args: Any, _orig: Any = original, _now: Any = now_ns,
                        **kwargs: Any) -> Any:
        try:
            buffer = local.b
        except AttributeError:
            buffer = new_buffer()
        depth = buffer.depth
        if depth:
            buffer.depth = depth + 1
            try:
                return _orig(self, *args, **kwargs)
            finally:
                buffer.depth = depth
        buffer.depth = 1
        start = _now()
        if push is not None:
            push(start)
        try:
            out = _orig(self, *args, **kwargs)
        except BaseException as exc:
            end = _now()
            if pop is not None:
                pop()
            buffer.depth = 0
            buffer.calls.append((start, end, self, 0, describe_inputs(args, kwargs), None, error_text(exc)))
            raise
        end = _now()
        if pop is not None:
            pop()
        buffer.depth = 0
        buffer.calls.append((start, end, self, 0, describe_inputs(args, kwargs), describe(out), None))
        if len(buffer.calls) >= COMPACT_AT:
            buffer.compact()
        if end - start >= long_step_ns and step_ended is not None and not buffer.open_steps:
            step_ended(end - start)
        return out

    return xsp_module_call


def _make_all_wrapper(recording: Recording, original: Callable[..., Any], at_root: Callable[[], None],
                      correlation: Correlation | None = None) -> Callable[..., Any]:
    local, new_buffer = recording.local, recording.buffer
    long_step_ns, step_ended = recording.long_step_ns, recording.on_long_step
    push, pop = correlation if correlation is not None else (None, None)

    def xsp_module_call(self: nn.Module, *args: Any, _orig: Any = original, _now: Any = now_ns,
                        _tensor: Any = _TENSOR, **kwargs: Any) -> Any:
        try:
            buffer = local.b
        except AttributeError:
            buffer = new_buffer()
        depth = buffer.depth
        if not depth:
            at_root()
        buffer.depth = depth + 1
        start = _now()
        if push is not None:  # CUPTI tracing: the call's start names it to the CUDA calls inside
            push(start)
        try:
            out = _orig(self, *args, **kwargs)
        except BaseException as exc:
            end = _now()
            if pop is not None:
                pop()
            buffer.depth = depth
            buffer.calls.append((start, end, self, depth, describe_inputs(args, kwargs), None,
                                 error_text(exc)))
            raise
        end = _now()
        if pop is not None:
            pop()
        buffer.depth = depth
        if kwargs or len(args) != 1 or type(args[0]) is not _tensor:
            in_desc = describe_inputs(args, kwargs)
        else:
            in_desc = args[0].shape
        calls = buffer.calls
        calls.append((start, end, self, depth, in_desc,
                      out.shape if type(out) is _tensor else describe(out), None))
        if depth < 2:
            if len(calls) >= COMPACT_AT:
                buffer.compact()
            if (not depth and end - start >= long_step_ns and step_ended is not None
                    and not buffer.open_steps):
                step_ended(end - start)
        return out

    return xsp_module_call


class ModuleCallInterceptor:
    """Installs the ``nn.Module.__call__`` wrapper (and backward hooks) for one recording."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recording: Recording | None = None
        self._users: dict[str, Mode] = {}
        self._original: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._backward_handles: list[Any] = []
        self._warning_filter: Any = None
        self._correlation: Correlation | None = None
        self.foreign_patch = False
        """True when something else replaced ``nn.Module.__call__`` while xsp was installed."""

    @property
    def mode(self) -> Mode | None:
        return max(self._users.values()) if self._users else None

    def acquire(self, user: str, recording: Recording, mode: Mode) -> None:
        """Start recording module calls for ``user`` (a tracer name) in at least ``mode``."""
        with self._lock:
            if self._recording is not None and self._recording is not recording:
                raise RuntimeError("module calls are already being recorded by another xsp session")
            self._recording = recording
            self._users[user] = mode
            self._install()

    def release(self, user: str) -> None:
        """Stop recording for ``user``; uninstall when nobody is left.

        Raises:
            RuntimeError: something else replaced ``nn.Module.__call__`` meanwhile; xsp leaves
                that replacement in place (after cleaning up everything of its own).
        """
        with self._lock:
            self._users.pop(user, None)
            if self._users:
                self._install()
                return
            self._uninstall()
            self._recording = None
            if self.foreign_patch:
                self.foreign_patch = False
                raise RuntimeError("torch.nn.Module.__call__ was replaced by other code while xsp was "
                                   "tracing; xsp left that replacement in place, and module calls that "
                                   "bypassed xsp's wrapper are missing from the trace")

    def correlate(self, correlation: Correlation | None) -> None:
        """Push and pop CUPTI external correlation ids around layer calls (None: stop)."""
        with self._lock:
            self._correlation = correlation
            if self._recording is not None:
                if correlation is not None:
                    self._recording.external_ids = True
                self._install()

    def _install(self) -> None:
        assert self._recording is not None
        current = nn.Module.__call__
        if self._original is None:
            self._original = current
        elif current is not self._wrapper:
            self.foreign_patch = True  # never overwrite another tool's replacement
            return
        if self.mode is Mode.ALL:
            wrapper = _make_all_wrapper(self._recording, self._original, self._sync_backward_hooks,
                                        self._correlation)
        else:
            wrapper = _make_roots_wrapper(self._recording, self._original, self._correlation)
        self._wrapper = wrapper
        nn.Module.__call__ = wrapper  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        self._remove_backward_hooks()
        if self._original is not None:
            if nn.Module.__call__ is self._wrapper:
                nn.Module.__call__ = self._original  # type: ignore[method-assign]
            else:
                self.foreign_patch = True
        self._original = self._wrapper = None

    # backward spans ------------------------------------------------------------------
    def _sync_backward_hooks(self) -> None:
        """At each top-level call: backward hooks on exactly while autograd records a graph.

        Global backward hooks make every module call build a ``BackwardHook``, so they are
        never left on for inference under ``torch.no_grad()``.
        """
        wanted = torch.is_grad_enabled()
        if wanted and not self._backward_handles:
            recording = self._recording
            if recording is None:
                return
            record_begin, record_end = _backward_hooks(recording)
            self._backward_handles = [
                torch_module.register_module_full_backward_pre_hook(record_begin),
                torch_module.register_module_full_backward_hook(record_end),
            ]
            warnings.filterwarnings("ignore", message=_OWN_HOOK_WARNING, category=UserWarning)
            self._warning_filter = warnings.filters[0]
        elif not wanted and self._backward_handles:
            self._remove_backward_hooks()

    def _remove_backward_hooks(self) -> None:
        for handle in self._backward_handles:
            handle.remove()
        self._backward_handles = []
        if self._warning_filter is not None:
            try:
                warnings.filters.remove(self._warning_filter)  # type: ignore[attr-defined]
            except ValueError:  # someone reset the filters meanwhile
                pass
            self._warning_filter = None


def _backward_hooks(recording: Recording) -> tuple[Callable[..., None], Callable[..., None]]:
    buffer_of = recording.buffer

    def record_begin(module: nn.Module, grad_output: Any) -> None:
        buffer_of().backward.append((module, now_ns(), 0))

    def record_end(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        buffer_of().backward.append((module, now_ns(), 1))

    return record_begin, record_end


INTERCEPTOR = ModuleCallInterceptor()
"""The process's one interceptor (there is one ``nn.Module.__call__``)."""
