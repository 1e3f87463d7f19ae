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
        "extern_kernels.addmm:3": [trace_text((str(model), 9, "forward", "return z.sum()"))],  # aten::addmm, 0/0
    }
    sources = sources_of_metrics([json.dumps(provenance), "not json"], "0/0")
    assert sources == {"cpp_fused_mul_relu_0": [[(str(model), 8, "Net.forward", "z = torch.relu(y)")],
                                                [(str(model), 7, "Net.forward", "y = x * 2")]],
                       "aten::addmm@0/0": [[(str(model), 9, "Net.forward", "return z.sum()")]]}


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


def test_an_operator_compiled_code_calls_as_it_is_lands_on_the_line_that_calls_it_in_its_compile():
    trace = compiled_trace({**SOURCES, "aten::addmm@0/0": [[["/a/net.py", 11, "Net.forward", "h = self.fc(z)"]],
                                                          [["/a/net.py", 13, "Net.forward", "return self.head(h)"]]],
                            "aten::expand@0/0": [[["/a/net.py", 12, "Net.forward", "never"]]]})
    spans = trace.spans
    extra = spans.iloc[[3, 3]].copy()  # the matrix multiply (5), and what it calls itself (6)
    extra[col.SPAN_ID] = [5, 6]
    extra[col.PARENT_ID] = pd.array([2, 5], dtype="Int64")
    extra[col.NAME] = ["aten::addmm", "aten::expand"]
    spans = spans.copy()
    spans.loc[3, col.END_NS] = 70  # the sum kernel: 60-70, the matrix multiply 70-90 (expand 80-85)
    extra[col.START_NS], extra[col.END_NS] = [70, 80], [90, 85]
    spans = pd.concat([spans, extra], ignore_index=True)
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    found = lines(xsp.Trace(spans, trace.metadata)).set_index("line")
    # half of it on each of the two lines that call it in its compile, and what it calls itself
    # (the expand) with it: one call each, half its time each
    for line in (11, 13):
        assert found.loc[line, "self_ms"] == found.loc[line, "inclusive_ms"] == pytest.approx(10 / 1e6)
        assert found.loc[line, "calls"] == 1
    assert found.loc[20, "self_ms"] == pytest.approx((100 - 40 - 10 - 20) / 1e6)
    assert found["self_ms"].sum() == pytest.approx(100 / 1e6)  # every nanosecond once
    assert 12 not in found.index
    spans[col.NAME] = spans[col.NAME].replace({"Torch-Compiled Region: 0/0": "Torch-Compiled Region: 1/0"})
    assert 11 not in lines(xsp.Trace(spans, trace.metadata)).set_index("line").index  # another compile's


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


# --- layers of compiled code ---

class Node:
    """A node of the graph dynamo hands to inductor: only the meta xsp reads."""

    def __init__(self, trace: str | None, *stack: tuple[str, type]) -> None:
        self.meta = {"stack_trace": trace, "nn_module_stack": {f"key{i}": entry for i, entry in enumerate(stack)}}


class Block(torch.nn.Module):
    pass


def graph_module(*nodes: Node):
    import types

    return types.SimpleNamespace(graph=types.SimpleNamespace(nodes=list(nodes)))


MUL = trace_text(("/a/net.py", 20, "forward", "x = block(x)"), ("/a/net.py", 9, "forward", "y = x * 2"))
RELU = trace_text(("/a/net.py", 20, "forward", "x = block(x)"), ("/a/net.py", 10, "forward", "z = torch.relu(y)"))
ADD = trace_text(("/a/net.py", 21, "forward", "return x + 1"))
FC = trace_text(("/a/net.py", 20, "forward", "x = block(x)"), ("/a/net.py", 11, "forward", "return self.fc(z)"))
HEAD = trace_text(("/a/net.py", 22, "forward", "return self.head(x)"))


