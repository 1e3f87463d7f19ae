"""xsp.trace / xsp.span / xsp.step on small real models."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import xsp
from xsp.core import schema as col


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x) * scale
        return self.head(h), h


def trace_of(fn, **options):
    options.setdefault("output", None)
    with xsp.trace(**options) as session:
        fn()
    return session.trace


def by_name(trace):
    return {name: group for name, group in trace.spans.groupby(col.NAME)}


def test_predict_spans_start_steps_and_layers_hang_below_them():
    model = Net()
    with torch.no_grad():
        trace = trace_of(lambda: [model(torch.randn(3, 4)) for _ in range(3)])
    spans = trace.spans
    predicts = spans[spans[col.KIND] == "predict"].sort_values(col.START_NS)
    assert predicts[col.STEP].tolist() == [0, 1, 2]
    assert predicts[col.BATCH_SIZE].tolist() == [3, 3, 3]
    assert predicts[col.MODULE_TYPE].tolist() == ["Net"] * 3
    assert predicts[col.PARENT_ID].isna().all()
    assert predicts[col.TRACE_ID].nunique() == 3
    layers = spans[spans[col.LEVEL] == "layer"]
    assert predicts[col.NAME].tolist() == ["model"] * 3  # named as the calling code names it
    assert sorted(layers[col.NAME].unique()) == sorted(
        ["model.encoder", "model.encoder.0", "model.encoder.0.fc", "model.encoder.0.act", "model.encoder.1",
         "model.encoder.1.fc", "model.encoder.1.act", "model.head"])
    assert len(layers) == 8 * 3
    ids = dict(zip(spans[col.SPAN_ID], spans[col.NAME]))
    step0 = layers[layers[col.STEP] == 0].set_index(col.NAME)
    assert ids[step0.loc["model.encoder.0.fc", col.PARENT_ID]] == "model.encoder.0"
    assert ids[step0.loc["model.encoder", col.PARENT_ID]] == "model"
    assert ids[step0.loc["model.head", col.PARENT_ID]] == "model"
    # the step's spans all share the predict's trace id
    assert (layers.groupby(col.STEP)[col.TRACE_ID].nunique() == 1).all()


def test_layer_attributes():
    model = Net()
    with torch.no_grad():
        trace = trace_of(lambda: model(torch.randn(3, 4)))
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"].set_index(col.NAME)
    fc = layers.loc["model.encoder.0.fc"]
    assert fc[col.MODULE_TYPE] == "Linear"
    assert json.loads(fc[col.INPUT_SHAPES]) == [[3, 4]]
    assert json.loads(fc[col.OUTPUT_SHAPES]) == [[3, 4]]
    assert fc[col.PARAM_COUNT] == 20
    assert fc[col.CALL_DEPTH] == 3
    assert layers.loc["model.encoder", col.PARAM_COUNT] == 40
    assert fc[col.SOURCE].endswith(".py:" + fc[col.SOURCE].rsplit(":", 1)[1])
    assert "linear.py" in fc[col.SOURCE]
    assert layers.loc["model.encoder.0", col.SOURCE].startswith(__file__)
    order = layers.sort_values(col.EXEC_INDEX).index.tolist()
    assert order == ["model.encoder", "model.encoder.0", "model.encoder.0.fc", "model.encoder.0.act",
                     "model.encoder.1", "model.encoder.1.fc", "model.encoder.1.act", "model.head"]
    assert fc[col.PATH] == "model[0]/model.encoder.0.fc[0]"
    predict = trace.spans[trace.spans[col.KIND] == "predict"].iloc[0]
    assert json.loads(predict[col.OUTPUT_SHAPES]) == [[3, 2], [3, 4]]  # tuple output


def test_batch_size_comes_from_keyword_inputs_too():
    model = Net()
    with torch.no_grad():
        trace = trace_of(lambda: model(x=torch.randn(5, 4), scale=2.0))
    predict = trace.spans[trace.spans[col.KIND] == "predict"].iloc[0]
    assert predict[col.BATCH_SIZE] == 5


class TakesUnderscoredKeywords(nn.Module):
    def forward(self, x, _orig=None, _now=None, _id=None, _tensor=None):
        return x + sum(v for v in (_orig, _now, _id, _tensor) if v is not None)


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_every_keyword_argument_reaches_the_model(levels):
    model = nn.Sequential(TakesUnderscoredKeywords())
    inner = model[0]
    with xsp.trace(levels=levels, output=None) as session:
        out = inner(torch.zeros(2), _orig=1, _now=2, _id=3, _tensor=4)
    assert out.tolist() == [10.0, 10.0]
    assert (session.trace.spans[col.KIND] == "predict").sum() == 1


def test_paths_are_stable_across_steps_and_count_repeated_calls():
    shared = nn.Linear(4, 4)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x):
            return self.shared(self.shared(x))

    model = Twice()
    with torch.no_grad():
        trace = trace_of(lambda: [model(torch.randn(1, 4)) for _ in range(2)])
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"]
    per_step = layers.groupby(col.STEP)[col.PATH].apply(sorted).tolist()
    assert per_step[0] == per_step[1] == ["model[0]/model.shared[0]", "model[0]/model.shared[1]"]


def test_user_spans_and_explicit_steps():
    model = Net()

    @xsp.span("postprocess", kind="argmax")
    def postprocess(logits):
        return logits.argmax(-1)

    def work():
        with xsp.span("preprocess", images=2):
            x = torch.randn(2, 4)
        with xsp.step("request"):
            with torch.no_grad():
                logits, _ = model(x)
                model(x)
            postprocess(logits)

    trace = trace_of(work)
    spans = trace.spans.set_index(col.NAME)
    assert spans.loc["preprocess", col.LEVEL] == "model"
    assert pd.isna(spans.loc["preprocess", col.STEP])
    assert json.loads(spans.loc["preprocess", col.ATTRIBUTES]) == {"images": 2}
    session = spans.loc["session"]
    assert spans.loc["preprocess", col.PARENT_ID] == session[col.SPAN_ID]
    assert spans.loc["preprocess", col.TRACE_ID] == session[col.TRACE_ID]
    step = spans.loc["request"]
    assert step[col.KIND] == "step" and step[col.STEP] == 0 and pd.isna(step[col.PARENT_ID])
    predicts = trace.spans[trace.spans[col.KIND] == "predict"]
    assert predicts[col.STEP].tolist() == [0, 0]  # inside an explicit step: no steps of their own
    assert (predicts[col.PARENT_ID] == step[col.SPAN_ID]).all()
    assert predicts[col.PATH].tolist() == ["request[0]/model[0]", "request[0]/model[1]"]
    assert spans.loc["postprocess", col.PARENT_ID] == step[col.SPAN_ID]
    assert json.loads(spans.loc["postprocess", col.ATTRIBUTES]) == {"kind": "argmax"}


def test_span_outside_a_session_records_nothing():
    with xsp.span("alone"):
        pass
    with xsp.trace(output=None) as session:
        pass
    assert session.trace.spans[col.NAME].tolist() == ["session"]


def test_model_level_only_records_no_layers():
    model = Net()
    with torch.no_grad():
        trace = trace_of(lambda: model(torch.randn(1, 4)), levels="model")
    assert set(trace.spans[col.LEVEL]) == {"model"}
    assert (trace.spans[col.KIND] == "predict").sum() == 1


def test_exception_marks_open_spans_as_errors_writes_the_trace_and_reraises(tmp_path):
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("bad input")

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ok = nn.Linear(4, 4)
            self.boom = Boom()

        def forward(self, x):
            return self.boom(self.ok(x))

    output = tmp_path / "failed.xsp.parquet"
    session = xsp.trace(output=output)
    with pytest.raises(RuntimeError, match="bad input"):
        with session:
            with xsp.span("request"):
                Outer()(torch.randn(1, 4))
    spans = xsp.load(output).spans.set_index(col.NAME)
    for name in ("Outer_0.boom", "Outer_0", "request", "session"):
        assert spans.loc[name, col.STATUS] == "error", name
        assert spans.loc[name, col.STATUS_MESSAGE] == "RuntimeError: bad input"
    assert spans.loc["Outer_0.ok", col.STATUS] == "ok"  # a model bound to no name: its class and an index


@pytest.mark.parametrize("concurrent", [True, False])
def test_explicit_steps_of_asyncio_tasks_running_at_once_are_warned_about_once(concurrent):
    """A thread's explicit steps nest: tasks that interleave their xsp.step() blocks on one event
    loop each took the others' model calls, with nothing said."""
    import asyncio

    model = Net()

    async def request():
        with xsp.step("request"):
            with xsp.step("inner"):  # nested in its own task: no warning
                model(torch.randn(1, 4))
            await asyncio.sleep(0)
            model(torch.randn(1, 4))

    async def serve():
        if concurrent:
            await asyncio.gather(*(request() for _ in range(4)))
        else:
            for _ in range(4):
                await request()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), xsp.trace(output=None):
            asyncio.run(serve())
    messages = [str(w.message) for w in caught if issubclass(w.category, xsp.XspWarning)]
    overlapped = [message for message in messages if "asyncio tasks that run at once" in message]
    assert len(overlapped) == (1 if concurrent else 0), messages


