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


def test_what_a_worker_exported_itself_counts_in_the_sessions_export() -> None:
    target = "grpc http://collector:4317"
    report = ExportReport(target=target, submitted=3, exported=3, to_send=3, done=True)
    worker = ExportReport(target=target, submitted=10, exported=10, to_send=10, spans_folded=4, done=True)
    report.add_process(ExportReport.from_metadata(worker.as_metadata()), "4242")
    assert (report.submitted, report.exported, report.failed, report.spans_folded) == (13, 13, 0, 4)
    assert report.state == "done" and report.summary().startswith("13 spans sent to grpc")


def test_a_worker_whose_export_failed_or_was_cut_off_makes_the_sessions_fail_and_says_which() -> None:
    target = "grpc http://collector:4317"
    report = ExportReport(target=target, submitted=3, exported=3, to_send=3, done=True)
    report.add_process(ExportReport(target=target, submitted=8, exported=5, failed=3, to_send=8,
                                    error="StatusCode.UNAVAILABLE", done=True), "11")
    report.add_process(ExportReport(target=target, submitted=6, exported=2, to_send=6, cut_off=True), "12")
    assert (report.exported, report.failed) == (10, 7)
    assert report.state == "failed" and report.error == "process 11: StatusCode.UNAVAILABLE"
    assert "10 of 17 spans sent; process 11: StatusCode.UNAVAILABLE" in report.summary()


def test_an_ending_session_retries_nothing_past_its_exit_wait() -> None:
    """A collector answering 503 held a run's exit 30 s for the window being sent (each send may
    retry for 30 s), then 8 s more for the last: once hurried, no send retries past that."""
    import time

    report = ExportReport(target="grpc http://collector:4317")
    report.start_sending(30.0)
    assert report.deadline is not None and report.deadline > time.monotonic() + 29
    report.hurry(2.0)
    assert report.deadline <= time.monotonic() + 2.0
    report.start_sending(30.0)  # the next window's send, and the last export's: no later either
    assert report.deadline <= time.monotonic() + 2.0
    assert "hurried_until" not in report.as_metadata()
