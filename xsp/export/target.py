"""Where an OTLP export goes (endpoint and protocol, from arguments or the ``OTEL_*`` variables),
whether it can be reached, and how many spans one trace may send: without OpenTelemetry's SDK
or pandas, which only an export imports."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final
from urllib.parse import ParseResult, urlparse

PROBE_TIMEOUT_S = 1.0
DEFAULT_SPAN_BUDGET: Final = 2000
"""Spans per exported trace (Jaeger's UI stays quick below about 2,000)."""
SPAN_BUDGET_ENV: Final = "XSP_SPAN_BUDGET"


class Protocol(str, Enum):
    GRPC = "grpc"
    HTTP = "http/protobuf"

    @classmethod
    def parse(cls, text: str) -> Protocol:
        value = text.strip().lower()
        if value in ("http", "http/protobuf"):
            return cls.HTTP
        if value == "grpc":
            return cls.GRPC
        raise ValueError(f"unknown OTLP protocol {text!r} (use 'grpc' or 'http/protobuf')")


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how to send spans."""

    endpoint: str
    protocol: Protocol

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = _parsed(self.endpoint)
        default_port = 4317 if self.protocol is Protocol.GRPC else 4318
        return parsed.hostname or "localhost", parsed.port or default_port

    @classmethod
    def resolve(cls, endpoint: str | None = None, protocol: str | None = None,
                environ: Mapping[str, str] = os.environ) -> OtlpTarget | None:
        """The target from arguments, else the OTEL_* variables; None when neither names one."""
        chosen = Protocol.parse(protocol or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        base = False  # the variable for every signal names a base URL: the traces' path is always added
        if endpoint:
            url = endpoint
        elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            url = environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            url, base = environ["OTEL_EXPORTER_OTLP_ENDPOINT"], True
        else:
            return None
        _check_endpoint(url)
        if chosen is Protocol.HTTP and (base or urlparse(url).path in ("", "/")):
            url = url.rstrip("/") + "/v1/traces"
        return cls(url, chosen)


def _parsed(url: str) -> ParseResult:
    """``url`` parsed, read as http:// when it names no scheme (``localhost:4317``)."""
    return urlparse(url if "://" in url else f"http://{url}")


def _check_endpoint(url: str) -> None:
    """Refuse, in one line, an endpoint no connection can be made to: no host, a bad port, a
    broken address (before any span is recorded, not when the first is sent)."""
    try:
        parsed = _parsed(url)
        parsed.port  # noqa: B018 - reading it checks it
    except ValueError as exc:
        raise ValueError(f"the OTLP endpoint {url!r} is not a URL xsp can send to ({exc})") from None
    if not parsed.hostname:
        raise ValueError(f"the OTLP endpoint {url!r} names no host (give one like http://localhost:4317)")


def probe(target: OtlpTarget, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the endpoint opens, else why not."""
    host, port = target.host_port
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port} is unreachable ({exc.strerror or exc})"


def span_budget_from_env(default: int = DEFAULT_SPAN_BUDGET) -> int:
    """``XSP_SPAN_BUDGET`` when set to a whole number (0: no budget), else ``default``."""
    return default if span_budget_env_problem() else int(os.environ.get(SPAN_BUDGET_ENV, "").strip() or default)


def span_budget_env_problem() -> str | None:
    """Why ``XSP_SPAN_BUDGET`` cannot be used, if it is set to something other than a whole number >= 0."""
    text = os.environ.get(SPAN_BUDGET_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        return f"{SPAN_BUDGET_ENV}={text!r} is not a whole number of spans (0: no limit); {DEFAULT_SPAN_BUDGET} is used"
    return None
