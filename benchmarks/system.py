"""What the system level's sampler costs a training loop.

Prints a table and records it in benchmarks/results/system.md. One process runs a training
loop (an MLP of 4 x Linear(512, 512), batch 64, one torch thread: forward, loss, backward,
SGD step) inside ``xsp.trace(levels="model")`` for the whole benchmark, in blocks of
``--block-s`` seconds. Each block runs with the system level's sampler off, at 10 Hz (its
default) or at 100 Hz: a :class:`xsp.tracers.system.SystemTracer` started on the session's
recording for the block and stopped after it. Blocks rotate through the three settings
``--rounds`` times, so that the machine's drift (these machines are shared: ±10% between
identical runs minutes apart) falls on all three alike.

Reported per setting: the median time per iteration over its blocks, its cost against the
blocks without the sampler next to it (the median of the paired ratios; the goal at 10 Hz:
at most 1%), the sampler's CPU time per reading (``reading_cost_us``, as the tracer measures
it) and its share of one core at that rate.

Usage: python benchmarks/system.py [--block-s 0.5] [--rounds 45]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from _results import record
from torch import nn

import xsp
from xsp.core import state as _state
from xsp.tracers.system import SystemTracer

RESULTS = Path(__file__).resolve().parent / "results" / "system.md"
SETTINGS = {"sampler off": None, "system level, 10 Hz": 0.1, "system level, 100 Hz": 0.01}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=45)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))

    def step() -> None:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    per_iteration: dict[str, list[float]] = {name: [] for name in SETTINGS}
    paired: dict[str, list[float]] = {name: [] for name in SETTINGS}
    costs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    with xsp.trace(levels="model", output=Path(tempfile.mkdtemp()) / "system.xsp.parquet"):
        recording = _state.recording
        assert recording is not None
        for _ in range(20):
            step()
        for round_index in range(args.rounds):
            order = names[round_index % 3:] + names[:round_index % 3]
            found: dict[str, float] = {}
            for name in order:
                interval = SETTINGS[name]
                tracer = None if interval is None else SystemTracer(interval_s=interval)
                if tracer is not None:
                    tracer.start(recording)
                count, began = 0, time.perf_counter()
                while time.perf_counter() - began < args.block_s:
                    step()
                    count += 1
                found[name] = (time.perf_counter() - began) / count * 1e6
                if tracer is not None:
                    tracer.stop()
                    cost = tracer.metadata()["reading_cost_us"]
                    if cost:
                        costs[name].append(float(cost))
                    recording.samples.clear()
            for name in names:
                per_iteration[name].append(found[name])
                paired[name].append(found[name] / found["sampler off"] - 1)
            print(f"round {round_index + 1}: " + ", ".join(f"{n} {found[n]:.0f} us" for n in names), file=sys.stderr)
    lines = [
        "# System level: what the sampler costs a training loop",
        "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d} on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}; "
        f"`python benchmarks/system.py --block-s {args.block_s:g} --rounds {args.rounds}`.",
        "Training loop of an MLP (4 x Linear(512, 512), batch 64, 1 torch thread) under `xsp.trace(levels=\"model\")`;"
        " blocks with the sampler off, at 10 Hz and at 100 Hz rotate round by round; medians over the rounds.",
        "",
        "| setting | µs per iteration | cost vs sampler off (paired median) | paired IQR | CPU per reading µs "
        "| share of one core |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        interval = SETTINGS[name]
        cost = statistics.median(costs[name]) if costs[name] else None
        share = f"{cost / (interval * 1e6):.2%}" if cost and interval else "-"
        versus = f"{statistics.median(paired[name]):+.2%}" if interval else "-"
        quartiles = statistics.quantiles(paired[name], n=4) if interval and len(paired[name]) > 1 else None
        spread = f"{quartiles[0]:+.1%} .. {quartiles[2]:+.1%}" if quartiles else "-"
        lines.append(f"| {name} | {statistics.median(per_iteration[name]):.0f} | {versus} | {spread} | "
                     f"{'-' if cost is None else f'{cost:.0f}'} | {share} |")
    lines += ["", "Goal: the system level at its default 10 Hz costs the loop at most 1%.", "",
              "Read the paired IQR first: where blocks next to each other differ by more than the goal (a shared "
              "machine), the paired median cannot show a 1% cost, and the sampler's own CPU share of one core "
              "(its readings' CPU time times the rate) is the figure that bounds what it takes from the loop."]
    record(lines, RESULTS)


if __name__ == "__main__":
    main()
