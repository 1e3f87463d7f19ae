"""Recommendations: every rule on constructed traces that must and must not trigger it, and on
the real traces of ../shared/traces."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp.analysis.recommend import COLUMNS, RULES, Rule, recommend
from xsp.analysis.windowed import windowed_report
from xsp.core import schema as col
from xsp.io.trace import Trace
from xsp.io.tree_windows import tree_windows

A100 = {"device_properties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "computeMajor": 8, "computeMinor": 0,
                               "numSms": 108, "totalGlobalMem": 80 * 2**30}]}
V100 = {"device_properties": [{"id": 0, "name": "Tesla V100-SXM2-32GB", "computeMajor": 7, "computeMinor": 0,
                               "numSms": 80}]}
P100 = {"device_properties": [{"id": 0, "name": "Tesla P100", "computeMajor": 6, "computeMinor": 0, "numSms": 56}]}


def fired(trace: Trace) -> dict[str, dict[str, object]]:
    """The rules that fire on ``trace``; the same, word for word, where it is read a tree at a time."""
    table = recommend(trace)
    assert list(table.columns) == list(COLUMNS)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("trace" + col.FILE_SUFFIX)
        Trace(spans=trace.spans, metadata={"schema_version": col.SCHEMA_VERSION, **trace.metadata}).save(path)
        windowed = windowed_report(tree_windows(path, window_spans=1)).recommendations
    assert windowed.to_dict("records") == table.to_dict("records")
    return {row["rule"]: row for row in table.to_dict("records")}


def step(rows, end_us=100, name="train_step"):
    return [(1, None, "model", "step", name, 0, end_us, {}), *rows]


def kernels_trace(kernel_rows, metadata, step_us=100, launch_us=1):
    """A step holding one operator that launches each kernel: (name, start, end, extra), each
    launch taking ``launch_us`` and ending 1 us before its kernel starts."""
    rows = [(2, 1, "operator", "operator", "aten::mm", 0, step_us, {})]
    next_id = 3
    for name, start, end, extra in kernel_rows:
        rows.append((next_id, 2, "cuda_api", "runtime", "cudaLaunchKernel", start - 1 - launch_us, start - 1, {}))
        rows.append((next_id + 1, next_id, "kernel", "kernel", name, start, end, dict(extra)))
        next_id += 2
    return make_trace(step(rows, step_us), metadata)


# input ----------------------------------------------------------------------------------------
def input_trace(wait_us, workers=None, pin=None, metadata=None, persistent=None, prefetch=None):
    attributes = {}
    if workers is not None:
        attributes["xsp.input.num_workers"] = workers
    if pin is not None:
        attributes["xsp.input.pin_memory"] = pin
    if persistent is not None:
        attributes[col.ATTR_INPUT_PERSISTENT_WORKERS] = persistent
    if prefetch is not None:
        attributes[col.ATTR_INPUT_PREFETCH_FACTOR] = prefetch
    rows = step([(2, 1, "input", "input", "DataLoader.__next__", 0, wait_us,
                  {col.ATTRIBUTES: json.dumps(attributes) if attributes else None}),
                 (3, 1, "model", "predict", "net", wait_us, 100, {})])
    return make_trace(rows, metadata or {})


def test_input_bound_by_the_tf_thresholds():
    assert fired(input_trace(25))["input_bound"]["severity"] == "high"
    moderate = fired(input_trace(10))["input_bound"]
    assert moderate["severity"] == "medium" and moderate["share"] == pytest.approx(0.10)
    assert moderate["paths"] == ["DataLoader.__next__"]
    assert "input_bound" not in fired(input_trace(4))
    older = input_trace(25)  # recorded before the input level: waits at the model level
    older.spans[col.LEVEL] = older.spans[col.LEVEL].replace("input", "model")
    assert fired(older)["input_bound"]["severity"] == "high"


def test_dataloader_workers_when_the_loader_has_fewer_workers_than_cpus():
    found = fired(input_trace(30, workers=0, pin=False, metadata={"cpus_available": 8}))["dataloader_workers"]
    assert found["severity"] == "high" and "num_workers=8" in found["fix"]
    assert "num_workers=0 of 8 CPUs" in found["evidence"]
    on_gpu = fired(input_trace(30, workers=2, pin=False, metadata={"cpus_available": 16, **A100}))
    assert "num_workers=4" in on_gpu["dataloader_workers"]["fix"] and "pin_memory=True" in on_gpu[
        "dataloader_workers"]["fix"]
    assert "dataloader_workers" not in fired(input_trace(30, workers=8, metadata={"cpus_available": 8}))
    assert "dataloader_workers" not in fired(input_trace(4, workers=0, metadata={"cpus_available": 8}))
    assert "dataloader_workers" not in fired(input_trace(30))  # no worker count recorded
    # on one CPU: the two input rules agree, and neither asks for more workers than CPUs
    one_cpu = fired(input_trace(30, workers=0, metadata={"cpus_available": 1}))
    assert "num_workers=1," in one_cpu["dataloader_workers"]["fix"]
    assert "num_workers=1," in one_cpu["input_bound"]["fix"]
    # every CPU already runs a worker: no rule asks for the count the loader already has
    full = fired(input_trace(30, workers=2, metadata={"cpus_available": 2}))
    assert "dataloader_workers" not in full and "num_workers=2," not in full["input_bound"]["fix"]
    assert "every CPU already runs a DataLoader worker (num_workers=2 of 2 CPUs)" in full["input_bound"]["fix"]


def test_input_advice_asks_only_for_settings_the_loader_does_not_have():
    # the loader of the report that asked for all of this: 2 workers that keep running, doing
    # the augmentation already; 8 CPUs
    found = fired(input_trace(30, workers=2, pin=False, persistent=True, prefetch=2,
                              metadata={"cpus_available": 8}))
    advice = found["input_bound"]["fix"]
    assert "num_workers=4" in advice and "prefetch_factor=4" in advice
    assert "persistent_workers" not in advice and "into the workers" not in advice
    assert "pin_memory" not in advice  # no GPU: pinning changes nothing
    assert "make each batch cheaper to fetch" in advice
    assert ("its DataLoader had num_workers=2, pin_memory=False, persistent_workers=True, prefetch_factor=2"
            in found["input_bound"]["evidence"])
    assert found["dataloader_workers"]["fix"] == "DataLoader(dataset, ..., num_workers=4, prefetch_factor=4)"
    # everything already set, every CPU a worker: only the batch's own cost is left to cut
    full = fired(input_trace(30, workers=2, pin=True, persistent=True, prefetch=4, metadata={"cpus_available": 2}))
    assert full["input_bound"]["fix"] == (
        "every CPU already runs a DataLoader worker (num_workers=2 of 2 CPUs): make each batch cheaper to fetch: "
        "do per-sample work (decoding, augmentation) once ahead of training, or on whole batches at once")
    on_gpu = fired(input_trace(30, workers=2, pin=True, persistent=True, prefetch=4,
                               metadata={"cpus_available": 2, **A100}))["input_bound"]["fix"]
    assert on_gpu.endswith("move per-sample work (decoding, augmentation) onto the GPU or do it once ahead of training")
    # no workers: the per-sample work moves into them
    none = fired(input_trace(30, workers=0, pin=True, metadata={"cpus_available": 4, **A100}))["input_bound"]["fix"]
    assert "num_workers=4, persistent_workers=True, prefetch_factor=4" in none and "into the workers" in none
    assert "pin_memory" not in none  # pinned already, on a GPU
    unpinned = fired(input_trace(30, workers=0, pin=False, metadata={"cpus_available": 4, **A100}))
    assert "pin_memory=True" in unpinned["input_bound"]["fix"]


def epochs_trace(persistent, fetch_rows=(), epochs=2):
    """Two epochs of two batches each, 2 workers on 2 CPUs: each epoch begins with iter(loader)
    (its workers start: 30 us) and a first batch (15 us), and the first ends with a 20 us wait
    (its workers stop); the other batches wait 2 us."""
    attributes = {col.ATTRIBUTES: json.dumps({"xsp.input.num_workers": 2, col.ATTR_INPUT_PERSISTENT_WORKERS: persistent,
                                              col.ATTR_INPUT_PREFETCH_FACTOR: 2})}
    waits = [(0, col.INPUT_ITER_NAME, 0, 30), (0, col.INPUT_NEXT_NAME, 30, 45), (1, col.INPUT_NEXT_NAME, 100, 102),
             (2, col.INPUT_NEXT_NAME, 200, 220), (2, col.INPUT_ITER_NAME, 220, 250), (2, col.INPUT_NEXT_NAME, 250, 265),
             (3, col.INPUT_NEXT_NAME, 300, 302)][:3 if epochs == 1 else None]
    rows = [(10 + number, None, "model", "step", "train_step", number * 100, number * 100 + 100, {"step": number})
            for number in range(2 * epochs)]
    for index, (number, name, start, end) in enumerate(waits):
        rows.append((20 + index, 10 + number, "input", "input", name, start, end, {"step": number, **attributes}))
    rows += [(30 + number, 10 + number, "model", "predict", "net", number * 100 + 90, number * 100 + 100,
              {"step": number}) for number in range(2 * epochs)]
    return make_trace([*rows, *fetch_rows], {"cpus_available": 2})


def test_workers_started_at_every_epoch_are_told_to_persist():
    found = fired(epochs_trace(persistent=False))["input_bound"]
    assert found["fix"] == ("keep the workers from one epoch to the next: DataLoader(..., persistent_workers=True); "
                            "stopping and starting them where the epochs turn (1 epoch start after the first) took "
                            "0.0650 ms of the 0.114 ms the loop waited")
    # kept already: the waits are the batches' own
    assert "persistent_workers=True" not in fired(epochs_trace(persistent=True))["input_bound"]["fix"]


def test_workers_of_a_single_epoch_are_not_told_to_persist():
    """The first epoch's workers start however they are kept: one epoch has nothing to save."""
    assert "persistent_workers=True" not in fired(epochs_trace(persistent=False, epochs=1))["input_bound"]["fix"]


