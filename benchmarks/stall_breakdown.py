"""Where the end of an operator-level run goes: the time from the end of the user's loop until
the trace file is on disk, split into waiting for the helper processes' queue of windows
(``finish_windows``), the last window (``interpret``) and writing the file (``write``).

The same loop as benchmarks/long_run.py (500 x Linear(8, 8), inference, GC on), with
``xsp.trace(levels="model,layer,operator")``. Prints one table row per run; results are
recorded by hand in benchmarks/results/long_run_notes.md.

Usage: python benchmarks/stall_breakdown.py [MODULE_CALLS] [RUNS]
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

import xsp
from xsp.session import ending, interpreting, windows

PHASES = {"finish_windows": (windows.WindowWorker, "finish_windows"),
          "interpret": (interpreting.WindowInterpreter, "interpret"), "write": (ending.TraceWriter, "write")}


def timed_phases() -> dict[str, float]:
    """Wrap each phase so that its time adds up in the returned dict."""
    spent: dict[str, float] = {}
    for label, (owner, name) in PHASES.items():
        original = getattr(owner, name)

        def wrapper(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - start

        setattr(owner, name, functools.wraps(original)(wrapper))
    return spent


def run(calls: int, output: Path, spent: dict[str, float]) -> tuple[float, int]:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(500)])
    x = torch.randn(1, 8)
    with torch.no_grad():
        session = xsp.trace(levels="model,layer,operator", output=output)
        session.__enter__()
        for _ in range(calls // 501):
            model(x)
        spent.clear()
        start = time.perf_counter()
        session.__exit__(None, None, None)
        stall = time.perf_counter() - start
    return stall, pq.ParquetFile(output).metadata.num_rows


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(1)
    spent = timed_phases()
    print("| module calls | spans | stall s | µs/span | finish_windows s | last window s | file s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as folder:
        for number in range(runs):
            stall, spans = run(calls, Path(folder) / f"run{number}.xsp.parquet", spent)
            phases = " | ".join(f"{spent.get(label, 0.0):.2f}" for label in PHASES)
            print(f"| {calls:,} | {spans:,} | {stall:.2f} | {stall / spans * 1e6:.2f} | {phases} |")


if __name__ == "__main__":
    main()
