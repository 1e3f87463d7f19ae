"""CUPTI activity records as columns: read in C where it can, through cupti-python where not.

Two paths lead to the same :class:`ActivityColumns`, one packed array per field of each record
family (API calls, kernels, copies, sets, synchronisations, external correlations):

* **C** (:class:`NativeRecords`, the ``xsp.record._activity`` extension): it binds to the libcupti
  that cupti-python loaded, hands CUPTI pooled, pre-zeroed buffers through its own callbacks
  (which only queue a completed buffer: no GIL, no parsing), and at each drain walks the
  queued buffers into columns without the GIL. Kernel names are interned in C.
* **Python** (:class:`RecordStore`, the fall-back): cupti-python's callback hands over one
  object per record; each record's bytes are copied and decoded a drain at once through
  cupti-python's numpy layouts. Many times dearer per record, all of it under the GIL.

The C path's columns equal the Python path's field for field (the tests check it on buffers of
every record version CUPTI 12.6 to 13.5 writes).
"""

from __future__ import annotations

import ctypes
import enum
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import numpy as np

from xsp.tracers.cuda.clock import CuptiClock

BUFFER_BYTES: Final = 8 << 20
"""Size of each activity buffer handed to CUPTI."""
MAX_BUFFERS: Final = 32
"""Buffers the C path lets CUPTI hold at once (256 MiB): past them CUPTI drops records, counted."""


class Kind(IntEnum):
    """CUPTI activity kinds xsp reads (values of ``cupti.ActivityKind``)."""

    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    MEMCPY2 = 22  # peer-to-peer copies (between GPUs)
    SYNCHRONIZATION = 38
    EXTERNAL_CORRELATION = 39


API_KINDS: Final = (Kind.RUNTIME, Kind.DRIVER)
ACTIVITY_KINDS: Final = (Kind.CONCURRENT_KERNEL, Kind.MEMCPY, Kind.MEMCPY2, Kind.MEMSET, Kind.SYNCHRONIZATION)
EXTERNAL_KIND_CUSTOM0: Final = 3
"""``cupti.ExternalCorrelationKind.CUSTOM0``: the external ids xsp pushes."""


class Family(str, enum.Enum):
    """Record kinds that share one layout, and the columns made of them."""

    API = "api"  # runtime and driver calls
    KERNEL = "kernel"  # concurrent and serial kernels
    MEMCPY = "memcpy"
    MEMSET = "memset"
    SYNC = "sync"
    EXTERNAL = "external"  # external correlation
    MEMCPY_PEER = "memcpy_peer"  # peer-to-peer copies (CUPTI's MEMCPY2 kind)


FIELDS: Final[dict[Family, dict[str, str]]] = {
    Family.API: {"kind": "u4", "start": "u8", "end": "u8", "correlation_id": "u4", "cbid": "u4",
                 "thread_id": "u4", "process_id": "u4", "return_value": "u4"},
    Family.KERNEL: {"start": "u8", "end": "u8", "correlation_id": "u4", "name": "u4",
                    "grid_x": "i4", "grid_y": "i4", "grid_z": "i4", "block_x": "i4", "block_y": "i4",
                    "block_z": "i4", "registers_per_thread": "u2", "static_shared_memory": "i4",
                    "dynamic_shared_memory": "i4", "stream_id": "u4", "device_id": "u4", "graph_id": "u4",
                    "graph_node_id": "u8", "source_graph_node_id": "u8"},
    Family.MEMCPY: {"start": "u8", "end": "u8", "correlation_id": "u4", "bytes": "u8", "copy_kind": "u1",
                    "stream_id": "u4", "device_id": "u4", "graph_id": "u4", "graph_node_id": "u8",
                    "source_graph_node_id": "u8"},
    Family.MEMSET: {"start": "u8", "end": "u8", "correlation_id": "u4", "bytes": "u8", "value": "u4",
                    "stream_id": "u4", "device_id": "u4", "graph_id": "u4", "graph_node_id": "u8",
                    "source_graph_node_id": "u8"},
    Family.SYNC: {"start": "u8", "end": "u8", "correlation_id": "u4", "type": "i4", "stream_id": "u4",
                  "cuda_event_id": "u4"},
    Family.EXTERNAL: {"external_kind": "i4", "external_id": "u8", "correlation_id": "u4"},
    Family.MEMCPY_PEER: {"start": "u8", "end": "u8", "correlation_id": "u4", "bytes": "u8", "copy_kind": "u1",
                         "stream_id": "u4", "device_id": "u4", "src_device_id": "u4", "dst_device_id": "u4"},
}
"""The columns of each family and their numpy dtypes (the C path's formats). A kernel's
``name`` is the index of its mangled name in :attr:`ActivityColumns.kernel_names`."""

