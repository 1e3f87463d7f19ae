"""A real inference service (FastAPI, uvicorn, OpenTelemetry's FastAPI instrumentation; the
example in examples/service/serve.py) inside ``xsp.trace(sample=...)``: each sampled request's
trace in the collector holds the HTTP server span, then xsp's predict span, then its layers; and
``xsp capture`` records the running service's next requests; a request's trace pulled from Jaeger
holds the file's spans of that request."""

from __future__ import annotations

import http.client
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import xsp
from tests.jaeger_standin import JaegerStandIn
from xsp.core import schema as col
from xsp.core.control import socket_path

from .otlp_receiver import HttpReceiver
from .test_pull import same_table

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("opentelemetry.instrumentation.fastapi")

SERVE = Path(__file__).resolve().parents[2] / "examples" / "service" / "serve.py"
SPLIT_SERVE = Path(__file__).resolve().parents[2] / "benchmarks" / "split_server.py"
TOKENS = json.dumps(list(range(32)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def request(port: int, method: str, path: str, body: str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


class Server:
    def __init__(self, tmp_path: Path, script: Path = SERVE, **environment: str) -> None:
        self.port = free_port()
        self.output = tmp_path / "service.xsp.parquet"
        env = {**os.environ, "XSP_BENCH_MODE": "xsp", "XSP_BENCH_OUTPUT": str(self.output), **environment}
        self.process = subprocess.Popen([sys.executable, str(script), str(self.port)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if request(self.port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(self.process.communicate(timeout=30))
            time.sleep(0.1)

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        _, err = self.process.communicate(timeout=120)
        return self.process.returncode, err


def test_each_sampled_request_trace_holds_the_http_span_then_predict_then_its_layers(tmp_path):
    with HttpReceiver() as receiver:
        server = Server(tmp_path, XSP_BENCH_SAMPLE="1.0", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        try:
            for i in range(6):  # the thread pool's handler and the event loop's, in turn
                status, body = request(server.port, "POST", "/predict" if i % 2 else "/predict_async", TOKENS)
                assert status == 200 and "label" in json.loads(body)
        finally:
            code, err = server.stop()
        received = list(receiver.sink.spans)
    assert code == 0, err
    assert "warning" not in err.lower(), err
    servers = [span for span in received if span.name in ("POST /predict", "POST /predict_async")]
    assert len(servers) == 6
    for http_span in servers:
        in_trace = [span for span in received if span.trace_id == http_span.trace_id]
        predicts = [span for span in in_trace if span.parent_id == http_span.span_id
                    and span.attributes.get(col.ATTR_KIND) == "predict"]
        assert len(predicts) == 1, [(s.name, s.attributes.get(col.ATTR_KIND)) for s in in_trace]
        assert predicts[0].resource["service.name"] == "serve"  # xsp's spans: the script's name
        by_id = {span.span_id: span for span in in_trace}
        layers = [span for span in in_trace if span.attributes.get(col.ATTR_LEVEL) == "layer"]
        assert len(layers) >= 5  # embedding, encoder, its two layers (their fast path calls no module), head
        for layer in layers:
            parent = by_id[layer.parent_id]
            while parent.span_id != predicts[0].span_id:
                parent = by_id[parent.parent_id]
    spans = xsp.load(server.output).spans
    roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
    assert len(roots) == 6
    assert set(roots[col.TRACE_ID].astype(str)) == {span.trace_id for span in servers}


@pytest.mark.heavy  # two services
def test_the_benchmark_split_servers_serve_without_steps_and_with_a_bare_timer(tmp_path):
    """benchmarks/production.py --split: a session whose wrapper is out records no step, and
    ends cleanly (its wrapper put back first); the C timer in place of nn.Module.__call__ serves."""
    server = Server(tmp_path, SPLIT_SERVE, XSP_BENCH_SPLIT="no_steps", XSP_BENCH_SAMPLE="1.0")
    try:
        for path in ("/predict", "/predict_async"):
            assert request(server.port, "POST", path, TOKENS)[0] == 200
    finally:
        code, err = server.stop()
    assert code == 0, err
    assert "warning" not in err.lower() and "replaced" not in err, err
    spans = xsp.load(server.output).spans
    assert spans[col.STEP].notna().sum() == 0 and len(spans) == 1  # the session's span alone
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here to build benchmarks/timer_floor.c")
    server = Server(tmp_path, SPLIT_SERVE, XSP_BENCH_SPLIT="timer", XSP_BENCH_MODE="plain")
    try:
        status, body = request(server.port, "POST", "/predict", TOKENS)
        assert status == 200 and "label" in json.loads(body)
    finally:
        code, err = server.stop()
    assert code == 0, err


def test_the_benchmark_switch_server_records_steps_only_while_they_are_on(tmp_path):
    """benchmarks/steps_in_process.py: one process, its xsp wrapper taken out and put back on request."""
    server = Server(tmp_path, SPLIT_SERVE, XSP_BENCH_SPLIT="switch", XSP_BENCH_SAMPLE="0.0")
    try:
        for on, requests in (("false", 2), ("true", 3), ("false", 4)):
            assert request(server.port, "POST", f"/xsp_steps?on={on}") == (200, f'{{"on":{on}}}'.encode())
            for _ in range(requests):
                assert request(server.port, "POST", "/predict_async", TOKENS)[0] == 200
        assert request(server.port, "POST", "/xsp_steps?on=maybe")[0] == 422
    finally:
        code, err = server.stop()  # steps off: the session puts its wrapper back before it ends
    assert code == 0, err
    assert "warning" not in err.lower() and "replaced" not in err, err
    spans = xsp.load(server.output).spans
    assert spans[col.STEP].nunique() == 3  # the requests served while the steps were on


def test_the_benchmark_presence_server_starts_and_ends_a_session_without_steps_on_request(tmp_path):
    """benchmarks/steps_in_process.py --presence: one process, a session (no steps) started and ended
    between loads; one still live when the server stops ends with it."""
    server = Server(tmp_path, SPLIT_SERVE, XSP_BENCH_SPLIT="presence", XSP_BENCH_SAMPLE="1.0")
    try:
        assert request(server.port, "POST", "/predict", TOKENS)[0] == 200
        assert not server.output.exists()  # no session yet
        assert request(server.port, "POST", "/xsp_session?on=true") == (200, b'{"on":true}')
        assert request(server.port, "POST", "/predict_async", TOKENS)[0] == 200
        assert request(server.port, "POST", "/xsp_session?on=false") == (200, b'{"on":false}')
        ended = xsp.load(server.output).spans
        assert len(ended) == 1 and ended[col.STEP].isna().all()  # the session's span alone: no step
        server.output.unlink()
        assert request(server.port, "POST", "/xsp_session?on=true")[0] == 200
        assert request(server.port, "POST", "/predict", TOKENS)[0] == 200
    finally:
        code, err = server.stop()  # the live session ends with the server
    assert code == 0, err
    assert "warning" not in err.lower() and "replaced" not in err, err
    spans = xsp.load(server.output).spans
    assert len(spans) == 1 and spans[col.STEP].isna().all()


def test_the_benchmark_whole_server_starts_and_ends_a_whole_session_on_request(tmp_path):
    """benchmarks/steps_in_process.py --whole: one process, a whole session (every request a step,
    its file written as it ends) started and ended between loads."""
    server = Server(tmp_path, SPLIT_SERVE, XSP_BENCH_SPLIT="whole", XSP_BENCH_SAMPLE="1.0")
    try:
        assert request(server.port, "POST", "/predict", TOKENS)[0] == 200
        assert not server.output.exists()  # no session yet
        for _ in range(2):
            assert request(server.port, "POST", "/xsp_session?on=true") == (200, b'{"on":true}')
            assert request(server.port, "POST", "/predict", TOKENS)[0] == 200
            assert request(server.port, "POST", "/predict_async", TOKENS)[0] == 200
            assert request(server.port, "POST", "/xsp_session?on=false") == (200, b'{"on":false}')
            trace = xsp.load(server.output)  # written before the answer: the next load meets no writing
            assert len(trace.steps) == 2
            assert (trace.spans[col.LEVEL] == "layer").any()  # sampled: recorded deep
            server.output.unlink()
        assert request(server.port, "POST", "/predict", TOKENS)[0] == 200  # no session: nothing recorded
    finally:
        code, err = server.stop()
    assert code == 0, err
    assert "warning" not in err.lower(), err
    assert not server.output.exists()


@pytest.mark.heavy  # a service, and Jaeger's stand-in
def test_a_request_trace_pulled_from_jaeger_holds_the_file_spans_of_that_request(tmp_path):
    with JaegerStandIn() as jaeger:  # the application's spans and xsp's, over OTLP/HTTP as Jaeger v2 takes them
        server = Server(tmp_path, XSP_BENCH_SAMPLE="1.0", OTEL_EXPORTER_OTLP_ENDPOINT=jaeger.query,
                        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        try:
            for i in range(4):
                assert request(server.port, "POST", "/predict" if i % 2 else "/predict_async", TOKENS)[0] == 200
        finally:
            code, err = server.stop()
        assert code == 0, err
        spans = xsp.load(server.output).spans
        roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
        assert len(roots) == 4 and roots[col.REMOTE_PARENT_ID].notna().all()
        first = str(roots[col.TRACE_ID].iloc[0])
        pulled_file = tmp_path / "request.xsp.parquet"
        cli = subprocess.run([sys.executable, "-m", "xsp", "pull", "--trace", first, "--jaeger", jaeger.query,
                              "-o", str(pulled_file)], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        assert "not recorded by xsp" in cli.stderr  # the request's HTTP spans came along, and it says so
        for trace_id in roots[col.TRACE_ID].astype(str):
            pulled = xsp.load(pulled_file).spans if trace_id == first else xsp.pull(trace_id=trace_id,
                                                                                    jaeger=jaeger.query).spans
            mine = spans[spans[col.TRACE_ID] == trace_id]
            ours = pulled[pulled[col.SPAN_ID].isin(mine[col.SPAN_ID])]
            same_table(ours, mine)  # every span xsp exported into the request's trace, as the file has it
            others = pulled[~pulled[col.SPAN_ID].isin(mine[col.SPAN_ID])]
            root = mine[mine[col.PARENT_ID].isna()]
            assert int(root[col.REMOTE_PARENT_ID].iloc[0]) in set(others[col.SPAN_ID])  # the HTTP server span
            assert (others[col.KIND] == col.SpanKind.USER.value).all()


@pytest.mark.heavy  # a service, and Jaeger's stand-in
def test_a_services_requests_pulled_by_service_or_session_all_come_back_with_nothing_said_missing(tmp_path):
    """Step roots sent into their requests' traces link to the session as other step roots do:
    a pull of the service counts them as the session's (it once said nearly all were missing, and
    kept the session's own trace alone), and a request whose client sent a traceparent is no cut
    trace (its HTTP span's parent is the caller's)."""
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with JaegerStandIn() as jaeger:
        server = Server(tmp_path, XSP_BENCH_SAMPLE="1.0", OTEL_EXPORTER_OTLP_ENDPOINT=jaeger.query,
                        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
        try:
            for i in range(6):
                headers = {"traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01"} if i == 0 else None
                assert request(server.port, "POST", "/predict" if i % 2 else "/predict_async", TOKENS,
                               headers)[0] == 200
        finally:
            code, err = server.stop()
        assert code == 0, err
        spans = xsp.load(server.output).spans
        roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
        assert len(roots) == 6 and caller_trace in set(roots[col.TRACE_ID].astype(str))
        session_trace = str(spans.loc[spans[col.KIND] == col.SpanKind.SESSION.value, col.TRACE_ID].iloc[0])
        for extra in ([], ["--session", session_trace]):
            pulled_file = tmp_path / "pulled.xsp.parquet"
            cli = subprocess.run([sys.executable, "-m", "xsp", "pull", "--service", "xsp-bench-service", "--jaeger",
                                  jaeger.query, "--since", "1h", "-o", str(pulled_file), *extra],
                                 capture_output=True, text=True, timeout=120)
            assert cli.returncode == 0, cli.stderr
            assert "missing" not in cli.stderr and "cut" not in cli.stderr, cli.stderr
            pulled = xsp.load(pulled_file)
            ours = pulled.spans[pulled.spans[col.SPAN_ID].isin(spans[col.SPAN_ID])]
            assert len(ours) == len(spans)  # every span of the session, the requests' included
            assert set(roots[col.TRACE_ID].astype(str)) <= set(pulled.spans[col.TRACE_ID].astype(str))
            report = pulled.metadata["pulled_from"]["report"]
            assert report["missing"] == {} and report["truncated_traces"] == 0
            assert pulled.metadata["pulled_from"]["session"] == (extra[1] if extra else None)
            entry = pulled.spans[(pulled.spans[col.TRACE_ID].astype(str) == caller_trace)
                                 & pulled.spans[col.PARENT_ID].isna() & pulled.spans[col.STEP].isna()]
            assert int(entry[col.REMOTE_PARENT_ID].iloc[0]) == 0x00F067AA0BA902B7  # the caller's span


@pytest.mark.heavy  # a service and two captures
def test_capture_of_a_running_service(tmp_path):
    server = Server(tmp_path, XSP_BENCH_SAMPLE="0")
    try:
        assert socket_path(server.process.pid).exists()
        capture = subprocess.Popen([sys.executable, "-m", "xsp", "capture", str(server.process.pid), "--steps", "3",
                                    "-o", str(tmp_path / "cap.xsp.parquet")], stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        deadline = time.monotonic() + 60  # a step is decided when the next begins, windows close each second
        while capture.poll() is None and time.monotonic() < deadline:
            assert request(server.port, "POST", "/predict", TOKENS)[0] == 200
            time.sleep(0.02)
        _, said = capture.communicate(timeout=60)
    finally:
        code, err = server.stop()
    assert capture.returncode == 0, said
    assert code == 0, err
    spans = xsp.load(tmp_path / "cap.xsp.parquet").spans
    assert set(spans[spans[col.PARENT_ID].isna()][col.SAMPLING].astype(str)) == {"capture"}
    assert (spans[col.LEVEL] == "layer").any()
    whole = xsp.load(server.output).spans
    roots = whole[whole[col.PARENT_ID].isna() & whole[col.STEP].notna()]
    captured = set(roots[roots[col.SAMPLING] == "capture"][col.STEP].astype(int))
    assert captured == set(spans[col.STEP].astype(int))  # the service's own file has the captured steps
    deep = set(whole[whole[col.LEVEL] == "layer"][col.STEP].astype(int))
    # and deep steps of its own only after a slow one (at sample 0: a busy machine's pause arms the next 3)
    after_slow = set(roots[roots[col.SAMPLING] == "after_slow"][col.STEP].astype(int))
    assert deep == captured | after_slow


@pytest.mark.heavy  # the example service under `xsp run`, loaded for half a minute
def test_the_long_serving_benchmark_checks_what_it_reports(tmp_path, monkeypatch):
    """benchmarks/long_serving.py, briefly: the service under `xsp run --sample --dataset --rotate
    --otlp`, paced load on both endpoints, a capture half-way, SIGTERM at the end; its report's
    claims hold (every request a step, xsp's roots under the request spans, the capture done)."""
    monkeypatch.syspath_prepend(str(SERVE.parents[2] / "benchmarks"))
    long_serving = importlib.import_module("long_serving")
    results = tmp_path / "long_serving.md"
    monkeypatch.setattr(long_serving, "RESULTS", results)
    monkeypatch.setattr(long_serving, "WARMUP_MARKS", 0)
    assert long_serving.main(["--minutes", "0.4", "--mark-s", "6", "--rate", "20", "--rotate", "8s",
                              "--capture-steps", "5"]) == 0
    report = results.read_text()
    assert "exit code 0" in report
    assert "(every request a step)" in report
    assert ", 0 under a span the collector never got" in report
    assert re.search(r"Capture.*: exit 0 after [\d.]+ s, 5 steps in its file", report)
    rows = [line for line in report.splitlines() if re.match(r"\| \d+ \| [\d,]+ \|", line)]
    assert len(rows) >= 3  # one a stretch
    assert re.search(r"\*\*Parts\*\*: [2-9]\d* parts", report)  # rotated while it ran


@pytest.mark.heavy  # three processes running the example's model for a few seconds each
def test_the_window_export_benchmark_checks_what_it_reports(tmp_path, monkeypatch):
    """benchmarks/window_export.py, briefly: an exporting session's windows go to helpers (unless
    XSP_HELPER_PROCESS=0), and every span of its file is sent, none failed."""
    monkeypatch.syspath_prepend(str(SERVE.parents[2] / "benchmarks"))
    window_export = importlib.import_module("window_export")
    results = tmp_path / "window_export.md"
    monkeypatch.setattr(window_export, "RESULTS", results)
    assert window_export.main(["--seconds", "7", "--rounds", "1"]) == 0
    rows = {line[:16].strip(): line[16:].split() for line in results.read_text().splitlines()
            if line.startswith(("file ", "otlp"))}
    assert set(rows) == {"file", "otlp", "otlp, in thread"}
    for variant, cells in rows.items():
        windows, helpers, file_spans, sent, failed = cells[-5:]
        assert int(windows) >= 2, (variant, cells)
        if variant == "file":
            assert int(helpers) >= 1 and (sent, failed) == ("-", "-")
        else:
            assert (int(helpers) == 0) == (variant == "otlp, in thread"), (variant, cells)
            assert sent == file_spans and failed == "0", (variant, cells)


def ran_with_the_timer(benchmark: str, results: Path, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a benchmark of benchmarks/ that builds timer_floor.c (skipped without a C compiler) with
    ``argv``, its results written to ``results``: whether it returned 0 and left
    ``nn.Module.__call__`` as it found it."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here to build benchmarks/timer_floor.c")
    monkeypatch.syspath_prepend(str(SERVE.parents[2] / "benchmarks"))
    module = importlib.import_module(benchmark)
    monkeypatch.setattr(module, "RESULTS", results)
    import torch

    before = torch.nn.Module.__dict__["__call__"]
    return module.main(argv) == 0 and torch.nn.Module.__dict__["__call__"] is before


def test_the_cold_step_benchmark_pairs_every_wrapper_at_every_eviction(tmp_path, monkeypatch):
    """benchmarks/cold_step.py, briefly: a row per eviction and wrapper, each call timed off and
    on, the pair count right, and the wrappers put back as they were."""
    results = tmp_path / "cold_step.md"
    assert ran_with_the_timer("cold_step", results, ["--blocks", "2", "--calls", "5", "--evict-mb", "0", "1"],
                              monkeypatch)
    rows = [line.split() for line in results.read_text().splitlines() if line[:8].strip().isdigit()]
    assert [row[:2] for row in rows] == [["0", "xsp"], ["0", "timer"], ["1", "xsp"], ["1", "timer"]]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[5].endswith("/2"), row


@pytest.mark.heavy  # two runs of python under valgrind, minutes each
def test_the_step_misses_benchmark_counts_what_xsps_step_adds(tmp_path, monkeypatch):
    """benchmarks/step_misses.py, briefly: the plain and xsp loops counted under callgrind, and
    xsp's step adding instructions and lines fetched to every call."""
    if shutil.which("valgrind") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("valgrind and a C compiler count the step's misses; one is not here")
    results = tmp_path / "step_misses.md"
    assert ran_with_the_timer("step_misses", results, ["--calls", "3"], monkeypatch)
    rows = {" ".join(line.split()[2:-7]): [float(value) for value in line.split()[-7:]]
            for line in results.read_text().splitlines() if line.startswith("this tree ")}
    assert list(rows) == ["plain", "xsp", "xsp adds"]
    assert all(value >= 0 for value in rows["plain"] + rows["xsp"]) and rows["plain"][0] > 0
    assert rows["xsp adds"][0] > 1_000, rows  # instructions: xsp's step is more than a pass-through
    assert all(abs(adds - (xsp - plain)) <= 0.11 for plain, xsp, adds in zip(*rows.values()))  # of one run


def test_the_step_parts_benchmark_measures_both_wrappers_part_by_part(tmp_path, monkeypatch):
    """benchmarks/step_parts.py, briefly: both variants timed on and off, every part of every call
    positive, and the wrappers put back as they were (xsp's taken out by its session)."""
    results = tmp_path / "step_parts.md"
    assert ran_with_the_timer("step_parts", results, ["--blocks", "2"], monkeypatch)
    rows = [line.split() for line in results.read_text().splitlines() if line.startswith(("xsp ", "timer "))]
    assert [row[:2] for row in rows] == [[variant, state] for variant in ("xsp", "timer")
                                         for state in ("on", "off", "adds")]
    for row in rows:
        if row[1] != "adds":
            assert row[2] == "20" and all(float(value) > 0 for value in row[3:]), row
