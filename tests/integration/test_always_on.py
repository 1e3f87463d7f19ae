"""Always on (``xsp.trace(sample=...)``): every step timed at the model level, a fraction deeper,
steps joined to the application's OpenTelemetry request spans, exported into their traces."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

import xsp
from xsp.core import schema as col
from xsp.core.figures import counted
from xsp.core.lazy import background_imports_done
from xsp.core.schema import StepSampling
from xsp.record import hotpath
from xsp.record.columns import count_packed_rows
from xsp.record.sampling import DEFAULT_SLOW_STEPS, SLOW_SHARE

from .otlp_receiver import GrpcReceiver, HttpReceiver


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


class Sometimes(torch.nn.Module):
    """Sleeps in its forward when told to: one slow step among fast ones."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.sleep_s = 0.0

    def forward(self, x):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.inner(x)


def step_roots(spans):
    return spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()]


def tracer_of(sampler=None):
    provider = TracerProvider() if sampler is None else TracerProvider(sampler=sampler)
    return provider.get_tracer("service")


@pytest.fixture(params=["c", "python"])
def wrapper(request, monkeypatch):
    """Both module-call wrappers: xsp's C one (where built) and the Python one."""
    if request.param == "c" and hotpath.HOTPATH is None:
        pytest.skip("xsp's C wrapper is not built here")
    if request.param == "python":
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    return request.param


@pytest.mark.parametrize("rate, reason", [(0.0, StepSampling.MODEL_ONLY), (1.0, StepSampling.SAMPLED)])
def test_every_step_is_timed_and_only_sampled_steps_have_layers(wrapper, rate, reason):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=rate) as session:
        for _ in range(12):
            model(x)
    spans = session.trace.spans
    roots = step_roots(spans)
    assert len(roots) == 12
    assert set(roots[col.SAMPLING].astype(str)) == {reason.value}
    layers = spans[spans[col.LEVEL] == "layer"]
    assert len(layers) == (12 * 4 if rate else 0)  # body and its three children, per step
    assert session.trace.metadata["sampling"]["steps"][reason.value] == 12


def test_a_fraction_of_steps_is_recorded_deep(wrapper):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.25) as session:
        for _ in range(400):
            model(x)
    spans = session.trace.spans
    roots = step_roots(spans)
    drawn = roots[roots[col.SAMPLING] == StepSampling.SAMPLED.value]
    deep = roots[roots[col.SAMPLING].isin(["sampled", "after_slow"])]  # (a step 3x the median arms the next)
    assert len(roots) == 400
    assert 50 <= len(drawn) <= 150  # 100 expected; binomial sd 8.7
    layer_steps = set(spans[spans[col.LEVEL] == "layer"][col.STEP].astype(int))
    assert layer_steps == set(deep[col.STEP].astype(int))


def test_a_step_in_a_request_span_joins_the_request_trace_when_exported(tmp_path):
    tracer = tracer_of()
    model, x = Net(), torch.randn(2, 8)
    requests = []
    with GrpcReceiver() as receiver:
        with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "t.xsp.parquet", sample=1.0,
                                        otlp_endpoint=receiver.endpoint) as session:
            for _ in range(5):
                with tracer.start_as_current_span("POST /predict") as request:
                    model(x)
                requests.append(request.get_span_context())
        report = session.wait_for_export(30)
        assert report is not None and report.error is None, report
        received = list(receiver.sink.spans)
    file_spans = xsp.load(tmp_path / "t.xsp.parquet").spans
    roots = step_roots(file_spans)
    assert sorted(roots[col.TRACE_ID].astype(str)) == sorted(f"{r.trace_id:032x}" for r in requests)
    assert sorted(roots[col.REMOTE_PARENT_ID].astype("int64").astype("uint64").tolist()) == sorted(
        r.span_id for r in requests)
    for request in requests:
        in_trace = [span for span in received if span.trace_id == f"{request.trace_id:032x}"]
        predict = [span for span in in_trace if span.parent_id == request.span_id]
        assert [span.name for span in predict] == ["model"]
        by_id = {span.span_id: span for span in in_trace}
        layers = [span for span in in_trace if span.attributes.get(col.ATTR_LEVEL) == "layer"]
        assert len(layers) == 4
        for layer in layers:  # each layer's chain of parents reaches the predict span
            parent = by_id[layer.parent_id]
            while parent.span_id != predict[0].span_id:
                parent = by_id[parent.parent_id]


def test_a_request_the_application_did_not_sample_is_timed_but_not_exported(tmp_path):
    dropped, kept = tracer_of(ALWAYS_OFF), tracer_of()
    model, x = Net(), torch.randn(2, 8)
    with GrpcReceiver() as receiver:
        with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=1.0,
                                        otlp_endpoint=receiver.endpoint) as session:
            for i in range(6):
                with (dropped if i % 2 else kept).start_as_current_span("request") as request:
                    model(x)
        report = session.wait_for_export(30)
        received = list(receiver.sink.spans)
    roots = step_roots(session.trace.spans)
    assert roots[col.SAMPLING].astype(str).tolist() == ["sampled", "request_not_sampled"] * 3
    assert request.get_span_context().trace_flags.sampled is False
    unsampled_traces = set(roots[roots[col.SAMPLING] == "request_not_sampled"][col.TRACE_ID].astype(str))
    assert not any(span.trace_id in unsampled_traces for span in received)
    assert report.not_sampled_by_request == 3  # their predict spans; no layer was recorded
    layers = session.trace.spans[session.trace.spans[col.LEVEL] == "layer"]
    assert set(layers[col.STEP].astype(int)) == {0, 2, 4}


def test_requests_served_on_threads_each_land_in_their_own_trace():
    tracer = tracer_of()
    model, x = Net(), torch.randn(2, 8)

    def serve(_: int) -> tuple[int, int]:
        with tracer.start_as_current_span("request") as request:
            with torch.no_grad():
                model(x)
            time.sleep(0.001)
            context = request.get_span_context()
        return context.trace_id, context.span_id

    with xsp.trace(levels="model,layer", output=None, sample=1.0) as session:
        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(serve, range(40)))
    roots = step_roots(session.trace.spans)
    pairs = {(int(t, 16), int(p) & (2**64 - 1)) for t, p in zip(roots[col.TRACE_ID].astype(str),
                                                                roots[col.REMOTE_PARENT_ID].astype("int64"))}
    assert pairs == set(served)


class HighIds(IdGenerator):
    """Trace and span ids with their top bits set: no half of them fits a signed 64-bit int."""

    def __init__(self) -> None:
        self.made = 0

    def generate_span_id(self) -> int:
        self.made += 1
        return 2**64 - self.made

    def generate_trace_id(self) -> int:
        self.made += 1
        return 2**128 - 2**64 - self.made


