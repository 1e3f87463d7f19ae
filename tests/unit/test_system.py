"""The system level: its readers (on fake RAPL files and a fake NVML), each step's averages
and energy, and a real session sampling this machine."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import xsp
from xsp import analysis
from xsp.core import schema as col
from xsp.core.threads import start_thread
from xsp.record.samples import EnergyMethod, step_averages
from xsp.tracers import system as system_tracer
from xsp.tracers.system import (
    GpuReader,
    HostReader,
    ProcessReader,
    SystemTracer,
    rapl_counters,
    sampling_hz,
    visible_gpus,
)

S = 1_000_000_000


def long_samples(*intervals):
    """(device, metric, start_s, end_s, value, method) -> sample_table's long format."""
    return pd.DataFrame([{"start_ns": int(a * S), "end_ns": int(b * S), "source": device.rstrip("0123456789"),
                          "device": device, "metric": metric, "value": value, "energy_method": method}
                         for device, metric, a, b, value, method in intervals])


def test_a_step_gets_time_weighted_averages_and_the_energy_inside_it():
    samples = long_samples(("gpu0", "power_w", 0, 1, 100.0, "counter"), ("gpu0", "power_w", 1, 2, 300.0, "counter"),
                           ("gpu0", "energy_j", 0, 1, 100.0, "counter"), ("gpu0", "energy_j", 1, 2, 300.0, "counter"))
    # a step over the second half of the first interval and all of the second
    (found,) = step_averages(samples, np.array([int(0.5 * S)]), np.array([2 * S]))
    assert found["gpu0.power_w"] == pytest.approx((100 * 0.5 + 300 * 1) / 1.5)
    assert found["gpu0.energy_j"] == pytest.approx(50 + 300)
    assert found["gpu0.energy_method"] == "counter"


def test_a_step_shorter_than_an_interval_gets_its_share_marked_estimated():
    samples = long_samples(("gpu0", "energy_j", 0, 1, 100.0, "polled"), ("gpu0", "utilization_percent", 0, 1, 40.0,
                                                                          "polled"))
    (found,) = step_averages(samples, np.array([int(0.2 * S)]), np.array([int(0.3 * S)]))
    assert found["gpu0.energy_j"] == pytest.approx(10.0)
    assert found["gpu0.energy_method"] == EnergyMethod.ESTIMATED.value
    assert found["gpu0.utilization_percent"] == pytest.approx(40.0)


def test_a_step_no_sample_covers_gets_nothing_and_unmeasured_energy_says_so():
    samples = long_samples(("host", "cpu_percent", 0, 1, 50.0, "unavailable"),
                           ("process", "cpu_percent", 0, 1, 90.0, "unavailable"))
    inside, after = step_averages(samples, np.array([0, 5 * S]), np.array([S, 6 * S]))
    assert inside == {"host.cpu_percent": 50.0, "process.cpu_percent": 90.0, "host.energy_method": "unavailable"}
    assert after == {}


def write_rapl(root, package, energy_uj, limit_uj=1_000_000):
    zone = root / f"intel-rapl:{package}"
    zone.mkdir(exist_ok=True)
    (zone / "energy_uj").write_text(str(energy_uj))
    (zone / "max_energy_range_uj").write_text(str(limit_uj))
    return zone


