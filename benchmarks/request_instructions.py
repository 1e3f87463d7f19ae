"""What an always-on session adds to one request of the example service, in instructions.

benchmarks/steps_in_process.py --whole times the example service with and without a live
``xsp.trace(levels=("model", "layer"), sample=0.01)`` in one process: the median request moves
by 0.1-1.6% from run to run, intervals of about ±0.5% each, and the CPU time a request by 10-20
µs. Timings cannot say what part of that is work xsp does and what part is the machine (caches,
the other processes of a 2-core box). Instructions can: this counts, under valgrind's callgrind,
the instructions of requests of the example service's transformer (examples/service/serve.py),
each inside an OpenTelemetry span (the SDK's, sampled, sent nowhere) as FastAPI's instrumentation
makes one, plainly and inside the session, where the service runs them:

* *thread*: on a thread of their own, one after another (a ``def`` handler in FastAPI's pool);
* *async*: each an asyncio task on an event loop (an ``async def`` handler);
* *app def* and *app async*: the whole request through the example service's ASGI app, called
  as uvicorn calls it (FastAPI's routing and JSON, OpenTelemetry's middleware, and for the
  ``def`` handler anyio's hop to its worker thread), one root task serving them one after
  another as uvicorn's does (anyio keeps its worker thread then); no socket.

Each loop runs in ``--layouts`` memory layouts (see benchmarks/workload_instructions.py: which
type-attribute lookups collide in CPython's cache changes with the layout, by thousands of
instructions a request, with xsp and without); the table gives each layout's counts and the
median of xsp's part over them. The session's window interpretation (a helper process, once a
window) is not in these counts: benchmarks/always_on_costs.py measures it.

Prints a table and records it in benchmarks/results/request_instructions.md.

Usage: python benchmarks/request_instructions.py [--requests 100] [--layouts 2] [--jobs 2]
[--places thread async app-def app-async] (needs valgrind; about fifteen minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "request_instructions.md"
SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"
PLACES: Final = ("thread", "async", "app def", "app async")
APP_PATHS: Final = {"app def": "/predict", "app async": "/predict_async"}
SAMPLE: Final = 0.01
WARM_REQUESTS: Final = 30
"""Requests before the counted ones: the model's first call (its naming), the thread's buffer."""


def child(place: str, traced: bool, requests: int) -> None:
    """Inside callgrind: the service's model and tracer, warmed up, then ``requests`` counted."""
    import torch

    sys.path.insert(0, str(SERVICE))
    from serve import TinyTransformer, tracer_provider
    from workload_instructions import instrument_from_here, run_measured

    torch.set_num_threads(1)
    model = TinyTransformer().eval()
    tracer = tracer_provider().get_tracer("service")
    tokens = list(range(32))

    def classify() -> int:
        with torch.inference_mode():
            return int(model(torch.tensor([tokens], dtype=torch.long)).argmax())

    def request() -> None:
        with tracer.start_as_current_span("POST /predict"):
            classify()

    async def request_task() -> None:
        with tracer.start_as_current_span("POST /predict_async"):
            classify()

    if traced:
        import xsp

        xsp.trace(output=None, levels=("model", "layer"), sample=SAMPLE).__enter__()  # ends with the process
    run: Callable[[int], None]
    if place in APP_PATHS:
        run = app_requests(model, APP_PATHS[place], tokens)
    elif place == "async":
        loop = asyncio.new_event_loop()

        def run(count: int) -> None:
            for _ in range(count):
                loop.run_until_complete(loop.create_task(request_task()))
    else:
        def run(count: int) -> None:
            for _ in range(count):
                request()

    def measured() -> None:
        run(WARM_REQUESTS)
        instrument_from_here()
        run_measured(run, requests)

    if place != "thread":  # the event loop's thread: the main one
        measured()
    else:
        worker = threading.Thread(target=measured, name="AnyIO worker thread")
        worker.start()
        worker.join()
    os._exit(0)  # the session's end (its trace) is not a request's


