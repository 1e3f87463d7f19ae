"""OTLP protobuf made straight from the span table's columns, for ``xsp push`` and the end-of-run export.

The SDK path makes an SDK span per row, then a protobuf object per span, attribute and value,
then serializes them: about 20,000 spans a second. Here every value that repeats is encoded
once (a name, a string attribute, a row's JSON attributes, the resource and the scope), and the
spans are written by xsp's C encoder (``xsp/export/_protobuf.c``) from arrays of the columns,
batch by batch. The bytes decode to what the SDK path sends for the same rows, span for span:
the same ids, parents, times, attributes in the same order, status, link to the session and
flags; values are cleaned and limited as the SDK does (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``,
``OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT``), with the SDK's own attribute encoder.

Sending stays the SDK exporters' (:class:`EncodedExporter`), so every ``OTEL_EXPORTER_OTLP_*``
setting (endpoint, headers, compression, timeout, certificates) keeps working.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Final, overload

import numpy as np
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider

from xsp._version import __version__
from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.export.wire import varint
from xsp.record.hotpath import optional_extension

PROTOBUF: Any = optional_extension("xsp.export._protobuf")
"""xsp's C span encoder, or None where it is not built (then the SDK path is used)."""

try:  # the SDK's own encoding of attribute values, so that ours are exactly its
    from opentelemetry.exporter.otlp.proto.common._internal import _encode_attributes
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
except ImportError:  # another layout of the SDK: the SDK path is used
    _encode_attributes = encode_spans = None  # type: ignore[assignment]

TYPE_INT: Final = 1
TYPE_STRING: Final = 2
SPAN_FLAGS: Final = 0x100
"""SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK: what the SDK sets for a span whose parent is local."""
SCOPE_NAME: Final = "xsp"


def available() -> bool:
    """Whether spans can be encoded here (the C encoder is built and the SDK's encoder found)."""
    return PROTOBUF is not None and _encode_attributes is not None and encode_spans is not None


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the payload's length, the payload."""
    return bytes([tag]) + varint(len(payload)) + payload


def request_roots(spans: pd.DataFrame) -> np.ndarray:
    """The step roots sent as a request span's children (:func:`xsp.export.otlp.under_request_spans`):
    they link to the session span as every other step root does, so that a session's steps in its
    requests' traces are found from it (``xsp pull --session``, and in Jaeger)."""
    if col.REMOTE_PARENT_ID not in spans:
        return np.zeros(len(spans), dtype=bool)
    remote = spans[col.REMOTE_PARENT_ID]
    return (remote.notna() & (spans[col.PARENT_ID] == remote)).to_numpy(dtype=bool, na_value=False)