def test_training_step_records_backward_spans():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for _ in range(2):
            with xsp.step("train"):
                logits, _ = model(torch.randn(4, 4))
                loss = logits.sum()
                loss.backward()
                with xsp.span("optimizer"):
                    optimizer.step()
                optimizer.zero_grad()

    trace = trace_of(train)
    spans = trace.spans
    backward = spans[spans[col.KIND] == "backward"]
    assert set(backward[col.NAME]) >= {"model.head.backward", "model.encoder.0.fc.backward", "model.backward"}
    assert set(backward[col.STEP]) == {0, 1}
    forward_end = spans[(spans[col.KIND] == "predict")].groupby(col.STEP)[col.END_NS].max()
    assert (backward[col.START_NS].to_numpy() >= backward[col.STEP].map(forward_end).to_numpy()).all()
    ids = dict(zip(spans[col.SPAN_ID], spans[col.NAME]))
    fc0 = backward[(backward[col.NAME] == "model.encoder.0.fc.backward") & (backward[col.STEP] == 0)].iloc[0]
    assert ids[fc0[col.PARENT_ID]] in {"model.encoder.0.backward", "model.encoder.backward"}


@pytest.mark.parametrize("wrapper", ["c", "python"])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_a_linear_on_a_3d_input_has_its_matrix_multiply_in_its_backward(monkeypatch, wrapper, input_needs_grad):
    """As in every transformer: the Linear's output node is the view back to 3-D, and its backward
    span (that node alone) held 0.1% of a backward whose matrix multiply, run after that node,
    took 50% of the step; the multiply's time showed as its parents' own."""
    from xsp.record import hotpath

    if wrapper == "python":
        monkeypatch.setattr(hotpath, "HOTPATH", None)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x) if input_needs_grad else x)

    model = Block()

    def train() -> None:
        for _ in range(2):
            model(torch.randn(4, 8, 16)).sum().backward()

    spans = trace_of(train, levels="model,layer,operator").spans
    fc = spans[spans[col.NAME] == "model.fc.backward"]
    multiplies = spans[spans[col.NAME].isin(["AddmmBackward0", "MmBackward0"])
                       | spans[col.NAME].str.contains("evaluate_function: (?:Addmm|Mm)Backward0", regex=True)]
    assert len(fc) == 2 and len(multiplies) >= 2
    for _, multiply in multiplies.iterrows():
        inside = fc[(fc[col.START_NS] <= multiply[col.START_NS]) & (multiply[col.END_NS] <= fc[col.END_NS])]
        assert len(inside) == 1, multiply[col.NAME]


