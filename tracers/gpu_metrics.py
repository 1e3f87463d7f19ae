"""The ``gpu_metrics`` level: DRAM bytes and FLOPs from the GPU's performance monitors.

Through cupti-python's PM sampling (``cupti.pm_sampling``, cupti-python 13.3 and later): the
GPU samples its counters every ``SAMPLING_INTERVAL_NS`` while the session runs; each sample
becomes a ``counters`` span (level ``gpu_metrics``) with the DRAM bytes read and written and
the floating-point operations counted in that interval. :func:`xsp.analysis.counters_per_kernel`
shares each sample among the kernels that ran during it, which feeds the roofline.

Counting perturbs timings, so this is a level of its own: take durations from a run without
it (leveled experimentation does). FLOPs are counted from the SASS add, multiply and
fused-multiply-add instructions of FP16, FP32 and FP64 (an FMA is two operations); tensor-core
operations are not among them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind
from xsp.record.recording import Recording
from xsp.record.window import Window
from xsp.tracers.base import Tracer
from xsp.tracers.cuda.source import cupti_error_text, cupti_module, measure_cupti_offset, probe

SAMPLING_INTERVAL_NS = 100_000
HARDWARE_BUFFER_BYTES = 256 << 20
DECODE_SAMPLES = 10_000
"""Samples decoded at a time: one decode fills a counter image of this many, leaving the rest in
the hardware buffer for the next (100 µs samples: one second of GPU time)."""
MAX_DECODES = 10_000
"""A bound on decodes (10^8 samples, hours of GPU time) in case a collector never says it is done."""
DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
FLOP_METRICS = {
    "sm__sass_thread_inst_executed_op_fadd_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_fmul_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_ffma_pred_on.sum": 2,
    "sm__sass_thread_inst_executed_op_hadd_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_hmul_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_hfma_pred_on.sum": 2,
    "sm__sass_thread_inst_executed_op_dadd_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_dmul_pred_on.sum": 1,
    "sm__sass_thread_inst_executed_op_dfma_pred_on.sum": 2,
}
"""Instruction counters and the floating-point operations each instruction performs."""
METRIC_SETS: tuple[tuple[str, ...], ...] = (
    (*DRAM_METRICS, *FLOP_METRICS),
    (*DRAM_METRICS, *list(FLOP_METRICS)[:3]),  # FP32 only, when all do not fit in one pass
    DRAM_METRICS,
)
"""Tried in order: PM sampling collects only metrics that fit in a single pass."""
SAMPLE_NAME = "pm_sample"


def sample_rows(samples: Iterable[Any], metrics: Sequence[str], offset_ns: int, device_id: int) -> pd.DataFrame:
    """``counters`` spans from PM samples (``start_timestamp``, ``end_timestamp``,
    ``metric_values`` in the order of ``metrics``), moved onto xsp's host clock."""
    rows = []
    for sample in samples:
        values = dict(zip(metrics, sample.metric_values))
        dram = [values[name] for name in DRAM_METRICS if name in values]
        flops = [values[name] * factor for name, factor in FLOP_METRICS.items() if name in values]
        rows.append({
            col.LEVEL: Level.GPU_METRICS.value, col.KIND: SpanKind.COUNTERS.value, col.NAME: SAMPLE_NAME,
            col.START_NS: int(sample.start_timestamp) - offset_ns, col.END_NS: int(sample.end_timestamp) - offset_ns,
            col.DEVICE_ID: device_id,
            col.BYTES: int(round(sum(dram))) if dram else None,
            col.FLOPS: int(round(sum(flops))) if flops else None,
            col.ATTRIBUTES: json.dumps(values),
        })
    return pd.DataFrame(rows) if rows else pd.DataFrame()


def decoded_samples(collector: Any) -> list[Any]:
    """Every completed sample left in ``collector``'s hardware buffer: decoded
    :data:`DECODE_SAMPLES` at a time until a decode comes back with room to spare."""
    samples: list[Any] = []
    for _ in range(MAX_DECODES):
        counter_data = collector.decode(max_samples=DECODE_SAMPLES)
        samples.extend(counter_data)
        if counter_data.num_populated_samples < counter_data.num_total_samples or not len(counter_data):
            break
    return samples


def pm_sampling_module() -> Any:
    """``cupti.pm_sampling`` (cupti-python 13.3 and later)."""
    from cupti import pm_sampling

    return pm_sampling


class GpuMetricsTracer(Tracer):
    """PM sampling of DRAM bytes and FLOPs on the current CUDA device."""

    name: ClassVar[str] = "gpu_metrics"
    level: ClassVar[Level] = Level.GPU_METRICS
    collects_at_end = True
    """Its records are read when it stops, so steps are not exported before the session ends."""

    def __init__(self) -> None:
        self._collector: Any = None
        self._metrics: tuple[str, ...] = ()
        self._device_id = 0
        self._offset_ns = 0
        self._uncertainty_ns = 0
        self._samples: list[Any] = []

    def available(self) -> str | None:
        reason = probe()
        if reason is not None:
            return reason
        try:
            pm_sampling_module()
        except ImportError:
            from importlib.metadata import version

            return (f"cupti-python {version('cupti-python')} has no PM sampling (it needs 13.3 or later; "
                    "PyTorch's CUDA builds pin an older CUPTI)")
        return None

    def start(self, recording: Recording) -> None:
        import torch

        pm_sampling = pm_sampling_module()
        self._device_id = torch.cuda.current_device()
        collector = pm_sampling.Collector(device_index=self._device_id)
        try:
            collector.enable()
        except PermissionError:
            raise RuntimeError("GPU counters need administrator rights here (run as root, or load the "
                               "driver with NVreg_RestrictProfilingToAdminUsers=0)") from None
        except Exception as exc:
            raise RuntimeError(f"PM sampling could not start: {cupti_error_text(exc)}") from None
        failures = []
        for metrics in METRIC_SETS:
            try:
                collector.configure(metrics=list(metrics), sampling_interval=SAMPLING_INTERVAL_NS,
                                    hardware_buffer_size=HARDWARE_BUFFER_BYTES)
                self._metrics = metrics
                break
            except (ValueError, RuntimeError) as exc:
                failures.append(str(exc))
        else:
            collector.disable()
            raise RuntimeError(f"no metric set could be configured: {failures[-1]}")
        self._offset_ns, self._uncertainty_ns = measure_cupti_offset(cupti_module().get_timestamp)
        collector.start()
        self._collector = collector

    def stop(self) -> None:
        collector, self._collector = self._collector, None
        if collector is None:
            return
        try:
            collector.stop()
            self._samples = decoded_samples(collector)
        finally:
            collector.disable()

    def metadata(self) -> dict[str, Any]:
        return {"metrics": list(self._metrics), "sampling_interval_ns": SAMPLING_INTERVAL_NS,
                "device_id": self._device_id, "cupti_to_host_offset_ns": self._offset_ns,
                "uncertainty_ns": self._uncertainty_ns}

    def collect(self, window: Window) -> pd.DataFrame:
        if not window.final:  # samples are decoded when sampling stops
            return pd.DataFrame()
        samples, self._samples = self._samples, []
        return sample_rows(samples, self._metrics, self._offset_ns, self._device_id)
