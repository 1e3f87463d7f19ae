"""Chrome trace-event JSON (chrome://tracing, Perfetto UI) from a span table."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pandas as pd

from xsp.analysis.memory import memory_timeline
from xsp.analysis.system import system_metrics
from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.export.processes import Processes
from xsp.io.outputs import write_output
from xsp.io.trace import Trace
from xsp.record.samples import is_sample

_ARG_COLUMNS = (col.LEVEL, col.KIND, col.STEP, col.PATH, col.MODULE_TYPE, col.INPUT_SHAPES,
                col.OUTPUT_SHAPES, col.PARAM_COUNT, col.CALL_DEPTH, col.EXEC_INDEX, col.SOURCE,
                col.CALL_FILE, col.CALL_LINE, col.CALL_FUNCTION,
                col.BATCH_SIZE, col.CORRELATION_ID, col.GRID, col.BLOCK, col.REGISTERS_PER_THREAD,
                col.SHARED_MEMORY_BYTES, col.BYTES, col.COPY_KIND, col.FLOPS, col.GRAPH_NODE_ID, col.STATUS,
                col.STATUS_MESSAGE)


def _metadata_event(kind: str, pid: Any, name: str, tid: Any = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


SPAN_CHUNK_ROWS: Final = 50_000
"""Spans turned into events, and encoded, at a time: memory stays bounded on traces of millions."""


def chrome_events(trace: Trace) -> dict[str, Any]:
    """``{"traceEvents": [...]}``: one complete ("X") event per span, times in µs.

    Host spans are placed on their process and thread (named as Python, or the imported
    profiler trace, named them); device spans (kernels) on a ``GPU <device>`` process with one
    track per stream. A trace of several ranks gives each rank its own processes
    (``<service> rank <r> (<pid>)``, ``rank <r> GPU <device>``). System samples become
    counter tracks (one per source and metric) and memory events instants, with a counter
    track of the live tensor memory per device.
    """
    events: list[dict[str, Any]] = []
    for chunk in _event_chunks(trace):
        events += chunk
    return {"traceEvents": events, **_document_fields(trace)}


def _origin(spans: pd.DataFrame) -> int:
    """The trace's first start (ns): the events' times are counted from it."""
    return int(spans[col.START_NS].min()) if len(spans) else 0


def _document_fields(trace: Trace) -> dict[str, Any]:
    return {"displayTimeUnit": "ns", "otherData": {"xsp_version": trace.metadata.get("xsp_version"),
                                                   "origin_epoch_ns": _origin(trace.spans)}}


def _event_chunks(trace: Trace) -> Iterator[list[dict[str, Any]]]:
    """:func:`chrome_events`' events, :data:`SPAN_CHUNK_ROWS` spans' worth at a time, then the
    memory, counter and naming events."""
    spans = trace.spans
    origin = _origin(spans)
    process = Processes.of(trace)
    several = process.several
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    timed = spans[~is_sample(spans) & (levels != Level.MEMORY.value)]
    threads: set[tuple[Any, int]] = set()
    gpus: set[tuple[Any, Any, Any]] = set()
    for first in range(0, len(timed), SPAN_CHUNK_ROWS):
        yield _span_events(timed.iloc[first:first + SPAN_CHUNK_ROWS], origin, process, several, threads, gpus)
    events: list[dict[str, Any]] = []
    for rank, part in ([(int(r), trace.for_rank(int(r))) for r in trace.ranks] if several else [(None, trace)]):
        memory_threads: set[int] = set()  # each rank's memory events and system samples, in its process
        events += _memory_events(part, origin, process.host(rank), memory_threads)
        events += _counter_events(part, origin, process.host(rank))
        threads |= {(rank, thread) for thread in memory_threads}
    names = trace.thread_names()
    for rank in sorted({rank for rank, _ in threads} | {rank for rank, _, _ in gpus}, key=lambda r: (r is None, r)):
        events.append(_metadata_event("process_name", process.host(rank), process.host_name(rank)))
        if rank is not None:
            events.append({"name": "process_sort_index", "ph": "M", "pid": process.host(rank),
                           "args": {"sort_index": int(rank)}})
    for rank, thread in sorted(threads, key=lambda item: (item[0] is None, item[0] or 0, item[1])):
        name = names.get((rank, thread), f"thread {thread}")
        events.append(_metadata_event("thread_name", process.host(rank), name, thread))
    for rank, device in sorted({(rank, device) for rank, device, _ in gpus}, key=str):
        events.append(_metadata_event("process_name", process.gpu(rank, device), process.gpu(rank, device)))
    for rank, device, stream in sorted(gpus, key=str):
        events.append(_metadata_event("thread_name", process.gpu(rank, device), f"stream {stream}", f"stream {stream}"))
    yield events


def _values(column: pd.Series) -> list[Any]:
    """The column as plain Python values, ``None`` where it is empty."""
    values = column.tolist()
    missing = column.isna().to_numpy()
    if missing.any():
        for position in np.flatnonzero(missing).tolist():
            values[position] = None
    return values


def _span_events(spans: pd.DataFrame, origin: int, process: Processes, several: bool,
                 threads: set[tuple[Any, int]], gpus: set[tuple[Any, Any, Any]]) -> list[dict[str, Any]]:
    """One "X" event per span of ``spans``; adds the threads and GPU streams they are on."""
    count = len(spans)
    thread_ids = _values(spans[col.THREAD_ID])
    device_ids = _values(spans[col.DEVICE_ID])
    stream_ids = _values(spans[col.STREAM_ID])
    rank_values = _values(spans[col.RANK]) if several and col.RANK in spans else [None] * count
    on_device = (spans[col.THREAD_ID].isna() & spans[col.DEVICE_ID].notna()).to_numpy().tolist()
    pids: list[Any] = []
    tids: list[Any] = []
    for device, stream, thread, rank, device_side in zip(device_ids, stream_ids, thread_ids, rank_values, on_device):
        if device_side:
            gpus.add((rank, device, stream))
            pids.append(process.gpu(rank, device))
            tids.append(f"stream {stream}")
        else:
            thread = int(thread or 0)
            threads.add((rank, thread))
            pids.append(process.host(rank))
            tids.append(thread)
    # only the columns that hold something in this chunk; each row keeps its non-empty values
    filled = [(name, _values(spans[name])) for name in _ARG_COLUMNS if name in spans and spans[name].notna().any()]
    arg_names = [name for name, _ in filled]
    arg_rows = zip(*(values for _, values in filled)) if filled else iter([()] * count)
    attributes = _values(spans[col.ATTRIBUTES]) if col.ATTRIBUTES in spans else [None] * count
    starts = ((spans[col.START_NS].to_numpy(dtype=np.int64) - origin) / 1e3).tolist()
    durations = (spans[col.DURATION_NS].to_numpy(dtype=np.int64) / 1e3).tolist()
    events = []
    for name, level, start, duration, pid, tid, arg_values, extra in zip(
            _values(spans[col.NAME]), _values(spans[col.LEVEL]), starts, durations, pids, tids, arg_rows, attributes):
        args = {key: value for key, value in zip(arg_names, arg_values) if value is not None}
        if extra:
            args.update(_decode_attributes(extra))
        events.append({"name": name, "cat": level, "ph": "X", "ts": start, "dur": duration, "pid": pid, "tid": tid,
                       "args": args})
    return events


_decode_attributes = msgspec.json.Decoder(dict).decode


def _memory_events(trace: Trace, origin: int, pid: int, threads: set[int]) -> list[dict[str, Any]]:
    """Each allocation and free as an instant on its thread, and the live memory per device as
    a counter track."""
    spans = trace.spans
    memory = spans[spans[col.LEVEL] == Level.MEMORY.value]
    events: list[dict[str, Any]] = []
    for name, start, thread, size in zip(memory[col.NAME].tolist(), memory[col.START_NS].tolist(),
                                         memory[col.THREAD_ID].astype("Int64").tolist(),
                                         memory[col.BYTES].astype("Int64").tolist()):
        tid = 0 if thread is None or thread is pd.NA else int(thread)
        threads.add(tid)
        events.append({"name": name, "cat": Level.MEMORY.value, "ph": "i", "s": "t", "pid": pid, "tid": tid,
                       "ts": (int(start) - origin) / 1e3, "args": {"bytes": None if size is pd.NA else int(size)}})
    timeline = memory_timeline(spans)
    for device, time_ns, live in zip(timeline["device"].tolist(), timeline["time_ns"].tolist(),
                                     timeline["live_bytes"].tolist()):
        events.append({"name": f"live tensor memory ({device})", "ph": "C", "pid": pid,
                       "ts": (int(time_ns) - origin) / 1e3, "args": {"bytes": int(live)}})
    return events


def _counter_events(trace: Trace, origin: int, pid: int) -> list[dict[str, Any]]:
    """The system level's samples as counter tracks: one per device and metric."""
    metrics = system_metrics(trace)
    return [{"name": f"{device} {metric} ({unit})", "ph": "C", "pid": pid, "ts": (int(time_ns) - origin) / 1e3,
             "args": {metric: float(value)}}
            for time_ns, device, metric, value, unit in zip(metrics["time_ns"].tolist(), metrics["device"].tolist(),
                                                            metrics["metric"].tolist(), metrics["value"].tolist(),
                                                            metrics["unit"].tolist())]


def write_chrome(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as Chrome/Perfetto JSON, atomically.

    Raises:
        xsp.io.outputs.OutputError: the file could not be written (nothing is left at ``path``).
    """
    document_fields = msgspec.json.encode(_document_fields(trace))

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as out:
            out.write(b'{"traceEvents":[')
            first = True
            for chunk in _event_chunks(trace):
                if not chunk:
                    continue
                if not first:
                    out.write(b",")
                out.write(encode(chunk)[1:-1])  # the list's items, without its brackets
                first = False
            out.write(b"],")
            out.write(document_fields[1:])  # the other fields, after the opening brace

    encode = msgspec.json.Encoder().encode
    return write_output(path, write)


__all__ = ["chrome_events", "write_chrome"]
