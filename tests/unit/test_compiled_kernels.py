"""Compiled kernels to the user's lines: inductor's provenance read (xsp.record.compiled_kernels)
and a fused kernel's time counted on the lines of the operators it fuses (xsp.analysis.lines),
on hand-made provenance and spans. The real compiler's: tests/integration/test_compiled_code.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pandas as pd
import pytest
import torch

import xsp
from xsp.analysis.lines import compiled_kernel_lines, lines
from xsp.core import schema as col
from xsp.record.compiled_kernels import (
    AMBIGUOUS_KEY,
    METADATA_KEY,
    kernel_name,
    kernel_sources,
    parse_stack_trace,
    sources_of_metrics,
)

MODEL_CODE = textwrap.dedent("""
    import torch


    class Net(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            z = torch.relu(y)
            return z.sum()
""")


def trace_text(*frames: tuple[str, int, str, str]) -> str:
    """A stack trace as inductor keeps one (Python's traceback format, a caret line under each)."""
    return "".join(f'  File "{file}", line {line}, in {function}\n    {code}\n    ^^^^\n'
                   for file, line, function, code in frames)


def test_a_stack_trace_is_read_as_frames_outermost_first():
    text = trace_text(("/a/net.py", 15, "forward", "x = self.block(x)"), ("/a/net.py", 9, "forward", "y = x * 2"))
    assert parse_stack_trace(text) == [("/a/net.py", 15, "forward", "x = self.block(x)"),
                                       ("/a/net.py", 9, "forward", "y = x * 2")]
    assert parse_stack_trace("no frames here") == []


def test_sources_keep_the_users_frames_by_qualified_name_and_drop_the_handle(tmp_path):
    model = tmp_path / "net.py"
    model.write_text(MODEL_CODE)
    library = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")
    provenance = {
        "cpp_fused_mul_relu_0:1": [trace_text((str(model), 8, "forward", "z = torch.relu(y)")),
                                   trace_text((str(model), 7, "forward", "y = x * 2"),
                                              (library, 1775, "_call_impl", "return forward_call(*args)"))],
        "cpp_fused_sum_1:2": [trace_text((library, 10, "inner", "pass"))],  # no user frame: no source
        "extern_kernels.addmm:3": [trace_text((str(model), 9, "forward", "return z.sum()"))],  # runs as aten::addmm
    }
    sources = sources_of_metrics([json.dumps(provenance), "not json"])
    assert sources == {"cpp_fused_mul_relu_0": [[(str(model), 8, "Net.forward", "z = torch.relu(y)")],
                                                [(str(model), 7, "Net.forward", "y = x * 2")]]}


def test_kernel_names_lose_inductors_graph_prefix():
    assert kernel_name("graph_0_cpp_fused_mul_relu_0") == "cpp_fused_mul_relu_0"
    assert kernel_name("triton_poi_fused_mul_relu_0") == "triton_poi_fused_mul_relu_0"
    assert kernel_name("aten::mul") == "aten::mul"


def compiled_trace(sources: dict) -> xsp.Trace:
    """A step: the compiled model's call on line 20 of the script, the compiled call inside it,
    and two generated kernels: one fusing lines 7 and 8, one on line 9 (40 and 30 ns)."""
    spans = pd.DataFrame({
        col.SPAN_ID: [1, 2, 3, 4], col.PARENT_ID: [None, 1, 2, 2],
        col.NAME: ["model", "Torch-Compiled Region: 0/0", "graph_0_cpp_fused_mul_relu_0", "graph_0_cpp_fused_sum_1"],
        col.LEVEL: ["model", "operator", "operator", "operator"],
        col.KIND: ["predict", "operator", "operator", "operator"],
        col.START_NS: [0, 10, 20, 60], col.END_NS: [100, 95, 60, 90], col.THREAD_ID: [1, 1, 1, 1],
        col.STEP: [0, 0, 0, 0], col.CALL_FILE: ["/a/run.py", "/a/run.py", "/a/run.py", "/a/run.py"],
        col.CALL_LINE: [20, 20, 20, 20], col.CALL_FUNCTION: ["main"] * 4, col.CORRELATION_ID: [None] * 4})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    metadata = {"tracer_details": {"operator": {METADATA_KEY: sources}}}
    return xsp.Trace(spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64", col.CALL_LINE: "Int64",
                                   col.CORRELATION_ID: "Int64"}), metadata)


