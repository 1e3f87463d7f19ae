"""xsp diff on noisy runs: false alarms, detection, attribution, and speed beside HTA.

Prints a table and records it in benchmarks/results/diff.md.

1. A small real model (an MLP of five Linear layers with ReLU, batch 64, CPU, one thread) is
   profiled at the model and layer levels in separate processes, 40 steps each (after 5
   warm-up steps that are not recorded). Runs are made in interleaved order: plain runs, and
   runs whose layer ``body.2`` does +10%, +20% or +50% more work (the same Linear applied
   again to that share of the batch, inside the layer).
2. *False alarms*: every A/A pair of plain runs (consecutive runs, each used once) diffed
   with the defaults; a false alarm is an overall verdict of ``regressed`` or ``improved``
   (``inconclusive``, counted apart, says the pair could not have shown a change).
3. *Detection*: each slowed run against a plain run made next to it: detected when the
   verdict is ``regressed``; *attributed* when the slowed layer is the regressed layer
   with the largest delta.
4. *Several runs a side*: the same runs drawn three at a time (seeded, no run on both sides
   of a draw): 20 A/A draws of plain runs, and for each slowdown draws of three slowed runs
   against three plain ones, pooled by ``xsp.diff`` (a key must then also move beyond the
   spread between the runs' medians).
5. *Baselines*: the same pairs with the base given as its baseline summary (``xsp summary``),
   and the size of ResNet-50's summaries beside their traces (model,layer and
   model,layer,operator; 40 and 100 steps).
6. *Speed*: two 200k-span traces (the 123k-span Kineto trace from ../shared/traces, its
   spans repeated, one copy's durations scaled) diffed by name, beside HolisticTraceAnalysis's
   ``TraceDiff.compare_traces`` on the same pair when ``hta`` is installed (it is not a
   dependency: ``pip install --no-deps holistictraceanalysis==0.5.0``).

7. *All pairings under load* (``--all-pairings 10``, alone): ten plain runs made while
   ``--busy`` processes spin on the CPUs, every one of the 45 pairings diffed (results in
   diff_loaded.md), for each ``--model`` (the MLP, ResNet-50): no pair of runs of one program
   may fail the check (exit 1); inconclusive (exit 3) is counted apart.

Usage: python benchmarks/diff.py [--pairs 20] [--slowed 8] [--steps 40] [--size-steps 40 100]
       python benchmarks/diff.py --all-pairings 10 [--busy 1 2] [--trials 3] [--keep FOLDER]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "diff.md"
SHARED_TRACE = (Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "kineto"
                / "v100_2rank_train_rank1.json.gz")
SLOWED_LAYER = "body.2"
SLOWDOWNS = (0.1, 0.2, 0.5)

CHILD = r"""
import sys, torch, xsp
from torch import nn
torch.set_num_threads(1)
extra, steps, out = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

