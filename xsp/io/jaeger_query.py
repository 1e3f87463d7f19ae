"""Traces read back from Jaeger (v2's query API, ``/api/v3``) into the span table: ``xsp pull``.

Jaeger answers a search (``GET /api/v3/traces`` with the service and a time range, both bounds
required) and a trace (``GET /api/v3/traces/{trace_id}``) with a stream of OTLP ``TracesData``
as JSON, each wrapped ``{"result": ...}``; an error is ``{"error": {"httpCode", "message"}}``
(404 "No traces found": none). Ids come as hex or base64, 64-bit integers as strings.

A search returns at most its ``search_depth`` traces and has no paging, so a range whose answer
reaches that many is split in two and each half asked again, down to a microsecond. Some servers
answer fewer whatever the depth (OpenSearch's limits, memory stores): each session span says how
many traces and spans the session sent (``xsp.session.sent``), and while fewer came back, the
ranges whose answers held the most any answer held are split too; what is still missing then is
said, with counts (``report.missing``). Spans seen
twice (a trace in two ranges) are kept once. A trace whose spans name a parent that never came is
counted as truncated (Jaeger's ``max_trace_size`` cuts big traces).

xsp's attributes turn back into the columns they came from (``xsp.level``, ``xsp.kind``, every
typed column of :data:`xsp.core.schema.COLUMN_ATTRIBUTE_KEYS`), the rest into ``attributes``; the
session span carries the run's metadata (``xsp.session.metadata``), which comes back whole.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.errors import XspError, XspWarning, warn
from xsp.io.trace import Trace
from xsp.table.build import conform

DEFAULT_JAEGER: Final = "http://localhost:16686"
SEARCH_DEPTH: Final = 1000
"""Traces a search asks for; an answer of this many may be cut: its range is split."""
SMALLEST_RANGE_NS: Final = 1_000
AGGREGATED_KEY: Final = '"xsp.aggregated.count"'
"""In an aggregate span's attributes (the span budget's, xsp.export.budget): many spans folded into one."""
TIMEOUT_S: Final = 30.0
READ_BYTES: Final = 1 << 20
INT_COLUMNS: Final = frozenset(name for name, dtype in col.COLUMNS.items() if dtype == "Int64")
COLUMN_OF_KEY: Final = {key: column for column, key in col.COLUMN_ATTRIBUTE_KEYS.items()}
SPAN_KINDS: Final = frozenset(kind.value for kind in col.SpanKind)


class JaegerError(XspError):
    """Jaeger could not be reached, or refused or could not answer a query (the message says which)."""


@dataclass
class PullReport:
    """What a pull asked and found."""

    queries: int = 0
    splits: int = 0
    traces: int = 0
    spans_seen: int = 0
    duplicates: int = 0
    truncated_traces: int = 0
    aggregates: int = 0
    malformed: int = 0
    """Spans left out: no trace or span id that reads as one, or no start or end time."""
    other_spans: int = 0
    """Spans kept that xsp did not record (no ``xsp.level``): the application's own, such as the
    HTTP span of a request whose trace holds xsp's (as user spans at the model level)."""
    cut_ranges: list[str] = field(default_factory=list)
    """Ranges still at the search's limit at the smallest split (some traces there may be missing)."""
    missing: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per session (its trace id) that said what it sent: the ``traces`` and ``spans`` that did not
    come back, even split as finely as the server's answers allowed."""


# the query API -------------------------------------------------------------------------
def rfc3339(ns: int) -> str:
    """Epoch nanoseconds as RFC 3339 with nanoseconds, UTC."""
    seconds, rest = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{rest:09d}Z"


def _is_jaeger_error(body: str) -> bool:
    """Whether an error answer is Jaeger's own (``{"error": {"httpCode": ..., "message": ...}}``),
    not a page of some other server at that address."""
    try:
        found = json.JSONDecoder().raw_decode(body.lstrip())[0]
    except ValueError:
        return False
    return isinstance(found, dict) and isinstance(found.get("error"), dict)


