"""What xsp costs the scripts of examples/workloads, measured side by side in one run.

For each workload the script's own ``build()`` sets it up once (compiling its models, for the
torch.compile ones) and its ``run_steps(n)`` loop is timed plainly, inside an
``xsp.trace(levels="model")`` session and inside an ``xsp.trace(levels="model,layer")``
session. Configurations are interleaved round by round (each round starting with a different
one); overhead = a configuration's time / the plain time - 1, from the medians and from the
best rounds (on a shared machine other work only ever adds time, so the best rounds are the
least disturbed). Goals: model level <= 2%, model+layer <= 10%.

For the torch.compile workloads the compilation is repeated in a fresh dynamo state plainly and
inside each kind of session (build() inside the session, as ``xsp run`` sees it) and dynamo's
counters are compared: graph breaks, graphs, frames compiled. Goal: no graph break added.

Prints a table and records it in benchmarks/results/workloads.md.

Usage: python benchmarks/workloads.py [--rounds N] [--seconds S] [--threads T] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from _results import record

import xsp
from xsp.core.metadata import cpu_model

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "examples" / "workloads"
RESULTS = Path(__file__).resolve().parent / "results" / "workloads.md"
CONFIGURATIONS: dict[str, Callable[[], AbstractContextManager[Any]]] = {
    "plain": nullcontext,
    "model": lambda: xsp.trace(levels="model", output=None),
    "model+layer": lambda: xsp.trace(levels="model,layer", output=None),
}
COMPILED = ("compile_inference", "compile_train")


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"workload_{name}", WORKLOADS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seconds_per_step(run_steps: Callable[[int], Any], measurements: int = 5) -> float:
    """Seconds one iteration takes, untraced (after a warm-up): the least of ``measurements``
    timings of four iterations. Other work on a shared machine only adds time, and one timing
    alone spread 10x here (a threaded workload's four iterations timed 0.4 to 4 ms)."""
    run_steps(2)
    best = float("inf")
    for _ in range(measurements):
        began = time.perf_counter()
        run_steps(4)
        best = min(best, (time.perf_counter() - began) / 4)
    return max(best, 1e-6)


def steps_for(run_steps: Callable[[int], Any], seconds: float) -> int:
    """How many iterations take about ``seconds`` (after a warm-up)."""
    return max(4, int(seconds / seconds_per_step(run_steps)))


def timed(run_steps: Callable[[int], Any], steps: int, configuration: str) -> float:
    """Seconds per iteration of ``steps`` iterations inside one configuration."""
    gc.collect()
    with CONFIGURATIONS[configuration]():
        run_steps(1)  # the session's first call (model naming) is not the steady state
        began = time.perf_counter()
        run_steps(steps)
        return (time.perf_counter() - began) / steps


def overheads(name: str, rounds: int, seconds: float) -> dict[str, Any]:
    run_steps = load(name).build()
    steps = steps_for(run_steps, seconds)
    samples: dict[str, list[float]] = {configuration: [] for configuration in CONFIGURATIONS}
    order = list(CONFIGURATIONS)
    for round_number in range(rounds):
        turn = round_number % len(order)
        for configuration in order[turn:] + order[:turn]:
            samples[configuration].append(timed(run_steps, steps, configuration))
    medians = {configuration: statistics.median(values) for configuration, values in samples.items()}
    best = {configuration: min(values) for configuration, values in samples.items()}
    return {"steps": steps, "plain_ms": medians["plain"] * 1e3,
            **{f"{c}_overhead": medians[c] / medians["plain"] - 1 for c in CONFIGURATIONS if c != "plain"},
            **{f"{c}_best": best[c] / best["plain"] - 1 for c in CONFIGURATIONS if c != "plain"},
            "spread": max((max(v) - min(v)) / statistics.median(v) for v in samples.values())}


def compile_counts(name: str, configuration: str) -> tuple[int, int, int]:
    """(graph breaks, graphs, frames compiled) when the workload compiles inside ``configuration``."""
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    with CONFIGURATIONS[configuration]():
        load(name).build()(3)
    return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
            len(get_compilation_metrics()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.5, help="length of one timed loop")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run (default: all)")
    args = parser.parse_args(argv)
    names = args.only or sorted(p.stem for p in WORKLOADS.glob("*.py"))
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(WORKLOADS))
    rows = []
    for name in names:
        print(f"{name}...", file=sys.stderr, flush=True)
        result = overheads(name, args.rounds, args.seconds)
        if name in COMPILED:
            result["compile"] = {configuration: compile_counts(name, configuration) for configuration in CONFIGURATIONS}
        rows.append((name, result))
    record(report(rows, args), RESULTS)
    return 0


def report(rows: list[tuple[str, dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Overhead on real workloads",
        "",
        f"Last run: {stamp}, {cpu_model()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch thread(s); `python benchmarks/workloads.py --rounds {args.rounds} "
        f"--threads {args.threads}`.",
        "",
        "Each workload's own loop (`run_steps`, after `build()`), timed plainly and inside `xsp.trace()` "
        f"sessions, interleaved over {args.rounds} rounds. Overhead = the configuration's time / the plain "
        "time - 1, from the medians and from the best rounds (goals: model <= 2%, model+layer <= 10%). "
        "*Spread* is the widest (max - min) / median of any configuration's rounds: differences smaller "
        "than it are within this shared machine's noise.",
        "",
        "| workload | iterations timed | plain ms / iteration | model (median) | model+layer (median) "
        "| model (best) | model+layer (best) | spread |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, result in rows:
        lines.append(f"| {name} | {result['steps']} | {result['plain_ms']:.3f} | {result['model_overhead']:+.1%} "
                     f"| {result['model+layer_overhead']:+.1%} | {result['model_best']:+.1%} "
                     f"| {result['model+layer_best']:+.1%} | {result['spread']:.1%} |")
    compiled = [(name, result["compile"]) for name, result in rows if "compile" in result]
    if compiled:
        lines += [
            "",
            "torch.compile, compiling inside each configuration (`build()` in the session, as under `xsp run`): "
            "dynamo's graph-break counter, graphs and frames compiled (goal: the same as plain).",
            "",
            "| workload | configuration | graph breaks | graphs | frames compiled |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for name, counts in compiled:
            for configuration, (breaks, graphs, frames) in counts.items():
                lines.append(f"| {name} | {configuration} | {breaks} | {graphs} | {frames} |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
