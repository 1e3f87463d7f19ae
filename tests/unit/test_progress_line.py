"""The CLI's progress line: a spinner on a terminal while slow work runs, nothing in a pipe; the
session tells it when the end-of-run write starts and ends."""

from __future__ import annotations

import io

import torch
from rich.console import Console

import xsp
from xsp.cli import _common


def _stderr(monkeypatch, terminal: bool) -> io.StringIO:
    written = io.StringIO()
    monkeypatch.setattr(_common, "error_console",
                        lambda: Console(file=written, force_terminal=terminal, width=80, color_system=None))
    return written


def test_a_terminal_sees_what_is_being_done_and_a_pipe_nothing(monkeypatch):
    written = _stderr(monkeypatch, terminal=True)
    with _common.progress("reading big.json.gz") as say:
        say("writing big.xsp.parquet")
    assert "reading big.json.gz" in written.getvalue() or "writing big.xsp.parquet" in written.getvalue()
    piped = _stderr(monkeypatch, terminal=False)
    with _common.progress("reading big.json.gz") as say:
        say("writing big.xsp.parquet")
    assert piped.getvalue() == ""


def test_the_session_says_when_it_writes_its_trace(tmp_path):
    told: list[bool] = []
    model = torch.nn.Linear(4, 4)
    with xsp.trace(output=tmp_path / "t.xsp.parquet") as session, torch.no_grad():
        session.on_finishing.append(told.append)
        model(torch.randn(1, 4))
    assert told == [True, False] and (tmp_path / "t.xsp.parquet").exists()
