"""Where in my code: time by line (xsp.analysis.lines), the report's lines, diffs by line, and
the speedscope and folded-stack exports, on programs whose answer is known.

The user's code is a file written to a temporary folder. Its layers *sleep* set times, so each
line's share of a step is known whatever the machine's load (a sleep lasts at least its time,
and a few percent of scheduling delay moves no share by 5 points).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import numpy as np
import pandas as pd
import pytest
import torch

import xsp
from tests.user_code import marked_line, user_module
from xsp.analysis.lines import LINE_COLUMNS, line_keys, lines
from xsp.core import schema as col
from xsp.core.schema import SpanKind
from xsp.export.stacks import collapsed_stacks, frame_events, speedscope_document

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "speedscope-file-format-schema.json"

USER_CODE = '''
import threading
import time

import torch
import xsp
from torch import nn


class Sleep(nn.Module):
    def __init__(self, ms):
        super().__init__()
        self.ms = ms

    def forward(self, x):
        if self.ms:  # (sleep(0) gives the CPU up, and a busy machine may not give it back soon)
            time.sleep(self.ms / 1000)
        return x


class Net(nn.Module):
    def __init__(self, big_ms=8.0, tiny_ms=1.0):
        super().__init__()
        self.big, self.small, self.tiny = Sleep(big_ms), Sleep(2.0), Sleep(tiny_ms)

    def forward(self, x):
        x = self.big(x)  # BIG
        x = helper(self.small, x)  # FIRST_HELPER_CALL
        x = helper(self.small, x)  # SECOND_HELPER_CALL
        for _ in range(3):
            x = self.tiny(x)  # LOOP
        return x


def helper(layer, x):
    return inner(layer, x)


def inner(layer, x):
    return layer(x)  # INNER


def run(model, steps):
    x = torch.zeros(1)
    for _ in range(steps):
        model(x)  # MODEL


def in_threads(first, second, steps):
    workers = [threading.Thread(target=run, args=(first, steps)), threading.Thread(target=other, args=(second, steps))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def other(model, steps):
    x = torch.zeros(1)
    for _ in range(steps):
        model(x)  # OTHER
'''

LAYER_OF_LINE = {"BIG": "big", "INNER": "small", "LOOP": "tiny"}
"""The layer each line calls. Per step: big 8 ms; the helper's inner line 2 x 2 ms (called from
two lines, through two functions); the loop 3 x 1 ms."""


def _known_shares(trace: xsp.Trace) -> dict[str, float]:
    """Each line's share of the steps: the time of the layer it calls, as the layer's own spans
    measured it (a sleep lasts longer than asked on a busy machine, the longer the busier)."""
    spans = trace.spans
    steps_ns = spans.loc[spans[col.KIND] == SpanKind.PREDICT.value, col.DURATION_NS].sum()
    layers = spans[spans[col.KIND] == SpanKind.FORWARD.value]
    return {marker: layers.loc[layers[col.NAME].str.endswith(f".{layer}"), col.DURATION_NS].sum() / steps_ns
            for marker, layer in LAYER_OF_LINE.items()}


@pytest.fixture
def user(tmp_path: Path) -> ModuleType:
    return user_module(tmp_path / "user_lines.py", USER_CODE, "user_lines_for_tests")


def _line(module: ModuleType, marker: str) -> int:
    return marked_line(module, marker)


def _trace(program: Any, levels: str = "model,layer") -> xsp.Trace:
    with xsp.trace(levels=levels, output=None) as session:
        program()
    return session.trace


def test_each_lines_share_is_its_known_share(user):
    trace = _trace(lambda: user.run(user.Net(), 6))
    found = lines(trace).set_index("line")
    assert list(lines(trace).columns) == LINE_COLUMNS
    known_shares = _known_shares(trace)
    assert known_shares["BIG"] == pytest.approx(8 / 15, abs=0.25)  # the sleeps ran (as long as asked, or longer)
    for marker, known in known_shares.items():
        row = found.loc[_line(user, marker)]
        assert abs(row["self_share"] - known) <= 0.05, (marker, row["self_share"], known)
        assert row["file"] == user.__file__
    # the line that called the model holds all of it, and none of its own
    model_line = found.loc[_line(user, "MODEL")]
    assert model_line["share"] == pytest.approx(1.0, abs=0.01) and model_line["self_share"] < 0.05
    assert model_line["function"] == "run" and model_line["calls"] == 6
    # the inner line of the helper counts each call once: 2 a step, through both calling lines
    assert found.loc[_line(user, "INNER"), "calls"] == 12
    assert found.loc[_line(user, "INNER"), "function"] == "inner"
    assert found.loc[_line(user, "LOOP"), "calls"] == 18
    # lines the walk passes over (calls of plain functions) are no rows of their own
    assert _line(user, "FIRST_HELPER_CALL") not in found.index
    # self times add up to the steps' time, once
    assert found["self_share"].sum() == pytest.approx(1.0, abs=0.02)


def test_threads_keep_their_own_lines(user):
    trace = _trace(lambda: user.in_threads(user.Net(4.0), user.Net(1.0), 3))
    found = lines(trace).set_index("line")
    assert found.loc[_line(user, "MODEL"), "threads"] == 1
    assert found.loc[_line(user, "OTHER"), "threads"] == 1
    assert found.loc[_line(user, "MODEL"), "calls"] == 3 and found.loc[_line(user, "OTHER"), "calls"] == 3
    # the big layer ran on both threads from one line
    assert found.loc[_line(user, "BIG"), "threads"] == 2


def test_a_user_span_around_a_model_call_holds_it(user):
    def program() -> None:
        model, x = user.Net(1.0), torch.zeros(1)
        for _ in range(2):
            with xsp.span("outer"):
                model(x)

    trace = _trace(program)
    found = lines(trace)
    span_line = found[found["calls"] == 2].sort_values("inclusive_ms").iloc[-1]
    model_rows = found[found["function"].str.endswith("program")]
    # the span's line holds the model call's line inside it: its self time is only its own
    assert len(model_rows) == 2
    assert model_rows["self_ms"].min() < 0.05 * span_line["inclusive_ms"]


def test_kernels_take_the_line_of_their_launch():
    """A kernel (GPU) under its launch under a layer with a line: its time is that line's."""
    spans = pd.DataFrame({
        col.SPAN_ID: [1, 2, 3, 4], col.PARENT_ID: [None, 1, 2, 3], col.NAME: ["model", "model.fc", "cudaLaunchKernel",
                                                                               "gemm"],
        col.LEVEL: ["model", "layer", "cuda_api", "kernel"], col.KIND: ["predict", "forward", "runtime", "kernel"],
        col.START_NS: [0, 10, 20, 40], col.END_NS: [100, 90, 30, 70], col.THREAD_ID: [1, 1, 1, None],
        col.STEP: [0, 0, 0, 0], col.CALL_FILE: ["/a/train.py", "/a/net.py", None, None],
        col.CALL_LINE: [5, 12, None, None], col.CALL_FUNCTION: ["main", "Net.forward", None, None],
        col.CORRELATION_ID: [None, None, 7, 7]})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    trace = xsp.Trace(spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64", col.CALL_LINE: "Int64",
                                    col.CORRELATION_ID: "Int64"}))
    found = lines(trace).set_index("line")
    assert found.loc[12, "kernel_ms"] == pytest.approx(30 / 1e6)
    assert found.loc[5, "kernel_ms"] == 0
    assert found.loc[12, "self_ms"] == pytest.approx(80 / 1e6)  # the launch is host time of the layer's line


