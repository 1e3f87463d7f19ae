"""How accurate leveled experimentation is, on ResNet-50 and BERT-base on this CPU.

For each model at batch 1 and a larger batch, in one process, side by side:

* the model's latency untraced, under PyTorch's profiler (CPU, shapes recorded), and in each
  leveled run (model; model+layer; model+layer+operator; the flops metric run);
* the sum of the top-level layers' leveled latencies against the model-only run's model
  latency (goal: within 3%);
* the inflation a naive run with every level at once (model, layer, operator, flops) shows
  against the leveled figures, for layers and for operators (median of per-span ratios, and
  of the total).

Then repeatability: ``xsp.leveled(fn)`` with its default arguments (levels model, layer,
operator; calibrated compensation; rounds until the intervals are within ±2% or the budget
runs out), invoked ``--invocations`` times (default 10) on the small-layer model (40 x
``Linear(64, 64)`` + ``ReLU``, batch 8, under no_grad and without it) and, unless
``--repeatability small``, on ResNet-50 and BERT-base at batch 1 and (unless
``--repeatability batch1``) the larger batch (``--repeatability large``: those two models
only, every batch): the error of the top-level layers' sum against
the model call's leveled latency in each invocation (goal: within 3% in 10 of 10), the rounds
each took, and the calibration figures per level.

Models are built from their configs with random weights (nothing downloaded). Results go to
benchmarks/results/leveled.md.

Usage: python benchmarks/leveled.py [--repeat N] [--warmup N] [--quick] [--invocations N]
       [--repeatability small|batch1|large|all] [--skip-accuracy]
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from _results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
RESULTS = ROOT / "benchmarks" / "results" / "leveled.md"
ALL_LEVELS = "model,layer,operator,flops"


def _call_times_ms(fn: Callable[[], Any], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def _profiler_times_ms(fn: Callable[[], Any], repeat: int) -> list[float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True):
        return _call_times_ms(fn, repeat)


def _naive(fn: Callable[[], Any], repeat: int, warmup: int) -> pd.DataFrame:
    """Spans of one run with every level at once."""
    import xsp
    from xsp.core import schema as col

    for _ in range(warmup):
        fn()
    with xsp.trace(levels=ALL_LEVELS, output=None) as session:
        for _ in range(repeat):
            with xsp.step("leveled"):
                fn()
    spans = session.trace.spans
    return spans[spans[col.LEVEL].isin(["layer", "operator"])]


def _inflation(merged: pd.DataFrame, naive: pd.Series, level: str) -> tuple[float, float]:
    from xsp.core import schema as col

    mine = merged[(merged[col.LEVEL] == level) & merged[col.PATH].isin(naive.index)]
    if mine.empty:
        return float("nan"), float("nan")
    leveled = mine[col.DURATION_NS].to_numpy(dtype=np.float64)
    inflated = naive.reindex(mine[col.PATH]).to_numpy(dtype=np.float64)
    ok = leveled > 0
    return float(np.median(inflated[ok] / leveled[ok])), float(inflated[ok].sum() / leveled[ok].sum())


def measure(name: str, batch: int, fn: Callable[[], Any], repeat: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Every configuration once per round, interleaved; figures pooled over the rounds."""
    import xsp
    from xsp.analysis.model import trimmed_mean
    from xsp.core import schema as col
    from xsp.table.walks import parent_positions

    for _ in range(warmup):
        fn()
    # one untimed pass under the profiler and under every xsp level first: on these machines a
    # process's first profiling session pays for faulting in fresh memory for its event buffers,
    # which would otherwise land on whichever measurement happens to come first
    _profiler_times_ms(fn, 1)
    xsp.leveled(fn, levels=ALL_LEVELS, repeat=1, warmup=0)
    untraced: list[float] = []
    profiled: list[float] = []
    naive_frames = []
    for _ in range(rounds):
        untraced += _call_times_ms(fn, repeat)
        profiled += _profiler_times_ms(fn, repeat)
        naive_frames.append(_naive(fn, repeat, warmup))
    result = xsp.leveled(fn, levels=ALL_LEVELS, repeat=repeat, warmup=warmup, rounds=rounds)
    naive_spans = pd.concat(naive_frames, ignore_index=True)
    naive = naive_spans.groupby(col.PATH)[col.DURATION_NS].agg(lambda v: trimmed_mean(v.to_numpy()))
    spans = result.trace.spans
    parents = parent_positions(spans)
    kinds = spans[col.KIND].to_numpy()
    is_top_layer = (spans[col.LEVEL] == "layer").to_numpy() & (parents >= 0)
    is_top_layer &= kinds[np.maximum(parents, 0)] == "predict"
    top_layers_ms = spans[col.DURATION_NS].to_numpy()[is_top_layer].sum() / 1e6
    overhead = result.overhead.set_index("run")
    model_ms = float(overhead.loc["model", "model_latency_ms"])
    layer_median, layer_total = _inflation(spans, naive, "layer")
    op_median, op_total = _inflation(spans, naive, "operator")
    return {
        "model": name, "batch": batch, "untraced_ms": trimmed_mean(np.array(untraced)),
        "profiler_ms": trimmed_mean(np.array(profiled)),
        "runs": {run: float(row["model_latency_ms"]) for run, row in overhead.iterrows()},
        "model_ms": model_ms, "top_layers_ms": top_layers_ms, "top_layers": int(is_top_layer.sum()),
        "layer_inflation": (layer_median, layer_total), "operator_inflation": (op_median, op_total),
        "unmatched": len(result.unmatched), "spans": len(spans), "steps": int(overhead["steps"].iloc[0]),
    }


