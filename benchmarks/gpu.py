"""The CUDA API and kernel levels on a GPU: linking, agreement with PyTorch's profiler, overhead.

Workloads, on one CUDA device, random weights built from configs (nothing downloaded):
ResNet-50 inference at batch 1 and 32, a ResNet-50 training step (forward, backward, SGD) at
batch 32, and BERT-base inference at batch 8, sequence 128. For each:

* one run with every level (model, layer, cuda_api, kernel): kernels recorded, the share linked
  to a launching CUDA call and to a layer, records CUPTI dropped, the record path (C or Python);
* latency (median of synchronised calls) with no tracing, the model level, model+layer and
  model+layer+cuda_api+kernel, measured side by side in one process: ``--rounds`` rounds, each
  running every level set in turn (the order rotated from round to round, so clock ramps and
  cache warmth fall on each alike), and the overhead of each against the untraced run;
* then PyTorch's profiler (CPU + CUDA activities) on the same calls: its kernel count, kernel
  time and overhead, in rounds interleaved with untraced ones. The profiler comes after every
  xsp run: once it has traced CUDA it keeps CUPTI's one subscription for the process.

Goals (issue 33): overhead of every level at most +15% at batch 1 and +3% at batch 32, below the
profiler's, with the profiler's kernel count and no record dropped.

Needs a CUDA GPU and cupti-python; without them it says so and exits 2. Results go to
benchmarks/results/gpu.md and benchmarks/results/gpu.json with the device name.

Also: the untraced latency before any xsp session of the process and after them all (CUPTI must
leave nothing attached: PyTorch's profiler is known to leave 10-20% behind, pytorch#144455), and
the clock each run used with the drift it saw.

Usage: python benchmarks/gpu.py [--iterations N] [--warmup N] [--rounds N] [--workloads 1,32] [--name gpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "benchmarks" / "results" / "gpu.md"
JSON_RESULTS = ROOT / "benchmarks" / "results" / "gpu.json"
ALL_LEVELS = "model,layer,cuda_api,kernel"
LEVEL_SETS = {"none": None, "model": "model", "model+layer": "model,layer", "model+layer+cuda_api+kernel": ALL_LEVELS}
PROFILER = "torch.profiler"


@dataclass
class Workload:
    """One call to time (``step()``), and how to tell it in the results."""

    key: str
    label: str
    step: Callable[[], Any]


def synchronised_latencies_ms(model: torch.nn.Module, x: torch.Tensor, iterations: int,
                              after_each: Callable[[], Any] | None = None) -> list[float]:
    """``iterations`` calls of ``model(x)``, each timed between two device synchronisations (ms);
    ``after_each`` runs after each call, outside its time."""
    return _timed(lambda: model(x), iterations, after_each)


def _timed(step: Callable[[], Any], iterations: int, after_each: Callable[[], Any] | None = None) -> list[float]:
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - start) / 1e6)
        if after_each is not None:
            after_each()
    return times


@contextlib.contextmanager
def _levels(levels: str | None) -> Iterator[None]:
    import xsp

    if levels is None:
        yield
        return
    with xsp.trace(levels=levels, output=None):
        yield


@contextlib.contextmanager
def _profiler() -> Iterator[Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield prof


def _rotating_medians(step: Callable[[], Any], labels: list[str], enter: Callable[[str], Any], iterations: int,
                      rounds: int) -> dict[str, float]:
    """Median latency (ms) of ``step`` under each label's context, rounds rotating the order."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            with enter(label):
                times[label] += _timed(step, iterations)
    return {label: statistics.median(values) for label, values in times.items()}


