"""Windows interpreted in forked helpers never hang on a lock another thread held at the fork."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
