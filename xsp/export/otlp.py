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

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags

from xsp._version import __version__
from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.threads import start_thread
from xsp.export import encoding
from xsp.export.budget import DEFAULT_SPAN_BUDGET, within_budget
from xsp.export.delivery import (
    MESSAGES_KEPT,
    RETRY_BUDGET_S,
    ExportReport,
    export_batch,
    make_exporter,
    sdk_messages_into,
)
from xsp.export.encoding import EncodedBatch, SpanColumns, request_roots, resource_and_scope
from xsp.export.target import OtlpTarget
from xsp.table.walks import depth_of, parent_positions

BATCH_SIZE = 512


ENCODED_BATCH_SIZE: Final = 2048
"""Spans a request encoded from the columns holds (about 1.2 MB of a layer trace's spans, under
the 4 MiB collectors accept by default; a collector that refuses one gets it again in halves)."""


SCOPE_NAME = "xsp"


ATTR_WORLD_SIZE = "xsp.world_size"


ATTR_JOB_ID = "xsp.job_id"


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


class _Batcher(SpanProcessor):
    """Hands finished spans on in batches as they end, so few are alive at once (a growing
    heap of finished spans makes Python's cyclic GC rescan it over and over)."""

    def __init__(self, sink: Callable[[list[ReadableSpan]], None], batch_size: int) -> None:
        self.sink = sink
        self.batch_size = batch_size
        self.batch: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.batch.append(span)
        if len(self.batch) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            batch, self.batch = self.batch, []
            self.sink(batch)


def resource_for(service_name: str, metadata: Mapping[str, Any]) -> Resource:
    """service.name, host, process id, xsp and torch versions, device; in a distributed job
    also ``service.instance.id`` (one per rank, so that Jaeger shows each rank as its own
    instance) with the rank, world size and job id."""
    attributes: dict[str, Any] = {
        "service.name": service_name,
        "host.name": str(metadata.get("host", "")),
        "process.pid": int(metadata.get("pid", os.getpid())),
        col.ATTR_VERSION: __version__,
        col.ATTR_TORCH_VERSION: str(metadata.get("torch_version", "")),
        col.ATTR_DEVICE: str(metadata.get("device", "")),
    }
    job = metadata.get("distributed")
    if isinstance(job, Mapping) and "rank" in job:
        attributes.update({
            "service.instance.id": f"{job.get('job_id', '')}/rank{job['rank']}",
            col.ATTR_RANK: int(job["rank"]),
            ATTR_WORLD_SIZE: int(job.get("world_size", 0)),
            ATTR_JOB_ID: str(job.get("job_id", "")),
        })
    try:
        detected = _detected(*(os.environ.get(name, "") for name in RESOURCE_VARIABLES))
    except RuntimeError:  # exit has begun before anything was detected: the detectors' pool is refused
        from opentelemetry.sdk.resources import OTELResourceDetector

        detected = OTELResourceDetector().detect()  # the variables, read here
    return detected.merge(Resource(attributes))


RESOURCE_VARIABLES: Final = ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS")
"""What OpenTelemetry's resource detectors read: a change of any is detected again."""


@functools.lru_cache(maxsize=4)
def _detected(*variables: str) -> Resource:
    """What OpenTelemetry's resource detectors find (``Resource.create``), once a process while
    ``variables`` (the values of :data:`RESOURCE_VARIABLES`) stay the same. They run on a thread
    pool, which Python refuses once it has begun to exit, where ``xsp run`` may end a session (and
    export it) after the script's threads: :func:`resource_for` then reads the variables only."""
    return Resource.create({})


def span_attributes(spans: pd.DataFrame) -> list[dict[str, Any]]:
    """OTel attributes of every row: level, kind, the typed columns that are set, then the
    row's own attributes (user attributes keep their keys)."""
    result = [{col.ATTR_LEVEL: level, col.ATTR_KIND: kind}
              for level, kind in zip(spans[col.LEVEL].tolist(), spans[col.KIND].tolist())]
    for column, key in col.COLUMN_ATTRIBUTE_KEYS.items():
        values = spans[column]
        present = values.notna().to_numpy()
        for row, value in zip(np.flatnonzero(present).tolist(), values[present].tolist()):
            result[row][key] = value
    extra = spans[col.ATTRIBUTES]
    present = extra.notna().to_numpy()
    for row, text in zip(np.flatnonzero(present).tolist(), extra[present].tolist()):
        for key, value in json.loads(text).items():
            result[row].setdefault(key, value)
    return result