class TwentyMatmuls(nn.Module):
    """A leaf module whose own part of the graph is larger than xsp searches at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(20, 16, 16) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(20):
            x = torch.tanh(x @ self.weight[i])
        return x


@pytest.mark.parametrize("wrapper", ["c", "python"])
@pytest.mark.parametrize("leaf", ["gru", "twenty_matmuls"])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_a_leaf_with_hundreds_of_graph_nodes_has_its_whole_backward(monkeypatch, wrapper, leaf, input_needs_grad):
    """An nn.GRU on CPU makes ~180 graph nodes a call: its backward span was its output's node
    alone (0.01 ms), and the rest (4 ms) counted as its parent's own time."""
    from xsp.record import hotpath

    if wrapper == "python":
        monkeypatch.setattr(hotpath, "HOTPATH", None)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(16, 16)
            self.body = nn.GRU(16, 16, batch_first=True) if leaf == "gru" else TwentyMatmuls()
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.body(self.pre(x) if input_needs_grad else x)
            return self.head((out[0] if leaf == "gru" else out)[:, -1])

    model = Net()

    def train() -> None:
        for _ in range(2):
            model(torch.randn(4, 8, 16)).sum().backward()

    spans = trace_of(train, levels="model,layer,operator").spans
    body = spans[spans[col.NAME] == "model.body.backward"]
    assert len(body) == 2
    assert all(json.loads(a) == {col.ATTR_BACKWARD_END: col.BackwardEnd.NEXT_BACKWARD.value}
               for a in body[col.ATTRIBUTES])
    operators = spans[spans[col.LEVEL] == "operator"]
    for _, span in body.iterrows():
        own = operators[operators[col.PARENT_ID] == span[col.SPAN_ID]]
        assert len(own) >= 40, len(own)  # the graph's nodes, not its output's alone
        model_backward = spans[(spans[col.NAME] == "model.backward") & (spans[col.STEP] == span[col.STEP])].iloc[0]
        parents_own = operators[operators[col.PARENT_ID] == model_backward[col.SPAN_ID]]
        assert len(parents_own) < 10, parents_own[col.NAME].tolist()
        passes = spans[(spans[col.NAME] == "backward") & (spans[col.STEP] == span[col.STEP])]
        assert span[col.END_NS] <= passes[col.END_NS].max()
        if input_needs_grad:  # it ends where the layer before it begins its backward
            pre = spans[(spans[col.NAME] == "model.pre.backward") & (spans[col.STEP] == span[col.STEP])].iloc[0]
            assert span[col.END_NS] <= pre[col.START_NS]


