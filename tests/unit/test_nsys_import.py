"""Nsight Systems SQLite exports into the span table (xsp/io/nsys.py): the real export in
../shared/traces/nsys, and exports made here from the same tables."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.io.nsys import NVTX_DOMAIN_CREATE, NVTX_NAME_THREAD, NVTX_PUSH_POP, NVTX_START_END, load_nsys
from xsp.io.nsys_export import is_nsys_path

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "nsys" / "saxpy_mpi_cuda_rank0.sqlite"
needs_shared = pytest.mark.skipif(not SHARED.is_file(), reason="../shared/traces (the real traces) is not here")

PID, TID = 4242, 4243
GLOBAL_TID = (PID << 24) | TID
GLOBAL_PID = PID << 24
EPOCH_NS = 1_700_000_000_000_000_000

SCHEMA = {
    "EXPORT_META_DATA": "name TEXT, value TEXT",
    "StringIds": "id INTEGER PRIMARY KEY, value TEXT",
    "NVTX_EVENTS": "start INT, end INT, eventType INT, rangeId INT, category INT, color INT, text TEXT, "
                   "globalTid INT, endGlobalTid INT, textId INT, domainId INT",
    "CUPTI_ACTIVITY_KIND_RUNTIME": "start INT, end INT, eventClass INT, globalTid INT, correlationId INT, "
                                   "nameId INT, returnValue INT, callchainId INT",
    "CUPTI_ACTIVITY_KIND_KERNEL": "start INT, end INT, deviceId INT, contextId INT, streamId INT, correlationId INT, "
                                  "globalPid INT, demangledName INT, shortName INT, registersPerThread INT, "
                                  "gridX INT, gridY INT, gridZ INT, blockX INT, blockY INT, blockZ INT, "
                                  "staticSharedMemory INT, dynamicSharedMemory INT",
    "CUPTI_ACTIVITY_KIND_MEMCPY": "start INT, end INT, deviceId INT, contextId INT, streamId INT, correlationId INT, "
                                  "globalPid INT, bytes INT, copyKind INT, srcKind INT, dstKind INT",
    "CUPTI_ACTIVITY_KIND_MEMSET": "start INT, end INT, deviceId INT, contextId INT, streamId INT, correlationId INT, "
                                  "globalPid INT, value INT, bytes INT",
    "ThreadNames": "nameId INT, priority INT, globalTid INT",
    "TARGET_INFO_GPU": "id INT, name TEXT",
    "TARGET_INFO_SESSION_START_TIME": "utcEpochNs INT, utcTime TEXT, localTime TEXT",
    "TARGET_INFO_SYSTEM_ENV": "globalVid INT, devStateName TEXT, name TEXT, nameEnum INT, value TEXT",
}
"""The tables of the exports made here, as the shared export (Nsight Systems 2022.2, schema 2.9.1) has them."""


def _insert(connection: sqlite3.Connection, table: str, rows: list[dict[str, object]]) -> None:
    """Rows by column name: a layout's other columns stay null, as an export leaves what it did not record."""
    for row in rows:
        names = ", ".join(f'"{name}"' for name in row)
        connection.execute(f"insert into {table} ({names}) values ({', '.join('?' * len(row))})", list(row.values()))


