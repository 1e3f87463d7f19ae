"""A stand-in for ``cupti.cupti`` on machines without a GPU, built on cupti-python's real records.

It keeps CUPTI's contract as xsp uses it: one subscriber, activity kinds enabled one by one,
a completed-buffer callback fed on flush, a time base of its own, and a stack of external
correlation ids. ``launch()`` plays a CUDA runtime call made by the calling thread: an API
record (with the external id on top of the stack) and the kernel it launches.

With a ``library`` (the fake libcupti of :mod:`tests.native_cupti`) it plays the control plane
of xsp's C record path: records are staged as bytes in that library, which hands them to xsp's
C callbacks on flush, and the external-id stack is the library's, pushed from C.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from typing import Any

import numpy as np
from cupti import cupti as real

from xsp.tracers.cuda.records import Kind
from xsp.tracers.cuda.rows import api_enum

KERNEL_RECORD = max((getattr(real, name) for name in dir(real) if name.startswith("ActivityKernel")
                     and name[len("ActivityKernel"):].isdigit()),
                    key=lambda record: int(record.__name__[len("ActivityKernel"):]))
"""The newest kernel record of this cupti-python (``ActivityKernel13`` in 13.4, ``10`` in 13.0)."""


class CuptiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUPTI error {status}")
        self.status = status


MULTIPLE_SUBSCRIBERS = int(real.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)


NODE_HANDLES, GRAPH_HANDLES = 0x10_0000, 0x20_0000
"""Where the fake's graph node and graph handles begin (a handle is its id plus this)."""