def test_kernels_take_the_line_of_the_operator_that_launched_them():
    """With the operator level, an operator has the line inside forward that issued it: the
    kernel its launch starts is that line's, not the layer's call line."""
    spans = pd.DataFrame({
        col.SPAN_ID: [1, 2, 3, 4, 5], col.PARENT_ID: [None, 1, 2, 3, 4],
        col.NAME: ["model", "model.block", "aten::mm", "cudaLaunchKernel", "gemm"],
        col.LEVEL: ["model", "layer", "operator", "cuda_api", "kernel"],
        col.KIND: ["predict", "forward", "operator", "runtime", "kernel"],
        col.START_NS: [0, 10, 15, 20, 40], col.END_NS: [100, 90, 35, 30, 70], col.THREAD_ID: [1, 1, 1, 1, None],
        col.STEP: [0, 0, 0, 0, 0], col.CALL_FILE: ["/a/train.py", "/a/net.py", "/a/net.py", None, None],
        col.CALL_LINE: [5, 12, 31, None, None], col.CALL_FUNCTION: ["main", "Net.forward", "Block.forward", None, None],
        col.CORRELATION_ID: [None, None, None, 7, 7]})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    trace = xsp.Trace(spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64", col.CALL_LINE: "Int64",
                                    col.CORRELATION_ID: "Int64"}))
    found = lines(trace).set_index("line")
    assert found.loc[31, "kernel_ms"] == pytest.approx(30 / 1e6)
    assert found.loc[12, "kernel_ms"] == 0 and found.loc[5, "kernel_ms"] == 0
    assert found.loc[31, "self_ms"] == pytest.approx(20 / 1e6)  # the operator, its launch included
    assert found.loc[12, "self_ms"] == pytest.approx(60 / 1e6)