def test_the_c_sampler_notes_each_step_as_a_packed_row_and_its_ids_come_back_whole():
    """An always-on step's decision is one row of int64s, not a tuple kept until its window; while
    a view holds the rows (they cannot grow), the notes are tuples, and none is lost."""
    if hotpath.HOTPATH is None:
        pytest.skip("xsp's C wrapper is not built here")
    tracer = TracerProvider(id_generator=HighIds()).get_tracer("service")
    model, x = Net(), torch.randn(2, 8)
    served = []

    def serve() -> None:
        with tracer.start_as_current_span("request") as request:
            model(x)
        served.append((request.get_span_context().trace_id, request.get_span_context().span_id))

    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.0, window_s=1e6) as session:
        model(x)  # the model's first call names it (Python's path)
        for _ in range(6):
            serve()
        assert session.run is not None
        buffer = session.run.recording.local.b
        assert count_packed_rows(buffer.packed_notes) >= 6
        assert not [note for note in buffer.step_notes if note[3]]  # no decision in a request as a tuple
        with memoryview(buffer.packed_notes):
            for _ in range(20):
                serve()
        assert len([note for note in buffer.step_notes if note[3]]) > 0
    roots = step_roots(session.trace.spans)
    pairs = {(int(t, 16), int(p) & (2**64 - 1)) for t, p in zip(roots[col.TRACE_ID].astype(str),
                                                                roots[col.REMOTE_PARENT_ID].astype("Int64"))
             if p is not pd.NA}
    assert pairs == set(served) and len(served) == 26


class Meeting(torch.nn.Module):
    """Waits in its forward until every thread is inside its own step, then calls its inner layer."""

    def __init__(self, threads: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.meet = threading.Barrier(threads, timeout=30)

    def forward(self, x):
        self.meet.wait()
        return self.inner(x)


def test_steps_open_on_more_threads_at_once_than_pass_through_each_keep_their_depth(wrapper):
    # 10 steps open at once, more than the C wrapper's entries for threads whose layer calls pass
    # straight through (8): each step's layer is recorded exactly when the step was drawn deep,
    # whichever thread took or missed an entry and in whatever order the steps end
    threads, rounds = 10, 6
    model, x = Meeting(threads), torch.randn(2, 4)

    def serve(_: int) -> None:
        for _ in range(rounds):
            with torch.no_grad():
                model(x)

    with xsp.trace(levels="model,layer", output=None, sample=0.5) as session:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(serve, range(threads)))
    spans = session.trace.spans
    roots = step_roots(spans)
    assert len(roots) == threads * rounds
    layered = set(spans.loc[spans[col.LEVEL] == "layer", col.STEP].astype(int))
    deep = set(roots.loc[roots[col.SAMPLING] != StepSampling.MODEL_ONLY.value, col.STEP].astype(int))
    assert layered == deep
    assert 0 < len(deep) < threads * rounds
    assert len(spans[spans[col.LEVEL] == "layer"]) == len(deep)


def test_requests_served_as_asyncio_tasks_each_land_in_their_own_trace():
    tracer = tracer_of()
    model, x = Net(), torch.randn(2, 8)

    async def handle() -> int:
        with tracer.start_as_current_span("request") as request:
            await asyncio.sleep(0.001)  # the other tasks run here
            with torch.no_grad():
                model(x)
            await asyncio.sleep(0.001)
            return request.get_span_context().trace_id

    async def serve() -> list[int]:
        return list(await asyncio.gather(*(handle() for _ in range(30))))

    with xsp.trace(levels="model,layer", output=None, sample=1.0) as session:
        served = asyncio.run(serve())
    roots = step_roots(session.trace.spans)
    assert sorted(int(t, 16) for t in roots[col.TRACE_ID].astype(str)) == sorted(served)
    layers = session.trace.spans[session.trace.spans[col.LEVEL] == "layer"]
    assert len(layers) == 30 * 4


@pytest.mark.parametrize("embed_grad", [False, True])
def test_two_endpoints_models_on_one_thread_never_share_a_step_across_requests(wrapper, embed_grad):
    """A worker thread serves /classify and /embed in turn, each with its own model; a request
    that runs both is one step. (The second model once joined the step of the request before:
    in that request's trace, with the time between the requests in its latency. With autograd
    left on for /embed, as a sync streaming response's generator resumed on another pool thread
    has it, the embedder was read as the first iteration's model trained after a frozen one.)"""
    tracer = tracer_of()
    classifier, embedder, x = Net(), torch.nn.Sequential(torch.nn.Linear(8, 4)), torch.randn(2, 8)
    served = []

    def embed(inputs):
        with torch.set_grad_enabled(embed_grad):
            return embedder(inputs)

    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=1.0) as session:
        for i in range(12):
            with tracer.start_as_current_span("request") as request:
                served.append(request.get_span_context().trace_id)
                if i % 3 == 2:  # both models in one request
                    embed(classifier(x)[:, :1].expand(2, 8).contiguous())
                else:
                    classifier(x) if i % 3 == 0 else embed(x)
            time.sleep(0.002)  # between requests: no request's time
    spans = session.trace.spans
    roots = step_roots(spans).sort_values(col.START_NS)
    assert [int(t, 16) for t in roots[col.TRACE_ID].astype(str)] == served
    assert roots[col.NAME].tolist() == ["classifier", "embedder", "inference_step"] * 4
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 16 and (predicts.groupby(col.STEP)[col.TRACE_ID].nunique() == 1).all()


@pytest.mark.parametrize("pure_python", [False, True])
def test_asyncio_requests_taking_turns_between_two_models_keep_each_call_in_its_requests_trace(pure_python,
                                                                                                monkeypatch):
    if pure_python:
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    tracer = tracer_of()
    encoder, head, x = Net(), torch.nn.Linear(2, 2), torch.randn(2, 8)

    async def handle() -> int:
        with tracer.start_as_current_span("request") as request:
            with torch.no_grad():
                hidden = encoder(x)
            await asyncio.sleep(0.001)  # the other requests' encoders run here
            with torch.no_grad():
                head(hidden)
            return request.get_span_context().trace_id

    async def serve() -> list[int]:
        return list(await asyncio.gather(*(handle() for _ in range(8))))

    with xsp.trace(levels="model,layer", output=None, sample=1.0) as session:
        served = asyncio.run(serve())
    spans = session.trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 16
    by_trace = predicts.groupby(predicts[col.TRACE_ID].astype(str))[col.NAME].apply(sorted)
    assert sorted(int(t, 16) for t in by_trace.index) == sorted(served)
    assert by_trace.tolist() == [["encoder", "head"]] * 8


