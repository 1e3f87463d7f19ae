"""Automatic steps on hand-made event sequences: what a loop's iterations become."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xsp.record.marks import MarkKind
from xsp.record.steps import AutoSteps

ENCODER, HEAD, MODEL = 1, 2, 3


BASE = 1_000_000
"""The made-up clock's origin (a host clock never reads 0)."""


class Loop:
    """Drives one thread's AutoSteps through a loop's events on a made-up clock (1 unit = 1 ns),
    and reports times from the clock's origin."""

    def __init__(self) -> None:
        self.decided: list[int] = []
        recording = SimpleNamespace(on_long_step=self.decided.append, long_step_ns=0, sampler=None)
        self.buffer = SimpleNamespace(marks=[], open_steps=0, depth=0, recording=recording, optimizer_starts=[])
        self.steps = AutoSteps(self.buffer)  # type: ignore[arg-type]
        self.now = BASE

    def tick(self, duration: int) -> tuple[int, int]:
        start = self.now
        self.now += duration
        return start, self.now

    def call(self, model: int, duration: int = 10, training: bool = False) -> None:
        start, end = self.tick(duration)
        self.steps.call_begins(model, start, training)
        self.steps.call_ends(end)

    def wait(self, duration: int = 5, last: bool = False) -> None:
        start, end = self.tick(duration)
        self.steps.wait_begins(start)
        if last:
            self.steps.forget_wait(start)
        self.steps.piece_ends(end)

    def backward(self, duration: int = 20) -> None:
        start, end = self.tick(duration)
        self.steps.piece_ends(end, trains=True, start_ns=start)

    def optimizer(self, duration: int = 4) -> None:
        self.steps.optimizer_ends(*self.tick(duration))

    def idle(self, duration: int = 3) -> None:
        self.tick(duration)

    def end(self) -> list[tuple[str, int, int]]:
        self.steps.finish()
        return [(name, start - BASE, end - BASE) for kind, start, end, name, _, _ in self.buffer.marks
                if kind == MarkKind.STEP]


def test_one_model_per_iteration_each_call_is_its_own_step():
    loop = Loop()
    for _ in range(3):
        loop.call(MODEL)
        loop.idle()
    assert loop.end() == []  # no step spans: each model call is its step
    assert loop.decided == [10, 10, 10]  # decided as the next began, the last at the end


def test_a_second_model_joins_the_step_of_the_first():
    loop = Loop()
    for _ in range(2):
        loop.call(ENCODER)
        loop.idle(2)
        loop.call(HEAD, 4)
        loop.idle(3)
    assert loop.end() == [("inference_step", 0, 16), ("inference_step", 19, 35)]


def test_the_input_wait_before_a_call_begins_its_step_and_the_loops_end_begins_none():
    loop = Loop()
    loop.wait()
    loop.call(MODEL)
    loop.wait()
    loop.call(MODEL)
    loop.wait(last=True)  # StopIteration
    assert loop.end() == [("inference_step", 0, 15), ("inference_step", 15, 30)]
    assert not loop.steps.holding


def test_a_training_iteration_runs_from_one_optimizer_step_to_the_next():
    loop = Loop()
    for _ in range(3):
        loop.wait()
        loop.idle(1)  # zero_grad
        loop.call(MODEL, training=True)
        loop.call(HEAD, 2, training=True)  # the loss module
        loop.backward()
        loop.optimizer()
        loop.idle(2)  # zero_grad after the optimizer: the next iteration's
    steps = loop.end()
    assert [name for name, _, _ in steps] == ["train_step"] * 3
    assert steps[0] == ("train_step", 0, 42)
    assert steps[1][1] == 42 and steps[2][1] == steps[1][2]  # back to back: nothing falls between
    assert steps[2][2] == 42 + 2 * 44  # the last one ends at its optimizer step, not at the session's end


def test_two_optimizers_in_one_iteration_end_one_step():
    loop = Loop()
    for _ in range(2):
        loop.call(ENCODER, training=True)  # discriminator
        loop.backward()
        loop.optimizer()
        loop.call(HEAD, training=True)  # generator
        loop.backward()
        loop.optimizer()
    assert [(start, end) for _, start, end in loop.end()] == [(0, 68), (68, 136)]


