"""``xsp push``: send a trace file to an OpenTelemetry collector (Jaeger), now or later."""

from __future__ import annotations

import argparse
from typing import Any

from xsp.cli._common import CliError, add_otlp_options, error_console, progress
from xsp.core.metadata import service_name_from_environment
from xsp.core.options import checked_span_budget
from xsp.export.target import OtlpTarget, probe, span_budget_from_env


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "push", help="send a trace file to an OTLP collector (Jaeger)",
        description="Send every span of a trace file (an .xsp.parquet file, or a PyTorch profiler "
                    ".json/.json.gz) to an OpenTelemetry collector: spans a run could not send, or a "
                    "trace recorded without a collector. The endpoint and protocol come from --otlp and "
                    "--otlp-protocol, else from OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT and _PROTOCOL; "
                    "headers, timeout, compression and certificates from the other OTEL_* variables.")
    parser.add_argument("file", help="a .xsp.parquet trace, or a PyTorch profiler trace (.json, .json.gz)")
    add_otlp_options(parser, "collector endpoint, e.g. http://localhost:4317", "the one recorded in the trace")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from xsp.export.delivery import ExportReport, make_exporter
    from xsp.export.otlp import export_table, resource_for
    from xsp.io.loading import load
    checked_span_budget(options.span_budget, "--span-budget")
    target = OtlpTarget.resolve(options.otlp, options.otlp_protocol)
    if target is None:
        raise CliError("no collector to send to: give --otlp URL or set OTEL_EXPORTER_OTLP_ENDPOINT")
    with progress(f"reading {options.file}"):
        trace = load(options.file)
    unreachable = probe(target)
    if unreachable is not None:
        raise CliError(f"OTLP endpoint {target.endpoint}: {unreachable}")
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
