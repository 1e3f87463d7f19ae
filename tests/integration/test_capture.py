"""``xsp capture PID``: a running process records its next steps at every level into a file, while
it runs on; the real CLI against real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import xsp
from xsp.cli.main import main
from xsp.core import schema as col
from xsp.core.control import socket_path

SERVICE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch

    stop = Path(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 16)
    served = 0
    with torch.no_grad():
        while not stop.exists():
            model(x)
            served += 1
            time.sleep(0.002)
    print("served", served > 0)
""")


def xsp_cli(*arguments: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xsp", *arguments], capture_output=True, text=True, timeout=timeout)


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


class Service:
    """The script above under ``xsp run`` (extra options), stopped by a file."""

    def __init__(self, tmp_path: Path, *options: str) -> None:
        self.stop = tmp_path / "stop"
        script = tmp_path / "service.py"
        script.write_text(SERVICE)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xsp", "run", *options, "-o", str(tmp_path / "service.xsp.parquet"), "--",
             str(script), str(self.stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: socket_path(self.process.pid).exists() or self.process.poll() is not None)
        assert self.process.poll() is None, self.process.communicate()

    def end(self) -> tuple[int, str, str]:
        self.stop.touch()
        out, err = self.process.communicate(timeout=120)
        return self.process.returncode, out, err


@pytest.mark.parametrize("options", [pytest.param(("--sample", "0", "--slow-factor", "0"), id="always-on"),
                                     pytest.param((), id="every-step", marks=pytest.mark.heavy)])
def test_capture_writes_the_next_steps_at_every_level_while_the_process_runs_on(tmp_path, options):
    service = Service(tmp_path, *options)
    try:
        done = xsp_cli("capture", str(service.process.pid), "--steps", "4", "-o", str(tmp_path / "cap.xsp.parquet"))
        assert service.process.poll() is None  # it serves on
    finally:
        code, out, err = service.end()
    assert done.returncode == 0, done.stderr
    assert f"xsp: captured 4 steps of process {service.process.pid} -> {tmp_path / 'cap.xsp.parquet'}" in done.stderr
    assert code == 0 and out == "served True\n", err
    assert "warning" not in err
    captured = xsp.load(tmp_path / "cap.xsp.parquet")
    spans = captured.spans
    roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
    assert len(roots) == 4 and set(roots[col.SAMPLING].astype(str)) == {"capture"}
    steps = roots[col.STEP].astype(int).tolist()
    assert steps == list(range(steps[0], steps[0] + 4))
    assert (spans[col.LEVEL] == "layer").sum() == 4 * 3
    assert captured.metadata["capture"]["steps"] == steps
    whole = xsp.load(tmp_path / "service.xsp.parquet").spans
    assert set(whole[whole[col.LEVEL] == "layer"][col.STEP].astype(int)) >= set(steps)
    if options:  # always on at 0: the captured steps are the only ones with layers
        assert set(whole[whole[col.LEVEL] == "layer"][col.STEP].astype(int)) == set(steps)
    assert not socket_path(service.process.pid).exists()  # removed at the session's end


def test_capture_of_levels_the_process_does_not_record_is_refused(tmp_path):
    service = Service(tmp_path, "--sample", "0")
    try:
        done = xsp_cli("capture", str(service.process.pid), "--levels", "operator", "-o", str(tmp_path / "c.parquet"))
    finally:
        service.end()
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"xsp: error: process {service.process.pid}: this process records input, layer, model; operator cannot be "
        "added while it runs"]
    assert not (tmp_path / "c.parquet").exists()


@pytest.mark.heavy  # waits out a timeout and a window
def test_a_capture_that_times_out_writes_nothing_then_or_later(tmp_path):
    service = Service(tmp_path, "--sample", "0")
    try:
        done = xsp_cli("capture", str(service.process.pid), "--steps", "5000", "--timeout", "1",
                       "-o", str(tmp_path / "late.xsp.parquet"))
        time.sleep(0.5)  # the next capture finds this one's caller gone, and takes its place
        again = xsp_cli("capture", str(service.process.pid), "--steps", "2", "-o", str(tmp_path / "next.xsp.parquet"))
    finally:
        code, _, err = service.end()
    assert done.returncode == 2 and "did not complete the capture in time:" in done.stderr
    assert re.search(r"[\d,]+ of the 5,000 steps asked for began in 1 s; no file was written", done.stderr), done.stderr
    assert again.returncode == 0, again.stderr  # the abandoned capture no longer holds the process
    assert code == 0, err
    assert not (tmp_path / "late.xsp.parquet").exists()


