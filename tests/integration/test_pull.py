"""xsp pull: traces sent to Jaeger read back into the span table, against a loopback stand-in that
answers as Jaeger's api_v3 documents (tests/jaeger_standin.py)."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import xsp
from tests.jaeger_standin import JaegerStandIn
from xsp.core import schema as col
from xsp.export.delivery import ExportReport, make_exporter
from xsp.export.otlp import export_table, resource_for
from xsp.export.target import OtlpTarget
from xsp.io.jaeger_query import JaegerError, pull


def recorded(tmp_path: Path) -> xsp.Trace:
    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("bad ✗")

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet", service_name="pulled"):
        for i in range(4):
            with xsp.span("load", batch=i, tags=["a", "b"], ok=True):
                pass
            model(torch.randn(4, 8)).sum().backward()
        try:
            Fails()(torch.randn(2))
        except ValueError:
            pass
    return xsp.load(tmp_path / "run.xsp.parquet")


def push(trace: xsp.Trace, otlp: str, service: str = "pulled", span_budget: int = 0) -> ExportReport:
    report = ExportReport(target="test")
    exporter = make_exporter(OtlpTarget.resolve(otlp, "grpc"))
    export_table(trace.spans, resource_for(service, trace.metadata), exporter, report, span_budget=span_budget,
                 metadata=trace.metadata)
    exporter.shutdown()
    assert report.exported == len(trace.spans), report
    return report


def same_table(pulled: pd.DataFrame, original: pd.DataFrame) -> None:
    left = pulled.sort_values(col.SPAN_ID, ignore_index=True)
    right = original.sort_values(col.SPAN_ID, ignore_index=True)
    assert len(left) == len(right)
    for column in col.COLUMNS:
        if column == col.ATTRIBUTES:
            parse = lambda text: None if pd.isna(text) else json.loads(text)  # noqa: E731
            assert [parse(t) for t in left[column]] == [parse(t) for t in right[column]], column
        elif col.COLUMNS[column] == col.CATEGORY:  # the categories may differ: the texts may not
            assert isinstance(left[column].dtype, pd.CategoricalDtype), column
            assert left[column].astype("string").tolist() == right[column].astype("string").tolist(), column
        else:
            pd.testing.assert_series_equal(left[column], right[column], check_names=False, obj=column)


def range_of(trace: xsp.Trace) -> dict[str, int]:
    spans = trace.spans
    return {"start_ns": int(spans[col.START_NS].min()) - 1_000_000, "end_ns": int(spans[col.END_NS].max()) + 1_000_000}


def test_a_pushed_trace_pulls_back_as_the_same_span_table_and_metadata(tmp_path: Path) -> None:
    trace = recorded(tmp_path)
    with JaegerStandIn() as jaeger:
        push(trace, jaeger.otlp)
        pulled = pull("pulled", jaeger.query, **range_of(trace))
    same_table(pulled.spans, trace.spans)
    expected = json.loads(json.dumps(trace.metadata, default=str))
    kept = {key: value for key, value in pulled.metadata.items() if key != "pulled_from"}
    assert kept == expected
    report = pulled.metadata["pulled_from"]["report"]
    assert report["truncated_traces"] == 0 and report["traces"] == trace.spans[col.TRACE_ID].nunique()


@pytest.mark.parametrize("base64_ids", [False, True])
def test_a_range_at_the_search_limit_is_split_until_every_trace_came(tmp_path: Path, base64_ids: bool) -> None:
    trace = recorded(tmp_path)
    with JaegerStandIn(base64_ids=base64_ids) as jaeger:
        push(trace, jaeger.otlp)
        pulled = pull("pulled", jaeger.query, search_depth=2, **range_of(trace))
        assert all("query.start_time_min" in query for query in jaeger.store.queries)
    report = pulled.metadata["pulled_from"]["report"]
    assert report["splits"] > 0 and report["cut_ranges"] == []
    same_table(pulled.spans, trace.spans)


def test_one_trace_a_session_and_an_attribute_are_pulled_alone(tmp_path: Path) -> None:
    trace = recorded(tmp_path)
    spans = trace.spans
    step_trace = spans.loc[spans[col.KIND] == col.SpanKind.STEP.value, col.TRACE_ID].iloc[1]
    session_trace = spans.loc[spans[col.KIND] == col.SpanKind.SESSION.value, col.TRACE_ID].iloc[0]
    with JaegerStandIn() as jaeger:
        push(trace, jaeger.otlp)
        one = pull(jaeger=jaeger.query, trace_id=step_trace)
        assert set(one.spans[col.TRACE_ID]) == {step_trace}
        same_table(one.spans, spans[spans[col.TRACE_ID] == step_trace])
        (tmp_path / "other").mkdir()
        other = recorded(tmp_path / "other")
        push(other, jaeger.otlp)  # another run of the same service in the range
        window = {"start_ns": min(range_of(trace)["start_ns"], range_of(other)["start_ns"]),
                  "end_ns": max(range_of(trace)["end_ns"], range_of(other)["end_ns"])}
        assert len(pull("pulled", jaeger.query, **window).spans) == len(spans) + len(other.spans)
        session = pull("pulled", jaeger.query, session=session_trace, **window)
        same_table(session.spans, spans)
        loads = pull("pulled", jaeger.query, attributes={"batch": "2"}, **window)
        # the spans outside steps hang below the session span: the two sessions' traces, and no step's
        assert loads.spans[col.TRACE_ID].nunique() == 2
        assert set(loads.spans[col.KIND]) == {col.SpanKind.SESSION.value, col.SpanKind.USER.value}


def test_a_trace_jaeger_cut_to_its_max_trace_size_is_counted(tmp_path: Path) -> None:
    trace = recorded(tmp_path)
    with JaegerStandIn(max_trace_size=3) as jaeger:
        push(trace, jaeger.otlp)
        pulled = pull("pulled", jaeger.query, **range_of(trace))
    assert pulled.metadata["pulled_from"]["report"]["truncated_traces"] > 0


def test_the_ranks_of_a_distributed_job_come_back_each_as_it_was(tmp_path: Path) -> None:
    trace = recorded(tmp_path)
    ranks = []
    for rank in range(2):
        spans = trace.spans.copy()
        offset = (rank + 1) << 40
        spans[col.SPAN_ID] = spans[col.SPAN_ID] ^ offset
        spans[col.PARENT_ID] = spans[col.PARENT_ID] ^ offset
        spans[col.TRACE_ID] = spans[col.TRACE_ID].str.slice(0, 31) + str(rank)
        spans[col.RANK] = pd.array(np.full(len(spans), rank), dtype="Int64")
        metadata = {**trace.metadata, "distributed": {"rank": rank, "world_size": 2, "job_id": "j"}}
        ranks.append(xsp.Trace(spans=spans, metadata=metadata))
    with JaegerStandIn() as jaeger:
        for part in ranks:
            push(part, jaeger.otlp)
        pulled = pull("pulled", jaeger.query, **range_of(trace))
    same_table(pulled.spans, pd.concat([part.spans for part in ranks], ignore_index=True))


def test_errors_are_one_clear_line(tmp_path: Path) -> None:
    with JaegerStandIn() as jaeger:
        with pytest.raises(ValueError, match="not a trace id"):
            pull(jaeger=jaeger.query, trace_id="xyz")
        nothing = pull("nobody", jaeger.query)  # nothing in the range: an empty table
        assert len(nothing.spans) == 0
        nothing.save(tmp_path / "nothing.xsp.parquet")  # a span table like any other, which loads
        assert len(xsp.load(tmp_path / "nothing.xsp.parquet").spans) == 0
        assert len(pull(jaeger=jaeger.query, trace_id="0" * 32).spans) == 0  # 404: no such trace
    with pytest.raises(JaegerError, match="cannot reach Jaeger"):
        pull("pulled", "http://127.0.0.1:9")
    with _other_server() as address, pytest.raises(JaegerError, match="does not answer as Jaeger's query API"):
        pull("pulled", address)  # a 404 page of some other server is no "no traces"
    for url in ("ftp://127.0.0.1:16686", "notaurl", "http://"):  # refused at once, not after a timeout
        with pytest.raises(ValueError, match="an http:// or https:// URL with a host"):
            pull("pulled", url)
    for arguments, said in ((["--jaeger", "notaurl"], "an http:// or https:// URL with a host"),
                            (["-o", str(tmp_path / "x.json")], "names a .json file")):
        options = {"--jaeger": "http://127.0.0.1:9", "-o": str(tmp_path / "x.xsp.parquet")}
        options.update(zip(arguments[::2], arguments[1::2]))
        cli = subprocess.run([sys.executable, "-m", "xsp", "pull", "--service", "s",
                              *(word for pair in options.items() for word in pair)],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and said in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
        assert not list(tmp_path.glob("x.*"))


@contextlib.contextmanager
def _other_server() -> Iterator[str]:
    """A web server that is not Jaeger: every path a 404 page."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *args: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_xsp_pull_writes_the_file_and_says_what_it_read(tmp_path: Path) -> None:
    trace = recorded(tmp_path)
    with JaegerStandIn() as jaeger:
        push(trace, jaeger.otlp)
        start = pd.Timestamp(range_of(trace)["start_ns"], unit="ns", tz="UTC").isoformat()
        end = pd.Timestamp(range_of(trace)["end_ns"], unit="ns", tz="UTC").isoformat()
        out = tmp_path / "back.xsp.parquet"
        done = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", jaeger.query, "--service", "pulled",
                               "--start", start, "--end", end, "-o", str(out)], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"{len(trace.spans):,} spans" in done.stderr
        same_table(xsp.load(out).spans, trace.spans)
        missing = subprocess.run([sys.executable, "-m", "xsp", "pull", "-o", str(out)], capture_output=True,
                                 text=True, timeout=120)
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
    down = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", "http://127.0.0.1:9", "--service", "x",
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 2 and "cannot reach Jaeger" in down.stderr and "Traceback" not in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1
    with JaegerStandIn() as jaeger:
        empty = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", jaeger.query, "--service", "nobody",
                                "-o", str(tmp_path / "none.xsp.parquet")], capture_output=True, text=True, timeout=120)
    assert empty.returncode == 1 and "no spans of service 'nobody'" in empty.stderr
    assert not (tmp_path / "none.xsp.parquet").exists()
    for wrong in (["--start", "0001-01-01T00:00:00Z"], ["--since", "99999999999d"]):
        refused = subprocess.run([sys.executable, "-m", "xsp", "pull", "--service", "x", *wrong, "-o", str(out)],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert "1970" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_spans_without_ids_or_times_are_counted_and_said_not_dropped_silently(tmp_path: Path) -> None:
    good = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "kept", "startTimeUnixNano": "1700000000000000000",
            "endTimeUnixNano": "1700000000000001000"}
    answer = json.dumps({"result": {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [
        good, {**good, "spanId": "not hex"}, {**good, "spanId": "ef" * 8, "startTimeUnixNano": None},
        {**good, "traceId": None, "spanId": "12" * 8}]}]}]}}).encode()

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.warns(xsp.XspWarning, match="3 span"):
            pulled = pull(jaeger=address, trace_id="ab" * 16)
        assert list(pulled.spans[col.NAME]) == ["kept"]
        assert pulled.metadata["pulled_from"]["report"]["malformed"] == 3
        assert sum(pulled.metadata["dropped"].values()) == 3
        out = tmp_path / "back.xsp.parquet"
        done = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", address, "--trace", "ab" * 16,
                               "-o", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "3 span(s)" in done.stderr and "left out" in done.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_an_error_jaeger_words_on_several_lines_is_one_line_of_the_cli(tmp_path: Path) -> None:
    class Fails(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            message = "storage:\n  index missing\n"
            self.wfile.write(json.dumps({"error": {"httpCode": 500, "message": message}}).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fails)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", f"http://127.0.0.1:"
                               f"{server.server_address[1]}", "--service", "x", "-o", str(tmp_path / "x.xsp.parquet")],
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["xsp: error: Jaeger answered 500: storage: index missing"]