SMALL_LAYERS = 40


def small_layer_model() -> Callable[[], Any]:
    """40 x Linear(64, 64) + ReLU at batch 8: layers of a few microseconds, where a layer's own
    tracing cost is a large share of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(SMALL_LAYERS) for m in (torch.nn.Linear(64, 64),
                                                                            torch.nn.ReLU())]).eval()
    x = torch.randn(8, 64)
    return lambda: model(x)


def nested_block_model() -> Callable[[], Any]:
    """40 blocks of Sequential(Linear(64, 64), ReLU()) at batch 8 under inference_mode: the
    small layers of :func:`small_layer_model`, nested one level in containers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
                                  for _ in range(SMALL_LAYERS)]).eval()
    x = torch.randn(8, 64)

    def call() -> Any:
        with torch.inference_mode():
            return model(x)

    return call


def depth_comparison(invocations: int, work: list[tuple[str, int, Callable[[], Any]]]) -> list[dict[str, Any]]:
    """For each model, ``invocations`` separate ``xsp.leveled(fn)`` calls with default arguments
    leveled by module depth and as many with compensation only (``by_depth=False``), the two
    alternating: the top-level layers' error against the model call, whether it lies within
    the model-only figure's own 95% interval, precision, bursts run again, time per call."""
    import xsp

    rows = []
    for name, batch, fn in work:
        print(f"depth-leveled against compensation-only: {name}, batch {batch} ...", file=sys.stderr)
        found: dict[bool, dict[str, list[Any]]] = {mode: {"errors": [], "spread": [], "precise": [], "bursts": [],
                                                          "seconds": [], "rounds": [], "runs": []}
                                                   for mode in (True, False)}
        for _ in range(invocations):
            for by_depth in (True, False):
                began = time.perf_counter()
                result = xsp.leveled(fn, by_depth=by_depth)
                taken = found[by_depth]
                taken["seconds"].append(time.perf_counter() - began)
                details = result.trace.metadata["leveled"]
                model = result.overhead.set_index("run").loc["model"]
                taken["errors"].append(top_layer_error(result))
                taken["spread"].append(float(model["model_latency_ci_ms"] / model["model_latency_ms"]))
                taken["precise"].append(bool(details["precise"]))
                taken["bursts"].append(int(details.get("repeated", 0)))
                taken["rounds"].append(int(details["rounds"]))
                taken["runs"].append(int(details.get("runs_per_round", len(details["runs"]))))
        for by_depth in (True, False):
            rows.append({"model": name, "batch": batch, "by_depth": by_depth, **found[by_depth]})
    return rows


