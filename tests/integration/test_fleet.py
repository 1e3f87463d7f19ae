"""Many runs as one Parquet dataset: ``dataset=`` lays trace files out by run and rank, and
DuckDB queries a hundred of them at once with ``run`` and ``rank`` as partition columns."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pyarrow.dataset as pads
import pytest
import torch
from torch import nn

import xsp
from xsp.core import schema as col

duckdb = pytest.importorskip("duckdb", reason="duckdb is in the test extra")


def infer(steps: int = 4) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(2, 16))


def test_a_run_writes_into_its_partition(monkeypatch, tmp_path):
    monkeypatch.setenv("XSP_RUN_ID", "nightly/42")  # not a safe folder name: made one
    with xsp.trace(levels="model,layer", dataset=tmp_path, service_name="resnet") as session:
        infer()
    assert session.output == tmp_path / "run=nightly_42" / "rank=0" / "resnet.xsp.parquet"
    assert session.output.is_file() and session.trace.metadata["run_id"] == "nightly/42"
    monkeypatch.delenv("XSP_RUN_ID")
    with xsp.trace(levels="model", dataset=tmp_path, service_name="resnet") as second:  # no run id: a fresh one
        infer(1)
    assert second.output.parent.parent != session.output.parent.parent


def test_duckdb_queries_a_hundred_trace_files_as_one_dataset(monkeypatch, tmp_path):
    monkeypatch.setenv("XSP_RUN_ID", "seed")
    with xsp.trace(levels="model,layer", dataset=tmp_path / "seed", service_name="model") as session:
        infer()
    spans = session.trace.spans
    root = tmp_path / "fleet"
    runs, ranks = 25, 4
    for run in range(runs):
        for rank in range(ranks):
            slower = spans.copy()
            # run i is i% slower: a trend a fleet query should find
            slower[col.END_NS] = slower[col.START_NS] + (slower[col.DURATION_NS] * (1 + run / 100)).astype("int64")
            slower[col.DURATION_NS] = slower[col.END_NS] - slower[col.START_NS]
            slower[col.RANK] = pd.array([rank] * len(slower), dtype="Int64")
            xsp.Trace(spans=slower, metadata=session.trace.metadata).save(
                root / f"run=r{run:03d}" / f"rank={rank}" / "model.xsp.parquet")
    files = sorted(root.rglob("*.xsp.parquet"))
    assert len(files) == 100
    dataset = f"read_parquet('{root}/**/*.xsp.parquet', hive_partitioning = true)"
    totals = duckdb.sql(f"select count(*), count(distinct run), count(distinct rank) from {dataset}").fetchall()[0]
    assert totals == (100 * len(spans), runs, ranks)
    per_run = duckdb.sql(f"""
        select run, median(duration_ns) / 1e6 as latency_ms, count(distinct rank) as ranks
        from {dataset} where kind = 'predict' group by run order by run""").df()
    assert len(per_run) == runs and (per_run["ranks"] == ranks).all()
    assert per_run["latency_ms"].is_monotonic_increasing
    # the slowest layers across the fleet, by type
    layers = duckdb.sql(f"""
        select module_type, sum(duration_ns) / 1e6 as total_ms from {dataset}
        where level = 'layer' group by module_type order by total_ms desc""").df()
    assert set(layers["module_type"]) == {"Linear", "ReLU"}
    # each file is still a trace xsp reads on its own
    assert len(xsp.load(files[0]).spans) == len(spans)
    # pandas and pyarrow read the folder as one dataset too: a file leaves out the column its
    # folder names (they refused the file's int64 rank against the folder's int32)
    frame = pd.read_parquet(root)
    assert len(frame) == 100 * len(spans)
    assert sorted(frame[col.RANK].astype(int).unique()) == list(range(ranks)) and frame["run"].nunique() == runs
    assert pads.dataset(root, partitioning="hive").count_rows() == 100 * len(spans)


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_xsp_run_writes_into_the_dataset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nfor _ in range(3):\n    m(torch.ones(1, 4))\n")
    result = subprocess.run([sys.executable, "-m", "xsp", "run", "--dataset", "runs", "--", str(script)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "XSP_RUN_ID": "ci-7"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "run=ci-7" / "rank=0" / "job.xsp.parquet").is_file()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    refused = subprocess.run([sys.executable, "-m", "xsp", "run", "--dataset", str(blocked / "x"), "--", str(script)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
