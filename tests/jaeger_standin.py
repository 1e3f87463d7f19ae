"""A loopback stand-in for Jaeger v2 (no Jaeger binary reaches these machines): OTLP in (gRPC, and
HTTP's ``POST /v1/traces`` on the query port; metrics posted there are taken and dropped), the
query API out (``/api/v3/traces`` and ``/api/v3/traces/{id}``) as Jaeger documents it: answers
streamed as ``{"result": TracesData}`` objects (OTLP JSON: hex ids, 64-bit integers as strings,
enums as numbers), errors as ``{"error": {...}}``, both bounds of a search's time range required,
at most ``query.search_depth`` traces a search and no paging, and big traces cut to
``max_trace_size`` spans."""

from __future__ import annotations

import base64
import gzip
import json
import threading
import urllib.parse
from concurrent import futures
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pbg
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1 import trace_pb2


def _ns(text: str) -> int:
    """RFC 3339 with up to nanoseconds, to epoch ns."""
    head, _, rest = text.rstrip("Z").partition(".")
    seconds = int(datetime.fromisoformat(head + "+00:00").timestamp())
    return seconds * 1_000_000_000 + int((rest + "000000000")[:9])


@dataclass
class Store:
    spans: list[tuple[bytes, bytes, trace_pb2.Span]] = field(default_factory=list)
    """(resource bytes, scope bytes, span) of every span received."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    max_trace_size: int = 0
    base64_ids: bool = False
    queries: list[str] = field(default_factory=list)
    max_results: int = 0
    """Traces a search answers at most, whatever the depth asked (0: the depth); a trace asked
    for by id always comes whole."""

    def take(self, request: pb.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = resource_spans.resource.SerializeToString()
                for scope_spans in resource_spans.scope_spans:
                    scope = scope_spans.scope.SerializeToString()
                    for span in scope_spans.spans:
                        self.spans.append((resource, scope, span))

    def service_of(self, resource: bytes) -> str:
        for kv in Resource.FromString(resource).attributes:
            if kv.key == "service.name":
                return kv.value.string_value
        return ""

    def traces_data(self, chosen: list[tuple[bytes, bytes, trace_pb2.Span]]) -> dict[str, Any]:
        data = trace_pb2.TracesData()
        groups: dict[tuple[bytes, bytes], list[trace_pb2.Span]] = {}
        for resource, scope, span in chosen:
            groups.setdefault((resource, scope), []).append(span)
        for (resource, scope), spans in groups.items():
            resource_spans = data.resource_spans.add()
            resource_spans.resource.ParseFromString(resource)
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.ParseFromString(scope)
            scope_spans.spans.extend(spans)
        found = MessageToDict(data, use_integers_for_enums=True)
        if not self.base64_ids:
            for resource_spans in found.get("resourceSpans", []):
                for scope_spans in resource_spans.get("scopeSpans", []):
                    for span in scope_spans.get("spans", []):
                        for key in ("traceId", "spanId", "parentSpanId"):
                            if key in span:
                                span[key] = base64.b64decode(span[key]).hex()
                        for link in span.get("links", []):
                            for key in ("traceId", "spanId"):
                                link[key] = base64.b64decode(link[key]).hex()
        return found

    def by_trace(self) -> dict[bytes, list[tuple[bytes, bytes, trace_pb2.Span]]]:
        traces: dict[bytes, list[tuple[bytes, bytes, trace_pb2.Span]]] = {}
        with self.lock:
            for entry in self.spans:
                traces.setdefault(entry[2].trace_id, []).append(entry)
        if self.max_trace_size:
            traces = {key: spans[-self.max_trace_size:] for key, spans in traces.items()}  # the latest kept
        return traces


class Handler(BaseHTTPRequestHandler):
    store: Store

    def log_message(self, *args: Any) -> None:
        pass

    def answer(self, status: int, objects: list[dict[str, Any]]) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        for found in objects:  # streamed: one JSON object after another
            self.wfile.write(json.dumps(found).encode() + b"\n")
            self.wfile.flush()

    def error(self, status: int, message: str) -> None:
        self.answer(status, [{"error": {"grpcCode": 5 if status == 404 else 3, "httpCode": status,
                                        "message": message}}])

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.path == "/v1/traces":
            self.store.take(pb.ExportTraceServiceRequest.FromString(body))
        elif self.path != "/v1/metrics":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlparse(self.path)
        store = self.store
        store.queries.append(self.path)
        traces = store.by_trace()
        if url.path.startswith("/api/v3/traces/"):
            wanted = url.path.rsplit("/", 1)[-1]
            spans = traces.get(bytes.fromhex(wanted)) if len(wanted) == 32 else None
            if not spans:
                return self.error(404, "No traces found")
            half = max(len(spans) // 2, 1)  # two chunks
            return self.answer(200, [{"result": store.traces_data(part)} for part in (spans[:half], spans[half:])
                                     if part])
        if url.path != "/api/v3/traces":
            return self.error(404, "404 page not found")
        query = {key: values[0] for key, values in urllib.parse.parse_qs(url.query).items()}
        service = query.get("query.service_name")
        low, high = query.get("query.start_time_min"), query.get("query.start_time_max")
        if not service or not low or not high:
            return self.error(400, "query.service_name, query.start_time_min and query.start_time_max are required")
        low_ns, high_ns = _ns(low), _ns(high)
        depth = int(query.get("query.search_depth") or 20)
        wanted_attributes = json.loads(query.get("query.attributes") or "{}")
        chosen = []
        for spans in traces.values():
            if not any(store.service_of(resource) == service for resource, _, _ in spans):
                continue
            if not any(low_ns <= span.start_time_unix_nano <= high_ns for _, _, span in spans):
                continue
            if wanted_attributes and not any(
                    all(any(kv.key == key and str(kv.value.string_value or kv.value.int_value) == str(value)
                            for kv in span.attributes) for key, value in wanted_attributes.items())
                    for _, _, span in spans):
                continue
            chosen.append(spans)
        chosen.sort(key=lambda spans: -min(span.start_time_unix_nano for _, _, span in spans))
        chosen = chosen[:depth]  # no paging: the newest ones
        if store.max_results:  # a server that answers at most so many, whatever the depth asked
            chosen = chosen[:store.max_results]
        self.answer(200, [{"result": store.traces_data(spans)} for spans in chosen])


class JaegerStandIn:
    """Start with ``with JaegerStandIn() as jaeger:``; ``jaeger.otlp`` (gRPC) and ``jaeger.query`` (the
    query API, and OTLP over HTTP) are the URLs."""

    def __init__(self, max_trace_size: int = 0, base64_ids: bool = False, max_results: int = 0) -> None:
        self.store = Store(max_trace_size=max_trace_size, base64_ids=base64_ids, max_results=max_results)

    def __enter__(self) -> JaegerStandIn:
        store = self.store

        class Service(pbg.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the service's name
                store.take(request)
                return pb.ExportTraceServiceResponse()

        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pbg.add_TraceServiceServicer_to_server(Service(), self.grpc)
        port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()
        self.otlp = f"http://127.0.0.1:{port}"
        handler = type("BoundHandler", (Handler,), {"store": store})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.query = f"http://127.0.0.1:{self.http.server_address[1]}"
        return self

    def __exit__(self, *args: Any) -> None:
        self.http.shutdown()
        self.grpc.stop(None)
