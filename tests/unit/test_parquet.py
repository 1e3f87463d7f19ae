"""The canonical .xsp.parquet file: round trip, metadata, and refusing bad files."""

from __future__ import annotations

import base64
import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import xsp
from xsp.core import schema as col
from xsp.io.parquet import arrow_table, write_trace, write_trace_tables


@pytest.fixture
def recorded(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    path = tmp_path / "run.xsp.parquet"
    with xsp.trace(output=path) as session, torch.no_grad():
        with xsp.span("pre", note="x"):
            pass
        model(torch.randn(2, 3))
    return path, session.trace


def test_round_trip_keeps_every_column_dtype_and_value(recorded):
    path, trace = recorded
    loaded = xsp.load(path)
    assert list(loaded.spans.columns) == list(col.COLUMNS)
    for name, dtype in col.COLUMNS.items():
        assert str(loaded.spans[name].dtype) == dtype, name
    pd.testing.assert_frame_equal(loaded.spans, trace.spans)
    assert loaded.metadata == json.loads(json.dumps(trace.metadata, default=str))


def test_a_loaded_table_can_be_changed_in_place(recorded):
    spans = xsp.load(recorded[0]).spans  # its columns are not Arrow's read-only buffers
    first = spans.index[:2]
    for name in (col.START_NS, col.DURATION_NS, col.SPAN_ID):
        spans.loc[first, name] = 7
    spans.loc[first, col.CORRELATION_ID] = 3
    spans.loc[first, col.NAME] = spans[col.NAME].iloc[-1]
    assert spans[col.START_NS].iloc[:2].tolist() == [7, 7] and spans[col.CORRELATION_ID].iloc[:2].tolist() == [3, 3]
    assert spans[col.NAME].iloc[0] == spans[col.NAME].iloc[-1]


def test_a_file_out_of_start_order_is_read_in_start_order(recorded, tmp_path):
    _, trace = recorded
    spans = trace.spans.iloc[::-1].reset_index(drop=True)  # windows of several threads interleave so
    write_trace(tmp_path / "reversed.xsp.parquet", spans, trace.metadata)
    pd.testing.assert_frame_equal(xsp.load(tmp_path / "reversed.xsp.parquet").spans, trace.spans)


def test_metadata_describes_the_run(recorded):
    meta = xsp.load(recorded[0]).metadata
    for key in ("xsp_version", "schema_version", "torch_version", "python_version", "host", "device", "levels",
                "clock", "dropped", "hierarchy", "service_name"):
        assert key in meta, key
    assert meta["schema_version"] == col.SCHEMA_VERSION
    assert meta["levels"] == ["model", "input", "layer"]
    assert set(meta["clock"]) == {"host_to_epoch_ns", "uncertainty_ns", "drift_ns"}


def test_pandas_reads_the_file_directly(recorded):
    frame = pd.read_parquet(recorded[0])
    assert set(col.REQUIRED_COLUMNS) <= set(frame.columns)
    assert frame[col.PARENT_ID].isna().sum() >= 2  # session and predict are roots


def test_every_parent_is_a_span_of_the_same_table(recorded):
    spans = xsp.load(recorded[0]).spans
    parents = spans[col.PARENT_ID].dropna()
    assert parents.isin(spans[col.SPAN_ID]).all()
    assert spans[col.SPAN_ID].is_unique
    assert (spans[col.DURATION_NS] == spans[col.END_NS] - spans[col.START_NS]).all()
    assert set(spans[col.LEVEL]) <= {level.value for level in xsp.Level}


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        xsp.load(tmp_path / "nothing.xsp.parquet")


def test_not_parquet(tmp_path):
    path = tmp_path / "text.xsp.parquet"
    path.write_text("hello")
    with pytest.raises(xsp.TraceFormatError, match="not a Parquet file"):
        xsp.load(path)


def test_parquet_without_xsp_metadata(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1, 2]}), path)
    with pytest.raises(xsp.TraceFormatError, match="not an xsp trace"):
        xsp.load(path)


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_file(recorded, tmp_path, keep):
    data = recorded[0].read_bytes()
    path = tmp_path / "cut.xsp.parquet"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(xsp.TraceFormatError, match="truncated"):
        xsp.load(path)


