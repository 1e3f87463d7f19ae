"""OTLP protobuf encoded from the span table's columns (xsp/export/encoding.py) against the SDK
path, span for span: the bytes must decode to exactly what the SDK path sends."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import xsp
from xsp.core import schema as col
from xsp.export import encoding
from xsp.export.otlp import build_sdk_spans, resource_for, session_of

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture(autouse=True)
def encoder() -> None:
    if not encoding.available():
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.export._protobuf is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.export._protobuf is not built here")


def sdk_request(spans: pd.DataFrame, metadata: dict) -> ExportTraceServiceRequest:
    sdk_spans: list = []
    build_sdk_spans(spans, resource_for("svc", metadata), sdk_spans.extend)
    return encode_spans(sdk_spans)


def our_request(spans: pd.DataFrame, metadata: dict) -> ExportTraceServiceRequest:
    import numpy as np

    table = encoding.SpanColumns(spans, resource_for("svc", metadata), session_of(spans))
    return ExportTraceServiceRequest.FromString(table.request(np.arange(len(spans))))


def assert_same(spans: pd.DataFrame, metadata: dict) -> int:
    sdk, ours = sdk_request(spans, metadata), our_request(spans, metadata)
    assert len(sdk.resource_spans) == len(ours.resource_spans) == 1
    sdk_rs, our_rs = sdk.resource_spans[0], ours.resource_spans[0]
    assert sdk_rs.resource == our_rs.resource and sdk_rs.schema_url == our_rs.schema_url
    assert len(sdk_rs.scope_spans) == len(our_rs.scope_spans) == 1
    assert sdk_rs.scope_spans[0].scope == our_rs.scope_spans[0].scope
    sdk_spans = {span.span_id: span for span in sdk_rs.scope_spans[0].spans}
    our_spans = {span.span_id: span for span in our_rs.scope_spans[0].spans}
    assert sdk_spans.keys() == our_spans.keys() and len(our_spans) == len(spans)
    for span_id, span in sdk_spans.items():
        assert our_spans[span_id] == span, (span, our_spans[span_id])
    return len(spans)


def traced_run() -> xsp.Trace:
    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad input ✗")

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with xsp.trace(levels="model,layer,operator", output=None) as session:
        for i in range(3):
            with xsp.span("préparation ✓", batch=i, ratio=0.5, ok=True, tags=["a", "b"], empty="", sizes=[1, 2]):
                pass
            model(torch.randn(4, 8)).sum().backward()
        try:
            Fails()(torch.randn(2))
        except ValueError:
            pass
    assert session.trace is not None
    return session.trace


def test_a_traced_run_encodes_as_the_sdk_path_does() -> None:
    trace = traced_run()
    spans = trace.spans
    assert (spans[col.STATUS] == col.Status.ERROR.value).any() and spans[col.PARENT_ID].isna().sum() > 1
    assert assert_same(spans, trace.metadata) > 50


def test_attribute_limits_are_applied_as_the_sdk_applies_them(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = traced_run()
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "5")
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", "4")
    assert_same(trace.spans, trace.metadata)


def test_own_attributes_that_name_a_typed_key_are_kept_as_the_sdk_keeps_them() -> None:
    trace = traced_run()
    spans = trace.spans.copy()
    spans.loc[spans.index[:5], col.ATTRIBUTES] = '{"xsp.step": 99, "xsp.path": "mine", "other": null, "deep": {"a": 1}}'
    assert_same(spans, trace.metadata)


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/traces (the real traces) is not here")
@pytest.mark.heavy
def test_a_real_kineto_trace_encodes_as_the_sdk_path_does() -> None:
    trace = xsp.load(SHARED / "kineto" / "v100_2rank_train_rank1.json.gz")
    spans = trace.spans.iloc[:20000]
    assert spans[col.ATTRIBUTES].notna().any()
    assert_same(spans.reset_index(drop=True), trace.metadata)


def test_a_batch_splits_into_halves_that_encode_their_own_rows() -> None:
    import numpy as np

    trace = traced_run()
    table = encoding.SpanColumns(trace.spans, resource_for("svc", trace.metadata), None)
    batch = encoding.EncodedBatch(table, np.arange(len(trace.spans)))
    halves = [batch[len(batch) // 2:], batch[:len(batch) // 2]]
    assert sum(len(half) for half in halves) == len(batch)
    ids = [span.span_id for half in halves
           for span in ExportTraceServiceRequest.FromString(half.payload()).resource_spans[0].scope_spans[0].spans]
    assert sorted(ids) == sorted(int(i).to_bytes(8, "big") for i in trace.spans[col.SPAN_ID])


def test_a_table_sent_in_chunks_sends_every_span_as_the_sdk_path_does() -> None:
    from opentelemetry.sdk.trace.export import SpanExportResult

    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import send_encoded

    class Collecting:
        xsp_encoded = True

        def __init__(self) -> None:
            self.spans: list = []

        def export(self, batch: encoding.EncodedBatch) -> SpanExportResult:
            request = ExportTraceServiceRequest.FromString(batch.payload())
            self.spans += list(request.resource_spans[0].scope_spans[0].spans)
            return SpanExportResult.SUCCESS

    trace = traced_run()
    exporter, report = Collecting(), ExportReport(target="test")
    resource = resource_for("svc", trace.metadata)
    send_encoded(trace.spans, resource, exporter, report, batch_size=7)
    assert report.exported == len(trace.spans) == len(exporter.spans)
    seen: set[bytes] = set()
    for span in exporter.spans:  # within a chunk (here the whole table), every parent before its children
        assert not span.parent_span_id or span.parent_span_id in seen
        seen.add(span.span_id)
    exporter, report = Collecting(), ExportReport(target="test")
    send_encoded(trace.spans, resource, exporter, report, batch_size=7, chunk_rows=40)
    assert report.exported == len(trace.spans) == len(exporter.spans)
    sent = sdk_request(trace.spans, trace.metadata).resource_spans[0].scope_spans[0].spans
    sdk = {span.span_id: span for span in sent}
    assert all(sdk[span.span_id] == span for span in exporter.spans)


class Collecting:
    """An exporter that takes encoded batches and keeps the spans their requests hold."""

    xsp_encoded = True

    def __init__(self) -> None:
        self.spans: list = []

    def export(self, batch: encoding.EncodedBatch):
        from opentelemetry.sdk.trace.export import SpanExportResult

        request = ExportTraceServiceRequest.FromString(batch.payload())
        self.spans += list(request.resource_spans[0].scope_spans[0].spans)
        return SpanExportResult.SUCCESS


def test_a_table_made_ready_in_one_process_and_sent_from_another_sends_and_counts_as_one_export() -> None:
    """A helper process makes a window's spans ready (prepare_export) and hands them back
    pickled; the session only sends them (send_prepared): what reaches the collector, and every
    count of the report, is what export_table gives in one go."""
    import pickle

    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import export_table, prepare_export, send_prepared

    trace = traced_run()
    resource = resource_for("svc", trace.metadata)
    whole, whole_report = Collecting(), ExportReport(target="test")
    export_table(trace.spans, resource, whole, whole_report, span_budget=3)
    prepared = prepare_export(trace.spans, encoding.resource_and_scope(resource), None, span_budget=3)
    assert prepared.chunks and prepared.spans is None
    handed, handed_report = Collecting(), ExportReport(target="test")
    send_prepared(pickle.loads(pickle.dumps(prepared)), resource, handed, handed_report)
    assert whole_report.traces_folded > 0  # the budget folded the deepest levels: counted alike
    counted = ("to_send", "submitted", "exported", "failed", "traces_folded", "spans_folded", "aggregates",
               "dropped_by_budget", "step_traces", "not_sampled_by_request")
    assert {name: getattr(handed_report, name) for name in counted} == {
        name: getattr(whole_report, name) for name in counted}
    assert handed_report.exported == len(handed.spans) > 0
    assert sorted(span.SerializeToString() for span in handed.spans) == sorted(
        span.SerializeToString() for span in whole.spans)


def test_spans_that_could_not_be_made_ready_count_as_failed_and_say_why() -> None:
    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import PreparedExport, send_prepared

    trace = traced_run()
    exporter, report = Collecting(), ExportReport(target="test")
    unready = PreparedExport(to_send=5, not_sampled_by_request=0, rows=5, error="ValueError: no columns")
    send_prepared(unready, resource_for("svc", trace.metadata), exporter, report)
    assert (report.to_send, report.submitted, report.failed, report.exported) == (5, 5, 5, 0)
    assert report.error == "ValueError: no columns" and exporter.spans == []


class Slow(Collecting):
    """Takes ``delay_s`` over each batch (a collector far away)."""

    delay_s = 0.05

    def export(self, batch: encoding.EncodedBatch):
        import time

        time.sleep(self.delay_s)
        return super().export(batch)

    def shutdown(self) -> None:
        pass


def test_the_export_seconds_count_every_windows_send_and_the_last_export_whole() -> None:
    """A windowed session sends each window's spans, then the rest at its end, into one report:
    its ``seconds`` are all of them, not the last export's alone."""
    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import prepare_export, send_prepared, start_export
    from xsp.export.target import OtlpTarget, Protocol

    trace = traced_run()
    resource = resource_for("svc", trace.metadata)
    exporter, report = Slow(), ExportReport(target="test")
    for _ in range(3):  # three windows' batches, each made ready elsewhere
        send_prepared(prepare_export(trace.spans, encoding.resource_and_scope(resource), None), resource, exporter,
                      report)
    windows_batches = len(exporter.spans) // len(trace.spans)
    assert windows_batches == 3 and report.seconds >= 3 * Slow.delay_s
    target = OtlpTarget("http://127.0.0.1:1/v1/traces", Protocol.HTTP)
    last = start_export(trace.spans, trace.metadata, target, "svc", exporter=exporter, report=report).wait(60)
    assert last.done and last.exported == 4 * len(trace.spans)
    assert last.seconds >= 4 * Slow.delay_s  # the windows' sends kept, the last one added


def test_a_long_sdk_message_is_kept_cut_between_words_and_its_retry_still_counted() -> None:
    import logging

    from xsp.export.delivery import MESSAGE_CHARS, ExportReport, sdk_messages_into

    report = ExportReport(target="test")
    cause = "Max retries exceeded with url: /v1/metrics (Caused by NewConnectionError(...)) " * 4
    said = f"Transient error {cause}encountered while exporting metrics batch, retrying in 1s."
    assert len(said) > MESSAGE_CHARS and said.index("retrying in") > MESSAGE_CHARS
    logger = logging.getLogger("opentelemetry.exporter.test")
    with sdk_messages_into(report):
        logger.warning(said)
    assert report.retries == 1  # counted from the whole line, not from what is kept of it
    kept = report.sdk_messages[0]
    assert kept.endswith(" ...") and len(kept) <= MESSAGE_CHARS + 4
    assert said.startswith(kept.removesuffix(" ...") + " ")  # cut where a word ends
