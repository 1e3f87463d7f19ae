"""Where an unsampled always-on step's cost falls, around and inside the example's model, in one loop.

The example service's model (examples/service/serve.py: an embedding, a 2-layer transformer
encoder, a linear head; 1 torch thread) is called in a loop, each call under a current
OpenTelemetry span as a request's would be, inside ``xsp.trace(levels=("model", "layer"),
sample=<fraction>)`` with its windows never closing. In alternating blocks of 10 calls,
``nn.Module.__call__`` is xsp's wrapper (*on*) or the plain one (*off*); then the same with the C
timer of benchmarks/timer_floor.c in the wrapper's place: the floor of any model-level tracer.
Each call is timed in parts by readings taken inside the model's own forward and its encoder's
(both replaced on the instances by timing shims, in every variant alike): *before* (the call to
the forward's first line), *embed* (the forward's start to the encoder's), *encoder*, *head*
(the encoder's end to the forward's), *after* (the forward's end to the call's return).
Reported: each part's median, on and off, and what the wrapper adds (on - off, µs a call).

This is the instrument for the step's cost (issue 61's 1% goal): the service's latency ratios
(benchmarks/production.py, steps_in_process.py) cannot resolve a change of a microsecond.

Usage: python benchmarks/step_parts.py [--blocks 300] [--sample 0.01]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _results import record
from production import last_run_line
from split_server import install_timer
from torch import nn

SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"
sys.path.insert(0, str(SERVICE))
import serve  # noqa: E402  (the example service, found beside it)

RESULTS = Path(__file__).resolve().parent / "results" / "step_parts.md"
PARTS = ("before", "embed", "encoder", "head", "after", "total")
BLOCK = 10
"""Calls in a block: on and off alternate this often."""


class TimedModel:
    """The model with timing shims on its forward and its encoder's forward: each call's part
    boundaries, read with perf_counter_ns."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.marks = [0, 0, 0, 0]
        forward, encoder_forward = model.forward, model.encoder.forward
        clock, marks = time.perf_counter_ns, self.marks

        def timed_forward(tokens: torch.Tensor) -> torch.Tensor:
            marks[0] = clock()
            out = forward(tokens)
            marks[3] = clock()
            return out

        def timed_encoder(*args: Any, **kwargs: Any) -> torch.Tensor:
            marks[1] = clock()
            out = encoder_forward(*args, **kwargs)
            marks[2] = clock()
            return out

        model.forward = timed_forward  # type: ignore[method-assign]
        model.encoder.forward = timed_encoder  # type: ignore[method-assign]

    def call(self, tokens: torch.Tensor) -> tuple[int, ...]:
        """One call's parts, in nanoseconds (as PARTS)."""
        marks, clock = self.marks, time.perf_counter_ns
        start = clock()
        self.model(tokens)
        end = clock()
        return (marks[0] - start, marks[1] - marks[0], marks[2] - marks[1], marks[3] - marks[2], end - marks[3],
                end - start)


def alternate(timed: TimedModel, tokens: torch.Tensor, tracer: Any, on: Any, off: Any,
              blocks: int) -> dict[bool, list[tuple[int, ...]]]:
    """``blocks`` blocks of calls with ``nn.Module.__call__`` as ``on`` and as ``off`` each, in
    alternating order; each call's parts, by whether it was on."""
    parts: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    with torch.inference_mode():
        for block in range(blocks):
            for state in ((True, False) if block % 2 else (False, True)):
                nn.Module.__call__ = on if state else off  # type: ignore[method-assign]
                for _ in range(BLOCK):
                    with tracer.start_as_current_span("request"):
                        parts[state].append(timed.call(tokens))
    return parts


def medians_us(calls: list[tuple[int, ...]]) -> list[float]:
    return [statistics.median(call[index] for call in calls) / 1e3 for index in range(len(PARTS))]


def timer_wrapper(original: Callable[..., Any]) -> Any:
    """The C timer of timer_floor.c around ``original`` (built with the machine's compiler)."""
    saved = nn.Module.__dict__["__call__"]
    nn.Module.__call__ = original  # type: ignore[method-assign]
    try:
        install_timer()
        return nn.Module.__dict__["__call__"]
    finally:
        nn.Module.__call__ = saved  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=300, help=f"blocks of {BLOCK} calls per state and variant")
    parser.add_argument("--sample", type=float, default=0.01, help="xsp's sample fraction")
    args = parser.parse_args(argv)
    if args.blocks < 2:
        parser.error("--blocks must be 2 or more")
    began = time.monotonic()
    import xsp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = serve.TinyTransformer().eval()
    timed = TimedModel(model)
    tokens = torch.randint(0, serve.VOCABULARY, (1, serve.SEQUENCE_LENGTH))
    tracer = serve.tracer_provider().get_tracer("step_parts")
    results: dict[str, dict[bool, list[tuple[int, ...]]]] = {}
    folder = tempfile.TemporaryDirectory(prefix="xsp-step-parts-")
    with folder, xsp.trace(levels=("model", "layer"), sample=args.sample, output=Path(folder.name) / "run.xsp.parquet",
                           window_s=1e9):
        wrapper = nn.Module.__dict__["__call__"]
        original = getattr(wrapper, "original", None)
        if original is None:
            raise SystemExit("xsp's C wrapper is not built here: nothing to measure")
        timer = timer_wrapper(original)
        alternate(timed, tokens, tracer, wrapper, original, 5)  # warm-up
        try:
            results["xsp"] = alternate(timed, tokens, tracer, wrapper, original, args.blocks)
            results["timer"] = alternate(timed, tokens, tracer, timer, original, args.blocks)
        finally:
            nn.Module.__call__ = wrapper  # type: ignore[method-assign]  # xsp takes its own out
    head = f"{'variant':<7} {'state':<5} {'calls':>6} " + " ".join(f"{part:>8}" for part in PARTS)
    lines = [head]
    for name, parts in results.items():
        on, off = medians_us(parts[True]), medians_us(parts[False])
        lines.append(f"{name:<7} {'on':<5} {len(parts[True]):>6,} " + " ".join(f"{value:>8.2f}" for value in on))
        lines.append(f"{name:<7} {'off':<5} {len(parts[False]):>6,} " + " ".join(f"{value:>8.2f}" for value in off))
        lines.append(f"{name:<7} {'adds':<5} {'':>6} " + " ".join(f"{a - b:>+8.2f}" for a, b in zip(on, off)))
    command = " ".join(["python benchmarks/step_parts.py", *(sys.argv[1:] if argv is None else argv)])
    record(["# Where an unsampled step's cost falls", "", last_run_line(command, began), "",
            f"The example's model in a loop, a current OpenTelemetry span a call, inside `xsp.trace(levels=(\"model\", "
            f"\"layer\"), sample={args.sample:g})` (windows never closing). {args.blocks} blocks of {BLOCK} calls per "
            "state, *on* (the variant's wrapper in `nn.Module.__call__`) and *off* (the plain one) alternating; "
            "*xsp*: xsp's wrapper, *timer*: the C timer of benchmarks/timer_floor.c. Medians in µs of each part of "
            "a call (see the script's docs), and what the wrapper adds (*adds*: on - off).", "",
            "```", *lines, "```"], RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
