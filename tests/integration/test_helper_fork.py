"""Windows interpreted in forked helpers never hang on a lock another thread held at the fork."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import xsp


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_helpers_never_wait_on_a_lock_the_program_held_when_they_were_forked(tmp_path):
    """While windows are forked, another thread keeps registering C++ exit handlers (as PyTorch
    does at an op's first use), which takes glibc's lock of them: a helper that set up a C++
    static of its own (Arrow's, at its first use) would find that lock held forever, and hung
    in about one run in twenty of a CPU workload under load. The first window is interpreted in
    the session's process, so that the helpers find every static set up."""
    script = tmp_path / "fork_while_registering.py"
    script.write_text(textwrap.dedent("""
        import ctypes, sys, threading, time
        import torch
        import xsp, xsp.session.options, xsp.session.windows
        xsp.session.options.WINDOW_S = 0.0              # a window, and a helper, at every step end
        xsp.session.windows.HELPER_DEADLINE_S = 60.0    # a hung helper shows in a minute (a slow one, on a
                                                        # loaded machine, finishes well within it)
        libc = ctypes.CDLL(None)
        register = libc.__cxa_atexit
        register.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        free = ctypes.cast(libc.free, ctypes.c_void_p)  # free(NULL) at exit: harmless
        stop = False
        def registering():
            while not stop:
                for _ in range(50):
                    register(free, None, None)
                time.sleep(0)
        threading.Thread(target=registering, daemon=True).start()
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
        with xsp.trace(levels="model,layer", output=sys.argv[1]) as session:
            for _ in range(40):
                model(torch.randn(2, 8))
                time.sleep(0.01)
        stop = True
        print(session.trace.metadata["helper_windows"], session.trace.metadata["closed_windows"])
    """))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run.xsp.parquet")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "could not interpret a window" not in done.stderr, done.stderr
    helper_windows, closed_windows = map(int, done.stdout.split())
    assert helper_windows >= 1 and closed_windows >= 20  # helpers did the windows (those waiting together)


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_an_always_on_sessions_helpers_yield_the_cpu_and_other_sessions_helpers_do_not(tmp_path):
    """An always-on session serves requests: its helpers run at the lowest priority, so that a
    request thread that becomes runnable takes the CPU from them. A session of every step (a
    training loop keeping the cores busy) keeps its helpers at the program's priority: its
    windows, a second apart, must keep pace."""
    script = tmp_path / "niceness.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        import torch
        import xsp, xsp.session.options
        from xsp.session.interpreting import WindowInterpreter
        xsp.session.options.WINDOW_S = xsp.session.options.ALWAYS_ON_WINDOW_S = 0.0  # a helper a step end
        interpret_in_helper = WindowInterpreter.interpret_in_helper
        def noted(self, window, *rest):  # in the helper: its niceness, appended to the session's file
            with open(os.environ["NICENESS_FILE"], "a") as file:
                file.write(f"{os.nice(0)}\\n")
            return interpret_in_helper(self, window, *rest)
        WindowInterpreter.interpret_in_helper = noted
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        for name, sample in (("every_step", None), ("always_on", 0.5)):
            os.environ["NICENESS_FILE"] = os.path.join(sys.argv[1], name + ".txt")
            with torch.no_grad(), xsp.trace(levels="model,layer", sample=sample,
                                            output=os.path.join(sys.argv[1], name + ".xsp.parquet")) as session:
                for _ in range(20 if sample is None else 6):
                    model(torch.randn(2, 8))
                    if sample is not None:
                        time.sleep(0.6)  # a pause: each window's helper done before the next is taken
            assert session.trace.metadata["helper_windows"] >= 1, session.trace.metadata
        print(os.nice(0), session.trace.metadata["helpers_behind"])
    """))
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "could not interpret a window" not in done.stderr, done.stderr
    program, behind = map(int, done.stdout.split()[-2:])
    every_step = {int(line) for line in (tmp_path / "every_step.txt").read_text().split()}
    always_on = [int(line) for line in (tmp_path / "always_on.txt").read_text().split()]
    assert every_step == {program}
    # the lowest priority while the windows keep pace; a machine too busy for that gives the
    # helpers of windows that waited the program's (below)
    assert always_on[0] == min(program + 19, 19) and always_on.count(program) == behind < len(always_on)
    assert set(always_on) <= {min(program + 19, 19), program}


def test_an_always_on_sessions_helper_takes_the_programs_priority_while_windows_wait(tmp_path):
    """At the lowest priority on a machine whose cores other work keeps busy, an always-on
    session's helper got almost no CPU, and the windows waiting for it held the program's memory
    (and no part was sealed): while windows wait, the next helper runs at the program's priority."""
    script = tmp_path / "behind.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading, time
        import torch
        import xsp, xsp.session.options
        from xsp.session.interpreting import WindowInterpreter
        xsp.session.options.WINDOW_S = xsp.session.options.ALWAYS_ON_WINDOW_S = 0.0  # a window a step end
        prepare, interpret_in_helper = WindowInterpreter.prepare, WindowInterpreter.interpret_in_helper
        first = threading.Event()
        def slow_first(self, window):  # the worker falls behind while the loop closes windows
            if not first.is_set():
                first.set()
                time.sleep(1.0)
            prepare(self, window)
        def noted(self, window, *rest):  # in the helper: its niceness
            with open(sys.argv[1] + ".txt", "a") as file:
                file.write(f"{os.nice(0)}\\n")
            return interpret_in_helper(self, window, *rest)
        WindowInterpreter.prepare, WindowInterpreter.interpret_in_helper = slow_first, noted
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        with torch.no_grad(), xsp.trace(levels="model,layer", sample=0.5, output=sys.argv[1]) as session:
            for _ in range(30):
                model(torch.randn(2, 8))
                time.sleep(0.05)
        print(os.nice(0), session.trace.metadata["helpers_behind"])
    """))
    output = tmp_path / "run.xsp.parquet"
    done = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "could not interpret a window" not in done.stderr, done.stderr
    program, behind = map(int, done.stdout.split())
    niceness = [int(line) for line in Path(f"{output}.txt").read_text().split()]
    assert behind >= 1 and niceness.count(program) == behind, (niceness, behind)
    assert xsp.load(output).metadata["helpers_behind"] == behind


def test_a_helper_stuck_when_the_session_ends_is_stopped_soon_and_its_window_kept(tmp_path, monkeypatch):
    """A service's SIGTERM ends its session, which waits for the helper interpreting a window. A
    helper that makes no progress then (asleep or stopped, as one deadlocked on a lock held at
    the fork) is stopped within seconds, not at its deadline (a minute and more, past a
    scheduler's grace period), and its window is interpreted by the session itself."""
    import os
    import signal

    import pytest
    import torch

    import xsp
    import xsp.session.options
    import xsp.session.windows as windows
    from xsp.session.forked import fork_available

    if not fork_available():
        pytest.skip("forked helpers run on Linux only")
    interpret_in_helper = windows._interpret_in_helper

    def stuck(*args, **kwargs):  # in the helper: stopped for good, as a deadlocked one sleeps
        os.kill(os.getpid(), signal.SIGSTOP)
        return interpret_in_helper(*args, **kwargs)

    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end
    monkeypatch.setattr(windows, "_interpret_in_helper", stuck)
    monkeypatch.setattr(windows, "HELPER_DEADLINE_S", 30.0)  # its deadline alone would say "took too long"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.warns(xsp.XspWarning, match="helper process made no progress for 2 s while the program ended"):
        with torch.no_grad(), xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
            for _ in range(6):
                model(torch.randn(2, 8))
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.steps == list(range(6)) and trace.metadata["helper_windows"] == 0
    assert session.trace.metadata["closed_windows"] >= 2
