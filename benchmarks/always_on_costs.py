"""Where an always-on session's CPU goes, per request: the request's own thread, and the helper
that interprets the windows.

One process per configuration (``--sample`` 0, 0.01 and every step recorded, ``full``) serves
``--requests`` requests of the example service's transformer (and ``none``: no xsp, the twin's
own difference, which the others' are read against) (examples/service/serve.py), each
inside an OpenTelemetry span, on one thread, with one torch thread:

* *request thread*: each traced request is paired with a call of an untraced twin of the model
  (a deep copy whose modules call the original ``nn.Module.__call__``, so xsp never sees it),
  in alternating order; the median of the pairs' differences in the thread's CPU time is what
  xsp adds to a request where it runs (the pairs cancel the machine's drift, which moves single
  runs by 20% and more here).
* *window helper*: the CPU time of interpreting the windows that closed while the requests ran
  (the spans built, the file's segments written), per record they held (a request not sampled
  is one record), as the session does it: in a forked helper process, whose CPU (the fork, its
  copy-on-write faults and its exit included) is read from the children's resource usage once
  it is reaped, plus the window thread's own (the fork, the result read back). Interpreted on a
  thread of this process instead, the same work measured 2x more, its time slices interleaved
  with the requests' under the GIL. An always-on window closes after 60 s or 50,000 records, so
  the default run closes two whatever the machine's speed.

Prints a table and records it in benchmarks/results/always_on_costs.md.

Usage: python benchmarks/always_on_costs.py [--requests 110000]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "always_on_costs.md"
SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"
CONFIGS = ("none", "0", "0.01", "full")

CHILD = """
import copy, json, resource, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[3])
import torch
from opentelemetry.sdk.trace import TracerProvider
from serve import TinyTransformer
import xsp
import xsp.session.windows as windows

config, requests = sys.argv[1], int(sys.argv[2])
helper_s, helper_records = [], []
forked = windows.run_forked
def children_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
def counted(function, deadline_s, *rest):
    began, before = time.thread_time(), children_s()
    try:
        return forked(function, deadline_s, *rest)
    finally:  # the helper is reaped before run_forked returns
        helper_s.append(time.thread_time() - began + children_s() - before)
        helper_records.append(next(arg.records for arg in function.args if hasattr(arg, "records")))  # the window
windows.run_forked = counted
torch.set_num_threads(1)
tracer = TracerProvider().get_tracer("service")
model = TinyTransformer().eval()
twin = copy.deepcopy(model)
for module in twin.modules():
    module.__class__ = type(type(module).__name__, (type(module),), {"__call__": torch.nn.Module.__call__})
tokens = torch.randint(0, 1000, (1, 32))
options = {} if config in ("full", "none") else {"sample": float(config)}
traced, plain = [], []
spans = 0
with tempfile.TemporaryDirectory() as folder, torch.no_grad():
    for _ in range(100):
        model(tokens)
    import contextlib
    session = (contextlib.nullcontext() if config == "none"
               else xsp.trace(levels="model,layer", output=folder + "/run.xsp.parquet", **options))
    with session:
        for request in range(requests):
            pairs = ((model, traced), (twin, plain)) if request % 2 else ((twin, plain), (model, traced))
            for called, times in pairs:
                began = time.thread_time_ns()
                with tracer.start_as_current_span("POST /predict"):
                    called(tokens)
                times.append(time.thread_time_ns() - began)
    if config != "none":
        import pyarrow.parquet as pq
        spans = pq.read_metadata(folder + "/run.xsp.parquet").num_rows
differences = [a - b for a, b in zip(traced, plain)]
print(json.dumps({"plain_us": statistics.median(plain) / 1e3, "added_us": statistics.median(differences) / 1e3,
                  "helper_us": 1e6 * sum(helper_s) / sum(helper_records) if helper_s else None,
                  "windows": len(helper_s), "window_records": sum(helper_records) / max(len(helper_s), 1),
                  "spans_per_request": spans / requests}))
"""


def run_child(config: str, requests: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, config, str(requests), str(SERVICE)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def helper_cell(found: dict[str, float]) -> str:
    return "-" if found["helper_us"] is None else f"{found['helper_us']:.1f}"


def per_request_cell(found: dict[str, float]) -> str:
    return "-" if found["helper_us"] is None else f"{found['helper_us'] * found['spans_per_request']:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=110_000)
    args = parser.parse_args(argv)
    rows = []
    for config in CONFIGS:
        found = run_child(config, args.requests)
        rows.append((config, found))
        print(f"{config}: +{found['added_us']:.1f} us on the request's thread, {helper_cell(found)} us helper",
              file=sys.stderr, flush=True)
    from xsp.core.metadata import cpu_model

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Always on: where the CPU goes, per request",
        "",
        f"Last run: {stamp}, {cpu_model()}, Python {platform.python_version()}; "
        f"`python benchmarks/always_on_costs.py --requests {args.requests}`.",
        "",
        "The example service's transformer, one request at a time inside an OpenTelemetry span, "
        "levels model and layer. *Request thread*: median over pairs of (traced request - untraced "
        "twin's request), in thread CPU time. *Window helper*: CPU of interpreting the windows that closed "
        "while the requests ran, per record they held (a request not sampled is one), in the forked helper "
        "that interprets them (its fork, copy-on-write faults and exit included), and per request (times the "
        "file's spans a request, about its records a request); `-` where no window closed (an always-on window "
        "closes after 60 s or 50,000 records: run more requests). *Added*: the pair difference less the same "
        "difference without xsp (`none`: the model against its twin alone).",
        "",
        "| sample | untraced request (µs) | pair difference (µs) | added on the request's thread (µs) "
        "| window helper (µs a record) | spans a request | window helper (µs a request) | windows | records a window |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(f"| {config} | {found['plain_us']:.0f} | {found['added_us']:+.1f} | "
          f"{found['added_us'] - rows[0][1]['added_us']:+.1f} | {helper_cell(found)} | "
          f"{found['spans_per_request']:.1f} | {per_request_cell(found)} | {found['windows']:.0f} | "
          f"{found['window_records']:,.0f} |" for config, found in rows),
    ]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