def hints_of_two_blocks():
    from xsp.record.compiled_kernels import layer_hints

    blocks = [(f"L['self'].blocks.{i}", Block) for i in range(2)]
    return layer_hints(graph_module(
        *(Node(MUL, block) for block in blocks), *(Node(RELU, block) for block in blocks),
        *(Node(FC, block, (f"{block[0]}.fc", torch.nn.Linear)) for block in blocks),
        Node(ADD), Node(HEAD, ("L['self'].head", torch.nn.Linear)), Node(None, blocks[0])))


def test_the_graph_dynamo_compiles_names_the_modules_of_each_stack_trace():
    hints = hints_of_two_blocks()
    assert hints[MUL] == {"blocks.0": "Block", "blocks.1": "Block"}  # one line runs in both blocks
    assert hints[FC] == {"blocks.0.fc": "Linear", "blocks.1.fc": "Linear"}  # the innermost module
    assert hints[ADD] == {"": ""}  # the compiled module's own code
    assert None not in hints and len(hints) == 5


def test_a_kernels_time_is_shared_by_its_operators_then_by_the_modules_that_ran_them():
    from xsp.record.compiled_kernels import layers_of_metrics

    provenance = {"cpp_fused_add_mul_relu_0:1": [MUL, RELU, ADD], "cpp_fused_add_mul_relu_0:3": [MUL],
                  "cpp_fused_unknown_1:2": ["  File \"/a/x.py\", line 1, in f\n    g()\n"],
                  "extern_kernels.addmm:4": [FC], "extern_kernels.addmm:5": [HEAD],
                  "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:6": [HEAD]}
    third = pytest.approx(1 / 3)
    assert layers_of_metrics([json.dumps(provenance)], hints_of_two_blocks(), "0/1") == {
        # three operators (a third each); the mul's and the relu's thirds split by the two blocks;
        # the add's third is the compiled module's own: it stays on the calling layer
        "cpp_fused_add_mul_relu_0": [("blocks.0", "Block", third), ("blocks.1", "Block", third)],
        # an operator called as it is, keyed with its compile: one module per call, three call it
        "aten::addmm@0/1": [("blocks.0.fc", "Linear", third), ("blocks.1.fc", "Linear", third),
                            ("head", "Linear", third)],
        "aten::_scaled_dot_product_flash_attention_for_cpu@0/1": [("head", "Linear", 1.0)]}


def test_inductors_names_of_operators_called_as_they_are():
    from xsp.record.compiled_kernels import called_operator

    assert called_operator("extern_kernels.mm") == "aten::mm"
    assert called_operator("torch.ops.aten.convolution.default") == "aten::convolution"
    assert called_operator("torch.ops.mylib.op.default") == "mylib::op"
    assert called_operator("cpp_fused_mul_0") is None and called_operator("torch.ops.") is None


