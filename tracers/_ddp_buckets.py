"""DDP's gradient all-reduces at the model level, bucket by bucket.

``DistributedDataParallel``'s C++ reducer all-reduces each bucket of gradients as soon as
backward has filled it: Python never calls those collectives, so the wrappers of
:mod:`xsp.tracers._collectives` cannot see them. DDP's communication hook can. A hook the
program registers while a session runs (``register_comm_hook``, ``_register_builtin_comm_hook``)
is registered inside a timing hook of xsp's, which calls it with its state and returns its
future: it runs as it would have, and DDP logs it by its own name. At a DDP model's first call,
if it has no hook, xsp registers one that does what the reducer does without one (the bucket's
gradients multiplied by 1/world size, then one all-reduce of the bucket on DDP's process group:
the same gradients, bit for bit), timed the same way; a hook the program registers after that
takes its place (it is never refused). A hook registered before the session is left alone, and
its buckets are not recorded (the operator level shows them).

For each bucket, on the thread that ran backward:

* a ``collective`` span ``all_reduce``: the bucket's launch (the hook's call), with its bytes,
  dtype, bucket index, group and number among the group's collectives (as Python collectives
  are numbered), and ``xsp.collective.work_ns``: how long from launch to completion (to the end
  of DDP's wait for it, when its completion callback had not yet run: a future wakes its waiters
  before it calls its callbacks);
* a ``collective_wait`` span ``wait all_reduce`` where backward, at its end, waited for the
  bucket (DDP's finalisation, after the last bucket was launched), when it had not completed
  by then: the communication that computation did not hide.

On GPUs a bucket's work completes, for xsp, when NCCL has been handed it; the kernel level
shows when the GPU ran it. A hook xsp registered stays on its reducer after the session (a
reducer takes one hook, for good), recording nothing and doing what the reducer would.
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
from xsp.record.marks import MarkKind
from xsp.record.recording import Recording
from xsp.tracers._collectives import Collectives
from xsp.tracers._post_import import forget, when_imported
from xsp.tracers.module_calls.call_context import dynamo_compiling
from xsp.tracers.module_calls.call_values import error_text

DDP_MODULE: Final = "torch.nn.parallel.distributed"
ALL_REDUCE: Final = "all_reduce"
BROADCAST: Final = "broadcast"
REGISTRATIONS: Final = frozenset({"register_comm_hook", "_register_builtin_comm_hook"})
"""The DDP methods kept replaced once a model carries xsp's hook (the program's later registrations reach it)."""
NOT_RECORDED_NOTE: Final = ("DDP's gradient all-reduces of a model are not recorded: the program registered its "
                            "communication hook before xsp started (the operator level records them)")

_patched_classes: dict[type, dict[str, Any]] = {}
"""DDP classes whose methods xsp replaced: the originals, by name. Kept for good once a hook was
registered through them (the program's later registrations must still reach xsp's hook)."""
_hooks: weakref.WeakKeyDictionary[Any, BucketHook] = weakref.WeakKeyDictionary()
"""The hook xsp registered on each DDP model."""
_forwarding = threading.local()
"""``ddp``: the DDP model whose forward the thread is in (its reducer's rebuild is that model's)."""
_lock = threading.Lock()
_observer: DdpBuckets | None = None
"""The session's observer (None: no session; hooks then record nothing)."""


class _Bucket:
    """One bucket's all-reduce in one backward pass."""

    __slots__ = ("start_ns", "launched_ns", "completed_ns", "error", "attributes")

    def __init__(self, start_ns: int, launched_ns: int, attributes: dict[str, Any]) -> None:
        self.start_ns = start_ns
        self.launched_ns = launched_ns
        self.completed_ns = 0
        self.error: str | None = None
        self.attributes = attributes


def _first_tensor(future: Any) -> Any:
    return future.value()[0]


