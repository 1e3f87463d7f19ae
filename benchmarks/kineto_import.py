"""Kineto trace import: xsp against HolisticTraceAnalysis on the same real trace, side by side.

Both load the V100 trace from ../shared/traces (216k events), build their tree of the trace
and compute the GPU kernel breakdown:

* xsp: ``xsp.load`` (decode, span table, hierarchy with launch correlation, steps, paths)
  then ``xsp.analysis.kernels_by_name``;
* HTA: ``TraceAnalysis`` (parse), ``CallGraph`` (its call stacks), ``get_gpu_kernel_breakdown``.

Each run is a fresh subprocess (so neither warms the other's caches and peak memory is the
process's own); runs alternate and the best of N is kept. HolisticTraceAnalysis is needed
only here: ``pip install --no-deps holistictraceanalysis==0.5.0 && pip install psutil ijson
pydot plotly``. Results go to benchmarks/results/kineto_import.md.

With ``--repeat K`` the trace is first built K times longer: the real trace repeated end to
end, each copy shifted in time past the one before, with its correlation, external, flow and
step ids shifted so that no two copies share one (K=10 gives 2.16M events of the V100 trace).
Wall time is then also given for the whole fresh process (imports included), as a user waits
for it, and memory per event.

Usage: python benchmarks/kineto_import.py [--runs N] [--trace PATH] [--repeat K]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _results import record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "kineto" / "v100_2rank_train_rank1.json.gz"
RESULTS = ROOT / "benchmarks" / "results" / "kineto_import.md"

PEAK = """
def peak_mb():
    import resource
    try:  # this process alone: ru_maxrss keeps, across exec, the peak of the process that started it
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""
"""The peak memory of the process measured, not of the benchmark that started it (which builds
the repeated trace, and would otherwise count as every run's peak)."""

XSP_RUN = PEAK + """
import json, resource, sys, time
t0 = time.perf_counter()
import xsp
from xsp.analysis import kernels_by_name
t1 = time.perf_counter()
trace = xsp.load(sys.argv[1])
t2 = time.perf_counter()
breakdown = kernels_by_name(trace)
t3 = time.perf_counter()
print(json.dumps({"load_and_tree_s": t2 - t1, "breakdown_s": t3 - t2, "total_s": t3 - t1,
                  "peak_rss_mb": peak_mb(),
                  "spans": len(trace.spans), "kernels": int(breakdown["count"].sum()),
                  "top_kernel": breakdown["name"].iloc[0] if len(breakdown) else None}))
"""

FLOOR_RUN = PEAK + """
import gzip, json, resource, sys, time, zlib
import msgspec
t1 = time.perf_counter()
from xsp.io.kineto_json import _DECODER
with open(sys.argv[1], "rb") as file:
    data = file.read()
inflated = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
t2 = time.perf_counter()
decoded = _DECODER.decode(inflated)
t3 = time.perf_counter()
print(json.dumps({"inflate_s": t2 - t1, "decode_s": t3 - t2, "total_s": t3 - t1,
                  "peak_rss_mb": peak_mb()}))
"""
"""The floor of any importer that reads the whole JSON: inflating the gzip and one typed decode
of it (xsp's own msgspec structs), nothing else."""

HTA_RUN = PEAK + """
import json, logging, resource, sys, time
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
from hta.common.call_stack import CallGraph
t1 = time.perf_counter()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
t2 = time.perf_counter()
graph = CallGraph(analysis.t)
t3 = time.perf_counter()
breakdown = analysis.get_gpu_kernel_breakdown(visualize=False)
t4 = time.perf_counter()
print(json.dumps({"parse_s": t2 - t1, "tree_s": t3 - t2, "breakdown_s": t4 - t3, "total_s": t4 - t1,
                  "peak_rss_mb": peak_mb()}))
"""


SHIFTED_ARGS = ("External id", "correlation", "Ev Idx", "Python id", "Python parent id", "Record function id")


def _document(source: Path) -> dict[str, Any]:
    import gzip

    import msgspec

    return msgspec.json.decode(gzip.open(source).read() if source.suffix == ".gz" else source.read_bytes())


