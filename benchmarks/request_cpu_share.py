"""Where an always-on request's CPU time goes: xsp's share of the example service's CPU, sampled.

benchmarks/request_instructions.py counts what an always-on session adds to a request in
instructions (+0.25-0.31% of one). Instructions are not time: a cache or page the session
disturbs costs the program's own code time without an instruction of xsp's. This samples time
instead, where the program spends it, in the same requests (the example service's ASGI app, as
uvicorn calls it, in one root task, no socket; see request_instructions.py):

* *compiled*: Linux ``perf`` samples the process's CPU clock at 4 kHz while it serves
  ``--requests`` requests inside a live ``xsp.trace(levels=("model", "layer"), sample=0.01)``
  (its first 500 not sampled: the model's first call, the thread's buffer), in ``--runs``
  processes; the table gives the share of samples in xsp's compiled modules (its record path,
  where every module call and step goes through) and in the kernel (page faults, wake-ups).
* *Python*: every bytecode the process runs for ``--traced`` requests is counted
  (``sys.settrace`` with opcode events, on every thread), plainly and inside the session; the
  table gives the bytecodes a request, and those of xsp's own functions.

What neither sees: CPython's own work on xsp's behalf (a tuple made for a record) is counted as
CPython's in *compiled*; *Python* counts bytecodes, not their cost. request_instructions.py
counts both in instructions.

Prints a table and records it in benchmarks/results/request_cpu_share.md.

Usage: python benchmarks/request_cpu_share.py [--requests 8000] [--runs 3] [--traced 200]
[--places app-def app-async] (needs Linux ``perf`` and the right to sample one's own processes;
about two minutes).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, Final

from _results import record
from request_instructions import SERVICE, app_requests

RESULTS = Path(__file__).resolve().parent / "results" / "request_cpu_share.md"
PLACES: Final = {"app def": "/predict", "app async": "/predict_async"}
SAMPLE: Final = 0.01
WARM_REQUESTS: Final = 500
SAMPLING_HZ: Final = 4000
TOKENS: Final = list(range(32))


def _app(path: str) -> Any:
    import torch

    sys.path.insert(0, str(SERVICE))
    from serve import TinyTransformer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    return app_requests(TinyTransformer().eval(), path, TOKENS)


def _session() -> None:
    import xsp

    xsp.trace(output=None, levels=("model", "layer"), sample=SAMPLE).__enter__()


def sampled_child(path: str, requests: int) -> None:
    """Serve inside a session: warm, say ``ready``, wait for ``go`` (perf attached), serve the
    measured requests and print their CPU time a request (µs)."""
    run = _app(path)
    _session()
    run(WARM_REQUESTS)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.process_time_ns()
    run(requests)
    print(f"{(time.process_time_ns() - start) / requests / 1e3:.1f}", flush=True)
    os._exit(0)  # the session's end (its trace) is not a request's


def traced_child(path: str, traced: bool, requests: int, out: Path) -> None:
    """Count every bytecode of ``requests`` requests, on every thread, by function."""
    run = _app(path)
    if traced:
        _session()
    opcodes: collections.Counter[tuple[str, str]] = collections.Counter()
    counting = [False]

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode" and counting[0]:
            opcodes[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        return tracer

    threading.settrace(tracer)  # anyio's worker thread starts at the first request, after this
    sys.settrace(tracer)
    run(WARM_REQUESTS // 10)
    counting[0] = True
    run(requests)
    counting[0] = False
    sys.settrace(None)
    threading.settrace(None)
    out.write_text("\n".join(f"{count}\t{name}\t{file}" for (file, name), count in opcodes.items()))
    os._exit(0)


@functools.cache
def xsp_root() -> Path:
    """xsp's package folder (its ``tracers`` lie beside it, as ``xsp.tracers`` maps them)."""
    import xsp

    return Path(xsp.__file__).resolve().parent


@functools.cache
def xsp_modules() -> frozenset[str]:
    """The file names of xsp's compiled modules (as perf names their DSOs)."""
    return frozenset(path.name for path in xsp_root().rglob("*.so"))


