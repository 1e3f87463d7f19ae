"""xsp.session.forked: a function run in a forked child, its result or its failure brought back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import xsp.session.forked
from xsp.session.forked import ForkFailed, fork_available, run_forked

pytestmark = pytest.mark.skipif(not fork_available(), reason="forked helpers run on Linux only")


def test_the_result_comes_back_and_the_child_ran_elsewhere():
    parent = os.getpid()
    child, values = run_forked(lambda: (os.getpid(), {"a": [1, 2]}), deadline_s=30)
    assert child != parent and values == {"a": [1, 2]}


def test_an_exception_in_the_child_is_named():
    def fails() -> None:
        raise ValueError("bad window")

    with pytest.raises(ForkFailed, match="ValueError: bad window"):
        run_forked(fails, deadline_s=30)


def test_a_child_that_dies_gives_no_result():
    with pytest.raises(ForkFailed, match="without a result"):
        run_forked(lambda: os.kill(os.getpid(), signal.SIGKILL), deadline_s=30)


def test_a_child_past_its_deadline_is_stopped():
    began = time.monotonic()
    with pytest.raises(ForkFailed, match="too long"):
        run_forked(lambda: time.sleep(30), deadline_s=0.5)
    assert time.monotonic() - began < 10


def spin(seconds: float) -> str:
    """Busy for ``seconds`` (never asleep: runnable all along)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


def test_a_child_still_runnable_at_its_deadline_is_given_it_again_then_stopped():
    """A helper of low priority on a busy machine waits for a CPU: it is not stuck on a lock,
    and its deadline is renewed, a few times."""
    assert run_forked(lambda: spin(1.0), deadline_s=0.4) == "done"
    began = time.monotonic()
    with pytest.raises(ForkFailed, match="too long"):
        run_forked(lambda: spin(60), deadline_s=0.4)
    assert time.monotonic() - began < 10  # the deadline, given again RUNNABLE_EXTENSIONS times


@pytest.fixture
def pipe_held_elsewhere(monkeypatch):
    """Each helper's pipe is also held open by another process, as by a process the program forks
    on another thread while the helper's pipe is open (it lives on after the helper ends)."""
    holders: list[int] = []
    real_pipe = os.pipe

    def pipe() -> tuple[int, int]:
        fds = real_pipe()
        holder = os.fork()
        if holder == 0:
            time.sleep(600)
            os._exit(0)
        holders.append(holder)
        return fds

    monkeypatch.setattr(xsp.session.forked.os, "pipe", pipe)
    yield
    for holder in holders:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)


def test_the_result_comes_back_while_another_process_holds_the_pipe(pipe_held_elsewhere):
    # read to the pipe's end, the result would wait for the holder's exit: the deadline, then "too long"
    assert run_forked(lambda: 41 + 1, deadline_s=60) == 42


def test_a_child_that_dies_while_another_process_holds_the_pipe_gives_no_result(pipe_held_elsewhere):
    with pytest.raises(ForkFailed, match="without a result"):
        run_forked(lambda: os.kill(os.getpid(), signal.SIGKILL), deadline_s=60)


def test_nothing_of_the_parent_runs_in_the_child():
    """No buffered output printed twice, no atexit handler run twice, the program goes on once."""
    script = (
        "import atexit, sys\n"
        "from xsp.session.forked import run_forked\n"
        "atexit.register(lambda: print('exit handler'))\n"
        "print('buffered', end=' ')\n"
        "print(run_forked(lambda: 41 + 1, deadline_s=30))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered 42\nexit handler\n"
    assert done.stderr == ""


def test_while_the_program_ends_a_child_that_makes_no_progress_is_stopped_and_one_that_works_is_not(monkeypatch):
    """Once ``ending`` is set, a child asleep with its CPU time unchanged for STALLED_S is stuck
    (stopped long before its deadline); a child busy all along finishes."""
    import threading

    monkeypatch.setattr(xsp.session.forked, "STALLED_S", 0.3)
    ending = threading.Event()
    ending.set()
    with pytest.raises(ForkFailed, match="made no progress for 0.3 s while the program ended"):
        run_forked(lambda: time.sleep(60), deadline_s=60, ending=ending)
    assert run_forked(lambda: spin(1.0), deadline_s=60, ending=ending) == "done"
    assert run_forked(lambda: "quick", deadline_s=60, ending=threading.Event()) == "quick"
