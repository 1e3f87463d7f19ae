"""What an always-on session's steps cost a real inference service, measured inside one process.

benchmarks/production.py compares separate processes: plain against xsp. Two processes of one
program differ here by up to 1-2% (their memory layouts, benchmarks/results/production.md's *plain
twin*), as much as the steps' cost itself. This benchmark takes that difference out: it starts the
example service (examples/service/serve.py) inside ``xsp.trace(levels=("model", "layer"),
sample=<fraction>)`` with benchmarks/split_server.py's ``switch``, which takes xsp's module-call
wrapper out of ``nn.Module.__call__`` and puts it back on request, and loads each server with its
steps *off* (the session present, no step recorded) and *on* (every request a step, the fraction
drawn recorded with its layers) in turn, the order alternated from round to round. The session's
windows never close while the run lasts (``XSP_WINDOW_S`` past its end): their work is
benchmarks/production.py's to measure.

Reported per endpoint (*sync*: a ``def`` handler in FastAPI's thread pool; *async*: an ``async
def`` one on the event loop): requests, throughput, p50, p90 and p99 latency and the server's CPU
time a request with the steps off and on, and *on* over *off*: pooled percentiles with a 95%
bootstrap interval over rounds (each round's *on* drawn with its *off*), and the CPU time a request
the steps add; and *paired*: the geometric mean of each round's percentile over its *off*'s, with a
95% bootstrap interval over rounds (what moves a whole round cancels within its pair). Prints a
table and records it in benchmarks/results/steps_in_process.md.

With ``--presence``, what is switched is the session itself instead of its steps (split_server.py's
``presence``): each server starts with no session, and is loaded with none (*off*) and with one
started, its wrapper taken out (*on*: its threads, signal handlers and objects, no step recorded),
in turn, a session started and ended between loads. That is production.py's *no steps* against
*plain*, free of how two processes differ. Recorded in benchmarks/results/presence_in_process.md.

With ``--whole``, the session switched on is the whole of it (split_server.py's ``whole``): its
wrapper in place, every request a step, the fraction drawn recorded with its layers, its windows
closing every ``--window-s`` seconds (default: xsp's own, 60 s) and its file written as it ends,
between loads. That is production.py's *xsp* against *plain*, free of how two processes differ.
Recorded in benchmarks/results/whole_in_process.md.

Usage: python benchmarks/steps_in_process.py [--rounds 12] [--seconds 2] [--concurrency 4]
       [--sample 0.01] [--servers 2] [--endpoints sync,async] [--presence | --whole [--window-s S]]
       [--settle-s S] [--pin] [--keep] [--save FILE.json]
       python benchmarks/steps_in_process.py --from FILE.json [FILE.json ...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _results import record
from production import (
    ENDPOINTS,
    HOST,
    MODE_ENV,
    NO_WINDOWS_S,
    REQUEST_TIMEOUT_S,
    SAMPLE_ENV,
    SPLIT_ENV,
    WARMUP_SECONDS,
    WINDOW_ENV,
    Cpu,
    Load,
    Server,
    cpu_ms_per_request,
    drive,
    last_run_line,
    leave_folder,
    paired_ratio_interval,
    percentile_ms,
    ratio_interval,
    servers_stopped,
    start_server,
    tail,
    wait_ready,
)
from split_server import PRESENCE, SESSION_PATH, STEPS_PATH, SWITCH, WHOLE

RESULTS = Path(__file__).resolve().parent / "results" / "steps_in_process.md"
PRESENCE_RESULTS = Path(__file__).resolve().parent / "results" / "presence_in_process.md"
WHOLE_RESULTS = Path(__file__).resolve().parent / "results" / "whole_in_process.md"
OFF, ON = "off", "on"
PERCENTILES = (0.5, 0.9, 0.99)


def switch_steps(server: Server, on: bool, path: str = STEPS_PATH) -> None:
    """Put the server's xsp wrapper in (``on``) or take it out; with ``path`` SESSION_PATH, start a
    session without steps or end it."""
    connection = http.client.HTTPConnection(HOST, server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", f"{path}?on={'true' if on else 'false'}")
        answer = connection.getresponse()
        body = answer.read()
    finally:
        connection.close()
    if answer.status != 200:
        raise RuntimeError(f"{server.name}: steps {'on' if on else 'off'}: HTTP {answer.status} {body[:200]!r}\n"
                           f"{tail(server.log)}")


def states_in_order(round_index: int, server_index: int) -> tuple[str, str]:
    """Off then on, or on then off: alternated, so that neither always meets a round's start."""
    return (OFF, ON) if (round_index + server_index) % 2 == 0 else (ON, OFF)


