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

Usage: python benchmarks/kineto_import.py [--runs N] [--trace PATH]
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
from datetime import datetime, timezone
from pathlib import Path

from _results import record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "kineto" / "v100_2rank_train_rank1.json.gz"
RESULTS = ROOT / "benchmarks" / "results" / "kineto_import.md"

XSP_RUN = """
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
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "spans": len(trace.spans), "kernels": int(breakdown["count"].sum()),
                  "top_kernel": breakdown["name"].iloc[0]}))
"""

HTA_RUN = """
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
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(code: str, argument: str) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", code, argument], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr else "failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def hta_available() -> bool:
    return subprocess.run([sys.executable, "-c", "import hta.trace_analysis"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        print(f"no trace at {args.trace}", file=sys.stderr)
        return 2
    if not hta_available():
        print("HolisticTraceAnalysis is not installed: pip install --no-deps holistictraceanalysis==0.5.0 && "
              "pip install psutil ijson pydot plotly", file=sys.stderr)
        return 2
    xsp_runs, hta_runs = [], []
    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(args.trace, Path(folder) / args.trace.name)  # HTA reads every trace in a folder
        for _ in range(args.runs):
            xsp_runs.append(run(XSP_RUN, str(args.trace)))
            hta_runs.append(run(HTA_RUN, folder))
    xsp_best = min(xsp_runs, key=lambda r: r["total_s"])
    hta_best = min(hta_runs, key=lambda r: r["total_s"])
    speedup = hta_best["total_s"] / xsp_best["total_s"]
    median_speedup = (statistics.median(r["total_s"] for r in hta_runs)
                      / statistics.median(r["total_s"] for r in xsp_runs))
    lines = [
        "# Kineto import: xsp against HolisticTraceAnalysis", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, Python {platform.python_version()}, "
        f"{platform.machine()}; `python benchmarks/kineto_import.py --runs {args.runs}`.", "",
        f"Trace: `{args.trace.name}` ({xsp_best['spans']:,} spans imported, {xsp_best['kernels']:,} kernels). "
        f"Best of {args.runs} alternating runs, each in a fresh process. Goal: xsp at least 5x faster.", "",
        "| tool | load / parse s | tree s | kernel breakdown s | total s | peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| xsp | {xsp_best['load_and_tree_s']:.2f} (with tree) | - | {xsp_best['breakdown_s']:.3f} | "
        f"{xsp_best['total_s']:.2f} | {xsp_best['peak_rss_mb']:,.0f} |",
        f"| HolisticTraceAnalysis 0.5.0 | {hta_best['parse_s']:.2f} | {hta_best['tree_s']:.2f} | "
        f"{hta_best['breakdown_s']:.3f} | {hta_best['total_s']:.2f} | {hta_best['peak_rss_mb']:,.0f} |",
        "", f"**xsp is {speedup:.1f}x faster** (best HTA total / best xsp total; "
        f"{median_speedup:.1f}x on the medians).", "",
        "All runs (total s): xsp " + ", ".join(f"{r['total_s']:.2f}" for r in xsp_runs)
        + "; HTA " + ", ".join(f"{r['total_s']:.2f}" for r in hta_runs) + ".",
    ]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