def test_gradient_accumulation_is_one_step_per_optimizer_step():
    loop = Loop()
    loop.steps.optimizer_seen = True  # a run that has stepped its optimizer before
    for _ in range(2):
        for _ in range(4):
            loop.wait()
            loop.call(MODEL, training=True)
            loop.backward()
        loop.optimizer()
    steps = loop.end()
    assert [(start, end) for _, start, end in steps] == [(0, 144), (144, 288)]


def test_evaluation_between_training_steps_is_reported_apart():
    loop = Loop()
    loop.wait()
    loop.call(MODEL, training=True)
    loop.backward()
    loop.optimizer()  # ends at 39
    loop.idle(10)  # logging
    for _ in range(2):  # evaluation: no autograd
        loop.wait()
        loop.call(MODEL)
    loop.idle(10)
    loop.wait()  # training again
    loop.call(MODEL, training=True)
    loop.backward()
    loop.optimizer()
    assert loop.end() == [("train_step", 0, 39), ("inference_step", 49, 64), ("inference_step", 64, 79),
                          ("train_step", 89, 128)]


def test_training_calls_without_an_optimizer_end_at_the_leading_models_next_call():
    loop = Loop()
    for _ in range(2):
        loop.call(MODEL, training=True)
        loop.backward()
        loop.idle(5)
    assert loop.end() == [("train_step", 0, 30), ("train_step", 35, 65)]


def test_calls_with_autograd_on_but_no_backward_are_inference():
    loop = Loop()
    for _ in range(2):
        loop.call(MODEL, training=True)  # a traced model called with autograd on, as in tutorials
        loop.call(HEAD)
    assert loop.end() == [("inference_step", 0, 20), ("inference_step", 20, 40)]


def test_generate_is_one_step_with_the_wait_before_it_and_its_calls_inside():
    loop = Loop()
    for _ in range(2):
        loop.wait()
        start = loop.now
        loop.steps.generate_begins("lm", start)
        for _ in range(3):
            loop.call(MODEL)  # prefill, decode, decode: no steps of their own
        loop.steps.generate_ends(loop.now)
    assert loop.end() == [("lm.generate", 0, 35), ("lm.generate", 35, 70)]


def test_an_explicit_step_ends_the_automatic_one_and_suspends_the_rules():
    loop = Loop()
    loop.call(ENCODER)
    loop.call(HEAD)
    loop.steps.finish()  # xsp.step() begins
    loop.buffer.open_steps = 1
    loop.wait()
    loop.call(ENCODER, training=True)
    loop.backward()
    loop.optimizer()
    loop.buffer.open_steps = 0
    assert loop.end() == [("inference_step", 0, 20)]


@pytest.mark.parametrize("event", ["wait", "call"])
def test_a_thread_holds_its_records_until_its_step_is_decided(event):
    loop = Loop()
    assert not loop.steps.holding
    getattr(loop, event)(MODEL) if event == "call" else loop.wait()
    assert loop.steps.holding  # a wait (or call) whose step is still open
    loop.end()
    assert not loop.steps.holding


def test_the_lane_is_open_only_while_the_step_is_one_call_of_its_model():
    """The wrapper's short path (AutoSteps.lane) may decide a step only where call_begins would
    decide it the same way: the step is one call of that model, in the same autograd mode."""
    loop = Loop()
    steps = loop.steps
    loop.call(MODEL)
    assert (steps.lane, steps.lane_grad) == (MODEL, False)
    loop.call(HEAD)  # joins the step: the step is no longer one call
    assert steps.lane == 0
    loop.call(MODEL)
    assert steps.lane == MODEL
    loop.wait()
    assert steps.lane == 0
    loop.call(MODEL)  # its step holds the wait
    assert steps.lane == 0
    loop.call(MODEL)
    assert steps.lane == MODEL
    loop.call(MODEL, training=True)  # autograd on, no training (yet)
    assert (steps.lane, steps.lane_grad) == (MODEL, True)
    loop.backward()
    assert steps.lane == 0
    loop.optimizer()
    loop.call(MODEL, training=True)  # after an optimizer step, training steps end only at the next one
    assert steps.lane == 0
    loop.end()
    assert steps.lane == 0


