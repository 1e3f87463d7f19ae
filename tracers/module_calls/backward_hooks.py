"""The backward of each module call as a span: hooks on the autograd graph node that produced
the call's output, registered by the layer level's wrapper (:mod:`xsp.tracers.module_calls.interceptor`)
while autograd records a graph, and gone with that graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Final

from torch import nn

from xsp.core.clock import now_ns
from xsp.record.columns import BACKWARD_ALIAS, BACKWARD_BEGIN, BACKWARD_END, BACKWARD_END_OPEN
from xsp.record.recording import Recording, ThreadBuffer
from xsp.tracers.module_calls.call_context import TENSOR_TYPE
from xsp.tracers.module_calls.call_values import items_of, top_tensors
from xsp.tracers.module_calls.ranges import ModuleRanges


def output_nodes(out: Any) -> set[Any]:
    """The autograd graph nodes that produced the tensors of ``out``: one level into containers,
    or, where that finds none, two (an ``nn.LSTM`` on packed input returns a ``PackedSequence``, a
    named tuple, beside its states) and into a dataclass's fields (a head returning one)."""
    tensors = top_tensors(out)
    if not tensors:
        held = ([getattr(out, field.name, None) for field in dataclasses.fields(out)]
                if dataclasses.is_dataclass(out) and not isinstance(out, type) else items_of(out))
        tensors = [tensor for item in held for tensor in top_tensors(item)]
    return {tensor.grad_fn for tensor in tensors if tensor.grad_fn is not None}


LAST_NODE_SEARCH: Final = 16
"""Most graph nodes looked at for where a leaf module's backward ends; past it (an ``nn.GRU`` on
CPU makes hundreds), the span's end is left open: the next layer's backward begin ends it."""


def last_node(node: Any, first_input: Any) -> Any | None:
    """The node of a leaf module call's own part of the graph that autograd runs last: the one
    made first in its forward (autograd runs the nodes of one device in the reverse of their
    making, ``sequence_nr``). Its own part: the nodes reachable from its output's ``node`` made
    after its first argument (a tensor's node; any node where the argument needs no gradient),
    parameters' ``AccumulateGrad`` left out. A ``Linear`` on a 3-D input makes a view, a matrix
    multiply and a view back: its output's node is the last view, whose backward is a reshape,
    and the multiply's backward runs after it. None where that part has more than
    :data:`LAST_NODE_SEARCH` nodes: walking them all would cost each call a millisecond."""
    made_after = -1
    grad_fn = getattr(first_input, "grad_fn", None) if type(first_input) is TENSOR_TYPE else None
    if grad_fn is not None:
        made_after = grad_fn._sequence_nr()
    first, first_made = node, node._sequence_nr()
    waiting, seen = [node], {node}
    while waiting:
        for next_node, _ in waiting.pop().next_functions:
            if next_node is None or next_node in seen or type(next_node).__name__ == "AccumulateGrad":
                continue
            made = next_node._sequence_nr()
            if made <= made_after:
                continue
            seen.add(next_node)
            if len(seen) > LAST_NODE_SEARCH:
                return None
            waiting.append(next_node)
            if made < first_made:
                first, first_made = next_node, made
    return first


COMPILED_GRAPH_NODE: Final = "CompiledFunctionBackward"
"""The one autograd node of a graph ``torch.compile`` made (AOTAutograd's)."""


def compiled(module: nn.Module) -> bool:
    """``torch.compile(module)`` (an ``OptimizedModule``) or ``module.compile()``: its calls run a
    compiled graph, whose backward is one node, not its submodules' calls."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def backward_hooks(recording: Recording, module_ranges: ModuleRanges | None = None,
                    ) -> Callable[[ThreadBuffer, Any, nn.Module, int, Any], None]:
    """``hook(buffer, out, module, call_start, first_input)``: record the begin and end of the
    backward of one call.

    The backward of a module call begins when the node that produced its output is about to
    run (its gradient is complete). A leaf module's ends when the last node of its own part of
    the graph has run (:func:`last_node`: for most, its output's node); a module with
    submodules is stretched over their backward when the layer spans are built. Events go to
    the buffer of the thread that runs the backward (an autograd device thread on GPUs). Where
    its own part of the graph is too large to search, the end is left open
    (``BACKWARD_END_OPEN``, at its output's node): the spans are built with the next layer's
    backward begin as its end.

    Hook registrations cost microseconds each, so they are spared where the span follows
    from others. A module with submodules gets no end hook: its backward ends with theirs (its
    span is stretched over them), and it begins at its own output's node. A module whose output
    is the very tensor its last submodule returned (an ``nn.Sequential``, a block ending in its
    norm layer) shares that submodule's node: it is recorded as an alias of the submodule's call
    (phase 2, with that call's start as its time) instead of hooking the node again.
    """
    buffer_of = recording.buffer

    def begin(module: nn.Module, call: int, grad_outputs: Any) -> None:
        buffer_of().record_backward(module, now_ns(), BACKWARD_BEGIN, call)

    def end(module: nn.Module, call: int, phase: int, grad_inputs: Any, grad_outputs: Any) -> None:
        buffer_of().record_backward(module, now_ns(), phase, call)

    # with NVTX, a leaf layer's backward (its node's pre-hook to its hook, on the thread that runs
    # the node) is a range; a container's backward is known only once its children's have ended
    ranges = None if module_ranges is None else module_ranges.ranges

    def begin_ranged(module: nn.Module, call: int, grad_outputs: Any) -> None:
        if ranges is not None:
            ranges.push(module_ranges.backward_message_of(module))  # type: ignore[union-attr]
        buffer_of().record_backward(module, now_ns(), BACKWARD_BEGIN, call)

    def end_ranged(module: nn.Module, call: int, phase: int, grad_inputs: Any, grad_outputs: Any) -> None:
        buffer_of().record_backward(module, now_ns(), phase, call)
        if ranges is not None:
            ranges.pop()

    def hook(buffer: ThreadBuffer, out: Any, module: nn.Module, call: int, first_input: Any = None) -> None:
        node = out.grad_fn if type(out) is TENSOR_TYPE else None
        if node is None:
            nodes: Any = output_nodes(out)
        else:
            hooked = buffer.last_hooked
            if hooked is not None and hooked[0] is node:
                buffer.record_backward(module, hooked[1], BACKWARD_ALIAS, call)
                return
            buffer.last_hooked = (node, call)
            nodes = (node,)
        # a module with submodules ends with them (cover_submodules stretches it), unless it is
        # compiled: its submodules run inside its graph, and have no backward of their own
        leaf = not module._modules or compiled(module)
        for node in nodes:
            if leaf or type(node).__name__ == COMPILED_GRAPH_NODE:
                node.register_prehook(partial(begin_ranged if ranges is not None else begin, module, call))
                last = last_node(node, first_input)
                (node if last is None else last).register_hook(partial(
                    end_ranged if ranges is not None else end, module, call,
                    BACKWARD_END_OPEN if last is None else BACKWARD_END))
            else:
                node.register_prehook(partial(begin, module, call))

    return hook
