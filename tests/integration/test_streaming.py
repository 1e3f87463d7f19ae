"""Streaming windows to disk: bounded memory on long runs, and files recovered after SIGKILL."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import xsp
import xsp.session.interpreting
import xsp.session.options
import xsp.session.session
import xsp.session.windows
from xsp.core import schema as col
from xsp.io.output_claim import writer_file
from xsp.io.segments import SEGMENT_PATTERN, UNFINISHED, UNFINISHED_MESSAGE, SegmentWriter, unfinished_sessions
from xsp.session.forked import ForkFailed, fork_available
from xsp.session.interpreting import WindowInterpreter
from xsp.tracers.layer import LayerTracer

KILLED = """
import os, signal, sys, time, torch, xsp
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
with torch.no_grad(), xsp.trace(output=sys.argv[1]):
    began = time.monotonic()
    while time.monotonic() - began < float(sys.argv[2]):
        model(torch.randn(2, 8))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".xsp-segments." in p.name or p.name.endswith(".partial")]


def _loop(model: nn.Module, steps: int) -> None:
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(2, 8))


@pytest.fixture
def short_windows(monkeypatch):
    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end


def test_a_streamed_run_writes_the_same_spans_as_one_kept_in_memory(tmp_path, short_windows):
    import pyarrow as pa

    pool = pa.default_memory_pool().backend_name
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as streamed:
        _loop(model, 30)
    with xsp.trace(output=None) as kept:
        _loop(model, 30)
    assert streamed.trace.metadata["closed_windows"] >= 10  # windows waiting together are written as one
    assert streamed.trace.metadata["streamed_windows"] >= 2
    assert kept.trace.metadata["streamed_windows"] == 0
    assert streamed.trace.source == tmp_path / "run.xsp.parquet"
    assert streamed.trace._spans is None  # read from the file only when asked for
    columns = [col.LEVEL, col.KIND, col.NAME, col.PATH, col.STEP, col.EXEC_INDEX, col.CALL_DEPTH]
    a, b = streamed.trace.spans, kept.trace.spans
    assert a[col.START_NS].is_monotonic_increasing
    pd.testing.assert_frame_equal(a[columns], b[columns])
    ids = set(a[col.SPAN_ID])
    parents = a[col.PARENT_ID].dropna()
    assert parents.isin(ids).all()  # windows link to spans of earlier windows (the session span)
    assert leftovers(tmp_path) == []
    if fork_available():  # interpreted beside the loop, by helper processes
        # not the first (it sets up, in this process, the C++ statics helpers would otherwise set
        # up under a lock a fork may have copied as held: test_helper_fork.py), nor the last (the
        # session's own, interpreted in this process once the block ended; not counted when empty)
        assert 1 <= streamed.trace.metadata["helper_windows"] <= streamed.trace.metadata["windows"] - 1
        # a helper takes Arrow's memory from the system allocator; this process keeps its own
        assert pa.default_memory_pool().backend_name == pool