def test_capture_says_in_one_line_what_is_wrong(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        no_xsp = xsp_cli("capture", str(sleeper.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert no_xsp.returncode == 2
    assert no_xsp.stderr.startswith(f"xsp: error: process {sleeper.pid} runs no xsp session (nothing listens at ")
    ended = xsp_cli("capture", str(sleeper.pid))
    assert ended.returncode == 2 and ended.stderr == f"xsp: error: no process {sleeper.pid} is running\n"
    closed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "XSP_CONTROL": "0"})
    try:  # it may run a session, one that opens no channel: not "runs no xsp session"
        said = xsp_cli("capture", str(closed.pid))
    finally:
        closed.kill()
        closed.wait()
    assert said.returncode == 2 and said.stderr == (
        f"xsp: error: process {closed.pid} was started with XSP_CONTROL=0: an xsp session there opens no channel for "
        "xsp capture (start it without that setting to capture its steps)\n")
    bad = xsp_cli("capture", "1", "--steps", "0")
    assert bad.returncode == 2 and bad.stderr == "xsp: error: --steps must be 1 or more, not 0\n"
    for pid in ("0", "-5"):  # no process, said alike
        no_pid = xsp_cli("capture", "--", pid)
        assert no_pid.returncode == 2 and no_pid.stderr == f"xsp: error: PID must be a process id above 0, not {pid}\n"
    unnamed = xsp_cli("capture", "1", "-o", "")
    assert unnamed.returncode == 2 and unnamed.stderr == "xsp: error: -o must name a file, not an empty string\n"
    kineto_named = xsp_cli("capture", "1", "-o", "x.json")  # written as Parquet, it was then read as Kineto JSON
    assert kineto_named.returncode == 2 and kineto_named.stderr == (
        "xsp: error: -o x.json names a .json file, but xsp writes a Parquet trace: give it a .xsp.parquet name "
        "(x.xsp.parquet)\n")


def test_another_users_process_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "getuid", lambda: 12345)
    assert main(["capture", str(os.getpid())]) == 2
    assert capsys.readouterr().err == (f"xsp: error: process {os.getpid()} belongs to another user: xsp capture "
                                       "reaches only your own processes\n")


def test_the_control_socket_is_the_users_own(tmp_path):
    service = Service(tmp_path)
    try:
        path = socket_path(service.process.pid)
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        assert path.stat().st_uid == os.getuid()
    finally:
        service.end()


