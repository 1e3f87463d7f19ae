"""xsp's stand-ins for heavy modules (xsp.core.lazy): imported on first use, and never by two of
xsp's threads at once (two threads importing pandas together can each be handed it half made)."""

from __future__ import annotations

import sys
import threading

from xsp.core.lazy import background_imports_done, forks_wait, lazy_module


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