def test_a_layer_sharing_another_layers_graph_node_is_not_marked_as_ending_at_the_next_backward():
    """An nn.Identity (its output is the layer before's) and the Sequential around them share one
    node: their backward is an alias of that layer's, which ended on its own node."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity())

    def train() -> None:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()

    spans = trace_of(train).spans
    backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == "backward")]
    assert {"model.backward", "model.0.backward", "model.1.backward"} <= set(backward[col.NAME])
    assert backward[col.ATTRIBUTES].isna().all(), backward[[col.NAME, col.ATTRIBUTES]]


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_models_backward_lasts_as_long_as_its_graphs(how):
    """Its submodules run inside its compiled graph and have no backward of their own, so its
    backward, stretched over theirs, was 0 ns in every step."""
    torch._dynamo.reset()

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.act(self.fc1(x)))

    model = MLP()
    if how == "model.compile()":
        model.compile(backend="aot_eager")
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager")

    def train() -> None:
        for _ in range(3):
            compiled(torch.randn(4, 8)).sum().backward()

    spans = trace_of(train, levels="model,layer").spans
    torch._dynamo.reset()
    backward = spans[(spans[col.KIND] == "backward") & (spans[col.CALL_DEPTH] == 0)]
    assert len(backward) == 3 and (backward[col.DURATION_NS] > 0).all(), backward[[col.NAME, col.DURATION_NS]]


def test_inference_under_no_grad_installs_no_backward_hooks():
    from torch.nn.modules import module as torch_module

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(bool(torch_module._global_backward_hooks))
            return x

    with xsp.trace(output=None), torch.no_grad():
        Probe()(torch.randn(1))
    assert seen == [False]


def test_four_threads_running_models_at_once_keep_their_spans_apart():
    models = [Net() for _ in range(4)]
    barrier = threading.Barrier(4)
    thread_ids = {}

    def worker(i):
        barrier.wait()
        thread_ids[i] = threading.get_native_id()
        with torch.no_grad():
            for _ in range(5):
                models[i](torch.randn(i + 1, 4))

    def run_threads():
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    trace = trace_of(run_threads)
    spans = trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 20 and sorted(predicts[col.STEP]) == list(range(20))
    layers = spans[spans[col.LEVEL] == "layer"]
    assert len(layers) == 20 * 8
    by_id = spans.set_index(col.SPAN_ID)
    parent_threads = by_id.loc[layers[col.PARENT_ID].astype("int64"), col.THREAD_ID].to_numpy()
    assert (parent_threads == layers[col.THREAD_ID].to_numpy()).all()
    for i, native in thread_ids.items():
        mine = predicts[predicts[col.THREAD_ID] == native]
        assert len(mine) == 5 and set(mine[col.BATCH_SIZE]) == {i + 1}
        steps = set(mine[col.STEP])
        assert set(layers[layers[col.THREAD_ID] == native][col.STEP]) == steps
    assert trace.metadata["dropped"] == {}


def _binding_globals_at_every_step_of_naming(bound: dict[str, object]):
    """A tracer that, at every bytecode xsp runs while scanning for a model's name, binds a new
    name in ``bound``: what another thread's module-level loop does at a thread switch there."""
    from tracers.module_calls import model_names

    added = iter(range(10**6))

    def at_opcode(frame, event, arg):
        if event == "opcode":
            bound[f"_bound_meanwhile_{next(added)}"] = None
        return at_opcode

    def at_call(frame, event, arg):
        if frame.f_code.co_filename == model_names.__file__ and frame.f_code.co_name == "<listcomp>":
            frame.f_trace_opcodes = True
            return at_opcode
        return None

    return at_call