def answers(url: str, timeout_s: float = TIMEOUT_S) -> Iterator[dict[str, Any]]:
    """The ``result`` objects of one streamed answer, read a piece at a time; an error answer
    raises :class:`JaegerError`, except 404 (no traces: nothing)."""
    try:
        response = urllib.request.urlopen(url, timeout=timeout_s)  # noqa: S310 - the user's Jaeger
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")
        if exc.code == 404 and _is_jaeger_error(body):
            return  # Jaeger's "No traces found"
        if exc.code == 404:
            raise JaegerError(f"{url.split('/api/')[0]} does not answer as Jaeger's query API (HTTP 404 for "
                              f"/api/{url.split('/api/', 1)[-1].split('?')[0]}): give the address of Jaeger v2's "
                              "query service (port 16686)") from None
        raise JaegerError(f"Jaeger answered {exc.code}: {_error_text(body) or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise JaegerError(f"cannot reach Jaeger's query API at {url.split('/api/')[0]}: {reason}") from None
    decoder = json.JSONDecoder()
    text = ""
    with response:
        while True:
            piece = response.read(READ_BYTES)
            text += piece.decode("utf-8", "replace") if piece else ""
            position = 0
            while True:
                while position < len(text) and text[position] in " \t\r\n,[]":
                    position += 1
                if position >= len(text):
                    break
                try:
                    found, end = decoder.raw_decode(text, position)
                except json.JSONDecodeError:
                    if not piece:
                        raise JaegerError(f"Jaeger's answer is not JSON: {text[position:position + 80]!r}") from None
                    break
                position = end
                if isinstance(found, dict) and "error" in found:
                    error = found["error"] if isinstance(found["error"], dict) else {}
                    if error.get("httpCode") == 404 or error.get("grpcCode") == 5:
                        continue
                    raise JaegerError(f"Jaeger answered {error.get('httpCode', '')}: {error.get('message', found)}")
                if isinstance(found, dict) and isinstance(found.get("result"), dict):
                    yield found["result"]
            text = text[position:]
            if not piece:
                if text.strip():
                    raise JaegerError(f"Jaeger's answer ended inside a JSON object: {text[:80]!r}")
                return


def _error_text(body: str) -> str:
    try:
        found = json.loads(body)
    except ValueError:
        return body.strip()[:200]
    error = found.get("error") if isinstance(found, dict) else None
    return str(error.get("message", "")) if isinstance(error, dict) else body.strip()[:200]


def search_url(jaeger: str, service: str, start_ns: int, end_ns: int, attributes: Mapping[str, str],
               depth: int = SEARCH_DEPTH) -> str:
    query = {"query.service_name": service, "query.start_time_min": rfc3339(start_ns),
             "query.start_time_max": rfc3339(end_ns), "query.search_depth": str(depth)}
    if attributes:
        query["query.attributes"] = json.dumps(dict(attributes), separators=(",", ":"))
    return f"{jaeger.rstrip('/')}/api/v3/traces?{urllib.parse.urlencode(query)}"


def trace_url(jaeger: str, trace_id: str) -> str:
    return f"{jaeger.rstrip('/')}/api/v3/traces/{urllib.parse.quote(trace_id)}"


# OTLP JSON into rows -------------------------------------------------------------------
def hex_id(value: Any, size: int) -> str | None:
    """An OTLP JSON id (hex, or base64 as some versions send it) as lowercase hex of ``size`` bytes."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) == 2 * size and re.fullmatch(r"[0-9a-fA-F]+", value):
        return value.lower()
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == size else None


def any_value(value: Any) -> Any:
    """The Python value of an OTLP JSON AnyValue."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [any_value(item) for item in (value["arrayValue"] or {}).get("values", [])]
    if "kvlistValue" in value:
        items = (value["kvlistValue"] or {}).get("values", [])
        return {item.get("key"): any_value(item.get("value")) for item in items}
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes_of(items: Any) -> dict[str, Any]:
    return {item["key"]: any_value(item.get("value")) for item in items or []
            if isinstance(item, dict) and "key" in item}


def _nanoseconds(value: Any) -> int | None:
    """An OTLP time (a string of epoch nanoseconds in JSON, or a number) as an int; None where absent
    or not a time."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        found = int(value)
    except (TypeError, ValueError):
        return None
    return found if 0 < found < 2**63 else None


@dataclass
class Collected:
    """Spans read so far, one row each (a span seen twice is kept once), and what came with them."""

    rows: dict[str, list[Any]] = field(default_factory=lambda: {name: [] for name in (
        col.TRACE_ID, col.SPAN_ID, col.PARENT_ID, col.NAME, col.START_NS, col.END_NS, col.STATUS,
        col.STATUS_MESSAGE, "links", "attrs", "ours")})
    seen: set[int] = field(default_factory=set)
    resources: list[dict[str, Any]] = field(default_factory=list)
    report: PullReport = field(default_factory=PullReport)
    sent: dict[str, dict[str, int]] = field(default_factory=dict)
    """What each session (by its trace id) said it sent in all (:data:`~xsp.core.schema.ATTR_SESSION_SENT`)."""

    def add(self, traces_data: Mapping[str, Any]) -> set[str]:
        """Add the spans of one TracesData; the trace ids seen in it."""
        trace_ids: set[str] = set()
        rows = self.rows
        for resource_spans in traces_data.get("resourceSpans") or []:
            resource = attributes_of((resource_spans.get("resource") or {}).get("attributes"))
            if resource and resource not in self.resources:
                self.resources.append(resource)
            for scope_spans in resource_spans.get("scopeSpans") or []:
                for span in scope_spans.get("spans") or []:
                    trace_id, span_id = hex_id(span.get("traceId"), 16), hex_id(span.get("spanId"), 8)
                    start_ns, end_ns = _nanoseconds(span.get("startTimeUnixNano")), _nanoseconds(
                        span.get("endTimeUnixNano"))
                    if trace_id is None or span_id is None or start_ns is None or end_ns is None:
                        self.report.malformed += 1
                        continue
                    self.report.spans_seen += 1
                    trace_ids.add(trace_id)
                    number = int(span_id, 16)
                    if number in self.seen:
                        self.report.duplicates += 1
                        continue
                    self.seen.add(number)
                    parent = hex_id(span.get("parentSpanId"), 8)
                    status = span.get("status") or {}
                    error = status.get("code") in (2, "STATUS_CODE_ERROR")
                    rows[col.TRACE_ID].append(trace_id)
                    rows[col.SPAN_ID].append(number)
                    rows[col.PARENT_ID].append(None if parent is None else int(parent, 16))
                    rows[col.NAME].append(span.get("name", ""))
                    rows[col.START_NS].append(start_ns)
                    rows[col.END_NS].append(end_ns)
                    rows[col.STATUS].append(col.Status.ERROR.value if error else col.Status.OK.value)
                    rows[col.STATUS_MESSAGE].append(status.get("message") if error else None)
                    rows["links"].append([hex_id(link.get("traceId"), 16) for link in span.get("links") or []])
                    attributes = attributes_of(span.get("attributes"))
                    sent = attributes.pop(col.ATTR_SESSION_SENT, None)
                    if isinstance(sent, str):
                        self._note_sent(trace_id, sent, start_ns, end_ns)
                    rows["attrs"].append(attributes)
                    rows["ours"].append(col.ATTR_LEVEL in attributes)
        return trace_ids

    def _note_sent(self, trace_id: str, text: str, start_ns: int, end_ns: int) -> None:
        try:
            found = json.loads(text)
        except ValueError:
            return
        if isinstance(found, dict) and all(isinstance(found.get(key), int) for key in ("traces", "spans")):
            self.sent[trace_id] = {"traces": int(found["traces"]), "spans": int(found["spans"]), "start_ns": start_ns,
                                   "end_ns": end_ns}

    def linked_sessions(self) -> set[str]:
        """The traces the spans read link to: their sessions' (a step's root links to its session)."""
        return {link for links in self.rows["links"] for link in links if link is not None}

    def came_back(self, session: str) -> tuple[int, int]:
        """Traces and spans read of one session: its own trace, and those that link to it (a
        step's own trace, or the request's trace it joined); of the spans, xsp's alone (a request's
        trace holds the application's too)."""
        rows = self.rows
        traces = {session} | {trace for trace, links in zip(rows[col.TRACE_ID], rows["links"]) if session in links}
        return len(traces), sum(trace in traces and ours for trace, ours in zip(rows[col.TRACE_ID], rows["ours"]))

    def short(self, start_ns: int, end_ns: int) -> dict[str, tuple[int, int, int, int]]:
        """Sessions that ran within ``start_ns``..``end_ns`` of which fewer traces or spans came
        back than they sent: ``(traces read, sent, spans read, sent)`` by session trace id."""
        found = {}
        for session, sent in self.sent.items():
            if sent["start_ns"] < start_ns or sent["end_ns"] > end_ns:
                continue  # a session the range cuts: only part of it was asked for
            traces, spans = self.came_back(session)
            if traces < sent["traces"] or spans < sent["spans"]:
                found[session] = (traces, sent["traces"], spans, sent["spans"])
        return found

    def table(self) -> tuple[pd.DataFrame, dict[str, Any] | None]:
        """The span table of every span kept, and the session's metadata where a session span had it."""
        rows = self.rows
        count = len(rows[col.SPAN_ID])
        columns: dict[str, Any] = {name: rows[name] for name in (col.TRACE_ID, col.NAME, col.STATUS,
                                                                 col.STATUS_MESSAGE)}
        columns[col.SPAN_ID] = np.array(rows[col.SPAN_ID], dtype=np.uint64).astype(np.int64)
        columns[col.PARENT_ID] = pd.array([None if p is None else np.uint64(p).astype(np.int64)
                                           for p in rows[col.PARENT_ID]], dtype="Int64")
        columns[col.START_NS] = np.array(rows[col.START_NS], dtype=np.int64)
        columns[col.END_NS] = np.array(rows[col.END_NS], dtype=np.int64)
        levels, kinds, others = [], [], []
        typed: dict[str, list[Any]] = {column: [None] * count for column in col.COLUMN_ATTRIBUTE_KEYS}
        metadata = None
        for row, attributes in enumerate(rows["attrs"]):
            levels.append(attributes.pop(col.ATTR_LEVEL, col.Level.MODEL.value))
            kinds.append(attributes.pop(col.ATTR_KIND, col.SpanKind.USER.value))
            kept = attributes.pop(col.ATTR_SESSION_METADATA, None)
            if isinstance(kept, str) and kinds[-1] == col.SpanKind.SESSION.value:
                try:
                    metadata = json.loads(kept)
                except ValueError:
                    pass
            for key in [key for key in attributes if key in COLUMN_OF_KEY]:
                typed[COLUMN_OF_KEY[key]][row] = attributes.pop(key)
            others.append(json.dumps(attributes, ensure_ascii=False) if attributes else None)
        columns[col.LEVEL], columns[col.KIND], columns[col.ATTRIBUTES] = levels, kinds, others
        for column, values in typed.items():
            if any(value is not None for value in values):
                columns[column] = pd.array(values, dtype="Int64") if column in INT_COLUMNS else values
        frame = pd.DataFrame(columns)
        frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
        ours = np.array(rows["ours"], dtype=bool)  # (as each span came: its level is popped above)
        self.report.other_spans = count - int(ours.sum())
        return _under_remote_parents(conform(frame), ours), metadata


