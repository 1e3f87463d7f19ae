"""Memory of a service always on for a million requests: does xsp's resident memory stay flat?

One fresh process per configuration serves ``--requests`` requests in a loop, each inside an
OpenTelemetry span (as an instrumented service's are), to a small model (three layers), with the
garbage collector on:

* ``plain``: no xsp;
* ``always on 0.01``: ``xsp.trace(levels="model,layer", sample=0.01, dataset=..., rotate=...)``:
  every request timed, 1% with layers, the trace written in parts.

The process's resident memory (RSS) is read every tenth of the run. Reported: RSS after the
warm-up (the first tenth), at the end, their difference (the goal for xsp: at most 50 MB over a
million requests), and the time a request took. Prints a table and records it in
benchmarks/results/always_on_memory.md.

Usage: python benchmarks/always_on_memory.py [--requests 1000000]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "always_on_memory.md"
CONFIGS = ("plain", "always on 0.01")
MARKS = 10
GOAL_MB = 50

CHILD = """
import json, sys, time, psutil, torch
from opentelemetry.sdk.trace import TracerProvider
config, requests, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
tracer = TracerProvider().get_tracer("service")
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x = torch.randn(4, 32)
process = psutil.Process()
rss = []
if config == "plain":
    import contextlib
    session = contextlib.nullcontext()
else:
    import xsp
    session = xsp.trace(levels="model,layer", sample=0.01, dataset=folder, rotate="10m")
began = time.perf_counter()
with session, torch.no_grad():
    for request in range(requests):
        with tracer.start_as_current_span("POST /predict"):
            model(x)
        if request % (requests // %(marks)d) == 0:
            rss.append(process.memory_info().rss)
    rss.append(process.memory_info().rss)
    seconds = time.perf_counter() - began
print(json.dumps({"rss": rss, "seconds": seconds}))
""".replace("%(marks)d", str(MARKS))


def run_child(config: str, requests: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([sys.executable, "-c", CHILD, config, str(requests), folder], capture_output=True,
                              text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    rows = []
    for config in CONFIGS:
        found = run_child(config, args.requests)
        rss = [value / 2**20 for value in found["rss"]]  # type: ignore[union-attr]
        warm, end = rss[1], rss[-1]
        rows.append((config, warm, end, end - warm, float(found["seconds"]) / args.requests * 1e6,  # type: ignore
                     " ".join(f"{value:.0f}" for value in rss)))
        print(f"{config}: {warm:.0f} MB after warm-up, {end:.0f} MB at the end", file=sys.stderr, flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from xsp.core.metadata import cpu_model

    lines = [
        "# A service always on for a million requests: resident memory",
        "",
        f"Last run: {stamp}, {cpu_model()}, Python {platform.python_version()}; "
        f"`python benchmarks/always_on_memory.py --requests {args.requests}`.",
        "",
        f"Each request inside an OpenTelemetry span, one process per configuration, GC on. RSS read every "
        f"tenth of the run; growth = the end minus after the first tenth (goal for xsp: at most {GOAL_MB} MB).",
        "",
        "| configuration | RSS after warm-up (MB) | RSS at the end (MB) | growth (MB) | µs a request "
        "| RSS each tenth (MB) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
        *(f"| {config} | {warm:.0f} | {end:.0f} | {growth:+.0f} | {per_request:.1f} | {marks} |"
          for config, warm, end, growth, per_request, marks in rows),
    ]
    print("\n".join(lines))
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
