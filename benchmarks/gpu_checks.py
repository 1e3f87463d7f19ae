"""The GPU checks of issue 48 that benchmarks/gpu.py does not make: clocks over a long run, the
operator level with both CUDA levels, and the gpu_metrics level's figures.

Parts (``--part``, each in a process of its own; each adds its section to
benchmarks/results/gpu_checks.json and rewrites gpu_checks.md from it):

* ``clock``: ResNet-50 inference at batch 32 for ``--seconds`` with the model, cuda_api and
  kernel levels, each call followed by ``torch.cuda.synchronize()``. Every kernel must lie in its
  launch's window plus the launch queue: it starts no earlier than its launching CUDA call and
  ends no later than the synchronisation that waited for it. Counted over the whole run and per
  tenth of it (a drifting clock shows as a trend), with the drift xsp measured.
* ``operator``: a ResNet-50 training step (forward, backward, SGD) at batch 32 with the
  operator, cuda_api and kernel levels: spans of all three, kernels linked to a launch and to an
  operator, records dropped.
* ``shared``: CUPTI shared with PyTorch's profiler (issue 63): ResNet-50 inference at batch 8, 3
  steps under the CUDA levels, 3 inside a ``torch.profiler.profile`` with CUDA activities started
  in the session (xsp lets go of CUPTI: none of its kernels there, all of the profiler's), 3
  after it (xsp took CUPTI back); then a session started inside a profiler (its CUDA levels
  unavailable, the profiler's kernels whole); then two sessions, each after 5 s idle, with what
  they dropped (pytorch#192021 misclocked the first kernels of such sessions: counted, not drawn).
* ``graphs``: CUDA graph replays (issue 63): a small model captured with ``torch.cuda.graph``
  inside a session with the kernel level, replayed 5 times: replayed kernels with a graph node,
  attributed to their capture-time layers, the replays' layer trees; then the same model under
  ``torch.compile(mode="reduce-overhead")``; then under ``torch.compile`` compiled inside a session
  with the operator and CUDA levels: Triton kernels with known layers and lines, and the GPU time
  per layer of compiled code.
* ``metrics``: the gpu_metrics level with the kernel level on ResNet-50 inference at batch 32
  for about ``--seconds`` of GPU time (more than one decode of PM samples): samples, the metric
  set CUPTI took, DRAM bandwidth against the device's peak, FP32/16/64 FLOP rate, and the share
  of the time a kernel ran (from the kernel level).

Needs a CUDA GPU and cupti-python (``metrics``: cupti-python 13.3 or later); without them it says
so and exits 2. :func:`launch_windows` and :func:`level_counts` also run on imported traces.

Usage: python benchmarks/gpu_checks.py --part clock|operator|shared|graphs|metrics [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from _results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "benchmarks" / "results" / "gpu_checks.md"
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cuCtxSynchronize", "cuStreamSynchronize")
PEAK_DRAM_GB_S = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0,
                  "A100-SXM4-40GB": 1555.0}
"""Vendors' datasheet DRAM bandwidth by device name (a substring of torch's name)."""
PARTS_OF_RUN = 10


def launch_windows(spans: pd.DataFrame) -> pd.DataFrame:
    """Per kernel with a launching CUDA call: ``lead_ns`` (kernel start minus launch start: never
    negative on one clock), ``queue_ns`` (kernel start minus launch end), ``sync_slack_ns`` (end
    of the first synchronisation call begun after the launch, minus kernel end: never negative;
    NaN where no such call was recorded) and ``start_ns``."""
    from xsp.core import schema as col
    from xsp.core.schema import Level, SpanKind
    from xsp.table.walks import parent_positions

    kinds = spans[col.KIND].astype(str).to_numpy()
    levels = spans[col.LEVEL].astype(str).to_numpy()
    parents = parent_positions(spans)
    kernels = np.flatnonzero(kinds == SpanKind.KERNEL.value)
    launches = parents[kernels]
    launched = launches >= 0
    launched[launched] = levels[launches[launched]] == Level.CUDA_API.value
    kernels, launches = kernels[launched], launches[launched]
    starts = spans[col.START_NS].to_numpy(dtype=np.int64)
    ends = spans[col.END_NS].to_numpy(dtype=np.int64)
    names = spans[col.NAME].astype(str).to_numpy()
    syncs = np.flatnonzero((levels == Level.CUDA_API.value) & np.isin(names, SYNC_NAMES))
    sync_order = syncs[np.argsort(starts[syncs], kind="stable")]
    sync_starts = starts[sync_order]
    following = np.searchsorted(sync_starts, starts[launches], side="left")
    has_sync = following < len(sync_order)
    slack = np.full(len(kernels), np.nan)
    slack[has_sync] = ends[sync_order[following[has_sync]]] - ends[kernels[has_sync]]
    return pd.DataFrame({"start_ns": starts[kernels], "lead_ns": starts[kernels] - starts[launches],
                         "queue_ns": starts[kernels] - ends[launches], "sync_slack_ns": slack})


def window_summary(windows: pd.DataFrame, parts: int = PARTS_OF_RUN) -> dict[str, Any]:
    """Violations over the run and, per ``parts`` equal stretches of it, the least lead and slack."""
    if windows.empty:
        return {"kernels": 0}
    first, last = int(windows["start_ns"].min()), int(windows["start_ns"].max())
    stretch = np.minimum((windows["start_ns"].to_numpy() - first) * parts // max(last - first + 1, 1), parts - 1)
    per_part = windows.groupby(stretch).agg(kernels=("lead_ns", "size"), least_lead_ns=("lead_ns", "min"),
                                            median_queue_ns=("queue_ns", "median"),
                                            least_sync_slack_ns=("sync_slack_ns", "min"))
    return {"kernels": len(windows), "with_a_following_sync": int(windows["sync_slack_ns"].notna().sum()),
            "started_before_launch": int((windows["lead_ns"] < 0).sum()),
            "ended_after_sync": int((windows["sync_slack_ns"] < 0).sum()),
            "least_lead_ns": int(windows["lead_ns"].min()),
            "queue_ns_percentiles": {str(q): float(windows["queue_ns"].quantile(q / 100)) for q in (1, 50, 99)},
            "least_sync_slack_ns": float(windows["sync_slack_ns"].min()),
            "run_s": (last - first) / 1e9,
            "per_tenth": [{key: (int(value) if pd.notna(value) else None) for key, value in row.items()}
                          for row in per_part.rename_axis("tenth").reset_index().to_dict("records")]}


def level_counts(spans: pd.DataFrame) -> dict[str, int]:
    """Spans per level."""
    from xsp.core import schema as col

    return {str(level): int(count) for level, count in spans[col.LEVEL].astype(str).value_counts().items()}


def _resnet(batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from resnet50_inference import build_model

    return build_model().cuda().eval(), torch.randn(batch, 3, 224, 224, device="cuda")


def _dropped(trace: Any) -> dict[str, int]:
    return {what: int(count) for what, count in (trace.metadata.get("dropped") or {}).items()}


def _traced_inference(levels: str, seconds: float, synchronise_each: bool) -> tuple[Any, int]:
    """ResNet-50 inference at batch 32 for ``seconds`` under ``levels`` (after 5 untraced warm-up
    calls): the trace and the calls made. ``synchronise_each``: wait for the GPU after every call,
    else once at the end."""
    import xsp

    model, images = _resnet(32)
    with torch.no_grad():
        for _ in range(5):
            model(pixel_values=images)
        torch.cuda.synchronize()
        calls = 0
        with xsp.trace(levels=levels, output=None) as session:
            began = time.perf_counter()
            while time.perf_counter() - began < seconds:
                model(pixel_values=images)
                if synchronise_each:
                    torch.cuda.synchronize()
                calls += 1
            torch.cuda.synchronize()
    return session.trace, calls


def clock_part(seconds: float) -> dict[str, Any]:
    trace, calls = _traced_inference("model,cuda_api,kernel", seconds, synchronise_each=True)
    details = trace.metadata["tracer_details"].get("kernel", {})
    return {"calls": calls, "spans": len(trace.spans), "levels": level_counts(trace.spans),
            "windows": window_summary(launch_windows(trace.spans)), "dropped": _dropped(trace),
            "clock": details.get("clock"), "clock_drift_ns": details.get("drift_ns"),
            "record_path": details.get("record_path"), "kernel_details": _plain(details)}


def operator_part() -> dict[str, Any]:
    from gpu import training_step
    from resnet50_inference import build_model

    import xsp
    from xsp.core import schema as col
    from xsp.core.schema import Level, SpanKind
    from xsp.table.walks import nearest_ancestor, of_level, parent_positions

    step = training_step(build_model())
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with xsp.trace(levels="operator,cuda_api,kernel", output=None) as session:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    spans = session.trace.spans
    kernels = np.flatnonzero((spans[col.KIND].astype(str) == SpanKind.KERNEL.value).to_numpy())
    parents = parent_positions(spans)
    levels = spans[col.LEVEL].astype(str).to_numpy()
    launched = (parents[kernels] >= 0) & (levels[np.maximum(parents[kernels], 0)] == Level.CUDA_API.value)
    under_operator = nearest_ancestor(spans, of_level(spans, Level.OPERATOR), parents)[kernels] >= 0
    details = session.trace.metadata["tracer_details"].get("kernel", {})
    return {"steps": 5, "levels": level_counts(spans), "kernels": len(kernels),
            "linked_to_launch": float(launched.mean()) if len(kernels) else 0.0,
            "linked_to_operator": float(under_operator.mean()) if len(kernels) else 0.0,
            "dropped": _dropped(session.trace), "record_path": details.get("record_path"),
            "warnings": session.trace.metadata.get("warnings", [])}


def _profiler_kernels(profiler: Any) -> int:
    """GPU kernels in a torch.profiler capture."""
    from torch.autograd import DeviceType

    return sum(1 for event in profiler.events() if event.device_type == DeviceType.CUDA)


def shared_part() -> dict[str, Any]:
    """CUPTI shared with PyTorch's profiler (issue 63, item 3): started inside a session with the
    CUDA levels (xsp steps aside, and takes CUPTI back when it stops), and the other way round."""
    import xsp
    from xsp.core import schema as col
    from xsp.core.schema import SpanKind

    model, images = _resnet(8)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.no_grad():
        for _ in range(3):
            model(pixel_values=images)
        torch.cuda.synchronize()
        with xsp.trace(levels="model,layer,cuda_api,kernel", output=None) as inside:
            for _ in range(3):
                model(pixel_values=images)
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=activities) as profiler:
                for _ in range(3):
                    model(pixel_values=images)
                    torch.cuda.synchronize()
            for _ in range(3):
                model(pixel_values=images)
                torch.cuda.synchronize()
        profiled_inside = _profiler_kernels(profiler)
        with torch.profiler.profile(activities=activities) as outer:
            with xsp.trace(levels="model,kernel", output=None) as refused:
                model(pixel_values=images)
                torch.cuda.synchronize()
        after_idle = []  # pytorch#192021: the first kernels of a session after an idle spell, misclocked
        for _ in range(2):
            time.sleep(5)
            with xsp.trace(levels="model,cuda_api,kernel", output=None) as session:
                for _ in range(3):
                    model(pixel_values=images)
                    torch.cuda.synchronize()
            idle_spans = session.trace.spans
            after_idle.append({"kernels": int((idle_spans[col.KIND].astype(str) == SpanKind.KERNEL.value).sum()),
                               "dropped": _dropped(session.trace)})
    spans = inside.trace.spans
    kernels = spans[spans[col.KIND].astype(str) == SpanKind.KERNEL.value]
    details = inside.trace.metadata["tracer_details"].get("kernel", {})
    return {"xsp_kernels_per_step": {int(step): int(count) for step, count in kernels.groupby(col.STEP).size().items()},
            "stood_down": details.get("cupti_stood_down"), "cupti_subscription": details.get("cupti_subscription"),
            "cupti_api_version": details.get("cupti_api_version"), "record_path": details.get("record_path"),
            "profiler_kernels_inside_a_session": profiled_inside, "dropped": _dropped(inside.trace),
            "warnings": inside.trace.metadata.get("warnings", []),
            "profiler_kernels_around_a_session": _profiler_kernels(outer),
            "session_inside_the_profiler": refused.trace.metadata.get("unavailable", {}),
            "sessions_after_5_s_idle": after_idle}


def _graph_summary(trace: Any) -> dict[str, Any]:
    from xsp import analysis

    kernels = analysis.kernel_table(trace)
    replayed = kernels[kernels["replayed"]] if len(kernels) else kernels
    with_node = kernels["graph_node_id"].notna() if len(kernels) else kernels
    tree = analysis.replayed_layers(trace)
    layers = set(replayed["layer"].dropna()) if len(kernels) else set()
    return {"kernels": len(kernels), "with_a_graph_node": int(with_node.sum()) if len(kernels) else 0,
            "every_graph_kernel_on_a_capture_layer": bool(len(replayed)) and len(replayed) == int(with_node.sum())
            and int(replayed["layer"].notna().sum()) == len(replayed),
            "capture_layers": sorted(layers),
            "replayed_on_a_capture_layer": len(replayed),
            "replayed_by_layer": {str(k): int(v) for k, v in replayed.groupby("layer").size().items()},
            "replays": int(tree["launch_span_id"].nunique()) if len(tree) else 0, "tree_rows": len(tree),
            "graph_nodes": trace.metadata["tracer_details"].get("kernel", {}).get("graph_nodes"),
            "dropped": _dropped(trace)}


def graphs_part() -> dict[str, Any]:
    """CUDA graph replays on their capture-time layers (issue 63, item 2): a model captured with
    ``torch.cuda.graph`` inside a session and replayed 5 times, then the same model under
    ``torch.compile(mode="reduce-overhead")``."""
    import xsp

    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
                                  for _ in range(4)]).cuda().eval()
    static = torch.randn(64, 1024, device="cuda")
    result: dict[str, Any] = {}
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static)
        torch.cuda.current_stream().wait_stream(side)
        with xsp.trace(levels="model,layer,kernel", output=None) as session:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(static)
            for _ in range(5):
                with xsp.step("replay"):
                    graph.replay()
                torch.cuda.synchronize()
        result["cuda_graph"] = _graph_summary(session.trace)
        try:
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                compiled(static)
            torch.cuda.synchronize()
            with xsp.trace(levels="model,layer,kernel", output=None) as compiled_session:
                for _ in range(5):
                    compiled(static)
                torch.cuda.synchronize()
            result["reduce_overhead"] = _graph_summary(compiled_session.trace)
        except Exception as exc:  # the CUDA graph check above stands on its own
            result["reduce_overhead"] = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        result["compiled_layers"] = _compiled_layers_summary(model, static)
    except Exception as exc:  # the checks above stand on their own
        result["compiled_layers"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


def _compiled_layers_summary(model: Any, static: Any) -> dict[str, Any]:
    """Issue 63, item 1 on a GPU: ``torch.compile`` (default mode) compiled inside a session with
    the operator and CUDA levels: the Triton kernels with known layers and lines, and the GPU
    time per layer of compiled code (``kernel_time_per_layer``)."""
    import xsp
    from xsp.analysis import kernel_time_per_layer
    from xsp.record.compiled_kernels import kernel_layers, kernel_name, kernel_sources

    compiled = torch.compile(model)
    with torch.no_grad(), xsp.trace(levels="model,layer,operator,cuda_api,kernel", output=None) as session:
        for _ in range(5):
            compiled(static)
        torch.cuda.synchronize()
    trace = session.trace
    spans = trace.spans
    kernels = spans[spans["kind"].astype(str) == "kernel"]
    names = kernels["name"].astype(str).map(kernel_name)
    layers, sources = kernel_layers(trace.metadata), kernel_sources(trace.metadata)
    per_layer = kernel_time_per_layer(trace)
    return {"kernels": len(kernels), "triton_kernels": int(names.str.startswith("triton").sum()),
            "with_layers": int(names.isin(set(layers)).sum()), "with_lines": int(names.isin(set(sources)).sum()),
            "called_operators_with_layers": sorted(key for key in layers if "@" in key),
            "kernel_us_per_layer": {str(row.layer): round(float(row.kernel_us), 1)
                                    for row in per_layer.head(12).itertuples()},
            "dropped": _dropped(trace)}


def metrics_part(seconds: float) -> dict[str, Any]:
    from xsp.core import schema as col
    from xsp.core.schema import SpanKind
    from xsp.table.walks import union_length

    trace, calls = _traced_inference("kernel,gpu_metrics", seconds, synchronise_each=False)
    spans = trace.spans
    kinds = spans[col.KIND].astype(str)
    samples = spans[kinds == SpanKind.COUNTERS.value]
    kernels = spans[kinds == SpanKind.KERNEL.value]
    out: dict[str, Any] = {"calls": calls, "samples": len(samples), "kernels": len(kernels),
                           "details": _plain(trace.metadata["tracer_details"].get("gpu_metrics", {})),
                           "warnings": trace.metadata.get("warnings", []), "dropped": _dropped(trace)}
    if len(samples) == 0:
        return out
    sample_s = (samples[col.END_NS] - samples[col.START_NS]).to_numpy(dtype=np.int64) / 1e9
    dram_gb_s = samples[col.BYTES].to_numpy(dtype=float, na_value=np.nan) / sample_s / 1e9
    flops = samples[col.FLOPS].to_numpy(dtype=float, na_value=np.nan)
    window = (int(samples[col.START_NS].min()), int(samples[col.END_NS].max()))
    k_starts = kernels[col.START_NS].to_numpy(dtype=np.int64).clip(*window)
    k_ends = kernels[col.END_NS].to_numpy(dtype=np.int64).clip(*window)
    busy = union_length(k_starts, k_ends) / max(window[1] - window[0], 1)
    device = torch.cuda.get_device_name(0)
    peak = next((value for name, value in PEAK_DRAM_GB_S.items() if name in device), None)
    out.update({
        "sampled_s": float(sample_s.sum()), "median_sample_us": float(np.median(sample_s) * 1e6),
        "kernel_busy_share": round(busy, 4),
        "dram_gb_s": {"mean": float(np.nansum(samples[col.BYTES].to_numpy(dtype=float, na_value=0)) / sample_s.sum()
                                    / 1e9),
                      "p50": float(np.nanmedian(dram_gb_s)), "max": float(np.nanmax(dram_gb_s))},
        "peak_dram_gb_s": peak,
        "tflop_s": {"mean": float(np.nansum(flops) / sample_s.sum() / 1e12) if np.isfinite(flops).any() else None,
                    "max": float(np.nanmax(flops / sample_s) / 1e12) if np.isfinite(flops).any() else None},
    })
    return out


def _grouped(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f}"


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _markdown(summary: dict[str, Any]) -> list[str]:
    lines = ["# GPU checks beyond benchmarks/gpu.py (issue 48)", "",
             f"Device **{summary.get('device')}**, torch {summary.get('torch')}, cupti-python per part below, "
             f"Python {summary.get('python')}; `python benchmarks/gpu_checks.py --part PART` "
             "(every figure: benchmarks/results/gpu_checks.json).", ""]
    clock = summary.get("clock")
    if clock and not clock["windows"].get("kernels"):
        lines += [f"## Clocks over a long run ({clock['run_date']}): no kernel with a launch was recorded "
                  f"(levels {clock['levels']}; kernel level: {clock['kernel_details']})", ""]
    elif clock:
        w = clock["windows"]
        lines += [f"## Clocks over a long run ({clock['run_date']}, cupti-python {clock['cupti_python']})", "",
                  f"ResNet-50 inference, batch 32, {w['run_s']:.1f} s, {clock['calls']} calls, each followed by "
                  f"`torch.cuda.synchronize()`; levels model, cuda_api, kernel; {clock['spans']:,} spans; records "
                  f"read by the {clock['record_path']} path; clock `{clock['clock']}`, drift xsp measured "
                  f"{clock['clock_drift_ns']} ns; dropped {clock['dropped'] or 'none'}.", "",
                  f"* kernels with a launch: {w['kernels']:,}; with a synchronisation after the launch: "
                  f"{w['with_a_following_sync']:,}",
                  f"* started before their launch began: **{w['started_before_launch']}**; ended after the "
                  f"synchronisation that waited for them: **{w['ended_after_sync']}**",
                  f"* least lead (kernel start - launch start): {w['least_lead_ns']:,} ns; least slack "
                  f"(sync end - kernel end): {w['least_sync_slack_ns']:,.0f} ns",
                  "* queue (kernel start - launch end), 1st/50th/99th percentile: "
                  + " / ".join(f"{v:,.0f}" for v in w["queue_ns_percentiles"].values()) + " ns", "",
                  "| tenth of the run | kernels | least lead (ns) | median queue (ns) | least sync slack (ns) |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for part in w["per_tenth"]:
            lines.append(f"| {part['tenth'] + 1} | {part['kernels']:,} | {part['least_lead_ns']:,} | "
                         f"{part['median_queue_ns']:,} | {_grouped(part['least_sync_slack_ns'])} |")
        lines.append("")
    operator = summary.get("operator")
    if operator:
        lines += [f"## The operator level with both CUDA levels ({operator['run_date']})", "",
                  f"ResNet-50 training step (SGD), batch 32, {operator['steps']} steps: spans per level "
                  f"{operator['levels']}; {operator['kernels']:,} kernels, {operator['linked_to_launch']:.1%} linked "
                  f"to a launch, {operator['linked_to_operator']:.1%} under an operator; records read by the "
                  f"{operator['record_path']} path; dropped {operator['dropped'] or 'none'}; warnings "
                  f"{operator['warnings'] or 'none'}.", ""]
    graphs = summary.get("graphs")
    if graphs:
        lines += [f"## CUDA graph replays on their capture-time layers ({graphs['run_date']})", "",
                  "4 blocks of Linear(1024)+ReLU at batch 64: captured with `torch.cuda.graph` inside a session and "
                  "replayed 5 times; then `torch.compile(mode=\"reduce-overhead\")` (captured at warm-up, before "
                  "its session: its replays keep their launch).", "",
                  f"* torch.cuda.graph: {graphs['cuda_graph']}",
                  f"* reduce-overhead: {graphs['reduce_overhead']}",
                  f"* torch.compile, compiled in a session with the operator and CUDA levels (layers and lines "
                  f"of Triton kernels): {graphs.get('compiled_layers')}", ""]
    shared = summary.get("shared")
    if shared:
        lines += [f"## CUPTI shared with PyTorch's profiler ({shared['run_date']}, cupti-python "
                  f"{shared['cupti_python']})", "",
                  "ResNet-50 inference, batch 8: 3 steps under xsp (model, layer, cuda_api, kernel), 3 inside "
                  "`torch.profiler.profile` (CPU and CUDA) started in the session, 3 after it.", "",
                  f"* xsp's kernels per step: {shared['xsp_kernels_per_step']} (none expected in steps 3-5)",
                  "* the profiler's kernels, started inside the session: "
                  f"{shared['profiler_kernels_inside_a_session']:,}",
                  f"* xsp let go of CUPTI: {shared['stood_down']}",
                  f"* subscription: {shared['cupti_subscription']}, CUPTI API {shared['cupti_api_version']}, "
                  f"{shared['record_path']} path; dropped {shared['dropped'] or 'none'}",
                  f"* the other way round, the profiler's kernels around a session: "
                  f"{shared['profiler_kernels_around_a_session']:,}; that session's unavailable levels: "
                  f"{shared['session_inside_the_profiler']}",
                  f"* two more sessions of 3 steps, each after 5 s idle (pytorch#192021): "
                  f"{shared['sessions_after_5_s_idle']}", ""]
    metrics = summary.get("metrics")
    if metrics:
        lines += [f"## gpu_metrics (PM sampling) ({metrics['run_date']}, cupti-python {metrics['cupti_python']})", ""]
        if not metrics.get("samples"):
            lines += [f"No samples: warnings {metrics.get('warnings')}; details {metrics.get('details')}.", ""]
        else:
            dram, tflop = metrics["dram_gb_s"], metrics["tflop_s"]
            peak = metrics["peak_dram_gb_s"]
            lines += [f"ResNet-50 inference, batch 32, {metrics['calls']} calls with the kernel and gpu_metrics "
                      f"levels: {metrics['samples']:,} samples of {metrics['median_sample_us']:.0f} µs "
                      f"({metrics['sampled_s']:.2f} s sampled), metrics {metrics['details'].get('metrics')}.", "",
                      "| figure | value |", "| --- | ---: |",
                      f"| a kernel running (kernel level) | {metrics['kernel_busy_share']:.1%} |",
                      f"| DRAM GB/s, mean over the samples | {dram['mean']:,.0f} |",
                      f"| DRAM GB/s, median sample | {dram['p50']:,.0f} |",
                      f"| DRAM GB/s, busiest sample | {dram['max']:,.0f} |",
                      f"| device peak (datasheet) | {peak if peak is not None else 'unknown'} |",
                      f"| FP16/32/64 TFLOP/s (no tensor cores), mean | {tflop['mean']} |",
                      f"| the same, busiest sample | {tflop['max']} |", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("clock", "operator", "shared", "graphs", "metrics"), required=True)
    parser.add_argument("--seconds", type=float, default=60.0, help="clock: run length; metrics: about 1/20 of it")
    args = parser.parse_args(argv)
    from gpu import cuda_problem

    problem = cuda_problem("benchmarks/gpu_checks.py")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    from importlib.metadata import version

    if args.part == "clock":
        result = clock_part(args.seconds)
    elif args.part == "operator":
        result = operator_part()
    elif args.part == "shared":
        result = shared_part()
    elif args.part == "graphs":
        result = graphs_part()
    else:
        result = metrics_part(max(args.seconds / 20, 2.0))
    result.update(run_date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  cupti_python=version("cupti-python"))
    path = RESULTS.with_suffix(".json")
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "python": platform.python_version(), args.part: _plain(result)})
    path.write_text(json.dumps(summary, indent=2) + "\n")
    record(_markdown(summary), RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
