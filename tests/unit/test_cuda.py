"""The CUDA API and kernel tracers without a GPU: real cupti-python records, a stand-in CUPTI."""

from __future__ import annotations

import json
import threading
import time
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("cupti", reason="cupti-python is not installed (Linux x86_64/aarch64 only)")

# cupti-python 13.0 complains when a record made by hand (not read from a CUPTI buffer) is freed
# on a machine with a driver: its buffer manager has no buffer to count down
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. 'cupti.cupti.Activity:pytest.PytestUnraisableExceptionWarning")

from cupti import cupti as real  # noqa: E402

import xsp  # noqa: E402
from xsp.analysis import gpu  # noqa: E402
from xsp.cli.doctor import tracer_rows  # noqa: E402
from xsp.core import schema as col  # noqa: E402
from xsp.core.schema import Level, SpanKind  # noqa: E402
from xsp.record.window import HELD_WHOLLY  # noqa: E402
from xsp.table.walks import nearest_ancestor, of_level, parent_positions  # noqa: E402
from xsp.tracers.cuda import records as _cupti_records  # noqa: E402
from xsp.tracers.cuda import rows as _cupti_rows  # noqa: E402
from xsp.tracers.cuda import source as _cupti  # noqa: E402
from xsp.tracers.cuda.clock import ClockMode, CuptiClock  # noqa: E402
from xsp.tracers.cuda.graphs import GraphNodeMarks  # noqa: E402
from xsp.tracers.cuda.records import Family, RecordStore, columns_from_tuples  # noqa: E402
from xsp.tracers.cuda.rows import activity_rows, api_rows, demangle  # noqa: E402
from xsp.tracers.cuda.source import CuptiSource  # noqa: E402
from xsp.tracers.cuda_api import CudaApiTracer  # noqa: E402
from xsp.tracers.kernel import KernelTracer  # noqa: E402
from xsp.tracers.module_calls.interceptor import INTERCEPTOR  # noqa: E402

from ..fake_cupti import CuptiError, FakeCupti, kernel_record  # noqa: E402
from ..native_cupti import NEWEST, SHARING, assert_same_columns  # noqa: E402


def _api(correlation: int, start: int, end: int, cbid: int = 211, kind: int = 5, thread: int = 42) -> object:
    record = real.ActivityAPI()
    record.kind, record.start, record.end, record.correlation_id = kind, start, end, correlation
    record.cbid, record.thread_id, record.process_id, record.return_value = cbid, thread, 1, 0
    return record


def _memcpy(correlation: int, start: int, end: int, nbytes: int, copy_kind: int) -> object:
    record = real.ActivityMemcpy6()
    record.kind, record.start, record.end, record.correlation_id = 1, start, end, correlation
    record.bytes, record.copy_kind, record.stream_id, record.device_id = nbytes, copy_kind, 7, 0
    return record


def _memset(correlation: int, start: int, end: int) -> object:
    record = real.ActivityMemset4()
    record.kind, record.start, record.end, record.correlation_id = 2, start, end, correlation
    record.bytes, record.value, record.stream_id, record.device_id = 4096, 0, 7, 0
    return record


def _sync(correlation: int, start: int, end: int) -> object:
    record = real.ActivitySynchronization2()
    record.kind, record.start, record.end, record.correlation_id = 38, start, end, correlation
    record.type, record.stream_id, record.cuda_event_id = 3, 7, 0
    return record


def _external(correlation: int, external_id: int) -> object:
    record = real.ActivityExternalCorrelation()
    record.kind, record.external_kind = 39, int(real.ExternalCorrelationKind.CUSTOM0)
    record.external_id, record.correlation_id = external_id, correlation
    return record


def _stored(records: list[object]) -> _cupti_records.ActivityColumns:
    store = RecordStore()
    store.on_completed(records)
    kept, dropped = store.drain()
    assert not dropped
    return kept


# windows of threads inside a step ----------------------------------------------------------
def test_a_window_leaves_a_held_threads_cuda_calls_since_its_open_step_with_the_kernels_they_launched():
    """Thread 7's decided steps went with the window, its open step (from 4,000) did not; thread 8
    was left whole; thread 9 was taken."""
    records = _stored([
        _api(1, 1_000, 1_100, thread=7), kernel_record("_Z1ai", 1_200, 1_300, 1),
        _api(2, 5_000, 5_100, thread=7), kernel_record("_Z1bi", 5_200, 5_300, 2),
        _api(3, 2_000, 2_100, thread=8), kernel_record("_Z1ci", 2_200, 2_300, 3),
        _api(4, 3_000, 3_100, thread=9), kernel_record("_Z1di", 3_200, 3_300, 4),
        _api(5, 11_000, 11_100, thread=9), kernel_record("_Z1ei", 11_200, 11_300, 5),  # after the window
    ])
    now, later = records.split(10_000, {7: 4_000, 8: HELD_WHOLLY}, CuptiClock.constant(0))
    assert sorted(now[Family.API]["correlation_id"].tolist()) == [1, 4]
    assert sorted(now[Family.KERNEL]["correlation_id"].tolist()) == [1, 4]
    assert sorted(later[Family.API]["correlation_id"].tolist()) == [2, 3, 5]
    assert sorted(later[Family.KERNEL]["correlation_id"].tolist()) == [2, 3, 5]


def test_a_window_leaves_the_graph_nodes_a_held_thread_made_in_its_open_step():
    marks = GraphNodeMarks()
    made = [(0, node, 0, 1, 0, thread, at) for node, thread, at in
            ((1, 7, 1_000), (2, 7, 5_000), (3, 8, 2_000), (4, 9, 3_000), (5, 9, 11_000))]
    marks.marks.extend(made)
    now = marks.take(10_000, {7: 4_000, 8: HELD_WHOLLY})
    assert [mark[1] for mark in now] == [1, 4]
    assert [mark[1] for mark in marks.take()] == [2, 3, 5]


# conversion --------------------------------------------------------------------------------
def test_records_become_spans_with_names_launch_geometry_and_memory_facts():
    offset = 1_000_000
    records = _stored([
        _api(1, 2_000_000, 2_010_000), _external(1, 555),
        kernel_record("_Z6vecAddPfS_S_i", 2_020_000, 2_050_000, 1),
        _api(2, 2_100_000, 2_110_000, cbid=int(FakeCupti.RuntimeApiTraceCbid.cudaMemcpyAsync_v3020)),
        _memcpy(2, 2_120_000, 2_130_000, nbytes=1_000_000, copy_kind=1),
        _memset(3, 2_140_000, 2_141_000), _sync(4, 2_150_000, 2_160_000),
        _api(5, 2_200_000, 2_201_000, cbid=int(FakeCupti.DriverApiTraceCbid.cuLaunchKernel), kind=4),
    ])
    api = api_rows(records, CuptiClock.constant(offset))
    assert api[col.NAME].tolist() == ["cudaLaunchKernel", "cudaMemcpyAsync", "cuLaunchKernel"]
    assert api[col.KIND].tolist() == [SpanKind.RUNTIME.value, SpanKind.RUNTIME.value, SpanKind.DRIVER.value]
    assert api[col.START_NS].tolist() == [1_000_000, 1_100_000, 1_200_000]
    assert api[col.EXTERNAL_ID].tolist()[0] == 555 and api[col.THREAD_ID].tolist() == [42, 42, 42]
    assert set(api[col.LEVEL]) == {Level.CUDA_API.value}

    activities = activity_rows(records, CuptiClock.constant(offset)).set_index(col.KIND)
    kernel = activities.loc[SpanKind.KERNEL.value]
    assert kernel[col.NAME] == "vecAdd(float*, float*, float*, int)"
    assert (kernel[col.GRID], kernel[col.BLOCK]) == ("[128,2,1]", "[256,1,1]")
    assert (kernel[col.REGISTERS_PER_THREAD], kernel[col.SHARED_MEMORY_BYTES]) == (32, 1024 + 4096)
    assert (kernel[col.STREAM_ID], kernel[col.DEVICE_ID], kernel[col.CORRELATION_ID]) == (7, 0, 1)
    details = json.loads(kernel[col.ATTRIBUTES])
    assert (details["static_shared_memory"], details["dynamic_shared_memory"]) == (1024, 4096)
    assert details["mangled_name"] == "_Z6vecAddPfS_S_i"
    copy = activities.loc[SpanKind.MEMCPY.value]
    assert (copy[col.NAME], copy[col.COPY_KIND], copy[col.BYTES]) == ("Memcpy HtoD", "HtoD", 1_000_000)
    assert json.loads(copy[col.ATTRIBUTES])["bandwidth_gb_s"] == pytest.approx(100.0)  # 1 MB in 10 us
    assert activities.loc[SpanKind.MEMSET.value][col.BYTES] == 4096
    assert activities.loc[SpanKind.SYNC.value][col.NAME] == "Stream Sync"
    assert (activities[col.START_NS] >= 1_000_000).all()