class _Repetition:
    """How ``source``'s events are repeated end to end: each copy shifted in time past the one
    before, its correlation, external, flow and step ids shifted so that no two copies share one."""

    def __init__(self, source: Path) -> None:
        import re

        self.document = _document(source)
        events = self.events = self.document.pop("traceEvents")
        timed = [e for e in events if "ts" in e]
        first = min((float(e["ts"]) for e in timed), default=0.0)
        self.period = max((float(e["ts"]) + float(e.get("dur", 0)) for e in timed), default=first) - first + 1000.0
        stride = 1 + max((max((int(e.get("args", {}).get(key, 0)) for key in SHIFTED_ARGS
                               if isinstance(e.get("args", {}).get(key, 0), int)), default=0) for e in events),
                         default=0)
        self.id_stride = max(stride, 1 + max((int(e["id"]) for e in events if isinstance(e.get("id"), int)),
                                             default=0))
        self.step = re.compile(r"^(ProfilerStep#)(\d+)$")
        self.steps = sum(1 for e in events if e.get("ph") == "X" and self.step.match(str(e.get("name", ""))))

    def copy(self, number: int) -> list[dict[str, Any]]:
        """The events of copy ``number`` (0: the source's own, metadata included; the others
        leave the metadata events out)."""
        if number == 0:
            return self.events
        out = []
        for event in self.events:
            if "ts" not in event:
                continue  # metadata (process and thread names) once
            shifted = dict(event)
            shifted["ts"] = float(event["ts"]) + number * self.period
            if isinstance(event.get("id"), int):
                shifted["id"] = event["id"] + number * self.id_stride
            args = event.get("args")
            if args:
                args = dict(args)
                for key in SHIFTED_ARGS:
                    if isinstance(args.get(key), int) and args[key] >= 0:
                        args[key] += number * self.id_stride
                shifted["args"] = args
            found = self.step.match(str(event.get("name", "")))
            if found:
                shifted["name"] = f"{found.group(1)}{int(found.group(2)) + number * self.steps}"
            out.append(shifted)
        return out


def repeated_trace(source: Path, copies: int, target: Path) -> int:
    """``source`` repeated ``copies`` times end to end (see the module's docstring), gzipped; its events."""
    import gzip

    import msgspec

    repetition = _Repetition(source)
    document = dict(repetition.document)
    document["traceEvents"] = [event for number in range(copies) for event in repetition.copy(number)]
    with gzip.open(target, "wb", compresslevel=6) as file:
        file.write(msgspec.json.encode(document))
    return len(document["traceEvents"])


def write_repeated_trace(source: Path, target: Path, copies: int | None = None, target_bytes: int | None = None) -> int:
    """``source`` repeated end to end as plain JSON, written copy by copy (never held whole):
    ``copies`` times, or until the file holds ``target_bytes``. Its top-level fields come after its
    events, as Kineto writes them. Returns the events written."""
    import msgspec

    repetition = _Repetition(source)
    encoder = msgspec.json.Encoder()
    written = events = number = 0
    with open(target, "wb") as file:
        file.write(b'{"traceEvents":[')
        if not any("ts" in event for event in repetition.events):
            copies = 1  # nothing to repeat: one copy, whatever the size asked for
        while (copies is None or number < copies) and (target_bytes is None or written < target_bytes):
            batch = repetition.copy(number)
            text = encoder.encode(batch)[1:-1]
            if written and text:
                file.write(b",")
            file.write(text)
            written += len(text)
            events += len(batch)
            number += 1
        fields = encoder.encode(repetition.document)[1:-1]
        file.write(b"]" + (b"," + fields if fields else b"") + b"}")
    return events


