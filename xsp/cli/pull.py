"""``xsp pull``: read traces back from Jaeger (its v2 query API) into a ``.xsp.parquet`` file."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from xsp.cli._common import CliError, check_output, error_console, progress
from xsp.core.options import checked_output_name

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "pull", help="read traces back from Jaeger into an .xsp.parquet file",
        description="Read a service's traces (or one trace) from Jaeger's query API (/api/v3, the UI's port) "
                    "into the span table, with the run's metadata where its session span was sent: the file "
                    "works with xsp report, diff and the analyses like the one the run wrote. A range whose "
                    "answer reaches the search limit is split until every trace came.")
    parser.add_argument("--jaeger", metavar="URL", default="http://localhost:16686",
                        help="Jaeger's query API (default: http://localhost:16686)")
    parser.add_argument("--service", default=None, help="the service (service.name) whose traces to read")
    parser.add_argument("--since", default=None, metavar="DURATION",
                        help="the last DURATION (90s, 30m, 1h, 2d; default: 1h)")
    parser.add_argument("--start", default=None, help="range start (RFC 3339, e.g. 2026-11-28T10:00:00Z)")
    parser.add_argument("--end", default=None, help="range end (RFC 3339; default: now)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--session", default=None, metavar="TRACE_ID",
                       help="only this session: its session trace (the id Jaeger shows) and the step traces "
                            "linked to it")
    which.add_argument("--trace", default=None, metavar="TRACE_ID", help="only this trace")
    parser.add_argument("--attr", action="append", default=[], metavar="KEY=VALUE",
                        help="only traces with a span holding this attribute value (repeatable)")
    parser.add_argument("-o", "--output", required=True, help="the .xsp.parquet file to write")
    parser.set_defaults(handler=run)


def _time_ns(text: str, what: str) -> int:
    import pandas as pd

    try:
        stamp = pd.Timestamp(text)
        if stamp.tzinfo is None:
            stamp = stamp.tz_localize("UTC")
        nanoseconds = int(stamp.value)
    except (ValueError, TypeError, OverflowError):
        raise CliError(f"{what}: not a time (RFC 3339, e.g. 2026-11-28T10:00:00Z) between 1970 and 2262: "
                       f"{text!r}") from None
    if nanoseconds < 0:
        raise CliError(f"{what}: before 1970, when no trace was recorded: {text!r}")
    return nanoseconds


def run(options: argparse.Namespace) -> int:
    from xsp.io.jaeger_query import pull

    if options.service is None and options.trace is None:
        raise CliError("give --service NAME (or --trace ID)")
    since_s = 3600.0
    if options.since is not None:
        found = DURATION.match(options.since)
        if not found:
            raise CliError(f"--since: a duration such as 90s, 30m, 1h or 2d, not {options.since!r}")
        since_s = float(found.group(1)) * SECONDS[found.group(2)]
        if since_s * 1e9 >= time.time_ns():
            raise CliError(f"--since {options.since} reaches back before 1970, when no trace was recorded")
    start_ns = None if options.start is None else _time_ns(options.start, "--start")
    end_ns = None if options.end is None else _time_ns(options.end, "--end")
    attributes = {}
    for item in options.attr:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--attr: KEY=VALUE, not {item!r}")
        attributes[key] = value
    check_output(options.output, "")
    checked_output_name(options.output, "-o")  # (a ValueError: the one line main() says)
    with progress(f"reading from {options.jaeger}") as say:
        trace = pull(options.service, options.jaeger, start_ns=start_ns, end_ns=end_ns, since_s=since_s,
                     trace_id=options.trace, session=options.session, attributes=attributes)
        if len(trace.spans):
            say(f"writing {options.output}")
            trace.save(options.output)
    report = trace.metadata["pulled_from"]["report"]
    out = error_console()
    if not len(trace.spans):
        wanted = f"trace {options.trace}" if options.trace else f"service {options.service!r} in that time range"
        out.print(f"xsp: no spans of {wanted} at {options.jaeger} ({report['queries']} queries); nothing written",
                  markup=False)
        return 1
    out.print(f"xsp: {len(trace.spans):,} spans of {report['traces']:,} traces from {options.jaeger} "
              f"({report['queries']} queries) -> {options.output}", markup=False)
    if report["other_spans"]:
        out.print(f"xsp: {report['other_spans']:,} of them not recorded by xsp (the application's own, such as a "
                  "request's HTTP span): kept as user spans at the model level", markup=False)
    if report["truncated_traces"]:
        out.print(f"xsp: warning: {report['truncated_traces']} trace(s) came without some of their spans (Jaeger "
                  "cut them to its max_trace_size): their subtrees are incomplete", markup=False)
    if report["cut_ranges"]:
        out.print(f"xsp: warning: {len(report['cut_ranges'])} range(s) of a microsecond still held more traces than a "
                  "search returns: some traces there may be missing", markup=False)
    if report["aggregates"]:
        out.print(f"xsp: {report['aggregates']} aggregate span(s): steps the span budget folded when they were sent "
                  "(the run's own file has every span)", markup=False)
    return 0
