"""``xsp summary`` and ``xsp report`` of a trace too large to load: a window of whole trees at a time
(:func:`xsp.gate.baseline.summarize_windows`, :func:`xsp.analysis.windowed.windowed_report`), against
loading it whole (``xsp.load``, then :func:`xsp.gate.baseline.summarize` or the report), side by side
on the same .xsp.parquet file, then windowed alone on a larger one.

The traces are the V100 trace of ../shared/traces repeated end to end (benchmarks/kineto_import.py),
imported with ``xsp import`` (a window at a time). Each summary is a fresh process; side by side the
two alternate, best of ``--runs``. Peak memory is the process's own (VmHWM). The goal (issue 64):
at most 2 GB whatever the size. Both summaries of the side-by-side trace are compared key by key.

The report's figures are the same either way (tests/unit/test_tree_windows.py compares them).

Usage: python benchmarks/large_summary.py [--runs N] [--copies C] [--large-copies C] [--scratch DIR]
Results go to benchmarks/results/large_summary.md.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from _results import record
from kineto_import import DEFAULT_TRACE, PEAK, run, write_repeated_trace

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "large_summary.md"

WHOLE = PEAK + """
import json, sys, time
t0 = time.perf_counter()
import xsp
from xsp.gate.baseline import summarize
summary = summarize(xsp.load(sys.argv[1]), source="run")
summary.save(sys.argv[1] + ".whole.xsp-summary.parquet")
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": summary.metadata["spans"]}))
"""

WINDOWED = PEAK + """
import json, sys, time
t0 = time.perf_counter()
from xsp.gate.baseline import summarize_windows
from xsp.io.tree_windows import tree_windows
windows = tree_windows(sys.argv[1])
summary = summarize_windows(windows, source="run")
summary.save(sys.argv[1] + ".windows.xsp-summary.parquet")
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": summary.metadata["spans"],
                  "windows": windows.count}))
"""

REPORT_WHOLE = PEAK + """
import io, json, sys, time
t0 = time.perf_counter()
from rich.console import Console
import xsp
from xsp.reports.terminal import render_report
trace = xsp.load(sys.argv[1])
render_report(trace, Console(file=io.StringIO(), width=100))
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": len(trace.spans)}))
"""

REPORT_WINDOWED = PEAK + """
import io, json, sys, time
t0 = time.perf_counter()
from rich.console import Console
from xsp.analysis.windowed import windowed_report
from xsp.io.tree_windows import tree_windows
from xsp.reports.terminal import render_windowed_report
windows = tree_windows(sys.argv[1])
render_windowed_report(windowed_report(windows), Console(file=io.StringIO(), width=100))
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": windows.spans,
                  "windows": windows.count}))
"""
TOOLS = (("summary", "loaded whole", WHOLE), ("summary", "a window at a time", WINDOWED),
         ("report", "loaded whole", REPORT_WHOLE), ("report", "a window at a time", REPORT_WINDOWED))


def _imported(copies: int, scratch: Path) -> tuple[Path, int]:
    from xsp.io.kineto_stream import import_kineto

    source = scratch / f"x{copies}.json"
    events = write_repeated_trace(DEFAULT_TRACE, source, copies=copies)
    output = scratch / f"x{copies}.xsp.parquet"
    import_kineto(source, output)
    source.unlink()
    return output, events


def _described(copies: int, events: int, path: Path) -> str:
    return f"V100 x{copies}: {events / 1e6:.1f}M events, .xsp.parquet of {path.stat().st_size / 2**20:,.0f} MB"


def _same(path: Path) -> bool:
    from xsp.gate.baseline import Summary
    from xsp.gate.diff_columns import SAMPLES_NS

    whole = Summary.load(f"{path}.whole.xsp-summary.parquet")
    windowed = Summary.load(f"{path}.windows.xsp-summary.parquet")
    if whole.metadata != windowed.metadata:
        return False
    for by, frame in whole.keys.items():
        other = windowed.keys[by]
        if list(frame.columns) != list(other.columns) or len(frame) != len(other):
            return False
        for column in frame.columns:
            left, right = frame[column].tolist(), other[column].tolist()
            if column == SAMPLES_NS:
                left, right = [list(v) for v in left], [list(v) for v in right]
            if [None if v != v else v for v in left] != [None if v != v else v for v in right]:
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--copies", type=int, default=24, help="copies of the V100 trace side by side")
    parser.add_argument("--large-copies", type=int, default=96, help="copies for the windowed summary alone")
    parser.add_argument("--scratch", default=None)
    options = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="xsp-summary-", dir=options.scratch))
    try:
        path, events = _imported(options.copies, scratch)
        best: dict[tuple[str, str], dict[str, float]] = {}
        for _ in range(options.runs):
            for tool, how, code in TOOLS:
                figures = run(code, str(path))
                if (tool, how) not in best or figures["wall_s"] < best[tool, how]["wall_s"]:
                    best[tool, how] = figures
        same = _same(path)
        large, large_events = _imported(options.large_copies, scratch)
        rows = [(_described(options.copies, events, path), tool, how, figures) for (tool, how), figures in best.items()]
        for tool, how, code in TOOLS:
            if how != "loaded whole":
                rows.append((_described(options.large_copies, large_events, large), tool, how, run(code, str(large))))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# xsp summary and xsp report of a trace too large to load",
        "",
        f"Last run: {stamp}, Python {platform.python_version()}, `python benchmarks/large_summary.py --runs "
        f"{options.runs} --copies {options.copies} --large-copies {options.large_copies}`: the V100 trace repeated, "
        "imported with `xsp import`; each summary a fresh process (interpreter start included), side by side "
        f"best of {options.runs}.",
        "",
        "| trace | tool | read | spans | windows | wall s | peak MB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for trace, tool, how, figures in rows:
        windows = f"{int(figures['windows']):,}" if "windows" in figures else ""
        lines.append(f"| {trace} | xsp {tool} | {how} | {int(figures['spans']):,} | {windows} | "
                     f"{figures['wall_s']:.1f} | {figures['peak_rss_mb']:,.0f} |")
    lines.append("")
    for tool in ("summary", "report"):
        whole, windowed = best[tool, "loaded whole"], best[tool, "a window at a time"]
        lines.append(f"Side by side, xsp {tool} a window at a time takes "
                     f"{windowed['peak_rss_mb'] / whole['peak_rss_mb']:.2f}x the memory and "
                     f"{windowed['wall_s'] / whole['wall_s']:.2f}x the time of the {tool} of the trace loaded whole.")
    lines.append(f"The two summaries are {'the same' if same else 'DIFFERENT'}, key by key.")
    record(lines, RESULTS)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