def layered_trace(*, caller_is_layer: bool = False, backward: bool = False) -> xsp.Trace:
    """A step: the model (or, with ``caller_is_layer``, a layer ``model.net`` inside it) calls
    compiled code: a fused kernel (60 ns), the matrix multiply it calls as it is (40 ns, with an
    operator of its own inside: 10 ns), in compile 0/0."""
    names = ["model", "model.net", "Torch-Compiled Region: 0/0", "graph_0_cpp_fused_add_mul_relu_0", "aten::addmm",
             "aten::expand"]
    spans = pd.DataFrame({
        col.SPAN_ID: [1, 2, 3, 4, 5, 6], col.PARENT_ID: [None, 1, 2, 3, 3, 5], col.NAME: names,
        col.LEVEL: ["model", "layer", "operator", "operator", "operator", "operator"],
        col.KIND: ["predict", "forward", "operator", "operator", "operator", "operator"],
        col.PATH: ["model[0]", "model[0]/model.net[0]", None, None, None, None],
        col.MODULE_TYPE: ["Net", "Inner", None, None, None, None],
        col.CALL_DEPTH: [0, 1, None, None, None, None],
        col.START_NS: [0, 5, 10, 20, 80, 85], col.END_NS: [200, 195, 190, 80, 120, 95], col.THREAD_ID: [1] * 6,
        col.STEP: [0] * 6, col.CORRELATION_ID: [None] * 6})
    if not caller_is_layer:
        spans = spans.drop(index=1).reset_index(drop=True)
        spans.loc[1, col.PARENT_ID] = 1
    if backward:
        spans.loc[spans[col.NAME] == "Torch-Compiled Region: 0/0", col.NAME] = "CompiledFunctionBackward"
        spans.loc[spans[col.NAME] == "aten::addmm", col.NAME] = "aten::mm"
    for column in (col.EXEC_INDEX, col.DURATION_CI_NS, col.PARAM_COUNT, col.INPUT_SHAPES, col.OUTPUT_SHAPES,
                   col.SOURCE):
        spans[column] = None
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    from xsp.record.compiled_kernels import LAYERS_KEY

    metadata = {"tracer_details": {"operator": {LAYERS_KEY: {
        "cpp_fused_add_mul_relu_0": [["blocks.0", "Block", 1 / 3], ["blocks.1", "Block", 1 / 3]],
        "aten::addmm@0/0": [["blocks.0.fc", "Linear", 0.5], ["head", "Linear", 0.5]],
        "aten::expand@0/0": [["blocks.1", "Block", 1.0]],  # (called by the addmm here)
        "aten::addmm@1/0": [["other", "Linear", 1.0]]}}}}
    return xsp.Trace(spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64", col.CORRELATION_ID: "Int64",
                                   col.CALL_DEPTH: "Int64"}), metadata)


def test_the_layer_table_has_the_layers_of_compiled_code_under_the_model():
    from xsp.analysis.layers import layer_table, top_layers

    table = layer_table(layered_trace()).set_index("name")
    assert table["compiled"].all()
    assert set(table.index) == {"model.blocks.0", "model.blocks.1", "model.blocks.0.fc", "model.head"}
    assert table.loc["model.blocks.0", "self_ms"] == pytest.approx(20 / 1e6)  # a third of the kernel
    assert table.loc["model.blocks.0.fc", "self_ms"] == pytest.approx(20 / 1e6)  # half the matrix multiply
    assert table.loc["model.head", "self_ms"] == pytest.approx(20 / 1e6)  # (aten::expand, inside it, is its own)
    assert table.loc["model.blocks.0", "duration_ms"] == pytest.approx(40 / 1e6)  # with its fc's
    assert table.loc["model.blocks.1", "duration_ms"] == pytest.approx(20 / 1e6)
    assert table.loc["model.blocks.0.fc", "call_depth"] == 2 and table.loc["model.blocks.0", "call_depth"] == 1
    assert table.loc["model.blocks.0.fc", "module_type"] == "Linear"
    assert table.loc["model.blocks.0.fc", "path"] == "model[0]/model.blocks.0.fc"
    assert (table["kind"] == "forward").all() and (table["step"] == 0).all()
    top = top_layers(layered_trace()).set_index("name")
    assert top.loc["model.blocks.0", "calls"] == 1 and top.loc["model.blocks.0", "total_self_ms"] == pytest.approx(2e-5)


def test_an_operator_called_as_it_is_takes_the_layers_of_its_own_compile():
    from xsp.analysis.layers import layer_table

    trace = layered_trace()
    spans = trace.spans.copy()
    spans[col.NAME] = spans[col.NAME].replace({"Torch-Compiled Region: 0/0": "Torch-Compiled Region: 1/0"})
    table = layer_table(xsp.Trace(spans, trace.metadata)).set_index("name")
    assert set(table.index) == {"model.blocks.0", "model.blocks.1", "model.other"}
    assert table.loc["model.other", "self_ms"] == pytest.approx(40 / 1e6)