def test_operators_between_requests_model_calls_never_land_in_another_requests_trace():
    """A request's input and output operators run outside its model call: the next request's
    input once joined the step of the request before, in that request's trace."""
    tracer = tracer_of()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    ran_in: list[tuple[int, int, int]] = []
    with torch.no_grad(), xsp.trace(levels="model,layer,operator", output=None, sample=1.0) as session:
        for i in range(8):
            with tracer.start_as_current_span("request") as request:
                began = time.time_ns()
                x = torch.randn(1, 8) * (i + 1)  # the request's input: operators before its model call
                model(x).softmax(-1)  # and after it
                ran_in.append((request.get_span_context().trace_id, began, time.time_ns()))
            time.sleep(0.005)  # between requests: what runs in the next lies well after this one
    spans = session.trace.spans
    operators = spans[spans[col.LEVEL] == "operator"]
    windows = {format(trace, "032x"): (began, ended) for trace, began, ended in ran_in}
    requested = operators[operators[col.TRACE_ID].astype(str).isin(windows)]
    assert len(requested) > 0
    for trace, start in zip(requested[col.TRACE_ID].astype(str), requested[col.START_NS]):
        began, ended = windows[trace]
        assert began - 1_000_000 <= start <= ended + 1_000_000  # in its own request (the clocks are two)
    randn = operators[operators[col.NAME] == "aten::randn"]
    assert len(randn) == 8 and not randn[col.TRACE_ID].astype(str).isin(windows).any()  # the session's


def test_a_slow_step_arms_deep_recording_of_the_next_steps(wrapper):
    model, x = Sometimes(), torch.randn(2, 4)
    # steps of 2 ms, one of 300 ms: only the one can pass 20 times the median, on a busy machine too
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.0, slow_factor=20) as session:
        for i in range(40):
            model.sleep_s = 0.3 if i == 30 else 0.002
            model(x)
    spans = session.trace.spans
    roots = step_roots(spans).sort_values(col.STEP)
    reasons = roots[col.SAMPLING].astype(str).tolist()
    assert reasons[31:34] == ["after_slow"] * 3
    assert reasons[:31].count("model_only") >= 29 and reasons[34:] == ["model_only"] * 6
    slow = roots.iloc[30]
    assert json.loads(slow[col.ATTRIBUTES])[col.ATTR_STEP_SLOW] > 20
    assert slow[col.SAMPLING] == "model_only"  # the slow step itself: timed, with the reason
    layer_steps = set(spans[spans[col.LEVEL] == "layer"][col.STEP].astype(int))
    assert {31, 32, 33} <= layer_steps
    assert session.trace.metadata["sampling"]["slow_steps_found"] >= 1


def test_the_leveled_figures_come_from_the_drawn_steps_not_those_recorded_after_a_slow_one():
    """Steps after a slow one come in slow stretches: in the deepest run, they would make its
    overhead look larger than it is (the report calls the runs the drawn steps')."""
    from xsp.session.rotation import leveled_over_steps

    model, x = Sometimes(), torch.randn(2, 4)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.3, slow_factor=20) as session:
        for i in range(60):
            model.sleep_s = 0.3 if i == 30 else 0.002
            model(x)
    roots = step_roots(session.trace.spans)
    reasons = roots[col.SAMPLING].astype(str)
    assert (reasons == "after_slow").sum() == 3 and (reasons == "sampled").any()
    result = leveled_over_steps(session.trace)
    assert result is not None
    drawn = roots[reasons.isin(["sampled", "model_only"])]
    expected = drawn[col.LEVELED_RUN].astype(str).value_counts().to_dict()
    assert result.overhead.set_index("run")["steps"].to_dict() == expected


def test_a_model_that_goes_on_alone_after_joining_another_models_steps_has_each_step_sampled(wrapper):
    """A pool thread that served one endpoint, then another: the second model's first calls
    joined the first's step, then became steps of their own, and had no sampling (the report
    counted fewer steps timed than the trace held)."""
    first, second = Net(), torch.nn.Sequential(torch.nn.Linear(8, 4))
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.2) as session:
        for _ in range(30):
            first(torch.randn(1, 8))
        for _ in range(20):
            second(torch.randn(1, 8))
    roots = step_roots(session.trace.spans)
    assert roots[col.NAME].astype(str).value_counts().to_dict() == {"first": 30, "second": 20}
    assert roots[col.SAMPLING].notna().all(), roots[roots[col.SAMPLING].isna()][[col.NAME, col.STEP]]
    # the session counted them too: the report's "steps timed" is the trace's steps
    counts = session.trace.metadata["sampling"]["steps"]
    assert roots[col.SAMPLING].astype(str).value_counts().to_dict() == {k: v for k, v in counts.items() if v}


def test_a_services_endpoints_are_leveled_each_over_its_own_models_steps(tmp_path):
    """Two endpoints, two models, each request its own step: the leveled runs pooled both models'
    steps and took their layers from one model's last step (the other's vanished from the
    report, and the figures were off: a layer's leveled time above its raw one, an overhead
    below zero)."""
    from xsp.session.rotation import leveled_by_model, leveled_over_steps

    tracer = tracer_of()
    big = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    small = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    output = tmp_path / "two.xsp.parquet"
    with torch.no_grad(), xsp.trace(levels="model,layer", output=str(output), sample=0.3):
        for _ in range(300):
            with tracer.start_as_current_span("POST /classify"):
                big(torch.randn(16, 64))
            with tracer.start_as_current_span("POST /small"):
                small(torch.randn(1, 8))
    trace = xsp.load(output)
    found = dict(leveled_by_model(trace))
    assert list(found) == ["big", "small"]  # the busiest first
    for model, result in found.items():
        layers = result.trace.spans[result.trace.spans[col.LEVEL] == "layer"][col.NAME]
        assert sorted(set(layers)) == [f"{model}.{i}" for i in range(3)]
        model_steps = result.overhead.set_index("run")["steps"]
        roots = step_roots(trace.spans)
        # its own steps, drawn or timed at the model level (not those recorded deep after a slow one)
        drawn_or_timed = roots[col.SAMPLING].astype(str).isin(["sampled", "model_only"]).to_numpy()
        assert model_steps.sum() == ((roots[col.NAME] == model).to_numpy() & drawn_or_timed).sum()
    assert leveled_over_steps(trace, "small").trace.spans[col.NAME].str.startswith("small").any()
    report = subprocess.run([sys.executable, "-m", "xsp", "report", str(output)], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "100"})
    assert report.returncode == 0, report.stderr
    assert "Top 3 layers of big by self time, leveled" in report.stdout
    assert "Top 3 layers of small by self time, leveled" in report.stdout


def test_a_layer_failing_in_a_step_not_sampled_leaves_the_next_deep_steps_whole(wrapper):
    """In a step recorded at the model level only, xsp's C wrapper passes the calls inside
    straight through; a failure there must not leave them passed through in later steps."""
    model, x = Sometimes(), torch.randn(2, 4)
    real_forward, failing = model.inner.forward, [False]

    def inner(value):
        if failing[0]:
            raise RuntimeError("bad request")
        return real_forward(value)

    model.inner.forward = inner
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.0, slow_factor=20) as session:
        for i in range(40):
            failing[0] = i == 25
            model.sleep_s = 0.3 if i == 30 else 0.002
            try:
                model(x)
            except RuntimeError:
                assert i == 25
    spans = session.trace.spans
    roots = step_roots(spans)
    deep = set(roots[roots[col.SAMPLING] == "after_slow"][col.STEP].astype(int))
    layers = spans[spans[col.LEVEL] == "layer"]
    assert len(deep) == 3
    assert sorted(layers[col.STEP].astype(int)) == sorted(deep)  # one layer call in each deep step, none elsewhere


