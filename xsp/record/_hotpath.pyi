"""The common cases of xsp's module-call wrapper, in C (xsp/record/_hotpath/*.c): what
:mod:`xsp.record.hotpath` loads where the extension is built."""

from collections.abc import Sequence
from typing import Any

class FastCall:
    """What xsp installs as ``nn.Module.__call__``: records the common cases of a module call (see
    tracers/module_calls/interceptor.py) and hands the others to the Python wrapper ``slow``."""

    exposed: Any
    """What reading the attribute gives (a Python function doing the same); None: the object itself."""
    on_read: Any
    """Called with no arguments before each read."""
    compiler: Any
    call_machinery: Any
    """(nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__), or None."""
    nvtx_messages: Any
    """{module: NVTX message index} of the module calls' ranges (use_nvtx), or None."""
    def use_nvtx(self, capsule: Any, messages: dict[Any, int] | None, message_of: Any, /) -> None:
        """Push and pop an NVTX range (xsp.record._nvtx.ranges) around each module call recorded here;
        its message from ``messages``, or ``message_of(module, is_root)`` the first time."""
    def __init__(self, mode: int, original: Any, slow: Any, local: Any, recording: Any, now: Any,
                 grad_enabled: Any, jit_tracing: Any, tensor_type: type, describe_inputs: Any, describe: Any,
                 on_error: Any, hook_backward: Any, buffer_type: type, steps_type: type,
                 step_constants: Sequence[Any] = ..., compact_at: int = ..., native_grad_mode: Any = ...,
                 correlation: Any = ..., graph_task_id: Any = ..., max_depth: int = ..., sites: Any = ...,
                 native_graph_task_id: int = ...) -> None: ...
    def __call__(self, module: Any, /, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, instance: Any, owner: type | None = None) -> Any: ...

class StepEvents:
    """The bodies of the backward and optimizer-step hooks (tracers/_loop_events.py), in C."""

    def __init__(self, local: Any, new_buffer: Any, now: Any, error_text: Any, optimizer_names: Any,
                 buffer_type: type, steps_type: type, step_constants: Sequence[Any], mark_backward: Any,
                 mark_optimizer: Any, backward_name: str, site_of: Any = None) -> None: ...
    def optimizer_begins(self, optimizer: Any, /) -> bool:
        """An optimizer step starts; True when ``AutoSteps.optimizer_begins`` must hear."""
    def optimizer_ends(self, optimizer: Any, /) -> tuple[int, int] | None:
        """None, or ``(start, end)`` for ``AutoSteps.optimizer_ends`` when no step is open."""

class BackwardCall:
    """``torch.autograd.backward`` timed: calls ``original`` and tells ``events`` its start and end."""

    def __init__(self, events: StepEvents, original: Any) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def empty_packed(size: int, /) -> bytearray:
    """A bytearray of ``size`` bytes, the first eight zero (the row count), the rest not written."""

def pack_columns(rows: Sequence[tuple[int, ...]], itemsizes: Sequence[int], /) -> tuple[bytes, ...]:
    """Rows of ints packed into one bytes object per column, each of its item size."""

def split_rows(data: Any, itemsizes: Sequence[int], /) -> tuple[bytes, ...]:
    """The int64 rows of ``data`` split into one bytes object per column, each of its item size."""

def decide_quiet_step(buffer: Any, now_ns: int, quiet_ns: int, none: Any, inference: Any, /) -> tuple[int, int] | None:
    """The thread's open one-call inference step decided from another thread, once no call has run on
    the thread for ``quiet_ns``: its ``(start_ns, end_ns)``, or None (left as it is)."""

class SamplerCore:
    """The per-step part of an always-on session's StepSampler (xsp/record/_hotpath/sampler.c); its
    Python twin is xsp.record.sampling.PySamplerCore."""

    armed: int
    begun: int
    last_begun_ns: int
    ended: int
    probe_errors: int
    threshold_ns: int
    @property
    def median_ns(self) -> int: ...
    def __init__(self, rate: float, slow_factor: float, seed: int, ambient: Any, on_armed: Any, on_plan: Any,
                 on_slow: Any, median_steps: int, warmup_steps: int, median_every: int, context: Any = ...) -> None: ...
    def step_begins(self, buffer: Any, time_ns: int, before_ns: int = ..., /) -> None: ...
    def decide(self, buffer: Any, time_ns: int, /) -> int: ...
    def depth(self, buffer: Any, time_ns: int, /) -> tuple[int, bool]: ...
    def step_ended(self, duration_ns: int, buffer: Any, /) -> None: ...
    def note(self, buffer: Any, time_ns: int, reason: int, trace_id: int | None, span_id: int | None, plan: int,
             /) -> None: ...
    def draw(self) -> float: ...
    def ambient_span(self) -> tuple[int | None, int | None, bool]: ...
    def counts(self) -> list[int]: ...
