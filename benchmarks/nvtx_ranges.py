"""What NVTX ranges cost: xsp.trace(nvtx=True) beside the layer level alone, with a tool attached and
without one, and one range (push + pop) through each way Python can send it.

A tool is attached the way Nsight Systems attaches: NVTX_INJECTION64_PATH names a library NVTX
loads at its first call. Here that is tests/nvtx_recorder.c built without its record file: it
counts each push and pop under a mutex, about what the least a real tool does. Each setting runs
in its own process (NVTX loads its tool once per process); within one process the settings
compared are interleaved, rounds of each, the median kept.

1. *Layer level*: a model of 40 x (Linear(64, 64), ReLU), batch 8, one thread, no_grad; each
   step is 1 model call and 80 layer calls, so 81 ranges. Microseconds a step under the layer
   level, and with nvtx=True; the difference over 81 is the cost of one range on the hot path.
2. *One range from Python*, in a loop: xsp's own (xsp.record._nvtx push/pop of a registered
   name), the ``nvtx`` package's push_range/pop_range in a domain (when installed; not a
   dependency) and ``torch.cuda.nvtx.range_push/range_pop`` (CUDA builds of PyTorch only).

Goals (issue 47): at most 300 ns a range with a tool attached; without one, within the noise of
the layer level alone. Prints a table and records it in benchmarks/results/nvtx_ranges.md.

Usage: python benchmarks/nvtx_ranges.py [--rounds 7] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from _results import record

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "nvtx_ranges.md"
RANGES_PER_STEP = 81

CHILD = r"""
import json, statistics, sys, time
import torch, xsp
from torch import nn
torch.set_num_threads(1)
rounds, steps = int(sys.argv[1]), int(sys.argv[2])
layers = []
for _ in range(40):
    layers += [nn.Linear(64, 64), nn.ReLU()]
model = nn.Sequential(*layers).eval()
x = torch.randn(8, 64)

def per_step_us(nvtx):
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, nvtx=nvtx):
        for _ in range(20):
            model(x)
        start = time.perf_counter_ns()
        for _ in range(steps):
            model(x)
        return (time.perf_counter_ns() - start) / steps / 1e3

import warnings
warnings.simplefilter("ignore")
results = {"layer": [], "layer+nvtx": []}
for _ in range(rounds):
    results["layer"].append(per_step_us(False))
    results["layer+nvtx"].append(per_step_us(True))

def loop_ns(push, pop, count=200_000):
    for _ in range(1000):
        push(); pop()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(count):
            push(); pop()
        best = min(best, (time.perf_counter_ns() - start) / count)
    return best

def empty():
    pass
ranges = {"empty Python calls (push + pop), for scale": loop_ns(empty, empty)}
from xsp.record import nvtx as xsp_nvtx
bound, why = xsp_nvtx.open_ranges()
if bound is not None:
    message = bound.message("model.0", xsp_nvtx.RangeKind.LAYER)
    push, pop = bound.extension.push, bound.extension.pop
    ranges["xsp.record._nvtx push(message) + pop()"] = loop_ns(lambda: push(message), pop)
try:
    import nvtx
    domain = nvtx.get_domain("bench")
    attributes = domain.get_event_attributes(message="model.0")
    ranges["nvtx package: Domain.push_range(attributes) + pop_range()"] = loop_ns(
        lambda: domain.push_range(attributes), domain.pop_range)
    ranges["nvtx package: nvtx.push_range(message, domain) + pop_range(domain)"] = loop_ns(
        lambda: nvtx.push_range("model.0", domain="bench"), lambda: nvtx.pop_range(domain="bench"))
except ImportError:
    pass
try:
    torch.cuda.nvtx.range_push("model.0"); torch.cuda.nvtx.range_pop()
    ranges["torch.cuda.nvtx.range_push + range_pop"] = loop_ns(lambda: torch.cuda.nvtx.range_push("model.0"),
                                                                torch.cuda.nvtx.range_pop)
except Exception as exc:
    ranges["torch.cuda.nvtx.range_push + range_pop"] = f"not available: {type(exc).__name__}"
print(json.dumps({"steps": {k: statistics.median(v) for k, v in results.items()},
                  "spread": {k: (min(v), max(v)) for k, v in results.items()},
                  "ranges": ranges, "bound": bound is not None, "why": why}))
"""


def build_tool(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.nvtx_tool import nvtx_headers

    headers = nvtx_headers()
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if headers is None or compiler is None:
        raise SystemExit("needs a C compiler and NVTX's headers (pip install nvidia-nvtx-cu12)")
    library = folder / "librecorder.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-pthread", f"-I{headers}", "-o", str(library),
                    str(ROOT / "tests" / "nvtx_recorder.c")], check=True)
    return library


def measure(tool: Path | None, rounds: int, steps: int) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if key not in ("NVTX_INJECTION64_PATH", "XSP_NVTX")}
    env.pop("XSP_NVTX_RECORD", None)
    if tool is not None:
        env["NVTX_INJECTION64_PATH"] = str(tool)
    done = subprocess.run([sys.executable, "-c", CHILD, str(rounds), str(steps)], env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tool = build_tool(Path(scratch))
        attached = measure(tool, args.rounds, args.steps)
        alone = measure(None, args.rounds, args.steps)
    rows = []
    for label, found in (("attached (counting tool)", attached), ("none (NVTX_INJECTION64_PATH unset)", alone)):
        steps = found["steps"]
        assert isinstance(steps, dict)
        spread = found["spread"]
        assert isinstance(spread, dict)
        extra_ns = (steps["layer+nvtx"] - steps["layer"]) * 1e3 / RANGES_PER_STEP
        best_ns = (spread["layer+nvtx"][0] - spread["layer"][0]) * 1e3 / RANGES_PER_STEP
        rows.append(f"| {label} | {steps['layer']:.1f} ({spread['layer'][0]:.1f}-{spread['layer'][1]:.1f}) | "
                    f"{steps['layer+nvtx']:.1f} ({spread['layer+nvtx'][0]:.1f}-{spread['layer+nvtx'][1]:.1f}) | "
                    f"{steps['layer+nvtx'] / steps['layer']:.3f}x | {extra_ns:+.0f} | {best_ns:+.0f} |")
    ranges = attached["ranges"]
    assert isinstance(ranges, dict)
    range_rows = [f"| {name} | {value:.0f} |" if isinstance(value, float) else f"| {name} | {value} |"
                  for name, value in ranges.items()]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    record([
        "# NVTX ranges: what xsp.trace(nvtx=True) costs", "",
        f"Last run: {now}, {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
        f"`python benchmarks/nvtx_ranges.py --rounds {args.rounds} --steps {args.steps}`. The tool attached is "
        "tests/nvtx_recorder.c counting each push and pop (NVTX loads it as it loads Nsight Systems).", "",
        "## The layer level with and without NVTX ranges (40 x Linear(64, 64) + ReLU, batch 8, no_grad; "
        f"{RANGES_PER_STEP} ranges a step)", "",
        "Microseconds a step, median of the rounds (min-max), the rounds of the two interleaved; ns a range "
        "from the medians and from the best rounds (the least disturbed by the machine). Goal: at most +300 ns "
        "a range with a tool, within the noise without one.", "",
        "| tool | layer level µs | layer level + nvtx µs | ratio | ns a range (medians) | ns a range (best rounds) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        "## One range (push + pop) from Python with the tool attached, best of the rounds", "",
        "| how | ns |", "| --- | ---: |", *range_rows,
    ], RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