def test_explicit_steps_are_sampled_too(wrapper):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.0) as session:
        for _ in range(3):
            with xsp.step("request"):
                model(x)
                model(x)
    spans = session.trace.spans
    roots = step_roots(spans)
    assert roots[col.NAME].astype(str).tolist() == ["request"] * 3
    assert set(roots[col.SAMPLING].astype(str)) == {"model_only"}
    assert not (spans[col.LEVEL] == "layer").any()
    assert (spans[col.KIND] == "predict").sum() == 6


def test_a_session_after_an_always_on_one_records_every_layer_again(wrapper):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad():
        with xsp.trace(levels="model,layer", output=None, sample=0.0):
            model(x)
        with xsp.trace(levels="model,layer", output=None) as session:
            model(x)
    assert (session.trace.spans[col.LEVEL] == "layer").sum() == 4
    assert session.trace.metadata["sampling"] is None


def test_xsp_sample_from_the_environment(monkeypatch):
    model, x = Net(), torch.randn(2, 8)
    monkeypatch.setenv("XSP_SAMPLE", "0")
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None) as session:
        model(x)
    assert session.trace.metadata["sampling"]["rate"] == 0.0
    for mistyped in ("lots", "5"):  # a service's typo: timed at the model level, not recorded at every level
        monkeypatch.setenv("XSP_SAMPLE", mistyped)
        with pytest.warns(xsp.XspWarning, match=r"XSP_SAMPLE is not used: .*; the session runs always on as with "
                                                r"XSP_SAMPLE=0 \(every step timed at the model level, none sampled "
                                                r"deeper\)"), torch.no_grad():
            with xsp.trace(levels="model,layer", output=None, slow_factor=0) as session:
                model(x)
        assert session.trace.metadata["sampling"]["rate"] == 0.0
        assert (session.trace.spans[col.LEVEL] == "layer").sum() == 0


def windows_closed(tmp_path, seconds: float, **options) -> int:
    """Windows an always-on session writing to a file closed while a loop of steps ran ``seconds``."""
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "w.xsp.parquet", sample=0.0,
                                    **options) as session:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            model(x)
            time.sleep(0.002)
    return int(session.trace.metadata["closed_windows"])


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_window_s_and_xsp_window_s_set_how_often_an_always_on_session_writes(monkeypatch, tmp_path):
    monkeypatch.delenv("XSP_WINDOW_S", raising=False)
    assert windows_closed(tmp_path, 1.0) == 0  # 60 s by default: the session's end writes the one window
    assert windows_closed(tmp_path, 1.0, window_s=0.2) >= 3
    monkeypatch.setenv("XSP_WINDOW_S", "0.2")
    assert windows_closed(tmp_path, 1.0) >= 3
    assert windows_closed(tmp_path, 1.0, window_s=30) == 0  # the argument before the environment
    monkeypatch.setenv("XSP_WINDOW_S", "often")
    with pytest.warns(xsp.XspWarning, match="XSP_WINDOW_S is not used: it must be a number of seconds above 0, "
                                            "not 'often'; windows close every 60 s"):
        assert windows_closed(tmp_path, 0.5) == 0


def steps_for(model, x, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        model(x)
        time.sleep(0.002)


def steps_until(model, x, done, at_least_s: float, give_up_s: float = 60.0) -> None:
    """Steps 1 ms apart for ``at_least_s``, then until ``done()``: on a busy machine the windows
    (and the parts sealed from them) come later than the steps' seconds say."""
    began = time.monotonic()
    while time.monotonic() - began < give_up_s:
        model(x)
        time.sleep(0.001)
        if time.monotonic() - began >= at_least_s and done():
            return


def sealed_parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.xsp.parquet"), key=lambda path: int(path.name.split("-")[1].split(".")[0]))


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_a_window_taken_in_a_burst_of_requests_is_interpreted_in_the_pause_after_it(tmp_path):
    # window_s=4: the window comes due at the burst's end and may wait 2 s for a pause; the
    # burst goes on 0.3 s past it, then the program pauses (a service between bursts)
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "b.xsp.parquet", sample=0.0,
                                    window_s=4.0) as session:
        steps_for(model, x, 4.3)
        time.sleep(2.5)
    meta = session.trace.metadata
    assert meta["closed_windows"] == 1 and meta["helper_windows"] >= 1
    assert meta["window_waits"] == {"after_pause": 1, "past_wait": 0, "at_once": 0}


def test_a_long_step_under_way_is_no_pause(wrapper, tmp_path):
    # steps of 0.4 s back to back (slow requests, one after another): no step begins for 0.4 s at
    # a time, yet one is always under way, so the window taken at 2 s waits its whole second
    model, x = Sometimes(), torch.randn(2, 4)
    model.sleep_s = 0.4
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "l.xsp.parquet", sample=0.0,
                                    window_s=2.0) as session:
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            model(x)
    waits = session.trace.metadata["window_waits"]
    assert waits["after_pause"] == 0 and waits["past_wait"] >= 1, waits


KILLED_ALWAYS_ON = """
import os, signal, sys, time, torch, xsp
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad(), xsp.trace(levels="model,layer", output=sys.argv[1], sample=0.05, window_s=0.5):
    for _ in range(5):  # bursts of requests and pauses: windows are written while it runs
        burst = time.monotonic()
        while time.monotonic() - burst < 0.3:
            model(torch.randn(2, 8))
        time.sleep(0.6)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_report_of_a_killed_always_on_run_counts_the_steps_in_its_file(tmp_path):
    script, output = tmp_path / "killed.py", tmp_path / "svc.xsp.parquet"
    script.write_text(KILLED_ALWAYS_ON)
    done = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    loaded = xsp.load(output)  # read from the windows written before the kill
    steps = len(loaded.steps)
    assert steps > 0
    # what a kill loses, from its window interval (0.5 s, and half a window more always on): it said "about a second"
    assert "the steps of its last window (up to about 0.75 s before it ended) are missing" in \
        loaded.metadata["warnings"][-1], loaded.metadata["warnings"]
    report = subprocess.run([sys.executable, "-m", "xsp", "report", str(output)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert report.returncode == 0, report.stderr
    line = next(line for line in report.stdout.splitlines() if line.startswith("Always on"))
    assert "the session did not end" in line and f"{counted(steps, 'step')} timed" in line, line
    # read from its windows: the report says so, and what that leaves out (it said nothing of it)
    assert "recovered from" in report.stdout and "are missing" in report.stdout, report.stdout[:2000]


KILLED_IN_PARTS = """
import os, signal, sys, time, torch, xsp
from pathlib import Path
folder = Path(sys.argv[1])
parts = folder / "run=svc" / "rank=0"
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with torch.no_grad(), xsp.trace(levels="model,layer", dataset=folder, rotate=0.3, window_s=0.1):
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up and not (parts / "part-1.xsp.parquet").exists():
        model(torch.randn(2, 8))
        time.sleep(0.001)
    # a window past the last sealed part, killed before a next part takes it in: a fixed time
    # after part-1 could end just as a part was sealed (its windows, still there, are that part's)
    segments = list(parts.glob(".part-0.xsp.parquet.xsp-segments.*"))[0]
    while time.monotonic() < give_up and ((segments / "sealing.json").exists() or not list(segments.glob("window-*"))):
        model(torch.randn(2, 8))
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_in_parts(tmp_path: Path, script_text: str) -> Path:
    """Run ``script_text`` (a run in parts that kills itself) as run ``svc`` of a dataset in
    ``tmp_path/runs``; its rank's folder."""
    script = tmp_path / "killed.py"
    script.write_text(script_text)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "XSP_RUN_ID": "svc"})
    assert done.returncode == -9, done.stderr
    return tmp_path / "runs" / "run=svc" / "rank=0"