def test_workers_busy_all_the_time_are_not_told_to_fetch_further_ahead():
    def fetches(busy_us):  # one worker's two fetches of 100 us, ``busy_us`` apart at their starts
        return [(40 + index, None, "input", "fetch", "fetch", start, start + 100,
                 {"step": None, col.PROCESS_ID: 77, col.BATCH_SIZE: 8,
                  col.ATTRIBUTES: json.dumps({col.ATTR_INPUT_WORKER: 0})})
                for index, start in enumerate((0, busy_us))]
    saturated = fired(epochs_trace(persistent=True, fetch_rows=fetches(100)))["input_bound"]["fix"]
    assert "prefetch_factor" not in saturated
    assert saturated.endswith("(the workers fetched 100.0% of their time: fetching further ahead cannot help)")
    idle = fired(epochs_trace(persistent=True, fetch_rows=fetches(400)))["input_bound"]["fix"]
    assert "prefetch_factor=4" in idle and "cannot help" not in idle


# GPU time -------------------------------------------------------------------------------------
def test_gpu_idle_when_kernels_are_launched_after_the_gpu_ran_dry():
    # k1 30..50; k2 launched at 300 (after the GPU went idle at 50), runs 310..330
    idle = kernels_trace([("k1", 30, 50, {}), ("k2", 310, 330, {})], A100, step_us=400)
    found = fired(idle)["gpu_idle"]
    assert found["severity"] == "high" and found["paths"] == ["device 0"]
    # k2 launched at 28, queued behind k1: no host-bound gap
    busy = make_trace(step([(2, 1, "operator", "operator", "aten::mm", 0, 100, {}),
                            (3, 2, "cuda_api", "runtime", "cudaLaunchKernel", 20, 21, {}),
                            (4, 3, "kernel", "kernel", "k1", 30, 50, {}),
                            (5, 2, "cuda_api", "runtime", "cudaLaunchKernel", 28, 29, {}),
                            (6, 5, "kernel", "kernel", "k2", 50, 70, {})]), A100)
    assert "gpu_idle" not in fired(busy)