def test_a_layer_that_calls_compiled_code_hands_its_layers_their_time():
    from xsp.analysis.layers import layer_table

    table = layer_table(layered_trace(caller_is_layer=True)).set_index("name")
    assert "model.net.blocks.0" in table.index and not table.loc["model.net", "compiled"]
    # 190 ns of its own, less the compiled layers' 80 ns (a third twice of 60, half twice of 40)
    assert table.loc["model.net", "self_ms"] == pytest.approx((190 - 80) / 1e6)
    assert table["self_ms"].sum() == pytest.approx(190 / 1e6)  # every nanosecond once


def test_a_compiled_backwards_kernels_are_its_layers_backward():
    from xsp.analysis.layers import layer_table

    table = layer_table(layered_trace(backward=True)).set_index("name")
    # the matrix multiply is in no compiled region (so no compile of its own): it stays on the model
    assert set(table.index) == {"model.blocks.0.backward", "model.blocks.1.backward"}
    assert (table["kind"] == "backward").all()


def test_without_layers_of_compiled_code_the_table_is_the_layer_spans():
    from xsp.analysis.layers import layer_table

    trace = layered_trace(caller_is_layer=True)
    bare = xsp.Trace(trace.spans, {})
    table = layer_table(bare)
    assert table["name"].tolist() == ["model.net"] and not table["compiled"].any()
    assert table.loc[0, "self_ms"] == pytest.approx(190 / 1e6)
    assert layer_table(trace.spans)["name"].tolist() == ["model.net"]  # a bare table has no metadata
    damaged = xsp.Trace(trace.spans, {"tracer_details": {"operator": {"compiled_kernel_layers": {"k": [["x"]]}}}})
    assert layer_table(damaged)["name"].tolist() == ["model.net"]


def test_the_session_notices_each_graph_inductor_compiles_and_sets_compile_fx_back(monkeypatch):
    import types

    from xsp.tracers.compiled_kernels import COMPILE_FX, DYNAMO_UTILS, CompiledKernels

    calls = []

    def compile_fx(model_, example_inputs, **kwargs):
        calls.append((model_, example_inputs, kwargs))
        return "compiled"

    module = types.ModuleType(COMPILE_FX)
    module.compile_fx = compile_fx
    monkeypatch.setitem(sys.modules, COMPILE_FX, module)
    compiles = []
    monkeypatch.setitem(sys.modules, DYNAMO_UTILS, types.SimpleNamespace(get_compilation_metrics=lambda: compiles))
    kernels = CompiledKernels()
    kernels.install()
    assert module.compile_fx is not compile_fx
    graph = graph_module(Node(MUL, ("L['self'].blocks.0", Block)))
    assert module.compile_fx(graph, [1], inner_compile=None) == "compiled"
    assert calls == [(graph, [1], {"inner_compile": None})]
    assert module.compile_fx("not a graph", []) == "compiled"  # a graph it cannot read: compiled all the same
    compiles.append(types.SimpleNamespace(inductor_provenance={json.dumps({"cpp_fused_mul_0:1": [MUL]})},
                                          compile_id="0/0"))
    from xsp.record.compiled_kernels import kernel_layers

    assert kernel_layers({"tracer_details": {"operator": kernels.details()}}) == {
        "cpp_fused_mul_0": [("blocks.0", "Block", 1.0)]}
    kernels.uninstall()
    assert module.compile_fx is compile_fx


def test_compiled_layers_are_named_as_an_eager_run_names_them():
    from xsp.analysis.compiled import compiled_layer_name
    from xsp.record.compiled_kernels import module_path

    assert module_path("L['self'].blocks.0") == "blocks.0" and module_path("L['self']") == ""
    assert module_path("L['model'].layers.0") == "/model.layers.0"  # a compiled function's variable
    assert module_path("G['net']") == "/net"
    assert compiled_layer_name("model", "blocks.0", False) == "model.blocks.0"
    # the backward's caller is the model's backward span; a compiled submodule's, its _orig_mod
    assert compiled_layer_name("model.backward", "blocks.0.fc1", True) == "model.blocks.0.fc1.backward"
    assert compiled_layer_name("model.body._orig_mod", "blocks.0", False) == "model.body.blocks.0"
    assert compiled_layer_name("model", "/net.layers.0", False) == "net.layers.0"
    assert compiled_layer_name(None, "blocks.0", False) == "blocks.0"


