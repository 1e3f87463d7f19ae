"""Importing Kineto traces a window at a time (xsp.io.kineto_stream): the same spans, tree and
metadata as the in-memory import, on every shared trace, however small the windows."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest

import xsp
from xsp.core import schema as col
from xsp.io import memory_needed
from xsp.io.kineto_stream import import_kineto
from xsp.io.memory_needed import inflated_bytes, kineto_memory_bytes
from xsp.table.equality import PARENT_PLACE, span_differences, structural_form

SHARED = ["a100_alexnet", "a100_cupti_counters", "a100_event_sync_multistream", "a100_nccl_rank0", "a100_triton",
          "cpu_only_rank34", "sampled_rank0", "v100_2rank_train_rank1"]
# what the file says of where it came from, and the ids drawn at random, differ by design
_NOT_COMPARED = {"imported_from"}


@pytest.fixture(scope="module")
def in_memory(shared_traces):
    return {name: xsp.load(shared_traces / "kineto" / f"{name}.json.gz") for name in SHARED}


@pytest.mark.parametrize("window_events", [1, pytest.param(5000, marks=pytest.mark.heavy), 1 << 30])
@pytest.mark.parametrize("name", SHARED)
def test_a_trace_imported_in_windows_is_the_one_imported_whole(shared_traces, in_memory, tmp_path, name,
                                                               window_events):
    output = tmp_path / f"{name}.xsp.parquet"
    imported = import_kineto(shared_traces / "kineto" / f"{name}.json.gz", output, window_events=window_events)
    whole = in_memory[name]
    streamed = xsp.load(output)
    assert span_differences(whole.spans, streamed.spans) == []
    assert {k: v for k, v in streamed.metadata.items() if k not in _NOT_COMPARED} == {
        k: v for k, v in whole.metadata.items() if k not in _NOT_COMPARED}
    assert imported.bounded and imported.spans == len(whole.spans) and imported.steps == len(whole.steps)
    if window_events == 1 and name in ("v100_2rank_train_rank1", "a100_nccl_rank0", "cpu_only_rank34"):
        assert imported.windows > 2  # it was cut: the test is of windows, not of one
    assert imported.largest_window_events <= imported.events
    starts = streamed.spans[col.START_NS].to_numpy()
    assert (np.diff(starts) >= 0).all()  # in start order across windows, late kernels included
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".xsp-import-")]  # scratch removed


def test_plain_json_is_streamed_as_gzip_is(shared_traces, tmp_path):
    plain = tmp_path / "trace.json"
    with gzip.open(shared_traces / "kineto" / "a100_nccl_rank0.json.gz") as source, open(plain, "wb") as target:
        shutil.copyfileobj(source, target)
    output = tmp_path / "plain.xsp.parquet"
    imported = import_kineto(plain, output, window_events=2000)
    whole = xsp.load(shared_traces / "kineto" / "a100_nccl_rank0.json.gz")
    assert imported.windows > 1
    assert span_differences(whole.spans, xsp.load(output).spans) == []


def _flow_only_trace(path):
    """A kernel whose correlation id only an ac2g flow gives (old traces): msgspec's reader's file."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 10, "dur": 5,
         "args": {"correlation": 7}},
        {"ph": "s", "cat": "ac2g", "id": 7, "pid": 1, "tid": 1, "ts": 10, "name": "ac2g"},
        {"ph": "f", "cat": "ac2g", "id": 7, "pid": 0, "tid": 7, "ts": 50, "name": "ac2g", "bp": "e"},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 50, "dur": 20,
         "args": {"device": 0, "stream": 7}},
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_a_file_the_scanner_leaves_to_msgspec_is_imported_whole_and_said(tmp_path):
    source = _flow_only_trace(tmp_path / "old.json")
    imported = import_kineto(source, tmp_path / "old.xsp.parquet")
    assert not imported.bounded
    spans = xsp.load(tmp_path / "old.xsp.parquet").spans
    assert span_differences(xsp.load(source).spans, spans) == []
    assert imported.metadata["hierarchy"]["launched"] == 1


def test_the_comparison_sees_a_parent_moved(in_memory):
    spans = in_memory["v100_2rank_train_rank1"].spans
    moved = spans.copy()
    child = int(np.flatnonzero(moved[col.PARENT_ID].notna().to_numpy())[100])
    moved.loc[child, col.PARENT_ID] = moved.loc[0, col.SPAN_ID] if child else moved.loc[1, col.SPAN_ID]
    differences = span_differences(spans, moved)
    assert len(differences) == 1 and differences[0].startswith(PARENT_PLACE)
    renamed = spans.copy()
    renamed[col.SPAN_ID] = renamed[col.SPAN_ID] + 1
    renamed[col.PARENT_ID] = renamed[col.PARENT_ID] + 1  # the same tree under other ids
    assert span_differences(spans, renamed) == []
    assert (structural_form(spans)[PARENT_PLACE] >= -1).all()