class SpanColumns:
    """A span table made ready for the C encoder: its columns as arrays, what repeats encoded once.

    ``resource``: the SDK resource, or its encoding and the scope's (:func:`resource_and_scope`,
    made once for many tables). ``session`` is the (trace id, span id) of the session span that
    step roots link to.
    """

    def __init__(self, spans: pd.DataFrame, resource: Resource | tuple[bytes, bytes], session: tuple[str, int] | None,
                 limits: SpanLimits | None = None) -> None:
        self.limits = limits or SpanLimits()
        count = len(spans)
        self.count = count
        trace_codes, trace_texts = pd.factorize(spans[col.TRACE_ID], use_na_sentinel=False)
        trace_table = np.frombuffer(b"".join(bytes.fromhex(str(text)) for text in trace_texts) or b"\0" * 16,
                                    dtype=np.uint8).reshape(-1, 16)
        self.trace_ids = np.ascontiguousarray(trace_table[trace_codes]).tobytes()
        self.span_ids = spans[col.SPAN_ID].to_numpy(dtype=np.int64).astype(">u8").tobytes()
        parents = spans[col.PARENT_ID]
        self.has_parent = parents.notna().to_numpy(dtype=np.uint8)
        self.parent_ids = parents.fillna(0).to_numpy(dtype=np.int64).astype(">u8").tobytes()
        name_codes, names = pd.factorize(spans[col.NAME], use_na_sentinel=False)
        self.name_codes = name_codes.astype(np.int32)
        self.names = [b"" if pd.isna(name) else str(name).encode() for name in names]
        self.start_ns = spans[col.START_NS].to_numpy(dtype=np.int64)
        self.end_ns = spans[col.END_NS].to_numpy(dtype=np.int64)
        errors = (spans[col.STATUS] == col.Status.ERROR.value).fillna(False).to_numpy(dtype=bool)
        self.status_codes = np.where(errors, 2, 0).astype(np.uint8)
        messages = spans[col.STATUS_MESSAGE].where(errors)
        message_codes, message_texts = pd.factorize(messages, use_na_sentinel=True)
        self.message_codes = message_codes.astype(np.int32)
        self.messages = [str(text).encode() for text in message_texts]
        kinds = spans[col.KIND].to_numpy(dtype=object)
        self.link = b""
        self.linked = np.zeros(count, dtype=np.uint8)
        if session is not None:
            self.link = self._link(session)
            self.linked = (((self.has_parent == 0) | request_roots(spans))
                           & (kinds != col.SpanKind.SESSION.value)).astype(np.uint8)
        self.columns: list[tuple[bytes, int, np.ndarray, np.ndarray, list[bytes] | None]] = []
        """What the C encoder reads, per attribute: its KeyValue key field, type, values, presence, AnyValue table."""
        self.column_texts: list[tuple[str, list[str] | None]] = []
        """Beside each of ``columns``: its key and a string column's distinct texts (a row encoded whole reads them)."""
        typed_keys = {col.ATTR_LEVEL, col.ATTR_KIND}
        present_counts = np.full(count, 2, dtype=np.int64)
        for column, key in ((col.LEVEL, col.ATTR_LEVEL), (col.KIND, col.ATTR_KIND)):
            self.columns.append(self._strings(key, spans[column].fillna("")))
        for column, key in col.COLUMN_ATTRIBUTE_KEYS.items():
            if column not in spans:
                continue
            values = spans[column]
            typed_keys.add(key)
            if not values.notna().any():
                continue
            if pd.api.types.is_integer_dtype(values.dtype):
                present = values.notna().to_numpy(dtype=np.uint8)
                self.columns.append((field(0x0A, key.encode()), TYPE_INT,
                                     values.fillna(0).to_numpy(dtype=np.int64), present, None))
                self.column_texts.append((key, None))
            else:
                self.columns.append(self._strings(key, values))
            present_counts += self.columns[-1][3]
        self.extra_codes = np.full(count, -1, dtype=np.int32)
        self.extras: list[bytes] = []
        self._json_attributes(spans, typed_keys, present_counts)
        self.prefix, self.scope = resource if isinstance(resource, tuple) else resource_and_scope(resource)

    # -----------------------------------------------------------------------------------
    def _value(self, value: Any) -> bytes:
        """One value's AnyValue, cleaned and encoded by the SDK."""
        cleaned = BoundedAttributes(None, {"v": value}, immutable=False,
                                    max_value_len=self.limits.max_span_attribute_length)
        encoded = _encode_attributes(cleaned)
        return encoded[0].value.SerializeToString() if encoded else b""

    def _strings(self, key: str, values: pd.Series) -> tuple[bytes, int, np.ndarray, np.ndarray, list[bytes]]:
        codes, found = pd.factorize(values, use_na_sentinel=True)
        texts = [str(text) for text in found]
        self.column_texts.append((key, texts))
        present = (codes >= 0).astype(np.uint8)
        table = [self._value(text) for text in texts]
        return field(0x0A, key.encode()), TYPE_STRING, np.maximum(codes, 0).astype(np.int32), present, table

    def _entries(self, attributes: dict[str, Any], limit: int | None) -> bytes:
        """Span attribute fields (and the count the limit dropped) of ``attributes``, as the SDK
        keeps them: cleaned, at most ``limit``, the first ones dropped beyond it."""
        bounded = BoundedAttributes(limit, attributes, immutable=False,
                                    max_value_len=self.limits.max_span_attribute_length)
        entries = b"".join(field(0x4A, kv.SerializeToString()) for kv in _encode_attributes(bounded))
        if bounded.dropped:
            entries += b"\x50" + varint(bounded.dropped)
        return entries

    def _json_attributes(self, spans: pd.DataFrame, typed_keys: set[str], present_counts: np.ndarray) -> None:
        """The rows' own attributes (JSON), encoded once per distinct text. A row whose own
        attributes name a typed key, or that holds more attributes than the limit allows, is
        encoded whole here as the SDK path builds it (typed first, its own after)."""
        if col.ATTRIBUTES not in spans:
            return
        codes, texts = pd.factorize(spans[col.ATTRIBUTES], use_na_sentinel=True)
        limit = self.limits.max_span_attributes
        parsed: list[dict[str, Any]] = []
        plain: list[bool] = []
        for text in texts:
            found = json.loads(text)
            found = found if isinstance(found, dict) else {}
            parsed.append(found)
            plain.append(not (typed_keys & found.keys()))
            self.extras.append(self._entries(found, None) if plain[-1] else b"")
        self.extra_codes = codes.astype(np.int32)
        known = np.where(codes >= 0, codes, len(parsed))
        sizes = np.array([len(found) for found in parsed] + [0], dtype=np.int64)[known]
        whole = (codes >= 0) & ~np.array(plain + [True], dtype=bool)[known]
        if limit is not None:
            whole |= (present_counts + sizes) > limit
        for row in np.flatnonzero(whole).tolist():
            attributes = self._typed_attributes(row)
            if codes[row] >= 0:
                for key, value in parsed[codes[row]].items():
                    attributes.setdefault(key, value)
            for column in self.columns:
                column[3][row] = 0
            self.extra_codes[row] = len(self.extras)
            self.extras.append(self._entries(attributes, limit))

    def _typed_attributes(self, row: int) -> dict[str, Any]:
        """A row's attributes from the typed columns, as values (for a row encoded whole)."""
        attributes: dict[str, Any] = {}
        for (_, _, values, present, _), (key, texts) in zip(self.columns, self.column_texts):
            if present[row]:
                attributes[key] = int(values[row]) if texts is None else texts[values[row]]
        return attributes

    @staticmethod
    def _link(session: tuple[str, int]) -> bytes:
        """The link of a step's root to the session span (Span.links, field 13), as the SDK writes it."""
        link = (field(0x0A, bytes.fromhex(session[0])) + field(0x12, int(session[1]).to_bytes(8, "big"))
                + field(0x22, field(0x0A, col.ATTR_SESSION_LINK.encode()) + field(0x12, field(0x0A, b"session")))
                + b"\x35" + SPAN_FLAGS.to_bytes(4, "little"))
        return field(0x6A, link)

    # -----------------------------------------------------------------------------------
    def spans_bytes(self, rows: np.ndarray) -> bytes:
        """The ScopeSpans.spans entries of ``rows`` (table positions), in that order."""
        return bytes(PROTOBUF.encode_spans(
            np.ascontiguousarray(rows, dtype=np.int64), self.trace_ids, self.span_ids, self.parent_ids,
            self.has_parent, self.name_codes, self.names, self.start_ns, self.end_ns, self.status_codes,
            self.message_codes, self.messages, self.linked, self.link, self.columns, self.extra_codes, self.extras,
            SPAN_FLAGS))

    def request(self, rows: np.ndarray) -> bytes:
        """A whole ExportTraceServiceRequest of ``rows``: one resource, one scope, their spans."""
        scope_spans = field(0x12, self.scope + self.spans_bytes(rows))
        return field(0x0A, self.prefix + scope_spans)