def test_a_compiled_function_under_a_step_has_its_models_layers_by_their_variable():
    from xsp.analysis.layers import layer_table

    trace = layered_trace()
    spans = trace.spans.copy()
    spans.loc[0, [col.LEVEL, col.KIND, col.NAME]] = ["model", "step", "step"]  # no model call: a step
    layers = {"cpp_fused_add_mul_relu_0": [["/net.blocks.0", "Block", 0.5]],
              "aten::addmm@0/0": [["/net.head", "Linear", 1.0]]}
    table = layer_table(xsp.Trace(spans, {"tracer_details": {"operator": {"compiled_kernel_layers": layers}}}))
    assert table.set_index("name")["self_ms"].to_dict() == {"net.blocks.0": pytest.approx(30 / 1e6),
                                                            "net.head": pytest.approx(40 / 1e6)}


def test_an_operator_a_training_graph_calls_runs_under_its_autograd_function():
    from xsp.analysis.layers import layer_table

    trace = layered_trace()
    spans = trace.spans.copy()
    wrapper = spans.iloc[[1]].copy()  # region (3) > CompiledFunction (9) > the kernel and the matrix multiply
    wrapper[[col.SPAN_ID, col.PARENT_ID, col.NAME]] = [9, 3, "CompiledFunction"]
    spans.loc[spans[col.PARENT_ID] == 3, col.PARENT_ID] = 9
    spans = pd.concat([spans, wrapper], ignore_index=True).astype({col.PARENT_ID: "Int64"})
    names = set(layer_table(xsp.Trace(spans, trace.metadata))["name"])
    assert names == {"model.blocks.0", "model.blocks.1", "model.blocks.0.fc", "model.head"}


def test_a_compiles_forward_and_backward_share_its_called_operators(monkeypatch):
    import types

    from xsp.record.compiled_kernels import kernel_layers
    from xsp.tracers.compiled_kernels import DYNAMO_UTILS, CompiledKernels

    forward = types.SimpleNamespace(inductor_provenance={json.dumps({"extern_kernels.mm:1": [FC]})},
                                    compile_id="0/0")
    backward = types.SimpleNamespace(inductor_provenance={json.dumps({"extern_kernels.mm:2": [HEAD]})},
                                     compile_id="0/0")  # dynamo files the backward under the forward's id
    compiles = [forward, backward]
    monkeypatch.setitem(sys.modules, DYNAMO_UTILS, types.SimpleNamespace(get_compilation_metrics=lambda: compiles))
    from xsp.tracers.compiled_kernels import COMPILE_FX

    module = types.ModuleType(COMPILE_FX)
    module.compile_fx = lambda model_, *args, **kwargs: None
    monkeypatch.setitem(sys.modules, COMPILE_FX, module)
    kernels = CompiledKernels()
    kernels.install()
    blocks = [(f"L['self'].blocks.{i}", Block) for i in range(2)]
    module.compile_fx(graph_module(*(Node(FC, block, (f"{block[0]}.fc", torch.nn.Linear)) for block in blocks),
                                   Node(HEAD, ("L['self'].head", torch.nn.Linear)), Node(ADD)))
    backward.inductor_provenance.add(json.dumps({"extern_kernels.mm:3": [ADD]}))  # the compiled module's own
    details = kernels.details()
    kernels.uninstall()
    # four modules call it (the compiled module itself among them, whose quarter stays on the caller)
    assert kernel_layers({"tracer_details": {"operator": details}})["aten::mm@0/0"] == [
        ("blocks.0.fc", "Linear", pytest.approx(1 / 4)), ("blocks.1.fc", "Linear", pytest.approx(1 / 4)),
        ("head", "Linear", pytest.approx(1 / 4))]
    assert "compiled_kernels_ambiguous" not in details


