"""Interpreting recorded module calls after the session: names, module facts, shapes."""

from __future__ import annotations

import inspect
import json
import linecache
import re
import weakref
from collections.abc import Sequence
from functools import lru_cache
from types import CodeType
from typing import Any

import numpy as np
import torch
from torch import nn

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.lazy import pyarrow as pa
from xsp.record.columns import (
    BACKWARD_ALIAS,
    BACKWARD_BEGIN,
    BACKWARD_END,
    BACKWARD_END_OPEN,
    ROOT_GRAD,
    ROOT_MODE_UNKNOWN,
    ROOT_TRAINING,
)
from xsp.record.marks import MarkKind
from xsp.record.sites import CallSites
from xsp.record.window import Window, WindowBuffer
from xsp.table.walks import arrow_strings, categories_at

BACKWARD_SUFFIX = col.BACKWARD_SUFFIX


def as_numpy(values: Any) -> np.ndarray:
    """Copy a typed ``array.array`` into a numpy array without iterating in Python."""
    return np.frombuffer(values, dtype=values.typecode).astype(np.int64) if len(values) else (
        np.zeros(0, dtype=np.int64))


@lru_cache(maxsize=4096)
def class_source(cls: type) -> str | None:
    """``file:line`` where ``cls`` is defined (its first decorator's line, as :mod:`inspect`
    says), or None when Python cannot tell."""
    try:
        path = inspect.getsourcefile(cls)
    except Exception:  # a built-in class; one defined where no file is (python -c, a REPL): its methods may say
        path = None
    if not path:
        return _source_of_methods(cls)
    line = _class_line(path, cls.__name__)
    if line is None:
        try:
            _, line = inspect.getsourcelines(cls)
        except Exception:
            return None
    return f"{path}:{line}"


def _source_of_methods(cls: type) -> str | None:
    """``file:line`` of ``cls`` from the code of the methods it defines, where its module has no
    file: a class of a notebook's cell (``__main__`` of a kernel), whose methods' code names the
    cell's file (``/tmp/ipykernel_…/….py``, in :mod:`linecache`). The line is that of its
    ``class`` statement where the cell's text says it, else of its first method; None where no
    method of its own has code in a file Python keeps the lines of (``python -c``, a REPL)."""
    try:
        codes: list[CodeType] = [
            code for code in (getattr(value, "__code__", None) for value in vars(cls).values())
            if isinstance(code, CodeType) and getattr(code, "co_qualname", "").startswith(f"{cls.__qualname__}.")]
        if not codes:
            return None
        first = min(codes, key=lambda code: code.co_firstlineno)
        path = first.co_filename
        if not linecache.getlines(path):
            return None
        return f"{path}:{_class_line(path, cls.__name__) or first.co_firstlineno}"
    except Exception:
        return None


def _class_line(path: str, name: str) -> int | None:
    """The line of the one ``class name`` statement in ``path`` (what ``inspect`` would say, found
    without parsing the file: a process that ends after a few calls, a followed child, pays that
    per class); None where the text is not that plain (several, none, a decorator), for
    :mod:`inspect` to decide."""
    statement = re.compile(rf"\s*class\s+{re.escape(name)}\b")
    lines = linecache.getlines(path)
    found = [number for number, text in enumerate(lines) if statement.match(text)]
    if len(found) != 1:
        return None
    before = found[0] - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    if before >= 0 and lines[before].lstrip().startswith(("@", ")")) or \
            before >= 0 and lines[before].rstrip().endswith((",", "(", "\\")):
        return None  # decorated: inspect decides
    return found[0] + 1


def parameter_count(module: nn.Module) -> int:
    """Parameters of ``module`` and its children."""
    return sum(p.numel() for p in module.parameters())


def _shapes(descriptor: Any) -> Sequence[Any]:
    """The shapes in a descriptor: one ``torch.Size`` or a tuple of them."""
    return [descriptor] if all(isinstance(dim, int) for dim in descriptor) else descriptor


