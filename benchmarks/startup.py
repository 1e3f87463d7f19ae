"""What starting xsp costs before the user's first line runs, in a fresh process per sample.

Three commands, interleaved (one of each per round, so that a noisy moment hits all three):

- ``import torch``: the floor every PyTorch program pays;
- ``import torch`` then ``with xsp.trace():`` entered: the difference is what a session adds
  before the block's first line (goal: at most 0.3 s on a quiet machine). Timed inside the
  process, from before ``import xsp`` to the first line of the block; the process's total
  is shown too (it includes writing the trace at the block's end);
- ``xsp run -- missing.py``: how long a mistyped script name takes to be answered (goal: under
  0.5 s), the whole command timed from outside.

Python's compiled bytecode is written and used as an installed package would (a first run in a
fresh checkout compiles every module; that run is discarded as warm-up).

    python benchmarks/startup.py [--rounds 10] [--busy N]

``--busy N`` runs N processes spinning on the CPU meanwhile (the machine a CI runner is).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _results import record

RESULTS = Path(__file__).resolve().parent / "results" / "startup.md"
IMPORT_TORCH = "import time; began = time.perf_counter(); import torch; print(time.perf_counter() - began)"
ENTER_SESSION = textwrap.dedent("""
    import sys, time
    import torch
    began = time.perf_counter()
    import xsp
    with xsp.trace(output=sys.argv[1]):
        print(time.perf_counter() - began)
""")
OVERLAP = textwrap.dedent("""
    import statistics, sys, time
    import torch
    mode = sys.argv[2]
    if mode == "preimported":  # what a session imported before its block's first line, until this change
        import pandas, pyarrow, pyarrow.compute, pyarrow.parquet, opentelemetry.sdk.trace
    import contextlib, xsp
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU())
                                  for _ in range(8)]).eval()
    x = torch.randn(1, 16, 32, 32)
    session = contextlib.nullcontext() if mode == "none" else xsp.trace(output=sys.argv[1])
    with torch.no_grad():
        for _ in range(5):
            model(x)
        times = []
        with session:
            began = time.perf_counter()
            while time.perf_counter() - began < 1.0:  # the session's first second: its imports run beside
                start = time.perf_counter()
                model(x)
                times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    print(statistics.median(times), times[int(len(times) * 0.9)], times[-1], len(times))
""")
OVERLAP_MODES = ("none", "lazy", "preimported", "xsp run")
ENTRY_GOAL_S = 0.3
MISSING_GOAL_S = 0.5


def _spin() -> None:
    while True:
        pass


def _timed(command: list[str], environ: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environ, check=False)
    return time.perf_counter() - began, done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile")
    options = parser.parse_args()
    environ = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    xsp_command = shutil.which("xsp") or "xsp"
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(options.busy)]
    for spinner in spinners:
        spinner.start()
    torch_s: list[float] = []
    entry_s: list[float] = []
    entry_process_s: list[float] = []
    torch_process_s: list[float] = []
    missing_s: list[float] = []
    overlap: dict[str, list[tuple[float, ...]]] = {mode: [] for mode in OVERLAP_MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="xsp-startup-") as folder:
            script = Path(folder) / "enter.py"
            script.write_text(ENTER_SESSION)
            steps_script = Path(folder) / "steps.py"
            steps_script.write_text(OVERLAP)
            output = str(Path(folder) / "run.xsp.parquet")
            missing = str(Path(folder) / "missing.py")
            commands = {
                "torch": [sys.executable, "-c", IMPORT_TORCH],
                "entry": [sys.executable, str(script), output],
                "missing": [xsp_command, "run", "--", missing],
            }
            for command in commands.values():  # warm-up: bytecode compiled, files in the page cache
                _timed(command, environ)
            for _ in range(options.rounds):
                took, printed = _timed(commands["torch"], environ)
                torch_process_s.append(took)
                torch_s.append(float(printed))
                took, printed = _timed(commands["entry"], environ)
                entry_process_s.append(took)
                entry_s.append(float(printed))
                missing_s.append(_timed(commands["missing"], environ)[0])
                for mode in OVERLAP_MODES:
                    command = ([xsp_command, "run", "-o", output, "--", str(steps_script), output, "none"]
                               if mode == "xsp run" else [sys.executable, str(steps_script), output, mode])
                    printed = _timed(command, environ)[1]
                    overlap[mode].append(tuple(float(v) for v in printed.split()))
    finally:
        for spinner in spinners:
            spinner.terminate()
    median = statistics.median
    busy = f", {options.busy} busy processes" if options.busy else ", quiet"
    lines = [
        f"# Start-up cost ({os.cpu_count()} cores{busy}, {options.rounds} rounds, a fresh process each)",
        "",
        "Written by `python benchmarks/startup.py`; medians (min-max) in seconds.",
        "",
        "| what | median s | min-max s | goal |",
        "|---|---:|---:|---|",
        f"| `import torch` (inside the process) | {median(torch_s):.3f} | {min(torch_s):.3f}-{max(torch_s):.3f} | |",
        f"| `import xsp` + entering `xsp.trace()` (inside, after torch) | {median(entry_s):.3f} | "
        f"{min(entry_s):.3f}-{max(entry_s):.3f} | at most {ENTRY_GOAL_S} s: "
        f"{'met' if median(entry_s) <= ENTRY_GOAL_S else 'NOT met'} |",
        f"| process: `import torch` | {median(torch_process_s):.3f} | "
        f"{min(torch_process_s):.3f}-{max(torch_process_s):.3f} | |",
        f"| process: `import torch` + an empty session, its trace written | {median(entry_process_s):.3f} | "
        f"{min(entry_process_s):.3f}-{max(entry_process_s):.3f} | |",
        f"| `xsp run -- missing.py` answered | {median(missing_s):.3f} | "
        f"{min(missing_s):.3f}-{max(missing_s):.3f} | under {MISSING_GOAL_S} s: "
        f"{'met' if median(missing_s) < MISSING_GOAL_S else 'NOT met'} |",
        "",
        f"Entering a session adds {median(entry_s) / median(torch_s):.0%} of `import torch`'s time before the "
        "block's first line. What it defers (pandas, pyarrow, OpenTelemetry's SDK, the machine-speed probe) "
        "is paid by the window thread in the background and at the block's end.",
        "",
        "Steps in the session's first second, while its thread imports (a small CNN, 1 thread; "
        "medians over the rounds of each process's median, p90 and longest step, ms, and of the steps made in it):",
        "",
        "| session | median step | p90 step | longest step | steps in the second |",
        "|---|---:|---:|---:|---:|",
        *[f"| {mode} | {median([r[0] for r in overlap[mode]]):.3f} | {median([r[1] for r in overlap[mode]]):.3f} | "
          f"{median([r[2] for r in overlap[mode]]):.3f} | {median([r[3] for r in overlap[mode]]):.0f} |"
          for mode in OVERLAP_MODES],
        "",
        "`none`: no xsp; `lazy`: `with xsp.trace():` as it is, its window thread importing as it starts (the "
        "first model call waits for those imports before its clock is read: its step is the longest); "
        "`preimported`: pandas, pyarrow and OpenTelemetry's SDK imported before the session, as every session did "
        "before its imports were made lazy; `xsp run`: the same script unchanged under `xsp run`, which starts "
        "those imports before the script, beside its own `import torch`.",
    ]
    record(lines, RESULTS if not options.busy else RESULTS.with_name("startup_busy.md"))


if __name__ == "__main__":
    main()
