"""torch.distributed collectives called from Python, as model-level spans.

Every collective function of ``torch.distributed`` (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``broadcast``, ``barrier``, ``all_to_all``, point-to-point sends and receives,
and DDP's ``_broadcast_coalesced``) is replaced, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` (the same functions; PyTorch's own code calls them through
the latter), by a wrapper that records one ``collective`` span: bytes of this rank's payload,
the group, its size, the backend, the dtype, whether it was asynchronous, and its number among
this process's collectives on that group (every rank calls a group's collectives in the same
order, which matches the same call across ranks). A collective that calls another (the
deprecated ``all_gather_into_tensor`` calls ``all_gather_single``) is one span. ``Work.wait()``
on an asynchronous collective's handle is a ``collective_wait`` span with the same number.

DDP's gradient all-reduces, which its C++ reducer issues during backward, are recorded by
:mod:`xsp.tracers._ddp_buckets`, with the same numbering. A name bound before the session
started (``from torch.distributed import all_reduce``) keeps calling the original.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Final

import torch

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.record.marks import MarkKind
from xsp.record.recording import Recording
from xsp.tracers._post_import import forget, when_imported
from xsp.tracers.module_calls.call_context import dynamo_compiling
from xsp.tracers.module_calls.call_values import error_text, top_tensors

C10D: Final = "torch.distributed.distributed_c10d"
SPAWN: Final = "torch.multiprocessing.spawn"
SPAWN_NOTE: Final = ("processes started by torch.multiprocessing.spawn are ranks of a distributed job, not followed "
                     "into this trace: call xsp.trace() in the function they run (each rank writes its own file), "
                     "or launch the job with torchrun -m xsp run")
DISTRIBUTED: Final = "torch.distributed"
PAYLOAD_ARGUMENT: Final[dict[str, tuple[int, str]]] = {
    # the argument that holds what this rank sends (position, keyword)
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"), "reduce": (0, "tensor"),
    "all_gather": (1, "tensor"), "all_gather_single": (1, "input_tensor"),
    "all_gather_into_tensor": (1, "input_tensor"), "_all_gather_base": (1, "input_tensor"),
    "reduce_scatter": (1, "input_list"), "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"), "_reduce_scatter_base": (1, "input"),
    "all_to_all": (1, "input_tensor_list"), "all_to_all_single": (1, "input"),
    "gather": (0, "tensor"), "scatter": (1, "scatter_list"),
    "send": (0, "tensor"), "isend": (0, "tensor"), "recv": (0, "tensor"), "irecv": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"), "_broadcast_coalesced": (1, "tensors"),
    "barrier": (-1, ""), "monitored_barrier": (-1, ""), "batch_isend_irecv": (-1, ""),
    # Python objects, pickled into tensors inside: one span each (their inner collectives are not)
    "all_gather_object": (-1, ""), "broadcast_object_list": (-1, ""), "gather_object": (-1, ""),
    "scatter_object_list": (-1, ""), "send_object_list": (-1, ""), "recv_object_list": (-1, ""),
}
"""The collectives recorded."""
PENDING_LIMIT: Final = 4096
"""Asynchronous handles remembered until waited for (older ones are forgotten)."""


def payload(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors this rank sends (or, for a receive, receives) in collective ``name``."""
    position, keyword = PAYLOAD_ARGUMENT.get(name, (-1, ""))
    if position < 0:
        return []
    value = kwargs.get(keyword) if keyword in kwargs else args[position] if len(args) > position else None
    return list(top_tensors(value))


def _group_of(args: tuple[Any, ...], kwargs: dict[str, Any], group_type: Any) -> Any:
    group = kwargs.get("group")
    if group is None and group_type is not None:  # by type: isinstance on ProcessGroup costs a Python call
        group = next((arg for arg in args if type(arg) is group_type), None)
    return group


