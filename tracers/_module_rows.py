"""Interpreting recorded module calls after the session: names, module facts, shapes."""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd
from torch import nn

from xsp import schema as col
from xsp.recording import Window, WindowBuffer

PREDICT_NAME = "predict"
BACKWARD_SUFFIX = ".backward"


def as_numpy(values: Any) -> np.ndarray:
    """Copy a typed ``array.array`` into a numpy array without iterating in Python."""
    return np.frombuffer(values, dtype=values.typecode).astype(np.int64) if len(values) else (
        np.zeros(0, dtype=np.int64))


@lru_cache(maxsize=4096)
def class_source(cls: type) -> str | None:
    """``file:line`` where ``cls`` is defined, or None when Python cannot tell."""
    try:
        path = inspect.getsourcefile(cls)
        _, line = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    return f"{path}:{line}" if path else None


def parameter_count(module: nn.Module) -> int:
    """Parameters of ``module`` and its children."""
    return sum(p.numel() for p in module.parameters())


def shapes_text(descriptor: Any) -> str | None:
    """``[[1, 3, 224, 224]]``: a descriptor recorded by the wrapper, as JSON."""
    if descriptor is None:
        return None
    if all(isinstance(dim, int) for dim in descriptor):
        return json.dumps([list(descriptor)])
    return json.dumps([list(shape) for shape in descriptor])


def batch_size_of(descriptor: Any) -> int | None:
    """First dimension of the first tensor with one."""
    if descriptor is None:
        return None
    shapes: Sequence[Any] = [descriptor] if all(isinstance(d, int) for d in descriptor) else descriptor
    for shape in shapes:
        if len(shape):
            return int(shape[0])
    return None


class _Names:
    """Module paths as seen from each root module, cached per root."""

    def __init__(self) -> None:
        self._by_root: dict[int, dict[int, str]] = {}
        self.any_root: dict[int, str] = {}

    def of_root(self, root: nn.Module) -> dict[int, str]:
        names = self._by_root.get(id(root))
        if names is None:
            names = {id(module): name for name, module in root.named_modules()}
            self._by_root[id(root)] = names
            for module_id, name in names.items():
                self.any_root.setdefault(module_id, name)
        return names

    @staticmethod
    def fallback(module: nn.Module) -> str:
        return f"<{type(module).__name__}>"


def module_call_rows(window: Window) -> pd.DataFrame:
    """One row per recorded module call of every thread (roots and layers together).

    Cached on the window: the model and layer tracers both read it.
    """
    cached = window.derived.get("module_calls")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    names = _Names()
    frames = [_buffer_call_rows(buffer, names) for buffer in window.buffers if len(buffer.call_columns)]
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if window.external_ids and len(rows):  # each call pushed its start to CUPTI as its external id
        rows[col.EXTERNAL_ID] = rows[col.START_NS].astype("Int64")
    window.derived["module_calls"] = rows
    window.derived["module_names"] = names
    return rows


def _buffer_call_rows(buffer: WindowBuffer, names: _Names) -> pd.DataFrame:
    cols = buffer.call_columns
    depth = as_numpy(cols.depth)
    module_idx = as_numpy(cols.module)
    count = len(depth)
    roots = np.flatnonzero(depth == 0)
    # a call belongs to the first top-level call that ends at or after it (records are in end order)
    position = np.searchsorted(roots, np.arange(count))
    has_root = position < len(roots)
    if len(roots):
        root_row = np.where(has_root, roots[np.minimum(position, len(roots) - 1)], -1)
    else:
        root_row = np.full(count, -1)
    root_module = np.where(has_root, module_idx[np.maximum(root_row, 0)], -1)
    modules = buffer.modules.values
    for root_i in np.unique(module_idx[roots]).tolist():
        names.of_root(modules[root_i])
    name_of_pair: dict[tuple[int, int], str] = {}
    call_names = np.empty(count, dtype=object)
    for i, (root_i, module_i) in enumerate(zip(root_module.tolist(), module_idx.tolist())):
        key = (root_i, module_i)
        name = name_of_pair.get(key)
        if name is None:
            name = _call_name(modules, root_i, module_i, names)
            name_of_pair[key] = name
        call_names[i] = name
    facts = [_module_facts(module) for module in modules]
    descriptors = buffer.descriptors.values
    shape_texts = np.array([shapes_text(d) for d in descriptors] + [None], dtype=object)
    batch_sizes = np.array([batch_size_of(d) for d in descriptors] + [None], dtype=object)
    inputs, outputs = as_numpy(cols.inputs), as_numpy(cols.outputs)
    errors = [buffer.string(i) for i in as_numpy(cols.error).tolist()]
    return pd.DataFrame({
        col.START_NS: as_numpy(cols.start),
        col.END_NS: as_numpy(cols.end),
        col.THREAD_ID: buffer.thread_id,
        col.CALL_DEPTH: depth,
        col.NAME: call_names,
        col.MODULE_TYPE: [facts[i][0] for i in module_idx.tolist()],
        col.PARAM_COUNT: [facts[i][1] for i in module_idx.tolist()],
        col.SOURCE: [facts[i][2] for i in module_idx.tolist()],
        col.INPUT_SHAPES: shape_texts[inputs],
        col.OUTPUT_SHAPES: shape_texts[outputs],
        col.BATCH_SIZE: batch_sizes[inputs],
        col.STATUS: [col.Status.OK.value if e is None else col.Status.ERROR.value for e in errors],
        col.STATUS_MESSAGE: errors,
    })


