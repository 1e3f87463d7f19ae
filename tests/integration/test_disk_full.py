"""A disk that fills during a run: the script's exit status stays its own, no closed window is
lost (kept in memory, then spooled elsewhere), and ``xsp recover`` brings every step back."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import xsp
import xsp.session.ending
import xsp.session.options
from xsp.core import schema as col
from xsp.io import segments
from xsp.io.segments import recover

STEPS = 20
SCRIPT = """
import sys, time, torch
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(40)])
for _ in range({steps}):
    model(torch.randn(4, 32))
    time.sleep(0.12)  # windows close about once a second: several small ones
print("done")
sys.exit(3)
"""


def _no_space(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _steps(path: Path) -> int:
    spans = xsp.load(path).spans
    return int((spans[col.KIND] == col.SpanKind.PREDICT.value).sum())


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """Windows written as segments until ``fill()``; from then the output's folder takes no writes,
    and the trace file cannot be written at the end."""
    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window at every step end
    monkeypatch.setenv(segments.SPOOL_ENV, str(tmp_path / "spool"))
    output = tmp_path / "out" / "run.xsp.parquet"
    output.parent.mkdir()
    state = {"full": False}
    write_segment = segments.write_segment

    def write_unless_full(table: pa.Table, where: Path) -> None:
        if state["full"] and str(output.parent) in str(where):
            _no_space()
        write_segment(table, where)

    monkeypatch.setattr(segments, "write_segment", write_unless_full)
    monkeypatch.setattr(xsp.session.ending, "write_trace_tables", _no_space)

    def fill() -> None:
        state["full"] = True

    return output, fill


def _run(output: Path, fill, fill_at: int) -> xsp.Session:
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)])
    with pytest.warns(xsp.XspWarning) as said, xsp.trace(levels="model,layer", output=output) as session:
        for step in range(STEPS):
            model(torch.randn(2, 16))
            if step == fill_at:
                fill()
    messages = [str(w.message) for w in said]
    assert any("windows can no longer be written" in m for m in messages), messages
    assert any("the trace file was not written" in m and "xsp recover" in m for m in messages), messages
    return session


def test_windows_kept_in_memory_come_back_with_recover(full_disk):
    output, fill = full_disk
    session = _run(output, fill, fill_at=5)
    assert session.write_error is not None and not output.exists()
    assert (session.trace.spans[col.KIND] == col.SpanKind.PREDICT.value).sum() == STEPS  # in hand
    written, metadata = recover(output)  # the disk has room again
    assert _steps(written) == STEPS
    assert metadata.get("interrupted") is None and not metadata.get("dropped")  # it ended; nothing lost
    assert "could not be written when the run ended" in metadata["warnings"][-1]
    assert segments.unfinished_sessions(output) == []


def test_windows_past_the_memory_bound_are_spooled_and_recovered(full_disk, monkeypatch, tmp_path):
    monkeypatch.setattr(segments, "MEMORY_BOUND_BYTES", 1)  # every window that waits goes to the spool
    output, fill = full_disk
    _run(output, fill, fill_at=3)
    spooled = list((tmp_path / "spool" / "xsp-spool").iterdir())
    assert len(spooled) == 1 and any(spooled[0].glob(segments.SEGMENT_PATTERN))
    assert (spooled[0] / segments.FINAL_FILE).exists()
    assert [len(folders) for folders in segments.unfinished_sessions(output)] == [2]  # beside it, and spooled
    written, metadata = recover(output)
    assert _steps(written) == STEPS and metadata.get("interrupted") is None
    assert not spooled[0].exists()


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_the_script_keeps_its_exit_status_when_the_file_cannot_be_written(tmp_path):
    """A file-size limit lets the small windows through and stops the trace file, as a disk that
    fills up at the end would."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT.format(steps=STEPS))
    output = tmp_path / "run.xsp.parquet"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000));"
            "from xsp.cli.main import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "run", "-o", str(output), "--", str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
    assert done.returncode == 3, done.stderr  # the script's, not xsp's
    assert done.stdout == "done\n"
    assert "the trace file was not written" in done.stderr and "Traceback" not in done.stderr
    assert not output.exists()
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(output)], capture_output=True, text=True,
                               timeout=300, cwd=tmp_path)
    assert recovered.returncode == 0, recovered.stderr
    assert "could not write its file" in recovered.stderr
    assert _steps(output) == STEPS