@pytest.mark.heavy  # two processes and a wait
def test_a_session_that_ends_during_a_capture_says_so(tmp_path):
    service = Service(tmp_path, "--sample", "0")
    capture = subprocess.Popen([sys.executable, "-m", "xsp", "capture", str(service.process.pid), "--steps", "5000",
                                "-o", str(tmp_path / "never.xsp.parquet")], stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    code, _, _ = service.end()
    _, err = capture.communicate(timeout=60)
    assert code == 0
    assert capture.returncode == 2
    assert "the session ended after" in err and "was not written" in err
    assert not (tmp_path / "never.xsp.parquet").exists()


DDP_SERVICE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import torch.distributed as dist

    stop = Path(sys.argv[1])
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    while True:
        flag = torch.tensor([float(stop.exists())])
        dist.all_reduce(flag)  # every rank stops at the same step
        if flag.item():
            break
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
        time.sleep(0.005)
    dist.destroy_process_group()
""")


@pytest.mark.heavy  # a torchrun job of two ranks
@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="this PyTorch has no torch.distributed")
def test_a_torchrun_job_is_captured_on_every_rank_at_the_same_steps(tmp_path):
    stop = tmp_path / "stop"
    script = tmp_path / "ddp_service.py"
    script.write_text(DDP_SERVICE)
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "xsp", "run", "--sample", "0", "--slow-factor", "0",
                            "-o", str(tmp_path / "ddp.xsp.parquet"), "--", str(script), str(stop)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import psutil

        def ranks_listen() -> bool:
            children = psutil.Process(job.pid).children(recursive=True)
            return sum(socket_path(child.pid).exists() for child in children) == 2 or job.poll() is not None

        wait_for(ranks_listen, 120)
        time.sleep(1)  # a few steps in
        done = xsp_cli("capture", str(job.pid), "--steps", "3", "-o", str(tmp_path / "cap.xsp.parquet"))
    finally:
        stop.touch()
        _, err = job.communicate(timeout=300)
    assert done.returncode == 0, done.stderr + err
    assert "(rank 0) -> " in done.stderr and "(rank 1) -> " in done.stderr
    steps = {}
    for rank in (0, 1):
        captured = xsp.load(tmp_path / f"cap.rank{rank}.xsp.parquet")
        spans = captured.spans
        roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
        assert set(roots[col.SAMPLING].astype(str)) == {"capture"}
        steps[rank] = captured.metadata["capture"]["steps"]
        assert (spans[col.LEVEL] == "layer").any()
    assert steps[0] == steps[1] and len(steps[0]) == 3


@pytest.mark.heavy  # a parent and its child under xsp
def test_a_parent_that_is_no_launcher_is_not_captured_through_its_children_but_names_them(tmp_path):
    """A pre-forking server's master (gunicorn's) whose workers each start a session: the
    capture names the workers to capture instead."""
    stop = tmp_path / "stop"
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; subprocess.run([sys.executable, '-m', 'xsp', 'run', '-o', sys.argv[1], '--', "
        "sys.argv[2], sys.argv[3]])"), str(tmp_path / "child.xsp.parquet"), str(script), str(stop)])
    try:
        import psutil

        wait_for(lambda: any(socket_path(child.pid).exists() for child in psutil.Process(parent.pid).children(True)))
        done = xsp_cli("capture", str(parent.pid), "--steps", "2", "-o", str(tmp_path / "cap.xsp.parquet"))
    finally:
        stop.touch()
        parent.wait(timeout=120)
    assert done.returncode == 2
    assert f"process {parent.pid} runs no xsp session, but its child process " in done.stderr, done.stderr
    assert "capture one with `xsp capture " in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("cap*.xsp.parquet"))


def test_sockets_of_killed_processes_are_cleared_and_the_folder_left_empty_is_removed(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / "xsp"
    folder.mkdir(mode=0o700)
    ended = folder / "4194999.sock"  # past any pid in use: a process killed before it removed its socket
    ended.touch()
    with xsp.trace(levels="model", output=None):
        assert socket_path(os.getpid(), folder).exists()
        assert not ended.exists()
        torch.nn.Linear(2, 2)(torch.zeros(1, 2))
    assert not folder.exists()


LONG_WINDOWS_SERVICE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    import xsp
    from xsp.session import options

    options.ALWAYS_ON_WINDOW_S = 3600.0  # no window would close during this test but for the capture
    stop = Path(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 16)
    with torch.no_grad(), xsp.trace(sample=0, slow_factor=0, output=sys.argv[2]):
        while not stop.exists():
            model(x)
            time.sleep(0.002)
""")


def test_a_capture_closes_windows_sooner_than_an_always_on_sessions_hour(tmp_path):
    stop, script = tmp_path / "stop", tmp_path / "service.py"
    script.write_text(LONG_WINDOWS_SERVICE)
    process = subprocess.Popen([sys.executable, str(script), str(stop), str(tmp_path / "whole.xsp.parquet")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: socket_path(process.pid).exists() or process.poll() is not None)
        done = xsp_cli("capture", str(process.pid), "--steps", "3", "--timeout", "60",
                       "-o", str(tmp_path / "cap.xsp.parquet"))
    finally:
        stop.touch()
        out, err = process.communicate(timeout=120)
    assert done.returncode == 0, done.stderr
    assert process.returncode == 0, err
    spans = xsp.load(tmp_path / "cap.xsp.parquet").spans
    assert (spans[col.LEVEL] == "layer").sum() == 3 * 3


BURSTS_SERVICE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch

    stop, bursts = Path(sys.argv[1]), Path(sys.argv[2])
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 16)
    with torch.no_grad():
        while not stop.exists():  # quiet, but for the bursts of requests asked for by a file
            for burst in sorted(bursts.glob("burst-*")):
                for _ in range(int(burst.read_text())):
                    model(x)
                    time.sleep(0.002)
                burst.unlink()
            time.sleep(0.01)
