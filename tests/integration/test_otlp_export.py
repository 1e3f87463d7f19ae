"""Spans received by real OTLP receivers on loopback match the trace file span for span."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import xsp
from xsp.cli.main import main
from xsp.core import schema as col
from xsp.export.otlp import span_attributes
from xsp.export.target import OtlpTarget, Protocol

from .otlp_receiver import GrpcReceiver, HttpReceiver


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


def workload():
    model = Small()
    with xsp.span("preprocess", images=3):
        x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            model(x)


def trace_into(receiver, protocol, tmp_path):
    output = tmp_path / "run.xsp.parquet"
    with xsp.trace(output=output, otlp_endpoint=receiver.endpoint, otlp_protocol=protocol,
                   service_name="xsp-test") as session:
        workload()
    report = session.wait_for_export(30)
    assert report is not None and report.done and report.error is None, report
    return xsp.load(output), report


def assert_same_spans(trace, received):
    spans = trace.spans
    assert len(received) == len(spans)
    got = {span.span_id: span for span in received}
    session = spans[spans[col.KIND] == "session"].iloc[0]
    attributes = span_attributes(spans)
    for index, row in enumerate(spans.astype(object).where(spans.notna(), None).to_dict("records")):
        span = got[row[col.SPAN_ID]]
        assert span.name == row[col.NAME]
        assert span.trace_id == row[col.TRACE_ID]
        assert span.parent_id == row[col.PARENT_ID]
        assert (span.start_ns, span.end_ns) == (row[col.START_NS], row[col.END_NS])
        expected = json.loads(json.dumps(attributes[index]))
        arrived = dict(span.attributes)
        if row[col.KIND] == "session":  # the run's metadata rides on the session span (xsp pull reads it back)
            sent = json.loads(arrived.pop(col.ATTR_SESSION_METADATA))
            assert sent["xsp_version"] == trace.metadata["xsp_version"] and sent["pid"] == trace.metadata["pid"]
            # and what the session sent in all: its own trace and one a step, every span (xsp pull checks it)
            assert json.loads(arrived.pop(col.ATTR_SESSION_SENT)) == {"traces": spans[col.TRACE_ID].nunique(),
                                                                      "spans": len(spans)}
        assert arrived == expected
        assert span.scope == "xsp"
        if row[col.KIND] in ("predict", "step") and row[col.PARENT_ID] is None:
            assert span.links == [(session[col.TRACE_ID], session[col.SPAN_ID])]
    resource = received[0].resource
    assert resource["service.name"] == "xsp-test"
    assert resource["xsp.version"] == xsp.__version__
    assert resource["xsp.torch.version"] == torch.__version__
    assert resource["process.pid"] == trace.metadata["pid"]
    assert resource["host.name"] == trace.metadata["host"]
    assert resource["xsp.device"] == trace.metadata["device"]


@pytest.mark.parametrize("receiver_type, protocol", [(GrpcReceiver, "grpc"), (HttpReceiver, "http/protobuf")])
def test_received_spans_match_the_file(receiver_type, protocol, tmp_path):
    with receiver_type() as receiver:
        trace, report = trace_into(receiver, protocol, tmp_path)
    assert report.exported == len(trace.spans) and report.failed == 0
    assert_same_spans(trace, receiver.sink.spans)
    steps = trace.spans[trace.spans[col.STEP].notna()][col.TRACE_ID].nunique()
    assert steps == 3
    assert {span.trace_id for span in receiver.sink.spans} == set(trace.spans[col.TRACE_ID])


def test_layer_attributes_reach_the_collector(tmp_path):
    with GrpcReceiver() as receiver:
        trace, _ = trace_into(receiver, "grpc", tmp_path)
    layer = next(span for span in receiver.sink.spans if span.name == "model.body.0")
    assert layer.attributes["xsp.level"] == "layer"
    assert layer.attributes["xsp.layer.type"] == "Linear"
    assert json.loads(layer.attributes["xsp.layer.input_shapes"]) == [[3, 4]]
    assert layer.attributes["xsp.layer.param_count"] == 40
    user = next(span for span in receiver.sink.spans if span.name == "preprocess")
    assert user.attributes["images"] == 3


def test_error_spans_carry_error_status(tmp_path):
    class Boom(torch.nn.Module):
        def forward(self, x):
            raise ValueError("broken")

    with GrpcReceiver() as receiver:
        with pytest.raises(ValueError):
            with xsp.trace(output=None, otlp_endpoint=receiver.endpoint) as session:
                Boom()(torch.randn(1))
        session.wait_for_export(30)
    predict = next(span for span in receiver.sink.spans if span.name == "Boom_0")
    assert predict.status_code == 2 and predict.status_message == "ValueError: broken"


def test_environment_variables_choose_endpoint_and_protocol(monkeypatch, tmp_path):
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
        with xsp.trace(output=None) as session:
            workload()
        session.wait_for_export(30)
    assert receiver.sink.spans and receiver.sink.spans[0].resource["service.name"] == "from-env"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_unreachable_endpoint_warns_once_keeps_the_file_and_reports_it_was_not_used(tmp_path):
    output = tmp_path / "run.xsp.parquet"
    port = closed_port()
    with pytest.warns(xsp.XspWarning, match="unreachable") as caught:
        with xsp.trace(output=output, otlp_endpoint=f"http://127.0.0.1:{port}") as session:
            workload()
    assert len([w for w in caught if issubclass(w.category, xsp.XspWarning)]) == 1
    assert session.export is None
    assert len(xsp.load(output).spans) > 0
    # the report jaeger.md reads (it was None: `report.failed` raised in the very case checked for)
    report = session.wait_for_export(timeout_s=1)
    assert report is not None and report.state == "failed" and report.exported == 0
    assert report.error == f"not used: 127.0.0.1:{port} is unreachable (Connection refused)"
    assert report.as_metadata() == xsp.load(output).metadata["export"]


def test_target_resolution_follows_the_otel_variables():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert OtlpTarget.resolve(environ=env) == OtlpTarget("http://collector:4318/v1/traces", Protocol.HTTP)
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://other:4318/custom"
    assert OtlpTarget.resolve(environ=env).endpoint == "http://other:4318/custom"
    assert OtlpTarget.resolve(environ={}) is None
    assert OtlpTarget.resolve("localhost:4317", environ={}) == OtlpTarget("localhost:4317", Protocol.GRPC)
    assert OtlpTarget.resolve("http://h:4318", "http", environ={}).endpoint == "http://h:4318/v1/traces"
    assert OtlpTarget("localhost:4317", Protocol.GRPC).host_port == ("localhost", 4317)
    with pytest.raises(ValueError, match="unknown OTLP protocol"):
        OtlpTarget.resolve("http://h:1", "thrift", environ={})


def test_spans_dataframe_is_untouched_by_export(tmp_path):
    with GrpcReceiver() as receiver:
        trace, _ = trace_into(receiver, "grpc", tmp_path)
    pd.testing.assert_frame_equal(trace.spans, xsp.load(tmp_path / "run.xsp.parquet").spans)


def test_silent_collector_fails_the_export_within_its_timeout(monkeypatch, tmp_path):
    """A port that accepts connections but never answers: counted as failed, never hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    try:
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with xsp.trace(output=tmp_path / "run.xsp.parquet", otlp_endpoint=endpoint,
                       otlp_protocol="http/protobuf") as session:
            workload()
        began = time.perf_counter()
        with pytest.warns(xsp.XspWarning, match="0 of .* spans sent"):
            report = session.wait_for_export(15)
        assert time.perf_counter() - began < 10
    finally:
        listener.close()
    assert report.done and report.error is not None
    assert report.exported == 0 and report.failed == report.submitted == len(session.trace.spans)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_at_a_sessions_end_a_hanging_collector_gets_only_the_time_the_end_waits(monkeypatch, protocol):
    """A collector that takes connections and never answers, with OTEL_EXPORTER_OTLP_TIMEOUT=30:
    at the session's end each post (and the SDK's retries of it) ran its whole timeout, and each
    window held was posted again, so a service's file came 14-54 s after its SIGTERM. Over gRPC
    each call (and its retries) kept the 30 s after the HTTP posts were bounded."""
    from opentelemetry.sdk.trace import TracerProvider

    from xsp.export.delivery import OUT_OF_TIME, ExportReport, export_batch, hurry_posts, make_exporter

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    tracer = TracerProvider().get_tracer("test")
    batch = []
    for _ in range(3):
        span = tracer.start_span("s")
        span.end()
        batch.append(span)
    try:
        exporter = make_exporter(OtlpTarget.resolve(f"http://127.0.0.1:{listener.getsockname()[1]}", protocol))
        report = ExportReport(target="silent")
        report.hurry(1.0)
        hurry_posts(exporter, 1.0)  # as a session's end does (EXIT_WAIT_S)
        began = time.monotonic()
        export_batch(batch, exporter, report)  # its post gets what is left of the second, and no retry after it
        assert time.monotonic() - began < 10
        assert (report.exported, report.failed) == (0, 3)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
        later = ExportReport(target="silent")
        later.hurry(0.0)
        export_batch(batch, exporter, later)  # past the end's time: not posted at all
        assert (later.failed, later.error) == (3, OUT_OF_TIME)
        exporter.shutdown()
    finally:
        listener.close()