def _call_name(modules: list[nn.Module], root_i: int, module_i: int, names: _Names) -> str:
    if root_i == module_i:
        return PREDICT_NAME
    module = modules[module_i]
    if root_i < 0:
        return names.any_root.get(id(module)) or names.fallback(module)
    name = names.of_root(modules[root_i]).get(id(module))
    return name if name else names.fallback(module)


def _module_facts(module: nn.Module) -> tuple[str, int, str | None]:
    cls = type(module)
    return cls.__name__, parameter_count(module), class_source(cls)  # type: ignore[arg-type]


def backward_rows(window: Window) -> pd.DataFrame:
    """One row per module backward, pairing each begin with the next end of the same module.

    Ends without a begin and begins without an end are counted in the window's dropped
    counts (``unpaired_backward_events``) rather than guessed.
    """
    module_call_rows(window)  # fills the root-name cache
    names: _Names = window.derived["module_names"]
    frames = []
    for buffer in window.buffers:
        cols = buffer.backward_columns
        if not len(cols):
            continue
        times, modules_idx, phases = as_numpy(cols.time), as_numpy(cols.module), as_numpy(cols.phase)
        order = np.argsort(times, kind="stable")
        open_begins: dict[int, list[int]] = {}
        starts, ends, which = [], [], []
        unpaired = 0
        for i in order.tolist():
            module_i = int(modules_idx[i])
            if phases[i] == 0:
                open_begins.setdefault(module_i, []).append(int(times[i]))
            elif open_begins.get(module_i):
                starts.append(open_begins[module_i].pop())
                ends.append(int(times[i]))
                which.append(module_i)
            else:
                unpaired += 1
        unpaired += sum(len(v) for v in open_begins.values())
        if unpaired:
            window.dropped["unpaired_backward_events"] += unpaired
        modules = buffer.modules.values
        facts = [_module_facts(modules[i]) for i in which]
        frames.append(_cover_submodules(pd.DataFrame({
            col.START_NS: np.array(starts, dtype=np.int64),
            col.END_NS: np.array(ends, dtype=np.int64),
            col.THREAD_ID: buffer.thread_id,
            col.NAME: [_backward_name(modules[i], names) for i in which],
            col.MODULE_TYPE: [f[0] for f in facts],
            col.PARAM_COUNT: [f[1] for f in facts],
            col.SOURCE: [f[2] for f in facts],
            col.STATUS: col.Status.OK.value,
        })))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _cover_submodules(rows: pd.DataFrame) -> pd.DataFrame:
    """Stretch each module's backward over its submodules' backward in the same pass.

    PyTorch fires a module's full backward hook as soon as the gradient of its *output* is
    known when none of its inputs needs a gradient (the first layers, the whole model), so
    that span would end before its submodules' backward runs. A module's backward contains
    its submodules' by construction, so its end is moved to theirs; such rows are marked
    ``{"xsp.backward_end": "submodules"}`` in ``attributes``.
    """
    if rows.empty:
        return rows
    rows = rows.sort_values(col.START_NS, kind="stable").reset_index(drop=True)
    names = rows[col.NAME].str.slice(stop=-len(BACKWARD_SUFFIX)).to_numpy(dtype=object)
    starts = rows[col.START_NS].to_numpy(dtype=np.int64)
    ends = rows[col.END_NS].to_numpy(dtype=np.int64).copy()
    extended = np.zeros(len(rows), dtype=bool)
    for name in pd.unique(names):
        own = np.flatnonzero(names == name)
        if name == PREDICT_NAME:
            inside = np.flatnonzero(names != name)
        else:
            inside = np.flatnonzero(pd.Series(names).str.startswith(name + ".").to_numpy())
        if not len(inside):
            continue
        inside_starts = starts[inside]
        window_ends = np.append(starts[own][1:], np.iinfo(np.int64).max)
        for row, window_end in zip(own.tolist(), window_ends.tolist()):
            lo, hi = np.searchsorted(inside_starts, [starts[row], window_end], side="left")
            if hi > lo:
                latest = int(ends[inside[lo:hi]].max())
                if latest > ends[row]:
                    ends[row], extended[row] = latest, True
    rows[col.END_NS] = ends
    rows[col.ATTRIBUTES] = ['{"xsp.backward_end": "submodules"}' if e else None for e in extended.tolist()]
    return rows


def _backward_name(module: nn.Module, names: _Names) -> str:
    name = names.any_root.get(id(module))
    if name is None:
        name = names.fallback(module)
    elif name == "":
        name = PREDICT_NAME
    return name + BACKWARD_SUFFIX
