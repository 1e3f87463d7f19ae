"""Sending a span table to an OpenTelemetry collector (Jaeger, or any OTLP receiver).

Spans are created with the OpenTelemetry SDK after the traced block, never during it, with
explicit start/end times, the parents the hierarchy builder assigned, and the table's own
span and trace ids (so a span in Jaeger and a row in the ``.xsp.parquet`` file share an id).
Each step is its own trace and its root links to the session span.

Configuration follows the standard variables: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or ``http/protobuf``), and the exporters' own
``OTEL_EXPORTER_OTLP_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION`` and certificates.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pandas as pd
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

from xsp import schema as col
from xsp._version import __version__

DEFAULT_TIMEOUT_S = 5.0
"""Export timeout when OTEL_EXPORTER_OTLP_TIMEOUT is not set: bounds the delay at exit."""
PROBE_TIMEOUT_S = 1.0
BATCH_SIZE = 512
SCOPE_NAME = "xsp"


class Protocol(str, Enum):
    GRPC = "grpc"
    HTTP = "http/protobuf"

    @classmethod
    def parse(cls, text: str) -> Protocol:
        value = text.strip().lower()
        if value in ("http", "http/protobuf"):
            return cls.HTTP
        if value == "grpc":
            return cls.GRPC
        raise ValueError(f"unknown OTLP protocol {text!r} (use 'grpc' or 'http/protobuf')")


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how to send spans."""

    endpoint: str
    protocol: Protocol

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = urlparse(self.endpoint if "://" in self.endpoint else f"http://{self.endpoint}")
        default_port = 4317 if self.protocol is Protocol.GRPC else 4318
        return parsed.hostname or "localhost", parsed.port or default_port

    @classmethod
    def resolve(cls, endpoint: str | None = None, protocol: str | None = None,
                environ: Mapping[str, str] = os.environ) -> OtlpTarget | None:
        """The target from arguments, else the OTEL_* variables; None when neither names one."""
        chosen = Protocol.parse(protocol or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        if endpoint:
            url = endpoint
        elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            url = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            url = environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
            if chosen is Protocol.HTTP:
                url = url.rstrip("/") + "/v1/traces"
            return cls(url, chosen)
        else:
            return None
        if chosen is Protocol.HTTP and urlparse(url).path in ("", "/"):
            url = url.rstrip("/") + "/v1/traces"
        return cls(url, chosen)


def probe(target: OtlpTarget, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the endpoint opens, else why not."""
    host, port = target.host_port
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port} is unreachable ({exc.strerror or exc})"


def make_exporter(target: OtlpTarget, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The SDK's OTLP exporter for ``target``; other OTEL_* settings are read by it."""
    timeout: dict[str, float] = {}
    if not (environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout["timeout"] = DEFAULT_TIMEOUT_S
    if target.protocol is Protocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        url = target.endpoint if "://" in target.endpoint else f"http://{target.endpoint}"
        return Grpc(endpoint=url, insecure=url.startswith("http://"), **timeout)  # type: ignore[arg-type]
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=target.endpoint, **timeout)  # type: ignore[arg-type]


# building SDK spans from the table ----------------------------------------------------
class PresetIdGenerator(IdGenerator):
    """Hands the SDK the ids the span table already assigned."""

    def __init__(self) -> None:
        self.span_id = 0
        self.trace_id = 0

    def generate_span_id(self) -> int:
        return self.span_id

    def generate_trace_id(self) -> int:
        return self.trace_id


class _Collect(SpanProcessor):
    def __init__(self) -> None:
        self.finished: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.finished.append(span)


def resource_for(service_name: str, metadata: Mapping[str, Any]) -> Resource:
    """service.name, host, process id, xsp and torch versions, device."""
    return Resource.create({
        "service.name": service_name,
        "host.name": str(metadata.get("host", "")),
        "process.pid": int(metadata.get("pid", os.getpid())),
        col.ATTR_VERSION: __version__,
        col.ATTR_TORCH_VERSION: str(metadata.get("torch_version", "")),
        col.ATTR_DEVICE: str(metadata.get("device", "")),
    })


def span_attributes(row: Mapping[str, Any]) -> dict[str, Any]:
    """OTel attributes of one table row: level, kind, typed columns, then user attributes."""
    attributes: dict[str, Any] = {col.ATTR_LEVEL: row[col.LEVEL], col.ATTR_KIND: row[col.KIND]}
    for column, key in col.COLUMN_ATTRIBUTE_KEYS.items():
        value = row.get(column)
        if value is not None and value is not pd.NA and not (isinstance(value, float) and np.isnan(value)):
            attributes[key] = value.item() if isinstance(value, np.generic) else value
    extra = row.get(col.ATTRIBUTES)
    if isinstance(extra, str) and extra:
        for key, value in json.loads(extra).items():
            attributes.setdefault(key, value)
    return attributes


def _tree_depth(parent_pos: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parent_pos), dtype=np.int64)
    current = parent_pos.copy()
    while (current >= 0).any():
        alive = current >= 0
        depth[alive] += 1
        current[alive] = parent_pos[current[alive]]
    return depth


def _rows_parents_first(spans: pd.DataFrame) -> Iterator[tuple[dict[str, Any], int | None]]:
    ids = spans[col.SPAN_ID].to_numpy(dtype=np.int64)
    position = {int(span_id): i for i, span_id in enumerate(ids)}
    parent_ids = spans[col.PARENT_ID]
    parent_pos = np.array([position.get(int(p), -1) if p is not pd.NA else -1
                           for p in parent_ids.astype(object)], dtype=np.int64)
    order = np.lexsort((spans[col.START_NS].to_numpy(dtype=np.int64), _tree_depth(parent_pos)))
    records = spans.astype(object).where(spans.notna(), None).to_dict("records")
    for i in order.tolist():
        record = records[i]
        yield record, record[col.PARENT_ID]


def build_sdk_spans(spans: pd.DataFrame, resource: Resource) -> list[ReadableSpan]:
    """One finished SDK span per table row, with the table's ids, parents and times."""
    ids = PresetIdGenerator()
    collector = _Collect()
    provider = TracerProvider(resource=resource, id_generator=ids)
    provider.add_span_processor(collector)
    tracer = provider.get_tracer(SCOPE_NAME, __version__)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    session = spans[spans[col.KIND] == col.SpanKind.SESSION.value]
    session_link: list[Link] = []
    if len(session):
        context = SpanContext(int(session[col.TRACE_ID].iloc[0], 16), int(session[col.SPAN_ID].iloc[0]),
                              is_remote=False, trace_flags=sampled)
        session_link = [Link(context, {col.ATTR_SESSION_LINK: "session"})]
    for row, parent_id in _rows_parents_first(spans):
        trace_id = int(row[col.TRACE_ID], 16)
        ids.trace_id, ids.span_id = trace_id, int(row[col.SPAN_ID])
        links: list[Link] = []
        if parent_id is None:
            parent_context = None
            if row[col.KIND] != col.SpanKind.SESSION.value:
                links = session_link
        else:
            parent = SpanContext(trace_id, int(parent_id), is_remote=False, trace_flags=sampled)
            parent_context = otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(parent))
        span = tracer.start_span(row[col.NAME], context=parent_context, links=links,
                                 start_time=int(row[col.START_NS]), attributes=span_attributes(row))
        if row.get(col.STATUS) == col.Status.ERROR.value:
            span.set_status(Status(StatusCode.ERROR, row.get(col.STATUS_MESSAGE) or None))
        span.end(end_time=int(row[col.END_NS]))
    provider.shutdown()
    return collector.finished


