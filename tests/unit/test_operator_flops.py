"""The operator and flops levels on small real models, and their pure parts on made-up events."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

import xsp
from xsp.analysis import backward_attribution, backward_time_per_layer, layer_flops, model_flops, operator_table
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import nearest_ancestor, of_level, parent_positions
from xsp.tracers.flops import NORM_FLOPS_PER_ELEMENT, count_call
from xsp.tracers.operator_profiler import CLOCK_MARKER, THREAD_MARKER, clock_offset, operator_rows


class Event:
    """Quacks like PyTorch's ``_KinetoEvent``."""

    def __init__(self, name: str, start: int, duration: int, thread: int = 1, sequence: int = -1,
                 shapes: list | None = None, dtypes: list | None = None, annotation: bool = False,
                 forward_thread: int = 0) -> None:
        self._values = dict(name=name, start_ns=start, duration_ns=duration, start_thread_id=thread,
                            sequence_nr=sequence, shapes=shapes or [], dtypes=dtypes or [],
                            is_user_annotation=annotation, fwd_thread_id=forward_thread, device_type="DeviceType.CPU")

    def __getattr__(self, name: str):
        return lambda: self._values[name]


def test_profiler_events_become_operator_spans_on_xsp_clock_and_threads():
    offset = 1_700_000_000_000_000_000
    brackets = [(1_000, 1_400), (2_000, 2_100)]  # the second is tighter
    events = [
        Event(CLOCK_MARKER, offset + 1_150, 10, annotation=True),
        Event(CLOCK_MARKER, offset + 2_060, 10, annotation=True),  # 10 ns after the bracket's middle
        Event(f"{THREAD_MARKER}4242", offset + 2_500, 5, annotation=True),
        Event("aten::linear", offset + 10_000, 5_000, sequence=7, shapes=[[2, 4], [3, 4]],
              dtypes=["float", "float"]),
        Event("aten::addmm", offset + 11_000, 3_000, sequence=8),
        Event("AddmmBackward0", offset + 30_000, 2_000, thread=2, sequence=8, forward_thread=1),
        Event("Optimizer.step#SGD.step", offset + 40_000, 4_000, annotation=True),
        Event("my_region", offset + 50_000, 1_000, annotation=True),
    ]
    rows, facts = operator_rows(events, brackets)
    # markers (1150, 1160) in (1000, 1400) and (2060, 2070) in (2000, 2100): offset in [-30, 60]
    assert facts["profiler_to_host_offset_ns"] == offset + 15 and facts["uncertainty_ns"] == 45
    # the optimizer's annotation is left out: the model level records optimizer steps itself
    assert rows[col.NAME].tolist() == ["aten::linear", "aten::addmm", "AddmmBackward0", "my_region"]
    assert rows[col.START_NS].tolist()[:2] == [9_985, 10_985] and rows[col.END_NS].tolist()[0] == 14_985
    assert rows[col.THREAD_ID].tolist() == [4242, 4242, -2, 4242]  # thread 2 left no marker
    assert rows[col.LEVEL].tolist() == ["operator"] * 4
    assert rows[col.KIND].tolist() == ["operator", "operator", "operator", "user"]
    assert json.loads(rows[col.INPUT_SHAPES].iloc[0]) == [[2, 4], [3, 4]]
    assert rows[col.SEQUENCE_NUMBER].tolist()[:3] == [7, 8, 8]
    assert json.loads(rows[col.ATTRIBUTES].iloc[2]) == {"forward_thread_id": 4242}


def test_the_clock_offset_is_where_every_marker_fits_its_bracket():
    assert clock_offset([(150, 160), (1_060, 1_070)], [(0, 400), (1_000, 1_100)]) == (15, 45)
    # brackets no single offset satisfies (a clock stepped): the tightest bracket's midpoints
    assert clock_offset([(100, 110), (1_000, 1_010)], [(0, 20), (990, 1_000)]) == (10, 5)


def _train(levels: str, steps: int = 2):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with xsp.trace(levels=levels, output=None) as session:
        for _ in range(steps):
            with xsp.step("train"):
                loss = model(torch.randn(4, 8)).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    return session.trace


@pytest.fixture(scope="module")
def trained():
    return _train("model,layer,operator")


def test_operators_nest_under_their_layers_and_inside_each_other(trained):
    spans = trained.spans
    parents = parent_positions(spans)
    names = spans[col.NAME].to_numpy()
    addmm = np.flatnonzero((names == "aten::addmm") & (spans[col.LEVEL] == "operator").to_numpy())
    assert len(addmm) == 2 * 2  # two Linear layers, two steps (forward only: backward uses mm)
    assert set(names[parents[addmm]]) == {"aten::linear"}  # nested operators keep their nesting
    layer = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)[addmm]
    assert sorted(set(names[layer])) == ["model.0", "model.2"]
    assert set(spans[col.THREAD_ID].to_numpy()[addmm]) == {threading.get_native_id()}
    assert spans[col.STEP].to_numpy()[addmm].tolist() == [0, 0, 1, 1]
    assert abs(trained.metadata["tracer_details"]["operator"]["uncertainty_ns"]) < 1_000_000