def test_gpu_idle_counts_a_gap_only_when_every_stream_is_idle():
    rows = step([(2, 1, "operator", "operator", "aten::mm", 0, 400, {}),
                 (3, 2, "cuda_api", "runtime", "cudaLaunchKernel", 20, 21, {}),
                 (4, 3, "kernel", "kernel", "long", 30, 330, {"stream": 7}),
                 (5, 2, "cuda_api", "runtime", "cudaLaunchKernel", 300, 301, {}),
                 (6, 5, "kernel", "kernel", "side", 310, 320, {"stream": 9})], 400)
    assert "gpu_idle" not in fired(make_trace(rows, A100))  # stream 9 idled, the GPU did not


def test_small_kernels_when_launches_outlast_kernels():
    short = kernels_trace([(f"k{i}", 10 + 9 * i, 12 + 9 * i, {}) for i in range(10)], A100, launch_us=5)
    found = fired(short)["small_kernels"]
    assert "10 of 10 kernels" in found["evidence"] and found["paths"] == ["aten::mm"]
    long = kernels_trace([(f"k{i}", 10 + 30 * i, 35 + 30 * i, {}) for i in range(3)], A100, launch_us=5)
    assert "small_kernels" not in fired(long)


def test_pageable_memcpy_names_the_copies_and_their_operator():
    def copy_trace(name):
        rows = step([(2, 1, "operator", "operator", "aten::copy_", 0, 50, {col.PATH: "net[0]/aten::copy_[0]"}),
                     (3, 2, "cuda_api", "runtime", "cudaMemcpyAsync", 5, 40, {}),
                     (4, 3, "kernel", "memcpy", name, 10, 40, {col.COPY_KIND: "HtoD", col.BYTES: 4_000_000})])
        return make_trace(rows, A100)

    found = fired(copy_trace("Memcpy HtoD (Pageable -> Device)"))["pageable_memcpy"]
    assert found["severity"] == "high" and found["paths"] == ["net[0]/aten::copy_[0]"]
    assert "HtoD x1" in found["evidence"] and "pin_memory=True" in found["fix"]
    assert "pageable_memcpy" not in fired(copy_trace("Memcpy HtoD (Pinned -> Device)"))