def test_the_file_records_how_the_export_went(tmp_path):
    with GrpcReceiver() as receiver:
        trace, report = trace_into(receiver, "grpc", tmp_path)
    exported = xsp.load(tmp_path / "run.xsp.parquet").metadata["export"]
    assert exported["state"] == "done" and exported["error"] is None
    assert exported["exported"] == exported["submitted"] == len(trace.spans) == len(receiver.sink.spans)


def test_a_failed_export_is_one_warning_with_the_sdks_words_and_the_file_says_so(tmp_path):
    """A collector that accepts connections and never answers: the gRPC exporter retries and
    logs; all of it becomes xsp's one warning, and the file records the failure."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    script = tmp_path / "s.py"
    script.write_text(
        "import sys, torch, xsp\n"
        "m = torch.nn.Linear(4, 4)\n"
        "with xsp.trace(output=sys.argv[1], otlp_endpoint=sys.argv[2], otlp_protocol='grpc') as s:\n"
        "    m(torch.randn(2, 4))\n"
        "s.wait_for_export(30)\n")
    try:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
        result = subprocess.run([sys.executable, str(script), str(tmp_path / "run.xsp.parquet"),
                                 f"http://127.0.0.1:{listener.getsockname()[1]}"], capture_output=True, text=True,
                                timeout=120, env=env)
    finally:
        listener.close()
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "XspWarning" in line]
    assert len(warned) == 1 and "0 of 2 spans sent" in warned[0] and "xsp push" in warned[0], result.stderr
    others = [line for line in result.stderr.splitlines() if line.strip() and "XspWarning" not in line
              and not line.startswith("  ")]  # the line python's warnings print below
    assert others == [], result.stderr
    exported = xsp.load(tmp_path / "run.xsp.parquet").metadata["export"]
    assert exported["state"] == "failed" and exported["failed"] == 2 and exported["error"]


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_export_is_never_lost_at_interpreter_exit(tmp_path):
    """The script ends right after its block, while the export still runs: exit waits for it."""
    script = tmp_path / "s.py"
    script.write_text(
        "import sys, torch, xsp\n"
        "m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(30)])\n"
        "with xsp.trace(output=None, otlp_endpoint=sys.argv[1], otlp_protocol='grpc'):\n"
        "    for _ in range(20):\n"
        "        m(torch.randn(2, 4))\n")
    for _ in range(3):
        with GrpcReceiver() as receiver:
            result = subprocess.run([sys.executable, str(script), receiver.endpoint], capture_output=True,
                                    text=True, timeout=120)
            assert result.returncode == 0 and result.stderr == "", result.stderr
            assert len(receiver.sink.spans) == 1 + 20 * 31


@pytest.mark.parametrize("kind", ["xsp", "kineto"])
def test_push_sends_any_trace_file_later(kind, tmp_path, shared_traces, capsys, monkeypatch):
    if kind == "xsp":
        path = tmp_path / "run.xsp.parquet"
        with xsp.trace(output=path):
            workload()
    else:
        path = shared_traces / "kineto" / "a100_alexnet.json.gz"
    expected = xsp.load(path).spans
    with HttpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        assert main(["push", str(path), "--otlp", receiver.endpoint]) == 0
    assert f"{len(expected):,} spans sent" in capsys.readouterr().err
    if kind == "xsp":
        assert sorted(span.span_id for span in receiver.sink.spans) == sorted(expected[col.SPAN_ID].tolist())
    else:  # an import makes new ids each time it is read
        assert sorted(span.name for span in receiver.sink.spans) == sorted(expected[col.NAME].tolist())


def test_push_without_a_reachable_collector_is_one_line(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.xsp.parquet"
    with xsp.trace(output=path):
        workload()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert main(["push", str(path)]) == 2
    assert "no collector to send to" in capsys.readouterr().err
    assert main(["push", str(path), "--otlp", f"http://127.0.0.1:{closed_port()}"]) == 2
    assert "unreachable" in capsys.readouterr().err


def _many_spans_session(receiver: HttpReceiver, tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])
    with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet", otlp_endpoint=receiver.endpoint,
                   otlp_protocol="http/protobuf") as session, torch.no_grad():
        for _ in range(20):
            model(torch.randn(2, 8))
    report = session.export.wait(60)
    return session, report


def test_batches_a_collector_finds_too_large_are_split_until_they_pass(tmp_path):
    with HttpReceiver(max_body_bytes=20_000) as receiver:  # a 512-span batch is ~60 KB
        session, report = _many_spans_session(receiver, tmp_path)
    spans = xsp.load(tmp_path / "run.xsp.parquet").spans
    assert report.error is None and report.exported == report.submitted == len(spans)
    assert report.splits >= 1 and 413 in receiver.statuses
    assert {span.span_id for span in receiver.sink.spans} == set(spans[col.SPAN_ID])


@pytest.mark.heavy
def test_a_collector_asking_to_wait_is_waited_for_within_the_budget(tmp_path):
    with HttpReceiver(busy=[6.0]) as receiver:  # longer than the SDK waits on its own (5 s), within the exit budget
        session, report = _many_spans_session(receiver, tmp_path)
    spans = xsp.load(tmp_path / "run.xsp.parquet").spans
    assert report.error is None and report.exported == len(spans)
    assert receiver.statuses[0] == 429 and report.retries == 1 and len(receiver.sink.spans) == len(spans)


def test_a_collector_that_asks_for_longer_than_the_budget_fails_fast_and_the_file_keeps_all(tmp_path):
    with HttpReceiver(busy=[600.0]) as receiver:
        began = time.monotonic()
        session, report = _many_spans_session(receiver, tmp_path)
        waited = time.monotonic() - began
    assert report.error is not None and "past the time this export may take" in report.error
    assert report.failed == report.submitted and waited < 120  # never the ten minutes asked for
    assert len(xsp.load(tmp_path / "run.xsp.parquet").spans) == report.submitted


def test_retries_the_sdk_makes_on_its_own_are_counted_in_the_file(tmp_path):
    with HttpReceiver(busy=[0.2, 0.2, 0.2]) as receiver:  # short waits: the SDK sends again itself
        session, report = _many_spans_session(receiver, tmp_path)
    assert receiver.statuses[:3] == [429, 429, 429]
    assert report.error is None and report.retries == 3
    export = xsp.load(tmp_path / "run.xsp.parquet").metadata["export"]
    assert export["retries"] == 3 and export["state"] == "done" and export["to_send"] == export["exported"]


def test_an_export_cut_off_by_the_process_end_says_so_with_what_was_sent():
    from xsp.export.delivery import ExportReport
    from xsp.export.otlp import OtlpExport
    from xsp.session import windows

    heard: list[dict] = []
    report = ExportReport(target="http/protobuf http://127.0.0.1:1", to_send=500, submitted=300, exported=256)
    hanging = threading.Event()
    thread = threading.Thread(target=hanging.wait, daemon=True)
    thread.start()
    export = OtlpExport(report, thread=thread, on_done=lambda final: heard.append(final.as_metadata()))
    windows.EXIT_WAIT_S, saved = 0.1, windows.EXIT_WAIT_S
    try:
        windows.wait_at_exit(export)
        windows._wait_for_exports()  # what interpreter exit runs
    finally:
        windows.EXIT_WAIT_S = saved
        hanging.set()
    assert [entry["state"] for entry in heard] == ["unfinished"]
    assert (heard[0]["to_send"], heard[0]["exported"]) == (500, 256)
    export.cut_off()  # once only
    assert len(heard) == 1
    done = ExportReport(target="t", done=True)
    failed = ExportReport(target="t", done=True, error="the collector rejected a batch")
    assert (done.state, failed.state, ExportReport(target="t").state) == ("done", "failed", "running")


SERVICE_CASES = [  # (flag, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, expected; None: the default)
    pytest.param("from-flag", "from-env", "service.name=from-attributes", "from-flag", marks=pytest.mark.heavy),
    pytest.param(None, "from-env", "service.name=from-attributes", "from-env", marks=pytest.mark.heavy),
    pytest.param(None, None, "team=ml,service.name=from%20attributes", "from attributes", marks=pytest.mark.heavy),
    (None, None, None, None),
]


def _service_env(monkeypatch: pytest.MonkeyPatch, name: str | None, attributes: str | None) -> dict[str, str]:
    for key, value in (("OTEL_SERVICE_NAME", name), ("OTEL_RESOURCE_ATTRIBUTES", attributes)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    return dict(os.environ)


@pytest.mark.parametrize("flag, name, attributes, expected", SERVICE_CASES)
def test_xsp_run_names_the_service_by_flag_then_the_standard_variables_then_the_script(
        flag, name, attributes, expected, tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nfor _ in range(2):\n    m(torch.zeros(1, 2))\n")
    env = _service_env(monkeypatch, name, attributes)
    with GrpcReceiver() as receiver:
        command = [sys.executable, "-m", "xsp", "run", "--otlp", receiver.endpoint, "-o",
                   str(tmp_path / "job.xsp.parquet"), *(["--service-name", flag] if flag else []), "--", str(script)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        assert receiver.sink.spans
        assert {span.resource["service.name"] for span in receiver.sink.spans} == {expected or "job"}
    if attributes and "team=ml" in attributes:  # the variable's other attributes reach the resource too
        assert receiver.sink.spans[0].resource["team"] == "ml"


@pytest.mark.parametrize("flag, name, attributes, expected", SERVICE_CASES)
def test_xsp_push_names_the_service_by_flag_then_the_standard_variables_then_the_trace(
        flag, name, attributes, expected, tmp_path, monkeypatch):
    path = tmp_path / "run.xsp.parquet"
    _service_env(monkeypatch, None, None)
    with xsp.trace(output=path, service_name="recorded"):
        workload()
    _service_env(monkeypatch, name, attributes)
    with GrpcReceiver() as receiver:
        assert main(["push", str(path), "--otlp", receiver.endpoint, *(["--service-name", flag] if flag else [])]) == 0
    assert {span.resource["service.name"] for span in receiver.sink.spans} == {expected or "recorded"}


@pytest.mark.parametrize("flag, name, attributes, expected", SERVICE_CASES)
def test_xsp_trace_names_the_service_by_argument_then_the_standard_variables_then_the_script(
        flag, name, attributes, expected, tmp_path, monkeypatch):
    _service_env(monkeypatch, name, attributes)
    with GrpcReceiver() as receiver:
        with xsp.trace(output=tmp_path / "t.xsp.parquet", otlp_endpoint=receiver.endpoint, otlp_protocol="grpc",
                       service_name=flag) as session:
            workload()
        report = session.wait_for_export(30)
        assert report is not None and report.done and report.error is None, report
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] not in ("", "-c", "-m") else "python"
    assert {span.resource["service.name"] for span in receiver.sink.spans} == {expected or script}