def test_a_compile_in_a_layers_first_call_is_not_the_layers_own_time():
    from xsp.analysis.layers import layer_table

    trace = layered_trace(caller_is_layer=True)
    spans = trace.spans.copy()
    compile_span = spans.iloc[[1]].copy()  # a compile of 50 ns inside model.net, before the compiled call
    compile_span[[col.SPAN_ID, col.PARENT_ID, col.NAME, col.LEVEL, col.KIND, col.START_NS, col.END_NS]] = [
        9, 2, "torch.compile", "model", "compile", 6, 9]
    spans = pd.concat([spans, compile_span], ignore_index=True).astype({col.PARENT_ID: "Int64"})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    table = layer_table(xsp.Trace(spans, trace.metadata)).set_index("name")
    assert table.loc["model.net", "self_ms"] == pytest.approx((190 - 80 - 3) / 1e6)


def test_a_call_with_a_forward_and_a_backward_counts_each_layers_time_once():
    """Nesting is found within each call and direction: a backward row's sub-layer is not a
    forward row's, so the forward's outermost rows still hand their time to the calling layer."""
    from xsp.analysis.layers import layer_table

    trace = layered_trace(caller_is_layer=True)
    spans = trace.spans.copy()
    # the kernel's row runs in the backward (blocks.0, blocks.1), the matrix multiply's in the forward
    # (blocks.0.fc, head): blocks.0.fc has no blocks.0 row in its own direction
    wrapper = spans[spans[col.NAME] == "Torch-Compiled Region: 0/0"].copy()  # an operator span
    wrapper[[col.SPAN_ID, col.PARENT_ID, col.NAME, col.START_NS, col.END_NS]] = [9, 3, "CompiledFunctionBackward", 15,
                                                                             85]
    spans.loc[spans[col.NAME] == "graph_0_cpp_fused_add_mul_relu_0", col.PARENT_ID] = 9
    spans = pd.concat([spans, wrapper], ignore_index=True).astype({col.PARENT_ID: "Int64"})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    table = layer_table(xsp.Trace(spans, trace.metadata)).set_index("name")
    assert table.loc["model.net.blocks.0.fc", "call_depth"] == 2  # directly under model.net
    assert table.loc["model.net.blocks.0.backward", "duration_ms"] == pytest.approx(20 / 1e6)  # not the fc's
    assert table["self_ms"].sum() == pytest.approx(190 / 1e6)  # every nanosecond once


def test_a_compiled_backwards_matrix_multiplies_take_their_forwards_compile():
    """The backward runs in no region: its compile is its forward's, found by the autograd
    sequence number the CompiledFunction call and its backward node share."""
    from xsp.analysis.layers import layer_table

    trace = layered_trace()
    spans = trace.spans.copy()
    spans[col.SEQUENCE_NUMBER] = pd.array([None] * len(spans), dtype="Int64")
    forward = spans[spans[col.NAME] == "Torch-Compiled Region: 0/0"].copy()  # region (3) > CompiledFunction (9)
    forward[[col.SPAN_ID, col.PARENT_ID, col.NAME, col.SEQUENCE_NUMBER]] = [9, 3, "CompiledFunction", 5]
    backward = spans.iloc[[0]].copy()  # later: model.backward (10) > CompiledFunctionBackward (11) > mm (12)
    backward[[col.SPAN_ID, col.NAME, col.LEVEL, col.KIND, col.START_NS, col.END_NS]] = [
        10, "model.backward", "layer", "backward", 300, 400]
    node = forward.copy()
    node[[col.SPAN_ID, col.PARENT_ID, col.NAME, col.START_NS, col.END_NS]] = [11, 10, "CompiledFunctionBackward", 310,
                                                                         390]
    matmul = spans[spans[col.NAME] == "aten::addmm"].copy()
    matmul[[col.SPAN_ID, col.PARENT_ID, col.START_NS, col.END_NS, col.SEQUENCE_NUMBER]] = [12, 11, 320, 380, None]
    spans = pd.concat([spans, forward, backward, node, matmul], ignore_index=True)
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    spans = spans.astype({col.PARENT_ID: "Int64", col.SEQUENCE_NUMBER: "Int64"})
    table = layer_table(xsp.Trace(spans, trace.metadata)).set_index("name")
    assert table.loc["model.blocks.0.fc.backward", "self_ms"] == pytest.approx(30 / 1e6)  # half the 60 ns
    assert table.loc["model.head.backward", "kind"] == "backward"
    other = spans.copy()
    other.loc[other[col.NAME] == "CompiledFunctionBackward", col.SEQUENCE_NUMBER] = 6  # another forward's backward
    assert "model.head.backward" not in set(layer_table(xsp.Trace(other, trace.metadata))["name"])


