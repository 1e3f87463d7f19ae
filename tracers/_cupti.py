"""The process's one CUPTI client, shared by the ``cuda_api`` and ``kernel`` tracers.

CUPTI (through NVIDIA's cupti-python) allows one subscriber per process, so both tracers
go through :data:`SOURCE`, which subscribes once, enables the activity kinds its users ask
for, hands CUPTI 8 MiB buffers and keeps what CUPTI gives back as plain tuples.

* **Off the hot path.** CUPTI fills its buffers itself; the completed-buffer callback (on
  CUPTI's thread, or the flushing one) turns each record into one tuple and appends them
  under a lock once per buffer. At each step end a background thread flushes the completed
  buffers; at session end everything is flushed (forced) after the device is synchronised.
* **Clock.** CUPTI stamps records on its own time base (CLOCK_REALTIME on Linux).
  :func:`measure_cupti_offset` brackets ``cupti.get_timestamp()`` between two readings of
  xsp's host clock; records are moved onto the host clock by that offset when interpreted.
* **Linking.** While the source runs, the layer wrapper pushes an external correlation id
  (the layer call's start on the host clock) around every module call. CUPTI reports which
  id was on top when each CUDA API call was made; the API call's ``external_id`` then names
  the layer span that made it, and the hierarchy builder uses it (see
  :mod:`xsp.hierarchy`).
* **Never fatal.** Every CUPTI failure becomes a reason the tracer is unavailable, or a
  warning; ``cupti.finalize()`` is never called (it tears CUPTI down for everyone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cache, lru_cache
from typing import Any

import numpy as np
import pandas as pd

from xsp import schema as col
from xsp.clock import measure_offset_ns, now_ns
from xsp.recording import Window
from xsp.schema import Level, SpanKind, Status

BUFFER_BYTES = 8 << 20
"""Size of each activity buffer handed to CUPTI."""


class Kind(IntEnum):
    """CUPTI activity kinds xsp reads (values of ``cupti.ActivityKind``)."""

    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    SYNCHRONIZATION = 38
    EXTERNAL_CORRELATION = 39


API_KINDS = (Kind.RUNTIME, Kind.DRIVER)
ACTIVITY_KINDS = (Kind.CONCURRENT_KERNEL, Kind.MEMCPY, Kind.MEMSET, Kind.SYNCHRONIZATION)
EXTERNAL_KIND_CUSTOM0 = 3
"""``cupti.ExternalCorrelationKind.CUSTOM0``: the external ids xsp pushes."""

# cupti.ActivityMemcpyKind, written as Kineto and Nsight write them
COPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
              8: "DtoD", 9: "HtoH", 10: "PtoP"}
# cupti.ActivitySynchronizationType
SYNC_TYPES = {0: "Unknown", 1: "Event Sync", 2: "Stream Wait Event", 3: "Stream Sync", 4: "Context Sync"}


# Records as tuples -----------------------------------------------------------------------
# The callback keeps one tuple per record, its first item the kind:
#   API:        (kind, start, end, correlation_id, cbid, thread_id, process_id, return_value)
#   kernel:     (kind, start, end, correlation_id, name, grid_x, grid_y, grid_z, block_x, block_y,
#                block_z, registers_per_thread, static_shared_memory, dynamic_shared_memory,
#                stream_id, device_id, graph_id)
#   memcpy:     (kind, start, end, correlation_id, bytes, copy_kind, stream_id, device_id)
#   memset:     (kind, start, end, correlation_id, bytes, value, stream_id, device_id)
#   sync:       (kind, start, end, correlation_id, type, stream_id, cuda_event_id)
#   external:   (kind, external_kind, external_id, correlation_id)

def record_tuple(record: Any) -> tuple[Any, ...] | None:
    """The tuple kept for one CUPTI activity record, or None for a kind xsp does not read."""
    kind = record.kind
    if kind == Kind.CONCURRENT_KERNEL or kind == Kind.KERNEL:
        return (Kind.CONCURRENT_KERNEL, record.start, record.end, record.correlation_id, record.name,
                record.grid_x, record.grid_y, record.grid_z, record.block_x, record.block_y, record.block_z,
                record.registers_per_thread, record.static_shared_memory, record.dynamic_shared_memory,
                record.stream_id, record.device_id, record.graph_id)
    if kind == Kind.RUNTIME or kind == Kind.DRIVER:
        return (kind, record.start, record.end, record.correlation_id, record.cbid, record.thread_id,
                record.process_id, record.return_value)
    if kind == Kind.EXTERNAL_CORRELATION:
        return (kind, record.external_kind, record.external_id, record.correlation_id)
    if kind == Kind.MEMCPY:
        return (kind, record.start, record.end, record.correlation_id, record.bytes, record.copy_kind,
                record.stream_id, record.device_id)
    if kind == Kind.MEMSET:
        return (kind, record.start, record.end, record.correlation_id, record.bytes, record.value,
                record.stream_id, record.device_id)
    if kind == Kind.SYNCHRONIZATION:
        return (kind, record.start, record.end, record.correlation_id, record.type, record.stream_id,
                record.cuda_event_id)
    return None


# Records as bytes ------------------------------------------------------------------------
# Reading a record's fields one attribute at a time costs ~1.5 us in cupti-python 13.4 but
# ~50-100 us in 13.0 (each attribute goes through a numpy record), the version torch's CUDA 13.0
# builds get; on an H100 that made ResNet-50 inference 5-8x slower while the kernel level ran.
# So the callback copies each record's bytes (its address and one memcpy) and the fields are
# read later, a whole drain at once, through the numpy layout cupti-python gives each record type.
_RAW_FIELDS = {
    "API": ("kind", "start", "end", "correlation_id", "cbid", "thread_id", "process_id", "return_value"),
    "Kernel": ("kind", "start", "end", "correlation_id", "name", "grid_x", "grid_y", "grid_z", "block_x",
               "block_y", "block_z", "registers_per_thread", "static_shared_memory", "dynamic_shared_memory",
               "stream_id", "device_id", "graph_id"),
    "Memcpy": ("kind", "start", "end", "correlation_id", "bytes", "copy_kind", "stream_id", "device_id"),
    "Memset": ("kind", "start", "end", "correlation_id", "bytes", "value", "stream_id", "device_id"),
    "Synchronization": ("kind", "start", "end", "correlation_id", "type", "stream_id", "cuda_event_id"),
    "ExternalCorrelation": ("kind", "external_kind", "external_id", "correlation_id"),
}
"""The fields kept of each record family, in the order of the tuples above."""
_RECORD_CLASS = re.compile(r"Activity(API|Kernel|Memcpy|Memset|Synchronization|ExternalCorrelation)(\d*)$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


@dataclass(frozen=True)
class RawLayout:
    """Where a record type's fields lie in its bytes (its cupti-python numpy dtype)."""

    dtype: Any
    fields: tuple[str, ...]
    name_offset: int | None
    """Kernels: the offset of the pointer to the kernel's name, read while the record is at hand."""

    @property
    def size(self) -> int:
        return int(self.dtype.itemsize)


