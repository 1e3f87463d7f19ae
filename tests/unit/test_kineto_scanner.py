"""The C Kineto scanner (xsp.io._kineto) against the msgspec reader it accelerates.

Both readers make the same event columns; these tests hold the scanner to the rows and metadata
the msgspec reader gives, on the real traces and on hand-made files with every odd thing JSON
and Kineto allow, read in pieces cut at every byte; and they check that whatever the scanner
leaves to msgspec (flows standing in for correlation ids, string pids, truncated or invalid
files) still loads, or fails, as it did. Skipped where the scanner is not built, a failure under
XSP_REQUIRE_HOTPATH (CI).
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
from pathlib import Path

import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.io import kineto, kineto_events, kineto_json
from xsp.io.kineto_events import decoded_events, scanned_events


@pytest.fixture(autouse=True)
def scanner_built(monkeypatch):
    monkeypatch.delenv("XSP_PURE_PYTHON", raising=False)
    try:
        importlib.import_module("xsp.io._kineto")
    except ImportError:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.io._kineto is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.io._kineto is not built")


def _scanned(path: Path):
    return scanned_events(path, kineto.CATEGORY_NAMES, kineto.LAUNCH_LINKED, kineto.DEVICE_CATEGORIES)


def _decoded(path: Path):
    return decoded_events(kineto.decode(path), kineto.CATEGORY_NAMES, kineto.LAUNCH_LINKED,
                          kineto.DEVICE_CATEGORIES)


def assert_same_rows(path: Path) -> pd.DataFrame:
    scanned = _scanned(path)
    assert scanned is not None, "the scanner left the file to msgspec"
    rows, metadata = kineto.kineto_rows(scanned)
    expected_rows, expected_metadata = kineto.kineto_rows(_decoded(path))
    pd.testing.assert_frame_equal(rows, expected_rows)
    assert metadata == expected_metadata
    return rows


@pytest.mark.parametrize("name", [  # the largest trace (54 MB of JSON) in the heavy suite
    pytest.param("v100_2rank_train_rank1", marks=pytest.mark.heavy), "a100_alexnet", "a100_nccl_rank0",
    "a100_triton", "a100_event_sync_multistream",
    "sampled_rank0", "cpu_only_rank34", "a100_cupti_counters"])
def test_real_traces_read_the_same_by_both_readers(shared_traces, name):
    rows = assert_same_rows(shared_traces / "kineto" / f"{name}.json.gz")
    assert len(rows)


ODD_EVENTS = [
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "main \"loop\" \u00e9 \U0001F600"}},
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python", "other": [1, {"a": None}]}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm\n\t\\/\u00e9\U0001F600", "pid": 1, "tid": 7, "ts": 10.5, "dur": 2.25,
     "args": {"Input Dims": [[2, 3], [3, 4]], "Sequence number": 5, "External id": 1,
              "nested": {"k": [1.5e3, -2, True, False, None, "x}y]"]}}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 1, "tid": 7, "ts": 10.5, "dur": 0,
     "args": {"Input Dims": [], "Sequence number": 7.0}},
    {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 11, "dur": 1,
     "args": {"correlation": 5, "cbid": 211}},
    {"ph": "X", "cat": "Kernel", "name": "sgemm", "pid": 0, "tid": 3, "ts": 12.001, "dur": 4e0,
     "args": {"correlation": 5.0, "device": 0, "stream": None, "grid": [4, 1, 1], "block": [128, 1, 1],
              "registers per thread": 32, "shared memory": True, "bytes": 1.5}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 3, "ts": 20,
     "dur": 1, "args": {"correlation": 6, "bytes": 4096, "device": 1, "stream": 9}},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 7, "ts": 19, "dur": 3,
     "args": {"correlation": 6}},
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 7, "ts": 9, "dur": 30},
    {"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
     "pid": 1, "tid": 7, "ts": 9.5, "dur": 0.25},
    {"ph": "X", "cat": "python_function", "name": "nn.Module: Linear_0", "pid": 1, "tid": 7, "ts": 10, "dur": 5,
     "args": {}},
    {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler", "pid": 1, "tid": 7, "ts": 0, "dur": 100},
    {"ph": "X", "cat": "", "name": "nothing", "pid": 1, "tid": 7, "ts": 0, "dur": 1},
    {"ph": "X", "cat": "cpu_op", "name": "no duration", "pid": 1, "tid": 7, "ts": 1},
    {"ph": "X", "cat": "cpu_op", "name": "null start", "pid": 1, "tid": 7, "ts": None, "dur": 1},
    {"ph": "X", "cat": "cpu_op", "name": "negative", "pid": 1, "tid": 7, "ts": 30, "dur": -1},
    {"ph": "X", "cat": "cpu_op", "name": "huge", "pid": 1, "tid": 7, "ts": 1e300, "dur": 1},
    {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "pid": 1, "tid": 7, "ts": 5, "s": "t"},
    {"ph": "Z", "cat": "", "name": "from a newer tool", "pid": 1, "tid": 7, "ts": 6},
    {"ph": "", "cat": "", "name": "empty phase", "pid": 1, "tid": 7},
    {"ph": "s", "cat": "ac2g", "id": 5, "pid": 1, "tid": 7, "ts": 11, "bp": "e"},
    {"ph": "f", "cat": "ac2g", "id": 5, "pid": 0, "tid": 3, "ts": 12.001, "bp": "e"},
    {"ph": "X", "cat": "cuda_profiler_range", "name": "range", "pid": 0, "tid": 3, "ts": 40, "dur": 2,
     "args": {"smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 10, "correlation": 9}},
]


def _document(events, **top) -> dict:
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Fake GPU"}],
            "distributedInfo": {"rank": 2, "world_size": 4}, **top, "traceEvents": events,
            "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceName": "odd \u00e9"}


def _write(tmp_path: Path, document, name="odd.json", indent=None) -> Path:
    text = json.dumps(document, indent=indent, ensure_ascii=False).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    return path


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("name", ["odd.json", "odd.json.gz"])
def test_odd_but_valid_events_read_the_same(tmp_path, name, indent):
    rows = assert_same_rows(_write(tmp_path, _document(ODD_EVENTS), name, indent))
    assert rows[col.NAME].iloc[0] == "ProfilerStep#3"
    with pytest.warns(xsp.XspWarning, match="2 Kineto events with impossible times"):
        trace = xsp.load(tmp_path / name)
    assert trace.metadata["threads"] == {"7": "main \"loop\" \u00e9 \U0001F600"}
    assert trace.metadata["not_imported"] == {
        "ignored Trace events": 1, "ignored uncategorised events": 1, "missing_times": 2, "impossible_times": 2,
        "ignored cpu_instant_event events": 1, "ignored Z events": 1, "ignored unphased events": 1}
    kernel = trace.spans[trace.spans[col.KIND] == "kernel"].iloc[0]
    assert (kernel[col.CORRELATION_ID], kernel[col.DEVICE_ID], kernel[col.STREAM_ID]) == (5, 0, 3)
    assert kernel[col.GRID] == "[4,1,1]" and kernel[col.SHARED_MEMORY_BYTES] == 1 and pd.isna(kernel[col.BYTES])


def test_attributes_are_the_arguments_no_column_holds_as_compact_json(tmp_path):
    trace = xsp.load(_write(tmp_path, _document(ODD_EVENTS[2:4]), "args.json", indent=4))
    attributes = trace.spans[col.ATTRIBUTES].tolist()
    # the integers and shapes are in their columns; an empty shape and a float are kept as written
    assert json.loads(attributes[0]) == {"nested": ODD_EVENTS[2]["args"]["nested"]}
    assert attributes[1] == '{"Input Dims":[],"Sequence number":7.0}'
    assert '"x}y]"' in attributes[0] and "\n" not in attributes[0]
    first = trace.spans.iloc[0]
    assert (first[col.EXTERNAL_ID], first[col.SEQUENCE_NUMBER], first[col.INPUT_SHAPES]) == (1, 5, "[[2,3],[3,4]]")
    assert kineto.kineto_arguments(trace.spans) == [ODD_EVENTS[2]["args"], ODD_EVENTS[3]["args"]]


@pytest.mark.parametrize("piece_bytes", [1, 2, 3, 7, 64, 1000])
def test_pieces_cut_anywhere_read_the_same(tmp_path, monkeypatch, piece_bytes):
    path = _write(tmp_path, _document(ODD_EVENTS * 3), "odd.json.gz", indent=1)
    whole = kineto.kineto_rows(_scanned(path))
    monkeypatch.setattr(kineto_json, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(kineto_json, "READ_BYTES", piece_bytes)
    pieces = _scanned(path)
    assert pieces is not None
    rows, metadata = kineto.kineto_rows(pieces)
    pd.testing.assert_frame_equal(rows, whole[0])
    assert metadata == whole[1]


FLOW_ONLY = [  # an old trace: the kernel's correlation id is only on the flow between them
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 11, "dur": 1, "args": {}},
    {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 3, "ts": 12, "dur": 4, "args": {"device": 0}},
    {"ph": "s", "cat": "ac2g", "id": 42, "pid": 1, "tid": 7, "ts": 11},
    {"ph": "f", "cat": "ac2g", "id": 42, "pid": 0, "tid": 3, "ts": 12, "bp": "e"},
]


@pytest.mark.parametrize("events, why", [
    (FLOW_ONLY, "correlation ids only on flows"),
    ([{"ph": "X", "cat": "cpu_op", "name": "op", "pid": "host", "tid": 1, "ts": 1, "dur": 1}], "a string pid"),
    ([{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1,
       "args": {"Sequence number": "12"}}], "digits as a string"),
    ([{"ph": "X", "cat": "cpu_op", "n\\u0061me": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}], "an escaped key"),
    ([{"cat": "cpu_op", "name": "no phase", "pid": 1, "tid": 1, "ts": 7}], "no phase"),
])
def test_what_the_scanner_leaves_to_msgspec_loads_as_before(tmp_path, monkeypatch, events, why):
    path = tmp_path / "left.json"
    path.write_text(json.dumps({"traceEvents": events}).replace("n\\\\u0061me", "n\\u0061me"))
    assert _scanned(path) is None, why
    trace = xsp.load(path)
    monkeypatch.setenv("XSP_PURE_PYTHON", "1")
    expected = xsp.load(path)
    columns = [c for c in trace.spans.columns if c not in (col.SPAN_ID, col.PARENT_ID, col.TRACE_ID)]
    pd.testing.assert_frame_equal(trace.spans[columns], expected.spans[columns])
    if events is FLOW_ONLY:
        assert trace.spans[col.CORRELATION_ID].tolist() == [42, 42]


@pytest.mark.parametrize("text, message", [
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}',
     "truncated"),
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]} extra',
     "not valid"),
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, "tid": 1, "ts": 01, "dur": 1}]}',
     "not valid"),
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op\x01", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]}',
     "not valid"),
])
def test_broken_json_fails_as_it_did(tmp_path, monkeypatch, text, message):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(xsp.TraceFormatError, match=message):
        _scanned(path)  # by the scanner, where it meets the byte: not after msgspec read the whole file
    with pytest.raises(xsp.TraceFormatError, match=message):
        xsp.load(path)
    monkeypatch.setenv("XSP_PURE_PYTHON", "1")
    with pytest.raises(xsp.TraceFormatError, match=message):
        xsp.load(path)


def _counted_pieces(monkeypatch) -> list[int]:
    """The sizes of the pieces the scanner is handed, from now on."""
    sizes: list[int] = []
    pieces = kineto_json.inflated_pieces

    def counted(source):
        for piece in pieces(source):
            sizes.append(len(piece))
            yield piece

    monkeypatch.setattr(kineto_events, "inflated_pieces", counted)
    return sizes


@pytest.mark.parametrize("head", [
    b'{"traceEvents": [',
    # an event the scanner leaves to msgspec first: it goes on checking the JSON, reading no rows
    b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "n\\u0061me": "op", "pid": 1, "tid": 1, "ts": 1, "dur": 1}, ',
    b'{"deviceProperties": [',
])
@pytest.mark.parametrize("name", ["garbage.json", "garbage.json.gz"])
def test_garbage_is_refused_at_its_first_byte_without_reading_the_rest(tmp_path, monkeypatch, head, name):
    text = head + bytes(range(256)) * (16 << 10)  # 4 MiB that cannot be JSON
    path = tmp_path / name
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    monkeypatch.setattr(kineto_json, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(kineto_json, "_read_bytes", None)  # msgspec's whole-file read is never reached
    sizes = _counted_pieces(monkeypatch)
    with pytest.raises(xsp.TraceFormatError, match=rf"not valid Kineto JSON: invalid character \(byte {len(head)}\)"):
        xsp.load(path)
    assert sum(sizes) <= 5 * (64 << 10)  # a piece and those read ahead (one more on a busy machine), not the file


def test_a_value_that_never_ends_is_refused_past_the_cap(tmp_path, monkeypatch):
    path = tmp_path / "endless.json"
    path.write_bytes(b'{"traceEvents": [{"ph": "X", "name": "' + b"a" * (4 << 20))
    monkeypatch.setattr(kineto_json, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(kineto_events, "MAX_VALUE_BYTES", 1 << 20)
    sizes = _counted_pieces(monkeypatch)
    with pytest.raises(xsp.TraceFormatError, match="an event or field at byte 17 is longer than 1 MiB"):
        xsp.load(path)
    assert sum(sizes) <= (2 << 20) + (256 << 10)


@pytest.mark.parametrize("value_bytes, refused", [(900 << 10, False), (1536 << 10, True), (3 << 20, True)])
@pytest.mark.parametrize("followed", [False, True], ids=["last_event", "events_after"])
def test_a_value_longer_than_the_cap_is_refused_even_when_it_ends(tmp_path, monkeypatch, value_bytes, refused,
                                                                   followed):
    """docs/cli.md: a value longer than 256 MiB is refused as no trace's. A 300 MiB name that
    ended before the file did was imported (2.3 GB resident); here with a cap of 1 MiB."""
    event = b'{"ph": "X", "cat": "cpu_op", "name": "%s", "pid": 1, "tid": 1, "ts": %d, "dur": 1}'
    events = [event % (b"a" * value_bytes, 5)] + ([event % (b"b", 10), event % (b"c", 20)] if followed else [])
    path = tmp_path / "long_value.json"
    path.write_bytes(b'{"schemaVersion": 1, "traceEvents": [' + b", ".join(events) + b"]}")
    monkeypatch.setattr(kineto_json, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(kineto_events, "MAX_VALUE_BYTES", 1 << 20)
    if refused:
        with pytest.raises(xsp.TraceFormatError, match="is longer than 1 MiB"):
            xsp.load(path)
    else:
        assert len(xsp.load(path).spans) >= 1


def _deep_args_trace(tmp_path: Path, depth: int, events=(), name="deep.json") -> Path:
    """A trace with one event whose args nest ``depth`` levels (the args object is the first)."""
    deep = {"ph": "X", "cat": "cpu_op", "name": "deep", "pid": 1, "tid": 1, "ts": 5, "dur": 1, "args": "ARGS"}
    nested = '{"External id": 7, "deep": ' + '{"a": ' * (depth - 1) + "1" + "}" * (depth - 1) + "}"
    text = json.dumps(_document([*ODD_EVENTS[2:4], deep, *events]), ensure_ascii=False).replace('"ARGS"', nested)
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    return path


@pytest.mark.parametrize("depth, dropped", [(512, False), (513, True), (1000, True), (200_000, True)])
@pytest.mark.parametrize("left_to_msgspec", [False, True])
def test_arguments_nested_too_deeply_are_dropped_not_the_trace(tmp_path, depth, dropped, left_to_msgspec):
    path = _deep_args_trace(tmp_path, depth, FLOW_ONLY if left_to_msgspec else ())
    assert (_scanned(path) is None) == left_to_msgspec
    if dropped:
        with pytest.warns(xsp.XspWarning, match="1 Kineto events' arguments nested more than 512 levels") as caught:
            trace = xsp.load(path)
        assert len([w for w in caught if issubclass(w.category, xsp.XspWarning)]) == 1
        assert trace.metadata["not_imported"]["args_too_deep"] == 1
        assert trace.metadata["dropped"] == {"Kineto events' arguments nested more than 512 levels": 1}
    else:
        trace = xsp.load(path)
        assert "args_too_deep" not in trace.metadata["not_imported"]
    spans = trace.spans.set_index(col.NAME)
    assert pd.isna(spans.loc["deep", col.ATTRIBUTES]) == dropped
    assert spans.loc["aten::empty", col.ATTRIBUTES] == '{"Input Dims":[],"Sequence number":7.0}'
    if left_to_msgspec:
        assert trace.spans[trace.spans[col.KIND] == "kernel"][col.CORRELATION_ID].tolist() == [42]


@pytest.mark.parametrize("piece_bytes", [1, 7, 4096])
def test_dropped_arguments_are_counted_once_whatever_the_pieces(tmp_path, monkeypatch, piece_bytes):
    path = _deep_args_trace(tmp_path, 600, name="deep.json.gz")
    monkeypatch.setattr(kineto_json, "PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(kineto_json, "READ_BYTES", piece_bytes)
    events = _scanned(path)
    assert events is not None and events.counts["args_too_deep"] == 1
    assert kineto.kineto_rows(events)[1]["not_imported"]["args_too_deep"] == 1


def test_the_depth_cap_is_the_scanners(tmp_path):
    assert importlib.import_module("xsp.io._kineto").MAX_DEPTH == kineto_json.ARGS_MAX_DEPTH


@pytest.mark.parametrize("where", ["deviceProperties", "an event's other field"])
def test_values_nested_too_deeply_elsewhere_are_refused_in_one_line(tmp_path, where):
    deep = b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
    other = deep if where != "deviceProperties" else b"1"
    path = tmp_path / "deep.json"
    path.write_bytes(b'{"deviceProperties": [%s], "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op", "pid": 1, '
                     b'"tid": 1, "ts": 1, "dur": 1, "other": %s}]}' % (deep if where == "deviceProperties" else b"{}",
                                                                      other))
    with pytest.raises(xsp.TraceFormatError, match="nested too deeply"):
        xsp.load(path)


def test_a_gzip_bomb_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_json, "MIN_INFLATED_CAP_BYTES", 1 << 20)
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (8 << 20) + b"]}"))
    with pytest.raises(xsp.TraceFormatError, match="inflates to more than"):
        list(kineto_json.inflated_pieces(path))


@pytest.mark.parametrize("pure_python", [False, True])
def test_a_name_that_spells_another_spans_path_shares_its_category(tmp_path, monkeypatch, pure_python):
    """``x[0]/y`` at the top spells the path of ``y`` inside ``x``: one category for both, and
    the path categories stay distinct and sorted, as written by C or joined by Arrow."""
    if pure_python:
        monkeypatch.setenv("XSP_PURE_PYTHON", "1")
    annotation = {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 7}
    events = [{**annotation, "name": "x", "ts": 10, "dur": 10}, {**annotation, "name": "y", "ts": 12, "dur": 2},
              {**annotation, "name": "x[0]/y", "ts": 30, "dur": 2}, {**annotation, "name": "z", "ts": 40, "dur": 2}]
    spans = xsp.load(_write(tmp_path, _document(events), "spelt.json")).spans
    assert spans[col.PATH].astype(str).tolist() == ["x[0]", "x[0]/y[0]", "x[0]/y[0]", "z[0]"]
    categories = spans[col.PATH].cat.categories
    assert categories.is_unique and categories.is_monotonic_increasing and len(categories) == 3


@pytest.mark.parametrize("seed", range(4))
def test_path_categories_are_sorted_whatever_the_names(tmp_path, seed):
    """Paths sort as the tree walks them only where no name holds "/" or "[k]" and more: names
    that do are sorted as text instead; either way the categories are the paths, sorted, once."""
    import random

    chooser = random.Random(seed)
    names = ["a", "a[0] x", "a[0]", "b[1]c", "a[10]", "a.b", "a/b", "z"] if seed % 2 else ["a", "a.b", "ab", "z", "b"]
    annotation = {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 7}
    events, at = [], 0
    for _ in range(30):  # top-level spans, some holding a nested one and that one another
        depth = chooser.randrange(3)
        events += [{**annotation, "name": chooser.choice(names), "ts": at + level, "dur": 10 - 2 * level}
                   for level in range(depth + 1)]
        at += 20
    spans = xsp.load(_write(tmp_path, _document(events), "names.json")).spans
    paths = spans[col.PATH].astype(str)
    assert list(spans[col.PATH].cat.categories) == sorted(set(paths))