def test_a_compile_the_graph_cache_answered_takes_this_programs_files():
    """FX's graph cache gave a compile the provenance of the program that first made it (the same
    model in another file): the kernels' lines named that file, and no layer was found."""
    import json

    from xsp.record.compiled_kernels import layers_of_metrics, rebased_provenance, sources_of_metrics

    def trace(file: str) -> str:
        return (f'  File "{file}", line 18, in forward\n    x = block(x)\n'
                f'  File "{file}", line 9, in forward\n    return torch.relu(self.fc(x * 2))\n'
                "                                   ^^^^^\n")

    mine, theirs = "/home/me/bench.py", "/home/me/old/train.py"
    hints = {trace(mine): {"blocks.0": "Block", "blocks.1": "Block"}}
    cached = [json.dumps({"cpp_fused_mul_0:1": [trace(theirs)]})]
    assert layers_of_metrics(cached, hints) == {}  # as it was: nothing matched
    texts, replaced, dropped = rebased_provenance(cached, hints)
    assert (replaced, dropped) == (1, 0)
    shares = [("blocks.0", "Block", 0.5), ("blocks.1", "Block", 0.5)]
    assert layers_of_metrics(texts, hints) == {"cpp_fused_mul_0": shares}
    assert {chain[-1][0] for chain in sources_of_metrics(texts)["cpp_fused_mul_0"]} == {mine}
    # its own program's provenance and code run by exec (no code to compare) stay as they are
    assert rebased_provenance([json.dumps({"k:1": [trace(mine)]})], hints) == (
        [json.dumps({"k:1": [trace(mine)]})], 0, 0)
    bare = '  File "<doc>", line 18, in forward\n  File "<doc>", line 9, in forward\n'
    assert rebased_provenance([json.dumps({"k:1": [bare]})], hints)[1:] == (0, 0)
    # other code, of a file that is not here: left out, its kernel's time stays on the calling line
    other = trace(theirs).replace("x * 2", "x * 3")
    texts, replaced, dropped = rebased_provenance([json.dumps({"k:1": [other]})], hints)
    assert (replaced, dropped) == (0, 1) and json.loads(texts[0]) == {"k:1": []}
    # two traces of this program alike but for their files: which one is meant, nothing says
    both = {**hints, trace("/home/me/copy.py"): {"blocks.0": "Block"}}
    assert rebased_provenance(cached, both)[1:] == (0, 0)


