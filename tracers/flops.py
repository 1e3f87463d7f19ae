"""The ``flops`` level: analytic FLOPs and bytes moved by every aten operator.

A ``TorchDispatchMode`` sees each operator as it runs (forward and backward, on the thread
that entered it: the session's) and records its time, its FLOPs and the bytes its tensors
hold. Each call becomes a span at level ``flops`` (kind ``operator``, named like the operator
level's ``aten::addmm``) that nests in its layer, so FLOPs add up per layer
(:func:`xsp.analysis.layer_flops`) and per model (:func:`xsp.analysis.model_flops`), and
arithmetic intensity and the roofline work on any machine, GPU or not.

Counting runs Python for every operator, which slows the model down: durations from a run
with this level are not the model's (leveled experimentation takes them from other runs).

FLOPs: PyTorch's own formulas (``torch.utils.flop_counter``: matrix multiplies, convolutions
and their backward, attention on GPUs) where it has one; :func:`attention_flops` for the CPU
attention kernels; else one operation per output element for
elementwise and activation operators, ``NORM_FLOPS_PER_ELEMENT`` per element for
normalisations and softmax, one per input element for reductions, none for views, copies and
indexing. Bytes: the sizes of the input and output tensors (what the operator would move if
nothing were cached); zero for views.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.record.recording import Recording
from xsp.record.window import Window
from xsp.tracers.base import Tracer

NORM_FLOPS_PER_ELEMENT = 5
"""Mean, variance, normalise and scale-shift, per element (and softmax's max, exp, sum, divide)."""
NORMALISATIONS = frozenset({
    "aten::native_layer_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training", "aten::native_group_norm", "aten::_softmax",
    "aten::_log_softmax", "aten::native_layer_norm_backward", "aten::native_batch_norm_backward",
    "aten::native_group_norm_backward", "aten::_softmax_backward_data", "aten::_log_softmax_backward_data",
})
REDUCTIONS = frozenset({"aten::sum", "aten::mean", "aten::amax", "aten::amin", "aten::max", "aten::min",
                        "aten::var", "aten::std", "aten::norm", "aten::linalg_vector_norm"})
ELEMENTWISE = frozenset({
    "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::mul", "aten::mul_", "aten::div", "aten::div_",
    "aten::relu", "aten::relu_", "aten::gelu", "aten::silu", "aten::sigmoid", "aten::tanh", "aten::exp",
    "aten::log", "aten::sqrt", "aten::rsqrt", "aten::pow", "aten::neg", "aten::clamp", "aten::clamp_min",
    "aten::hardtanh", "aten::hardtanh_", "aten::threshold_backward", "aten::gelu_backward", "aten::silu_backward",
    "aten::sigmoid_backward", "aten::tanh_backward", "aten::addcmul_", "aten::addcdiv_", "aten::lerp_",
    "aten::where", "aten::maximum", "aten::minimum", "aten::erf", "aten::reciprocal", "aten::square",
})


def _tensors(values: Iterable[Any]) -> list[Any]:
    import torch

    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _numel(tensors: list[Any]) -> int:
    return sum(int(t.numel()) for t in tensors)


def operator_flops(name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Analytic FLOPs of one operator call (see the module's docstring for the rules)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "_overloadpacket", None)
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if "scaled_dot_product" in name and "attention" in name:  # CPU kernels PyTorch has no formula for
        backward = name.endswith("_backward")
        tensors = _tensors(args)
        query, key, value = tensors[1:4] if backward else tensors[:3]  # a backward's first is grad_out
        return attention_flops(query, key, value, backward=backward)
    outputs = _tensors([out])
    if name in ELEMENTWISE:
        return _numel(outputs)
    if name in NORMALISATIONS:
        return NORM_FLOPS_PER_ELEMENT * _numel(outputs[:1])
    if name in REDUCTIONS:
        return _numel(_tensors(args)[:1])
    return 0


def attention_flops(query: Any, key: Any, value: Any, backward: bool = False) -> int:
    """Scaled dot-product attention on (batch, heads, length, dim) tensors: ``Q @ K^T`` and
    ``scores @ V`` (2 * B * H * L * S * E each); the backward pass does twice the forward's."""
    *batch, length, dim = query.shape
    source = key.shape[-2]
    heads_batch = 1
    for size in batch:
        heads_batch *= int(size)
    forward = 2 * heads_batch * int(length) * int(source) * (int(dim) + int(value.shape[-1]))
    return 2 * forward if backward else forward


def operator_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes of the operator's input and output tensors (0 for a view, which moves nothing)."""
    if getattr(func, "is_view", False):
        return 0
    tensors = _tensors([*args, *kwargs.values(), out])
    return sum(int(t.numel()) * t.element_size() for t in tensors)


UNCOUNTED = -1
"""FLOPs of an operator whose arguments a formula did not expect."""


def count_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[str, int, int]:
    """``(name, flops, bytes)`` of one operator call; counted as it happens, so that no tensor
    is kept alive for later."""
    name = func._schema.name
    try:
        return name, operator_flops(name, func, args, kwargs, out), operator_bytes(func, args, kwargs, out)
    except Exception:
        return name, UNCOUNTED, UNCOUNTED


def _make_mode(records: list[tuple[Any, ...]]) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class FlopCounting(TorchDispatchMode):
        """Times each operator and appends ``(start, end, thread, name, flops, bytes)``."""

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            kwargs = kwargs or {}
            if func._overloadpacket not in flop_registry:
                # Under inference_mode (and for any op autograd did not already decompose) a
                # composite such as aten::conv2d or aten::linear reaches the mode whole, and
                # calling it would hide the convolution or matmul inside from this mode:
                # decompose it, as FlopCounterMode does, so that its parts are counted.
                with self:
                    decomposed = func.decompose(*args, **kwargs)
                if decomposed is not NotImplemented:
                    return decomposed
            start = now_ns()
            out = func(*args, **kwargs)
            end = now_ns()
            records.append((start, end, threading.get_native_id(), *count_call(func, args, kwargs, out)))
            return out

    return FlopCounting()


def flops_rows(records: list[tuple[Any, ...]]) -> tuple[pd.DataFrame, int]:
    """Span rows for recorded operator calls, and how many could not be counted."""
    if not records:
        return pd.DataFrame(), 0
    frame = pd.DataFrame(records, columns=[col.START_NS, col.END_NS, col.THREAD_ID, col.NAME, col.FLOPS, col.BYTES])
    uncounted = frame[col.FLOPS] == UNCOUNTED
    frame[col.FLOPS] = frame[col.FLOPS].astype("Int64").mask(uncounted)
    frame[col.BYTES] = frame[col.BYTES].astype("Int64").mask(uncounted)
    frame[col.LEVEL] = Level.FLOPS.value
    frame[col.KIND] = SpanKind.OPERATOR.value
    return frame, int(uncounted.sum())


class FlopsTracer(Tracer):
    """Analytic FLOPs and bytes of each aten operator, on the session's thread."""

    name: ClassVar[str] = "flops"
    level: ClassVar[Level] = Level.FLOPS

    def __init__(self) -> None:
        self._mode: Any = None
        self._records: list[tuple[Any, ...]] = []

    def available(self) -> str | None:
        try:
            from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
            from torch.utils.flop_counter import flop_registry  # noqa: F401
        except ImportError as exc:
            return f"this PyTorch has no dispatch modes or FLOP formulas: {exc}"
        return None

    def start(self, recording: Recording) -> None:
        self._records = []
        self._mode = _make_mode(self._records)
        self._mode.__enter__()

    def stop(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)

    def collect(self, window: Window) -> pd.DataFrame:
        records, self._records[:] = list(self._records), []
        rows, failed = flops_rows(records)
        if failed:
            window.dropped["operators whose FLOPs could not be counted"] += failed
        return rows
