"""The tools users run on a trace of millions of spans: load, report and every export format.

The V100 trace of ../shared/traces is repeated end to end (``--repeat`` copies, as
benchmarks/kineto_import.py builds them: 16 give 1.97M spans) and imported once into an
.xsp.parquet file. Then each tool runs in a fresh process of its own, as a user runs it from the
shell: ``xsp.load``, ``xsp report`` (output to /dev/null), ``xsp export --format chrome``,
``speedscope``, ``collapsed`` and ``perfetto``. Per tool: wall time of the process (imports included), peak
memory of the process (xsp.load's is what loading alone costs). Best of ``--runs`` by time, with
the least peak of the runs. Results go to benchmarks/results/large_trace_tools.md.

Usage: python benchmarks/large_trace_tools.py [--repeat 16] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _results import record
from kineto_import import DEFAULT_TRACE, PEAK, repeated_trace

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "large_trace_tools.md"

RUN_TOOL = PEAK + """
import json, sys, time
began = time.perf_counter()
from xsp.cli.main import entry_point
sys.argv = ["xsp", *json.loads(sys.argv[1])]
try:
    entry_point()
except SystemExit as exit:
    code = exit.code
else:
    code = 0
print(json.dumps({"peak_mb": peak_mb(), "code": code}), file=sys.stderr)
"""

LOAD = PEAK + """
import json, sys
import xsp
trace = xsp.load(sys.argv[1])
print(json.dumps({"peak_mb": peak_mb(), "code": 0, "spans": len(trace.spans)}), file=sys.stderr)
"""


def _measure(script: str, argument: str) -> dict[str, float]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script, argument], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - began
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "{}"
    try:
        figures = json.loads(last)
    except ValueError:
        figures = {}
    if done.returncode != 0 or figures.get("code") not in (0, None):
        raise SystemExit(f"{argument}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return {"wall_s": wall, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=16)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xsp-large-") as scratch:
        folder = Path(scratch)
        source = folder / "repeated.json.gz"
        events = repeated_trace(DEFAULT_TRACE, args.repeat, source)
        trace = folder / "repeated.xsp.parquet"
        subprocess.run([sys.executable, "-m", "xsp", "import", str(source), "-o", str(trace)], check=True,
                       stdout=subprocess.DEVNULL)
        tools = {
            "xsp.load": (LOAD, str(trace)),
            "xsp report": (RUN_TOOL, json.dumps(["report", str(trace)])),
            "xsp export --format chrome": (RUN_TOOL, json.dumps(["export", str(trace), "--format", "chrome", "-o",
                                                                 str(folder / "out.json")])),
            "xsp export --format speedscope": (RUN_TOOL, json.dumps(["export", str(trace), "--format", "speedscope",
                                                                     "-o", str(folder / "out.speedscope.json")])),
            "xsp export --format collapsed": (RUN_TOOL, json.dumps(["export", str(trace), "--format", "collapsed",
                                                                    "-o", str(folder / "out.folded")])),
            "xsp export --format perfetto": (RUN_TOOL, json.dumps(["export", str(trace), "--format", "perfetto",
                                                                   "-o", str(folder / "out.pftrace")])),
        }
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.runs):  # tools alternate from run to run
            for name, (script, argument) in tools.items():
                figures = _measure(script, argument)
                if name not in best:
                    best[name] = figures
                else:
                    best[name] = {**figures, "wall_s": min(figures["wall_s"], best[name]["wall_s"]),
                                  "peak_mb": min(figures["peak_mb"], best[name]["peak_mb"])}
                print(f"{name}: {figures['wall_s']:.1f} s, {figures['peak_mb']:.0f} MB", flush=True)
        sizes = {name: (folder / file).stat().st_size for name, file in
                 (("chrome", "out.json"), ("speedscope", "out.speedscope.json"), ("collapsed", "out.folded"),
                  ("perfetto", "out.pftrace"))}
        trace_mb = trace.stat().st_size / 2**20
    spans = int(best["xsp.load"]["spans"])
    lines = [
        "# Tools on a large trace", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, "
        f"`python benchmarks/large_trace_tools.py --repeat {args.repeat} --runs {args.runs}`: the V100 trace "
        f"repeated {args.repeat} times ({events:,} Kineto events), imported into a {trace_mb:.0f} MB .xsp.parquet "
        f"of {spans:,} spans; each tool a fresh process, best of {args.runs}.", "",
        "| tool | wall s | peak MB | peak B/span | output MB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, figures in best.items():
        output = next((size for key, size in sizes.items() if name.endswith(key)), None)
        lines.append(f"| {name} | {figures['wall_s']:.1f} | {figures['peak_mb']:,.0f} | "
                     f"{figures['peak_mb'] * 2**20 / spans:,.0f} | "
                     f"{'' if output is None else f'{output / 2**20:,.1f}'} |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