def test_a_model_is_named_while_another_thread_binds_new_globals(monkeypatch):
    """A script whose main loop runs at module level binds globals (``i``, ``y``) while a worker
    thread calls its model for the first time: naming it scans those globals. It raised
    'dictionary changed size during iteration' in the worker's call (CI saw the worker's model
    vanish from the trace)."""
    import sys

    bound = globals()
    before = set(bound)
    model = Net().eval()
    sys.settrace(_binding_globals_at_every_step_of_naming(bound))
    try:
        with xsp.trace(output=None) as session, torch.no_grad():
            model(torch.randn(2, 4))
    finally:
        sys.settrace(None)
        for name in set(bound) - before:
            del bound[name]
    assert set(session.trace.spans[col.NAME]) >= {"model", "model.head"}


def test_nested_trace_is_a_span_of_the_outer_session_and_has_a_trace_of_its_own():
    model = Net()
    with pytest.warns(xsp.XspWarning, match="already active"):
        with xsp.trace(output=None) as outer:
            with xsp.trace(output=None) as inner, torch.no_grad():
                model(torch.randn(1, 4))
    assert "xsp.trace" in set(outer.trace.spans[col.NAME])
    assert inner.trace is not None and (inner.trace.spans[col.KIND] == "predict").sum() == 1
    assert (outer.trace.spans[col.KIND] == "predict").sum() == 1


def test_decorator_profiles_each_call(tmp_path):
    model = Net()
    output = tmp_path / "deco.xsp.parquet"

    @xsp.trace(levels="model", output=output)
    def infer(n):
        with torch.no_grad():
            return [model(torch.randn(1, 4)) for _ in range(n)]

    infer(2)
    assert len(xsp.load(output).steps) == 2
    infer(3)
    assert len(xsp.load(output).steps) == 3