@pytest.mark.parametrize("named", ["first part", "folder"])
def test_recovering_a_killed_run_in_parts_writes_the_next_part_never_over_a_sealed_one(tmp_path, named):
    """A run in parts writes every window into its first part's hidden folder, so `xsp recover
    part-0.xsp.parquet` looked right, and wrote the windows after the last sealed part over part-0."""
    folder = killed_in_parts(tmp_path, KILLED_IN_PARTS)
    sealed = {path.name: path.read_bytes() for path in folder.glob("part-*.xsp.parquet")}
    assert len(sealed) >= 2
    target = folder / "part-0.xsp.parquet" if named == "first part" else folder
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(target)], capture_output=True, text=True,
                               timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    next_part = folder / f"part-{len(sealed)}.xsp.parquet"
    assert f"-> {next_part}" in recovered.stderr, recovered.stderr
    assert all((folder / name).read_bytes() == content for name, content in sealed.items())  # none written over
    assert xsp.load(next_part).metadata["part"] == {"index": len(sealed), "last": True}
    roots = step_roots(xsp.load(tmp_path / "runs").spans)
    assert roots[col.STEP].astype(int).tolist() == list(range(len(roots)))  # every step once, none lost
    assert len(roots) > sum(len(step_roots(xsp.load(folder / name).spans)) for name in sealed)


KILLED_AS_IT_SEALS = """
import os, pathlib, signal, sys, time, torch, xsp
folder = pathlib.Path(sys.argv[1])
unlink = pathlib.Path.unlink

def killed_as_windows_go(self, missing_ok=False):  # the part in place, its windows not deleted yet
    if self.name.startswith("window-") and (self.parent.parent / "part-1.xsp.parquet").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    return unlink(self, missing_ok=missing_ok)

pathlib.Path.unlink = killed_as_windows_go
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
with torch.no_grad(), xsp.trace(levels="model,layer", dataset=folder, rotate=0.3, window_s=0.1):
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        model(torch.randn(2, 8))
        time.sleep(0.001)
"""


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_a_run_killed_as_it_seals_a_part_is_recovered_without_writing_its_windows_twice(tmp_path):
    """Killed after part-1 was in place and before its windows were deleted, a run's windows were
    all written again by `xsp recover`: 2,204 spans twice, and the report counted their steps twice."""
    folder = killed_in_parts(tmp_path, KILLED_AS_IT_SEALS)
    assert (folder / "part-1.xsp.parquet").exists()
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(folder)], capture_output=True, text=True,
                               timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    roots = step_roots(xsp.load(tmp_path / "runs").spans)
    steps = roots[col.STEP].astype(int).tolist()
    assert steps == sorted(set(steps)), "a step in two parts"
    assert not list(folder.glob(".*.partial"))


@pytest.mark.heavy  # a subprocess run: `python -m pytest -m heavy`
def test_a_killed_run_in_parts_reads_with_the_windows_after_its_last_part_and_says_so(tmp_path):
    """Read before `xsp recover`, its folder left out the windows after its last sealed part
    without a word (up to a part's worth: an hour with --rotate 1h)."""
    folder = killed_in_parts(tmp_path, KILLED_IN_PARTS)
    sealed = sorted(folder.glob("part-*.xsp.parquet"))
    in_parts = sum(len(step_roots(xsp.load(path).spans)) for path in sealed)
    before = xsp.load(folder)
    assert len(step_roots(before.spans)) > in_parts
    assert any("written after" in warning and f"`xsp recover {folder}`" in warning
               for warning in before.metadata["warnings"]), before.metadata["warnings"]
    recovered = subprocess.run([sys.executable, "-m", "xsp", "recover", str(folder)], capture_output=True, text=True,
                               timeout=120)
    assert recovered.returncode == 0, recovered.stderr
    after = xsp.load(folder)
    assert len(step_roots(after.spans)) == len(step_roots(before.spans))
    assert not any("written after" in warning for warning in after.metadata.get("warnings", []))


def test_a_dataset_whose_first_part_is_not_sealed_yet_loads_from_its_windows(monkeypatch, tmp_path):
    """Its only content was the hidden folder of windows, whose session.json was taken for a
    PyTorch profiler trace: 'session.json is JSON but not a Chrome trace', from load and report."""
    monkeypatch.setenv("XSP_RUN_ID", "svc")
    model, x = Net(), torch.randn(2, 8)
    folder = tmp_path / "runs" / "run=svc" / "rank=0"
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path / "runs", rotate="100MB", window_s=0.05):
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and not list(folder.glob(".part-0.xsp.parquet.xsp-segments.*/window-*")):
            model(x)
            time.sleep(0.001)
        assert not list(folder.glob("part-*"))
        while_running = xsp.load(tmp_path / "runs")
    assert len(step_roots(while_running.spans)) > 0 and while_running.metadata["recovered"]["windows"] >= 1
    from xsp.cli.main import main

    assert main(["report", str(tmp_path / "runs")]) == 0


def test_windows_of_steps_that_never_pause_wait_no_longer_than_half_their_interval(tmp_path):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "n.xsp.parquet", sample=0.0,
                                    window_s=0.6) as session:
        steps_for(model, x, 3.0)
    meta = session.trace.metadata
    assert meta["window_waits"]["past_wait"] >= 1


def thread_wakes(native_id: int) -> int:
    """How often a thread of this process has slept and woken (Linux)."""
    status = (Path("/proc/self/task") / str(native_id) / "status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches:")).split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts a thread's wakes in /proc")
def test_the_threads_of_an_always_on_session_never_wake_between_windows_without_a_capture(tmp_path):
    """Each wake of a thread of xsp's takes the GIL from the program's (an event loop's), on a core
    the program may need: a service between two windows, with no capture asked for, sees none."""
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "q.xsp.parquet", sample=0.01):
        model(x)
        background_imports_done()  # the windows' thread imports what it works with as the session starts
        time.sleep(0.5)
        threads = {thread.name: thread.native_id for thread in threading.enumerate() if thread.name.startswith("xsp-")}
        assert {"xsp-windows", "xsp-control"} <= set(threads)
        before = {name: thread_wakes(native_id) for name, native_id in threads.items()}
        time.sleep(2.5)
        after = {name: thread_wakes(native_id) for name, native_id in threads.items()}
        model(x)
    assert after == before


