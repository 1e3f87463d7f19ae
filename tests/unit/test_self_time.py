"""Self time stays true: under a depth cap, with overlapping siblings, and as a property of any tree."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xsp.analysis.layers import layer_table
from xsp.analysis.operators import operator_table
from xsp.analysis.overview import aggregated_tree
from xsp.core import schema as col
from xsp.table import parents as hierarchy
from xsp.table.build import conform
from xsp.table.parents import MAX_DEPTH
from xsp.table.self_time import self_ns


def table(rows, parents=None):
    frame = pd.DataFrame(rows, columns=["name", "level", "start_ns", "end_ns", "thread_id"])
    frame[col.SPAN_ID] = np.arange(1, len(frame) + 1)
    frame[col.DURATION_NS] = frame["end_ns"] - frame["start_ns"]
    frame[col.KIND] = [col.SpanKind.FORWARD.value if level == "layer" else None for level in frame["level"]]
    frame[col.MODULE_TYPE] = [name.split(".")[0] for name in frame["name"]]
    frame[col.STEP] = 0
    built = conform(frame)
    if parents is None:
        return hierarchy.build(built)
    built[col.PARENT_ID] = pd.array([None if p is None else p + 1 for p in parents], dtype="Int64")
    return built


def test_a_chain_past_the_depth_cap_keeps_every_self_time():
    depth = MAX_DEPTH + 72  # 200 nested layers, each 10 ns longer than the one inside it
    rows = [("model", "model", 0, 20 * depth + 100, 1)]
    rows += [(f"Deep.{i}", "layer", 10 * i, 20 * depth + 100 - 10 * i, 1) for i in range(1, depth + 1)]
    spans = table(rows)
    assert spans.attrs["hierarchy"]["flattened"] > 0  # the tree was cut...
    layers = layer_table(spans).set_index("name")
    inner_most = f"Deep.{depth}"
    for i in range(1, depth):  # ... and each layer's self time is still its 20 ns around the next
        assert layers.loc[f"Deep.{i}", "self_ms"] * 1e6 == 20, i
    assert layers.loc[inner_most, "self_ms"] * 1e6 == layers.loc[inner_most, "duration_ms"] * 1e6
    total_self = layers["self_ms"].sum() * 1e6
    assert total_self == pytest.approx(20 * depth + 80)  # every layer's time once: the outermost layer's duration


def test_a_child_is_clipped_to_its_parent():
    spans = table([("model", "model", 0, 100, 1), ("a", "layer", 50, 400, 1)], parents=[None, 0])
    assert self_ns(spans, np.ones(2, dtype=bool)).tolist() == [50, 350]


def test_a_leveled_merges_leaf_layer_keeps_its_whole_time_as_self_time():
    # placed from several runs' figures, a sibling (Flatten) ended inside a leaf (Conv2d): the
    # merge's parents hold, so the leaf's self time is its whole time (it read 0.308 of 0.323 ms)
    rows = [("model", "model", 0, 700, 1), ("Conv2d.0", "layer", 250, 575, 1), ("Flatten.0", "layer", 535, 550, 1)]
    placed = table(rows, parents=[None, 0, 0])
    placed[col.DURATION_CI_NS] = pd.array([7, 5, 1], dtype="Int64")  # a leveled merge's intervals
    layers = layer_table(placed).set_index("name")
    assert (layers["self_ms"] == layers["duration_ms"]).all()
    recorded = table(rows, parents=[None, 0, 0])  # one run's positions: Flatten ran inside the Conv2d
    assert layer_table(recorded).set_index("name").loc["Conv2d.0", "self_ms"] * 1e6 == 325 - 15


def test_spans_of_other_threads_are_never_moved_inside_each_other():
    spans = table([("model", "model", 0, 100, 1), ("a", "layer", 10, 90, 1), ("b", "layer", 20, 30, 2)],
                  parents=[None, 0, 0])
    assert self_ns(spans, np.ones(3, dtype=bool)).tolist() == [20, 80, 10]


def test_siblings_that_overlap_take_their_shared_time_off_their_parent_once():
    spans = table([("model", "model", 0, 100, 1), ("a", "layer", 10, 60, 1), ("b", "layer", 40, 90, 1)],
                  parents=[None, 0, 0])
    assert self_ns(spans, np.ones(3, dtype=bool)).tolist() == [20, 50, 50]  # 100 minus the union [10, 90]


@st.composite
def contained_trees(draw):
    """Spans on one thread, each inside its parent in time (what a file that loads may hold),
    with siblings that may overlap, nest or repeat each other's interval."""
    rows, parents = [(0, 1000)], [None]
    for _ in range(draw(st.integers(0, 40))):
        parent = draw(st.integers(0, len(rows) - 1))
        low, high = rows[parent]
        start = draw(st.integers(low, high))
        rows.append((start, draw(st.integers(start, high))))
        parents.append(parent)
    return rows, parents


