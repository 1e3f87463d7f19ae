"""The tree builder on hand-made spans and on random nested intervals (property tests)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xsp.core import schema as col
from xsp.table import parents as hierarchy
from xsp.table.build import conform
from xsp.table.parents import inclusion_parents


def spans(rows):
    frame = pd.DataFrame(rows, columns=["name", "level", "start_ns", "end_ns", "thread_id"])
    frame[col.SPAN_ID] = np.arange(1, len(frame) + 1)
    frame[col.DURATION_NS] = frame["end_ns"] - frame["start_ns"]
    return conform(frame)


def parents_by_name(table):
    built = hierarchy.build(table)
    by_id = dict(zip(built[col.SPAN_ID], built[col.NAME]))
    return {name: (None if pd.isna(p) else by_id[p]) for name, p in zip(built[col.NAME], built[col.PARENT_ID])}


def test_innermost_enclosing_span_of_same_or_shallower_level_is_the_parent():
    table = spans([
        ("predict", "model", 0, 100, 1),
        ("encoder", "layer", 10, 90, 1),
        ("encoder.0", "layer", 20, 40, 1),
        ("encoder.1", "layer", 40, 80, 1),  # touches encoder.0's end: a sibling, not a child
        ("user", "model", 50, 60, 1),  # a model-level span inside a layer hangs from the model span
        ("after", "layer", 95, 100, 1),
    ])
    assert parents_by_name(table) == {
        "predict": None, "encoder": "predict", "encoder.0": "encoder", "encoder.1": "encoder",
        "user": "predict", "after": "predict"}


def test_a_deeper_level_never_parents_a_shallower_one():
    table = spans([("layer", "layer", 0, 100, 1), ("op", "operator", 10, 90, 1), ("inner", "layer", 20, 30, 1)])
    assert parents_by_name(table)["inner"] == "layer"


def test_spans_on_other_threads_never_parent_each_other():
    table = spans([("a", "model", 0, 100, 1), ("b", "layer", 10, 20, 2)])
    assert parents_by_name(table) == {"a": None, "b": None}


def test_overlap_without_nesting_and_equal_twins_are_reported():
    table = spans([("a", "layer", 0, 50, 1), ("b", "layer", 40, 90, 1),
                   ("c", "layer", 100, 110, 1), ("d", "layer", 100, 110, 1)])
    built = hierarchy.build(table)
    assert built.attrs["hierarchy"]["overlapping"] == 1
    assert built.attrs["hierarchy"]["ambiguous"] == 1


def test_call_depth_breaks_ties_between_identical_intervals():
    table = spans([("inner", "layer", 0, 10, 1), ("outer", "layer", 0, 10, 1)])
    table[col.CALL_DEPTH] = pd.array([2, 1], dtype="Int64")
    built = hierarchy.build(table)
    assert parents_by_name(table) == {"inner": "outer", "outer": None}
    assert built.attrs["hierarchy"]["ambiguous"] == 0


def test_gpu_activities_hang_below_their_launch_by_correlation_not_time():
    table = spans([
        ("op", "operator", 0, 100, 1),
        ("cudaLaunchKernel", "cuda_api", 10, 20, 1),
        ("cudaMemcpyAsync", "cuda_api", 30, 40, 1),
        ("gemm", "kernel", 500, 900, None),  # runs long after its launch returned
        ("copy", "kernel", 950, 960, None),
        ("orphan", "kernel", 970, 980, None),
        ("no id", "kernel", 990, 995, None),
    ])
    table[col.KIND] = pd.array(["operator", "runtime", "runtime", "kernel", "memcpy", "kernel", "kernel"],
                               dtype="string")
    table[col.CORRELATION_ID] = pd.array([None, 7, 8, 7, 8, 9, None], dtype="Int64")
    table[col.DEVICE_ID] = pd.array([None, None, None, 0, 0, 0, 0], dtype="Int64")
    assert parents_by_name(table) == {"op": None, "cudaLaunchKernel": "op", "cudaMemcpyAsync": "op",
                                      "gemm": "cudaLaunchKernel", "copy": "cudaMemcpyAsync", "orphan": None,
                                      "no id": None}
    diagnostics = hierarchy.build(table).attrs["hierarchy"]
    assert diagnostics["gpu_activities"] == 4 and diagnostics["launched"] == 2
    assert diagnostics["launch_missing"] == 1 and diagnostics["without_correlation"] == 1


def test_a_correlation_id_carried_by_two_launches_is_reported_not_guessed():
    table = spans([("launch a", "cuda_api", 0, 10, 1), ("launch b", "cuda_api", 20, 30, 2),
                   ("kernel", "kernel", 40, 50, None)])
    table[col.KIND] = pd.array(["runtime", "runtime", "kernel"], dtype="string")
    table[col.CORRELATION_ID] = pd.array([5, 5, 5], dtype="Int64")
    built = hierarchy.build(table)
    assert built[col.PARENT_ID].isna().all()
    assert built.attrs["hierarchy"]["duplicate_correlation"] == 1
    report = hierarchy.diagnostics_table(built.attrs["hierarchy"]).set_index("problem")
    assert report.loc["duplicate_correlation", "spans"] == 1 and report.loc["duplicate_correlation", "share"] == 1


@st.composite
def random_forest(draw):
    """Random trees of strictly nested intervals on a few threads, with their true parents."""
    rows, parents = [], []

    def grow(start, end, parent, depth, thread):
        count = draw(st.integers(0, 3 if depth < 4 else 0))
        if count == 0 or end - start < 4 * count + 2:
            return
        cuts = sorted(draw(st.lists(st.integers(start + 1, end - 1), min_size=2 * count, max_size=2 * count,
                                    unique=True)))
        for i in range(count):
            a, b = cuts[2 * i], cuts[2 * i + 1]
            index = len(rows)
            rows.append((thread, a, b, min(depth, 4)))
            parents.append(parent)
            grow(a, b, index, depth + 1, thread)

    for thread in range(draw(st.integers(1, 3))):
        index = len(rows)
        rows.append((thread, 0, 10_000, 0))
        parents.append(-1)
        grow(0, 10_000, index, 1, thread)
    return rows, parents


@settings(max_examples=200, deadline=None)
@given(random_forest(), st.randoms(use_true_random=False))
def test_random_nested_intervals_are_rebuilt_exactly_in_any_input_order(forest, random):
    rows, true_parents = forest
    order = list(range(len(rows)))
    random.shuffle(order)
    thread = np.array([rows[i][0] for i in order])
    start = np.array([rows[i][1] for i in order])
    end = np.array([rows[i][2] for i in order])
    rank = np.array([min(rows[i][3], 1) for i in order])  # model roots, layers below
    parents, diagnostics = inclusion_parents(thread, start, end, rank, np.zeros(len(rows), dtype=np.int64))
    position_of = {original: shuffled for shuffled, original in enumerate(order)}
    expected = [-1 if true_parents[i] < 0 else position_of[true_parents[i]] for i in order]
    assert parents.tolist() == expected
    assert diagnostics.overlapping == 0 and diagnostics.ambiguous == 0


@settings(max_examples=150, deadline=None)
@given(random_forest(), st.randoms(use_true_random=False), st.integers(1, 30))
@pytest.mark.heavy
def test_random_trees_with_gpu_activities_are_rebuilt_exactly(forest, random, kernels):
    """Host spans nest by time; each kernel hangs below the launch carrying its correlation id,
    whatever its own time (kernels run long after their launch returned)."""
    rows, true_parents = forest
    table_rows = [(f"span{i}", "model" if depth == 0 else "operator", start, end, thread)
                  for i, (thread, start, end, depth) in enumerate(rows)]
    # a launch (cuda_api) inside a random host span, and a kernel far later on the GPU
    launches = []
    for _ in range(kernels):
        host = random.randrange(len(rows))
        thread, start, end, _ = rows[host]
        if end - start < 2:
            continue
        at = random.randrange(start + 1, end - 1) if end - start > 2 else start
        touches_child = any(true_parents[i] == host and rows[i][1] <= at + 1 and at <= rows[i][2]
                            for i in range(len(rows)))
        touches_launch = any(rows[other][0] == thread and abs(other_at - at) <= 2 for other, other_at in launches)
        if touches_child or touches_launch or not (start < at and at + 1 < end):
            continue
        launches.append((host, at))
    for number, (host, at) in enumerate(launches):
        table_rows.append((f"launch{number}", "cuda_api", at, at + 1, rows[host][0]))
        true_parents.append(host)
    for number in range(len(launches)):
        start = 20_000 + random.randrange(10_000)
        table_rows.append((f"kernel{number}", "kernel", start, start + random.randrange(1, 500), None))
        true_parents.append(len(rows) + number)
    order = list(range(len(table_rows)))
    random.shuffle(order)
    table = spans([table_rows[i] for i in order])
    kinds = ["runtime" if r[0].startswith("launch") else "kernel" if r[0].startswith("kernel") else "operator"
             for r in (table_rows[i] for i in order)]
    table[col.KIND] = pd.array(kinds, dtype="string")
    correlation = [int(r[0][6:]) if r[0].startswith("launch") else int(r[0][6:]) if r[0].startswith("kernel")
                   else None for r in (table_rows[i] for i in order)]
    table[col.CORRELATION_ID] = pd.array(correlation, dtype="Int64")
    built = hierarchy.build(table)
    by_id = dict(zip(built[col.SPAN_ID], built[col.NAME]))
    got = {name: (None if pd.isna(p) else by_id[p]) for name, p in zip(built[col.NAME], built[col.PARENT_ID])}
    expected = {table_rows[i][0]: (None if true_parents[i] < 0 else table_rows[true_parents[i]][0])
                for i in range(len(table_rows))}
    assert got == expected
    assert built.attrs["hierarchy"]["launched"] == len(launches)


def _stack_walk_parents(thread, start, end, rank, tiebreak):
    """The plain stack walk that ``inclusion_parents`` does with numpy: the reference."""
    order = np.lexsort((tiebreak, -end, rank, start, thread))
    parents = np.full(len(start), -1, dtype=np.int64)
    stack: list[int] = []
    current = None
    overlapping = ambiguous = 0
    for p in order.tolist():
        if thread[p] != current:
            stack.clear()
            current = thread[p]
        while stack and end[stack[-1]] < end[p]:
            if end[stack.pop()] > start[p]:
                overlapping += 1
        for q in reversed(stack):
            if rank[q] <= rank[p]:
                parents[p] = q
                ambiguous += int(start[q] == start[p] and end[q] == end[p] and rank[q] == rank[p]
                                 and tiebreak[q] == tiebreak[p])
                break
        stack.append(p)
    return parents, overlapping, ambiguous


@pytest.mark.parametrize("seed", range(40))
def test_inclusion_parents_matches_the_stack_walk_on_random_spans(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 400))
    start = rng.integers(0, 60, count)
    end = start + rng.integers(0, 25, count)  # overlaps, equal intervals and zero lengths included
    thread = rng.integers(0, 3, count)
    rank = rng.integers(0, 4, count)
    tiebreak = rng.integers(0, 3, count)
    parents, diagnostics = hierarchy.inclusion_parents(thread, start, end, rank, tiebreak)
    expected, overlapping, ambiguous = _stack_walk_parents(thread, start, end, rank, tiebreak)
    assert parents.tolist() == expected.tolist()
    assert (diagnostics.overlapping, diagnostics.ambiguous) == (overlapping, ambiguous)


def test_inclusion_parents_of_a_deep_chain_and_a_long_rising_run():
    count = 3000
    nested = hierarchy.inclusion_parents(np.zeros(count, np.int64), np.arange(count), 2 * count - np.arange(count),
                                         np.ones(count, np.int64), np.zeros(count, np.int64))[0]
    assert nested.tolist() == [-1, *range(count - 1)]
    rising = hierarchy.inclusion_parents(np.zeros(count, np.int64), np.arange(count), np.arange(count) + 10 ** 6,
                                         np.ones(count, np.int64), np.zeros(count, np.int64))
    assert (rising[0] == -1).all() and rising[1].overlapping == count - 1


def test_cuda_records_that_come_a_window_late_are_placed_under_the_layer_that_made_them():
    from xsp.table.build import build_table, new_step_state

    state = new_step_state()
    first = pd.DataFrame({
        col.LEVEL: ["model", "layer"], col.KIND: ["predict", "forward"], col.NAME: ["model", "model.0"],
        col.START_NS: [100, 110], col.END_NS: [200, 190], col.THREAD_ID: [7, 7], col.CALL_DEPTH: [0, 1],
        col.EXTERNAL_ID: pd.array([100, 110], dtype="Int64")})
    table_1 = build_table([first], 0, state).spans
    layer = table_1[table_1[col.NAME] == "model.0"].iloc[0]
    late = pd.DataFrame({  # the layer's launch and its kernel, handed over with the next window
        col.LEVEL: ["cuda_api", "kernel", "cuda_api"], col.KIND: ["runtime", "kernel", "runtime"],
        col.NAME: ["cudaLaunchKernel", "k", "cudaMalloc"], col.START_NS: [120, 150, 5000],
        col.END_NS: [125, 170, 5010], col.THREAD_ID: pd.array([7, None, 7], dtype="Int64"),
        col.DEVICE_ID: pd.array([None, 0, None], dtype="Int64"),
        col.CORRELATION_ID: pd.array([1, 1, 2], dtype="Int64"),
        col.EXTERNAL_ID: pd.array([110, None, 999], dtype="Int64")})
    result = build_table([late], 0, state)
    table_2 = result.spans.set_index(col.NAME)
    assert table_2.loc["cudaLaunchKernel", col.PARENT_ID] == layer[col.SPAN_ID]
    assert table_2.loc["cudaLaunchKernel", col.TRACE_ID] == layer[col.TRACE_ID]
    assert table_2.loc["k", col.PARENT_ID] == table_2.loc["cudaLaunchKernel", col.SPAN_ID]
    assert table_2.loc["k", col.STEP] == layer[col.STEP] == table_2.loc["cudaLaunchKernel", col.STEP]
    assert pd.isna(table_2.loc["cudaMalloc", col.PARENT_ID])  # no layer of its id: left as it was
    assert result.diagnostics["late_linked"] == 1
