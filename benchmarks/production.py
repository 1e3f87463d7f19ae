"""What xsp costs a real inference service, as its users meet it: latency and throughput over HTTP.

Starts the example service (examples/service/serve.py: FastAPI + uvicorn + OpenTelemetry, a
small transformer on CPU) four times, as separate processes: ``plain`` (no xsp), ``plain twin``
(the same again), ``xsp`` (the whole server inside ``xsp.trace(levels=("model", "layer"))``) and
``xsp s=<fraction>`` (the same with ``sample``). The twin runs exactly plain's code: its ratios to
plain are how much two processes of one program differ here (their memory layouts, hash seeds
and caches differ), the spread below which no variant's ratio says anything. Each is warmed
up, then driven over loopback by closed-loop clients (each sends its next request when the
last is answered, on a keep-alive connection) at the ``def`` endpoint
(FastAPI's thread pool) and the ``async def`` one (the event loop). Rounds are interleaved: every
round loads each variant in turn (the order rotated from round to round) while all servers stay up.
Rounds are short and many (40 of 2 s by default): the machine's own drift (other tenants of the host)
then falls alike on the variants of a round, and two processes of one program differ by about 1%
instead of 3% (rounds of 5 s, twelve of them). Before the next variant is loaded, the helper
processes the last one left running are waited for (at most ``SETTLE_S``), so that none of its work
falls in another's round; an always-on server starts a window's work in the first pause of its
steps (xsp/session/pauses.py), so the pause that ends its round is waited for first, and the
round's CPU time counts through the wait. With ``--servers K``, each variant runs as K servers, started in turn
(plain, twin, xsp, xsp s=..., then the second of each, ...): two processes of one program differ by
1-2% (their memory layouts), and two xsp servers by up to 3 points, so a variant's figures pooled
over several servers say more than any one server's.

``--split`` runs, instead of ``xsp`` on every request, three variants that each take one part of
``xsp s=<fraction>``'s cost out: ``no windows`` (the same session, its windows never closing while
the run lasts: ``XSP_WINDOW_S`` past its end), ``no steps`` (the same session with its module-call
wrapper taken out, so that no step is recorded: the session's mere presence,
benchmarks/split_server.py) and ``timer`` (no xsp; every top-level module call timed by a C object
of a few lines, benchmarks/timer_floor.c: the floor of any model-level tracer).

Reported per variant and endpoint: requests, throughput, p50 and p99 latency, the server's CPU
time per request, and p50/p99 as ratios to plain (pooled over the rounds and servers, with a 95%
bootstrap interval over servers and rounds: each variant's servers drawn on their own, each
variant's round with plain's of the same round). The servers
are then stopped with SIGTERM and each xsp trace file is checked. Prints a table and records it
in benchmarks/results/production.md.

Usage: python benchmarks/production.py [--rounds 40] [--seconds 2] [--concurrency 4] [--sample 0.01]
       [--servers 1] [--endpoints sync,async] [--split] [--keep]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from _results import record

from xsp.core.metadata import cpu_model
from xsp.session.pauses import PAUSE_S

RESULTS = Path(__file__).resolve().parent / "results" / "production.md"
SERVER = Path(__file__).resolve().parents[1] / "examples" / "service" / "serve.py"
SPLIT_SERVER = Path(__file__).resolve().parent / "split_server.py"
SPLIT_ENV = "XSP_BENCH_SPLIT"  # read by split_server.py
WINDOW_ENV = "XSP_WINDOW_S"
NO_WINDOWS_S = 1e9
"""``XSP_WINDOW_S`` of the ``no windows`` variant: no window closes while the run lasts."""
HOST = "127.0.0.1"
ENDPOINTS = {"sync": "/predict", "async": "/predict_async"}
HEALTH_PATH = "/health"
MODE_ENV, SAMPLE_ENV, OUTPUT_ENV = "XSP_BENCH_MODE", "XSP_BENCH_SAMPLE", "XSP_BENCH_OUTPUT"  # read by serve.py
SAMPLE_OPTION = "sample"  # of the xsp options serve.py's /health gives: the server runs always on
CLEARED_ENV = ("XSP_SAMPLE", "XSP_WINDOW_S", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
"""The caller's settings that would change what a variant does (xsp's sampling, span export)."""
PLAIN = "plain"
PLAIN_TWIN = "plain twin"
VOCABULARY, SEQUENCE_LENGTH = 1000, 32
STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, REQUEST_TIMEOUT_S = 120.0, 120.0, 30.0
WARMUP_SECONDS = 2.0
SETTLE_S = 5.0
"""After a round of one variant, how long its helper processes still running are waited for."""
PAUSE_NOTICED_S = 2 * PAUSE_S + 0.1
"""After a round of an always-on server, how long until its session has noticed the pause (it
looks every ``PAUSE_S``) and forked the helper of a window taken in the round."""
BOOTSTRAP_DRAWS, BOOTSTRAP_SEED = 400, 0
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
BODY = json.dumps([random.Random(0).randrange(VOCABULARY) for _ in range(SEQUENCE_LENGTH)]).encode()
HEADERS = {"Content-Type": "application/json"}


@dataclass
class Server:
    name: str
    variant: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    trace_file: Path | None
    health: dict[str, Any] = field(default_factory=dict)


@dataclass
class Load:
    """One variant under load for one round: each request's latency, the wall time, the server's CPU."""

    latency_ns: list[int]
    seconds: float
    cpu: Cpu
    server: int = 0
    """Which of its variant's servers it loaded (``--servers``), from 0."""
    round: int = 0


