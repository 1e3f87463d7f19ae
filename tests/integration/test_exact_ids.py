"""A trace file reads back with exact span and parent ids in pandas, pyarrow, DuckDB and Polars,
and a span id as Jaeger shows it (16 hex digits) finds its row."""

from __future__ import annotations

import duckdb
import pandas as pd
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch

import xsp
from xsp.core import schema as col

from .otlp_receiver import GrpcReceiver


def _deep_model(layers: int = 60) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(layers)])


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    path = tmp_path_factory.mktemp("ids") / "run.xsp.parquet"
    model = _deep_model().eval()
    with xsp.trace(levels="model,layer", output=path), torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 8))
    spans = xsp.load(path).spans
    expected = dict(zip(spans[col.SPAN_ID].tolist(), spans[col.PARENT_ID].astype(object).where(
        spans[col.PARENT_ID].notna(), None).tolist()))
    assert len(expected) > 300 and sum(parent is not None for parent in expected.values()) > 300
    return path, expected


def _exact(pairs: list[tuple[int, int | None]], expected: dict[int, int | None]) -> None:
    assert dict(pairs) == expected
    ids = set(expected)
    assert all(parent in ids for _, parent in pairs if parent is not None)  # every parent is a span


def test_pandas_reads_exact_ids(traced):
    path, expected = traced
    frame = pd.read_parquet(path)
    assert str(frame[col.PARENT_ID].dtype) == "Int64" and str(frame[col.STEP].dtype) == "Int64"
    parents = frame[col.PARENT_ID].astype(object).where(frame[col.PARENT_ID].notna(), None).tolist()
    _exact(list(zip(frame[col.SPAN_ID].tolist(), parents)), expected)


def test_pyarrow_duckdb_and_polars_read_exact_ids(traced):
    path, expected = traced
    table = pq.read_table(path, columns=[col.SPAN_ID, col.PARENT_ID])
    _exact(list(zip(table[col.SPAN_ID].to_pylist(), table[col.PARENT_ID].to_pylist())), expected)
    _exact(duckdb.sql(f"select span_id, parent_id from '{path}'").fetchall(), expected)
    frame = pl.read_parquet(path, columns=[col.SPAN_ID, col.PARENT_ID])
    _exact(list(zip(frame[col.SPAN_ID].to_list(), frame[col.PARENT_ID].to_list())), expected)


def test_a_span_id_as_jaeger_shows_it_finds_its_row(tmp_path):
    model = _deep_model(5).eval()
    with GrpcReceiver() as receiver:
        with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet", otlp_endpoint=receiver.endpoint,
                       service_name="ids") as session, torch.no_grad():
            model(torch.randn(2, 8))
        assert session.export is not None
        session.export.wait(30)
    spans = pd.read_parquet(tmp_path / "run.xsp.parquet")
    received = receiver.sink.spans
    assert len(received) == len(spans)
    for span in received:
        assert len(span.span_id_hex) == 16
        row = spans[spans[col.SPAN_ID] == int(span.span_id_hex, 16)]  # as docs/jaeger.md says to look it up
        assert row[col.NAME].tolist() == [span.name]


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_events_nested_thirty_thousand_deep_stay_linear_and_are_flattened_and_said(tmp_path):
    """Kineto events each inside the one before (30,000 levels) took xsp summary 11 minutes and
    hung xsp push: paths and walks of the tree grew with the square of the nesting."""
    import json
    import subprocess
    import sys

    from xsp.table.parents import MAX_DEPTH

    depth = 30_000
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 2 * depth - 2 * i}
              for i in range(depth)]
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"traceEvents": events}))
    trace = xsp.load(nested)
    assert trace.metadata["hierarchy"]["flattened"] == depth - MAX_DEPTH - 1
    from xsp.table.walks import depth_of, parent_positions

    assert depth_of(parent_positions(trace.spans)).max() == MAX_DEPTH
    for argv in (["summary", str(nested), "-o", str(tmp_path / "s.xsp-summary.parquet")], ["report", str(nested)]):
        done = subprocess.run([sys.executable, "-m", "xsp", *argv], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    with GrpcReceiver() as receiver:
        done = subprocess.run([sys.executable, "-m", "xsp", "push", str(nested), "--otlp", receiver.endpoint],
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert receiver.sink.spans