def _train_eager(steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        with xsp.span("prepare"):  # after the last optimizer step, before the model: the next step's
            batch = torch.randn(4, 8)
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()


def _train_raw_tensors(steps: int) -> None:
    """No module xsp sees (as a compiled training function, whose model runs in compiled code):
    each iteration's first event is its backward pass."""
    torch.manual_seed(0)
    weight = torch.randn(8, 1, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        (torch.randn(4, 8) @ weight).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("train", [_train_eager, _train_raw_tensors])
def test_a_training_loop_streamed_keeps_each_iteration_in_its_step(tmp_path, short_windows, train):
    """A window taken as a training step is decided (the next iteration has begun: its input,
    or its backward pass where no model call is seen) leaves that iteration's records with its
    own step, as a run kept whole places them."""
    with xsp.trace(levels="model,layer,operator", output=tmp_path / "run.xsp.parquet") as streamed:
        train(4)
    with xsp.trace(levels="model,layer,operator", output=None) as kept:
        train(4)
    assert streamed.trace.metadata["closed_windows"] >= 3
    columns = [col.LEVEL, col.KIND, col.NAME, col.PATH, col.STEP]
    a, b = (trace.spans.sort_values(col.START_NS, kind="stable").reset_index(drop=True)[columns]
            for trace in (streamed.trace, kept.trace))
    pd.testing.assert_frame_equal(a, b)
    for spans in (a, b):
        marked = spans[spans[col.NAME].isin(["prepare", "backward"]) | (spans[col.KIND] == "optimizer")]
        assert marked[col.STEP].iloc[1 if train is _train_eager else 0:].notna().all()  # (the first step
        # of a loop whose model xsp sees begins at its first call: the first "prepare" is before it)
        assert sorted(spans[col.STEP].dropna().unique()) == [0, 1, 2, 3]
        assert (marked[marked[col.NAME] == "backward"][col.STEP].tolist() == [0, 1, 2, 3])  # the first one too


def test_windows_are_interpreted_in_this_process_when_asked_or_when_a_helper_fails(tmp_path, short_windows,
                                                                                  monkeypatch):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    monkeypatch.setenv(xsp.session.windows.HELPER_ENV, "0")
    with xsp.trace(output=tmp_path / "thread.xsp.parquet") as asked:
        _loop(model, 30)
    monkeypatch.delenv(xsp.session.windows.HELPER_ENV)

    def fails(function, deadline_s, ending=None):
        raise ForkFailed("fork failed: no memory")

    monkeypatch.setattr(xsp.session.windows, "run_forked", fails)
    with pytest.warns(xsp.XspWarning, match="helper process could not interpret a window") as said:
        with xsp.trace(output=tmp_path / "fallback.xsp.parquet") as fallback:
            _loop(model, 30)
    assert len([w for w in said if "helper" in str(w.message)]) <= 1  # said once, not per window
    for session in (asked, fallback):
        assert session.trace.metadata["helper_windows"] == 0
        assert session.trace.metadata["closed_windows"] >= 10 and session.trace.metadata["streamed_windows"] >= 2
        assert session.trace.steps == list(range(30))


def _timed_loop(model: nn.Module, seconds: float, until: Callable[[], bool] = lambda: True) -> int:
    """Steps 10 ms apart for ``seconds``, then until ``until()`` (at most 60 s): on a busy machine
    the windows, and the helpers they fork, come later than the steps' seconds say. The steps made."""
    began, made = time.monotonic(), 0
    with torch.no_grad():
        while time.monotonic() - began < 60:
            model(torch.randn(2, 8))
            made += 1
            time.sleep(0.01)
            if time.monotonic() - began >= seconds and until():
                break
    return made


@pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")
def test_a_helper_that_failed_once_is_tried_again_later(tmp_path, short_windows, monkeypatch):
    """One helper failing (a fork refused while memory was short) moves the windows into the
    program's process for a while only: a service running for days gets its helpers back."""
    real_run_forked, calls = xsp.session.windows.run_forked, []

    def fails_the_second(function, deadline_s, ending=None):
        calls.append(deadline_s)
        if len(calls) == 2:
            raise ForkFailed("fork failed: no memory")
        return real_run_forked(function, deadline_s, ending)

    monkeypatch.setattr(xsp.session.windows, "run_forked", fails_the_second)
    monkeypatch.setattr(xsp.session.windows, "HELPER_RETRY_FIRST_S", 0.3)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with pytest.warns(xsp.XspWarning, match=r"helper process could not interpret a window \(fork failed: no memory\); "
                                            r"windows are interpreted in this process, and a helper is tried again "
                                            r"in 0.3 s") as said:
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            _timed_loop(model, 1.5, lambda: len(calls) >= 3)
    assert len([w for w in said if "helper" in str(w.message)]) == 1
    meta = session.trace.metadata
    assert meta["helper_failures"] == 1 and len(calls) >= 3, (meta, calls)
    assert meta["helper_windows"] == len(calls) - 1  # every window after the wait went to a helper again
    assert session.trace.steps == list(range(len(session.trace.steps)))


@pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")
@pytest.mark.parametrize("raised, after_it_ran", [(TypeError, False), (AttributeError, True)])
def test_a_helper_that_failed_unforeseen_leaves_every_window_whole(tmp_path, short_windows, monkeypatch, raised,
                                                                     after_it_ran):
    """Something other than ForkFailed raised where a helper runs (a benchmark's wrapper, before or
    after the helper had run): the windows thread ended there, and every window after it was lost,
    with a traceback and no warning. It is a helper's failure: said once, the window interpreted here."""
    real_run_forked, calls = xsp.session.windows.run_forked, []

    def raises_the_second(function, deadline_s, ending=None):
        calls.append(deadline_s)
        if len(calls) == 2 and not after_it_ran:
            raise raised("counted() takes 2 positional arguments but 3 were given")
        result = real_run_forked(function, deadline_s, ending)
        if len(calls) == 2:
            raise raised("'NoneType' object has no attribute 'records'")
        return result

    monkeypatch.setattr(xsp.session.windows, "run_forked", raises_the_second)
    monkeypatch.setattr(xsp.session.windows, "HELPER_RETRY_FIRST_S", 0.3)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    said_once = rf"helper process could not interpret a window \({raised.__name__}: "
    with pytest.warns(xsp.XspWarning, match=said_once) as said:
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            made = _timed_loop(model, 1.5, lambda: len(calls) >= 3)
    assert len([w for w in said if "helper" in str(w.message)]) == 1
    meta = session.trace.metadata
    assert meta["helper_failures"] == 1 and len(calls) >= 3 and meta["helper_windows"] >= 1, (meta, calls)
    assert session.trace.steps == list(range(made))  # every step once, the failed window's too


@pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")
def test_a_window_whose_helper_ran_but_could_not_be_taken_over_is_said_and_the_windows_go_on(tmp_path, short_windows,
                                                                                            monkeypatch):
    real_adopt, adopted = WindowInterpreter.adopt, []

    def fails_the_second(self, result):
        adopted.append(result)
        if len(adopted) == 2:
            raise KeyError("segments")
        return real_adopt(self, result)

    monkeypatch.setattr(WindowInterpreter, "adopt", fails_the_second)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with pytest.warns(xsp.XspWarning, match=r"what a helper process learnt of a window could not be taken over "
                                            r"\(KeyError: 'segments'\): that window's spans may be missing") as said:
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            _timed_loop(model, 1.5, lambda: len(adopted) >= 3)
    assert len([w for w in said if "taken over" in str(w.message)]) == 1
    assert len(adopted) >= 3 and session.trace.metadata["helper_windows"] == len(adopted) - 1
    assert len(session.trace.steps) > 0


@pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")
def test_helpers_that_keep_failing_are_tried_less_and_less_often(tmp_path, short_windows, monkeypatch):
    calls: list[float] = []

    def fails(function, deadline_s, ending=None):
        calls.append(time.monotonic())
        raise ForkFailed("fork failed: no memory")

    monkeypatch.setattr(xsp.session.windows, "run_forked", fails)
    monkeypatch.setattr(xsp.session.windows, "HELPER_RETRY_FIRST_S", 0.1)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with pytest.warns(xsp.XspWarning, match="helper process could not interpret a window") as said:
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            _timed_loop(model, 1.6, lambda: len(calls) >= 2)
    assert len([w for w in said if "helper" in str(w.message)]) == 1  # said once, counted in the file
    assert session.trace.metadata["helper_failures"] == len(calls) >= 2
    gaps = [later - earlier for earlier, later in zip(calls, calls[1:])]
    assert all(gap >= 0.1 * 2 ** i for i, gap in enumerate(gaps)), gaps  # each wait twice the one before
    assert session.trace.metadata["helper_windows"] == 0 and session.trace.metadata["closed_windows"] > len(calls)


@pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")
def test_what_a_helper_process_finds_wrong_is_said_by_the_program(tmp_path, short_windows, monkeypatch):
    def broken(self, window):
        raise RuntimeError("layer rows broke")

    monkeypatch.setattr(LayerTracer, "collect", broken)  # the forked helpers inherit it
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with pytest.warns(xsp.XspWarning, match="tracer layer failed while collecting its spans.*layer rows broke"):
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            _loop(model, 20)
    assert session.trace.metadata["helper_windows"] >= 1 and session.trace.metadata["closed_windows"] >= 5
    assert any("layer rows broke" in message for message in session.trace.metadata["warnings"])
    spans = session.trace.spans
    assert set(spans[col.LEVEL]) == {"model"} and session.trace.steps == list(range(20))


@pytest.mark.heavy
def test_memory_holds_a_window_not_the_run(tmp_path, short_windows):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(50)])
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        _loop(model, 200)
        gc.collect()
        held = sum(len(t) for t in session.run.interpreter.tables)
    assert held == 0  # every window went to disk
    assert xsp.load(tmp_path / "run.xsp.parquet").steps == list(range(200))


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_a_killed_run_is_recovered_with_its_closed_windows(tmp_path):
    script, output = tmp_path / "killed.py", tmp_path / "run.xsp.parquet"
    script.write_text(KILLED)
    done = subprocess.run([sys.executable, str(script), str(output), "4"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert not output.exists()
    assert len(unfinished_sessions(output)) == 1
    assert writer_file(output).exists()  # the killed run's claim on its name
    unfinished = xsp.load(output)  # read from the windows while no file exists
    assert unfinished.metadata["recovered"]["windows"] >= 1
    assert len(unfinished.steps) > 100
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True,
                               text=True, timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    assert "recovered" in recovered.stderr and recovered.stderr.count("\n") == 1
    trace = xsp.load(output)
    assert trace.metadata["interrupted"] == UNFINISHED
    session = trace.spans[trace.spans[col.KIND] == "session"]
    assert session[col.STATUS].tolist() == ["error"] and session[col.STATUS_MESSAGE].tolist() == [UNFINISHED_MESSAGE]
    assert trace.spans[col.PARENT_ID].dropna().isin(set(trace.spans[col.SPAN_ID])).all()
    assert len(trace.steps) == len(unfinished.steps)
    assert leftovers(tmp_path) == []
    assert not writer_file(output).exists()  # its holder is dead: recover gave the name back
    again = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.startswith("xsp: error: nothing to recover")


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_a_damaged_window_is_left_out_and_said(tmp_path):
    script, output = tmp_path / "killed.py", tmp_path / "run.xsp.parquet"
    script.write_text(KILLED)
    subprocess.run([sys.executable, str(script), str(output), "3"], capture_output=True, timeout=120)
    folder = unfinished_sessions(output)[0][0]
    first = sorted(folder.glob(SEGMENT_PATTERN))[0]
    first.write_bytes(first.read_bytes()[:100])
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output), "-o",
                                str(tmp_path / "other.xsp.parquet")], capture_output=True, text=True)
    assert recovered.returncode == 0 and "1 damaged window(s) left out" in recovered.stderr
    assert xsp.load(tmp_path / "other.xsp.parquet").metadata["recovered"]["unreadable_segments"]