def start_server(name: str, settings: dict[str, str], folder: Path, variant: str | None = None,
                 cpus: set[int] | None = None) -> Server:
    """Start the service with ``settings`` in its environment (split_server.py's where they name a
    split), on ``cpus`` alone where given (every thread and helper process it starts inherits them)."""
    tag = name.replace(" ", "_").replace("=", "").replace("#", "")
    trace_file = folder / f"{tag}.xsp.parquet" if settings[MODE_ENV] != PLAIN else None
    environment = {key: value for key, value in os.environ.items() if key not in CLEARED_ENV}
    environment.update(settings, **{OUTPUT_ENV: str(trace_file or "")})
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = int(probe.getsockname()[1])
    log = folder / f"{tag}.stderr.txt"
    with open(log, "wb") as stderr:  # a session of its own: a Ctrl-C reaches this script alone
        script = SPLIT_SERVER if SPLIT_ENV in settings else SERVER
        process = subprocess.Popen([sys.executable, str(script), str(port)], env=environment,
                                   stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    return Server(name, variant or name, process, port, log, trace_file)


def wait_ready(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while server.process.poll() is None and time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection(HOST, server.port, timeout=REQUEST_TIMEOUT_S)
            connection.request("GET", HEALTH_PATH)
            server.health = json.loads(connection.getresponse().read())
            connection.close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{server.name}: not ready (exit code {server.process.poll()}):\n{tail(server.log)}")


@dataclass(frozen=True)
class Cpu:
    """CPU seconds of a server: all of it (its process, the helpers living in its session and
    those it reaped), of it xsp's threads (named ``xsp-...`` in the OS) and its helper processes."""

    total: float
    xsp_threads: float
    helpers: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.total - other.total, self.xsp_threads - other.xsp_threads, self.helpers - other.helpers)


def cpu_seconds(server: Server) -> Cpu:
    """The server's CPU time so far (:class:`Cpu`)."""
    total = xsp_threads = helpers = 0
    for path, pid, fields in session_processes(server):
        ticks = int(fields[11]) + int(fields[12])
        total += ticks
        if pid == server.process.pid:
            reaped = int(fields[13]) + int(fields[14])
            total += reaped
            helpers += reaped
            xsp_threads += xsp_thread_ticks(path)
        else:
            helpers += ticks
    return Cpu(total / CLOCK_TICKS_PER_S, xsp_threads / CLOCK_TICKS_PER_S, helpers / CLOCK_TICKS_PER_S)


def session_processes(server: Server) -> Iterator[tuple[str, int, list[str]]]:
    """The living processes of ``server``'s session (the server, its helpers): each one's ``/proc``
    folder, pid and ``stat`` fields after its name."""
    for entry in os.scandir("/proc"):
        stat = read_stat(entry.path) if entry.name.isdigit() else None
        if stat is not None and int(stat[1][3]) == server.process.pid:
            yield entry.path, int(entry.name), stat[1]


def read_stat(path: str) -> tuple[str, list[str]] | None:
    """A process's (or thread's) name and the fields after it in its ``stat``; None once it has ended."""
    try:
        stat = Path(path, "stat").read_text()
    except OSError:
        return None
    name, fields = stat[stat.index("(") + 1:].rsplit(")", 1)
    return name, fields.split()


def xsp_thread_ticks(process: str) -> int:
    """CPU ticks of the process's living threads that xsp named (xsp.core.threads)."""
    ticks = 0
    for task in os.scandir(Path(process, "task")):
        stat = read_stat(task.path)
        if stat is not None and stat[0].startswith("xsp-"):
            ticks += int(stat[1][11]) + int(stat[1][12])
    return ticks


def drive(server: Server, path: str, concurrency: int, seconds: float) -> Load:
    """Closed-loop load: ``concurrency`` clients, each on its own keep-alive connection."""
    latency_ns: list[list[int]] = [[] for _ in range(concurrency)]
    ended_ns, start_ns, failures = [0] * concurrency, [0], []
    barrier = threading.Barrier(concurrency, lambda: start_ns.__setitem__(0, time.perf_counter_ns()), REQUEST_TIMEOUT_S)

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(HOST, server.port, timeout=REQUEST_TIMEOUT_S)
        connection.connect()
        barrier.wait()
        deadline_ns, mine, now = start_ns[0] + int(seconds * 1e9), latency_ns[index], time.perf_counter_ns
        try:
            while (sent_ns := now()) < deadline_ns:
                connection.request("POST", path, BODY, HEADERS)
                response = connection.getresponse()
                body = response.read()
                mine.append(now() - sent_ns)
                if response.status != 200:
                    failures.append(f"HTTP {response.status} {body[:200]!r}")
                    return
        except OSError as error:
            failures.append(repr(error))
        finally:
            ended_ns[index] = now()
            connection.close()

    cpu_before = cpu_seconds(server)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    if failures:
        raise RuntimeError(f"{server.name} {path}: {failures[0]}\n{tail(server.log)}")
    return Load([value for values in latency_ns for value in values], (max(ended_ns) - start_ns[0]) / 1e9,
                cpu_seconds(server) - cpu_before)


def settle(server: Server) -> None:
    """Wait (at most :data:`SETTLE_S`) until no helper process of ``server`` runs. An always-on
    session starts a window's work in the first pause of its steps (xsp/session/pauses.py): the
    pause that ends the round is waited for first, so that the helper it forks is waited for too."""
    if SAMPLE_OPTION in server.health.get("xsp_options", {}):
        time.sleep(PAUSE_NOTICED_S)
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and helpers_running(server):
        time.sleep(0.05)


def loaded_round(server: Server, path: str, concurrency: int, seconds: float) -> Load:
    """One round of ``server``: :func:`drive`, then :func:`settle`; the round's CPU time counts
    the settling too, so that the work of a window taken in the round is the round's."""
    cpu_before = cpu_seconds(server)
    load = drive(server, path, concurrency, seconds)
    settle(server)
    load.cpu = cpu_seconds(server) - cpu_before
    return load


def helpers_running(server: Server) -> bool:
    """Whether a process of ``server``'s session other than the server itself is running."""
    return any(pid != server.process.pid and fields[0] not in ("Z", "X")
               for _, pid, fields in session_processes(server))


def stop(servers: Sequence[Server]) -> None:
    """SIGTERM (uvicorn shuts down, the xsp block writes its file); SIGKILL past the deadline."""
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        try:
            server.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


@contextmanager
def servers_stopped(servers: list[Server], folder: Path) -> Iterator[None]:
    """Stop ``servers`` (as started into the list by the block) when the block ends, saying which
    ended badly; where the block fails, say where their logs and traces are kept."""
    try:
        yield
    except BaseException:
        print(f"servers' logs and traces kept in {folder}", file=sys.stderr)
        raise
    finally:
        stop(servers)
        for server in servers:
            if server.process.returncode != 0 or (server.trace_file and not server.trace_file.exists()):
                print(f"{server.name}: exit code {server.process.returncode}, {server.log}:\n{tail(server.log)}",
                      file=sys.stderr)


def last_run_line(command: str, began: float) -> str:
    """When, on what, and with which command the results were measured (``began``: monotonic)."""
    return (f"Last run: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, Python {platform.python_version()}; `{command}` "
            f"({time.monotonic() - began:.0f} s).")


def leave_folder(folder: Path, keep: bool) -> None:
    """Remove the servers' folder, or say where it is kept."""
    if keep:
        print(f"servers' logs and traces kept in {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder)


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def percentile_ms(loads: Sequence[Load], fraction: float) -> float:
    ordered = sorted(value for load in loads for value in load.latency_ns)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)] / 1e6


