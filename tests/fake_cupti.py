"""A stand-in for ``cupti.cupti`` on machines without a GPU, built on cupti-python's real records.

It keeps CUPTI's contract as xsp uses it: one subscriber, activity kinds enabled one by one,
a completed-buffer callback fed on flush, a time base of its own, and a stack of external
correlation ids. ``launch()`` plays a CUDA runtime call made by the calling thread: an API
record (with the external id on top of the stack) and the kernel it launches.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from cupti import cupti as real
from xsp.tracers._cupti import Kind, api_enum

KERNEL_RECORD = max((getattr(real, name) for name in dir(real) if name.startswith("ActivityKernel")
                     and name[len("ActivityKernel"):].isdigit()),
                    key=lambda record: int(record.__name__[len("ActivityKernel"):]))
"""The newest kernel record of this cupti-python (``ActivityKernel13`` in 13.4, ``10`` in 13.0)."""


class CuptiError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUPTI error {status}")
        self.status = status


MULTIPLE_SUBSCRIBERS = int(real.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)


class FakeCupti:
    Result = real.Result
    RuntimeApiTraceCbid = api_enum(real, Kind.RUNTIME)
    DriverApiTraceCbid = api_enum(real, Kind.DRIVER)

    def __init__(self, clock_offset_ns: int = 1_700_000_000_000_000_000, skew_ns: int = 0,
                 held_by_other: bool = False, per_call_switch: bool = True) -> None:
        self.clock_offset_ns = clock_offset_ns
        """CUPTI time = xsp host time + this (what the tracer must measure)."""
        self.skew_ns = skew_ns
        """Added to record times only, not to get_timestamp(): a clock the measurement misses."""
        self.held_by_other = held_by_other
        self.per_call_switch = per_call_switch
        """Has ``activity_enable_runtime_api``/``_driver_api`` (cupti-python's bindings of 12.6 on do)."""
        self.silenced: set[tuple[int, int]] = set()
        """``(kind, cbid)`` of the API calls CUPTI was told to make no records of."""
        self.subscribers = 0
        self.enabled: set[int] = set()
        self.completed: Any = None
        self.pending: list[Any] = []
        self.stack: list[int] = []
        self.pushes = 0
        self.correlation = 0
        self.flushes: list[int] = []
        self.lock = threading.Lock()

    # clock ---------------------------------------------------------------------------
    def get_timestamp(self) -> int:
        return time.perf_counter_ns() + self.clock_offset_ns

    # subscription ---------------------------------------------------------------------
    def subscribe(self, callback: Any, userdata: Any) -> int:
        if self.held_by_other or self.subscribers:
            raise CuptiError(MULTIPLE_SUBSCRIBERS)
        self.subscribers += 1
        return 1234

    def unsubscribe(self, handle: int) -> None:
        self.subscribers -= 1

    def set_thread_id_type(self, kind: int) -> None:
        assert kind == int(real.ActivityThreadIdType.SYSTEM)

    # activity API -----------------------------------------------------------------------
    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        size, _ = requested()
        assert size > 0
        self.completed = completed

    def activity_enable(self, kind: int) -> None:
        self.enabled.add(kind)

    def activity_disable(self, kind: int) -> None:
        self.enabled.discard(kind)

    def activity_enable_runtime_api(self, cbid: int, enable: int) -> None:
        self._switch(int(real.ActivityKind.RUNTIME), cbid, enable)

    def activity_enable_driver_api(self, cbid: int, enable: int) -> None:
        self._switch(int(real.ActivityKind.DRIVER), cbid, enable)

    def _switch(self, kind: int, cbid: int, enable: int) -> None:
        if not self.per_call_switch:
            raise AttributeError("module 'cupti.cupti' has no attribute 'activity_enable_runtime_api'")
        if enable:
            self.silenced.discard((kind, cbid))
        else:
            self.silenced.add((kind, cbid))

    def activity_flush_all(self, flag: int) -> None:
        self.flushes.append(flag)
        with self.lock:
            records, self.pending = self.pending, []
        if records and self.completed is not None:
            self.completed(records)

    def activity_push_external_correlation_id(self, kind: int, external_id: int) -> None:
        assert kind == int(real.ExternalCorrelationKind.CUSTOM0)
        self.stack.append(external_id)
        self.pushes += 1

    def activity_pop_external_correlation_id(self, kind: int) -> int:
        return self.stack.pop()

    # what the GPU would do --------------------------------------------------------------
    def query(self) -> None:
        """A cudaGetDevice on this thread, with the driver call it makes (neither runs GPU work)."""
        calls = ((real.ActivityKind.RUNTIME, self.RuntimeApiTraceCbid.cudaGetDevice_v3020),
                 (real.ActivityKind.DRIVER, self.DriverApiTraceCbid.cuDevicePrimaryCtxGetState))
        for kind, cbid in calls:
            if int(kind) not in self.enabled or (int(kind), int(cbid)) in self.silenced:
                continue
            with self.lock:
                self.correlation += 1
                api = real.ActivityAPI()
                api.kind, api.correlation_id, api.cbid = int(kind), self.correlation, int(cbid)
                api.start = self.get_timestamp() + self.skew_ns
                api.end = api.start + 300
                api.thread_id, api.process_id, api.return_value = threading.get_native_id(), 1, 0
                self.pending.append(api)

    def launch(self, kernel: str = "_Z6vecAddPfS_S_i", work_ns: int = 20_000) -> None:
        """A cudaLaunchKernel on this thread, and the kernel it runs."""
        with self.lock:
            self.correlation += 1
            correlation = self.correlation
        start = self.get_timestamp() + self.skew_ns
        time.sleep(0)  # the call takes a little time
        end = self.get_timestamp() + self.skew_ns
        records: list[Any] = []
        if int(real.ActivityKind.RUNTIME) in self.enabled:
            api = real.ActivityAPI()
            api.kind, api.start, api.end, api.correlation_id = int(real.ActivityKind.RUNTIME), start, end, correlation
            api.cbid = int(self.RuntimeApiTraceCbid.cudaLaunchKernel_v7000)
            api.thread_id, api.process_id, api.return_value = threading.get_native_id(), 1, 0
            records.append(api)
        if self.stack and int(real.ActivityKind.EXTERNAL_CORRELATION) in self.enabled:
            external = real.ActivityExternalCorrelation()
            external.kind = int(real.ActivityKind.EXTERNAL_CORRELATION)
            external.external_kind = int(real.ExternalCorrelationKind.CUSTOM0)
            external.external_id, external.correlation_id = self.stack[-1], correlation
            records.append(external)
        if int(real.ActivityKind.CONCURRENT_KERNEL) in self.enabled:
            records.append(kernel_record(kernel, end + 5_000, end + 5_000 + work_ns, correlation))
        with self.lock:
            self.pending.extend(records)


def kernel_record(name: str, start: int, end: int, correlation: int) -> Any:
    record = KERNEL_RECORD()
    record.kind = int(real.ActivityKind.CONCURRENT_KERNEL)
    record.start, record.end, record.correlation_id, record.name = start, end, correlation, name
    record.grid_x, record.grid_y, record.grid_z = 128, 2, 1
    record.block_x, record.block_y, record.block_z = 256, 1, 1
    record.registers_per_thread, record.static_shared_memory, record.dynamic_shared_memory = 32, 1024, 4096
    record.stream_id, record.device_id, record.graph_id = 7, 0, 0
    return record
