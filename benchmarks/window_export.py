"""What exporting an always-on session's windows over OTLP costs the process it runs in.

Each window's spans are interpreted by a forked helper process, which (since this benchmark was
written) also makes them ready to send: the span budget applied, the columns encoded for xsp's
protobuf encoder. The session's window thread then only posts the batches. Before, a session
that exported interpreted and encoded every window on its own thread, holding the GIL beside the
program's threads; that is still the way with ``XSP_HELPER_PROCESS=0``, or after a helper failed.

One process per variant and round runs the example service's transformer (examples/service/
serve.py) in a loop on one thread (one torch thread, a 0.2 ms sleep between calls, as between
requests) for ``--seconds``, inside ``xsp.trace(levels=("model", "layer"), sample=0.01,
window_s=3)``:

* *file*: the trace file only;
* *otlp*: also exported over OTLP/HTTP to a loopback receiver in its own process, which counts
  what it gets;
* *otlp, in thread*: the same with ``XSP_HELPER_PROCESS=0``: interpreted and made ready on the
  window thread.

Reported per variant (its rounds pooled): the model calls, their p50, p99 and p99.9 latency, how
many took over 2 ms and the longest; the CPU time of the session's window thread per 1,000 steps
(what the program's threads compete with for the GIL); the windows, and how many of them helper
processes interpreted; the trace files' spans, and the spans the export sent and failed.
The rounds interleave the variants, so that the machine's drift falls on all alike.

Prints a table and records it in benchmarks/results/window_export.md.

Usage: python benchmarks/window_export.py [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _results import record
from production import CLOCK_TICKS_PER_S, read_stat

RESULTS = Path(__file__).resolve().parent / "results" / "window_export.md"
SERVICE = Path(__file__).resolve().parents[1] / "examples" / "service"
VARIANTS = {"file": {}, "otlp": {}, "otlp, in thread": {"XSP_HELPER_PROCESS": "0"}}
WINDOW_S = 3.0
PAUSE_S = 2e-4
SLOW_NS = 2_000_000
WINDOW_THREAD = "xsp-windows"


def thread_ticks(name: str) -> int:
    """CPU clock ticks of this process's threads called ``name``."""
    ticks = 0
    for task in os.scandir("/proc/self/task"):
        stat = read_stat(task.path)
        if stat is not None and stat[0] == name:
            ticks += int(stat[1][11]) + int(stat[1][12])
    return ticks


def child(variant: str, seconds: float, endpoint: str | None, folder: Path) -> dict[str, Any]:
    """One variant's process: the loop under xsp, measured."""
    import torch

    sys.path.insert(0, str(SERVICE))
    from serve import TinyTransformer

    import xsp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    tokens = torch.randint(0, 1000, (1, 32))
    session = xsp.trace(output=folder / f"{variant.replace(', ', '-').replace(' ', '-')}-{os.getpid()}.xsp.parquet",
                        levels=("model", "layer"), sample=0.01, window_s=WINDOW_S, otlp_endpoint=endpoint,
                        otlp_protocol="http/protobuf" if endpoint else None)
    latencies: list[int] = []
    clock = time.perf_counter_ns
    with session:
        time.sleep(3.0)  # xsp's imports on its window thread are done
        with torch.inference_mode():
            for _ in range(200):
                model(tokens)
            ticks_before = thread_ticks(WINDOW_THREAD)
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                began = clock()
                model(tokens)
                latencies.append(clock() - began)
                time.sleep(PAUSE_S)
            ticks = thread_ticks(WINDOW_THREAD) - ticks_before
    report = session.wait_for_export(30) if endpoint else None
    return {"latency_ns": latencies, "window_thread_s": ticks / CLOCK_TICKS_PER_S,
            "exported": None if report is None else report.exported,
            "failed": None if report is None else report.failed, "file_spans": len(session.trace.spans),
            "helper_windows": session.trace.metadata["helper_windows"], "windows": session.trace.metadata["windows"]}