DEPTH_SECTION = "## Leveled by module depth against compensation only"
DEPTH_COLUMNS = 13
"""Cells in a row of the depth comparison (the last: when the row was measured)."""


def _depth_lines(rows: list[dict[str, Any]], invocations: int) -> list[str]:
    lines = [DEPTH_SECTION, "",
             f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, "
             f"{platform.processor() or platform.machine()}, 1 torch thread; `python benchmarks/leveled.py "
             f"--by-depth --invocations {invocations}`. Per model, {invocations} separate `xsp.leveled(fn)` calls "
             "with default arguments (levels model, layer, operator) leveled by depth, and as many with "
             "`by_depth=False` (the layer level once, every depth, the calibrated cost of the layers below each "
             "one taken out), alternating. Error: the top-level layers' sum over the model call's leveled latency, "
             "minus one (goal: within 3% in every call, and within the model-only figure's own 95% interval).", "",
             "| model | batch | leveling | runs a round | within 3% | within the model's interval | errors (min / "
             "median / max) | model-only interval (median) | precise (±2%) | bursts run again | rounds | "
             "seconds per call | measured |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- |"]
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    for r in rows:
        errors, spread = np.array(r["errors"]), np.array(r["spread"])
        lines.append(
            f"| {r['model']} | {r['batch']} | {'by depth' if r['by_depth'] else 'compensation only'} | "
            f"{max(r['runs'])} | {int((np.abs(errors) <= 0.03).sum())} of {len(errors)} | "
            f"{int((np.abs(errors) <= spread).sum())} of {len(errors)} | "
            f"{errors.min():+.1%} / {np.median(errors):+.1%} / {errors.max():+.1%} | ±{np.median(spread):.1%} | "
            f"{sum(r['precise'])} of {len(errors)} | {sum(r['bursts'])} | {min(r['rounds'])}-{max(r['rounds'])} | "
            f"{np.median(r['seconds']):.1f} | {when} |")
    return lines


