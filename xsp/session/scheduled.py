"""The steps a session's schedule keeps, warms up and skips (``xsp.trace(schedule=...)``), as
each thread's steps end: the records of a step not kept are forgotten, and recording pauses
for a step the schedule skips."""

from __future__ import annotations

from collections import Counter
from typing import Any

from xsp.record.recording import Recording, ThreadBuffer
from xsp.record.schedule import Schedule, StepAction


class ScheduledSteps:
    """What a session's schedule decided of the steps so far (steps counted from its start).

    Args:
        schedule: the session's schedule.
        recording: the recording whose step records it keeps or forgets.
    """

    def __init__(self, schedule: Schedule, recording: Recording) -> None:
        self.schedule = schedule
        self.recording = recording
        self.actions: Counter[StepAction] = Counter()
        """How many steps were recorded, warmed up and skipped."""
        self.recorded: list[list[int]] = []
        """Runs ``[first, last]`` of the steps the schedule kept."""

    def pause_first(self) -> None:
        """Before the first step: pause recording if the schedule skips it."""
        self.recording.paused = self.schedule.action(0) is StepAction.SKIP

    def step_ended(self, duration_ns: int = 0, buffer: ThreadBuffer | None = None) -> None:
        """On the thread whose step was just decided: keep or forget its records as the schedule
        says, and pause or resume recording for the step that begins."""
        step = self.actions.total()  # the steps decided so far
        action = self.schedule.action(step)
        self.actions[action] += 1
        buffer = buffer or self.recording.buffer()
        if action is StepAction.RECORD:
            if self.recorded and self.recorded[-1][1] == step - 1:
                self.recorded[-1][1] = step
            else:
                self.recorded.append([step, step])
            buffer.keep(step)
        else:
            buffer.discard()
        self.recording.paused = self.schedule.action(step + 1) is StepAction.SKIP

    def as_metadata(self) -> dict[str, Any]:
        """The trace's ``schedule``: the schedule and what it did."""
        return {**self.schedule.as_metadata(), "steps_seen": self.actions.total(), "recorded_steps": self.recorded,
                "warmup_steps": self.actions[StepAction.WARMUP], "skipped_steps": self.actions[StepAction.SKIP]}
