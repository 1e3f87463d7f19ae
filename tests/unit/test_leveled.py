"""Leveled experimentation: the merge on constructed runs, and xsp.leveled on a real model."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp.analysis.model import trimmed_mean, trimmed_mean_ci
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.session.calibration import LevelCost, calibrate
from xsp.session.leveled_merge import LeveledRun, merge_runs, nest_in_parents
from xsp.session.leveled_plans import RunPlan, level_runs, run_label
from xsp.session.leveled_rounds import MAX_ROUNDS, MIN_ROUNDS, precise_enough
from xsp.session.session import calibration_session
from xsp.table.build import conform
from xsp.table.walks import parent_positions

M, L, OP, F = Level.MODEL, Level.LAYER, Level.OPERATOR, Level.FLOPS
IN = Level.INPUT
STEP, PREDICT, A, B, MM = "leveled[0]", "leveled[0]/predict[0]", "leveled[0]/predict[0]/a[0]", \
    "leveled[0]/predict[0]/b[0]", "leveled[0]/predict[0]/a[0]/aten::mm[0]"
KINDS = {Level.MODEL: SpanKind.PREDICT, Level.LAYER: SpanKind.FORWARD, Level.OPERATOR: SpanKind.OPERATOR,
         Level.FLOPS: SpanKind.OPERATOR}


def _run(levels: tuple[Level, ...], figures: dict[str, list[float]], flops: dict[str, int] | None = None) -> LeveledRun:
    """A traced run: ``figures`` maps a path to its duration in each step (None: absent in that step)."""
    rows = []
    steps = len(next(iter(figures.values())))
    next_id = 1
    for step in range(steps):
        ids: dict[str, int] = {}
        start = step * 10_000
        for path, durations in figures.items():
            duration = durations[step]
            if duration is None:
                continue
            parent = path.rsplit("/", 1)[0] if "/" in path else None
            level = M if path in (STEP, PREDICT) else (OP if "aten::" in path and F not in levels else
                                                      F if "aten::" in path else L)
            kind = SpanKind.STEP if path == STEP else KINDS[level]
            ids[path] = next_id
            rows.append({col.SPAN_ID: next_id, col.PARENT_ID: ids.get(parent), col.STEP: step, col.PATH: path,
                         col.LEVEL: level.value, col.KIND: kind.value, col.NAME: path.rsplit("/", 1)[-1][:-3],
                         col.START_NS: start, col.END_NS: start + int(duration), col.DURATION_NS: int(duration),
                         col.FLOPS: (flops or {}).get(path)})
            next_id += 1
    return LeveledRun(levels, xsp.Trace(spans=conform(pd.DataFrame(rows)), metadata={"device": "test"}))


def test_the_runs_are_the_level_prefixes_then_one_per_metric():
    # the input level comes with the model level: it never makes a run of its own
    def levels_of(plan: list[RunPlan]) -> list[tuple[Level, ...]]:
        return [entry.levels for entry in plan]

    assert levels_of(level_runs("model,layer,operator,flops")) == [(M, IN), (M, IN, L), (M, IN, L, OP), (M, IN, L, F)]
    assert levels_of(level_runs("model,kernel")) == [(M, IN), (M, IN, Level.CUDA_API),
                                                     (M, IN, Level.CUDA_API, Level.KERNEL)]
    assert [run.label for run in level_runs("model,layer")] == ["model", "model+layer"]


def test_nested_modules_make_one_layer_run_per_depth():
    plan = level_runs("model,layer,operator,flops", layer_depths=3)
    assert [run.label for run in plan] == ["model", "model+layer<=1", "model+layer<=2", "model+layer",
                                           "model+layer+operator", "model+layer+flops"]
    assert [run.layer_depth for run in plan] == [None, 1, 2, None, None, None]
    assert run_label((M, L), 2) == "model+layer<=2"
    # a flat model (every layer at depth 1) or none: the same runs as without depths
    assert level_runs("model,layer", layer_depths=1) == level_runs("model,layer", layer_depths=0) == \
        level_runs("model,layer")


def test_each_span_takes_the_trimmed_mean_of_the_run_where_its_level_was_deepest():
    runs = [
        _run((M,), {STEP: [100, 101, 102, 103, 500], PREDICT: [90] * 5}),
        _run((M, L), {STEP: [120] * 5, PREDICT: [110] * 5, A: [40, 41, 42, 43, 900], B: [30] * 5}),
        _run((M, L, OP), {STEP: [200] * 5, PREDICT: [190] * 5, A: [80] * 5, B: [50] * 5, MM: [25] * 5}),
        _run((M, L, F), {STEP: [900] * 5, PREDICT: [800] * 5, A: [400] * 5, B: [300] * 5, MM: [200] * 5},
             flops={MM: 1_000}),
    ]
    result = merge_runs(runs)
    merged = result.trace.spans.set_index(col.PATH)
    assert merged.loc[STEP, col.DURATION_NS] == 102  # 20% trimmed: 101, 102, 103
    assert merged.loc[PREDICT, col.DURATION_NS] == 90
    assert merged.loc[A, col.DURATION_NS] == 42 and merged.loc[B, col.DURATION_NS] == 30
    assert merged.loc[MM, col.DURATION_NS] == 25
    assert merged.loc[A, col.LEVELED_RUN] == "model+layer" and merged.loc[MM, col.LEVELED_RUN] == "model+layer+operator"
    assert (merged[col.END_NS] - merged[col.START_NS] == merged[col.DURATION_NS]).all()
    # FLOPs from the metric run: the operator's own, and every span above it
    assert merged.loc[MM, col.FLOPS] == 1_000 and merged.loc[A, col.FLOPS] == 1_000
    assert merged.loc[PREDICT, col.FLOPS] == 1_000 and pd.isna(merged.loc[B, col.FLOPS])
    # the tree is the deepest timing run's last step, never the metric run's
    assert set(merged[col.STEP]) == {4} and len(merged) == 5
    overhead = result.overhead.set_index("run")
    assert overhead.loc["model", "model_latency_ms"] == pytest.approx(102e-6)
    assert overhead.loc["model+layer", "overhead"] == pytest.approx(120 / 102 - 1)
    assert overhead.loc["model+layer+flops", "metric"] and not overhead.loc["model+layer", "metric"]
    assert result.unmatched.empty


def test_spans_that_do_not_repeat_are_reported_and_keep_the_deepest_runs_figure():
    runs = [
        _run((M,), {STEP: [100] * 4, PREDICT: [90] * 4}),
        _run((M, L), {STEP: [120] * 4, PREDICT: [110] * 4, A: [40, None, 40, None], B: [30] * 4}),
        _run((M, L, OP), {STEP: [200] * 4, PREDICT: [190] * 4, A: [70, 70, 70, 70], B: [50] * 4, MM: [25] * 4}),
    ]
    result = merge_runs(runs)
    merged = result.trace.spans.set_index(col.PATH)
    assert merged.loc[A, col.DURATION_NS] == 70 and merged.loc[A, col.LEVELED_RUN] == "model+layer+operator"
    assert merged.loc[B, col.DURATION_NS] == 30
    assert result.unmatched[["path", "run", "reason"]].values.tolist() == [
        [A, "model+layer", "not once in every step of the run"]]


def test_warmup_steps_are_left_out():
    runs = [_run((M,), {STEP: [1_000, 1_000, 100, 100], PREDICT: [900, 900, 90, 90]})]
    result = merge_runs(runs, warmup_steps=2)
    assert result.overhead["steps"].tolist() == [2]
    assert result.trace.spans.set_index(col.PATH).loc[STEP, col.DURATION_NS] == 100


@pytest.mark.heavy  # a real model, leveled: `python -m pytest -m heavy`
def test_leveled_on_a_real_model_returns_one_consistent_tree(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    with torch.no_grad():
        result = xsp.leveled(lambda: model(x), levels="model,layer,operator,flops", repeat=5, warmup=1,
                             output=tmp_path / "leveled.xsp.parquet")
    assert result.overhead["run"].tolist() == ["model", "model+layer", "model+layer+operator", "model+layer+flops"]
    spans = result.trace.spans
    assert spans[col.PATH].is_unique and spans[col.STEP].nunique() == 1
    parents = parent_positions(spans)
    assert (parents[1:] >= 0).all()  # one root: the step
    levels = spans[col.LEVEL].to_numpy()
    runs = spans[col.LEVELED_RUN].to_numpy()
    expected = {"model": "model", "layer": "model+layer", "operator": "model+layer+operator"}
    matched = ~spans[col.PATH].isin(result.unmatched["path"]).to_numpy()
    assert all(runs[i] == expected[levels[i]] for i in np.flatnonzero(matched))
    addmm = spans[spans[col.NAME] == "aten::addmm"]
    assert addmm[col.FLOPS].tolist() == [2 * 8 * 16 * 32, 2 * 8 * 32 * 4]
    loaded = xsp.load(tmp_path / "leveled.xsp.parquet")
    assert loaded.metadata["leveled"]["runs"] == result.overhead["run"].tolist()
    assert len(loaded.spans) == len(spans)
    # every child lies inside its parent, whichever run each figure came from
    starts, ends = spans[col.START_NS].to_numpy(), spans[col.END_NS].to_numpy()
    child = np.flatnonzero(parents >= 0)
    assert (starts[child] >= starts[parents[child]]).all() and (ends[child] <= ends[parents[child]]).all()
    assert (spans[col.DURATION_NS] == ends - starts).all()


def test_children_are_placed_inside_their_parents_leveled_interval():
    # deepest run: parent 0..100 with children at 10..40 and 60..90; leveled: parent 50 long,
    # children 20 and 30 long (the deeper run's overhead stretched the parent)
    parents = np.array([-1, 0, 0, 2])
    starts, ends = np.array([0, 10, 60, 65]), np.array([100, 40, 90, 85])
    durations = np.array([50, 20, 30, 40])  # the grandchild measured longer than its parent
    host = np.ones(4, dtype=bool)
    new_starts, new_durations, clamped = nest_in_parents(parents, starts, ends, durations, host)
    assert new_starts[:3].tolist() == [0, 5, 20] and new_durations[:3].tolist() == [50, 20, 30]
    assert clamped == 1 and new_durations[3] == 30 and new_starts[3] == 20
    new_ends = new_starts + new_durations
    assert (new_ends[1:] <= new_ends[parents[1:]]).all() and (new_starts[1:] >= new_starts[parents[1:]]).all()
    gpu = np.array([True, True, False, True])  # a GPU activity keeps its own times
    kept, _, _ = nest_in_parents(parents, starts, ends, durations, gpu)
    assert kept[2] == 60


def test_rounds_interleave_the_runs_and_pool_their_steps():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    order = []
    with torch.no_grad():
        result = xsp.leveled(lambda: order.append(model(torch.randn(2, 4))), levels="model,layer", repeat=3,
                             warmup=0, rounds=2)
    assert result.overhead["steps"].tolist() == [6, 6]
    # 2 rounds of 2 runs of 3 steps, and the first call that finds what autograd does in it
    assert result.trace.metadata["leveled"]["rounds"] == 2 and len(order) == 12 + 1
    assert result.unmatched.empty


def test_levels_that_cannot_run_are_left_out_with_the_reason(monkeypatch):
    monkeypatch.setattr("xsp.tracers.cuda.source.SOURCE.available", lambda: "no CUDA driver: test")
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        result = xsp.leveled(lambda: model(torch.randn(2, 4)), levels="model,layer,kernel", repeat=2, warmup=0)
    assert result.overhead["run"].tolist() == ["model", "model+layer"]
    assert result.trace.metadata["leveled"]["skipped"] == {"cuda_api": "no CUDA driver: test",
                                                            "kernel": "no CUDA driver: test"}


NESTED = "leveled[0]/predict[0]/a[0]/c[0]"
"""A layer c inside layer a (b beside a holds none)."""


def _nested_runs() -> list[LeveledRun]:
    """A model-only run and a model+layer run whose layer a holds layer c."""
    return [_run((M,), {STEP: [1000] * 5, PREDICT: [900] * 5}),
            _run((M, L), {STEP: [1200] * 5, PREDICT: [1100] * 5, A: [500] * 5, NESTED: [100] * 5, B: [40] * 5})]


def test_calibrated_costs_come_out_of_each_figure_and_its_ancestors():
    # a (layer) holds b's child c (layer): a has one layer below it; b none
    runs = _nested_runs()
    costs = {Level.MODEL: LevelCost("model", inside_ns=50, parent_ns=120, events=1),
             Level.LAYER: LevelCost("layer", inside_ns=30, parent_ns=70, events=1)}
    result = merge_runs(runs, costs=costs)
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.OVERHEAD_NS] == 30 + 70 and spans.loc[A, col.DURATION_NS] == 500 - 100
    assert spans.loc[NESTED, col.OVERHEAD_NS] == 30 and spans.loc[B, col.DURATION_NS] == 40 - 30
    assert spans.loc[PREDICT, col.DURATION_NS] == 900 - 50  # its own recording; no model call below it
    assert spans.loc[STEP, col.DURATION_NS] == 1000 - 120  # a step costs nothing itself; its model call does
    assert set(result.trace.metadata["leveled"]["calibration"]) == {"model", "layer"}
    raw = merge_runs(runs)
    assert raw.trace.spans.set_index(col.PATH).loc[A, col.DURATION_NS] == 500
    assert raw.trace.spans[col.OVERHEAD_NS].fillna(0).eq(0).all()


def test_a_layers_untimed_call_cost_is_given_back_to_it_and_not_to_its_ancestors():
    runs = _nested_runs()
    costs = {Level.LAYER: LevelCost("layer", inside_ns=0, parent_ns=70, events=1, untimed_ns=25)}
    spans = merge_runs(runs, costs=costs).trace.spans.set_index(col.PATH)
    # each layer gains what calling it costs beyond its clock readings; a loses c's recording
    assert spans.loc[B, col.DURATION_NS] == 40 + 25 and spans.loc[B, col.OVERHEAD_NS] == -25
    assert spans.loc[NESTED, col.DURATION_NS] == 100 + 25
    assert spans.loc[A, col.DURATION_NS] == 500 + 25 - 70
    assert spans.loc[PREDICT, col.DURATION_NS] == 900  # the model call's own figure: its run had no layers


def test_compensation_never_makes_a_duration_negative_and_skips_unmatched_spans():
    runs = [_run((M,), {STEP: [100] * 5, PREDICT: [90] * 5}),
            _run((M, L), {STEP: [120] * 5, PREDICT: [110] * 5, A: [40] * 5, B: [30, 30, None, 30, 30]})]
    costs = {Level.LAYER: LevelCost("layer", inside_ns=1000, parent_ns=1000, events=1)}
    spans = merge_runs(runs, costs=costs).trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_NS] == 0 and spans.loc[A, col.OVERHEAD_NS] == 40
    assert (spans[col.DURATION_NS] >= 0).all()
    assert spans.loc[B, col.DURATION_NS] == 30 and pd.isna(spans.loc[B, col.OVERHEAD_NS])  # not its own run's figure


def test_every_figure_carries_its_95_percent_interval():
    noisy = [100, 104, 96, 102, 98, 101, 99, 103, 97, 100]
    runs = [_run((M,), {STEP: [1000 + 10 * i for i in range(10)], PREDICT: [900] * 10}),
            _run((M, L), {STEP: [1200] * 10, PREDICT: [1100] * 10, A: noisy, B: [30] * 10})]
    result = merge_runs(runs, target=0.02)
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[B, col.DURATION_CI_NS] == 0
    assert 1 <= spans.loc[A, col.DURATION_CI_NS] <= 4
    model = result.overhead.set_index("run").loc["model"]
    assert 0 < model["model_latency_ci_ms"] < 0.05
    assert "leveled[0]/predict[0]/a[0]" not in result.trace.metadata["leveled"]["imprecise"]  # no thread: not drawn


def test_trimmed_mean_interval_covers_the_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(400):
        sample = rng.normal(100.0, 5.0, size=12)
        half = trimmed_mean_ci(sample, 0.2)
        covered += abs(trimmed_mean(sample, 0.2) - 100.0) <= half
    assert 0.9 <= covered / 400 <= 0.99
    assert np.isnan(trimmed_mean_ci(np.array([1.0, 2.0]))) and trimmed_mean_ci(np.full(8, 5.0)) == 0


def test_calibration_measures_each_host_level():
    original_call = torch.nn.Module.__call__
    costs = calibrate((Level.MODEL, Level.LAYER, Level.OPERATOR), calibration_session)
    assert set(costs) == {Level.MODEL, Level.LAYER, Level.OPERATOR}
    for cost in costs.values():
        assert cost.events > 0 and 0 <= cost.inside_ns < 100_000 and 0 < cost.parent_ns < 100_000
    assert costs[Level.LAYER].parent_ns >= costs[Level.LAYER].inside_ns * 0.5  # the parent sees at least the inside
    assert costs[Level.LAYER].fastest and not costs[Level.MODEL].fastest
    # a module call passing through the model level's wrapper costs far less than a recorded
    # top-level call: with the C part, next to nothing (a field of the wrapper read before the
    # original's call), so the median difference may be 0
    assert 0 <= costs[Level.MODEL].nested_ns < costs[Level.MODEL].parent_ns
    assert torch.nn.Module.__call__ is original_call  # the session's wrapper is gone


@pytest.mark.heavy
def test_leveled_repeats_until_precise_or_out_of_budget_and_says_which():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        adaptive = xsp.leveled(lambda: model(x), levels="model,layer", repeat=5, warmup=1, budget_s=1.0)
        forced = xsp.leveled(lambda: model(x), levels="model,layer", repeat=5, warmup=1, rounds=3,
                             compensate=False)
    details = adaptive.trace.metadata["leveled"]
    assert details["adaptive"] and 1 <= details["rounds"] <= MAX_ROUNDS
    if details["rounds"] < MIN_ROUNDS:  # a busy machine: the budget of 1 s cut the minimum short, and said so
        assert details["given_up"] and details["given_up"][0].startswith("rounds: ")
    assert isinstance(details["precise"], bool)
    assert details["precise"] == precise_enough(adaptive, 0.02)
    assert set(details["calibration"]) == {"model", "layer"}
    assert adaptive.trace.spans[col.DURATION_CI_NS].notna().all()
    assert forced.trace.metadata["leveled"]["rounds"] == 3 and not forced.trace.metadata["leveled"]["adaptive"]
    assert forced.trace.metadata["leveled"]["calibration"] == {}
    assert forced.overhead["steps"].tolist() == [15, 15]


def test_a_plain_trace_is_compensated_in_columns_of_its_own():
    # model call M holds layer A, which holds layer B and two operators; costs per level
    rows = [(1, None, "model", "predict", "M", 0, 1000, {}), (2, 1, "layer", "forward", "A", 100, 900, {}),
            (3, 2, "layer", "forward", "B", 200, 400, {}), (4, 3, "operator", "operator", "op1", 250, 300, {}),
            (5, 2, "operator", "operator", "op2", 500, 600, {})]
    trace = make_trace(rows, {"calibration": {
        "model": {"level": "model", "inside_ns": 10, "parent_ns": 20, "events": 1},
        "layer": {"level": "layer", "inside_ns": 30, "parent_ns": 50, "events": 1},
        "operator": {"level": "operator", "inside_ns": 100, "parent_ns": 200, "events": 1}}})
    table = xsp.analysis.compensated(trace).set_index(col.NAME)
    us = 1000
    assert table.loc["op1", col.OVERHEAD_NS] == 100
    assert table.loc["B", col.OVERHEAD_NS] == 30 + 200  # itself, and op1 below it
    assert table.loc["A", col.OVERHEAD_NS] == 30 + 50 + 2 * 200  # itself, B, op1 and op2
    assert table.loc["M", col.OVERHEAD_NS] == 10 + 2 * 50 + 2 * 200
    assert (table["compensated_ns"] == table[col.DURATION_NS] - table[col.OVERHEAD_NS]).all()
    assert table.loc["A", col.DURATION_NS] == 800 * us  # the raw times stay
    with pytest.raises(ValueError, match="no calibration"):
        xsp.analysis.compensated(make_trace(rows))


def test_a_session_can_calibrate_first_and_keep_it(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with xsp.trace(levels="model,layer", output=tmp_path / "c.xsp.parquet", calibrate=True) as session:
        model(torch.randn(2, 8))
    assert session.warnings == []
    trace = xsp.load(tmp_path / "c.xsp.parquet")
    assert set(trace.metadata["calibration"]) == {"model", "layer"}
    table = xsp.analysis.compensated(trace)
    assert (table["compensated_ns"] >= 0).all() and (table[col.OVERHEAD_NS] > 0).any()
    assert len(trace.steps) == 1  # calibration's own sessions leave nothing in the trace


def test_a_model_figure_loses_the_pass_through_cost_of_each_module_call_inside_it():
    # the model-only run recorded no layers, but every nested module call passed through xsp
    runs = _nested_runs()
    costs = {Level.MODEL: LevelCost("model", inside_ns=50, parent_ns=120, events=1, nested_ns=5)}
    spans = merge_runs(runs, costs=costs).trace.spans.set_index(col.PATH)
    assert spans.loc[PREDICT, col.OVERHEAD_NS] == 50 + 3 * 5  # itself, and a, c and b passing through
    assert spans.loc[A, col.OVERHEAD_NS] == 0  # no layer cost calibrated


@pytest.mark.heavy
def test_calibration_under_autograd_measures_the_backward_hooks_too():
    plain, recording = calibrate([Level.LAYER], calibration_session), calibrate([Level.LAYER], calibration_session,
                                                                                 grad=True)
    # each layer call then also hooks its graph node for the backward span: microseconds more
    assert recording[Level.LAYER].parent_ns > plain[Level.LAYER].parent_ns + 500


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_what_autograd_does_in_a_call_is_found_by_tracing_one():
    from xsp.session.leveled import Autograd, autograd_of

    model, x = _small_model(), torch.randn(4, 8)

    def no_grad() -> None:
        with torch.no_grad():
            model(x)

    def train() -> None:
        model(x).sum().backward()

    assert autograd_of(no_grad) == Autograd(records=False, runs_backward=False)
    assert autograd_of(lambda: model(x)) == Autograd(records=True, runs_backward=False)
    assert autograd_of(train) == Autograd(records=True, runs_backward=True)


@pytest.mark.parametrize("backward", [True, False])
def test_a_session_without_backward_hooks_records_no_layer_backward(backward):
    model, x = _small_model(), torch.randn(4, 8)
    with xsp.trace(levels="model,layer", output=None, backward=backward) as session:
        model(x).sum().backward()
    spans = session.trace.spans
    layer_backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == SpanKind.BACKWARD.value)]
    assert (len(layer_backward) > 0) is backward
    assert (spans[col.LEVEL] == "layer").sum() >= 3  # the forward layers are there either way


@pytest.mark.heavy
def test_leveled_inference_without_no_grad_hooks_no_backward_but_training_does():
    model, x = _small_model(), torch.randn(4, 8)
    inference = xsp.leveled(lambda: model(x), levels=("model", "layer"), rounds=1, repeat=2)
    training = xsp.leveled(lambda: model(x).sum().backward(), levels=("model", "layer"), rounds=1, repeat=2)
    for result, hooked in ((inference, False), (training, True)):
        spans = result.trace.spans
        layer_backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == SpanKind.BACKWARD.value)]
        assert (len(layer_backward) > 0) is hooked
        details = result.trace.metadata["leveled"]
        assert details["records_autograd"] is True and details["backward_hooks"] is hooked


def test_leveled_inference_without_no_grad_registers_no_backward_hook(monkeypatch):
    from xsp.tracers.module_calls import interceptor as _module_calls

    hooked = []
    make_hooks = _module_calls.backward_hooks

    def counting(recording, *more):  # type: ignore[no-untyped-def]
        hook = make_hooks(recording, *more)

        def counted(*args):  # type: ignore[no-untyped-def]
            hooked.append(args[2])
            return hook(*args)

        return counted

    monkeypatch.setattr(_module_calls, "backward_hooks", counting)
    model, x = _small_model(), torch.randn(4, 8)
    xsp.leveled(lambda: model(x), levels=("model", "layer"), rounds=1, repeat=2)
    assert hooked == []
    with xsp.trace(levels="model,layer", output=None):  # a plain session hooks them, as it cannot know
        model(x)
    assert len(hooked) == 4  # the three layers and the Sequential around them


def test_a_figure_that_moves_between_rounds_is_not_called_precise():
    """Each round's steps agree closely, but the rounds do not (the machine ran at another speed
    in each run): the interval comes from the spread of the rounds, not of the steps."""
    from xsp.session.leveled_merge import ROUND_STARTS, pooled

    def rounds(levels: tuple[Level, ...], shifts: list[int]) -> LeveledRun:
        traces = []
        for shift in shifts:
            steady = [100 + shift + (i % 2) for i in range(6)]
            traces.append(_run(levels, {STEP: [1200 + shift] * 6, PREDICT: [1000 + 10 * shift + (i % 2) for i in
                                                                                range(6)], A: steady,
                                        B: [30] * 6}).trace)
        trace = pooled(traces)
        assert trace.metadata[ROUND_STARTS] == [0, 6, 12]
        return LeveledRun(levels, trace)

    result = merge_runs([rounds((M,), [0, 8, -8]), rounds((M, L), [0, 8, -8])], target=0.02)
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_CI_NS] >= 10  # about t(2) x 8 / sqrt(3); the steps alone say 1
    assert spans.loc[B, col.DURATION_CI_NS] == 0
    model = result.overhead.set_index("run").loc["model"]
    # the steps' latencies are 1192, 1200 and 1208 ns by round: t(2) x 8 ns / sqrt(3)
    assert model["model_latency_ci_ms"] == pytest.approx(4.303 * 8 / 3 ** 0.5 * 1e-6, rel=0.01)
    assert not precise_enough(result, 0.02)
    assert ROUND_STARTS not in result.trace.metadata
    steady = merge_runs([rounds((M,), [0, 0, 0]), rounds((M, L), [0, 0, 0])], target=0.02)
    assert steady.trace.spans.set_index(col.PATH).loc[A, col.DURATION_CI_NS] <= 2


def test_a_round_disturbed_from_end_to_end_moves_no_figure():
    """Another process's burst lasting a whole run (seconds, on a big model) slows every step
    of one round: the figures come from the middle rounds, not from the pooled steps."""
    from xsp.session.leveled_merge import pooled

    def rounds(levels: tuple[Level, ...], slowdowns: list[float]) -> LeveledRun:
        traces = [_run(levels, {STEP: [int(1200 * s)] * 6, PREDICT: [int(1000 * s) + (i % 2) for i in range(6)],
                                A: [int(100 * s) + (i % 2) for i in range(6)], B: [30] * 6}).trace
                  for s in slowdowns]
        return LeveledRun(levels, pooled(traces))

    disturbed = merge_runs([rounds((M,), [1.0, 2.0, 1.0]), rounds((M, L), [1.0, 1.0, 2.5])])
    spans = disturbed.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_NS] == pytest.approx(100, abs=1)
    assert spans.loc[PREDICT, col.DURATION_NS] == pytest.approx(1000, abs=1)
    assert disturbed.overhead.set_index("run").loc["model", "model_latency_ms"] == pytest.approx(1200e-6, rel=0.01)
    # with two rounds there is no middle: the steps are pooled
    two = merge_runs([rounds((M,), [1.0, 2.0]), rounds((M, L), [1.0, 1.0])])
    assert two.trace.spans.set_index(col.PATH).loc[PREDICT, col.DURATION_NS] == pytest.approx(1500, abs=2)


def _with_depths(run: LeveledRun, layer_depth: int | None = None) -> LeveledRun:
    """``run`` with each layer's module call depth (1: the model's own calls), as the layer
    level records it, and the depth its run recorded down to."""
    spans = run.trace.spans.copy()
    layer = spans[col.LEVEL] == Level.LAYER.value
    spans[col.CALL_DEPTH] = pd.array([path.count("/") - 1 if is_layer else None
                                      for path, is_layer in zip(spans[col.PATH], layer)], dtype="Int64")
    return LeveledRun(run.levels, xsp.Trace(spans=spans, metadata=run.trace.metadata), layer_depth)


def _depth_runs() -> list[LeveledRun]:
    """A model-only run, a run of the depth-1 layers a and b only, and a run of every depth
    (c inside a): a's figure differs between them by what recording c cost."""
    return [_with_depths(_run((M,), {STEP: [1000] * 5, PREDICT: [900] * 5})),
            _with_depths(_run((M, L), {STEP: [1100] * 5, PREDICT: [1000] * 5, A: [420] * 5, B: [40] * 5}), 1),
            _with_depths(_run((M, L), {STEP: [1200] * 5, PREDICT: [1100] * 5, A: [500] * 5, NESTED: [100] * 5,
                                       B: [45] * 5}))]


