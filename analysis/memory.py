"""The memory level: what each layer allocates, frees and holds at its peak (XSP's layer
memory analysis), memory by layer type, and the memory timeline.

Memory events (``alloc``/``free`` instants of the thread that made them, CPU and CUDA) nest
under the operator and layer that allocated, so a layer's figures include its sublayers'.
Live memory is counted from the session's start: what was allocated before it (the weights,
usually) is not in the totals, only what the traced code allocated and has not freed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.walks import parent_positions

EVENT_COLUMNS = ["step", "time_ns", "device", "kind", "bytes", "live_bytes", "thread_id"]
LAYER_COLUMNS = ["step", "path", "name", "kind", "module_type", "device", "allocations", "allocated_bytes",
                 "freed_bytes", "net_bytes", "peak_bytes"]
TYPE_COLUMNS = ["module_type", "device", "layers", "allocated_bytes", "mean_allocated_bytes", "net_bytes",
                "max_peak_bytes"]


def _device_names(spans: pd.DataFrame) -> np.ndarray:
    device = spans[col.DEVICE_ID].astype("Int64")
    names = "cuda:" + device.astype("string").fillna("").to_numpy(dtype=object)
    return np.where(device.isna().to_numpy(), "cpu", names)


def _events(spans: pd.DataFrame) -> np.ndarray:
    kinds = spans[col.KIND].to_numpy(dtype=object)
    return np.flatnonzero((spans[col.LEVEL] == Level.MEMORY.value).to_numpy()
                          & np.isin(kinds, [SpanKind.ALLOC.value, SpanKind.FREE.value]))


def _signed_live(spans: pd.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the event ``rows``: signed size, device name and live bytes on that device just
    after the event (in time order per device, from the session's start)."""
    sizes = spans[col.BYTES].fillna(0).to_numpy(dtype=np.int64)[rows]
    signed = np.where(spans[col.KIND].to_numpy(dtype=object)[rows] == SpanKind.FREE.value, -sizes, sizes)
    devices = _device_names(spans)[rows]
    times = spans[col.START_NS].to_numpy(dtype=np.int64)[rows]
    live = np.zeros(len(rows), dtype=np.int64)
    for device in np.unique(devices):
        mine = np.flatnonzero(devices == device)
        order = mine[np.argsort(times[mine], kind="stable")]
        live[order] = np.cumsum(signed[order])
    return signed, devices, live