def test_a_trace_without_lines_has_none(user):
    with xsp.trace(levels="model", output=None) as session:
        user.run(user.Net(0.0), 1)
    without = session.trace.spans.drop(columns=[col.CALL_FILE, col.CALL_LINE, col.CALL_FUNCTION])
    assert lines(without).empty and list(lines(without).columns) == LINE_COLUMNS


def test_line_keys_name_each_lines_outermost_spans(user):
    trace = _trace(lambda: user.run(user.Net(0.0), 2))
    from xsp.table.walks import parent_positions

    keys = line_keys(trace.spans, parent_positions(trace.spans)).dropna()
    assert set(keys) == {f"user_lines.py:{_line(user, m)} {f}" for m, f in
                         (("MODEL", "run"), ("BIG", "Net.forward"), ("INNER", "inner"), ("LOOP", "Net.forward"))}


def test_diff_by_line_attributes_a_slower_line_to_it(user):
    # the line that must stay unchanged sleeps 0 ms: three 1 ms sleeps overslept by more than 5% in
    # one trace than in the other on a busy CI machine (its change is then real, not xsp's error);
    # a call that does nothing moves by less than the 20 µs a change must have to be judged
    base = _trace(lambda: user.run(user.Net(8.0, tiny_ms=0.0), 12))
    new = _trace(lambda: user.run(user.Net(16.0, tiny_ms=0.0), 12))
    result = xsp.diff(base, new, by="line", machine_speed=False)
    table = result.table.set_index("key")
    big = f"user_lines.py:{_line(user, 'BIG')} Net.forward"
    assert table.loc[big, "verdict"] == "regressed"
    assert table.loc[f"user_lines.py:{_line(user, 'LOOP')} Net.forward", "verdict"] == "unchanged"
    assert result.breakdown["key"].iloc[1] == big


def _validated(document: dict[str, Any]) -> None:
    jsonschema.validate(document, json.loads(SCHEMA.read_text()))


