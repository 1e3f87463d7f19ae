"""``xsp push``: send a trace file to an OpenTelemetry collector (Jaeger), now or later."""

from __future__ import annotations

import argparse
from typing import Any

from xsp.cli._common import CliError, error_console, progress
from xsp.core.metadata import service_name_from_environment
from xsp.export.target import DEFAULT_SPAN_BUDGET, OtlpTarget, probe, span_budget_from_env


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "push", help="send a trace file to an OTLP collector (Jaeger)",
        description="Send every span of a trace file (an .xsp.parquet file, or a PyTorch profiler "
                    ".json/.json.gz) to an OpenTelemetry collector: spans a run could not send, or a "
                    "trace recorded without a collector. The endpoint and protocol come from --otlp and "
                    "--otlp-protocol, else from OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT and _PROTOCOL; "
                    "headers, timeout, compression and certificates from the other OTEL_* variables.")
    parser.add_argument("file", help="a .xsp.parquet trace, or a PyTorch profiler trace (.json, .json.gz)")
    parser.add_argument("--otlp", metavar="URL", default=None, help="collector endpoint, e.g. http://localhost:4317")
    parser.add_argument("--otlp-protocol", choices=["grpc", "http/protobuf", "http"], default=None,
                        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    parser.add_argument("--service-name", default=None,
                        help="OTel service.name (default: OTEL_SERVICE_NAME, else service.name in "
                             "OTEL_RESOURCE_ATTRIBUTES, else the one recorded in the trace)")
    parser.add_argument("--span-budget", type=int, default=None, metavar="N",
                        help="most spans per trace (step) sent; a step over it has its deepest levels folded into "
                             "aggregate spans so that Jaeger can open it (default: XSP_SPAN_BUDGET, else "
                             f"{DEFAULT_SPAN_BUDGET}; 0: no limit)")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.export.otlp import ExportReport, export_table, make_exporter, resource_for
    from xsp.io.loading import load
    target = OtlpTarget.resolve(options.otlp, options.otlp_protocol)
    if target is None:
        raise CliError("no collector to send to: give --otlp URL or set OTEL_EXPORTER_OTLP_ENDPOINT")
    with progress(f"reading {options.file}"):
        trace = load(options.file)
    unreachable = probe(target)
    if unreachable is not None:
        raise CliError(f"OTLP endpoint {target.endpoint}: {unreachable}")
    if options.span_budget is not None and options.span_budget < 0:
        raise CliError("--span-budget must be 0 (no limit) or more")
    budget = span_budget_from_env() if options.span_budget is None else options.span_budget
    service_name = (options.service_name or service_name_from_environment()
                    or str(trace.metadata.get("service_name") or "xsp"))
    report = ExportReport(target=f"{target.protocol.value} {target.endpoint}")
    exporter = make_exporter(target)
    parts = [trace.for_rank(rank) for rank in trace.ranks] or [trace]
    with progress(f"sending {len(trace.spans):,} spans to {target.endpoint}") as say:
        try:  # each rank of a distributed job as its own service instance
            for number, part in enumerate(parts, 1):
                if len(parts) > 1:
                    say(f"sending rank {number} of {len(parts)} ({len(part.spans):,} spans) to {target.endpoint}")
                export_table(part.spans, resource_for(service_name, part.metadata), exporter, report,
                             span_budget=budget, metadata=part.metadata)
        finally:
            exporter.shutdown()
    out = error_console()
    if report.error is not None:
        out.print(f"xsp: error: {report.summary()}", markup=False)
        return 1
    out.print(f"xsp: {report.summary()}", markup=False)
    return 0
