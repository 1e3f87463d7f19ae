"""xsp's stand-ins for heavy modules (xsp.core.lazy): imported on first use, and never by two of
xsp's threads at once (two threads importing pandas together can each be handed it half made)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from xsp.core.lazy import background_imports_done, forks_wait, lazy_module

CLOCKS_APART_NS = 5_000_000
"""How far the spans' epoch times may sit from ``time.time_ns()`` (their offset is measured to µs):
far less than the 300 ms the imports are held for."""


def test_a_stand_in_imports_its_module_on_the_first_read_and_keeps_what_it_read():
    colorsys = lazy_module("colorsys")
    assert colorsys.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert "rgb_to_hsv" in vars(colorsys)  # kept: the next read is a plain attribute read


def test_xsps_imports_on_another_thread_wait_for_those_beside_the_program():
    importing, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def beside_the_program() -> None:
        with forks_wait():
            importing.set()
            finish.wait(30)
            order.append("background imports done")

    def first_read() -> None:
        sys.modules.pop("netrc", None)
        lazy_module("netrc").netrc  # noqa: B018  (the read is what is tested)
        order.append("stand-in read")

    def session_end() -> None:
        background_imports_done()
        order.append("end went on")

    background = threading.Thread(target=beside_the_program)
    background.start()
    assert importing.wait(30)
    waiting = [threading.Thread(target=first_read), threading.Thread(target=session_end)]
    for thread in waiting:
        thread.start()
    for thread in waiting:
        thread.join(0.3)
    assert all(thread.is_alive() for thread in waiting) and order == []  # both wait for the imports
    finish.set()
    for thread in [background, *waiting]:
        thread.join(30)
    assert order[0] == "background imports done" and sorted(order[1:]) == ["end went on", "stand-in read"]


def test_the_thread_that_imports_may_read_stand_ins_itself():
    with forks_wait():  # re-entered by the same thread: no wait on itself
        background_imports_done()
        assert lazy_module("colorsys").hls_to_rgb(0.0, 0.5, 0.0) == (0.5, 0.5, 0.5)


def test_a_threads_first_model_call_waits_for_xsps_imports_before_its_clock_starts():
    """Beside xsp's imports each torch operator waited for the GIL (a small model's calls took
    16 ms instead of 35 µs, and were recorded so): a thread's first call now waits them out."""
    import torch
    from torch import nn

    import xsp
    from xsp.core import schema as col

    importing, finish = threading.Event(), threading.Event()
    imports_done_ns: list[int] = []
    called: list[str] = []

    def beside_the_program() -> None:
        with forks_wait():
            importing.set()
            finish.wait(30)
            imports_done_ns.append(time.time_ns())  # spans are in epoch ns

    model = nn.Linear(2, 2)
    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        background = threading.Thread(target=beside_the_program)
        background.start()
        assert importing.wait(30)
        caller = threading.Thread(target=lambda: (model(torch.zeros(1, 2)), called.append("model called")))
        caller.start()
        caller.join(0.3)
        assert caller.is_alive() and called == []  # its first call waits for the imports
        finish.set()
        for thread in (background, caller):
            thread.join(30)
    assert called == ["model called"]
    predicts = session.trace.spans[session.trace.spans[col.KIND] == "predict"]
    assert len(predicts) == 1 and int(predicts[col.START_NS].iloc[0]) >= imports_done_ns[0] - CLOCKS_APART_NS


@pytest.mark.parametrize("opening", ["step", "span"])
def test_a_threads_first_step_or_span_waits_for_xsps_imports_before_its_clock_starts(opening):
    """``xsp.step`` read its clock before its thread's buffer waited for the imports: a service's
    first request step held some 300 ms of xsp's wait, and the report called it the program's warm-up."""
    import torch
    from torch import nn

    import xsp
    from xsp.core import schema as col

    importing, finish = threading.Event(), threading.Event()
    imports_done_ns: list[int] = []
    model = nn.Linear(2, 2)

    def beside_the_program() -> None:
        with forks_wait():
            importing.set()
            finish.wait(30)
            imports_done_ns.append(time.time_ns())  # spans are in epoch ns

    def request() -> None:
        with getattr(xsp, opening)("request"), torch.no_grad():
            model(torch.zeros(1, 2))

    with xsp.trace(levels="model", output=None) as session:
        background = threading.Thread(target=beside_the_program)
        background.start()
        assert importing.wait(30)
        caller = threading.Thread(target=request)
        caller.start()
        caller.join(0.3)
        assert caller.is_alive()  # waiting for the imports
        finish.set()
        for thread in (background, caller):
            thread.join(30)
    spans = session.trace.spans
    opened = spans[spans[col.NAME] == "request"]
    assert len(opened) == 1 and int(opened[col.START_NS].iloc[0]) >= imports_done_ns[0] - CLOCKS_APART_NS