def test_host_energy_comes_from_the_rapl_package_counters_across_a_wrap(tmp_path):
    write_rapl(tmp_path, 0, 900_000)
    write_rapl(tmp_path, 1, 10_000)
    (write_rapl(tmp_path, 0, 0).parent / "intel-rapl:0:0").mkdir()  # a subzone (core): inside package 0
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("5")
    assert [path.parent.name for path, _ in rapl_counters(tmp_path)] == ["intel-rapl:0", "intel-rapl:1"]
    write_rapl(tmp_path, 0, 900_000)
    reader = HostReader(rapl_root=tmp_path)
    assert reader.sample(0) is None  # the first reading starts the first interval
    write_rapl(tmp_path, 0, 100_000)  # wrapped: 100k past the 1M range
    write_rapl(tmp_path, 1, 60_000)
    sample = reader.sample(S // 2)
    assert sample is not None and sample.energy_method == "counter"
    assert sample.metrics["energy_j"] == pytest.approx(0.2 + 0.05)
    assert sample.metrics["power_w"] == pytest.approx(0.5)
    # (read at once: too few of the kernel's CPU ticks for a busy share, which is then left out)
    assert 0 <= sample.metrics.get("cpu_percent", 0) <= 100 and sample.metrics["memory_used_bytes"] > 0


def test_unreadable_rapl_means_no_host_energy(tmp_path):
    assert rapl_counters(tmp_path / "absent") == []
    reader = HostReader(rapl_root=tmp_path / "absent")
    reader.sample(0)
    sample = reader.sample(S)
    assert sample is not None and sample.energy_method == "unavailable" and "energy_j" not in sample.metrics


class FakeNvml:
    """Just what the GPU reader calls, for two GPUs: GPU 0 has an energy counter, GPU 1 not."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.energy_mj = {0: 1_000_000}
        self.power_mw = {0: 200_000, 1: 100_000}

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return f"GPU-{handle}aaaa-bbbb"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=75)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=2**30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.power_mw[handle]

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1410

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if handle not in self.energy_mj:
            raise self.NVMLError("Not Supported")
        return self.energy_mj[handle]


def test_gpu_energy_from_the_counter_or_else_from_polled_power():
    nvml = FakeNvml()
    with_counter, without = GpuReader(nvml, 0, 0), GpuReader(nvml, 1, 1)
    assert with_counter.has_counter and not without.has_counter
    for reader in (with_counter, without):
        reader.sample(0)
    nvml.energy_mj[0] += 50_000  # 50 J in 0.5 s
    nvml.power_mw[1] = 300_000
    counted, polled = with_counter.sample(S // 2), without.sample(S // 2)
    assert counted is not None and counted.energy_method == "counter" and counted.metrics["energy_j"] == 50.0
    assert counted.metrics == {"utilization_percent": 75, "memory_used_bytes": 2**30, "power_w": 200.0,
                               "sm_clock_mhz": 1410, "energy_j": 50.0}
    assert polled is not None and polled.energy_method == "polled"
    assert polled.metrics["energy_j"] == pytest.approx((100 + 300) / 2 * 0.5)  # trapezoid
    assert polled.device_id == 1 and polled.source == "gpu"


@pytest.mark.parametrize(("visible", "expected"), [(None, [(0, 0), (1, 1)]), ("1", [(0, 1)]), ("1,0", [(0, 1), (1, 0)]),
                                                    ("GPU-1aaaa", [(0, 1)]), ("0,7,1", [(0, 0)]), ("", [])])
def test_the_gpus_sampled_are_those_cuda_shows_numbered_as_cuda_numbers_them(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpus(FakeNvml()) == expected


@pytest.mark.parametrize(("given", "hz"), [(None, 10.0), ("50", 50.0), ("0", 10.0), ("fast", 10.0)])
def test_the_sampling_rate_comes_from_the_environment(monkeypatch, given, hz):
    if given is None:
        monkeypatch.delenv(system_tracer.HZ_ENV, raising=False)
    else:
        monkeypatch.setenv(system_tracer.HZ_ENV, given)
    assert sampling_hz() == hz


def test_a_session_samples_this_machine_and_each_step_carries_its_averages(tmp_path, monkeypatch):
    monkeypatch.setenv(system_tracer.HZ_ENV, "50")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    with xsp.trace(levels="model,system", output=tmp_path / "s.xsp.parquet") as session:
        for _ in range(10):
            model(torch.randn(32, 64))
            time.sleep(0.03)
    assert session.warnings == []
    trace = xsp.load(tmp_path / "s.xsp.parquet")
    metrics = analysis.system_metrics(trace)
    assert list(metrics.columns) == ["time_ns", "source", "device", "metric", "value", "unit"]
    assert {"process", "host"} <= set(metrics["source"])
    assert set(metrics[metrics["source"] == "process"]["metric"]) == {"cpu_percent", "rss_bytes"}
    rss = metrics[metrics["metric"] == "rss_bytes"]
    assert (rss["unit"] == "B").all() and (rss["value"] > 10 * 2**20).all()
    per_step = analysis.system_per_step(trace)
    assert set(per_step["step"]) == set(range(10))  # every step, even one shorter than an interval
    details = trace.metadata["tracer_details"]["system"]
    assert details["interval_s"] == pytest.approx(0.02) and details["readings"] >= 15
    assert details["reading_cost_us"] > 0
    energy = analysis.energy_per_step(trace)
    host = energy[energy["device"] == "host"]
    assert len(host) == 10
    expected = {"unavailable"} if details["cpu_energy"] == "unavailable" else {"counter", "estimated"}
    assert set(host["method"]) <= expected
    # samples are intervals that follow one another, none twice
    samples = trace.spans[(trace.spans[col.LEVEL] == "system") & (trace.spans[col.KIND] == "sample")]
    for _, group in samples.groupby(col.NAME):
        starts, ends = group[col.START_NS].to_numpy(), group[col.END_NS].to_numpy()
        order = np.argsort(starts)
        assert (starts[order][1:] == ends[order][:-1]).all()


def test_samples_survive_streamed_windows(tmp_path, monkeypatch):
    """A long session writes windows as it goes: each window's samples come once, in order."""
    monkeypatch.setenv(system_tracer.HZ_ENV, "40")
    model = torch.nn.Linear(8, 8)
    with xsp.trace(levels="model,system", output=tmp_path / "long.xsp.parquet") as session:
        ended = time.monotonic() + 2.5
        while time.monotonic() < ended:
            model(torch.randn(4, 8))
            time.sleep(0.005)
    trace = xsp.load(tmp_path / "long.xsp.parquet")
    assert trace.metadata["windows"] >= 2
    process = trace.spans[(trace.spans[col.LEVEL] == "system") & (trace.spans[col.NAME] == "process")]
    starts = np.sort(process[col.START_NS].to_numpy())
    ends = np.sort(process[col.END_NS].to_numpy())
    assert len(process) >= 60 and (starts[1:] == ends[:-1]).all()
    steps = trace.spans[trace.spans[col.KIND] == "predict"]
    annotated = [json.loads(text) for text in steps[col.ATTRIBUTES].tolist() if isinstance(text, str)]
    assert sum("xsp.system.process.cpu_percent" in a for a in annotated) >= 0.9 * len(steps)
    assert session.warnings == []


def test_without_psutil_the_level_is_unavailable_with_the_reason(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    assert SystemTracer().available() == "psutil is not installed (pip install psutil)"


def test_host_cpu_share_stays_within_0_and_100_when_float_sums_jitter(tmp_path):
    # busy time is total minus idle, two big float sums: over a short interval it can read a few
    # ulps lower than before (CI saw -3.6e-08 %), and a busy share can never pass the total.
    reader = HostReader(rapl_root=tmp_path / "absent")
    big = 123456789.123
    fell, _ = reader.interval((big, big * 2, 1, None), (big - 1e-7, big * 2 + 1.0, 1, None), 0.5)
    assert fell["cpu_percent"] == 0.0
    rose, _ = reader.interval((big, big * 2, 1, None), (big + 2.0, big * 2 + 1.0, 1, None), 0.5)
    assert rose["cpu_percent"] == 100.0
    half, _ = reader.interval((big, big * 2, 1, None), (big + 0.5, big * 2 + 1.0, 1, None), 0.5)
    assert half["cpu_percent"] == pytest.approx(50.0, abs=1e-3)


def test_an_interval_too_short_for_the_kernels_cpu_ticks_has_no_host_cpu_share(tmp_path):
    """The host's CPU time is counted in ticks of 10 ms: a session of 4.5 ms read 100% in one run
    and 0% in the next. Under 10 ticks over all CPUs, the interval has memory but no busy share."""
    reader = HostReader(rapl_root=tmp_path / "absent")
    tick = reader.tick_s
    short, _ = reader.interval((1.0, 2.0, 1, None), (1.0 + tick, 2.0 + tick, 7, None), 0.0045)
    assert "cpu_percent" not in short and short["memory_used_bytes"] == 7
    long, _ = reader.interval((1.0, 2.0, 1, None), (1.0 + 5 * tick, 2.0 + 10 * tick, 7, None), 0.05)
    assert long["cpu_percent"] == pytest.approx(50.0)


def test_the_process_cpu_time_is_read_finer_than_the_kernels_ticks():
    """psutil's process CPU time moves in ticks of 10 ms: 3 ms of work read 0 or 10 ms."""
    reader = ProcessReader()
    before, _ = reader.read()
    while time.process_time() - before < 0.003:
        pass
    after, rss = reader.read()
    assert after - before >= 0.003 and rss > 0


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _Collecting(torch.nn.Module):
    """A layer whose forward sets off a full collection (as an allocation past the threshold does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import gc

        gc.collect()
        return x


def test_a_collection_inside_a_call_that_outlives_its_window_is_placed_under_that_call(tmp_path, monkeypatch):
    """A thread inside a module call when a window closes keeps its records for a later window:
    a collection that interrupted that call waits with them, and lands under the call."""
    import gc
    import threading

    import xsp.session.options
    from xsp.core.lazy import background_imports_done

    monkeypatch.setenv(system_tracer.HZ_ENV, "1")
    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end
    collected, release = threading.Event(), threading.Event()

    class CollectThenWait(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gc.collect()
            collected.set()
            release.wait(60)
            return x

    waiting = torch.nn.Sequential(torch.nn.Linear(8, 8), CollectThenWait())
    other = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with torch.no_grad(), xsp.trace(levels="model,layer,system", output=tmp_path / "held.xsp.parquet") as session:
        background_imports_done()
        thread = threading.Thread(target=lambda: waiting(torch.randn(2, 8)))
        thread.start()
        assert collected.wait(60)
        for _ in range(3):  # steps of this thread close windows while the other waits inside its call
            other(torch.randn(2, 8))
        release.set()
        thread.join()
        waiting_thread = thread.native_id
    assert session.warnings == []
    trace = xsp.load(tmp_path / "held.xsp.parquet")
    assert trace.metadata["windows"] >= 3
    spans = trace.spans
    full = spans[(spans[col.KIND] == "gc") & (spans[col.THREAD_ID] == waiting_thread)]
    assert len(full) == 1
    by_id = spans.set_index(col.SPAN_ID)
    parent = by_id.loc[full[col.PARENT_ID].iloc[0]]
    assert parent[col.NAME] == "waiting.1" and parent[col.THREAD_ID] == waiting_thread  # the layer it interrupted


def test_a_session_records_each_garbage_collection_under_the_span_it_interrupted(tmp_path, monkeypatch):
    import gc
    import threading

    from xsp.core.lazy import background_imports_done
    from xsp.export.chrome import chrome_events

    # a gc.collect() called while another thread's collection runs does nothing: let xsp's
    # threads (its imports, the sampler) be still while this one collects
    monkeypatch.setenv(system_tracer.HZ_ENV, "1")
    callbacks_before = list(gc.callbacks)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _Collecting())
    with xsp.trace(levels="model,layer,system", output=tmp_path / "gc.xsp.parquet") as session:
        background_imports_done()
        for _ in range(3):
            model(torch.randn(4, 8))
        cycles = [_Cycle() for _ in range(500)]
        del cycles
        gc.collect(1)
        start_thread(gc.collect, "xsp-test-collect").join()  # xsp's own work: counted apart
    assert gc.callbacks == callbacks_before  # the level's callback left with the session
    assert session.warnings == []
    trace = xsp.load(tmp_path / "gc.xsp.parquet")
    spans = trace.spans
    found = spans[spans[col.KIND] == "gc"]
    assert (found[col.LEVEL] == "system").all() and (found[col.DURATION_NS] > 0).all()
    attributes = [json.loads(text) for text in found[col.ATTRIBUTES]]
    generations = [a[col.ATTR_GC_GENERATION] for a in attributes]
    assert {1, 2} <= set(generations)
    assert set(found[col.NAME]) >= {"gc generation 1", "gc generation 2"}
    assert sum(a[col.ATTR_GC_COLLECTED] for a in attributes) >= 500  # the cycles, freed by the collect(1)
    # each full one ran on this thread, inside the layer that set it off, in that layer's step
    full = found[found[col.NAME] == "gc generation 2"]
    assert len(full) == 3 and (full[col.THREAD_ID] == threading.get_native_id()).all()
    by_id = spans.set_index(col.SPAN_ID)
    assert [by_id.loc[parent, col.NAME] for parent in full[col.PARENT_ID]] == ["model.1"] * 3
    assert sorted(full[col.STEP].tolist()) == [0, 1, 2]
    # the one after the loop delayed no step: it hangs from the session, with no step
    (after,) = found[found[col.NAME] == "gc generation 1"].sort_values(col.START_NS).tail(1).itertuples()
    assert by_id.loc[getattr(after, col.PARENT_ID), col.KIND] == "session" and pd.isna(getattr(after, col.STEP))
    assert trace.metadata["hierarchy"]["other_without_thread"] == 0
    details = trace.metadata["tracer_details"]["system"]
    assert details["gc_collections"] == len(found) and details["gc_collections_dropped"] == 0
    assert details["gc_collections_by_xsp"] >= 1 and details["gc_ms_by_xsp"] > 0
    assert len(full) == 3  # the one on xsp's thread is no span
    table = analysis.gc_collections(trace)
    assert list(table.columns) == ["generation", "collections", "total_ms", "mean_ms", "max_ms", "collected",
                                   "wall_share"]
    assert table["collections"].sum() == len(found)
    assert table.set_index("generation").loc[2, "collections"] == generations.count(2)
    assert ((table["wall_share"] > 0) & (table["wall_share"] < 1)).all()
    # a slice on its thread's track in the Chrome and Perfetto views
    events = chrome_events(trace)
    slices = [e for e in (events["traceEvents"] if isinstance(events, dict) else events)
              if e.get("ph") == "X" and e["name"] == "gc generation 2"]
    assert len(slices) == 3 and {e["tid"] for e in slices} == {threading.get_native_id()}


def gc_trace(steps_us, gc_us, generation=2):
    """Steps (start, end) on one thread, and collections (start, end) of ``generation``."""
    rows = [(index + 1, None, "model", "step", "train_step", start, end, {col.STEP: index})
            for index, (start, end) in enumerate(steps_us)]
    for offset, (start, end) in enumerate(gc_us):
        rows.append((100 + offset, None, "system", "gc", f"gc generation {generation}", start, end,
                     {col.ATTRIBUTES: json.dumps({col.ATTR_GC_GENERATION: generation, col.ATTR_GC_COLLECTED: 3}),
                      col.STEP: None}))
    from tests.unit.test_gpu_analyses import make_trace
    return make_trace(rows)


def test_the_collections_table_sums_each_generation_over_the_wall_time():
    trace = gc_trace([(0, 1000)], [(100, 150), (300, 310)])
    (row,) = analysis.gc_collections(trace).to_dict("records")
    assert row["generation"] == 2 and row["collections"] == 2 and row["collected"] == 6
    assert row["total_ms"] == pytest.approx(0.060) and row["max_ms"] == pytest.approx(0.050)
    assert row["mean_ms"] == pytest.approx(0.030) and row["wall_share"] == pytest.approx(0.06)
    assert analysis.gc_collections(gc_trace([(0, 1000)], [])).empty


def test_collection_time_inside_intervals_counts_each_interval_in_flight_and_overlaps_once():
    from xsp.analysis.system import gc_spans, gc_time_within

    # two collections that overlap (two processes), one apart; three intervals, two of them concurrent
    spans = gc_trace([(0, 10)], [(100, 200), (150, 250), (400, 420)]).spans
    within = gc_time_within(gc_spans(spans), np.array([0, 120, 0, 500]) * 1000, np.array([1000, 410, 90, 600]) * 1000)
    assert within.tolist() == [170_000, 140_000, 0, 0]  # 100..250 and 400..420; 120..250 and 400..410


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_keeps_no_collections_it_could_never_hand_over(tmp_path, monkeypatch):
    """A DataLoader worker forked during a session inherits the level's callback but takes no
    windows: what it would keep only grows."""
    import gc

    monkeypatch.setenv(system_tracer.HZ_ENV, "1")

    from xsp.core.lazy import background_imports_done

    with xsp.trace(levels="model,system", output=tmp_path / "fork.xsp.parquet"):
        background_imports_done()  # no collection of theirs beside this thread's (which would then do nothing)
        (tracer,) = [callback.__self__ for callback in gc.callbacks
                     if isinstance(getattr(callback, "__self__", None), SystemTracer)]
        pid = os.fork()
        if pid == 0:  # the child: its collections are not counted
            before = tracer.metadata()["gc_collections"]
            gc.collect()
            os._exit(0 if tracer.metadata()["gc_collections"] == before else 1)
        _, status = os.waitpid(pid, 0)
        counted = tracer.metadata()["gc_collections"]
        gc.collect()
        assert tracer.metadata()["gc_collections"] == counted + 1  # the parent's still are
    assert os.waitstatus_to_exitcode(status) == 0


def test_collections_past_a_windows_limit_are_counted_and_said(tmp_path, monkeypatch):
    import gc

    monkeypatch.setattr(system_tracer, "MAX_GC_PAUSES", 2)
    with pytest.warns(Warning, match=system_tracer.DROPPED_GC), \
            xsp.trace(levels="model,system", output=tmp_path / "cap.xsp.parquet") as session:
        for _ in range(6):
            gc.collect(0)
    trace = xsp.load(tmp_path / "cap.xsp.parquet")
    details = trace.metadata["tracer_details"]["system"]
    assert details["gc_collections_dropped"] >= 1
    assert trace.metadata["dropped"][system_tracer.DROPPED_GC] == details["gc_collections_dropped"]
    assert any(system_tracer.DROPPED_GC in warning for warning in session.warnings)
