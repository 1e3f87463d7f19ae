"""What an unsampled always-on step costs when the CPU's caches no longer hold xsp.

A service's model call is one step every request. Between two steps the program runs its own
code (the model's forward, the web framework, other processes on the core), which evicts what
xsp's step touched: its machine code and its objects. The step then pays for memory reads that
a loop calling a small model in a tight loop never shows. This measures it directly.

A one-leaf model (``nn.Sequential(nn.Linear(4, 4))``) is called under a current OpenTelemetry
span (as a request's would be), inside ``xsp.trace(levels=("model", "layer"), sample=0.0)``
(every call a step, none recorded deeper; the windows never close while it runs). Before each
call, a buffer of ``--evict-mb`` is written (not timed): *0* leaves the caches warm, a few MB
empties the core's own caches, more than the last-level cache empties them all. Only the model
call is timed. In alternating blocks, ``nn.Module.__call__`` is xsp's wrapper or the plain one
(*xsp adds*: on - off), then the C timer of benchmarks/timer_floor.c (the floor of any
model-level tracer: two clock reads around the call).

Usage: python benchmarks/cold_step.py [--blocks 20] [--calls 100] [--evict-mb 0 4 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _results import record
from production import last_run_line
from step_parts import timer_wrapper
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "cold_step.md"


def timed_calls(model: nn.Module, tokens: torch.Tensor, tracer: Any, buffer: torch.Tensor | None,
                calls: int) -> float:
    """The median model call, µs, each after ``buffer`` is written (where given)."""
    clock = time.perf_counter_ns
    taken: list[int] = []
    with torch.inference_mode():
        for _ in range(calls):
            if buffer is not None:
                buffer.add_(1.0)
            with tracer.start_as_current_span("request"):
                began = clock()
                model(tokens)
                taken.append(clock() - began)
    return statistics.median(taken) / 1e3


def paired(model: nn.Module, tokens: torch.Tensor, tracer: Any, buffer: torch.Tensor | None, on: Callable[..., Any],
           off: Callable[..., Any], blocks: int, calls: int) -> tuple[float, float, list[float]]:
    """Blocks with ``nn.Module.__call__`` as ``on`` and ``off`` in alternating order: the median
    off call, the median on call, and each block pair's on - off (µs)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for block in range(blocks):
        for state in ((True, False) if block % 2 else (False, True)):
            nn.Module.__call__ = on if state else off  # type: ignore[method-assign]
            times[state].append(timed_calls(model, tokens, tracer, buffer, calls))
    return (statistics.median(times[False]), statistics.median(times[True]),
            [a - b for a, b in zip(times[True], times[False])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="blocks of each state, alternating")
    parser.add_argument("--calls", type=int, default=100, help="calls a block")
    parser.add_argument("--evict-mb", type=int, nargs="+", default=[0, 4, 64],
                        help="MB written before each call (0: none)")
    args = parser.parse_args(argv)
    began = time.monotonic()
    from opentelemetry.sdk.trace import TracerProvider

    import xsp

    torch.set_num_threads(1)
    tracer = TracerProvider().get_tracer("cold_step")
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    tokens = torch.randn(1, 4)
    rows: list[str] = []
    output = os.path.join(tempfile.mkdtemp(), "cold.xsp.parquet")
    with xsp.trace(levels=("model", "layer"), sample=0.0, window_s=10 ** 6, output=output):  # no window closes
        wrapper = nn.Module.__dict__["__call__"]
        original = getattr(wrapper, "original", None)
        if original is None:
            raise SystemExit("xsp's C wrapper is not built here: nothing to measure")
        timer = timer_wrapper(original)
        try:
            for evict_mb in args.evict_mb:
                buffer = torch.zeros(evict_mb * 2 ** 20 // 4) if evict_mb else None
                paired(model, tokens, tracer, buffer, wrapper, original, 2, args.calls)  # warm-up
                for name, on in (("xsp", wrapper), ("timer", timer)):
                    off_us, on_us, adds = paired(model, tokens, tracer, buffer, on, original, args.blocks, args.calls)
                    rows.append(f"{evict_mb:>8} {name:6s} {off_us:8.2f} {on_us:8.2f} {statistics.median(adds):+8.2f} "
                                f"{sum(a > 0 for a in adds):>4}/{len(adds)}")
                    print(rows[-1], file=sys.stderr)
        finally:
            nn.Module.__call__ = wrapper  # type: ignore[method-assign]  # xsp takes its own out
    command = "python benchmarks/cold_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        "# An unsampled step, with the caches warm and cold", "",
        last_run_line(command.strip(), began), "",
        f"A one-leaf model called under a current OpenTelemetry span, inside `xsp.trace(levels=(\"model\", "
        f"\"layer\"), sample=0.0)`; before each call a buffer of *evict MB* is written (not timed). "
        f"{args.blocks} blocks of {args.calls} calls in each state, alternating; medians in µs of a model call, "
        "*off* (plain `nn.Module.__call__`) and *on* (the wrapper: *xsp*'s, or the C *timer*'s of "
        "benchmarks/timer_floor.c); *adds*: the median over block pairs of on - off, and in how many pairs "
        "it was above 0.", "",
        "```", f"{'evict MB':>8} {'wrap':6s} {'off µs':>8} {'on µs':>8} {'adds µs':>8} {'> 0':>7}", *rows, "```",
    ]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
