"""Which spans are the work of code ``torch.compile`` compiled, and the key under which a trace's
metadata keeps their sources (:func:`xsp.record.compiled_kernels.kernel_sources`) and layers
(:func:`xsp.record.compiled_kernels.kernel_layers`).

Two kinds of spans run compiled code: the kernels inductor generated (``graph_0_cpp_fused_mul_0``
on CPU, ``triton_poi_fused_mul_0`` on GPU), known by their kernel's name, and the operators the
compiled code calls as they are (``aten::addmm`` for a ``Linear``): right under the span of the
compiled call (``Torch-Compiled Region: 0/0``, or its graph's call inside it), known by their
name and their compile's id,
as two compiles call the same operator for different lines and modules.
"""

from __future__ import annotations

import re
from typing import Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.schema import BACKWARD_SUFFIX, Level, SpanKind
from xsp.record.compiled_kernels import NAMED_MARK, called_key, kernel_name
from xsp.table.walks import nearest_ancestor, text_matches

COMPILED_REGION: Final = "Torch-Compiled Region: "
"""The name of the span of one call of compiled code, before its compile id (``0/0``)."""
REGION_PATTERN: Final = re.compile(re.escape(COMPILED_REGION))
CALL_PATTERN: Final = re.compile(r"## Call CompiledFxGraph|CompiledFunction$|CompiledFunctionBackward$")
"""The spans of the call of one compiled graph: PyTorch's profiler's, inside its region, and the
autograd function a graph that trains runs as, and its backward (which runs in no region: its
compile is its forward's, found by their autograd sequence number)."""
OPERATOR_PATTERN: Final = re.compile("::")
"""An operator's name has its namespace (``aten::addmm``)."""


COMPILED_FORWARD: Final = "CompiledFunction"
"""The autograd function a compiled graph that trains runs as (in its region)."""
COMPILED_BACKWARD: Final = "CompiledFunctionBackward"
"""The autograd node a compiled graph's backward runs under: its kernels count on the layers' backward."""
ORIGINAL_MODULE: Final = "._orig_mod"
"""What a compiled module's layer name ends with inside ``torch.compile``'s wrapper (the layer
``model.body._orig_mod`` is ``model.body`` compiled)."""


def compiled_layer_name(caller: str | None, path: str, backward: bool) -> str:
    """The name of the layer ``path`` of compiled code (a :data:`LayerShare`'s path), as an eager
    run names it: below the layer (or model) ``caller`` that called the compiled code
    (``model.blocks.0``), or the path's own name for a module a compiled function called
    (``/model.blocks.0``); with ``.backward`` for its backward."""
    if path.startswith(NAMED_MARK):
        name = path[len(NAMED_MARK):]
    else:
        owner = (caller or "").removesuffix(BACKWARD_SUFFIX).removesuffix(ORIGINAL_MODULE)
        name = f"{owner}.{path}" if owner else path
    return name + (BACKWARD_SUFFIX if backward else "")