def ratio_interval(loads: list[Load], plains: list[Load], fraction: float) -> tuple[float, float, float]:
    """The pooled percentile's ratio to plain's, and its 95% bootstrap interval: rounds drawn with
    replacement, a variant's and plain's of the same round together (they met the same machine)."""
    pooled = percentile_ms(loads, fraction) / percentile_ms(plains, fraction)
    draw = random.Random(BOOTSTRAP_SEED)
    ratios = []
    for _ in range(BOOTSTRAP_DRAWS):
        chosen = [draw.randrange(len(loads)) for _ in loads]
        ratios.append(percentile_ms([loads[i] for i in chosen], fraction)
                      / percentile_ms([plains[i] for i in chosen], fraction))
    ratios.sort()
    return pooled, ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def paired_ratio_interval(loads: list[Load], plains: list[Load], fraction: float) -> tuple[float, float, float]:
    """Each round's percentile over plain's of the same round (the same process, the same minutes),
    their geometric mean, and its 95% bootstrap interval over rounds. What moves a whole round (the
    machine slowing by a quarter for a minute) cancels within its pair here, where the pooled
    percentile of :func:`ratio_interval` is led by the slowest rounds, and its interval by how many
    of them a draw takes."""
    logs = [math.log(percentile_ms([load], fraction) / percentile_ms([plain], fraction))
            for load, plain in zip(loads, plains, strict=True)]
    draw = random.Random(BOOTSTRAP_SEED)
    means = sorted(statistics.fmean(draw.choice(logs) for _ in logs) for _ in range(BOOTSTRAP_DRAWS))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * len(means))]),
            math.exp(means[int(0.975 * len(means)) - 1]))


