"""Long runs: what xsp costs over millions of events, with the garbage collector on.

Prints a table and records it in benchmarks/results/long_run.md. For each run length (300k,
1M and 2M recorded module calls) and configuration, a fresh Python process runs the same
loop over a model of 500 small Linear layers (inference, GC on, as a user's job runs):

* ``baseline``: nothing installed;
* ``empty hooks``: an empty pair of global forward hooks (the floor of hook-based tracers);
* ``xsp model+layer``: ``xsp.trace(levels="model,layer")`` writing its trace file (closed
  windows are written to disk as the loop runs);
* ``xsp schedule 1/10``: the same with ``schedule="wait=9,active=1"`` (one step in ten recorded);
* ``xsp model+layer+operator``: the operator level too (every aten operator, with the line of
  the user's code that issued it), streamed a window at a time like the layer level;
* ``torch.profiler``: ``torch.profiler.profile`` (CPU activity), then ``export_chrome_trace``.

Reported per configuration: ns per module call, the overhead's ratio to the empty hooks'
(goal for xsp: at most 1.35x), the stall at the end of the block until the file is on disk
per event (goal: at most 1.5 µs), and the growth of the process's peak memory over the run per
event (goal: at most 400 B). torch.profiler's events are operators, not module calls: its
figures are given per module call of the same loop *and* per event it recorded.

Configurations are interleaved round by round; each figure is the median of the rounds.

Usage: python benchmarks/long_run.py [--events 300000,1000000,2000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "long_run.md"
CONFIGS = ("baseline", "empty hooks", "xsp model+layer", "xsp schedule 1/10", "xsp model+layer+operator",
           "torch.profiler")
LAYERS = 500

CHILD = r"""
import gc, json, os, resource, sys, tempfile, time
import torch
from torch import nn
from torch.nn.modules import module as torch_module
torch.set_num_threads(1)
config, forwards, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
x = torch.randn(1, 8)
calls = forwards * (layers + 1)
out = tempfile.mkdtemp()

def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def loop():
    with torch.no_grad():
        for _ in range(forwards):
            model(x)

with torch.no_grad():  # warm up
    for _ in range(20):
        model(x)
if config.startswith("xsp"):
    import xsp  # imports are no part of the loop's cost
elif config == "torch.profiler":
    from torch.profiler import ProfilerActivity, profile
gc.collect()
before = rss_bytes()
events, stall, windows, start = calls, 0.0, 0, 0.0
if config == "baseline":
    began = time.perf_counter_ns(); loop(); ended = time.perf_counter_ns()
elif config == "empty hooks":
    pre = torch_module.register_module_forward_pre_hook(lambda m, a: None)
    post = torch_module.register_module_forward_hook(lambda m, a, o: None)
    began = time.perf_counter_ns(); loop(); ended = time.perf_counter_ns()
    pre.remove(); post.remove()
elif config.startswith("xsp"):
    schedule = "wait=9,active=1" if config == "xsp schedule 1/10" else None
    levels = "model,layer,operator" if config == "xsp model+layer+operator" else "model,layer"
    session = xsp.trace(levels=levels, output=os.path.join(out, "run.xsp.parquet"), schedule=schedule)
    entered = time.perf_counter_ns()
    session.__enter__()
    began = time.perf_counter_ns(); start = (began - entered) / 1e9
    loop(); ended = time.perf_counter_ns()
    session.__exit__(None, None, None)
    stall = (time.perf_counter_ns() - ended) / 1e9
    assert os.path.getsize(os.path.join(out, "run.xsp.parquet")) > 0
    events = session.trace.metadata["hierarchy"]["spans"] - 1  # not the session span; spans stay on disk
    windows = session.trace.metadata["streamed_windows"]
else:
    prof = profile(activities=[ProfilerActivity.CPU])
    entered = time.perf_counter_ns()
    prof.__enter__()
    began = time.perf_counter_ns(); start = (began - entered) / 1e9
    loop(); ended = time.perf_counter_ns()
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(os.path.join(out, "trace.json"))
    stall = (time.perf_counter_ns() - ended) / 1e9
    events = len(prof.events())
with open("/proc/self/status") as f:  # the peak of this process alone (ru_maxrss keeps the parent's)
    peak = int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
