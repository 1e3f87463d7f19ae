"""Long steps are exported while the session runs, and match the final file exactly."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings

import pytest
import torch

import xsp
from xsp.core import schema as col

from .otlp_receiver import GrpcReceiver
from .test_otlp_export import Small, assert_same_spans


def wait_for(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_each_long_step_reaches_the_collector_before_the_block_ends(tmp_path):
    model = Small()
    arrived_during_block = []
    with GrpcReceiver() as receiver:
        with xsp.trace(output=tmp_path / "run.xsp.parquet", otlp_endpoint=receiver.endpoint, service_name="xsp-test",
                       long_step_s=0.0) as session:
            for step in range(3):
                with xsp.span("preprocess"):
                    x = torch.randn(2, 4)
                with torch.no_grad():
                    model(x)
                # a step is decided when the next one begins: the one before this call is exported now
                arrived_during_block.append(wait_for(
                    lambda step=step: sum(s.name == "model" for s in receiver.sink.spans) == step))
        report = session.wait_for_export(30)
    assert arrived_during_block == [True, True, True]
    assert sum(s.name == "model" for s in receiver.sink.spans) == 3
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.metadata["windows"] >= 3
    # helper processes interpreted the windows and made their spans ready; this process only sent them
    assert trace.metadata["helper_windows"] >= 1, trace.metadata
    assert report.error is None and report.exported == len(trace.spans)
    assert_same_spans(trace, receiver.sink.spans)
    spans = trace.spans
    assert sorted(spans[spans[col.KIND] == "predict"][col.STEP]) == [0, 1, 2]
    preprocess = spans[spans[col.NAME] == "preprocess"].sort_values(col.START_NS)
    assert preprocess[col.PATH].tolist() == [f"session[0]/preprocess[{k}]" for k in range(3)]
    session_id = spans[spans[col.KIND] == "session"][col.SPAN_ID].iloc[0]
    assert (preprocess[col.PARENT_ID] == session_id).all()


@pytest.mark.heavy
def test_backward_after_an_exported_forward_joins_its_step(tmp_path):
    model = Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with GrpcReceiver() as receiver:
        with xsp.trace(output=None, otlp_endpoint=receiver.endpoint, service_name="xsp-test",
                       long_step_s=0.0) as session:
            for _ in range(2):
                out = model(torch.randn(3, 4))  # with its backward, one step: exported as the next begins
                out.sum().backward()  # (without an optimizer step, a backward may be a micro-batch's:
                optimizer.step()  # the step's end is decided later, docs/steps.md)
                optimizer.zero_grad()
        session.wait_for_export(30)
    spans = session.trace.spans
    assert session.trace.metadata["windows"] >= 2
    assert spans[spans[col.KIND] == "step"][col.NAME].tolist() == ["train_step", "train_step"]
    predicts = spans[spans[col.KIND] == "predict"].set_index(col.STEP)
    backward = spans[spans[col.KIND] == "backward"]
    assert set(backward[col.STEP]) == {0, 1}
    for step, group in backward.groupby(col.STEP):
        assert (group[col.TRACE_ID] == predicts.loc[step, col.TRACE_ID]).all()
        layers = spans[(spans[col.LEVEL] == "layer") & (spans[col.STEP] == step)]
        assert sorted(layers[col.EXEC_INDEX]) == list(range(len(layers)))  # counting went on
    assert_same_spans(session.trace, receiver.sink.spans)


def test_explicit_steps_with_inner_model_calls_are_not_split(tmp_path):
    model = Small()
    with GrpcReceiver() as receiver:
        with xsp.trace(output=None, otlp_endpoint=receiver.endpoint, service_name="xsp-test",
                       long_step_s=0.0) as session:
            for _ in range(2):
                with xsp.step("train"):
                    model(torch.randn(2, 4)).sum().backward()
                    model(torch.randn(2, 4))
        session.wait_for_export(30)
    spans = session.trace.spans
    steps = spans[spans[col.KIND] == "step"]
    assert steps[col.STEP].tolist() == [0, 1]
    predicts = spans[spans[col.KIND] == "predict"]
    assert predicts[col.PARENT_ID].isin(steps[col.SPAN_ID]).all()
    assert sorted(predicts[col.PATH]) == ["train[0]/model[0]", "train[0]/model[0]",
                                          "train[0]/model[1]", "train[0]/model[1]"]
    assert_same_spans(session.trace, receiver.sink.spans)


def collect_here() -> None:
    """A full collection, run on this thread: ``gc.collect()`` does nothing while a collection
    set off on another thread (xsp's own, importing at the session's start) is under way."""
    ran: list[int] = []
    thread = threading.get_ident()

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and threading.get_ident() == thread:
            ran.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        while not ran:
            gc.collect()
    finally:
        gc.callbacks.remove(seen)


class CollectThenWait(torch.nn.Module):
    """Sets off a full collection at each call; the ``wait_at``-th call then waits for ``release``."""

    def __init__(self, wait_at: int) -> None:
        super().__init__()
        self.calls, self.wait_at = 0, wait_at
        self.waiting, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        collect_here()
        self.calls += 1
        if self.calls == self.wait_at:
            self.waiting.set()
            self.release.wait(60)
        return x


@pytest.mark.parametrize("levels, in_each_step", [("model,layer", "background.0"),
                                                  ("model,layer,operator", "aten::addmm"),
                                                  ("model,layer,system", "gc generation 2")])
def test_a_threads_decided_steps_reach_the_collector_while_its_next_step_is_open(tmp_path, levels, in_each_step):
    """A server's thread is almost always inside a step (its last one is decided only when its
    next begins): windows closed on other threads still take its decided steps, with what the
    deeper levels recorded of them elsewhere (operators, collections), and leave the open one
    whole for later."""
    collecting = CollectThenWait(wait_at=3)
    background = torch.nn.Sequential(torch.nn.Linear(4, 4), collecting)

    def serve():
        with torch.no_grad():
            for _ in range(3):  # steps 0 and 1 decided; step 2 open, waiting inside its call
                background(torch.randn(3, 4))

    model = Small()
    with GrpcReceiver() as receiver:
        # windows close by time, each at the first step end past it: all on this thread's steps
        with xsp.trace(output=tmp_path / "run.xsp.parquet", levels=levels, otlp_endpoint=receiver.endpoint,
                       service_name="xsp-test", window_s=0.1) as session:
            worker = threading.Thread(target=serve)
            worker.start()
            assert collecting.waiting.wait(60)

            def background_steps_sent() -> int:
                with torch.no_grad():
                    model(torch.randn(1, 4))  # a step of this thread's ends: a window closes here
                return sum(span.name == "background" for span in receiver.sink.spans)

            arrived = wait_for(lambda: background_steps_sent() >= 2)
            open_step_sent = background_steps_sent() > 2
            sent_while_waiting = list(receiver.sink.spans)
            collecting.release.set()
            worker.join()
        session.wait_for_export(30)
    assert arrived, "the waiting thread's decided steps were not sent while it waited"
    assert not open_step_sent, "the waiting thread's open step was sent before it was decided"
    names_by_trace: dict[str, set[str]] = {}
    for span in sent_while_waiting:
        names_by_trace.setdefault(span.trace_id, set()).add(span.name)
    sent_steps = [names for names in names_by_trace.values() if "background" in names]
    assert len(sent_steps) == 2 and all(in_each_step in names for names in sent_steps), sent_steps
    spans = session.trace.spans
    layers = spans[spans[col.LEVEL] == "layer"]
    by_id = spans.set_index(col.SPAN_ID)
    parents = by_id.loc[layers[col.PARENT_ID].astype("int64")]
    assert (parents[col.STEP].to_numpy() == layers[col.STEP].to_numpy()).all()
    assert_same_spans(session.trace, receiver.sink.spans)


def test_threads_with_windows_keep_a_consistent_tree(tmp_path):
    models = [Small() for _ in range(4)]

    def worker(i):
        with torch.no_grad():
            for _ in range(5):
                models[i](torch.randn(i + 1, 4))

    with GrpcReceiver() as receiver:
        with xsp.trace(output=None, otlp_endpoint=receiver.endpoint, service_name="xsp-test",
                       long_step_s=0.0) as session:
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        session.wait_for_export(30)
    spans = session.trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert sorted(predicts[col.STEP]) == list(range(20))
    layers = spans[spans[col.LEVEL] == "layer"]
    assert len(layers) == 20 * 4 and layers[col.PARENT_ID].notna().all()
    by_id = spans.set_index(col.SPAN_ID)
    parents = by_id.loc[layers[col.PARENT_ID].astype("int64")]
    assert (parents[col.THREAD_ID].to_numpy() == layers[col.THREAD_ID].to_numpy()).all()
    assert (parents[col.STEP].to_numpy() == layers[col.STEP].to_numpy()).all()
    assert spans[col.SPAN_ID].is_unique
    assert_same_spans(session.trace, receiver.sink.spans)


def test_with_the_operator_level_no_step_leaves_before_its_operators(tmp_path):
    """Each step is sent as it ends, with its operators (the operator level's records are taken
    into the window of the step that made them)."""
    model = Small()
    with GrpcReceiver() as receiver:
        with xsp.trace(output=tmp_path / "ops.xsp.parquet", levels="model,layer,operator",
                       otlp_endpoint=receiver.endpoint, service_name="xsp-test", long_step_s=0.0) as session:
            for _ in range(3):
                with torch.no_grad():
                    model(torch.randn(2, 4))
        report = session.wait_for_export(30)
    trace = xsp.load(tmp_path / "ops.xsp.parquet")
    assert report.error is None and report.exported == len(trace.spans)
    sent_names = {}
    for span in receiver.sink.spans:
        sent_names.setdefault(span.trace_id, set()).add(span.name)
    steps = trace.spans[trace.spans[col.STEP].notna()]
    for trace_id in steps[col.TRACE_ID].astype(str).unique():  # every step trace sent whole: with its operators
        assert "aten::addmm" in sent_names[trace_id] and "model" in sent_names[trace_id]
    spans = trace.spans
    operators = spans[(spans[col.LEVEL] == "operator") & spans[col.PATH].str.startswith("model[0]/")]
    predicts = spans[spans[col.KIND] == "predict"].set_index(col.STEP)
    # every operator of a model call inside its own step's model call
    inside = [predicts.loc[step, col.START_NS] <= start and end <= predicts.loc[step, col.END_NS]
              for step, start, end in zip(operators[col.STEP], operators[col.START_NS], operators[col.END_NS])]
    assert len(operators) and all(inside)


def test_a_helper_that_fails_while_the_session_exports_leaves_every_span_sent_once(tmp_path, monkeypatch):
    """Windows are interpreted, and made ready to send, by helper processes; the session only
    sends. When a helper fails, the windows from then on are interpreted and sent by the session
    itself: the collector still gets every span of the file, none twice, and the failure is said once."""
    import xsp.session.windows as windows
    from xsp.session.forked import ForkFailed

    real_run_forked, calls = windows.run_forked, []

    def fails_after_one(function, deadline_s, ending=None):
        calls.append(deadline_s)
        if len(calls) > 1:
            raise ForkFailed("fork failed: no memory")
        return real_run_forked(function, deadline_s, ending)

    monkeypatch.setattr(windows, "run_forked", fails_after_one)
    model = Small()
    with GrpcReceiver() as receiver:
        with pytest.warns(xsp.XspWarning, match="helper process could not interpret a window") as said:
            with xsp.trace(output=tmp_path / "run.xsp.parquet", otlp_endpoint=receiver.endpoint,
                           service_name="xsp-test", long_step_s=0.0) as session:
                for _ in range(6):
                    with torch.no_grad():
                        model(torch.randn(2, 4))
                    time.sleep(0.05)  # a window a step, not several merged
            report = session.wait_for_export(30)
    assert len([w for w in said if "helper" in str(w.message)]) == 1
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert trace.metadata["helper_windows"] == 1 and trace.metadata["windows"] >= 3, trace.metadata
    assert report.error is None and report.failed == 0 and report.exported == len(trace.spans)
    assert trace.steps == list(range(6))
    assert_same_spans(trace, receiver.sink.spans)


def test_a_collector_that_failed_a_window_gets_the_windows_after_it_came_back(tmp_path):
    """A service runs for days; its collector restarts. The windows sent while it was down are
    counted as failed (the file keeps them), and the windows after it came back reach it: one
    failure does not end the session's export."""
    from .otlp_receiver import HttpReceiver

    model = Small()

    def step_answered(receiver, status) -> bool:
        with torch.no_grad():
            model(torch.randn(2, 4))  # a step ends: the one before it is decided, its window sent
        return status in receiver.statuses[-1:]

    failing = "is failing (the collector rejected or did not acknowledge a batch)"
    with HttpReceiver() as receiver, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with xsp.trace(output=tmp_path / "run.xsp.parquet", otlp_endpoint=receiver.endpoint,
                       otlp_protocol="http/protobuf", service_name="xsp-test", long_step_s=0.0) as session:
            assert wait_for(lambda: step_answered(receiver, 200))
            receiver.rejecting = True  # the collector goes down (answers 400)
            assert wait_for(lambda: step_answered(receiver, 400))
            # said while the service runs, not days later at its end
            assert wait_for(lambda: any(failing in str(w.message) for w in said)), [str(w.message) for w in said]
            receiver.rejecting = False  # and comes back
            assert wait_for(lambda: step_answered(receiver, 200))
        report = session.wait_for_export(30)
    assert sum(failing in str(w.message) for w in said) == 1  # once
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    first_refusal = receiver.statuses.index(400)
    assert 200 in receiver.statuses[first_refusal:], receiver.statuses  # sent again after the failure
    assert report.tried_again >= 1 and trace.metadata["export"]["tried_again"] == report.tried_again
    received = [span.span_id for span in receiver.sink.spans]
    assert len(received) == len(set(received)) == report.exported
    assert set(received) < set(trace.spans[col.SPAN_ID])  # the file keeps every span, sent or not
    assert report.failed > 0 and report.exported + report.failed == report.submitted
    assert report.state == "failed" and f"{report.exported:,} of {report.submitted:,} spans sent" in report.summary()