def test_a_folder_that_cannot_hold_windows_keeps_them_in_memory(tmp_path, short_windows, monkeypatch):
    def refuse(self, metadata):
        raise PermissionError("no room for windows")

    monkeypatch.setattr(SegmentWriter, "start", refuse)
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.warns(xsp.XspWarning, match="windows are kept in memory"):
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            _loop(model, 20)
    assert xsp.load(tmp_path / "run.xsp.parquet").steps == list(range(20))
    assert session.trace.metadata["streamed_windows"] == 0


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_the_cli_records_only_scheduled_steps(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\nfor _ in range(12):\n"
                      "    model(torch.randn(2, 4))\nprint('done')\n")
    output = tmp_path / "run.xsp.parquet"
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", str(output), "--schedule",
                           "wait=2,active=2,repeat=2", "--", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("done")
    assert xsp.load(output).steps == [2, 3, 6, 7]
    bad = subprocess.run([sys.executable, "-m", "xsp", "run", "--schedule", "active=0", "--", str(script)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "active" in bad.stderr


def test_a_window_closes_after_so_many_records_however_fast_they_come(tmp_path, monkeypatch):
    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 3600.0)
    monkeypatch.setattr(xsp.session.options, "WINDOW_EVENTS", 1000)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(99)])
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        _loop(model, 60)  # 6000 records
    assert 5 <= session.trace.metadata["closed_windows"] <= 7
    assert session.trace.steps == list(range(60))