def _under_remote_parents(spans: pd.DataFrame, ours: np.ndarray) -> pd.DataFrame:
    """xsp's spans as their file holds them: a step's root exported as the child of a span of the
    application's own instrumentation (its request's span, :data:`~xsp.core.schema.REMOTE_PARENT_ID`)
    is a root again, with that span as its remote parent; the application's spans stay, as they
    came, but for the first of a trace whose parent is not in it, whose parent is remote too."""
    if ours.all():
        return spans
    parents = spans[col.PARENT_ID]
    remote = ours & parents.isin(spans.loc[~ours, col.SPAN_ID]).to_numpy(dtype=bool)
    # the application's first span of a trace whose parent is not in it: the caller's span (a
    # request whose client sent a traceparent), as much a remote parent as a request's for a step
    missing = (~ours & parents.notna().to_numpy(dtype=bool)
               & ~parents.isin(spans[col.SPAN_ID]).to_numpy(dtype=bool))
    if missing.any():
        first_start = spans.groupby(col.TRACE_ID, observed=True)[col.START_NS].transform("min")
        remote |= missing & (spans[col.START_NS] == first_start).to_numpy(dtype=bool)
    if remote.any():
        spans[col.REMOTE_PARENT_ID] = spans[col.REMOTE_PARENT_ID].mask(remote, parents)
        spans[col.PARENT_ID] = parents.mask(remote)
    return spans