def run(code: str, argument: str, timeout_s: float = 1800) -> dict[str, float]:
    """One fresh process running ``code``: its own figures, and its wall time as a user waits for
    it (interpreter start and imports included).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s``."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, argument], capture_output=True, text=True,
                            timeout=timeout_s)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr else "failed")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    figures["wall_s"] = wall_s
    return figures


def hta_available() -> bool:
    return subprocess.run([sys.executable, "-c", "import hta.trace_analysis"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeat", type=int, default=1,
                        help="build a trace this many times longer from --trace first (10: 2.16M events)")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"no trace at {args.trace}", file=sys.stderr)
        return 2
    if not hta_available():
        print("HolisticTraceAnalysis is not installed: pip install --no-deps holistictraceanalysis==0.5.0 && "
              "pip install psutil ijson pydot plotly", file=sys.stderr)
        return 2
    xsp_runs, hta_runs, floor_runs = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / args.trace.name  # HTA reads every trace in a folder
        if args.repeat > 1:
            trace = trace.with_name(f"x{args.repeat}_{args.trace.name}")
            events = repeated_trace(args.trace, args.repeat, trace)
        else:
            shutil.copy(args.trace, trace)  # the trace as it was written, byte for byte
            events = len(_document(args.trace)["traceEvents"])
        for _ in range(args.runs):
            xsp_runs.append(run(XSP_RUN, str(trace)))
            hta_runs.append(run(HTA_RUN, folder))
            floor_runs.append(run(FLOOR_RUN, str(trace)))
    xsp_best = min(xsp_runs, key=lambda r: r["total_s"])
    hta_best = min(hta_runs, key=lambda r: r["total_s"])
    speedup = hta_best["total_s"] / xsp_best["total_s"]
    median_speedup = (statistics.median(r["total_s"] for r in hta_runs)
                      / statistics.median(r["total_s"] for r in xsp_runs))
    wall_speedup = min(r["wall_s"] for r in hta_runs) / min(r["wall_s"] for r in xsp_runs)
    goal = 10 if events >= 1_000_000 else 5
    floor = min(floor_runs, key=lambda r: r["total_s"])
    lines = [
        "# Kineto import: xsp against HolisticTraceAnalysis", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, Python {platform.python_version()}, "
        f"{platform.machine()}; `python benchmarks/kineto_import.py --runs {args.runs}"
        + (f" --repeat {args.repeat}" if args.repeat > 1 else "") + "`.", "",
        f"Trace: `{args.trace.name}`" + (f" repeated {args.repeat} times (`--repeat {args.repeat}`)"
                                          if args.repeat > 1 else "")
        + f": {events:,} events, {xsp_best['spans']:,} spans imported, {xsp_best['kernels']:,} kernels. "
        f"Best of {args.runs} alternating runs, each in a fresh process. Goal: xsp at least {goal}x faster in "
        "fresh processes (*process s*: the whole process as a user waits for it, imports included), peak memory "
        "at most 400 B per event.", "",
        "| tool | load / parse s | tree s | kernel breakdown s | total s | process s | peak RSS MB | "
        "peak B/event |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| xsp | {xsp_best['load_and_tree_s']:.2f} (with tree) | - | {xsp_best['breakdown_s']:.3f} | "
        f"{xsp_best['total_s']:.2f} | {xsp_best['wall_s']:.2f} | {xsp_best['peak_rss_mb']:,.0f} | "
        f"{xsp_best['peak_rss_mb'] * 2**20 / events:,.0f} |",
        f"| HolisticTraceAnalysis 0.5.0 | {hta_best['parse_s']:.2f} | {hta_best['tree_s']:.2f} | "
        f"{hta_best['breakdown_s']:.3f} | {hta_best['total_s']:.2f} | {hta_best['wall_s']:.2f} | "
        f"{hta_best['peak_rss_mb']:,.0f} | {hta_best['peak_rss_mb'] * 2**20 / events:,.0f} |",
        f"| floor: gzip inflate + typed decode | {floor['total_s']:.2f} | - | - | {floor['total_s']:.2f} | "
        f"{floor['wall_s']:.2f} | {floor['peak_rss_mb']:,.0f} | {floor['peak_rss_mb'] * 2**20 / events:,.0f} |",
        "", f"**xsp is {wall_speedup:.1f}x faster in fresh processes** (best HTA process / best xsp process); "
        f"{speedup:.1f}x on the load and analysis alone ({median_speedup:.1f}x on the medians).", "",
        f"xsp takes {xsp_best['total_s'] / floor['total_s']:.1f}x the floor's time (inflate "
        f"{floor['inflate_s']:.2f} s + decode {floor['decode_s']:.2f} s) and "
        f"{xsp_best['peak_rss_mb'] / floor['peak_rss_mb']:.1f}x its memory.", "",
        "All runs (process s): xsp " + ", ".join(f"{r['wall_s']:.2f}" for r in xsp_runs)
        + "; HTA " + ", ".join(f"{r['wall_s']:.2f}" for r in hta_runs) + ".",
    ]
    record(lines, RESULTS if args.repeat == 1 else RESULTS.with_name(f"kineto_import_x{args.repeat}.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
