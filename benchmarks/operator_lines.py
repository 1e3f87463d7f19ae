"""What the lines of operators cost: xsp's operator level with and without them, side by side
with PyTorch's profiler with and without ``with_stack=True`` (its Python stacks), in one process.

Two models, called under ``torch.no_grad()`` on one CPU thread: a forward of 80 small torch
calls on three lines a block (a module call, a function, tensor arithmetic: the most operators a
line, the worst case for the lines), and a two-layer ``nn.TransformerEncoder``. Each round runs
every configuration for the same number of steps, in a rotating order; the table gives the
median time a step over the rounds, and the ratios the issue sets goals for: lines over the
operator level without them (goal at most 1.3x) against with_stack over the profiler without it.

Prints a table and records it in benchmarks/results/operator_lines.md.

Usage: python benchmarks/operator_lines.py [--rounds N] [--steps N]   (about two minutes)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch
from _results import record
from torch import nn
from torch.profiler import ProfilerActivity, profile

import xsp
from xsp.core.metadata import cpu_model
from xsp.record.operator_lines import OPERATOR_LINES_VARIABLE

RESULTS = Path(__file__).resolve().parent / "results" / "operator_lines.md"


class SmallCalls(nn.Module):
    """20 blocks of a Linear, a relu and two arithmetic operators: 80 torch calls a step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(64, 64) for _ in range(20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for f in self.fc:
            x = f(x)
            x = torch.relu(x)
            x = x * 0.5 + 1
        return x


def models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2,
                                    enable_nested_tensor=False)
    return {"80 small torch calls": (SmallCalls().eval(), torch.randn(8, 64)),
            "TransformerEncoder, 2 layers": (encoder.eval(), torch.randn(4, 16, 64))}


@contextmanager
def xsp_operator(folder: Path, lines: bool) -> Iterator[None]:
    os.environ[OPERATOR_LINES_VARIABLE] = "1" if lines else "0"
    try:
        with xsp.trace(levels="operator", output=folder / f"lines-{lines}.xsp.parquet"):
            yield
    finally:
        os.environ.pop(OPERATOR_LINES_VARIABLE, None)


def configurations(folder: Path) -> dict[str, Callable[[], AbstractContextManager[object]]]:
    return {
        "plain": nullcontext,
        "xsp operator": lambda: xsp_operator(folder, False),
        "xsp operator + lines": lambda: xsp_operator(folder, True),
        "torch.profiler": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True),
        "torch.profiler with_stack": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                                     with_stack=True),
    }


def step_us(model: nn.Module, x: torch.Tensor, steps: int,
            around: Callable[[], AbstractContextManager[object]]) -> float:
    with around(), torch.no_grad():
        model(x)  # the first call after a start is not timed
        start = time.perf_counter_ns()
        for _ in range(steps):
            model(x)
        return (time.perf_counter_ns() - start) / steps / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        configs = configurations(folder)
        times: dict[tuple[str, str], list[float]] = {}
        for model_name, (model, x) in models().items():
            names = list(configs)
            for round_number in range(args.rounds):
                for name in names[round_number % len(names):] + names[:round_number % len(names)]:
                    times.setdefault((model_name, name), []).append(step_us(model, x, args.steps, configs[name]))
    median = {key: statistics.median(values) for key, values in times.items()}
    lines = [
        "# Lines of operators: what they cost",
        "",
        f"`python benchmarks/operator_lines.py --rounds {args.rounds} --steps {args.steps}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d}, {cpu_model() or platform.processor()}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, one CPU thread. Median µs a step over "
        f"{args.rounds} rounds, every configuration in each round.",
        "",
        "| model | plain | xsp operator | + lines | lines ratio | torch.profiler | with_stack | with_stack ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model_name in models():
        m = {name: median[(model_name, name)] for name in configurations(Path("."))}
        lines.append(
            f"| {model_name} | {m['plain']:.0f} | {m['xsp operator']:.0f} | {m['xsp operator + lines']:.0f} | "
            f"{m['xsp operator + lines'] / m['xsp operator']:.2f}x | {m['torch.profiler']:.0f} | "
            f"{m['torch.profiler with_stack']:.0f} | "
            f"{m['torch.profiler with_stack'] / m['torch.profiler']:.2f}x |")
    lines += ["", "Goal: lines at most 1.3x the operator level without them, and below with_stack's ratio."]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
