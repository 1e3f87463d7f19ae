"""Real OTLP receivers on loopback (gRPC and HTTP/protobuf) that keep what they receive."""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as metrics_pb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as metrics_pbg
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pbg
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def plain(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    resource: dict[str, Any]
    scope: str
    trace_id: str
    span_id: int
    parent_id: int | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, int]]
    status_code: int
    status_message: str
    span_id_hex: str = ""
    """The span id as Jaeger shows it: its 8 bytes in hex."""


@dataclass
class Sink:
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    metrics: list[metrics_pb.ExportMetricsServiceRequest] = field(default_factory=list)
    """Every metrics request received, as it came."""

    def histograms(self, name: str) -> list[tuple[dict[str, Any], int, float]]:
        """The data points of histogram ``name`` in the last request that had it: (attributes,
        count, sum); the SDK sends cumulative figures, so the last one holds them all."""
        with self.lock:
            requests = list(self.metrics)
        for request in reversed(requests):
            found = [({kv.key: plain(kv.value) for kv in point.attributes}, point.count, point.sum)
                     for resource in request.resource_metrics for scope in resource.scope_metrics
                     for metric in scope.metrics if metric.name == name for point in metric.histogram.data_points]
            if found:
                return found
        return []

    def take(self, request: pb.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                resource = {kv.key: plain(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(ReceivedSpan(
                            resource=resource, scope=scope_spans.scope.name, trace_id=span.trace_id.hex(),
                            span_id=int.from_bytes(span.span_id, "big"), span_id_hex=span.span_id.hex(),
                            parent_id=int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None,
                            name=span.name, start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                            attributes={kv.key: plain(kv.value) for kv in span.attributes},
                            links=[(link.trace_id.hex(), int.from_bytes(link.span_id, "big")) for link in span.links],
                            status_code=span.status.code, status_message=span.status.message))


class _Servicer(pbg.TraceServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        self.sink.take(request)
        return pb.ExportTraceServiceResponse()


class _MetricsServicer(metrics_pbg.MetricsServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        with self.sink.lock:
            self.sink.metrics.append(request)
        return metrics_pb.ExportMetricsServiceResponse()


class GrpcReceiver:
    def __init__(self) -> None:
        self.sink = Sink()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pbg.add_TraceServiceServicer_to_server(_Servicer(self.sink), self.server)
        metrics_pbg.add_MetricsServiceServicer_to_server(_MetricsServicer(self.sink), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> GrpcReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)


class HttpReceiver:
    """An OTLP/HTTP receiver; ``max_body_bytes`` answers 413 to larger requests, ``busy`` answers
    the first requests 429 with each ``Retry-After`` (seconds) in turn; while :attr:`rejecting`,
    trace requests are answered 400 (a failure no one retries); without ``takes_metrics``, metrics
    are answered 404, as a collector of traces only (Jaeger) does."""

    def __init__(self, max_body_bytes: int | None = None, busy: list[float] | None = None, port: int = 0,
                 takes_metrics: bool = True) -> None:
        self.sink = sink = Sink()
        self.statuses: list[int] = []
        self.rejecting = False
        statuses, refusals, receiver = self.statuses, list(busy or []), self

        class Handler(BaseHTTPRequestHandler):
            def refuse(self, status: int, retry_after: float | None = None) -> None:
                statuses.append(status)
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", f"{retry_after:g}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if max_body_bytes is not None and len(body) > max_body_bytes:
                    self.refuse(413)
                    return
                if refusals:
                    self.refuse(429, refusals.pop(0))
                    return
                if receiver.rejecting and self.path == "/v1/traces":
                    self.refuse(400)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/metrics" and not takes_metrics:  # Jaeger's receiver takes traces only
                    self.refuse(404)
                    return
                if self.path == "/v1/metrics":
                    metrics_request = metrics_pb.ExportMetricsServiceRequest()
                    metrics_request.ParseFromString(body)
                    with sink.lock:
                        sink.metrics.append(metrics_request)
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                statuses.append(200)
                request = pb.ExportTraceServiceRequest()
                request.ParseFromString(body)
                sink.take(request)
                reply = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HttpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