SOURCES = {"cpp_fused_mul_relu_0": [[["/a/net.py", 8, "Net.forward", "z = torch.relu(y)"]],
                                    [["/a/net.py", 7, "Net.forward", "y = x * 2"]]],
           "cpp_fused_sum_1": [[["/a/net.py", 9, "Net.forward", "return z.sum()"]]]}


def test_a_fused_kernels_time_is_shared_by_the_lines_of_its_operators():
    found = lines(compiled_trace(SOURCES)).set_index("line")
    assert found.loc[7, "self_ms"] == pytest.approx(20 / 1e6) and found.loc[8, "self_ms"] == pytest.approx(20 / 1e6)
    assert found.loc[9, "self_ms"] == pytest.approx(30 / 1e6)
    assert found.loc[7, "function"] == "Net.forward" and found.loc[7, "file"] == "/a/net.py"
    assert found.loc[7, "calls"] == 1 and found.loc[7, "inclusive_ms"] == pytest.approx(20 / 1e6)
    # the calling line keeps the rest: the model's and the compiled region's own time, not the kernels'
    assert found.loc[20, "self_ms"] == pytest.approx((100 - 40 - 30) / 1e6)
    assert found.loc[20, "inclusive_ms"] == pytest.approx(100 / 1e6)
    assert found["self_ms"].sum() == pytest.approx(100 / 1e6)  # every nanosecond once


def compiled_steps(fused_ns: int, steps: int = 12) -> xsp.Trace:
    """``steps`` steps of :func:`compiled_trace`'s shape, in microseconds: the mul+relu kernel
    takes ``fused_ns`` (the sum kernel 30 µs)."""
    frames = []
    for step in range(steps):
        spans = compiled_trace(SOURCES).spans.copy()
        begin = step * 1_000_000
        spans[col.START_NS] = begin + spans[col.START_NS] * 1000
        spans[col.END_NS] = begin + spans[col.END_NS] * 1000
        spans.loc[2, col.END_NS] = spans.loc[2, col.START_NS] + fused_ns
        spans.loc[3, col.START_NS] = spans.loc[2, col.END_NS]
        spans.loc[3, col.END_NS] = spans.loc[3, col.START_NS] + 30_000
        spans.loc[[0, 1], col.END_NS] = spans.loc[3, col.END_NS] + 5_000
        spans[col.SPAN_ID] = spans[col.SPAN_ID] + 10 * step
        spans[col.PARENT_ID] = spans[col.PARENT_ID] + 10 * step
        spans[col.STEP] = step
        frames.append(spans)
    spans = pd.concat(frames, ignore_index=True)
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    return xsp.Trace(spans, {"tracer_details": {"operator": {METADATA_KEY: SOURCES}}})


def test_by_line_a_fused_kernels_time_is_a_key_of_each_of_its_lines():
    from xsp.gate.diff_columns import KEY, PARENT_KEY, TOTAL_NS, KeyBy
    from xsp.gate.key_samples import key_samples

    trace = compiled_steps(fused_ns=40_000, steps=1)
    keys = key_samples(trace.spans, KeyBy.LINE, kernel_sources=kernel_sources(trace.metadata)).set_index(KEY)
    assert keys.loc["net.py:7 Net.forward", TOTAL_NS] == keys.loc["net.py:8 Net.forward", TOTAL_NS] == 20_000
    assert keys.loc["net.py:9 Net.forward", TOTAL_NS] == 30_000
    assert set(keys.loc[["net.py:7 Net.forward", "net.py:9 Net.forward"], PARENT_KEY]) == {"run.py:20 main"}
    assert key_samples(trace.spans, KeyBy.LINE)[KEY].tolist() == ["run.py:20 main"]  # without the sources


def test_diff_by_line_finds_the_lines_of_a_fused_kernel_that_got_slower():
    result = xsp.diff(compiled_steps(fused_ns=40_000), compiled_steps(fused_ns=400_000), by="line",
                      machine_speed=False)
    verdicts = result.table.set_index("key")["verdict"].to_dict()
    assert verdicts["net.py:7 Net.forward"] == verdicts["net.py:8 Net.forward"] == "regressed"
    assert verdicts["net.py:9 Net.forward"] == "unchanged"