_FAMILY_OF_KIND: Final = {Kind.RUNTIME: Family.API, Kind.DRIVER: Family.API, Kind.KERNEL: Family.KERNEL,
                          Kind.CONCURRENT_KERNEL: Family.KERNEL, Kind.MEMCPY: Family.MEMCPY,
                          Kind.MEMSET: Family.MEMSET, Kind.SYNCHRONIZATION: Family.SYNC,
                          Kind.EXTERNAL_CORRELATION: Family.EXTERNAL, Kind.MEMCPY2: Family.MEMCPY_PEER}


class Lost(str, enum.Enum):
    """What the counts of records lost on the way are called (the trace's ``dropped``)."""

    BY_CUPTI = "CUDA activity records CUPTI dropped (its buffers were full)"
    BUFFERS_REFUSED = "CUPTI buffer requests xsp refused (all its buffers were in use)"
    UNREADABLE = "unreadable CUPTI records"
    CUT_SHORT = "CUPTI buffers cut short (the records after an incomplete one are lost)"
    CORRELATION = "external correlation ids CUPTI refused"
    FOREIGN = "CUPTI buffers of another client (not read)"
    GRAPH_NODE_UNREADABLE = "CUDA graph node callbacks xsp could not read"
    OUT_OF_MEMORY = "CUPTI record drains that ran out of memory (their records are lost)"
    NO_TIMESTAMP = "gpu_no_timestamp"
    """Activities CUPTI wrote without a time (its header: concurrent-kernel records "may contain
    invalid (0) timestamps"): drawn, they would lie near the epoch, 56 years before the run."""
    END_BEFORE_START = "gpu_end_before_start"
    OUTSIDE_SESSION = "gpu_time_outside_session"
    """Records timed well before the subscription opened or after they were read: a timestamp not
    on the clock of the others (pytorch#192021: once the timestamp callback had been registered
    again, CUPTI's first kernel records of a session came about 1e14 ns off)."""
    BEFORE_LAUNCH = "gpu_before_its_launch"
    """GPU work timed to start well before the API call that launched it began (the same fault,
    within the subscription's time)."""


OUTSIDE_SESSION_SLACK_NS: Final = 1_000_000_000
"""How far before the subscription opened, or after its records were read, a record may lie
before it is counted out of range (the clock's measured uncertainty is microseconds)."""
BEFORE_LAUNCH_SLACK_NS: Final = 10_000_000
"""How far before its launch's start GPU work may be timed before it is counted out of range
(CUPTI puts GPU times on the CPU's time base within microseconds; the fault is hours)."""


def _empty(family: Family) -> dict[str, np.ndarray]:
    return {name: np.empty(0, dtype=dtype) for name, dtype in FIELDS[family].items()}


