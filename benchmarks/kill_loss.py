"""What a SIGKILL costs a run that streams its trace: the time of finished steps that
``xsp recover`` cannot bring back, on a quiet machine and on one whose cores are all busy.

A model+layer loop (20 Linear layers, 10 ms a step) writes a line per finished step to a log
(flushed), runs under ``xsp.trace(output=...)``, and is killed with SIGKILL after
``--seconds``; ``xsp recover`` then builds its file. The loss is the time between the last
finished step and the last step the recovered file holds. With ``--busy N``, N processes spin
on the CPU meanwhile (on a 2-core machine, 2 of them take every core).

    python benchmarks/kill_loss.py [--runs 6] [--seconds 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "kill_loss.md"
SCRIPT = textwrap.dedent("""
    import sys, time, torch, xsp
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    log = open(sys.argv[2], "w", buffering=1)
    began = None
    with xsp.trace(levels="model,layer", output=sys.argv[1]):
        for step in range(10**6):
            model(torch.randn(16, 64))
            time.sleep(0.01)
            began = began or time.time()
            log.write(f"{step} {time.time() - began:.3f}\\n")
""")


def one_run(folder: Path, seconds: float) -> tuple[float, float]:
    """(seconds of finished steps lost, share of finished steps lost)."""
    script, log, output = folder / "steps.py", folder / "log.txt", folder / "run.xsp.parquet"
    script.write_text(SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(output), str(log)])
    while not log.exists() or not log.read_text():  # the clock starts at the first step, not at import
        time.sleep(0.05)
    time.sleep(seconds)
    process.send_signal(signal.SIGKILL)
    process.wait()
    subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True, timeout=600)
    times = [float(line.split()[1]) for line in log.read_text().splitlines() if len(line.split()) == 2]
    import xsp

    try:
        kept = int((xsp.load(output).spans["kind"] == "predict").sum())
    except xsp.XspError:
        kept = 0
    last_kept = times[kept - 1] if kept else 0.0
    return times[-1] - last_kept, (len(times) - kept) / len(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args(argv)
    rows = []
    for label, busy in (("quiet", 0), (f"{args.busy} busy processes", args.busy)):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            losses = []
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as folder:
                    losses.append(one_run(Path(folder), args.seconds))
        finally:
            for spinner in spinners:
                spinner.kill()
        seconds = [lost for lost, _ in losses]
        shares = [share for _, share in losses]
        rows.append(f"| {label} | {args.runs} | {statistics.median(seconds):.2f} | {max(seconds):.2f} | "
                    f"{statistics.median(shares):.0%} | {max(shares):.0%} |")
    lines = ["# What a SIGKILL loses", "",
             f"A model+layer loop killed {args.seconds:g} s after its first step, then `xsp recover`; "
             f"{os.cpu_count()} cores. `python benchmarks/kill_loss.py --runs {args.runs} --seconds {args.seconds:g}`.",
             "", "| machine | runs | lost s (median) | lost s (max) | finished steps lost (median) | (max) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |", *rows]
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
