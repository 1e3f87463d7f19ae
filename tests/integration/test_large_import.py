"""``xsp import`` of a 1 GB Kineto trace under a memory limit (heavy): the import a window at a
time holds a window, not the trace, so it stays under the bound; the in-memory import of the same
trace does not (its peak is about 1.9 GB at this size: benchmarks/results/large_kineto_import.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COPIES = 25  # the V100 trace 25 times: 1.07 GB of JSON, 5.4M events
PEAK_BOUND_MB = 1024
"""The bound this test holds the import to: half the issue's 2 GB (a window of 131,072 events and
DuckDB's 512 MB; the in-memory import peaks at 1.9 GB on this trace)."""
ADDRESS_SPACE_BYTES = 4 << 30
"""The process's address space (ulimit -v): Arrow's and DuckDB's allocators reserve far more
address space than they touch, so the bound on what is touched is the peak RSS below."""

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
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from kineto_import import write_repeated_trace
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
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