def _dims(shape: Any) -> list[Any]:
    """A shape as a list of ints (a symbolic or traced size as its text, never an error)."""
    dims: list[Any] = []
    for dim in shape:
        try:
            dims.append(int(dim))
        except (TypeError, ValueError, RuntimeError):
            dims.append(str(dim))
    return dims


def shapes_text(descriptor: Any) -> str | None:
    """``[[1, 3, 224, 224]]``: a descriptor recorded by the wrapper, as JSON."""
    if descriptor is None:
        return None
    return json.dumps([_dims(shape) for shape in _shapes(descriptor)])


def batch_size_of(descriptor: Any) -> int | None:
    """First dimension of the first tensor with one."""
    if descriptor is None:
        return None
    for shape in _shapes(descriptor):
        dims = _dims(shape)
        if dims and isinstance(dims[0], int):
            return dims[0]
    return None


class LayerNames:
    """Layer names as seen from each top-level model: ``<model name>.<module path>``, the
    model's own name for the model itself. Cached per model."""

    def __init__(self, model_names: dict[int, str]) -> None:
        self._model_names = model_names
        self._by_root: dict[int, dict[int, str]] = {}
        self.any_root: dict[int, str] = {}

    def model(self, root: nn.Module) -> str:
        return self._model_names.get(id(root)) or type(root).__name__

    def of_root(self, root: nn.Module) -> dict[int, str]:
        names = self._by_root.get(id(root))
        if names is None:
            model = self.model(root)
            names = {id(module): _layer_name(model, path, root) for path, module in root.named_modules()}
            self._by_root[id(root)] = names
            for module_id, name in names.items():
                self.any_root.setdefault(module_id, name)
        return names

    def fallback(self, module: nn.Module, root: nn.Module | None = None) -> str:
        """A module called inside a model it does not belong to."""
        prefix = f"{self.model(root)}." if root is not None else ""
        return f"{prefix}<{type(module).__name__}>"

    @staticmethod
    def is_fallback(name: str) -> bool:
        """Whether ``name`` is one :meth:`fallback` gave below a model (``model.<Func>``)."""
        return name.endswith(">") and ".<" in name


COMPILED_INNER = "_orig_mod"
"""The model inside a ``torch.compile``d one (an ``OptimizedModule``)."""
HIDDEN = ""
"""The name of calls left out of the layers: a compiled model's call of the model inside it."""


GUARDS = "_guards_fn"
"""The module ``torch.export`` puts in an exported program to check its inputs: no layer of the model."""


def _layer_name(model: str, path: str, root: nn.Module) -> str:
    """``<model>.<path>``; a compiled model's (or compiled submodule's) layers are named as the
    model's own, and its call of the model inside is no layer (a compiled call is one span), nor
    is an exported program's check of its inputs."""
    if path:
        segments = path.split(".")
        if segments[-1] in (COMPILED_INNER, GUARDS):
            return HIDDEN
        if COMPILED_INNER in segments:
            path = ".".join(segment for segment in segments if segment != COMPILED_INNER)
    return f"{model}.{path}" if path else model


def module_call_rows(window: Window) -> pd.DataFrame:
    """One row per recorded module call of every thread (roots and layers together).

    Cached on the window: the model and layer tracers both read it. Each thread's calls give
    index arrays into its own tables of names, facts and shape texts; the columns of every
    thread are made at once (a window of a server that starts a thread per request holds
    thousands of threads of a call or two each, and a frame per thread cost milliseconds each).
    """
    cached = window.derived.get("module_calls")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    names = LayerNames(window.model_names)
    pieces = _CallPieces()
    for buffer in window.buffers:
        if len(buffer.call_columns):
            pieces.add(buffer, names)
    rows = pieces.frame(window.sites)
    if len(rows):
        rows = rows[rows[col.NAME] != HIDDEN].reset_index(drop=True)
        _name_by_caller(rows)
    if window.external_ids and len(rows):  # each call pushed its start to CUPTI as its external id
        rows[col.EXTERNAL_ID] = rows[col.START_NS].astype("Int64")
    window.derived["module_calls"] = rows
    window.derived["module_names"] = names
    return rows


