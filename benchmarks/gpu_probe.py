"""Where the CUDA levels' host overhead goes: ResNet-50 inference at batch 1 on one GPU, variants side by side.

Each variant runs ``--iterations`` synchronised calls in one process and gives the median
latency, how often CUPTI's buffers were flushed, the wall time of the flushes, of the C path's
drains and of the Python path's buffer callback (on the flushing thread: it includes waiting
for the GIL), and how many records each read. The variants: no tracing; model+layer; every level
(records read in C); every level with records read through cupti-python (the fall-back); every
level without the per-step flush; without external correlation ids; CUPTI alone (activity kinds
enabled by hand, records only counted, flushed between calls, outside the timed call). Needs a
CUDA GPU and cupti-python; results go to benchmarks/results/gpu_probe.md.

Usage: python benchmarks/gpu_probe.py [--iterations N]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _results import record
from gpu import synchronised_latencies_ms

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "benchmarks" / "results" / "gpu_probe.md"
STATS: dict[str, float] = {}


def _timed_flush(flush: Callable[[int], Any]) -> Callable[[int], Any]:
    def timed(flag: int) -> Any:
        start = time.perf_counter_ns()
        try:
            return flush(flag)
        finally:
            STATS["flushes"] += 1
            STATS["flush ms"] += (time.perf_counter_ns() - start) / 1e6
    return timed


def _timed_callback(callback: Callable[[Any, Iterable[Any]], None]) -> Callable[[Any, Iterable[Any]], None]:
    def timed(store: Any, activities: Iterable[Any]) -> None:
        start = time.perf_counter_ns()
        activities = list(activities)
        callback(store, activities)
        STATS["callback records"] += len(activities)
        STATS["callback ms"] += (time.perf_counter_ns() - start) / 1e6
    return timed


def _timed_drain(drain: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def timed(records: Any) -> Any:
        start = time.perf_counter_ns()
        columns, lost = drain(records)
        STATS["drained records"] += len(columns)
        STATS["drain ms"] += (time.perf_counter_ns() - start) / 1e6
        return columns, lost
    return timed


def _median_ms(model: torch.nn.Module, x: torch.Tensor, iterations: int,
               after_each: Callable[[], Any] | None = None) -> float:
    return statistics.median(synchronised_latencies_ms(model, x, iterations, after_each))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_probe.py needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    from cupti import cupti
    from resnet50_inference import build_model

    import xsp
    from xsp.tracers.cuda import records as _cupti_records
    from xsp.tracers.cuda import source as _cupti
    from xsp.tracers.module_calls.interceptor import INTERCEPTOR

    flush = cupti.activity_flush_all
    cupti.activity_flush_all = _timed_flush(flush)
    callback = _cupti.RecordStore.on_completed
    timed_callback = _timed_callback(callback)
    _cupti.RecordStore.on_completed = timed_callback  # type: ignore[method-assign]
    _cupti_records.NativeRecords.drain = _timed_drain(_cupti_records.NativeRecords.drain)  # type: ignore[method-assign]
    request = _cupti._Flusher.request
    every = "model,layer,cuda_api,kernel"
    model, x = build_model().cuda(), torch.randn(1, 3, 224, 224, device="cuda")
    rows = []

    def variant(label: str, levels: str | None, setup: Callable[[], Any] | None = None) -> None:
        STATS.update({"flushes": 0, "flush ms": 0.0, "callback records": 0, "callback ms": 0.0, "drained records": 0,
                      "drain ms": 0.0})
        with torch.no_grad():
            if levels is None:
                median = _median_ms(model, x, args.iterations)
            else:
                with xsp.trace(levels=levels, output=None):
                    if setup is not None:
                        setup()
                    median = _median_ms(model, x, args.iterations)
        rows.append((label, median, dict(STATS)))
        print(rows[-1], flush=True)

    def cupti_alone(label: str, kinds: list[int]) -> None:
        seen = [0]

        def completed(activities: Iterable[Any]) -> None:
            seen[0] += sum(1 for _ in activities)

        cupti.activity_register_callbacks(lambda: (8 << 20, 0), completed)
        for kind in kinds:
            cupti.activity_enable(kind)
        with torch.no_grad():
            median = _median_ms(model, x, args.iterations, after_each=lambda: flush(0))
        flush(1)
        for kind in kinds:
            cupti.activity_disable(kind)
        rows.append((label, median, {"callback records": seen[0]}))
        print(rows[-1], flush=True)

    with torch.no_grad():
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
    variant("no tracing", None)
    variant("model,layer", "model,layer")
    variant("every level (records read in C)", every)
    variant("model,cuda_api,kernel (no layer pushes its id)", "model,cuda_api,kernel")
    _cupti._Flusher.request = lambda self: None  # type: ignore[method-assign]
    variant("every level; no flush at step ends", every)
    _cupti._Flusher.request = request  # type: ignore[method-assign]
    variant("every level; no external ids", every, setup=lambda: INTERCEPTOR.correlate(None))
    _cupti.SOURCE._use_native = False
    variant("every level, records read through cupti-python", every)
    _cupti.RecordStore.on_completed = lambda self, activities: None  # type: ignore[method-assign]
    variant("every level through cupti-python; a callback that keeps nothing", every)
    _cupti.RecordStore.on_completed = timed_callback  # type: ignore[method-assign]
    _cupti.SOURCE._use_native = True
    kinds = [int(kind) for kind in (*_cupti.ACTIVITY_KINDS, *_cupti.API_KINDS, _cupti.Kind.EXTERNAL_CORRELATION)]
    cupti_alone("CUPTI alone: kernels", [int(_cupti.Kind.CONCURRENT_KERNEL)])
    cupti_alone("CUPTI alone: kernels, runtime", [int(_cupti.Kind.CONCURRENT_KERNEL), int(_cupti.Kind.RUNTIME)])
    cupti_alone("CUPTI alone: every kind xsp reads", kinds)
    variant("no tracing, again", None)
    cupti.activity_flush_all = flush
    lines = [
        "# Where the CUDA levels' host overhead goes", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, device **{torch.cuda.get_device_name(0)}**, "
        f"torch {torch.__version__}, Python {platform.python_version()}; `python benchmarks/gpu_probe.py "
        f"--iterations {args.iterations}` (ResNet-50 inference, batch 1).", "",
        "| variant | median ms | flushes | flush ms | records drained in C | drain ms | records to the Python "
        "callback | callback ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, median, stats in rows:
        cells = [f"{stats[key]:,.0f}" if key in stats else "" for key in
                 ("flushes", "flush ms", "drained records", "drain ms", "callback records", "callback ms")]
        lines.append(f"| {label} | {median:.2f} | " + " | ".join(cells) + " |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
