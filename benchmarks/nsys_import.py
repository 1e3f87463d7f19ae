"""Nsight Systems import: time and memory per row, against the Kineto import, side by side.

The real export in ../shared/traces/nsys is repeated end to end (every table of events copied,
each copy shifted in time past the one before, its correlation ids past the last copy's) to
about 250k and 1M rows; each is imported by ``xsp.load`` in a fresh process, and so is the V100
Kineto trace repeated to about as many events. Goal: linear in rows, and per event at least as
fast as the Kineto import. Results go to benchmarks/results/nsys_import.md.

Usage: python benchmarks/nsys_import.py [--rows N ...]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sqlite3
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from _results import record
from kineto_import import DEFAULT_TRACE, PEAK, _document, repeated_trace, run

ROOT = Path(__file__).resolve().parents[1]
EXPORT = ROOT.parent / "shared" / "traces" / "nsys" / "saxpy_mpi_cuda_rank0.sqlite"
RESULTS = ROOT / "benchmarks" / "results" / "nsys_import.md"
EVENT_TABLES = ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL",
                "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")

LOAD_RUN = PEAK + """
import json, sys, time
t0 = time.perf_counter()
import xsp
t1 = time.perf_counter()
trace = xsp.load(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1, "peak_rss_mb": peak_mb(), "spans": len(trace.spans)}))
"""


def repeated_export(source: Path, rows: int, target: Path) -> int:
    """``source`` with its event tables repeated to about ``rows`` rows; the rows it has."""
    shutil.copy(source, target)
    with sqlite3.connect(target) as connection:
        connection.text_factory = lambda raw: raw.decode("utf-8", "replace")
        tables = {name for (name,) in connection.execute("select name from sqlite_master where type = 'table'")}
        frames = {t: pd.read_sql_query(f"select * from {t}", connection) for t in EVENT_TABLES if t in tables}
        once = sum(len(f) for f in frames.values())
        copies = max(1, round(rows / once))
        period = max(int(f["end"].max()) for f in frames.values() if len(f) and f["end"].notna().any()) + 1_000
        stride = 1 + max(int(f["correlationId"].max()) for f in frames.values()
                         if "correlationId" in f and f["correlationId"].notna().any())
        for table, frame in frames.items():
            parts = []
            for copy in range(copies):
                shifted = frame.copy()
                shifted["start"] = frame["start"] + copy * period
                if "end" in frame:
                    shifted["end"] = frame["end"] + copy * period
                if "correlationId" in frame:
                    shifted["correlationId"] = frame["correlationId"] + copy * stride
                parts.append(shifted)
            connection.execute(f"delete from {table}")
            pd.concat(parts, ignore_index=True).to_sql(table, connection, if_exists="append", index=False)
        connection.commit()
    return once * copies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[250_000, 1_000_000])
    parser.add_argument("--runs", type=int, default=3,
                        help="fresh processes per import, alternating; the fastest of each is kept (default 3)")
    args = parser.parse_args(argv)
    if not EXPORT.is_file() or not DEFAULT_TRACE.is_file():
        print(f"no traces at {EXPORT.parent.parent}", file=sys.stderr)
        return 2
    kineto_events = len(_document(DEFAULT_TRACE)["traceEvents"])
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for rows in args.rows:
            export = Path(folder) / f"x{rows}.sqlite"
            made = repeated_export(EXPORT, rows, export)
            kineto = Path(folder) / f"x{rows}_{DEFAULT_TRACE.name}"
            events = repeated_trace(DEFAULT_TRACE, max(1, round(rows / kineto_events)), kineto)
            nsys_runs, json_runs = [], []
            for _ in range(max(args.runs, 1)):  # alternating: a slow spell of the machine meets both
                nsys_runs.append(run(LOAD_RUN, str(export)))
                json_runs.append(run(LOAD_RUN, str(kineto)))
            nsys = min(nsys_runs, key=lambda found: found["load_s"])
            json_run = min(json_runs, key=lambda found: found["load_s"])
            results.append((made, nsys, events, json_run))
            export.unlink()
            kineto.unlink()
    lines = [
        "# Nsight Systems import: time and memory per row", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}, Python {platform.python_version()}, "
        f"{platform.machine()}; `python benchmarks/nsys_import.py --rows {' '.join(map(str, args.rows))} "
        f"--runs {args.runs}`.", "",
        f"`{EXPORT.name}` repeated to each size, against `{DEFAULT_TRACE.name}` (Kineto) repeated to about as many "
        "events, each loaded by `xsp.load` in a fresh process (tree and launch links included), the fastest of "
        f"{args.runs} alternating runs each. Goal: linear in "
        "rows, at least as fast per event as the Kineto import.", "",
        "| rows | nsys load s | µs / row | peak MB | B / row | Kineto events | Kineto load s | µs / event | "
        "B / event |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for made, nsys, events, json_run in results:
        lines.append(f"| {made:,} | {nsys['load_s']:.2f} | {nsys['load_s'] / made * 1e6:.2f} | "
                     f"{nsys['peak_rss_mb']:,.0f} | {nsys['peak_rss_mb'] * 2**20 / made:,.0f} | {events:,} | "
                     f"{json_run['load_s']:.2f} | {json_run['load_s'] / events * 1e6:.2f} | "
                     f"{json_run['peak_rss_mb'] * 2**20 / events:,.0f} |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
