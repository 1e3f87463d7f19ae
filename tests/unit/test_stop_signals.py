"""The stopping-signal handlers: what a session leaves behind when a signal ends the program."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import xsp
from xsp.core.threads import STOPPING_SIGNALS, start_thread
from xsp.session.signals import StopSignals, Terminated, send_to_main_thread

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


WAITS_IN_A_SEMAPHORE = """
import multiprocessing, signal, sys, threading, time, xsp

def signal_this_thread():
    time.sleep(1)  # the main thread waits in the semaphore by now
    signal.pthread_kill(threading.get_ident(), signal.SIG{name})  # to this thread, not the main one
    time.sleep(120)

with xsp.trace(output=None):
    idle = multiprocessing.Lock()
    idle.acquire()
    threading.Thread(target=signal_this_thread, daemon=True).start()
    idle.acquire()  # an idle Pool worker's wait for its next task: only a signal to this thread ends it
"""


@pytest.mark.parametrize("name", ["TERM", pytest.param("HUP", marks=pytest.mark.heavy)])
def test_a_stopping_signal_that_lands_on_another_thread_ends_a_main_thread_waiting_in_a_semaphore(name):
    """The kernel may give a process's signal to any thread that does not block it. Python only
    notes it there, for the main thread to run the handler at its next bytecode; a main thread
    waiting in a semaphore never got there, and ``Pool.terminate()`` waited forever for such a
    worker. (Left to the default action, the signal ends the process on any thread.)"""
    if send_to_main_thread.__module__ != "xsp.session._signals":
        assert not os.environ.get("XSP_REQUIRE_HOTPATH"), "xsp.session._signals is not built: .ci/run requires it"
        pytest.skip("xsp.session._signals is not built (no C compiler)")
    try:
        done = subprocess.run([sys.executable, "-c", WAITS_IN_A_SEMAPHORE.format(name=name)],
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SIG{name} to another thread left the main thread waiting")
    assert done.returncode == -getattr(signal, f"SIG{name}"), done.stderr


MISSES_A_SIGNAL_IN_ANOTHER_HANDLER = """
import ctypes, multiprocessing, signal, xsp

# a handler in C that waits until a signal comes: from it, CPython goes back to the semaphore
# without looking for signals that came meanwhile
nap = ctypes.CDLL(None).sleep
nap.argtypes = [ctypes.c_uint, ctypes.py_object]
signal.signal(signal.SIGWINCH, nap)  # SIGWINCH is 28: CPython's pass over noted signals is past 15
with xsp.trace(output=None):
    idle = multiprocessing.Lock()
    idle.acquire()
    print("waiting", flush=True)
    idle.acquire()