def table(results: dict[tuple[str, str], list[Load]], endpoints: Sequence[str], switched: str = "steps",
          timed: bool = True) -> list[str]:
    """The loads' percentiles by endpoint and state, and *on* over *off* pooled and paired; with
    ``timed``, their throughput and the server's CPU a request too (not kept by ``--save``)."""
    lines = [f"{'api':<5} {switched:<7} {'requests':>8} " + (f"{'req/s':>6} " if timed else "")
             + f"{'p50 ms':>6} {'p90 ms':>6} {'p99 ms':>6}" + (f" {'CPU µs':>6}" if timed else "")]
    for endpoint in endpoints:
        for state in (OFF, ON):
            loads = results[(endpoint, state)]
            requests = sum(len(load.latency_ns) for load in loads)
            throughput = f"{requests / sum(load.seconds for load in loads):>6.0f} " if timed else ""
            lines.append(f"{endpoint:<5} {state:<7} {requests:>8,} {throughput}"
                         + " ".join(f"{percentile_ms(loads, fraction):>6.2f}" for fraction in PERCENTILES)
                         + (f" {1e3 * cpu_ms_per_request(loads):>6.0f}" if timed else ""))
    lines += ["", f"{'api':<5} " + " ".join(f"{f'p{round(100 * f)} on/off [95% CI]':>22}" for f in PERCENTILES)
              + (f" {'CPU µs a request on-off':>24}" if timed else "")]
    for endpoint in endpoints:
        ons, offs = results[(endpoint, ON)], results[(endpoint, OFF)]
        ratios = []
        for fraction in PERCENTILES:
            pooled, low, high = ratio_interval(ons, offs, fraction)
            ratios.append(f"{pooled:.4f} [{low:.3f},{high:.3f}]")
        added_us = 1e3 * (cpu_ms_per_request(ons) - cpu_ms_per_request(offs)) if timed else 0.0
        lines.append(f"{endpoint:<5} " + " ".join(f"{text:>22}" for text in ratios)
                     + (f" {added_us:>+24.1f}" if timed else ""))
    lines += ["", f"{'paired':<5} " + " ".join(f"{f'p{round(100 * f)} on/off [95% CI]':>22}" for f in PERCENTILES)]
    for endpoint in endpoints:
        ons, offs = results[(endpoint, ON)], results[(endpoint, OFF)]
        paired = [paired_ratio_interval(ons, offs, fraction) for fraction in PERCENTILES]
        lines.append(f"{endpoint:<5} " + " ".join(f"{f'{mean:.4f} [{low:.3f},{high:.3f}]':>22}"
                                                   for mean, low, high in paired))
    return lines


def save_latencies(results: dict[tuple[str, str], list[Load]], path: Path) -> None:
    """Every load's latencies (ns), by endpoint and state, in round order: to read again with
    other statistics than the table's."""
    loads = {f"{endpoint} {state}": [load.latency_ns for load in each] for (endpoint, state), each in results.items()}
    path.write_text(json.dumps(loads))


