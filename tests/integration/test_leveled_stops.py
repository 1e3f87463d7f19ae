"""``xsp run --leveled`` stopped part way (Ctrl-C, SIGTERM, the script's own failing exit): the
rounds that finished are written, marked partial with what was cut, or nothing is written and
that is said; the exit status is the script's (or the signal's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import xsp

# Each run of the script appends a line to RUNS; the run numbered STOP (from 1: the first run
# finds the model's depth, then 2 runs a round) waits there for the test's signal, or exits
# with EXIT.
SCRIPT = """
import os, sys, time, torch
runs = os.environ["RUNS"]
with open(runs, "a") as handle:
    handle.write("run\\n")
number = sum(1 for _ in open(runs))
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
with torch.no_grad():
    for _ in range(6):
        model(torch.randn(2, 16))
    if number == int(os.environ["STOP"]):
        if os.environ.get("EXIT"):
            sys.exit(int(os.environ["EXIT"]))
        while True:
            model(torch.randn(2, 16))
            time.sleep(0.01)
print("done", number)
"""


def leveled(tmp_path: Path, stop_at: int, exit_status: int | None = None) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "RUNS": str(tmp_path / "runs.txt"), "STOP": str(stop_at)}
    if exit_status is not None:
        env["EXIT"] = str(exit_status)

    def default_signals() -> None:  # whatever the test run inherited (nohup, CI runners)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)

    # --budget 0: no run is repeated for a burst of the machine's noise, so the runs are numbered as planned
    return subprocess.Popen([sys.executable, "-m", "xsp", "run", "--leveled", "--rounds", "3", "--warmup", "1",
                             "--budget", "0", "--no-compensate", "-o", str(tmp_path / "lev.xsp.parquet"), "--",
                             str(script)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)


def stop_when_waiting(process: subprocess.Popen[str], tmp_path: Path, stop_at: int, signum: int) -> None:
    """Send ``signum`` once the run numbered ``stop_at`` has begun (and waits for it)."""
    runs = tmp_path / "runs.txt"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if runs.exists() and len(runs.read_text().splitlines()) >= stop_at:
            time.sleep(0.5)  # into its wait
            process.send_signal(signum)
            return
        time.sleep(0.05)
    pytest.fail(f"the run numbered {stop_at} never began: {process.communicate()}")


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.heavy)])
def test_a_signal_in_round_three_writes_the_two_rounds_that_finished(tmp_path, signum):
    process = leveled(tmp_path, stop_at=6)  # the depth run, rounds 1 and 2 (2 runs each), then round 3's first
    stop_when_waiting(process, tmp_path, 6, signum)
    out, err = process.communicate(timeout=240)
    assert process.returncode == -signum, err  # ended by the signal, as the plain script would be
    assert f"partial leveled trace: stopped by {signal.Signals(signum).name} in round 3, after 0 of its 2 runs: " \
           "2 rounds merged" in err, err
    assert "the trace holds what was recorded" not in err
    trace = xsp.load(tmp_path / "lev.xsp.parquet")
    details = trace.metadata["leveled"]
    assert details["rounds"] == 2 and details["partial"]["rounds_finished"] == 2
    assert details["partial"]["by"] == signal.Signals(signum).name
    assert set(trace.spans["leveled_run"].dropna()) == {"model", "model+layer"}


def test_a_signal_before_any_round_finished_writes_nothing_and_says_so(tmp_path):
    process = leveled(tmp_path, stop_at=2)  # round 1's first run
    stop_when_waiting(process, tmp_path, 2, signal.SIGINT)
    out, err = process.communicate(timeout=240)
    assert process.returncode == -signal.SIGINT
    assert "stopped by SIGINT: no leveled round finished (0 of 2 runs of the first), so nothing was written" in err
    assert not (tmp_path / "lev.xsp.parquet").exists()
    assert "->" not in err


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
@pytest.mark.parametrize("stop_at, written", [(1, False), (4, True)])
def test_the_scripts_failing_exit_ends_the_runs_with_its_status(tmp_path, stop_at, written):
    process = leveled(tmp_path, stop_at=stop_at, exit_status=3)
    out, err = process.communicate(timeout=240)
    assert process.returncode == 3, err
    assert (tmp_path / "lev.xsp.parquet").exists() == written
    if written:
        assert "partial leveled trace: stopped by the script's exit status 3 in round 2, after 0 of its 2 runs: " \
               "1 round merged" in err, err
    else:
        assert "stopped by the script's exit status 3 before the leveled rounds began, so nothing was written" in err


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_api_writes_the_rounds_that_finished_then_raises_as_the_function_did(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    calls = []

    def work() -> None:
        calls.append(1)
        if len(calls) == 40:
            raise KeyboardInterrupt
        with torch.no_grad():
            model(torch.randn(2, 8))

    said: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        xsp.leveled(work, levels="model,layer", repeat=4, warmup=1, rounds=10, compensate=False,
                    output=tmp_path / "api.xsp.parquet", progress=said.append)
    details = xsp.load(tmp_path / "api.xsp.parquet").metadata["leveled"]
    assert details["partial"]["by"].startswith("KeyboardInterrupt") and details["rounds"] >= 1
    assert details["partial"]["rounds_finished"] == details["rounds"]
    assert any(line.startswith("leveled round 1 of 10, run 1 of 2: model") for line in said), said
