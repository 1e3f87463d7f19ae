"""Profiling schedules: the same steps as torch.profiler's schedule, and sessions that follow them."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerAction
from torch.profiler import schedule as torch_schedule

import xsp
from xsp.core import schema as col
from xsp.record.schedule import Schedule, ScheduleError, StepAction

_TORCH_ACTION = {ProfilerAction.NONE: StepAction.SKIP, ProfilerAction.WARMUP: StepAction.WARMUP,
                 ProfilerAction.RECORD: StepAction.RECORD, ProfilerAction.RECORD_AND_SAVE: StepAction.RECORD}


@pytest.mark.filterwarnings("ignore:Profiler won.t be using warmup")
@pytest.mark.parametrize("skip_first,wait,warmup,active,repeat",
                         list(itertools.product([0, 3], [0, 2], [0, 1], [1, 3], [0, 1, 2])))
def test_each_step_is_treated_as_torch_profiler_treats_it(skip_first, wait, warmup, active, repeat):
    ours = Schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    theirs = torch_schedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    assert [ours.action(step) for step in range(40)] == [_TORCH_ACTION[theirs(step)] for step in range(40)]


def test_parse_accepts_any_subset_and_refuses_nonsense():
    assert Schedule.parse("wait=1, active=2,repeat=3") == Schedule(wait=1, active=2, repeat=3)
    assert Schedule.parse("") == Schedule()
    for bad in ("wait=-1", "active=0", "often=2", "wait", "wait=two"):
        with pytest.raises(ScheduleError):
            Schedule.parse(bad)
    with pytest.raises(ScheduleError):
        xsp.trace(output=None, schedule={"sometimes": 1})


def _run(schedule, steps=20, output=None):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad(), xsp.trace(output=output, schedule=schedule) as session:
        for _ in range(steps):
            model(torch.randn(2, 4))
    return session.trace


@pytest.mark.parametrize("output", [None, "file"])
def test_a_session_keeps_the_scheduled_steps_numbered_as_counted(tmp_path, output):
    trace = _run("skip_first=2,wait=1,warmup=1,active=2,repeat=2",
                 output=None if output is None else tmp_path / "run.xsp.parquet")
    assert trace.steps == [4, 5, 8, 9]
    spans = trace.spans
    assert (spans[col.LEVEL] == "layer").sum() == 4 * 2  # two layers per recorded step, nothing else
    assert trace.metadata["schedule"] == {"skip_first": 2, "wait": 1, "warmup": 1, "active": 2, "repeat": 2,
                                          "steps_seen": 20, "recorded_steps": [[4, 5], [8, 9]],
                                          "warmup_steps": 2, "skipped_steps": 14}
    if output is not None:
        assert xsp.load(tmp_path / "run.xsp.parquet").steps == [4, 5, 8, 9]


def test_the_last_step_follows_the_schedule_too():
    assert _run(Schedule(wait=2, active=1), steps=9).steps == [2, 5, 8]
    assert _run(Schedule(wait=2, active=1), steps=8).steps == [2, 5]


def test_unrecorded_steps_leave_no_records_behind():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with torch.no_grad(), xsp.trace(output=None, schedule=Schedule(skip_first=1000)) as session:
        for _ in range(50):
            model(torch.randn(2, 4))
        buffer = xsp.core.state.recording.buffer()
        assert not buffer.calls and not len(buffer.call_columns)  # nothing recorded below a skipped call
    assert session.trace.steps == []
    assert session.trace.metadata["schedule"]["skipped_steps"] == 50


def test_steps_longer_than_a_compaction_are_kept_or_forgotten_whole():
    model = nn.Sequential(*[nn.Identity() for _ in range(700)])  # records are compacted inside each step
    with torch.no_grad(), xsp.trace(output=None, schedule="wait=1,active=1") as session:
        for _ in range(6):
            model(torch.randn(2, 4))
    spans = session.trace.spans
    assert session.trace.steps == [1, 3, 5]
    assert spans[spans[col.LEVEL] == "layer"].groupby(col.STEP).size().tolist() == [700, 700, 700]