def _linking(workload: Workload, iterations: int) -> dict[str, Any]:
    """xsp's kernels of ``iterations`` calls with every level: counts, links, losses, record path."""
    import xsp
    from xsp.core import schema as col
    from xsp.core.schema import Level, SpanKind
    from xsp.table.walks import nearest_ancestor, of_level, parent_positions

    with xsp.trace(levels=ALL_LEVELS, output=None) as session:
        for _ in range(iterations):
            workload.step()
        torch.cuda.synchronize()
    trace = session.trace
    spans = trace.spans
    kernels = np.flatnonzero((spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    parents = parent_positions(spans)
    launched = spans[col.LEVEL].to_numpy()[parents[kernels]] == Level.CUDA_API.value
    layered = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)[kernels] >= 0
    details = trace.metadata["tracer_details"].get("kernel", {})
    # CUPTI's drops and the records it timed wrong (gpu_no_timestamp, gpu_time_outside_session...)
    dropped = {what: count for what, count in (trace.metadata.get("dropped") or {}).items()
               if "CUPTI" in what or what.startswith("gpu_")}
    return {"kernels": len(kernels), "launched": float(launched.mean()) if len(kernels) else 0.0,
            "layered": float(layered.mean()) if len(kernels) else 0.0,
            "api_calls": int((spans[col.LEVEL] == Level.CUDA_API.value).sum()),
            "kernel_ms": spans[col.DURATION_NS].to_numpy()[kernels].sum() / 1e6,
            "dropped_records": sum(dropped.values()), "dropped": dropped,
            "buffers_with_records_dropped": details.get("buffers_with_records_dropped"),
            "most_records_dropped_in_a_buffer": details.get("most_records_dropped_in_a_buffer"),
            "record_path": details.get("record_path"), "cupti_release": details.get("cupti_release"),
            "why_not_c": details.get("why_not_c"), "warnings": trace.metadata.get("warnings", []),
            "clock": details.get("clock"), "clock_drift_ns": details.get("drift_ns")}


def _profiler_kernels(workload: Workload, iterations: int) -> tuple[int, float]:
    """PyTorch's profiler's kernel count and kernel ms for ``iterations`` calls."""
    with _profiler() as prof:
        for _ in range(iterations):
            workload.step()
        torch.cuda.synchronize()
    theirs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    return len(theirs), sum(e.device_time for e in theirs) / 1e3


WORKLOADS = ("1", "32", "train_32", "bert_8")
"""Every workload's key, in the order they run."""


def _infer(model: torch.nn.Module, **kwargs: Any) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return model(**kwargs)
    return step


def _workloads(keys: list[str]) -> list[Workload]:
    """The workloads named by ``keys`` (see :data:`WORKLOADS`), built on the GPU."""
    from resnet50_inference import build_model

    made = []
    resnet = build_model().cuda() if {"1", "32"} & set(keys) else None
    for key in keys:
        if key in ("1", "32"):
            images = torch.randn(int(key), 3, 224, 224, device="cuda")
            made.append(Workload(key, f"ResNet-50 inference, batch {key}", _infer(resnet, pixel_values=images)))
        elif key == "train_32":
            made.append(Workload(key, "ResNet-50 training step (SGD), batch 32", training_step(build_model())))
        elif key == "bert_8":
            from bert_inference import build_model as build_bert

            tokens = {"input_ids": torch.randint(0, 30522, (8, 128), device="cuda"),
                      "attention_mask": torch.ones(8, 128, dtype=torch.long, device="cuda")}
            made.append(Workload(key, "BERT-base inference, batch 8 x 128 tokens", _infer(build_bert().cuda(),
                                                                                            **tokens)))
    return made


def training_step(model: torch.nn.Module) -> Callable[[], None]:
    """One ResNet-50 training step on the GPU at batch 32 (forward, cross-entropy, backward, SGD), as a call."""
    trained = model.cuda().train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
    images, labels = torch.randn(32, 3, 224, 224, device="cuda"), torch.randint(0, 1000, (32,), device="cuda")

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = trained(images).logits
        torch.nn.functional.cross_entropy(logits, labels).backward()
        optimizer.step()

    return train_step


def cuda_problem(script: str) -> str | None:
    """Why ``script`` cannot measure the CUDA levels here (no CUDA GPU, or no CUPTI to use), or None."""
    if not torch.cuda.is_available():
        return f"{script} needs a CUDA GPU; none is visible here"
    from xsp.tracers.cuda.source import probe

    reason = probe()
    return None if reason is None else f"the CUDA levels cannot run here: {reason}"


def _pct(value: float, base: float) -> float:
    return round((value / base - 1) * 100, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"which to run, comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--name", default="gpu", help="results as benchmarks/results/NAME.md and NAME.json")
    args = parser.parse_args(argv)
    keys = [key for key in args.workloads.split(",") if key]
    unknown = set(keys) - set(WORKLOADS)
    if unknown or not keys:
        parser.error(f"--workloads: one or more of {', '.join(WORKLOADS)}")
    problem = cuda_problem("benchmarks/gpu.py")
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    workloads = _workloads(keys)
    results: dict[str, dict[str, Any]] = {}
    for workload in workloads:  # untraced, before any xsp session of this process
        for _ in range(args.warmup):
            workload.step()
        torch.cuda.synchronize()
        results[workload.key] = {"untraced_before_ms": statistics.median(_timed(workload.step,
                                                                               args.iterations * args.rounds))}
    for workload in workloads:
        linking = _linking(workload, args.iterations)
        latency = _rotating_medians(workload.step, list(LEVEL_SETS), lambda label: _levels(LEVEL_SETS[label]),
                                    args.iterations, args.rounds)
        results[workload.key].update(linking=linking, latency_ms=latency)
        print(f"{workload.label}: {latency}", flush=True)
    for workload in workloads:  # untraced again, after every xsp session: CUPTI must have left nothing behind
        after = statistics.median(_timed(workload.step, args.iterations * args.rounds))
        results[workload.key]["untraced_after_ms"] = after
        print(f"{workload.label}: untraced {results[workload.key]['untraced_before_ms']:.3f} ms before xsp, "
              f"{after:.3f} ms after", flush=True)
    for workload in workloads:  # last: the profiler keeps CUPTI for the rest of the process
        kernels, kernel_ms = _profiler_kernels(workload, args.iterations)
        profiled = _rotating_medians(workload.step, ["none", PROFILER],
                                     lambda label: _profiler() if label == PROFILER else contextlib.nullcontext(),
                                     args.iterations, args.rounds)
        results[workload.key].update(profiler_kernels=kernels, profiler_kernel_ms=kernel_ms, profiler_ms=profiled)
    summary = _summary(device, workloads, results, args)
    results_md = RESULTS.with_name(f"{args.name}.md")
    results_md.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    record(_markdown(device, workloads, results, summary, args), results_md)
    return 0


def _summary(device: str, workloads: list[Workload], results: dict[str, dict[str, Any]],
             args: argparse.Namespace) -> dict[str, Any]:
    """gpu.json: per workload the overhead of every level and of the profiler, kernels, drops."""
    entries = {}
    for workload in workloads:
        r = results[workload.key]
        latency, profiled, linking = r["latency_ms"], r["profiler_ms"], r["linking"]
        entries[workload.key] = {
            "workload": workload.label,
            "latency_ms": latency["none"],
            "model_overhead_pct": _pct(latency["model"], latency["none"]),
            "layer_overhead_pct": _pct(latency["model+layer"], latency["none"]),
            "kernel_overhead_pct": _pct(latency["model+layer+cuda_api+kernel"], latency["none"]),
            "profiler_overhead_pct": _pct(profiled[PROFILER], profiled["none"]),
            "kernels_xsp": linking["kernels"], "kernels_profiler": r["profiler_kernels"],
            "kernel_ms_xsp": round(linking["kernel_ms"], 3), "kernel_ms_profiler": round(r["profiler_kernel_ms"], 3),
            "linked_to_launch": round(linking["launched"], 4), "linked_to_layer": round(linking["layered"], 4),
            "dropped_records": linking["dropped_records"], "record_path": linking["record_path"],
            "untraced_before_ms": round(r["untraced_before_ms"], 4),
            "untraced_after_ms": round(r["untraced_after_ms"], 4),
            "left_behind_pct": _pct(r["untraced_after_ms"], r["untraced_before_ms"]),
            "clock": linking["clock"], "clock_drift_ns": linking["clock_drift_ns"],
        }
    first = results[workloads[0].key]["linking"]
    return {"device": device, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "cupti": {"cupti_python": _version("cupti-python"),
                                                  "libcupti": first["cupti_release"],
                                                  "record_path": first["record_path"],
                                                  "why_not_c": first["why_not_c"]},
            "iterations": args.iterations, "rounds": args.rounds,
            "batches": {key: entries[key] for key in ("1", "32") if key in entries},
            "workloads": {key: value for key, value in entries.items() if key not in ("1", "32")}}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _markdown(device: str, workloads: list[Workload], results: dict[str, dict[str, Any]], summary: dict[str, Any],
              args: argparse.Namespace) -> list[str]:
    cupti = summary["cupti"]
    lines = [
        "# CUDA levels on a GPU", "",
        f"Last run: {summary['date']}, device **{device}**, torch {torch.__version__}, cupti-python "
        f"{cupti['cupti_python']}, libcupti {cupti['libcupti']}, records read by the {cupti['record_path']} path, "
        f"Python {platform.python_version()}; `python benchmarks/gpu.py --iterations {args.iterations} "
        f"--rounds {args.rounds}` (also benchmarks/results/gpu.json).", "",
        f"## Linking and agreement with PyTorch's profiler ({args.iterations} calls, separate runs)", "",
        "| workload | kernels (xsp) | kernels (profiler) | linked to a launch | linked to a layer | kernel ms (xsp) "
        "| kernel ms (profiler) | difference | CUDA API calls (xsp) | records dropped |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload in workloads:
        r = results[workload.key]
        link = r["linking"]
        difference = (link["kernel_ms"] - r["profiler_kernel_ms"]) / r["profiler_kernel_ms"]
        lines.append(f"| {workload.label} | {link['kernels']} | {r['profiler_kernels']} | {link['launched']:.1%} | "
                     f"{link['layered']:.1%} | {link['kernel_ms']:.2f} | {r['profiler_kernel_ms']:.2f} | "
                     f"{difference:+.1%} | {link['api_calls']} | {link['dropped_records']} |")
    lines += ["", f"## Latency by levels traced (median ms of {args.rounds} x {args.iterations} synchronised calls "
              "each; overhead against no tracing in the same rounds)", "",
              "| workload | none | model | model+layer | model+layer+cuda_api+kernel | torch.profiler (CPU+CUDA) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for workload in workloads:
        r = results[workload.key]
        latency, profiled = r["latency_ms"], r["profiler_ms"]
        cells = [f"{latency['none']:.2f}"] + [
            f"{latency[label]:.2f} ({_pct(latency[label], latency['none']):+.1f}%)"
            for label in ("model", "model+layer", "model+layer+cuda_api+kernel")]
        cells.append(f"{profiled[PROFILER]:.2f} ({_pct(profiled[PROFILER], profiled['none']):+.1f}%)")
        lines.append(f"| {workload.label} | " + " | ".join(cells) + " |")
    lines += ["", "## Nothing left behind: untraced latency before any xsp session and after them all "
              f"(median ms of {args.rounds * args.iterations} synchronised calls)", "",
              "| workload | before | after | change | clock | clock drift seen (ns) |",
              "| --- | ---: | ---: | ---: | --- | ---: |"]
    for workload in workloads:
        r = results[workload.key]
        lines.append(f"| {workload.label} | {r['untraced_before_ms']:.3f} | {r['untraced_after_ms']:.3f} | "
                     f"{_pct(r['untraced_after_ms'], r['untraced_before_ms']):+.1f}% | {r['linking']['clock']} | "
                     f"{r['linking']['clock_drift_ns']} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
