"""Step and layer latency as OpenTelemetry metrics (an always-on session's): histograms
``xsp.step.duration`` and ``xsp.layer.duration`` (seconds; the layer's structural path in the
attribute :data:`LAYER_PATH`), sent over OTLP to the session's collector by the SDK's periodic
reader, so that Prometheus or Grafana chart them. The series are bounded
(:mod:`xsp.table.latency`)."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from xsp._version import __version__
from xsp.export.delivery import ExportReport, sdk_messages_into
from xsp.export.target import OtlpTarget, Protocol
from xsp.table.latency import BOUNDS_S, Latencies

STEP_DURATION: Final = "xsp.step.duration"
LAYER_DURATION: Final = "xsp.layer.duration"
LAYER_PATH: Final = "xsp.layer.path"
EXPORT_INTERVAL_S: Final = 10.0
"""How often the histograms are sent."""
SEND_TIMEOUT_S: Final = 2.0
"""How long one send may take (a collector that never answers must not hold the program's exit)."""
SHUTDOWN_WAIT_S: Final = 3.0
"""At the session's end, how long the last send may take (a send's own timeout, and a little more)."""
METRICS_PATH: Final = "/v1/metrics"


def metrics_endpoint(target: OtlpTarget) -> str:
    """The metrics endpoint beside ``target``'s traces endpoint (OTLP/HTTP: ``/v1/metrics``
    instead of ``/v1/traces``; gRPC: the same address)."""
    url = target.endpoint if "://" in target.endpoint else f"http://{target.endpoint}"
    if target.protocol is Protocol.HTTP:
        base = url[:-len("/v1/traces")] if url.endswith("/v1/traces") else url.rstrip("/")
        return base + METRICS_PATH
    return url


def metric_exporter(target: OtlpTarget) -> MetricExporter:
    """The SDK's OTLP metric exporter for ``target``'s collector."""
    endpoint = metrics_endpoint(target)
    if target.protocol is Protocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return Grpc(endpoint=endpoint, insecure=endpoint.startswith("http://"), timeout=SEND_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return Http(endpoint=endpoint, timeout=SEND_TIMEOUT_S)


class CountedExporter(MetricExporter):
    """``exporter``, counting the sends that succeeded and failed (the SDK's reader only logs them)."""

    def __init__(self, exporter: MetricExporter) -> None:
        super().__init__()
        self.exporter = exporter
        self.sent = 0
        self.failed = 0
        self.last_ok = True
        self.said = ExportReport(target="metrics")
        """What the SDK logged while sending (kept out of the program's log, said in xsp's one warning)."""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            with sdk_messages_into(self.said):
                result = self.exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:
            self.said.sdk_messages.append(f"{type(exc).__name__}: {exc}")
            result = MetricExportResult.FAILURE
        self.last_ok = result is MetricExportResult.SUCCESS
        if self.last_ok:
            self.sent += 1
        else:
            self.failed += 1
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis=timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.exporter.shutdown(timeout_millis=timeout_millis, **kwargs)


class LatencyMetrics:
    """The session's latency histograms, recorded a window at a time and sent periodically.

    Args:
        exporter: where the SDK's reader sends them (:func:`metric_exporter`).
        resource: the session's resource (service name, host, rank), as its spans have.
        interval_s: how often they are sent.
    """

    def __init__(self, exporter: MetricExporter, resource: Resource, interval_s: float = EXPORT_INTERVAL_S) -> None:
        self.exporter = CountedExporter(exporter)
        reader = PeriodicExportingMetricReader(self.exporter, export_interval_millis=interval_s * 1000)
        buckets = ExplicitBucketHistogramAggregation(list(BOUNDS_S))
        self.provider = MeterProvider(
            resource=resource, metric_readers=[reader],
            views=[View(instrument_name=name, aggregation=buckets) for name in (STEP_DURATION, LAYER_DURATION)])
        meter = self.provider.get_meter("xsp", __version__)
        self.step = meter.create_histogram(STEP_DURATION, unit="s",
                                           description="Duration of each step (a request's model call, a training "
                                                       "iteration), every step counted")
        self.layer = meter.create_histogram(LAYER_DURATION, unit="s",
                                            description="Duration of each forward call of a layer, in the steps "
                                                        "recorded at the layer level; the top layers by time each "
                                                        "a series, the others as 'other'")

    def record(self, latencies: Latencies, series: dict[str, np.ndarray]) -> None:
        """One window's durations (``series``: its layer durations as the histograms counted them)."""
        record_step = self.step.record
        for value_ns in latencies.step_ns.tolist():
            record_step(value_ns / 1e9)
        record_layer = self.layer.record
        for path, values_ns in series.items():
            attributes: dict[str, Any] = {LAYER_PATH: path}
            for value_ns in values_ns.tolist():
                record_layer(value_ns / 1e9, attributes)

    def close(self, timeout_s: float = SHUTDOWN_WAIT_S) -> bool:
        """Send what is left and stop; False when the last send failed or did not finish in ``timeout_s``."""
        try:
            self.provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # the collector went away: the file keeps the same figures
            return False
        return self.exporter.last_ok

    def as_metadata(self) -> dict[str, Any]:
        """How the sends went (``sent`` and ``failed``, each a send of every histogram; what the SDK said)."""
        return {"sent": self.exporter.sent, "failed": self.exporter.failed,
                "messages": list(dict.fromkeys(self.exporter.said.sdk_messages))[:5]}

    def problem(self) -> str | None:
        """One line on the sends that failed (None: none did)."""
        failed = self.exporter.failed
        if not failed:
            return None
        said = list(dict.fromkeys(self.exporter.said.sdk_messages))
        because = f" (the SDK said: {said[0]})" if said else ""
        return (f"latency metrics: {failed} of {failed + self.exporter.sent} sends to the collector failed{because}; "
                "the trace file keeps the same histograms (metadata 'latency')")