""")


class Bursts:
    """The script above under ``xsp run --sample 0``: steps only in the bursts :meth:`serve` asks for."""

    def __init__(self, tmp_path: Path) -> None:
        self.stop, self.bursts, self.made = tmp_path / "stop", tmp_path / "bursts", 0
        self.bursts.mkdir()
        script = tmp_path / "bursts.py"
        script.write_text(BURSTS_SERVICE)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xsp", "run", "--sample", "0", "--slow-factor", "0", "-o",
             str(tmp_path / "service.xsp.parquet"), "--", str(script), str(self.stop), str(self.bursts)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: socket_path(self.process.pid).exists() or self.process.poll() is not None)
        assert self.process.poll() is None, self.process.communicate()

    def serve(self, steps: int) -> None:
        """A burst of ``steps`` requests, served before this returns."""
        self.made += 1
        burst, pending = self.bursts / f"burst-{self.made:04d}", self.bursts / f".pending-{self.made:04d}"
        pending.write_text(str(steps))
        pending.rename(burst)  # whole when the service finds it (a file it read empty ended the service)
        wait_for(lambda: not burst.exists())

    def capturing(self) -> bool:
        from xsp.cli.capture import Target, ask

        return bool(ask(Target(self.process.pid, socket_path(self.process.pid)), {"op": "status"})["capturing"])

    def capture(self, output: Path, *options: str) -> subprocess.Popen[str]:
        """``xsp capture`` started, and asked to capture, before this returns."""
        started = subprocess.Popen([sys.executable, "-m", "xsp", "capture", str(self.process.pid), *options, "-o",
                                    str(output)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: self.capturing() or started.poll() is not None)
        return started

    def capture_then_serve(self, output: Path, steps: int, served: int) -> tuple[int, str]:
        """A capture of ``steps`` asked for, then ``served`` requests, then quiet: the capture's exit
        code and what it said, once it ended."""
        capture = self.capture(output, "--steps", str(steps), "--timeout", "60")
        self.serve(served)
        _, err = capture.communicate(timeout=120)
        return capture.returncode, err

    def end(self) -> tuple[int, str, str]:
        self.stop.touch()
        out, err = self.process.communicate(timeout=120)
        return self.process.returncode, out, err


def captured_then_quiet(tmp_path: Path, steps: int, served: int, served_after: int = 0) -> xsp.Trace:
    """A :class:`Bursts` service that served 3 requests is asked to capture ``steps``, then serves
    ``served`` requests and goes quiet (``served_after`` more once the capture ended): the
    capture's trace (the capture and the service both ended well)."""
    service = Bursts(tmp_path)
    try:
        service.serve(3)
        captured_code, err = service.capture_then_serve(tmp_path / "cap.xsp.parquet", steps, served)
        if served_after:
            service.serve(served_after)
    finally:
        code, _, service_err = service.end()
    assert captured_code == 0, err
    assert code == 0, service_err
    return xsp.load(tmp_path / "cap.xsp.parquet")


def test_a_capture_asked_for_before_a_burst_is_complete_though_the_service_then_goes_quiet(tmp_path):
    captured = captured_then_quiet(tmp_path, steps=5, served=20)  # no step ends after them
    first = captured.metadata["capture"]["from_step"]
    assert captured.steps == list(range(first, first + 5))


def test_a_capture_of_exactly_as_many_requests_as_it_asks_for_completes_though_no_more_come(tmp_path):
    """The last captured step is decided when the thread's next one begins, which a quiet service
    never begins: a capture waiting decides it once its thread has been quiet for a moment."""
    from xsp.record import hotpath

    if hotpath.HOTPATH is None:
        pytest.skip("xsp's C part is not built here (its Python twin leaves the step to the next request)")
    # then the service goes on as before: its next steps are steps of their own
    captured = captured_then_quiet(tmp_path, steps=2, served=2, served_after=2)
    first = captured.metadata["capture"]["from_step"]
    assert captured.steps == [first, first + 1]
    assert (captured.spans[col.LEVEL] == "layer").sum() == 2 * 3
    spans = xsp.load(tmp_path / "service.xsp.parquet").spans
    roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
    assert len(roots) == 7 and sorted(roots[col.STEP].astype(int)) == list(range(7))
    assert (roots[col.SAMPLING].astype(str) == "capture").sum() == 2


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_a_capture_after_one_its_caller_gave_up_holds_only_its_own_steps(tmp_path):
    service = Bursts(tmp_path)
    try:
        service.serve(3)
        given_up = service.capture(tmp_path / "given-up.xsp.parquet", "--steps", "5", "--timeout", "1")
        _, given_up_err = given_up.communicate(timeout=120)  # no step came in its second
        service.serve(10)  # perhaps captured for the capture given up, if the service has not seen it go yet
        capture = service.capture(tmp_path / "next.xsp.parquet", "--steps", "5", "--timeout", "60")
        service.serve(10)
        out, err = capture.communicate(timeout=120)
    finally:
        code, _, service_err = service.end()
    assert given_up.returncode == 2 and "did not complete the capture in time" in given_up_err
    assert capture.returncode == 0, err
    assert code == 0, service_err
    assert not (tmp_path / "given-up.xsp.parquet").exists()
    captured = xsp.load(tmp_path / "next.xsp.parquet")
    first = captured.metadata["capture"]["from_step"]
    assert first >= 3 and captured.steps == list(range(first, first + 5)), (first, captured.steps)


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_a_capture_given_up_is_dropped_before_the_next_step_comes(tmp_path):
    """A quiet service learns that the caller hung up within a second or so, with no step to show
    it a window: its next request is not recorded deep for a file nobody will write."""
    service = Bursts(tmp_path)
    try:
        service.serve(3)
        # its first window (the burst's steps) is taken while it waits, and the later ones are empty
        given_up = service.capture(tmp_path / "given-up.xsp.parquet", "--steps", "5", "--timeout", "4")
        given_up.communicate(timeout=120)
        time.sleep(3.0)  # quiet: no step, no window (asking the service's status would drop it too)
        service.serve(4)
    finally:
        code, _, err = service.end()
    assert given_up.returncode == 2
    assert code == 0, err
    spans = xsp.load(tmp_path / "service.xsp.parquet").spans
    roots = spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]
    assert len(roots) == 7 and set(roots[col.SAMPLING].astype(str)) == {"model_only"}


