"""The gpu_metrics level without a GPU: PM samples built by hand, a stand-in collector."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("cupti.pm_sampling", reason="cupti-python 13.3 or later (PM sampling) is not installed")

from cupti.pm_sampling import Sample  # noqa: E402

import xsp  # noqa: E402
from xsp.analysis import counters_per_kernel, kernel_roofline  # noqa: E402
from xsp.core import schema as col  # noqa: E402
from xsp.core.schema import Level, SpanKind  # noqa: E402
from xsp.record.recording import Recording  # noqa: E402
from xsp.record.window import Window  # noqa: E402
from xsp.table.build import conform  # noqa: E402
from xsp.tracers import gpu_metrics  # noqa: E402
from xsp.tracers.gpu_metrics import (  # noqa: E402
    DECODE_SAMPLES,
    DRAM_METRICS,
    FLOP_METRICS,
    METRIC_SETS,
    GpuMetricsTracer,
    sample_rows,
)

FFMA = "sm__sass_thread_inst_executed_op_ffma_pred_on.sum"
FADD = "sm__sass_thread_inst_executed_op_fadd_pred_on.sum"


def test_samples_become_counter_spans_with_dram_bytes_and_flops():
    metrics = [*DRAM_METRICS, FFMA, FADD]
    samples = [Sample(1_000_100, 1_000_200, [300.0, 100.0, 10.0, 5.0]),
               Sample(1_000_200, 1_000_300, [0.0, 0.0, 0.0, 0.0])]
    rows = sample_rows(samples, metrics, offset_ns=1_000_000, device_id=1)
    assert rows[col.START_NS].tolist() == [100, 200] and rows[col.END_NS].tolist() == [200, 300]
    assert rows[col.BYTES].tolist() == [400, 0]
    assert rows[col.FLOPS].tolist() == [2 * 10 + 5, 0]  # an FMA is two operations
    assert set(rows[col.LEVEL]) == {Level.GPU_METRICS.value} and set(rows[col.KIND]) == {SpanKind.COUNTERS.value}
    assert (rows[col.DEVICE_ID] == 1).all()


def _spans(rows: list[dict]) -> pd.DataFrame:
    table = conform(pd.DataFrame(rows))
    table[col.SPAN_ID] = range(1, len(table) + 1)
    table[col.DURATION_NS] = table[col.END_NS] - table[col.START_NS]
    return table


def _kernel(name: str, start: int, end: int, device: int = 0) -> dict:
    return {col.LEVEL: Level.KERNEL.value, col.KIND: SpanKind.KERNEL.value, col.NAME: name,
            col.START_NS: start, col.END_NS: end, col.DEVICE_ID: device}


def _sample(start: int, end: int, flops: int, dram: int, device: int = 0) -> dict:
    return {col.LEVEL: Level.GPU_METRICS.value, col.KIND: SpanKind.COUNTERS.value, col.NAME: "pm_sample",
            col.START_NS: start, col.END_NS: end, col.FLOPS: flops, col.BYTES: dram, col.DEVICE_ID: device}


def test_each_sample_is_shared_among_the_kernels_by_their_time_in_it():
    spans = _spans([
        _sample(0, 100, flops=1000, dram=100), _sample(100, 200, flops=600, dram=60),
        _sample(200, 300, flops=50, dram=5),  # no kernel ran: not any kernel's
        _kernel("gemm", 0, 150),  # all of sample 0's time with "a" overlapping half of it
        _kernel("a", 50, 100),
        _kernel("b", 150, 200),
        _kernel("other_device", 0, 300, device=1),
    ])
    shares = counters_per_kernel(spans).set_index("name")
    # sample 0: gemm 100 ns, a 50 ns -> 2/3 and 1/3; sample 1: gemm 50 ns, b 50 ns -> halves
    assert shares.loc["gemm", "flops"] == pytest.approx(1000 * 2 / 3 + 300)
    assert shares.loc["a", "flops"] == pytest.approx(1000 / 3)
    assert shares.loc["b", "dram_bytes"] == pytest.approx(30)
    assert "other_device" not in shares.index
    assert shares["flops"].sum() == pytest.approx(1600)


def test_the_roofline_uses_sampled_counters_when_kernels_carry_none():
    spans = _spans([_sample(0, 100, flops=4_000, dram=1_000), _kernel("gemm", 0, 100)])
    trace = xsp.Trace(spans=spans, metadata={"device": "cuda:0 NVIDIA A100-SXM4-80GB"})
    row = kernel_roofline(trace).set_index("name").loc["gemm"]
    assert row["flops"] == 4_000 and row["dram_bytes"] == 1_000 and row["arithmetic_intensity"] == 4.0
    assert row["bound"] == "memory"


class CounterData(list):
    """Stands in for ``pm_sampling.CounterData``: the completed samples and the image's slots."""

    def __init__(self, samples: list[Sample], total: int) -> None:
        super().__init__(samples)
        self.num_total_samples, self.num_populated_samples = total, len(samples)


