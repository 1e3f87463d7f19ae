"""What xsp costs one module call, counted in instructions: a top-level call, a call nested in
one, and a nested call with a keyword argument, at each level, with xsp's C part and without.

Four toy models, each called in a loop under ``torch.no_grad()``: one whose forward calls no
module (a top-level call alone), one whose forward calls ten leaf modules, and one that calls
them with a keyword argument (as Hugging Face models call theirs), and one whose ten leaves sit in
two nn.Sequential inside a third (torch's code calls them). Each leaf returns its input,
so what is counted is the machinery of the call. Every loop runs under valgrind's callgrind
(as in benchmarks/workload_instructions.py); from the counts per iteration follow xsp's cost
of a top-level call (the first model, traced minus plain) and of a nested call (the second
model's extra over the first, per leaf). ``python`` configurations set ``XSP_PURE_PYTHON``.

Prints a table and records it in benchmarks/results/call_instructions.md.

Usage: python benchmarks/call_instructions.py [--calls N] [--jobs J]
(needs valgrind; about five minutes).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

import torch
from _results import record
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from torch import nn
from workload_instructions import LAYOUT_STRIDE, counted_under_callgrind, instrument_from_here, run_measured

import xsp
from xsp.core.metadata import cpu_model

RESULTS = Path(__file__).resolve().parent / "results" / "call_instructions.md"
LEAVES = 10
MODELS = ("top-level only", "10 nested", "10 nested, keyword", "10 in nested Sequentials")
SEQUENTIAL_CALLS = LEAVES + 3
"""Module calls of the last model below its top-level call: two Sequentials of five leaves in a third."""
CONFIGURATIONS: dict[str, tuple[str | None, bool, bool, float | None, bool]] = {
    # name: (levels or None, pure Python, call sites, sample, each call in a request's span)
    "plain": (None, False, True, None, False),
    "model": ("model", False, True, None, False),
    "model+layer": ("model,layer", False, True, None, False),
    "model+layer, no call sites": ("model,layer", False, False, None, False),
    "model+layer, always on, not sampled": ("model,layer", False, True, 0.0, False),
    "plain, in a request's span": (None, False, True, None, True),
    "model+layer, always on, not sampled, in a request's span": ("model,layer", False, True, 0.0, True),
    "model, python": ("model", True, True, None, False),
    "model+layer, python": ("model,layer", True, True, None, False),
}
"""``always on, not sampled``: ``xsp.trace(sample=0)`` (with no step drawn, and none slow: the
steps of an always-on session that are timed at the model level only). ``in a request's span``:
each iteration runs inside an OpenTelemetry span (the SDK's, sampled, sent nowhere), as a
service's requests do under its instrumentation; its cost is counted against ``plain, in a
request's span``."""
SPAN_BASELINE: Final = "plain, in a request's span"


class Leaf(nn.Module):
    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        return x


class Calls(nn.Module):
    def __init__(self, leaves: int, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.leaves = nn.ModuleList(Leaf() for _ in range(leaves))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for leaf in self.leaves:
            x = leaf(x, scale=None) if self.keyword else leaf(x)
        return x


class InSequentials(nn.Module):
    """Leaves called by torch's code (nn.Sequential), two levels down: a call site's walk passes
    library frames to reach the user's line."""

    def __init__(self) -> None:
        super().__init__()
        half = LEAVES // 2
        self.body = nn.Sequential(nn.Sequential(*(Leaf() for _ in range(half))),
                                  nn.Sequential(*(Leaf() for _ in range(LEAVES - half))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build(model_name: str) -> nn.Module:
    return {"top-level only": Calls(0, False), "10 nested": Calls(LEAVES, False),
            "10 nested, keyword": Calls(LEAVES, True), "10 in nested Sequentials": InSequentials()}[model_name]


def child(model_name: str, configuration: str, calls: int) -> None:
    """Run inside callgrind: build, warm up, then the measured loop (run_measured)."""
    torch.set_num_threads(1)
    model, x = build(model_name), torch.zeros(4, 8)
    levels, _, _, sample, in_span = CONFIGURATIONS[configuration]
    tracer = TracerProvider(sampler=ALWAYS_ON).get_tracer("service")

    def loop(n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                model(x)

    def loop_in_spans(n: int) -> None:
        with torch.no_grad():
            for _ in range(n):
                with tracer.start_as_current_span("request"):
                    model(x)

    if in_span:
        loop = loop_in_spans
    instrument_from_here()
    loop(50)
    if levels is None:
        run_measured(loop, calls)
        return
    with xsp.trace(levels=levels, output=None, sample=sample, slow_factor=0):
        loop(50)  # the model's first call (naming) and the thread's buffer are not the steady state
        run_measured(loop, calls)


def counted(model_name: str, configuration: str, calls: int, folder: Path, layout: int) -> int:
    """Instructions per iteration of the loop in one layout, under callgrind."""
    prefix = folder / f"{MODELS.index(model_name)}.{configuration.replace(', ', '-')}.{layout}.cg"
    environment = dict(os.environ)
    environment.pop("XSP_PURE_PYTHON", None)
    environment.pop("XSP_CALL_SITES", None)
    if CONFIGURATIONS[configuration][1]:
        environment["XSP_PURE_PYTHON"] = "1"
    if not CONFIGURATIONS[configuration][2]:
        environment["XSP_CALL_SITES"] = "0"
    return counted_under_callgrind(prefix, Path(__file__).resolve(), [model_name, configuration, str(calls)],
                                   layout, environment, calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="iterations of each measured loop")
    parser.add_argument("--layouts", type=int, default=3, help="memory layouts each loop runs in (median)")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind processes at once (each uses one core)")
    parser.add_argument("--configurations", default=";".join(CONFIGURATIONS),
                        help="the configurations to count, separated by ; (plain is always counted)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the markdown file the table is recorded in")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None:
        print("call_instructions: valgrind is not installed", file=sys.stderr)
        return 2
    named = [name for name in args.configurations.split(";") if name in CONFIGURATIONS and name != "plain"]
    if any(CONFIGURATIONS[name][4] for name in named) and SPAN_BASELINE not in named:
        named.insert(0, SPAN_BASELINE)
    chosen = ["plain", *named]
    by_layout: dict[tuple[str, str, int], int] = {}
    with tempfile.TemporaryDirectory() as scratch, ThreadPoolExecutor(args.jobs) as pool:
        jobs = {(model_name, configuration, layout): pool.submit(counted, model_name, configuration, args.calls,
                                                                 Path(scratch), layout)
                for layout in range(args.layouts) for model_name in MODELS for configuration in chosen}
        for key, job in jobs.items():
            by_layout[key] = job.result()
            print(f"{key[0]} {key[1]} layout {key[2]}: {by_layout[key]:,} instructions per iteration",
                  file=sys.stderr, flush=True)
    record(report(by_layout, args, chosen, plain_leaf_ns()), args.results)
    return 0


def plain_leaf_ns(loops: int = 2000, repeats: int = 7) -> float:
    """What one plain leaf call takes here, in nanoseconds (no valgrind): to read instruction counts as time."""
    torch.set_num_threads(1)
    x = torch.zeros(4, 8)
    times = {}
    for name in ("top-level only", "10 nested"):
        model = build(name)
        with torch.no_grad():
            for _ in range(200):
                model(x)
            runs = []
            for _ in range(repeats):
                began = time.perf_counter_ns()
                for _ in range(loops):
                    model(x)
                runs.append((time.perf_counter_ns() - began) / loops)
        times[name] = statistics.median(runs)
    return (times["10 nested"] - times["top-level only"]) / LEAVES


def report(by_layout: dict[tuple[str, str, int], int], args: argparse.Namespace, chosen: list[str],
           leaf_ns: float) -> list[str]:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    top, nested, keyword, sequentials = MODELS
    layouts = range(args.layouts)
    counts = {(model_name, configuration): round(statistics.median(by_layout[(model_name, configuration, layout)]
                                                                   for layout in layouts))
              for model_name in MODELS for configuration in chosen}
    lines = [
        "# What one module call costs, in instructions",
        "",
        f"Last run: {stamp}, {cpu_model()}, torch {torch.__version__}, Python {platform.python_version()}; "
        f"`python benchmarks/call_instructions.py --calls {args.calls} --layouts {args.layouts}`.",
        "",
        "Instructions per iteration of a loop calling a toy model under `torch.no_grad()`, counted by "
        "callgrind; xsp's cost of a call = traced - plain (a top-level call: the model whose forward "
        f"calls no module; a nested call: the extra of the model calling {LEAVES} leaves, per leaf; in nested "
        f"Sequentials: per module call of {SEQUENTIAL_CALLS}, the leaves called by torch's code two levels down). "
        "`python`: xsp's C part switched off (`XSP_PURE_PYTHON=1`); `no call sites`: `XSP_CALL_SITES=0`, "
        "the line of the user's code that made each call not recorded; `in a request's span`: each iteration "
        "inside an OpenTelemetry span (the SDK's, sampled), counted against `plain, in a request's span`. "
        "Each loop runs in "
        f"{args.layouts} memory layouts (0, {LAYOUT_STRIDE}, {2 * LAYOUT_STRIDE}... classes made before anything "
        "else), since which type attribute lookups collide in CPython's 4096-slot cache changes with the "
        "layout (one layout of the plain ten-leaf loop missed 22 lookups an iteration, ~7,000 instructions, "
        "another none); counts are medians over layouts, and the last column is the nested call's cost "
        "in each layout.",
        "",
        "| configuration | top-level only | 10 nested | 10 nested, keyword | 10 in nested Sequentials "
        "| top-level call | nested call | nested call, keyword | call in nested Sequentials "
        "| nested call, each layout |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def extra(configuration: str, model_name: str, layout: int | None = None) -> int:
        baseline = SPAN_BASELINE if CONFIGURATIONS[configuration][4] else "plain"
        if layout is None:
            return counts[(model_name, configuration)] - counts[(model_name, baseline)]
        return by_layout[(model_name, configuration, layout)] - by_layout[(model_name, baseline, layout)]

    ns_per_instruction = leaf_ns / ((counts[(nested, "plain")] - counts[(top, "plain")]) / LEAVES)
    lines[4] += (f" A plain leaf call took {leaf_ns:,.0f} ns here outside valgrind: one instruction is about "
                 f"{ns_per_instruction:.3f} ns (100 ns, about {100 / ns_per_instruction:,.0f} instructions).")
    for configuration in chosen:
        row = [f"{counts[(model_name, configuration)]:,}" for model_name in MODELS]
        if CONFIGURATIONS[configuration][0] is None:  # a baseline: what the program's own calls cost
            per_leaf = (counts[(nested, configuration)] - counts[(top, configuration)]) / LEAVES
            per_keyword_leaf = (counts[(keyword, configuration)] - counts[(top, configuration)]) / LEAVES
            per_call = (counts[(sequentials, configuration)] - counts[(top, configuration)]) / SEQUENTIAL_CALLS
            costs = ["", f"({per_leaf:,.0f} per leaf call)", f"({per_keyword_leaf:,.0f})", f"({per_call:,.0f})", ""]
        else:
            top_cost = extra(configuration, top)
            each = " ".join(f"{(extra(configuration, nested, k) - extra(configuration, top, k)) / LEAVES:+,.0f}"
                            for k in layouts)
            costs = [f"+{top_cost:,}", f"{(extra(configuration, nested) - top_cost) / LEAVES:+,.0f}",
                     f"{(extra(configuration, keyword) - top_cost) / LEAVES:+,.0f}",
                     f"{(extra(configuration, sequentials) - top_cost) / SEQUENTIAL_CALLS:+,.0f}", each]
        lines.append(f"| {configuration} | " + " | ".join(row + costs) + " |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
