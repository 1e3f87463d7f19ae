"""Pushing spans over OTLP: xsp's encoder (protobuf from the table's columns) beside the SDK path.

The table: a real run of a 500-layer model (250 x Linear(16, 16) + ReLU, model and layer levels)
tiled to the size asked for (each copy with its own ids, later in time), as `xsp push` reads
it from a file. Measured in one process pinned to one core, side by side:

1. *Encode*: the table to ExportTraceServiceRequest bytes, batch by batch (512 spans), by xsp's
   encoder (every row), and by the SDK path (SDK spans, then the SDK's protobuf encoder; on a
   slice, its rate being flat);
2. *Push*: `export_table` to a loopback OTLP/gRPC collector in another process that only counts
   (it parses nothing), through xsp's exporter: the encoder, and (on a slice) SDK spans;
3. *Memory*: the process's peak RSS over the table's while pushing, at each size (sampled every
   10 ms): bounded when it does not grow with the table.

Goal (issue 46): at least 500,000 spans/s on one core, on 1M spans; memory bounded pushing 10M.
Prints a table and records it in benchmarks/results/otlp_encode.md.

Usage: python benchmarks/otlp_encode.py [--rows 1000000 10000000] [--sdk-rows 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "otlp_encode.md"

COLLECTOR = r"""
import sys, time, grpc
from concurrent import futures
count = [0, 0]
def export(request, context):
    count[0] += 1
    count[1] += len(request)
    return b""
handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
    "Export": grpc.unary_unary_rpc_method_handler(export, request_deserializer=None, response_serializer=None)})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.max_receive_message_length", 1 << 30)])
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
sys.stdin.read()
print(count[0], count[1], flush=True)
"""

CHILD = r"""
import json, sys, threading, time
import numpy as np, pandas as pd, psutil, torch, xsp
from torch import nn
from xsp.core import schema as col
from xsp.export import encoding
from xsp.export.delivery import ExportReport, make_exporter
from xsp.export.otlp import build_sdk_spans, export_table, resource_for
from xsp.export.target import OtlpTarget
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

rows_wanted, sdk_rows, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
layers = []
for _ in range(250):
    layers += [nn.Linear(16, 16), nn.ReLU()]
model = nn.Sequential(*layers)
with torch.no_grad(), xsp.trace(levels="model,layer", output=None) as session:
    for _ in range(4):
        model(torch.randn(2, 16))