WORKERS = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from pathlib import Path
    import torch

    def serve(stop):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        with torch.no_grad():
            while not Path(stop).exists():
                model(torch.randn(2, 16))
                time.sleep(0.002)

    if __name__ == "__main__":
        workers = [multiprocessing.get_context("fork").Process(target=serve, args=(sys.argv[1],)) for _ in range(2)]
        for worker in workers:
            worker.start()
        print(" ".join(str(worker.pid) for worker in workers), flush=True)
        for worker in workers:
            worker.join()
""")


def test_a_server_with_workers_refuses_at_once_and_its_workers_are_captured(tmp_path):
    """`uvicorn --workers 2` under `xsp run --sample`: the master's capture waited out its timeout
    (600 s by default), then said the process may serve too few steps; a worker's said it ran no
    xsp session. The master now says where its steps run, and a worker answers."""
    stop, script = tmp_path / "stop", tmp_path / "workers.py"
    script.write_text(WORKERS)
    server = subprocess.Popen([sys.executable, "-m", "xsp", "run", "--sample", "0", "-o",
                               str(tmp_path / "server.xsp.parquet"), "--", str(script), str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        workers = [int(pid) for pid in server.stdout.readline().split()]
        wait_for(lambda: all(socket_path(pid).exists() for pid in [server.pid, *workers]))
        master = xsp_cli("capture", str(server.pid), "--steps", "3", "-o", str(tmp_path / "master.xsp.parquet"),
                         "--timeout", "60")
        worker = xsp_cli("capture", str(workers[0]), "--steps", "3", "-o", str(tmp_path / "worker.xsp.parquet"))
    finally:
        stop.touch()
        _, err = server.communicate(timeout=120)
    assert master.returncode == 2 and not (tmp_path / "master.xsp.parquet").exists()
    assert (f"it has begun no step of its own: its model runs in the 2 child processes it started "
            f"({workers[0]}, {workers[1]}); capture one of those") in master.stderr, master.stderr
    assert worker.returncode == 0, worker.stderr
    roots = xsp.load(tmp_path / "worker.xsp.parquet").spans
    roots = roots[roots[col.PARENT_ID].isna() & roots[col.STEP].notna()]
    assert len(roots) == 3 and set(roots[col.SAMPLING].astype(str)) == {"capture"}
    assert server.returncode == 0, err


def _wait_until_set(stop: object) -> None:
    stop.wait(120)  # type: ignore[attr-defined]


def test_a_followed_child_of_a_session_not_always_on_is_told_apart_from_a_process_with_no_xsp(tmp_path, capsys):
    """A worker of `xsp run` without --sample was said to run "no xsp session": it runs one, which
    answers no capture; its parent's does."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    stop = context.Event()
    with xsp.trace(levels="model", output=tmp_path / "t.xsp.parquet"):
        child = context.Process(target=_wait_until_set, args=(stop,))
        child.start()
        try:
            status = main(["capture", str(child.pid), "--steps", "1", "-o", str(tmp_path / "c.xsp.parquet")])
        finally:
            stop.set()
            child.join()
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert f"process {child.pid} runs no xsp session that listens, but process {os.getpid()}, which started it" in err
    assert "only where the session is always on" in err