class Collectives:
    """Installs the wrappers for one recording; ``uninstall`` puts back what is still xsp's."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self._local = threading.local()
        self._sequence: dict[str, itertools.count[int]] = {}
        self._groups: dict[int, tuple[Any, str, int | None, str | None]] = {}
        self._pending: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._pending_lock = threading.Lock()
        self._patched: list[tuple[ModuleType | type, str, Any, Any]] = []

    def install(self) -> None:
        when_imported(C10D, self._patch)
        when_imported(SPAWN, self._watch_spawn)

    def uninstall(self) -> None:
        forget(C10D, self._patch)
        forget(SPAWN, self._watch_spawn)
        for owner, name, original, replacement in reversed(self._patched):
            if owner.__dict__.get(name) is replacement:
                setattr(owner, name, original)
        self._patched = []

    def _patch(self, c10d: ModuleType) -> None:
        dist = sys.modules.get(DISTRIBUTED)
        if not getattr(dist, "is_available", lambda: False)():
            return
        wrappers: dict[int, Any] = {}
        for module in (c10d, dist):
            for name in PAYLOAD_ARGUMENT:
                original = module.__dict__.get(name)
                if original is None or not callable(original):
                    continue
                wrapper = wrappers.get(id(original))
                if wrapper is None:
                    wrapper = wrappers[id(original)] = self._wrap(name, original, dist)
                setattr(module, name, wrapper)
                self._patched.append((module, name, original, wrapper))  # type: ignore[arg-type]
        work = getattr(dist, "Work", None)
        if isinstance(work, type) and "wait" in work.__dict__:
            original_wait = work.__dict__["wait"]
            replacement = self._wrap_wait(original_wait)
            try:
                work.wait = replacement  # type: ignore[attr-defined]
            except (TypeError, AttributeError):  # a build whose Work refuses new attributes: no wait spans
                return
            self._patched.append((work, "wait", original_wait, replacement))

    def _wrap(self, name: str, original: Callable[..., Any], dist: Any) -> Callable[..., Any]:
        buffer_of = self.recording.buffer
        local = self._local
        group_type = getattr(dist, "ProcessGroup", None)
        work_type = getattr(dist, "Work", None)

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if dynamo_compiling() or getattr(local, "depth", 0):
                return original(*args, **kwargs)
            local.depth = 1
            error = None
            result = None
            start = now_ns()
            try:
                result = original(*args, **kwargs)
                return result
            except BaseException as exc:
                error = error_text(exc)
                raise
            finally:
                end = now_ns()
                local.depth = 0
                try:
                    attributes = self._describe(name, args, kwargs, dist, group_type)
                    if work_type is not None and isinstance(result, work_type):
                        attributes[col.ATTR_COLLECTIVE_ASYNC] = True
                        self._remember(result, attributes)
                    buffer = buffer_of()
                    buffer.marks.append((MarkKind.COLLECTIVE, start, end, name.lstrip("_"), attributes, error))
                    buffer.steps.piece_ends(end)  # a collective between model calls is part of their step
                except Exception:  # describing a collective must never break it
                    self.recording.dropped["collectives"] += 1

        return collective

    def _watch_spawn(self, module: ModuleType) -> None:
        """Say once that processes started by ``torch.multiprocessing.spawn`` go unprofiled."""
        original = module.__dict__.get("start_processes")
        if original is None:
            return
        notes = self.recording.notes

        @functools.wraps(original)
        def start_processes(*args: Any, **kwargs: Any) -> Any:
            notes.append(SPAWN_NOTE)
            return original(*args, **kwargs)

        module.start_processes = start_processes  # type: ignore[attr-defined]
        self._patched.append((module, "start_processes", original, start_processes))

    def _group_facts(self, group: Any, dist: Any) -> tuple[str, int | None, str | None]:
        """(name, size, backend) of ``group`` (None: the default group), asked once per group object."""
        handle = group if group is not None else getattr(getattr(dist, "GroupMember", None), "WORLD", None)
        facts = self._groups.get(id(handle))
        if facts is None or facts[0] is not handle:
            name = str(getattr(handle, "group_name", None) or "0")
            size = backend = None
            if dist.is_initialized():
                size, backend = int(dist.get_world_size(group)), str(dist.get_backend(group))
                if group is None or group is handle:  # the default group: this process's rank in the job
                    self.recording.process_group = (int(dist.get_rank()), size, backend)
            facts = self._groups[id(handle)] = (handle, name, size, backend)
        return facts[1], facts[2], facts[3]

    def _describe(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], dist: Any,
                  group_type: Any) -> dict[str, Any]:
        group_name, size, backend = self._group_facts(_group_of(args, kwargs, group_type), dist)
        attributes: dict[str, Any] = {col.ATTR_COLLECTIVE_OP: name.lstrip("_"), col.ATTR_COLLECTIVE_GROUP: group_name}
        tensors = payload(name, args, kwargs)
        if tensors:
            attributes[col.BYTES] = sum(t.element_size() * t.numel() for t in tensors)
            attributes[col.ATTR_COLLECTIVE_DTYPE] = str(tensors[0].dtype).removeprefix("torch.")
        if size is not None:
            attributes[col.ATTR_COLLECTIVE_GROUP_SIZE] = size
            attributes[col.ATTR_COLLECTIVE_BACKEND] = backend
            self.recording.backend = backend
        counter = self._sequence.get(group_name)
        if counter is None:
            counter = self._sequence.setdefault(group_name, itertools.count())
        attributes[col.ATTR_COLLECTIVE_SEQ] = next(counter)
        return attributes

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Record no collective called on this thread meanwhile (they are part of one already)."""
        local = self._local
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth

    def describe_call(self, name: str, tensor: torch.Tensor, group: Any) -> dict[str, Any]:
        """What a span of collective ``name`` of ``tensor`` on ``group`` (None: the default one)
        carries, numbered among this process's collectives on that group (for DDP's buckets,
        which every rank all-reduces in the same order as its Python collectives)."""
        dist = sys.modules[DISTRIBUTED]
        return self._describe(name, (tensor,), {} if group is None else {"group": group}, dist,
                              getattr(dist, "ProcessGroup", None))

    def next_seq(self, group_name: str) -> int:
        """The next number among this process's collectives on group ``group_name``."""
        counter = self._sequence.get(group_name)
        if counter is None:
            counter = self._sequence.setdefault(group_name, itertools.count())
        return next(counter)

    def _remember(self, work: Any, attributes: dict[str, Any]) -> None:
        with self._pending_lock:
            self._pending[id(work)] = attributes
            while len(self._pending) > PENDING_LIMIT:
                self._pending.popitem(last=False)

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        buffer_of = self.recording.buffer
        local = self._local

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if dynamo_compiling() or getattr(local, "depth", 0):  # traced, or a synchronous collective's own wait
                return original(work, *args, **kwargs)
            with self._pending_lock:
                attributes = self._pending.pop(id(work), None)
            if attributes is None:
                return original(work, *args, **kwargs)
            error = None
            start = now_ns()
            try:
                return original(work, *args, **kwargs)
            except BaseException as exc:
                error = error_text(exc)
                raise
            finally:
                end = now_ns()
                waited = {key: value for key, value in attributes.items() if key != col.BYTES}
                buffer = buffer_of()
                buffer.marks.append((MarkKind.COLLECTIVE_WAIT, start, end,
                                     f"wait {attributes[col.ATTR_COLLECTIVE_OP]}", waited, error))
                buffer.steps.piece_ends(end)

        return wait
