"""The operator level recorded by xsp's RecordFunction observer (xsp/record/_operators/): its
records streamed a window at a time like the layer level's (a killed run keeps what closed), the
same spans as PyTorch's profiler gives, and PyTorch's profiler again where the observer cannot
be built, said once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import xsp
import xsp.session.options
import xsp.tracers.operator
from xsp.core import schema as col
from xsp.io.segments import unfinished_sessions

needs_observer = pytest.mark.skipif(xsp.tracers.operator.observer_unavailable() is not None,
                                    reason=f"xsp's operator observer cannot be built here: "
                                           f"{xsp.tracers.operator.observer_unavailable()}")


def train(model: nn.Module, steps: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def operators(trace: xsp.Trace) -> pd.DataFrame:
    spans = trace.spans
    return spans[spans[col.LEVEL] == col.Level.OPERATOR.value]


@needs_observer
def test_operators_stream_in_windows_and_nest_under_their_layers(tmp_path, monkeypatch):
    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end
    model = small()
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "run.xsp.parquet") as session:
        train(model, 20)
    meta = session.trace.metadata
    assert meta["closed_windows"] >= 5 and meta["streamed_windows"] >= 2  # the operator level no longer waits
    assert meta["tracer_details"]["operator"]["record_path"].startswith("xsp's RecordFunction observer")
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    ops, spans = operators(trace), trace.spans
    assert trace.steps == list(range(20))
    # outside every step: only the first input, made before the first forward began the first step
    assert set(ops[ops[col.STEP].isna()][col.NAME].astype(str)) <= {"aten::randn", "aten::empty", "aten::normal_"}
    addmm = ops[ops[col.NAME] == "aten::addmm"]
    assert len(addmm) == 40 and set(addmm[col.INPUT_SHAPES].astype(str)) == {"[[16], [4, 8], [8, 16], [], []]",
                                                                             "[[4], [4, 16], [16, 4], [], []]"}
    names = dict(zip(spans[col.SPAN_ID], spans[col.NAME].astype(str)))
    assert {names[parent] for parent in addmm[col.PARENT_ID]} == {"aten::linear"}
    linear = ops[ops[col.NAME] == "aten::linear"]
    assert {names[parent] for parent in linear[col.PARENT_ID]} == {"model.0", "model.2"}
    backward = ops[ops[col.NAME] == "AddmmBackward0"]
    assert len(backward) == 40 and backward[col.SEQUENCE_NUMBER].notna().all()
    assert xsp.analysis.backward_attribution(trace)["forward_layer"].notna().any()


@needs_observer
def test_the_observer_records_what_the_profiler_records(monkeypatch):
    model = small()
    with xsp.trace(levels="model,layer,operator", output=None) as observed:
        train(model, 3)
    monkeypatch.setattr(xsp.tracers.operator, "operator_observer", lambda: None)  # PyTorch's profiler instead
    with xsp.trace(levels="model,layer,operator", output=None) as profiled:
        train(model, 3)
    assert profiled.trace.metadata["tracer_details"]["operator"].get("record_path") is None
    mine, theirs = operators(observed.trace), operators(profiled.trace)

    def counted(ops):  # per step and name: the same operators, as often
        return ops.groupby([col.STEP, col.NAME], observed=True).size().to_dict()

    assert counted(mine) == counted(theirs)
    for name in ("aten::addmm", "aten::mm", "AddmmBackward0"):
        assert sorted(mine[mine[col.NAME] == name][col.INPUT_SHAPES].astype(str)) == \
            sorted(theirs[theirs[col.NAME] == name][col.INPUT_SHAPES].astype(str)), name


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
@needs_observer
def test_a_run_killed_at_the_operator_level_is_recovered_with_its_operators(tmp_path):
    script, output = tmp_path / "killed.py", tmp_path / "run.xsp.parquet"
    script.write_text(
        "import os, signal, sys, time, torch, xsp\n"
        "model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])\n"
        "with torch.no_grad(), xsp.trace(levels='model,layer,operator', output=sys.argv[1]):\n"
        "    began = time.monotonic()\n"
        "    while time.monotonic() - began < 4:\n"
        "        model(torch.randn(2, 8))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True, timeout=180)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not output.exists() and len(unfinished_sessions(output)) == 1
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True,
                               text=True, timeout=180)
    assert recovered.returncode == 0, recovered.stderr
    trace = xsp.load(output)
    ops = operators(trace)
    assert len(trace.steps) > 50 and len(ops) >= 20 * len(trace.steps)  # every recovered step has its operators
    assert set(ops[col.STEP].dropna().astype(int)) == set(trace.steps)


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_where_the_observer_cannot_be_built_the_profiler_records_and_it_is_said(tmp_path):
    script = tmp_path / "run.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nfor _ in range(3):\n    m(torch.randn(2, 4))\n")
    env = {**os.environ, "XSP_CACHE_DIR": str(tmp_path / "empty-cache"), "CXX": str(tmp_path / "no-compiler")}
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "--levels", "model,layer,operator", "-o",
                           str(tmp_path / "run.xsp.parquet"), "--", str(script)], capture_output=True, text=True,
                          env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "PyTorch's profiler" in line]
    assert len(said) == 1 and "the C++ compiler could not be run" in said[0], done.stderr
    assert (operators(xsp.load(tmp_path / "run.xsp.parquet"))[col.NAME] == "aten::addmm").sum() == 3
    assert not list(Path(tmp_path / "empty-cache").rglob("*.so"))


def profiler_sees_operators() -> bool:
    """Whether PyTorch's profiler records this thread's operators (RecordFunction is on here)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        torch.ones(3).add(1)
    return any(event.name == "aten::add" for event in profiler.events())


