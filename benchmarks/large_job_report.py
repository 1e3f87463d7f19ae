"""The report of a distributed job of 1,024 ranks, read from its rank files without loading them.

The job is made by benchmarks/job_dataset.py from the shared NCCL rank trace: 1,024 rank files,
8 ranks a host with each host's clock off by a known amount, and three ranks made late in one
step each by a known delay. ``xsp report`` of it runs in a fresh process (peak memory its own,
VmHWM), and ``xsp.analysis.job.load_job`` with the cross-rank analyses checks that what was
injected is found to the microsecond: each host's clock offset, each late step's straggler and
lateness, and the skew of each collective of those steps. Goal (issue 64): at most 4 GB and 2
minutes.

Usage: python benchmarks/large_job_report.py [--ranks N] [--scratch DIR]
Results go to benchmarks/results/large_job_report.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from _results import record
from job_dataset import SOURCE_NAME, write_job
from kineto_import import PEAK

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "traces" / "kineto" / SOURCE_NAME
RESULTS = ROOT / "benchmarks" / "results" / "large_job_report.md"
RANKS_PER_HOST = 8
HOST_OFFSET_NS = 1_234_567
LATE = {(17, 4): 120_000, (500, 5): 333_000, (1023, 6): 75_000}
"""(rank, step): delay injected, ns (ranks past the job's size are left out)."""
COLLECTIVES_PER_STEP = 7

REPORT = PEAK + """
import json, sys, time
t0 = time.perf_counter()
from xsp.cli.main import main
code = main(["report", sys.argv[1]])
print(json.dumps({"code": code, "s": time.perf_counter() - t0, "peak_rss_mb": peak_mb()}))
"""


def found_figures(name: Path, ranks: int, late: dict[tuple[int, int], int]) -> list[str]:
    """Whether what was injected is found, to the microsecond: one line each."""
    from xsp import analysis
    from xsp.analysis.job import load_job

    job = load_job(name)
    assert job is not None
    offsets = analysis.clock_offsets(job)
    expected = {rank: (rank // RANKS_PER_HOST) * HOST_OFFSET_NS for rank in range(ranks)}
    wrong = {rank: (offsets.get(rank), want) for rank, want in expected.items() if offsets.get(rank) != want}
    lines = [f"| clock offsets of {ranks} ranks on {ranks // RANKS_PER_HOST} hosts | "
             f"{'all exact' if not wrong else f'{len(wrong)} differ, e.g. {next(iter(wrong.items()))}'} |"]
    stragglers = analysis.stragglers(job).set_index("step")
    skew = analysis.collective_skew(job)
    for (rank, step), delay_ns in late.items():
        row = stragglers.loc[step]
        late_ns = round(float(row["late_ms"]) * 1e6)
        step_skew = skew[skew["step"] == step]
        skews = sorted(set(step_skew["skew_ns"].tolist()))
        verdict = ("exact" if int(row["straggler"]) == rank and late_ns == COLLECTIVES_PER_STEP * delay_ns
                   and skews == [delay_ns] and set(step_skew["latest_rank"]) == {rank} else "NOT FOUND")
        lines.append(f"| rank {rank} {delay_ns / 1e3:g} µs late in step {step} | straggler {int(row['straggler'])}, "
                     f"late {late_ns / 1e3:g} µs over {COLLECTIVES_PER_STEP} collectives, skew {skews[0] / 1e3:g} µs "
                     f"on each: {verdict} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--scratch", type=Path, default=None, help="folder for the job's files (kept when given)")
    args = parser.parse_args(argv)
    folder = args.scratch or Path(tempfile.mkdtemp(prefix="xsp-large-job-"))
    late = {key: delay for key, delay in LATE.items() if key[0] < args.ranks}
    try:
        name = folder / "job.xsp.parquet"
        if len(list(folder.glob("job.rank*.xsp.parquet"))) != args.ranks:
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                write_job(SOURCE, folder, args.ranks, RANKS_PER_HOST, HOST_OFFSET_NS, late)
            print(f"wrote {args.ranks} rank files in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        size_mb = sum(path.stat().st_size for path in folder.glob("job.rank*.xsp.parquet")) / 1e6
        started = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", REPORT, str(name)], capture_output=True, text=True,
                                timeout=3600)
        wall_s = time.perf_counter() - started
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checks = found_figures(name, args.ranks, late)
        spans = 26_932 * args.ranks
        lines = [
            "# The report of a distributed job of many ranks, read without loading it",
            "",
            f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, "
            f"{platform.machine()}; `python benchmarks/large_job_report.py --ranks {args.ranks}`.",
            "",
            f"Job: {args.ranks} rank files made from `{SOURCE_NAME}` (`benchmarks/job_dataset.py`), {spans:,} spans, "
            f"{size_mb:,.0f} MB of Parquet; {RANKS_PER_HOST} ranks a host, host h's clock off by "
            f"h x {HOST_OFFSET_NS:,} ns. Goal: the job report in at most 4 GB and 2 minutes.",
            "",
            "| what | figure |",
            "| --- | ---: |",
            f"| `xsp report` of the job, whole process (s) | {wall_s:.1f} |",
            f"| its peak RSS (MB) | {figures['peak_rss_mb']:,.0f} |",
            f"| its exit status | {figures['code']} |",
            "",
            "## What was injected, and what the report's analyses found",
            "",
            "| injected | found |",
            "| --- | --- |",
            *checks,
        ]
        record(lines, RESULTS)
    finally:
        if args.scratch is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
