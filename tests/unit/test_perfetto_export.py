"""xsp export --format perfetto: Perfetto's protobuf trace, read back with Perfetto's own message
definitions (the ``perfetto`` package), on hand-made spans and the real traces of ../shared."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict

import pandas as pd
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as protos

import xsp
from xsp.core import schema as col
from xsp.core.schema import SCHEMA_VERSION
from xsp.export import perfetto
from xsp.export.perfetto import write_perfetto, write_slices_in_python
from xsp.table.build import conform


def read(path) -> protos.Trace:
    trace = protos.Trace()
    trace.ParseFromString(path.read_bytes())
    return trace


def slices(trace: protos.Trace) -> tuple[dict[int, list[tuple[str, str, int, int]]], dict[int, str]]:
    """Each track's slices (name, category, start, end) as a nesting reader rebuilds them, and each
    track's name (a thread's, a stream's, a process's)."""
    names: dict[int, str] = {}
    categories: dict[int, str] = {}
    track_names: dict[int, str] = {}
    open_slices: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    found: dict[int, list[tuple[str, str, int, int]]] = defaultdict(list)
    for packet in trace.packet:
        if packet.HasField("interned_data"):
            names.update({entry.iid: entry.name for entry in packet.interned_data.event_names})
            categories.update({entry.iid: entry.name for entry in packet.interned_data.event_categories})
        if packet.HasField("track_descriptor"):
            descriptor = packet.track_descriptor
            track_names[descriptor.uuid] = (descriptor.thread.thread_name if descriptor.HasField("thread")
                                            else descriptor.process.process_name if descriptor.HasField("process")
                                            else descriptor.name)
        if packet.HasField("track_event"):
            event = packet.track_event
            assert packet.trusted_packet_sequence_id == perfetto.SEQUENCE_ID
            if event.type == protos.TrackEvent.TYPE_SLICE_BEGIN:
                open_slices[event.track_uuid].append((event.name_iid, event.category_iids[0], packet.timestamp))
            else:
                assert event.type == protos.TrackEvent.TYPE_SLICE_END
                name, category, start = open_slices[event.track_uuid].pop()
                assert packet.timestamp >= start
                found[event.track_uuid].append((names[name], categories[category], start, packet.timestamp))
    assert not any(open_slices.values())  # every slice closed
    return found, track_names


def hand_made() -> xsp.Trace:
    """Thread 7: a model call holding two layers, the second overlapping a third span that starts
    inside it and ends after it; thread 8: one operator; GPU 0 stream 3: two kernels."""
    rows = [  # id, parent, level, name, start, end, thread, device, stream
        (1, None, "model", "model", 100, 1_000, 7, None, None),
        (2, 1, "layer", "model.a", 110, 300, 7, None, None),
        (3, 1, "layer", "model.b", 300, 600, 7, None, None),
        (4, 1, "operator", "aten::mm", 500, 700, 7, None, None),  # in b, past its end
        (5, None, "operator", "aten::add", 150, 160, 8, None, None),
        (6, 4, "kernel", "gemm", 520, 580, None, 0, 3),
        (7, 4, "kernel", "gemm", 590, 610, None, 0, 3),
        (8, None, "system", "cpu", 100, 200, None, None, None),  # a sample: no slice
    ]
    spans = pd.DataFrame(rows, columns=[col.SPAN_ID, col.PARENT_ID, col.LEVEL, col.NAME, col.START_NS, col.END_NS,
                                        col.THREAD_ID, col.DEVICE_ID, col.STREAM_ID])
    spans[col.KIND] = spans[col.LEVEL].map({"model": "predict", "layer": "forward", "operator": "operator",
                                            "kernel": "kernel", "system": "counters"})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    spans[col.STEP] = 0
    spans = spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64", col.DEVICE_ID: "Int64",
                          col.STREAM_ID: "Int64"})
    return xsp.Trace(conform(spans), {"pid": 4242, "service_name": "svc", "threads": {"7": "MainThread"},
                                      "schema_version": SCHEMA_VERSION})


def test_spans_are_slices_on_their_threads_and_streams(tmp_path):
    path, written, cut = write_perfetto(hand_made(), tmp_path / "run.pftrace")
    assert written == 7  # the system sample is no slice
    found, track_names = slices(read(path))
    by_name = {track_names[uuid]: sorted(items, key=lambda s: (s[2], -s[3])) for uuid, items in found.items()}
    assert set(by_name) == {"MainThread", "thread 8", "stream 3"}
    assert by_name["MainThread"] == [("model", "model", 100, 1_000), ("model.a", "layer", 110, 300),
                                     ("model.b", "layer", 300, 600), ("aten::mm", "operator", 500, 600)]
    assert cut == 1  # aten::mm overlapped model.b without fitting in it: cut at its end
    assert by_name["stream 3"] == [("gemm", "kernel", 520, 580), ("gemm", "kernel", 590, 610)]
    processes = {name for name in track_names.values() if "(" in name or name.startswith("GPU")}
    assert processes == {"svc (4242)", "GPU 0"}


def test_the_c_and_the_python_encoder_write_the_same_bytes(tmp_path):
    if perfetto.ENCODER is None:
        pytest.skip("xsp's C extensions are not built here (XSP_PURE_PYTHON, or no compiler)")
    trace = hand_made()
    c_path, _, c_cut = write_perfetto(trace, tmp_path / "c.pftrace")
    python_path, _, python_cut = write_perfetto(trace, tmp_path / "python.pftrace",
                                                write_slices=write_slices_in_python)
    assert c_path.read_bytes() == python_path.read_bytes() and c_cut == python_cut == 1


def test_ranks_have_processes_of_their_own(tmp_path):
    spans = hand_made().spans
    two = pd.concat([spans.assign(**{col.RANK: 0}), spans.assign(**{col.RANK: 1})], ignore_index=True)
    two[col.SPAN_ID] = range(1, len(two) + 1)
    trace = xsp.Trace(conform(two.astype({col.RANK: "Int64"})), {"service_name": "job", "ranks": {
        "0": {"pid": 10, "service_name": "job"}, "1": {"pid": 11, "service_name": "job"}}})
    found, track_names = slices(read(write_perfetto(trace, tmp_path / "job.pftrace")[0]))
    assert {"job rank 0 (10)", "job rank 1 (11)", "rank 0 GPU 0", "rank 1 GPU 0"} <= set(track_names.values())
    assert sum(len(items) for items in found.values()) == 2 * 7


@pytest.mark.parametrize("name", ["a100_alexnet", "v100_2rank_train_rank1", "cpu_only_rank34"])
def test_every_span_of_a_real_trace_is_a_slice(shared_traces, tmp_path, name):
    trace = xsp.load(shared_traces / "kineto" / f"{name}.json.gz")
    path, _, cut = write_perfetto(trace, tmp_path / f"{name}.pftrace")
    found, track_names = slices(read(path))
    # threads named as the profiler named them, on the process it recorded (an imported trace is one rank's)
    thread_names = set(trace.thread_names().values())
    assert thread_names and thread_names <= set(track_names.values())
    assert not any(name.startswith("rank ") for name in track_names.values())
    spans = trace.spans[~trace.spans[col.LEVEL].isin(["system", "memory"])]
    assert Counter(name for items in found.values() for name, *_ in items) == Counter(spans[col.NAME].astype(str))
    # a slice keeps its span's start, and its end unless it was cut (counted)
    starts = Counter(start for items in found.values() for _, _, start, _ in items)
    assert starts == Counter(spans[col.START_NS].tolist())
    ends = Counter(end for items in found.values() for *_, end in items)
    assert sum((Counter(spans[col.END_NS].tolist()) - ends).values()) == cut
    assert path.stat().st_size < 80 * len(spans)


def test_the_cli_writes_it_and_says_how_many_spans_were_cut(tmp_path):
    source = hand_made().save(tmp_path / "run.xsp.parquet")
    out = tmp_path / "run.pftrace"
    done = subprocess.run([sys.executable, "-m", "xsp", "export", "--format", "perfetto", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == f"xsp: wrote 7 spans to {out} (1 cut at the end of a span they overlap on their " \
                                  "thread or stream)"
    assert sum(len(items) for items in slices(read(out))[0].values()) == 7


def test_a_chrome_file_too_large_for_the_ui_points_to_perfetto(tmp_path, monkeypatch, capsys):
    import argparse

    from xsp.cli import export

    source = hand_made().save(tmp_path / "run.xsp.parquet")
    monkeypatch.setattr(export, "LARGE_JSON_BYTES", 100)
    assert export.run(argparse.Namespace(file=str(source), output=str(tmp_path / "t.json"), format="chrome")) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "the Perfetto UI may fail to open JSON this large; --format perfetto" in said
    monkeypatch.setattr(export, "LARGE_JSON_BYTES", 2**30)
    assert export.run(argparse.Namespace(file=str(source), output=str(tmp_path / "u.json"), format="chrome")) == 0
    assert "--format perfetto" not in capsys.readouterr().err
