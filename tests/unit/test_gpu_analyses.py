"""GPU analyses on hand-made spans with known answers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xsp.analysis import gpu, roofline
from xsp.core import schema as col
from xsp.io.trace import Trace
from xsp.table.build import conform
from xsp.table.walks import union_length

US = 1_000


def make_trace(rows, metadata=None):
    """rows: (id, parent, level, kind, name, start_us, end_us, extra dict)."""
    records = []
    for span_id, parent, level, kind, name, start, end, extra in rows:
        on_device = level == "kernel"
        records.append({col.SPAN_ID: span_id, col.PARENT_ID: parent, col.LEVEL: level, col.KIND: kind,
                        col.NAME: name, col.START_NS: start * US, col.END_NS: end * US,
                        col.DURATION_NS: (end - start) * US, col.THREAD_ID: None if on_device else 1,
                        col.DEVICE_ID: 0 if on_device else None, col.STREAM_ID: extra.pop("stream", 7) if on_device
                        else None, col.STEP: extra.pop("step", 0), col.TRACE_ID: "t" * 32, col.PATH: name,
                        **extra})
    return Trace(conform(pd.DataFrame(records)), metadata or {})


@pytest.fixture
def small():
    # step 0: layer L (0..100) > op A (10..60) > launch 1 (20..25) -> kernel k1 (30..50)
    #                                          > launch 2 (40..44) -> kernel k2 (70..90) [after a host gap]
    #         copy launch 3 (60..62) -> memcpy (95..105) 1 MB HtoD; sync call 4 (100..140)
    rows = [
        (1, None, "model", "step", "ProfilerStep#0", 0, 150, {}),
        (2, 1, "layer", "forward", "L", 0, 100, {col.MODULE_TYPE: "Linear"}),
        (3, 2, "operator", "operator", "A", 10, 60, {}),
        (4, 3, "cuda_api", "runtime", "cudaLaunchKernel", 20, 25, {}),
        (5, 3, "cuda_api", "runtime", "cudaLaunchKernel", 40, 44, {}),
        (6, 4, "kernel", "kernel", "k1", 30, 50, {col.CORRELATION_ID: 1}),
        (7, 5, "kernel", "kernel", "k2", 70, 90, {col.CORRELATION_ID: 2}),
        (8, 1, "cuda_api", "runtime", "cudaMemcpyAsync", 60, 62, {}),
        (9, 8, "kernel", "memcpy", "Memcpy HtoD", 95, 105, {col.BYTES: 1_000_000, col.COPY_KIND: "HtoD"}),
        (10, 1, "cuda_api", "runtime", "cudaStreamSynchronize", 100, 140, {}),
    ]
    return make_trace(rows)


def test_kernel_table_attributes_kernels(small):
    table = gpu.kernel_table(small).set_index("name")
    assert table.loc["k1", "launch"] == "cudaLaunchKernel"
    assert table.loc["k1", "operator"] == "A" and table.loc["k1", "layer"] == "L"
    assert table.loc["k1", "duration_us"] == 20 and table.loc["k1", "launch_delay_us"] == 10
    assert table.loc["k2", "launch_duration_us"] == 4


def test_kernels_by_name_counts_from_one(small):
    by_name = gpu.kernels_by_name(small).set_index("name")
    assert by_name.loc["k1", "count"] == 1 and by_name["share"].sum() == pytest.approx(1)


def test_kernel_time_per_layer_and_operator(small):
    assert gpu.kernel_time_per_layer(small).set_index("layer").loc["L", "kernel_us"] == 40
    assert gpu.kernel_time_per_operator(small).set_index("operator").loc["A", "kernels"] == 2


def test_gpu_vs_cpu_time_per_layer(small):
    row = gpu.gpu_vs_cpu_per_layer(small).iloc[0]
    assert row["duration_us"] == 100 and row["gpu_us"] == 40 and row["cpu_us"] == 60 and row["kernels"] == 2


def test_memory_operations_bandwidth(small):
    row = gpu.memory_operations(small).iloc[0]
    assert row["direction"] == "HtoD" and row["bytes"] == 1_000_000
    assert row["bandwidth_gb_s"] == pytest.approx(100.0)  # 1 MB in 10 us


def test_synchronization(small):
    sync = gpu.synchronization(small).set_index("name")
    assert sync.loc["cudaStreamSynchronize", "total_us"] == 40


def test_gpu_idle_is_split_into_host_bound_and_other(small):
    row = gpu.gpu_utilization(small).iloc[0]
    # stream 7: k1 30..50, k2 70..90 (launched at 40, before the gap: other wait),
    # memcpy 95..105 (launched at 60, before the gap: other wait)
    assert row["busy_us"] == 50 and row["window_us"] == 75
    assert row["other_idle_us"] == 25 and row["host_bound_idle_us"] == 0


def test_host_bound_gap():
    rows = [
        (1, None, "model", "step", "s", 0, 200, {}),
        (2, 1, "cuda_api", "runtime", "cudaLaunchKernel", 0, 5, {}),
        (3, 2, "kernel", "kernel", "a", 10, 20, {col.CORRELATION_ID: 1}),
        (4, 1, "cuda_api", "runtime", "cudaLaunchKernel", 100, 105, {}),  # launched after the GPU went idle
        (5, 4, "kernel", "kernel", "b", 110, 120, {col.CORRELATION_ID: 2}),
    ]
    row = gpu.gpu_utilization(make_trace(rows)).iloc[0]
    assert row["host_bound_idle_us"] == 90 and row["other_idle_us"] == 0
    assert row["utilization"] == pytest.approx(20 / 110)


def test_launch_overhead(small):
    row = gpu.launch_overhead(small).iloc[0]
    assert row["kernels"] == 2 and row["launch_us"] == 9 and row["kernel_us"] == 40
    assert row["kernels_shorter_than_launch"] == 0


def test_union_length_counts_overlaps_once():
    assert union_length(np.array([0, 5, 20]), np.array([10, 15, 30])) == 25
    assert union_length(np.array([]), np.array([])) == 0


def test_roofline_from_counters_and_kernels():
    rows = [
        (1, None, "model", "step", "s", 0, 1000, {}),
        (2, 1, "cuda_api", "runtime", "cudaLaunchKernel", 0, 5, {}),
        (3, 2, "kernel", "kernel", "gemm", 10, 110, {col.CORRELATION_ID: 1, col.BYTES: 10_000_000}),
        (4, None, "kernel", "counters", "gemm", 500, 900, {col.FLOPS: 2_000_000_000, col.STEP: None}),
    ]
    trace = make_trace(rows, {"device_properties": [{"name": "Tesla V100-SXM2-32GB", "totalGlobalMem": 34e9}]})
    row = roofline.kernel_roofline(trace).set_index("name").loc["gemm"]
    assert row["flops"] == 2e9 and row["kernel_us"] == 100  # time from the kernel, not the replayed range
    assert row["achieved_tflops"] == pytest.approx(20.0)
    assert row["arithmetic_intensity"] == pytest.approx(200.0)
    assert row["ridge_point"] == pytest.approx(15.7e12 / 900e9)
    assert row["bound"] == "compute"


@pytest.mark.parametrize("name, memory, expected", [
    ("Tesla V100-SXM2-32GB", None, "V100"), ("NVIDIA A100-PG509-200", 42e9, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 85e9, "A100-80GB"), ("NVIDIA H100 80GB HBM3", None, "H100"),
    ("NVIDIA H200", None, "H200"), ("NVIDIA L4", None, "L4"), ("Tesla T4", None, "T4"),
    ("NVIDIA A10", None, "A10"), ("NVIDIA GeForce RTX 3090", None, "RTX 3090"),
    ("NVIDIA GeForce RTX 4090", None, "RTX 4090"), ("NVIDIA A10G", None, None),
])
def test_peak_table_lookup(name, memory, expected):
    peak = roofline.peak_for(name, memory)
    assert (peak.name if peak else None) == expected


def compiled_gpu_trace(caller_is_layer: bool = True) -> Trace:
    """A layer ``model.net`` calls compiled code (compile 0/0) that launches a Triton kernel
    (20 µs) and calls ``aten::mm`` as it is, whose cuBLAS kernel takes 40 µs; an eager kernel
    (10 µs) runs after it in the same layer."""
    from xsp.record.compiled_kernels import LAYERS_KEY

    rows = [
        (1, None, "model", "predict", "model", 0, 200, {}),
        (2, 1, "layer", "forward", "model.net", 0, 190, {col.MODULE_TYPE: "Inner"}),
        (3, 2, "operator", "operator", "Torch-Compiled Region: 0/0", 10, 100, {}),
        (4, 3, "cuda_api", "runtime", "cuLaunchKernel", 20, 25, {}),
        (5, 4, "kernel", "kernel", "triton_poi_fused_mul_0", 30, 50, {col.CORRELATION_ID: 1}),
        (6, 3, "operator", "operator", "aten::mm", 40, 60, {}),
        (7, 6, "cuda_api", "runtime", "cudaLaunchKernel", 45, 50, {}),
        (8, 7, "kernel", "kernel", "sm90_xmma_gemm", 50, 90, {col.CORRELATION_ID: 2}),
        (9, 2, "operator", "operator", "aten::relu", 120, 130, {}),
        (10, 9, "cuda_api", "runtime", "cudaLaunchKernel", 121, 125, {}),
        (11, 10, "kernel", "kernel", "relu_kernel", 130, 140, {col.CORRELATION_ID: 3}),
    ]
    if not caller_is_layer:  # the compiled model itself: no layer above its kernels
        rows = [row if row[0] != 3 else (3, 1, *row[2:]) for row in rows if row[0] not in (2, 9, 10, 11)]
    layers = {"triton_poi_fused_mul_0": [["blocks.0", "Block", 0.5], ["blocks.1", "Block", 0.25]],
              "aten::mm@0/0": [["blocks.0.fc", "Linear", 1.0]],
              "aten::mm@1/0": [["other", "Linear", 1.0]]}
    return make_trace(rows, {"tracer_details": {"operator": {LAYERS_KEY: layers}}})


def test_the_kernels_of_compiled_code_count_on_its_layers():
    table = gpu.kernel_time_per_layer(compiled_gpu_trace()).set_index("layer")
    assert table.loc["model.net.blocks.0", "kernel_us"] == pytest.approx(10)  # half the Triton kernel
    assert table.loc["model.net.blocks.1", "kernel_us"] == pytest.approx(5)
    assert table.loc["model.net.blocks.0.fc", "kernel_us"] == pytest.approx(40)  # the matrix multiply's kernel
    assert table.loc["model.net", "kernel_us"] == pytest.approx(5 + 10)  # the Triton kernel's rest, the eager one
    assert table["kernel_us"].sum() == pytest.approx(70) and table["share"].sum() == pytest.approx(1)
    assert "model.net.other" not in table.index  # another compile's matrix multiply
    bare = gpu.kernel_time_per_layer(compiled_gpu_trace().spans).set_index("layer")  # no metadata: the launch's layer
    assert bare["kernel_us"].to_dict() == {"model.net": pytest.approx(70)}


def test_a_compiled_models_kernels_count_on_its_layers_under_the_model():
    table = gpu.kernel_time_per_layer(compiled_gpu_trace(caller_is_layer=False)).set_index("layer")
    assert table["kernel_us"].to_dict() == {"model.blocks.0.fc": pytest.approx(40), "model.blocks.0": pytest.approx(10),
                                            "model.blocks.1": pytest.approx(5)}
    assert table["share"].sum() == pytest.approx(55 / 60)  # the rest of the Triton kernel is the model's own