@dataclass
class ActivityColumns:
    """One drain's records: per family, one array per field (see :data:`FIELDS`)."""

    families: dict[Family, dict[str, np.ndarray]] = field(
        default_factory=lambda: {family: _empty(family) for family in Family})
    kernel_names: Sequence[str] = ()
    """Mangled kernel names, indexed by the kernels' ``name`` column."""

    def __getitem__(self, family: Family) -> dict[str, np.ndarray]:
        return self.families[family]

    def count(self, family: Family) -> int:
        return len(next(iter(self.families[family].values())))

    def __len__(self) -> int:
        return sum(self.count(family) for family in Family)

    def where(self, family: Family, keep: np.ndarray) -> ActivityColumns:
        """These columns with only the rows of ``family`` where ``keep`` is true."""
        families = dict(self.families)
        families[family] = {name: values[keep] for name, values in self.families[family].items()}
        return ActivityColumns(families, self.kernel_names)

    def then(self, later: ActivityColumns) -> ActivityColumns:
        """These records followed by ``later``'s (whose kernel names extend these ones')."""
        if not len(self):
            return later
        families = {family: {name: np.concatenate([values, later[family][name]])
                             for name, values in self.families[family].items()} for family in Family}
        return ActivityColumns(families, later.kernel_names)

    def without_bad_times(self, clock: CuptiClock, opened_ns: int | None, read_ns: int,
                          ) -> tuple[ActivityColumns, Counter[str]]:
        """These records less those no span can be drawn of, or drawn where it happened, and how
        many of each were left out: a start or end of 0; an end before the start; a time more
        than :data:`OUTSIDE_SESSION_SLACK_NS` before ``opened_ns`` (when the subscription
        opened, host clock; None: not checked) or after ``read_ns`` (when they were read); GPU
        work timed more than :data:`BEFORE_LAUNCH_SLACK_NS` before the start of the API call
        that launched it (when that call is among these records)."""
        lost: Counter[str] = Counter()
        columns = self
        api = self[Family.API]
        order = np.lexsort((api["start"], api["correlation_id"]))  # of a repeated id, the earliest first
        launch_ids, launch_starts = api["correlation_id"][order], api["start"][order].astype(np.int64)
        for family in Family:
            times = self[family]
            if "start" not in times or not len(times["start"]):
                continue
            start, end = times["start"], times["end"]
            untimed = (start == 0) | (end == 0)
            backwards = ~untimed & (end < start)
            timed = ~(untimed | backwards)
            outside = timed & (clock.to_host_ns(end) > read_ns + OUTSIDE_SESSION_SLACK_NS)
            if opened_ns is not None:
                outside |= timed & (clock.to_host_ns(start) < opened_ns - OUTSIDE_SESSION_SLACK_NS)
            early = np.zeros(len(start), dtype=bool)
            if family is not Family.API and len(launch_ids):
                at = np.minimum(np.searchsorted(launch_ids, times["correlation_id"]), len(launch_ids) - 1)
                launched = launch_ids[at] == times["correlation_id"]
                early = timed & ~outside & launched & (start.astype(np.int64)
                                                       < launch_starts[at] - BEFORE_LAUNCH_SLACK_NS)
            for what, rows in ((Lost.NO_TIMESTAMP, untimed), (Lost.END_BEFORE_START, backwards),
                               (Lost.OUTSIDE_SESSION, outside), (Lost.BEFORE_LAUNCH, early)):
                lost[what.value] += int(rows.sum())
            keep = timed & ~outside & ~early
            if not keep.all():
                columns = columns.where(family, keep)
        return columns, +lost

    def split(self, closed_ns: int, held_since_ns: Mapping[int, int], clock: CuptiClock,
              ) -> tuple[ActivityColumns, ActivityColumns]:
        """``(now, later)``: the records of a window taken at ``closed_ns`` (host clock), and
        those that belong to a later one: CUDA calls made after it was taken, or on a thread it
        left for later since that thread's time in ``held_since_ns`` (``Window.held_since_ns``),
        with the GPU work and external ids they launched. GPU work whose launch is not among
        these records goes by its own start."""
        api = self[Family.API]
        api_host_ns = clock.to_host_ns(api["start"])
        api_later = api_host_ns >= closed_ns
        for thread, since_ns in held_since_ns.items():
            api_later |= (api["thread_id"] == thread) & (api_host_ns >= since_ns)
        launches = api["correlation_id"]
        later_launches = launches[api_later]
        later = {Family.API: api_later}
        for family in Family:
            if family is Family.API:
                continue
            correlation = self[family]["correlation_id"]
            by_launch = np.isin(correlation, later_launches)
            if "start" in self[family]:
                unlaunched = ~np.isin(correlation, launches)
                by_launch |= unlaunched & (clock.to_host_ns(self[family]["start"]) >= closed_ns)
            later[family] = by_launch
        now = {family: {name: values[~later[family]] for name, values in self.families[family].items()}
               for family in Family}
        then = {family: {name: values[later[family]] for name, values in self.families[family].items()}
                for family in Family}
        return ActivityColumns(now, self.kernel_names), ActivityColumns(then, self.kernel_names)


