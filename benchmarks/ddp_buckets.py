"""What recording DDP's gradient all-reduces costs a training step: the timing hook xsp puts on
the reducer against the reducer's own C++ all-reduce, side by side in one process.

One gloo process group of one rank; two identical DDP models (8 Linear layers of 256, buckets
of --bucket-kb, so that a backward pass launches several); training steps alternate between
the plain model (never called inside a session: the reducer's own all-reduce) and the hooked
one (called inside ``xsp.trace(levels="model")``: xsp's hook, recording), in rounds. Reported:
the median step of each, their difference, and that difference per bucket.

    python benchmarks/ddp_buckets.py [--rounds 15] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "ddp_buckets.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="training steps per round and model")
    parser.add_argument("--bucket-kb", type=float, default=300.0)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn

    import xsp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)

    def model() -> nn.Module:
        layers = [nn.Linear(256, 256) for _ in range(8)]
        return nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=args.bucket_kb / 1024)

    plain, hooked = model(), model()
    x = torch.randn(64, 256)

    def steps(ddp: nn.Module) -> list[float]:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            ddp(x).sum().backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return times

    plain_times: list[float] = []
    hooked_times: list[float] = []
    buckets = 0
    for _ in range(args.rounds):
        plain_times += steps(plain)
        with xsp.trace(levels="model", output=None) as session:
            hooked_times += steps(hooked)
        spans = session.trace.spans
        recorded = spans[spans["kind"] == "collective"]
        buckets = max(buckets, int(recorded["attributes"].str.contains("bucket").sum()) // args.steps)
    dist.destroy_process_group()
    plain_ms, hooked_ms = statistics.median(plain_times) * 1e3, statistics.median(hooked_times) * 1e3
    extra_us = (hooked_ms - plain_ms) * 1e3
    lines = ["# Recording DDP's gradient all-reduces", "",
             f"One gloo rank, 8 Linear(256) layers, buckets of {args.bucket_kb:g} KB; {args.rounds} rounds of "
             f"{args.steps} steps per model, alternating; {os.cpu_count()} cores. "
             f"`python benchmarks/ddp_buckets.py --rounds {args.rounds} --steps {args.steps}`.", "",
             "The traced step also carries the model level's own records (the model call, backward, optimizer "
             "step).", "",
             "| model | buckets per step | step ms (median) | extra µs per step | extra µs per bucket |",
             "| --- | ---: | ---: | ---: | ---: |",
             f"| reducer's own all-reduce | {buckets} | {plain_ms:.3f} | | |",
             f"| xsp's timing hook, recording | {buckets} | {hooked_ms:.3f} | {extra_us:.0f} | "
             f"{extra_us / max(buckets, 1):.0f} |"]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