def saved_latencies(paths: Sequence[Path]) -> dict[tuple[str, str], list[Load]]:
    """The loads :func:`save_latencies` wrote, the files' rounds one after another (each round's
    *on* still beside its *off*): their latencies only."""
    results: dict[tuple[str, str], list[Load]] = {}
    for path in paths:
        for name, loads in json.loads(path.read_text()).items():
            endpoint, state = name.split(" ")
            results.setdefault((endpoint, state), []).extend(
                Load(latency_ns, 0.0, Cpu(0.0, 0.0, 0.0)) for latency_ns in loads)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=2.0, help="load per state, endpoint, server and round")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop clients")
    parser.add_argument("--sample", type=float, default=0.01, help="xsp's sample fraction")
    parser.add_argument("--servers", type=int, default=2, help="server processes, each loaded in every round")
    parser.add_argument("--endpoints", default=",".join(ENDPOINTS), help="of: " + ",".join(ENDPOINTS))
    parser.add_argument("--presence", action="store_true",
                        help="switch the session itself (no steps) instead of its steps")
    parser.add_argument("--whole", action="store_true",
                        help="switch the whole session (its steps, windows and file) instead of its steps")
    parser.add_argument("--window-s", type=float, default=None,
                        help="with --whole: how often the session's windows close (default: xsp's own)")
    parser.add_argument("--settle-s", type=float, default=None,
                        help="after each switch, load the server this long unmeasured (with --whole, 0.5 s by "
                             "default: what a session's start costs, once in a service's life, is left out)")
    parser.add_argument("--pin", action="store_true",
                        help="the servers on the last CPU alone, the clients on the others (as a service on "
                             "a CPU of its own runs), so that the clients' threads do not queue the server's")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs and trace files")
    parser.add_argument("--save", type=Path, default=None, metavar="FILE.json",
                        help="write every load's latencies (ns) here, by endpoint and state, in round order")
    parser.add_argument("--from", dest="saved", type=Path, nargs="+", default=None, metavar="FILE.json",
                        help="run nothing: print the tables of the latencies --save wrote, these files' rounds "
                             "pooled")
    args = parser.parse_args(argv)
    if args.saved is not None:
        missing = [str(path) for path in args.saved if not path.is_file()]
        if missing:
            parser.error(f"no such file: {', '.join(missing)}")
        saved = saved_latencies(args.saved)
        print("\n".join(table(saved, [name for name in ENDPOINTS if (name, ON) in saved], "state", timed=False)))
        return 0
    server_cpus: set[int] | None = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            parser.error("--pin needs 2 CPUs or more")
        server_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # the clients' threads, made later, inherit it
    if args.settle_s is None:
        args.settle_s = 0.5 if args.whole else 0.0
    if args.presence and args.whole:
        parser.error("--presence and --whole cannot be combined")
    if args.window_s is not None and (not args.whole or args.window_s <= 0):
        parser.error("--window-s applies to --whole, and must be above 0")
    endpoints = [name for name in args.endpoints.split(",") if name]
    unknown = [name for name in endpoints if name not in ENDPOINTS]
    if args.servers < 1 or args.rounds < 1 or not endpoints or unknown:
        parser.error(f"--servers and --rounds must be 1 or more, --endpoints some of {','.join(ENDPOINTS)}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the servers are stopped too
    began = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="xsp-steps-in-process-"))
    split, path = (PRESENCE, SESSION_PATH) if args.presence else (WHOLE, SESSION_PATH) if args.whole \
        else (SWITCH, STEPS_PATH)
    settings = {MODE_ENV: "xsp", SAMPLE_ENV: str(args.sample), WINDOW_ENV: f"{NO_WINDOWS_S:g}", SPLIT_ENV: split}
    if args.whole:  # the windows close as in production, or as often as asked
        del settings[WINDOW_ENV]
        if args.window_s is not None:
            settings[WINDOW_ENV] = f"{args.window_s:g}"
    servers: list[Server] = []
    results: dict[tuple[str, str], list[Load]] = {}
    with servers_stopped(servers, folder):
        servers += [start_server(f"{split} #{number + 1}", settings, folder, split, server_cpus)
                    for number in range(args.servers)]
        for server in servers:
            wait_ready(server)
            for on in (False, True):
                switch_steps(server, on, path)
                for endpoint in endpoints:
                    drive(server, ENDPOINTS[endpoint], args.concurrency, WARMUP_SECONDS)
        for round_index in range(args.rounds):
            for endpoint in endpoints:
                for server_index, server in enumerate(servers):
                    for state in states_in_order(round_index, server_index):
                        switch_steps(server, state == ON, path)
                        if args.settle_s > 0:
                            drive(server, ENDPOINTS[endpoint], args.concurrency, args.settle_s)
                        load = drive(server, ENDPOINTS[endpoint], args.concurrency, args.seconds)
                        results.setdefault((endpoint, state), []).append(load)
                        print(f"round {round_index + 1}/{args.rounds} {server.name} {endpoint:<5} {state:<3} "
                              f"{len(load.latency_ns) / load.seconds:7.1f} req/s", file=sys.stderr)
    if args.save is not None:
        save_latencies(results, args.save)
    command = " ".join(["python benchmarks/steps_in_process.py", *(sys.argv[1:] if argv is None else argv)])
    if args.presence or args.whole:
        record(session_lines(command, began, args, results, endpoints),
               PRESENCE_RESULTS if args.presence else WHOLE_RESULTS)
        leave_folder(folder, args.keep)
        return 0
    lines = [
        "# An always-on session's steps, measured inside one process", "",
        last_run_line(command, began), "",
        f"The example service (FastAPI + uvicorn + OpenTelemetry, a 2-layer transformer on CPU with 1 torch "
        f"thread) inside `xsp.trace(levels=(\"model\", \"layer\"), sample={args.sample:g})`, its windows never "
        f"closing; {args.concurrency} closed-loop keep-alive clients on the same machine{pinned(args.pin)}. "
        f"{args.servers} "
        f"server process(es), each loaded in every round with xsp's module-call wrapper taken out (*off*: the "
        f"session present, no step recorded) and put back (*on*), {args.seconds:g} s each, in alternating "
        f"order; {args.rounds} rounds. *on/off*: pooled percentiles, with a 95% bootstrap interval over "
        "rounds (each round's *on* drawn with its *off*, of the same process). *CPU µs*: the server's CPU "
        "time a request.", "",
        "```", *table(results, endpoints), "```",
    ]
    record(lines, RESULTS)
    leave_folder(folder, args.keep)
    return 0