class _CallPieces:
    """The module calls of several threads, gathered as arrays and indexes into value tables."""

    def __init__(self) -> None:
        self.ints: dict[str, list[np.ndarray]] = {key: [] for key in (
            col.START_NS, col.END_NS, col.THREAD_ID, col.CALL_DEPTH, "name", "module", "inputs", "outputs", "error",
            "has_error", "site")}
        self.attributes: list[np.ndarray] = []
        self.names: list[str] = []
        self.types: list[str] = []
        self.params: list[int | None] = []
        self.sources: list[str | None] = []
        self.shapes: list[str | None] = []
        self.batch_sizes: list[int | None] = []
        self.messages: list[str | None] = []

    def add(self, buffer: WindowBuffer, names: LayerNames) -> None:
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
        # names per distinct (model, module) pair, then spread over the rows: no Python per row
        width = len(modules) + 1
        pairs, pair_of_row = np.unique((root_module + 1) * width + module_idx, return_inverse=True)
        ints = self.ints
        ints["name"].append(pair_of_row.reshape(-1) + len(self.names))
        self.names += [_call_name(modules, pair // width - 1, pair % width, names) for pair in pairs.tolist()]
        ints["module"].append(module_idx + len(self.types))
        facts = [_module_facts(module) for module in modules]
        self.types += [f[0] for f in facts]
        self.params += [f[1] for f in facts]
        self.sources += [f[2] for f in facts]
        descriptors = buffer.descriptors.values
        inputs, outputs = as_numpy(cols.inputs), as_numpy(cols.outputs)
        inputs[inputs < 0], outputs[outputs < 0] = len(descriptors), len(descriptors)
        ints["inputs"].append(inputs + len(self.shapes))
        ints["outputs"].append(outputs + len(self.shapes))
        self.shapes += [shapes_text(d) for d in descriptors] + [None]
        self.batch_sizes += [batch_size_of(d) for d in descriptors] + [None]
        error_idx = as_numpy(cols.error)
        ints["error"].append(np.where(error_idx >= 0, error_idx, len(buffer.strings.values)) + len(self.messages))
        ints["has_error"].append((error_idx >= 0).astype(np.int64))
        self.messages += list(buffer.strings.values) + [None]
        starts = as_numpy(cols.start)
        ints[col.START_NS].append(starts)
        ints[col.END_NS].append(as_numpy(cols.end))
        ints[col.THREAD_ID].append(np.full(count, buffer.thread_id, dtype=np.int64))
        ints[col.CALL_DEPTH].append(depth)
        ints["site"].append(as_numpy(cols.site))  # ids of the recording's table, shared by every thread
        self.attributes.append(_root_attributes(buffer, starts, depth))

    def frame(self, sites: CallSites | None) -> pd.DataFrame:
        if not self.attributes:
            return pd.DataFrame()
        ints = {key: np.concatenate(arrays) for key, arrays in self.ints.items()}
        message_texts = pa.array(self.messages, type=pa.large_string())
        shape_texts = pa.array(self.shapes, type=pa.large_string())
        return pd.DataFrame({
            col.START_NS: ints[col.START_NS],
            col.END_NS: ints[col.END_NS],
            col.THREAD_ID: ints[col.THREAD_ID],
            col.CALL_DEPTH: ints[col.CALL_DEPTH],
            col.ATTRIBUTES: np.concatenate(self.attributes),
            col.NAME: _spread(self.names, ints["name"]),
            col.MODULE_TYPE: _spread(self.types, ints["module"]),
            col.PARAM_COUNT: _spread_ints(self.params, ints["module"]),
            col.SOURCE: _spread(self.sources, ints["module"]),
            **site_columns(sites, ints["site"]),
            col.INPUT_SHAPES: arrow_strings(shape_texts.take(ints["inputs"])),
            col.OUTPUT_SHAPES: arrow_strings(shape_texts.take(ints["outputs"])),
            col.BATCH_SIZE: _spread_ints(self.batch_sizes, ints["inputs"]),
            col.STATUS: _spread([col.Status.OK.value, col.Status.ERROR.value], ints["has_error"]),
            col.STATUS_MESSAGE: arrow_strings(message_texts.take(ints["error"])),
        })


def site_columns(sites: CallSites | None, ids: np.ndarray) -> dict[str, Any]:
    """``call_file``, ``call_line`` and ``call_function`` of records with site ``ids``: each
    distinct site's text worked out once (:meth:`CallSites.resolve`), then spread over the rows."""
    distinct, index = np.unique(ids, return_inverse=True)
    texts = [None if sites is None else sites.resolve(site) for site in distinct.tolist()]
    index = index.reshape(-1)
    return {col.CALL_FILE: _spread([None if t is None else t[0] for t in texts], index),
            col.CALL_LINE: _spread_ints([None if t is None else t[1] for t in texts], index),
            col.CALL_FUNCTION: _spread([None if t is None else t[2] for t in texts], index)}


def _spread(values: Sequence[str | None], index: np.ndarray) -> pd.Categorical:
    """``values[index]`` as codes into the distinct values (a categorical), which the table makes
    its text column once sorted (a text column costs far more to sort and concatenate)."""
    distinct = list(dict.fromkeys(value for value in values if value is not None))
    number = {value: position for position, value in enumerate(distinct)}
    codes = np.array([-1 if value is None else number[value] for value in values], dtype=np.int64)
    return categories_at(codes[index], distinct)


def _spread_ints(values: Sequence[int | None], index: np.ndarray) -> pd.arrays.IntegerArray:
    """``values[index]`` as a nullable integer column."""
    missing = np.array([v is None for v in values], dtype=bool)
    filled = np.array([0 if v is None else v for v in values], dtype=np.int64)
    return pd.arrays.IntegerArray(filled[index], missing[index])


_ROOT_ATTRIBUTES = {flags: json.dumps({**({} if flags & ROOT_MODE_UNKNOWN else
                                           {col.ATTR_MODEL_TRAINING: bool(flags & ROOT_TRAINING)}),
                                        col.ATTR_MODEL_GRAD: bool(flags & ROOT_GRAD)})
                    for flags in range(8)}


def _root_attributes(buffer: WindowBuffer, starts: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """For top-level calls, their mode (training, autograd recording) as attributes JSON."""
    attributes = np.full(len(starts), None, dtype=object)
    roots = buffer.root_columns
    if not len(roots):
        return attributes
    root_starts, root_flags = as_numpy(roots.start), as_numpy(roots.flags)
    order = np.argsort(root_starts, kind="stable")
    root_starts, root_flags = root_starts[order], root_flags[order]
    top = np.flatnonzero(depth == 0)  # by columns: an always-on window has a top-level call a request
    at = np.searchsorted(root_starts, starts[top], side="right") - 1  # (of equal starts, the last, as a dict kept)
    found = (at >= 0) & (root_starts[np.maximum(at, 0)] == starts[top])
    texts = np.array([_ROOT_ATTRIBUTES[flags] for flags in range(len(_ROOT_ATTRIBUTES))], dtype=object)
    attributes[top[found]] = texts[root_flags[at[found]]]
    return attributes


def _name_by_caller(rows: pd.DataFrame) -> None:
    """In place: a module that its model does not name (kept in a dict, a list, made in
    ``forward()``), named below the layer that called it (``model.layers.0.self_attn.<Func>``)
    instead of below the model alone, where one call of every layer pooled into one name."""
    names = rows[col.NAME].to_numpy(dtype=object)
    depths = rows[col.CALL_DEPTH].to_numpy(dtype=np.int64)
    unnamed = np.flatnonzero(np.array([LayerNames.is_fallback(name) for name in names], dtype=bool) & (depths > 1))
    if not len(unnamed):
        return
    unnamed = unnamed[np.argsort(depths[unnamed], kind="stable")]
    starts, ends = rows[col.START_NS].to_numpy(dtype=np.int64), rows[col.END_NS].to_numpy(dtype=np.int64)
    threads = rows[col.THREAD_ID].to_numpy(dtype=np.int64)
    by_place: dict[tuple[int, int], np.ndarray] = {}
    renamed = names.copy()
    for row in unnamed.tolist():  # outermost first: a caller renamed first names its callees
        place = (int(threads[row]), int(depths[row]) - 1)
        callers = by_place.get(place)
        if callers is None:
            callers = np.flatnonzero((threads == place[0]) & (depths == place[1]))
            callers = callers[np.argsort(starts[callers], kind="stable")]
            by_place[place] = callers
        at = int(np.searchsorted(starts[callers], starts[row], side="right")) - 1
        if at >= 0 and ends[callers[at]] >= ends[row]:
            renamed[row] = f"{renamed[callers[at]]}.{names[row].rsplit('.', 1)[-1]}"
    rows[col.NAME] = renamed


def _call_name(modules: list[nn.Module], root_i: int, module_i: int, names: LayerNames) -> str:
    module = modules[module_i]
    if root_i == module_i:
        return names.model(module)
    if root_i < 0:
        found = names.any_root.get(id(module))
        return found if found is not None else names.fallback(module)
    name = names.of_root(modules[root_i]).get(id(module))
    return name if name is not None else names.fallback(module, modules[root_i])


_FACTS: weakref.WeakKeyDictionary[nn.Module, tuple[str, int, str | None]] = weakref.WeakKeyDictionary()
"""Each module's facts, worked out once: in the session's process before a window is handed to a
helper (:func:`remember_module_facts`), so that every helper forked later finds them there."""


def remember_module_facts(window: Window) -> None:
    """Work out the facts of every module the window's records name that are not known yet."""
    for buffer in window.buffers:
        for module in buffer.modules.values:
            _module_facts(module)


def _module_facts(module: nn.Module) -> tuple[str, int, str | None]:
    try:
        return _FACTS[module]
    except (KeyError, TypeError):
        pass
    cls = type(module)
    inner = getattr(module, COMPILED_INNER, None)
    if cls.__name__ == "OptimizedModule" and isinstance(inner, nn.Module):  # torch.compile(model): the model's
        cls = type(inner)
    name = getattr(module, "original_name", None) if isinstance(module, torch.jit.ScriptModule) else None
    facts = (name or module_type_name(cls), parameter_count(module), class_source(cls))  # type: ignore[arg-type]
    try:
        _FACTS[module] = facts
    except TypeError:  # a module that takes no weak reference: worked out each time
        pass
    return facts


def module_type_name(cls: type) -> str:
    """A module class's name in the type tables: PyTorch's own classes outside ``torch.nn``
    (quantized, quantization-aware, fused ...) say where they are from, so that a quantized
    ``Linear`` is not counted as ``torch.nn``'s."""
    where = getattr(cls, "__module__", "") or ""
    if not where.startswith("torch.") or where.startswith("torch.nn.") or where == "torch.nn":
        return cls.__name__
    package = where.split(".modules.", 1)[0]
    return f"{cls.__name__} ({package})"


def backward_rows(window: Window) -> pd.DataFrame:
    """One row per module call's backward: from the first begin to the last end recorded for
    that call (a call whose outputs came from several graph nodes has several of each).

    A call with a begin but no end, or an end but no begin (its output was changed in place
    after the call, so the hooked node never ran), is counted in the window's dropped counts
    (``unpaired_backward_events``) rather than guessed. A leaf whose end was left open (its own
    part of the graph too large to search) ends at the next backward begin on its thread within
    its backward pass (:func:`_open_ends`).
    """
    calls = module_call_rows(window)
    names: LayerNames = window.derived["module_names"]
    # a call's backward is named as its forward was (a module made inside forward() has no
    # path of its own); forward calls of earlier windows fall back to the module's path
    forward_names: dict[int, str] = {}
    forward_depths: dict[int, int] = {}
    forward_ends: dict[int, int] = {}
    if len(calls) and any(len(buffer.backward_columns) for buffer in window.buffers):
        starts = calls[col.START_NS].tolist()
        forward_names = dict(zip(starts, calls[col.NAME].tolist()))
        # a wrapper and the module it wraps (DDP and its .module) share one output, so their
        # backward spans share an interval: the forward's depth says which is outside
        forward_depths = dict(zip(starts, calls[col.CALL_DEPTH].tolist()))
        forward_ends = dict(zip(starts, calls[col.END_NS].tolist()))  # which calls a module's backward covers
    passes: tuple[np.ndarray, np.ndarray] | None = None
    frames = []
    for buffer in window.buffers:
        cols = buffer.backward_columns
        if not len(cols):
            continue
        events = pd.DataFrame({"module": as_numpy(cols.module), "call": as_numpy(cols.call),
                               "time": as_numpy(cols.time), "phase": as_numpy(cols.phase)})
        keys = ["module", "call"]
        phase = events["phase"]
        begins = events[phase == BACKWARD_BEGIN].groupby(keys, observed=True)["time"].min().rename(col.START_NS)
        ends = events[phase == BACKWARD_END].groupby(keys, observed=True)["time"].max().rename(col.END_NS)
        open_ends = events[phase == BACKWARD_END_OPEN].groupby(keys, observed=True)["time"].max().rename("open_end")
        paired = pd.concat([begins, ends, open_ends], axis=1, join="outer").reset_index()
        # a module with submodules has only a begin: it ends with them (see _cover_submodules)
        has_children = np.array([bool(buffer.modules.values[i]._modules) for i in paired["module"].tolist()],
                                dtype=bool)
        complete = paired[col.START_NS].notna() & (paired[col.END_NS].notna() | paired["open_end"].notna()
                                                   | has_children)
        unpaired = int((~complete).sum())
        paired = paired[complete.to_numpy()].copy()
        opened = np.array(paired["open_end"].notna(), dtype=bool)
        if opened.any():
            if passes is None:
                passes = _backward_passes(window)
            resolved = _open_ends(paired["open_end"].to_numpy()[opened].astype(np.int64),
                                  paired["call"].to_numpy()[opened].astype(np.int64), events, passes)
            exact = np.array(paired[col.END_NS], dtype=float)[opened]
            stretched = np.isnan(exact) | (resolved > exact)
            paired.loc[opened, col.END_NS] = np.where(stretched, resolved, exact)
            opened[opened] = stretched & (resolved > paired["open_end"].to_numpy()[opened])
        paired[col.END_NS] = paired[col.END_NS].fillna(paired[col.START_NS])
        paired[[col.START_NS, col.END_NS]] = paired[[col.START_NS, col.END_NS]].astype("int64")
        paired["open"] = opened
        paired = paired.drop(columns="open_end")
        if unpaired:
            window.dropped["unpaired_backward_events"] += unpaired
        if paired.empty:  # forward passes whose backward never ran (aliases of them included)
            continue
        paired = pd.concat([paired, _aliases(events[events["phase"] == BACKWARD_ALIAS], paired)], ignore_index=True)
        modules = buffer.modules.values
        which = paired["module"].tolist()
        facts = [_module_facts(modules[i]) for i in which]
        backward_names = [_backward_name(modules[i], call, names, forward_names)
                          for i, call in zip(which, paired["call"].tolist())]
        shown = [name is not None for name in backward_names]
        frames.append(_cover_submodules(pd.DataFrame({
            "call": paired["call"].to_numpy(dtype=np.int64),
            "call_end": np.array([forward_ends.get(call, NO_CALL_END) for call in paired["call"].tolist()],
                                 dtype=np.int64),
            "has_children": np.array([bool(modules[i]._modules) for i in which], dtype=bool),
            "open": paired["open"].to_numpy(dtype=bool),
            col.START_NS: paired[col.START_NS].to_numpy(dtype=np.int64),
            col.END_NS: paired[col.END_NS].to_numpy(dtype=np.int64),
            col.THREAD_ID: buffer.thread_id,
            col.CALL_DEPTH: pd.array([forward_depths.get(call) for call in paired["call"].tolist()], dtype="Int64"),
            col.NAME: backward_names,
            col.MODULE_TYPE: [f[0] for f in facts],
            col.PARAM_COUNT: [f[1] for f in facts],
            col.SOURCE: [f[2] for f in facts],
            col.STATUS: col.Status.OK.value,
        })[shown]))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _backward_passes(window: Window) -> tuple[np.ndarray, np.ndarray]:
    """The starts and ends of the window's backward passes (``torch.autograd.backward`` calls),
    on any thread: on a GPU the nodes run on an autograd device thread, not the caller's."""
    starts, ends = [], []
    for buffer in window.buffers:
        marks = buffer.mark_columns
        if len(marks):
            backward = as_numpy(marks.kind) == MarkKind.BACKWARD
            starts.append(as_numpy(marks.start)[backward])
            ends.append(as_numpy(marks.end)[backward])
    if not starts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(starts), np.concatenate(ends)


def _open_ends(open_ns: np.ndarray, calls: np.ndarray, events: pd.DataFrame,
               passes: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Where the backward of leaf calls whose end was left open at ``open_ns`` ends: at the first
    backward begin of another call on the same thread (``events``) after it, no later than the
    end of the innermost backward pass around it; with none after it in that pass, at the
    pass's end. Outside every pass recorded (its caller's thread outside the window), where it
    was left open."""
    pass_starts, pass_ends = passes
    begin_rows = events[events["phase"] == BACKWARD_BEGIN].sort_values("time", kind="stable")
    begin_times = begin_rows["time"].to_numpy(dtype=np.int64)
    begin_calls = begin_rows["call"].to_numpy(dtype=np.int64)
    resolved = open_ns.copy()
    for row, (open_at, call) in enumerate(zip(open_ns.tolist(), calls.tolist())):
        around = (pass_starts <= open_at) & (pass_ends >= open_at)
        if not around.any():
            continue
        bound = int(pass_ends[around].min())
        at = int(np.searchsorted(begin_times, open_at, side="right"))
        while at < len(begin_times) and begin_calls[at] == call:  # another output node of the same call
            at += 1
        resolved[row] = min(int(begin_times[at]), bound) if at < len(begin_times) else bound
    return resolved


def _aliases(aliases: pd.DataFrame, paired: pd.DataFrame) -> pd.DataFrame:
    """The backward of calls that share the node of another call (whose start is their ``time``):
    its interval, and whether its end was an open one closed (``open``)."""
    if aliases.empty:
        return paired.iloc[:0]
    shared = paired.drop_duplicates("call").set_index("call")[[col.START_NS, col.END_NS, "open"]]
    found = aliases[aliases["time"].isin(shared.index)]
    times = shared.loc[found["time"].to_numpy()]
    return pd.DataFrame({"module": found["module"].to_numpy(), "call": found["call"].to_numpy(),
                         col.START_NS: times[col.START_NS].to_numpy(), col.END_NS: times[col.END_NS].to_numpy(),
                         "open": times["open"].to_numpy(dtype=bool)})


NO_CALL_END = -1
"""``call_end`` of a backward row whose forward call is in an earlier window."""
_BACKWARD_END_SUBMODULES = col.BACKWARD_END_ATTRIBUTES[col.BackwardEnd.SUBMODULES]
_BACKWARD_END_NEXT = col.BACKWARD_END_ATTRIBUTES[col.BackwardEnd.NEXT_BACKWARD]


def _cover_submodules(rows: pd.DataFrame) -> pd.DataFrame:
    """Stretch each module's backward over its submodules' backward of the same call.

    A module's backward is timed on the graph node that produced its output. That node runs
    first, and its hooks fire just after those of a submodule that produced the same output;
    the nodes of its other submodules (and of its first operators) run after it. A module's
    backward contains its submodules' by construction, so it is stretched to cover theirs:
    those whose forward call lay inside its forward call (``call`` to ``call_end``; where its
    forward is in an earlier window, up to the next call of the same module). A submodule called
    again outside it (its parent's parent reusing it) is not inside. Stretched rows are marked
    ``{"xsp.backward_end": "submodules"}`` in ``attributes``, those whose open end was closed
    (``open``) ``"next_backward"``; the ``call``, ``call_end``, ``has_children`` and ``open``
    columns are dropped.
    """
    helpers = ["call", "call_end", "has_children", "open"]
    if rows.empty:
        return rows.drop(columns=helpers)
    rows = rows.sort_values("call", kind="stable").reset_index(drop=True)
    names = rows[col.NAME].str.slice(stop=-len(BACKWARD_SUFFIX)).to_numpy(dtype=object)
    calls = rows["call"].to_numpy(dtype=np.int64)
    call_ends = rows["call_end"].to_numpy(dtype=np.int64)
    starts = rows[col.START_NS].to_numpy(dtype=np.int64).copy()
    ends = rows[col.END_NS].to_numpy(dtype=np.int64).copy()
    extended = np.zeros(len(rows), dtype=bool)
    for name in pd.unique(names[rows["has_children"].to_numpy(dtype=bool)]):  # only those can contain others
        own = np.flatnonzero(names == name)
        inside = np.flatnonzero(pd.Series(names).str.startswith(name + ".").to_numpy())
        if not len(inside):
            continue
        next_calls = np.append(calls[own][1:], np.iinfo(np.int64).max)
        window_ends = np.where(call_ends[own] != NO_CALL_END, call_ends[own], next_calls)
        bounds = np.stack([np.searchsorted(calls[inside], calls[own], side="left"),
                           np.searchsorted(calls[inside], window_ends, side="right")])
        for row, lo, hi in zip(own.tolist(), bounds[0].tolist(), bounds[1].tolist()):
            if hi > lo:
                earliest, latest = int(starts[inside[lo:hi]].min()), int(ends[inside[lo:hi]].max())
                if latest > ends[row]:
                    ends[row], extended[row] = latest, True
                starts[row] = min(starts[row], earliest)
    rows[col.START_NS], rows[col.END_NS] = starts, ends
    rows[col.ATTRIBUTES] = [_BACKWARD_END_SUBMODULES if e else _BACKWARD_END_NEXT if o else None
                            for e, o in zip(extended.tolist(), rows["open"].to_numpy(dtype=bool).tolist())]
    return rows.drop(columns=helpers)


def _backward_name(module: nn.Module, call: int, names: LayerNames, forward_names: dict[int, str]) -> str | None:
    """``<forward call's name>.backward`` (``call`` is the forward call's start); None for the
    backward of a call that is no layer (a compiled model's call of the model inside it)."""
    name = forward_names.get(call)
    if name is None:
        name = names.any_root.get(id(module))
        if name == HIDDEN:
            return None
    return (name or names.fallback(module)) + BACKWARD_SUFFIX