def test_by_depth_each_layer_takes_its_time_from_the_run_of_its_own_depth():
    result = merge_runs(_depth_runs())
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_NS] == 420 and spans.loc[A, col.LEVELED_RUN] == "model+layer<=1"
    assert spans.loc[B, col.DURATION_NS] == 40 and spans.loc[B, col.LEVELED_RUN] == "model+layer<=1"
    assert spans.loc[NESTED, col.DURATION_NS] == 100 and spans.loc[NESTED, col.LEVELED_RUN] == "model+layer"
    assert spans.loc[PREDICT, col.LEVELED_RUN] == "model"
    details = result.trace.metadata["leveled"]
    assert details["by_depth"] is True and details["layer_depths"] == 2
    assert details["runs"] == ["model", "model+layer<=1", "model+layer"]
    # without depth runs, a's time is the every-depth run's
    flat = merge_runs([_depth_runs()[0], _depth_runs()[2]]).trace.spans.set_index(col.PATH)
    assert flat.loc[A, col.DURATION_NS] == 500 and flat.loc[A, col.LEVELED_RUN] == "model+layer"


def test_by_depth_only_what_is_inside_a_spans_own_clock_readings_is_compensated():
    costs = {Level.MODEL: LevelCost("model", inside_ns=50, parent_ns=120, events=1, nested_ns=10),
             Level.LAYER: LevelCost("layer", inside_ns=30, parent_ns=70, events=1, untimed_ns=5)}
    spans = merge_runs(_depth_runs(), costs=costs).trace.spans.set_index(col.PATH)
    # a recorded no layer below it in its own run: nothing of c's recording is taken out of it
    assert spans.loc[A, col.OVERHEAD_NS] == 30 - 5 and spans.loc[A, col.DURATION_NS] == 420 - 25
    assert spans.loc[NESTED, col.DURATION_NS] == 100 - 25
    # the model call: its own recording only, no pass-through estimate for the calls inside it
    assert spans.loc[PREDICT, col.DURATION_NS] == 900 - 50