def test_speedscope_is_valid_balanced_and_round_trips(user):
    trace = _trace(lambda: user.in_threads(user.Net(1.0), user.Net(1.0), 2), levels="model,layer,operator")
    document = speedscope_document(trace)
    _validated(document)
    frames = document["shared"]["frames"]
    spans = trace.spans[trace.spans[col.LEVEL] != "kernel"]
    assert len(document["profiles"]) == spans[col.THREAD_ID].nunique()
    rebuilt: Counter[tuple[str, int]] = Counter()
    for profile in document["profiles"]:
        stack: list[tuple[int, float]] = []
        last = -1.0
        for event in profile["events"]:
            assert event["at"] >= last
            last = event["at"]
            if event["type"] == "O":
                stack.append((event["frame"], event["at"]))
            else:
                frame, opened = stack.pop()
                assert frame == event["frame"]  # balanced: each close closes the frame on top
                rebuilt[(frames[frame]["name"], round(event["at"] - opened))] += 1
        assert not stack
    origin = int(trace.spans[col.START_NS].min())
    del origin
    # every span comes back as a frame of its name and duration
    expected = Counter(zip(spans[col.NAME], spans[col.DURATION_NS].astype(int)))
    assert expected - rebuilt == Counter()
    # the line frames carry the file and the line
    line_frames = [f for f in frames if "line" in f]
    assert {f["line"] for f in line_frames} >= {_line(user, m) for m in ("MODEL", "OTHER", "BIG", "INNER", "LOOP")}
    assert all(f["file"] == user.__file__ for f in line_frames)


def test_the_speedscope_file_is_written_as_the_events_come_and_is_the_document(user, tmp_path, monkeypatch):
    from xsp.export import stacks

    trace = _trace(lambda: user.in_threads(user.Net(1.0), user.Net(1.0), 2), levels="model,layer,operator")
    whole = stacks.write_speedscope(trace, tmp_path / "whole.speedscope.json").read_bytes()  # one write a profile
    monkeypatch.setattr(stacks, "EVENTS_PER_WRITE", 3)  # many writes per profile
    written = json.loads(stacks.write_speedscope(trace, tmp_path / "run.speedscope.json").read_text())
    assert json.dumps(written, separators=(",", ":")).encode() == whole
    assert written == speedscope_document(trace)
    assert len(written["profiles"]) > 1
    _validated(written)
    empty = xsp.Trace(trace.spans.iloc[0:0])
    assert json.loads(stacks.write_speedscope(empty, tmp_path / "empty.json").read_text()) == speedscope_document(
        empty)


def test_folded_stacks_add_up_and_put_lines_under_models_and_layers(user):
    trace = _trace(lambda: user.run(user.Net(2.0), 3))
    stacks = collapsed_stacks(trace)
    spans = trace.spans
    session = spans[spans[col.KIND] == SpanKind.SESSION.value]
    assert sum(stacks.values()) == int(session[col.DURATION_NS].sum())
    big = f"user_lines.py:{_line(user, 'BIG')} Net.forward"
    chains = [stack.split(";") for stack in stacks]
    assert ["session", f"user_lines.py:{_line(user, 'MODEL')} run", "model", big, "model.big"] in chains
    # a layer's own time sits on its stack: the big layer's 3 x 2 ms
    own = sum(v for s, v in stacks.items() if s.endswith(";" + big + ";model.big"))
    assert own >= 3 * 2_000_000


def test_stacks_of_overlapping_spans_never_hold_more_time_than_ran():
    spans = pd.DataFrame({
        col.SPAN_ID: [1, 2, 3], col.PARENT_ID: [None, 1, 1], col.NAME: ["a", "b;c", "d"],
        col.LEVEL: ["model", "layer", "layer"], col.KIND: ["predict", "forward", "forward"],
        col.START_NS: [0, 10, 50], col.END_NS: [100, 60, 150], col.THREAD_ID: [1, 1, 1], col.STEP: [0, 0, 0]})
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    trace = xsp.Trace(spans.astype({col.PARENT_ID: "Int64", col.THREAD_ID: "Int64"}))
    events = list(frame_events(trace))
    depth = 0
    for event in events:
        depth += 1 if event.opened else -1
        assert depth >= 0
    assert depth == 0
    stacks = collapsed_stacks(trace)
    # d starts inside b, so it is b's callee, cut at b's end: what ran past it is no stack's
    assert stacks == Counter({"a": 50, "a;b:c": 40, "a;b:c;d": 10})
    _validated(speedscope_document(trace))