def _parents_first(spans: pd.DataFrame) -> np.ndarray:
    """Row order in which every parent comes before its children.

    A parent outside the table (the session span, exported with a later window) counts as none.
    """
    depth = depth_of(parent_positions(spans))
    return np.lexsort((spans[col.START_NS].to_numpy(dtype=np.int64), depth))


def session_of(spans: pd.DataFrame) -> tuple[str, int] | None:
    """The (trace id, span id) of the table's session span, which step roots link to; None without one."""
    rows = np.flatnonzero((spans[col.KIND] == col.SpanKind.SESSION.value).to_numpy())
    if not len(rows):
        return None
    return str(spans[col.TRACE_ID].iloc[rows[0]]), int(spans[col.SPAN_ID].iloc[rows[0]])


def build_sdk_spans(spans: pd.DataFrame, resource: Resource, sink: Callable[[list[ReadableSpan]], None],
                    session: tuple[str, int] | None = None, batch_size: int = BATCH_SIZE) -> None:
    """One finished SDK span per table row, with the table's ids, parents and times, handed to
    ``sink`` in batches of ``batch_size`` (parents before children).

    ``session`` is the (trace id, span id) of the session span that step roots link to; by
    default the session row of ``spans``.
    """
    ids = PresetIdGenerator()
    batcher = _Batcher(sink, batch_size)
    provider = TracerProvider(resource=resource, id_generator=ids)
    provider.add_span_processor(batcher)
    tracer = provider.get_tracer(SCOPE_NAME, __version__)
    sampled = TraceFlags(TraceFlags.SAMPLED)
    kinds = spans[col.KIND].tolist()
    if session is None:
        session = session_of(spans)
    session_link: list[Link] = []
    if session is not None:
        context = SpanContext(int(session[0], 16), session[1], is_remote=False, trace_flags=sampled)
        session_link = [Link(context, {col.ATTR_SESSION_LINK: "session"})]
    attributes = span_attributes(spans)
    names, trace_ids = spans[col.NAME].tolist(), spans[col.TRACE_ID].tolist()
    span_ids, starts, ends = spans[col.SPAN_ID].tolist(), spans[col.START_NS].tolist(), spans[col.END_NS].tolist()
    parent_ids = spans[col.PARENT_ID].astype(object).where(spans[col.PARENT_ID].notna(), None).tolist()
    errors = (spans[col.STATUS] == col.Status.ERROR.value).fillna(False).tolist()
    messages = spans[col.STATUS_MESSAGE].astype(object).where(spans[col.STATUS_MESSAGE].notna(), None).tolist()
    joined = request_roots(spans)
    contexts: dict[int, Any] = {}
    for i in _parents_first(spans).tolist():
        trace_id = int(trace_ids[i], 16)
        ids.trace_id, ids.span_id = trace_id, span_ids[i]
        parent_id = parent_ids[i]
        if parent_id is None:
            parent_context, links = None, ([] if kinds[i] == col.SpanKind.SESSION.value else session_link)
        else:
            parent_context, links = contexts.get(parent_id), session_link if joined[i] else []
            if parent_context is None:
                parent = SpanContext(trace_id, int(parent_id), is_remote=False, trace_flags=sampled)
                parent_context = otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(parent))
                contexts[parent_id] = parent_context
        span = tracer.start_span(names[i], context=parent_context, links=links, start_time=starts[i],
                                 attributes=attributes[i])
        if errors[i]:
            span.set_status(Status(StatusCode.ERROR, messages[i]))
        span.end(end_time=ends[i])
    batcher.flush()
    provider.shutdown()