def app_requests(model: Any, path: str, tokens: list[int]) -> Callable[[int], None]:
    """``run(count)``: ``count`` POSTs of ``tokens`` to ``path`` of the example service's ASGI
    app, one after another in one root task (as uvicorn's connection task serves a keep-alive
    client: anyio's worker thread for a ``def`` handler lives as long as it)."""
    from serve import build_app, tracer_provider

    app = build_app(model, tracer_provider(), {})
    body = json.dumps(tokens).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000)}

    async def one() -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client keeps the connection: no disconnect
            return {"type": "http.disconnect"}

        status: list[int] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])

        await app(dict(scope), receive, send)
        if status != [200]:
            raise RuntimeError(f"{path} answered {status}")

    async def many(count: int) -> None:
        for _ in range(count):
            await one()

    loop = asyncio.new_event_loop()

    def run(count: int) -> None:
        loop.run_until_complete(many(count))

    return run


def counted(place: str, traced: bool, layout: int, requests: int, folder: Path) -> int:
    from workload_instructions import counted_under_callgrind

    prefix = folder / f"{place.replace(' ', '_')}.{int(traced)}.{layout}.cg"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("XSP_")}
    return counted_under_callgrind(prefix, Path(__file__).resolve(), [place, str(int(traced)), str(requests)],
                                   layout, environment, requests)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--child"]:
        child(arguments[1], arguments[2] == "1", int(arguments[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="counted requests per loop")
    parser.add_argument("--layouts", type=int, default=2, help="memory layouts per loop")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind runs at once")
    parser.add_argument("--places", nargs="+", choices=[place.replace(" ", "-") for place in PLACES],
                        default=[place.replace(" ", "-") for place in PLACES], help="which requests to count")
    options = parser.parse_args(arguments)
    places = [place.replace("-", " ") for place in options.places]
    began = time.monotonic()
    jobs = [(place, traced, layout)
            for layout in range(options.layouts) for place in places for traced in (False, True)]
    with tempfile.TemporaryDirectory(prefix="xsp-request-instructions-") as folder, \
            ThreadPoolExecutor(options.jobs) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: counted(*job, options.requests, Path(folder)), jobs)))
    import torch

    from xsp.core.metadata import cpu_model

    chosen = "" if len(places) == len(PLACES) else " --places " + " ".join(options.places)

    lines = [
        "# What an always-on session adds to a request, in instructions", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, torch {torch.__version__}, Python "
        f"{platform.python_version()}; `python benchmarks/request_instructions.py --requests {options.requests} "
        f"--layouts {options.layouts}{chosen}` ({time.monotonic() - began:.0f} s).", "",
        "Instructions a request of the example service's transformer (32 tokens, one torch thread) inside an "
        "OpenTelemetry span, counted by callgrind, plain and inside `xsp.trace(levels=(\"model\", \"layer\"), "
        f"sample={SAMPLE})`: *thread*, one request after another on a thread of their own (a `def` handler); "
        "*async*, each an asyncio task on the event loop (an `async def` handler); *app def* and *app async*, the "
        "whole request through the service's ASGI app as uvicorn calls it (FastAPI's routing and JSON, "
        "OpenTelemetry's middleware, anyio's hop to its worker thread for the `def` handler), in one root task, no "
        "socket. Each layout is a memory layout "
        "(benchmarks/workload_instructions.py); *xsp's part* is the median over layouts of xsp's count less "
        "plain's, and its share of plain's. The window's interpretation (a helper process) is not counted here "
        "(benchmarks/always_on_costs.py).", "",
        "| place | layout | plain | always on | difference |", "| --- | ---: | ---: | ---: | ---: |"]
    for place in places:
        for layout in range(options.layouts):
            plain, traced = counts[(place, False, layout)], counts[(place, True, layout)]
            lines.append(f"| {place} | {layout} | {plain:,} | {traced:,} | {traced - plain:+,} |")
    lines += ["", "| place | xsp's part (median over layouts) | of a request |", "| --- | ---: | ---: |"]
    for place in places:
        parts = [counts[(place, True, layout)] - counts[(place, False, layout)] for layout in range(options.layouts)]
        plain = statistics.median(counts[(place, False, layout)] for layout in range(options.layouts))
        part = statistics.median(parts)
        lines.append(f"| {place} | {part:+,.0f} | {part / plain:+.3%} |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