def _steady_trace(latency_ns: int, wobble_ns: int, steps: int = 8) -> xsp.Trace:
    """A run's measured steps: model latencies alternating ``latency_ns`` ± ``wobble_ns``."""
    figures = [latency_ns + (wobble_ns if i % 2 else -wobble_ns) for i in range(steps)]
    return _run((M,), {STEP: [f + 50 for f in figures], PREDICT: figures}).trace


def test_a_run_hit_by_a_burst_of_noise_is_run_again_and_said():
    from xsp.session.leveled_rounds import RoundsLog, run_rounds, step_spread

    calls: list[str] = []
    plan = [RunPlan((M,)), RunPlan((M, L), 1), RunPlan((M, L))]

    def run(entry: RunPlan) -> xsp.Trace:
        calls.append(entry.label)
        burst = len(calls) == 5  # the fifth run's steps spread 40 times wider than the others'
        return _steady_trace(10_000, 2_000 if burst else 50)

    def merge(traces: dict[RunPlan, list[xsp.Trace]]) -> object:
        return {entry.label: len(found) for entry, found in traces.items()}

    log = RoundsLog()
    result, rounds = run_rounds(plan, run, merge, rounds=2, budget_s=60, log=log)  # type: ignore[arg-type]
    assert rounds == 2 and result == {"model": 2, "model+layer<=1": 2, "model+layer": 2}
    assert len(calls) == 7 and calls[4] == calls[5]  # the burst's run, once more
    assert [burst["run"] for burst in log.bursts] == [calls[4]] and log.bursts[0]["round"] == 2
    assert log.bursts[0]["spread"] > 4 * log.bursts[0]["typical"]
    assert step_spread(_steady_trace(10_000, 50)) < 0.02
    # no budget left: the burst is kept, not run again
    calls.clear()
    spent = RoundsLog()
    run_rounds(plan, run, merge, rounds=2, budget_s=0, log=spent)  # type: ignore[arg-type]
    assert len(calls) == 6 and spent.bursts == []