def test_records_are_kept_as_bytes_and_read_as_their_attributes_read():
    records = [_api(1, 2_000_000, 2_010_000, thread=7), _external(1, 555),
               kernel_record("_Z6vecAddPfS_S_i", 2_020_000, 2_050_000, 1),
               kernel_record("_Z6vecAddPfS_S_i", 2_060_000, 2_070_000, 2), kernel_record("k2", 1, 2, 3),
               _api(5, 2_200_000, 2_201_000, cbid=int(FakeCupti.DriverApiTraceCbid.cuLaunchKernel), kind=4),
               _memcpy(2, 2_120_000, 2_130_000, nbytes=1_000_000, copy_kind=1), _memset(3, 2_140_000, 2_141_000),
               _sync(4, 2_150_000, 2_160_000)]
    for record in records:  # every type xsp reads has a layout here: no attribute is read per record
        assert _cupti_records.raw_layout(type(record)) is not None, type(record).__name__
    store = RecordStore()
    store.on_completed(records)
    assert not store.records and sum(len(blobs) for blobs, _ in store.raw.values()) == len(records)
    kept, dropped = store.drain()
    assert not dropped and not store.raw
    assert_same_columns(kept, columns_from_tuples(_cupti_records.record_tuple(r) for r in records))


def test_a_record_type_without_a_layout_is_read_by_its_attributes():
    class Plain:  # a record of a cupti-python without numpy layouts
        kind, start, end, correlation_id, cbid, thread_id, process_id, return_value = 5, 10, 20, 1, 211, 3, 1, 0

    assert _cupti_records.raw_layout(Plain) is None
    api = _stored([Plain(), _api(2, 30, 40)])[Family.API]
    assert [tuple(values) for values in zip(*(api[name].tolist() for name in api))] == [
        (5, 10, 20, 1, 211, 3, 1, 0), (5, 30, 40, 2, 211, 42, 1, 0)]


def test_demangling_leaves_plain_and_broken_names_alone():
    assert demangle("_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_3addEvEUliE_EEviT1_") == (
        "void at::native::elementwise_kernel<128, 2, at::native::add()::{lambda(int)#1}>"
        "(int, at::native::add()::{lambda(int)#1})")
    assert demangle("volta_sgemm_128x64_nn") == "volta_sgemm_128x64_nn"
    assert demangle("_Znot-a-symbol") == "_Znot-a-symbol"


def test_unreadable_records_are_counted_not_fatal():
    class Odd:
        kind = 10  # a kernel without the fields

    store = RecordStore()
    store.on_completed([Odd(), _api(1, 10, 20)])
    kept, dropped = store.drain()
    assert len(kept) == 1 and dropped == {"unreadable CUPTI records": 1}


def test_the_cupti_offset_is_measured_against_the_host_clock():
    fake = FakeCupti(clock_offset_ns=123_456_789_000)
    offset, uncertainty = _cupti.measure_cupti_offset(fake.get_timestamp)
    assert abs(offset - 123_456_789_000) <= uncertainty + 1_000
    records = _stored([_api(1, 123_456_789_000 + 5_000, 123_456_789_000 + 6_000)])
    shifted = api_rows(records, CuptiClock.constant(offset))
    assert abs(int(shifted[col.START_NS].iloc[0]) - 5_000) <= uncertainty + 1_000


# a session with the stand-in CUPTI -------------------------------------------------------------
class Launching(torch.nn.Module):
    """A layer whose forward makes CUDA calls (played by the stand-in)."""

    def __init__(self, fake: FakeCupti, launches: int) -> None:
        super().__init__()
        self.fake, self.launches = fake, launches
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.launches):
            self.fake.query()  # as PyTorch asks cudaGetDevice before its launches
            self.fake.launch()
        return self.linear(x)


def _model(fake: FakeCupti) -> torch.nn.Module:
    return torch.nn.Sequential(Launching(fake, 2), torch.nn.ReLU(), Launching(fake, 3)).eval()


@pytest.fixture(params=["python", "c"], ids=["python-path", "c-path"])
def fake(request, monkeypatch):
    """A stand-in CUPTI, its records read through cupti-python's callback or by xsp's C path (from
    the fake libcupti, which hands them over on a thread of its own)."""
    if request.param == "c":
        library = request.getfixturevalue("fake_libcupti")
        fake = FakeCupti(library=library)
        return _installed(fake, CuptiSource(module=lambda: fake, library=str(library.path)), monkeypatch)
    return request.getfixturevalue("python_fake")


@pytest.fixture
def python_fake(monkeypatch):
    """A stand-in CUPTI whose records go through cupti-python's callback."""
    fake = FakeCupti()
    return _installed(fake, CuptiSource(module=lambda: fake, native=False), monkeypatch)


