"""xsp.session.forked: a function run in a forked child, its result or its failure brought back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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