@dataclass
class ExportReport:
    """How an export went: counts are exact, whatever the exporter's return values said."""

    target: str
    submitted: int = 0
    exported: int = 0
    failed: int = 0
    error: str | None = None
    seconds: float = 0.0
    done: bool = False


def export_spans(finished: list[ReadableSpan], exporter: SpanExporter, report: ExportReport,
                 batch_size: int = BATCH_SIZE) -> ExportReport:
    """Send ``finished`` in batches; after the first failed batch the rest count as failed."""
    report.submitted += len(finished)
    for begin in range(0, len(finished), batch_size):
        batch = finished[begin:begin + batch_size]
        if report.error is None:
            try:
                result = exporter.export(batch)
            except Exception as exc:  # exporters should not raise; a broken one must not escape
                result, report.error = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
            if result is SpanExportResult.SUCCESS:
                report.exported += len(batch)
                continue
            report.error = report.error or "the collector rejected or did not acknowledge a batch"
        report.failed += len(batch)
    return report


@dataclass
class OtlpExport:
    """A running export in a background thread; ``wait`` bounds how long anyone waits for it."""

    report: ExportReport
    thread: threading.Thread | None = None
    _on_done: list[Callable[[ExportReport], None]] = field(default_factory=list)

    def wait(self, timeout_s: float | None = None) -> ExportReport:
        if self.thread is not None:
            self.thread.join(timeout_s)
        return self.report


def start_export(spans: pd.DataFrame, metadata: Mapping[str, Any], target: OtlpTarget,
                 service_name: str, exporter: SpanExporter | None = None) -> OtlpExport:
    """Export ``spans`` to ``target`` in a daemon thread and return at once."""
    report = ExportReport(target=f"{target.protocol.value} {target.endpoint}")
    export = OtlpExport(report)

    def run() -> None:
        began = time.perf_counter()
        try:
            sink = exporter or make_exporter(target)
            finished = build_sdk_spans(spans, resource_for(service_name, metadata))
            export_spans(finished, sink, report)
            sink.shutdown()
        except Exception as exc:
            report.error = report.error or f"{type(exc).__name__}: {exc}"
            report.failed = max(report.failed, len(spans) - report.exported)
        finally:
            report.seconds = time.perf_counter() - began
            report.done = True

    export.thread = threading.Thread(target=run, name="xsp-otlp-export", daemon=True)
    export.thread.start()
    return export