# the helper processes that interpreted windows beside the loop: the largest one's peak RSS (forked
# from this process, so it shares pages with it: its growth over this process's size is counted)
helper_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"loop_ns_per_call": (ended - began) / calls, "start_s": start, "stall_s": stall, "events": events,
                  "peak_growth_bytes": max(peak - before, 0), "helper_growth_bytes": max(helper_peak - before, 0),
                  "windows": windows}))
"""


def run_child(config: str, events: int) -> dict[str, float]:
    forwards = max(events // (LAYERS + 1), 1)
    done = subprocess.run([sys.executable, "-c", CHILD, config, str(forwards), str(LAYERS)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", default="300000,1000000,2000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profiler-max-events", type=int, default=300_000,
                        help="run torch.profiler only up to this many module calls (it takes ~50 KB per call)")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.events.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for size in sizes:
        for round_index in range(args.rounds):
            for config in configs:
                if config == "torch.profiler" and size > args.profiler_max_events:
                    continue
                result = run_child(config, size)
                results.setdefault((size, config), []).append(result)
                print(f"{size:>9} events, round {round_index + 1}: {config:<16} "
                      f"{result['loop_ns_per_call']:8.0f} ns/call, stall {result['stall_s']:.2f} s", file=sys.stderr)

    def median(size: int, config: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(size, config)])

    import torch

    lines = [
        "# Long runs",
        "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, 1 torch thread, GC on; "
        f"`python benchmarks/long_run.py --events {args.events} --rounds {args.rounds} "
        f"--configs '{args.configs}'`.",
        "",
        f"Inference loop over {LAYERS} x Linear(8, 8) (one model call and {LAYERS} layer calls per forward), "
        "each configuration in a fresh process, interleaved, median of the rounds. *Ratio*: the "
        "configuration's overhead per module call over the empty global hooks' (goal for xsp: <= 1.35x). "
        "The loop alone is timed: imports and the start of the session or profiler are not in it (*start s* "
        "gives the start). "
        "*Stall*: from the end of the user's loop until the file is on disk (goal: <= 1.5 µs per event). "
        "*Peak memory*: growth of the process's peak RSS over the run, plus the growth of the largest helper "
        "process that interpreted windows beside the loop over the process's size before the run (goal: "
        "<= 400 B per event). "
        "torch.profiler records operators (about 3 per Linear call): its stall and memory are also given "
        "per operator event it recorded. It needs about 50 KB per module call of this loop (15 GB at 300k), "
        "so it runs only at the smallest size.",
        "",
        "| module calls | configuration | ns per call | overhead ns | ratio to hooks | start s | stall s | "
        "stall µs/call | peak MB | peak B/call | events recorded | stall µs/event | peak B/event | windows on disk |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in sizes:
        calls = max(size // (LAYERS + 1), 1) * (LAYERS + 1)
        base = median(size, "baseline", "loop_ns_per_call") if "baseline" in configs else 0.0
        hooks = median(size, "empty hooks", "loop_ns_per_call") - base if "empty hooks" in configs else 0.0
        for config in configs:
            if (size, config) not in results:
                continue
            per_call = median(size, config, "loop_ns_per_call")
            stall = median(size, config, "stall_s")
            peak = median(size, config, "peak_growth_bytes") + median(size, config, "helper_growth_bytes")
            events = median(size, config, "events")
            overhead = per_call - base
            ratio = f"{overhead / hooks:.2f}x" if config not in ("baseline", "empty hooks") and hooks > 0 else ""
            recorded = config in ("xsp model+layer", "xsp schedule 1/10", "xsp model+layer+operator", "torch.profiler")
            lines.append(
                f"| {calls:,} | {config} | {per_call:,.0f} | {overhead:,.0f} | {ratio} | "
                + (f"{median(size, config, 'start_s'):.2f} | {stall:.2f} | {stall / calls * 1e6:.2f} | "
                   f"{peak / 1e6:,.0f} | {peak / calls:,.0f} | "
                   f"{events:,.0f} | {stall / events * 1e6:.2f} | {peak / events:,.0f} | "
                   f"{median(size, config, 'windows'):.0f} |" if recorded else "| | | | | | | | |"))
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