def test_windows_no_folder_can_take_at_the_end_are_said_lost_with_their_count(full_disk, monkeypatch, tmp_path):
    """With the spool unwritable too, the windows were lost and counted in the metadata, while the
    warning said they were kept in the folders it named."""
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    monkeypatch.setenv(segments.SPOOL_ENV, str(blocker / "spool"))  # no spool folder can be made either
    output, fill = full_disk
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)])
    with pytest.warns(xsp.XspWarning) as said, xsp.trace(levels="model,layer", output=output) as session:
        for step in range(STEPS):
            model(torch.randn(2, 16))
            if step == 5:
                fill()
    lost = session.trace.metadata["dropped"][segments.LOST_AT_END]
    assert lost > 0
    messages = [str(w.message) for w in said]
    assert any(f"{lost:,} spans of its windows could be written nowhere and are lost" in m for m in messages), messages
    assert not any("its windows and metadata are kept in" in m for m in messages)


def test_the_recover_command_said_for_a_run_in_parts_is_one_that_recovers(tmp_path, monkeypatch):
    """It named the last part (`xsp recover .../part-1.xsp.parquet`), where recover found nothing:
    a run in parts keeps its windows beside its first part."""
    import re
    import time

    monkeypatch.setenv("XSP_RUN_ID", "full")
    monkeypatch.setattr(xsp.session.ending, "write_trace_tables", _no_space)  # the last part only
    folder = tmp_path / "runs" / "run=full" / "rank=0"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with pytest.warns(xsp.XspWarning) as said, torch.no_grad(), \
            xsp.trace(levels="model,layer", dataset=tmp_path / "runs", rotate=0.2, window_s=0.05) as session:
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and not (folder / "part-1.xsp.parquet").exists():
            model(torch.randn(2, 8))
            time.sleep(0.001)
        model(torch.randn(2, 8))
    told = next(str(w.message) for w in said if "the trace file was not written" in str(w.message))
    target = re.search(r"`xsp recover (\S+)`", told)
    assert target is not None, told
    monkeypatch.undo()
    sealed = sorted(folder.glob("part-*.xsp.parquet"))
    from xsp.cli.main import main

    assert main(["recover", target.group(1)]) == 0  # as the warning says it
    written = sorted(set(folder.glob("part-*.xsp.parquet")) - set(sealed))
    assert len(written) == 1
    assert _steps(written[0]) == int((session.trace.spans[col.KIND] == col.SpanKind.PREDICT.value).sum())


IN_PARTS_UNTIL_TWO_SEALED = """
import pathlib, sys, time, torch
folder = pathlib.Path(sys.argv[1]) / "run=full" / "rank=0"
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
give_up = time.monotonic() + 60
with torch.no_grad():
    while time.monotonic() < give_up and not (folder / "part-1.xsp.parquet").exists():
        model(torch.randn(2, 8))
        time.sleep(0.001)
    model(torch.randn(2, 8))
"""


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_xsp_run_says_which_part_of_a_run_in_parts_it_counts_when_the_last_cannot_be_written(tmp_path):
    """It printed "xsp: 9,749 spans, 2,437 steps", the last part's counts for a run of 3,049 steps,
    and named no file."""
    script = tmp_path / "loop.py"
    script.write_text(IN_PARTS_UNTIL_TWO_SEALED)
    code = ("import errno, sys, xsp.session.ending as ending\n"
            "def full(*_, **__):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "ending.write_trace_tables = full\n"
            "from xsp.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", code, "run", "--dataset", str(tmp_path / "runs"), "--rotate", "0.3",
                           "--", str(script), str(tmp_path / "runs")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "XSP_RUN_ID": "full", "XSP_WINDOW_S": "0.1"})
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "runs" / "run=full" / "rank=0"
    sealed = len(list(folder.glob("part-*.xsp.parquet")))
    line = next(line for line in done.stderr.splitlines() if line.startswith("xsp: ") and " spans, " in line)
    assert line.endswith(f"in the last of {sealed + 1} parts, not written (the {sealed} before it are in "
                         f"runs{os.sep}run=full{os.sep}rank=0{os.sep})"), line


def test_the_folders_said_to_keep_the_windows_are_those_that_hold_them(full_disk, monkeypatch, tmp_path):
    """A disk full from the start: every window went to the spool, and the warning said they were
    kept in the folder beside the output too, which held only the session's start."""
    monkeypatch.setattr(segments, "MEMORY_BOUND_BYTES", 1)
    output, fill = full_disk
    fill()
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(10)])
    with pytest.warns(xsp.XspWarning) as said, xsp.trace(levels="model,layer", output=output):
        for _ in range(STEPS):
            model(torch.randn(2, 16))
    told = next(str(w.message) for w in said if "the trace file was not written" in str(w.message))
    spooled = next((tmp_path / "spool" / "xsp-spool").iterdir())
    beside = [folder for folder in output.parent.iterdir() if folder.is_dir()]
    assert beside and not any(any(folder.glob(segments.SEGMENT_PATTERN)) for folder in beside)
    assert f"kept in {spooled} (" in told and str(beside[0]) not in told, told
    written, _ = recover(output)
    assert _steps(written) == STEPS
