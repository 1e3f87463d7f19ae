"""The step sampler of an always-on session (xsp/record/sampling.py), on hand-made steps, and its
notes made table columns (xsp/table/sampling.py, xsp/table/latency.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from xsp.core.schema import StepSampling
from xsp.record.columns import (
    NOTE_BYTES,
    NOTE_FIELDS,
    BackwardColumns,
    CallColumns,
    Interner,
    MarkColumns,
    RootColumns,
    count_packed_rows,
    note_rows,
    notes_buffer,
    split_packed_notes,
)
from xsp.record.sampling import (
    EVERY_DEPTH,
    MODEL_ONLY_LIMIT,
    REASONS,
    WARMUP_STEPS,
    DepthPlan,
    NoteKind,
    SamplingPolicy,
    StepSampler,
)
from xsp.record.window import WindowBuffer
from xsp.table.latency import BOUNDS_S, MAX_LAYERS, OTHER_LAYERS, Histogram, Latencies, LatencyHistograms
from xsp.table.sampling import StepNotes


class Thread:
    def __init__(self) -> None:
        self.step_notes: list[tuple[int, ...]] = []


def reasons(thread: Thread) -> list[StepSampling]:
    return [REASONS[note[2]] for note in thread.step_notes if note[1] == NoteKind.DECISION]


@pytest.mark.parametrize("rate, slow_factor, slow_steps, message", [
    (-0.5, 5, 3, "sample must be from 0 to 1"), ("half", 5, 3, "sample must be a number"),
    (0.1, 0.5, 3, "slow_factor must be above 1"), (0.1, 5, -1, "slow_steps must be 0 or more")])
def test_a_policy_out_of_range_is_refused_naming_the_option(rate, slow_factor, slow_steps, message):
    with pytest.raises(ValueError, match=message):
        SamplingPolicy.parse(rate, slow_factor, slow_steps)


def test_the_rate_is_the_share_of_steps_drawn():
    sampler, thread = StepSampler(SamplingPolicy.parse(0.1, slow_factor=0), seed=1), Thread()
    deep = sum(sampler.decide(thread, step) != MODEL_ONLY_LIMIT for step in range(10_000))
    assert 900 <= deep <= 1100
    assert sampler.decided[StepSampling.SAMPLED] == deep
    assert sampler.begun == 10_000


def test_a_slow_step_arms_the_next_steps_and_is_noted():
    sampler, thread = StepSampler(SamplingPolicy.parse(0.0, slow_factor=5, slow_steps=3), seed=1), Thread()
    for step in range(WARMUP_STEPS):
        sampler.decide(thread, step)
        sampler.step_ended(1_000_000, thread)
    assert sampler.median_ns == 1_000_000
    sampler.decide(thread, 100)
    sampler.step_ended(6_000_000, thread)  # six times the median
    for step in range(5):
        sampler.decide(thread, 200 + step)
        sampler.step_ended(1_000_000, thread)
    assert reasons(thread)[-6:] == [StepSampling.MODEL_ONLY, *[StepSampling.AFTER_SLOW] * 3,
                                    StepSampling.MODEL_ONLY, StepSampling.MODEL_ONLY]
    slow = [note for note in thread.step_notes if note[1] == NoteKind.SLOW]
    assert [(note[5], note[6]) for note in slow] == [(6_000_000, 1_000_000)]


def test_slow_steps_on_a_busy_machine_record_at_most_one_percent_deep():
    sampler, thread = StepSampler(SamplingPolicy.parse(0.0, slow_factor=5, slow_steps=3), seed=1), Thread()
    for step in range(10_000):  # one step in ten is slow: noise, not a problem to look into each time
        sampler.decide(thread, step)
        sampler.step_ended(10_000_000 if step % 10 == 9 else 1_000_000, thread)
    assert sampler.slow_steps > 900
    assert sampler.decided[StepSampling.AFTER_SLOW] <= 0.01 * 10_000 + 3


def test_a_capture_takes_the_steps_from_the_one_asked_for_and_one_at_a_time():
    sampler, thread = StepSampler(SamplingPolicy.parse(0.0, slow_factor=0)), Thread()
    for step in range(5):
        sampler.decide(thread, step)
    assert sampler.capture(3, first=7) == 7
    assert sampler.capture(2) is None  # one capture at a time
    for step in range(5, 12):
        sampler.decide(thread, step)
    assert reasons(thread)[5:] == [StepSampling.MODEL_ONLY] * 2 + [StepSampling.CAPTURE] * 3 + [
        StepSampling.MODEL_ONLY] * 2
    assert sampler.capture(2) == 12


def test_the_current_request_is_noted_and_an_unsampled_one_stays_shallow():
    answers = iter([(0xABC, 0x12, True), (0xDEF, 0x34, False), None])
    sampler, thread = StepSampler(SamplingPolicy.parse(1.0), ambient=lambda: next(answers)), Thread()
    assert [sampler.decide(thread, step) for step in range(3)] == [EVERY_DEPTH, MODEL_ONLY_LIMIT, EVERY_DEPTH]
    assert [(note[2], note[3], note[4]) for note in thread.step_notes] == [
        (REASONS.index(StepSampling.SAMPLED), 0xABC, 0x12),
        (REASONS.index(StepSampling.REQUEST_NOT_SAMPLED), 0xDEF, 0x34),
        (REASONS.index(StepSampling.SAMPLED), 0, 0)]


def test_a_failing_context_probe_joins_no_request():
    def broken() -> None:
        raise RuntimeError("context")

    sampler, thread = StepSampler(SamplingPolicy.parse(1.0), ambient=broken), Thread()
    assert sampler.decide(thread, 0) == EVERY_DEPTH
    assert sampler.probe_errors == 1 and thread.step_notes[0][3:5] == (0, 0)


def test_histograms_count_each_bucket_and_bound_the_layer_series():
    histogram = Histogram()
    histogram.add(np.array([50_000, 100_000, 2_000_000_000, 20_000_000_000]))
    assert histogram.counts[0] == 2  # up to 0.1 ms, inclusive
    assert histogram.counts[BOUNDS_S.index(2.5)] == 1 and histogram.counts[-1] == 1
    assert (histogram.count, histogram.min_ns, histogram.max_ns) == (4, 50_000, 20_000_000_000)
    many = {f"model/layer{i}": np.full(3, 1_000 * (i + 1), dtype=np.int64) for i in range(MAX_LAYERS + 5)}
    histograms = LatencyHistograms()
    series = histograms.add(Latencies(step_ns=np.array([10, 20]), layer_ns=many, deep_steps=1))
    assert len(histograms.layers) == MAX_LAYERS + 1 and OTHER_LAYERS in histograms.layers
    assert "model/layer0" not in histograms.layers  # the least time
    assert len(series[OTHER_LAYERS]) == 5 * 3
    later = histograms.add(Latencies(step_ns=np.array([5]), layer_ns={"model/new": np.array([7])}))
    assert list(later) == [OTHER_LAYERS] and histograms.step.count == 3


def test_drawn_steps_take_the_plans_in_turn_and_armed_ones_the_deepest():
    sampler, thread = StepSampler(SamplingPolicy.parse(1.0, slow_factor=0)), Thread()
    shallow, deep = DepthPlan("model+layer<=1", 1, frozenset({"model", "layer"})), DepthPlan(
        "model+layer", 0, frozenset({"model", "layer"}))
    sampler.rotate([shallow, deep])
    assert [sampler.decide(thread, step) for step in range(4)] == [1, 0, 1, 0]
    sampler.capture(1)
    assert sampler.decide(thread, 4) == 0  # a captured step: the deepest plan
    sampler.rotate([DepthPlan("model+layer<=2", 2, frozenset({"model", "layer"})), deep])  # learnt deeper
    assert sampler.plans == [shallow, deep, DepthPlan("model+layer<=2", 2, frozenset({"model", "layer"}))]
    sampler.decide(thread, 5)
    assert [note[5] for note in thread.step_notes] == [1, 2, 1, 2, 2, 3]  # 1 + the plan's place in plans


def window_buffer(thread_id: int, step_notes: list[tuple[int, ...]], packed_notes: bytes = b"") -> WindowBuffer:
    empty = Interner()
    return WindowBuffer(thread_id, "t", CallColumns(), MarkColumns(), BackwardColumns(), RootColumns(), empty, empty,
                        empty, [], step_notes, notes_buffer(packed_notes))


def packed(notes: list[tuple[int, ...]]) -> bytes:
    """Notes as xsp's C sampler packs them: the trace id in two halves, each id's bits as int64."""
    rows = [(time, kind, reason, trace >> 64, trace & (2**64 - 1), span, fifth, sixth)
            for time, kind, reason, trace, span, fifth, sixth in notes]
    return struct.pack(f"{len(rows) * NOTE_FIELDS}Q", *(value for row in rows for value in row))


NOTES = [(100, NoteKind.DECISION, 0, 2**128 - 3, 2**64 - 5, 0, 0), (200, NoteKind.SLOW, 0, 0, 0, 9_000, 3_000),
         (300, NoteKind.DECISION, 2, 0, 0, 2, 0), (400, NoteKind.DECISION, 1, 0x1F << 64 | 7, 11, 1, 0)]


@pytest.mark.parametrize("as_packed", [(), (0, 2, 3), (0, 1, 2, 3)])
def test_step_notes_read_the_same_packed_or_as_tuples(as_packed):
    tuples = [note for i, note in enumerate(NOTES) if i not in as_packed]
    rows = packed([note for i, note in enumerate(NOTES) if i in as_packed])
    notes = StepNotes.of([window_buffer(7, tuples, rows)], host_to_epoch_ns=1_000)
    assert notes is not None
    assert notes.time_ns.tolist() == [1_100, 1_300, 1_400] and notes.reason.tolist() == [0, 2, 1]
    assert notes.plan.tolist() == [0, 2, 1] and notes.span_id.astype(np.uint64).tolist() == [2**64 - 5, 0, 11]
    assert notes.slow_time_ns.tolist() == [1_200] and notes.slow_duration_ns.tolist() == [9_000]
    assert notes.slow_median_ns.tolist() == [3_000]
    starts, ends = np.array([1_050, 1_250, 1_350, 1_450]), np.array([1_150, 1_350, 1_450, 1_500])
    # the last step has no decision of its own: it was recorded under the one before it
    assert notes.joined_trace_ids(np.full(4, 7), starts, ends) == [
        "ffffffffffffffff" "fffffffffffffffd", None, f"{0x1F:016x}{7:016x}", f"{0x1F:016x}{7:016x}"]


def test_a_window_and_a_thread_split_their_packed_notes_at_a_time():
    rows = packed(NOTES)
    before, after = split_packed_notes(notes_buffer(rows), 300)
    assert (note_rows(before), note_rows(after)) == (rows[:2 * NOTE_BYTES], rows[2 * NOTE_BYTES:])
    assert count_packed_rows(after) == 2
    later = window_buffer(7, [], rows).since(250)
    assert note_rows(later.packed_notes) == rows[2 * NOTE_BYTES:]
    assert split_packed_notes(notes_buffer(), 5) == (notes_buffer(), notes_buffer())