class FakeCollector:
    """Stands in for ``pm_sampling.Collector``: refuses metric sets that are too big; its hardware
    buffer holds samples starting at ``held``."""

    def __init__(self, device_index: int = 0, fits: int = len(METRIC_SETS[1]), denied: bool = False,
                 held: tuple[int, ...] = (10,)) -> None:
        self.fits, self.denied, self.held = fits, denied, list(held)
        self.configured: list[str] = []
        self.state = "new"

    def enable(self) -> None:
        if self.denied:
            raise PermissionError("ERROR_INSUFFICIENT_PRIVILEGES")
        self.state = "enabled"

    def configure(self, *, metrics: list[str], sampling_interval: int, hardware_buffer_size: int) -> None:
        if len(metrics) > self.fits:
            raise ValueError("Requested PM sampling configuration is not supported.")
        self.configured = metrics

    def start(self) -> None:
        self.state = "started"

    def stop(self) -> None:
        self.state = "stopped"

    def decode(self, max_samples: int) -> CounterData:
        """Like cupti-python's: at most ``max_samples`` from what the hardware buffer holds."""
        taken, self.held = self.held[:max_samples], self.held[max_samples:]
        return CounterData([Sample(start, start + 10, [1.0] * len(self.configured)) for start in taken],
                           total=max_samples)

    def disable(self) -> None:
        self.state = "disabled"


@pytest.fixture
def pm(monkeypatch):
    made: list[FakeCollector] = []
    options: dict = {}

    class Module:
        @staticmethod
        def Collector(device_index: int = 0) -> FakeCollector:  # noqa: N802 - the real class's name
            made.append(FakeCollector(device_index, **options))
            return made[-1]

    class Cupti:
        @staticmethod
        def get_timestamp() -> int:
            return 0

    monkeypatch.setattr(gpu_metrics, "pm_sampling_module", lambda: Module)
    monkeypatch.setattr(gpu_metrics, "cupti_module", lambda: Cupti)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return made, options


def test_the_largest_metric_set_that_fits_in_one_pass_is_used(pm):
    made, _ = pm
    tracer = GpuMetricsTracer()
    tracer.start(Recording())
    assert made[0].configured == list(METRIC_SETS[1]) and made[0].state == "started"
    tracer.stop()
    assert made[0].state == "disabled"
    rows = tracer.collect(Window([], final=True))
    assert rows[col.BYTES].tolist() == [2] and rows[col.FLOPS].tolist() == [1 + 1 + 2]
    assert tracer.metadata()["metrics"] == list(METRIC_SETS[1])
    assert set(METRIC_SETS[0]) == {*DRAM_METRICS, *FLOP_METRICS}


def test_every_sample_in_the_hardware_buffer_is_decoded_not_only_the_first_image(pm):
    made, options = pm
    options["held"] = tuple(range(0, 10 * (2 * DECODE_SAMPLES + 1), 10))
    tracer = GpuMetricsTracer()
    tracer.start(Recording())
    tracer.stop()
    rows = tracer.collect(Window([], final=True))
    assert len(rows) == 2 * DECODE_SAMPLES + 1 and rows[col.START_NS].is_unique
    assert made[0].held == []


def test_without_permission_the_tracer_says_how_to_get_it(pm):
    _, options = pm
    options["denied"] = True
    with pytest.raises(RuntimeError, match="NVreg_RestrictProfilingToAdminUsers=0"):
        GpuMetricsTracer().start(Recording())


def test_a_cupti_without_pm_sampling_is_a_reason(monkeypatch):
    def missing():
        raise ImportError("No module named 'cupti.pm_sampling'")

    monkeypatch.setattr(gpu_metrics, "probe", lambda: None)
    monkeypatch.setattr(gpu_metrics, "pm_sampling_module", missing)
    assert "has no PM sampling (it needs 13.3 or later" in GpuMetricsTracer().available()
