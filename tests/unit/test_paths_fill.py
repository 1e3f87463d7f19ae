"""Span paths written in place by C (xsp.table._paths) against Arrow's layer-by-layer joining.

Both must give the same column for any forest: roots, deep chains, rows on a cycle (no path),
the session row outside the window as an anchor, names of any Unicode, any occurrence number.
Skipped where the C part is not built (a failure under XSP_REQUIRE_HOTPATH, as in CI).
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xsp
from xsp.core import schema as col
from xsp.table import paths, steps


@pytest.fixture(scope="module")
def fill():
    try:
        return importlib.import_module("xsp.table._paths").fill_paths
    except ImportError:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.table._paths is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.table._paths is not built")


def both_ways(fill, names: list[str], anchor: np.ndarray, occurrence: np.ndarray):
    layer = paths._tree_layers(anchor)
    order = np.argsort(layer, kind="stable")
    bounds = np.searchsorted(layer[order], np.arange(layer.max() + 2))
    column = pa.array(names, type=pa.large_string())
    encoded = column.dictionary_encode()  # the filler reads each row's name by its code among the distinct ones
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    filled = paths._filled_paths(fill, codes, encoded.dictionary, occurrence, anchor, order, bounds)
    joined = paths._joined_paths(column, occurrence, anchor, order, bounds)
    return list(filled), list(joined)


@st.composite
def forests(draw):
    count = draw(st.integers(min_value=1, max_value=60))
    anchor = np.array([draw(st.integers(min_value=-1, max_value=count)) for _ in range(count)] + [-1],
                      dtype=np.int64)
    for row in range(count):  # mostly trees: an anchor among the rows before, the session or none
        if anchor[row] >= 0 and anchor[row] != count and draw(st.booleans()):
            anchor[row] = draw(st.integers(min_value=-1, max_value=row - 1)) if row else -1
    distinct = draw(st.lists(st.text(max_size=12), min_size=1, max_size=count))
    names = [draw(st.sampled_from(distinct)) for _ in range(count)]  # names recur, as in a trace
    occurrence = np.array(draw(st.lists(st.integers(min_value=0, max_value=10**12), min_size=count + 1,
                                        max_size=count + 1)), dtype=np.int64)
    occurrence[count] = 0
    return names, anchor, occurrence


@settings(max_examples=300, deadline=None)
@given(forests())
@pytest.mark.heavy
def test_filled_paths_equal_joined_paths_for_any_forest(fill, forest):
    filled, joined = both_ways(fill, *forest)
    assert filled == joined


def test_a_chain_below_the_session_and_a_cycle(fill):
    names = ["step", "aten::mm", "kernel \u00e9\U0001F600", "a", "b"]
    anchor = np.array([5, 0, 1, 4, 3, -1])  # rows 3 and 4 anchor each other: no path
    occurrence = np.array([2, 0, 11, 0, 0, 0])
    filled, joined = both_ways(fill, names, anchor, occurrence)
    assert filled == joined
    assert filled[:3] == [f"{steps.SESSION_NAME}[0]/step[2]", f"{steps.SESSION_NAME}[0]/step[2]/aten::mm[0]",
                          f"{steps.SESSION_NAME}[0]/step[2]/aten::mm[0]/kernel \u00e9\U0001F600[11]"]
    assert pd.isna(filled[3]) and pd.isna(filled[4])


def test_imported_traces_get_the_same_paths_either_way(fill, shared_traces, monkeypatch):
    source = shared_traces / "kineto" / "a100_nccl_rank0.json.gz"
    monkeypatch.setattr(paths, "_path_filler", lambda: fill)
    filled = xsp.load(source).spans[col.PATH].tolist()
    monkeypatch.setattr(paths, "_path_filler", lambda: None)
    joined = xsp.load(source).spans[col.PATH].tolist()
    assert filled == joined


def test_a_name_code_past_the_distinct_names_is_refused(fill):
    names = pa.array(["a"], type=pa.large_string())
    offsets = np.frombuffer(names.buffers()[1], dtype=np.int64)[:2]
    data = bytearray(8)
    with pytest.raises(ValueError, match="name code out of range"):
        fill(np.array([0, 1]), np.array([-1, -1]), np.array([0, 4], dtype=np.int64), data, np.array([1]), offsets,
             names.buffers()[2], np.array([0, 0]), b"session", 1)