def test_backward_layer_spans_add_no_operators_and_cut_none(trained):
    spans = trained.spans
    assert not spans[col.NAME].str.contains("BackwardHook").any()  # node hooks run no operator
    assert trained.metadata["hierarchy"]["overlapping"] == 0


def test_the_optimizer_step_is_a_span_of_its_own(trained):
    spans = trained.spans
    optimizer = spans[spans[col.KIND] == SpanKind.OPTIMIZER.value]
    assert len(optimizer) == 2 and set(optimizer[col.LEVEL]) == {Level.MODEL.value}
    assert optimizer[col.PATH].tolist() == ["train[0]/SGD.step[0]"] * 2
    assert not spans[col.NAME].str.startswith("Optimizer.step#").any()  # PyTorch's annotation of the same
    parents = parent_positions(spans)
    inside = np.flatnonzero((spans[col.NAME] == "aten::add_").to_numpy())
    assert len(inside) and set(spans[col.KIND].to_numpy()[parents[inside]]) <= {SpanKind.OPTIMIZER.value}


def test_backward_operators_are_attributed_to_the_forward_layer_that_made_them(trained):
    table = backward_attribution(trained)
    addmm_backward = table[table["name"] == "AddmmBackward0"]
    assert len(addmm_backward) == 4
    assert set(addmm_backward["forward_operator"]) == {"aten::addmm"}
    assert sorted(addmm_backward["forward_layer"]) == ["model.0", "model.0", "model.2", "model.2"]
    layers = table[table["kind"] == "layer"]
    assert set(layers["forward_layer"]) >= {"model.0", "model.1", "model.2"}
    per_layer = backward_time_per_layer(trained).set_index("forward_layer")
    assert per_layer.loc["model.0", "backward_operators"] >= 2 and per_layer.loc["model.2", "backward_operator_us"] > 0
    ops = operator_table(trained)
    assert ops["share"].sum() == pytest.approx(1.0)
    assert (ops["self_us"] <= ops["total_us"] + 1e-9).all()


def test_flops_level_counts_linear_layers_exactly_and_rolls_up():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).eval()
    with xsp.trace(levels="model,layer,flops", output=None) as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 64))
    trace = session.trace
    ops = trace.spans[trace.spans[col.LEVEL] == Level.FLOPS.value]
    assert set(ops[col.KIND]) == {SpanKind.OPERATOR.value}
    per_layer = layer_flops(trace).set_index("name")
    assert per_layer.loc["model.0", "flops_per_call"] == 2 * 32 * 64 * 128
    assert per_layer.loc["model.2", "flops_per_call"] == 2 * 32 * 128 * 10
    assert per_layer.loc["model.1", "flops_per_call"] == 32 * 128  # relu: one per element
    assert per_layer.loc["model.0", "bytes"] == 3 * 4 * (128 + 32 * 64 + 64 * 128 + 32 * 128)  # bias, x, W, out
    steps = model_flops(trace)
    assert steps["flops"].tolist() == [2 * 32 * 64 * 128 + 32 * 128 + 2 * 32 * 128 * 10] * 3


def test_flops_formulas_for_convolution_attention_norms_and_views():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {}

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name, flops, moved = count_call(func, args, kwargs or {}, out)
            seen.setdefault(name, (flops, moved))
            return out

    x = torch.randn(2, 3, 16, 16)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with Spy():
        with torch.no_grad():
            conv(x)
            torch.nn.functional.layer_norm(torch.randn(4, 32), (32,))
            torch.randn(4, 4).t()
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    assert seen["aten::convolution"][0] == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)
    assert seen["aten::native_layer_norm"][0] == NORM_FLOPS_PER_ELEMENT * 4 * 32
    forward = [flops for name, (flops, _) in seen.items() if "attention" in name and "backward" not in name]
    backward = [flops for name, (flops, _) in seen.items() if "attention" in name and "backward" in name]
    assert forward == [4 * 1 * 2 * 8 * 8 * 16]  # two matmuls of 2*B*H*L*L*D
    assert backward == [2 * forward[0]]
    assert seen["aten::t"] == (0, 0)  # a view moves nothing


def test_flops_and_operator_levels_leave_nothing_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    _train("model,layer,operator,flops", steps=1)
    assert _get_current_dispatch_mode() is None
    assert not torch.autograd.profiler._is_profiler_enabled
