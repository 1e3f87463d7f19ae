"""What xsp costs the scripts of examples/workloads, counted in instructions: a measure that
the shared machine's noise does not move.

benchmarks/workloads.py times each workload plainly and inside xsp sessions; on this 2-core
machine its rounds spread by 10-80%, far more than the 2% goal it checks. Here each workload
runs once per configuration (plain, ``xsp.trace(levels="model")``,
``xsp.trace(levels="model,layer")``) under valgrind's callgrind, and the instructions executed
by every thread of the process while its ``run_steps(n)`` loop runs are counted (callgrind
dumps its counters when ``operator.call``, which starts the loop, is entered and left).
Overhead = the configuration's instructions / the plain run's - 1. Instructions are not time
(a cache miss costs more than an add), but the same program on the same input executes the
same instructions whatever else the machine does, so a difference of 1% is a real 1%.
DataLoader worker processes are not counted (xsp adds nothing to them).

Prints a table and records it in benchmarks/results/workload_instructions.md.

Usage: python benchmarks/workload_instructions.py [--seconds S] [--jobs J] [--only NAME ...]
(needs valgrind; about a minute per workload and configuration).
"""

from __future__ import annotations

import argparse
import gc
import operator
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _results import record
from workloads import CONFIGURATIONS, WORKLOADS, load, seconds_per_step

from xsp.core.metadata import cpu_model

RESULTS = Path(__file__).resolve().parent / "results" / "workload_instructions.md"
LOOP_ENTRY = "_operator_call"
"""The C function behind ``operator.call``, which the child calls to run the measured loop
and nothing in torch calls: callgrind dumps its counters on entering and on leaving it."""


def iterations_for(name: str, seconds: float) -> tuple[int, float]:
    """How many iterations of the workload take about ``seconds`` natively, and ms per iteration."""
    per_iteration = seconds_per_step(load(name).build())
    return max(3, round(seconds / per_iteration)), per_iteration * 1e3


