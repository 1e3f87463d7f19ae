"""Child processes started while a session runs (issue 59, item 3): their model calls are in the
session's trace with their process ids, a DataLoader's workers' fetches too, and those that
handed nothing over are counted and said."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import xsp
from xsp.core import schema as col
from xsp.core.schema import SpanKind
from xsp.session import children
from xsp.session.children import FOLLOW_ENV

CALLS = 5


def _work(calls: int) -> int:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for _ in range(calls):
            model(torch.randn(2, 8))
    return calls


def _sleep_forever(_: int) -> None:
    _work(2)
    time.sleep(600)


def _kinds(spans: pd.DataFrame, kind: SpanKind) -> pd.DataFrame:
    return spans[spans[col.KIND] == kind.value]


def _check_children(trace: xsp.Trace, calls_by_children: int, own_calls: int) -> None:
    spans = trace.spans
    predicts = _kinds(spans, SpanKind.PREDICT)
    assert len(predicts) == own_calls + calls_by_children
    assert predicts[col.PROCESS_ID].isna().sum() == own_calls  # the session's own process
    children = predicts[predicts[col.PROCESS_ID].notna()]
    processes = _kinds(spans, SpanKind.PROCESS)
    session = _kinds(spans, SpanKind.SESSION)
    assert len(session) == 1 and set(processes[col.PARENT_ID]) == set(session[col.SPAN_ID])
    assert set(children[col.PROCESS_ID]) <= set(processes[col.PROCESS_ID])
    assert os.getpid() not in set(processes[col.PROCESS_ID])
    # each call its own step, numbered apart from the session's own steps
    assert predicts[col.STEP].nunique() == len(predicts)
    # every span of a child sits below its process span
    by_id = spans.set_index(col.SPAN_ID)
    layers = spans[(spans[col.LEVEL] == "layer") & spans[col.PROCESS_ID].notna()]
    assert len(layers) == 3 * calls_by_children  # Linear, ReLU, Linear
    assert (by_id.loc[layers[col.PARENT_ID].astype("int64"), col.PROCESS_ID].to_numpy()
            == layers[col.PROCESS_ID].to_numpy()).all()
    facts = trace.metadata["child_processes"]
    assert facts["untraced"] == {} and trace.metadata["dropped"] == {}


def test_a_process_and_a_pools_workers_forked_in_a_session_are_in_its_trace(tmp_path):
    context = multiprocessing.get_context("fork")
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        _work(CALLS)
        process = context.Process(target=_work, args=(CALLS,))
        process.start()
        process.join()
        with context.Pool(2) as pool:
            assert pool.map(_work, [CALLS] * 4) == [CALLS] * 4
    assert process.exitcode == 0
    _check_children(xsp.load(tmp_path / "run.xsp.parquet"), 5 * CALLS, CALLS)
    assert session.trace is not None
    assert len(session.trace.metadata["child_processes"]["followed"]) >= 2


WORK_SCRIPT = textwrap.dedent("""
    import multiprocessing, sys, torch

    def work(calls):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        with torch.no_grad():
            for _ in range(calls):
                model(torch.randn(2, 8))
        return calls
""")
"""A script's ``work``, as ``_work`` above: run by the children it starts (its ``__main__`` added)."""


@pytest.mark.heavy  # each spawned child imports torch: `python -m pytest -m heavy`
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_children_started_by_spawn_and_forkserver_are_in_its_trace(tmp_path, method):
    script = tmp_path / "children.py"
    script.write_text(WORK_SCRIPT + textwrap.dedent(f"""
        if __name__ == "__main__":
            context = multiprocessing.get_context("{method}")
            process = context.Process(target=work, args=({CALLS},))
            process.start()
            process.join()
            with context.Pool(2) as pool:
                print(sum(pool.map(work, [{CALLS}] * 4)))
            sys.exit(3)
    """))
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    profiled = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "run.xsp.parquet", "--", str(script)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == profiled.returncode == 3, profiled.stderr
    assert profiled.stdout == plain.stdout == f"{4 * CALLS}\n"
    assert "warning:" not in profiled.stderr, profiled.stderr
    _check_children(xsp.load(tmp_path / "run.xsp.parquet"), 5 * CALLS, 0)