def test_only_an_always_on_session_waits_for_a_pause(tmp_path):
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "p.xsp.parquet") as session:
        model(x)
    assert session.trace.metadata["window_waits"] is None


def test_a_window_interval_past_any_run_keeps_steps_on_the_fast_path(tmp_path):
    """The next window's due time stays an int64, which xsp's C wrapper reads at each step."""
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "w.xsp.parquet", sample=0.0,
                                    window_s=1e12) as session:
        model(x)
        assert session.run is not None
        assert session.run.recording.report_after_ns < 2**63
        model(x)
    assert session.trace.metadata["closed_windows"] == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "10", True])
def test_a_window_interval_that_is_no_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="window_s must be a number of seconds above 0"):
        xsp.trace(sample=0.1, window_s=bad)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "x"])
def test_a_sample_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="sample"):
        xsp.trace(sample=bad)


@pytest.mark.parametrize("receiver_type, protocol", [(GrpcReceiver, "grpc"), (HttpReceiver, "http/protobuf")])
def test_step_and_layer_latency_are_exported_as_metrics_and_kept_in_the_file(receiver_type, protocol):
    model, x = Net(), torch.randn(2, 8)
    with receiver_type() as receiver:
        with torch.no_grad(), xsp.trace(levels="model,layer", output=None, sample=0.5, otlp_endpoint=receiver.endpoint,
                                        otlp_protocol=protocol, service_name="svc") as session:
            for _ in range(30):
                model(x)
        session.wait_for_export(30)
        steps = receiver.sink.histograms("xsp.step.duration")
        layers = receiver.sink.histograms("xsp.layer.duration")
        resource = receiver.sink.metrics[-1].resource_metrics[0].resource.attributes
        step_point, = [metric.histogram.data_points[0] for metric in
                       receiver.sink.metrics[-1].resource_metrics[0].scope_metrics[0].metrics
                       if metric.name == "xsp.step.duration"]
    assert [(count, attributes) for attributes, count, _ in steps] == [(30, {})]
    latency = session.trace.metadata["latency"]
    assert latency["step"]["count"] == 30 and sum(latency["step"]["bucket_counts"]) == 30
    assert abs(steps[0][2] - latency["step"]["sum_ns"] / 1e9) < 1e-6
    assert list(step_point.bucket_counts) == latency["step"]["bucket_counts"]  # the file's figures, bucket by bucket
    assert list(step_point.explicit_bounds) == latency["bounds_s"]
    assert (step_point.min, step_point.max) == (latency["step"]["min_ns"] / 1e9, latency["step"]["max_ns"] / 1e9)
    deep = latency["deep_steps"]
    assert deep == int((step_roots(session.trace.spans)[col.SAMPLING].isin(["sampled", "after_slow"])).sum())
    by_path = {attributes["xsp.layer.path"]: count for attributes, count, _ in layers}
    assert set(by_path) == set(latency["layers"])  # the top layers, and "other" (empty here)
    assert {path: by_path[path] for path in by_path if by_path[path]} == {
        path: deep for path in session.trace.spans[session.trace.spans[col.LEVEL] == "layer"][col.PATH].astype(str)}
    assert {kv.key: kv.value.string_value for kv in resource}["service.name"] == "svc"
    assert latency["metrics_export"]["sent"] >= 1 and latency["metrics_export"]["failed"] == 0


def test_metrics_a_traces_only_collector_refuses_are_one_warning_and_the_spans_reach_it():
    model, x = Net(), torch.randn(2, 8)
    with HttpReceiver(takes_metrics=False) as receiver:
        with pytest.warns(xsp.XspWarning) as said, torch.no_grad():
            with xsp.trace(levels="model,layer", output=None, sample=0.5, otlp_endpoint=receiver.endpoint,
                           otlp_protocol="http/protobuf") as session:
                for _ in range(10):
                    model(x)
            report = session.wait_for_export(30)
    assert report.error is None and report.exported == len(session.trace.spans)
    messages = [str(w.message) for w in said]
    assert len(messages) == 1 and messages[0].startswith("xsp: latency metrics: 1 of 1 sends to the collector failed")


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(x))


def test_drawn_steps_rotate_through_the_layer_depths_and_level_the_figures(monkeypatch, tmp_path):
    import xsp.session.options as session_options
    from xsp.session.rotation import leveled_over_steps

    monkeypatch.setattr(session_options, "ALWAYS_ON_WINDOW_S", 0.1)  # windows soon show how deep the layers go
    model, x = Nested(), torch.randn(2, 8)
    output = tmp_path / "rotating.xsp.parquet"
    with torch.no_grad(), xsp.trace(levels="model,layer", output=output, sample=0.5, slow_factor=0) as session:
        assert session.run is not None and session.run.sampler is not None
        sampler, learnt_at = session.run.sampler, []

        def deep_plans_drawn_a_while() -> bool:
            """The plans to depth 1 and 2 learnt from a window, then 0.5 s of steps drawn in turn."""
            if not learnt_at and {plan.label for plan in sampler.plans} >= {"model+layer<=1", "model+layer"}:
                learnt_at.append(time.monotonic())
            return bool(learnt_at) and time.monotonic() - learnt_at[0] > 0.5

        steps_until(model, x, deep_plans_drawn_a_while, at_least_s=1.5)
    spans = session.trace.spans
    roots = step_roots(spans)
    runs = roots.groupby(roots[col.LEVELED_RUN].astype(str))[col.STEP].apply(set)
    assert {"model", "model+layer<=1", "model+layer"} <= set(runs.index)
    assert set(roots[roots[col.LEVELED_RUN] == "model"][col.SAMPLING].astype(str)) == {"model_only"}
    layers = spans[spans[col.LEVEL] == "layer"]
    depth_of_step = layers.groupby(col.STEP)[col.CALL_DEPTH].max()
    assert depth_of_step[depth_of_step.index.isin(runs["model+layer<=1"])].max() == 1
    assert depth_of_step[depth_of_step.index.isin(runs["model+layer"])].max() == 2
    result = leveled_over_steps(xsp.load(output))
    assert result is not None
    by_run = result.overhead.set_index("run")["steps"].to_dict()
    assert by_run["model"] == len(runs["model"]) and by_run["model+layer<=1"] == len(runs["model+layer<=1"])
    merged = result.trace.spans
    sources = merged[merged[col.LEVEL] == "layer"].set_index(col.NAME)[col.LEVELED_RUN].to_dict()
    assert sources["model.block"] == "model+layer<=1" and sources["model.block.0"] == "model+layer"
    report = subprocess.run([sys.executable, "-m", "xsp", "report", str(output)], capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "80"})
    assert report.returncode == 0, report.stderr
    assert "Leveled over the drawn steps" in report.stdout and "from run" in report.stdout
    assert "by self time (the " in report.stdout and " recorded deep; ms per call)" in report.stdout  # deep steps
    assert max(map(len, report.stdout.splitlines())) <= 80