def test_a_compile_the_graph_cache_answered_after_the_script_was_edited_takes_its_lines_now(tmp_path):
    """A line added at the top of the script, then a run the graph cache answered: its kernels'
    lines were those of the first run (a blank line, a `def`), and no layer was found."""
    import json

    from xsp.record.compiled_kernels import layers_of_metrics, rebased_provenance

    script = tmp_path / "net.py"
    body = ["class Net:", "    def forward(self, x):", "        x = block(x)", "        return torch.relu(x * 2)"]
    script.write_text("\n".join(["import torch", "import os", *body]) + "\n")  # now: two lines above it

    def trace(first: int) -> str:
        return (f'  File "{script}", line {first + 2}, in forward\n    x = block(x)\n'
                f'  File "{script}", line {first + 3}, in forward\n    return torch.relu(x * 2)\n')

    now, before = trace(3), trace(1)  # the code two lines further down than when it was cached
    hints = {now: {"blocks.0": "Block"}}
    texts, replaced, dropped = rebased_provenance([json.dumps({"cpp_fused_mul_0:1": [before]})], hints)
    assert (replaced, dropped) == (1, 0)
    assert layers_of_metrics(texts, hints) == {"cpp_fused_mul_0": [("blocks.0", "Block", 1.0)]}
    edited = before.replace("x * 2", "x * 4")  # and code that is no longer there at all: left out
    assert rebased_provenance([json.dumps({"k:1": [edited]})], hints)[1:] == (0, 1)


def test_a_cached_trace_through_xsps_wrapper_matches_this_programs_frames(tmp_path):
    """The compile that filled the graph cache ran with xsp's Python wrapper of module calls in
    place: its traces held the wrapper's frames between the model's, which this program's graphs
    do not, so they matched none, and another script's lines were kept."""
    import json

    import tracers.module_calls.interceptor as interceptor
    from xsp.record.compiled_kernels import layers_of_metrics, rebased_provenance

    wrapper = interceptor.__file__
    script = tmp_path / "net.py"
    script.write_text("import torch\nclass Net:\n    def forward(self, x):\n        return self.head(self.blocks(x))\n")

    def trace(file: str, line: int, through_wrapper: bool) -> str:
        middle = (f'  File "{wrapper}", line 254, in xsp_module_call\n    return _orig(self, *args, **kwargs)\n'
                  if through_wrapper else "")
        return (f'  File "{file}", line {line}, in forward\n    return self.head(self.blocks(x))\n'
                "                     ^^^^^^^^^^^^^^^\n" + middle)

    now = trace(str(script), 4, through_wrapper=False)
    hints = {now: {"blocks": "Sequential"}}
    cached = [json.dumps({"cpp_fused_0:1": [trace(str(tmp_path / "other.py"), 15, through_wrapper=True)]})]
    texts, replaced, dropped = rebased_provenance(cached, hints)
    assert (replaced, dropped) == (1, 0)
    assert layers_of_metrics(texts, hints) == {"cpp_fused_0": [("blocks", "Sequential", 1.0)]}


def test_two_traces_alike_in_the_programs_own_frames_are_told_apart_by_the_others(tmp_path):
    """A Linear's operator has two traces in the graph, one through xsp's wrapper of module calls
    and one without: alike in the program's own frames, so a cached trace from before a line was
    added matched both, and kept its stale line (a `def`)."""
    import json

    import tracers.module_calls.interceptor as interceptor
    from xsp.record.compiled_kernels import rebased_provenance

    script = tmp_path / "lines.py"
    script.write_text("# v2\\nclass Net:\\n    def forward(self, x):\\n        y = self.fc(x) * 2\\n")
    wrapper = (f'  File "{interceptor.__file__}", line 254, in xsp_module_call\\n'
               "    return _orig(self, *args, **kwargs)\\n")

    def trace(line: int, through_wrapper: bool) -> str:
        return (f'  File "{script}", line {line}, in forward\\n    y = self.fc(x) * 2\\n        ^^^^^^^^^^^^^^\\n'
                + (wrapper if through_wrapper else ""))

    through, direct = trace(4, True), trace(4, False)
    texts, replaced, dropped = rebased_provenance([json.dumps({"extern_kernels.addmm:1": [trace(3, True)]})],
                                                  {through: {"fc": "Linear"}, direct: {"fc": "Linear"}})
    assert (replaced, dropped) == (1, 0) and json.loads(texts[0]) == {"extern_kernels.addmm:1": [through]}
