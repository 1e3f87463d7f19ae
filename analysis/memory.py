"""The memory level: what each layer allocates, frees and holds at its peak (XSP's layer
memory analysis), memory by layer type, and the memory timeline.

Memory events (``alloc``/``free`` instants of the thread that made them, CPU and CUDA) nest
under the operator and layer that allocated, so a layer's figures include its sublayers'.
Live memory is counted from the session's start: what was allocated before it (the weights,
usually) is not in the totals, only what the traced code allocated and has not freed.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _signed_sizes(spans: pd.DataFrame, rows: np.ndarray) -> np.ndarray:
    """The event ``rows``' sizes, negative for a free."""
    sizes = spans[col.BYTES].fillna(0).to_numpy(dtype=np.int64)[rows]
    return np.where(spans[col.KIND].to_numpy(dtype=object)[rows] == SpanKind.FREE.value, -sizes, sizes)


def _signed_live(spans: pd.DataFrame, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the event ``rows``: signed size, device name and live bytes on that device just
    after the event (in time order per device, from the session's start)."""
    signed = _signed_sizes(spans, rows)
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


def _layers_over(parents: np.ndarray, rows: np.ndarray, is_layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each pair of a layer and a memory event under it (the event ``rows``' ancestors that are
    layers, ``is_layer``): the layer's row and the event's index in ``rows``."""
    pairs_layer, pairs_event = [], []
    event, ancestor = np.arange(len(rows)), parents[rows]
    while len(event):
        keep = ancestor >= 0
        event, ancestor = event[keep], ancestor[keep]
        hit = is_layer[ancestor]
        pairs_layer.append(ancestor[hit])
        pairs_event.append(event[hit])
        ancestor = parents[ancestor]
    if not pairs_layer:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(pairs_layer), np.concatenate(pairs_event)


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
    is_layer = ((spans[col.LEVEL] == Level.LAYER.value)
                | (spans[col.KIND] == SpanKind.PREDICT.value)).to_numpy()  # the whole model's call too
    times = spans[col.START_NS].to_numpy(dtype=np.int64)[rows]
    layer_of, event_of = _layers_over(parent_positions(spans), rows, is_layer)
    if not len(layer_of):
        return pd.DataFrame(columns=LAYER_COLUMNS)
    pairs = pd.DataFrame({"layer": layer_of, "device": devices[event_of], "signed": signed[event_of],
                          "live": live[event_of], "time": times[event_of], "event": event_of})
    pairs["allocated"] = np.maximum(pairs["signed"], 0)
    pairs["freed"] = np.maximum(-pairs["signed"], 0)
    # a layer's first event: its earliest, and of those at one time the first in the table, as
    # the live bytes were counted (what was live before it is what the layer began with)
    pairs = pairs.sort_values(["layer", "device", "time", "event"], kind="stable")
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
    return memory_type_table(table.groupby(["module_type", "device"], observed=True, dropna=False).agg(
        layers=("path", "size"), allocated_bytes=("allocated_bytes", "sum"), net_bytes=("net_bytes", "sum"),
        max_peak_bytes=("peak_bytes", "max")).reset_index())


def memory_type_table(sums: pd.DataFrame) -> pd.DataFrame:
    """:func:`memory_by_layer_type`'s table of its sums per module type (None: unknown) and
    device (``layers``, ``allocated_bytes``, ``net_bytes``, ``max_peak_bytes``), however they
    were added up: most allocated first, ties in the order of type and device."""
    if sums.empty:
        return pd.DataFrame(columns=TYPE_COLUMNS)
    table = sums.assign(module_type=sums["module_type"].astype(object).where(sums["module_type"].notna(), "?"))
    table = table.groupby(["module_type", "device"], observed=True).agg(
        layers=("layers", "sum"), allocated_bytes=("allocated_bytes", "sum"), net_bytes=("net_bytes", "sum"),
        max_peak_bytes=("max_peak_bytes", "max")).reset_index()
    table["mean_allocated_bytes"] = table["allocated_bytes"] / table["layers"]
    return table.sort_values("allocated_bytes", ascending=False, kind="stable").reset_index(drop=True)[TYPE_COLUMNS]


@dataclass
class ForwardMemory:
    """A table's memory events and forward layers, for :func:`memory_by_layer_type` of a trace
    read a part at a time: the live bytes need every event of the trace in time order."""

    events: pd.DataFrame
    """Each memory event: ``row`` (in the table), ``device``, ``time_ns``, ``signed_bytes``
    (negative: a free)."""
    pairs: pd.DataFrame
    """Each forward layer and event under it: ``layer_row``, ``module_type``, ``event_row``."""


def forward_memory(source: Trace | pd.DataFrame) -> ForwardMemory:
    """The memory events and forward layers of ``source`` (see :class:`ForwardMemory`)."""
    spans = spans_of(source)
    rows = _events(spans)
    events = pd.DataFrame({"row": rows, "device": _device_names(spans)[rows],
                           "time_ns": spans[col.START_NS].to_numpy(dtype=np.int64)[rows],
                           "signed_bytes": _signed_sizes(spans, rows)})
    forward = ((spans[col.LEVEL] == Level.LAYER.value) & (spans[col.KIND] == SpanKind.FORWARD.value)).to_numpy()
    layer_of, event_of = _layers_over(parent_positions(spans), rows, forward) if len(rows) and forward.any() else (
        np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    pairs = pd.DataFrame({"layer_row": layer_of,
                          "module_type": spans[col.MODULE_TYPE].to_numpy(dtype=object)[layer_of],
                          "event_row": rows[event_of]})
    return ForwardMemory(events, pairs)