def test_accumulated_micro_batches_are_one_step_from_the_first():
    loop = Loop()
    for _ in range(2):
        for _ in range(3):  # three forwards and backwards, then one optimizer step
            loop.call(MODEL, training=True)
            loop.backward()
        loop.optimizer()
        loop.idle(1)
    assert loop.end() == [("train_step", 0, 94), ("train_step", 94, 189)]


def test_a_warm_up_whose_gradients_zero_grad_throws_away_is_a_step_of_its_own():
    loop = Loop()
    loop.call(MODEL, training=True)  # warm-up: forward and backward, no optimizer step
    loop.backward()
    loop.steps.gradients_cleared()
    loop.idle(1)
    for _ in range(2):
        loop.call(MODEL, training=True)
        loop.backward()
        loop.optimizer()
    assert loop.end() == [("train_step", 0, 30), ("train_step", 31, 65), ("train_step", 65, 99)]


def test_zero_grad_inside_a_closure_decides_nothing():
    loop = Loop()
    loop.call(MODEL, training=True)
    loop.backward()
    loop.buffer.optimizer_starts.append(loop.now)  # an optimizer's step(closure) is running
    loop.steps.gradients_cleared()
    loop.buffer.optimizer_starts.pop()
    loop.optimizer()
    assert loop.end() == [("train_step", 0, 34)]


def test_without_any_optimizer_step_each_iteration_is_a_step():
    loop = Loop()
    for _ in range(3):
        loop.call(MODEL, training=True)
        loop.backward()
    assert [name for name, _, _ in loop.end()] == ["train_step"] * 3


def test_a_model_called_three_times_without_the_leader_leads_from_its_first_call():
    loop = Loop()
    for _ in range(2):
        loop.call(ENCODER)
        loop.idle(1)
    for _ in range(4):  # a second loop, over another model
        loop.call(HEAD)
        loop.idle(1)
    loop.end()
    assert len(loop.decided) == 6  # every call its own step: none swallowed another


def test_accumulation_fed_by_a_data_loader_is_one_step_per_optimizer_step_from_the_first():
    loop = Loop()
    for _ in range(2):
        for _ in range(2):  # two micro-batches: wait for the batch, forward, backward
            loop.wait()
            loop.call(MODEL, training=True)
            loop.backward()
        loop.optimizer()
    loop.wait(last=True)  # StopIteration
    assert loop.end() == [("train_step", 0, 74), ("train_step", 74, 148)]  # each wait inside its step
    assert len(loop.decided) == 2


def test_accumulation_over_two_zipped_loaders_keeps_both_waits_in_the_step():
    loop = Loop()
    for _ in range(2):
        loop.wait()
        loop.wait()  # zip(images, labels): two next() per micro-batch
        loop.call(MODEL, training=True)
        loop.backward()
    loop.optimizer()
    assert loop.end() == [("train_step", 0, 84)]


def test_training_without_an_optimizer_from_a_data_loader_begins_each_step_at_its_wait():
    loop = Loop()
    for _ in range(3):
        loop.wait()
        loop.call(MODEL, training=True)
        loop.backward()
    assert loop.end() == [("train_step", 0, 35), ("train_step", 35, 70), ("train_step", 70, 105)]


def test_evaluation_calls_around_a_gradient_only_loop_are_steps_of_their_own():
    """An input-gradient loop (PGD attacks, saliency maps): no_grad, then forward and backward with
    no optimizer, then no_grad again: each no_grad call is an inference step, each iteration a
    training step."""
    loop = Loop()
    for _ in range(2):
        loop.call(MODEL)
        for _ in range(3):
            loop.call(MODEL, training=True)
            loop.backward()
        loop.call(MODEL)
    marks = loop.end()
    assert [name for name, _, _ in marks] == ["train_step"] * 6
    assert len(loop.decided) == 10  # 2 x (1 + 3 + 1) steps, none swallowed another