def test_pageable_memcpy_names_an_operator_of_each_direction():
    """Six long uploads and one short download: the download's operator is among the paths."""
    rows = []
    for i in range(7):
        kind, length = ("DtoH", 5) if i == 6 else ("HtoD", 60)
        base = 100 * i
        rows += [(10 + 3 * i, 1, "operator", "operator", "aten::copy_", base, base + length + 20,
                  {col.PATH: f"net[0]/aten::copy_[{i}]"}),
                 (11 + 3 * i, 10 + 3 * i, "cuda_api", "runtime", "cudaMemcpyAsync", base + 2, base + 8, {}),
                 (12 + 3 * i, 11 + 3 * i, "kernel", "memcpy", f"Memcpy {kind} (Pageable)", base + 10,
                  base + 10 + length, {col.COPY_KIND: kind, col.BYTES: 1_000})]
    found = fired(make_trace(step(rows, 1000), A100))["pageable_memcpy"]
    assert "net[0]/aten::copy_[6]" in found["paths"] and len(found["paths"]) <= 5
    assert "HtoD x6" in found["evidence"] and "DtoH x1" in found["evidence"]


def test_blocking_sync_in_the_loop():
    def sync_trace(name, us):
        rows = step([(2, 1, "operator", "operator", "aten::item", 0, 60, {col.PATH: "aten::item[0]"}),
                     (3, 2, "cuda_api", "runtime", name, 10, 10 + us, {})], 1000)
        return make_trace(rows, A100)

    found = fired(sync_trace("cudaStreamSynchronize", 40))["blocking_sync"]
    assert found["severity"] == "medium" and found["share"] == pytest.approx(0.04)
    assert found["paths"] == ["aten::item[0]"] and ".item()" in found["fix"]
    assert "blocking_sync" not in fired(sync_trace("cudaStreamSynchronize", 5))  # 0.5% of the step
    assert "blocking_sync" not in fired(sync_trace("cudaStreamWaitEvent", 40))  # the host does not wait


def test_no_tf32_on_ampere_fp32_gemms_only():
    sgemm = [("ampere_sgemm_128x64_nn", 10, 60, {})]
    found = fired(kernels_trace(sgemm, {**A100, "tf32_matmul": False}))["no_tf32"]
    assert "allow_tf32 = True" in found["fix"] and "allow_tf32=False" in found["evidence"]
    assert "no_tf32" not in fired(kernels_trace(sgemm, V100))  # no TF32 before Ampere
    tf32 = [("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x16", 10, 60, {})]
    assert "no_tf32" not in fired(kernels_trace(tf32, A100))