class FakeCupti:
    Result = real.Result
    CallbackDomain = real.CallbackDomain
    ResourceData = real.ResourceData
    GraphData = real.GraphData
    RuntimeApiTraceCbid = api_enum(real, Kind.RUNTIME)
    DriverApiTraceCbid = api_enum(real, Kind.DRIVER)

    def __init__(self, clock_offset_ns: int = 1_700_000_000_000_000_000, skew_ns: int = 0,
                 held_by_other: bool = False, per_call_switch: bool = True, library: Any = None) -> None:
        self.library = library
        """The fake libcupti xsp's C path binds to, or None (records go through the callback)."""
        self._library_pushes = 0 if library is None else library.pushes()
        self.python_callbacks = 0
        """Times xsp registered cupti-python's buffer callbacks (never, on the C path)."""
        self.clock_offset_ns = clock_offset_ns
        """CUPTI time = xsp host time + this (what the tracer must measure)."""
        self.skew_ns = skew_ns
        """Added to record times only, not to get_timestamp(): a clock the measurement misses."""
        self.held_by_other = held_by_other
        self.holder_name: str | None = None
        """What CUPTI calls the client that holds it (``CUPTI for Nsight Systems``), told to a
        ``cuptiSubscribe_v2`` it refuses; None: CUPTI does not say."""
        self.has_subscribe_v2 = True
        """cupti-python binds ``cuptiSubscribe_v2`` and libcupti has it (CUPTI 13.3 on)."""
        self.subscriber_names: list[str] = []
        """The names clients gave ``cuptiSubscribe_v2``."""
        self.callback: Any = None
        """The subscriber's callback (what CUPTI calls for the callbacks enabled)."""
        self.callbacks_enabled: set[tuple[int, int]] = set()
        """``(domain, cbid)`` of the callbacks enabled on xsp's subscription."""
        self.capturing_graph: int | None = None
        """While set, launches on any thread are captured into this graph (stream capture): each
        makes a node, and no kernel runs."""
        self.captured: list[int] = []
        """The nodes captured, in order."""
        self.reports_source_node = True
        """Replayed records name the captured node they came from (``sourceGraphNodeId``, CUPTI
        13.4 on); False: only the executable graph's node (older CUPTI)."""
        self._original_of: dict[int, int] = {}
        self._next_node = 1
        self.other_shares = False
        """The client holding CUPTI (``held_by_other``) subscribed in the multi-subscriber mode:
        a client asking for it too subscribes beside it (CUPTI 13.5)."""
        self.shared = False
        """xsp's subscription shares CUPTI: its calls must then be the ``_v2`` ones, made in C."""
        self.per_call_switch = per_call_switch
        """Has ``activity_enable_runtime_api``/``_driver_api`` (cupti-python's bindings of 12.6 on do)."""
        self.silenced: set[tuple[int, int]] = set()
        """``(kind, cbid)`` of the API calls CUPTI was told to make no records of."""
        self.subscribers = 0
        self.enabled: set[int] = set()
        self.completed: Any = None
        self.pending: list[Any] = []
        self.dropped_pending = 0
        self._stack: list[int] = []
        self._pushes = 0
        self.correlation = 0
        self.flushes: list[int] = []
        self.lock = threading.Lock()
        self.slew = 0.0
        """CUPTI's clock runs this much faster than the host's (an NTP slew: 0.0005 is 500 ppm)."""
        self._slew_from_ns = time.perf_counter_ns()
        self.calls: list[tuple[Any, ...]] = []
        """The control-plane calls xsp made, in order: ``("enable", kind)``, ``("flush", flag)``..."""
        self.thread_id_type = 0
        """The process's thread-id type (CUPTI's default: 0)."""
        self.while_ending: Any = None
        """Run once, as another thread would, right after xsp's first disable or forced flush at the end."""

    # clock ---------------------------------------------------------------------------
    def get_timestamp(self) -> int:
        """CUPTI's clock: xsp's host clock once the C path handed CUPTI its timestamp callback,
        else a clock of its own (offset from the host's, perhaps slewing)."""
        if self.library is not None and self.library.has_timestamp_callback():
            return int(self.library.timestamp())
        now = time.perf_counter_ns()
        return now + self.clock_offset_ns + int(self.slew * (now - self._slew_from_ns))

    def is_enabled(self, kind: int) -> bool:
        """xsp has enabled records of ``kind``: as CUPTI's one subscriber, or for its shared one."""
        return int(kind) in self.enabled or (self.library is not None and bool(self.library.enabled_v2(int(kind))))

    def undelivered(self) -> int:
        """Records made but never handed to xsp (still in CUPTI's buffers)."""
        return len(self.pending) if self.library is None else int(self.library.staged())

    def _ending(self) -> None:
        hook, self.while_ending = self.while_ending, None
        if hook is not None:
            hook()

    # subscription ---------------------------------------------------------------------
    def subscribe(self, callback: Any, userdata: Any) -> int:
        if self.held_by_other or self.subscribers:
            raise CuptiError(MULTIPLE_SUBSCRIBERS)
        self.subscribers += 1
        self.calls.append(("subscribe",))
        self.callback = callback
        return 1234

    def enable_callback(self, enable: int, subscriber: int, domain: int, cbid: int) -> None:
        assert subscriber == 1234
        (self.callbacks_enabled.add if enable else self.callbacks_enabled.discard)((int(domain), int(cbid)))

    def get_graph_node_id(self, node: int) -> int:
        return node - NODE_HANDLES

    def get_graph_id(self, graph: int) -> int:
        return graph - GRAPH_HANDLES

    # CUDA graphs --------------------------------------------------------------------------
    def _graph_callback(self, cbid: int, node: int, graph: int, original: int = 0) -> None:
        """CUPTI's resource callback for a node made (13) or cloned (20), on this thread, with a
        ``CUpti_ResourceData`` whose descriptor is a ``CUpti_GraphData``, as CUPTI passes them."""
        domain = int(real.CallbackDomain.RESOURCE)
        if (domain, cbid) not in self.callbacks_enabled or self.callback is None:
            return
        graph_data = np.zeros(1, dtype=real.graph_data_dtype)
        graph_data["node"], graph_data["graph"] = node + NODE_HANDLES, graph + GRAPH_HANDLES
        graph_data["original_node"] = original + NODE_HANDLES if original else 0
        graph_data["node_type"] = 0  # CU_GRAPH_NODE_TYPE_KERNEL
        resource = np.zeros(1, dtype=real.resource_data_dtype)
        resource["resource_descriptor"] = graph_data.ctypes.data
        self.callback(None, domain, cbid, resource.ctypes.data)

    def instantiate(self, executable_graph: int) -> list[int]:
        """cudaGraphInstantiate of the captured nodes: each cloned into ``executable_graph``; the
        clones' ids, in order."""
        clones = []
        for node in self.captured:  # CUPTI makes each clone (13), then says what it cloned (20)
            clone = self._new_node()
            self._original_of[clone] = node
            self._graph_callback(13, clone, executable_graph)
            self._graph_callback(20, clone, executable_graph, original=node)
            clones.append(clone)
        return clones

    def replay(self, clones: list[int], executable_graph: int, work_ns: int = 20_000) -> None:
        """A cudaGraphLaunch on this thread, and one kernel per node, each with its node's id."""
        with self.lock:
            self.correlation += 1
            correlation = self.correlation
        start = self.get_timestamp() + self.skew_ns
        end = self.get_timestamp() + self.skew_ns + 1_000
        records = self._call_records(self.RuntimeApiTraceCbid.cudaGraphLaunch_v10000, start, end, correlation)
        if self.is_enabled(real.ActivityKind.CONCURRENT_KERNEL):
            begins = end + 5_000
            for clone in clones:
                kernel = kernel_record("_Z6vecAddPfS_S_i", begins, begins + work_ns, correlation)
                kernel.graph_id, kernel.graph_node_id = executable_graph, clone
                if self.reports_source_node and hasattr(kernel, "source_graph_node_id"):
                    kernel.source_graph_node_id = self._original_of.get(clone, 0)
                records.append(kernel)
                begins += work_ns
        self._emit(records)

    def _call_records(self, cbid: Any, start: int, end: int, correlation: int) -> list[Any]:
        """The records of a runtime call on this thread: its own, and the external id on top of
        the stack when it was made (each where its kind is enabled)."""
        records: list[Any] = []
        if self.is_enabled(real.ActivityKind.RUNTIME):
            api = real.ActivityAPI()
            api.kind, api.start, api.end, api.correlation_id = int(real.ActivityKind.RUNTIME), start, end, correlation
            api.cbid = int(cbid)
            api.thread_id, api.process_id, api.return_value = threading.get_native_id(), 1, 0
            records.append(api)
        top = self._top_external_id()
        if top and self.is_enabled(real.ActivityKind.EXTERNAL_CORRELATION):
            external = real.ActivityExternalCorrelation()
            external.kind = int(real.ActivityKind.EXTERNAL_CORRELATION)
            external.external_kind = int(real.ExternalCorrelationKind.CUSTOM0)
            external.external_id, external.correlation_id = top, correlation
            records.append(external)
        return records

    def _new_node(self) -> int:
        with self.lock:
            node, self._next_node = self._next_node, self._next_node + 1
        return node

    def subscribe_v2(self, callback: Any, userdata: Any, p_params: int) -> int:
        """``cuptiSubscribe_v2``: refused, CUPTI writes the holder's name where the caller asked
        (cupti-python without it: an AttributeError, as for a missing binding)."""
        if not self.has_subscribe_v2:
            raise RuntimeError("cuptiSubscribe_v2 is not found in libcupti")  # no status: not CUPTI's refusal
        size, name, old_name, old_size, allow = struct.unpack("<QQQQB", ctypes.string_at(p_params, 33))
        assert size == 40 and old_size >= 64
        self.subscriber_names.append(ctypes.string_at(name).decode())
        if self.holder_name is not None and (self.held_by_other or self.subscribers):
            ctypes.memmove(old_name, self.holder_name.encode()[:old_size - 1] + b"\0",
                           min(len(self.holder_name) + 1, old_size))
        assert not allow or self.library is not None, "xsp asked to share CUPTI off its C path"
        if allow and self.held_by_other and self.other_shares and not self.subscribers:
            self.subscribers += 1
            self.calls.append(("subscribe", "shared"))
        else:
            self.subscribe(callback, userdata)
        if allow:
            self.shared = True
            self.library.set_shared(1234)
        return 1234

    def unsubscribe(self, handle: int) -> None:
        self.subscribers -= 1
        self.calls.append(("unsubscribe",))
        if self.shared:
            self.shared = False
            self.library.set_shared(None)
            # a client that shares CUPTI still holds it: the one-subscriber calls stay refused
            self.library.set_others_sharing(int(self.held_by_other and self.other_shares))

    def _one_subscriber_call(self, name: str) -> None:
        """cupti-python's calls for the process's one subscriber, which xsp must not make while
        it shares CUPTI."""
        assert not self.shared, f"xsp called {name} while it shares CUPTI (the _v2 form is needed)"

    def set_thread_id_type(self, kind: int) -> None:
        self._one_subscriber_call("set_thread_id_type")
        assert kind in (int(real.ActivityThreadIdType.SYSTEM), int(real.ActivityThreadIdType.DEFAULT))
        self.thread_id_type = kind
        self.calls.append(("thread_id_type", kind))

    def get_thread_id_type(self) -> int:
        self._one_subscriber_call("get_thread_id_type")
        return self.thread_id_type

    # activity API -----------------------------------------------------------------------
    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        self._one_subscriber_call("activity_register_callbacks")
        self.python_callbacks += 1
        size, _ = requested()
        assert size > 0
        self.completed = completed

    def activity_enable(self, kind: int) -> None:
        self._one_subscriber_call("activity_enable")
        self.enabled.add(kind)
        self.calls.append(("enable", kind))

    def activity_disable(self, kind: int) -> None:
        self._one_subscriber_call("activity_disable")
        self.enabled.discard(kind)
        self.calls.append(("disable", kind))
        self._ending()

    def activity_enable_runtime_api(self, cbid: int, enable: int) -> None:
        self._switch(int(real.ActivityKind.RUNTIME), cbid, enable)

    def activity_enable_driver_api(self, cbid: int, enable: int) -> None:
        self._switch(int(real.ActivityKind.DRIVER), cbid, enable)

    def _switch(self, kind: int, cbid: int, enable: int) -> None:
        self._one_subscriber_call("activity_enable_runtime_api")
        if not self.per_call_switch:
            raise AttributeError("module 'cupti.cupti' has no attribute 'activity_enable_runtime_api'")
        if enable:
            self.silenced.discard((kind, cbid))
        else:
            self.silenced.add((kind, cbid))

    def activity_flush_all(self, flag: int) -> None:
        self.flushes.append(flag)
        self.calls.append(("flush", flag))
        if self.library is not None:
            self.library.flush(flag)
        else:
            with self.lock:
                records, self.pending = self.pending, []
            if records and self.completed is not None:
                self.completed(records)
        if flag:
            self._ending()

    def activity_get_num_dropped_records(self, context: int, stream_id: int, dropped: int) -> None:
        """What CUPTI dropped since it was last asked (the Python path asks after each buffer)."""
        assert self.library is None, "xsp read CUPTI's drops through cupti-python on its C path"
        with self.lock:
            count, self.dropped_pending = self.dropped_pending, 0
        ctypes.c_size_t.from_address(dropped).value = count

    def add_dropped(self, count: int) -> None:
        """CUPTI dropped ``count`` records (its buffers were full): on either path."""
        if self.library is not None:
            self.library.add_dropped(count)
        else:
            with self.lock:
                self.dropped_pending += count

    def activity_push_external_correlation_id(self, kind: int, external_id: int) -> None:
        self._one_subscriber_call("activity_push_external_correlation_id")
        assert kind == int(real.ExternalCorrelationKind.CUSTOM0)
        assert self.library is None, "xsp pushed through cupti-python while its C path pushes"
        self._stack.append(external_id)
        self._pushes += 1

    def activity_pop_external_correlation_id(self, kind: int) -> int:
        return self._stack.pop()

    @property
    def stack_depth(self) -> int:
        """The calling thread's external ids on CUPTI's stack."""
        return self.library.depth() if self.library is not None else len(self._stack)

    @property
    def pushes(self) -> int:
        return self.library.pushes() - self._library_pushes if self.library is not None else self._pushes

    def _top_external_id(self) -> int | None:
        if self.library is not None:
            return self.library.depth() and self.library.top_external_id()
        return self._stack[-1] if self._stack else None

    def _emit(self, records: list[Any]) -> None:
        """What CUPTI would write: record objects for the callback, or bytes in the library."""
        if self.library is None:
            with self.lock:
                self.pending.extend(records)
            return
        self.library.stage(b"".join(to_bytes(record, self.library) for record in records))

    # what the GPU would do --------------------------------------------------------------
    def query(self) -> None:
        """A cudaGetDevice on this thread, with the driver call it makes (neither runs GPU work)."""
        calls = ((real.ActivityKind.RUNTIME, self.RuntimeApiTraceCbid.cudaGetDevice_v3020),
                 (real.ActivityKind.DRIVER, self.DriverApiTraceCbid.cuDevicePrimaryCtxGetState))
        for kind, cbid in calls:
            if not self.is_enabled(kind) or (int(kind), int(cbid)) in self.silenced:
                continue
            with self.lock:
                self.correlation += 1
                correlation = self.correlation
            api = real.ActivityAPI()
            api.kind, api.correlation_id, api.cbid = int(kind), correlation, int(cbid)
            api.start = self.get_timestamp() + self.skew_ns
            api.end = api.start + 300
            api.thread_id, api.process_id, api.return_value = threading.get_native_id(), 1, 0
            self._emit([api])

    def launch(self, kernel: str = "_Z6vecAddPfS_S_i", work_ns: int = 20_000, untimed: bool = False,
               misclocked_ns: int = 0) -> None:
        """A cudaLaunchKernel on this thread, and the kernel it runs (``untimed``: a kernel record
        CUPTI could not time, start and end 0; ``misclocked_ns``: added to the kernel's times, as
        CUPTI did to the first kernels of a session in pytorch#192021, about -1e14)."""
        with self.lock:
            self.correlation += 1
            correlation = self.correlation
        start = self.get_timestamp() + self.skew_ns
        time.sleep(0)  # the call takes a little time
        if self.capturing_graph is not None:  # captured: the launch makes a node, inside the call
            node = self._new_node()
            self.captured.append(node)
            self._graph_callback(13, node, self.capturing_graph)
        end = self.get_timestamp() + self.skew_ns
        records = self._call_records(self.RuntimeApiTraceCbid.cudaLaunchKernel_v7000, start, end, correlation)
        if self.is_enabled(real.ActivityKind.CONCURRENT_KERNEL) and self.capturing_graph is None:
            begins = 0 if untimed else end + 5_000 + misclocked_ns
            records.append(kernel_record(kernel, begins, begins + work_ns if begins else 0, correlation))
        self._emit(records)