class Layer(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.linear, self.extra = nn.Linear(512, 512), extra
    def forward(self, x):
        y = self.linear(x)
        if self.extra:  # the same work again on a share of the batch, inside this layer
            self.linear(x[: round(self.extra * x.shape[0])])
        return torch.relu(y)

class Net(nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.body = nn.Sequential(Layer(0), Layer(0), Layer(extra), Layer(0), Layer(0))
        self.head = nn.Linear(512, 10)
    def forward(self, x):
        return self.head(self.body(x))

torch.manual_seed(0)
model, x = Net(extra).eval(), torch.randn(64, 512)
with torch.no_grad():
    for _ in range(5):
        model(x)
    with xsp.trace(levels="model,layer", output=out):
        for _ in range(steps):
            model(x)
"""


def profile(extra: float, steps: int, out: Path) -> Path:
    subprocess.run([sys.executable, "-c", CHILD, str(extra), str(steps), str(out)], check=True,
                   capture_output=True, text=True)
    return out


def attributed_to(result: object, layer: str) -> bool:
    """Whether the first branch of the breakdown (the largest delta at each depth, from the
    model down) passes through ``layer``: the place a reader of the report is sent to."""
    breakdown = result.breakdown  # type: ignore[attr-defined]
    chain: list[str] = []
    for depth, name in zip(breakdown["depth"].tolist(), breakdown["name"].tolist()):
        if depth != len(chain):
            break
        chain.append(str(name))
    return any(name == layer or name.endswith("." + layer) for name in chain)


def alarm_row(comparison: str, results: Sequence[Any]) -> dict[str, object]:
    """A row of A/A diffs: how many gave any verdict but ``unchanged``."""
    alarms = [result.verdict.value for result in results]
    false = sum(v in ("regressed", "improved") for v in alarms)
    return {"comparison": comparison, "pairs": len(alarms), "flagged": f"{false} ({false / len(alarms):.0%})",
            "inconclusive": alarms.count("inconclusive"), "goal": "<= 5% false alarms", "top attribution": "-",
            "verdicts": ", ".join(alarms)}


def detection_row(comparison: str, slowdown: float, results: Sequence[Any]) -> dict[str, object]:
    """A row of diffs against runs whose ``SLOWED_LAYER`` was slowed by ``slowdown``: how many
    found a regression, and how many sent the reader to that layer."""
    verdicts = [result.verdict.value for result in results]
    found = sum(v == "regressed" for v in verdicts)
    attributed = sum(attributed_to(result, SLOWED_LAYER) for result in results)
    return {"comparison": comparison, "pairs": len(verdicts), "flagged": f"{found} ({found / len(verdicts):.0%})",
            "inconclusive": verdicts.count("inconclusive"),
            "goal": ">= 95% detected and attributed" if slowdown == 0.2 else "",
            "top attribution": f"{attributed} ({attributed / len(verdicts):.0%})", "verdicts": ", ".join(verdicts)}


def accuracy(pairs: int, slowed: int, steps: int, folder: Path) -> list[dict[str, object]]:
    from xsp.gate.diff import diff

    plain: list[Path] = []
    slow: dict[float, list[tuple[Path, Path]]] = {f: [] for f in SLOWDOWNS}
    # interleaved: each slowed run has a plain run made just before it
    for i in range(max(2 * pairs, slowed)):
        plain.append(profile(0.0, steps, folder / f"plain{i}.xsp.parquet"))
        if i < slowed:
            for f in SLOWDOWNS:
                slow[f].append((plain[-1], profile(f, steps, folder / f"slow{f}_{i}.xsp.parquet")))
        print(f"  runs made: {len(plain)} plain, {sum(len(v) for v in slow.values())} slowed", file=sys.stderr)
    rows = [alarm_row("A/A (plain vs plain)", [diff(a, b) for a, b in zip(plain[0::2], plain[1::2])])]
    rows += [detection_row(f"{SLOWED_LAYER} +{f:.0%}", f, [diff(base, new) for base, new in runs])
             for f, runs in slow.items()]
    rows += several_runs(plain, slow, pairs)
    rows += against_summaries(plain, slow, folder)
    return rows


RUNS_A_SIDE = 3


def several_runs(plain: list[Path], slow: dict[float, list[tuple[Path, Path]]],
                 pairs: int) -> list[dict[str, object]]:
    """Draws of ``RUNS_A_SIDE`` runs a side, pooled (what a CI job that profiles each side
    three times compares)."""
    import random

    from xsp.gate.diff import diff
    from xsp.io.loading import load

    draw = random.Random(0)
    traces = {path: load(path) for path in plain}
    results = []
    for _ in range(pairs):
        chosen = draw.sample(plain, 2 * RUNS_A_SIDE)
        results.append(diff([traces[p] for p in chosen[:RUNS_A_SIDE]], [traces[p] for p in chosen[RUNS_A_SIDE:]]))
    rows = [alarm_row(f"A/A, {RUNS_A_SIDE} runs a side", results)]
    for f, runs in slow.items():
        slowed = [load(new) for _, new in runs]
        if len(slowed) < RUNS_A_SIDE:
            continue
        results = [diff([traces[p] for p in draw.sample(plain, RUNS_A_SIDE)], draw.sample(slowed, RUNS_A_SIDE))
                   for _ in range(len(runs))]
        rows.append(detection_row(f"{SLOWED_LAYER} +{f:.0%}, {RUNS_A_SIDE} runs a side", f, results))
    return rows


def against_summaries(plain: list[Path], slow: dict[float, list[tuple[Path, Path]]],
                      folder: Path) -> list[dict[str, object]]:
    """The same pairs with the base given as its baseline summary (what CI keeps in a repository)."""
    from xsp.gate.baseline import summarize
    from xsp.gate.diff import diff
    from xsp.io.loading import load

    def baseline(run: Path) -> Path:
        return summarize(load(run)).save(folder / (run.stem + ".xsp-summary.parquet"))

    rows = [alarm_row("A/A, base as its summary", [diff(baseline(a), b) for a, b in zip(plain[0::2], plain[1::2])])]
    rows += [detection_row(f"{SLOWED_LAYER} +{f:.0%}, base as its summary", f,
                           [diff(baseline(base), new) for base, new in runs]) for f, runs in slow.items()]
    return rows


RESNET_CHILD = r"""
import sys, torch, xsp
from transformers import ResNetConfig, ResNetForImageClassification
torch.manual_seed(0)
torch.set_num_threads(1)
levels, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = ResNetForImageClassification(ResNetConfig()).eval()
x = torch.randn(1, 3, 224, 224)
with torch.inference_mode():
    model(pixel_values=x)
    with xsp.trace(levels=levels, output=out):
        for _ in range(steps):
            model(pixel_values=x)
"""


TINY_CHILD = r"""
import sys, torch, xsp
torch.manual_seed(0)
torch.set_num_threads(1)
steps, out = int(sys.argv[1]), sys.argv[2]
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 10)).eval()
x = torch.randn(64, 64)
with torch.inference_mode():
    model(x)
    with xsp.trace(levels="model,layer", output=out):
        for _ in range(steps):
            model(x)