"""


def test_a_stopping_signal_that_comes_while_the_main_thread_runs_another_handler_still_ends_it():
    """CPython notes a SIGTERM that comes while the main thread runs a higher-numbered signal's
    handler, then goes back to its wait without running it (a Pool worker with PyTorch's SIGCHLD
    handler, which a DataLoader leaves behind). Without xsp the default action ends the process;
    with xsp's handler it waited forever. The C part wakes the main thread until it runs."""
    if send_to_main_thread.__module__ != "xsp.session._signals":
        assert not os.environ.get("XSP_REQUIRE_HOTPATH"), "xsp.session._signals is not built: .ci/run requires it"
        pytest.skip("xsp.session._signals is not built (no C compiler)")
    child = subprocess.Popen([sys.executable, "-c", MISSES_A_SIGNAL_IN_ANOTHER_HANDLER], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "waiting"
        time.sleep(0.2)  # in the semaphore
        child.send_signal(signal.SIGWINCH)
        time.sleep(0.5)  # in the handler's sleep
        child.send_signal(signal.SIGTERM)
        try:
            returncode = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("a SIGTERM that came during another signal's handler was never handled")
        assert returncode == -signal.SIGTERM, child.stderr.read() if child.stderr else ""
    finally:
        child.kill()
        child.communicate()


def test_xsps_threads_take_no_stopping_signal():
    """Where the C part is not built, a signal sent to the process still never lands on a thread
    of xsp's (nor on one such a thread starts: Arrow's pool inherits its mask)."""
    masks: list[set[int]] = []
    start_thread(lambda: masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])), "xsp-test").join()
    assert set(STOPPING_SIGNALS) <= masks[0]
    assert not set(STOPPING_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the starter's is as it was


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a thread's signal mask in /proc")
def test_a_streaming_sessions_threads_take_no_stopping_signal(tmp_path):
    with xsp.trace(output=tmp_path / "run.xsp.parquet"):
        threads = {thread.name: thread.native_id for thread in threading.enumerate() if thread.name.startswith("xsp-")}
        assert "xsp-windows" in threads
        for name, native_id in threads.items():
            status = (Path("/proc/self/task") / str(native_id) / "status").read_text()
            blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
            assert all(blocked >> (signum - 1) & 1 for signum in STOPPING_SIGNALS), name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a thread's name in /proc")
def test_a_streaming_sessions_threads_carry_their_names_in_the_operating_system(tmp_path):
    """``top -H``, ``ps -L`` and ``perf`` tell xsp's threads from the program's (each of Python's
    own is ``python`` there); a name past Linux's 15 bytes is cut, not refused."""
    with xsp.trace(output=tmp_path / "run.xsp.parquet"):
        threads = [thread for thread in threading.enumerate() if thread.name.startswith("xsp-")]
        assert {"xsp-windows", "xsp-control"} <= {thread.name for thread in threads}
        for thread in threads:
            name, comm = thread.name, Path("/proc/self/task") / str(thread.native_id) / "comm"
            # a pool's thread (a file's read-ahead) takes the name of the work it runs (xsp-trace-file),
            # and a short-lived one may have ended (its id then names another thread): each is xsp's
            own = name in ("xsp-windows", "xsp-control")

            def named(thread_name: str = name, path: Path = comm, own: bool = own) -> bool:
                try:
                    os_name = path.read_text().strip()
                except OSError:  # ended
                    return False
                return os_name == thread_name[:15] or (not own and os_name.startswith("xsp-"))

            deadline = time.monotonic() + 30  # a thread names itself as it begins: on a busy machine, later
            while thread.is_alive() and not named() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert named() or (not own and not thread.is_alive()), (name, comm)
    names: list[str] = []
    start_thread(lambda: names.append(Path("/proc/thread-self/comm").read_text().strip()),
                 "xsp-a-name-longer-than-fifteen").join()
    assert names == ["xsp-a-name-long"]


WAITS_IN_NATIVE_CODE = """
import datetime, socket, sys
import torch.distributed as dist
with socket.socket() as free:
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
print("waiting", flush=True)  # rank 1 of 2 whose rank 0 never comes: in C++, retrying when interrupted
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=600))
"""


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_a_sigterm_to_a_main_thread_waiting_in_native_code_ends_the_process_as_without_xsp(tmp_path):
    """Rank 1 of a job whose rank 0 never started waits in the C++ rendezvous, which retries when a
    signal interrupts it: its SIGTERM was noted and never handled (the Python handler runs between
    bytecodes), so the process ran on until the rendezvous timed out, 125 s later, where a plain
    run ended at once (and torchrun killed it with SIGKILL after its grace period)."""
    script = tmp_path / "rank1.py"
    script.write_text(WAITS_IN_NATIVE_CODE)
    output = tmp_path / "run.xsp.parquet"
    process = subprocess.Popen([sys.executable, "-m", "xsp", "run", "-o", str(output), "--", str(script)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "waiting\n"
        time.sleep(1.0)  # in the rendezvous
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)  # the rendezvous would wait 600 s
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM, err
    said = [line for line in err.splitlines() if line.startswith("xsp: SIGTERM came while the main thread waited")]
    assert len(said) == 1 and f"`xsp recover {output}`" in said[0], err