def _thread_per_request(model: nn.Module, requests: int) -> None:
    def serve() -> None:
        with torch.no_grad():
            model(torch.randn(2, 8))

    for _ in range(requests):
        thread = threading.Thread(target=serve, name="request")
        thread.start()
        thread.join()


@pytest.mark.parametrize("schedule", [None, "wait=1,active=1"])
def test_a_thread_per_request_server_leaves_no_buffer_per_thread_behind(tmp_path, short_windows, schedule):
    """Each thread's only step is decided once the thread has ended: a window (which a new
    thread's first record makes due too) takes it, and the thread's buffer is let go."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    requests = 40
    with xsp.trace(output=tmp_path / "server.xsp.parquet", schedule=schedule) as session:
        _thread_per_request(model, requests)
        recording = session.recording
        assert recording is not None
        left = len(recording.buffers)
    assert left <= 3  # this thread, the last request's, and one a window had not yet seen end
    assert len(session.run.interpreter.state.latest_step) <= 3  # nor what windows keep per thread for the next
    spans = session.trace.spans
    predicts = spans[spans[col.KIND] == col.SpanKind.PREDICT.value]
    assert len(predicts) == (requests if schedule is None else requests // 2)
    assert predicts[col.STEP].is_unique
    assert (spans[col.LEVEL] == col.Level.LAYER.value).sum() == 3 * len(predicts)
    threads = session.trace.metadata["threads"]
    assert "request" in threads.values() and len(threads) >= 2
    assert not session.trace.metadata["dropped"]


def test_windows_that_wait_are_interpreted_as_one_so_the_backlog_stays_one_window(tmp_path, short_windows,
                                                                                 monkeypatch):
    """On a machine too busy for the windows to keep pace, a kill lost more and more of the run;
    windows waiting now go together, so what waits stays about one window."""
    prepare = xsp.session.interpreting.WindowInterpreter.prepare
    slow_once = threading.Event()

    def slow_first(self, window):
        if not slow_once.is_set():
            slow_once.set()
            time.sleep(1.0)  # the worker falls behind while the loop closes windows
        prepare(self, window)

    monkeypatch.setattr(xsp.session.interpreting.WindowInterpreter, "prepare", slow_first)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        for _ in range(30):
            model(torch.randn(2, 8))
            time.sleep(0.05)
    meta = session.trace.metadata
    assert meta["closed_windows"] >= 20 and meta["windows"] <= meta["closed_windows"] - 10
    assert xsp.load(tmp_path / "run.xsp.parquet").steps == list(range(30))


LIVE = """
import os, sys, time, torch, xsp
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
with torch.no_grad(), xsp.trace(output=sys.argv[1], window_s=0.1):
    for _ in range(100):
        model(torch.randn(2, 8))
        time.sleep(0.005)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
"""


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_recover_refuses_a_run_still_running_and_takes_none_of_its_windows(tmp_path):
    """`xsp recover` of a live run took its windows (its first steps were then missing from the
    file it wrote at its end, over the "recovered" one) and said it had recovered a run that did
    not finish."""
    script, output, stop = tmp_path / "live.py", tmp_path / "run.xsp.parquet", tmp_path / "stop"
    script.write_text(LIVE)
    live = subprocess.Popen([sys.executable, str(script), str(output), str(stop)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        waited_until = time.monotonic() + 120
        while not unfinished_sessions(output) and time.monotonic() < waited_until:
            time.sleep(0.05)
        refused = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True,
                                 text=True, timeout=120)
    finally:
        stop.touch()
        _, err = live.communicate(timeout=120)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"(process {live.pid}) is still running" in refused.stderr
    assert live.returncode == 0, err
    assert xsp.load(output).steps == list(range(100))