base = session.trace.spans
metadata = session.trace.metadata
copies = -(-rows_wanted // len(base))
span = base[col.END_NS].max() - base[col.START_NS].min() + 1
stride = len(base)
ids = pd.Series(np.arange(1, len(base) + 1), index=base[col.SPAN_ID].to_numpy())
own = np.arange(1, len(base) + 1, dtype=np.int64)
parent = base[col.PARENT_ID].map(ids).astype("Int64")  # a parent outside the table stays none
parts = []
for k in range(copies):
    part = base.copy()
    part[col.SPAN_ID] = own + k * stride
    part[col.PARENT_ID] = parent + k * stride
    part[col.START_NS] = part[col.START_NS] + k * span
    part[col.END_NS] = part[col.END_NS] + k * span
    parts.append(part)
spans = pd.concat(parts, ignore_index=True).iloc[:rows_wanted].reset_index(drop=True)
del parts
import gc; gc.collect()
resource = resource_for("bench", metadata)
process = psutil.Process()
result = {"rows": len(spans)}

def peak_during(work):
    peak, stop = [process.memory_info().rss], threading.Event()
    def sample():
        while not stop.wait(0.01):
            peak.append(process.memory_info().rss)
    sampler = threading.Thread(target=sample, daemon=True)
    before = peak[0]
    sampler.start()
    began = time.perf_counter()
    work()
    seconds = time.perf_counter() - began
    stop.set(); sampler.join()
    return seconds, (max(peak) - before) / 2**20

result["table_rss_mb"] = process.memory_info().rss / 2**20
def ours_encode():
    resource_bytes = encoding.resource_and_scope(resource)
    total = 0
    for first in range(0, len(spans), 65536):
        chunk = spans.iloc[first:first + 65536]
        table = encoding.SpanColumns(chunk, resource_bytes, None)
        positions = np.arange(len(chunk))
        for start in range(0, len(chunk), 512):
            total += len(table.request(positions[start:start + 512]))
    result["bytes_per_span"] = total / len(spans)
seconds, _ = peak_during(ours_encode)
result["ours_encode_per_s"] = len(spans) / seconds
if sdk_rows:
    sample = spans.iloc[:sdk_rows].reset_index(drop=True)
    def sdk_encode():
        build_sdk_spans(sample, resource, lambda batch: encode_spans(batch).SerializeToString())
    seconds, _ = peak_during(sdk_encode)
    result["sdk_encode_per_s"] = len(sample) / seconds
target = OtlpTarget.resolve(f"http://127.0.0.1:{port}", "grpc")
def push(table, encoded):
    report = ExportReport(target="bench")
    exporter = make_exporter(target)
    export_table(table, resource, exporter, report, span_budget=0, encoded=encoded)
    exporter.shutdown()
    assert report.exported == len(table), (report.exported, report.error)
seconds, extra_mb = peak_during(lambda: push(spans, True))
result["ours_push_per_s"] = len(spans) / seconds
result["ours_push_extra_mb"] = extra_mb
if sdk_rows:
    seconds, _ = peak_during(lambda: push(sample, False))
    result["sdk_push_per_s"] = len(sample) / seconds
print(json.dumps(result))
"""


def measure(rows: int, sdk_rows: int) -> dict[str, float]:
    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
    try:
        assert collector.stdout is not None and collector.stdin is not None
        port = int(collector.stdout.readline())
        pin = ["taskset", "-c", "0"] if sys.platform == "linux" and os.cpu_count() and os.cpu_count() > 1 else []
        done = subprocess.run([*pin, sys.executable, "-c", CHILD, str(rows), str(sdk_rows), str(port)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        if collector.stdin is not None:
            collector.stdin.close()
        collector.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--sdk-rows", type=int, default=50_000, help="rows the SDK path is timed on")
    args = parser.parse_args()
    lines = []
    for rows in args.rows:
        found = measure(rows, args.sdk_rows if rows == args.rows[0] else 0)
        print(json.dumps(found), file=sys.stderr)
        sdk_encode = found.get("sdk_encode_per_s")
        sdk_push = found.get("sdk_push_per_s")
        ours = found["ours_encode_per_s"]
        sdk_text = "-" if sdk_encode is None else f"{sdk_encode:,.0f}"
        ratio = "-" if sdk_encode is None else f"{ours / sdk_encode:.0f}x"
        sdk_push_text = "-" if sdk_push is None else f"{sdk_push:,.0f}"
        lines.append(
            f"| {found['rows']:,} | {ours:,.0f} | {sdk_text} | {ratio} | {found['ours_push_per_s']:,.0f} | "
            f"{sdk_push_text} | {found['bytes_per_span']:.0f} | {found['table_rss_mb']:,.0f} | "
            f"{found['ours_push_extra_mb']:,.0f} |")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    record([
        "# OTLP push: xsp's encoder beside the SDK path", "",
        f"Last run: {now}, {platform.machine()}, Python {platform.python_version()}; `python benchmarks/otlp_encode.py "
        f"--rows {' '.join(map(str, args.rows))} --sdk-rows {args.sdk_rows}`. One process pinned to one core; the "
        "collector (loopback OTLP/gRPC, counting only) in another. The SDK path is timed on the first "
        f"{args.sdk_rows:,} rows.", "",
        "Spans a second (goal: at least 500,000 on one core); memory: the process's peak RSS over the table's "
        "while pushing every row (goal: bounded).", "",
        "| spans | encode: xsp | encode: SDK path | ratio | push: xsp | push: SDK path | bytes a span | "
        "table RSS MB | push: extra MB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *lines,
    ], RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
