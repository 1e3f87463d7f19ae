"""Whether xsp lengthens the program's waits for its DataLoader: the time a training loop spends
in ``iter(loader)`` and ``next()``, timed by the loop itself, plain and under ``xsp run``.

A map-style dataset (a random 28x28 image made and normalised per item), 2 worker processes,
batches of 32, a small CNN trained with SGD; runs alternate plain / traced (N of each). The
traced wait should match the plain one within 10% (issue 35): xsp hands its windows over after
a DataLoader wait rather than during it, and never forks a helper for an empty window.

    python benchmarks/input_waits.py [--runs 5] [--items 2048] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "input_waits.md"
LOOP = textwrap.dedent("""
    import json, sys, time
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    class Images(Dataset):
        def __init__(self, n): self.n = n
        def __len__(self): return self.n
        def __getitem__(self, i):
            x = torch.randn(1, 28, 28)
            return (x - 0.1307) / 0.3081, i % 10

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
            self.fc1, self.fc2 = nn.Linear(16 * 12 * 12, 64), nn.Linear(64, 10)
        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))

    items, epochs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    loader = DataLoader(Images(items), batch_size=32, shuffle=True, num_workers=2)
    model, criterion = Net(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    waited, first, steps = 0.0, None, 0
    for _ in range(epochs):
        began = time.perf_counter()
        batches = iter(loader)
        while True:
            try:
                x, y = next(batches)
            except StopIteration:
                break
            waited += time.perf_counter() - began
            first = waited if first is None else first
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            steps += 1
            began = time.perf_counter()
        waited += time.perf_counter() - began
    json.dump({"waited_ms": waited * 1e3, "first_ms": first * 1e3, "steps": steps}, open(out, "w"))
""")


def one_run(folder: Path, traced: bool, items: int, epochs: int) -> dict[str, float]:
    script, out, trace = folder / "loop.py", folder / "out.json", folder / "run.xsp.parquet"
    script.write_text(LOOP)
    command = [sys.executable, *(["-m", "xsp", "run", "-o", str(trace), "--"] if traced else []), str(script),
               str(items), str(epochs), str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    if traced:
        import xsp

        spans = xsp.load(trace).spans
        result["spans_ms"] = float(spans[spans["kind"] == "input"]["duration_ns"].sum()) / 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    plain: list[dict[str, float]] = []
    traced: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.runs):
            plain.append(one_run(Path(folder), False, args.items, args.epochs))
            traced.append(one_run(Path(folder), True, args.items, args.epochs))

    def median(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    ratio = median(traced, "waited_ms") / median(plain, "waited_ms")
    lines = ["# DataLoader waits, plain and under xsp run", "",
             f"{args.items} items, 2 workers, batches of 32, {args.epochs} epochs "
             f"({int(plain[0]['steps'])} steps), a small CNN trained with SGD; {args.runs} runs of each, "
             f"alternating; {os.cpu_count()} cores. `python benchmarks/input_waits.py --runs {args.runs}`.", "",
             "| run | waits ms (median) | first wait ms | xsp's input spans ms |", "| --- | ---: | ---: | ---: |",
             f"| plain | {median(plain, 'waited_ms'):.1f} | {median(plain, 'first_ms'):.1f} | |",
             f"| xsp run | {median(traced, 'waited_ms'):.1f} | {median(traced, 'first_ms'):.1f} | "
             f"{median(traced, 'spans_ms'):.1f} |", "",
             f"Traced / plain: **{ratio:.2f}** (goal: at most 1.10)."]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
