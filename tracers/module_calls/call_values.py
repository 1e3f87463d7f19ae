"""A module call's values as the span table keeps them: shape descriptors of its inputs and
outputs, its error's text, and whether a backward pass is running (recomputation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import torch

from xsp.tracers.module_calls.call_context import (
    TENSOR_TYPE,
    Descriptor,
)


def items_of(value: Any) -> Any:
    """What a container holds: a mapping's values, a tuple's or list's items; none for anything else."""
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, (tuple, list)):
        return value
    return ()


def top_tensors(value: Any) -> Any:
    """The tensors of ``value``: itself, or those one level into a tuple, list or dict."""
    if isinstance(value, TENSOR_TYPE):
        return (value,)
    return [item for item in items_of(value) if isinstance(item, TENSOR_TYPE)]


def describe(value: Any) -> Descriptor:
    """Shapes of the tensors in ``value`` (one level into tuples, lists and dicts)."""
    if isinstance(value, TENSOR_TYPE):
        return value.shape
    return tuple(tensor.shape for tensor in top_tensors(value)) or None


def describe_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Descriptor:
    """Shapes of the tensor arguments, positional first, one level into containers."""
    if not kwargs and len(args) == 1 and type(args[0]) is TENSOR_TYPE:
        return args[0].shape
    shapes: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, TENSOR_TYPE):
            shapes.append(value.shape)
        elif isinstance(value, (tuple, list)):
            shapes.extend(item.shape for item in value if isinstance(item, TENSOR_TYPE))
    return tuple(shapes) or None


STOP_RECOMPUTATION: Final = "_StopRecomputationError"
"""What a non-reentrant checkpoint raises to end its recomputation early: no failure."""
GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def backward_running() -> bool:
    """Whether this thread is inside a backward pass (a checkpoint's recomputation calls modules there)."""
    return GRAPH_TASK_ID is not None and GRAPH_TASK_ID() != -1


def error_text(exc: BaseException) -> str | None:
    """What a failed call records (None: it did not fail, PyTorch stopped it on purpose)."""
    if type(exc).__name__ == STOP_RECOMPUTATION:
        return None
    return f"{type(exc).__name__}: {exc}"