@pytest.mark.parametrize("collector_starts", ["after a window failed", "before the first window"])
def test_an_always_on_session_whose_collector_starts_after_it_sends_once_it_answers(tmp_path, monkeypatch,
                                                                                  collector_starts):
    """A service's collector (a sidecar) may start after the service: its always-on session says
    so once, counts the windows it could not send as failed (the file keeps them), and sends the
    windows after the collector answers. Where it answered before any window was due, nothing was
    lost: the export is done, not failed, and its line says every span was sent (it said
    "303 of 303 spans sent; the collector did not answer", a failure that lost nothing)."""
    import socket

    import xsp.session.windows as session_windows

    from .otlp_receiver import HttpReceiver

    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = Small()
    real_probe, probes = session_windows.probe, []

    def counted_probe(target):  # asked before each window's export while the collector did not answer
        answer = real_probe(target)
        probes.append(answer)
        return answer

    monkeypatch.setattr(session_windows, "probe", counted_probe)

    def steps_for(seconds: float) -> None:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            with torch.no_grad():
                model(torch.randn(2, 4))
            time.sleep(0.01)

    failing_first = collector_starts == "after a window failed"
    with contextlib.ExitStack() as collector:
        with pytest.warns(xsp.XspWarning, match=rf"OTLP endpoint \S*:{port}\S* does not answer now: .*tries it "
                                                r"again at each window.*trace file only") as said:
            with xsp.trace(output=tmp_path / "run.xsp.parquet", otlp_endpoint=f"http://127.0.0.1:{port}",
                           otlp_protocol="http/protobuf", service_name="xsp-test", sample=0.5,
                           window_s=0.2) as session:
                if failing_first:  # windows close while nothing listens: at least one is exported then
                    assert wait_for(lambda: (steps_for(0.1), any(answer is not None for answer in probes))[1], 60)
                receiver = collector.enter_context(HttpReceiver(port=port))  # the collector starts
                assert wait_for(lambda: (steps_for(0.1), len(receiver.sink.spans))[1] > 0)
                steps_for(0.5)
            report = session.wait_for_export(30)  # the last window and the session span, sent at the end
    messages = [str(w.message) for w in said]
    assert len([message for message in messages if "does not answer now" in message]) == 1, messages
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    received = [span.span_id for span in receiver.sink.spans]
    assert report.tried_again == 1 and len(received) == len(set(received)) > 0
    assert report.exported + report.failed == report.submitted
    assert set(received) <= set(trace.spans[col.SPAN_ID])
    assert trace.metadata["otlp"] is not None and trace.metadata["export"]["tried_again"] == 1
    if failing_first:  # the export's one line at the end: what was sent of what, and why the rest was not
        assert report.failed > 0 and report.state == "failed"
        assert any(f"{report.exported:,} of {report.submitted:,} spans sent; the collector did not answer" in message
                   for message in messages), messages
    else:
        assert report.failed == 0 and report.state == "done" and report.error is None
        assert report.exported == report.submitted == len(received)
        assert "spans sent" not in " ".join(messages)  # no warning of a failure that lost nothing
        assert report.summary() == (f"{report.exported:,} spans sent to http/protobuf "
                                    f"http://127.0.0.1:{port}/v1/traces (the collector did not answer at first: "
                                    f"{report.unanswered}; every span was sent once it did)")
        assert trace.metadata["export"]["state"] == "done"
