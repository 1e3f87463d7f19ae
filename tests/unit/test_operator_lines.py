"""Operators carry the user's line that issued them (xsp/record/operator_lines.py and its C trace
function): inside forward() too, tensor arithmetic included, the backward pass on its forward's
lines, each thread apart; never over another tool's trace function."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np
import pandas as pd
import pytest
import torch

import xsp
from tests.user_code import marked_line, user_module
from xsp.core import schema as col
from xsp.record import operator_lines
from xsp.record.operator_lines import OPERATOR_LINES_VARIABLE, LineChanges, operator_sites
from xsp.record.sites import NO_SITE, CallSites

needs_c = pytest.mark.skipif(operator_lines.LINES is None, reason="xsp.record._lines is not built")

USER_CODE = '''
import threading
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)  # LINEAR
        y = torch.relu(y)  # RELU
        z = y * 0.5 + 1  # ARITHMETIC
        return helper(z)  # HELPER CALL


def helper(z):
    w = z @ z.T  # MATMUL
    return z + w.sum()  # SUM


def worker(out):
    a = torch.ones(30, 30)  # WORKER ONES
    for _ in range(2):
        out.append((a @ a).sum())  # WORKER MATMUL


def run(model, x, training):
    out = []
    thread = threading.Thread(target=worker, args=(out,))
    thread.start()
    if training:
        loss = model(x).pow(2).mean()  # FORWARD
        loss.backward()  # BACKWARD
    else:
        with torch.no_grad():
            model(x)  # INFERENCE
    thread.join()
    return out
'''


@pytest.fixture()
def user(tmp_path: Path) -> ModuleType:
    return user_module(tmp_path / "user_code.py", USER_CODE, "user_code_for_operator_lines")


def operators(trace: xsp.Trace) -> pd.DataFrame:
    spans = trace.spans
    return spans[spans[col.LEVEL] == "operator"]


def line_of(ops: pd.DataFrame, name: str) -> set[int]:
    return set(ops.loc[ops[col.NAME] == name, col.CALL_LINE].dropna().astype(int).tolist())


@needs_c
def test_each_operator_has_the_line_inside_forward_that_issued_it(user, tmp_path):
    model, x = torch.nn.Sequential(user.Block(), user.Block()), torch.randn(4, 16)
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
        user.run(model, x, training=False)
    ops = operators(session.trace)
    main = ops[ops[col.THREAD_ID] == threading.get_native_id()]
    assert main[col.CALL_LINE].notna().all(), main[main[col.CALL_LINE].isna()][col.NAME].tolist()
    assert line_of(main, "aten::addmm") == {marked_line(user, "LINEAR")}
    assert line_of(main, "aten::relu") == {marked_line(user, "RELU")}
    # tensor arithmetic: no call event sees it, the line does
    assert line_of(main, "aten::mul") == {marked_line(user, "ARITHMETIC")}
    assert marked_line(user, "ARITHMETIC") in line_of(main, "aten::add")
    assert line_of(main, "aten::mm") == {marked_line(user, "MATMUL")}
    assert line_of(main, "aten::sum") == {marked_line(user, "SUM")}
    assert set(main[col.CALL_FILE].unique()) == {user.__file__}
    assert set(main[col.CALL_FUNCTION].unique()) == {"Block.forward", "helper"}
    # the worker thread's lines are its own
    worker = ops[ops[col.THREAD_ID] != threading.get_native_id()]
    assert line_of(worker, "aten::mm") == {marked_line(user, "WORKER MATMUL")}
    assert line_of(worker, "aten::ones") == {marked_line(user, "WORKER ONES")}
    # nothing is left behind: no trace function on any thread, none for threads to come
    assert sys.gettrace() is None and threading.gettrace() is None
    assert not operator_lines.LINES.traced_here()


@needs_c
def test_the_backward_pass_is_counted_on_its_forward_lines(user, tmp_path):
    model, x = user.Block(), torch.randn(4, 16)
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
        user.run(model, x, training=True)
    ops = operators(session.trace)
    main = ops[ops[col.THREAD_ID] == threading.get_native_id()]
    nodes = main[main[col.NAME].str.endswith("Backward0") & ~main[col.NAME].str.startswith("autograd::")]
    assert len(nodes) >= 4
    assert line_of(nodes[nodes[col.NAME] == "AddmmBackward0"], "AddmmBackward0") == {marked_line(user, "LINEAR")}
    assert line_of(nodes, "ReluBackward0") == {marked_line(user, "RELU")}
    assert line_of(nodes, "MmBackward0") == {marked_line(user, "MATMUL")}
    assert line_of(nodes, "PowBackward0") == {marked_line(user, "FORWARD")}
    # the operators a node runs are on its line, not on `loss.backward()`'s
    assert line_of(main, "aten::threshold_backward") == {marked_line(user, "RELU")}
    rows = xsp.analysis.lines(session.trace)
    assert set(rows["line"].astype(int)) >= {marked_line(user, m) for m in ("LINEAR", "RELU", "MATMUL")}


PRODUCTS_CODE = '''
import time
import torch

A, B, C = torch.randn(512, 512), torch.randn(384, 384), torch.randn(640, 640)
spent = {"ONCE": 0.0, "HELPER": 0.0, "LOOP": 0.0}
clock = time.perf_counter


def forward():
    t = clock()
    c = C @ C  # ONCE
    spent["ONCE"] += clock() - t
    twice(A)
    twice(A)
    for _ in range(3):
        t = clock()
        b = B @ B  # LOOP
        spent["LOOP"] += clock() - t


def twice(a):
    t = clock()
    b = a @ a  # HELPER
    spent["HELPER"] += clock() - t
    return b
'''


@needs_c
def test_each_line_inside_a_function_has_its_known_share(tmp_path):
    """Matrix products of set sizes on three lines (one in a helper called from two lines, one in
    a loop): each line's share of the products' time is the share the program's own clock gave
    it, in the same run. The products are large enough (milliseconds each) that what xsp does
    around each one, which the program's clock sees too, is no part of a share on a busy machine."""
    user = user_module(tmp_path / "products.py", PRODUCTS_CODE, "user_code_for_product_lines")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
            for _ in range(10):
                with xsp.step():
                    user.forward()
    finally:
        torch.set_num_threads(threads)
    rows = xsp.analysis.lines(session.trace)
    mine = rows[rows["file"] == user.__file__].set_index("line")
    products = [marked_line(user, marker) for marker in user.spent]
    measured = mine.loc[products, "self_ms"] / mine.loc[products, "self_ms"].sum()
    total = sum(user.spent.values())
    for marker, spent in user.spent.items():
        share = measured.loc[marked_line(user, marker)]
        assert abs(share - spent / total) <= 0.05, (marker, share, spent / total)
    assert mine.loc[marked_line(user, "HELPER"), "calls"] == 20
    assert mine.loc[marked_line(user, "LOOP"), "calls"] == 30
    assert mine.loc[marked_line(user, "HELPER"), "function"] == "twice"
    assert mine.loc[marked_line(user, "ONCE"), "function"] == "forward"