def child(name: str, configuration: str, iterations: int) -> None:
    """Run inside callgrind: build, warm up, then the measured loop (run_measured)."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(WORKLOADS))
    run_steps = load(name).build()
    instrument_from_here()
    run_steps(2)
    with CONFIGURATIONS[configuration]():
        run_steps(1)  # the session's first call (model naming) is not the steady state
        run_measured(run_steps, iterations)


def run_measured(loop: Callable[[int], Any], iterations: int) -> None:
    """``loop(iterations)``, through ``operator.call`` (callgrind counts from its entry to its exit).

    A full collection first: otherwise the warm-up leaves the collector's generations part full,
    by amounts that differ between configurations, and a full collection of torch's heap (tens of
    millions of instructions) falls inside one configuration's loop and not another's. After it,
    each loop pays for the collections its own allocations trigger.
    """
    gc.collect()
    operator.call(loop, iterations)


def instrument_from_here() -> None:
    """Switch callgrind's instrumentation on (the child starts without it, which makes importing
    torch and compiling the workload's models some ten times faster) and return once it is on."""
    control = subprocess.Popen(["callgrind_control", "--instr=on", str(os.getpid())], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    while control.poll() is None:  # callgrind takes the command between basic blocks of ours
        time.sleep(0.001)


def loop_instructions(out_prefix: Path) -> int:
    """Instructions of the dump that ``LOOP_ENTRY``'s exit triggered (the loop alone, every thread)."""
    for part in sorted(out_prefix.parent.glob(out_prefix.name + ".*")):
        text = part.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: (.*)$", text, re.MULTILINE)
        if trigger and LOOP_ENTRY in trigger.group(1) and "after" in trigger.group(1).lower():
            totals = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
            if totals:
                return int(totals.group(1))
    raise RuntimeError(f"no callgrind dump after {LOOP_ENTRY} in {out_prefix}*")


LAYOUT_STRIDE = 5
"""Classes a layout makes before anything else, per layout index (see ``counted_under_callgrind``)."""

_PADDED_START = (
    "import os, runpy, sys\n"
    "pads = [type(f'_LayoutPad{i}', (), {}) for i in range(int(sys.argv.pop(1)))]\n"
    "for pad in pads:\n"
    "    getattr(pad, 'x', None)  # its first lookup gives the class a type version tag\n"
    "sys.argv.pop(0)\n"
    "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
"""``python -c`` program: make some classes, then run a script as ``__main__`` with the arguments after it."""


def counted_under_callgrind(prefix: Path, script: Path, child_args: list[str], layout: int,
                            environment: dict[str, str], per: int) -> int:
    """Instructions of the loop ``script --child *child_args`` runs, per iteration (``per`` of
    them), under callgrind, in memory layout number ``layout``.

    CPython's type attribute cache has 4096 slots, indexed by a type's version tag and the
    attribute name's address: two lookups a loop repeats can share a slot and miss every time
    (a miss is a walk of the class's MRO, ~300 instructions). Which pairs collide changes with
    the order types were first looked up and with where strings were allocated, so any change
    to a program, xsp's presence included, reshuffles them: measured on the ten-leaf toy model
    of call_instructions.py, from none to 40 misses an iteration from one layout to another
    (up to 14,000 instructions of a 125,000-instruction iteration), plainly and with xsp alike. A layout makes
    ``layout * LAYOUT_STRIDE`` classes ahead of everything, which shifts every later version tag
    (and the heap); the caller takes the median over layouts.
    """
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--dump-before={LOOP_ENTRY}",
               # %p: a process forked in the loop (a DataLoader worker) writes files of its own, and
               # its counts, dumped when it exits, never carry the trigger loop_instructions reads
               f"--dump-after={LOOP_ENTRY}", f"--callgrind-out-file={prefix}.%p", sys.executable, "-c",
               _PADDED_START, str(layout * LAYOUT_STRIDE), str(script), "--child", *child_args]
    # kernels inductor compiled and cached natively (the parent compiles the workload to size its
    # loop) stopped valgrind with SIGILL; with a cache of its own the child compiles them under
    # valgrind, for the CPU valgrind presents, and they run
    environment = {**environment, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
                   "TORCHINDUCTOR_CACHE_DIR": str(prefix.parent / "inductor" / prefix.name)}
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=prefix.parent)
    if finished.returncode != 0:
        raise RuntimeError(f"{' '.join(child_args)} (layout {layout}) under callgrind exited {finished.returncode}: "
                           f"{finished.stderr[-2000:]}")
    return loop_instructions(prefix) // per