def without_unsampled_requests(spans: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """``spans`` without the steps that began inside a request the application's sampler dropped
    (:attr:`~xsp.core.schema.StepSampling.REQUEST_NOT_SAMPLED`), and how many spans those were."""
    if col.SAMPLING not in spans or not spans[col.SAMPLING].notna().any():
        return spans, 0
    roots = (spans[col.SAMPLING] == col.StepSampling.REQUEST_NOT_SAMPLED.value).fillna(False).to_numpy(dtype=bool)
    if not roots.any():
        return spans, 0
    unsent = spans[col.TRACE_ID].isin(spans[col.TRACE_ID][roots].unique()).to_numpy(dtype=bool)
    return spans[~unsent].reset_index(drop=True), int(unsent.sum())


def under_request_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """``spans`` with each step root that began inside an application's span (a request's) made
    that span's child (:data:`~xsp.core.schema.REMOTE_PARENT_ID`): the request's trace then holds
    the step. The file keeps the root without a parent; only what is sent has one."""
    if col.REMOTE_PARENT_ID not in spans:
        return spans
    remote = spans[col.REMOTE_PARENT_ID]
    if not remote.notna().any():
        return spans
    spans = spans.copy(deep=False)
    spans[col.PARENT_ID] = spans[col.PARENT_ID].fillna(remote)
    return spans


ENCODED_CHUNK: Final = 65_536
"""Rows made ready for the encoder at a time: its memory stays that of a chunk, whatever the table's size."""


def with_session_metadata(spans: pd.DataFrame, metadata: Mapping[str, Any],
                          sent: Mapping[str, int] | None = None) -> pd.DataFrame:
    """``spans`` with the trace's metadata in its session span's attributes
    (:data:`~xsp.core.schema.ATTR_SESSION_METADATA`, JSON), and what the session sent in all
    (``sent``: :data:`~xsp.core.schema.ATTR_SESSION_SENT`); unchanged without a session span."""
    rows = np.flatnonzero((spans[col.KIND] == col.SpanKind.SESSION.value).to_numpy())
    if not len(rows):
        return spans
    row = int(rows[0])
    text = spans[col.ATTRIBUTES].iloc[row]
    attributes = json.loads(text) if isinstance(text, str) else {}
    attributes[col.ATTR_SESSION_METADATA] = json.dumps(dict(metadata), default=str, ensure_ascii=False)
    if sent is not None:
        attributes[col.ATTR_SESSION_SENT] = json.dumps(dict(sent))
    spans = spans.copy(deep=False)
    column = spans[col.ATTRIBUTES].copy()
    column.iloc[row] = json.dumps(attributes, ensure_ascii=False)
    spans[col.ATTRIBUTES] = column
    return spans


def _step_traces(spans: pd.DataFrame, session: tuple[str, int] | None) -> int:
    """The traces of ``spans`` other than the session's own (one per step; a step's spans are
    never split between two tables)."""
    if not len(spans):
        return 0
    session = session if session is not None else session_of(spans)
    traces = spans[col.TRACE_ID]
    count = int(traces.nunique())
    return count - int(session is not None and (traces == session[0]).any())


def send_encoded(spans: pd.DataFrame, resource: Resource, exporter: SpanExporter, report: ExportReport,
                 session: tuple[str, int] | None = None, batch_size: int = ENCODED_BATCH_SIZE,
                 chunk_rows: int = ENCODED_CHUNK) -> None:
    """Encode ``spans`` from their columns (:mod:`xsp.export.encoding`) and send them in batches
    of ``batch_size`` rows. ``chunk_rows`` consecutive rows of the table are made ready for the
    encoder at a time (a slice, not a copy); within one, parents go before their children."""
    for table, order in encoded_chunks(spans, resource_and_scope(resource), session, max(chunk_rows, batch_size)):
        send_chunk(table, order, exporter, report, batch_size)


def encoded_chunks(spans: pd.DataFrame, encoded_resource: tuple[bytes, bytes], session: tuple[str, int] | None,
                   chunk_rows: int = ENCODED_CHUNK) -> Iterator[tuple[SpanColumns, np.ndarray]]:
    """``spans`` made ready for the encoder ``chunk_rows`` rows at a time: each chunk's columns
    and its rows in the order they are sent (parents before their children)."""
    if session is None:
        session = session_of(spans)
    for chunk_first in range(0, len(spans), chunk_rows):
        chunk = spans.iloc[chunk_first:chunk_first + chunk_rows]
        yield SpanColumns(chunk, encoded_resource, session), _parents_first(chunk.reset_index(drop=True))


def send_chunk(table: SpanColumns, order: np.ndarray, exporter: SpanExporter, report: ExportReport,
               batch_size: int = ENCODED_BATCH_SIZE) -> None:
    """Send one chunk's rows, in ``order``, in batches of ``batch_size``."""
    for first in range(0, len(order), batch_size):
        export_batch(EncodedBatch(table, order[first:first + batch_size]), exporter, report)


@dataclass
class PreparedExport:
    """A span table made ready to send (:func:`prepare_export`), with what the report must count
    of it: everything up to the sending itself, which can be done in another process (a helper
    that interpreted the window) and handed over pickled."""

    to_send: int
    """Spans handed to the export (those of unsampled requests not among them)."""
    not_sampled_by_request: int
    traces_folded: int = 0
    spans_folded: int = 0
    aggregates: int = 0
    dropped_by_budget: int = 0
    step_traces: int = 0
    rows: int = 0
    """Rows to send: the table's after the span budget folded it."""
    messages: list[str] = field(default_factory=list)
    """What the preparation said (the span budget could not be applied)."""
    chunks: list[tuple[SpanColumns, np.ndarray]] = field(default_factory=list)
    """The encoded path's chunks (:func:`encoded_chunks`)."""
    spans: pd.DataFrame | None = None
    """The table to send through SDK spans, where it is not encoded from its columns."""
    error: str | None = None
    """Why the spans could not even be made ready: they all count as failed."""

    def count_into(self, report: ExportReport) -> None:
        """Add what was counted before sending to ``report``."""
        report.not_sampled_by_request += self.not_sampled_by_request
        report.to_send += self.to_send
        report.traces_folded += self.traces_folded
        report.spans_folded += self.spans_folded
        report.aggregates += self.aggregates
        report.dropped_by_budget += self.dropped_by_budget
        report.step_traces += self.step_traces
        report.sdk_messages.extend(self.messages[:max(MESSAGES_KEPT - len(report.sdk_messages), 0)])


def prepare_export(spans: pd.DataFrame, encoded_resource: tuple[bytes, bytes] | None,
                   session: tuple[str, int] | None = None, span_budget: int = DEFAULT_SPAN_BUDGET,
                   metadata: Mapping[str, Any] | None = None, sent_before: tuple[int, int] = (0, 0)) -> PreparedExport:
    """``spans`` made ready to send: unsampled requests' steps left out, the span budget
    applied, each step root put under its request's span, and (``encoded_resource`` given) the
    columns made ready for xsp's encoder; None: sent through SDK spans. ``metadata`` and
    ``sent_before`` (step traces, spans submitted so far): the last table's (see :func:`export_table`)."""
    spans, unsampled = without_unsampled_requests(spans)
    prepared = PreparedExport(to_send=len(spans), not_sampled_by_request=unsampled)
    try:
        folded = within_budget(spans, span_budget)
    except Exception as exc:  # folding is for the viewer's sake: send the raw spans rather than none
        prepared.messages.append(f"the span budget could not be applied: {type(exc).__name__}: {exc}")
    else:
        spans = folded.spans
        prepared.traces_folded, prepared.spans_folded = folded.traces_folded, folded.raw_spans_folded
        prepared.aggregates, prepared.dropped_by_budget = folded.aggregates, folded.dropped
    prepared.step_traces = _step_traces(spans, session)
    spans = under_request_spans(spans)  # after the budget, which finds each step's root by its missing parent
    prepared.rows = len(spans)
    if metadata is not None:  # the last table: what the session sent in all goes with it
        traces_before, submitted_before = sent_before
        spans = with_session_metadata(spans, metadata, sent={"traces": traces_before + prepared.step_traces + 1,
                                                             "spans": submitted_before + len(spans)})
    if encoded_resource is None:
        prepared.spans = spans
        return prepared
    heard = ExportReport(target="")  # what the SDK's attribute cleaning logs, kept out of the user's log
    try:
        with sdk_messages_into(heard):
            prepared.chunks = list(encoded_chunks(spans, encoded_resource, session))
    except Exception as exc:
        prepared.error = f"{type(exc).__name__}: {exc}"
    prepared.messages += heard.sdk_messages
    return prepared


def send_prepared(prepared: PreparedExport, resource: Resource, exporter: SpanExporter, report: ExportReport,
                  session: tuple[str, int] | None = None, deadline_s: float | None = None) -> ExportReport:
    """Send a table :func:`prepare_export` made ready, counting exactly into ``report``: spans
    that could not be made ready, or not sent, count as failed. Batches the collector refuses
    are split or retried (see :func:`export_batch`) for at most ``deadline_s`` seconds from now
    (default :data:`RETRY_BUDGET_S`)."""
    began = time.perf_counter()
    report.start_sending(RETRY_BUDGET_S if deadline_s is None else deadline_s)
    prepared.count_into(report)
    submitted_before = report.submitted
    try:
        if prepared.error is not None:
            raise ExportNotReady(prepared.error)
        with sdk_messages_into(report):
            for table, order in prepared.chunks:
                send_chunk(table, order, exporter, report)
            if prepared.spans is not None and len(prepared.spans):
                build_sdk_spans(prepared.spans, resource, lambda batch: export_batch(batch, exporter, report), session)
    except Exception as exc:
        report.stop(str(exc) if isinstance(exc, ExportNotReady) else f"{type(exc).__name__}: {exc}")
        unsent = prepared.rows - (report.submitted - submitted_before)
        report.submitted += unsent
        report.failed += unsent
    report.seconds += time.perf_counter() - began
    return report


class ExportNotReady(Exception):
    """The spans could not be made ready to send (the message says why)."""


def sends_encoded(exporter: SpanExporter) -> bool:
    """Whether ``exporter`` takes batches xsp encoded from the columns, and the encoder is built here."""
    return encoding.available() and bool(getattr(exporter, "xsp_encoded", False))


def export_table(spans: pd.DataFrame, resource: Resource, exporter: SpanExporter, report: ExportReport,
                 session: tuple[str, int] | None = None, span_budget: int = DEFAULT_SPAN_BUDGET,
                 deadline_s: float | None = None, encoded: bool = True,
                 metadata: Mapping[str, Any] | None = None) -> ExportReport:
    """Send ``spans`` to ``exporter``, counting exactly: spans that could not even be encoded
    count as failed. Encoded from the columns where xsp's encoder is built and ``exporter`` takes
    encoded batches (``xsp_encoded``: those of :func:`make_exporter`; :func:`send_encoded`), else
    (or ``encoded=False``) through SDK spans (:func:`build_sdk_spans`).

    A trace (a step) of more than ``span_budget`` spans is sent with its deepest levels folded
    into aggregate spans (:mod:`xsp.export.budget`; 0: no budget); the report counts them.
    Batches the collector refuses are split or retried (see :func:`export_batch`) for at most
    ``deadline_s`` seconds from now (default :data:`RETRY_BUDGET_S`). ``metadata``: the trace's,
    sent on the session span (:func:`with_session_metadata`) so that ``xsp pull`` gets it back.
    """
    began = time.perf_counter()
    encoded_resource = resource_and_scope(resource) if encoded and sends_encoded(exporter) else None
    prepared = prepare_export(spans, encoded_resource, session, span_budget, metadata,
                              sent_before=(report.step_traces, report.submitted))
    report.seconds += time.perf_counter() - began
    return send_prepared(prepared, resource, exporter, report, session, deadline_s)


@dataclass
class OtlpExport:
    """A running export in a background thread; ``wait`` bounds how long anyone waits for it."""

    report: ExportReport
    thread: threading.Thread | None = None
    abandoned: bool = False
    """Someone already waited as long as exit allows: interpreter exit does not wait again."""
    on_done: Callable[[ExportReport], None] | None = None
    """Told the final report: when the export ends, or when the process's end cuts it off."""

    def wait(self, timeout_s: float | None = None) -> ExportReport:
        if self.thread is not None:
            self.thread.join(timeout_s)
        return self.report

    def abandon(self) -> None:
        """Stop waiting for this export at interpreter exit (one bounded wait is enough): it is
        cut off (:meth:`cut_off`)."""
        self.abandoned = True
        self.cut_off()

    def cut_off(self) -> None:
        """The process ends before this export did: its report says ``unfinished`` with what was
        sent, and :attr:`on_done` hears it (the trace file records it)."""
        if self.report.done or self.report.cut_off:
            return
        self.report.cut_off = True
        if self.on_done is not None:
            with contextlib.suppress(Exception):
                self.on_done(self.report)


def start_export(spans: pd.DataFrame, metadata: Mapping[str, Any], target: OtlpTarget,
                 service_name: str, exporter: SpanExporter | None = None,
                 report: ExportReport | None = None, session: tuple[str, int] | None = None,
                 on_done: Callable[[ExportReport], None] | None = None,
                 span_budget: int = DEFAULT_SPAN_BUDGET, deadline_s: float | None = None) -> OtlpExport:
    """Export ``spans`` to ``target`` in a daemon thread and return at once.

    ``report`` continues the counts of earlier exports of the same session; ``on_done`` is
    called on the export's thread with the final report.
    """
    report = report or ExportReport(target=f"{target.protocol.value} {target.endpoint}")
    export = OtlpExport(report, on_done=on_done)

    def run() -> None:
        began, handed_before, seconds_before = time.perf_counter(), report.to_send, report.seconds
        try:
            sink = exporter or make_exporter(target)
            export_table(spans, resource_for(service_name, metadata), sink, report, session, span_budget, deadline_s,
                         metadata=metadata)
            with sdk_messages_into(report):
                sink.shutdown()
        except Exception as exc:  # the exporter could not even be made
            report.error = report.error or f"{type(exc).__name__}: {exc}"
            report.failed += len(spans)
            report.submitted += len(spans)
            if report.to_send == handed_before:  # failed before the spans were handed over
                report.to_send += len(spans)
        finally:
            # the windows' exports before this one, and all of this one (export_table's own count in it)
            report.seconds = seconds_before + time.perf_counter() - began
            report.done = True
        if on_done is not None:
            with contextlib.suppress(Exception):  # the outcome is in the report either way
                on_done(report)

    export.thread = start_thread(run, "xsp-otlp-export")
    return export