def many_steps(tmp_path: Path, steps: int) -> xsp.Trace:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "many.xsp.parquet", service_name="capped"):
        for _ in range(steps):
            model(torch.randn(1, 4))
    return xsp.load(tmp_path / "many.xsp.parquet")


def test_a_server_that_answers_fewer_traces_than_asked_never_passes_for_the_whole_run(tmp_path: Path) -> None:
    """OpenSearch's document limits and memory stores answer at most so many traces, whatever the
    depth asked: a 150-step run came back as the 100 newest traces, exit 0, no word. The session
    span says what it sent; the ranges are split until all of it came back."""
    trace = many_steps(tmp_path, 150)
    assert trace.spans[col.TRACE_ID].nunique() == 151  # the session's own trace and one a step
    with JaegerStandIn(max_results=100) as jaeger:
        push(trace, jaeger.otlp, service="capped")
        with warnings.catch_warnings():
            warnings.simplefilter("error", xsp.XspWarning)  # no word: it all came back
            pulled = pull("capped", jaeger.query, **range_of(trace))
    same_table(pulled.spans, trace.spans)
    report = pulled.metadata["pulled_from"]["report"]
    assert report["splits"] > 0 and report["missing"] == {}


def test_what_never_comes_back_is_said_with_counts(tmp_path: Path) -> None:
    trace = many_steps(tmp_path, 30)
    spans = trace.spans
    steps = spans[spans[col.STEP].notna()][col.TRACE_ID].unique()
    lost = set(steps[:5])  # five step traces the server never stored
    with JaegerStandIn() as jaeger:
        push(trace, jaeger.otlp, service="capped")
        store = jaeger.store
        store.spans[:] = [entry for entry in store.spans if entry[2].trace_id.hex() not in lost]
        with pytest.warns(xsp.XspWarning, match=r"only 26 of the 31 traces \(\d+ of \d+ spans\) session [0-9a-f]{32} "
                                                r"sent came back .*: 5 traces \(\d+ spans\) are missing"):
            pulled = pull("capped", jaeger.query, **range_of(trace))
        session = spans.loc[spans[col.KIND] == col.SpanKind.SESSION.value, col.TRACE_ID].iloc[0]
        assert pulled.metadata["pulled_from"]["report"]["missing"][session]["traces"] == 5
        # a search for an attribute, or a range that cuts the session, reads part of it on purpose: no word
        with warnings.catch_warnings():
            warnings.simplefilter("error", xsp.XspWarning)
            pull("capped", jaeger.query, attributes={"xsp.kind": "predict"}, **range_of(trace))
            pull("capped", jaeger.query, start_ns=int(spans[col.START_NS].median()), end_ns=range_of(trace)["end_ns"])
        start = pd.Timestamp(range_of(trace)["start_ns"], unit="ns", tz="UTC").isoformat()
        end = pd.Timestamp(range_of(trace)["end_ns"], unit="ns", tz="UTC").isoformat()
        done = subprocess.run([sys.executable, "-m", "xsp", "pull", "--jaeger", jaeger.query, "--service", "capped",
                               "--start", start, "--end", end, "-o", str(tmp_path / "back.xsp.parquet")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "5 traces" in done.stderr and "are missing" in done.stderr, done.stderr
