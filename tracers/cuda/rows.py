"""CUPTI activity columns as span rows: names, clock, links, a family at a time.

Everything here works on whole columns (:class:`~xsp.tracers.cuda.records.ActivityColumns`):
a name is looked up once per distinct callback id or kernel, a JSON attribute once per
distinct kernel configuration, never once per record.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import re
from functools import cache, lru_cache
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind, Status
from xsp.tracers.cuda.clock import CuptiClock
from xsp.tracers.cuda.records import EXTERNAL_KIND_CUSTOM0, ActivityColumns, Family, Kind

# cupti.ActivityMemcpyKind, written as Kineto and Nsight write them
COPY_KINDS: Final = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
                     8: "DtoD", 9: "HtoH", 10: "PtoP"}
# cupti.ActivitySynchronizationType
SYNC_TYPES: Final = {0: "Unknown", 1: "Event Sync", 2: "Stream Wait Event", 3: "Stream Sync", 4: "Context Sync"}
NO_STREAM: Final = 0xFFFFFFFF
"""The stream id CUPTI writes for "no stream" (a context synchronisation)."""


# Callback ids --------------------------------------------------------------------------------
_VERSION_SUFFIX = re.compile(r"_v\d+$")

# cupti-python renamed its callback-id enums: 13.0 has ``runtime_api_trace_cbid``, 13.2 and later
# ``RuntimeApiTraceCbid`` (torch's CUDA 13.0 builds pin a CUPTI that only 13.0 binds)
_CBID_ENUMS = {Kind.RUNTIME: ("RuntimeApiTraceCbid", "runtime_api_trace_cbid"),
               Kind.DRIVER: ("DriverApiTraceCbid", "driver_api_trace_cbid")}


def cupti_module() -> Any:
    """``cupti.cupti``, imported on first use (the import alone costs ~0.2 s)."""
    from cupti import cupti

    return cupti


def api_enum(cupti: Any, kind: int) -> Any:
    """The enum of callback ids of ``kind`` (runtime or driver) in this cupti-python.

    Raises:
        AttributeError: this cupti-python has neither name.
    """
    for name in _CBID_ENUMS[Kind(kind)]:
        enum = getattr(cupti, name, None)
        if enum is not None:
            return enum
    raise AttributeError(f"cupti-python has no enum of {Kind(kind).name.lower()} callback ids")


@cache
def api_name(kind: int, cbid: int) -> str:
    """``cudaLaunchKernel`` for a runtime callback id (``cuLaunchKernel`` for the driver)."""
    try:
        return _VERSION_SUFFIX.sub("", api_enum(cupti_module(), kind)(cbid).name)
    except Exception:  # an id this cupti-python does not know
        return f"{'cuda' if kind == Kind.RUNTIME else 'cu'}Api#{cbid}"


QUERY_CALLS: Final = frozenset({
    # runtime
    "cudaGetDevice", "cudaSetDevice", "cudaGetDeviceCount", "cudaDeviceGetAttribute", "cudaGetLastError",
    "cudaPeekAtLastError", "cudaGetErrorString", "cudaGetErrorName", "cudaFuncGetAttributes",
    "cudaStreamIsCapturing", "cudaStreamGetCaptureInfo", "cudaDriverGetVersion", "cudaRuntimeGetVersion",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
    "cudaOccupancyMaxActiveClusters", "cudaOccupancyAvailableDynamicSMemPerBlock",
    # driver
    "cuDevicePrimaryCtxGetState", "cuGetProcAddress", "cuKernelGetName", "cuKernelGetFunction",
    "cuKernelGetAttribute", "cuLibraryGetKernel", "cuFuncGetAttribute", "cuFuncGetName", "cuDeviceGet",
    "cuDeviceGetCount", "cuDeviceGetAttribute", "cuCtxGetCurrent", "cuCtxGetDevice", "cuCtxGetLimit",
    "cuDriverGetVersion", "cuGetErrorString", "cuGetErrorName", "cuPointerGetAttribute",
    "cuPointerGetAttributes", "cuStreamIsCapturing", "cuStreamGetCaptureInfo", "cuModuleGetLoadingMode",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags",
    "cuOccupancyMaxActiveClusters", "cuOccupancyAvailableDynamicSMemPerBlock",
})
"""CUDA calls that only read the runtime's or driver's state: no GPU work, no wait, no
allocation. PyTorch makes them by the thousand (ResNet-50 inference on an H100: 48,000 of
54,000 API calls a 10-step run, ``cudaGetDevice`` alone 28,000), and each one recorded costs a
record in CUPTI's buffer and a span. The ``cuda_api`` level leaves them out unless
``XSP_CUDA_API_QUERIES=1``."""

RECORD_QUERIES_ENV: Final = "XSP_CUDA_API_QUERIES"


def query_cbids(cupti: Any, kind: int) -> tuple[int, ...]:
    """The callback ids of ``kind`` whose call is one of :data:`QUERY_CALLS` (every version)."""
    try:
        enum = api_enum(cupti, kind)
    except AttributeError:
        return ()
    return tuple(sorted({int(member) for member in enum
                         if _VERSION_SUFFIX.sub("", member.name) in QUERY_CALLS}))


def api_keys(columns: ActivityColumns) -> np.ndarray:
    """``kind << 32 | cbid`` of each API record: one key per distinct call."""
    api = columns[Family.API]
    return (api["kind"].astype(np.int64) << 32) | api["cbid"].astype(np.int64)


def without_calls(columns: ActivityColumns, left_out: frozenset[tuple[int, int]]) -> tuple[ActivityColumns, int]:
    """``columns`` without the API records of the ``(kind, cbid)`` in ``left_out``, and how many
    were left out."""
    if not left_out or not columns.count(Family.API):
        return columns, 0
    keys = np.fromiter(((kind << 32) | cbid for kind, cbid in left_out), dtype=np.int64)
    keep = ~np.isin(api_keys(columns), keys)
    return columns.where(Family.API, keep), int((~keep).sum())


# Kernel names --------------------------------------------------------------------------------
class _Demangler:
    """C++ symbol demangling with libstdc++'s ``__cxa_demangle`` (what c++filt uses)."""

    def __init__(self) -> None:
        self._function: Any = None
        self._free: Any = None
        try:
            library = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
            self._function = getattr(library, "__cxa_demangle")  # not library.__cxa...: a class body mangles it
            self._function.restype = ctypes.c_void_p
            self._function.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(ctypes.c_int)]
            self._free = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").free
            self._free.argtypes = [ctypes.c_void_p]
        except (OSError, AttributeError):
            self._function = None

    @lru_cache(maxsize=65536)  # noqa: B019 - one process-wide instance; kernel names repeat
    def __call__(self, name: str) -> str:
        if self._function is None or not name.startswith("_Z"):
            return name
        status = ctypes.c_int()
        pointer = self._function(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not pointer:
            return name
        try:
            return ctypes.string_at(pointer).decode(errors="replace")
        finally:
            self._free(pointer)


demangle = _Demangler()


# Column helpers ------------------------------------------------------------------------------
def _per_distinct(keys: np.ndarray, make: Any) -> np.ndarray:
    """``make(key)`` for each row's key (rows of a 2-D ``keys``), called once per distinct key.

    Keys are told apart by hashing (``pandas.factorize``), column by column, never by sorting.
    """
    if not len(keys):
        return np.empty(0, dtype=object)
    columns = [keys] if keys.ndim == 1 else list(keys.T)
    codes, _ = pd.factorize(columns[0])
    for column in columns[1:]:
        more, distinct = pd.factorize(column)
        codes, _ = pd.factorize(codes.astype(np.int64) * len(distinct) + more)
    first_rows = np.full(codes.max() + 1, -1, dtype=np.int64)
    first_rows[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)  # the first row of each code
    made = np.empty(len(first_rows), dtype=object)
    distinct_keys = keys[first_rows].tolist()
    made[:] = [make(key) for key in distinct_keys]
    return made[codes]


def _dims(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    return _per_distinct(np.stack([x, y, z], axis=1).astype(np.int64), lambda d: f"[{d[0]},{d[1]},{d[2]}]")


def _nullable(values: np.ndarray, missing: np.ndarray) -> pd.arrays.IntegerArray:
    return pd.arrays.IntegerArray(values.astype(np.int64), missing)


def _constant(value: str, count: int) -> np.ndarray:
    out = np.empty(count, dtype=object)
    out[:] = value
    return out


def external_ids(columns: ActivityColumns, correlation_ids: np.ndarray) -> pd.arrays.IntegerArray:
    """For each correlation id, the external id xsp had pushed when that API call was made (the
    last one CUPTI reported for it), or NA."""
    external = columns[Family.EXTERNAL]
    ours = external["external_kind"] == EXTERNAL_KIND_CUSTOM0
    keys, ids = external["correlation_id"][ours], external["external_id"][ours]
    if not len(keys):
        return _nullable(np.zeros(len(correlation_ids)), np.ones(len(correlation_ids), dtype=bool))
    order = np.argsort(keys, kind="stable")
    keys, ids = keys[order], ids[order]
    at = np.searchsorted(keys, correlation_ids, side="right") - 1
    found = (at >= 0) & (keys[np.maximum(at, 0)] == correlation_ids)
    return _nullable(np.where(found, ids[np.maximum(at, 0)].astype(np.int64), 0), ~found)


# Rows ----------------------------------------------------------------------------------------
def api_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    """CUDA runtime and driver calls as span rows on xsp's host clock."""
    api = columns[Family.API]
    count = columns.count(Family.API)
    if not count:
        return pd.DataFrame()
    kinds = api["kind"]
    failed = api["return_value"] != 0
    return pd.DataFrame({
        col.LEVEL: _constant(Level.CUDA_API.value, count),
        col.KIND: np.where(kinds == Kind.RUNTIME, SpanKind.RUNTIME.value, SpanKind.DRIVER.value).astype(object),
        col.NAME: _per_distinct(api_keys(columns), lambda key: api_name(key >> 32, key & 0xFFFFFFFF)),
        col.START_NS: clock.to_host_ns(api["start"]),
        col.END_NS: clock.to_host_ns(api["end"]),
        col.THREAD_ID: api["thread_id"].astype(np.int64),
        col.CORRELATION_ID: api["correlation_id"].astype(np.int64),
        col.EXTERNAL_ID: external_ids(columns, api["correlation_id"]),
        col.STATUS: np.where(failed, Status.ERROR.value, Status.OK.value).astype(object),
        col.STATUS_MESSAGE: _per_distinct(api["return_value"].astype(np.int64),
                                          lambda code: f"CUDA error {code}" if code else None),
    })


def graph_nodes(family: dict[str, np.ndarray]) -> pd.arrays.IntegerArray:
    """The graph node that ran each activity: the captured node it was instantiated from where
    CUPTI says (13.4 on), else the node of the executable graph (null: not run by a graph
    launch, CUPTI's 0). A family without the column (peer copies) has none."""
    nodes = family.get("graph_node_id")
    if nodes is None:
        count = len(family["start"])
        return _nullable(np.zeros(count, dtype=np.int64), np.ones(count, dtype=bool))
    source = family.get("source_graph_node_id")
    if source is not None:
        nodes = np.where(source != 0, source, nodes)
    return _nullable(nodes.astype(np.int64), nodes == 0)


def _kernel_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    kernel = columns[Family.KERNEL]
    count = columns.count(Family.KERNEL)
    names = columns.kernel_names
    static, dynamic = kernel["static_shared_memory"], kernel["dynamic_shared_memory"]
    details = np.stack([kernel["name"], static, dynamic, kernel["graph_id"]], axis=1).astype(np.int64)
    return pd.DataFrame({
        col.LEVEL: _constant(Level.KERNEL.value, count),
        col.KIND: _constant(SpanKind.KERNEL.value, count),
        col.NAME: _per_distinct(kernel["name"].astype(np.int64), lambda index: demangle(names[index])),
        col.START_NS: clock.to_host_ns(kernel["start"]),
        col.END_NS: clock.to_host_ns(kernel["end"]),
        col.CORRELATION_ID: kernel["correlation_id"].astype(np.int64),
        col.GRID: _dims(kernel["grid_x"], kernel["grid_y"], kernel["grid_z"]),
        col.BLOCK: _dims(kernel["block_x"], kernel["block_y"], kernel["block_z"]),
        col.REGISTERS_PER_THREAD: kernel["registers_per_thread"].astype(np.int64),
        col.SHARED_MEMORY_BYTES: static.astype(np.int64) + dynamic,
        col.STREAM_ID: kernel["stream_id"].astype(np.int64),
        col.DEVICE_ID: kernel["device_id"].astype(np.int64),
        col.GRAPH_NODE_ID: graph_nodes(kernel),
        col.ATTRIBUTES: _per_distinct(details, lambda d: json.dumps({
            "static_shared_memory": d[1], "dynamic_shared_memory": d[2], "mangled_name": names[d[0]],
            "graph_id": d[3]})),
    })


def _copies(copy: dict[str, np.ndarray], clock: CuptiClock, ends: tuple[str, ...] = ()) -> pd.DataFrame:
    """Copy rows of one family's columns; ``ends``: the columns naming the devices at both ends
    (peer-to-peer copies), put in the attributes beside the bandwidth."""
    count = len(copy["start"])
    directions = _per_distinct(copy["copy_kind"].astype(np.int64), lambda kind: COPY_KINDS.get(kind, "Unknown"))
    duration_ns = copy["end"].astype(np.int64) - copy["start"].astype(np.int64)
    end_ids = list(zip(*(copy[name].tolist() for name in ends))) if ends else [()] * count
    details = [json.dumps({**dict(zip(ends, devices)), "bandwidth_gb_s": nbytes / duration if duration > 0 else None})
               for devices, nbytes, duration in zip(end_ids, copy["bytes"].tolist(), duration_ns.tolist())]
    return pd.DataFrame({
        col.LEVEL: _constant(Level.KERNEL.value, count),
        col.KIND: _constant(SpanKind.MEMCPY.value, count),
        col.NAME: np.array([f"Memcpy {direction}" for direction in directions], dtype=object),
        col.START_NS: clock.to_host_ns(copy["start"]),
        col.END_NS: clock.to_host_ns(copy["end"]),
        col.CORRELATION_ID: copy["correlation_id"].astype(np.int64),
        col.BYTES: copy["bytes"].astype(np.int64),
        col.COPY_KIND: directions,
        col.STREAM_ID: copy["stream_id"].astype(np.int64),
        col.DEVICE_ID: copy["device_id"].astype(np.int64),
        col.GRAPH_NODE_ID: graph_nodes(copy),
        col.ATTRIBUTES: np.array(details, dtype=object),
    })


def _copy_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    return _copies(columns[Family.MEMCPY], clock)


def _peer_copy_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    """Copies between two GPUs (CUPTI's MEMCPY2 kind): on the device that ran the copy, with both ends."""
    return _copies(columns[Family.MEMCPY_PEER], clock, ends=("src_device_id", "dst_device_id"))


def _set_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    memset = columns[Family.MEMSET]
    count = columns.count(Family.MEMSET)
    return pd.DataFrame({
        col.LEVEL: _constant(Level.KERNEL.value, count),
        col.KIND: _constant(SpanKind.MEMSET.value, count),
        col.NAME: _constant("Memset", count),
        col.START_NS: clock.to_host_ns(memset["start"]),
        col.END_NS: clock.to_host_ns(memset["end"]),
        col.CORRELATION_ID: memset["correlation_id"].astype(np.int64),
        col.BYTES: memset["bytes"].astype(np.int64),
        col.STREAM_ID: memset["stream_id"].astype(np.int64),
        col.DEVICE_ID: memset["device_id"].astype(np.int64),
        col.GRAPH_NODE_ID: graph_nodes(memset),
        col.ATTRIBUTES: _per_distinct(memset["value"].astype(np.int64), lambda value: json.dumps({"value": value})),
    })


def _sync_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    sync = columns[Family.SYNC]
    count = columns.count(Family.SYNC)
    stream = sync["stream_id"]
    return pd.DataFrame({
        col.LEVEL: _constant(Level.KERNEL.value, count),
        col.KIND: _constant(SpanKind.SYNC.value, count),
        col.NAME: _per_distinct(sync["type"].astype(np.int64), lambda kind: SYNC_TYPES.get(kind, "Unknown")),
        col.START_NS: clock.to_host_ns(sync["start"]),
        col.END_NS: clock.to_host_ns(sync["end"]),
        col.CORRELATION_ID: sync["correlation_id"].astype(np.int64),
        col.STREAM_ID: _nullable(stream, stream == NO_STREAM),
        col.ATTRIBUTES: _per_distinct(sync["cuda_event_id"].astype(np.int64),
                                      lambda event: json.dumps({"cuda_event_id": event})),
    })


_ACTIVITY_ROWS: Final = ((Family.KERNEL, _kernel_rows), (Family.MEMCPY, _copy_rows),
                         (Family.MEMCPY_PEER, _peer_copy_rows), (Family.MEMSET, _set_rows), (Family.SYNC, _sync_rows))


def activity_rows(columns: ActivityColumns, clock: CuptiClock) -> pd.DataFrame:
    """Kernels, copies (peer-to-peer ones too), sets and synchronisations as span rows on xsp's host clock.

    They carry no thread: the hierarchy places them under the API call with their
    correlation id.
    """
    frames = [rows(columns, clock) for family, rows in _ACTIVITY_ROWS if columns.count(family)]
    if not frames:
        return pd.DataFrame()
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)