def test_a_dataloaders_workers_fetches_are_spans_of_their_processes(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(96, 8)), batch_size=16, num_workers=2,
                        multiprocessing_context="fork")
    model = torch.nn.Linear(8, 2)
    with xsp.trace(output=tmp_path / "run.xsp.parquet"):
        for _ in range(2):  # two epochs: each starts its workers afresh
            for (x,) in loader:
                model(x)
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    spans = trace.spans
    fetches = _kinds(spans, SpanKind.FETCH)
    assert len(fetches) == 2 * 6 and set(fetches[col.BATCH_SIZE]) == {16}
    assert (fetches[col.LEVEL] == "input").all() and fetches[col.STEP].isna().all()
    assert (fetches[col.STATUS] == "ok").all() and (fetches[col.DURATION_NS] > 0).all()
    assert fetches[col.PROCESS_ID].nunique() == 4  # two workers an epoch
    assert {json.loads(text)[col.ATTR_INPUT_WORKER] for text in fetches[col.ATTRIBUTES]} == {0, 1}
    workers = _kinds(spans, SpanKind.PROCESS)
    assert len(workers) == 4 and set(fetches[col.PARENT_ID]) == set(workers[col.SPAN_ID])
    assert set(workers[col.NAME]) == {"DataLoader worker 0", "DataLoader worker 1"}
    # each worker's span covers its fetches; the model's own calls stay the session's
    for worker in workers.itertuples():
        own = fetches[fetches[col.PARENT_ID] == getattr(worker, col.SPAN_ID)]
        assert own[col.START_NS].min() >= getattr(worker, col.START_NS)
        assert own[col.END_NS].max() <= getattr(worker, col.END_NS)
    assert _kinds(spans, SpanKind.PREDICT)[col.PROCESS_ID].isna().all()
    assert len(_kinds(spans, SpanKind.PREDICT)) == 12
    assert trace.metadata["child_processes"]["dataloader_workers_started_before"] == []
    workers = xsp.analysis.input_workers(trace)
    assert len(workers) == 4 and workers["batches"].tolist() == [3] * 4 and (workers["samples"] == 48).all()
    assert set(workers["worker"]) == {0, 1} and ((workers["busy"] > 0) & (workers["busy"] <= 1)).all()




def _pool_of_two() -> None:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_work, [2, 2])


def test_a_childs_own_children_are_in_the_trace_and_its_metadata(tmp_path):
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        process = multiprocessing.get_context("fork").Process(target=_pool_of_two)
        process.start()
        process.join()
    facts = session.trace.metadata["child_processes"]
    followed = facts["followed"]
    assert facts["untraced"] == {} and followed[str(process.pid)]["untraced_children"] == {}
    workers = {pid for pid, entry in followed.items() if entry.get("parent") == process.pid}
    assert len(workers) == 2 and len(followed) == 3
    calls = _kinds(session.trace.spans, SpanKind.PREDICT)
    assert len(calls) == 4 and set(calls[col.PROCESS_ID].astype(str)) <= workers

class _Failing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise KeyError(f"sample {index} is missing")
        return torch.zeros(4)


def _xsp_lines(text: str) -> list[str]:
    here = os.path.dirname(xsp.__file__) + os.sep
    return [line for line in text.splitlines() if here in line]