def test_no_amp_suggests_the_16_bit_type_the_gpu_has():
    sgemm = [("volta_sgemm_128x64_nn", 10, 60, {})]
    on_volta = fired(kernels_trace(sgemm, V100))["no_amp"]
    assert "torch.float16" in on_volta["fix"] and "GradScaler" in on_volta["fix"]
    assert "torch.bfloat16" in fired(kernels_trace(sgemm, A100))["no_amp"]["fix"]
    assert "no_amp" not in fired(kernels_trace(sgemm, P100))
    half = [("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nn", 10, 60, {})]
    assert "no_amp" not in fired(kernels_trace(half, A100))
    elementwise = [("vectorized_elementwise_kernel", 10, 60, {})]
    assert "no_amp" not in fired(kernels_trace(elementwise, A100))


def test_channels_last_when_layouts_are_converted():
    converting = [("void cudnn::ops::nchwToNhwcKernel<float>", 10, 20, {}), ("implicit_gemm", 22, 60, {})]
    found = fired(kernels_trace(converting, A100))["channels_last"]
    assert "channels_last" in found["fix"] and "1 layout conversion kernels" in found["evidence"]
    assert "channels_last" not in fired(kernels_trace([("implicit_gemm", 10, 60, {})], A100))


def optimizer_trace(operator_names):
    rows = [(2, 1, "model", "predict", "net", 0, 60, {}), (3, 1, "model", "optimizer", "AdamW.step", 70, 95, {})]
    for index, name in enumerate(operator_names):
        rows.append((10 + index, 3, "operator", "operator", name, 71 + index, 71 + index + 1, {}))
    return make_trace(step(rows), {})


def test_unfused_optimizer_needs_many_operators_none_fused():
    found = fired(optimizer_trace(["aten::add_"] * 12))["unfused_optimizer"]
    assert "torch.optim.AdamW(model.parameters(), ..., fused=True)" in found["fix"]
    assert found["share"] == pytest.approx(0.25)
    assert "unfused_optimizer" not in fired(optimizer_trace(["aten::add_"] * 11 + ["aten::_fused_adamw_"]))
    assert "unfused_optimizer" not in fired(optimizer_trace(["aten::add_"] * 3))
    assert "unfused_optimizer" not in fired(optimizer_trace([]))  # which implementation ran is unknown


def test_gpu_underutilized_by_sm_efficiency():
    few_blocks = [("k", 10, 60, {col.GRID: "[4, 1, 1]"})]
    found = fired(kernels_trace(few_blocks, A100))["gpu_underutilized"]
    assert found["severity"] == "high" and "108 SMs" in found["evidence"]
    many_blocks = [("k", 10, 60, {col.GRID: "[216, 1, 1]"})]
    assert "gpu_underutilized" not in fired(kernels_trace(many_blocks, A100))


def test_memory_near_capacity_on_a_gpu_or_the_host():
    def memory(peak, total=100):
        return make_trace(step([]), {"memory": {"devices": [{"device": 0, "peak_reserved_bytes": peak,
                                                             "total_bytes": total}]}})

    found = fired(memory(95))["memory_near_capacity"]
    assert found["paths"] == ["GPU 0"] and "95.0%" in found["evidence"]
    assert "memory_near_capacity" not in fired(memory(50))
    host = make_trace(step([]), {"memory": {"devices": [], "host_peak_rss_bytes": 99, "host_total_bytes": 100}})
    assert fired(host)["memory_near_capacity"]["severity"] == "high"


def test_cpu_threads_oversubscribed_or_unused():
    work = step([(2, 1, "model", "predict", "net", 0, 90, {})])
    over = fired(make_trace(work, {"torch_num_threads": 8, "cpus_available": 4}))["cpu_threads"]
    assert "torch.set_num_threads(4)" in over["fix"]
    one = fired(make_trace(work, {"torch_num_threads": 1, "cpus_available": 8}))["cpu_threads"]
    assert "torch.set_num_threads(8)" in one["fix"]
    assert "cpu_threads" not in fired(make_trace(work, {"torch_num_threads": 4, "cpus_available": 4}))
    assert "cpu_threads" not in fired(make_trace(work, {"torch_num_threads": 1, "cpus_available": 2}))