def test_progress_says_the_run_the_round_and_the_time_left_from_the_runs_so_far(monkeypatch):
    """Each run's line: its round and place, and the time left, the runs so far's mean duration
    times the runs still to come (this one included). On a clock where each run takes 2 s, the
    estimate is the time the rounds then still take."""
    import time

    from xsp.session.leveled_rounds import RoundsLog, RunProgress, run_rounds

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    plan = [RunPlan((M,)), RunPlan((M, L))]
    heard: list[RunProgress] = []

    def run(entry: RunPlan) -> xsp.Trace:
        now[0] += 2.0
        return _steady_trace(10_000, 50)

    run_rounds(plan, run, lambda traces: None, rounds=3, budget_s=60, log=RoundsLog(),  # type: ignore[arg-type,return-value]
               progress=heard.append)
    assert [(p.round_number, p.run_number) for p in heard] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert [p.seconds_left for p in heard] == [None, 10.0, 8.0, 6.0, 4.0, 2.0]
    assert heard[1].text() == "leveled round 1 of 3, run 2 of 2: model+layer; about 10 s left"
    import dataclasses

    almost_done = dataclasses.replace(heard[1], seconds_left=0.2)
    assert almost_done.text().endswith("model+layer; under 1 s left")  # it said "about under 1 s"


