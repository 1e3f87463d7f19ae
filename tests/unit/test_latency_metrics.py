"""The latency histograms sent as OTLP metrics: the file's own figures, cumulative, sent
periodically by a thread of xsp's and once more at the end."""

from __future__ import annotations

import threading
import time

import numpy as np
from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult
from opentelemetry.sdk.resources import Resource

from xsp.export.metrics import LAYER_DURATION, LAYER_PATH, STEP_DURATION, LatencyMetrics
from xsp.table.latency import BOUNDS_S, Latencies, LatencyHistograms


class Keeping(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []
        self.arrived = threading.Event()

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        self.sent.append(metrics_data)
        self.arrived.set()
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        pass


def points(metrics_data) -> dict[str, list]:
    scope = metrics_data.resource_metrics[0].scope_metrics[0]
    return {metric.name: list(metric.data.data_points) for metric in scope.metrics}


def test_the_file_s_histograms_are_sent_cumulative_while_the_session_runs_and_at_its_end() -> None:
    exporter = Keeping()
    metrics = LatencyMetrics(exporter, Resource.create({"service.name": "svc"}), interval_s=0.05)
    file = LatencyHistograms()  # what the session keeps for the file: what the metrics send
    windows = [Latencies(np.array([150_000, 700_000, 3_000_000]), {"encoder": np.array([90_000])}, deep_steps=1),
               Latencies(np.array([2_000_000_000, 400_000]), {"encoder": np.array([120_000, 100_000])}, deep_steps=2)]
    file.add(windows[0])
    metrics.record(file)
    assert exporter.arrived.wait(5)  # sent while it runs, not only at the end
    file.add(windows[1])
    metrics.record(file)
    assert metrics.close() and metrics.as_metadata()["sent"] == len(exporter.sent) >= 2
    last = points(exporter.sent[-1])
    step, = last[STEP_DURATION]
    assert (step.count, step.bucket_counts, list(step.explicit_bounds)) == (
        5, file.step.counts, list(BOUNDS_S))
    assert abs(step.sum - file.step.sum_ns / 1e9) < 1e-12 and (step.min, step.max) == (150e-6, 2.0)
    layer, = last[LAYER_DURATION]
    assert layer.attributes == {LAYER_PATH: "encoder"} and layer.count == 3
    assert layer.bucket_counts == file.layers["encoder"].counts
    assert step.start_time_unix_nano < step.time_unix_nano
    scope = exporter.sent[-1].resource_metrics[0].scope_metrics[0]
    assert all(metric.data.aggregation_temporality is AggregationTemporality.CUMULATIVE for metric in scope.metrics)
    assert exporter.sent[-1].resource_metrics[0].resource.attributes["service.name"] == "svc"


def test_nothing_is_sent_before_a_window_is_counted() -> None:
    exporter = Keeping()
    metrics = LatencyMetrics(exporter, Resource.create({}), interval_s=0.01)
    time.sleep(0.1)
    assert metrics.close() and exporter.sent == [] and metrics.as_metadata()["sent"] == 0