class BucketHook:
    """The communication hook xsp registers on one DDP model's reducer (see the module docs)."""

    def __init__(self, ddp: Any) -> None:
        self.__qualname__ = "xsp_timed_comm_hook"  # what DDP logs a hook as
        self.group = ddp.process_group
        self.scale = 1.0 / self.group.size()
        self.program_hook: tuple[Callable[[Any, Any], Any], Any] | None = None
        """The hook and state the program registered (None: the reducer's own all-reduce)."""
        self.running: list[_Bucket] = []
        """Buckets of the backward pass under way."""
        self.described: dict[tuple[int, int], dict[str, Any]] = {}
        """Each bucket's attributes, by (index, elements), as first described."""

    def __call__(self, state: Any, bucket: Any) -> Any:
        observer = _observer
        if observer is None:
            return self._launch(bucket)
        start = now_ns()
        try:
            attributes = self._describe(observer.collectives, bucket)
        except Exception:  # describing a bucket must never break its all-reduce
            observer.recording.dropped["collectives"] += 1
            return self._launch(bucket)
        with observer.collectives.quiet():  # collectives a program's hook calls are this bucket's
            future = self._launch(bucket)
        record = _Bucket(start, now_ns(), attributes)
        self.running.append(record)
        if bucket.is_last():
            self._after_finalisation(observer)
        # beside the future, not chained to it: a callback chained with then() makes its own
        # future, whose failure wraps the all-reduce's ("Got the following error when running the
        # callback: ..."), with xsp's frames in it; the program's exceptions stay its own
        future.add_done_callback(functools.partial(_completed, record))
        return future

    def _describe(self, collectives: Collectives, bucket: Any) -> dict[str, Any]:
        """The bucket's span attributes: what does not change between passes is worked out once
        per bucket (its index and size), the collective's number every time."""
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.numel())
        known = self.described.get(key)
        if known is None:
            attributes = collectives.describe_call(ALL_REDUCE, buffer, self.group)
            attributes[col.ATTR_COLLECTIVE_BUCKET] = key[0]
            attributes[col.ATTR_COLLECTIVE_ASYNC] = True
            self.described[key] = attributes
            return dict(attributes)
        attributes = dict(known)
        attributes[col.ATTR_COLLECTIVE_SEQ] = collectives.next_seq(known[col.ATTR_COLLECTIVE_GROUP])
        return attributes

    def _launch(self, bucket: Any) -> Any:
        if self.program_hook is not None:
            hook, state = self.program_hook
            return hook(state, bucket)
        buffer = bucket.buffer()
        buffer.mul_(self.scale)  # as the reducer scales gradients without a hook: by the reciprocal
        # as PyTorch's own allreduce_hook: a Python hook's future must be completed by Python (its
        # value a Python object), so a failed all-reduce reaches backward wrapped once, by then()
        return self.group.allreduce([buffer]).get_future().then(_first_tensor)

    def _after_finalisation(self, observer: DdpBuckets) -> None:
        """Record this pass's buckets once DDP has waited for them: DDP queues its finalisation
        (which waits) after this last bucket's hook returns, so a callback queued now queues a
        second one, which runs after it."""
        running, self.running = self.running, []
        engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

        def finalised() -> None:
            observer.record(running, now_ns())

        try:
            engine.queue_callback(lambda: engine.queue_callback(finalised))
        except RuntimeError:  # not inside a backward pass (DDP's join shadowing): recorded now, no waits
            observer.record(running, 0)


def _ended_ns(bucket: _Bucket, finalised_ns: int) -> int:
    """When the bucket's all-reduce ended (0: not known). After DDP's finalisation
    (``finalised_ns``), no later than it: DDP waited for the bucket's future, and a future wakes
    its waiters before it runs its callbacks, so xsp's may not have run yet."""
    if not finalised_ns:
        return bucket.completed_ns
    return min(bucket.completed_ns or finalised_ns, finalised_ns)


def _completed(record: _Bucket, future: Any) -> None:
    """The bucket's all-reduce ended (a callback beside its future: its failure is the program's)."""
    record.completed_ns = now_ns()
    try:
        future.value()
    except BaseException as exc:
        record.error = error_text(exc)


