"""The stopping-signal handlers: what a session leaves behind when a signal ends the program."""
from __future__ import annotations

import signal
import sys

import pytest

from xsp.session.signals import StopSignals, Terminated

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD on this platform")


def test_a_sigterm_leaves_sigchld_to_a_python_handler_that_does_nothing(monkeypatch):
    """PyTorch's DataLoader installs a Python SIGCHLD handler that raises when a worker dies. Once
    SIGTERM ends the program, that handler is replaced, and by a Python one: with ``SIG_DFL``, a
    SIGCHLD already caught but not yet run printed "Signal 17 ignored due to race condition" (as
    the program's workers died by the same SIGTERM)."""
    heard: list[int] = []
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    previous_chld = signal.signal(signal.SIGCHLD, lambda signum, frame: heard.append(signum))
    previous_term = signal.getsignal(signal.SIGTERM)
    stops = StopSignals()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stops.install()
        with pytest.raises(Terminated):
            signal.raise_signal(signal.SIGTERM)
        handler = signal.getsignal(signal.SIGCHLD)
        assert callable(handler)
        signal.raise_signal(signal.SIGCHLD)
        assert heard == [] and unraisable == []
    finally:
        stops.release(None)
        signal.signal(signal.SIGCHLD, previous_chld)
        signal.signal(signal.SIGTERM, previous_term)
