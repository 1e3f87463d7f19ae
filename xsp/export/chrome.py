"""Chrome trace-event JSON (chrome://tracing, Perfetto UI) from a span table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from xsp import schema as col
from xsp.fileio import write_text_output
from xsp.trace import Trace

_ARG_COLUMNS = (col.LEVEL, col.KIND, col.STEP, col.PATH, col.MODULE_TYPE, col.INPUT_SHAPES,
                col.OUTPUT_SHAPES, col.PARAM_COUNT, col.CALL_DEPTH, col.EXEC_INDEX, col.SOURCE,
                col.BATCH_SIZE, col.CORRELATION_ID, col.GRID, col.BLOCK, col.REGISTERS_PER_THREAD,
                col.SHARED_MEMORY_BYTES, col.BYTES, col.COPY_KIND, col.FLOPS, col.STATUS,
                col.STATUS_MESSAGE)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def chrome_events(trace: Trace) -> dict[str, Any]:
    """``{"traceEvents": [...]}``: one complete ("X") event per span, times in µs.

    Host spans are placed on their process and thread; device spans (kernels) on a
    ``GPU <device>`` process with one track per stream.
    """
    spans = trace.spans
    pid = int(trace.metadata.get("pid", 0))
    origin = int(spans[col.START_NS].min()) if len(spans) else 0
    events: list[dict[str, Any]] = []
    records = spans.astype(object).where(spans.notna(), None).to_dict("records")
    for row in records:
        on_device = row[col.THREAD_ID] is None and row[col.DEVICE_ID] is not None
        args = {name: _plain(row[name]) for name in _ARG_COLUMNS if row.get(name) is not None}
        if row.get(col.ATTRIBUTES):
            args.update(json.loads(row[col.ATTRIBUTES]))
        events.append({
            "name": row[col.NAME], "cat": row[col.LEVEL], "ph": "X",
            "ts": (int(row[col.START_NS]) - origin) / 1e3, "dur": int(row[col.DURATION_NS]) / 1e3,
            "pid": f"GPU {row[col.DEVICE_ID]}" if on_device else pid,
            "tid": (f"stream {row[col.STREAM_ID]}" if on_device else int(row[col.THREAD_ID] or 0)),
            "args": args,
        })
    events.append({"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": f"{trace.metadata.get('service_name', 'xsp')} ({pid})"}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"xsp_version": trace.metadata.get("xsp_version"), "origin_epoch_ns": origin}}


def write_chrome(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as Chrome/Perfetto JSON, atomically.

    Raises:
        xsp.fileio.OutputError: the file could not be written (nothing is left at ``path``).
    """
    return write_text_output(path, json.dumps(chrome_events(trace)))


__all__ = ["chrome_events", "write_chrome"]