def make_export(path: Path, schema_version: str = "2.9.1", rank: str | None = "3",
                drop_column: tuple[str, str] | None = None, schema: dict[str, str] | None = None,
                metadata_table: str | None = "EXPORT_META_DATA", gpu_table: str = "TARGET_INFO_GPU",
                product_version: str = "2024.1.1") -> Path:
    """An export with one training-like step: an NVTX ``step`` range (push/pop) holding a
    ``forward`` range, a launch and its kernel, a copy and a set; a start/end range on the side.
    ``schema``: the tables and their columns (default :data:`SCHEMA`), as a release writes them;
    ``metadata_table``: where it names its product and schema (None: a release that wrote none)."""
    connection = sqlite3.connect(path)
    for table, columns in (schema or SCHEMA).items():
        connection.execute(f"create table {table} ({columns})")
    major, minor, micro = schema_version.split(".")
    if metadata_table is not None:
        connection.executemany(f"insert into {metadata_table} values (?, ?)", [
            ("EXPORT_PRODUCT_NAME", "NVIDIA Nsight Systems"), ("EXPORT_PRODUCT_VERSION", product_version),
            ("EXPORT_SCHEMA_VERSION", schema_version), ("EXPORT_SCHEMA_VERSION_MAJOR", major),
            ("EXPORT_SCHEMA_VERSION_MINOR", minor), ("EXPORT_SCHEMA_VERSION_MICRO", micro)])
    strings = {1: "cudaLaunchKernel_v7000", 2: "void gemm<float>(float*, int)", 3: "gemm", 4: "cudaMemcpyAsync_v3020",
               5: "cudaMemsetAsync_v3020", 6: "python3", 7: "cuCtxSynchronize", 8: "forward"}
    connection.executemany("insert into StringIds values (?, ?)", list(strings.items()))
    nvtx = ("start", "end", "eventType", "rangeId", "category", "color", "text", "globalTid", "endGlobalTid",
            "textId", "domainId")
    _insert(connection, "NVTX_EVENTS", [dict(zip(nvtx, values)) for values in [
        (10, None, NVTX_DOMAIN_CREATE, None, None, None, "training", GLOBAL_TID, None, None, 7),
        (11, None, NVTX_NAME_THREAD, None, None, None, "trainer", GLOBAL_TID, None, None, 0),
        (1_000, 9_000, NVTX_PUSH_POP, None, None, None, "step", GLOBAL_TID, None, None, 7),
        (1_100, 5_000, NVTX_PUSH_POP, None, None, None, None, GLOBAL_TID, None, 8, 7),
        (20_000, 21_000, NVTX_START_END, 1, None, None, "checkpoint", GLOBAL_TID, GLOBAL_TID, None, 0),
    ]])
    runtime = ("start", "end", "eventClass", "globalTid", "correlationId", "nameId", "returnValue", "callchainId")
    _insert(connection, "CUPTI_ACTIVITY_KIND_RUNTIME", [dict(zip(runtime, values)) for values in [
        (1_200, 1_300, 0, GLOBAL_TID, 100, 1, 0, None),
        (1_190, 1_310, 67, GLOBAL_TID, 100, 1, 0, 5),  # the same call again, with its backtrace
        (5_100, 5_200, 0, GLOBAL_TID, 101, 4, 0, None),
        (5_300, 5_400, 0, GLOBAL_TID, 102, 5, 0, None),
        (8_000, 8_500, 1, GLOBAL_TID, 103, 7, 0, None),
    ]])
    device = {"deviceId": 0, "contextId": 1, "streamId": 7, "globalPid": GLOBAL_PID}
    _insert(connection, "CUPTI_ACTIVITY_KIND_KERNEL", [{
        "start": 1_400, "end": 4_400, **device, "correlationId": 100, "demangledName": 2, "shortName": 3,
        "registersPerThread": 32, "gridX": 128, "gridY": 1, "gridZ": 1, "blockX": 256, "blockY": 1, "blockZ": 1,
        "staticSharedMemory": 1024, "dynamicSharedMemory": 2048}])
    _insert(connection, "CUPTI_ACTIVITY_KIND_MEMCPY", [{
        "start": 5_150, "end": 5_900, **device, "correlationId": 101, "bytes": 4096, "copyKind": 1, "srcKind": 1,
        "dstKind": 2}])
    _insert(connection, "CUPTI_ACTIVITY_KIND_MEMSET", [{
        "start": 5_950, "end": 6_000, **device, "correlationId": 102, "value": 0, "bytes": 512}])
    _insert(connection, "ThreadNames", [{"nameId": 6, "priority": 0, "globalTid": GLOBAL_TID}])
    gpu_id = "deviceId" if gpu_table == "TARGET_INFO_CUDA_GPU" else "id"
    _insert(connection, gpu_table, [{gpu_id: 0, "name": "NVIDIA H100 80GB HBM3"}])
    _insert(connection, "TARGET_INFO_SESSION_START_TIME", [{"utcEpochNs": EPOCH_NS, "utcTime": "", "localTime": ""}])
    if rank is not None:
        _insert(connection, "TARGET_INFO_SYSTEM_ENV", [{"globalVid": 0, "devStateName": "", "name": "RANK",
                                                        "nameEnum": 0, "value": rank}])
    if drop_column:
        connection.execute(f"alter table {drop_column[0]} drop column {drop_column[1]}")
    connection.commit()
    connection.close()
    return path