def ratio_interval_over_servers(loads: list[Load], plains: list[Load], fraction: float) -> tuple[float, float, float]:
    """As :func:`ratio_interval`, for variants that ran as separate processes: each draw takes the
    variant's servers and plain's with replacement, each its own (two processes of one program
    differ by as much as the cost measured: an interval over rounds alone leaves that out), then
    the rounds with replacement, a variant's and plain's of the same round together."""
    pooled = percentile_ms(loads, fraction) / percentile_ms(plains, fraction)
    by_key = {(load.server, load.round): load for load in loads}
    plain_by_key = {(load.server, load.round): load for load in plains}
    servers, plain_servers = sorted({key[0] for key in by_key}), sorted({key[0] for key in plain_by_key})
    rounds = sorted({key[1] for key in by_key} & {key[1] for key in plain_by_key})
    draw = random.Random(BOOTSTRAP_SEED)
    ratios = []
    for _ in range(BOOTSTRAP_DRAWS):
        chosen = [draw.choice(servers) for _ in servers]
        chosen_plain = [draw.choice(plain_servers) for _ in plain_servers]
        chosen_rounds = [draw.choice(rounds) for _ in rounds]
        ratios.append(percentile_ms([by_key[(server, index)] for server in chosen for index in chosen_rounds], fraction)
                      / percentile_ms([plain_by_key[(server, index)] for server in chosen_plain
                                       for index in chosen_rounds], fraction))
    ratios.sort()
    return pooled, ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]


def ratio_text(loads: list[Load], plains: list[Load], fraction: float) -> str:
    pooled, low, high = ratio_interval_over_servers(loads, plains, fraction)
    return f"{pooled:.3f} [{low:.2f},{high:.2f}]"