# The Python path: one object per record ------------------------------------------------------
# The tuple kept of each record, its first item the kind:
#   API:        (kind, start, end, correlation_id, cbid, thread_id, process_id, return_value)
#   kernel:     (kind, start, end, correlation_id, name, grid_x, grid_y, grid_z, block_x, block_y,
#                block_z, registers_per_thread, static_shared_memory, dynamic_shared_memory,
#                stream_id, device_id, graph_id)
#   memcpy:     (kind, start, end, correlation_id, bytes, copy_kind, stream_id, device_id)
#   memset:     (kind, start, end, correlation_id, bytes, value, stream_id, device_id)
#   sync:       (kind, start, end, correlation_id, type, stream_id, cuda_event_id)
#   external:   (kind, external_kind, external_id, correlation_id)
#   peer copy:  (kind, start, end, correlation_id, bytes, copy_kind, stream_id, device_id, src_device_id,
#                dst_device_id)
# After the kind (kept only for API calls) the items are the family's columns, in order.

def record_tuple(record: Any) -> tuple[Any, ...] | None:
    """The tuple kept for one CUPTI activity record, or None for a kind xsp does not read."""
    kind = record.kind
    if kind == Kind.CONCURRENT_KERNEL or kind == Kind.KERNEL:
        return (Kind.CONCURRENT_KERNEL, record.start, record.end, record.correlation_id, record.name,
                record.grid_x, record.grid_y, record.grid_z, record.block_x, record.block_y, record.block_z,
                record.registers_per_thread, record.static_shared_memory, record.dynamic_shared_memory,
                record.stream_id, record.device_id, record.graph_id, record.graph_node_id,
                getattr(record, "source_graph_node_id", 0))
    if kind == Kind.RUNTIME or kind == Kind.DRIVER:
        return (kind, record.start, record.end, record.correlation_id, record.cbid, record.thread_id,
                record.process_id, record.return_value)
    if kind == Kind.EXTERNAL_CORRELATION:
        return (kind, record.external_kind, record.external_id, record.correlation_id)
    if kind == Kind.MEMCPY:
        return (kind, record.start, record.end, record.correlation_id, record.bytes, record.copy_kind,
                record.stream_id, record.device_id, record.graph_id, record.graph_node_id,
                getattr(record, "source_graph_node_id", 0))
    if kind == Kind.MEMSET:
        return (kind, record.start, record.end, record.correlation_id, record.bytes, record.value,
                record.stream_id, record.device_id, record.graph_id, record.graph_node_id,
                getattr(record, "source_graph_node_id", 0))
    if kind == Kind.SYNCHRONIZATION:
        return (kind, record.start, record.end, record.correlation_id, record.type, record.stream_id,
                record.cuda_event_id)
    if kind == Kind.MEMCPY2:
        return (kind, record.start, record.end, record.correlation_id, record.bytes, record.copy_kind,
                record.stream_id, record.device_id, record.src_device_id, record.dst_device_id)
    return None