def by_name(trace: xsp.Trace) -> dict[str, pd.Series]:
    return {name: row for name, row in zip(trace.spans[col.NAME], trace.spans.to_dict("records"))}


def test_an_export_becomes_the_span_tree(tmp_path):
    trace = xsp.load(make_export(tmp_path / "report.sqlite"))
    spans = trace.spans
    rows = by_name(trace)
    assert len(spans) == 10  # the repeated call is one span
    assert trace.metadata["nsys"]["not_imported"] == {
        "CUPTI_ACTIVITY_KIND_RUNTIME rows repeating a call (its backtrace's)": 1}
    ids = dict(zip(spans[col.NAME], spans[col.SPAN_ID]))
    # NVTX ranges: model-level spans nested by their intervals, named by text or string id
    assert rows["step"][col.LEVEL] == "model" and rows["step"][col.KIND] == "user"
    assert rows["forward"][col.PARENT_ID] == ids["step"]
    assert json.loads(rows["forward"][col.ATTRIBUTES]) == {"nvtx.domain": "training"}
    assert pd.isna(rows["checkpoint"][col.ATTRIBUTES])  # the default domain
    # the launch inside forward, its kernel under it by correlation id
    assert rows["cudaLaunchKernel"][col.PARENT_ID] == ids["forward"]
    assert rows["cudaLaunchKernel"][col.START_NS] == EPOCH_NS + 1_200  # the call, not its backtrace's
    kernel = rows["void gemm<float>(float*, int)"]
    assert kernel[col.PARENT_ID] == ids["cudaLaunchKernel"] and kernel[col.LEVEL] == "kernel"
    assert kernel[col.GRID] == "[128,1,1]" and kernel[col.BLOCK] == "[256,1,1]"
    assert kernel[col.REGISTERS_PER_THREAD] == 32 and kernel[col.SHARED_MEMORY_BYTES] == 3072
    assert kernel[col.DEVICE_ID] == 0 and kernel[col.STREAM_ID] == 7 and pd.isna(kernel[col.THREAD_ID])
    copy = rows["Memcpy HtoD (Pinned -> Device)"]
    assert copy[col.COPY_KIND] == "HtoD" and copy[col.BYTES] == 4096
    assert copy[col.PARENT_ID] == ids["cudaMemcpyAsync"]
    assert rows["Memset"][col.BYTES] == 512 and rows["Memset"][col.PARENT_ID] == ids["cudaMemsetAsync"]
    assert rows["cuCtxSynchronize"][col.KIND] == "driver"
    # threads, the GPU, the rank
    assert rows["step"][col.THREAD_ID] == TID
    assert trace.metadata["threads"] == {str(TID): "python3"}
    assert trace.metadata["device"] == "NVIDIA H100 80GB HBM3"
    assert trace.metadata["rank"] == 3 and trace.metadata["distributed"] == {"rank": 3}
    assert trace.metadata["hierarchy"]["launched"] == 3
    assert trace.metadata["nsys"]["schema_version"] == "2.9.1"


def test_the_analyses_and_a_round_trip_work_on_an_import(tmp_path):
    trace = xsp.load(make_export(tmp_path / "report.sqlite", rank=None))
    assert trace.metadata["rank"] is None
    assert xsp.analysis.kernels_by_name(trace)["name"].tolist() == ["void gemm<float>(float*, int)"]
    trace.save(tmp_path / "report.xsp.parquet")
    again = xsp.load(tmp_path / "report.xsp.parquet")
    pd.testing.assert_frame_equal(again.spans.reset_index(drop=True), trace.spans.reset_index(drop=True),
                                  check_dtype=False)


