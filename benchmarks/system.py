"""What the system level's sampler costs a training loop.

Prints a table and records it in benchmarks/results/system.md. Each configuration runs in a
fresh Python process: a training loop (an MLP of 4 x Linear(512, 512), batch 64, one torch
thread, forward, loss, backward, SGD step) for ``--seconds`` after a warm-up:

* ``baseline``: no xsp;
* ``xsp model``: ``xsp.trace(levels="model")``;
* ``xsp model+system``: the same with the system level at its default 10 Hz;
* ``xsp model+system 100 Hz``: ``XSP_SYSTEM_HZ=100``.

Reported: iterations per second, the time per iteration, the cost of the system level over
``xsp model`` in the same round (the goal: at most 1% at 10 Hz), the sampler's own cost per
reading, as the tracer measured it (``reading_cost_us`` in the trace's metadata), and its share of
one core at that rate. Configurations are interleaved round by round; each figure is the
median of the rounds.

Usage: python benchmarks/system.py [--seconds 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "system.md"
CONFIGS = {"baseline": None, "xsp model": ("model", None), "xsp model+system": ("model,system", None),
           "xsp model+system 100 Hz": ("model,system", "100")}

CHILD = r"""
import json, sys, tempfile, time
import torch
from torch import nn
torch.set_num_threads(1)
levels, seconds = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())], nn.Linear(512, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
criterion = nn.CrossEntropyLoss()
x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))

def step():
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

def loop():
    for _ in range(20):
        step()
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        step()
        count += 1
    return count, time.perf_counter() - began

details = None
if levels == "-":
    count, elapsed = loop()
else:
    import xsp
    with xsp.trace(levels=levels, output=tempfile.mkdtemp() + "/t.xsp.parquet") as session:
        count, elapsed = loop()
    details = session.trace.metadata["tracer_details"].get("system") if session.trace else None
print(json.dumps({"iterations": count, "seconds": elapsed, "system": details}))
"""


def run(config: str, seconds: float) -> dict[str, object]:
    spec = CONFIGS[config]
    env = dict(os.environ)
    env.pop("XSP_SYSTEM_HZ", None)
    if spec is not None and spec[1] is not None:
        env["XSP_SYSTEM_HZ"] = spec[1]
    levels = "-" if spec is None else spec[0]
    out = subprocess.run([sys.executable, "-c", CHILD, levels, str(seconds)], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    per_iteration: dict[str, list[float]] = {name: [] for name in CONFIGS}
    costs: dict[str, list[float]] = {name: [] for name in CONFIGS}
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    versus_model: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        names = list(CONFIGS)
        names = names[round_index % len(names):] + names[:round_index % len(names)]  # rotate the order
        found = {name: run(name, args.seconds) for name in names}
        for name, result in found.items():
            per_iteration[name].append(float(result["seconds"]) / int(result["iterations"]) * 1e6)  # type: ignore[arg-type]
            system = result["system"]
            if isinstance(system, dict) and system.get("reading_cost_us"):
                costs[name].append(float(system["reading_cost_us"]))
                rates[name].append(1.0 / float(system["interval_s"]))
        for name in CONFIGS:
            versus_model[name].append(per_iteration[name][-1] / per_iteration["xsp model"][-1] - 1)
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {per_iteration[n][-1]:.0f} us" for n in CONFIGS),
              file=sys.stderr)
    lines = [
        "# System level: what the sampler costs a training loop",
        "",
        f"Recorded {datetime.now(timezone.utc):%Y-%m-%d} on {platform.node()} ({os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}), Python {platform.python_version()}; "
        f"`python benchmarks/system.py --seconds {args.seconds:g} --rounds {args.rounds}`.",
        "Training loop of an MLP (4 x Linear(512, 512), batch 64, 1 torch thread); median of the rounds, "
        "configurations interleaved.",
        "",
        "| configuration | µs per iteration | vs xsp model | reading cost µs | sampler share of one core |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in CONFIGS:
        cost = statistics.median(costs[name]) if costs[name] else None
        rate = statistics.median(rates[name]) if rates[name] else None
        share = f"{cost * rate / 1e6:.2%}" if cost and rate else "-"
        versus = f"{statistics.median(versus_model[name]):+.2%}" if name != "baseline" else "-"
        lines.append(f"| {name} | {statistics.median(per_iteration[name]):.0f} | {versus} | "
                     f"{'-' if cost is None else f'{cost:.0f}'} | {share} |")
    lines += ["", "Goal: the system level at 10 Hz costs at most 1% over `xsp model`."]
    record(lines, RESULTS)


if __name__ == "__main__":
    main()
