"""The CUDA API and kernel levels on a GPU: linking, agreement with PyTorch's profiler, overhead.

ResNet-50 inference (random weights, from its config) at batch 1 and 32, on one CUDA device:

* one run with every level (model, layer, cuda_api, kernel): the share of kernels linked to
  a launching CUDA call and to a layer;
* a separate run of the same iterations under PyTorch's profiler (CPU + CUDA): its kernel
  count and total kernel time against xsp's (goal: equal counts, time within 5%). The
  profiler runs after every xsp run: PyTorch's profiler keeps CUPTI's one subscription for
  the rest of the process once it has traced CUDA, and xsp's CUDA levels cannot start then;
* model latency (median of the timed iterations, each synchronised) with no tracing, the
  model level, model+layer, and model+layer+cuda_api+kernel, measured side by side in one
  process: ``--rounds`` rounds, each running every level set in turn (the order rotated
  from round to round, so clock ramps and cache warmth fall on each alike), and the
  overhead of each against the untraced run.

Needs a CUDA GPU and cupti-python; without them it says so and exits 2. Results go to
benchmarks/results/gpu.md with the device name.

Usage: python benchmarks/gpu.py [--iterations N] [--warmup N] [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "benchmarks" / "results" / "gpu.md"
LEVEL_SETS = {"none": None, "model": "model", "model+layer": "model,layer",
              "model+layer+cuda_api+kernel": "model,layer,kernel"}


def synchronised_latencies_ms(model: torch.nn.Module, x: torch.Tensor, iterations: int,
                              after_each: Callable[[], Any] | None = None) -> list[float]:
    """``iterations`` calls of ``model(x)``, each timed between two device synchronisations (ms);
    ``after_each`` runs after each call, outside its time."""
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        model(x)
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - start) / 1e6)
        if after_each is not None:
            after_each()
    return times


def _latency_ms(model: torch.nn.Module, x: torch.Tensor, iterations: int, rounds: int) -> dict[str, float]:
    """Median latency per level set over ``rounds`` rounds that run every set, in a rotating order."""
    labels = list(LEVEL_SETS)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            with _levels(LEVEL_SETS[label]):
                times[label] += synchronised_latencies_ms(model, x, iterations)
    return {label: statistics.median(values) for label, values in times.items()}


@contextlib.contextmanager
def _levels(levels: str | None) -> Iterator[None]:
    import xsp

    if levels is None:
        yield
        return
    with xsp.trace(levels=levels, output=None):
        yield


def _linking(batch: int, model: torch.nn.Module, x: torch.Tensor, iterations: int) -> dict[str, Any]:
    """xsp's kernels of ``iterations`` calls: how many, how many linked to a launch and a layer."""
    import xsp
    from xsp import schema as col
    from xsp.schema import Level, SpanKind
    from xsp.tree import nearest_ancestor, of_level, parent_positions

    with xsp.trace(levels="model,layer,kernel", output=None) as session:
        for _ in range(iterations):
            model(x)
        torch.cuda.synchronize()
    spans = session.trace.spans
    kernels = np.flatnonzero((spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    parents = parent_positions(spans)
    launched = spans[col.LEVEL].to_numpy()[parents[kernels]] == Level.CUDA_API.value
    layered = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)[kernels] >= 0
    api_calls = int((spans[col.LEVEL] == Level.CUDA_API.value).sum())
    return {"batch": batch, "kernels": len(kernels), "launched": float(launched.mean()) if len(kernels) else 0.0,
            "layered": float(layered.mean()) if len(kernels) else 0.0, "api_calls": api_calls,
            "kernel_ms": spans[col.DURATION_NS].to_numpy()[kernels].sum() / 1e6,
            "hierarchy": session.trace.metadata["hierarchy"]}


def _profiler_kernels(model: torch.nn.Module, x: torch.Tensor, iterations: int) -> tuple[int, float]:
    """PyTorch's profiler's kernel count and kernel ms for ``iterations`` calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            model(x)
        torch.cuda.synchronize()
    theirs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    return len(theirs), sum(e.device_time for e in theirs) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    from xsp.tracers._cupti import probe

    reason = probe()
    if reason is not None:
        print(f"the CUDA levels cannot run here: {reason}", file=sys.stderr)
        return 2
    from resnet50_inference import build_model

    device = torch.cuda.get_device_name(0)
    model = build_model().cuda()
    linking, latency = [], []
    inputs = {batch: torch.randn(batch, 3, 224, 224, device="cuda") for batch in (1, 32)}
    with torch.no_grad():
        for batch, x in inputs.items():
            for _ in range(args.warmup):
                model(x)
            torch.cuda.synchronize()
            linking.append(_linking(batch, model, x, args.iterations))
            latency.append({"batch": batch, **_latency_ms(model, x, args.iterations, args.rounds)})
        for row in linking:  # last: the profiler keeps CUPTI for the rest of the process
            row["profiler_kernels"], row["profiler_kernel_ms"] = _profiler_kernels(
                model, inputs[row["batch"]], args.iterations)
    lines = [
        "# CUDA levels on a GPU", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, device **{device}**, torch {torch.__version__}, "
        f"Python {platform.python_version()}; `python benchmarks/gpu.py --iterations {args.iterations} "
        f"--rounds {args.rounds}`.", "",
        f"## Linking and agreement with PyTorch's profiler (ResNet-50 inference, {args.iterations} calls, "
        "separate runs)", "",
        "| batch | kernels (xsp) | kernels (profiler) | linked to a launch | linked to a layer | kernel ms (xsp) "
        "| kernel ms (profiler) | difference | CUDA API calls (xsp) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in linking:
        difference = (r["kernel_ms"] - r["profiler_kernel_ms"]) / r["profiler_kernel_ms"]
        lines.append(f"| {r['batch']} | {r['kernels']} | {r['profiler_kernels']} | {r['launched']:.1%} | "
                     f"{r['layered']:.1%} | {r['kernel_ms']:.2f} | {r['profiler_kernel_ms']:.2f} | {difference:+.1%} "
                     f"| {r['api_calls']} |")
    lines += ["", f"## Model latency by levels traced (median ms of {args.rounds} x {args.iterations} synchronised "
              "calls each; overhead against no tracing)", "",
              "| batch | " + " | ".join(LEVEL_SETS) + " |", "| ---: |" + " ---: |" * len(LEVEL_SETS)]
    for row in latency:
        base = row["none"]
        cells = [f"{row[label]:.2f}" + ("" if label == "none" else f" ({row[label] / base - 1:+.1%})")
                 for label in LEVEL_SETS]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