@pytest.mark.parametrize("schema_version", ["1.9.0", "9.0.0"])
def test_an_export_of_an_unknown_schema_is_one_clear_error(tmp_path, schema_version):
    with pytest.raises(TraceFormatError, match=f"schema {schema_version} is not one xsp reads"):
        load_nsys(make_export(tmp_path / "report.sqlite", schema_version=schema_version))


def test_a_table_without_a_column_xsp_reads_is_one_clear_error(tmp_path):
    path = make_export(tmp_path / "report.sqlite", drop_column=("CUPTI_ACTIVITY_KIND_KERNEL", "correlationId"))
    with pytest.raises(TraceFormatError, match="CUPTI_ACTIVITY_KIND_KERNEL .* lacks correlationId"):
        load_nsys(path)


def test_files_that_are_no_export_are_one_clear_error(tmp_path):
    other = tmp_path / "other.sqlite"
    connection = sqlite3.connect(other)
    connection.execute("create table t (x INT)")
    connection.commit()
    connection.close()
    with pytest.raises(TraceFormatError, match="no Nsight Systems export"):
        xsp.load(other)
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"SQLite format 3\x00" + b"\x07" * 500)
    assert is_nsys_path(corrupt)
    with pytest.raises(TraceFormatError):
        xsp.load(corrupt)
    truncated = tmp_path / "truncated.sqlite"
    truncated.write_bytes(make_export(tmp_path / "whole.sqlite").read_bytes()[:3000])
    with pytest.raises(TraceFormatError):
        xsp.load(truncated)