def dso_shares(data: Path) -> dict[str, float]:
    report = subprocess.run(["perf", "report", "-i", str(data), "--sort", "dso", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].endswith("%"):
            shares[parts[1]] = float(parts[0].rstrip("%"))
    return shares


def sampled(path: str, requests: int, folder: Path, index: int) -> tuple[float, float, float]:
    """(CPU µs a request, xsp's compiled share %, kernel share %) of one process."""
    child = subprocess.Popen([sys.executable, __file__, "--sampled-child", path, str(requests)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise SystemExit(f"request_cpu_share: the service process for {path} did not start")
    data = folder / f"{path.strip('/')}.{index}.data"
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(SAMPLING_HZ), "-o", str(data),
                             "-p", str(child.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # perf attaches to every thread before the first measured request
    child.stdin.write("go\n")
    child.stdin.flush()
    cpu_us = float(child.stdout.readline())
    child.wait()
    _, error = perf.communicate(timeout=60)
    if not data.exists():
        raise SystemExit(f"request_cpu_share: perf recorded nothing: {error.decode().strip()}")
    shares = dso_shares(data)
    ours = xsp_modules()
    return (cpu_us, sum(share for dso, share in shares.items() if dso in ours),
            sum(share for dso, share in shares.items() if dso.startswith("[kernel")))


def bytecodes(path: str, traced: bool, requests: int, folder: Path) -> collections.Counter[tuple[str, str]]:
    out = folder / f"{path.strip('/')}.{int(traced)}.opcodes"
    subprocess.run([sys.executable, __file__, "--traced-child", path, str(int(traced)), str(requests), str(out)],
                   check=True)
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in out.read_text().splitlines():
        count, name, file = line.split("\t", 2)
        counts[(file, name)] += int(count)
    return counts


def is_xsps(file: str) -> bool:
    return file.startswith((str(xsp_root()), str(xsp_root().parent / "tracers")))


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--sampled-child"]:
        sampled_child(arguments[1], int(arguments[2]))
        return 0
    if arguments[:1] == ["--traced-child"]:
        traced_child(arguments[1], arguments[2] == "1", int(arguments[3]), Path(arguments[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8000, help="sampled requests per process")
    parser.add_argument("--runs", type=int, default=3, help="sampled processes per place")
    parser.add_argument("--traced", type=int, default=200, help="requests whose bytecodes are counted")
    parser.add_argument("--places", nargs="+", choices=[place.replace(" ", "-") for place in PLACES],
                        default=[place.replace(" ", "-") for place in PLACES], help="which requests to measure")
    options = parser.parse_args(arguments)
    if shutil.which("perf") is None:
        print("request_cpu_share: needs Linux perf (linux-tools)", file=sys.stderr)
        return 2
    places = [place.replace("-", " ") for place in options.places]
    began = time.monotonic()
    samples: dict[str, list[tuple[float, float, float]]] = {}
    codes: dict[str, tuple[int, int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="xsp-request-cpu-share-") as folder:
        for place in places:
            path = PLACES[place]
            samples[place] = [sampled(path, options.requests, Path(folder), index) for index in range(options.runs)]
            plain, traced = (bytecodes(path, flag, options.traced, Path(folder)) for flag in (False, True))
            ours = sum(count for (file, _), count in traced.items() if is_xsps(file))
            codes[place] = (sum(plain.values()), sum(traced.values()), ours)
    import torch

    from xsp.core.metadata import cpu_model

    chosen = "" if len(places) == len(PLACES) else " --places " + " ".join(options.places)
    requests = options.traced
    lines = [
        "# Where an always-on request's CPU time goes", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, torch {torch.__version__}, Python "
        f"{platform.python_version()}; `python benchmarks/request_cpu_share.py --requests {options.requests} "
        f"--runs {options.runs} --traced {options.traced}{chosen}` ({time.monotonic() - began:.0f} s).", "",
        "Requests of the example service's transformer (32 tokens, one torch thread) through its ASGI app as uvicorn "
        "calls it (*app def*: the `def` handler, on anyio's worker thread; *app async*: the `async def` one), one "
        "after another, no socket, inside `xsp.trace(levels=(\"model\", \"layer\"), sample="
        f"{SAMPLE})`. *Compiled*: `perf` sampled each process's CPU clock at {SAMPLING_HZ:,} Hz over "
        f"{options.requests:,} requests (after {WARM_REQUESTS}); *xsp* is the share of samples in xsp's compiled "
        "modules, *kernel* the kernel's. CPython's work on xsp's behalf is CPython's here "
        "(benchmarks/request_instructions.py counts it).", "",
        "| place | process | CPU µs a request | xsp | kernel |", "| --- | ---: | ---: | ---: | ---: |"]
    for place in places:
        for index, (cpu_us, compiled_share, kernel_share) in enumerate(samples[place]):
            lines.append(f"| {place} | {index} | {cpu_us:,.1f} | {compiled_share:.2f}% | {kernel_share:.2f}% |")
        lines.append(f"| {place} | median | {statistics.median(s[0] for s in samples[place]):,.1f} | "
                     f"{statistics.median(s[1] for s in samples[place]):.2f}% | "
                     f"{statistics.median(s[2] for s in samples[place]):.2f}% |")
    lines += ["", f"*Python*: the bytecodes of {requests} requests, on every thread, counted by `sys.settrace` (a "
              "request's share), plainly and inside the session, and those of xsp's own functions.", "",
              "| place | bytecodes a request, plain | always on | difference | xsp's own |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for place in places:
        plain_codes, traced_codes, own_codes = codes[place]
        lines.append(f"| {place} | {plain_codes / requests:,.0f} | {traced_codes / requests:,.0f} | "
                     f"{(traced_codes - plain_codes) / requests:+,.1f} "
                     f"({(traced_codes - plain_codes) / plain_codes:+.3%}) | {own_codes / requests:,.1f} |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