PARTS_SCRIPT = """
import pathlib, time, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
began = time.monotonic()
parts = pathlib.Path("runs", "run=svc", "rank=0")
with torch.no_grad():  # 2 s, then until three parts are sealed (later on a busy machine)
    while time.monotonic() - began < 60 and (time.monotonic() - began < 2 or len(list(parts.glob("part-*"))) < 3):
        model(torch.randn(2, 8))
        time.sleep(0.001)
"""


def test_xsp_runs_closing_line_counts_every_part_of_a_run_written_in_parts(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(PARTS_SCRIPT)
    environment = {**os.environ, "XSP_WINDOW_S": "0.1", "XSP_RUN_ID": "svc"}
    command = [sys.executable, "-m", "xsp", "run", "--sample", "0.2", "--dataset", "runs", "--rotate", "0.4s", "--",
               str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "runs" / "run=svc" / "rank=0"
    parts = list(folder.glob("part-*.xsp.parquet"))
    assert len(parts) >= 3
    whole = xsp.load(folder)
    steps = whole.spans[col.STEP].dropna().nunique()
    line = (f"xsp: {counted(len(whole.spans), 'span')}, {counted(steps, 'step')} in {len(parts)} parts -> "
            f"{os.path.join('runs', 'run=svc', 'rank=0')}{os.sep}")
    assert line in done.stderr, done.stderr


def test_a_long_session_is_written_in_parts_each_readable_while_it_runs(monkeypatch, tmp_path, capsys):
    import xsp.session.options as session_options

    monkeypatch.setattr(session_options, "ALWAYS_ON_WINDOW_S", 0.1)
    monkeypatch.setenv("XSP_RUN_ID", "svc")
    model, x = Net(), torch.randn(2, 8)
    folder = tmp_path / "runs" / "run=svc" / "rank=0"
    sealed_while_running = []
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path / "runs", sample=0.2, slow_factor=0,
                                    rotate=0.4) as session:

        def three_sealed() -> bool:
            if not sealed_while_running and (folder / "part-0.xsp.parquet").exists():
                sealed_while_running.append(xsp.load(folder / "part-0.xsp.parquet"))
            return len(sealed_parts(folder)) >= 3

        steps_until(model, x, three_sealed, at_least_s=2.0)
    parts = sealed_parts(folder)
    assert len(parts) >= 3
    first = sealed_while_running[0]  # read while the session ran
    assert first.metadata["part"] == {**first.metadata["part"], "index": 0, "last": False}
    assert len(step_roots(first.spans)) > 0
    whole = xsp.load(tmp_path / "runs")
    assert whole.metadata["parts"] == [str(path) for path in parts]
    assert whole.metadata["part"] == {"index": len(parts) - 1, "last": True}
    roots = step_roots(whole.spans)
    assert roots[col.STEP].astype(int).tolist() == list(range(len(roots)))  # every step once, across the parts
    assert len(roots) == len(step_roots(session.trace.spans)) + sum(
        len(step_roots(xsp.load(path).spans)) for path in parts[:-1])
    assert (whole.spans[col.KIND] == "session").sum() == 1
    # a service that ran for days has more parts than the machine loads at once: said so, in one line naming
    # the newest part, which xsp report still reads (a window at a time)
    from xsp.cli.main import main
    from xsp.io import memory_needed

    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 16)
    with pytest.raises(xsp.TraceTooLargeError, match=rf"\({len(parts)} parts\) is too large to load whole here"):
        xsp.load(tmp_path / "runs")
    assert main(["report", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"the newest {parts[-1]}," in error
    assert main(["report", str(parts[-1])]) == 0
    assert "read a part at a time" in " ".join(capsys.readouterr().out.split())


@pytest.mark.heavy  # seconds of steps, until three parts are sealed
def test_parts_rotated_by_size_are_near_that_size_not_a_fraction_of_it(monkeypatch, tmp_path):
    """A part is Parquet, compressed; its windows, while the session runs, are not. Sizes were
    compared before compression: `rotate="512KB"` sealed parts of about 190 KB."""
    monkeypatch.setenv("XSP_RUN_ID", "svc")
    limit = 512 << 10
    model, x = Net(), torch.randn(2, 8)
    folder = tmp_path / "runs" / "run=svc" / "rank=0"
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path / "runs", rotate="512KB", window_s=0.05):
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and not (folder / "part-3.xsp.parquet").exists():
            for _ in range(50):
                model(x)
                time.sleep(0.0002)
    parts = sorted(folder.glob("part-*.xsp.parquet"), key=lambda path: int(path.name.split("-")[1].split(".")[0]))
    assert len(parts) >= 4
    # the first part is sealed before how much the windows compress is known, the last when the
    # session ends: the parts between hold what was asked
    between = [path.stat().st_size for path in parts[1:-1]]
    assert all(0.5 * limit <= size <= 1.5 * limit for size in between), (between, limit)
    assert xsp.load(tmp_path / "runs").spans[col.STEP].dropna().nunique() > 0


def test_an_always_on_session_rotating_by_time_seals_its_parts_that_often(monkeypatch, tmp_path):
    """Parts are sealed as windows close, and an always-on session's close every 60 s: rotate=0.3
    (or `--rotate 2s`) sealed nothing until the end, and said nothing."""
    monkeypatch.setenv("XSP_RUN_ID", "svc")
    monkeypatch.delenv("XSP_WINDOW_S", raising=False)
    model, x = Net(), torch.randn(2, 8)
    folder = tmp_path / "runs" / "run=svc" / "rank=0"
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path / "runs", sample=0.2, rotate=0.3):
        steps_until(model, x, lambda: len(sealed_parts(folder)) >= 3, at_least_s=1.5)
    parts = sealed_parts(folder)
    assert len(parts) >= 3, parts


def test_rotate_needs_a_dataset_and_a_time_or_a_size():
    with pytest.raises(ValueError, match="dataset=DIR"):
        xsp.trace(rotate="1h")
    with pytest.raises(ValueError, match="rotate must be a time"):
        xsp.trace(rotate="soon", dataset="d")


@pytest.mark.heavy  # waits out the sends' timeouts
def test_a_collector_that_never_answers_costs_one_warning_per_signal_and_no_sdk_line(capfd):
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    model, x = Net(), torch.randn(2, 8)
    try:
        with pytest.warns(xsp.XspWarning) as said, torch.no_grad():
            with xsp.trace(levels="model,layer", output=None, sample=0.5, otlp_protocol="http/protobuf",
                           otlp_endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}") as session:
                for _ in range(20):
                    model(x)
            session.wait_for_export(30)
    finally:
        silent.close()
    metrics = session.trace.metadata["latency"]["metrics_export"]
    assert metrics["failed"] >= 1 and metrics["sent"] == 0
    # one collector, one warning: the spans' failure says the metrics' too
    about_metrics = [str(w.message) for w in said if "latency metrics" in str(w.message)]
    assert len(about_metrics) == 1 and "spans sent" in about_metrics[0], about_metrics
    assert "its latency metrics failed too (" in about_metrics[0]
    assert "Failed to export" not in capfd.readouterr().err  # the SDK's own lines stay out of the program's stderr


