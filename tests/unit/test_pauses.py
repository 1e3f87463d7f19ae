"""Where an always-on session's closed window waits for a pause in the program's steps before its
work starts (xsp/session/pauses.py), told by a hand-made time of the last step's start."""

from __future__ import annotations

import threading
import time

from xsp.core.clock import now_ns
from xsp.session.pauses import PauseWait


class Steps:
    """When the last step began: just now at each reading while ``going`` (a program that never
    pauses), else long ago. Counts the readings."""

    def __init__(self, going: bool) -> None:
        self.going = going
        self.readings = 0

    def __call__(self) -> int:
        self.readings += 1
        return now_ns() if self.going else 1


def never() -> bool:
    return False


def counts(wait: PauseWait) -> tuple[int, int, int]:
    return wait.after_pause, wait.past_wait, wait.at_once


def test_a_window_starts_in_the_first_pause_of_the_steps():
    wait = PauseWait(Steps(going=False), never, longest_wait_s=60.0, pause_s=0.02)
    wait.wait(now_ns(), never, never)
    assert counts(wait) == (1, 0, 0)


def test_a_pause_is_seen_once_it_has_lasted_from_the_last_step_on():
    began_ns = now_ns()  # the last step began now; none after it
    wait = PauseWait(lambda: began_ns, never, longest_wait_s=60.0, pause_s=0.05)
    wait.wait(began_ns, never, never)
    assert counts(wait) == (1, 0, 0)
    assert now_ns() - began_ns >= 0.05e9  # not before the pause was whole


def test_a_step_under_way_is_no_pause_however_long_since_the_last_began():
    running = iter([True] * 3 + [False] * 2)  # a long step (a slow request), then none (seen twice)
    wait = PauseWait(Steps(going=False), lambda: next(running), longest_wait_s=60.0, pause_s=0.02)
    wait.wait(now_ns(), never, never)
    assert counts(wait) == (1, 0, 0)
    assert next(running, "all read") == "all read"  # it asked until the step was over


class BackToBack:
    """Long steps one after another: each look finds one under way, except the looks listed in
    ``gaps`` (counted from 0), which fall between one step's end and the next one's start; the
    next step begins right after each gap."""

    def __init__(self, gaps: set[int]) -> None:
        self.gaps = gaps
        self.looks = 0
        self.began_ns = 1  # long ago: only whether a step runs tells

    def last_begun_ns(self) -> int:
        return self.began_ns

    def running(self) -> bool:
        look, self.looks = self.looks, self.looks + 1
        if look in self.gaps:
            return False
        if look - 1 in self.gaps:
            self.began_ns += 1  # the step after the gap began (a moment after the look)
        return True


def test_the_gap_between_long_steps_back_to_back_is_no_pause():
    steps = BackToBack(gaps={2, 5})
    wait = PauseWait(steps.last_begun_ns, steps.running, longest_wait_s=0.3, pause_s=0.02)
    wait.wait(now_ns(), never, never)
    assert counts(wait) == (0, 1, 0)
    assert steps.looks > 6  # it looked past both gaps


def test_steps_that_never_pause_hold_a_window_back_no_longer_than_its_longest_wait():
    wait = PauseWait(Steps(going=True), never, longest_wait_s=0.1, pause_s=0.02)
    wait.wait(now_ns(), never, never)
    assert counts(wait) == (0, 1, 0)


def test_a_window_taken_longer_ago_than_its_longest_wait_starts_at_once():
    steps = Steps(going=True)
    wait = PauseWait(steps, never, longest_wait_s=0.5, pause_s=10.0)
    wait.wait(now_ns() - 10**9, never, never)  # a backlog: waiting would only add to it
    assert counts(wait) == (0, 1, 0)
    assert steps.readings == 0  # never waited on


def test_a_window_waits_no_longer_once_the_next_one_is_taken():
    wait = PauseWait(Steps(going=True), never, longest_wait_s=600.0, pause_s=0.01)
    polls = iter([False, False, True])
    wait.wait(now_ns(), never, lambda: next(polls))  # returns: the test would hang otherwise
    assert counts(wait) == (0, 1, 0)


def test_the_session_ending_stops_the_wait_at_once():
    wait = PauseWait(Steps(going=True), never, longest_wait_s=600.0, pause_s=600.0)
    ended = threading.Thread(target=wait.wait, args=(now_ns(), never, never))
    ended.start()
    time.sleep(0.05)
    wait.hurry.set()
    ended.join(timeout=30)
    assert not ended.is_alive()
    assert counts(wait) == (0, 0, 1)


def test_a_capture_being_recorded_is_not_held_back():
    wait = PauseWait(Steps(going=True), never, longest_wait_s=600.0, pause_s=600.0)
    wait.wait(now_ns(), lambda: True, never)  # returns without waiting: the test would hang otherwise
    assert counts(wait) == (0, 0, 1)
