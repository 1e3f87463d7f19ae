"""Chrome trace-event JSON (chrome://tracing, Perfetto UI) from a span table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from xsp import schema as col
from xsp.analysis.memory import memory_timeline
from xsp.analysis.system import system_metrics
from xsp.fileio import write_text_output
from xsp.schema import Level
from xsp.trace import Trace

_ARG_COLUMNS = (col.LEVEL, col.KIND, col.STEP, col.PATH, col.MODULE_TYPE, col.INPUT_SHAPES,
                col.OUTPUT_SHAPES, col.PARAM_COUNT, col.CALL_DEPTH, col.EXEC_INDEX, col.SOURCE,
                col.BATCH_SIZE, col.CORRELATION_ID, col.GRID, col.BLOCK, col.REGISTERS_PER_THREAD,
                col.SHARED_MEMORY_BYTES, col.BYTES, col.COPY_KIND, col.FLOPS, col.STATUS,
                col.STATUS_MESSAGE)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _metadata_event(kind: str, pid: Any, name: str, tid: Any = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        event["tid"] = tid
    return event


def chrome_events(trace: Trace) -> dict[str, Any]:
    """``{"traceEvents": [...]}``: one complete ("X") event per span, times in µs.

    Host spans are placed on their process and thread (named as Python named them); device
    spans (kernels) on a ``GPU <device>`` process with one track per stream. System samples
    become counter tracks (one per source and metric) and memory events instants, with a
    counter track of the live tensor memory per device.
    """
    spans = trace.spans
    meta = trace.metadata
    pid = int(meta.get("pid", 0))
    origin = int(spans[col.START_NS].min()) if len(spans) else 0
    events: list[dict[str, Any]] = []
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    timed = spans[(levels != Level.SYSTEM.value) & (levels != Level.MEMORY.value)]
    records = timed.astype(object).where(timed.notna(), None).to_dict("records")
    threads: set[int] = set()
    gpus: set[tuple[Any, Any]] = set()
    for row in records:
        on_device = row[col.THREAD_ID] is None and row[col.DEVICE_ID] is not None
        args = {name: _plain(row[name]) for name in _ARG_COLUMNS if row.get(name) is not None}
        if row.get(col.ATTRIBUTES):
            args.update(json.loads(row[col.ATTRIBUTES]))
        if on_device:
            gpus.add((row[col.DEVICE_ID], row[col.STREAM_ID]))
        else:
            threads.add(int(row[col.THREAD_ID] or 0))
        events.append({
            "name": row[col.NAME], "cat": row[col.LEVEL], "ph": "X",
            "ts": (int(row[col.START_NS]) - origin) / 1e3, "dur": int(row[col.DURATION_NS]) / 1e3,
            "pid": f"GPU {row[col.DEVICE_ID]}" if on_device else pid,
            "tid": (f"stream {row[col.STREAM_ID]}" if on_device else int(row[col.THREAD_ID] or 0)),
            "args": args,
        })
    events += _memory_events(trace, origin, pid, threads)
    events += _counter_events(trace, origin, pid)
    names = meta.get("threads") or {}
    events.append(_metadata_event("process_name", pid, f"{meta.get('service_name', 'xsp')} ({pid})"))
    for thread in sorted(threads):
        events.append(_metadata_event("thread_name", pid, str(names.get(str(thread), f"thread {thread}")), thread))
    for device in sorted({device for device, _ in gpus}, key=str):
        events.append(_metadata_event("process_name", f"GPU {device}", f"GPU {device}"))
    for device, stream in sorted(gpus, key=str):
        events.append(_metadata_event("thread_name", f"GPU {device}", f"stream {stream}", f"stream {stream}"))
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"xsp_version": meta.get("xsp_version"), "origin_epoch_ns": origin}}


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
        xsp.fileio.OutputError: the file could not be written (nothing is left at ``path``).
    """
    return write_text_output(path, json.dumps(chrome_events(trace)))


__all__ = ["chrome_events", "write_chrome"]
