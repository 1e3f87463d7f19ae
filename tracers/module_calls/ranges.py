"""The NVTX ranges of module calls, named as their spans (see :mod:`xsp.record.nvtx`).

A model call's range is named as its model span (``model``), a layer call's as its layer span
(``model.encoder.layers.0``), a leaf layer's backward as its backward span
(``model.fc.backward``). Names are worked out once per module, at its first call, and kept in
``NvtxRanges.forward``, which the C module-call wrapper reads at every call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from xsp.record.nvtx import NvtxRanges, RangeKind
from xsp.record.recording import Recording
from xsp.tracers.module_calls.rows import BACKWARD_SUFFIX, HIDDEN, LayerNames

NO_RANGE = -1
"""The message of a call that pushes no range (a compiled model's call of the model inside it)."""


class ModuleRanges:
    """Messages of module calls for one session's :class:`NvtxRanges`."""

    def __init__(self, ranges: NvtxRanges, model_names: dict[int, str]) -> None:
        self.ranges = ranges
        self.names = LayerNames(model_names)
        self.last_root: nn.Module | None = None
        """The model whose call was named last: a module called inside a model it does not belong
        to (a loss made in forward) is named under it, as its span is."""

    def message_of(self, module: nn.Module, is_root: bool) -> int:
        """The message of ``module``'s calls (kept in ``ranges.forward``), :data:`NO_RANGE` for none.

        A top-level call names its model's layers as it first runs (they are called inside it),
        so a layer takes the name it has under the first model that called it.
        """
        if is_root:
            name, kind = self.names.model(module), RangeKind.MODEL
            self.names.of_root(module)
            self.last_root = module
        else:
            found = self.names.any_root.get(id(module))
            if found is None:  # not part of any model: not kept (a loss made anew at each call would pile up)
                return self.ranges.message(self.names.fallback(module, self.last_root), RangeKind.LAYER)
            name, kind = found, RangeKind.LAYER
        message = NO_RANGE if name == HIDDEN else self.ranges.message(name, kind)
        try:
            self.ranges.forward[module] = message
        except TypeError:  # a module class that made itself unhashable: named again at each call
            pass
        return message

    def backward_message_of(self, module: nn.Module) -> int:
        """The message of ``module``'s backward (its forward's name with ``.backward``)."""
        try:
            found = self.ranges.backward.get(module)
        except TypeError:
            found = None
        if found is not None:
            return found
        try:
            forward = self.ranges.name_of(self.ranges.forward.get(module, NO_RANGE))
        except TypeError:
            forward = None
        if forward is None:  # not part of any model: named as its call was, and not kept
            return self.ranges.message(self.names.fallback(module, self.last_root) + BACKWARD_SUFFIX,
                                       RangeKind.BACKWARD)
        message = self.ranges.message(forward + BACKWARD_SUFFIX, RangeKind.BACKWARD)
        try:
            self.ranges.backward[module] = message
        except TypeError:
            pass
        return message

    def enter(self, module: nn.Module, is_root: bool) -> int:
        """Push ``module``'s range (the Python wrapper's way); the message, or :data:`NO_RANGE`."""
        try:
            message: Any = self.ranges.forward.get(module)
        except TypeError:
            message = None
        if message is None:
            message = self.message_of(module, is_root)
        if message != NO_RANGE:
            self.ranges.push(message)
        return int(message)


def ranges_of(recording: Recording) -> ModuleRanges | None:
    """The NVTX ranges of module calls, where the session sends NVTX ranges."""
    return None if recording.nvtx is None else ModuleRanges(recording.nvtx, recording.model_names)


def range_calls(module_ranges: ModuleRanges | None) -> tuple[Callable[[nn.Module, bool], int] | None,
                                                             Callable[[], None]]:
    """``(enter(module, is_root), leave())`` of the Python wrapper's NVTX ranges (enter None: none)."""
    if module_ranges is None:
        return None, _nothing
    return module_ranges.enter, module_ranges.ranges.pop


def _nothing() -> None:
    """No range to leave."""