def memory_timeline(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Every allocation and free in time order: ``step``, ``time_ns``, ``device`` (``cpu``,
    ``cuda:0``), ``kind`` (alloc, free), ``bytes``, ``live_bytes`` (allocated since the session
    started and not yet freed, on that device, after the event), ``thread_id``."""
    spans = spans_of(source)
    rows = _events(spans)
    if not len(rows):
        return pd.DataFrame(columns=EVENT_COLUMNS)
    signed, devices, live = _signed_live(spans, rows)
    out = pd.DataFrame({
        "step": spans[col.STEP].astype("Int64").array[rows],
        "time_ns": spans[col.START_NS].to_numpy(dtype=np.int64)[rows], "device": devices,
        "kind": spans[col.KIND].to_numpy(dtype=object)[rows], "bytes": np.abs(signed), "live_bytes": live,
        "thread_id": spans[col.THREAD_ID].astype("Int64").array[rows],
    })
    return out.sort_values(["time_ns", "device"], kind="stable").reset_index(drop=True)[EVENT_COLUMNS]


def layer_memory(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per layer span (forward and backward; and each model call, kind ``predict``) and
    device it allocated on: ``step``,
    ``path``, ``name``, ``kind``, ``module_type``, ``device``, ``allocations``,
    ``allocated_bytes`` and ``freed_bytes`` (inside the layer and its sublayers),
    ``net_bytes`` (what it left allocated: activations kept for backward, outputs),
    ``peak_bytes`` (the most it held at once above what was live when it began)."""
    spans = spans_of(source)
    rows = _events(spans)
    if not len(rows):
        return pd.DataFrame(columns=LAYER_COLUMNS)
    signed, devices, live = _signed_live(spans, rows)
    parents = parent_positions(spans)
    is_layer = ((spans[col.LEVEL] == Level.LAYER.value)
                | (spans[col.KIND] == SpanKind.PREDICT.value)).to_numpy()  # the whole model's call too
    times = spans[col.START_NS].to_numpy(dtype=np.int64)[rows]
    pairs_layer, pairs_event = [], []
    event, ancestor = np.arange(len(rows)), parents[rows]
    while len(event):
        keep = ancestor >= 0
        event, ancestor = event[keep], ancestor[keep]
        hit = is_layer[ancestor]
        pairs_layer.append(ancestor[hit])
        pairs_event.append(event[hit])
        ancestor = parents[ancestor]
    layer_of = np.concatenate(pairs_layer) if pairs_layer else np.zeros(0, dtype=np.int64)
    event_of = np.concatenate(pairs_event) if pairs_event else np.zeros(0, dtype=np.int64)
    if not len(layer_of):
        return pd.DataFrame(columns=LAYER_COLUMNS)
    pairs = pd.DataFrame({"layer": layer_of, "device": devices[event_of], "signed": signed[event_of],
                          "live": live[event_of], "time": times[event_of]})
    pairs["allocated"] = np.maximum(pairs["signed"], 0)
    pairs["freed"] = np.maximum(-pairs["signed"], 0)
    pairs = pairs.sort_values(["layer", "device", "time"], kind="stable")
    first = pairs.groupby(["layer", "device"], sort=False, observed=True).first()
    table = pairs.groupby(["layer", "device"], sort=False, observed=True).agg(
        allocations=("allocated", lambda values: int((values > 0).sum())), allocated_bytes=("allocated", "sum"),
        freed_bytes=("freed", "sum"), net_bytes=("signed", "sum"), top=("live", "max"))
    began = first["live"] - first["signed"]  # live on the device when the layer's first event came
    table["peak_bytes"] = np.maximum(table["top"] - began, 0)
    table = table.reset_index()
    positions = table["layer"].to_numpy(dtype=np.int64)
    out = pd.DataFrame({
        "step": spans[col.STEP].astype("Int64").array[positions],
        "path": spans[col.PATH].to_numpy(dtype=object)[positions],
        "name": spans[col.NAME].to_numpy(dtype=object)[positions],
        "kind": spans[col.KIND].to_numpy(dtype=object)[positions],
        "module_type": spans[col.MODULE_TYPE].to_numpy(dtype=object)[positions],
        "device": table["device"].to_numpy(), "allocations": table["allocations"].to_numpy(dtype=np.int64),
        "allocated_bytes": table["allocated_bytes"].to_numpy(dtype=np.int64),
        "freed_bytes": table["freed_bytes"].to_numpy(dtype=np.int64),
        "net_bytes": table["net_bytes"].to_numpy(dtype=np.int64),
        "peak_bytes": table["peak_bytes"].to_numpy(dtype=np.int64),
        "_start": spans[col.START_NS].to_numpy(dtype=np.int64)[positions],
    })
    return out.sort_values(["_start", "device"], kind="stable").reset_index(drop=True)[LAYER_COLUMNS]


def memory_by_layer_type(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per module type and device, over the forward calls of every step: ``layers`` (calls),
    ``allocated_bytes`` (all calls), ``mean_allocated_bytes`` (per call), ``net_bytes``,
    ``max_peak_bytes``; most allocated first. A layer's bytes are its own and its sublayers'."""
    table = layer_memory(source)
    table = table[table["kind"] == SpanKind.FORWARD.value]
    if table.empty:
        return pd.DataFrame(columns=TYPE_COLUMNS)
    grouped = table.groupby([table["module_type"].fillna("?"), "device"], observed=True).agg(
        layers=("path", "size"), allocated_bytes=("allocated_bytes", "sum"),
        mean_allocated_bytes=("allocated_bytes", "mean"), net_bytes=("net_bytes", "sum"),
        max_peak_bytes=("peak_bytes", "max")).reset_index()
    return grouped.sort_values("allocated_bytes", ascending=False, kind="stable").reset_index(drop=True)[TYPE_COLUMNS]