def counted(name: str, configuration: str, iterations: int, folder: Path, layout: int) -> int:
    """Instructions per iteration of the workload in one configuration and layout, under callgrind."""
    return counted_under_callgrind(folder / f"{name}.{configuration}.{layout}.cg", Path(__file__).resolve(),
                                   [name, configuration, str(iterations)], layout, dict(os.environ), iterations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="native length of the measured loop")
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations of the measured loop, instead of --seconds' worth timed natively: the "
                             "timing moves with the machine's load, and a workload with costs per loop (the "
                             "threaded server starts its three workers in each) counts them per iteration")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind processes at once (each uses one core)")
    parser.add_argument("--layouts", type=int, default=3, help="memory layouts each configuration runs in (median)")
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run (default: all)")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("workload_instructions: valgrind is not installed", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    sys.path.insert(0, str(WORKLOADS))
    names = args.only or sorted(p.stem for p in WORKLOADS.glob("*.py"))
    plan = {name: iterations_for(name, args.seconds) for name in names}
    if args.iterations:
        plan = {name: (args.iterations, ms) for name, (_, ms) in plan.items()}
    rows: dict[str, dict[str, Any]] = {name: {"iterations": n, "plain_ms": ms} for name, (n, ms) in plan.items()}
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(args.jobs) as pool:
        jobs = {(name, configuration, layout): pool.submit(counted, name, configuration, plan[name][0], Path(scratch),
                                                           layout)
                for layout in range(args.layouts) for name in names for configuration in CONFIGURATIONS}
        for (name, configuration, layout), job in jobs.items():
            try:
                count = job.result()
            except RuntimeError as failed:  # e.g. SIGILL: code valgrind cannot run
                rows[name]["failed"] = f"{configuration}: {str(failed).splitlines()[0][:200]}"
                print(f"{name} {configuration}: failed: {failed}", file=sys.stderr, flush=True)
                continue
            rows[name].setdefault(configuration, {})[layout] = count
            print(f"{name} {configuration} layout {layout}: {count:,} instructions per iteration",
                  file=sys.stderr, flush=True)
    record(report(rows, args), RESULTS)
    return 0


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Overhead on real workloads, in instructions",
        "",
        f"Last run: {stamp}, {cpu_model()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"1 torch thread; `python benchmarks/workload_instructions.py "
        f"{f'--iterations {args.iterations}' if args.iterations else f'--seconds {args.seconds}'} "
        f"--layouts {args.layouts}`.",
        "",
        "Instructions executed by every thread of the workload's process during its `run_steps(n)` loop "
        "(after `build()` and a warm-up), counted by callgrind, per iteration. Overhead = the "
        "configuration's count / the plain count - 1 (goals, as for time: model <= 2%, model+layer <= 10%). "
        "Unlike the timings of `workloads.md` these counts do not move with the machine's load. Each "
        f"configuration runs in one or more memory layouts (`--layouts`: 0, {LAYOUT_STRIDE}, {2 * LAYOUT_STRIDE}... "
        "classes made before anything else): which of a loop's type attribute lookups collide in CPython's "
        "4096-slot cache changes with the layout, and any change to a program reshuffles them (up to some "
        "14,000 instructions an iteration, which matters to workloads of a few hundred thousand); the "
        "figures are medians over layouts, and the last columns give each layout's overhead. A full "
        "collection precedes each measured loop. A run of some workloads (`--only`) keeps the other "
        "rows of the runs before it as they were (rows without the last two columns come from a run "
        "that had neither layouts nor the collection).",
        "",
        "| workload | iterations | plain ms / iteration (native) | plain instructions | model | model+layer "
        "| model, per iteration | model+layer, per iteration | model, each layout | model+layer, each layout |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    table = {name: _row(name, row) for name, row in rows.items()}
    return lines + [line for _, line in sorted({**previous_rows(), **table}.items())]


def _row(name: str, row: dict[str, Any]) -> str:
    """One workload's line: medians over layouts, and each layout's overhead (plain and traced in
    the same layout number)."""
    lead = f"| {name} | {row['iterations']} | {row['plain_ms']:.3f} | "
    if "failed" in row:
        return lead + f"not counted: {row['failed']} | | | | | | |"
    plain = statistics.median(row["plain"].values())
    cells = [f"{plain:,.0f}"]
    traced = ("model", "model+layer")
    cells += [f"{statistics.median(row[configuration].values()) / plain - 1:+.2%}" for configuration in traced]
    cells += [f"{statistics.median(row[configuration].values()) - plain:+,.0f}" for configuration in traced]
    cells += [" ".join(f"{counts[layout] / row['plain'][layout] - 1:+.2%}" for layout in sorted(counts))
              for counts in (row[configuration] for configuration in traced)]
    return lead + " | ".join(cells) + " |"


def previous_rows() -> dict[str, str]:
    """The rows of the last results, by workload: a run of some workloads (``--only``) replaces
    those rows and keeps the others."""
    if not RESULTS.is_file():
        return {}
    known = {path.stem for path in WORKLOADS.glob("*.py")}
    rows = {}
    for line in RESULTS.read_text().splitlines():
        name = line.strip("| ").split(" |")[0]
        if line.startswith("| ") and name in known:
            rows[name] = line
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