def kernel_record(name: str, start: int, end: int, correlation: int) -> Any:
    record = KERNEL_RECORD()
    record.kind = int(real.ActivityKind.CONCURRENT_KERNEL)
    record.start, record.end, record.correlation_id, record.name = start, end, correlation, name
    record.grid_x, record.grid_y, record.grid_z = 128, 2, 1
    record.block_x, record.block_y, record.block_z = 256, 1, 1
    record.registers_per_thread, record.static_shared_memory, record.dynamic_shared_memory = 32, 1024, 4096
    record.stream_id, record.device_id, record.graph_id = 7, 0, 0
    return record


_FIELDS = {"ActivityAPI": ("activity_api_dtype", ("kind", "start", "end", "correlation_id", "cbid", "thread_id",
                                                  "process_id", "return_value")),
           "ActivityExternalCorrelation": ("activity_external_correlation_dtype",
                                           ("kind", "external_kind", "external_id", "correlation_id")),
           KERNEL_RECORD.__name__: (f"activity_kernel{KERNEL_RECORD.__name__[len('ActivityKernel'):]}_dtype",
                                    ("kind", "start", "end", "correlation_id", "grid_x", "grid_y", "grid_z",
                                     "block_x", "block_y", "block_z", "registers_per_thread", "static_shared_memory",
                                     "dynamic_shared_memory", "stream_id", "device_id", "graph_id",
                                     "graph_node_id", *(("source_graph_node_id",) if hasattr(
                                         KERNEL_RECORD(), "source_graph_node_id") else ())))}


def to_bytes(record: Any, library: Any) -> bytes:
    """A record object's bytes as CUPTI writes them (its kernel name a pointer into ``library``)."""
    layout, names = _FIELDS[type(record).__name__]
    value = np.zeros(1, dtype=getattr(real, layout))
    for name in names:
        value[name] = getattr(record, name)
    if "name" in value.dtype.names and type(record) is KERNEL_RECORD:
        value["name"] = library.name_pointer(record.name)
    return value.tobytes()
