"""The span budget: traces Jaeger can open, with the deepest levels folded and nothing lost silently."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.export.budget import (
    ATTR_AGGREGATED_COUNT,
    ATTR_AGGREGATED_TOP,
    ATTR_AGGREGATED_TOTAL_NS,
    ATTR_BUDGET_CUT,
    ATTR_BUDGET_RAW_SPANS,
    within_budget,
)
from xsp.export.target import span_budget_from_env
from xsp.table.build import conform


def step(trace_id: str, operators: int, kernels_per_operator: int, first_id: int) -> list[dict]:
    """A step: a model span, operators under it, each launching kernels (a CUDA call and a kernel each)."""
    rows = [{col.TRACE_ID: trace_id, col.SPAN_ID: first_id, col.LEVEL: "model", col.KIND: "predict",
             col.NAME: "model", col.START_NS: 0, col.END_NS: 10_000_000, col.THREAD_ID: 1}]
    next_id = first_id + 1
    for op in range(operators):
        op_id, start = next_id, 1000 + op * 1000
        rows.append({col.TRACE_ID: trace_id, col.SPAN_ID: op_id, col.PARENT_ID: first_id, col.LEVEL: "operator",
                     col.KIND: "operator", col.NAME: f"aten::op{op % 7}", col.START_NS: start,
                     col.END_NS: start + 900, col.THREAD_ID: 1})
        next_id += 1
        for k in range(kernels_per_operator):
            launch = next_id
            rows.append({col.TRACE_ID: trace_id, col.SPAN_ID: launch, col.PARENT_ID: op_id, col.LEVEL: "cuda_api",
                         col.KIND: "runtime", col.NAME: "cudaLaunchKernel", col.START_NS: start + 10 + k * 50,
                         col.END_NS: start + 30 + k * 50, col.THREAD_ID: 1})
            rows.append({col.TRACE_ID: trace_id, col.SPAN_ID: launch + 1, col.PARENT_ID: launch, col.LEVEL: "kernel",
                         col.KIND: "kernel", col.NAME: f"gemm{k % 2}", col.START_NS: start + 100 + k * 50,
                         col.END_NS: start + 140 + k * 50, col.STREAM_ID: 7, col.DEVICE_ID: 0})
            next_id += 2
    return rows


def table(*steps: list[dict]) -> pd.DataFrame:
    frame = conform(pd.DataFrame([row for rows in steps for row in rows]))
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    return frame


def represented(spans: pd.DataFrame) -> int:
    """Raw spans a (folded) table stands for: aggregates count their members."""
    counts = [json.loads(a).get(ATTR_AGGREGATED_COUNT, 1) if isinstance(a, str) else 1 for a in spans[col.ATTRIBUTES]]
    return int(sum(counts))


def assert_a_tree(spans: pd.DataFrame) -> None:
    ids = set(spans[col.SPAN_ID].tolist())
    parents = spans[col.PARENT_ID].dropna().astype(int).tolist()
    assert set(parents) <= ids
    assert spans[col.SPAN_ID].is_unique


def test_a_trace_within_the_budget_is_untouched():
    spans = table(step("a" * 32, 10, 2, 1))
    folded = within_budget(spans, 2000)
    assert folded.spans is spans and folded.traces_folded == 0


def test_kernels_under_an_operator_become_one_span_per_level_and_stream():
    big, small = step("a" * 32, 300, 3, 1), step("b" * 32, 5, 1, 100_000)
    spans = table(big, small)
    folded = within_budget(spans, 1000)
    out = folded.spans
    assert folded.traces_folded == 1 and folded.dropped == 0
    big_out = out[out[col.TRACE_ID] == "a" * 32]
    assert len(big_out) <= 1000
    assert represented(big_out) == len(big)  # every raw span is in a count
    assert len(out[out[col.TRACE_ID] == "b" * 32]) == len(small)  # the small trace is sent as it is
    assert_a_tree(out)
    # the operators stay; under each, one CUDA API aggregate and one kernel aggregate
    assert (big_out[col.LEVEL] == "operator").sum() == 300
    kernels = big_out[big_out[col.LEVEL] == "kernel"]
    assert len(kernels) == 300
    first = json.loads(kernels[col.ATTRIBUTES].iloc[0])
    assert first[ATTR_AGGREGATED_COUNT] == 3 and first[ATTR_AGGREGATED_TOTAL_NS] == 120
    assert first[ATTR_AGGREGATED_TOP] == ["gemm0 x2", "gemm1 x1"]
    operator_ids = set(big_out[big_out[col.LEVEL] == "operator"][col.SPAN_ID])
    assert set(kernels[col.PARENT_ID].astype(int)) <= operator_ids
    root = big_out[big_out[col.PARENT_ID].isna()].iloc[0]
    marks = json.loads(root[col.ATTRIBUTES])
    assert marks[ATTR_BUDGET_RAW_SPANS] == len(big) and marks[ATTR_BUDGET_CUT] == "cuda_api"


def test_when_levels_apart_do_not_fit_an_operators_descendants_become_one_span():
    spans = table(step("a" * 32, 300, 3, 1))
    out = within_budget(spans, 700).spans
    assert (out[col.LEVEL] == "operator").sum() == 300 and len(out) == 601
    below = out[~out[col.LEVEL].isin(["operator", "model"])]
    assert {json.loads(a)[ATTR_AGGREGATED_COUNT] for a in below[col.ATTRIBUTES]} == {6}
    assert set(below[col.NAME]) == {"6 spans"}


def test_tighter_budgets_fold_higher_levels_and_always_fit():
    spans = table(step("a" * 32, 300, 3, 1))
    for budget in (900, 400, 50, 5):
        folded = within_budget(spans, budget)
        assert len(folded.spans) <= budget
        assert represented(folded.spans) + folded.dropped == len(spans)
        assert_a_tree(folded.spans)


def test_no_budget_folds_nothing(monkeypatch):
    spans = table(step("a" * 32, 300, 3, 1))
    assert within_budget(spans, 0).spans is spans
    monkeypatch.setenv("XSP_SPAN_BUDGET", "0")
    assert span_budget_from_env() == 0
    monkeypatch.setenv("XSP_SPAN_BUDGET", "junk")
    assert span_budget_from_env() == 2000


@pytest.mark.parametrize("name", ["a100_nccl_rank0", "v100_2rank_train_rank1", "sampled_rank0"])
def test_real_gpu_steps_fit_jaegers_budget(shared_traces, name):
    spans = xsp.load(shared_traces / "kineto" / f"{name}.json.gz").spans
    sizes = spans[col.TRACE_ID].value_counts()
    assert sizes.max() > 2000  # a real step is far over what Jaeger's UI opens quickly
    folded = within_budget(spans, 2000)
    out = folded.spans
    assert out[col.TRACE_ID].value_counts().max() <= 2000
    assert represented(out) + folded.dropped == len(spans)
    assert folded.dropped == 0
    assert_a_tree(out)
    # the operators keep their time: the time of each step's root is unchanged
    roots_before = spans[spans[col.PARENT_ID].isna()].set_index(col.SPAN_ID)[col.DURATION_NS]
    roots_after = out[out[col.PARENT_ID].isna()].set_index(col.SPAN_ID)[col.DURATION_NS]
    assert np.array_equal(roots_before.sort_index().to_numpy(), roots_after.sort_index().to_numpy())