def test_an_operator_takes_the_line_current_at_its_middle():
    changes = LineChanges(times_ns={7: np.array([100, 200, 300])}, sites={7: np.array([4, 5, 4])})
    threads = np.array([7, 7, 7, 7, 8])
    starts = np.array([50, 190, 250, 400, 250])
    ends = np.array([90, 230, 260, 500, 260])
    got = operator_sites(changes, threads, starts, ends, np.full(5, np.nan), np.zeros(5, dtype=np.int64))
    # before the first change, none; an operator starting just before a change but mostly after it: the change's
    assert got.tolist() == [NO_SITE, 5, 5, 4, NO_SITE]


def test_backward_nodes_take_their_forward_operators_line_and_lend_it_to_what_they_run():
    # thread 1: forward ops (sequence 10 at line site 3, 11 at site 6); the backward runs on
    # thread 2 (autograd's), where no user line is current
    changes = LineChanges(times_ns={1: np.array([0, 150])}, sites={1: np.array([3, 6])})
    threads = np.array([1, 1, 1, 2, 2, 2, 2])
    starts = np.array([100, 120, 200, 1000, 1010, 1100, 1110])
    ends = np.array([140, 130, 250, 1090, 1080, 1190, 1150])
    sequence = np.array([10, 10, 11, 11, np.nan, 10, np.nan])
    forward_threads = np.array([0, 0, 0, 1, 0, 1, 0])
    got = operator_sites(changes, threads, starts, ends, sequence, forward_threads)
    assert got.tolist() == [3, 3, 6, 6, 6, 3, 3]


