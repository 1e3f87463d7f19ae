"""An export's report (xsp/export/delivery.py): a collector that did not answer when the session
started is a failure only where a span went unsent because of it."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SpanExportResult

from xsp.export.delivery import ExportReport, export_batch


class Answering:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def export(self, batch: list[object]) -> SpanExportResult:
        self.sent += list(batch)
        return SpanExportResult.SUCCESS


def test_a_collector_that_answers_before_any_batch_loses_nothing_and_the_export_is_done() -> None:
    report, exporter = ExportReport(target="http/protobuf http://collector:4318"), Answering()
    report.hold("collector:4318 is unreachable (Connection refused)")
    report.try_again()  # it answers at the first window
    export_batch(list(range(5)), exporter, report)
    report.done = True
    assert exporter.sent == list(range(5)) and report.failed == 0
    assert report.state == "done" and report.error is None and report.as_metadata()["state"] == "done"
    assert report.summary() == ("5 spans sent to http/protobuf http://collector:4318 (the collector did not answer "
                                "at first: collector:4318 is unreachable (Connection refused); every span was sent "
                                "once it did)")


def test_batches_handed_over_while_the_collector_does_not_answer_fail_for_that_reason() -> None:
    report, exporter = ExportReport(target="http/protobuf http://collector:4318"), Answering()
    report.hold("collector:4318 is unreachable (Connection refused)")
    export_batch(list(range(3)), exporter, report)  # a window while it is down: counted, not sent
    report.try_again()
    export_batch(list(range(4)), exporter, report)
    report.done = True
    assert exporter.sent == list(range(4)) and (report.submitted, report.exported, report.failed) == (7, 4, 3)
    assert report.state == "failed"
    assert report.summary() == ("OTLP export to http/protobuf http://collector:4318: 4 of 7 spans sent; the collector "
                                "did not answer (collector:4318 is unreachable (Connection refused)); the trace file "
                                "keeps every span (`xsp push FILE` sends them all again, the 4 sent already included)")


def test_an_export_that_sent_nothing_says_push_sends_the_file() -> None:
    report = ExportReport(target="grpc collector:4317")
    report.hold("collector:4317 is unreachable (Connection refused)")
    export_batch(list(range(3)), Answering(), report)
    report.done = True
    assert report.summary().endswith("0 of 3 spans sent; the collector did not answer (collector:4317 is unreachable "
                                     "(Connection refused)); the trace file keeps every span (send it with "
                                     "`xsp push FILE`)")


def test_a_collector_that_answered_from_the_start_says_nothing_of_answering_late() -> None:
    report, exporter = ExportReport(target="grpc collector:4317"), Answering()
    export_batch(list(range(2)), exporter, report)
    report.done = True
    assert report.summary() == "2 spans sent to grpc collector:4317" and report.unanswered is None
