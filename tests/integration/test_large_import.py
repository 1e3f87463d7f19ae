"""``xsp import`` of a 1 GB Kineto trace under a memory limit (heavy): the import a window at a
time holds a window, not the trace, so it stays under the bound; the in-memory import of the same
trace does not (its peak is about 1.9 GB at this size: benchmarks/results/large_kineto_import.md)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPIES = 25  # the V100 trace 25 times: 1.07 GB of JSON, 5.4M events
PEAK_BOUND_MB = 1024
"""The bound this test holds the import to: half the issue's 2 GB (a window of 131,072 events and
DuckDB's 512 MB; the in-memory import peaks at 1.9 GB on this trace)."""
ADDRESS_SPACE_BYTES = 4 << 30
"""The process's address space (ulimit -v): Arrow's and DuckDB's allocators reserve far more
address space than they touch, so the bound on what is touched is the peak RSS below."""

def _benchmark(module: str) -> Any:
    """A module of benchmarks/ (the traces and jobs they make are the tests' too)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


_IMPORT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from xsp.cli.main import main
code = main(["import", sys.argv[1], "-o", sys.argv[2]])
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
print(json.dumps({{"code": code, "peak_mb": peak}}))
"""


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_a_1_gb_trace_imports_within_the_memory_bound(shared_traces, tmp_path):
    write_repeated_trace = _benchmark("kineto_import").write_repeated_trace
    source = tmp_path / "x25.json"
    events = write_repeated_trace(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz", source, copies=COPIES)
    assert source.stat().st_size > 1_000_000_000
    output = tmp_path / "x25.xsp.parquet"
    result = subprocess.run([sys.executable, "-c", _IMPORT.format(limit=ADDRESS_SPACE_BYTES), str(source), str(output)],
                            capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["code"] == 0
    assert figures["peak_mb"] <= PEAK_BOUND_MB, f"peak {figures['peak_mb']:.0f} MB for {events:,} events"
    import pyarrow.parquet as pq

    metadata = json.loads(pq.read_schema(output).metadata[b"xsp"])
    assert pq.ParquetFile(output).metadata.num_rows == COPIES * 123378
    assert metadata["hierarchy"]["launched"] == metadata["hierarchy"]["gpu_activities"] == COPIES * 22290
    assert metadata["hierarchy"]["roots"] == COPIES * 6
    assert f"{COPIES * 123378} spans, {COPIES * 5} steps" in result.stderr
    assert "held at once" not in result.stderr and "read whole" not in result.stderr  # a window at a time


_REPORT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from xsp.cli.main import main
code = main(["report", sys.argv[1]])
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
print(json.dumps({{"code": code, "peak_mb": peak}}))
"""
JOB_RANKS = 64
JOB_PEAK_BOUND_MB = 1536
"""The bound the report of 64 ranks is held to (the issue's 4 GB is for 1,024; 1.5 GB measured there)."""


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_report_of_a_64_rank_job_stays_within_its_bound_and_finds_what_was_injected(shared_traces, tmp_path):
    write_job = _benchmark("job_dataset").write_job
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name = write_job(shared_traces / "kineto" / "a100_nccl_rank0.json.gz", tmp_path, JOB_RANKS,
                         ranks_per_host=8, host_offset_ns=1_234_567, late={(37, 5): 333_000})
    result = subprocess.run([sys.executable, "-c", _REPORT.format(limit=ADDRESS_SPACE_BYTES), str(name)],
                            capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["code"] == 0 and figures["peak_mb"] <= JOB_PEAK_BOUND_MB, figures
    report = result.stdout
    assert f"Distributed job synthetic-job: {JOB_RANKS} ranks" in report
    assert "Clocks: 8 hosts" in report and "offsets 0 to 8,642 µs" in report  # 7 x 1,234.567 µs
    assert "largest 333.0 µs (all_reduce 0 of step 5, rank 37 last)" in report
    assert "   5    37  2.331" in report  # the straggler table: step 5, rank 37, 7 x 333 µs late
    assert f"the 16 of {JOB_RANKS} ranks latest over all steps" in " ".join(report.split()) and "\n  37 " in report


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_sigterm_ends_an_import_with_nothing_left_behind(shared_traces, tmp_path):
    import signal
    import time

    write_repeated_trace = _benchmark("kineto_import").write_repeated_trace
    source = tmp_path / "x6.json"
    write_repeated_trace(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz", source, copies=6)
    output = tmp_path / "out" / "x6.xsp.parquet"
    output.parent.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "xsp", "import", str(source), "-o", str(output)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(output.parent.glob(".xsp-import-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until it has begun to write its scratch files
    assert process.poll() is None, "the import ended before it could be stopped"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and stderr.strip().splitlines()[-1] == "xsp: interrupted"
    assert list(output.parent.iterdir()) == []  # no scratch folder, no partial output


_SUMMARY = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from xsp.io import memory_needed
memory_needed.free_memory_bytes = lambda: 1 << 20  # as where the trace does not fit: read in windows
from xsp.cli.main import main
code = main(sys.argv[1:])
sys.stdout.flush()
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
print(json.dumps({{"code": code, "peak_mb": peak}}))
"""
SUMMARY_COPIES = 24  # the V100 trace 24 times: 2.96M spans
SUMMARY_PEAK_BOUND_MB = 1280
"""The bound the windowed summary and report of 2.96M spans are held to (the issue's 2 GB is for a 10 GB trace;
about 0.9 GB measured at this size, where the summary of the trace loaded whole takes 2.2 GB)."""


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_summary_and_report_of_a_trace_too_large_to_load_stay_within_their_bound(shared_traces, tmp_path):
    from xsp.gate.baseline import Summary
    from xsp.gate.diff_columns import KeyBy
    from xsp.io.kineto_stream import import_kineto

    write_repeated_trace = _benchmark("kineto_import").write_repeated_trace
    source = tmp_path / "x24.json"
    write_repeated_trace(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz", source,
                         copies=SUMMARY_COPIES)
    trace = tmp_path / "x24.xsp.parquet"
    import_kineto(source, trace)
    source.unlink()
    output = tmp_path / "x24.xsp-summary.parquet"
    result = subprocess.run([sys.executable, "-c", _SUMMARY.format(limit=ADDRESS_SPACE_BYTES), "summary",
                             str(trace), "-o", str(output)], capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["code"] == 0 and figures["peak_mb"] <= SUMMARY_PEAK_BOUND_MB, figures
    report = subprocess.run([sys.executable, "-c", _SUMMARY.format(limit=ADDRESS_SPACE_BYTES), "report", str(trace)],
                            capture_output=True, text=True, timeout=800)
    assert report.returncode == 0, report.stderr[-2000:]
    figures = json.loads(report.stdout.strip().splitlines()[-1])
    assert figures["code"] == 0 and figures["peak_mb"] <= SUMMARY_PEAK_BOUND_MB, figures
    text = " ".join(report.stdout.split())
    for section in ("Communication per rank", "Recommendations", "Model latency over steps", "Steps cover",
                    "Top 10 operators by self time", "GPU: ", "Kernel time per operator", "Memory copies and sets",
                    "Launch overhead per step", "read a part at a time"):
        assert section in text, section
    summary = Summary.load(output)
    assert summary.metadata["spans"] == SUMMARY_COPIES * 123378 and summary.metadata["steps"] == SUMMARY_COPIES * 5
    by_path = summary.keys[KeyBy.PATH].set_index("key")
    assert by_path.loc["ProfilerStep#*[0]", "sample_count"] == SUMMARY_COPIES * 5  # each step a sample
    assert by_path.loc["ProfilerStep#*[0]", "count"] == SUMMARY_COPIES * 5
    assert list(tmp_path.iterdir()) == [trace, output]  # the scratch folder removed