@pytest.mark.parametrize("appended", [b"garbage\n", b"PAR1" * 3, "first half"])
def test_a_file_with_bytes_appended_says_so_not_truncated(recorded, tmp_path, appended):
    data = recorded[0].read_bytes()
    extra = data[: len(data) // 2] if appended == "first half" else appended
    path = tmp_path / "added.xsp.parquet"
    path.write_bytes(data + extra)
    with pytest.raises(xsp.TraceFormatError,
                       match=rf"has {len(extra):,} bytes after the end of its Parquet data \(at byte {len(data):,}\)"):
        xsp.load(path)


def test_corrupt_middle(recorded, tmp_path):
    data = bytearray(recorded[0].read_bytes())
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    middle = (4 + footer_start) // 2  # the middle of the data pages (the footer's own bytes are checked apart)
    data[middle: middle + 64] = b"\xff" * 64
    path = tmp_path / "corrupt.xsp.parquet"
    path.write_bytes(bytes(data))
    with pytest.raises(xsp.TraceFormatError):
        xsp.load(path).spans.to_dict()


def test_newer_schema_is_refused(recorded, tmp_path):
    trace = xsp.load(recorded[0])
    path = tmp_path / "future.xsp.parquet"
    write_trace(path, trace.spans, {**trace.metadata, "schema_version": col.SCHEMA_VERSION + 1})
    with pytest.raises(xsp.SchemaVersionError, match="upgrade xsp"):
        xsp.load(path)


def test_unwritable_output_warns_but_the_trace_is_kept(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(xsp.XspWarning, match="the trace file was not written: cannot write .*run.xsp.parquet"):
        with xsp.trace(output=blocker / "sub" / "run.xsp.parquet") as session:
            pass
    assert session.trace is not None and len(session.trace.spans) == 1
    assert session.write_error is not None and session.write_error.endswith(f"{blocker} is a file, not a directory")


def _tables_then(recorded, read: list[str]):
    spans = xsp.load(recorded[0]).spans
    table = arrow_table(spans)
    for start in range(0, len(table), 2):
        read.append(f"table {start}")
        yield table.slice(start, 2)


@pytest.mark.parametrize("filler", [0, 40_000], ids=["fits its room", "larger than its room"])
def test_metadata_known_only_at_the_end_reads_as_any_trace_metadata(recorded, tmp_path, filler):
    """The end of a streamed run writes its file while its last windows are still interpreted, and
    its metadata once they are: pyarrow, DuckDB and xsp.load read it all the same, checksum and
    all. Metadata larger than the room kept for it has the file written again, still right."""
    path, trace = recorded
    metadata = {**json.loads(json.dumps(trace.metadata, default=str)), "filler": "x" * filler}
    read: list[str] = []

    def known_late() -> dict:
        read.append("metadata")
        return metadata

    late = tmp_path / "late.xsp.parquet"
    write_trace_tables(late, _tables_then(recorded, read), known_late)
    assert read[-1] == "metadata" and read.count("metadata") == 1  # asked for once every table was written
    loaded = xsp.load(late)
    assert loaded.metadata == metadata
    pd.testing.assert_frame_equal(loaded.spans, xsp.load(path).spans)
    stored = json.loads(pq.read_table(late).schema.metadata[col.METADATA_KEY])
    assert stored == metadata and json.loads(pq.read_metadata(late).metadata[col.METADATA_KEY]) == metadata
    duckdb = pytest.importorskip("duckdb")
    value = duckdb.sql(f"SELECT value FROM parquet_kv_metadata('{late}') WHERE key = 'xsp'").fetchall()[0][0]
    assert json.loads(value) == metadata


def test_late_metadata_that_no_longer_matches_its_checksum_is_refused(recorded, tmp_path):
    path, trace = recorded
    late = tmp_path / "late.xsp.parquet"
    write_trace_tables(late, _tables_then(recorded, []), lambda: {**trace.metadata, "note": "abc"})
    stored = pq.read_metadata(late).metadata[b"ARROW:schema"]  # where pyarrow reads the schema's metadata from
    damaged = base64.b64encode(base64.b64decode(stored).replace(b'"note": "abc"', b'"note": "abd"'))
    assert damaged != stored and len(damaged) == len(stored)
    late.write_bytes(late.read_bytes().replace(stored, damaged))
    with pytest.raises(xsp.TraceFormatError, match="checksum"):
        xsp.load(late)
