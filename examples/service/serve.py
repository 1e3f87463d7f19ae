"""A small inference service, as users deploy one: FastAPI served by uvicorn, traced with
OpenTelemetry, optionally with the whole server inside ``with xsp.trace(...)``.

The model is a small transformer built in code with random weights (an embedding, a
2-layer ``nn.TransformerEncoder`` with d_model=128 and 4 heads, a linear head), on CPU with
one torch thread. Endpoints:

* ``POST /predict``: a plain ``def`` handler (FastAPI runs it in its thread pool);
* ``POST /predict_async``: an ``async def`` handler (runs on the event loop);
* ``GET /health``: readiness, with the mode and the xsp options in effect.

Both predict endpoints take a JSON list of token ids (about 32) and answer ``{"label": int}``.
Spans of the requests go to the OTLP HTTP endpoint in ``OTEL_EXPORTER_OTLP_ENDPOINT`` when it is
set, else to an exporter that drops them. SIGTERM and SIGINT shut the server down gracefully
(uvicorn's own handling); the xsp block then ends and writes its file.

Environment: ``XSP_BENCH_MODE`` (``plain``: xsp is never imported; ``xsp``), ``XSP_BENCH_SAMPLE``
(xsp's ``sample`` fraction: always on), ``XSP_BENCH_OUTPUT`` (the trace file; default a file in the
temporary folder), ``XSP_BENCH_PORT``. With ``xsp``, xsp's own options come from its variables too
(``OTEL_EXPORTER_OTLP_ENDPOINT``: the requests' traces get the model's spans).

Usage: XSP_BENCH_MODE=xsp python examples/service/serve.py [PORT]
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from opentelemetry import trace as otel_trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from torch import nn

HOST = "127.0.0.1"
DEFAULT_PORT = 8000
SERVICE_NAME = "xsp-bench-service"
MODE_ENV, SAMPLE_ENV, OUTPUT_ENV, PORT_ENV = "XSP_BENCH_MODE", "XSP_BENCH_SAMPLE", "XSP_BENCH_OUTPUT", "XSP_BENCH_PORT"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
MODE_PLAIN, MODE_XSP = "plain", "xsp"
XSP_LEVELS = ("model", "layer")
SAMPLE_OPTION = "sample"

VOCABULARY, D_MODEL, HEADS, LAYERS, CLASSES = 1000, 128, 4, 2, 10
SEQUENCE_LENGTH = 32
"""Token ids per request the load generator sends (any length is served)."""


class TinyTransformer(nn.Module):
    """Embedding, transformer encoder, mean over the sequence, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(token_ids)).mean(dim=1))


class DroppingExporter(SpanExporter):
    """Accepts every span and sends it nowhere (no collector configured)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def tracer_provider() -> TracerProvider:
    """The service's OpenTelemetry provider: OTLP over HTTP where an endpoint is set."""
    exporter: SpanExporter
    if os.environ.get(OTLP_ENDPOINT_ENV):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # reads the endpoint (and /v1/traces) from the environment
    else:
        exporter = DroppingExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def build_app(model: nn.Module, provider: TracerProvider, health: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    def classify(tokens: list[int]) -> dict[str, int]:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens], dtype=torch.long))
        return {"label": int(logits.argmax())}

    @app.post("/predict")
    def predict(tokens: list[int]) -> dict[str, int]:
        return classify(tokens)

    @app.post("/predict_async")
    async def predict_async(tokens: list[int]) -> dict[str, int]:
        return classify(tokens)

    @app.get("/health")
    async def health_check() -> dict[str, Any]:
        return health

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider)
    return app


def xsp_options() -> dict[str, Any]:
    """The keyword arguments of ``xsp.trace`` for this run: the one place they are decided."""
    output = os.environ.get(OUTPUT_ENV) or os.path.join(tempfile.gettempdir(), f"serve-{os.getpid()}.xsp.parquet")
    options: dict[str, Any] = {"levels": XSP_LEVELS, "output": output}
    sample = os.environ.get(SAMPLE_ENV)
    if sample:
        options[SAMPLE_OPTION] = float(sample)
    return options


def xsp_session(options: dict[str, Any]) -> AbstractContextManager[Any]:
    """The whole server inside ``xsp.trace(**options)``: every request is a step."""
    import xsp

    return xsp.trace(**options)


def exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """After uvicorn's graceful shutdown it raises the signal again: end by unwinding (the xsp
    block writes its file, the span processor flushes) instead of dying on the spot."""
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    port = int(args[0]) if args else int(os.environ.get(PORT_ENV, DEFAULT_PORT))
    mode = os.environ.get(MODE_ENV, MODE_PLAIN)
    if mode not in (MODE_PLAIN, MODE_XSP):
        raise SystemExit(f"{MODE_ENV} must be {MODE_PLAIN} or {MODE_XSP}, not {mode!r}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, exit_on_signal)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    provider = tracer_provider()
    otel_trace.set_tracer_provider(provider)
    options = xsp_options() if mode == MODE_XSP else {}
    session = xsp_session(options) if mode == MODE_XSP else nullcontext()
    health = {"status": "ok", "mode": mode, "pid": os.getpid(), "xsp_options": options}
    app = build_app(model, provider, health)
    try:
        with session:
            uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False)
    finally:
        provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