def test_an_unwritable_output_is_one_error(shared_traces, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(xsp.XspError, match="cannot write"):
        import_kineto(shared_traces / "kineto" / "a100_triton.json.gz", blocker / "sub" / "t.xsp.parquet")


def test_a_gzip_trace_s_inflated_size_is_read_from_its_trailer(shared_traces):
    source = shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz"
    with gzip.open(source) as file:
        assert inflated_bytes(source) == len(file.read())


@pytest.fixture
def little_free_memory(monkeypatch):
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 20)


def test_a_trace_larger_than_free_memory_is_refused_in_one_line(shared_traces, tmp_path, little_free_memory):
    source = shared_traces / "kineto" / "a100_nccl_rank0.json.gz"
    with pytest.raises(xsp.TraceTooLargeError) as refused:
        xsp.load(source)
    message = str(refused.value)
    assert "\n" not in message and "is free" in message and f"xsp import {source}" in message
    output = tmp_path / "nccl.xsp.parquet"
    import_kineto(source, output)  # a window at a time: no such check
    with pytest.raises(xsp.TraceTooLargeError, match="DuckDB"):
        xsp.load(output)


def test_the_cli_says_a_trace_is_too_large_in_one_line(shared_traces, little_free_memory, capsys):
    from xsp.cli.main import main

    code = main(["summary", str(shared_traces / "kineto" / "a100_nccl_rank0.json.gz")])
    error = capsys.readouterr().err.strip()
    assert code != 0 and len(error.splitlines()) == 1 and "too large to load whole" in error


def test_a_trace_is_loaded_exactly_when_it_fits(shared_traces, monkeypatch):
    source = shared_traces / "kineto" / "a100_triton.json.gz"
    room = kineto_memory_bytes(source) / memory_needed.HEADROOM  # the free memory a load counts on
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: int(room) - 1)
    with pytest.raises(xsp.TraceTooLargeError):
        xsp.load(source)
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: int(room) + 1)
    assert len(xsp.load(source).spans) == 7


def test_a_small_gzip_trace_is_not_taken_for_a_wrapped_size(tmp_path):
    source = tmp_path / "tiny.json.gz"
    text = b'{"traceEvents": []}'
    source.write_bytes(gzip.compress(text))
    # not 4 GiB more, though it inflates less than 3 times (3 times its file at least: a file of several
    # members' trailer gives its last member's size)
    assert inflated_bytes(source) == 3 * source.stat().st_size


def test_xsp_import_says_when_a_file_was_read_whole(tmp_path, capsys):
    from xsp.cli.main import main

    source = _flow_only_trace(tmp_path / "old.json")
    assert main(["import", str(source), "-o", str(tmp_path / "old.xsp.parquet")]) == 0
    error = capsys.readouterr().err
    assert "was read whole, not a window at a time" in error and "3 spans" in error


def test_xsp_import_says_how_many_events_a_step_held(shared_traces, tmp_path, capsys, monkeypatch):
    from xsp.cli import import_
    from xsp.cli.main import main

    source = shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz"
    assert main(["import", str(source), "-o", str(tmp_path / "a.xsp.parquet")]) == 0
    assert "held at once" not in capsys.readouterr().err  # 123,378 events: one window, under the bound
    monkeypatch.setattr(import_, "HELD_WHOLE_EVENTS", 1000)
    assert main(["import", str(source), "-o", str(tmp_path / "b.xsp.parquet")]) == 0
    assert "123,378 events were held at once" in capsys.readouterr().err