def columns_from_tuples(records: Iterable[tuple[Any, ...]], names: dict[str, int] | None = None) -> ActivityColumns:
    """The columns of the Python path's tuples, kernel names interned in order of first use
    (in ``names``, which may hold the names of earlier drains, and is added to)."""
    grouped: dict[Family, list[tuple[Any, ...]]] = {family: [] for family in Family}
    for record in records:
        family = _FAMILY_OF_KIND.get(record[0])
        if family is not None:
            grouped[family].append(record if family is Family.API else record[1:])
    names = {} if names is None else names
    families = {}
    for family, rows in grouped.items():
        if not rows:
            families[family] = _empty(family)
            continue
        values = list(zip(*rows))
        if family is Family.KERNEL:
            values[3] = tuple(names.setdefault(name, len(names)) for name in values[3])
        families[family] = {name: np.array(items, dtype=dtype)
                            for (name, dtype), items in zip(FIELDS[family].items(), values)}
    return ActivityColumns(families, list(names))


# Reading a record's fields one attribute at a time costs ~1.5 us in cupti-python 13.4 but
# ~50-100 us in 13.0 (each attribute goes through a numpy record), the version torch's CUDA 13.0
# builds get. So the callback copies each record's bytes (its address and one memcpy) and the
# fields are read later, a whole drain at once, through the numpy layout cupti-python gives each
# record type.
_RAW_FIELDS = {
    "API": ("kind", "start", "end", "correlation_id", "cbid", "thread_id", "process_id", "return_value"),
    "Kernel": ("kind", "start", "end", "correlation_id", "name", "grid_x", "grid_y", "grid_z", "block_x",
               "block_y", "block_z", "registers_per_thread", "static_shared_memory", "dynamic_shared_memory",
               "stream_id", "device_id", "graph_id", "graph_node_id", "source_graph_node_id"),
    "Memcpy": ("kind", "start", "end", "correlation_id", "bytes", "copy_kind", "stream_id", "device_id", "graph_id",
               "graph_node_id", "source_graph_node_id"),
    "Memset": ("kind", "start", "end", "correlation_id", "bytes", "value", "stream_id", "device_id", "graph_id",
               "graph_node_id", "source_graph_node_id"),
    "Synchronization": ("kind", "start", "end", "correlation_id", "type", "stream_id", "cuda_event_id"),
    "ExternalCorrelation": ("kind", "external_kind", "external_id", "correlation_id"),
    "MemcpyPtoP": ("kind", "start", "end", "correlation_id", "bytes", "copy_kind", "stream_id", "device_id",
                   "src_device_id", "dst_device_id"),
}
"""The fields kept of each record family, in the order of the tuples above."""
_OPTIONAL_FIELDS: Final = frozenset({"source_graph_node_id"})
"""Fields the older record versions lack (kernel 13, memcpy 7 and memset 5, CUPTI 13.4, have
them): 0 there."""
_RECORD_CLASS = re.compile(r"Activity(API|Kernel|MemcpyPtoP|Memcpy|Memset|Synchronization|ExternalCorrelation)(\d*)$")
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
        if dtype is not None and set(fields) - _OPTIONAL_FIELDS <= set(names) and hasattr(record_type, "ptr"):
            layout = RawLayout(dtype, fields, int(dtype.fields["name"][1]) if family == "Kernel" else None)
    _LAYOUTS[record_type] = layout
    return layout


def decode(layout: RawLayout, blobs: list[bytes], names: list[str]) -> list[tuple[Any, ...]]:
    """The tuples of the records whose bytes are ``blobs`` (``names``: their kernels' names)."""
    values = np.frombuffer(b"".join(blobs), dtype=layout.dtype)
    present = layout.dtype.names or ()
    columns: list[list[Any]] = [values[name].tolist() if name in present else [0] * len(values)
                                for name in layout.fields]
    if layout.name_offset is not None:
        columns[0] = [Kind.CONCURRENT_KERNEL] * len(values)
        columns[4] = names
    return list(zip(*columns))