def test_the_report_says_why_known_sources_found_no_kernel_span():
    from rich.console import Console

    from xsp.reports.terminal import lines_table

    trace = compiled_trace({"cpp_fused_add_7": SOURCES["cpp_fused_sum_1"]})  # a kernel that never ran as a span
    console = Console(width=80, record=True, color_system=None)
    lines_table(trace, console, 10)
    said = " ".join(console.export_text().split())
    assert "1 compiled kernel with known source lines, but none ran as a span" in said
    assert "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1" in said
    console = Console(width=80, record=True, color_system=None)
    lines_table(compiled_trace(SOURCES), console, 10)
    assert "none ran as a span" not in console.export_text()


def test_without_provenance_a_kernel_stays_on_the_calling_line():
    found = lines(compiled_trace({})).set_index("line")
    assert list(found.index) == [20] and found.loc[20, "self_ms"] == pytest.approx(100 / 1e6)
    positions, codes, sites = compiled_kernel_lines(compiled_trace({}).spans, {})
    assert len(positions) == len(codes) == 0 and sites == []


def test_each_run_of_a_kernel_is_placed_on_each_of_its_lines():
    spans = compiled_trace(SOURCES).spans
    spans = pd.concat([spans, spans.iloc[[2]]], ignore_index=True)  # the fused kernel ran twice
    spans.loc[1, col.NAME] = None  # a span without a name is no kernel
    positions, codes, sites = compiled_kernel_lines(spans, kernel_sources(compiled_trace(SOURCES).metadata))
    placed = sorted((int(position), sites[code][1]) for position, code in zip(positions, codes))
    assert placed == [(2, 7.0), (2, 8.0), (3, 9.0), (4, 7.0), (4, 8.0)]


def test_damaged_sources_are_skipped_not_fatal():
    kept = SOURCES["cpp_fused_mul_relu_0"]
    damaged = {"tracer_details": {"operator": {METADATA_KEY: {"cpp_fused_sum_1": [[["/a/net.py", "x"]]],
                                                              "cpp_fused_mul_relu_0": kept}}}}
    assert set(kernel_sources(damaged)) == {"cpp_fused_mul_relu_0"}
    assert kernel_sources({}) == {}


class FakeCompile:
    """One of dynamo's compilation metrics: only the field xsp reads."""

    def __init__(self, provenance: dict) -> None:
        self.inductor_provenance = {json.dumps(provenance)}


def test_each_compile_is_read_once_and_a_name_two_compiles_disagree_on_is_ambiguous(tmp_path, monkeypatch):
    import types

    from xsp.tracers.compiled_kernels import DYNAMO_UTILS, CompiledKernels

    model = tmp_path / "net.py"
    model.write_text(MODEL_CODE)
    mul = trace_text((str(model), 7, "forward", "y = x * 2"))
    relu = trace_text((str(model), 8, "forward", "z = torch.relu(y)"))
    compiles = [FakeCompile({"cpp_fused_mul_0:1": [mul]})]
    monkeypatch.setitem(sys.modules, DYNAMO_UTILS, types.SimpleNamespace(get_compilation_metrics=lambda: compiles))
    kernels = CompiledKernels()
    kernels.read()
    kernels.read()  # the same compile again: nothing new, nothing ambiguous
    assert kernel_sources({"tracer_details": {"operator": kernels.details()}}) == {
        "cpp_fused_mul_0": [[(str(model), 7, "Net.forward", "y = x * 2")]]}
    compiles.append(FakeCompile({"cpp_fused_relu_1:1": [relu], "cpp_fused_mul_0:2": [relu]}))  # another graph
    details = kernels.details()
    assert set(details[METADATA_KEY]) == {"cpp_fused_relu_1"}
    assert details[AMBIGUOUS_KEY] == ["cpp_fused_mul_0"]


def test_the_session_sets_inductors_options_back_but_never_the_users_own(monkeypatch):
    import types

    from xsp.tracers.compiled_kernels import INDUCTOR_CONFIG, CompiledKernels

    config = types.ModuleType(INDUCTOR_CONFIG)  # a stand-in for inductor's config, imported already
    config.trace = types.SimpleNamespace(provenance_tracking_level=0)
    config.cpp = types.SimpleNamespace(enable_kernel_profile=True)  # the user's own
    monkeypatch.setitem(sys.modules, INDUCTOR_CONFIG, config)
    kernels = CompiledKernels()
    kernels.install()
    assert config.trace.provenance_tracking_level == 1 and config.cpp.enable_kernel_profile is True
    kernels.uninstall()
    assert config.trace.provenance_tracking_level == 0 and config.cpp.enable_kernel_profile is True