def gc_steps(collections_us, generation=2):
    """Two concurrent steps (requests in flight together): 0..1000 us and 500..1500 us; and
    collections (start, end) of ``generation``, which every step in flight waits for."""
    rows = [(1, None, "model", "step", "request", 0, 1000, {col.STEP: 0}),
            (2, None, "model", "step", "request", 500, 1500, {col.STEP: 1})]
    for offset, (start, end) in enumerate(collections_us):
        rows.append((10 + offset, None, "system", "gc", f"gc generation {generation}", start, end,
                     {col.ATTRIBUTES: json.dumps({col.ATTR_GC_GENERATION: generation, col.ATTR_GC_COLLECTED: 0}),
                      col.STEP: None}))
    return make_trace(rows, {})


def test_garbage_collections_are_judged_by_what_the_steps_in_flight_waited_for():
    # 60 us inside both steps (2 x 60 of 2,000 us of step time: 6%), and a long one between runs
    found = fired(gc_steps([(600, 660), (1600, 9000)]))["gc_pauses"]
    assert found["severity"] == "medium" and found["share"] == pytest.approx(0.06)
    assert "6.0% of step time" in found["evidence"] and "gc.freeze()" in found["fix"]
    assert "0.0600 ms per step over 2 steps" in found["evidence"]
    assert fired(gc_steps([(600, 760)]))["gc_pauses"]["severity"] == "high"  # 320 of 2,000 us: 16%
    young = fired(gc_steps([(100, 140)], generation=0))["gc_pauses"]  # inside the first step only: 2%
    assert young["severity"] == "low" and young["share"] == pytest.approx(0.02)
    assert "generation 2" not in young["evidence"]  # none was full
    assert "full ones (generation 2), which walk every object the program keeps, 0.120 ms of it" in \
        fired(gc_steps([(600, 660), (1600, 9000)]))["gc_pauses"]["evidence"]
    assert "gc_pauses" not in fired(gc_steps([(100, 105), (2000, 9000)]))  # 0.25% inside; the rest between steps
    assert "gc_pauses" not in fired(gc_steps([]))


def test_rules_are_sorted_by_severity_then_share_and_all_documented():
    table = recommend(input_trace(30, workers=0, metadata={"cpus_available": 8, "torch_num_threads": 16}))
    assert table["rule"].tolist()[:2] == ["input_bound", "dataloader_workers"]
    ranks = table["severity"].map({"high": 0, "medium": 1, "low": 2}).tolist()
    assert ranks == sorted(ranks)
    assert set(RULES) == set(Rule) and len(Rule) == 14
    assert recommend(make_trace([], {})).empty


def test_real_traces(shared_traces):
    expected = {
        "a100_alexnet.json.gz": {"pageable_memcpy", "gpu_idle"},
        "a100_nccl_rank0.json.gz": {"channels_last", "no_amp"},
        "v100_2rank_train_rank1.json.gz": {"no_amp", "gpu_idle"},
        "cpu_only_rank34.json.gz": set(),
    }
    # rules that fired with nothing at stake (0.0% of the trace's time) are left out: sampled_rank0's
    # pageable copies (0.08 ms), alexnet's fp32 GEMMs in a trace of 55 s
    assert "pageable_memcpy" not in set(recommend(xsp.load(shared_traces / "kineto" / "sampled_rank0.json.gz"))["rule"])
    assert "no_tf32" not in set(recommend(xsp.load(shared_traces / "kineto" / "a100_alexnet.json.gz"))["rule"])
    for name, rules in expected.items():
        table = recommend(xsp.load(shared_traces / "kineto" / name))
        found = set(table["rule"])
        assert rules <= found, name
        if not rules:
            assert not found, name
        assert table["share"].between(0, 1).all()
    v100 = recommend(xsp.load(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz")).set_index("rule")
    assert "torch.float16" in v100.loc["no_amp", "fix"]  # V100 has no bfloat16 Tensor Cores


def test_durations_in_findings_are_never_written_in_exponent_notation():
    from xsp.core.figures import milliseconds

    assert [milliseconds(v) for v in (0.0, 0.0123, 1.234, 12.34, 123.4, 12_850.2)] == [
        "0 ms", "0.0123 ms", "1.23 ms", "12.3 ms", "123 ms", "12,850 ms"]
    assert "e+" not in milliseconds(1e7) and "e-" not in milliseconds(1e-7)