# pulling ---------------------------------------------------------------------------------
def pull(service: str | None = None, jaeger: str = DEFAULT_JAEGER, *, start_ns: int | None = None,
         end_ns: int | None = None, since_s: float | None = 3600.0, trace_id: str | None = None,
         session: str | None = None, attributes: Mapping[str, str] | None = None,
         search_depth: int = SEARCH_DEPTH, timeout_s: float = TIMEOUT_S) -> Trace:
    """Read traces back from Jaeger into an :class:`xsp.Trace`.

    Args:
        service: the service whose traces to read (``service.name``); not needed with ``trace_id``.
        jaeger: the query API's base URL (Jaeger's UI port, 16686).
        start_ns, end_ns: the time range (epoch ns); by default the last ``since_s`` seconds.
        trace_id: read this one trace (hex) instead of searching.
        session: keep the session trace of this id (hex: the session span's trace id) and the step
            traces that link to it; the rest of the range is left out.
        attributes: only traces with spans holding these attribute values (Jaeger's tag search).
        search_depth: traces asked for per query; a range whose answer reaches it is split.

    Raises:
        JaegerError: Jaeger cannot be reached, or refused the query.
        ValueError: a range or an id that cannot be asked for, or a URL that is no Jaeger's
            (not http:// or https:// with a host).
    """
    address = urllib.parse.urlsplit(jaeger)
    if address.scheme.lower() not in ("http", "https") or not address.netloc:
        raise ValueError(f"Jaeger's query API is an http:// or https:// URL with a host (such as {DEFAULT_JAEGER}), "
                         f"not {jaeger!r}")
    collected = Collected()
    report = collected.report
    now_ns = int(datetime.now(tz=timezone.utc).timestamp() * 1e9)
    if trace_id is not None:
        wanted = hex_id(trace_id, 16)
        if wanted is None:
            raise ValueError(f"not a trace id (32 hex digits): {trace_id!r}")
        report.queries += 1
        for result in answers(trace_url(jaeger, wanted), timeout_s):
            collected.add(result)
    else:
        if not service:
            raise ValueError("a service to search is needed (or a trace id)")
        end = now_ns if end_ns is None else end_ns
        start = start_ns if start_ns is not None else end - int((since_s or 3600.0) * 1e9)
        if start >= end:
            raise ValueError("the time range is empty: its start is not before its end")
        answered = _search(collected, jaeger, service, [(start, end)], attributes or {}, search_depth, search_depth,
                           timeout_s)
        # the session traces the steps link to, asked for by id where the search did not bring
        # them (a capped answer keeps the newest traces; a session's own starts first)
        whole = not attributes  # a search for some attribute reads only part of each session
        named = hex_id(session, 16) if session is not None else None
        wanted_sessions = {named} if named is not None else set()
        if whole:
            wanted_sessions |= collected.linked_sessions()
        for missing_session in sorted(wanted_sessions - set(collected.rows[col.TRACE_ID])):
            report.queries += 1
            for result in answers(trace_url(jaeger, str(missing_session)), timeout_s):
                collected.add(result)
        # a server may answer fewer traces than asked, whatever the depth (OpenSearch's document
        # limits, memory stores): where a session says it sent more than came back, the ranges
        # whose answers reached the most any answer held are split too
        limit = max(answered.values(), default=0)
        while (whole and collected.short(start, end) and limit
               and any(count >= limit for count in answered.values())):
            fuller = [window for window, count in answered.items() if count >= limit]
            for window in fuller:
                del answered[window]
            before = len(collected.seen)
            answered.update(_search(collected, jaeger, service, _halves(fuller, report), attributes or {},
                                    search_depth, limit, timeout_s))
            if len(collected.seen) == before and all(high - low <= SMALLEST_RANGE_NS for low, high in fuller):
                break
    spans, metadata = collected.table()
    short = collected.short(start, end) if trace_id is None and not attributes else {}
    report.missing = {short_session: {"traces": sent - read, "spans": sent_spans - read_spans}
                      for short_session, (read, sent, read_spans, sent_spans) in short.items()}
    for short_session, (read, sent, read_spans, sent_spans) in short.items():
        warn(XspWarning(
            f"only {read} of the {sent} traces ({read_spans} of {sent_spans} spans) session {short_session} sent "
            "came back "
            f"from {jaeger}, even split into ranges of single answers: {sent - read} traces ({sent_spans - read_spans} "
            "spans) are missing (a server that caps its answers, or spans it dropped or has not stored yet); the "
            "trace file the run wrote has them all"))
    if session is not None:
        spans = _session_only(spans, collected, session)
    report.traces = int(spans[col.TRACE_ID].nunique()) if len(spans) else 0
    report.truncated_traces = _truncated(spans)
    report.aggregates = int(spans[col.ATTRIBUTES].str.contains(AGGREGATED_KEY, regex=False).fillna(False).sum())
    info: dict[str, Any] = dict(metadata) if metadata else {}
    resource = collected.resources[0] if collected.resources else {}
    info.setdefault("service_name", resource.get("service.name", service))
    # traces that no xsp session sent (another service's, or none found) are a span table all the same
    info.setdefault("schema_version", col.SCHEMA_VERSION)
    info["pulled_from"] = {"jaeger": jaeger, "service": service, "trace_id": trace_id, "session": session,
                           "report": report.__dict__}
    if report.malformed:
        info["dropped"] = {**(info.get("dropped") or {}), "spans without ids or times Jaeger answered with":
                           report.malformed}
        warn(XspWarning(f"{report.malformed} span(s) from {jaeger} had no trace or span id, or no start or "
                                 "end time, and were left out"))
    return Trace(spans=spans, metadata=info)


