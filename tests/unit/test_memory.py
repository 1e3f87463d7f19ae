"""The memory level: allocation events from PyTorch's profiler, per layer (XSP's layer memory
analysis), by layer type, and the timeline; on constructed events and on a real model."""

from __future__ import annotations

import pytest
import torch

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp import analysis
from xsp.core import schema as col


def constructed():
    """Step 0: model call M (0..100) > layer A (10..50) > layer B (20..40). Events:
    12 alloc 100 (A), 25 alloc 300 (B), 30 free 300 (B), 35 alloc 50 (B), 45 free 100 (A),
    60 alloc 7 on cuda:0 (M), 70 alloc 1000 (M)."""
    rows = [
        (1, None, "model", "step", "s", 0, 110, {}),
        (2, 1, "model", "predict", "M", 0, 100, {col.MODULE_TYPE: "Net"}),
        (3, 2, "layer", "forward", "A", 10, 50, {col.MODULE_TYPE: "Block"}),
        (4, 3, "layer", "forward", "B", 20, 40, {col.MODULE_TYPE: "Linear"}),
    ]
    events = [(12, "alloc", 100, 3), (25, "alloc", 300, 4), (30, "free", 300, 4), (35, "alloc", 50, 4),
              (45, "free", 100, 3), (60, "alloc", 7, 2), (70, "alloc", 1000, 2)]
    for i, (at, kind, size, parent) in enumerate(events):
        extra = {col.BYTES: size}
        rows.append((10 + i, parent, "memory", kind, kind, at, at, extra))
    trace = make_trace(rows)
    spans = trace.spans
    cuda = spans[col.START_NS] == 60_000
    spans.loc[cuda, col.DEVICE_ID] = 0
    return trace


def test_each_layer_gets_what_it_and_its_sublayers_allocated_freed_and_peaked():
    table = analysis.layer_memory(constructed()).set_index(["name", "device"])
    b, a, m = table.loc[("B", "cpu")], table.loc[("A", "cpu")], table.loc[("M", "cpu")]
    assert (b["allocations"], b["allocated_bytes"], b["freed_bytes"], b["net_bytes"]) == (2, 350, 300, 50)
    assert b["peak_bytes"] == 300  # 100 was live when B began: it held at most 400
    assert (a["allocated_bytes"], a["freed_bytes"], a["net_bytes"], a["peak_bytes"]) == (450, 400, 50, 400)
    assert (m["allocated_bytes"], m["net_bytes"], m["peak_bytes"]) == (1450, 1050, 1050)
    assert table.loc[("M", "cuda:0"), "allocated_bytes"] == 7 and ("A", "cuda:0") not in table.index
    assert m["kind"] == "predict" and b["module_type"] == "Linear"


def test_memory_by_layer_type_and_the_timeline():
    trace = constructed()
    by_type = analysis.memory_by_layer_type(trace)
    assert by_type["module_type"].tolist() == ["Block", "Linear"]  # forward layers, most allocated first
    assert by_type["allocated_bytes"].tolist() == [450, 350]
    timeline = analysis.memory_timeline(trace)
    cpu = timeline[timeline["device"] == "cpu"]
    assert cpu["live_bytes"].tolist() == [100, 400, 100, 150, 50, 1050]
    assert timeline[timeline["device"] == "cuda:0"]["live_bytes"].tolist() == [7]


def test_without_the_memory_level_the_tables_are_empty_with_their_columns():
    trace = make_trace([(1, None, "model", "step", "s", 0, 10, {})])
    for function, columns in ((analysis.layer_memory, analysis.memory.LAYER_COLUMNS),
                              (analysis.memory_by_layer_type, analysis.memory.TYPE_COLUMNS),
                              (analysis.memory_timeline, analysis.memory.EVENT_COLUMNS)):
        found = function(trace)
        assert found.empty and list(found.columns) == columns


@pytest.mark.parametrize("levels", ["model,layer,memory", "model,layer,operator,memory"])
def test_a_real_model_allocates_its_activations_in_its_layers(levels):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    with xsp.trace(levels=levels, output=None) as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 64))
    assert session.warnings == []
    spans = session.trace.spans
    assert (spans[col.LEVEL] == "operator").any() == ("operator" in levels)
    table = analysis.layer_memory(session.trace)
    first = table[(table["step"] == 0) & (table["kind"] == "forward")].set_index("name")
    # each layer's output: 32 x 256 (or 32 x 10) float32
    assert first.loc["model.0", "allocated_bytes"] >= 32 * 256 * 4
    assert first.loc["model.1", "allocated_bytes"] >= 32 * 256 * 4
    assert first.loc["model.2", "allocated_bytes"] >= 32 * 10 * 4
    assert (table.groupby("name")["allocated_bytes"].nunique() == 1).all()  # the same every step
    memory = spans[spans[col.LEVEL] == "memory"]
    assert set(memory[col.KIND]) <= {"alloc", "free"} and memory[col.DEVICE_ID].isna().all()
    assert (memory[col.DURATION_NS] == 0).all()