def _installed(fake: FakeCupti, source: CuptiSource, monkeypatch) -> FakeCupti:
    monkeypatch.setattr(_cupti, "SOURCE", source)
    monkeypatch.setattr(CudaApiTracer.__init__, "__defaults__", (source,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


def _trace(fake: FakeCupti, levels: str = "model,layer,kernel", steps: int = 3) -> xsp.Trace:
    model = _model(fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        with xsp.trace(levels=levels, output=None) as session, torch.no_grad():
            for _ in range(steps):
                model(torch.randn(2, 8))
    assert session.trace is not None
    return session.trace


def _warned(fake: FakeCupti, levels: str) -> tuple[list[str], xsp.Trace]:
    """One call of the model under ``levels``: xsp's warnings, and the trace."""
    model = _model(fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with xsp.trace(levels=levels, output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))
    assert session.trace is not None
    return [str(w.message) for w in caught if issubclass(w.category, xsp.XspWarning)], session.trace


def test_every_kernel_hangs_from_its_launch_and_the_layer_that_made_it(fake):
    trace = _trace(fake)
    spans = trace.spans
    kernels = spans[spans[col.KIND] == SpanKind.KERNEL.value]
    launches = spans[spans[col.LEVEL] == Level.CUDA_API.value]
    assert len(kernels) == len(launches) == 3 * (2 + 3)
    parents = parent_positions(spans)
    kernel_rows = np.flatnonzero((spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    assert (spans[col.LEVEL].to_numpy()[parents[kernel_rows]] == Level.CUDA_API.value).all()
    layer = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)[kernel_rows]
    assert sorted(spans[col.NAME].to_numpy()[layer].tolist()) == ["model.0"] * 6 + ["model.2"] * 9
    assert set(kernels[col.STEP].tolist()) == {0, 1, 2}
    # launches lie inside their layer on the shared clock, and their external id names it
    api_rows_ = np.flatnonzero((spans[col.LEVEL] == Level.CUDA_API.value).to_numpy())
    owner = parents[api_rows_]
    start, end = spans[col.START_NS].to_numpy(), spans[col.END_NS].to_numpy()
    assert ((start[owner] <= start[api_rows_]) & (end[api_rows_] <= end[owner])).all()
    assert (spans[col.EXTERNAL_ID].to_numpy()[owner] == spans[col.EXTERNAL_ID].to_numpy()[api_rows_]).all()
    hierarchy = trace.metadata["hierarchy"]
    assert hierarchy["launched"] == 15 and hierarchy["external_linked"] == 15
    assert hierarchy["external_reparented"] == 0
    details = trace.metadata["tracer_details"]["kernel"]
    if fake.library is None:  # CUPTI's own clock: the offset measured
        assert details["clock"] == ClockMode.INTERPOLATED.value
        assert abs(details["cupti_to_host_offset_ns"] - fake.clock_offset_ns) <= details["uncertainty_ns"] + 1_000
    else:  # the C path hands CUPTI xsp's clock
        assert details["clock"] == ClockMode.HOST_CALLBACK.value and details["cupti_to_host_offset_ns"] == 0
        assert abs(details["cupti_get_timestamp_offset_ns"]) < 1_000_000
    by_layer = gpu.kernel_time_per_layer(trace)
    assert dict(zip(by_layer["layer"], by_layer["kernels"])) == {"model.0": 6, "model.2": 9}


@pytest.mark.parametrize("per_call_switch", [True, False], ids=["cupti-leaves-them-out", "xsp-drops-them"])
def test_query_calls_are_left_out_and_cuptis_setting_is_given_back(fake, per_call_switch):
    fake.per_call_switch = per_call_switch
    trace = _trace(fake)
    api = trace.spans[trace.spans[col.LEVEL] == Level.CUDA_API.value]
    assert api[col.NAME].tolist() == ["cudaLaunchKernel"] * 15
    details = trace.metadata["tracer_details"]["cuda_api"]
    assert details["query_calls"] == "left out"
    # 15 cudaGetDevice and 15 cuDevicePrimaryCtxGetState: made by CUPTI and dropped by xsp only without the switch
    assert details.get("query_calls_left_out", 0) == (0 if per_call_switch else 30)
    assert fake.silenced == set()  # switched back on for the next CUPTI client of the process


def test_query_calls_are_recorded_on_request(fake, monkeypatch):
    monkeypatch.setenv("XSP_CUDA_API_QUERIES", "1")
    trace = _trace(fake)
    names = trace.spans[trace.spans[col.LEVEL] == Level.CUDA_API.value].groupby(col.NAME).size().to_dict()
    assert names == {"cudaLaunchKernel": 15, "cudaGetDevice": 15, "cuDevicePrimaryCtxGetState": 15}
    assert trace.metadata["tracer_details"]["cuda_api"]["query_calls"] == "recorded"


def test_callback_ids_are_named_with_either_enum_name_of_cupti_python():
    class Cupti130:  # cupti-python 13.0 names the enums in snake case
        runtime_api_trace_cbid = FakeCupti.RuntimeApiTraceCbid
        driver_api_trace_cbid = FakeCupti.DriverApiTraceCbid

    assert _cupti_rows.api_enum(Cupti130, _cupti.Kind.RUNTIME)(211).name == "cudaLaunchKernel_v7000"
    assert _cupti_rows.api_enum(Cupti130, _cupti.Kind.DRIVER) is FakeCupti.DriverApiTraceCbid
    runtime_queries = _cupti_rows.query_cbids(Cupti130, _cupti.Kind.RUNTIME)
    assert int(FakeCupti.RuntimeApiTraceCbid.cudaGetDevice_v3020) in runtime_queries
    assert int(FakeCupti.RuntimeApiTraceCbid.cudaLaunchKernel_v7000) not in runtime_queries
    with pytest.raises(AttributeError):
        _cupti_rows.api_enum(object(), _cupti.Kind.RUNTIME)
    assert _cupti_rows.query_cbids(object(), _cupti.Kind.RUNTIME) == ()


def test_a_clock_the_measurement_missed_is_corrected_by_the_external_ids(fake):
    fake.skew_ns = 10_000_000  # records 10 ms late: their intervals fall outside their layers
    trace = _trace(fake)
    spans = trace.spans
    hierarchy = trace.metadata["hierarchy"]
    assert hierarchy["external_linked"] == 15 and hierarchy["external_reparented"] > 0
    parents = parent_positions(spans)
    api = np.flatnonzero((spans[col.LEVEL] == Level.CUDA_API.value).to_numpy())
    assert set(spans[col.NAME].to_numpy()[parents[api]]) == {"model.0", "model.2"}


def test_cupti_is_set_up_once_flushed_at_step_ends_and_left_clean(fake, monkeypatch):
    source = _cupti.SOURCE
    requests = []
    flush_on_thread = source.step_ended
    monkeypatch.setattr(source, "step_ended", lambda: (requests.append(1), flush_on_thread()))
    _trace(fake, steps=4)
    # each step end heard while the session runs, by both tracers (the flusher's event coalesces them);
    # the last step ends with the session, whose final flush is forced
    assert len(requests) == 3 * 2
    assert fake.subscribers == 0 and fake.enabled == set() and fake.stack_depth == 0
    assert fake.flushes[-1] == 1  # forced at the end
    assert fake.pushes == 4 * 6  # the model, its three children and the two Linear inside, every step
    assert INTERCEPTOR._correlation is None and not _cupti.SOURCE.running


def test_without_the_cuda_levels_nothing_is_pushed(fake):
    _trace(fake, levels="model,layer")
    assert fake.pushes == 0 and fake.subscribers == 0


def test_another_subscriber_makes_the_levels_unavailable_with_one_warning(fake):
    fake.held_by_other = True
    reason = _cupti.SOURCE.available()
    assert reason is not None and "another CUPTI client" in reason and "MULTIPLE_SUBSCRIBERS" in reason
    rows = {name: status for name, _, status in tracer_rows()}
    assert rows["cuda_api"] == reason and rows["kernel"] == reason
    messages, trace = _warned(fake, "model,layer,kernel")
    assert len(messages) == 1 and "levels cuda_api, kernel are not recorded" in messages[0]
    assert set(trace.spans[col.LEVEL]) == {Level.MODEL.value, Level.LAYER.value}


def test_pytorchs_profiler_and_the_cuda_levels_exclude_each_other(fake, monkeypatch):
    monkeypatch.setattr(torch.autograd.profiler, "_is_profiler_enabled", True)
    reason = _cupti.SOURCE.available()
    assert reason.startswith("PyTorch's profiler is recording in this process, and may hold CUPTI: ")
    assert "another CUPTI client holds CUPTI and does not share it" in reason


@pytest.mark.parametrize("has_subscribe_v2", [True, False], ids=["subscribe-v2", "subscribe"])
def test_the_client_that_holds_cupti_is_named_where_cupti_says(fake, has_subscribe_v2):
    fake.held_by_other, fake.holder_name, fake.has_subscribe_v2 = True, "CUPTI for Nsight Systems", has_subscribe_v2
    reason = _cupti.SOURCE.available()
    assert "another CUPTI client holds" in reason and "MULTIPLE_SUBSCRIBERS" in reason
    assert ("CUPTI is held by 'CUPTI for Nsight Systems'" in reason) == has_subscribe_v2
    messages, trace = _warned(fake, "model,layer,kernel")
    assert len(messages) == 1 and "levels cuda_api, kernel are not recorded" in messages[0]
    assert ("'CUPTI for Nsight Systems'" in messages[0]) == has_subscribe_v2
    assert trace.metadata["unavailable"]["kernel"] == reason
    fake.held_by_other = False
    _trace(fake)
    assert fake.subscriber_names[-1:] == (["xsp"] if has_subscribe_v2 else [])  # xsp names itself to CUPTI


class FakeKineto:
    """PyTorch's profiler as CUPTI sees it: ``_prepare_profiler`` with CUDA activities registers
    Kineto's buffer callbacks and enables its kinds, so xsp must have let go by then;
    ``_disable_profiler`` lets go (or, ``keeps_cupti``, stays subscribed, as a Kineto on demand)."""

    def __init__(self, fake: FakeCupti, keeps_cupti: bool = False) -> None:
        self.fake, self.keeps_cupti = fake, keeps_cupti
        self.held_before = False
        self.found: list[tuple[int, set[int], int]] = []
        """At each CUDA start: xsp's subscriptions, the kinds xsp left enabled, its ids on the stack."""

    def prepare(self, config, activities, activity_filter=None) -> None:
        if any(activity.name == "CUDA" for activity in activities):
            library = self.fake.library
            enabled = set(self.fake.enabled) | {kind for kind in range(64) if library and library.enabled_v2(kind)}
            self.found.append((self.fake.subscribers, enabled, self.fake.stack_depth))
            self.held_before = self.fake.held_by_other
            self.fake.held_by_other, self.fake.holder_name = True, "CUPTI for Kineto"

    def enable(self, config, activities) -> None:
        pass

    def disable(self) -> str:
        self.fake.held_by_other = self.keeps_cupti or self.held_before
        return "kineto results"

    def install(self, monkeypatch) -> Any:
        """In place of the functions PyTorch's profiler calls (looked up by name): the module."""
        profiler = torch.autograd.profiler
        monkeypatch.setattr(profiler, "_prepare_profiler", self.prepare)
        monkeypatch.setattr(profiler, "_enable_profiler", self.enable)
        monkeypatch.setattr(profiler, "_disable_profiler", self.disable)
        return profiler


def _with_torch_profiler(fake: FakeCupti, kineto: FakeKineto, monkeypatch, activities) -> tuple[list[str], xsp.Trace]:
    """Two steps, two more inside PyTorch's profiler (started as ``torch.profiler.profile`` does),
    two after it: xsp's warnings and trace."""
    profiler = kineto.install(monkeypatch)
    model = _model(fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            for _ in range(2):
                model(torch.randn(2, 8))
            # as torch.profiler.profile.__enter__ and __exit__ call them, looked up by name
            profiler._prepare_profiler(object(), activities)
            profiler._enable_profiler(object(), activities)
            for _ in range(2):
                model(torch.randn(2, 8))
            assert profiler._disable_profiler() == "kineto results"
            for _ in range(2):
                model(torch.randn(2, 8))
    assert session.trace is not None
    return [str(w.message) for w in caught if issubclass(w.category, xsp.XspWarning)], session.trace


def test_pytorchs_profiler_started_inside_a_session_takes_cupti_and_xsp_takes_it_back(fake, monkeypatch):
    kineto = FakeKineto(fake)
    activities = {torch.autograd.ProfilerActivity.CPU, torch.autograd.ProfilerActivity.CUDA}
    messages, trace = _with_torch_profiler(fake, kineto, monkeypatch, activities)
    # Kineto found CUPTI free: no subscription, no kind, no id of xsp's on the stack
    assert kineto.found == [(0, set(), 0)]
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert sorted(kernels[col.STEP].unique().tolist()) == [0, 1, 4, 5]  # none from Kineto's steps
    assert len(kernels) == 4 * 5
    assert len(messages) == 1 and messages[0].startswith(
        "xsp: PyTorch's profiler started with CUDA activities: xsp's CUDA levels let go of CUPTI for it")
    (down,) = trace.metadata["tracer_details"]["kernel"]["cupti_stood_down"]
    steps = trace.spans[trace.spans[col.KIND] == "predict"].sort_values(col.START_NS)
    assert steps[col.END_NS].iloc[1] <= down["from_ns"] < down["to_ns"] <= steps[col.START_NS].iloc[4]
    assert down["taken_back"] is True and "could_not_come_back" not in down
    assert fake.subscribers == 0 and fake.enabled == set() and fake.stack_depth == 0
    assert torch.autograd.profiler._prepare_profiler == kineto.prepare  # PyTorch's functions given back


def test_cupti_kept_by_the_other_client_is_said_and_the_trace_keeps_what_came_before(fake, monkeypatch):
    kineto = FakeKineto(fake, keeps_cupti=True)
    messages, trace = _with_torch_profiler(fake, kineto, monkeypatch, {torch.autograd.ProfilerActivity.CUDA})
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert sorted(kernels[col.STEP].unique().tolist()) == [0, 1]
    assert len(messages) == 1 and messages[0].startswith("xsp: PyTorch's profiler started with CUDA activities: ")
    assert "could not take CUPTI back when it stopped" in messages[0] and "'CUPTI for Kineto'" in messages[0]
    (down,) = trace.metadata["tracer_details"]["kernel"]["cupti_stood_down"]
    assert "CUPTI for Kineto" in down["could_not_come_back"] and down["to_ns"] is not None
    assert down["taken_back"] is False
    assert fake.enabled == set() and fake.stack_depth == 0


def test_cupti_let_go_late_by_the_other_client_is_taken_back_at_a_later_step_end(fake, monkeypatch):
    monkeypatch.setattr(_cupti, "COME_BACK_RETRY_NS", 0)
    kineto = FakeKineto(fake, keeps_cupti=True)  # Kineto finalizes CUPTI on a later CUDA call
    profiler = kineto.install(monkeypatch)
    model = _model(fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))  # step 0
            profiler._prepare_profiler(object(), {torch.autograd.ProfilerActivity.CUDA})
            model(torch.randn(2, 8))  # step 1: the profiler's
            profiler._disable_profiler()
            model(torch.randn(2, 8))  # step 2: CUPTI still held; the step end tries, and is refused
            fake.held_by_other = False  # Kineto lets go
            model(torch.randn(2, 8))  # step 3: the next step end takes CUPTI back
            model(torch.randn(2, 8))  # step 4: recorded
    messages = [str(w.message) for w in caught if issubclass(w.category, xsp.XspWarning)]
    kernels = session.trace.spans[session.trace.spans[col.KIND] == SpanKind.KERNEL.value]
    steps = set(kernels[col.STEP].unique().tolist())
    assert {0, 4} <= steps and not {1, 2} & steps
    (down,) = session.trace.metadata["tracer_details"]["kernel"]["cupti_stood_down"]
    assert down["taken_back"] is True and "could_not_come_back" not in down
    assert len(messages) == 1 and "they recorded again once it had stopped" in messages[0]


def test_a_profiler_that_fails_to_start_gives_cupti_back_at_once(fake, monkeypatch):
    def refuse(config, activities, activity_filter=None) -> None:
        raise RuntimeError("Profiler is already enabled")

    monkeypatch.setattr(torch.autograd.profiler, "_prepare_profiler", refuse)
    model = _model(fake)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xsp.XspWarning)
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))
            with pytest.raises(RuntimeError, match="already enabled"):
                torch.autograd.profiler._prepare_profiler(object(), {torch.autograd.ProfilerActivity.CUDA})
            model(torch.randn(2, 8))
    kernels = session.trace.spans[session.trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert sorted(kernels[col.STEP].unique().tolist()) == [0, 1]
    (down,) = session.trace.metadata["tracer_details"]["kernel"]["cupti_stood_down"]
    assert down["taken_back"] is True


def test_pytorchs_profiler_without_cuda_leaves_the_cuda_levels_recording(fake, monkeypatch):
    kineto = FakeKineto(fake)
    messages, trace = _with_torch_profiler(fake, kineto, monkeypatch, {torch.autograd.ProfilerActivity.CPU})
    assert kineto.found == [] and messages == []
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert sorted(kernels[col.STEP].unique().tolist()) == list(range(6))
    assert "cupti_stood_down" not in trace.metadata["tracer_details"]["kernel"]


class Replaying(torch.nn.Module):
    """Runs the instantiated graph, as ``torch.cuda.CUDAGraph.replay()`` does: one launch, no module inside."""

    def __init__(self, fake: FakeCupti, clones: list[int], executable_graph: int) -> None:
        super().__init__()
        self.fake, self.clones, self.executable_graph = fake, clones, executable_graph

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake.replay(self.clones, self.executable_graph)
        return x


def test_replayed_kernels_belong_to_the_layers_that_captured_their_graph_nodes(fake):
    model = torch.nn.Sequential(torch.nn.Sequential(Launching(fake, 2)), torch.nn.ReLU(), Launching(fake, 3)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))  # step 0: eager
            fake.capturing_graph = 1  # step 1: captured (as torch.cuda.graph does): nodes, no kernels
            model(torch.randn(2, 8))
            fake.capturing_graph = None
            clones = fake.instantiate(executable_graph=2)
            replayer = Replaying(fake, clones, 2)
            for _ in range(3):  # steps 2-4: replays
                replayer(torch.randn(2, 8))
    trace = session.trace
    assert trace.metadata["tracer_details"]["kernel"]["graph_nodes"] == "followed"
    spans = trace.spans
    marks = spans[spans[col.KIND] == SpanKind.GRAPH_NODE.value]
    # 5 nodes made in the capture and 5 made by the instantiation; with CUPTI 13.4 on (the C path
    # here) the records name the captured node themselves, and clones are not followed
    clones_followed = fake.library is None
    assert marks[col.NAME].astype(str).value_counts().to_dict() == {"made kernel node": 10, **(
        {"cloned kernel node": 5} if clones_followed else {})}
    table = gpu.kernel_table(trace)
    replayed = table[table["replayed"]]
    assert len(replayed) == 3 * 5 and set(replayed["step"]) == {2, 3, 4}
    assert (replayed["launch"] == "cudaGraphLaunch").all()
    # each replayed kernel on the layer that made its node at capture, not on the one that replayed it
    assert replayed.groupby("layer").size().to_dict() == {"model.0.0": 3 * 2, "model.2": 3 * 3}
    eager = table[~table["replayed"]]
    assert len(eager) == 5 and eager["graph_node_id"].isna().all()
    assert str(table["graph_node_id"].dtype) == "Int64"
    from xsp.analysis.overview import level_summary

    summary = level_summary(trace).set_index("level")  # the marks are no GPU work
    assert summary.loc[Level.KERNEL.value, "spans"] == 5 + 15
    by_layer = gpu.kernel_time_per_layer(trace)
    assert dict(zip(by_layer["layer"], by_layer["kernels"])) == {"model.0.0": 4 * 2, "model.2": 4 * 3}
    tree = gpu.replayed_layers(trace)
    assert list(tree.columns) == list(gpu.REPLAYED_LAYER_COLUMNS)
    assert tree["launch_span_id"].nunique() == 3 and set(tree["step"]) == {2, 3, 4}
    one = tree[tree["launch_span_id"] == tree["launch_span_id"].iloc[0]].set_index("layer")
    assert one["kernels"].to_dict() == {"model.0": 2, "model.0.0": 2, "model.2": 3}
    assert one["depth"].to_dict() == {"model.0": 0, "model.0.0": 1, "model.2": 0}
    assert one.loc["model.0", "gpu_end_ns"] <= one.loc["model.2", "gpu_start_ns"]
    assert one.loc["model.0", "kernel_us"] == one.loc["model.0.0", "kernel_us"] > 0
    assert one.loc["model.2", "path"] == "model[0]/model.2[0]"  # where it was captured
    from rich.console import Console

    from xsp.reports.terminal import render_report

    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    report = console.export_text()
    assert "CUDA graph replays by the layer that captured them" in report
    table = report.split("CUDA graph replays by the layer that captured them")[1]
    assert "model.0.0" in table and "model.2" in table


def test_replays_captured_without_the_layer_level_have_no_layer_tree(fake):
    model = _model(fake)
    with xsp.trace(levels="model,kernel", output=None) as session, torch.no_grad():
        fake.capturing_graph = 1
        model(torch.randn(2, 8))
        fake.capturing_graph = None
        replayer = Replaying(fake, fake.instantiate(executable_graph=2), 2)
        replayer(torch.randn(2, 8))
    table = gpu.kernel_table(session.trace)
    assert table["replayed"].sum() == 5 and table["layer"].isna().all()
    tree = gpu.replayed_layers(session.trace)
    assert tree.empty and list(tree.columns) == list(gpu.REPLAYED_LAYER_COLUMNS)


def test_replays_of_a_graph_captured_before_the_session_keep_their_launch(fake):
    fake.capturing_graph = 1
    fake.launch()  # captured before any session: no callback, no mark
    fake.capturing_graph = None
    with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
        clones = fake.instantiate(executable_graph=2)  # instantiated inside it: its clones are marked
        model = torch.nn.Sequential(Replaying(fake, clones, 2))
        model(torch.randn(2, 8))
    table = gpu.kernel_table(session.trace)
    assert len(table) == 1 and not table["replayed"].any() and table["graph_node_id"].notna().all()
    assert table["layer"].tolist() == ["model.0"]  # the layer that replayed it, for want of its capture
    assert gpu.replayed_layers(session.trace).empty


def test_without_the_captured_node_in_records_clones_lead_to_it(python_fake):
    fake = python_fake  # (the C path's stand-in CUPTI is 13.4, whose records name the captured node)
    fake.reports_source_node = False  # CUPTI before 13.4: a replay names its executable graph's node only
    model = _model(fake)
    with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
        fake.capturing_graph = 1
        model(torch.randn(2, 8))
        fake.capturing_graph = None
        Replaying(fake, fake.instantiate(executable_graph=2), 2)(torch.randn(2, 8))
    replayed = gpu.kernel_table(session.trace).query("replayed")
    assert replayed.groupby("layer").size().to_dict() == {"model.0": 2, "model.2": 3}


def test_node_ids_of_two_ranks_never_meet(fake):
    traces = []
    for rank, model in enumerate((_model(fake), torch.nn.Sequential(torch.nn.Identity(), Launching(fake, 5)))):
        fake._next_node = 1  # each process numbers its graphs and nodes from the same start
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            fake.capturing_graph = 1
            model(torch.randn(2, 8))
            fake.capturing_graph = None
            fake.captured = fake.captured[-5:]
            Replaying(fake, fake.instantiate(executable_graph=2), 2)(torch.randn(2, 8))
        spans = session.trace.spans.copy()
        spans[col.RANK] = pd.array([rank] * len(spans), dtype="Int64")
        spans[col.SPAN_ID] += rank << 40
        spans[col.PARENT_ID] += rank << 40
        traces.append(spans)
    joined = xsp.Trace(pd.concat(traces, ignore_index=True), {})
    replayed = gpu.kernel_table(joined).query("replayed")
    assert replayed.groupby("layer").size().to_dict() == {"model.0": 2, "model.2": 3, "model.1": 5}


def test_missing_driver_and_missing_package_are_reasons(monkeypatch):
    def no_driver() -> object:
        class Module:
            def get_timestamp(self) -> int:
                raise RuntimeError("CUDA driver is not found (libcuda.so.1: ...)")
        return Module()

    def not_installed() -> object:
        raise ImportError("No module named 'cupti'")

    assert CuptiSource(module=no_driver).available().startswith("no CUDA driver: CUDA driver is not found")
    assert "pip install \"xsp[cuda12]\"" in CuptiSource(module=not_installed).available()


def test_a_refused_activity_kind_disables_the_tracer_and_releases_cupti(fake):
    def refuse(kind: int) -> None:
        raise CuptiError(int(real.Result.ERROR_INSUFFICIENT_PRIVILEGES))

    if fake.library is not None:
        fake.library.reset_attribute(0)
    fake.activity_enable = refuse
    with pytest.warns(xsp.XspWarning, match="ERROR_INSUFFICIENT_PRIVILEGES"):
        with xsp.trace(levels="model,kernel", output=None):
            pass
    assert fake.subscribers == 0 and fake.thread_id_type == 0
    if fake.library is not None:  # what the C path changed is set back on the failure path too
        assert fake.library.zeroed_attribute() == 0 and not any(_activity_settings().values())
        assert abs(int(fake.library.timestamp()) - time.time_ns()) < 1_000_000_000


def test_kernels_recorded_on_another_thread_are_linked_to_that_threads_layers(fake):
    model = _model(fake)
    with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
        worker = threading.Thread(target=lambda: model(torch.randn(2, 8)))
        worker.start()
        worker.join()
        model(torch.randn(2, 8))
    spans = session.trace.spans
    api = spans[spans[col.LEVEL] == Level.CUDA_API.value]
    assert api[col.THREAD_ID].nunique() == 2
    assert session.trace.metadata["hierarchy"]["external_linked"] == 10


def test_both_tracers_share_one_drain_per_window_and_drops_count_once():
    from xsp.record.window import Window

    source = CuptiSource(module=lambda: FakeCupti(), native=False)

    class Odd:
        kind = 10

    source.store.on_completed([_api(1, 10, 20), kernel_record("k", 30, 40, 1), Odd()])
    first = Window([])
    api, kernels = CudaApiTracer(source).collect(first), KernelTracer(source).collect(first)
    assert len(api) == 1 and len(kernels) == 1
    assert first.dropped == {"unreadable CUPTI records": 1}
    second = Window([])  # a new round drains anew: nothing is handed out twice
    assert CudaApiTracer(source).collect(second).empty and KernelTracer(source).collect(second).empty


# the C record path ---------------------------------------------------------------------------
@pytest.fixture
def c_path(fake_libcupti, monkeypatch):
    """A stand-in CUPTI whose records only xsp's C path reads (the fake libcupti hands them over)."""
    fake = FakeCupti(library=fake_libcupti)
    source = CuptiSource(module=lambda: fake, library=str(fake_libcupti.path))
    monkeypatch.setattr(_cupti, "SOURCE", source)
    monkeypatch.setattr(CudaApiTracer.__init__, "__defaults__", (source,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


@pytest.fixture
def sharing_cupti(c_path, fake_libcupti):
    """The C path's stand-in CUPTI as 13.5 is: it can share CUPTI between subscribers."""
    fake_libcupti.release(SHARING)
    yield c_path
    fake_libcupti.release(NEWEST)
    fake_libcupti.reset_v2()


def test_with_cupti_13_5_xsp_records_beside_another_client_that_shares_cupti(sharing_cupti):
    fake = sharing_cupti
    fake.held_by_other, fake.other_shares, fake.holder_name = True, True, "CUPTI for Nsight Systems"
    library = fake.library
    refused_before = library.refused_one_subscriber_calls()
    assert _cupti.SOURCE.available() is None
    model = _model(fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            # every setting is xsp's subscriber's own: its thread ids, its zeroed buffers, its clock
            # (not the zeroed-buffer attribute, which may be the process's: CUPTI zeroes xsp's buffers)
            assert fake.shared and library.thread_id_type_v2() == 1 and library.zeroed_v2() == -1
            assert library.has_timestamp_callback() and library.silenced_v2() > 0
            for _ in range(3):
                model(torch.randn(2, 8))
    trace = session.trace
    by_layer = gpu.kernel_time_per_layer(trace)
    assert dict(zip(by_layer["layer"], by_layer["kernels"])) == {"model.0": 6, "model.2": 9}
    assert trace.metadata["hierarchy"]["external_linked"] == 15
    details = trace.metadata["tracer_details"]["kernel"]
    assert details["cupti_subscription"] == "shared with other clients (CUPTI's multi-subscriber mode)"
    assert details["clock"] == ClockMode.HOST_CALLBACK.value
    # no call of the one-subscriber forms while shared, and nothing of xsp's left behind
    assert library.refused_one_subscriber_calls() == refused_before and fake.enabled == set()
    assert fake.subscribers == 0 and not fake.shared and not library.any_enabled_v2() and fake.stack_depth == 0
    assert library.silenced_v2() == 0 and not library.has_timestamp_callback()


def test_a_shared_subscription_steps_aside_for_pytorchs_profiler_and_shares_again_after(sharing_cupti, monkeypatch):
    fake = sharing_cupti
    fake.held_by_other, fake.other_shares = True, True  # a client that shares CUPTI: xsp shares too
    kineto = FakeKineto(fake)
    refused_before = fake.library.refused_one_subscriber_calls()
    messages, trace = _with_torch_profiler(fake, kineto, monkeypatch, {torch.autograd.ProfilerActivity.CUDA})
    assert kineto.found == [(0, set(), 0)] and not fake.library.any_enabled_v2()
    # the records read as the shared subscription ended (twice, before each unsubscription: the
    # one-subscriber calls stay refused while the other client shares CUPTI) are all in the trace
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert sorted(kernels[col.STEP].unique().tolist()) == [0, 1, 4, 5] and len(kernels) == 4 * 5
    assert trace.metadata["tracer_details"]["kernel"]["cupti_subscription"].startswith("shared")
    assert fake.library.refused_one_subscriber_calls() == refused_before
    assert len(messages) == 1 and fake.subscribers == 0 and not fake.shared


def test_a_layer_call_open_across_a_stand_down_pops_from_the_stack_it_pushed_to(sharing_cupti, monkeypatch):
    fake = sharing_cupti
    fake.held_by_other, fake.other_shares = True, True
    kineto = FakeKineto(fake)
    profiler = kineto.install(monkeypatch)
    inside, release, depths = threading.Event(), threading.Event(), []

    class Waiting(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inside.set()
            assert release.wait(60)
            return x

    def other_thread() -> None:
        with torch.no_grad():
            torch.nn.Sequential(Waiting())(torch.randn(2, 8))  # pushed for xsp's shared subscriber
        depths.append(fake.library.process_depth())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", xsp.XspWarning)
        with xsp.trace(levels="model,layer,kernel", output=None) as session:
            worker = threading.Thread(target=other_thread)
            worker.start()
            assert inside.wait(60)
            profiler._prepare_profiler(object(), {torch.autograd.ProfilerActivity.CUDA})  # xsp lets go
            release.set()  # the call returns while CUPTI is Kineto's: nothing popped from its stack
            worker.join()
            profiler._disable_profiler()
    assert depths == [0]
    assert _cupti_records.Lost.CORRELATION.value not in session.trace.metadata["dropped"]


def test_a_client_that_holds_cupti_alone_refuses_xsp_asking_to_share_it_by_name(sharing_cupti):
    fake = sharing_cupti
    fake.held_by_other, fake.holder_name = True, "CUPTI for Nsight Systems"
    reason = _cupti.SOURCE.available()
    assert reason.startswith("CUPTI is held by 'CUPTI for Nsight Systems': another CUPTI client holds")
    messages, trace = _warned(fake, "model,layer,kernel")
    assert len(messages) == 1 and "'CUPTI for Nsight Systems'" in messages[0]
    assert not fake.shared and fake.subscribers == 0


def test_before_cupti_13_5_xsp_holds_cupti_alone(c_path):
    trace = _trace(c_path)
    assert trace.metadata["tracer_details"]["kernel"]["cupti_subscription"] == "xsp alone"
    assert ("subscribe", "shared") not in c_path.calls and ("subscribe",) in c_path.calls


def test_on_the_c_path_layer_calls_push_their_ids_from_c_and_cupti_python_reads_no_record(c_path):
    from xsp.record import hotpath

    if hotpath.HOTPATH is None:
        pytest.skip("xsp.record._hotpath is not built here")
    model = _model(c_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            installed = torch.nn.Module.__dict__["__call__"]
            for _ in range(3):
                model(torch.randn(2, 8))
    assert type(installed).__name__ == "FastCall"  # C wraps every module call: no Python wrapper
    assert c_path.python_callbacks == 0 and c_path.pushes == 3 * 6
    details = session.trace.metadata["tracer_details"]["kernel"]
    assert details["record_path"] == "C" and details["cupti_release"] == "13.4"
    assert details["buffers_zeroed_by"] == "xsp" and details["records_read"] >= 45
    assert session.trace.metadata["hierarchy"]["external_linked"] == 15


def test_records_cupti_dropped_are_in_the_trace_and_the_report(fake):
    from rich.console import Console

    from xsp.reports.terminal import render_report

    model = _model(fake)
    with pytest.warns(xsp.XspWarning, match="5 CUDA activity records CUPTI dropped"):
        with xsp.trace(levels="model,layer,cuda_api,kernel", output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))
            fake.add_dropped(5)
    trace = session.trace
    assert trace.metadata["dropped"] == {_cupti_records.Lost.BY_CUPTI.value: 5}
    details = trace.metadata["tracer_details"]["kernel"]
    assert details["records_dropped_by_cupti"] == 5
    assert details["buffers_with_records_dropped"] == 1 and details["most_records_dropped_in_a_buffer"] == 5
    console = Console(width=200, record=True, color_system=None)
    render_report(trace, console)
    assert "dropped: 5 CUDA activity records CUPTI dropped" in console.export_text()


def test_records_cupti_dropped_after_its_last_buffer_are_counted_at_the_end(fake):
    model = _model(fake)
    with pytest.warns(xsp.XspWarning, match="3 CUDA activity records CUPTI dropped"):
        with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
            model(torch.randn(2, 8))
            fake.activity_flush_all(0)  # every record handed over
            fake.add_dropped(3)  # then dropped, with no buffer completed after
    assert session.trace.metadata["dropped"] == {_cupti_records.Lost.BY_CUPTI.value: 3}


def test_without_the_c_path_records_are_read_through_cupti_python_with_one_warning(monkeypatch, tmp_path):
    fake = FakeCupti()
    source = CuptiSource(module=lambda: fake, library=str(tmp_path / "libcupti.so.13"))  # nothing loaded there
    monkeypatch.setattr(_cupti, "SOURCE", source)
    monkeypatch.setattr(CudaApiTracer.__init__, "__defaults__", (source,))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    messages, trace = _warned(fake, "model,layer,kernel")
    assert len(messages) == 1 and "read through cupti-python" in messages[0] and "is not loaded" in messages[0]
    assert fake.python_callbacks == 1
    spans = trace.spans
    assert (spans[col.KIND] == SpanKind.KERNEL.value).sum() == 5
    details = trace.metadata["tracer_details"]["kernel"]
    assert details["record_path"] == "Python (cupti-python)" and "is not loaded" in details["why_not_c"]


def test_a_streamed_session_interprets_cuda_windows_in_helpers_with_every_kernel(fake, monkeypatch, tmp_path):
    import xsp.session.options

    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end
    model = _model(fake)
    with xsp.trace(levels="model,layer,cuda_api,kernel", output=tmp_path / "run.xsp.parquet") as session:
        with torch.no_grad():
            for _ in range(6):
                model(torch.randn(2, 8))
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    spans = trace.spans
    assert (spans[col.KIND] == SpanKind.KERNEL.value).sum() == 6 * 5
    hierarchy = trace.metadata["hierarchy"]
    # what CUPTI handed over after its window closed is placed as well
    assert hierarchy["external_linked"] + hierarchy["late_linked"] == 6 * 5
    assert spans[spans[col.LEVEL].isin(["cuda_api", "kernel"])][col.STEP].notna().all()
    meta = session.trace.metadata
    assert meta["helper_windows"] >= 1 and meta["closed_windows"] >= 3  # CUDA windows are interpreted in helpers


def test_a_failing_layer_pops_the_id_it_pushed_from_c(c_path):
    class Failing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c_path.launch()
            raise ValueError("bad input")

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Failing())
    with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
        for _ in range(2):
            with pytest.raises(ValueError, match="bad input"):
                model(torch.randn(2, 8))
    assert c_path.stack_depth == 0 and c_path.pushes == 2 * 3
    spans = session.trace.spans
    api = spans[spans[col.LEVEL] == Level.CUDA_API.value]
    assert len(api) == 2 and api[col.EXTERNAL_ID].notna().all()
    failed = spans[spans[col.NAME] == "model.1"]
    assert (failed[col.STATUS] == "error").all() and set(failed[col.EXTERNAL_ID]) == set(api[col.EXTERNAL_ID])


# CUPTI left as found, the end of a session, one clock, impossible records -----------------------
def _calls(fake: FakeCupti, what: str) -> list[int]:
    return [call[1] for call in fake.calls if call[0] == what]


@pytest.mark.parametrize("zeroed_before", [0, 1], ids=["cuptis-default", "set-by-another-client"])
def test_a_session_leaves_cupti_as_it_found_it(c_path, zeroed_before):
    library = c_path.library
    library.reset_attribute(zeroed_before)
    c_path.thread_id_type = 0  # CUPTI's default: pthread_self()
    model = _model(c_path)
    with xsp.trace(levels="model,layer,cuda_api,kernel", output=None) as session, torch.no_grad():
        model(torch.randn(2, 8))
        assert library.zeroed_attribute() == 1 and library.has_timestamp_callback()  # xsp's, while it runs
        assert c_path.thread_id_type == 1
    assert session.trace.metadata["tracer_details"]["kernel"]["buffers_zeroed_by"] == "xsp"
    # every kind enabled was disabled, the per-call switches and the thread-id type set back, the subscription gone
    assert sorted(_calls(c_path, "enable")) == sorted(_calls(c_path, "disable")) and c_path.enabled == set()
    assert c_path.silenced == set() and c_path.thread_id_type == 0
    assert c_path.subscribers == 0 and c_path.calls.count(("subscribe",)) == c_path.calls.count(("unsubscribe",))
    # the attribute as it was, and CUPTI's own clock (CLOCK_REALTIME) stamping records again
    assert library.zeroed_attribute() == zeroed_before
    assert abs(int(library.timestamp()) - time.time_ns()) < 1_000_000_000
    assert not any(_activity_settings().values())
    assert INTERCEPTOR._correlation is None


def _activity_settings() -> dict[str, bool]:
    """What xsp's C path still holds changed of CUPTI's settings (nothing, after a session)."""
    import xsp.record._activity as activity

    settings = activity.settings()
    return {key: settings[key] for key in ("zeroed_buffers_claimed", "host_clock")}


def test_the_end_disables_every_kind_before_the_forced_flush_so_no_record_is_left_behind(fake):
    # another thread (NCCL, a DataLoader worker) makes a CUDA call just as the session ends
    fake.while_ending = lambda: threading.Thread(target=fake.launch).run()
    trace = _trace(fake, levels="model,layer,kernel", steps=2)
    assert fake.undelivered() == 0  # nothing waits in CUPTI's buffers for the next client
    forced = max(i for i, call in enumerate(fake.calls) if call == ("flush", 1))
    assert all(i < forced for i, call in enumerate(fake.calls) if call[0] == "disable")
    assert (trace.spans[col.KIND] == SpanKind.KERNEL.value).sum() >= 2 * 5


def test_a_slewing_cupti_clock_moves_no_gpu_span_against_the_host_spans(fake):
    fake.slew = 0.02  # CUPTI's clock (CLOCK_REALTIME) slewed 2% fast: 200 us every 10 ms

    class Slow(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.01)
            return x

    model = torch.nn.Sequential(_model(fake), Slow()).eval()
    with xsp.trace(levels="model,layer,cuda_api,kernel", output=None) as session, torch.no_grad():
        for _ in range(5):
            model(torch.randn(2, 8))
    trace = session.trace
    spans = trace.spans
    parents = parent_positions(spans)
    api = np.flatnonzero((spans[col.LEVEL] == Level.CUDA_API.value).to_numpy())
    owner = parents[api]
    start, end = spans[col.START_NS].to_numpy(), spans[col.END_NS].to_numpy()
    assert len(api) == 5 * 5 and (spans[col.LEVEL].to_numpy()[owner] == Level.LAYER.value).all()
    assert ((start[owner] <= start[api]) & (end[api] <= end[owner])).all()  # inside by time alone
    assert trace.metadata["hierarchy"]["external_reparented"] == 0
    details = trace.metadata["tracer_details"]["kernel"]
    if fake.library is None:  # the offset followed: measured at open and close, interpolated between
        assert details["clock"] == ClockMode.INTERPOLATED.value and details["clock_measurements"] >= 2
        assert details["drift_ns"] >= 0.02 * 50_000_000 * 0.5
    else:  # CUPTI stamps with xsp's clock: its own slew never shows
        assert details["clock"] == ClockMode.HOST_CALLBACK.value and details["drift_ns"] == 0


def test_the_clock_interpolates_between_its_measurements_in_whole_nanoseconds():
    epoch = 1_790_000_000_000_000_000
    clock = CuptiClock(ClockMode.INTERPOLATED, [epoch, epoch + 1_000_000_000], [500, 1_500])
    cupti_ns = np.array([epoch - 10, epoch, epoch + 250_000_000, epoch + 1_000_000_000, epoch + 2_000_000_000],
                        dtype=np.uint64)
    assert clock.to_host_ns(cupti_ns).tolist() == [epoch - 510, epoch - 500, epoch + 250_000_000 - 750,
                                                   epoch + 1_000_000_000 - 1_500, epoch + 2_000_000_000 - 1_500]
    assert clock.drift_ns == 1_000 and CuptiClock.constant(7).to_host_ns(cupti_ns[:1]).tolist() == [epoch - 17]


def test_gpu_records_without_a_time_are_counted_not_drawn(fake):
    from rich.console import Console

    from xsp.reports.terminal import render_report

    class Untimed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fake.launch(untimed=True)
            fake.launch()
            return x

    with xsp.trace(levels="model,layer,kernel", output=None) as session, torch.no_grad():
        for _ in range(3):
            Untimed()(torch.randn(2, 8))
    trace = session.trace
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert len(kernels) == 3 and (kernels[col.START_NS] > 0).all()
    assert trace.metadata["dropped"] == {"gpu_no_timestamp": 3}
    console = Console(width=200, record=True, color_system=None)
    render_report(trace, console)
    assert "3 gpu_no_timestamp" in console.export_text()


def test_kernels_timed_off_the_clock_are_counted_not_drawn(fake):
    """pytorch#192021: CUPTI timed a session's first kernels ~1e14 ns before their own launches;
    drawn, they would lie a day before the run, outside every layer."""
    from rich.console import Console

    from xsp.reports.terminal import render_report

    class Misclocked(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fake.launch(misclocked_ns=-fake.get_timestamp())  # near CUPTI's epoch: hours before
            fake.launch()
            return x

    with pytest.warns(xsp.XspWarning, match="3 gpu_time_outside_session"):
        with xsp.trace(levels="model,layer,cuda_api,kernel", output=None) as session, torch.no_grad():
            for _ in range(3):
                Misclocked()(torch.randn(2, 8))
    trace = session.trace
    kernels = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
    assert len(kernels) == 3 and (kernels[col.PARENT_ID].notna()).all()
    assert trace.metadata["dropped"] == {"gpu_time_outside_session": 3}
    console = Console(width=200, record=True, color_system=None)
    render_report(trace, console)
    assert "3 gpu_time_outside_session" in console.export_text()


def test_times_out_of_range_are_left_out_of_the_columns():
    hour_ns = 3_600 * 10**9
    opened_ns = 30 * hour_ns
    read_ns = opened_ns + hour_ns
    columns = _stored([
        _api(1, opened_ns + 100, opened_ns + 200),
        kernel_record("launched", opened_ns + 300, opened_ns + 400, 1),
        kernel_record("before its launch", opened_ns + 100 - 20_000_000, opened_ns + 400, 1),
        kernel_record("a day early", opened_ns - 24 * hour_ns, opened_ns - 24 * hour_ns + 10, 7),
        kernel_record("in the future", read_ns + 2 * 10**9, read_ns + 3 * 10**9, 8),
        kernel_record("launch not here", opened_ns + 50, opened_ns + 60, 9),
        _api(2, opened_ns - 2 * 10**9, opened_ns - 10**9 - 1)])
    kept, lost = columns.without_bad_times(CuptiClock.constant(0), opened_ns, read_ns)
    assert sorted(kept[Family.KERNEL]["correlation_id"].tolist()) == [1, 9]
    assert kept[Family.API]["correlation_id"].tolist() == [1]
    assert lost == {"gpu_time_outside_session": 3, "gpu_before_its_launch": 1}
    unchecked, lost = columns.without_bad_times(CuptiClock.constant(0), None, read_ns)
    assert unchecked.count(Family.API) == 2 and lost["gpu_time_outside_session"] == 1  # the future only


def test_impossible_times_are_left_out_of_the_columns():
    columns = _stored([_api(1, 10, 20), kernel_record("k", 0, 0, 1), kernel_record("k", 50, 40, 2),
                       kernel_record("k", 30, 0, 3), kernel_record("k", 30, 60, 4), _memcpy(5, 0, 0, 8, 1)])
    kept, lost = columns.without_bad_times(CuptiClock.constant(0), None, read_ns=100)
    assert kept[Family.KERNEL]["correlation_id"].tolist() == [4] and kept.count(Family.MEMCPY) == 0
    assert kept.count(Family.API) == 1
    assert lost == {"gpu_no_timestamp": 3, "gpu_end_before_start": 1}


def _peer_copy(correlation: int, start: int, end: int) -> object:
    record = real.ActivityMemcpyPtoP4()
    record.kind, record.start, record.end, record.correlation_id = 22, start, end, correlation
    record.bytes, record.copy_kind, record.stream_id, record.device_id = 2_000_000, 10, 9, 1
    record.src_device_id, record.dst_device_id = 1, 0
    return record


def test_peer_to_peer_copies_are_recorded_with_both_devices(fake):
    _trace(fake, levels="model,kernel", steps=1)
    assert int(_cupti_records.Kind.MEMCPY2) in _calls(fake, "enable")  # CUPTI's kind for copies between GPUs
    records = _stored([_api(1, 2_000_000, 2_010_000, cbid=int(FakeCupti.RuntimeApiTraceCbid.cudaMemcpyPeerAsync_v4000)),
                       _peer_copy(1, 2_020_000, 2_040_000)])
    rows = activity_rows(records, CuptiClock.constant(1_000_000))
    copy = rows.iloc[0]
    assert (copy[col.KIND], copy[col.NAME], copy[col.COPY_KIND]) == (SpanKind.MEMCPY.value, "Memcpy PtoP", "PtoP")
    assert (copy[col.BYTES], copy[col.DEVICE_ID], copy[col.START_NS]) == (2_000_000, 1, 1_020_000)
    details = json.loads(copy[col.ATTRIBUTES])
    assert (details["src_device_id"], details["dst_device_id"]) == (1, 0)
    assert details["bandwidth_gb_s"] == pytest.approx(100.0)


def test_the_operator_level_and_both_cuda_levels_record_together(fake, monkeypatch):
    from xsp.tracers.operator import OperatorTracer

    start_profiler = OperatorTracer.start

    def start_as_kineto_does(self, recording):  # libkineto_init subscribes to CUPTI, even for a CPU-only profile
        try:
            fake.subscribe(None, None)
        except CuptiError:  # refused: Kineto goes on without CUPTI
            pass
        start_profiler(self, recording)

    monkeypatch.setattr(OperatorTracer, "start", start_as_kineto_does)
    model = _model(fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        with xsp.trace(levels="model,layer,operator,cuda_api,kernel", output=None) as session, torch.no_grad():
            for _ in range(2):
                model(torch.randn(2, 8))
    spans = session.trace.spans
    assert (spans[col.KIND] == SpanKind.KERNEL.value).sum() == 2 * 5
    assert (spans[col.LEVEL] == Level.CUDA_API.value).sum() == 2 * 5
    assert (spans[col.LEVEL] == Level.OPERATOR.value).sum() > 0


# which CUPTI -----------------------------------------------------------------------------------
def test_cupti_python_of_another_cuda_release_than_pytorchs_is_named_with_the_fix():
    note = _cupti.pairing_note("13.4.0", "12.8")
    assert "cupti-python 13.4.0 drives CUPTI 13, but PyTorch runs CUDA 12.8" in note
    assert "pip install 'xsp[cuda12]'" in note
    assert _cupti.pairing_note("13.2.0", "13.0") is None and _cupti.pairing_note("12.8.0", "12.6") is None


def test_a_mismatched_pairing_is_one_warning_and_in_the_metadata(fake, monkeypatch):
    monkeypatch.setattr(_cupti, "cupti_python_release", lambda: "13.4.0")
    monkeypatch.setattr(_cupti, "torch_cuda_release", lambda: "12.8")
    messages, trace = _warned(fake, "model,layer,cuda_api,kernel")
    assert len(messages) == 1 and "xsp[cuda12]" in messages[0]
    details = trace.metadata["tracer_details"]["kernel"]
    assert "xsp[cuda12]" in details["cupti_pairing"] and details["torch_cuda"] == "12.8"


def test_doctor_says_which_record_path_runs_and_why(fake_libcupti, monkeypatch):
    from xsp.tracers.cuda_api import record_path_here

    monkeypatch.setattr(_cupti, "probe", lambda holding=False: None)
    monkeypatch.setattr(_cupti, "torch_cuda_release", lambda: "13.0")
    assert record_path_here() == ("C", None, None)
    monkeypatch.setenv("XSP_PURE_PYTHON", "1")
    assert record_path_here()[:2] == ("Python (cupti-python)", "XSP_PURE_PYTHON is set")
    monkeypatch.setattr(_cupti, "probe", lambda holding=False: "no CUDA driver: ...")
    assert record_path_here()[:2] == ("none", "no CUDA driver: ...")


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_graph_replays_read_in_windows_are_the_whole_trace_s(fake, tmp_path):
    from tests.unit.test_tree_windows import assert_windowed_report_is_the_whole_s
    from xsp.analysis.windowed import windowed_report
    from xsp.io.tree_windows import tree_windows

    model = torch.nn.Sequential(torch.nn.Sequential(Launching(fake, 2)), torch.nn.ReLU(), Launching(fake, 3)).eval()
    path = tmp_path / "replays.xsp.parquet"
    with xsp.trace(levels="model,layer,operator,kernel", output=path), torch.no_grad():
        model(torch.randn(2, 8))  # step 0: eager
        fake.capturing_graph = 1  # step 1: captured, in a window of its own (a window of one tree below)
        model(torch.randn(2, 8))
        fake.capturing_graph = None
        replayer = Replaying(fake, fake.instantiate(executable_graph=2), 2)
        for _ in range(3):  # steps 2-4: replays, each in a window without the capture
            replayer(torch.randn(2, 8))
    trace = xsp.load(path)
    windows = tree_windows(path, window_spans=1)
    report = windowed_report(windows)
    assert not report.left_out
    per_operator = report.kernels_per_operator
    assert per_operator is not None
    pd.testing.assert_frame_equal(per_operator, gpu.kernel_time_per_operator(trace))
    replays = gpu.replay_table_of(gpu.replay_sums(gpu.replayed_layers(trace)))
    assert replays.set_index("layer")["replays"].to_dict() == {"model.0": 3, "model.0.0": 3, "model.2": 3}
    pd.testing.assert_frame_equal(report.graph_replays, replays)
    assert_windowed_report_is_the_whole_s(trace, path, 1)
    # a window of a replay alone finds where its kernels' nodes were captured in the sites of all
    sites = gpu.capture_sites([gpu.capture_site_parts(spans, order) for spans, order in windows.frames()])
    replay_windows = [spans for spans, _ in windows.frames() if (spans[col.NAME] == "cudaGraphLaunch").any()]
    assert len(replay_windows) == 3
    for spans in replay_windows:
        table = gpu.kernel_table(spans, sites)
        assert table["replayed"].all() and sorted(set(table["layer"])) == ["model.0.0", "model.2"]
        assert not gpu.kernel_table(spans)["replayed"].any()  # its own marks: none, the capture is elsewhere