def test_a_quiet_threads_one_call_step_is_decided_from_another_thread_only_when_nothing_else_can_be():
    """While a capture waits, a quiet service's last step is decided by the windows' thread (its
    own thread would decide it at its next request, which may not come)."""
    from xsp.core.clock import now_ns
    from xsp.record import hotpath
    from xsp.record.recording import Recording

    if hotpath.HOTPATH is None:
        pytest.skip("xsp's C part is not built here (its Python twin decides nothing)")
    recording = Recording()
    told: list[int] = []
    recording.on_long_step, recording.long_step_ns = told.append, 0
    buffer = recording.buffer()
    steps = buffer.steps
    start = now_ns() - 10_000_000
    steps.call_begins(MODEL, start, False)
    steps.call_ends(start + 1_000)
    assert recording.decide_quiet_steps(quiet_ns=60_000_000_000) == 0  # not quiet for a minute yet
    buffer.depth = 1  # a call under way
    assert recording.decide_quiet_steps(quiet_ns=1_000_000) == 0
    buffer.depth = 0
    assert recording.decide_quiet_steps(quiet_ns=1_000_000) == 1
    assert told == [1_000] and not steps.holding and steps.lane == 0
    steps.call_begins(MODEL, now_ns(), False)  # the thread's next call: a step of its own
    assert steps.holding and told == [1_000]
    later = now_ns()
    steps.call_ends(later)
    steps.call_begins(HEAD, later + 1, False)  # another model joins the step: not the lane any more
    steps.call_ends(later + 2)
    assert recording.decide_quiet_steps(quiet_ns=0) == 0 and steps.holding


def test_a_loop_whose_model_xsp_never_sees_begins_its_first_step_at_its_backward_pass():
    """A compiled training function (its model runs in compiled code) or raw tensors: the first
    iteration's backward begins its step, not its optimizer step; later steps begin where the
    step before them ended."""
    loop = Loop()
    for _ in range(3):
        loop.idle(5)  # the forward, in no module call xsp sees
        loop.backward()
        loop.steps.optimizer_begins(0)  # (the same optimizer stepping again begins the next iteration)
        loop.optimizer()
    assert loop.end() == [("train_step", 5, 29), ("train_step", 29, 58), ("train_step", 58, 87)]


def test_a_training_step_decided_after_its_next_iteration_began_keeps_that_iteration_held():
    """Whoever hears of a decided step (a window taken then) finds the thread holding what it
    recorded since the step ended: the next step, which begins there."""
    loop = Loop()
    held: list[tuple[bool, int]] = []
    loop.buffer.recording.on_long_step = lambda duration: held.append((loop.steps.holding, loop.steps.resume_ns))
    loop.call(MODEL, training=True)
    loop.backward()
    loop.optimizer()
    closed = loop.now
    loop.idle()
    loop.call(MODEL, training=True)  # the next iteration decides the step before it
    assert held == [(True, closed)]
    loop.backward()
    loop.optimizer()
    assert loop.end() == [("train_step", 0, 34), ("train_step", 34, 71)]


def test_a_frozen_model_called_before_the_trained_one_is_part_of_each_iteration():
    """Distillation: the teacher's call without autograd begins the iteration, the first one and
    each after an optimizer step; an evaluation call of the trained model stays its own step."""
    loop = Loop()
    teacher, student = ENCODER, MODEL
    for _ in range(3):
        loop.call(teacher)
        loop.call(student, training=True)
        loop.backward()
        loop.steps.optimizer_begins(0)
        loop.optimizer()
    loop.idle()
    loop.call(student)
    assert loop.end() == [("train_step", 0, 44), ("train_step", 44, 88), ("train_step", 88, 132)]
    assert loop.decided == [44, 44, 44, 10]


def test_another_models_call_without_autograd_after_training_then_more_of_them_are_their_own_steps():
    """An evaluation of another model (an EMA copy) over several batches after training: steps of
    its own, as before; only its first call could have begun an iteration."""
    loop = Loop()
    loop.call(MODEL, training=True)
    loop.backward()
    loop.optimizer()
    for _ in range(3):
        loop.call(HEAD)
    assert loop.end() == [("train_step", 0, 34)]
    assert loop.decided == [34, 10, 10, 10]
