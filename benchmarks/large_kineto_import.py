"""Importing a Kineto trace too large to hold: ``xsp import`` a window at a time, against the
in-memory import (``xsp.load(...).save(...)``), at 1 GB side by side and at 10 GB alone.

The traces are the V100 trace of ../shared/traces repeated end to end (each copy shifted in time
and ids: benchmarks/kineto_import.py) as plain JSON, written copy by copy, to about 1 GB and
10 GB; the 1 GB one is also gzipped (gzip input is streamed too). Each import is a fresh process;
at 1 GB the two imports alternate, best of ``--runs``. Peak memory is the process's own (VmHWM).
The goal (issue 64): at most 2 GB peak whatever the size, at no fewer events a second than the
in-memory import. Beside the figures, every shared Kineto trace is imported both ways at its own
size, in the smallest windows (every cut the trace allows) and in the default ones, and the
spans compared (:func:`xsp.table.equality.span_differences`).

Usage: python benchmarks/large_kineto_import.py [--runs N] [--gigabytes G] [--scratch DIR]
Results go to benchmarks/results/large_kineto_import.md.
"""

from __future__ import annotations

import argparse
import gzip
import platform
import shutil
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from _results import record
from kineto_import import DEFAULT_TRACE, PEAK, run, write_repeated_trace

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces" / "kineto"
RESULTS = ROOT / "benchmarks" / "results" / "large_kineto_import.md"

IN_MEMORY = PEAK + """
import json, sys, time
t0 = time.perf_counter()
import xsp
trace = xsp.load(sys.argv[1])
trace.save(sys.argv[1] + ".memory.xsp.parquet")
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": len(trace.spans)}))
"""

STREAMED = PEAK + """
import json, sys, time
t0 = time.perf_counter()
from xsp.io.kineto_stream import import_kineto
done = import_kineto(sys.argv[1], sys.argv[1] + ".stream.xsp.parquet")
print(json.dumps({"s": time.perf_counter() - t0, "peak_rss_mb": peak_mb(), "spans": done.spans,
                  "events": done.events, "windows": done.windows, "largest_window": done.largest_window_events,
                  "bounded": done.bounded}))
"""


def _same_spans_on_shared_traces() -> list[str]:
    import xsp
    from xsp.io.kineto_stream import import_kineto
    from xsp.table.equality import span_differences

    lines = ["| shared trace | spans | windows (smallest) | equal (smallest windows) | equal (default windows) |",
             "| --- | ---: | ---: | --- | --- |"]
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for source in sorted(SHARED.glob("*.json.gz")):
            whole = xsp.load(source)
            verdicts = []
            windows = 0
            for window_events in (1, None):
                output = Path(folder) / f"{source.name}.{window_events}.xsp.parquet"
                done = (import_kineto(source, output) if window_events is None
                        else import_kineto(source, output, window_events=window_events))
                windows = windows or done.windows
                differences = span_differences(whole.spans, xsp.load(output).spans)
                verdicts.append("yes" if not differences else "NO: " + "; ".join(differences)[:120])
            lines.append(f"| `{source.name}` | {len(whole.spans):,} | {windows} | {verdicts[0]} | {verdicts[1]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--gigabytes", type=float, default=10.0, help="the large trace's size (default 10)")
    parser.add_argument("--scratch", type=Path, default=None,
                        help="folder for the traces (kept there and reused when given; default a temporary one)")
    args = parser.parse_args(argv)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="xsp-large-import-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        traces = {}
        for label, size in (("1 GB", 1.0), (f"{args.gigabytes:g} GB", args.gigabytes)):
            path = scratch / f"v100_repeated_{size:g}gb.json"
            if not path.exists():
                started = time.perf_counter()
                events = write_repeated_trace(DEFAULT_TRACE, path, target_bytes=int(size * 1e9))
                print(f"built {path.name}: {events:,} events in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            traces[label] = path
        small = traces["1 GB"]
        zipped = small.with_name(small.name + ".gz")
        if not zipped.exists():
            with open(small, "rb") as source, gzip.open(zipped, "wb", compresslevel=1) as target:
                shutil.copyfileobj(source, target, 16 << 20)
        results: dict[str, list[dict[str, float]]] = {"in memory": [], "windows": []}
        for _ in range(args.runs):  # side by side, alternating
            results["in memory"].append(run(IN_MEMORY, str(small), timeout_s=3600))
            results["windows"].append(run(STREAMED, str(small), timeout_s=3600))
        gz = run(STREAMED, str(zipped), timeout_s=3600)
        large_label = f"{args.gigabytes:g} GB"
        large = run(STREAMED, str(traces[large_label]), timeout_s=7200)
        events = int(results["windows"][0]["events"])
        best = {name: min(runs, key=lambda r: r["wall_s"]) for name, runs in results.items()}
        rows = [
            ("1 GB JSON", "in memory", best["in memory"], events, small),
            ("1 GB JSON", "a window at a time", best["windows"], events, small),
            ("1 GB, gzip", "a window at a time", gz, int(gz["events"]), zipped),
            (f"{large_label} JSON", "a window at a time", large, int(large["events"]), traces[large_label]),
        ]
        lines = [
            "# Kineto traces too large to hold: xsp import a window at a time",
            "",
            f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, "
            f"{platform.machine()}; `python benchmarks/large_kineto_import.py --runs {args.runs} "
            f"--gigabytes {args.gigabytes:g}`.",
            "",
            "Traces: the V100 trace repeated end to end (`benchmarks/kineto_import.py`), as plain JSON. Each import "
            "is a fresh process, from start to the written `.xsp.parquet` (imports included); at 1 GB the two "
            f"alternate, best of {args.runs}. Goal: at most 2 GB peak whatever the size, at no fewer events a "
            "second than the in-memory import.",
            "",
            "| trace | import | file MB | events | spans | windows (largest) | s | events/s | peak RSS MB |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for label, how, figures, count, path in rows:
            windows = (f"{int(figures['windows'])} ({int(figures['largest_window']):,})" if "windows" in figures
                       else "-")
            size_mb = path.stat().st_size / 1e6
            lines.append(f"| {label} | {how} | {size_mb:,.0f} | {count:,} | {int(figures['spans']):,} "
                         f"| {windows} | {figures['wall_s']:.1f} | {count / figures['wall_s']:,.0f} "
                         f"| {figures['peak_rss_mb']:,.0f} |")
        ratio = best["in memory"]["wall_s"] / best["windows"]["wall_s"]
        lines += ["", f"At 1 GB, a window at a time runs at {ratio:.2f}x the in-memory import's events a second, "
                      f"in {best['windows']['peak_rss_mb'] / best['in memory']['peak_rss_mb']:.2f}x its peak memory.",
                  "", "All runs (s): " + "; ".join(f"{name} " + ", ".join(f"{r['wall_s']:.1f}" for r in runs)
                                                  for name, runs in results.items()) + ".",
                  "", "## The same spans as the in-memory import, on every shared trace", ""]
        lines += _same_spans_on_shared_traces()
        record(lines, RESULTS)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