def test_the_users_errors_in_children_show_no_line_of_xsps(tmp_path):
    # a dataset that raises in a worker, a process started twice: the tracebacks a plain run prints
    from torch.utils.data import DataLoader

    loader = DataLoader(_Failing(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        with pytest.raises(KeyError) as raised:
            list(loader)
        process = multiprocessing.get_context("fork").Process(target=_work, args=(1,))
        process.start()
        with pytest.raises(AssertionError) as twice:
            process.start()
        process.join()
    assert "sample 5 is missing" in str(raised.value) and _xsp_lines(str(raised.value)) == []
    assert _xsp_lines("".join(traceback.format_exception(twice.value))) == []
    fetches = _kinds(session.trace.spans, SpanKind.FETCH)  # the failed fetch is still a span
    assert sorted(fetches[col.STATUS]) == ["error", "ok"]
    assert len(_kinds(session.trace.spans, SpanKind.PREDICT)) == 1


@pytest.mark.parametrize("in_c", [True, False], ids=["in C", "in Python"])
def test_around_runs_the_hooks_and_never_lets_them_change_the_call(in_c):
    if in_c and children.Around is None:
        assert not os.environ.get("XSP_REQUIRE_HOTPATH"), "xsp.session._around is not built: .ci/run requires it"
        pytest.skip("xsp.session._around is not built (no C compiler)")
    wrap = children.around if in_c else children._around_in_python  # noqa: SLF001 (the fallback itself)
    seen: list[tuple[object, ...]] = []
    call = wrap(lambda x: seen.append(("before", x)) or "token", lambda x: 10 // x,
                lambda x, token, failed: seen.append(("after", x, token, failed)))
    assert call(2) == 5 and seen == [("before", 2), ("after", 2, "token", False)]
    with pytest.raises(ZeroDivisionError):
        call(0)
    assert seen[-1] == ("after", 0, "token", True)

    def broken(*_: object) -> None:
        raise RuntimeError("a hook failed")

    class Owner:
        method = wrap(broken, lambda self: self.value, broken)  # bound as a method; hooks' errors dropped

        def __init__(self) -> None:
            self.value = 7

    assert Owner().method() == 7 and children.wrapped(Owner.__dict__["method"])(Owner()) == 7


def test_dataloader_workers_started_before_the_session_are_said(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    model = torch.nn.Linear(8, 2)
    for (x,) in loader:  # the first epoch starts the workers; the next one keeps them
        model(x)
    with pytest.warns(xsp.XspWarning, match="2 DataLoader workers started before the session"):
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            for (x,) in loader:
                model(x)
    facts = session.trace.metadata["child_processes"]
    assert len(facts["dataloader_workers_started_before"]) == 2 and facts["untraced"] == {}
    assert len(_kinds(session.trace.spans, SpanKind.FETCH)) == 0


def _one_killed_beside(tmp_path: Path, target: Any, args: tuple[Any, ...], match: str) -> tuple[xsp.Session, Any, Any]:
    """A session in which one child sleeps until it is killed (SIGKILL) and another runs
    ``target`` to its end; the warning said at the end must match ``match``."""
    context = multiprocessing.get_context("fork")
    with pytest.warns(xsp.XspWarning, match=match):
        with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            killed = context.Process(target=_sleep_forever, args=(0,))
            killed.start()
            other = context.Process(target=target, args=args)
            other.start()
            other.join()
            time.sleep(0.5)
            os.kill(killed.pid, signal.SIGKILL)
            killed.join()
    return session, killed, other


def test_children_that_hand_nothing_over_are_counted_and_said(tmp_path):
    session, killed, done = _one_killed_beside(tmp_path, _work, (CALLS,),
                                               r"1 of 2 child processes .* handed no spans over.*exit code -9")
    untraced = session.trace.metadata["child_processes"]["untraced"]
    assert list(untraced) == [str(killed.pid)] and "exit code -9" in untraced[str(killed.pid)]
    assert (_kinds(session.trace.spans, SpanKind.PREDICT)[col.PROCESS_ID] == done.pid).sum() == CALLS


def test_the_count_of_children_that_handed_nothing_over_is_of_the_sessions_own(tmp_path):
    # a child's own pool workers are in the metadata, but not among "the child processes started
    # in the session": 1 of 2, not 1 of 4
    session, _, _ = _one_killed_beside(tmp_path, _pool_of_two, (), r"1 of 2 child processes .* handed no spans over")
    followed = session.trace.metadata["child_processes"]["followed"]
    assert len(followed) == 3 and sum("parent" in entry for entry in followed.values()) == 2


def test_a_child_still_running_at_the_end_is_said(tmp_path):
    context = multiprocessing.get_context("fork")
    with pytest.warns(xsp.XspWarning, match="still running when the session ended"):
        with xsp.trace(output=None) as session:
            running = context.Process(target=_sleep_forever, args=(0,))
            running.start()
            time.sleep(0.5)
    running.kill()
    running.join()
    assert str(running.pid) in session.trace.metadata["child_processes"]["untraced"]


def test_a_pools_terminate_still_hands_the_workers_spans_over(tmp_path):
    context = multiprocessing.get_context("fork")
    with xsp.trace(output=None) as session:
        pool = context.Pool(2)
        assert pool.map(_work, [CALLS] * 2, chunksize=1) == [CALLS] * 2
        time.sleep(0.5)  # the workers' sessions are running: SIGTERM ends them, each writes its trace
        pool.terminate()
        pool.join()
    assert len(_kinds(session.trace.spans, SpanKind.PREDICT)) == 2 * CALLS
    assert session.trace.metadata["child_processes"]["untraced"] == {}


def test_children_are_left_alone_when_asked_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv(FOLLOW_ENV, "0")
    context = multiprocessing.get_context("fork")
    with pytest.warns(xsp.XspWarning, match=rf"1 of 1 child processes.*not followed \({FOLLOW_ENV}=0\)"):
        with xsp.trace(output=None) as session:
            process = context.Process(target=_work, args=(CALLS,))
            process.start()
            process.join()
    assert len(_kinds(session.trace.spans, SpanKind.PREDICT)) == 0
    assert list(session.trace.metadata["child_processes"]["untraced"]) == [str(process.pid)]


def test_a_process_started_outside_any_session_is_untouched(tmp_path):
    context = multiprocessing.get_context("fork")
    with xsp.trace(output=None):
        pass
    process = context.Process(target=_work, args=(CALLS,))
    process.start()
    process.join()
    assert process.exitcode == 0 and not hasattr(process, "xsp_plan")
    assert multiprocessing.process.BaseProcess.start.__module__ == "multiprocessing.process"


AT_FORK_HOOK = """
import multiprocessing, os, time, torch, xsp
forks = []
# a hook of the program's, slow in the child: SIGTERM (Pool.terminate) may come while it runs,
# before xsp's own hook put the child's signal handlers back
os.register_at_fork(before=lambda: forks.append(1), after_in_child=lambda: time.sleep(1) if len(forks) > 1 else None)
model = torch.nn.Linear(8, 2)

def work(i):
    with torch.no_grad():
        model(torch.randn(2, 8))
    return i

if __name__ == "__main__":
    with xsp.trace(output="run.xsp.parquet"):
        with multiprocessing.get_context("fork").Pool(2) as pool:
            print(pool.map(work, range(4)), flush=True)
    print("done")
"""


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_a_worker_terminated_inside_the_programs_at_fork_hook_ends_as_in_a_plain_run(tmp_path):
    script = tmp_path / "hook.py"
    script.write_text(AT_FORK_HOOK)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "[0, 1, 2, 3]\ndone\n", result.stderr
    assert "Exception ignored" not in result.stderr and "Terminated" not in result.stderr


CTRL_C_POOL = """
import multiprocessing, time, torch
model = torch.nn.Linear(8, 2)

def task(i):
    model(torch.randn(2, 8))
    time.sleep(0.2)
    return i

if __name__ == "__main__":
    pool = multiprocessing.get_context("fork").Pool(2)
    workers = list(pool._pool)
    print("started", flush=True)
    try:
        pool.map(task, range(40), chunksize=1)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    pool.terminate()
    pool.join()
    print("exit codes", [worker.exitcode for worker in workers], flush=True)
"""


@pytest.mark.heavy  # subprocess runs: `python -m pytest -m heavy`
def test_ctrl_c_on_a_pool_prints_the_workers_tracebacks_as_a_plain_run(tmp_path):
    # a plain run prints each worker's KeyboardInterrupt traceback and its exit code is 1, unless
    # terminate()'s SIGTERM comes within the few ms it takes (a race of the program's own). Under
    # xsp the trace was written first (~100 ms), and terminate() killed every worker in it: no
    # traceback, exit code -15. Now the trace is written after the traceback.
    script = tmp_path / "pool.py"
    script.write_text(CTRL_C_POOL)
    output = tmp_path / "run.xsp.parquet"
    seen = []
    for _ in range(5):  # the program's own race may still cut a run short (more often on a busy machine)
        process = subprocess.Popen([sys.executable, "-m", "xsp", "run", "-o", str(output), "--", str(script)],
                                   cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert process.stdout is not None and process.stdout.readline().strip() == "started"
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0 and out.startswith("interrupted\nexit codes"), err
        seen.append((out, err))
        if out == "interrupted\nexit codes [1, 1]\n":
            break
    out, err = seen[-1]
    assert out == "interrupted\nexit codes [1, 1]\n", seen
    assert err.count("Process ForkPoolWorker-") == 2 and err.count("\nKeyboardInterrupt") >= 2, err
    trace = xsp.load(output)
    assert _kinds(trace.spans, SpanKind.PREDICT)[col.PROCESS_ID].nunique() == 2  # both workers handed theirs over


LEFT_BEHIND = """
import multiprocessing, os, signal, time, torch, xsp
model = torch.nn.Linear(8, 2)

def call():
    model(torch.randn(2, 8))

def outlives():
    call()
    time.sleep(3)
    call()

def killed():
    call()
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    with xsp.trace(output="run.xsp.parquet"):
        victim = context.Process(target=killed)
        victim.start()
        victim.join()
        survivor = context.Process(target=outlives)
        survivor.start()
    survivor.join()
    print(victim.exitcode, survivor.exitcode)
"""


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_children_killed_or_outliving_the_session_leave_no_folder_behind(tmp_path):
    script = tmp_path / "left.py"
    script.write_text(LEFT_BEHIND)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TMPDIR": str(temporary)})
    assert result.returncode == 0 and result.stdout == "-9 0\n", result.stderr
    assert list(temporary.iterdir()) == []  # was: the survivor's trace in a folder made again, the victim's folder
    untraced = xsp.load(tmp_path / "run.xsp.parquet").metadata["child_processes"]["untraced"]
    assert len(untraced) == 2


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_xsp_run_never_says_a_script_whose_children_ran_untraced_called_no_module(tmp_path):
    script = tmp_path / "children_only.py"
    script.write_text("import multiprocessing, torch\n"
                      "def call():\n    torch.nn.Linear(8, 2)(torch.randn(2, 8))\n"
                      "if __name__ == '__main__':\n"
                      "    process = multiprocessing.get_context('fork').Process(target=call)\n"
                      "    process.start()\n    process.join()\n")
    result = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", str(tmp_path / "run.xsp.parquet"), "--",
                             str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, FOLLOW_ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert "so there was nothing to profile" not in result.stderr
    assert "called no torch.nn.Module in its own process, and 1 child process ran untraced" in result.stderr


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_xsp_run_of_steps_that_call_no_module_reports_them_instead_of_saying_nothing_was_profiled(tmp_path):
    """A compiled training function (its modules inside the graph) or a loop over raw tensors has
    steps and no module call: `xsp run --report` said there was nothing to profile, and printed no
    report."""
    script = tmp_path / "functional.py"
    script.write_text("import torch\nw = torch.randn(4, requires_grad=True)\nopt = torch.optim.SGD([w], lr=0.1)\n"
                      "for _ in range(3):\n    (w * torch.randn(4)).sum().backward()\n    opt.step()\n"
                      "    opt.zero_grad()\n")
    result = subprocess.run([sys.executable, "-m", "xsp", "run", "--report", "-o", str(tmp_path / "run.xsp.parquet"),
                             "--", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "nothing to profile" not in result.stderr + result.stdout
    assert "3 steps" in result.stderr and "Model latency over steps" in result.stdout + result.stderr


def _sampling_of_children(trace: xsp.Trace) -> tuple[set[str], int, int]:
    """The ``sampling`` of the children's steps, how many there are, and the children's layer spans."""
    spans = trace.spans
    predicts = _kinds(spans, SpanKind.PREDICT)
    children = predicts[predicts[col.PROCESS_ID].notna()]
    layers = spans[(spans[col.LEVEL] == "layer") & spans[col.PROCESS_ID].notna()]
    return set(children[col.SAMPLING].dropna().astype(str)), len(children), len(layers)


def test_the_children_of_an_always_on_session_are_always_on_too(tmp_path):
    """A server's worker processes (uvicorn --workers, a Pool) under `xsp run --sample 0.01` recorded
    every request at every level, as if no sample had been given: the plan a child carries had no
    sampling. It now has the session's: the children's steps are timed at the model level and drawn."""
    context = multiprocessing.get_context("fork")
    with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet", sample=0.0, slow_factor=0):
        process = context.Process(target=_work, args=(CALLS,))
        process.start()
        process.join()
        with context.Pool(2) as pool:
            assert pool.map(_work, [CALLS] * 4) == [CALLS] * 4
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    samplings, steps, layers = _sampling_of_children(trace)
    assert steps == 5 * CALLS and samplings == {"model_only"} and layers == 0
    # the session's counts are its children's too (they read 0, and the report said the session
    # "did not end, so its own counts were never written")
    predicts = _kinds(trace.spans, SpanKind.PREDICT)
    counted_in_file = int((predicts[col.SAMPLING] == "model_only").sum())
    assert trace.metadata["sampling"]["steps"]["model_only"] == counted_in_file > 0
    assert trace.metadata["sampling"]["median_step_ns"] > 0


@pytest.mark.heavy  # each spawned child imports torch: `python -m pytest -m heavy`
def test_spawned_workers_of_xsp_run_sample_are_always_on(tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(WORK_SCRIPT + textwrap.dedent(f"""
        if __name__ == "__main__":
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                print(sum(pool.map(work, [{CALLS}] * 4)))
    """))
    profiled = subprocess.run([sys.executable, "-m", "xsp", "run", "--sample", "0", "--slow-factor", "0", "-o",
                               "run.xsp.parquet", "--", str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    assert profiled.returncode == 0 and profiled.stdout == f"{4 * CALLS}\n", profiled.stderr
    samplings, steps, layers = _sampling_of_children(xsp.load(tmp_path / "run.xsp.parquet"))
    assert steps == 4 * CALLS and samplings == {"model_only"} and layers == 0


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_a_bare_forked_child_exits_as_it_would_and_the_forks_are_said(tmp_path):
    """A pre-forking server (gunicorn) under `xsp run`: each worker's `sys.exit(0)` became exit code 1
    (gunicorn logged every worker's stop as an error), and the warning said the script called no
    module at all, though its workers did."""
    script = tmp_path / "prefork.py"
    script.write_text(textwrap.dedent("""
        import os, sys, torch

        model = torch.nn.Linear(4, 2)
        codes = []
        for exit_code in (0, 3):
            pid = os.fork()
            if pid == 0:
                with torch.no_grad():
                    model(torch.randn(1, 4))
                sys.exit(exit_code)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print(codes)
    """))
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    profiled = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "run.xsp.parquet", "--", str(script)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plain.stdout == profiled.stdout == "[0, 3]\n", profiled.stderr
    assert plain.returncode == profiled.returncode == 0
    assert ("called no torch.nn.Module in its own process; the 2 processes it forked with os.fork() (a server's "
            "workers) are not followed: start xsp.trace() in each worker (docs/processes.md)") in profiled.stderr
    assert xsp.load(tmp_path / "run.xsp.parquet").metadata["child_processes"]["forked_not_followed"] == 2


def _serve_until(stop: Any, deadline_s: float) -> None:
    """A server's worker: steps until told to stop (at most ``deadline_s``)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    ends = time.monotonic() + deadline_s
    with torch.no_grad():
        while not stop.is_set() and time.monotonic() < ends:
            model(torch.randn(2, 8))
            time.sleep(0.002)


def _exported_ids(received: list[Any]) -> list[tuple[str, int, int | None]]:
    return [(span.trace_id, span.span_id, span.parent_id) for span in received]


def _file_ids(spans: pd.DataFrame) -> list[tuple[str, int, int | None]]:
    parents = spans[col.PARENT_ID].astype("Int64")
    return [(str(trace), int(span_id), None if pd.isna(parent) else int(parent))
            for trace, span_id, parent in zip(spans[col.TRACE_ID], spans[col.SPAN_ID], parents)]


def test_a_worker_of_an_always_on_session_exports_its_own_windows_while_it_serves(tmp_path, monkeypatch):
    """A server's workers (uvicorn --workers) under `xsp run --sample`: their spans reached the
    collector only when the whole service stopped, and where OTEL_EXPORTER_OTLP_ENDPOINT was set,
    twice (each worker's session sent its own at its end, then the session sent them again). A
    worker now sends its windows as they close, to the session's collector, but its last, which
    the session sends with its own; none is sent twice: what the collector holds is the file, span
    for span."""
    from .otlp_receiver import GrpcReceiver

    context = multiprocessing.get_context("fork")
    with GrpcReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet", sample=1.0,
                       window_s=0.2) as session:
            stop = context.Event()
            worker = context.Process(target=_serve_until, args=(stop, 120))
            worker.start()
            seen_while_serving = False
            waited_until = time.monotonic() + 60
            while worker.is_alive() and time.monotonic() < waited_until and not seen_while_serving:
                time.sleep(0.05)
                with receiver.sink.lock:
                    seen_while_serving = any(span.resource.get("process.pid") == worker.pid
                                             for span in receiver.sink.spans)
            serving = worker.is_alive()
            stop.set()
            worker.join()
        report = session.wait_for_export()
        assert seen_while_serving and serving
        with receiver.sink.lock:
            received = list(receiver.sink.spans)
    spans = session.trace.spans
    assert sorted(_exported_ids(received)) == sorted(_file_ids(spans))  # each once, with the file's ids
    by_process = {span.resource.get("process.pid") for span in received}
    assert by_process == {os.getpid(), worker.pid}
    # the worker's session span is sent below the session's, in its trace: the file's process span
    process = _kinds(spans, SpanKind.PROCESS)
    session_span = _kinds(spans, SpanKind.SESSION)
    assert len(process) == 1 and set(process[col.TRACE_ID]) == set(session_span[col.TRACE_ID])
    assert report is not None and report.state == "done" and report.exported == len(spans) == report.submitted
    worker_export = session.trace.metadata["child_processes"]["followed"][str(worker.pid)]["export"]
    assert worker_export["exported"] > 0
    # its last window, the session's to send: a worker its parent terminated as it sent it lost it
    # (uvicorn's master on Ctrl-C), and the session said nothing
    assert worker_export["left_to_another"] > 0 and worker_export["state"] == "done"


def test_the_children_of_a_session_not_always_on_leave_the_export_to_it(tmp_path, monkeypatch):
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, each child's session exported its spans at its end,
    and the session exported them again with its own."""
    from .otlp_receiver import GrpcReceiver

    context = multiprocessing.get_context("fork")
    with GrpcReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet") as session:
            process = context.Process(target=_work, args=(CALLS,))
            process.start()
            process.join()
        report = session.wait_for_export()
        with receiver.sink.lock:
            received = list(receiver.sink.spans)
    assert report is not None and report.state == "done"
    assert sorted(_exported_ids(received)) == sorted(_file_ids(session.trace.spans))
    assert {span.resource.get("process.pid") for span in received} == {os.getpid()}
    assert session.trace.metadata["child_processes"]["followed"][str(process.pid)]["export"] is None