def percentile_ms(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1e6


def run_variant(variant: str, seconds: float, endpoint: str, folder: Path) -> dict[str, Any]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("XSP_", "OTEL_"))}
    environment.update(VARIANTS[variant])
    done = subprocess.run([sys.executable, __file__, "--child", variant, "--seconds", str(seconds),
                           "--endpoint", endpoint if variant != "file" else "", "--folder", str(folder)],
                          env=environment, capture_output=True, text=True, timeout=seconds + 300)
    if done.returncode != 0:
        raise SystemExit(f"{variant}: exit code {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [f"{'variant':<16} {'steps':>7} {'p50 ms':>6} {'p99 ms':>6} {'p99.9 ms':>8} {'>2 ms':>5} {'max ms':>6} "
             f"{'window thr ms/1k steps':>22} {'windows':>7} {'helpers':>7} {'file spans':>10} {'sent':>7} "
             f"{'failed':>6}"]
    for variant, runs in results.items():
        latencies = [value for run in runs for value in run["latency_ns"]]
        thread_ms = sum(run["window_thread_s"] for run in runs) * 1e3
        sent = "-" if runs[0]["exported"] is None else f"{sum(run['exported'] for run in runs):,}"
        failed = "-" if runs[0]["failed"] is None else f"{sum(run['failed'] for run in runs):,}"
        lines.append(f"{variant:<16} {len(latencies):>7,} {percentile_ms(latencies, 0.5):>6.2f} "
                     f"{percentile_ms(latencies, 0.99):>6.2f} {percentile_ms(latencies, 0.999):>8.2f} "
                     f"{sum(value > SLOW_NS for value in latencies):>5} {max(latencies) / 1e6:>6.1f} "
                     f"{thread_ms * 1000 / len(latencies):>22.1f} {sum(run['windows'] for run in runs):>7} "
                     f"{sum(run['helper_windows'] for run in runs):>7} {sum(run['file_spans'] for run in runs):>10,} "
                     f"{sent:>7} {failed:>6}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="the loop's time per variant and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.seconds, args.endpoint or None, Path(args.folder))))
        return 0
    import torch
    from long_serving import Received, collector

    from xsp.core.metadata import cpu_model

    began = time.monotonic()
    received = Received()
    receiver = collector(received)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}"
    results: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="xsp-window-export-") as folder:
        for round_number in range(args.rounds):
            order = list(VARIANTS)[round_number % len(VARIANTS):] + list(VARIANTS)[:round_number % len(VARIANTS)]
            for variant in order:
                results[variant].append(run_variant(variant, args.seconds, endpoint, Path(folder)))
                print(f"round {round_number + 1}/{args.rounds} {variant}", file=sys.stderr)
    receiver.shutdown()
    command = " ".join(["python", "benchmarks/window_export.py", *(argv if argv is not None else sys.argv[1:])])
    record([
        "# Exporting an always-on session's windows over OTLP: what the program's process pays", "",
        f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, Python {platform.python_version()}; `{command}` "
        f"({time.monotonic() - began:.0f} s).", "",
        f"The example service's transformer called in a loop on one thread ({PAUSE_S * 1e3:g} ms between calls) "
        f"inside `xsp.trace(levels=('model', 'layer'), sample=0.01, window_s={WINDOW_S:g})`, {args.seconds:g} s a "
        f"round, {args.rounds} interleaved rounds per variant. *file*: the trace file only; *otlp*: also sent over "
        "OTLP/HTTP to a loopback receiver (its own process), the windows made ready to send by the helper processes "
        "that interpret them; *otlp, in thread*: the same with `XSP_HELPER_PROCESS=0`, interpreted and made ready on "
        "the session's window thread (the way every exporting session worked before). *window thr*: the CPU time of "
        "the session's window thread, which the loop's thread competes with for the GIL. *windows*: the windows "
        "written; *helpers*: those a helper process interpreted; *file spans*: the trace files' spans; *sent*, "
        "*failed*: the export's count of them.", "",
        "```", *table(results), "```"], RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
