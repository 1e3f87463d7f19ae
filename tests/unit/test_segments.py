"""A session's windows on disk: segment files, and following them as they land."""
from __future__ import annotations

import threading

import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.io.segments import SegmentWriter, WindowsMoved, read_segment, segment_name, write_segment
from xsp.table.build import conform


def _window(start_ns: int, spans: int = 3) -> pd.DataFrame:
    return conform(pd.DataFrame({
        col.TRACE_ID: ["0" * 32] * spans, col.SPAN_ID: range(start_ns + 1, start_ns + 1 + spans),
        col.LEVEL: [col.Level.LAYER.value] * spans, col.KIND: [col.SpanKind.FORWARD.value] * spans,
        col.NAME: [f"layer{i}" for i in range(spans)], col.START_NS: range(start_ns, start_ns + spans),
        col.END_NS: range(start_ns + 1, start_ns + 1 + spans), col.DURATION_NS: [1] * spans,
        col.STATUS: [col.Status.OK.value] * spans}))


def test_a_segment_reads_back_and_any_damage_is_refused(tmp_path):
    from xsp.io.parquet import arrow_table

    table = arrow_table(_window(0))
    path = tmp_path / segment_name(1)
    write_segment(table, path)
    assert read_segment(path).equals(table)
    data = path.read_bytes()
    for damaged in (data[:len(data) // 2], data[:20] + bytes([data[20] ^ 1]) + data[21:], data[:-8]):
        path.write_bytes(damaged)
        with pytest.raises(xsp.TraceFormatError, match="damaged"):
            read_segment(path)


def test_following_reads_each_window_as_it_lands_until_the_last(tmp_path):
    segments = SegmentWriter(tmp_path / "run.xsp.parquet")
    segments.start({})
    done, cancelled = threading.Event(), threading.Event()
    read: list[int] = []
    follower = threading.Thread(target=lambda: read.extend(
        table.column(col.START_NS)[0].as_py() for table in segments.follow(done, cancelled)))
    follower.start()
    for window in range(4):
        segments.write(_window(window * 100))
    done.set()
    follower.join(timeout=30)
    assert read == [0, 100, 200, 300]


def test_following_gives_up_when_windows_leave_the_folder_or_it_is_cancelled(tmp_path):
    segments = SegmentWriter(tmp_path / "run.xsp.parquet")
    segments.start({})
    segments.write(_window(0))
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(WindowsMoved):
        list(segments.follow(threading.Event(), cancelled))
    done = threading.Event()
    done.set()  # a cancel wakes the follower through `done` too: it still gives up, never ends as if complete
    with pytest.raises(WindowsMoved):
        list(SegmentWriter(tmp_path / "other.xsp.parquet").follow(done, cancelled))
    segments.keep([])  # a helper said its window could not be written to the folder
    with pytest.raises(WindowsMoved):
        list(segments.follow(threading.Event(), threading.Event()))