def test_the_budget_is_respected_and_what_it_cut_is_said():
    import time

    from xsp.session.leveled_rounds import MIN_ROUNDS, RoundsLog, default_budget_s, run_rounds

    plan = [RunPlan((M,)), RunPlan((M, L))]

    def run(entry: RunPlan) -> xsp.Trace:
        time.sleep(0.01)
        return _steady_trace(10_000, 50)

    log = RoundsLog()
    _, rounds = run_rounds(plan, run, lambda traces: None, budget_s=0.0, log=log)  # type: ignore[arg-type,return-value]
    assert rounds < MIN_ROUNDS and log.given_up and log.given_up[0].startswith("rounds: ")
    assert default_budget_s(plan) == 2.0  # one second per run of a round


@pytest.mark.parametrize("by_depth", [pytest.param(True, marks=pytest.mark.heavy), False])
def test_leveled_by_depth_on_a_real_nested_model(by_depth):
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)])
    said: list[str] = []
    with torch.no_grad():
        result = xsp.leveled(lambda: model(torch.randn(2, 8)), levels="model,layer", repeat=3, warmup=1, rounds=2,
                             by_depth=by_depth, progress=said.append)
    details = result.trace.metadata["leveled"]
    runs = ["model", "model+layer<=1", "model+layer"] if by_depth else ["model", "model+layer"]
    assert result.overhead["run"].tolist() == runs and details["runs_per_round"] == len(runs)
    assert said[0] == ("leveled: a first run to find the model's depth" if by_depth
                       else "leveled: a first run to find what autograd does")
    assert said[1] == (f"leveled: the model's module calls nest 2 deep: 3 runs a round ({', '.join(runs)})"
                       if by_depth else f"leveled: 2 runs a round ({', '.join(runs)})")
    assert said[2].startswith("leveled round 1 of 2, run 1 of ")
    assert said[-1].startswith("leveled: 2 rounds in ")
    spans = result.trace.spans
    top = spans[(spans[col.LEVEL] == "layer") & (spans[col.CALL_DEPTH] == 1)]
    inner = spans[(spans[col.LEVEL] == "layer") & (spans[col.CALL_DEPTH] == 2)]
    assert len(top) == 3 and len(inner) == 6
    assert set(top[col.LEVELED_RUN]) == {"model+layer<=1" if by_depth else "model+layer"}
    assert set(inner[col.LEVELED_RUN]) == {"model+layer"}
    assert top[col.DURATION_CI_NS].notna().all()
    assert details["precise"] == (details["why_imprecise"] is None)


