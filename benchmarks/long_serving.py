"""Hours of serving: the example service under ``xsp run --sample``, as a platform team runs it.

The service (``examples/service/serve.py``: FastAPI, uvicorn, OpenTelemetry's FastAPI
instrumentation, a small transformer) runs unchanged under
``xsp run --sample RATE --dataset DIR --rotate WHEN --otlp URL``, and sends its own spans and
xsp's to a loopback OTLP/HTTP receiver that this script runs. Clients load it at a steady rate
(requests paced, not closed-loop: a service's traffic does not wait for it) on both endpoints
(``def`` and ``async def``) for ``--minutes``. Every ``--mark-s`` the script notes the server's
resident memory and CPU, the latency of that stretch, the parts sealed so far and the spans
received, and reads the newest sealed part while the service runs. Part-way through, it runs
``xsp capture PID --steps N``. At the end it stops the service with SIGTERM, as an orchestrator
does, and checks the whole trace against what was sent:

* every request answered is a step in the trace, timed at the model level;
* every step xsp recorded deep was exported, each xsp root span under its request's HTTP span
  (no xsp span hangs under a span the collector never got);
* what xsp dropped or did not export is counted in the trace's metadata;
* resident memory after warm-up stays flat (the issue's goal: at most 50 MB of growth);
* the capture completed while the service kept serving.

Prints a table and records it in benchmarks/results/long_serving.md.

Usage: python benchmarks/long_serving.py [--minutes 60] [--rate 40] [--sample 0.01] [--rotate 10m]
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
from _results import record
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from production import (
    ENDPOINTS,
    HEADERS,
    HOST,
    REQUEST_TIMEOUT_S,
    Server,
    last_run_line,
    leave_folder,
    tail,
    wait_ready,
)

import xsp
from xsp.core import schema as col
from xsp.table.sampling import deep_roots, step_roots

RESULTS = Path(__file__).resolve().parent / "results" / "long_serving.md"
SERVER = Path(__file__).resolve().parents[1] / "examples" / "service" / "serve.py"
PATHS = tuple(ENDPOINTS.values())  # `def` and `async def`
BODY = b"[" + b",".join(str(token).encode() for token in range(32)) + b"]"
XSP_SCOPE = "xsp"
SERVER_SPAN_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
STOP_TIMEOUT_S = 300.0
WARMUP_MARKS = 2
"""Marks before the memory baseline: imports, first windows and caches settle in the first minutes."""
GOAL_GROWTH_MB = 50.0


@dataclass
class Received:
    """What the loopback collector got: counts and the ids needed to join xsp's spans to the service's."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    metric_requests: int = 0
    xsp_spans: int = 0
    app_spans: int = 0
    app_span_ids: set[bytes] = field(default_factory=set)
    server_span_ids: set[bytes] = field(default_factory=set)
    xsp_span_ids: set[bytes] = field(default_factory=set)
    xsp_parents: list[bytes] = field(default_factory=list)
    """The parent of each xsp span, as sent (empty bytes: none)."""

    def take(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.lock:
            self.requests += 1
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    ours = scope_spans.scope.name == XSP_SCOPE
                    for span in scope_spans.spans:
                        if ours:
                            self.xsp_spans += 1
                            self.xsp_span_ids.add(span.span_id)
                            self.xsp_parents.append(span.parent_span_id)
                        else:
                            self.app_spans += 1
                            self.app_span_ids.add(span.span_id)
                            if span.kind == SERVER_SPAN_KIND:
                                self.server_span_ids.add(span.span_id)

    def xsp_roots(self) -> tuple[int, int, int]:
        """xsp's spans whose parent is not xsp's: (under the service's HTTP server span, under
        another span of the service's, under a span the collector never got)."""
        with self.lock:
            outside = [parent for parent in self.xsp_parents if parent and parent not in self.xsp_span_ids]
            under_server = sum(parent in self.server_span_ids for parent in outside)
            under_app = sum(parent in self.app_span_ids for parent in outside) - under_server
            return under_server, under_app, len(outside) - under_server - under_app


def collector(received: Received) -> ThreadingHTTPServer:
    """An OTLP/HTTP receiver on loopback that counts what it gets (a real collector's reply)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/traces":
                received.take(body)
            elif self.path == "/v1/metrics":
                with received.lock:
                    received.metric_requests += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer((HOST, 0), Handler)


@dataclass
class Traffic:
    """Each answered request's (end time, latency), by client; failures as text."""

    answered: list[list[tuple[float, int]]]
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def since(self, began: float) -> list[int]:
        return [latency for mine in self.answered for ended, latency in mine if ended >= began]

    def count(self) -> int:
        return sum(len(mine) for mine in self.answered)


def client(port: int, index: int, interval_s: float, traffic: Traffic) -> None:
    """Send a request every ``interval_s`` (paced from a fixed schedule), alternating endpoints
    by client, on one keep-alive connection; note each answer."""
    path, mine = PATHS[index % len(PATHS)], traffic.answered[index]
    connection = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
    due = time.monotonic() + interval_s * index / len(traffic.answered)
    try:
        while not traffic.stop.is_set():
            wait = due - time.monotonic()
            if wait > 0:
                traffic.stop.wait(wait)
                continue
            due += interval_s
            sent_ns = time.perf_counter_ns()
            connection.request("POST", path, BODY, HEADERS)
            response = connection.getresponse()
            body = response.read()
            if response.status != 200:
                traffic.failures.append(f"{path}: HTTP {response.status} {body[:200]!r}")
                return
            mine.append((time.monotonic(), time.perf_counter_ns() - sent_ns))
    except OSError as error:
        if not traffic.stop.is_set():
            traffic.failures.append(f"{path}: {error!r}")
    finally:
        connection.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def cpu_seconds(process: psutil.Process) -> float:
    """The server's CPU time, with that of the helper processes it reaped (windows' interpreters)."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def sealed_parts(dataset: Path) -> list[Path]:
    return sorted(dataset.glob("run=*/rank=*/part-*.xsp.parquet"), key=lambda part: part.stat().st_mtime)


def steps_in(path: Path) -> int:
    """Steps in a sealed part, read while the service runs (as a user's notebook would)."""
    return len(step_roots(xsp.load(path).spans))


@dataclass
class Mark:
    minute: float
    requests: int
    rate: float
    p50_ms: float
    p99_ms: float
    rss_mb: float
    cpu_percent: float
    parts: int
    newest_part_steps: str
    xsp_spans: int
    app_spans: int


def capture(pid: int, steps: int, output: Path) -> tuple[int, float, str]:
    """``xsp capture PID --steps N``: its exit code, how long it took, what it said."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "xsp", "capture", str(pid), "--steps", str(steps), "-o", str(output),
                           "--timeout", "300"], capture_output=True, text=True)
    said = (done.stderr or done.stdout).strip().splitlines()
    return done.returncode, time.monotonic() - began, said[-1] if said else ""


def percentile(values: Sequence[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1e6 if ordered else float("nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=40.0, help="requests a second, all clients together")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample", default="0.01")
    parser.add_argument("--rotate", default="10m")
    parser.add_argument("--mark-s", type=float, default=60.0, help="seconds between two notes")
    parser.add_argument("--capture-steps", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the dataset folder")
    args = parser.parse_args(argv)
    command = " ".join(["python benchmarks/long_serving.py", *(sys.argv[1:] if argv is None else argv)])
    folder = Path(tempfile.mkdtemp(prefix="xsp-long-serving-"))
    dataset, log = folder / "dataset", folder / "service.log"
    received = Received()
    receiver = collector(received)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://{HOST}:{receiver.server_address[1]}"
    port = free_port()
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("XSP_", "OTEL_"))}
    environment.update(XSP_BENCH_MODE="plain", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                       OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf")
    with open(log, "wb") as output:
        server = subprocess.Popen([sys.executable, "-m", "xsp", "run", "--sample", args.sample, "--dataset",
                                   str(dataset), "--rotate", args.rotate, "--otlp", endpoint, "--otlp-protocol",
                                   "http/protobuf", "--", str(SERVER), str(port)],
                                  env=environment, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    marks: list[Mark] = []
    captured: tuple[int, float, str, int] | None = None
    traffic = Traffic([[] for _ in range(args.clients)])
    began = time.monotonic()
    try:
        wait_ready(Server("the service", "xsp run", server, port, log, None))
        process = psutil.Process(server.pid)
        threads = [threading.Thread(target=client, args=(port, index, args.clients / args.rate, traffic), daemon=True)
                   for index in range(args.clients)]
        for thread in threads:
            thread.start()
        began = time.monotonic()
        last, last_cpu, capture_due = began, cpu_seconds(process), began + args.minutes * 60 / 2
        while (now := time.monotonic()) < began + args.minutes * 60 and not traffic.failures:
            if captured is None and now >= capture_due:
                capture_file = folder / "capture.xsp.parquet"
                code, seconds, said = capture(server.pid, args.capture_steps, capture_file)
                captured = (code, seconds, said, steps_in(capture_file) if code == 0 else 0)
            time.sleep(min(1.0, max(0.0, last + args.mark_s - time.monotonic())))
            if time.monotonic() < last + args.mark_s:
                continue
            now, cpu = time.monotonic(), cpu_seconds(process)
            latencies = traffic.since(last)
            parts = sealed_parts(dataset)
            try:
                newest = f"{steps_in(parts[-1]):,}" if parts else ""
            except Exception as error:  # a sealed part that cannot be read is what this run looks for
                newest = f"unreadable: {error}"
            with received.lock:
                xsp_spans, app_spans = received.xsp_spans, received.app_spans
            marks.append(Mark((now - began) / 60, traffic.count(), len(latencies) / (now - last),
                              percentile(latencies, 0.5), percentile(latencies, 0.99),
                              process.memory_info().rss / 2**20, 100 * (cpu - last_cpu) / (now - last), len(parts),
                              newest, xsp_spans, app_spans))
            print(f"{marks[-1]}", file=sys.stderr, flush=True)
            last, last_cpu = now, cpu
    finally:
        traffic.stop.set()
        server.send_signal(signal.SIGTERM)
        try:
            exit_code: int | str = server.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_code = f"killed after {STOP_TIMEOUT_S:.0f} s"
    time.sleep(2.0)  # the last spans the service's own processor flushed as it ended
    receiver.shutdown()
    if traffic.failures:
        print(f"long_serving.py: a request failed: {traffic.failures[0]}\n{tail(log)}", file=sys.stderr)
        return 1
    lines = report(args, command, began, marks, captured, exit_code, traffic, received, dataset, log)
    record(lines, RESULTS)
    leave_folder(folder, args.keep)
    return 0


def report(args: argparse.Namespace, command: str, began: float, marks: list[Mark],
           captured: tuple[int, float, str, int] | None, exit_code: int | str, traffic: Traffic, received: Received,
           dataset: Path, log: Path) -> list[str]:
    trace = xsp.load(dataset)
    spans = trace.spans
    steps = spans.iloc[step_roots(spans)]
    sampling = Counter(steps[col.SAMPLING].astype(str))
    deep = int(deep_roots(steps).sum())
    under_server, under_app, orphans = received.xsp_roots()
    export = trace.metadata.get("export", {})
    baseline = marks[min(WARMUP_MARKS, len(marks) - 1)] if marks else None
    growth = marks[-1].rss_mb - baseline.rss_mb if marks and baseline else float("nan")
    answered = traffic.count()
    lines = [
        "# Hours of serving under xsp", "",
        last_run_line(command, began), "",
        f"The example service under `xsp run --sample {args.sample} --dataset DIR --rotate {args.rotate} --otlp URL`, "
        f"{args.clients} clients sending {args.rate:g} requests a second together (paced; half to `def`, half to "
        "`async def`), its spans and xsp's sent to a loopback OTLP/HTTP receiver. Each row is one stretch: "
        "the latency of its requests, the server's resident memory at its end and its CPU over it (its own and "
        "that of the helper processes it reaped), the parts sealed so far and the steps in the newest one, "
        "read while the service ran, and the spans received so far.", "",
        "| min | requests | req/s | p50 ms | p99 ms | RSS MB | CPU % | parts | newest part's steps | xsp spans "
        "| service spans |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {m.minute:.0f} | {m.requests:,} | {m.rate:.1f} | {m.p50_ms:.2f} | {m.p99_ms:.2f} | {m.rss_mb:.0f} "
              f"| {m.cpu_percent:.1f} | {m.parts} | {m.newest_part_steps} | {m.xsp_spans:,} | {m.app_spans:,} |"
              for m in marks]
    verdict = "met" if growth <= GOAL_GROWTH_MB else "NOT met"
    capture_text = "not run (the run ended first)" if captured is None else (
        f"exit {captured[0]} after {captured[1]:.1f} s, {captured[3]} steps in its file"
        + (f" ({captured[2]})" if captured[0] != 0 else ""))
    lines += [
        "",
        f"* **Exit**: the service ended on SIGTERM with exit code {exit_code}.",
        f"* **Memory**: resident memory {baseline.rss_mb:.0f} MB at minute {baseline.minute:.0f}, "
        f"{marks[-1].rss_mb:.0f} MB at the end: {growth:+.0f} MB (goal: at most {GOAL_GROWTH_MB:.0f} MB, {verdict})."
        if marks and baseline else "* **Memory**: no stretch ended.",
        f"* **Steps**: {answered:,} requests answered, {len(steps):,} steps in the trace "
        f"({'every request a step' if len(steps) == answered else 'NOT one step per request'}); by sampling: "
        + ", ".join(f"{name} {count:,}" for name, count in sorted(sampling.items())) + ".",
        f"* **Parts**: {len(sealed_parts(dataset))} parts in the dataset; `xsp.load` of the folder reads them as one "
        "trace.",
        f"* **Export**: {received.xsp_spans:,} xsp spans and {received.app_spans:,} of the service's received in "
        f"{received.requests:,} requests, {received.metric_requests:,} metrics requests. xsp's root spans: "
        f"{under_server:,} under the request's HTTP server span, {under_app:,} under another span of the service's, "
        f"{orphans:,} under a span the collector never got; {deep:,} steps recorded deep in the file. "
        f"The trace's export counts: {dict(export) if export else 'none'}.",
        f"* **Capture** (`xsp capture PID --steps {args.capture_steps}` half-way): {capture_text}.",
        f"* **Service log**: {len(log.read_text().splitlines())} lines.",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