@pytest.fixture
def signal_handlers_kept():
    """The test's own SIGINT, SIGTERM and SIGHUP handlers, as they were before it (an interrupted
    import leaves them ignored: its process is ending)."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("became", [None, RuntimeError], ids=["swallowed", "became another error"])
def test_a_signal_a_library_swallows_still_ends_the_import(shared_traces, tmp_path, capsys, monkeypatch, became,
                                                           signal_handlers_kept):
    import os
    import signal

    from xsp.cli.main import main
    from xsp.core.errors import INTERRUPTED
    from xsp.io import kineto_stream

    def swallowing(source, output):  # as DuckDB or a finalizer may: the KeyboardInterrupt never comes out
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            if became is not None:
                raise became("Query interrupted") from None
        os.kill(os.getpid(), signal.SIGINT)  # a second signal, while it finishes: ignored
        return import_kineto(source, output)

    monkeypatch.setattr(kineto_stream, "import_kineto", swallowing)
    output = tmp_path / "a.xsp.parquet"
    source = shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz"
    assert main(["import", str(source), "-o", str(output)]) == INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == "xsp: interrupted"
    assert not output.exists() and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a late SIGINT cannot kill it as it exits


def _write(path, events, **fields):
    path.write_text(json.dumps({"traceEvents": events, **fields}))
    return path


def _imported_both_ways(source, tmp_path, window_events=1):
    output = tmp_path / (source.name + ".xsp.parquet")
    imported = import_kineto(source, output, window_events=window_events)
    return xsp.load(source), xsp.load(output), imported


@pytest.mark.parametrize("events", [[], [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
                                          "args": {"name": "main"}}]], ids=["empty", "metadata only"])
def test_a_trace_without_spans_imports_as_the_whole_import_does(tmp_path, events):
    whole, streamed, imported = _imported_both_ways(_write(tmp_path / "none.json", events), tmp_path)
    assert len(streamed.spans) == len(whole.spans) == 0 and imported.spans == 0
    assert {k: v for k, v in streamed.metadata.items() if k not in _NOT_COMPARED} == {
        k: v for k, v in whole.metadata.items() if k not in _NOT_COMPARED}


def test_an_output_folder_with_a_quote_in_its_name_is_no_sql(shared_traces, tmp_path):
    folder = tmp_path / "o'brien"
    folder.mkdir()
    imported = import_kineto(shared_traces / "kineto" / "cpu_only_rank34.json.gz", folder / "t.xsp.parquet",
                             window_events=1)
    assert imported.windows > 2 and len(xsp.load(folder / "t.xsp.parquet").spans) == 15


def _op(name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            **({"args": args} if args else {})}


def _step(number, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 1, "tid": 1, "ts": ts,
            "dur": dur}


def test_loose_roots_many_windows_apart_are_counted_on(tmp_path):
    # a root on a thread with no step, then three steps (each a window), then the same root again:
    # its path's count goes on from the first, as in the whole import (foo[1], not foo[0])
    events = [_op("foo", 0, 10, tid=2)]
    for number in range(3):
        events += [_step(number, 100 + 100 * number, 50), _op("aten::mm", 110 + 100 * number, 10)]
    events.append(_op("foo", 500, 10, tid=2))
    whole, streamed, imported = _imported_both_ways(_write(tmp_path / "loose.json", events), tmp_path)
    assert imported.windows >= 4
    assert span_differences(whole.spans, streamed.spans) == []
    assert sorted(streamed.spans[streamed.spans[col.NAME] == "foo"][col.PATH]) == ["foo[0]", "foo[1]"]


def _launch(ts, correlation, dur=5):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}


def _kernel(ts, correlation):
    return {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": ts, "dur": 20,
            "args": {"device": 0, "stream": 7, "correlation": correlation}}


def test_a_launch_with_impossible_times_does_not_pull_its_kernel_out_of_its_step(tmp_path):
    events = [_step(0, 0, 50), _launch(10, 1, dur=-1), _step(1, 100, 50), _op("aten::mm", 110, 10),
              _kernel(120, 1)]
    whole, streamed, _ = _imported_both_ways(_write(tmp_path / "negative.json", events), tmp_path)
    assert span_differences(whole.spans, streamed.spans) == []
    assert whole.metadata["hierarchy"]["launch_missing"] == streamed.metadata["hierarchy"]["launch_missing"] == 1


def test_launches_sharing_a_correlation_id_stay_in_one_window(tmp_path):
    events = [_step(0, 0, 50), _launch(10, 1), _step(1, 100, 50), _launch(110, 1), _kernel(120, 1),
              _step(2, 200, 50), _op("aten::mm", 210, 10)]
    whole, streamed, imported = _imported_both_ways(_write(tmp_path / "twice.json", events), tmp_path)
    assert imported.windows == 2  # the cut between the two launches is not taken
    assert span_differences(whole.spans, streamed.spans) == []
    assert streamed.metadata["hierarchy"]["duplicate_correlation"] == 1


def test_the_rank_column_is_written_as_saving_the_whole_import_writes_it(shared_traces, tmp_path):
    source = shared_traces / "kineto" / "cpu_only_rank34.json.gz"
    import_kineto(source, tmp_path / "windows.xsp.parquet", window_events=1)
    xsp.load(source).save(tmp_path / "whole.xsp.parquet")
    import pyarrow.parquet as pq

    written = pq.read_table(tmp_path / "windows.xsp.parquet", columns=[col.RANK])[col.RANK].to_pylist()
    assert written == pq.read_table(tmp_path / "whole.xsp.parquet", columns=[col.RANK])[col.RANK].to_pylist()
    assert set(written) == {34}


def test_a_container_s_memory_limit_bounds_the_free_memory(tmp_path, monkeypatch):
    limit, usage, stat = tmp_path / "memory.max", tmp_path / "memory.current", tmp_path / "memory.stat"
    limit.write_text(str(3 << 30))
    usage.write_text(str(2 << 30))
    stat.write_text(f"anon 1\ninactive_file {1 << 30}\n")  # page cache the kernel takes back counts as room
    monkeypatch.setattr(memory_needed, "CGROUP_FILES", ((str(limit), str(usage), str(stat), "inactive_file"),))
    assert memory_needed.free_memory_bytes() <= 2 << 30
    limit.write_text("max")
    assert memory_needed.free_memory_bytes() > 0  # no limit: the machine's figure