def _search(collected: Collected, jaeger: str, service: str, ranges: list[tuple[int, int]],
            attributes: Mapping[str, str], depth: int, limit: int, timeout_s: float) -> dict[tuple[int, int], int]:
    """Search each range, splitting those whose answer reached ``limit`` traces; how many traces
    each range searched last answered."""
    report = collected.report
    answered: dict[tuple[int, int], int] = {}
    while ranges:
        low, high = ranges.pop()
        report.queries += 1
        traces: set[str] = set()
        for result in answers(search_url(jaeger, service, low, high, attributes, depth), timeout_s):
            traces |= collected.add(result)
        if len(traces) >= limit and high - low > SMALLEST_RANGE_NS:
            ranges += _halves([(low, high)], report)
            continue
        if len(traces) >= limit:
            report.cut_ranges.append(f"{rfc3339(low)}..{rfc3339(high)}")
        answered[(low, high)] = len(traces)
    return answered


def _halves(ranges: list[tuple[int, int]], report: PullReport) -> list[tuple[int, int]]:
    """Each range in two halves (one it cannot split any more stays whole)."""
    halves = []
    for low, high in ranges:
        if high - low <= SMALLEST_RANGE_NS:
            halves.append((low, high))
            continue
        report.splits += 1
        middle = (low + high) // 2
        halves += [(middle, high), (low, middle)]
    return halves


def _session_only(spans: pd.DataFrame, collected: Collected, session: str) -> pd.DataFrame:
    """The session trace ``session`` and the traces whose spans link to it."""
    wanted = hex_id(session, 16)
    if wanted is None:
        raise ValueError(f"not a session trace id (32 hex digits): {session!r}")
    linked = {trace for trace, links in zip(collected.rows[col.TRACE_ID], collected.rows["links"]) if wanted in links}
    keep = spans[col.TRACE_ID].isin(linked | {wanted}).to_numpy()
    return spans[keep].reset_index(drop=True)


def _truncated(spans: pd.DataFrame) -> int:
    """Traces holding a span whose parent never came (Jaeger cut the trace)."""
    if not len(spans):
        return 0
    parents = spans[col.PARENT_ID]
    missing = parents.notna() & ~parents.isin(spans[col.SPAN_ID])
    return int(spans.loc[missing.to_numpy(dtype=bool), col.TRACE_ID].nunique())


__all__ = ["DEFAULT_JAEGER", "JaegerError", "PullReport", "pull", "answers", "search_url", "trace_url", "hex_id",
           "rfc3339"]