"""
"""A model of 3 layers, too few keys to measure the keys' scatter (two unchanged processes of it
failed the gate: every layer +23%, the model call +34%)."""


def summary_sizes(folder: Path, step_counts: Sequence[int]) -> list[dict[str, object]]:
    """ResNet-50 (random weights, from its config) traced for each step count at two depths,
    and the size of its baseline summary beside the trace's."""
    from xsp.gate.baseline import summarize
    from xsp.io.loading import load

    rows: list[dict[str, object]] = []
    for levels in ("model,layer", "model,layer,operator"):
        for steps in step_counts:
            trace_path = folder / f"resnet50_{levels.replace(',', '_')}_{steps}.xsp.parquet"
            subprocess.run([sys.executable, "-c", RESNET_CHILD, levels, str(steps), str(trace_path)], check=True,
                           capture_output=True, text=True)
            summary = summarize(load(trace_path))
            plain = summary.save(folder / "resnet50.xsp-summary.parquet").stat().st_size
            traced = trace_path.stat().st_size
            rows.append({"levels": levels, "steps": steps, "keys": len(summary.keys[next(iter(summary.keys))]),
                         "trace": f"{traced / 1024:,.0f} KiB",
                         "summary .xsp-summary.parquet": f"{plain / 1024:.1f} KiB",
                         "share": f"{plain / traced:.2%}", "goal": "< 1 MB"})
            print(f"  summary of resnet50 {levels} x {steps}: {plain} bytes of {traced}", file=sys.stderr)
    return rows