@pytest.mark.heavy
def test_the_report_of_a_leveled_trace_shows_each_layers_interval_and_the_top_level_check():
    import io

    from rich.console import Console

    from xsp.reports.terminal import render_report

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3)])
    with torch.no_grad():
        result = xsp.leveled(lambda: model(torch.randn(2, 8)), levels="model,layer", repeat=3, warmup=1, rounds=2)
    shown = io.StringIO()
    render_report(result.trace, Console(file=shown, width=80, color_system=None), top=5)
    text = shown.getvalue()
    assert "Layers leveled by module depth: 2 depths, 3 runs a round" in text
    assert "Top-level layers add up to" in text and "off the model-only latency" in text
    top_table = text.split("Top 5 layers by self time")[1].split("Time per layer type")[0]
    assert "95%" in top_table and max(map(len, text.splitlines())) <= 80
    plain = xsp.Trace(spans=result.trace.spans.drop(columns=[col.DURATION_CI_NS]).assign(
        **{col.DURATION_CI_NS: pd.array([None] * len(result.trace.spans), dtype="Int64")}), metadata={})
    shown = io.StringIO()
    render_report(plain, Console(file=shown, width=80, color_system=None), top=5)
    assert "95%" not in shown.getvalue().split("Top 5 layers by self time")[1]


