"""Stopping signals, two sessions at once and fork: the file is finished, the first session
undisturbed, the parent's file never written over."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import xsp
from xsp.core import schema as col

LOOP = """
import os, signal, sys, time, torch, xsp
model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])
{setup}
with xsp.trace(output=sys.argv[1]):
    step = 0
    while {condition}:
        with torch.no_grad():
            model(torch.randn(2, 8))
        step += 1
        if step == 50:
            print("ready", flush=True)
        time.sleep(0.001)
print("after the block", flush=True)
"""


def _stop_signals_as(disposition: signal.Handlers) -> None:
    """In the child, before it runs: the stopping signals' disposition the test needs, whatever
    the test run inherited (``nohup`` and CI runners leave SIGHUP ignored, and an ignored signal
    stays ignored across exec)."""
    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, disposition)


def start(tmp_path: Path, setup: str = "", condition: str = "True", cli: bool = False,
          ignored: tuple[signal.Signals, ...] = ()) -> subprocess.Popen[str]:
    """The loop script, running until it is ready; ``ignored``: signals its parent left ignored."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup=textwrap.dedent(setup), condition=condition))
    output = tmp_path / "run.xsp.parquet"
    if cli:
        plain = script.read_text().replace("with xsp.trace(output=sys.argv[1]):", "if True:")
        script.write_text(plain)
        argv = [sys.executable, "-m", "xsp", "run", "-o", str(output), "--", str(script), str(output)]
    else:
        argv = [sys.executable, str(script), str(output)]
    def dispositions() -> None:
        _stop_signals_as(signal.SIG_DFL)
        for signum in ignored:
            signal.signal(signum, signal.SIG_IGN)

    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=dispositions)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready", process.stderr.read() if process.stderr else ""
    return process


def finished(process: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str, str]:
    """The child's status and output; a child still running after ``timeout_s`` is killed (never
    left to run on after the test) and the test fails."""
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the child ran past {timeout_s:.0f} s and was killed; it said: {err[-2000:]}")
    return process.returncode, out, err


def test_a_signal_the_parent_left_ignored_stays_ignored(tmp_path):
    # nohup's SIGHUP: the program would have run on, and runs on under xsp, to its block's end
    process = start(tmp_path, condition="step < 400", ignored=(signal.SIGHUP,))
    process.send_signal(signal.SIGHUP)
    status, out, err = finished(process)
    assert status == 0 and "after the block" in out, err
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.metadata["signals"] == [] and len(trace.steps) == 400


def no_partial(tmp_path: Path) -> bool:
    return not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pytest.fixture(params=["inherited", "ignored by the test run"])
def test_run_signals(request):
    """The test run's own stopping signals as it found them, or ignored (as under ``nohup``):
    the children's must not depend on them."""
    if request.param == "inherited":
        yield
        return
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGHUP, signal.SIGTERM)}
    for signum in saved:
        signal.signal(signum, signal.SIG_IGN)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.heavy)])
@pytest.mark.parametrize("cli", [False, True], ids=["xsp.trace", "xsp run"])
def test_a_stopping_signal_finishes_the_file_then_ends_the_process_by_it(tmp_path, signum, cli, test_run_signals):
    process = start(tmp_path, cli=cli)
    process.send_signal(signum)
    status, out, err = finished(process)
    assert status == -signum, err
    assert "after the block" not in out and "Traceback" not in err
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.metadata["signals"] == [signal.Signals(signum).name]
    assert len(trace.steps) >= 50
    session = trace.spans[trace.spans[col.KIND] == "session"].iloc[0]
    assert session[col.STATUS] == "error" and signal.Signals(signum).name in session[col.STATUS_MESSAGE]
    assert f"interrupted by {signal.Signals(signum).name}" in err
    if cli:  # the closing line says what was written, as a run that ends by itself does
        assert f"steps -> {tmp_path / 'run.xsp.parquet'}" in err or "steps -> run.xsp.parquet" in err, err
    assert no_partial(tmp_path)