@settings(max_examples=200, deadline=None)
@given(contained_trees())
@pytest.mark.heavy
def test_self_times_of_any_tree_add_up_to_its_root_at_most(tree):
    rows, parents = tree
    spans = table([(f"L{i}", "layer", start, end, 1) for i, (start, end) in enumerate(rows)], parents)
    own = self_ns(spans, np.ones(len(spans), dtype=bool))
    duration = spans[col.DURATION_NS].to_numpy()
    assert (own >= 0).all() and (own <= duration).all()
    for position, (start, end) in enumerate(rows):  # a parent's own time: what no child covers
        covered = np.zeros(1001, dtype=bool)
        for child, (child_start, child_end) in enumerate(rows):
            if parents[child] == position:
                covered[child_start:child_end] = True
        # (less for a span with a sibling inside it: that sibling's time is its child's)
        assert own[position] <= (end - start) - covered[start:end].sum()
        if position == 0:
            assert own[0] == 1000 - covered.sum()
    cross = any(rows[a][0] < rows[b][0] < rows[a][1] < rows[b][1] for a in range(len(rows)) for b in range(len(rows)))
    if not cross:  # intervals that nest as a call stack's do, whatever parents say: each instant once
        assert own.sum() <= duration[0]


def test_operator_and_tree_self_times_agree_with_the_layers_under_a_cut():
    depth = MAX_DEPTH + 10
    rows = [("model", "model", 0, 20 * depth + 100, 1)]
    rows += [(f"op{i}", "operator", 10 * i, 20 * depth + 100 - 10 * i, 1) for i in range(1, depth + 1)]
    spans = table(rows)
    spans[col.KIND] = [None] + [col.SpanKind.OPERATOR.value] * depth
    ops = operator_table(spans).set_index("name")
    assert (ops.loc[[f"op{i}" for i in range(1, depth)], "self_us"] * 1e3).round().eq(20).all()
    tree = aggregated_tree(spans)
    assert tree["self_ms"].sum() * 1e6 <= 20 * depth + 100 + 1e-6


def test_what_torch_compile_did_is_neither_an_operators_time_nor_a_share_of_the_steps():
    """A compiled training step: the operators run while compiling (fake tensors) led the table
    (PythonDispatchMode 86%), the backward graph compiled at its first call was the self time of
    CompiledFunctionBackward (84%, by interval only: its compile span hangs below the model's
    backward span), and the layers' shares were taken of steps 98% compiling."""
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.analysis.layers import top_layers

    rows = [
        (1, None, "model", "predict", "net", 0, 1_000, {"step": 0}),
        (2, 1, "layer", "forward", "net.fc", 10, 400, {"step": 0, col.MODULE_TYPE: "Linear"}),
        (3, 2, "model", "compile", "torch.compile", 20, 380, {"step": 0}),  # the forward's compile
        (4, 3, "operator", "operator", "PythonDispatchMode", 30, 370, {"step": 0}),
        (5, 1, "model", "backward", "backward", 500, 990, {"step": 0}),
        (6, 5, "operator", "operator", "CompiledFunctionBackward", 510, 980, {"step": 0}),
        (7, 5, "model", "compile", "torch.compile", 520, 960, {"step": 0}),  # inside 6 by its interval only
        (8, 6, "operator", "operator", "aten::mm", 965, 975, {"step": 0}),
    ]
    trace = make_trace(rows)
    ops = operator_table(trace).set_index("name")
    assert "PythonDispatchMode" not in ops.index
    assert ops.loc["CompiledFunctionBackward", "self_us"] == pytest.approx(470 - 440 - 10)
    # the step, less its 800 µs of compiling: 200 µs, of which the layer's own (390 less 360 compiling)
    layers = top_layers(trace).set_index("name")
    assert layers.loc["net.fc", "share"] == pytest.approx(30 / 200)
