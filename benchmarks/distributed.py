"""Distributed jobs: what xsp costs a torchrun job, and what the span budget costs an export.

Prints tables and records them in benchmarks/results/distributed.md.

1. **A DDP job under torchrun** (examples/distributed/ddp_train.py, gloo, CPU): the wall time of
   the whole job run plainly, under ``xsp run`` (model and layer levels) and under ``xsp run
   --levels model,layer,operator`` (which sees DDP's gradient all-reduces), interleaved over
   rounds, the median of each; the ratio to the plain job is the cost a user sees, start-up
   and file writing included.
2. **A collective under the model level**: microseconds per ``dist.all_reduce`` of 4 KiB on a
   one-process gloo group (the cheapest collective there is: the wrapper's cost is the
   difference), plainly and inside ``xsp.trace(levels="model")``, interleaved.
3. **The span budget** on the real GPU traces in ../shared/traces: spans per step before and
   after folding to 2,000, and the time :func:`xsp.export.budget.within_budget` takes.

Usage: python benchmarks/distributed.py [--rounds 5] [--steps 20] [--processes 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _results import record  # noqa: E402

EXAMPLE = ROOT / "examples" / "distributed" / "ddp_train.py"
TRACES = ROOT.parent / "shared" / "traces" / "kineto"
RESULTS = ROOT / "benchmarks" / "results" / "distributed.md"
CONFIGURATIONS = {
    "plain": [],
    "xsp model,layer": ["-m", "xsp", "run", "-o", "job.xsp.parquet", "--"],
    "xsp model,layer,operator": ["-m", "xsp", "run", "--levels", "model,layer,operator", "-o", "job.xsp.parquet",
                                 "--"],
}


def job_seconds(configuration: list[str], processes: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as where:
        began = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={processes}", *configuration, str(EXAMPLE), "--steps", str(steps)],
                                cwd=where, capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"the job failed: {result.stderr[-2000:]}")
    return seconds


COLLECTIVE = """
import statistics, sys, time
import torch, torch.distributed as dist, xsp
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
tensor = torch.ones(1024)
def per_call(n=3000):
    began = time.perf_counter_ns()
    for _ in range(n):
        dist.all_reduce(tensor)
    return (time.perf_counter_ns() - began) / n / 1e3
per_call()
plain, traced = [], []
for _ in range(int(sys.argv[1])):
    plain.append(per_call())
    with xsp.trace(levels="model", output=None):
        traced.append(per_call())
print(statistics.median(plain), statistics.median(traced))
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    options = parser.parse_args()

    times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for _ in range(options.rounds):
        for name, configuration in CONFIGURATIONS.items():
            times[name].append(job_seconds(configuration, options.processes, options.steps))
    plain = statistics.median(times["plain"])
    lines = [
        "# Distributed jobs", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, Python "
        f"{platform.python_version()}; `python benchmarks/distributed.py --rounds {options.rounds} --steps "
        f"{options.steps} --processes {options.processes}`.", "",
        f"## A DDP job under torchrun ({options.processes} processes, gloo, CPU, {options.steps} steps)", "",
        "Wall time of the whole job (torchrun start to exit: start-up, the loop, writing every rank's file), "
        "configurations interleaved round by round, median of the rounds.", "",
        "| configuration | seconds (median) | min | max | ratio to plain |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, values in times.items():
        lines.append(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | "
                     f"{statistics.median(values) / plain:.2f}x |")

    collective = subprocess.run([sys.executable, "-c", COLLECTIVE, str(options.rounds)], capture_output=True,
                                text=True, timeout=600, cwd=ROOT)
    if collective.returncode != 0:
        raise SystemExit(collective.stderr[-2000:])
    plain_us, traced_us = (float(v) for v in collective.stdout.split())
    lines += ["", "## One collective under the model level", "",
              "`dist.all_reduce` of 1024 float32 on a one-process gloo group, 3000 calls per round, interleaved, "
              "median of the rounds: the wrapper's cost is the difference.", "",
              "| plain µs per call | under xsp µs per call | xsp's cost µs |", "| ---: | ---: | ---: |",
              f"| {plain_us:.1f} | {traced_us:.1f} | {traced_us - plain_us:.1f} |"]

    import xsp
    from xsp.export.budget import within_budget

    lines += ["", "## The span budget on real GPU traces (2,000 spans per exported step)", "",
              "| trace | spans | steps over budget | largest step before | largest step after | aggregates | "
              "spans folded | seconds |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("a100_nccl_rank0", "sampled_rank0", "v100_2rank_train_rank1"):
        path = TRACES / f"{name}.json.gz"
        if not path.is_file():
            continue
        spans = xsp.load(path).spans
        began = time.perf_counter()
        folded = within_budget(spans, 2000)
        seconds = time.perf_counter() - began
        lines.append(f"| {name} | {len(spans):,} | {folded.traces_folded} | "
                     f"{spans['trace_id'].value_counts().max():,} | {folded.spans['trace_id'].value_counts().max():,} "
                     f"| {folded.aggregates:,} | {folded.raw_spans_folded:,} | {seconds:.2f} |")
    record(lines, RESULTS)


if __name__ == "__main__":
    main()