def test_levels_without_a_tracer_are_warned_about_once(monkeypatch):
    monkeypatch.setattr("xsp.tracers.cuda.source.SOURCE.available", lambda: "no CUDA driver: test")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with xsp.trace(levels="model,kernel", output=None) as session:
            pass
    messages = [str(w.message) for w in caught if issubclass(w.category, xsp.XspWarning)]
    assert messages == ["xsp: levels cuda_api, kernel are not recorded: no CUDA driver: test"]
    assert session.trace.metadata["unavailable"] == {"cuda_api": "no CUDA driver: test",
                                                     "kernel": "no CUDA driver: test"}


def test_unknown_level_is_an_error_before_anything_runs():
    with pytest.raises(xsp.UnknownLevelError):
        xsp.trace(levels="model,layers")


def test_records_past_the_limit_are_dropped_and_counted():
    model = nn.Sequential(*[nn.Identity() for _ in range(10)])
    with pytest.warns(xsp.XspWarning, match="dropped"):
        with xsp.trace(output=None, max_events=15) as session, torch.no_grad():
            for _ in range(3):
                model(torch.randn(1))
    assert session.trace.metadata["dropped"]["module_calls"] == 3 * 11 - 15


def test_another_tool_replacing_module_call_is_warned_about_and_left_alone():
    model = Net()
    original = nn.Module.__call__
    with pytest.warns(xsp.XspWarning, match="replaced by other code"):
        with xsp.trace(output=None) as session, torch.no_grad():
            model(torch.randn(1, 4))
            wrapped = nn.Module.__call__

            def other_tool(self, *args, **kwargs):
                return wrapped(self, *args, **kwargs)

            nn.Module.__call__ = other_tool
    try:
        assert nn.Module.__call__ is other_tool
        assert len(session.trace.steps) == 1
    finally:
        nn.Module.__call__ = original


def test_recorded_calls_hold_no_object_the_garbage_collector_must_walk(monkeypatch):
    """Each record of the Python wrapper is a tuple of scalars (module and shapes interned), which
    the GC stops tracking at its first pass: a long run's records never reach the older
    generations. (The C wrapper packs its records as native ints: no objects at all.)"""
    import gc

    from xsp.record import hotpath

    monkeypatch.setattr(hotpath, "HOTPATH", None)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    with torch.no_grad(), xsp.trace(output=None):
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
        buffer = xsp.core.state.recording.buffer()
        records = list(buffer.calls)
        gc.collect(0)
        assert records and all(isinstance(value, (int, str, type(None))) for record in records for value in record)
        assert not any(gc.is_tracked(record) for record in records)


def test_xsps_warnings_point_at_the_users_line(monkeypatch):
    monkeypatch.setattr("xsp.tracers.cuda.source.SOURCE.available", lambda: "no CUDA driver: test")
    model = torch.nn.Linear(4, 2)
    with pytest.warns(xsp.XspWarning) as said:
        with xsp.trace(levels="model,kernel", output=None):  # warned as the block starts
            model(torch.randn(2, 4))
    assert [Path(w.filename).name for w in said] == [Path(__file__).name] * len(said)


def test_a_warning_from_one_of_xsps_threads_names_no_line_of_pythons_threading_module():
    from xsp.core.errors import NO_LINE_OF_YOURS, warn

    with pytest.warns(xsp.XspWarning) as said:
        thread = threading.Thread(target=warn, args=(xsp.XspWarning("xsp: said on a thread of xsp's"),))
        thread.start()
        thread.join()
        warn(xsp.XspWarning("xsp: said on the program's thread"))
    assert [(w.filename, w.lineno) for w in said][0] == NO_LINE_OF_YOURS
    assert Path(said[1].filename).name == Path(__file__).name


