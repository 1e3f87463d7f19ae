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
from xsp.core.schema import BACKWARD_SUFFIX
from xsp.record.compiled_kernels import NAMED_MARK, called_key, kernel_name
from xsp.table.walks import nearest_ancestor, text_matches

COMPILED_REGION: Final = "Torch-Compiled Region: "
"""The name of the span of one call of compiled code, before its compile id (``0/0``)."""
REGION_PATTERN: Final = re.compile(re.escape(COMPILED_REGION))
CALL_PATTERN: Final = re.compile(r"## Call CompiledFxGraph|CompiledFunction$")
"""The spans of the call of one compiled graph inside its region: PyTorch's profiler's, and the
autograd function a graph that trains runs as (its backward, ``CompiledFunctionBackward``, runs
in no region: the operators it calls as they are stay on the layer that called it)."""
OPERATOR_PATTERN: Final = re.compile("::")
"""An operator's name has its namespace (``aten::addmm``)."""


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
    region = nearest_ancestor(spans, is_region, parents)[positions]
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


__all__ = ["COMPILED_BACKWARD", "COMPILED_REGION", "compiled_keys", "compiled_layer_name", "REGION_PATTERN"]