@dataclass
class RecordStore:
    """The Python path: what cupti-python's callback handed over, each record's bytes (or, for a
    record type without a known layout, its tuple), with what could not be read counted."""

    records: list[tuple[Any, ...]] = field(default_factory=list)
    raw: dict[RawLayout, tuple[list[bytes], list[str]]] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    kernel_names: dict[str, int] = field(default_factory=dict)
    """Every kernel name drained so far, by id (ids hold across drains, as the C path's do)."""
    cupti_drops: Counter[str] = field(default_factory=Counter)
    """Over the subscription, as the C path counts them: ``records_dropped_by_cupti``,
    ``buffers_with_records_dropped``, ``most_records_dropped_in_a_buffer``."""

    def count_cupti_drops(self, dropped: int) -> None:
        """CUPTI said it dropped ``dropped`` records since the last buffer it completed."""
        if dropped <= 0:
            return
        with self.lock:
            self.dropped[Lost.BY_CUPTI.value] += dropped
            self.cupti_drops["records_dropped_by_cupti"] += dropped
            self.cupti_drops["buffers_with_records_dropped"] += 1
            self.cupti_drops["most_records_dropped_in_a_buffer"] = max(
                self.cupti_drops["most_records_dropped_in_a_buffer"], dropped)

    def on_completed(self, activities: Iterable[Any]) -> None:
        """cupti-python's buffer-completed callback: each record's bytes copied, one lock per buffer."""
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
                self.dropped[Lost.UNREADABLE.value] += unread

    def drain(self) -> tuple[ActivityColumns, Counter[str]]:
        """Everything kept so far as columns (and the drop counts), leaving the store empty."""
        with self.lock:
            records, self.records = self.records, []
            raw, self.raw = self.raw, {}
            dropped, self.dropped = self.dropped, Counter()
        for layout, (blobs, names) in raw.items():
            try:
                records.extend(decode(layout, blobs, names))
            except Exception:
                dropped[Lost.UNREADABLE.value] += len(blobs)
        return columns_from_tuples(records, self.kernel_names), dropped


_UNSEEN: Any = object()


# The C path ----------------------------------------------------------------------------------
def native_module() -> Any:
    """``xsp.record._activity``, or None where it was not built (or ``XSP_PURE_PYTHON`` is set)."""
    from xsp.record.hotpath import optional_extension

    return optional_extension("xsp.record._activity")


_NATIVE_COUNTS: Final = {"dropped_by_cupti": Lost.BY_CUPTI, "buffers_refused": Lost.BUFFERS_REFUSED,
                         "unreadable": Lost.UNREADABLE, "cut_short": Lost.CUT_SHORT,
                         "correlation_failed": Lost.CORRELATION, "foreign_buffers": Lost.FOREIGN}