def _on_host(run: LeveledRun, device_paths: tuple[str, ...] = ()) -> LeveledRun:
    """``run`` with its spans on a host thread, but for ``device_paths`` (GPU activities)."""
    spans = run.trace.spans.copy()
    spans[col.THREAD_ID] = pd.array([None if path in device_paths else 1 for path in spans[col.PATH]], dtype="Int64")
    return LeveledRun(run.levels, xsp.Trace(spans=spans, metadata=run.trace.metadata), run.layer_depth)


def test_host_figures_are_taken_at_the_model_only_runs_speed():
    """The machine ran some steps of the layer run 1.8x slower (a virtual machine's speed
    jumps for tens of milliseconds): each host span's figure is its share of its own step times
    the model-only run's step, so the layers still add up to the model call; a GPU activity,
    which the host's speed does not time, keeps its own figure."""
    speeds = [1.0, 1.8, 1.8, 1.0, 1.8, 1.8]
    model_only = _on_host(_run((M,), {STEP: [1200] * 6, PREDICT: [1000] * 6}))
    layers = _on_host(_run((M, L), {STEP: [int(1200 * s) for s in speeds], PREDICT: [int(1000 * s) for s in speeds],
                                    A: [int(600 * s) for s in speeds], B: [int(300 * s) for s in speeds]}),
                      device_paths=(B,))
    result = merge_runs([model_only, layers])
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_NS] == pytest.approx(600, abs=1)
    assert spans.loc[PREDICT, col.DURATION_NS] == pytest.approx(1000, abs=1)
    own = trimmed_mean(np.array([300 * s for s in speeds]), 0.2)
    assert spans.loc[B, col.DURATION_NS] == pytest.approx(own, abs=1)
    assert result.trace.metadata["leveled"]["step_speed"]["reference_step_ms"] == pytest.approx(1200e-6)
    pooled_as_recorded = merge_runs([model_only, layers], normalize_speed=False).trace.spans.set_index(col.PATH)
    assert pooled_as_recorded.loc[A, col.DURATION_NS] > 900
    assert merge_runs([model_only, layers], normalize_speed=False).trace.metadata["leveled"]["step_speed"] is None