@needs_observer
@pytest.mark.parametrize("pure_python", [False, True], ids=["c_wrapper", "python_wrapper"])
def test_an_always_on_step_without_operators_records_none_and_the_thread_records_again_after(
        tmp_path, monkeypatch, pure_python):
    """The steps an always-on session times at the model level, and those of its rotation without
    the operator level, run their model call with the thread's operator records paused: nothing is
    recorded there to be dropped later (it cost 80-160 us a request of the example transformer),
    and the thread records again after each call, a failing one too."""
    if pure_python:
        monkeypatch.setenv("XSP_PURE_PYTHON", "1")
    observer = xsp.record.operator_observer.observer()
    model, inputs, wrong = small().eval(), torch.randn(2, 8), torch.randn(2, 5)
    with xsp.trace(levels="model,layer,operator", sample=0.0, slow_factor=0,
                   output=tmp_path / "none.xsp.parquet"), torch.no_grad():
        for _ in range(30):
            model(inputs)
        recorded_in_steps = observer.recorded()
        torch.ones(2).mul(3)  # between steps the thread records
        recorded_between = observer.recorded() - recorded_in_steps
        with pytest.raises(RuntimeError):
            model(wrong)  # a call that fails inside a step recorded without operators
        torch.ones(2).mul(3)
        recorded_after_failure = observer.recorded() - recorded_in_steps - recorded_between
    assert recorded_in_steps == 0
    assert recorded_between >= 2 and recorded_after_failure >= 2
    assert profiler_sees_operators()

    with xsp.trace(levels="model,layer,operator", sample=1.0, slow_factor=0,
                   output=tmp_path / "all.xsp.parquet"), torch.no_grad():
        for _ in range(40):
            model(inputs)
        recorded = observer.recorded()
    spans = xsp.load(tmp_path / "all.xsp.parquet").spans
    ops = spans[spans[col.LEVEL] == col.Level.OPERATOR.value]
    roots = spans[spans[col.LEVEL] == col.Level.MODEL.value]
    with_operators = set(roots[roots[col.LEVELED_RUN].astype(str).str.contains("operator")][col.STEP])
    assert with_operators and len(with_operators) < 40  # the rotation ran plans without operators too
    assert set(ops[col.STEP].dropna()) == with_operators
    assert recorded == len(ops)  # none recorded to be dropped
    assert profiler_sees_operators()


@needs_observer
def test_all_steps_means_the_steps_and_what_ran_outside_them_is_said_apart(tmp_path):
    """Weight initialisation inside the session ran before the first step: it is no operator of
    "all steps" (ResNet-50's aten::normal_ and aten::uniform_ were 58% of that table), and the
    report says what ran outside the steps, and where."""
    from rich.console import Console

    from xsp.reports.terminal import render_report

    with xsp.trace(levels="model,layer,operator", output=tmp_path / "init.xsp.parquet") as session:
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))  # aten::uniform_ here
        with torch.no_grad():
            for _ in range(3):
                model(torch.ones(2, 64))
    trace = session.trace
    ops = operators(trace)
    assert (ops[ops[col.NAME] == "aten::uniform_"][col.STEP].isna()).all()  # the initialisation: no step's
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console, top=30)
    out = console.export_text()
    table = out[out.index("by self time (all steps)", out.index("operator")):]
    table = table[:table.index("Outside every step")]
    assert "aten::uniform_" not in table and "aten::linear" in table
    flat = " ".join(out.replace("\n  ", " ").split())  # prose wraps at 80 columns
    assert "Outside every step, not in these figures:" in flat and "before the first step (model construction" in flat
    assert "ran outside every step: " in flat