class NativeRecords:
    """The C path: ``xsp.record._activity`` bound to the loaded libcupti, its callbacks registered.

    Kernel names are interned for the process (CUPTI's buffers are the process's), so
    :attr:`kernel_names` only grows and every drain's ``name`` column indexes into it.
    """

    kernel_names: list[str] = []
    """Every kernel name the C path has interned in this process, by id."""

    def __init__(self, module: Any, bound: dict[str, Any], zeroed_by_xsp: bool) -> None:
        self.module = module
        self.bound = bound
        self.zeroed_by_xsp = zeroed_by_xsp
        self.totals: Counter[str] = Counter()
        """Counts over the subscription: records, buffers, kinds skipped, sizes unexpected."""

    @classmethod
    def open(cls, library: str | None = None, major: int | None = None) -> NativeRecords:
        """Bind to the loaded libcupti (``library``: its path; None finds it, and where several
        are loaded takes the one of CUDA release ``major``, cupti-python's) and register the C
        callbacks: from here xsp must not register cupti-python's.

        Raises:
            OSError: no C record path here (not built, no libcupti loaded, a CUPTI version whose
                records xsp does not know); the message says why, in one line.
            RuntimeError: CUPTI refused the callbacks.
        """
        bound = cls.bind_only(library, major)
        module = native_module()
        zeroed = module.register(BUFFER_BYTES, MAX_BUFFERS)
        return cls(module, bound, bool(zeroed))

    @staticmethod
    def bind_only(library: str | None = None, major: int | None = None) -> dict[str, Any]:
        """Bind as :meth:`open` does, registering nothing (to tell whether the C path would run).

        Raises:
            OSError: as :meth:`open`.
        """
        module = native_module()
        if module is None:
            raise OSError("xsp's C record path (xsp.record._activity) is not built here, or XSP_PURE_PYTHON is set")
        return module.bind(library, major or 0)  # type: ignore[no-any-return]

    def drain(self) -> tuple[ActivityColumns, Counter[str]]:
        """The records of every buffer CUPTI completed since the last drain, and what was lost."""
        lost: Counter[str] = Counter()
        try:
            drained = self.module.drain()
        except MemoryError:
            lost[Lost.OUT_OF_MEMORY.value] += 1
            return ActivityColumns(kernel_names=self.kernel_names), lost
        self.kernel_names.extend(drained["names"])
        families = {family: {name: np.asarray(column) for name, column in drained[family.value].items()}
                    for family in Family}
        for key, what in _NATIVE_COUNTS.items():
            if drained[key]:
                lost[what.value] += drained[key]
        self.totals.update({key: drained[key] for key in ("records", "buffers", "bytes", "other_kinds",
                                                          "size_mismatch", "dropped_by_cupti", "buffers_with_drops")})
        self.totals["most_dropped_in_a_buffer"] = max(self.totals["most_dropped_in_a_buffer"],
                                                      drained["most_dropped_in_a_buffer"])
        return ActivityColumns(families, self.kernel_names), lost

    def use_host_clock(self) -> bool:
        """Have CUPTI stamp records with xsp's host clock (before any kind is enabled); False
        where this libcupti has no timestamp callback, or refused it."""
        return bool(self.module.use_host_clock())

    def restore(self) -> None:
        """Set back every process-wide setting of CUPTI's that the C path changed (the buffers
        handed out zeroed, the clock), after the last flush.

        Raises:
            OSError: CUPTI refused; the message names what stays changed.
        """
        self.module.restore()

    def push(self, external_id: int) -> None:
        self.module.push(external_id)

    def pop(self) -> None:
        self.module.pop()

    @staticmethod
    def can_share(library: str | None = None, major: int | None = None) -> bool:
        """True when the C path binds here to a libcupti that can share CUPTI with other clients
        (13.5's multi-subscriber mode, with every ``_v2`` call xsp makes)."""
        try:
            NativeRecords.bind_only(library, major)
        except OSError:
            return False
        return bool(native_module().can_share())

    @staticmethod
    def share(subscriber: int | None) -> None:
        """Make every CUPTI call of the C path for xsp's ``subscriber`` (its ``_v2`` form): set
        before :meth:`open` registers the callbacks; None goes back to the one-subscriber calls."""
        native_module().share(subscriber)

    def count_drops(self) -> None:
        """Have the next drain count what CUPTI dropped after its last completed buffer."""
        self.module.count_drops()

    def register_again(self) -> None:
        """Register the C callbacks once more (another CUPTI client registered its own meanwhile).

        Raises:
            RuntimeError: CUPTI refused the callbacks.
        """
        self.zeroed_by_xsp = bool(self.module.register(BUFFER_BYTES, MAX_BUFFERS))

    def close(self) -> None:
        """After the last drain of a subscription: the pool's idle buffers are freed."""
        self.module.trim()

    def metadata(self) -> dict[str, Any]:
        return {"record_path": "C", "libcupti": self.bound["path"], "cupti_api_version": self.bound["version"],
                "cupti_release": self.bound["release"],
                "buffers_zeroed_by": "xsp" if self.zeroed_by_xsp else "CUPTI",
                "records_read": self.totals["records"], "buffers_read": self.totals["buffers"],
                "records_of_other_kinds": self.totals["other_kinds"],
                "records_of_unexpected_size": self.totals["size_mismatch"],
                "records_dropped_by_cupti": self.totals["dropped_by_cupti"],
                "buffers_with_records_dropped": self.totals["buffers_with_drops"],
                "most_records_dropped_in_a_buffer": self.totals["most_dropped_in_a_buffer"]}