def resource_and_scope(resource: Resource) -> tuple[bytes, bytes]:
    """The resource (ResourceSpans' fields but its scope spans) and the scope (ScopeSpans' fields
    but its spans) as the SDK encodes them, taken from one span it encodes."""
    provider = TracerProvider(resource=resource)
    span = provider.get_tracer(SCOPE_NAME, __version__).start_span("probe")
    span.end()
    request = encode_spans([span])  # type: ignore[list-item]
    resource_spans = request.resource_spans[0]
    scope_spans = resource_spans.scope_spans[0]
    scope_spans.ClearField("spans")
    scope = scope_spans.SerializeToString()
    resource_spans.ClearField("scope_spans")
    provider.shutdown()
    return resource_spans.SerializeToString(), scope


class EncodedBatch(Sequence[int]):
    """Rows of a :class:`SpanColumns` sent as one request; sliced into halves when a collector
    finds it too large (it is a sequence of row positions)."""

    def __init__(self, table: SpanColumns, rows: np.ndarray) -> None:
        self.table = table
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> EncodedBatch: ...

    def __getitem__(self, index: int | slice) -> int | EncodedBatch:
        if isinstance(index, slice):
            return EncodedBatch(self.table, self.rows[index])
        return int(self.rows[index])

    def __iter__(self) -> Iterator[int]:
        return iter(self.rows.tolist())

    def payload(self) -> bytes:
        """The request's bytes."""
        return self.table.request(self.rows)


__all__ = ["PROTOBUF", "SpanColumns", "EncodedBatch", "available", "resource_and_scope", "varint", "field"]