class DdpBuckets:
    """Records DDP's bucket all-reduces for one recording (see the module docs)."""

    def __init__(self, recording: Recording, collectives: Collectives) -> None:
        self.recording = recording
        self.collectives = collectives
        self.buffer_of = recording.buffer

    def install(self) -> None:
        global _observer
        _observer = self
        when_imported(DDP_MODULE, _patch)

    def uninstall(self) -> None:
        global _observer
        if _observer is self:
            _observer = None
        forget(DDP_MODULE, _patch)
        _unpatch_unused()

    def record(self, buckets: list[_Bucket], finalised_ns: int) -> None:
        """The marks of one backward pass's buckets, on the thread that finished it."""
        if not buckets:
            return
        marks = self.buffer_of().marks
        waited_from = max(bucket.launched_ns for bucket in buckets)
        # read once: xsp's completion callback may be setting it on another thread meanwhile
        ends = [_ended_ns(bucket, finalised_ns) for bucket in buckets]
        for bucket, ended_ns in zip(buckets, ends):
            attributes = bucket.attributes
            if ended_ns:
                attributes[col.ATTR_COLLECTIVE_WORK_NS] = ended_ns - bucket.start_ns
            marks.append((MarkKind.COLLECTIVE, bucket.start_ns, bucket.launched_ns, ALL_REDUCE, attributes,
                          bucket.error))
        if not finalised_ns:
            return
        for bucket, done in sorted(zip(buckets, ends), key=lambda pair: pair[0].attributes.get(
                col.ATTR_COLLECTIVE_BUCKET, 0)):
            if done <= waited_from:  # complete before backward got to it: hidden behind computation
                continue
            waited = {key: bucket.attributes[key] for key in (col.ATTR_COLLECTIVE_OP, col.ATTR_COLLECTIVE_GROUP,
                                                              col.ATTR_COLLECTIVE_SEQ, col.ATTR_COLLECTIVE_BUCKET)
                      if key in bucket.attributes}
            marks.append((MarkKind.COLLECTIVE_WAIT, waited_from, done, f"wait {ALL_REDUCE}", waited, bucket.error))
            waited_from = done

    def observe(self, ddp: Any) -> None:
        """A DDP model's first call in the session: register xsp's hook if it has none."""
        if ddp in _hooks or getattr(ddp, "reducer", None) is None:
            return
        try:
            registered = "comm_hook" in ddp._get_ddp_logging_data()
        except Exception:
            registered = True  # cannot tell: never risk a second registration
        if registered:
            self.recording.notes.append(NOT_RECORDED_NOTE)
            return
        hook = BucketHook(ddp)
        try:
            torch.distributed._register_comm_hook(ddp.reducer, None, hook)  # type: ignore[attr-defined]
        except Exception:
            self.recording.notes.append(NOT_RECORDED_NOTE)
            return
        _hooks[ddp] = hook


def _patch(module: ModuleType) -> None:
    ddp_class = getattr(module, "DistributedDataParallel", None)
    if not isinstance(ddp_class, type):
        return
    reducer_class = getattr(sys.modules.get("torch.distributed"), "Reducer", None)
    replaced: list[tuple[type, str, Callable[[Any], Any]]] = [
        (ddp_class, "forward", _observed_forward), (ddp_class, "register_comm_hook", _register_comm_hook),
        (ddp_class, "_register_builtin_comm_hook", _register_builtin_comm_hook)]
    if isinstance(reducer_class, type):
        replaced.append((reducer_class, "_rebuild_buckets", _timed_rebuild))
    with _lock:
        for owner, name, make in replaced:
            methods = _patched_classes.setdefault(owner, {})
            original = owner.__dict__.get(name)
            if name in methods or original is None:
                continue
            replacement = make(original)
            try:
                setattr(owner, name, replacement)
            except (AttributeError, TypeError):  # a class of C that takes no attribute: not timed
                continue
            methods[name] = (original, replacement)


def _observed_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def observed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        observer = _observer
        if observer is None:
            return forward(self, *args, **kwargs)
        if self not in _hooks and not dynamo_compiling():
            observer.observe(self)
        outer = getattr(_forwarding, "ddp", None)
        _forwarding.ddp = self
        try:
            return forward(self, *args, **kwargs)
        finally:
            _forwarding.ddp = outer

    return observed_forward