def compiled_callers(spans: pd.DataFrame, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every span: its *caller*, the nearest layer or model call above it (for compiled code,
    the one that called it), else the nearest compiled region (a compiled function called under
    no model or layer, inside an ``xsp.step``: its call is its caller); which spans are layers or
    model calls (a caller that is not names no layer); and which spans run in a compiled backward."""
    is_module = (spans[col.LEVEL] == Level.LAYER.value).to_numpy() | (
        spans[col.KIND] == SpanKind.PREDICT.value).to_numpy()
    callers = nearest_ancestor(spans, is_module, parents)
    callers = np.where(callers >= 0, callers, nearest_ancestor(spans, text_matches(spans[col.NAME], REGION_PATTERN),
                                                               parents))
    backward = nearest_ancestor(spans, (spans[col.NAME] == COMPILED_BACKWARD).to_numpy(), parents) >= 0
    return callers, is_module, backward


def _backward_regions(spans: pd.DataFrame, region_of: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """For each span under a compiled graph's backward (``CompiledFunctionBackward``, which runs in
    no region), the region of its forward: the ``CompiledFunction`` call of the same autograd
    sequence number (and process), the latest one begun before the backward; else -1."""
    found = np.full(len(spans), -1, dtype=np.int64)
    if col.SEQUENCE_NUMBER not in spans:
        return found
    names = spans[col.NAME]
    forwards = np.flatnonzero((names == COMPILED_FORWARD).to_numpy() & (region_of >= 0))
    backwards = np.flatnonzero((names == COMPILED_BACKWARD).to_numpy())
    if not len(forwards) or not len(backwards):
        return found
    sequence = spans[col.SEQUENCE_NUMBER].to_numpy(dtype=np.float64, na_value=np.nan)
    process = (spans[col.PROCESS_ID].to_numpy(dtype=np.float64, na_value=-1.0) if col.PROCESS_ID in spans
               else np.zeros(len(spans)))
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    latest: dict[tuple[float, float], list[tuple[int, int]]] = {}
    for at in forwards[np.argsort(starts[forwards], kind="stable")].tolist():
        latest.setdefault((process[at], sequence[at]), []).append((int(starts[at]), int(region_of[at])))
    region_of_backward = np.full(len(spans), -1, dtype=np.int64)
    for at in backwards.tolist():
        before = [region for start, region in latest.get((process[at], sequence[at]), []) if start <= starts[at]]
        if before:
            region_of_backward[at] = before[-1]
    under = nearest_ancestor(spans, region_of_backward >= 0, parents, include_self=False)
    found[under >= 0] = region_of_backward[under[under >= 0]]
    return found


def compiled_keys(spans: pd.DataFrame, positions: np.ndarray, parents: np.ndarray
                  ) -> tuple[np.ndarray, list[object]]:
    """The key of each span at ``positions``, as codes into a list of keys (a million spans of a
    few names cost a few texts): the kernel's name for a generated kernel (without inductor's
    ``graph_0_`` prefix), the :func:`called_key` of an operator that compiled code calls as it
    is, the span's name for any other (no key of the metadata's; None for a span without one).
    ``parents``: :func:`xsp.table.walks.parent_positions` of ``spans``."""
    codes, names = pd.factorize(spans[col.NAME].iloc[positions], use_na_sentinel=False)
    keys: list[object] = [kernel_name(name) if isinstance(name, str) else None for name in names]
    is_region = text_matches(spans[col.NAME], REGION_PATTERN)
    if not is_region.any() or not len(positions):
        return codes, keys
    operator_named = text_matches(spans[col.NAME], OPERATOR_PATTERN, anywhere=True)
    region_of = nearest_ancestor(spans, is_region, parents)
    backward_of = _backward_regions(spans, region_of, parents)
    region = np.where(region_of[positions] >= 0, region_of[positions], backward_of[positions])
    parent = np.maximum(parents[positions], 0)
    # right under the call: an operator's own work (what aten::addmm calls) is not the compiled
    # code's call, nor is the compiler's (its first call compiles inside the region)
    calls = is_region | text_matches(spans[col.NAME], CALL_PATTERN)
    called = np.flatnonzero((region >= 0) & (parents[positions] >= 0) & calls[parent] & operator_named[positions])
    if not len(called):
        return codes, keys
    # a key per distinct (operator, region name) pair, not per span
    region_codes, region_names = pd.factorize(spans[col.NAME].iloc[region[called]], use_na_sentinel=False)
    pairs, pair_of_span = np.unique(np.stack([codes[called], region_codes], axis=1), axis=0, return_inverse=True)
    called_keys = [called_key(str(keys[code]), str(region_names[at])[len(COMPILED_REGION):]) for code, at in pairs]
    codes = codes.copy()
    codes[called] = len(keys) + pair_of_span.reshape(-1)
    return codes, keys + called_keys


__all__ = ["COMPILED_BACKWARD", "COMPILED_REGION", "compiled_callers", "compiled_keys", "compiled_layer_name",
           "REGION_PATTERN"]