def test_what_tracing_adds_to_a_step_is_measured_against_the_model_only_run():
    """In a real model a layer span costs its parent about twice the calibrated floor (colder
    caches): the layer run's steps are taken as they would be untraced by comparing them with the
    model-only run's, not by taking the calibrated cost out, so the layers add up to the model
    call however wrong the calibration is."""
    costs = {L: LevelCost("layer", inside_ns=0, parent_ns=10, events=1)}  # far under the real 50
    model_only = _on_host(_run((M,), {STEP: [1000] * 6, PREDICT: [980] * 6}))
    layers = _on_host(_run((M, L), {STEP: [1100] * 6, PREDICT: [1080] * 6, A: [600] * 6, B: [380] * 6}))
    result = merge_runs([model_only, layers], costs=costs)
    spans = result.trace.spans.set_index(col.PATH)
    assert spans.loc[A, col.DURATION_NS] + spans.loc[B, col.DURATION_NS] == pytest.approx(
        spans.loc[PREDICT, col.DURATION_NS], abs=2)
    assert result.trace.metadata["leveled"]["step_speed"]["inflation"]["model+layer"] == pytest.approx(1.1)


def test_what_tracing_adds_is_compared_round_by_round():
    """The runs of one round ran back to back: a round in which one run met a slow machine and
    the other a fast one is outvoted by the others, where the pooled steps' fastest would have
    compared the model-only run's fast round with the layer run's ordinary ones."""
    from xsp.session.leveled_merge import pooled

    def rounds(levels: tuple[Level, ...], steps: list[int], share: float) -> LeveledRun:
        return _on_host(LeveledRun(levels, pooled([_run(levels, {STEP: [length] * 4, PREDICT: [length] * 4,
                                                                 A: [int(length * share)] * 4}).trace
                                                   for length in steps])))

    result = merge_runs([rounds((M,), [1000, 900, 1000], 0.0), rounds((M, L), [1100, 2000, 1100], 0.5)])
    assert result.trace.metadata["leveled"]["step_speed"]["inflation"]["model+layer"] == pytest.approx(1.1)


def test_costs_calibrated_at_the_machines_fastest_are_scaled_to_the_reference_speed():
    """The layer cost comes from the calibration's fastest moment; the figures are at the
    model-only run's typical speed, here 1.5x slower than its fastest steps."""
    costs = {L: LevelCost("layer", inside_ns=0, parent_ns=20, events=1, untimed_ns=10, fastest=True)}
    model_only = _on_host(_run((M,), {STEP: [1000, 1000, 1500, 1500, 1500, 1500, 1500, 2000, 2000, 2000],
                                      PREDICT: [900] * 10}))
    layers = _on_host(_run((M, L), {STEP: [1000] * 10, PREDICT: [900] * 10, A: [500] * 10}))
    result = merge_runs([model_only, layers], costs=costs)
    speed = result.trace.metadata["leveled"]["step_speed"]
    assert speed["slowdown"] == pytest.approx(speed["reference_step_ms"] / 1000e-6)
    assert result.trace.spans.set_index(col.PATH).loc[A, col.OVERHEAD_NS] == round(-10 * speed["slowdown"])
    unscaled = LevelCost("layer", inside_ns=0, parent_ns=20, events=1, untimed_ns=10)
    assert unscaled.scaled(2.0).untimed_ns == 20 and unscaled.scaled(2.0).parent_ns == 40


def test_the_reference_steps_own_spread_widens_every_host_interval():
    """A share measured precisely is no more precise than the step that sets its scale."""
    model_only = _on_host(_run((M,), {STEP: [1000, 1400] * 4, PREDICT: [800, 1120] * 4}))
    layers = _on_host(_run((M, L), {STEP: [1000] * 8, PREDICT: [800] * 8, A: [400] * 8, B: [200] * 8}))
    spans = merge_runs([model_only, layers]).trace.spans.set_index(col.PATH)
    reference = np.array([1000, 1400] * 4, dtype=float)
    relative = trimmed_mean_ci(reference, 0.2) / trimmed_mean(reference, 0.2)
    assert spans.loc[A, col.DURATION_CI_NS] == pytest.approx(spans.loc[A, col.DURATION_NS] * relative, rel=0.01)


def test_steps_without_a_root_to_measure_by_are_pooled_as_recorded():
    """A model call is its step's root where no step span is; a step of layers alone has none."""
    model_only = _on_host(_run((M,), {PREDICT: [1000] * 4}))
    by_model_call = merge_runs([model_only, _on_host(_run((M, L), {PREDICT: [1000, 2000] * 2, A: [500, 1000] * 2}))])
    assert by_model_call.trace.spans.set_index(col.PATH).loc[A, col.DURATION_NS] == pytest.approx(500, abs=1)
    rootless = merge_runs([model_only, _on_host(_run((M, L), {A: [500, 1000] * 2, B: [100] * 4}))])
    assert rootless.trace.metadata["leveled"]["step_speed"] is None
    assert rootless.trace.spans.set_index(col.PATH).loc[A, col.DURATION_NS] == 750