_LAYOUTS: dict[type, RawLayout | None] = {}


def raw_layout(record_type: type) -> RawLayout | None:
    """The layout of ``record_type``'s bytes, or None where its fields are read one by one (a
    record type xsp does not read, or a cupti-python without the numpy layout)."""
    if record_type in _LAYOUTS:
        return _LAYOUTS[record_type]
    layout = None
    match = _RECORD_CLASS.match(record_type.__name__)
    module = sys.modules.get(record_type.__module__)
    if match and module is not None:
        family, version = match.groups()
        dtype = getattr(module, f"activity_{_CAMEL.sub('_', family).lower()}{version}_dtype", None)
        fields = _RAW_FIELDS[family]
        names = getattr(dtype, "names", None) or ()
        if dtype is not None and set(fields) <= set(names) and hasattr(record_type, "ptr"):
            layout = RawLayout(dtype, fields, int(dtype.fields["name"][1]) if family == "Kernel" else None)
    _LAYOUTS[record_type] = layout
    return layout


def decode(layout: RawLayout, blobs: list[bytes], names: list[str]) -> list[tuple[Any, ...]]:
    """The tuples of the records whose bytes are ``blobs`` (``names``: their kernels' names)."""
    values = np.frombuffer(b"".join(blobs), dtype=layout.dtype)
    columns: list[list[Any]] = [values[name].tolist() for name in layout.fields]
    if layout.name_offset is not None:
        columns[0] = [Kind.CONCURRENT_KERNEL] * len(values)
        columns[4] = names
    return list(zip(*columns))