def _depth_merged_with(lines: list[str], previous: str) -> list[str]:
    """The depth comparison just measured for some models (``--only``), with the rows of the
    other models kept from ``previous`` results after it, each row dated by its last column."""
    if "\n" + DEPTH_SECTION not in previous:
        return lines
    old = previous.split("\n" + DEPTH_SECTION, 1)[1].split("\n## ", 1)[0].splitlines()
    found = next((re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", line) for line in old if line.startswith("Last run")),
                 None)
    when = found.group(0) if found else "earlier"
    new_keys = {_row_key(line) for line in lines}
    kept = [line if line.count("|") == DEPTH_COLUMNS + 1 else f"{line} {when} |"
            for line in old if _row_key(line) is not None and _row_key(line) not in new_keys]
    last = max(index for index, line in enumerate(lines) if line.startswith("| "))
    dated = [re.sub(r"^Last run: [^,]*, ", "Last runs: each row's last column; ", line) for line in lines]
    return [*dated[:last + 1], *kept, *dated[last + 1:]]


def _kept_depth_section(text: str) -> list[str]:
    """The depth comparison section of earlier results, kept by a run that does not measure it."""
    return ["", DEPTH_SECTION, *text.split("\n" + DEPTH_SECTION, 1)[1].rstrip("\n").splitlines()] \
        if "\n" + DEPTH_SECTION in text else []


def with_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` called while autograd records a graph (as a plain ``model(x)`` is), never running backward."""
    def called() -> Any:
        with torch.enable_grad():
            return fn()

    return called


def top_layer_error(result: Any) -> float:
    """Sum of the top-level layers over the model call's leveled latency, minus one."""
    from xsp.core import schema as col
    from xsp.table.walks import parent_positions

    spans = result.trace.spans
    parents = parent_positions(spans)
    kinds = spans[col.KIND].to_numpy()
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.float64)
    top = (spans[col.LEVEL] == "layer").to_numpy() & (parents >= 0)
    top &= kinds[np.maximum(parents, 0)] == "predict"
    model_call = durations[kinds == "predict"].sum()
    return float(durations[top].sum() / model_call - 1)


def repeatability(name: str, batch: int, fn: Callable[[], Any], invocations: int) -> dict[str, Any]:
    """``xsp.leveled(fn)`` with default arguments, ``invocations`` times."""
    import xsp

    errors, rounds, seconds, precise = [], [], [], []
    calibration: dict[str, Any] = {}
    for _ in range(invocations):
        began = time.perf_counter()
        result = xsp.leveled(fn)
        seconds.append(time.perf_counter() - began)
        details = result.trace.metadata["leveled"]
        errors.append(top_layer_error(result))
        rounds.append(details["rounds"])
        precise.append(bool(details["precise"]))
        calibration = details["calibration"]
    return {"model": name, "batch": batch, "errors": errors, "rounds": rounds, "seconds": seconds,
            "precise": precise, "calibration": calibration}


def _repeatability_lines(rows: list[dict[str, Any]], invocations: int) -> list[str]:
    lines = [
        "", f"## Repeatability with default arguments ({invocations} separate `xsp.leveled(fn)` calls; "
        "goal: top-level layers within 3% of the model call in every one)", "",
        "Error: sum of the top-level layers' leveled latencies over the model call's (both compensated), minus one.",
        "", "| model | batch | within 3% | worst error | errors (min / median / max) | rounds (min-max) | "
        "precise (±2%) | seconds per call |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for r in rows:
        errors = np.array(r["errors"])
        within = int((np.abs(errors) <= 0.03).sum())
        worst = errors[np.argmax(np.abs(errors))]
        lines.append(f"| {r['model']} | {r['batch']} | {within} of {len(errors)} | {worst:+.1%} | "
                     f"{errors.min():+.1%} / {np.median(errors):+.1%} / {errors.max():+.1%} | "
                     f"{min(r['rounds'])}-{max(r['rounds'])} | {sum(r['precise'])} of {len(errors)} | "
                     f"{np.median(r['seconds']):.1f} |")
    lines += ["", "## Calibration: what one span costs per level, measured at the start of each call (last call)", "",
              "| model | level | inside its own span ns | seen by its parent ns | each nested module call "
              "(model level) ns | untimed call given back ns |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        for level, cost in r["calibration"].items():
            lines.append(f"| {r['model']} (batch {r['batch']}) | {level} | {cost['inside_ns']:.0f} | "
                         f"{cost['parent_ns']:.0f} | {cost.get('nested_ns', 0):.0f} | "
                         f"{cost.get('untimed_ns', 0):.0f} |")
    return lines


def _row_key(line: str) -> str | None:
    """What a results table row is about: ``model (batch N)``, from either table's first cells."""
    cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
    if len(cells) < 2 or not line.startswith("| ") or set(cells[0]) <= {"-", " "} or cells[0] == "model":
        return None
    return cells[0] if cells[0].endswith(")") else f"{cells[0]} (batch {cells[1]})"


def _merged_with(lines: list[str], previous: str) -> list[str]:
    """``lines`` (the repeatability and calibration tables of the rows just measured) with the
    rows of ``previous`` results that were not measured again kept in place: a run of some
    rows (``--repeatability small --skip-accuracy``) replaces those rows only."""
    old_tables = previous.split("\n## Repeatability", 1)[1].split("\n## ") if "\n## Repeatability" in previous else []
    result: list[str] = []
    table = -1
    for index, line in enumerate(lines):
        if line.startswith("## "):
            table += 1
        result.append(line)
        if not line.startswith("| ---") or table >= len(old_tables):
            continue
        new_keys = {_row_key(row) for row in lines[index + 1:] if row.startswith("| ")}
        for old_line in old_tables[table].splitlines():
            key = _row_key(old_line)
            if key is not None and key not in new_keys:
                result.append(old_line)
    return result


def _workloads(quick: bool) -> list[tuple[str, int, Callable[[], Any]]]:
    from bert_inference import build_model as build_bert
    from bert_inference import make_batch
    from resnet50_inference import build_model as build_resnet
    from resnet50_inference import preprocess

    resnet, bert = build_resnet(), build_bert(layers=2 if quick else 12)
    image = 64 if quick else 224
    large = 2 if quick else 8
    work = []
    for batch in (1, large):
        images = preprocess(batch, image)
        work.append((f"ResNet-50 {image}x{image}", batch, lambda x=images: resnet(x)))
    for batch in (1, large):
        tokens = make_batch(batch, 128, bert.config.vocab_size)
        work.append((f"BERT-base seq 128{' (2 layers)' if quick else ''}", batch, lambda t=tokens: bert(**t)))
    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="measured calls per run and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every configuration")
    parser.add_argument("--quick", action="store_true", help="small inputs, for a smoke test")
    parser.add_argument("--invocations", type=int, default=10, help="xsp.leveled calls per repeatability row")
    parser.add_argument("--repeatability", choices=("small", "batch1", "large", "all"), default="all",
                        help="the small-layer model only, with ResNet-50 and BERT-base at batch 1, ResNet-50 and "
                        "BERT-base only (every batch), or all of them")
    parser.add_argument("--only", default=None, metavar="TEXT",
                        help="only the repeatability rows whose 'model (batch N)' contains TEXT, e.g. "
                        "'BERT-base seq 128 (batch 1)'")
    parser.add_argument("--by-depth", action="store_true",
                        help="only: leveled by module depth against compensation only, on the nested and flat "
                        "small-layer models, ResNet-50 and BERT-base at batch 1 (its own section of the results)")
    parser.add_argument("--skip-accuracy", action="store_true",
                        help="only the repeatability rows (the accuracy tables are not rewritten)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.by_depth:
        with torch.no_grad():
            work = [(f"{SMALL_LAYERS} x Sequential(Linear(64, 64), ReLU), inference_mode", 8, nested_block_model()),
                    (f"{SMALL_LAYERS} x Linear(64, 64) + ReLU, flat", 8, small_layer_model()),
                    *[item for item in _workloads(args.quick) if item[1] == 1]]
            if args.only:
                work = [item for item in work if args.only in f"{item[0]} (batch {item[1]})"]
            lines = _depth_lines(depth_comparison(args.invocations, work), args.invocations)
        print(*lines, sep="\n")
        text = RESULTS.read_text() if RESULTS.is_file() else "# Leveled experimentation: accuracy on CPU\n"
        kept = text.split("\n" + DEPTH_SECTION)[0].rstrip("\n").splitlines()
        if args.only:
            lines = _depth_merged_with(lines, text)
        record([*kept, "", *lines], RESULTS)
        return 0
    rows = []
    repeats = []
    with torch.no_grad():
        workloads = _workloads(args.quick)
        if not args.skip_accuracy:
            for name, batch, fn in workloads:
                print(f"measuring {name}, batch {batch} ...", file=sys.stderr)
                rows.append(measure(name, batch, fn, args.repeat, args.warmup, args.rounds))
        small = small_layer_model()
        chosen = [(f"{SMALL_LAYERS} x Linear(64, 64) + ReLU", 8, small),
                  (f"{SMALL_LAYERS} x Linear(64, 64) + ReLU, without no_grad", 8, with_grad(small))]
        if args.repeatability == "large":
            chosen = list(workloads)
        elif args.repeatability == "all":
            chosen += workloads
        elif args.repeatability == "batch1":
            chosen += [work for work in workloads if work[1] == 1]
        if args.only:
            chosen = [work for work in chosen if args.only in f"{work[0]} (batch {work[1]})"]
        for name, batch, fn in chosen:
            print(f"repeatability of {name}, batch {batch} ...", file=sys.stderr)
            repeats.append(repeatability(name, batch, fn, args.invocations))
    if args.skip_accuracy:
        text = RESULTS.read_text() if RESULTS.is_file() else "# Leveled experimentation: accuracy on CPU"
        previous = text.split("\n## Repeatability")[0].rstrip("\n").splitlines()
        depth = _kept_depth_section(text)
        text = text.split("\n" + DEPTH_SECTION)[0]
        record(previous + _merged_with(_repeatability_lines(repeats, args.invocations), text) + depth, RESULTS)
        return 0
    runs = list(rows[0]["runs"])
    lines = [
        "# Leveled experimentation: accuracy on CPU", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, 1 torch thread; "
        f"`python benchmarks/leveled.py --repeat {args.repeat} --warmup {args.warmup} --rounds {args.rounds}"
        f"{' --quick' if args.quick else ''}`. Random weights, no_grad. Every figure of one row comes from the same "
        f"process: {args.rounds} interleaved rounds of untraced calls, calls under PyTorch's profiler and the naive "
        f"all-levels run, then `xsp.leveled(rounds={args.rounds})` (its runs interleaved, each round starting one "
        f"run later), {args.repeat} measured calls each, pooled over the rounds; latencies "
        "are trimmed means (20% off each end). Before measuring, one untimed pass under the profiler and every "
        "level (a process's first profiling session pays for faulting in memory for its buffers, which on these "
        "virtual machines costs more than the tracing itself).", "",
        "## Overhead each level adds to the model latency (ms; in brackets, against the untraced model)", "",
        "| model | batch | untraced | PyTorch profiler (CPU) | " + " | ".join(runs) + " |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * len(runs),
    ]
    for r in rows:
        base = r["untraced_ms"]
        cells = [f"{r['runs'][run]:.2f} ({r['runs'][run] / base - 1:+.0%})" for run in runs]
        lines.append(f"| {r['model']} | {r['batch']} | {base:.2f} | {r['profiler_ms']:.2f} "
                     f"({r['profiler_ms'] / base - 1:+.0%}) | " + " | ".join(cells) + " |")
    lines += [
        "", "## Top-level layers in the merged result against the model-only run (goal: within 3%)", "",
        "| model | batch | top-level layers | their leveled sum ms | model latency (model-only run) ms | difference |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        difference = r["top_layers_ms"] / r["model_ms"] - 1
        lines.append(f"| {r['model']} | {r['batch']} | {r['top_layers']} | {r['top_layers_ms']:.2f} | "
                     f"{r['model_ms']:.2f} | {difference:+.1%} |")
    lines += [
        "", f"## Inflation of a naive run with every level at once ({ALL_LEVELS}) against the leveled figures", "",
        "Median over spans of naive / leveled duration, and total naive time / total leveled time.", "",
        "| model | batch | layers: median | layers: total | operators: median | operators: total | "
        "spans not repeating |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        (lm, lt), (om, ot) = r["layer_inflation"], r["operator_inflation"]
        lines.append(f"| {r['model']} | {r['batch']} | {lm:.2f}x | {lt:.2f}x | {om:.2f}x | {ot:.2f}x | "
                     f"{r['unmatched']} of {r['spans']} |")
    earlier = RESULTS.read_text() if RESULTS.is_file() else ""
    record(lines + _repeatability_lines(repeats, args.invocations) + _kept_depth_section(earlier), RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