def speed(folder: Path, repeats: int) -> list[dict[str, object]]:
    import pandas as pd

    import xsp
    from xsp.core import schema as col
    from xsp.gate.diff import diff

    if not SHARED_TRACE.exists():
        return [{"tool": "xsp diff", "seconds": "skipped: ../shared/traces missing"}]
    spans = xsp.load(SHARED_TRACE).spans
    copies = max(1, -(-200_000 // len(spans)))
    span_offset = int(spans[col.SPAN_ID].max()) + 1
    parts = []
    for k in range(copies):
        part = spans.copy()
        part[col.SPAN_ID] = part[col.SPAN_ID] + k * span_offset
        part[col.PARENT_ID] = part[col.PARENT_ID] + k * span_offset
        parts.append(part)
    base = pd.concat(parts, ignore_index=True).head(200_000)
    new = base.copy()
    slower = (new[col.NAME].str.contains("gemm", case=False)).to_numpy()
    new.loc[slower, col.DURATION_NS] = (new.loc[slower, col.DURATION_NS] * 1.3).astype("int64")
    new.loc[slower, col.END_NS] = new.loc[slower, col.START_NS] + new.loc[slower, col.DURATION_NS]
    base_path, new_path = folder / "big_base.xsp.parquet", folder / "big_new.xsp.parquet"
    metadata = {"schema_version": col.SCHEMA_VERSION}
    xsp.Trace(spans=base, metadata=metadata).save(base_path)
    xsp.Trace(spans=new, metadata=dict(metadata)).save(new_path)
    base_trace, new_trace = xsp.load(base_path), xsp.load(new_path)
    rows = []
    for by in ("name", "path"):
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            result = diff(base_trace, new_trace, by=by)
            times.append(time.perf_counter() - began)
        rows.append({"tool": f"xsp diff (by {by}, traces in memory)", "spans per trace": len(base),
                     "keys": len(result.table), "seconds": f"{min(times):.2f}", "goal": "<= 2 s"})
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        result = diff(base_path, new_path, by="name")
        times.append(time.perf_counter() - began)
    rows.append({"tool": "xsp diff (by name, from the files)", "spans per trace": len(base),
                 "keys": len(result.table), "seconds": f"{min(times):.2f}", "goal": "<= 2 s"})
    rows.extend(hta_speed(folder, repeats))
    return rows


def hta_speed(folder: Path, repeats: int) -> list[dict[str, object]]:
    """HTA's TraceDiff.compare_traces beside xsp diff on one real pair: the Kineto trace against
    a copy of itself, every iteration, both tools reading the files."""
    import shutil

    from xsp.gate.diff import diff

    try:
        from hta.common.trace import Trace as HtaTrace
        from hta.trace_diff import TraceDiff
    except ImportError:
        return [{"tool": "HTA TraceDiff.compare_traces", "seconds": "hta not installed"}]
    dirs = []
    for side in ("control", "test"):
        target = folder / side
        target.mkdir()
        shutil.copy(SHARED_TRACE, target / SHARED_TRACE.name)
        dirs.append(target)
    xsp_times, hta_times = [], []
    for _ in range(repeats):
        began = time.perf_counter()
        result = diff(dirs[0] / SHARED_TRACE.name, dirs[1] / SHARED_TRACE.name, by="name")
        xsp_times.append(time.perf_counter() - began)
        began = time.perf_counter()
        traces = []
        for target in dirs:
            trace = HtaTrace(trace_dir=str(target))
            trace.parse_traces()
            trace.decode_symbol_ids()
            traces.append(trace)
        frame = next(iter(traces[0].get_all_traces().values()))
        iterations = sorted(i for i in frame["iteration"].unique().tolist() if i >= 0)
        TraceDiff.compare_traces(traces[0], traces[1], control_iteration=iterations, test_iteration=iterations)
        hta_times.append(time.perf_counter() - began)
    name = SHARED_TRACE.name
    return [{"tool": f"xsp diff by name ({name} vs a copy, load + diff)", "keys": len(result.table),
             "seconds": f"{min(xsp_times):.2f}", "goal": ""},
            {"tool": "HTA 0.5.0 parse + TraceDiff.compare_traces (same pair, no statistics)", "keys": "-",
             "seconds": f"{min(hta_times):.2f}", "goal": ""}]


POOLED_DRAWS = 20
LOADED_RESULTS = Path(__file__).resolve().parent / "results" / "diff_loaded.md"
BUSY = "import time\nend = time.time() + float(__import__('sys').argv[1])\nwhile time.time() < end:\n    pass\n"


def profile_model(model: str, steps: int, out: Path) -> Path:
    """One plain run of ``model`` (``mlp``: the small MLP above; ``tiny``: :data:`TINY_CHILD`;
    ``resnet50``: ResNet-50 at batch 1, model and layer levels, as the README's example) in a
    process of its own."""
    if model == "mlp":
        return profile(0.0, steps, out)
    if model == "tiny":
        subprocess.run([sys.executable, "-c", TINY_CHILD, str(steps), str(out)], check=True, capture_output=True,
                       text=True)
        return out
    subprocess.run([sys.executable, "-c", RESNET_CHILD, "model,layer", str(steps), str(out)], check=True,
                   capture_output=True, text=True)
    return out


MOVED = ("regressed", "improved")
"""Verdicts that, on two runs of one program, are false alarms (exit 1 for a regression)."""


def all_pairings_under_load(runs: int, busy: int, steps: int, folder: Path,
                            model: str = "mlp") -> list[dict[str, object]]:
    """``runs`` plain runs of one program made while ``busy`` processes spin on the CPUs (a
    loaded CI runner), then every pairing of them diffed: A/A, so a regression (exit 1) is a
    failure without evidence and an improvement a false alarm; inconclusive (exit 3) says the
    runs could not have shown a change of the threshold, which is the truth of a busy machine."""
    import itertools
    import os
    import random
    from collections import Counter

    from xsp.gate.diff import diff
    from xsp.io.loading import load

    spinners = [subprocess.Popen([sys.executable, "-c", BUSY, "36000"]) for _ in range(busy)]
    try:
        paths = [profile_model(model, steps, folder / f"aa{i}.xsp.parquet") for i in range(runs)]
    finally:
        for spinner in spinners:
            spinner.kill()
    traces = [load(path) for path in paths]
    spreads = [trace.metadata.get("machine_speed", {}).get("spread") for trace in traces]
    results = [(a, b, diff(traces[a], traces[b])) for a, b in itertools.combinations(range(runs), 2)]
    verdicts = Counter(r.verdict.value for _, _, r in results)
    alarms = [(a, b, r) for a, b, r in results if r.verdict.value in MOVED]
    raw = Counter(diff(traces[a], traces[b], machine_speed=False).verdict.value for a, b, _ in results)
    draws = random.Random(0)
    pooled: Counter[str] = Counter()
    for _ in range(POOLED_DRAWS):  # the remedy for offsets between processes: three runs a side, pooled
        chosen = draws.sample(range(runs), 2 * RUNS_A_SIDE)
        pooled[diff([traces[i] for i in chosen[:RUNS_A_SIDE]],
                    [traces[i] for i in chosen[RUNS_A_SIDE:]]).verdict.value] += 1
    return [{"model": model, "runs": runs, "busy processes": f"{busy} on {os.cpu_count()} CPUs",
             "pairings": len(results),
             "failed (exit 1)": verdicts["regressed"], "goal": "0 failed",
             "inconclusive (exit 3)": verdicts["inconclusive"],
             "passed (exit 0)": verdicts["unchanged"] + verdicts["improved"],
             "false alarms (regressed or improved)": len(alarms),
             "raw times: failed / inconclusive / false alarms": f"{raw['regressed']} / {raw['inconclusive']} / "
                                                                 f"{raw['regressed'] + raw['improved']}",
             f"{RUNS_A_SIDE} runs a side: failed / inconclusive of {POOLED_DRAWS} draws":
                 f"{pooled['regressed']} / {pooled['inconclusive']}",
             "probe spread per run": ", ".join("-" if s is None else f"{s:.1%}" for s in spreads),
             "alarms": "; ".join(f"{a}-{b} {r.verdict.value} ({_worst(r)})" for a, b, r in alarms) or "-"}]


def _worst(result: Any) -> str:
    """The judged key that moved most, its raw and judged ratios, and the threshold it passed."""
    table = result.table[result.table["verdict"].isin(["regressed", "improved"])]
    top = table.iloc[(table["adjusted_ratio"] - 1).abs().argmax()]
    return (f"{top['key'].rsplit('/', 1)[-1]} x{top['ratio']:.2f} raw, x{top['adjusted_ratio']:.2f} judged, "
            f"threshold {result.settings['judged_threshold']:.0%}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20, help="A/A pairs (default: 20)")
    parser.add_argument("--slowed", type=int, default=8, help="runs per slowdown (default: 8)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="timings of the speed test (best kept)")
    parser.add_argument("--size-steps", type=int, nargs="+", default=[40, 100],
                        help="steps of the ResNet-50 runs whose summaries are weighed (default: 40 100)")
    parser.add_argument("--all-pairings", type=int, metavar="RUNS",
                        help="only: A/A over every pairing of RUNS runs on a loaded machine (diff_loaded.md)")
    parser.add_argument("--busy", type=int, nargs="+", default=[1, 2],
                        help="processes spinning meanwhile, a table row for each (default: 1 2)")
    parser.add_argument("--model", choices=("mlp", "tiny", "resnet50"), nargs="+", default=["mlp"],
                        help="with --all-pairings: the programs run, a row each (default: mlp; resnet50: ResNet-50 "
                             "at batch 1, model and layer levels)")
    parser.add_argument("--trials", type=int, default=1,
                        help="with --all-pairings: repeat each busy setting this many times, a row each")
    parser.add_argument("--keep", type=Path, metavar="FOLDER",
                        help="with --all-pairings: keep the runs' traces in FOLDER (busyN/trialT/aaI.xsp.parquet)")
    args = parser.parse_args(argv)
    if args.all_pairings:
        with tempfile.TemporaryDirectory() as scratch:
            kept = args.keep or Path(scratch)
            rows = []
            for model in args.model:
                for busy in args.busy:
                    for trial in range(args.trials):
                        folder = kept / model / f"busy{busy}" / f"trial{trial}"
                        folder.mkdir(parents=True, exist_ok=True)
                        rows += all_pairings_under_load(args.all_pairings, busy, args.steps, folder, model)
        print(*markdown_table(rows), sep="\n")
        failed = sum(int(row["failed (exit 1)"]) for row in rows)
        alarms = sum(int(row["false alarms (regressed or improved)"]) for row in rows)
        inconclusive = sum(int(row["inconclusive (exit 3)"]) for row in rows)
        total_pairings = sum(int(row["pairings"]) for row in rows)
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        record(["# xsp diff: A/A over every pairing of runs made on a loaded machine", "",
                f"Last run: {now}, {platform.machine()}, Python {platform.python_version()}; `python "
                f"benchmarks/diff.py --all-pairings {args.all_pairings} --busy {' '.join(map(str, args.busy))} "
                f"--steps {args.steps} --trials {args.trials} --model {' '.join(args.model)}`.", "",
                "Each run is a separate process profiling the same program (model,layer levels) while other "
                "processes spin on the CPUs; every pairing is diffed with the defaults. A row per program and "
                "trial (a fresh set of runs). Two runs of one program: a regression (exit 1) is a gate failing "
                "without evidence, an improvement a false alarm; inconclusive (exit 3) says the runs could not "
                "have shown a change of the threshold (no pass either).", "",
                *markdown_table(rows), "",
                f"In all: {failed} failed and {alarms} false alarms in {total_pairings} pairings "
                f"(goal: 0 failed); {inconclusive} inconclusive."], LOADED_RESULTS)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        size_rows = summary_sizes(folder, args.size_steps)
        print(*markdown_table(size_rows), sep="\n", file=sys.stderr)
        accuracy_rows = accuracy(args.pairs, args.slowed, args.steps, folder)
        print(*markdown_table(accuracy_rows), sep="\n", file=sys.stderr)
        speed_rows = speed(folder, args.repeats)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"Last run: {now}, {platform.machine()}, Python {platform.python_version()}; "
              f"`python benchmarks/diff.py --pairs {args.pairs} --slowed {args.slowed} --steps {args.steps}`.")
    lines = ["# xsp diff: false alarms, detection, attribution, speed", "", header, "",
             "## Accuracy: separate processes, default settings (threshold 5%, min delta 20 µs, FDR 0.01)", "",
             *markdown_table(accuracy_rows), "",
             "## Baselines: ResNet-50's summary beside its trace", "",
             "The summary file as `xsp summary TRACE -o baseline.xsp-summary.parquet` writes it, "
             "against the trace's Parquet file; a summary grows with the keys, a trace with the steps too.", "",
             *markdown_table(size_rows), "", "## Speed: two 200k-span traces", "", *markdown_table(speed_rows)]
    record(lines, RESULTS)
    return 0


def markdown_table(rows: list[dict[str, object]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


if __name__ == "__main__":
    sys.exit(main())