def cpu_ms_per_request(loads: Sequence[Load]) -> float:
    """The server's CPU time a request over ``loads``, in milliseconds."""
    return 1e3 * sum(load.cpu.total for load in loads) / sum(len(load.latency_ns) for load in loads)


def table(results: dict[tuple[str, str], list[Load]], names: Sequence[str], endpoints: Sequence[str]) -> list[str]:
    lines = [f"{'variant':<11} {'api':<5} {'requests':>8} {'req/s':>6} {'p50 ms':>6} {'p99 ms':>6} "
             f"{'CPU ms':>6} {'xsp thr µs':>10} {'helper µs':>9} {'p50 x plain [95% CI]':>20} "
             f"{'p99 x plain [95% CI]':>20}"]
    for endpoint in endpoints:
        for name in names:
            loads, plains = results[(name, endpoint)], results[(PLAIN, endpoint)]
            requests = sum(len(load.latency_ns) for load in loads)
            cpu_ms = cpu_ms_per_request(loads)
            threads_us = 1e6 * sum(load.cpu.xsp_threads for load in loads) / requests
            helpers_us = 1e6 * sum(load.cpu.helpers for load in loads) / requests
            throughput = requests / sum(load.seconds for load in loads)
            lines.append(f"{name:<11} {endpoint:<5} {requests:>8,} {throughput:>6.0f} "
                         f"{percentile_ms(loads, 0.5):>6.2f} {percentile_ms(loads, 0.99):>6.2f} {cpu_ms:>6.2f} "
                         f"{threads_us:>10.1f} {helpers_us:>9.1f} "
                         f"{ratio_text(loads, plains, 0.5):>20} {ratio_text(loads, plains, 0.99):>20}")
    return lines


def server_note(server: Server, loads: Sequence[Load], idle_cpu_seconds: float) -> str:
    """Its exit code, its CPU time a request under load and while the others were loaded, the xsp
    options in effect, its trace file."""
    note = (f"`{server.name}`: exit code {server.process.returncode}, "
            f"{cpu_ms_per_request(loads):.3f} ms CPU a request under load, "
            f"{idle_cpu_seconds:.1f} s CPU while idle")
    if server.trace_file is None:
        return note
    import xsp

    written = server.trace_file.exists()
    trace = (f"trace file {server.trace_file.stat().st_size / 1e6:.1f} MB, {len(xsp.load(server.trace_file).spans):,} "
             "spans" if written else "**no trace file written**")
    options = {key: value for key, value in server.health.get("xsp_options", {}).items() if key != "output"}
    return f"{note}, xsp options {options}, {trace}"


def servers_text(servers: int) -> str:
    """How many servers each variant ran as, for the results' description (nothing when one)."""
    if servers == 1:
        return ""
    return (f"Each variant ran as {servers} servers, started in turn (one of each, then the next of each); a "
            "variant's figures pool its servers' requests, and each server's own CPU a request is listed below. ")


def split_text(sample: float) -> str:
    """What the variants of ``--split`` are, for the results' description."""
    return (f" With `--split`, three variants each take one part of *xsp s={sample:g}*'s cost out: *no windows* "
            "is the same session with no window closing while the run lasts (`XSP_WINDOW_S` past its end: no helper "
            "process, nothing interpreted), *no steps* the same session with xsp's module-call wrapper taken out "
            "once it started (no step recorded: the session's threads, imports and objects alone), *timer* no xsp "
            "but every top-level module call timed by a C object of a few lines (`benchmarks/timer_floor.c`: the "
            "floor of any model-level tracer).")