def _timed_rebuild(rebuild: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """The reducer's bucket rebuild, at a DDP model's second training forward: its broadcast of the
    new buckets (from C++, which Python never sees) waits for every rank, one time. Recorded as a
    ``collective`` span ``broadcast`` where it rebuilt: without it, a rank's wait there for a slow
    one was forward time, and the slow rank's lateness at that step was blamed on the others."""
    @functools.wraps(rebuild)
    def rebuild_buckets(reducer: Any) -> bool:
        observer, ddp = _observer, getattr(_forwarding, "ddp", None)
        if observer is None or ddp is None or dynamo_compiling():
            return rebuild(reducer)
        start = now_ns()
        rebuilt = rebuild(reducer)
        if rebuilt:
            end = now_ns()
            try:
                attributes = observer.collectives.describe_call(BROADCAST, None, ddp.process_group)
                observer.buffer_of().marks.append((MarkKind.COLLECTIVE, start, end, BROADCAST, attributes, None))
            except Exception:  # a rebuild whose broadcast cannot be described: counted, never raised
                observer.recording.dropped["collectives"] += 1
        return rebuilt

    return rebuild_buckets


def _register_comm_hook(register: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        ours = _hooks.get(self)
        if ours is not None and ours.program_hook is None:  # xsp's own runs: the program's takes its place
            self._check_comm_hook(hook)  # the checks and bookkeeping of DDP's own registration
            self.logger._set_comm_hook_name(hook.__qualname__)
            self._comm_hooks.append((hook, state))
            ours.program_hook = (hook, state)
            return None
        if ours is not None or _observer is None or getattr(self, "reducer", None) is None:
            return register(self, state, hook)  # type: ignore[no-any-return]  # (a second one fails as it would)
        self._check_comm_hook(hook)  # what DDP's registration does, with xsp's timing hook in the reducer
        timed = BucketHook(self)
        timed.program_hook = (hook, state)
        torch.distributed._register_comm_hook(self.reducer, state, timed)  # type: ignore[attr-defined]
        self.logger._set_comm_hook_name(hook.__qualname__)
        self._comm_hooks.append((hook, state))
        _hooks[self] = timed
        return None

    return register_comm_hook


def _register_builtin_comm_hook(register_builtin: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(register_builtin)
    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        ours = _hooks.get(self)
        equivalent = _builtin_equivalent(comm_hook_type)
        if equivalent is None or (ours is not None and ours.program_hook is not None) or (
                ours is None and (_observer is None or getattr(self, "reducer", None) is None)):
            return register_builtin(self, comm_hook_type)  # type: ignore[no-any-return]
        if ours is None:
            ours = BucketHook(self)
            torch.distributed._register_comm_hook(self.reducer, None, ours)  # type: ignore[attr-defined]
            _hooks[self] = ours
        self.logger._set_comm_hook_name(str(comm_hook_type))
        ours.program_hook = (equivalent, self.process_group)
        return None

    return register_builtin_comm_hook


def _builtin_equivalent(comm_hook_type: Any) -> Callable[[Any, Any], Any] | None:
    """The Python hook that does what a built-in one does (None: none known)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    name = getattr(comm_hook_type, "name", str(comm_hook_type)).rsplit(".", 1)[-1]
    if name == "ALLREDUCE":
        return default_hooks.allreduce_hook  # type: ignore[no-any-return]
    if name == "FP16_COMPRESS":
        return default_hooks.fp16_compress_hook  # type: ignore[no-any-return]
    return None


def _unpatch_unused() -> None:
    """Put back what xsp replaced on DDP's class, except the registrations once a model has
    xsp's hook (a later registration by the program must reach it)."""
    with _lock:
        keep_registrations = len(_hooks) > 0
        for ddp_class, methods in list(_patched_classes.items()):
            for name, (original, replacement) in list(methods.items()):
                if name in REGISTRATIONS and keep_registrations:
                    continue
                if ddp_class.__dict__.get(name) is replacement:
                    setattr(ddp_class, name, original)
                del methods[name]


def hooked_models() -> int:
    """DDP models carrying xsp's hook in this process (for tests)."""
    return len(_hooks)