def _namespace_init_possible() -> bool:
    """Whether this machine lets a test run a process as its own PID namespace's init."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    done = subprocess.run([unshare, "-fp", "--mount-proc", "true"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not _namespace_init_possible(), reason="no unshare, or no right to make a PID namespace here")
@pytest.mark.parametrize("cli", [False, True], ids=["xsp.trace", "xsp run"])
def test_a_sigterm_to_a_containers_pid_1_is_ignored_as_without_xsp(tmp_path, cli):
    """A container's program run without an init is PID 1, to which the kernel delivers no SIGTERM
    left at its default: plainly it runs on. xsp raised its own Terminated, and after writing the
    file could not end the process by the signal either: a traceback and status 1."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(setup="", condition="step < 400"))
    output = tmp_path / "run.xsp.parquet"
    argv = [sys.executable, str(script), str(output)]
    if cli:
        script.write_text(script.read_text().replace("with xsp.trace(output=sys.argv[1]):", "if True:"))
        argv = [sys.executable, "-m", "xsp", "run", "-o", str(output), "--", str(script), str(output)]
    process = subprocess.Popen([shutil.which("unshare") or "unshare", "-fp", "--mount-proc", *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: _stop_signals_as(signal.SIG_DFL))
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    init = int(Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()[0])
    os.kill(init, signal.SIGTERM)
    status, out, err = finished(process)
    assert status == 0 and "after the block" in out and "Traceback" not in err, err
    trace = xsp.load(output)
    assert len(trace.steps) == 400 and trace.metadata["signals"] == ["SIGTERM"]


def test_the_programs_own_handler_still_decides(tmp_path):
    setup = """
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: (stop.append(signum), print("handled", flush=True)))
    """
    process = start(tmp_path, setup=setup, condition="not stop")
    process.send_signal(signal.SIGTERM)
    status, out, err = finished(process)
    assert status == 0, err
    assert "handled" in out and "after the block" in out
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.metadata["signals"] == ["SIGTERM"]
    session = trace.spans[trace.spans[col.KIND] == "session"].iloc[0]
    assert session[col.STATUS] == "ok"


def test_ctrl_c_twice_still_leaves_a_complete_file(tmp_path):
    """The second Ctrl-C comes while the file is being written: it is held back."""
    setup = """
    big = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(2000)])
    """
    script_condition = "True"
    process = start(tmp_path, setup=setup, condition=script_condition)
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    status, out, err = finished(process)
    assert status == -signal.SIGINT, err  # how python ends on an uncaught KeyboardInterrupt
    assert "KeyboardInterrupt" in err
    assert "xsp" not in err.split("KeyboardInterrupt")[0].split("Traceback")[-1], err  # the program's lines only
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert "SIGINT" in trace.metadata["signals"]
    assert len(trace.steps) >= 50
    assert no_partial(tmp_path)


def test_a_second_session_in_another_thread_never_disturbs_the_first(tmp_path):
    model = torch.nn.Linear(4, 4)
    barrier = threading.Barrier(2)
    sessions: dict[str, xsp.Session] = {}
    refused_done = threading.Event()

    def run(name: str) -> None:
        session = xsp.trace(output=tmp_path / f"{name}.xsp.parquet")
        barrier.wait()
        with session:
            barrier.wait()
            for _ in range(200):
                with torch.no_grad():
                    model(torch.randn(2, 4))
            refused = session._nested is not None
            if not refused:  # the first session ends last, so that it holds the joined block's span
                assert refused_done.wait(60)
        if refused:
            refused_done.set()
            sessions["joined"] = session
        else:
            sessions["first"] = session

    with pytest.warns(xsp.XspWarning, match="already active .*started in thread"):
        threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    first, joined = sessions["first"], sessions["joined"]
    trace = first.trace
    assert trace is not None
    predicts = trace.spans[trace.spans[col.KIND] == "predict"]
    assert len(predicts) == 400  # both threads' calls, none cut short
    assert trace.metadata["dropped"] == {}
    assert (trace.spans[col.NAME] == "xsp.trace").sum() == 1  # the joined block, as a span of the first
    # the joined block has a trace and a file of its own: its own thread's calls, all of them
    assert joined.trace is not None and joined.output is not None and joined.output.exists()
    own = xsp.load(joined.output)
    own_predicts = own.spans[own.spans[col.KIND] == "predict"]
    assert len(own_predicts) == 200 and own_predicts[col.THREAD_ID].nunique() == 1
    assert (own.spans[col.NAME] == "xsp.trace").sum() == 0 and (own.spans[col.KIND] == "session").sum() == 1
    assert len(own.steps) == 200 and own.metadata["dropped"] == {}


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_a_forked_child_never_writes_over_the_parents_file(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch, xsp
        model = torch.nn.Linear(4, 4)
        with xsp.trace(output=sys.argv[1]):
            for _ in range(5):
                model(torch.randn(2, 4))
            pid = os.fork()
            for _ in range(30 if pid == 0 else 10):
                model(torch.randn(2, 4))
        if pid == 0:
            print("child", flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", flush=True)
    """))
    output = tmp_path / "run.xsp.parquet"
    for _ in range(3):
        result = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert "child" in result.stdout and "parent" in result.stdout
        trace = xsp.load(output)
        assert len(trace.steps) == 15  # the parent's calls only
        assert no_partial(tmp_path)


OS_EXIT = """
import os, sys, torch, xsp
model = torch.nn.Linear(4, 4)
session = xsp.trace(output=sys.argv[1])
session.__enter__()
for _ in range(7):
    model(torch.randn(2, 4))
if os.fork() == 0:  # a child ending by os._exit writes nothing (the parent's session is not its own)
    model(torch.randn(2, 4))
    os._exit(0)
os.wait()
print("done", flush=True)
os._exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("status", [0, pytest.param(3, marks=pytest.mark.heavy)])
def test_os_exit_ends_the_session_and_writes_the_file(tmp_path, status):
    script = tmp_path / "ends.py"
    script.write_text(OS_EXIT)
    output = tmp_path / "run.xsp.parquet"
    result = subprocess.run([sys.executable, str(script), str(output), str(status)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == status and result.stdout == "done\n", result.stderr
    assert result.stderr == ""  # os._exit is the program's own way to end: nothing to warn about
    trace = xsp.load(output)
    assert len(trace.steps) == 7 and trace.metadata["ended_by"] == f"os._exit({status})"
    session = trace.spans[trace.spans[col.KIND] == "session"]
    assert session[col.STATUS].tolist() == ["ok" if status == 0 else "error"]
    assert no_partial(tmp_path)


def test_xsp_run_says_what_it_wrote_when_the_script_ends_by_os_exit(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(OS_EXIT.replace("session.__enter__()", "").replace("session = xsp.trace(output=sys.argv[1])",
                                                                            ""))
    result = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "run.xsp.parquet", "--", str(script), "x",
                             "4"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 4 and result.stdout == "done\n", result.stderr
    assert "xsp: " in result.stderr and "7 steps -> run.xsp.parquet" in result.stderr
    assert len(xsp.load(tmp_path / "run.xsp.parquet").steps) == 7


def test_a_refused_session_that_outlives_the_first_records_the_rest_itself(tmp_path):
    model = torch.nn.Linear(4, 4)
    first_done, second_inside, five_done = threading.Event(), threading.Event(), threading.Event()
    sessions: dict[str, xsp.Session] = {}

    def second() -> None:
        with xsp.trace(output=tmp_path / "second.xsp.parquet") as session:
            second_inside.set()
            for _ in range(5):  # while the first session runs: recorded by it
                model(torch.randn(2, 4))
            five_done.set()
            assert first_done.wait(60)
            for _ in range(7):  # after the first session ended: recorded by this one, not lost
                model(torch.randn(2, 4))
        sessions["second"] = session

    with pytest.warns(xsp.XspWarning) as said:
        with xsp.trace(output=tmp_path / "first.xsp.parquet") as first:
            worker = threading.Thread(target=second)
            worker.start()
            assert second_inside.wait(60)
            model(torch.randn(2, 4))
            assert five_done.wait(60)
        first_done.set()
        worker.join()
    messages = [str(w.message) for w in said]
    assert any("already active" in m for m in messages) and any("records from now on" in m for m in messages)
    first_predicts = first.trace.spans[first.trace.spans[col.KIND] == "predict"]
    # the second's fifth call is a step still open when the first ended (its next call could join
    # it): it goes on, whole, into the second's trace, with the calls after the hand-over
    assert len(first_predicts) == 1 + 4
    second_trace = xsp.load(tmp_path / "second.xsp.parquet")
    # the second's trace holds its own calls from its start, the first four too
    assert (second_trace.spans[col.KIND] == "predict").sum() == 5 + 7
    assert len(second_trace.steps) == 5 + 7
    assert first.trace.metadata["dropped"] == {} and second_trace.metadata["dropped"] == {}


SAME_OUTPUT = """
import sys, time, torch, xsp
model = torch.nn.Linear(4, 4)
with xsp.trace(output=sys.argv[1]) as session:
    for _ in range(int(sys.argv[2])):
        model(torch.randn(2, 4))
        time.sleep(0.05)
print(session.output)
"""


@pytest.mark.heavy
def test_two_runs_writing_one_name_at_once_both_keep_their_trace(tmp_path):
    script = tmp_path / "same.py"
    script.write_text(SAME_OUTPUT)
    runs = [subprocess.Popen([sys.executable, str(script), "run.xsp.parquet", str(steps)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for steps in (40, 30)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    written = sorted(Path(out.strip()).name for out, _ in outputs)
    assert written == ["run-2.xsp.parquet", "run.xsp.parquet"], outputs
    said = "".join(err for _, err in outputs)
    assert "run.xsp.parquet; this one writes" in said and "run-2.xsp.parquet instead" in said
    steps = sorted(int((xsp.load(tmp_path / name).spans[col.KIND] == "predict").sum()) for name in written)
    assert steps == [30, 40]
    assert not list(tmp_path.glob(".*xsp-writer"))  # claims given back


def test_a_claim_left_by_a_dead_process_is_taken_over(tmp_path):
    from xsp.io.output_claim import writer_file

    output = tmp_path / "run.xsp.parquet"
    writer_file(output).write_text(f"{__import__('socket').gethostname()}\n999999999\n")
    with xsp.trace(output=output) as session:
        torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert session.output == output and output.exists() and not writer_file(output).exists()


SERVES = """
import sys, time, torch, xsp
model = torch.nn.Linear(4, 4)
with xsp.trace(output=sys.argv[1]):
    began = time.monotonic()
    while time.monotonic() - began < float(sys.argv[2]):  # windows close about once a second, streamed
        model(torch.randn(2, 4))
        time.sleep(0.002)
"""


@pytest.mark.skipif(not _namespace_init_possible(), reason="no unshare, or no right to make a PID namespace here")
@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_a_run_restarted_with_the_killed_runs_process_id_keeps_its_windows_for_recover(tmp_path):
    """A container restarted after an OOM kill runs its program as PID 1 again, with the same
    output: the restarted run deleted the killed run's windows (its folder is named by the
    process id), and `xsp recover` had nothing left."""
    output, script = tmp_path / "svc.xsp.parquet", tmp_path / "serve.py"
    script.write_text(SERVES)
    as_init = [shutil.which("unshare") or "unshare", "-fp", "--mount-proc", sys.executable, str(script), str(output)]
    killed = subprocess.Popen([*as_init, "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".svc.xsp.parquet.xsp-segments.1/window-*.arrow")):
            assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
            time.sleep(0.1)
        time.sleep(1.5)  # a window more
    finally:  # an OOM kill, from outside (its own namespace cannot SIGKILL its init)
        os.kill(int(Path(f"/proc/{killed.pid}/task/{killed.pid}/children").read_text().split()[0]), signal.SIGKILL)
        killed.communicate(timeout=60)
    restarted = subprocess.run([*as_init, "0.3"], capture_output=True, text=True, timeout=120)
    assert restarted.returncode == 0, restarted.stderr
    assert "left its windows without writing it" in restarted.stderr, restarted.stderr
    assert "svc-2.xsp.parquet instead" in restarted.stderr
    assert not output.exists() and xsp.load(tmp_path / "svc-2.xsp.parquet").steps
    cli = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True, text=True,
                         timeout=120)  # from outside the killed run's namespace, where process 1 is another
    assert cli.returncode == 0, cli.stderr
    recovered = xsp.load(output)
    assert len(recovered.steps) > 10 and recovered.metadata["interrupted"] == "ended_before_session"


def test_only_a_dead_holders_claim_is_forgotten(tmp_path):
    import socket

    from xsp.io.output_claim import forget_dead_claim, writer_file

    output = tmp_path / "run.xsp.parquet"
    assert not forget_dead_claim(output)  # no claim
    for holder in (os.getppid(), os.getpid()):  # a live process's, this one's own: kept
        writer_file(output).write_text(f"{socket.gethostname()}\n{holder}\n")
        assert not forget_dead_claim(output) and writer_file(output).exists()
    writer_file(output).write_text("another-host\n999999999\n")  # another machine's: cannot be told dead
    assert not forget_dead_claim(output) and writer_file(output).exists()
    writer_file(output).write_text(f"{socket.gethostname()}\n999999999\n")
    assert forget_dead_claim(output) and not writer_file(output).exists()


# Sessions in several threads: every call of every thread is kept in the file of the block that
# made it (a block that joined another session's has a file of its own: issue 59, item 4), each
# call once in each file that has it, and each model named as its code calls it (issue 43).

THREAD_CALLS = 200


def _thread_predicts(path, thread_id):
    spans = xsp.load(path).spans
    return spans[(spans[col.KIND] == "predict") & (spans[col.THREAD_ID] == thread_id)]


def _check_thread(files, own, thread_id, calls_made=THREAD_CALLS):
    """Every call of the thread in its own block's file, each its own step there, never twice in
    a file, never a layer as a model, and in the thread's own file its model named as its code
    binds it; a call in another file is one of the same calls."""
    assert own.exists()
    own_starts = np.sort(_thread_predicts(own, thread_id)[col.START_NS].to_numpy(dtype=np.int64))
    assert len(np.unique(own_starts)) == calls_made
    for path in files:
        if not path.exists():
            continue
        calls = _thread_predicts(path, thread_id)
        assert calls[col.START_NS].is_unique
        # each file maps the host clock to epoch time by its own measurement (a few ns apart)
        starts = calls[col.START_NS].to_numpy(dtype=np.int64)
        nearest = np.clip(np.searchsorted(own_starts, starts), 1, len(own_starts) - 1)
        gap = np.minimum(np.abs(own_starts[nearest] - starts), np.abs(own_starts[nearest - 1] - starts))
        assert (gap < 10_000).all()
        assert calls[col.STEP].nunique() == len(calls)  # the thread's own steps, one per call
        names = set(calls[col.NAME])
        assert all(re.fullmatch(r"model|Sequential_\d+", name) for name in names), names  # no Linear_k
        if path == own:
            assert names <= {"model"}
        assert xsp.load(path).metadata["dropped"] == {}


@pytest.mark.filterwarnings("ignore::xsp.XspWarning")
@pytest.mark.parametrize("trial", range(5))
def test_two_threads_two_sessions_keep_every_call(tmp_path, trial):
    barrier = threading.Barrier(2)
    thread_ids: dict[str, int] = {}
    sessions: dict[str, xsp.Session] = {}

    def run(name: str) -> None:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        x = torch.randn(2, 8)
        barrier.wait()
        with torch.no_grad(), xsp.trace(output=tmp_path / f"{name}.xsp.parquet") as session:
            thread_ids[name] = threading.get_native_id()
            for _ in range(THREAD_CALLS):  # from the block's first line: no wait for the other session
                model(x)
        sessions[name] = session

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    files = [tmp_path / "a.xsp.parquet", tmp_path / "b.xsp.parquet"]
    for name, thread_id in thread_ids.items():
        session = sessions[name]  # each block, joined or not, has a trace and a file of its own
        assert session.trace is not None and session.output == tmp_path / f"{name}.xsp.parquet"
        assert (session.trace.spans[col.KIND] == "predict").sum() >= THREAD_CALLS
        _check_thread(files, tmp_path / f"{name}.xsp.parquet", thread_id)


@pytest.mark.filterwarnings("ignore::xsp.XspWarning")
@pytest.mark.parametrize("started_first_ends_first", [True, False])
def test_a_session_names_its_own_model_first_when_a_joined_thread_called_its_model_first(
        tmp_path, started_first_ends_first):
    joined_called, started_called, started_done, joined_done = (threading.Event() for _ in range(4))

    def joined() -> None:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        with torch.no_grad(), xsp.trace(output=tmp_path / "joined.xsp.parquet"):
            model(torch.randn(1, 4))  # the first model the session sees is bound to "model" here
            joined_called.set()
            assert started_called.wait(60)
            if started_first_ends_first:
                assert started_done.wait(60)
            model(torch.randn(1, 4))
        joined_done.set()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.no_grad(), xsp.trace(output=tmp_path / "started.xsp.parquet") as started:
        worker = threading.Thread(target=joined)
        worker.start()
        assert joined_called.wait(60)
        model(torch.randn(1, 4))
        started_called.set()
        if not started_first_ends_first:
            assert joined_done.wait(60)
    started_done.set()
    worker.join()
    for name in ("started", "joined"):
        spans = xsp.load(tmp_path / f"{name}.xsp.parquet").spans
        predicts = spans[spans[col.KIND] == "predict"]
        own = predicts[predicts[col.THREAD_ID] == (started.thread_id if name == "started" else worker.native_id)]
        assert set(own[col.NAME]) == {"model"}, name
        assert set(predicts[col.NAME]) <= {"model", "Sequential_0"}


@pytest.mark.filterwarnings("ignore::xsp.XspWarning")
def test_a_session_handed_over_between_threads_loses_nothing(tmp_path):
    first_ended, five_done = threading.Event(), threading.Event()
    made: dict[str, int] = {}

    def worker() -> None:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        x = torch.randn(2, 8)
        with torch.no_grad(), xsp.trace(output=tmp_path / "worker.xsp.parquet") as session:
            made["thread"] = threading.get_native_id()
            calls = 0
            while not first_ended.is_set():  # on while the first session ends and hands the recording over
                model(x)
                calls += 1
                if calls == 5:
                    five_done.set()
            for _ in range(20):
                model(x)
            made["calls"] = calls + 20
        made["session"] = session

    head = torch.nn.Linear(8, 8)
    with xsp.trace(output=tmp_path / "main.xsp.parquet"):
        thread = threading.Thread(target=worker)
        thread.start()
        assert five_done.wait(60)
        with torch.no_grad():
            head(torch.randn(2, 8))
    first_ended.set()
    thread.join()
    files = [tmp_path / "main.xsp.parquet", tmp_path / "worker.xsp.parquet"]
    assert files[1].exists()  # the worker's block outlived the first: it wrote its own file
    _check_thread(files, files[1], made["thread"], made["calls"])
    assert any("records from now on" in message for message in made["session"].warnings)


def test_a_block_nested_in_the_same_thread_has_its_own_trace_of_its_own_calls(tmp_path):
    model, head = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2)
    with pytest.warns(xsp.XspWarning) as said:
        with xsp.trace(output=tmp_path / "outer.xsp.parquet") as outer:
            for _ in range(3):
                model(torch.randn(2, 4))
            with xsp.trace(levels="model,layer,operator", output=tmp_path / "inner.xsp.parquet") as inner:
                for _ in range(4):
                    head(model(torch.randn(2, 4)))
            for _ in range(2):
                model(torch.randn(2, 4))
    assert any("a trace of its own" in str(w.message) for w in said)
    assert (outer.trace.spans[col.KIND] == "predict").sum() == 3 + 4 * 2 + 2  # the outer keeps every call
    own = xsp.load(tmp_path / "inner.xsp.parquet")
    predicts = own.spans[own.spans[col.KIND] == "predict"]
    assert len(predicts) == 4 * 2 and set(predicts[col.NAME]) == {"model", "head"}
    assert (own.spans[col.LEVEL] == "layer").sum() == 4 * 2  # Linear and ReLU of each model call
    # the operator level is not recorded per block: its metadata says where those spans are
    assert "session this block joined" in own.metadata["unavailable"]["operator"]
    assert inner.trace is not None and {"model", "layer", "operator"} <= set(own.metadata["levels"])



@pytest.mark.filterwarnings("ignore::xsp.XspWarning")
def test_a_joined_block_with_another_nested_inside_keeps_the_calls_made_before_it(tmp_path):
    # under xsp run, every block the script opens is a joined one: its own nested block must not take its calls
    model = torch.nn.Linear(4, 2)
    with xsp.trace(output=tmp_path / "outer.xsp.parquet") as outer:
        model(torch.randn(2, 4))
        with xsp.trace(output=tmp_path / "middle.xsp.parquet") as middle:
            for _ in range(3):
                model(torch.randn(2, 4))
            with xsp.trace(output=tmp_path / "inner.xsp.parquet") as inner:
                for _ in range(3):
                    model(torch.randn(2, 4))
            for _ in range(2):
                model(torch.randn(2, 4))

    def predicts(trace: xsp.Trace) -> int:
        return int((trace.spans[col.KIND] == "predict").sum())

    assert [predicts(outer.trace), predicts(middle.trace), predicts(inner.trace)] == [9, 8, 3]
    assert predicts(xsp.load(tmp_path / "middle.xsp.parquet")) == 8

LOADER_SCRIPT = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset

class Slow(TensorDataset):
    def __getitem__(self, i):
        time.sleep(0.005)
        return super().__getitem__(i)

loader = DataLoader(Slow(torch.randn(100000, 16), torch.randint(0, 3, (100000,))), batch_size=16, num_workers=2)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i, (x, y) in enumerate(loader):
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    if i == 5:
        print("ready", flush=True)
"""


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_sigterm_to_the_process_group_changes_nothing_the_program_prints(tmp_path):
    """A scheduler's SIGTERM reaches the whole process group: the DataLoader's workers die by it
    too. A plain run ends by the signal and prints nothing; under xsp run it printed the workers'
    RuntimeError traceback (torch's SIGCHLD handler, raising into xsp's end), "a helper process
    could not interpret a window" (the helpers died by it too) and a drop of a backward pass cut
    short. Now: the same exit, and xsp's one line, which names the file and what was cut short."""
    script = tmp_path / "loader.py"
    script.write_text(LOADER_SCRIPT)
    output = tmp_path / "run.xsp.parquet"
    for attempt, wait_s in enumerate((0.3, 1.5, 3.0)):
        process = subprocess.Popen([sys.executable, "-m", "xsp", "run", "-o", str(output), "--", str(script)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                   preexec_fn=lambda: _stop_signals_as(signal.SIG_DFL))
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(wait_s)
        os.killpg(process.pid, signal.SIGTERM)
        status, out, err = finished(process)
        assert status == -signal.SIGTERM, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 2 and lines[0].startswith(f"warning: xsp: interrupted by SIGTERM: the trace ({output})"), \
            f"attempt {attempt}: {err}"
        assert lines[1].startswith("xsp: ") and f"steps -> {output}" in lines[1], err  # what was written
        assert len(xsp.load(output).steps) >= 6