def pinned(pin: bool) -> str:
    return " (the servers pinned to one CPU of their own, the clients to the other)" if pin else ""


def session_lines(command: str, began: float, args: argparse.Namespace, results: dict[tuple[str, str], list[Load]],
                  endpoints: Sequence[str]) -> list[str]:
    """The results file of a ``--presence`` or a ``--whole`` run: a session switched on and off
    between loads, with no step (its presence) or the whole of it."""
    session = f"`xsp.trace(levels=(\"model\", \"layer\"), sample={args.sample:g})`"
    if args.presence:
        title = "# An always-on session's presence, measured inside one process"
        on = (f"{session} whose module-call wrapper was taken out as it started (*on*: its threads, signal "
              f"handlers and objects, no step recorded), {args.seconds:g} s each, in alternating order, the "
              f"session started and ended between loads;")
        cpu = "*CPU µs*: the server's CPU time a request."
    else:
        windows = ("xsp's default windows (60 s)" if args.window_s is None
                   else f"windows closing every {args.window_s:g} s")
        title = "# An always-on session, the whole of it, measured inside one process"
        on = (f"{session} as the example runs it (*on*: every request a step, the fraction drawn recorded with "
              f"its layers, {windows}), {args.seconds:g} s each, in alternating order, each after "
              f"{args.settle_s:g} s of unmeasured load; the session started before it (its start, once in a "
              f"service's life, left out) and ended (its file written) after its load.")
        cpu = "*CPU µs*: the server's CPU time a request (a window's helper process not counted)."
    return [
        title, "",
        last_run_line(command, began), "",
        f"The example service (FastAPI + uvicorn + OpenTelemetry, a 2-layer transformer on CPU with 1 torch "
        f"thread), started with no xsp session; {args.concurrency} closed-loop keep-alive clients on the same "
        f"machine{pinned(args.pin)}. {args.servers} server process(es), each loaded in every round with no "
        f"session (*off*; one ran and ended before the first round, so that every import is made) and with a live {on} "
        f"{args.rounds} rounds. *on/off*: pooled percentiles, with a 95% bootstrap interval over rounds (each "
        f"round's *on* drawn with its *off*, of the same process). {cpu}", "",
        "```", *table(results, endpoints, "session"), "```",
    ]


if __name__ == "__main__":
    sys.exit(main())