def test_a_block_that_joins_a_session_says_its_own_sample_is_not_used():
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), xsp.trace(levels="model,layer", output=None) as outer:
        with pytest.warns(xsp.XspWarning, match=r"its sample= is not used: that session decides how deep each step "
                                                r"is recorded \(every step at every level\)"):
            with xsp.trace(levels="model,layer", output=None, sample=0.1):
                model(x)
    assert (outer.trace.spans[col.LEVEL] == "layer").sum() == 4


def test_slow_factor_without_sampling_is_refused_by_the_api_as_by_the_cli(monkeypatch):
    """It was accepted and did nothing: no step is slow where every step is recorded deep."""
    monkeypatch.delenv("XSP_SAMPLE", raising=False)
    with pytest.raises(ValueError, match="slow_factor applies to always-on sessions only: give sample too"):
        xsp.trace(slow_factor=3, output=None)
    monkeypatch.setenv("XSP_SAMPLE", "0.5")  # sampling from the environment: the factor applies to it
    with xsp.trace(slow_factor=3, output=None) as session:
        pass
    assert session.trace.metadata["sampling"]["slow_factor"] == 3


def test_slow_factor_without_sample_is_refused(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    environment = {key: value for key, value in os.environ.items() if key != "XSP_SAMPLE"}
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "--slow-factor", "3", "--", str(script)],
                          capture_output=True, text=True, env=environment)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "xsp: error: --slow-factor applies to always-on sessions only: give --sample too\n"


LONG_RUN = """
import json, sys, psutil, torch
import xsp
from opentelemetry.sdk.trace import TracerProvider
requests, folder = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
tracer = TracerProvider().get_tracer("service")
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x = torch.randn(4, 32)
process = psutil.Process()
rss = []
with xsp.trace(levels="model,layer", sample=0.01, dataset=folder, rotate="1MB"), torch.no_grad():
    for request in range(requests):
        with tracer.start_as_current_span("POST /predict"):
            model(x)
        if request % (requests // 10) == 0:
            rss.append(process.memory_info().rss)
    rss.append(process.memory_info().rss)
print(json.dumps(rss))
"""


@pytest.mark.heavy  # a million requests, a minute or two
def test_a_million_requests_always_on_keep_memory_flat_and_the_trace_in_readable_parts(tmp_path):
    requests = 1_000_000
    service = subprocess.Popen([sys.executable, "-c", LONG_RUN, str(requests), str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "XSP_RUN_ID": "svc"})
    first_part = tmp_path / "run=svc" / "rank=0" / "part-0.xsp.parquet"
    read_while_running = None
    while service.poll() is None:  # another process reads the first part as the service runs
        if read_while_running is None and first_part.exists():
            read_while_running = xsp.load(first_part)
        time.sleep(0.5)
    out, err = service.communicate()
    assert service.returncode == 0, err
    assert "warning" not in err.lower(), err
    assert read_while_running is not None and read_while_running.metadata["part"]["last"] is False
    assert len(step_roots(read_while_running.spans)) > 0
    rss_mb = [value / 2**20 for value in json.loads(out.strip().splitlines()[-1])]
    # flat after warm-up (the first tenth): the highest of the second half at most 50 MB above the
    # highest of the first (a window, 10 s of steps, comes and goes: where the marks fall on it moves
    # single readings by tens of megabytes; a leak raises the peaks)
    assert max(rss_mb[6:]) - max(rss_mb[1:6]) <= 50, [round(value) for value in rss_mb]
    parts = list((tmp_path / "run=svc").glob("rank=*/part-*.xsp.parquet"))
    assert len(parts) >= 3, parts
    whole = xsp.load(tmp_path)
    roots = step_roots(whole.spans)
    assert len(roots) == requests and roots[col.STEP].astype(int).tolist() == list(range(requests))
    deep = roots[roots[col.SAMPLING] != StepSampling.MODEL_ONLY.value]
    drawn = int((roots[col.SAMPLING] == StepSampling.SAMPLED.value).sum())
    assert 0.008 * requests < drawn < 0.012 * requests  # the rate (1%: 10,000 +- 4 sd of 99)
    # plus the steps after a slow one, at most SLOW_SHARE of them (a busy machine makes many slow)
    assert len(deep) - drawn <= SLOW_SHARE * requests + DEFAULT_SLOW_STEPS


def test_xsp_sample_is_not_used_by_a_leveled_experiment_nor_its_calibration(monkeypatch):
    monkeypatch.setenv("XSP_SAMPLE", "0")  # a service's setting: model level only, were it used
    model, x = Net(), torch.randn(2, 8)
    with torch.no_grad(), pytest.warns(xsp.XspWarning, match="XSP_SAMPLE is not used by a leveled experiment"):
        result = xsp.leveled(lambda: model(x), levels="model,layer", repeat=3, warmup=1, rounds=1)
    spans = result.trace.spans
    layers = spans[spans[col.LEVEL] == "layer"]
    assert len(layers) == 4  # Net's layers, from a run that recorded them (at XSP_SAMPLE=0 it would have none)
    assert result.trace.metadata["leveled"]["calibration"]["layer"]["events"] > 0  # calibrated with layers too
    assert col.SAMPLING not in spans or spans[col.SAMPLING].isna().all()


@pytest.mark.heavy  # a leveled run of a script
def test_xsp_run_leveled_says_xsp_sample_is_not_used_and_records_every_step(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text("import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
                      "with torch.no_grad():\n    for _ in range(3):\n        model(torch.randn(4, 8))\n")
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "--leveled", "--levels", "model,layer", "--warmup", "1",
                           "--rounds", "1", "-o", str(tmp_path / "lv.xsp.parquet"), "--", str(script)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "XSP_SAMPLE": "0"})
    assert done.returncode == 0, done.stderr
    assert "xsp: XSP_SAMPLE is not used by --leveled" in done.stderr
    spans = xsp.load(tmp_path / "lv.xsp.parquet").spans
    assert (spans[col.LEVEL] == "layer").any()


def test_a_service_gone_quiet_after_a_burst_exports_its_last_requests_within_a_window(tmp_path):
    """A window closes at a step end: a service quiet after a burst kept its last requests' spans
    until its next request, so they were not in Jaeger for as long as it stayed quiet. The window
    thread now closes a window each interval the service is quiet."""
    tracer = tracer_of()
    model, x = Net(), torch.randn(2, 8)
    with GrpcReceiver() as receiver:
        with torch.no_grad(), xsp.trace(levels="model,layer", output=tmp_path / "t.xsp.parquet", sample=1.0,
                                        otlp_endpoint=receiver.endpoint, window_s=0.3) as session:
            for _ in range(5):
                with tracer.start_as_current_span("POST /predict"):
                    model(x)
            waited_until = time.monotonic() + 60
            arrived = 0
            while time.monotonic() < waited_until and arrived < 5:  # no step meanwhile
                time.sleep(0.05)
                with receiver.sink.lock:
                    arrived = sum(span.name == "model" for span in receiver.sink.spans)
        session.wait_for_export(30)
        assert arrived == 5