def variants_of(sample: float, split: bool) -> dict[str, dict[str, str]]:
    """Each variant's name and the settings of its servers (see the module's text)."""
    sampled = {MODE_ENV: "xsp", SAMPLE_ENV: str(sample)}
    variants = {PLAIN: {MODE_ENV: PLAIN}, PLAIN_TWIN: {MODE_ENV: PLAIN}}
    if not split:
        return {**variants, "xsp": {MODE_ENV: "xsp"}, f"xsp s={sample:g}": sampled}
    return {**variants, f"xsp s={sample:g}": sampled, "no windows": {**sampled, WINDOW_ENV: f"{NO_WINDOWS_S:g}"},
            "no steps": {**sampled, SPLIT_ENV: "no_steps"}, "timer": {MODE_ENV: PLAIN, SPLIT_ENV: "timer"}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=2.0, help="load per variant, endpoint and round")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--sample", type=float, default=0.01, help="xsp's sample fraction in the third variant")
    parser.add_argument("--servers", type=int, default=1, help="servers of each variant, started in turn")
    parser.add_argument("--endpoints", default=",".join(ENDPOINTS), help="of: " + ",".join(ENDPOINTS))
    parser.add_argument("--split", action="store_true",
                        help="instead of xsp on every request, xsp s=... without windows, without steps, and a C timer")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs and trace files")
    args = parser.parse_args(argv)
    if args.servers < 1:
        parser.error(f"--servers must be 1 or more, not {args.servers}")
    endpoints = [name for name in args.endpoints.split(",") if name]
    variants = variants_of(args.sample, args.split)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the servers are stopped too
    began = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="xsp-production-"))
    servers: list[Server] = []
    # each variant's loads by endpoint, its servers' pooled (each round adds one a server, so that a
    # variant's i-th load and plain's met the same round); and each server's own
    results: dict[tuple[str, str], list[Load]] = {}
    server_loads: dict[str, list[Load]] = {}
    with servers_stopped(servers, folder):
        servers += [start_server(name if args.servers == 1 else f"{name} #{number + 1}", settings, folder, name)
                    for number in range(args.servers) for name, settings in variants.items()]
        for server in servers:
            wait_ready(server)
            for endpoint in endpoints:  # warm-up
                drive(server, ENDPOINTS[endpoint], args.concurrency, WARMUP_SECONDS)
        idle_cpu_seconds = {server.name: cpu_seconds(server).total for server in servers}
        for round_index in range(args.rounds):
            shift = round_index % len(servers)
            for endpoint in endpoints:
                for server in servers[shift:] + servers[:shift]:
                    load = loaded_round(server, ENDPOINTS[endpoint], args.concurrency, args.seconds)
                    load.server, load.round = servers.index(server) // len(variants), round_index
                    results.setdefault((server.variant, endpoint), []).append(load)
                    server_loads.setdefault(server.name, []).append(load)
                    print(f"round {round_index + 1}/{args.rounds} {server.name:<14} {endpoint:<5} "
                          f"{len(load.latency_ns) / load.seconds:7.1f} req/s", file=sys.stderr)
        for server in servers:  # its CPU time while the others were loaded
            loaded = sum(load.cpu.total for load in server_loads[server.name])
            idle_cpu_seconds[server.name] = cpu_seconds(server).total - idle_cpu_seconds[server.name] - loaded
    command = " ".join(["python benchmarks/production.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        "# A real inference service under xsp", "",
        last_run_line(command, began), "",
        f"FastAPI + uvicorn + OpenTelemetry (spans dropped by a null exporter), a 2-layer transformer on CPU "
        f"with 1 torch thread, {SEQUENCE_LENGTH} tokens a request; {args.concurrency} closed-loop keep-alive "
        f"clients on the same machine. {servers_text(args.servers)}{args.rounds} interleaved rounds of "
        f"{args.seconds:g} s per variant and endpoint (*sync*: a `def` handler in FastAPI's thread pool; "
        "*async*: an `async def` one on the event loop). *CPU ms*: the server's CPU time per request over "
        "its rounds and the waits after them for its helpers (the clients' is not counted); of it, "
        "*xsp thr µs* on xsp's threads (its window and control threads) and "
        "*helper µs* in the helper processes xsp forks to interpret its windows (the rest is on the threads "
        "that serve the requests). Ratios: pooled percentiles over plain's, with a 95% bootstrap interval over "
        "servers and rounds (each variant's servers drawn on their own, a variant's round with plain's same round; "
        "with one server a variant, over rounds only). *plain twin* is a second server running "
        "plain's code: its ratios are how much two processes of one program differ on this machine, the "
        f"resolution of every other ratio.{split_text(args.sample) if args.split else ''}", "",
        "```", *table(results, list(variants), endpoints), "```", "",
        *(f"* {server_note(server, server_loads[server.name], idle_cpu_seconds[server.name])}" for server in servers),
    ]
    record(lines, RESULTS)
    leave_folder(folder, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