def test_the_options_the_api_and_the_cli_share_are_checked_once_and_defined_once(tmp_path, capsys):
    from xsp.cli.main import build_parser, main

    with pytest.raises(ValueError, match="span_budget must be 0 .no limit. or more, not -1"):
        xsp.trace(span_budget=-1, output=None)
    with pytest.raises(ValueError, match="layer_depth must be 1 or more"):
        xsp.trace(layer_depth=0, output=None)
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    assert main(["run", "--span-budget", "-5", "--", str(script)]) == 2
    assert main(["push", str(tmp_path / "none.xsp.parquet"), "--span-budget", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("xsp: error: --span-budget must be 0 (no limit) or more, not -5") == 2 and "ran" not in err
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse's own tree)
    for flag in ("--otlp-protocol", "--service-name", "--span-budget"):
        run_action, push_action = (next(action for action in commands[name]._actions  # noqa: SLF001
                                        if flag in action.option_strings) for name in ("run", "push"))
        assert run_action.choices == push_action.choices and run_action.type == push_action.type, flag
    for flag in ("--levels", "--skip-steps"):  # how summary and diff select a trace's steps
        summary_action, diff_action = (next(action for action in commands[name]._actions  # noqa: SLF001
                                            if flag in action.option_strings) for name in ("summary", "diff"))
        assert summary_action.type == diff_action.type and summary_action.default == diff_action.default, flag
    assert main(["summary", str(tmp_path / "none.xsp.parquet"), "--skip-steps", "-1"]) == 2
    assert "xsp: error: --skip-steps must not be negative" in capsys.readouterr().err


def test_a_sessions_options_are_one_frozen_object_made_once(tmp_path):
    import dataclasses

    from xsp.core.schema import Level
    from xsp.session.options import TraceOptions
    from xsp.session.session import Session, active_session

    session = xsp.trace(levels="model", output=tmp_path / "a.xsp.parquet", schedule="wait=1,active=1", layer_depth=2)
    options = session.options
    assert options.levels[0] is Level.MODEL and Level.LAYER not in options.levels
    assert options.output == (tmp_path / "a.xsp.parquet").absolute()
    assert options.layer_depth == 2 and options.schedule is not None and options.schedule.wait == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.layer_depth = 3  # type: ignore[misc]
    # given whole, they are used as they are: a decorated function's sessions share them
    assert Session(options=options).options is options
    calls = []

    @Session(options=dataclasses.replace(options, output=None, schedule=None))
    def work() -> None:
        active = active_session()
        assert active is not None
        calls.append(active.options)

    work()
    work()
    assert calls[0] is calls[1] and calls[0].output is None and calls[0].levels == options.levels
    with pytest.raises(ValueError, match="span_budget must be 0"):
        TraceOptions.parse(span_budget=-1)


def test_compiled_models_and_submodules_are_named_and_typed_as_the_models_own():
    """A compiled model's type read `OptimizedModule (torch._dynamo.eval_frame)`, a compiled
    submodule's call of the model inside it was a layer (`model.body._orig_mod`), and an exported
    program's input check (`_guards_fn`) too."""
    torch._dynamo.reset()

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.compile(Body(), backend="eager")
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    model, whole = Net(), torch.compile(nn.Sequential(nn.Linear(8, 8)), backend="eager")

    def infer() -> None:
        with torch.no_grad():
            for _ in range(2):
                model(torch.randn(2, 8))
                whole(torch.randn(2, 8))

    spans = trace_of(infer, levels="model,layer").spans
    torch._dynamo.reset()
    names = set(spans[col.NAME].astype(str))
    assert not any("_orig_mod" in name for name in names), names
    assert "model.body" in names
    types = dict(zip(spans[col.NAME].astype(str), spans[col.MODULE_TYPE].astype(str)))
    assert types["model.body"] == "Body" and types["whole"] == "Sequential", types


def test_a_module_its_model_does_not_name_is_named_below_the_layer_that_called_it():
    """transformers 5 keeps an attention kernel in a dict of each attention layer: every layer's
    call of it was `model.<Func>`, pooled into one row across the layers (and nested in itself)."""

    class Func(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.kernels = {"scale": Func()}  # not a submodule: no path of its own

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.kernels["scale"](self.proj(x))

    model = nn.Sequential(Attention(), Attention())

    def infer() -> None:
        with torch.no_grad():
            model(torch.randn(2, 4))

    names = set(trace_of(infer, levels="model,layer").spans[col.NAME].astype(str))
    assert {"model.0.<Func>", "model.1.<Func>"} <= names, names
    assert "model.<Func>" not in names