@dataclass
class RecordStore:
    """What CUPTI handed back: each record's bytes (or, for a record type without a known layout,
    its tuple), with what could not be read counted."""

    records: list[tuple[Any, ...]] = field(default_factory=list)
    raw: dict[RawLayout, tuple[list[bytes], list[str]]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    left_out: frozenset[tuple[int, int]] = frozenset()
    """``(kind, cbid)`` of API calls to leave out here, where CUPTI could not leave them out itself."""
    left_out_count: int = 0

    def on_completed(self, activities: Iterable[Any]) -> None:
        """CUPTI's buffer-completed callback: each record's bytes copied, one lock per buffer."""
        kept = []
        raw: dict[RawLayout, tuple[list[bytes], list[str]]] = {}
        kernel_names: dict[int, str] = {}  # one buffer's: a name's memory is CUPTI's
        unread = 0
        string_at = ctypes.string_at
        for record in activities:
            layout = _LAYOUTS.get(type(record), _UNSEEN)
            if layout is _UNSEEN:
                layout = raw_layout(type(record))
            try:
                if layout is None:
                    item = record_tuple(record)
                    if item is not None:
                        kept.append(item)
                    continue
                blob = string_at(record.ptr, layout.size)
                blobs, names = raw.get(layout) or raw.setdefault(layout, ([], []))
                if layout.name_offset is not None:
                    pointer = int.from_bytes(blob[layout.name_offset:layout.name_offset + 8], "little")
                    name = kernel_names.get(pointer)
                    if name is None:
                        name = kernel_names[pointer] = string_at(pointer).decode(errors="replace") if pointer else ""
                    names.append(name)
                blobs.append(blob)
            except Exception:  # a record of a shape this cupti-python does not have
                unread += 1
        with self.lock:
            self.records.extend(kept)
            for layout, (blobs, names) in raw.items():
                stored = self.raw.setdefault(layout, ([], []))
                stored[0].extend(blobs)
                stored[1].extend(names)
            if unread:
                self.dropped["unreadable CUPTI records"] += unread

    def drain(self) -> tuple[list[tuple[Any, ...]], Counter[str]]:
        """Everything kept so far as tuples (and the drop counts), leaving the store empty."""
        with self.lock:
            records, self.records = self.records, []
            raw, self.raw = self.raw, {}
            dropped, self.dropped = self.dropped, Counter()
        for layout, (blobs, names) in raw.items():
            try:
                records.extend(decode(layout, blobs, names))
            except Exception:
                dropped["unreadable CUPTI records"] += len(blobs)
        left_out = self.left_out
        if left_out:
            before = len(records)
            records = [r for r in records
                       if not ((r[0] == Kind.RUNTIME or r[0] == Kind.DRIVER) and (r[0], r[4]) in left_out)]
            self.left_out_count += before - len(records)
        return records, dropped


_UNSEEN: Any = object()


# Interpreting records --------------------------------------------------------------------
_VERSION_SUFFIX = re.compile(r"_v\d+$")

# cupti-python renamed its callback-id enums: 13.0 has ``runtime_api_trace_cbid``, 13.2 and later
# ``RuntimeApiTraceCbid`` (torch's CUDA 13.0 builds pin a CUPTI that only 13.0 binds)
_CBID_ENUMS = {Kind.RUNTIME: ("RuntimeApiTraceCbid", "runtime_api_trace_cbid"),
               Kind.DRIVER: ("DriverApiTraceCbid", "driver_api_trace_cbid")}


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


QUERY_CALLS = frozenset({
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
record in CUPTI's buffer, a tuple and a span. The ``cuda_api`` level leaves them out unless
``XSP_CUDA_API_QUERIES=1``."""

RECORD_QUERIES_ENV = "XSP_CUDA_API_QUERIES"


def query_cbids(cupti: Any, kind: int) -> tuple[int, ...]:
    """The callback ids of ``kind`` whose call is one of :data:`QUERY_CALLS` (every version)."""
    try:
        enum = api_enum(cupti, kind)
    except AttributeError:
        return ()
    return tuple(sorted({int(member) for member in enum
                         if _VERSION_SUFFIX.sub("", member.name) in QUERY_CALLS}))


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


def _dims(x: int, y: int, z: int) -> str:
    return f"[{x},{y},{z}]"


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows) if rows else pd.DataFrame()


def _external_ids(records: list[tuple[Any, ...]]) -> dict[int, int]:
    """Correlation id -> the external id xsp had pushed when the API call was made."""
    return {r[3]: r[2] for r in records if r[0] == Kind.EXTERNAL_CORRELATION and r[1] == EXTERNAL_KIND_CUSTOM0}


def api_rows(records: list[tuple[Any, ...]], cupti_offset_ns: int) -> pd.DataFrame:
    """CUDA runtime and driver calls as span rows on xsp's host clock."""
    external = _external_ids(records)
    rows = []
    for r in records:
        if r[0] != Kind.RUNTIME and r[0] != Kind.DRIVER:
            continue
        failed = bool(r[7])
        rows.append({
            col.LEVEL: Level.CUDA_API.value,
            col.KIND: (SpanKind.RUNTIME if r[0] == Kind.RUNTIME else SpanKind.DRIVER).value,
            col.NAME: api_name(int(r[0]), int(r[4])),
            col.START_NS: r[1] - cupti_offset_ns, col.END_NS: r[2] - cupti_offset_ns,
            col.THREAD_ID: r[5], col.CORRELATION_ID: r[3], col.EXTERNAL_ID: external.get(r[3]),
            col.STATUS: (Status.ERROR if failed else Status.OK).value,
            col.STATUS_MESSAGE: f"CUDA error {r[7]}" if failed else None,
        })
    return _frame(rows)


def activity_rows(records: list[tuple[Any, ...]], cupti_offset_ns: int) -> pd.DataFrame:
    """Kernels, copies, sets and synchronisations as span rows on xsp's host clock.

    They carry no thread: the hierarchy places them under the API call with their
    correlation id.
    """
    rows = []
    for r in records:
        kind = r[0]
        if kind == Kind.CONCURRENT_KERNEL:
            rows.append({
                col.LEVEL: Level.KERNEL.value, col.KIND: SpanKind.KERNEL.value, col.NAME: demangle(r[4]),
                col.START_NS: r[1] - cupti_offset_ns, col.END_NS: r[2] - cupti_offset_ns,
                col.CORRELATION_ID: r[3], col.GRID: _dims(r[5], r[6], r[7]), col.BLOCK: _dims(r[8], r[9], r[10]),
                col.REGISTERS_PER_THREAD: r[11], col.SHARED_MEMORY_BYTES: r[12] + r[13],
                col.STREAM_ID: r[14], col.DEVICE_ID: r[15],
                col.ATTRIBUTES: json.dumps({"static_shared_memory": r[12], "dynamic_shared_memory": r[13],
                                            "mangled_name": r[4], "graph_id": r[16]}),
            })
        elif kind == Kind.MEMCPY:
            direction = COPY_KINDS.get(r[5], "Unknown")
            duration_ns = r[2] - r[1]
            rows.append({
                col.LEVEL: Level.KERNEL.value, col.KIND: SpanKind.MEMCPY.value, col.NAME: f"Memcpy {direction}",
                col.START_NS: r[1] - cupti_offset_ns, col.END_NS: r[2] - cupti_offset_ns,
                col.CORRELATION_ID: r[3], col.BYTES: r[4], col.COPY_KIND: direction,
                col.STREAM_ID: r[6], col.DEVICE_ID: r[7],
                col.ATTRIBUTES: json.dumps({"bandwidth_gb_s": r[4] / duration_ns if duration_ns > 0 else None}),
            })
        elif kind == Kind.MEMSET:
            rows.append({
                col.LEVEL: Level.KERNEL.value, col.KIND: SpanKind.MEMSET.value, col.NAME: "Memset",
                col.START_NS: r[1] - cupti_offset_ns, col.END_NS: r[2] - cupti_offset_ns,
                col.CORRELATION_ID: r[3], col.BYTES: r[4], col.STREAM_ID: r[6], col.DEVICE_ID: r[7],
                col.ATTRIBUTES: json.dumps({"value": r[5]}),
            })
        elif kind == Kind.SYNCHRONIZATION:
            rows.append({
                col.LEVEL: Level.KERNEL.value, col.KIND: SpanKind.SYNC.value,
                col.NAME: SYNC_TYPES.get(r[4], "Unknown"),
                col.START_NS: r[1] - cupti_offset_ns, col.END_NS: r[2] - cupti_offset_ns,
                col.CORRELATION_ID: r[3], col.STREAM_ID: _stream_or_none(r[5]),
                col.ATTRIBUTES: json.dumps({"cuda_event_id": r[6]}),
            })
    return _frame(rows)


def _stream_or_none(stream_id: int) -> int | None:
    # CUPTI writes 0xFFFFFFFF for "no stream" (a context synchronisation)
    return None if stream_id in (0xFFFFFFFF, -1) else stream_id


def measure_cupti_offset(read_cupti: Callable[[], int]) -> tuple[int, int]:
    """``(offset_ns, uncertainty_ns)``: host clock = CUPTI timestamp - offset."""
    return measure_offset_ns(read_cupti, reference=now_ns)


# The CUPTI module behind a seam ------------------------------------------------------------
def cupti_module() -> Any:
    """``cupti.cupti``, imported on first use (the import alone costs ~0.2 s)."""
    from cupti import cupti

    return cupti


def cupti_error_text(exc: BaseException) -> str:
    """``ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (...)`` for a cuptiError, else the message."""
    status = getattr(exc, "status", None)
    if status is not None:
        try:
            return f"{cupti_module().Result(status).name}: {exc}"
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"


def torch_profiler_active() -> bool:
    """True while PyTorch's profiler (Kineto) is recording in this process, other than the
    operator level's own CPU-only one (which leaves CUPTI alone)."""
    try:
        import torch
        from xsp.tracers.operator import own_profiler_active

        return bool(torch.autograd.profiler._is_profiler_enabled) and not own_profiler_active()
    except Exception:
        return False


_CONFLICT = ("another CUPTI client holds the process's one subscription (PyTorch's profiler with CUDA "
             "activities, Nsight Systems or Compute, or another profiler); xsp's CUDA levels and "
             "PyTorch's profiler in CUDA mode cannot run at once")


def probe(load: Callable[[], Any] = cupti_module, holding: bool = False) -> str | None:
    """None when CUPTI can trace here, else why not (one line).

    Args:
        load: returns the ``cupti`` module (a seam for tests).
        holding: xsp already holds the subscription (so a test subscription would fail).
    """
    try:
        cupti = load()
    except ImportError:
        return "cupti-python is not installed (pip install cupti-python, Linux x86_64/aarch64 only)"
    except Exception as exc:
        return f"cupti-python cannot be imported: {type(exc).__name__}: {exc}"
    if torch_profiler_active():
        return _CONFLICT
    try:
        cupti.get_timestamp()
    except RuntimeError as exc:  # cupti's NotSupportedError: no driver
        return f"no CUDA driver: {exc}"
    except Exception as exc:
        return f"CUPTI is not usable: {cupti_error_text(exc)}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device"
    except Exception as exc:
        return f"PyTorch cannot query CUDA: {exc}"
    if not holding:  # a subscription held elsewhere (Nsight, a profiler) shows here
        try:
            cupti.unsubscribe(cupti.subscribe(_ignore_callback, None))
        except Exception as exc:
            return f"{_CONFLICT} ({cupti_error_text(exc)})"
    return None


# The shared source ---------------------------------------------------------------------------
@dataclass
class _Flusher:
    """Flushes CUPTI's completed buffers on its own thread when a step ends."""

    flush: Callable[[], None]
    wanted: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="xsp-cupti-flush", daemon=True)
        self.thread.start()

    def request(self) -> None:
        self.wanted.set()

    def stop(self) -> None:
        self.stopping = True
        self.wanted.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.stopping:
                return
            try:
                self.flush()
            except Exception:  # the final forced flush at stop still runs
                pass


class CuptiSource:
    """The one CUPTI subscription of the process, shared by the tracers that need it."""

    def __init__(self, module: Callable[[], Any] = cupti_module) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._users: dict[str, tuple[Kind, ...]] = {}
        self._enabled: set[Kind] = set()
        self._subscriber: Any = None
        self._flusher: _Flusher | None = None
        self.store = RecordStore()
        self.record_queries = False
        """Record :data:`QUERY_CALLS` too (``XSP_CUDA_API_QUERIES=1`` when the subscription opened)."""
        self._left_out_by_cupti: dict[Kind, tuple[int, ...]] = {}
        self.offset_ns = 0
        self.uncertainty_ns = 0
        self.drift_ns = 0
        self.warnings: list[str] = []

    @property
    def running(self) -> bool:
        return bool(self._users)

    def available(self) -> str | None:
        return probe(self._module, holding=self.running)

    def acquire(self, user: str, kinds: tuple[Kind, ...]) -> None:
        """Start (or widen) tracing for ``user``.

        Raises:
            RuntimeError: CUPTI refused; the message says why (another subscriber, no permission).
        """
        with self._lock:
            cupti = self._module()
            if not self._users:
                self._open(cupti)
            self._users[user] = kinds
            for kind in (*kinds, Kind.EXTERNAL_CORRELATION):
                if kind not in self._enabled:
                    try:
                        cupti.activity_enable(int(kind))
                    except Exception as exc:
                        if not self._enabled:
                            self._close(cupti)
                            self._users.pop(user, None)
                        raise RuntimeError(f"CUPTI refused activity kind {kind.name}: "
                                           f"{cupti_error_text(exc)}") from None
                    self._enabled.add(kind)
                    if kind in API_KINDS and not self.record_queries:
                        self._leave_out_queries(cupti, kind)

    def _open(self, cupti: Any) -> None:
        if torch_profiler_active():
            raise RuntimeError(_CONFLICT)
        self.record_queries = os.environ.get(RECORD_QUERIES_ENV, "") not in ("", "0")
        # records made before a kind is disabled still arrive with the final flush: what this
        # subscription leaves out holds until the next one
        self.store.left_out, self.store.left_out_count = frozenset(), 0
        try:
            # one subscription, held for the session: it fails when another client holds one
            self._subscriber = cupti.subscribe(_ignore_callback, None)
        except Exception as exc:
            raise RuntimeError(f"{_CONFLICT} ({cupti_error_text(exc)})") from None
        try:
            cupti.set_thread_id_type(1)  # ActivityThreadIdType.SYSTEM: thread ids as threading.get_native_id()
            cupti.activity_register_callbacks(_buffer_requested, self.store.on_completed)
        except Exception as exc:
            self._unsubscribe(cupti)
            raise RuntimeError(f"CUPTI could not be set up: {cupti_error_text(exc)}") from None
        self.offset_ns, self.uncertainty_ns = measure_cupti_offset(cupti.get_timestamp)
        self.drift_ns = 0
        self._flusher = _Flusher(lambda: cupti.activity_flush_all(0))
        self._flusher.start()

    def step_ended(self) -> None:
        """A step ended: flush CUPTI's completed buffers, on the flusher thread."""
        if self._flusher is not None:
            self._flusher.request()

    def release(self, user: str) -> None:
        """Stop tracing for ``user``; the last one out flushes everything and unsubscribes."""
        with self._lock:
            kinds = self._users.pop(user, ())
            cupti = self._module()
            still_wanted = {kind for wanted in self._users.values() for kind in wanted}
            if self._users:
                still_wanted.add(Kind.EXTERNAL_CORRELATION)
            for kind in kinds:
                if kind in self._enabled and kind not in still_wanted:
                    self._disable(cupti, kind)
            if not self._users:
                self._close(cupti)

    def _close(self, cupti: Any) -> None:
        if self._flusher is not None:
            self._flusher.stop()
            self._flusher = None
        _synchronize_device()
        try:
            cupti.activity_flush_all(1)  # forced: incomplete records too
        except Exception as exc:
            self.warnings.append(f"CUPTI's final flush failed; records still in its buffers are lost: "
                                 f"{cupti_error_text(exc)}")
        for kind in list(self._enabled):
            self._disable(cupti, kind)
        try:
            self.drift_ns = measure_cupti_offset(cupti.get_timestamp)[0] - self.offset_ns
        except Exception:
            pass
        self._unsubscribe(cupti)

    def _disable(self, cupti: Any, kind: Kind) -> None:
        try:
            cupti.activity_disable(int(kind))
        except Exception as exc:
            self.warnings.append(f"CUPTI activity kind {kind.name} could not be disabled: {cupti_error_text(exc)}")
        self._enabled.discard(kind)
        left_out = self._left_out_by_cupti.pop(kind, ())
        if left_out:  # CUPTI keeps the setting for the process: give the next client its default back
            enable = _per_call_switch(cupti, kind)
            try:
                for cbid in left_out:
                    enable(cbid, 1)
            except Exception as exc:
                self.warnings.append(f"CUPTI's records of {kind.name.lower()} query calls could not be "
                                     f"switched back on: {cupti_error_text(exc)}")

    def _leave_out_queries(self, cupti: Any, kind: Kind) -> None:
        """Ask CUPTI to make no records of :data:`QUERY_CALLS`; where it cannot (a cupti-python
        without the per-call switch), the completed-buffer callback drops them instead."""
        cbids = query_cbids(cupti, kind)
        try:
            enable = _per_call_switch(cupti, kind)
            for done, cbid in enumerate(cbids):
                enable(cbid, 0)
                self._left_out_by_cupti[kind] = cbids[:done + 1]
        except Exception:
            self.store.left_out = self.store.left_out | {(int(kind), cbid) for cbid in cbids}

    def _unsubscribe(self, cupti: Any) -> None:
        if self._subscriber is not None:
            try:
                cupti.unsubscribe(self._subscriber)
            except Exception as exc:
                self.warnings.append(f"CUPTI unsubscribe failed: {cupti_error_text(exc)}")
            self._subscriber = None

    def records_for(self, window: Window) -> list[tuple[Any, ...]]:
        """The records of one collection round: drained once (what was dropped counted in the
        window), shared by every tracer of the round."""
        if "cupti_records" not in window.derived:
            records, dropped = self.store.drain()
            window.derived["cupti_records"] = records
            window.dropped.update(dropped)
        return window.derived["cupti_records"]  # type: ignore[no-any-return]

    def metadata(self) -> dict[str, Any]:
        details: dict[str, Any] = {"cupti_to_host_offset_ns": self.offset_ns,
                                   "uncertainty_ns": self.uncertainty_ns, "drift_ns": self.drift_ns,
                                   "query_calls": "recorded" if self.record_queries else "left out"}
        if self.store.left_out_count:
            details["query_calls_left_out"] = self.store.left_out_count
        return details

    # external correlation around layer calls -------------------------------------------
    def correlation_pair(self) -> tuple[Callable[[int], Any], Callable[[], Any]]:
        """``(push, pop)`` of external correlation ids, for the layer wrapper."""
        cupti = self._module()
        push, pop = cupti.activity_push_external_correlation_id, cupti.activity_pop_external_correlation_id
        kind = EXTERNAL_KIND_CUSTOM0

        failures = self.store.dropped

        # these run inside the user's module calls: a CUPTI error is counted, never raised
        def push_id(external_id: int) -> None:
            try:
                push(kind, external_id)
            except Exception:
                failures["external correlation ids CUPTI refused"] += 1

        def pop_id() -> None:
            try:
                pop(kind)
            except Exception:
                failures["external correlation ids CUPTI refused"] += 1

        return push_id, pop_id


def _per_call_switch(cupti: Any, kind: Kind) -> Callable[[int, int], Any]:
    """``cupti.activity_enable_runtime_api`` (or ``_driver_api``): records of one call on or off."""
    return cupti.activity_enable_runtime_api if kind == Kind.RUNTIME else cupti.activity_enable_driver_api  # type: ignore[no-any-return]


def _buffer_requested() -> tuple[int, int]:
    return BUFFER_BYTES, 0  # 0: as many records as fit


def _ignore_callback(*_: Any) -> None:
    """The subscription exists to hold CUPTI; its callbacks are never enabled."""


def _synchronize_device() -> None:
    """Wait for the GPU so that every kernel launched has a record to flush."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:
        pass


SOURCE = CuptiSource()
"""The process's one CUPTI client."""
