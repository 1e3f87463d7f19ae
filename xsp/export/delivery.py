"""Getting spans to an OTLP collector: the exporter made from the target and the OTEL_*
variables (headers, timeout, compression, certificates), each batch sent with retries while the
collector is busy and split in halves while it finds the batch too large, and the report of what
arrived, what was refused and why."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final

from xsp.core.lazy import otel_span_export as sdk_export
from xsp.export.target import OtlpTarget, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

DEFAULT_TIMEOUT_S = 5.0
"""Export timeout when OTEL_EXPORTER_OTLP_TIMEOUT is not set: bounds the delay at exit."""


RETRY_BUDGET_S = 30.0
"""How long one export keeps retrying what a collector refused for now (429, 503), or splitting
what it found too large (413), when the caller sets no deadline."""


TOO_LARGE_SIGNS = ("413", "too large", "larger than max", "max_request_size", "RESOURCE_EXHAUSTED")


BUSY_STATUSES = frozenset({429, 502, 503, 504})


EXPORT_METHOD: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass
class CollectorAnswers:
    """What the collector last answered over HTTP (a response hook of the exporter's session):
    its status, and how long it asked to be left alone (``Retry-After``)."""

    status: int | None = None
    retry_after_s: float | None = None

    def heard(self, response: Any, *_: Any, **__: Any) -> None:
        self.status = response.status_code
        self.retry_after_s = _retry_after_s(response.headers.get("Retry-After"))

    def forget(self) -> None:
        self.status = self.retry_after_s = None


def _retry_after_s(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delay-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        from email.utils import parsedate_to_datetime

        try:
            return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
        except (TypeError, ValueError):
            return None
    return max(seconds, 0.0) if seconds == seconds and seconds != float("inf") else None


def make_exporter(target: OtlpTarget, environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The SDK's OTLP exporter for ``target``; other OTEL_* settings are read by it. Over HTTP
    it carries ``xsp_answers`` (:class:`CollectorAnswers`), which :func:`export_batch` reads.
    It also sends batches xsp encoded itself (:class:`xsp.export.encoding.EncodedBatch`), through
    the same connection, settings and retries."""
    from xsp.export.encoding import EncodedBatch

    timeout: dict[str, float] = {}
    if not (environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout["timeout"] = DEFAULT_TIMEOUT_S
    if target.protocol is Protocol.GRPC:
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

        grpc_posts = PostDeadline()

        class BytesOrMessageStub:
            """The trace service's stub on the SDK exporter's channel, whose ``Export`` also takes a
            request already serialized (xsp's encoder's bytes, sent as they are). Once the session
            is ending (``grpc_posts.deadline``), a call ends by the deadline and is not retried."""

            def __init__(self, channel: Any) -> None:
                self.message_call = TraceServiceStub(channel).Export
                self.bytes_call = channel.unary_unary(
                    EXPORT_METHOD, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString)

            def Export(self, request: Any, **options: Any) -> Any:  # noqa: N802 - the stub's method name
                call = self.bytes_call if isinstance(request, bytes) else self.message_call
                deadline = grpc_posts.deadline
                if deadline is None:
                    return call(request, **options)
                options["timeout"] = grpc_posts.seconds_left(options.get("timeout"))
                try:
                    return call(request, **options)
                except grpc.RpcError as error:
                    if time.monotonic() >= deadline:  # raised as no RpcError: the SDK would retry one after a backoff
                        raise PostsOutOfTime(OUT_OF_TIME) from error
                    raise

        class GrpcExporter(Grpc):
            """Sends an encoded batch's bytes through the SDK exporter (its channel, headers,
            compression, timeout and retries), with no protobuf object made of them."""

            def __init__(self, **options: Any) -> None:
                super().__init__(**options)
                # the SDK makes its stub again from _stub when it reconnects
                self._stub = BytesOrMessageStub
                self._client = BytesOrMessageStub(self._channel)  # type: ignore[assignment]

            def _translate_data(self, data: Any) -> ExportTraceServiceRequest | bytes:  # type: ignore[override]
                if isinstance(data, EncodedBatch):
                    return data.payload()
                return super()._translate_data(data)

        url = target.endpoint if "://" in target.endpoint else f"http://{target.endpoint}"
        grpc_exporter = GrpcExporter(endpoint=url, insecure=url.startswith("http://"), **timeout)  # type: ignore[arg-type]
        grpc_exporter.xsp_encoded = True  # type: ignore[attr-defined]
        grpc_exporter.xsp_posts = grpc_posts  # type: ignore[attr-defined]
        return grpc_exporter
    import requests
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    class HttpExporter(Http):
        """Posts an encoded batch's bytes through the SDK's own HTTP client (its retries, headers
        and compression)."""

        def export(self, spans: Any) -> sdk_export.SpanExportResult:
            if not isinstance(spans, EncodedBatch):
                return super().export(spans)
            if self._shutdown:
                return sdk_export.SpanExportResult.FAILURE
            outcome = self._client.export(spans.payload())
            return sdk_export.SpanExportResult.SUCCESS if outcome.success else sdk_export.SpanExportResult.FAILURE

    http_posts = PostDeadline()

    class DeadlineSession(requests.Session):
        """requests' session whose posts end by ``http_posts.deadline`` once one is set (the
        session is ending): a collector that hangs holds the exit a timeout a post otherwise."""

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            if http_posts.deadline is not None:
                if time.monotonic() >= http_posts.deadline:  # no connection error: the SDK retries none of this
                    raise requests.exceptions.RequestException(OUT_OF_TIME)
                kwargs["timeout"] = http_posts.seconds_left(kwargs.get("timeout"))
            return super().request(method, url, *args, **kwargs)

    answers = CollectorAnswers()
    session = DeadlineSession()
    session.hooks["response"].append(answers.heard)
    exporter = HttpExporter(endpoint=target.endpoint, session=session, **timeout)  # type: ignore[call-overload]
    exporter.xsp_answers = answers
    exporter.xsp_encoded = True
    exporter.xsp_posts = http_posts
    return exporter


SHORTEST_POST_S: Final = 0.5
"""The least time a post is given at a session's end, however little is left: a collector that
answers at once still gets the last batch."""


class PostsOutOfTime(Exception):
    """A post not made, or cut short, because the session's end ran out of the time it waits."""


@dataclass
class PostDeadline:
    """When an exporter's posts (HTTP) or calls (gRPC) must have ended: unset while the session
    runs (the exporter's own timeout holds), set as it ends (:func:`hurry_posts`)."""

    deadline: float | None = None

    def seconds_left(self, timeout: Any) -> float:
        """The timeout a post begun now is given: what is left (at least :data:`SHORTEST_POST_S`),
        or the post's own ``timeout`` if that is shorter."""
        assert self.deadline is not None
        left = max(self.deadline - time.monotonic(), SHORTEST_POST_S)
        return min(float(timeout), left) if isinstance(timeout, (int, float)) else left


def hurry_posts(exporter: SpanExporter, seconds: float) -> None:
    """Posts of ``exporter`` (HTTP or gRPC) from now on end within ``seconds``; once they are
    over, a post is not begun, nor retried."""
    posts = getattr(exporter, "xsp_posts", None)
    if isinstance(posts, PostDeadline):
        posts.deadline = time.monotonic() + seconds


@dataclass
class ExportReport:
    """How an export went: counts are exact, whatever the exporter's return values said."""

    target: str
    submitted: int = 0
    exported: int = 0
    failed: int = 0
    error: str | None = None
    seconds: float = 0.0
    """Seconds this process spent exporting, over the whole session: each window's sending (and
    its preparing, where that was done in this process), and all of the last export (its
    exporter made and shut down)."""
    done: bool = False
    sdk_messages: list[str] = field(default_factory=list)
    """What the OpenTelemetry SDK logged while exporting (folded into xsp's one warning)."""
    traces_folded: int = 0
    """Traces over the span budget, sent with their deepest levels folded."""
    spans_folded: int = 0
    """Spans sent as part of an aggregate instead of one by one (the trace file keeps them)."""
    aggregates: int = 0
    dropped_by_budget: int = 0
    """Spans not sent at all: a trace over the budget even with its deepest levels folded."""
    splits: int = 0
    """Batches the collector found too large (413), sent again in halves."""
    retries: int = 0
    """Batches the collector refused for now (429, 503), sent again after the wait it asked for:
    by xsp, or by the SDK on its own (what it logs as "retrying in")."""
    to_send: int = 0
    """Spans handed to this export (the budget's aggregates counted as sent)."""
    step_traces: int = 0
    """Traces handed to this export besides the session's own (one per step)."""
    not_sampled_by_request: int = 0
    """Spans of steps inside requests the application's OpenTelemetry sampler dropped: not
    sent, as the request's own spans are not (the trace file keeps them)."""
    cut_off: bool = False
    """The process ended before the export did (its bounded wait at exit ran out)."""
    left_to_another: int = 0
    """Spans left to another process to send (a followed child's last window: its parent sends it)."""
    deadline: float | None = field(default=None, repr=False)
    """``time.monotonic()`` past which nothing is retried (None: :data:`RETRY_BUDGET_S` from the first batch)."""
    hurried_until: float | None = field(default=None, repr=False)
    """Set by :meth:`hurry`: no deadline later than this."""
    heard: list[str] = field(default_factory=list, repr=False)
    """What the SDK said during the batch being sent (cleared before each)."""
    stopped: bool = field(default=False, repr=False)
    """A batch failed for good: the batches after it count as failed unsent, until
    :meth:`try_again` (a session's next window)."""
    tried_again: int = 0
    """Exports started again after a batch had failed for good (a session's later windows:
    a collector that restarted gets the spans of the windows after it came back)."""
    unanswered: str | None = None
    """Why the collector did not answer when the session started (None: it did), as the probe
    said. Not a failure by itself: it becomes ``error`` only once a span goes unsent because of it."""

    def stop(self, reason: str) -> None:
        """A batch failed for good: the batches after it count as failed unsent, until
        :meth:`try_again`; ``error`` keeps the first reason."""
        self.error = self.error or reason
        self.stopped = True

    def hold(self, unanswered: str) -> None:
        """The collector does not answer yet: batches count as failed unsent until
        :meth:`try_again` (``unanswered`` is their reason, should any be)."""
        self.unanswered = unanswered
        self.stopped = True

    def count_unsent(self, spans: int) -> None:
        """``spans`` handed over but not sent: failed, for the reason the export stopped."""
        if spans:
            self.failed += spans
            self.error = self.error or (f"the collector did not answer ({self.unanswered})"
                                        if self.unanswered is not None else "the export stopped")

    def try_again(self) -> None:
        """Send the batches of the next export, though a batch before them failed for good
        (``error`` keeps the first failure)."""
        if self.stopped:
            self.stopped = False
            self.tried_again += 1

    def hurry(self, seconds: float) -> None:
        """Nothing is retried past ``seconds`` from now, whatever later sends allow (the session is
        ending: a collector answering 503 held a run's exit for 30 s a window, then 8 s more)."""
        until = time.monotonic() + seconds
        self.hurried_until = until if self.hurried_until is None else min(self.hurried_until, until)
        self.deadline = until if self.deadline is None else min(self.deadline, until)

    def out_of_time(self) -> bool:
        """The session is ending and the time :meth:`hurry` gave it is over: nothing more is sent
        (a collector that hangs would otherwise hold the exit a timeout a batch)."""
        return self.hurried_until is not None and time.monotonic() >= self.hurried_until

    def start_sending(self, budget_s: float) -> None:
        """A send begins, which may retry for ``budget_s`` (no later than :meth:`hurry` allows)."""
        deadline = time.monotonic() + budget_s
        self.deadline = deadline if self.hurried_until is None else min(deadline, self.hurried_until)

    def leave_to_another(self, spans: int) -> None:
        """The last ``spans`` are left to another process to send (a followed child's last window,
        its parent's to send): this export is done without them."""
        self.left_to_another += spans
        self.done = True

    def add_process(self, other: ExportReport, process: str) -> None:
        """Count in what process ``process`` exported itself (an always-on session's worker sends
        its own windows): its spans sent, failed and folded are this export's too, and its error,
        where this one has none, this one's."""
        for name in ("submitted", "exported", "failed", "traces_folded", "spans_folded", "aggregates",
                     "dropped_by_budget", "splits", "retries", "to_send", "step_traces", "not_sampled_by_request",
                     "tried_again"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sdk_messages.extend(message for message in other.sdk_messages if message not in self.sdk_messages)
        error = other.error
        unsent = other.to_send - other.exported - other.failed - other.dropped_by_budget
        if other.cut_off and unsent > 0:  # its process ended before its export did: those never went
            self.failed += unsent
            error = error or "it ended before its export did"
        if error is not None and self.error is None:
            self.error = f"process {process}: {error}"

    @classmethod
    def from_metadata(cls, recorded: Mapping[str, Any]) -> ExportReport:
        """The report a trace file recorded (``metadata["export"]``, :meth:`as_metadata`), read back."""
        names = {entry.name for entry in fields(cls) if entry.init}
        return cls(**{key: value for key, value in recorded.items() if key in names})

    def as_metadata(self) -> dict[str, Any]:
        """The outcome, as recorded in the trace file's metadata (``metadata["export"]``)."""
        record = asdict(self)
        record.pop("deadline")
        record.pop("hurried_until")
        record.pop("heard")
        record.pop("stopped")
        return {**record, "state": self.state}

    @property
    def state(self) -> str:
        """``done``; ``failed`` (``error`` says why); ``unfinished`` (cut off by the process's end:
        ``exported`` of ``to_send`` were sent); ``running``."""
        if self.done:
            return "done" if self.error is None else "failed"
        return "unfinished" if self.cut_off else "running"

    def summary(self) -> str:
        """One line: what was sent, and why the rest was not."""
        folded = ""
        if self.traces_folded:
            left_out = f", {self.dropped_by_budget:,} left out" if self.dropped_by_budget else ""
            folded = (f" ({self.spans_folded:,} spans of {self.traces_folded:,} traces over the span budget sent as "
                      f"{self.aggregates:,} aggregates{left_out}; the trace file keeps them all)")
        if self.not_sampled_by_request:
            folded += (f" ({self.not_sampled_by_request:,} spans of requests the application's sampler dropped not "
                       "sent; the trace file keeps them)")
        if self.error is None:
            late = (f" (the collector did not answer at first: {self.unanswered}; every span was sent once it did)"
                    if self.unanswered is not None and self.tried_again else "")
            return f"{self.exported:,} spans sent to {self.target}{folded}{late}"
        said = f" (the SDK said: {'; '.join(dict.fromkeys(self.sdk_messages))})" if self.sdk_messages else ""
        # xsp push sends a file's every span: where some reached the collector, they would be there twice
        again = ("send it with `xsp push FILE`" if self.exported == 0 else
                 f"`xsp push FILE` sends them all again, the {self.exported:,} sent already included")
        return (f"OTLP export to {self.target}: {self.exported:,} of {self.submitted:,} spans sent; "
                f"{self.error}{said}; the trace file keeps every span ({again})")


SDK_RETRY: Final = "retrying in"
"""What the OTLP exporters of the SDK log when they send a batch again after a transient error."""


MESSAGES_KEPT: Final = 20
"""What the SDK said during an export, kept for the report: at most this many messages."""
MESSAGE_CHARS: Final = 300
"""The first line of each SDK message, kept up to this many characters (cut between words)."""


class _SdkMessages(logging.Filter):
    """Keeps what the SDK logs on xsp's export threads (and only there) out of the user's log."""

    def __init__(self, report: ExportReport) -> None:
        super().__init__()
        self.report = report
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        lines = record.getMessage().splitlines()
        line = lines[0] if lines else ""
        if SDK_RETRY in line:  # the SDK waits and sends again on its own: a retry all the same
            self.report.retries += 1
        message = line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS].rsplit(" ", 1)[0] + " ..."
        self.report.heard.append(message)
        if len(self.report.sdk_messages) < MESSAGES_KEPT:
            self.report.sdk_messages.append(message)
        return False


@contextlib.contextmanager
def sdk_messages_into(report: ExportReport) -> Iterator[None]:
    """While exporting on this thread, what the OpenTelemetry loggers say goes into ``report``."""
    catcher = _SdkMessages(report)
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith("opentelemetry")]
    for logger in loggers:
        logger.addFilter(catcher)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(catcher)


OUT_OF_TIME: Final = "the session ended, and the time its end waits for the collector ran out"


def export_batch(batch: Sequence[Any], exporter: SpanExporter, report: ExportReport) -> None:
    """Send one batch; after the first batch that fails for good the rest count as failed unsent
    (until ``report.try_again()``).

    A batch the collector finds too large (HTTP 413, a gRPC message over its limit) is sent
    again in halves, down to single spans; one it refuses for now (429, 502-504) is sent again
    after the ``Retry-After`` it asks for (else 1, 2, 4 ... s), while ``report.deadline`` allows.
    """
    report.submitted += len(batch)
    if report.deadline is None:
        report.deadline = time.monotonic() + RETRY_BUDGET_S
    waiting = [batch]
    backoff_s = 1.0
    while waiting and not report.stopped:
        if report.out_of_time():
            report.stop(OUT_OF_TIME)
            break
        part = waiting.pop()
        outcome, pause_s = _send(part, exporter, report, backoff_s)
        if outcome == "sent":
            report.exported += len(part)
            backoff_s = 1.0
        elif outcome == "too large" and len(part) > 1:
            report.splits += 1
            half = len(part) // 2
            waiting += [part[half:], part[:half]]  # the first half next
        elif outcome == "busy" and time.monotonic() + pause_s < report.deadline:
            report.retries += 1
            time.sleep(pause_s)
            backoff_s = min(backoff_s * 2, 8.0)
            waiting.append(part)
        else:
            report.stop(_failure_text(outcome, report))
            waiting.append(part)
    report.count_unsent(sum(len(part) for part in waiting))


def _send(part: Sequence[Any], exporter: SpanExporter, report: ExportReport,
          backoff_s: float) -> tuple[str, float]:
    """``(outcome, pause)``: "sent", "too large", "busy" (with the pause asked for) or "failed"."""
    answers: CollectorAnswers | None = getattr(exporter, "xsp_answers", None)
    if answers is not None:
        answers.forget()
    report.heard.clear()
    try:
        result = exporter.export(part)
    except Exception as exc:  # exporters should not raise; a broken one must not escape
        report.error = report.error or f"{type(exc).__name__}: {exc}"
        return "failed", 0.0
    if result is sdk_export.SpanExportResult.SUCCESS:
        return "sent", 0.0
    status = answers.status if answers is not None else None
    said = " ".join(report.heard)
    if status == 413 or (status is None and any(sign in said for sign in TOO_LARGE_SIGNS)):
        return "too large", 0.0
    if status in BUSY_STATUSES:
        asked = answers.retry_after_s if answers is not None else None
        return "busy", asked if asked is not None else backoff_s
    return "failed", 0.0


def _failure_text(outcome: str, report: ExportReport) -> str:
    if outcome == "too large":
        return "the collector refused a single span as too large"
    if outcome == "busy":
        return "the collector kept refusing for now (429/503) past the time this export may take"
    return "the collector rejected or did not acknowledge a batch"