@pytest.mark.parametrize("name", ["corrupt", "missing", "text"])
def test_the_cli_says_one_line_for_a_bad_export(tmp_path, name):
    path = tmp_path / f"{name}.sqlite"
    if name == "corrupt":
        path.write_bytes(b"SQLite format 3\x00" + b"\x07" * 500)
    elif name == "text":
        path.write_text("not a database\n")
    finished = subprocess.run([sys.executable, "-m", "xsp", "import", str(path)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
    assert finished.returncode != 0
    assert "Traceback" not in finished.stderr
    assert len([line for line in finished.stderr.splitlines() if line.strip()]) == 1, finished.stderr


def test_xsp_import_writes_the_trace(tmp_path):
    source = make_export(tmp_path / "report.sqlite")
    finished = subprocess.run([sys.executable, "-m", "xsp", "import", str(source)], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert "3 of 3 GPU activities linked to their launch" in finished.stderr
    assert len(xsp.load(tmp_path / "report.xsp.parquet").spans) == 10


@needs_shared
def test_the_real_export_of_an_mpi_job():
    trace = xsp.load(SHARED)
    spans = trace.spans
    assert spans[col.LEVEL].value_counts().to_dict() == {"cuda_api": 57, "model": 22, "kernel": 20}
    hierarchy = trace.metadata["hierarchy"]
    assert hierarchy["launched"] == hierarchy["gpu_activities"] == 20
    assert trace.metadata["nsys"]["schema_version"] == "2.9.1"
    assert trace.metadata["device"] == "NVIDIA A100-SXM4-40GB"
    assert trace.metadata["rank"] == 0  # its NVTX thread name, "MPI Rank 0"
    names = set(spans[col.NAME])
    assert {"MPI_Init", "MPI_Send", "MPI_Recv", "saxpy", "cudaLaunchKernel", "cudaMemcpy"} <= names
    assert not any(name.endswith(("_v7000", "_v3020")) for name in names)
    mpi = spans[spans[col.NAME] == "MPI_Send"]
    assert all(json.loads(text) == {"nvtx.domain": "MPI"} for text in mpi[col.ATTRIBUTES].tolist())
    kernels = xsp.analysis.kernels_by_name(trace)
    assert kernels["name"].tolist() == ["saxpy(double *, double *, double *, double, int)"]
    assert int(kernels["count"].iloc[0]) == 5
    copies = spans[spans[col.KIND] == "memcpy"]
    assert sorted(copies[col.COPY_KIND].value_counts().to_dict().items()) == [("DtoH", 5), ("HtoD", 10)]
    assert (spans[col.START_NS] > 1_687_000_000 * 10**9).all()  # epoch ns: June 2023


@needs_shared
@pytest.mark.heavy
def test_the_real_export_reports_recommends_and_diffs_from_the_cli(tmp_path):
    for command in (["report", str(SHARED)], ["recommend", str(SHARED)], ["diff", str(SHARED), str(SHARED)]):
        finished = subprocess.run([sys.executable, "-m", "xsp", *command], capture_output=True, text=True,
                                  cwd=tmp_path, timeout=300)
        assert "Traceback" not in finished.stderr
        assert all(len(line) <= 80 for line in finished.stdout.splitlines()), command
        if command[0] != "diff":
            assert finished.returncode == 0, (command, finished.stderr)
            continue
        # an export without steps is one sample a key: the report is written, but no key can be
        # judged, and a gate that compared nothing does not pass
        assert finished.returncode == 2 and "NO VERDICT" in finished.stdout
        assert "no key could be judged" in finished.stderr and "steps" in finished.stderr


def test_the_c_reader_and_pythons_sqlite3_give_the_same_table(tmp_path, monkeypatch):
    import os

    import xsp.io.nsys_export as nsys

    if nsys.SQLITE_COLUMNS is None:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.io._sqlite is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.io._sqlite is not built here")
    reader = nsys.SQLITE_COLUMNS
    path = make_export(tmp_path / "report.sqlite")
    in_c = load_nsys(path).spans
    monkeypatch.setattr(nsys, "SQLITE_COLUMNS", None)
    in_python = load_nsys(path).spans
    same = [c for c in in_c.columns if c not in (col.TRACE_ID, col.SPAN_ID, col.PARENT_ID)]
    pd.testing.assert_frame_equal(in_c[same], in_python[same])

    class Failing:  # a read that fails on its thread is read again through Python
        @staticmethod
        def read_floats(uri: str, query: str) -> tuple[bytearray, int]:
            if "NVTX" in query:
                raise OSError("SQLite: disk I/O error")
            return reader.read_floats(uri, query)

    monkeypatch.setattr(nsys, "SQLITE_COLUMNS", Failing)
    pd.testing.assert_frame_equal(load_nsys(path).spans[same], in_python[same])
    buffer, columns = reader.read_floats(f"{path.resolve().as_uri()}?mode=ro",
                                         "select start, end, textId from NVTX_EVENTS")
    assert columns == 3 and len(buffer) % 24 == 0
    with pytest.raises(OSError, match="no such table"):
        reader.read_floats(f"{path.resolve().as_uri()}?mode=ro", "select x from nowhere")


def test_rows_with_impossible_times_are_left_out_counted_and_said(tmp_path, recwarn):
    """A kernel that ends before it starts, a call before 1970, a range ending past 2116: each
    left out and counted (as the Kineto import does), never a span no recording can hold."""
    path = make_export(tmp_path / "report.sqlite")
    connection = sqlite3.connect(path)
    connection.execute("update CUPTI_ACTIVITY_KIND_KERNEL set end = start - 1000")
    connection.execute("update CUPTI_ACTIVITY_KIND_RUNTIME set start = -5000000000000000000 where correlationId = 103")
    connection.execute("update NVTX_EVENTS set end = 9223372036854775807 where text = 'checkpoint'")
    connection.commit()
    connection.close()
    trace = xsp.load(path)
    names = set(trace.spans[col.NAME])
    assert "void gemm<float>(float*, int)" not in names and "cuCtxSynchronize" not in names
    assert "checkpoint" not in names and "step" in names
    assert trace.metadata["dropped"] == {
        "Nsight Systems CUPTI_ACTIVITY_KIND_KERNEL rows with impossible times": 1,
        "Nsight Systems CUPTI_ACTIVITY_KIND_RUNTIME rows with impossible times": 1,
        "Nsight Systems NVTX_EVENTS rows with impossible times": 1}
    said = [str(w.message) for w in recwarn.list]
    assert any("were left out" in text for text in said)
    assert not any("invalid value" in text for text in said)  # no numpy cast warning leaks out
    assert (trace.spans[col.END_NS] >= trace.spans[col.START_NS]).all()


def test_exports_in_a_folder_are_runs_of_a_diff_and_summarized_beside_themselves(tmp_path):
    from xsp.cli.summary import default_output

    sides = [tmp_path / "base", tmp_path / "new"]
    for side in sides:
        side.mkdir()
        make_export(side / "run.sqlite")
    found = xsp.diff(*sides)
    assert len(found.table) and set(found.table["new_count"]) == set(found.table["base_count"])
    summary = default_output(str(tmp_path / "run.sqlite"), ".xsp-summary.parquet")
    assert summary == str(tmp_path / "run.xsp-summary.parquet")


@pytest.mark.parametrize("table, said", [
    ("TARGET_INFO_SESSION_START_TIME", "no session start time"),
    ("StringIds", "no StringIds table: the names its NVTX_EVENTS, CUPTI_ACTIVITY_KIND_RUNTIME")])
def test_an_export_lacking_what_the_table_needs_says_so(tmp_path, table, said):
    path = make_export(tmp_path / "report.sqlite")
    with sqlite3.connect(path) as connection:
        connection.execute(f"delete from {table}")
    with pytest.warns(xsp.XspWarning, match=said):
        trace = load_nsys(path)
    assert len(trace.spans) and any(said in lack for lack in trace.metadata["nsys"]["lacking"])
    assert not load_nsys(make_export(tmp_path / "whole.sqlite")).metadata["nsys"]["lacking"]


def test_nvtx_texts_are_the_same_however_many_distinct_ones_there_are(tmp_path):
    """A few distinct texts are read in C as numbers; more than MAX_CODED_TEXTS, through Python."""
    import xsp.io.nsys_export as nsys

    for count in (3, nsys.MAX_CODED_TEXTS + 6):
        path = make_export(tmp_path / f"report{count}.sqlite")
        with sqlite3.connect(path) as connection:
            connection.executemany("insert into NVTX_EVENTS values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
                (30_000 + 10 * i, 30_005 + 10 * i, NVTX_PUSH_POP, None, None, None, f"range {i % count} ✓",
                 GLOBAL_TID, None, None, 0) for i in range(2 * count)])
        spans = load_nsys(path).spans
        names = set(spans.loc[spans[col.START_NS] >= EPOCH_NS + 30_000, col.NAME])
        assert names == {f"range {i} ✓" for i in range(count)}, count


def test_an_export_without_steps_is_measured_against_its_own_time_and_an_empty_one_is_one_error(tmp_path):
    """No step in an export: a finding's share is of the trace's time, never of 'step time'."""
    from xsp.analysis import recommend
    from xsp.reports.advice import recommendation_lines

    trace = load_nsys(make_export(tmp_path / "report.sqlite"))
    table = recommend(trace)
    if len(trace.steps) == 0 and len(table):
        text = "\n".join(recommendation_lines(table))
        assert "step time" not in text and "of the trace's time at stake" in text
    (tmp_path / "empty.sqlite").write_bytes(b"")
    with pytest.raises(TraceFormatError, match="not an SQLite file"):
        xsp.load(tmp_path / "empty.sqlite")


def test_the_real_export_has_no_steps_and_its_findings_say_of_what(shared_traces):
    from xsp.analysis import recommend
    from xsp.reports.advice import recommendation_lines

    table = recommend(xsp.load(shared_traces / "nsys" / "saxpy_mpi_cuda_rank0.sqlite"))
    text = "\n".join(recommendation_lines(table))
    assert len(table) and "step time" not in text and "of the trace's time" in text
    assert "e+" not in text