@needs_c
def test_switched_off_operators_take_the_line_of_their_call(user, tmp_path, monkeypatch):
    monkeypatch.setenv(OPERATOR_LINES_VARIABLE, "0")
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
        user.run(user.Block(), torch.randn(4, 16), training=False)
    ops = operators(session.trace)
    assert col.CALL_LINE not in ops or ops[col.CALL_LINE].isna().all()
    rows = xsp.analysis.lines(session.trace)  # on the model's and the layer's calls only
    assert set(rows["line"].astype(int)) == {marked_line(user, "INFERENCE"), marked_line(user, "LINEAR")}


@needs_c
def test_another_tools_trace_function_is_left_alone_and_the_trace_says_so(user, tmp_path):
    seen: list[str] = []

    def tool(frame, event, arg):  # a debugger's or coverage's
        seen.append(event)
        return None

    sys.settrace(tool)
    try:
        with pytest.warns(xsp.XspWarning, match="trace function is set already"):
            with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
                user.run(user.Block(), torch.randn(4, 16), training=False)
        assert sys.gettrace() is tool
    finally:
        sys.settrace(None)
    assert seen
    ops = operators(session.trace)
    assert col.CALL_LINE not in ops or ops[col.CALL_LINE].isna().all()
    assert any("trace function is set already" in said for said in session.warnings)


@needs_c
def test_a_tracer_cannot_follow_lines_while_another_does():
    first = operator_lines.OperatorLines(CallSites())
    second = operator_lines.OperatorLines(CallSites())
    assert first.start() is None
    try:
        assert second.start() is not None
    finally:
        first.stop()
    assert first.take().times_ns  # this thread's changes
    assert second.start() is None
    second.stop()
    second.take()
    assert not operator_lines.LINES.traced_here()


RACE_SCRIPT = """
import threading
from xsp.record import operator_lines
from xsp.record.sites import CallSites

holder = {}


def taken_out():  # on the program's new thread, at its first line: the session ends meanwhile
    if threading.current_thread() is threading.main_thread():
        return
    follower = holder.pop("follower")
    follower.stop()
    follower.take()  # the last reference to the C tracer goes with it


def helper(i):
    return i * 2


def user_work():
    return sum(helper(i) for i in range(1000))


holder["follower"] = operator_lines.OperatorLines(CallSites(), on_thread=taken_out)
assert holder["follower"].start() is None
worker = threading.Thread(target=user_work)
worker.start()
worker.join()
print("followed", "follower" not in holder)
"""


@needs_c
def test_a_thread_starting_as_the_lines_stop_runs_on(tmp_path):
    """A thread's first event runs Python (on_thread, and the code caches' misses); a session
    ending meanwhile takes the tracer out and drops it. The thread then runs on, untraced: it
    used to read the freed tracer and crash the program (1 run in 4 of `xsp run` with operators
    through PyTorch's profiler)."""
    script = tmp_path / "race.py"
    script.write_text(RACE_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["followed", "True"]


@needs_c
def test_compiled_and_scripted_operators_have_the_line_that_called_them(user, tmp_path):
    import torch._dynamo.utils as dynamo_utils

    def function(x):
        y = x @ x
        return torch.relu(y) * 2

    compiled = torch.compile(function, backend="eager")
    scripted = torch.jit.script(function)
    x = torch.randn(8, 8)
    compiled(x)
    frames = dict(dynamo_utils.counters["frames"])
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "t.xsp.parquet") as session:
        compiled(x)  # COMPILED CALL
        scripted(x)  # SCRIPTED CALL
    assert dict(dynamo_utils.counters["frames"]) == frames  # nothing more compiled
    here = Path(__file__).read_text().splitlines()
    compiled_line = next(n for n, t in enumerate(here, 1) if t.strip() == "compiled(x)  # COMPILED CALL")
    scripted_line = next(n for n, t in enumerate(here, 1) if t.strip() == "scripted(x)  # SCRIPTED CALL")
    ops = operators(session.trace)
    assert set(ops[col.CALL_FILE].dropna().unique()) == {__file__}
    assert line_of(ops, "aten::mm") == {compiled_line, scripted_line}
    assert line_of(ops, "aten::relu") == {compiled_line, scripted_line}
