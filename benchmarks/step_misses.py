"""What an unsampled always-on step costs in memory traffic, counted instead of timed.

``benchmarks/cold_step.py`` times a step whose caches were emptied: +7 to +10 µs on this
machine, moving by ±1 µs between runs, too coarse to tell whether a change to the step's code
helped. This counts it: the loop of cold_step (a one-leaf model called under a current
OpenTelemetry span, inside ``xsp.trace(levels=("model", "layer"), sample=0.0)``, a buffer
larger than the simulated last-level cache written before each call) runs under callgrind with
its cache simulation, only the loop collected (a client request around it), the garbage
collector off inside it (a collection lands in whichever call allocates) and slow steps off (a
step's speed under valgrind says nothing). ``nn.Module.__call__`` is xsp's wrapper (*xsp*) or
the plain one (*plain*), in separate runs of the same session. Per call: instructions (*Ir*),
first-level instruction and data misses (*I1mr*, *D1mr*, *D1mw*) and last-level ones (*ILmr*,
*DLmr*, *DLmw*), each a 64-byte line fetched from the next level; *xsp adds*: xsp - plain.
The simulated caches: 32 KiB first level, 2 MiB last level (``--LL``), so that a 3 MiB buffer
empties it; a real last level of 32 MiB keeps more, so the counts are an upper bound of the
lines a step must fetch from memory when nothing of it is cached.

``--base DIR``: also count another checkout (its C parts built in place, for example
``git worktree add DIR REV`` then ``python -c "from setuptools import setup; setup()"
build_ext --inplace`` in it), side by side.

Usage: python benchmarks/step_misses.py [--calls 200] [--base DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _results import record
from production import last_run_line

RESULTS = Path(__file__).resolve().parent / "results" / "step_misses.md"
ROOT = Path(__file__).resolve().parents[1]
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")
LAST_LEVEL = "2097152,16,64"
EVICT_MB = 3
DESCRIPTION = (
    "The loop of benchmarks/cold_step.py under callgrind's cache simulation (32 KiB first level, {last_level} "
    "last level; {evict_mb} MiB written before each call), {calls} calls counted, the garbage collector and slow "
    "steps off; per call: instructions, then first-level (I1, D1) and last-level (IL, DL) misses, each a 64-byte "
    "line. *xsp adds*: xsp's wrapper - the plain one, in the same session.")
TOGGLE_SOURCE = """#include <valgrind/callgrind.h>
void toggle_collect(void) { CALLGRIND_TOGGLE_COLLECT; }
void start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
"""

CHILD = """
import ctypes, gc, os, sys, tempfile
import torch
from torch import nn
from opentelemetry.sdk.trace import TracerProvider
import xsp

wrapper_kind, calls, toggle_library, evict_mb = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
counting = ctypes.CDLL(toggle_library)
toggle = counting.toggle_collect
torch.set_num_threads(1)
tracer = TracerProvider().get_tracer("step_misses")
model = nn.Sequential(nn.Linear(4, 4)).eval()
tokens = torch.randn(1, 4)
evicted = torch.zeros(evict_mb * 2**20 // 4)[::16]  # a float a 64-byte line: every line written
output = os.path.join(tempfile.mkdtemp(), "misses.xsp.parquet")
with xsp.trace(levels=("model", "layer"), sample=0.0, slow_factor=0.0, window_s=10**6, output=output):
    wrapper = nn.Module.__dict__["__call__"]
    if getattr(wrapper, "original", None) is None:
        raise SystemExit("xsp's C wrapper is not built in " + os.path.dirname(xsp.__file__))
    nn.Module.__call__ = wrapper if wrapper_kind == "xsp" else wrapper.original
    counting.start_instrumentation()  # imports and the session's start ran uninstrumented: ten times faster
    with torch.inference_mode():
        for _ in range(20):  # the thread's buffer, the model's name, the interned shapes; the simulated caches
            with tracer.start_as_current_span("request"):
                model(tokens)
        gc.collect()
        gc.disable()
        toggle()
        for _ in range(calls):
            evicted.add_(1.0)
            with tracer.start_as_current_span("request"):
                model(tokens)
        toggle()
        gc.enable()
    nn.Module.__call__ = wrapper
"""


def build_toggle(folder: Path) -> Path:
    """A library whose one function switches callgrind's collection (its client request)."""
    source, built = folder / "toggle.c", folder / "toggle.so"
    source.write_text(TOGGLE_SOURCE)
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(source), "-o", str(built)], check=True)
    return built


def totals(callgrind_out: Path) -> dict[str, int]:
    """The run's totals by event, from callgrind's output file."""
    names: list[str] = []
    for line in callgrind_out.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            return dict(zip(names, (int(value) for value in line.split()[1:])))
    raise RuntimeError(f"no totals in {callgrind_out}")


def count(tree: Path, wrapper_kind: str, calls: int, toggle: Path, folder: Path) -> dict[str, float]:
    """Per call, each event of the loop with ``wrapper_kind``'s ``nn.Module.__call__``, ``tree``'s xsp."""
    out = folder / f"{tree.name}-{wrapper_kind}.callgrind"
    environment = dict(os.environ, PYTHONPATH=str(tree), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    command = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--LL={LAST_LEVEL}", "--collect-atstart=no",
               "--instr-atstart=no",
               f"--callgrind-out-file={out}", sys.executable, "-c", CHILD, wrapper_kind, str(calls), str(toggle),
               str(EVICT_MB)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree} {wrapper_kind}: exit {done.returncode}\n{done.stderr[-2000:]}")
    found = totals(out)
    return {event: found.get(event, 0) / calls for event in EVENTS}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls counted (after 20 not counted)")
    parser.add_argument("--base", type=Path, help="another checkout to count beside this one")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed here: nothing to count with")
    began = time.monotonic()
    trees = [ROOT] + ([args.base.resolve()] if args.base else [])
    folder = Path(tempfile.mkdtemp(prefix="xsp-step-misses-"))
    toggle = build_toggle(folder)
    runs = [(tree, kind) for tree in trees for kind in ("plain", "xsp")]
    counts = {run: count(run[0], run[1], args.calls, toggle, folder) for run in runs}
    shutil.rmtree(folder)
    header = f"{'tree':12s} {'wrapper':10s} " + " ".join(f"{event:>8s}" for event in EVENTS)
    rows = []
    for tree in trees:
        name = "this tree" if tree == ROOT else tree.name
        plain, xsp = counts[(tree, "plain")], counts[(tree, "xsp")]
        for label, values in (("plain", plain), ("xsp", xsp),
                              ("xsp adds", {event: xsp[event] - plain[event] for event in EVENTS})):
            rows.append(f"{name:12s} {label:10s} " + " ".join(f"{values[event]:8.1f}" for event in EVENTS))
    print("\n".join([header, *rows]))
    ran = " ".join(["python", "benchmarks/step_misses.py", *(sys.argv[1:] if argv is None else argv)])
    described = DESCRIPTION.format(last_level=LAST_LEVEL, evict_mb=EVICT_MB, calls=args.calls)
    record(["# An unsampled step's memory traffic, counted", "", last_run_line(ran, began), "", described, "",
            "```", header, *rows, "```"], RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
