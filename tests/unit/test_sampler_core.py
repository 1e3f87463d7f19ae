"""The per-step part of the step sampler (xsp/record/_hotpath/sampler.c) against its Python twin
(xsp.record.sampling.PySamplerCore), and its reading of OpenTelemetry's current span against the
API's, on threads and asyncio tasks."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import threading
from typing import Any

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan

from tests.unit.test_hotpath import require_built
from xsp.core.schema import StepSampling
from xsp.record import hotpath
from xsp.record.sampling import (
    DepthPlan,
    NoteKind,
    PySamplerCore,
    SamplingPolicy,
    StepSampler,
    otel_context_location,
    otel_context_probe,
    reads_context_plainly,
)

BUILT = hotpath.load()


class Steps:
    def __init__(self) -> None:
        self.start_ns = 0


class Thread:
    """What a ThreadBuffer gives the sampler."""

    def __init__(self) -> None:
        self.step_notes: list[tuple[int, ...]] = []
        self.steps = Steps()
        self.decided_ns = 0
        self.step_limit = 0
        self.step_operators = True
        self.step_trace: int | None = None


def sampler_on(core: str, monkeypatch: pytest.MonkeyPatch, **options: Any) -> StepSampler:
    """A StepSampler of seed 11 whose core is the C one (``c``) or the Python twin (``python``)."""
    if core == "c":
        require_built()
    with monkeypatch.context() as patch:
        if core == "python":
            patch.setattr(hotpath, "load", lambda: None)
        sampler = StepSampler(SamplingPolicy.parse(options.pop("rate", 0.2), slow_factor=3, slow_steps=2),
                              otel_context_probe(), seed=11, context=otel_context_location())
    expected = PySamplerCore if core == "python" else BUILT.SamplerCore
    assert type(sampler.core) is expected
    return sampler


def serve(sampler: StepSampler, tracer: Any) -> dict[str, Any]:
    """A scripted run: requests in sampled and unsampled spans and in none, a slow step, a capture;
    what the sampler noted and decided."""
    layers = frozenset({"model", "layer"})
    sampler.rotate([DepthPlan("model+layer<=1", 1, layers), DepthPlan("model+layer", 0, layers),
                    DepthPlan("model+layer+operator", 0, layers | {"operator"})])
    thread, limits = Thread(), []
    for step in range(400):
        thread.steps.start_ns = 1_000 * step
        before_ns = 0 if step == 0 else (9_000_000 if step in (150, 151, 300) else 1_000_000 + step)
        if step == 200:
            assert sampler.capture(4) == 200
        if step % 3 == 0:
            sampler.step_begins(thread, 1_000 * step, before_ns)
        else:
            sampled = step % 3 == 1
            with tracer(sampled).start_as_current_span("request"):
                sampler.step_begins(thread, 1_000 * step, before_ns)
        limits.append((thread.step_limit, thread.step_operators))
    decisions = [note for note in thread.step_notes if note[1] == NoteKind.DECISION]
    slow = [note[1:] for note in thread.step_notes if note[1] == NoteKind.SLOW]  # (their time is the clock's)
    return {"limits": limits, "decisions": [note[:3] + (note[3] != 0, note[4] != 0) + note[5:] for note in decisions],
            "slow": slow, "decided": sampler.decided, "median_ns": sampler.median_ns, "begun": sampler.begun,
            "last_begun_ns": sampler.last_begun_ns,
            "slow_steps": sampler.slow_steps, "metadata": sampler.as_metadata()}


@pytest.fixture
def tracer():
    providers = {True: TracerProvider(sampler=ALWAYS_ON), False: TracerProvider(sampler=ALWAYS_OFF)}
    return lambda sampled: providers[sampled].get_tracer("service")


def test_the_c_core_decides_as_its_python_twin(monkeypatch, tracer):
    c_run = serve(sampler_on("c", monkeypatch), tracer)
    python_run = serve(sampler_on("python", monkeypatch), tracer)
    assert c_run == python_run
    decided = c_run["decided"]
    assert c_run["last_begun_ns"] == 1_000 * 399  # the last step's start, told as it began
    # every kind of decision was made: the comparison covers each path
    assert set(decided) == set(StepSampling), decided
    assert decided[StepSampling.CAPTURE] == 4 and c_run["slow_steps"] == 3
    assert {limit for limit, _ in c_run["limits"]} == {-1, 0, 1}
    # operators in the steps of the plan that has them, and in captured and after-slow ones (the deepest)
    assert {operators for limit, operators in c_run["limits"] if limit == -1} == {False}
    assert {operators for limit, operators in c_run["limits"] if limit == 1} == {False}
    assert {operators for limit, operators in c_run["limits"] if limit == 0} == {False, True}


@pytest.mark.parametrize("core", ["c", "python"])
def test_a_step_keeps_its_requests_trace_and_another_requests_span_is_told_apart(core, monkeypatch, tracer):
    sampler, thread = sampler_on(core, monkeypatch), Thread()
    with tracer(True).start_as_current_span("request") as request:
        sampler.step_begins(thread, 1_000)
        assert thread.step_trace == request.get_span_context().trace_id
        assert not sampler.core.other_request(thread)
        with tracer(True).start_as_current_span("postprocess"):  # a span of the same request
            assert not sampler.core.other_request(thread)
    with tracer(True).start_as_current_span("next request"):
        assert sampler.core.other_request(thread)
    assert sampler.core.other_request(thread)  # no request now, one then
    sampler.step_begins(thread, 2_000)
    assert thread.step_trace is None and not sampler.core.other_request(thread)
    with tracer(False).start_as_current_span("unsampled request"):
        assert sampler.core.other_request(thread)


def test_the_c_core_reads_the_current_span_as_opentelemetry_does_on_threads_and_tasks(tracer):
    built = require_built()
    location = otel_context_location()
    assert location is not None, "OpenTelemetry keeps its context where xsp reads it"
    probe = otel_context_probe()
    core = built.SamplerCore(0.0, 0.0, 1, probe, None, None, None, 255, 20, 8, location)

    def as_api() -> tuple[Any, Any, bool]:
        found = probe()
        return (None, None, True) if found is None else found

    readings: list[tuple[Any, Any]] = []

    def request(sampled: bool) -> None:
        with tracer(sampled).start_as_current_span("request"):
            readings.append((core.ambient_span(), as_api()))
        readings.append((core.ambient_span(), as_api()))

    threads = [threading.Thread(target=request, args=(index % 2 == 0,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    async def task(sampled: bool) -> None:
        with tracer(sampled).start_as_current_span("request"):
            await asyncio.sleep(0)
            readings.append((core.ambient_span(), as_api()))

    async def tasks() -> None:
        await asyncio.gather(*(task(index % 2 == 0) for index in range(4)))

    asyncio.run(tasks())
    with otel_trace.use_span(INVALID_SPAN):
        readings.append((core.ambient_span(), as_api()))
    contextvars.Context().run(lambda: readings.append((core.ambient_span(), as_api())))
    assert all(read == api for read, api in readings), readings
    trace_ids = {read[0] for read, _ in readings if read[0] is not None}
    assert len(trace_ids) == 8  # each thread's and task's own request
    assert {read[2] for read, _ in readings} == {True, False}
    assert core.probe_errors == 0


def test_a_context_read_elsewhere_than_the_api_reads_it_is_not_used(tracer):
    require_built()
    elsewhere = (contextvars.ContextVar("elsewhere"), "current-span")
    sampler = StepSampler(SamplingPolicy.parse(0.0), otel_context_probe(), context=elsewhere)
    with tracer(True).start_as_current_span("request") as span:
        trace_id, span_id, sampled = sampler.core.ambient_span()
    assert (trace_id, span_id, sampled) == (span.get_span_context().trace_id, span.get_span_context().span_id, True)


@pytest.mark.parametrize("core", ["c", "python"])
def test_a_failing_probe_is_counted_and_the_step_joins_no_request(core, monkeypatch):
    def broken() -> None:
        raise RuntimeError("no context here")

    if core == "c":
        require_built()
    with monkeypatch.context() as patch:
        if core == "python":
            patch.setattr(hotpath, "load", lambda: None)
        sampler = StepSampler(SamplingPolicy.parse(0.0), ambient=broken)
    thread = Thread()
    sampler.step_begins(thread, 5)
    assert sampler.probe_errors == 1
    assert thread.step_notes == [(5, NoteKind.DECISION, 0, 0, 0, 0, 0)]
    assert thread.step_limit == -1


def test_the_c_core_reads_a_plain_spans_context_without_its_python_and_asks_a_changed_class(tracer, monkeypatch):
    built = require_built()
    location = otel_context_location()
    assert location is not None
    core = built.SamplerCore(0.0, 0.0, 1, otel_context_probe(), None, None, None, 255, 20, 8, location)
    frames: list[str] = []

    def python_calls_of(read: Any) -> Any:
        frames.clear()
        previous = sys.getprofile()
        sys.setprofile(lambda frame, event, arg: frames.append(frame.f_code.co_name) if event == "call" else None)
        try:
            return read()
        finally:
            sys.setprofile(previous)

    with tracer(True).start_as_current_span("request") as span:
        expected = span.get_span_context()
        core.ambient_span()  # the class's version tag is given by the first lookup
        read = python_calls_of(core.ambient_span)
        assert read == (expected.trace_id, expected.span_id, True)
        assert "get_span_context" not in frames, frames

        seen: list[Any] = []
        original = type(span).get_span_context

        def replaced(self: Any) -> Any:
            seen.append(self)
            return original(self)

        monkeypatch.setattr(type(span), "get_span_context", replaced)
        assert python_calls_of(core.ambient_span) == read
        assert seen == [span], "a class whose get_span_context was replaced is asked again"


def test_the_span_classes_read_plainly_are_opentelemetrys_own_and_no_class_that_reads_otherwise(tracer):
    class Remembering(NonRecordingSpan):
        def get_span_context(self) -> Any:
            return super().get_span_context()

    class Shadowed(NonRecordingSpan):
        _context = None

    sampled, dropped = tracer(True).start_span("request"), tracer(False).start_span("dropped")
    assert type(sampled) is not type(dropped)
    assert reads_context_plainly(type(sampled)) and reads_context_plainly(type(dropped))
    assert reads_context_plainly(NonRecordingSpan)
    assert not reads_context_plainly(Remembering) and not reads_context_plainly(Shadowed)
    assert not reads_context_plainly(object)
