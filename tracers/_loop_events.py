"""The model-level events of the user's loop, besides model calls: input waits, optimizer steps,
backward passes, ``generate()`` calls and ``torch.compile`` compilations.

Each becomes a model-level record of its thread and drives that thread's automatic steps
(:mod:`xsp.record.steps`): a DataLoader wait may begin a step, an optimizer step ends a training
step, a ``generate()`` call is a step. All are a handful per iteration, never per layer.

What is patched, and why there:

* ``_next_data`` of each DataLoader iterator class (not ``__next__``, whose warnings name
  their caller) and ``DataLoader.__iter__`` (starting an epoch's workers blocks the loop too);
* PyTorch's global optimizer step hooks;
* ``torch.autograd.backward``, which ``Tensor.backward`` calls;
* ``torch.jit``'s trace check, which runs the model again once it is traced: no step of the
  user's loop, so nothing is recorded inside it (not ``torch.jit.trace`` itself, which dynamo
  wraps for good the first time it compiles);
* ``transformers``' ``GenerationMixin.generate``, once transformers is imported;
* dynamo's compile start/end callbacks, once ``torch._dynamo`` is imported (and
  ``torch._dynamo.reset``, which would clear them).

Everything is undone at stop, and nothing is replaced that is no longer xsp's own.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any, Final

import torch

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.lazy import background_imports_done
from xsp.core.schema import ATTR_GENERATE_SAMPLES, CLOSURE_SUFFIX
from xsp.record import hotpath
from xsp.record.marks import MarkKind
from xsp.record.recording import Recording, ThreadBuffer
from xsp.record.steps import GENERATE_SUFFIX, AutoSteps, hotpath_constants
from xsp.record.user_spans import span
from xsp.tracers._post_import import forget, when_imported
from xsp.tracers.module_calls.call_context import dynamo_compiling
from xsp.tracers.module_calls.call_values import error_text
from xsp.tracers.module_calls.model_names import model_name

BACKWARD_NAME: Final = "backward"
COMPILE_NAME: Final = "torch.compile"
GENERATION_MODULE: Final = "transformers.generation.utils"
DYNAMO_CALLBACKS: Final = "torch._dynamo.callback"
ATTR_WORKERS: Final = col.ATTR_INPUT_WORKERS
ATTR_PIN_MEMORY: Final = col.ATTR_INPUT_PIN_MEMORY
ATTR_PERSISTENT_WORKERS: Final = col.ATTR_INPUT_PERSISTENT_WORKERS
ATTR_PREFETCH_FACTOR: Final = col.ATTR_INPUT_PREFETCH_FACTOR
ATTR_COMPILE_ID: Final = "xsp.compile.id"
ATTR_COMPILE_TRIGGER: Final = "xsp.compile.trigger"


class _Patch:
    """One attribute replaced on an object, put back only while it is still ours."""

    def __init__(self, owner: Any, name: str, replacement: Callable[..., Any]) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = owner.__dict__[name]
        setattr(owner, name, replacement)

    def undo(self) -> None:
        if self.owner.__dict__.get(self.name) is self.replacement:
            setattr(self.owner, self.name, self.original)


class LoopEvents:
    """Installs the patches and hooks above for one recording."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._patches: list[_Patch] = []
        self._handles: list[Any] = []
        self._local = threading.local()
        self._optimizer_names: dict[type, str] = {}
        self._compile_callbacks: tuple[Any, Any] | None = None
        self._fast: Any = None
        """``xsp.record._hotpath.StepEvents``, where xsp's C extension is built: the bodies of the
        optimizer hooks in C (the hooks stay Python functions, which dynamo can inline and whose
        first test it folds, as it does the module-call wrapper's: a compiled ``optimizer.step``
        runs them), and ``torch.autograd.backward``'s replacement, all of C."""
        if hotpath.HOTPATH is not None:
            try:
                self._fast = hotpath.HOTPATH.StepEvents(recording.local, recording.new_buffer, now_ns, error_text,
                                                        self._optimizer_names, ThreadBuffer, AutoSteps,
                                                        hotpath_constants(), MarkKind.BACKWARD, MarkKind.OPTIMIZER,
                                                        BACKWARD_NAME, recording.sites.of_frame)
            except (TypeError, AttributeError) as exc:  # a slot the C part needs is missing: hooks in Python
                recording.notes.append(hotpath.mismatch_note(exc))

    def install(self) -> None:
        self._patch_dataloader()
        self._hook_optimizers()
        self._watch_zero_grad()
        self._patches.append(_Patch(torch.autograd, "backward", self._backward(torch.autograd.backward)))
        from torch.jit import _trace

        if "_check_trace" in _trace.__dict__:
            self._patches.append(_Patch(_trace, "_check_trace", self._aside(_trace.__dict__["_check_trace"])))
        when_imported(GENERATION_MODULE, self._patch_generate)
        when_imported(DYNAMO_CALLBACKS, self._watch_compiles)

    def uninstall(self) -> None:
        forget(GENERATION_MODULE, self._patch_generate)
        forget(DYNAMO_CALLBACKS, self._watch_compiles)
        for patch in reversed(self._patches):
            patch.undo()
        self._patches = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._unwatch_compiles()

    def _stack(self, what: str) -> list[Any]:
        stack = getattr(self._local, what, None)
        if stack is None:
            stack = []
            setattr(self._local, what, stack)
        return stack

    # input waits ---------------------------------------------------------------------
    def _patch_dataloader(self) -> None:
        from torch.utils.data import dataloader

        for cls in dataloader._BaseDataLoaderIter.__subclasses__():
            if "_next_data" in cls.__dict__:
                waits = self._input_wait(cls.__dict__["_next_data"], col.INPUT_NEXT_NAME)
                self._patches.append(_Patch(cls, "_next_data", waits))
        self._patches.append(_Patch(dataloader.DataLoader, "__iter__",
                                    self._input_wait(dataloader.DataLoader.__dict__["__iter__"], col.INPUT_ITER_NAME)))

    def _input_wait(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        recording = self.recording
        buffer_of = recording.buffer
        hands_over = name != col.INPUT_ITER_NAME  # a next() always follows __iter__ at once: its wait hands over
        iterators_seen: weakref.WeakSet[Any] = weakref.WeakSet()
        worker_pids = recording.input_worker_pids
        site_of = recording.sites.of_frame

        @functools.wraps(original)
        def wait(loader: Any) -> Any:
            try:  # its workers, once: were they started in the session? (no object made per batch)
                if loader not in iterators_seen:
                    iterators_seen.add(loader)
                    worker_pids.update(int(worker.pid) for worker in getattr(loader, "_workers", None) or ()
                                       if worker.pid is not None)
            except Exception:  # a loader that takes no weak reference, a closed worker: not counted
                pass
            buffer = buffer_of()
            steps = buffer.steps
            buffer.input_waits += 1  # a window due from here on waits for the wait's end
            began = now_ns()
            steps.wait_begins(began)
            attributes = {ATTR_WORKERS: getattr(loader, "_num_workers", getattr(loader, "num_workers", None)),
                          ATTR_PIN_MEMORY: getattr(loader, "_pin_memory", getattr(loader, "pin_memory", None)),
                          ATTR_PERSISTENT_WORKERS: getattr(loader, "_persistent_workers",
                                                           getattr(loader, "persistent_workers", None)),
                          ATTR_PREFETCH_FACTOR: getattr(loader, "_prefetch_factor", getattr(loader, "prefetch_factor",
                                                                                            None))}
            error = None
            site = site_of(sys._getframe(1))  # the loop's line (`for batch in loader:`): where the time went
            start = now_ns()
            try:
                return original(loader)
            except StopIteration:  # the loop is over: this wait begins no step
                steps.forget_wait(began)
                raise
            except BaseException as exc:
                error = error_text(exc)
                raise
            finally:
                end = now_ns()
                buffer.marks.append((MarkKind.INPUT, start, end, name, attributes, error, site))
                steps.piece_ends(end)
                buffer.input_waits -= 1
                if hands_over and recording.window_deferred and not buffer.input_waits:
                    wait_over = recording.on_wait_over
                    if wait_over is not None:
                        wait_over()

        return wait

    # optimizer steps -----------------------------------------------------------------
    def _closure_recorded(self, opt: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """The step's arguments with its closure (``optimizer.step(closure)``) wrapped to record
        its run as a ``user`` span (``<Optimizer>.step.closure``): the program's forward, loss
        and backward, inside the optimizer span but not the optimizer's work. None: no closure."""
        positional = len(args) > 1 and "closure" not in kwargs  # (args[0] is the optimizer)
        closure = kwargs.get("closure") if not positional else args[1]
        if closure is None or not callable(closure):
            return None
        buffer_of = self.recording.buffer
        name = self._optimizer_name(opt) + CLOSURE_SUFFIX

        def closure_recorded() -> Any:
            start, error = now_ns(), None
            try:
                return closure()
            except BaseException as exc:
                error = error_text(exc)
                raise
            finally:
                buffer_of().marks.append((MarkKind.USER, start, now_ns(), name, None, error))

        if positional:
            return (args[0], closure_recorded, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_recorded}

    def _optimizer_name(self, opt: Any) -> str:
        """``SGD.step``: the name of an optimizer's step span, made once a type (xsp's C part
        fills the same table)."""
        name = self._optimizer_names.get(type(opt))
        if name is None:
            name = self._optimizer_names[type(opt)] = f"{type(opt).__name__}.step"
        return name

    def _hook_optimizers(self) -> None:
        from torch.optim import optimizer

        buffer_of = self.recording.buffer
        optimizer_name = self._optimizer_name
        fast = self._fast
        site_of = self.recording.sites.of_frame
        closure_recorded = self._closure_recorded
        if fast is not None:
            begins, ends = fast.optimizer_begins, fast.optimizer_ends

            def before_in_c(opt: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
                if dynamo_compiling():
                    return None
                if begins(opt):
                    buffer_of().steps.optimizer_begins(id(opt))
                return closure_recorded(opt, args, kwargs)

            def after_in_c(opt: Any, args: Any, kwargs: Any) -> None:
                if not dynamo_compiling():
                    no_step_open = ends(opt)
                    if no_step_open is not None:
                        start, end = no_step_open
                        buffer_of().steps.optimizer_ends(start, end, id(opt))

            self._handles += [optimizer.register_optimizer_step_pre_hook(before_in_c),
                              optimizer.register_optimizer_step_post_hook(after_in_c)]
            return

        def before(opt: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            if dynamo_compiling():
                return None
            buffer = buffer_of()
            buffer.optimizer_starts.append(now_ns())
            buffer.steps.optimizer_begins(id(opt))
            return closure_recorded(opt, args, kwargs)

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            if dynamo_compiling():
                return
            end = now_ns()
            buffer = buffer_of()
            starts = buffer.optimizer_starts
            start = starts.pop() if starts else end
            buffer.marks.append((MarkKind.OPTIMIZER, start, end, optimizer_name(opt), None, None,
                                 site_of(sys._getframe(1))))
            buffer.steps.optimizer_ends(start, end, id(opt))

        self._handles += [optimizer.register_optimizer_step_pre_hook(before),
                          optimizer.register_optimizer_step_post_hook(after)]

    # zero_grad() ---------------------------------------------------------------------
    def _watch_zero_grad(self) -> None:
        """``zero_grad()`` throws the gradients so far away: backward passes before it with no
        optimizer step were an iteration of their own (a warm-up), not micro-batches of the next."""
        from torch.optim import Optimizer

        buffer_of = self.recording.buffer
        for owner in (Optimizer, torch.nn.Module):
            original = owner.__dict__.get("zero_grad")
            if original is None:
                continue

            def zero_grad(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if not dynamo_compiling():
                    buffer_of().steps.gradients_cleared()
                return _original(*args, **kwargs)

            functools.update_wrapper(zero_grad, original)
            self._patches.append(_Patch(owner, "zero_grad", zero_grad))

    # torch.jit.trace's check ---------------------------------------------------------
    def _aside(self, original: Callable[..., Any]) -> Callable[..., Any]:
        buffer_of = self.recording.buffer

        @functools.wraps(original)
        def traced(*args: Any, **kwargs: Any) -> Any:
            buffer = buffer_of()
            buffer.aside += 1
            try:
                return original(*args, **kwargs)
            finally:
                buffer.aside -= 1

        return traced

    # backward passes -----------------------------------------------------------------
    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        buffer_of = self.recording.buffer
        site_of = self.recording.sites.of_frame
        fast = self._fast
        if fast is not None:  # no Python frame (dynamo never runs it: it rewrites Tensor.backward itself)
            return hotpath.HOTPATH.BackwardCall(fast, original)  # type: ignore[union-attr, no-any-return]

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            if dynamo_compiling():
                return original(*args, **kwargs)
            buffer = buffer_of()
            error = None
            start = now_ns()
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                error = error_text(exc)
                raise
            finally:
                end = now_ns()
                site = site_of(sys._getframe(1))
                buffer.marks.append((MarkKind.BACKWARD, start, end, BACKWARD_NAME, None, error, site))
                buffer.steps.piece_ends(end, trains=True, start_ns=start)

        return backward

    # generate() ----------------------------------------------------------------------
    def _patch_generate(self, module: ModuleType) -> None:
        mixin = getattr(module, "GenerationMixin", None)
        if mixin is None or "generate" not in mixin.__dict__:
            return
        recording = self.recording
        original = mixin.__dict__["generate"]

        @functools.wraps(original)
        def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
            if dynamo_compiling():
                return original(model, *args, **kwargs)
            buffer = recording.buffer()
            name = model_name(recording, model, sys._getframe(1))
            samples = _samples(args, kwargs)
            if buffer.open_steps:  # inside an xsp.step (a request): a span of its own, not a step
                attributes = {} if samples is None else {ATTR_GENERATE_SAMPLES: samples}
                with span(name + GENERATE_SUFFIX, **attributes):
                    return original(model, *args, **kwargs)
            buffer.steps.generate_begins(name, now_ns(), samples)
            try:
                return original(model, *args, **kwargs)
            finally:
                buffer.steps.generate_ends(now_ns())

        self._patches.append(_Patch(mixin, "generate", generate))

    # torch.compile -------------------------------------------------------------------
    def _watch_compiles(self, module: ModuleType) -> None:
        handler = getattr(module, "callback_handler", None)
        if handler is None or not hasattr(handler, "register_start_callback"):
            return
        buffer_of = self.recording.buffer

        def started(arguments: Any) -> None:
            # dynamo iterates numpy's module dicts as it traces, which xsp's imports beside the
            # program (pandas, pyarrow) may be growing meanwhile: the compile failed with
            # "dictionary changed size during iteration". A compile takes seconds; the imports'
            # rest is a fraction of one, so it waits for them.
            background_imports_done()
            # the exception being handled as it starts (a compile inside the program's own
            # `except` block): one still being handled as it ends is no error of the compile's
            self._stack("compile").append((now_ns(), sys.exc_info()[1]))

        def ended(arguments: Any) -> None:
            end = now_ns()
            # dynamo runs the end callbacks in a `finally`: a compile that raised (its error
            # reaches the program, or a frame it gives up on) ends with that exception in flight
            raised = sys.exc_info()[1]
            starts = self._stack("compile")
            start, handled = starts.pop() if starts else (end, None)
            error = error_text(raised) if raised is not None and raised is not handled else None
            trigger = getattr(getattr(arguments, "callback_trigger", None), "name", None)
            attributes = {ATTR_COMPILE_ID: str(getattr(arguments, "compile_id", "")), ATTR_COMPILE_TRIGGER: trigger}
            buffer_of().marks.append((MarkKind.COMPILE, start, end, COMPILE_NAME, attributes, error))

        handler.register_start_callback(started)
        handler.register_end_callback(ended)
        self._compile_callbacks = (handler, (started, ended))
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and "reset" in dynamo.__dict__:  # reset() clears every callback: put ours back
            self._patches.append(_Patch(dynamo, "reset", self._keeping_callbacks(dynamo.__dict__["reset"])))

    def _keeping_callbacks(self, reset: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(reset)
        def reset_keeping_xsp(*args: Any, **kwargs: Any) -> Any:
            try:
                return reset(*args, **kwargs)
            finally:
                if self._compile_callbacks is not None:
                    handler, (started, ended) = self._compile_callbacks
                    if started not in handler.start_callbacks:
                        handler.register_start_callback(started)
                        handler.register_end_callback(ended)

        return reset_keeping_xsp

    def _unwatch_compiles(self) -> None:
        if self._compile_callbacks is None:
            return
        handler, (started, ended) = self._compile_callbacks
        self._compile_callbacks = None
        for callbacks, callback in ((handler.start_callbacks, started), (handler.end_callbacks, ended)):
            if callback in callbacks:  # torch._dynamo.reset() may have cleared them already
                callbacks.remove(callback)


def _samples(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The input sequences a ``generate()`` call was given: the first dimension of its inputs
    (``input_ids``, ``inputs``, ``inputs_embeds`` or its first argument), None where none is a tensor."""
    given = (kwargs.get("input_ids"), kwargs.get("inputs"), kwargs.get("inputs_embeds"), args[0] if args else None)
    for value in given:
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) >= 1:
            return int(shape[0])
    return None
