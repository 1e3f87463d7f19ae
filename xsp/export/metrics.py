"""Step and layer latency as OpenTelemetry metrics (an always-on session's): histograms
``xsp.step.duration`` and ``xsp.layer.duration`` (seconds; the layer's structural path in the
attribute :data:`LAYER_PATH`), sent over OTLP to the session's collector every
:data:`EXPORT_INTERVAL_S` by a thread of xsp's, through the SDK's exporter, so that Prometheus or
Grafana chart them. The figures are the file's own histograms (:mod:`xsp.table.latency`), sent as
the SDK's explicit-bucket histograms would send them; the series are bounded."""

from __future__ import annotations

import threading
import time
from typing import Any, Final

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.export import Histogram as SdkHistogram
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from xsp._version import __version__
from xsp.core.threads import start_thread
from xsp.export.delivery import ExportReport, sdk_messages_into
from xsp.export.target import OtlpTarget, Protocol
from xsp.table.latency import BOUNDS_S, Histogram, LatencyHistograms

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
STEP_DESCRIPTION: Final = ("Duration of each step (a request's model call, a training iteration), every step "
                           "counted")
LAYER_DESCRIPTION: Final = ("Duration of each forward call of a layer, in the steps recorded at the layer level; "
                            "the top layers by time each a series, the others as 'other'")


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
    """The session's latency histograms, counted a window at a time and sent periodically.

    What is sent is the session's own histograms (:class:`xsp.table.latency.LatencyHistograms`, the
    file's), as they were after the last window was counted: a thread of xsp's sends their
    cumulative figures every ``interval_s`` as the OTLP metrics the SDK's explicit-bucket
    histograms would be. The SDK's instruments took a call of about 3.5 µs per step, on the thread that interprets
    the windows, beside the program's threads under the GIL.

    Args:
        exporter: where they are sent (:func:`metric_exporter`).
        resource: the session's resource (service name, host, rank), as its spans have.
        interval_s: how often they are sent.
    """

    def __init__(self, exporter: MetricExporter, resource: Resource, interval_s: float = EXPORT_INTERVAL_S) -> None:
        self.exporter = CountedExporter(exporter)
        self.resource = resource
        self.interval_s = interval_s
        self.start_ns = time.time_ns()
        self.step = Histogram()
        self.layers: dict[str, Histogram] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.sending = threading.Lock()
        self.thread = start_thread(self._send_periodically, "xsp-metrics")

    def record(self, histograms: LatencyHistograms) -> None:
        """The session's histograms as they are now (the file's, a window just counted into them):
        what the next send sends."""
        step, layers = histograms.step.copy(), {path: layer.copy() for path, layer in histograms.layers.items()}
        with self.lock:
            self.step, self.layers = step, layers

    def metrics_data(self) -> MetricsData | None:
        """The histograms so far, cumulative since the session began (None: nothing counted yet)."""
        now_ns = time.time_ns()
        with self.lock:
            if not self.step.count and not self.layers:
                return None
            step = [self._point(self.step, {}, now_ns)] if self.step.count else []
            layers = [self._point(histogram, {LAYER_PATH: path}, now_ns)
                      for path, histogram in self.layers.items() if histogram.count]
        metrics = [Metric(STEP_DURATION, STEP_DESCRIPTION, "s", SdkHistogram(step, AggregationTemporality.CUMULATIVE))]
        if layers:
            metrics.append(Metric(LAYER_DURATION, LAYER_DESCRIPTION, "s",
                                  SdkHistogram(layers, AggregationTemporality.CUMULATIVE)))
        scope = ScopeMetrics(InstrumentationScope("xsp", __version__), metrics, "")
        return MetricsData([ResourceMetrics(self.resource, [scope], "")])

    def _point(self, histogram: Histogram, attributes: dict[str, Any], now_ns: int) -> HistogramDataPoint:
        return HistogramDataPoint(attributes, self.start_ns, now_ns, histogram.count, histogram.sum_ns / 1e9,
                                  list(histogram.counts), list(BOUNDS_S), (histogram.min_ns or 0) / 1e9,
                                  (histogram.max_ns or 0) / 1e9)

    def _send_periodically(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.send()

    def send(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Send the histograms so far (nothing when nothing is counted yet)."""
        with self.sending:
            data = self.metrics_data()
            if data is not None:
                self.exporter.export(data, timeout_millis=timeout_s * 1000)

    def close(self, timeout_s: float = SHUTDOWN_WAIT_S) -> bool:
        """Send what is left and stop; False when the last send failed or did not finish in ``timeout_s``."""
        self.stopping.set()
        self.thread.join(timeout_s)
        try:
            self.send(min(SEND_TIMEOUT_S, timeout_s))
            self.exporter.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # the collector went away: the file keeps the same figures
            return False
        return self.exporter.last_ok

    def as_metadata(self) -> dict[str, Any]:
        """How the sends went (``sent`` and ``failed``, each a send of every histogram; what the SDK said)."""
        return {"sent": self.exporter.sent, "failed": self.exporter.failed,
                "messages": list(dict.fromkeys(self.exporter.said.sdk_messages))[:5]}

    def problem_beside_spans(self) -> str | None:
        """The sends that failed, said after the spans' export failed to the same collector (None:
        none did): the SDK's words are the spans' already."""
        failed = self.exporter.failed
        if not failed:
            return None
        return (f"its latency metrics failed too ({failed} of {failed + self.exporter.sent} sends; the trace file "
                "keeps the same histograms, metadata 'latency')")

    def problem(self) -> str | None:
        """One line on the sends that failed (None: none did)."""
        failed = self.exporter.failed
        if not failed:
            return None
        said = list(dict.fromkeys(self.exporter.said.sdk_messages))
        because = f" (the SDK said: {said[0]})" if said else ""
        return (f"latency metrics: {failed} of {failed + self.exporter.sent} sends to the collector failed{because}; "
                "the trace file keeps the same histograms (metadata 'latency')")