@pytest.mark.parametrize("fmt", ["speedscope", "collapsed"])
def test_the_cli_exports_and_reports_lines(user, tmp_path, fmt):
    trace = _trace(lambda: user.run(user.Net(2.0), 2))
    path = trace.save(tmp_path / "run.xsp.parquet")
    out = tmp_path / f"run.{fmt}"
    done = subprocess.run([sys.executable, "-m", "xsp", "export", "--format", fmt, str(path), "-o", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if fmt == "speedscope":
        _validated(json.loads(out.read_text()))
    else:
        assert all(re.fullmatch(r".+ \d+", line) for line in out.read_text().splitlines())
    report = subprocess.run([sys.executable, "-m", "xsp", "report", "--lines", str(path)], capture_output=True,
                            text=True, env={**__import__("os").environ, "COLUMNS": "80"})
    assert report.returncode == 0, report.stderr
    text = report.stdout
    assert "lines of your code" in text
    assert "user_lines.py:" in text and "x = self.big(x)" in text
    assert max(map(len, text.splitlines())) <= 80


def test_the_report_says_when_a_trace_has_no_lines(user, tmp_path):
    from rich.console import Console

    from xsp.reports.terminal import lines_table

    spans = _trace(lambda: user.run(user.Net(0.0), 1)).spans.drop(columns=[col.CALL_LINE])
    console = Console(width=80, record=True)
    lines_table(xsp.Trace(spans), console, 5)
    assert "no line of your code" in console.export_text()


def test_compiled_and_scripted_code_has_the_line_that_called_it(user):
    model = user.Net(0.0)
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    x = torch.zeros(1, 2)

    def program() -> None:
        for _ in range(2):
            scripted(x)  # the scripted call's line
            compiled(x)  # the compiled call's line
        user.run(model, 1)

    trace = _trace(program)
    spans = trace.spans
    here = Path(__file__).read_text().splitlines()
    scripted_line = next(n for n, t in enumerate(here, 1) if t.strip() == "scripted(x)  # the scripted call's line")
    compiled_line = next(n for n, t in enumerate(here, 1) if t.strip() == "compiled(x)  # the compiled call's line")
    predicts = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    recorded = set(zip(predicts[col.CALL_FILE].astype(object), predicts[col.CALL_LINE].astype(object)))
    assert (__file__, scripted_line) in recorded
    assert (__file__, compiled_line) in recorded
    # nothing inside a compiled or scripted call has a line of torch's own code
    with_lines = spans[spans[col.CALL_FILE].notna()]
    assert not with_lines[col.CALL_FILE].astype(str).str.contains("site-packages").any()
    assert np.isin(with_lines[col.CALL_FILE].astype(str), [__file__, user.__file__]).all()


def test_the_html_report_shows_the_hottest_file_as_annotated_source(user):
    from xsp.reports.html import HEAT_MOST, render_html

    page = render_html(_trace(lambda: user.run(user.Net(8.0), 2)))
    section = page[page.index("<h2>Where in your code</h2>"):]
    section = section[:section.index("</section>")]
    assert "user_lines.py" in section
    big = _line(user, "BIG")
    row = re.search(rf"<tr class='hot' style='background: rgba\(220, 40, 0, ([0-9.]+)\)'><td class='n'>{big}</td>",
                    section)
    assert row is not None and float(row.group(1)) == pytest.approx(HEAT_MOST)  # the hottest line: the darkest
    assert "x = self.big(x)  # BIG" in section


def test_time_outside_every_step_counts_in_no_share(user):
    """Operators run while a model is built (its weights' aten::uniform_, outside every step)
    counted in the shares, whose denominator is the steps' time: they summed to 109%."""

    def program() -> None:
        for _ in range(3):
            torch.nn.Linear(512, 512)  # built inside the session: operators outside every step
        user.run(user.Net(), 3)

    trace = _trace(program, levels="model,layer,operator")
    spans = trace.spans
    outside = spans[(spans[col.LEVEL] == "operator") & spans[col.STEP].isna() & spans[col.CALL_LINE].notna()]
    assert len(outside) > 0
    found = lines(trace)
    assert found["self_share"].sum() == pytest.approx(1.0, abs=0.02)
    assert found["share"].max() <= 1.0 + 1e-9
