"""What a module call is made of, read cheaply: the correlation a call pushes to CUPTI, its mode,
the descriptors of its inputs, and the entry points jit tracing and dynamo go through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import torch

TENSOR_TYPE = torch.Tensor
Descriptor = tuple[Any, ...] | None


@dataclass(frozen=True)
class Correlation:
    """How the wrapper names the CUDA calls made inside each module call: ``push(start_ns)``
    and ``pop()`` bracket the call (they count CUPTI's refusals and never raise). ``capsule``,
    where the records are read in C (``xsp.record._activity.correlation``), hands the same two calls
    to the C wrapper, so that neither costs a Python call; without it the Python wrapper runs."""

    push: Callable[[int], Any]
    pop: Callable[[], Any]
    capsule: Any = None

dynamo_compiling: Callable[[], bool] = (getattr(torch.compiler, "is_dynamo_compiling", None)
                                        or getattr(torch.compiler, "is_compiling", None) or (lambda: False))
"""True while dynamo traces (a constant to dynamo, a plain ``return False`` when eager). Not
``torch.compiler.is_compiling``: when eager, that one is True while *any* thread compiles."""
jit_tracing: Callable[[], Any] = torch._C._get_tracing_state
"""Truthy while ``torch.jit.trace`` traces on this thread."""
JIT_TRACE_ENTRIES: Final = (
    (torch._C, "_create_function_from_trace"),
    (torch._C, "_create_function_from_trace_with_dict"),
    (torch._C, "_create_graph_by_tracing"),
    (torch._C.ScriptModule, "_create_method_from_trace"),
    (torch._C.ScriptModule, "_create_method_from_trace_with_dict"),
)
"""Where the jit tracer starts (every caller in ``torch.jit`` and ``torch.onnx`` goes through
these): while one runs, its thread's buffer is ``aside``, so the C wrapper need not ask the
tracer (``jit_tracing``, a pybind11 call of about 900 instructions) at every top-level call."""
grad_enabled = torch.is_grad_enabled
DYNAMO_TRACE_RULES: Final = "torch._dynamo.trace_rules"
SETUP_LIBRARIES: Final = ("torch.ao.", "torch.quantization.", "torch.export.", "torch._export.", "torch.onnx.")
"""Packages whose code calls modules to prepare a model (quantization's observers, export and
conversion passes): a module they call before user code ever has is not a model. Not
``torch.fx``: a GraphModule's own ``__call__`` calls the module for the user."""


class Mode(IntEnum):
    """How much the wrapper records; a higher mode includes the lower."""

    ROOTS = 1
    ALL = 2
