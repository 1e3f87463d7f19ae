"""Ordinary PyTorch loops, unchanged, under xsp.trace(): names, steps, and what xsp leaves alone."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import xsp
from xsp import analysis
from xsp.core import schema as col
from xsp.core.schema import SpanKind
from xsp.record import hotpath


def traced(fn, levels="model,layer"):
    with xsp.trace(levels=levels, output=None) as session:
        fn()
    return session.trace


def model_calls(trace):
    spans = trace.spans
    return spans[spans[col.KIND] == SpanKind.PREDICT.value]


# -- names ------------------------------------------------------------------------------
encoder_global = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


class Pipeline:
    """Not a module: holds its models as attributes and calls them."""

    def __init__(self) -> None:
        self.encoder = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Sequential(nn.Linear(4, 2))

    def __call__(self, x):
        return self.head(self.encoder(x))


def test_models_are_named_by_the_variables_attributes_and_globals_that_hold_them():
    local_head = nn.Sequential(nn.Linear(4, 2))
    pipeline = Pipeline()

    def work():
        with torch.no_grad():
            local_head(encoder_global(torch.randn(1, 4)))
            pipeline(torch.randn(1, 4))

    calls = model_calls(traced(work))
    assert calls[col.NAME].tolist() == ["encoder_global", "local_head", "encoder", "head"]


FRAMEWORK = """
class Strategy:
    def __init__(self, module):
        self._lightning_module = module

    def training_step(self, x):
        return self._lightning_module(x)


def loop(strategy, x):
    pl_module = strategy._lightning_module
    return strategy.training_step(x)
"""


def test_a_model_a_framework_calls_by_its_private_attribute_is_named_by_the_users_own_code(tmp_path, monkeypatch):
    """Lightning's strategy calls the user's module as ``self._lightning_module``, frames below
    the user's ``trainer.fit(model)``: the user's name, found further up, names it; without one,
    the framework's public name (``pl_module``), else the private one."""
    import importlib.util

    from xsp.tracers.module_calls import model_names

    (tmp_path / "framework.py").write_text(FRAMEWORK)
    monkeypatch.setattr(model_names, "_INSTALLED", (str(tmp_path) + "/",))  # as an installed package
    spec = importlib.util.spec_from_file_location("framework", tmp_path / "framework.py")
    assert spec is not None and spec.loader is not None
    framework = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(framework)
    my_model = nn.Sequential(nn.Linear(4, 4))
    unnamed = [nn.Sequential(nn.Linear(4, 4))]  # bound to no name of the user's
    with torch.no_grad():
        calls = model_calls(traced(lambda: (framework.loop(framework.Strategy(my_model), torch.randn(1, 4)),
                                            framework.loop(framework.Strategy(unnamed[0]), torch.randn(1, 4)))))
    assert calls[col.NAME].tolist() == ["my_model", "pl_module"]


class Holder:
    """Holds a model as an attribute; not a module, not callable."""

    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(4, 4))


def test_a_model_called_through_an_attribute_is_named_by_it():
    """``net.backbone(x)`` was named ``Sequential_0``: a class and an index, where the README
    promises the attribute the code calls it through."""
    net = Pipeline()
    holder = Holder()

    def work():
        with torch.no_grad():
            net.encoder(torch.randn(1, 4))
            holder.model(torch.randn(1, 4))

    assert model_calls(traced(work))[col.NAME].tolist() == ["net.encoder", "holder.model"]


def test_two_sequentials_never_share_layer_names_or_paths():
    models = [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))]

    def work():
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(1, 4)
                for model in models:  # bound to the same loop variable: one keeps it
                    x = model(x)

    trace = traced(work)
    assert model_calls(trace)[col.NAME].tolist()[:2] == ["model", "Sequential_0"]
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"]
    assert sorted(layers[col.NAME].unique()) == ["Sequential_0.0", "model.0"]
    assert sorted(layers[col.PATH].unique()) == ["inference_step[0]/Sequential_0[0]/Sequential_0.0[0]",
                                                 "inference_step[0]/model[0]/model.0[0]"]
    assert len(trace.steps) == 2  # the first model called leads; the other joins its step


def test_a_model_bound_to_no_name_is_its_class_with_an_index():
    def work():
        with torch.no_grad():
            nn.Sequential(nn.Identity())(torch.randn(1))
            nn.Sequential(nn.Identity())(torch.randn(1))

    assert model_calls(traced(work))[col.NAME].tolist() == ["Sequential_0", "Sequential_1"]


def test_a_model_called_by_a_thread_pool_or_a_thread_is_not_named_by_pythons_own_code():
    """A pool's worker holds the model as ``fn``, a thread as ``_target``: not names of the user's."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pooled, threaded = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

    def work():
        with torch.no_grad(), ThreadPoolExecutor(1) as pool:
            pool.submit(pooled, torch.randn(1, 4)).result()
            thread = threading.Thread(target=threaded, args=(torch.randn(1, 4),))
            thread.start()
            thread.join()

    assert sorted(model_calls(traced(work))[col.NAME].tolist()) == ["Sequential_0", "Sequential_1"]


# -- a training loop --------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture(scope="module")
def training():
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(48, 8), torch.randint(0, 3, (48,))), batch_size=8)
    model, criterion = Net(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()  # after the optimizer: the next step's

    return traced(train)


def test_a_training_loop_is_one_step_per_optimizer_step(training):
    spans = training.spans
    steps = spans[spans[col.KIND] == SpanKind.STEP.value]
    assert steps[col.NAME].tolist() == ["train_step"] * 6
    assert json.loads(steps[col.ATTRIBUTES].iloc[0]) == {"xsp.step.type": "train"}
    starts, ends = steps[col.START_NS].to_numpy(), steps[col.END_NS].to_numpy()
    assert (starts[1:] == ends[:-1]).all()  # iterations follow each other with nothing between
    kinds = spans[spans[col.LEVEL].isin(["model", "input"])].groupby(col.STEP)[col.KIND].apply(
        lambda k: sorted(k.unique()))
    assert all(found == ["backward", "input", "optimizer", "predict", "step"] for found in kinds)
    optimizer = spans[spans[col.KIND] == SpanKind.OPTIMIZER.value]
    assert optimizer[col.NAME].unique().tolist() == ["SGD.step"]
    assert (optimizer[col.END_NS].to_numpy() == ends).all()
    waits = spans[spans[col.KIND] == SpanKind.INPUT.value]
    assert set(waits[col.NAME]) == {"DataLoader.__iter__", "DataLoader.__next__"}
    assert json.loads(waits[col.ATTRIBUTES].iloc[-1]) == {  # a single-process loader has no prefetch factor
        col.ATTR_INPUT_WORKERS: 0, col.ATTR_INPUT_PIN_MEMORY: False, col.ATTR_INPUT_PERSISTENT_WORKERS: False,
        col.ATTR_INPUT_PREFETCH_FACTOR: None}
    assert waits[col.STEP].isna().sum() == 1  # the epoch's last next(), which raised StopIteration
    assert set(waits[col.LEVEL]) == {"input"}


def test_input_waits_are_the_input_level_and_each_steps_wait_is_in_its_latency(training):
    waits = analysis.input_waits(training)
    spans = training.spans
    assert len(waits) == (spans[col.KIND] == SpanKind.INPUT.value).sum()
    assert (waits["num_workers"] == 0).all() and (~waits["pin_memory"]).all()
    assert (waits["copies"] == 0).all()  # on the CPU no batch is copied
    latency = analysis.model_latency(training)
    per_step = waits.dropna(subset=["step"]).groupby("step")["wait_ms"].sum()
    assert np.allclose(latency.set_index("step")["input_ms"].loc[per_step.index], per_step)
    assert (latency["input_ms"] > 0).all() and (latency["input_ms"] < latency["latency_ms"]).all()
    assert np.allclose(analysis.input_per_step(training).set_index("step")["input_ms"], per_step)


def test_backward_layer_spans_sit_in_their_steps_tree(training):
    spans = training.spans
    backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == "backward")]
    assert set(backward[col.NAME]) == {"model.backward", "model.body.backward", "model.body.0.backward",
                                       "model.body.1.backward", "model.body.2.backward", "model.body.3.backward",
                                       "model.head.backward", "criterion.backward"}
    parents = dict(zip(spans[col.SPAN_ID], spans[col.PARENT_ID]))
    kinds = dict(zip(spans[col.SPAN_ID], spans[col.KIND]))
    for span_id in backward[col.SPAN_ID]:
        chain = []
        while not pd.isna(span_id):
            chain.append(kinds[span_id])
            span_id = parents[span_id]
        assert chain[-1] == "step" and "backward" in chain[1:]  # under the model-level backward pass
    assert training.metadata["hierarchy"]["overlapping"] == 0
    assert training.metadata["dropped"] == {}


class _Wrapper(nn.Module):
    """Returns what the module it wraps returns, as DistributedDataParallel does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@dataclasses.dataclass
class HeadOutput:
    logits: torch.Tensor


class PackedAndDataclass(nn.Module):
    """An LSTM on packed sequences (its output: a PackedSequence and its states) and a head
    returning a dataclass: one level into a container finds no tensor in either."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = Head()

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return self.head(hidden[-1]).logits


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 2)

    def forward(self, x):
        return HeadOutput(self.fc(x))


def test_a_packed_sequence_or_a_dataclass_output_has_its_backward_span():
    torch.manual_seed(0)
    net = PackedAndDataclass()

    def train():
        net(torch.randn(3, 5, 4), torch.tensor([5, 3, 2])).sum().backward()

    spans = traced(train).spans
    backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == SpanKind.BACKWARD.value)]
    names = set(backward[col.NAME])
    assert {"net.lstm.backward", "net.head.backward", "net.head.fc.backward"} <= names
    head, fc = (backward[backward[col.NAME] == name].iloc[0] for name in ("net.head.backward", "net.head.fc.backward"))
    assert fc[col.PARENT_ID] == head[col.SPAN_ID]  # the head's backward holds its layer's, not the model's


def _step_roots(trace):
    spans = trace.spans
    return spans[spans[col.PARENT_ID].isna() & spans[col.STEP].notna()].sort_values(col.START_NS)


@pytest.mark.parametrize("wrapper", ["c", "python"])
@pytest.mark.parametrize("loop", ["siamese", "cell_over_time", "siamese_with_a_loader"])
def test_a_model_called_several_times_before_its_first_backward_is_one_training_step(monkeypatch, wrapper, loop):
    """Its first iteration's first calls were steps of their own (5 steps for 4 iterations):
    they cannot be told from an evaluation with autograd on until the backward reaches them."""
    if wrapper == "python":
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cell = nn.LSTMCell(8, 4)
    optimizer = torch.optim.SGD([*encoder.parameters(), *cell.parameters()], lr=0.01)
    batches = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)

    def train():
        for (x,) in (batches if loop == "siamese_with_a_loader" else [(torch.randn(4, 8),)] * 4):
            if loop == "cell_over_time":
                h = c = torch.zeros(4, 4)
                for _ in range(5):
                    h, c = cell(x, (h, c))
                loss = h.pow(2).mean()
            else:
                loss = -nn.functional.cosine_similarity(encoder(x + 0.1), encoder(x - 0.1)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():  # evaluation after training: steps of their own
            encoder(torch.randn(4, 8))
            encoder(torch.randn(4, 8))

    roots = _step_roots(traced(train))
    kinds = [name for name in roots[col.NAME]]
    assert kinds == ["train_step"] * 4 + ["encoder"] * 2, kinds


def test_an_evaluation_with_autograd_on_before_training_keeps_its_steps():
    """Calls whose backward never ran stay steps of their own."""
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train():
        for _ in range(3):
            model(torch.randn(4, 8))  # no torch.no_grad(): autograd records a graph nobody uses
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()

    roots = _step_roots(traced(train))
    assert roots[col.NAME].tolist() == ["model"] * 3 + ["train_step"] * 2


class ReusesASubmodule(nn.Module):
    """Calls ``block.fc`` again itself, after ``block``'s own call (weights shared across depths)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential()
        self.block.fc, self.block.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.block.fc(torch.relu(self.block(x))))


class Recursive(nn.Module):
    """Calls itself on its own output (a tree or a recurrence written as recursion)."""

    def __init__(self, depth: int, recurse_first: bool) -> None:
        super().__init__()
        self.fc, self.depth, self.recurse_first = nn.Linear(8, 8), depth, recurse_first

    def forward(self, x, level=0):
        if self.recurse_first:  # its own layer after the calls it made
            return torch.relu(self.fc(self(x, level + 1) if level < self.depth else x))
        y = torch.relu(self.fc(x))
        return self(y, level + 1) + y if level < self.depth else y


def _parent_names(rows, spans):
    names = dict(zip(spans[col.SPAN_ID], spans[col.NAME]))
    return [names.get(parent) for parent in rows[col.PARENT_ID]]


def test_a_submodule_called_again_outside_its_parent_is_not_in_the_parents_backward():
    model = ReusesASubmodule()

    def train():
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()

    spans = traced(train).spans
    for _, step in spans[spans[col.LEVEL] == "layer"].groupby(col.STEP):
        backward = step[step[col.KIND] == SpanKind.BACKWARD.value].sort_values(col.START_NS)
        fc = backward[backward[col.NAME] == "model.block.fc.backward"]
        block = backward[backward[col.NAME] == "model.block.backward"].iloc[0]
        # the second call's backward runs first: it is the model's, the first call's the block's
        assert _parent_names(fc, step) == ["model.backward", "model.block.backward"]
        assert block[col.START_NS] >= fc.iloc[0][col.END_NS]


@pytest.mark.parametrize("recurse_first", [True, False])
def test_a_recursive_modules_backward_nests_as_its_calls_do(recurse_first):
    model = Recursive(depth=2, recurse_first=recurse_first)

    def train():
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()

    spans = traced(train).spans
    for _, step in spans[spans[col.LEVEL] == "layer"].groupby(col.STEP):
        backward = step[step[col.KIND] == SpanKind.BACKWARD.value]
        calls = backward[backward[col.NAME] == "model.backward"].sort_values(col.START_NS)
        assert len(calls) == 3
        outer, middle, inner = (calls.iloc[i] for i in range(3))
        assert middle[col.PARENT_ID] == outer[col.SPAN_ID] and inner[col.PARENT_ID] == middle[col.SPAN_ID]
        fc = backward[backward[col.NAME] == "model.fc.backward"]
        # each call's own layer: one under each call's backward
        assert sorted(fc[col.PARENT_ID].tolist()) == sorted(calls[col.SPAN_ID].tolist())


def test_a_wrapper_and_the_module_it_wraps_have_their_backward_nested_not_ambiguous():
    model = _Wrapper(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    with xsp.trace(levels=("model", "layer"), output=None) as session:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    spans = session.trace.spans
    backward = spans[(spans[col.LEVEL] == "layer") & (spans[col.KIND] == "backward")]
    outer = backward[backward[col.NAME] == "model.backward"]
    inner = backward[backward[col.NAME] == "model.module.backward"]
    assert len(outer) == len(inner) == 3
    # one output, one graph node: the same interval; the forward's depth says which is outside
    assert (outer[col.START_NS].to_numpy() == inner[col.START_NS].to_numpy()).all()
    assert outer[col.CALL_DEPTH].tolist() == [0] * 3 and inner[col.CALL_DEPTH].tolist() == [1] * 3
    assert inner[col.PARENT_ID].tolist() == outer[col.SPAN_ID].tolist()
    assert session.trace.metadata["hierarchy"]["ambiguous"] == 0


def test_shares_of_a_training_step_add_up_and_none_exceeds_the_whole(training):
    breakdown = analysis.step_breakdown(training)
    parts = breakdown[["forward_ms", "backward_ms", "optimizer_ms", "input_ms", "compile_ms", "other_ms"]]
    assert np.allclose(parts.sum(axis=1), breakdown["latency_ms"])
    assert (breakdown[["forward_ms", "backward_ms", "optimizer_ms", "input_ms"]] > 0).all().all()
    for table in (analysis.top_layers(training, k=50), analysis.layer_type_summary(training)):
        assert table["share"].sum() <= 1.0
    # a module's forward and backward spans are one module of its type
    types = analysis.layer_type_summary(training).set_index("module_type")
    layers = analysis.layer_table(training)
    linear = layers[(layers["module_type"] == "Linear") & (layers["kind"] == "forward")]
    assert (layers[layers["module_type"] == "Linear"]["kind"] == "backward").any()
    assert types.loc["Linear", "layers"] == linear["name"].nunique()
    coverage = analysis.step_coverage(training).iloc[0]
    assert 0 < coverage["coverage"] < 1 and coverage["steps"] == 6


def test_user_spans_have_their_time_and_share():
    model = Net()

    def work():
        for _ in range(3):
            with xsp.span("preprocess"):
                x = torch.randn(2, 8)
            with torch.no_grad():
                model(x)

    table = analysis.user_spans(traced(work))
    row = table.set_index("name").loc["preprocess"]
    assert row["count"] == 3 and row["in_steps"] == 0 and 0 < row["share"] < 1


def test_user_spans_overlapping_on_threads_cover_the_session_once():
    """Ten all-reduces on two threads, each thread's calls back to back: their total is twice
    the session they ran in, their share of it never more than all of it."""
    from xsp.table.build import conform

    rows = [{col.SPAN_ID: 1, col.LEVEL: "model", col.KIND: SpanKind.SESSION.value, col.NAME: "session",
             col.START_NS: 0, col.END_NS: 1_000, col.DURATION_NS: 1_000, col.THREAD_ID: 1}]
    for thread in (1, 2):
        for call in range(5):
            start = 100 + call * 160
            rows.append({col.SPAN_ID: len(rows) + 1, col.PARENT_ID: 1, col.LEVEL: "model",
                         col.KIND: SpanKind.USER.value, col.NAME: "all_reduce", col.START_NS: start,
                         col.END_NS: start + 160, col.DURATION_NS: 160, col.THREAD_ID: thread})
    table = analysis.user_spans(conform(pd.DataFrame(rows)))
    row = table.set_index("name").loc["all_reduce"]
    assert row["count"] == 10 and row["threads"] == 2
    assert row["total_ms"] == pytest.approx(1_600e-6) and row["share"] == pytest.approx(0.8)


# -- what xsp leaves alone --------------------------------------------------------------
def kinds_of(script_module) -> list[str]:
    return [node.kind() for node in script_module.inlined_graph.nodes()]


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_jit_tracing_sees_no_xsp_and_traced_models_are_still_recorded():
    model = Net()
    x = torch.randn(2, 8)
    plain_kinds = kinds_of(torch.jit.trace(model, x))
    with xsp.trace(output=None) as session:
        traced_model = torch.jit.trace(model, x)  # autograd on, check_trace on: the tutorial form
        with torch.no_grad():
            frozen = torch.jit.trace(Net(), x)
            frozen(x)
        traced_model(x)
    assert kinds_of(traced_model) == plain_kinds
    calls = model_calls(session.trace)
    assert calls[col.NAME].tolist() == ["frozen", "traced_model"]  # tracing itself is no step
    assert set(calls[col.MODULE_TYPE]) == {"Net"}


def test_no_global_hooks_even_while_autograd_records():
    from torch.nn.modules import module as torch_module

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(bool(torch_module._has_any_global_hook()))
            return x * 2

    with xsp.trace(output=None):
        Probe()(torch.randn(2, requires_grad=True)).sum().backward()
    assert seen == [False]


def test_a_hugging_face_model_trains_without_new_warnings():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64)
    model = transformers.BertForSequenceClassification(config)
    inputs = {"input_ids": torch.randint(0, 100, (2, 8)), "labels": torch.tensor([0, 1])}

    def step():
        model(**inputs).loss.backward()

    def caught(fn):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fn()
        return sorted({(w.category.__name__, str(w.message)) for w in seen})

    plain = caught(step)
    assert caught(lambda: traced(step)) == plain


class BranchyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:  # a graph break of the model's own
            x = -x
        return self.b(x)


def test_torch_compile_compiles_the_same_frames_and_its_compile_time_is_no_latency():
    pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    def run():
        torch._dynamo.reset()
        counters.clear()
        clear_compilation_metrics()
        torch.manual_seed(0)  # the same branches taken in both runs
        compiled = torch.compile(BranchyModel(), backend="eager")
        with torch.no_grad():
            for _ in range(3):
                compiled(torch.randn(4, 8))
        return ([m.co_name for m in get_compilation_metrics()], dict(counters["graph_break"]),
                dict(counters["stats"]))

    plain = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about hooks or anything else
        with xsp.trace(output=None) as session:
            profiled = run()
    assert profiled == plain
    trace = session.trace
    calls = model_calls(trace)
    assert calls[col.NAME].tolist() == ["compiled"] * 3
    assert (trace.spans[col.LEVEL] == "layer").sum() == 0  # a compiled call is one span
    compiles = trace.spans[trace.spans[col.KIND] == SpanKind.COMPILE.value]
    assert len(compiles) == len(plain[0]) and set(compiles[col.STEP]) == {0}
    latency = analysis.model_latency(trace)
    assert latency["compile_ms"].iloc[0] > 0 and (latency["compile_ms"].iloc[1:] == 0).all()
    assert latency["latency_ms"].iloc[0] * 1e6 < calls[col.DURATION_NS].iloc[0] - compiles[col.DURATION_NS].sum() + 1


def test_a_compile_that_raised_is_an_error_and_one_inside_the_programs_except_block_is_not():
    pytest.importorskip("torch._dynamo")
    torch._dynamo.reset()
    failing = torch.compile(lambda x: x @ torch.ones(5, 5), backend="eager")  # shapes that cannot multiply
    working = torch.compile(lambda x: torch.relu(x) + 1, backend="eager")
    with xsp.trace(output=None) as session:
        with pytest.raises(Exception, match="same reduction dim"):
            failing(torch.ones(3, 4))
        try:
            raise KeyError("handled by the program")
        except KeyError:
            assert torch.equal(working(torch.ones(2)), torch.full((2,), 2.0))  # compiled while it is handled
    compiles = session.trace.spans[session.trace.spans[col.KIND] == SpanKind.COMPILE.value]
    assert compiles[col.STATUS].tolist() == ["error", "ok"]
    assert "same reduction dim" in compiles[col.STATUS_MESSAGE].iloc[0]
    assert pd.isna(compiles[col.STATUS_MESSAGE].iloc[1]) or not compiles[col.STATUS_MESSAGE].iloc[1]


def test_a_compile_waits_for_xsps_imports_beside_the_program():
    """Dynamo iterates numpy's module dicts while it traces; xsp's imports beside the program
    (pandas, pyarrow) grow them: a compile that overlapped them failed with "dictionary changed
    size during iteration". A compile now begins once they are done."""
    pytest.importorskip("torch._dynamo")
    import threading

    from torch._dynamo.callback import callback_handler

    from xsp.core.lazy import forks_wait

    importing, inside, still_importing_at_compile = threading.Event(), [False], []

    def imports_beside_the_program() -> None:
        with forks_wait():  # what xsp's own import thread holds while it imports
            inside[0] = True
            importing.set()
            threading.Event().wait(3.0)
            inside[0] = False

    def compile_begins(arguments: object) -> None:
        still_importing_at_compile.append(inside[0])

    torch._dynamo.reset()
    with xsp.trace(output=None):
        callback_handler.register_start_callback(compile_begins)  # after xsp's, so it runs after xsp's
        try:
            importer = threading.Thread(target=imports_beside_the_program)
            importer.start()
            importing.wait()
            compiled = torch.compile(lambda x: torch.relu(x) + 1, backend="eager")
            assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
            importer.join()
        finally:
            callback_handler.remove_start_callback(compile_begins)
    assert still_importing_at_compile == [False]


@pytest.mark.parametrize("backward", ["Tensor.backward", "torch.autograd.backward"])
def test_a_compiled_training_step_breaks_where_it_breaks_plainly_and_is_still_recorded(backward):
    """The backward pass and the optimizer step are xsp's events of a training loop: inside a
    compiled function, xsp's hooks and its timing of torch.autograd.backward add no graph break
    and no graph (dynamo rewrites Tensor.backward itself, skips torch.autograd.backward with or
    without xsp, and inlines the optimizer hooks' Python with their work folded away)."""
    pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    def run():
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def train_step(x):
            loss = model(x).sum()
            if backward == "Tensor.backward":
                loss.backward()
            else:
                torch.autograd.backward(loss)
            return loss * 2

        compiled_step = torch.compile(train_step, backend="eager")
        compiled_optimizer_step = torch.compile(optimizer.step, backend="eager")
        for _ in range(3):
            compiled_step(torch.randn(4, 8))
            compiled_optimizer_step()
            optimizer.zero_grad()
        return sum(counters["graph_break"].values()), dict(counters["stats"])

    plain = run()
    with xsp.trace(levels="model", output=None) as session:
        profiled = run()
    assert profiled == plain and plain[0] >= 1  # the backward call breaks the graph, plainly too
    # the backward passes run eagerly after the break, and are recorded; the compiled optimizer
    # step runs as a graph, in which the hooks left nothing
    assert session.trace.spans[col.KIND].tolist().count(SpanKind.BACKWARD.value) == 3


def tiny_gpt2() -> Any:
    """A GPT-2 of one layer and random weights (the test skips without transformers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


def test_generate_is_one_step_with_its_prefill_and_decode_calls():
    lm = tiny_gpt2()
    prompt = torch.tensor([[1, 2, 3]])

    def work():
        for _ in range(2):
            lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                        pad_token_id=0)

    trace = traced(work, levels="model")
    steps = trace.spans[trace.spans[col.KIND] == SpanKind.STEP.value]
    assert steps[col.NAME].tolist() == ["lm.generate"] * 2
    calls = model_calls(trace)
    attributes = [json.loads(a) for a in calls[col.ATTRIBUTES]]
    assert [(a["xsp.generate.phase"], a["xsp.generate.token_index"]) for a in attributes] == [
        ("prefill", 0), ("decode", 1), ("decode", 2)] * 2
    assert calls[col.STEP].tolist() == [0, 0, 0, 1, 1, 1]


def test_a_generate_steps_batch_is_the_sequences_it_was_given_not_its_beams():
    """3 beams on 2 prompts: the model calls ran on 6 sequences, and the step's batch (and its
    items/s) read 6; an encoder-decoder's read its encoder's 2 beside a decoder's 6."""
    lm = tiny_gpt2()
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def work():
        lm.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=2, num_beams=3,
                    do_sample=False, pad_token_id=0)

    trace = traced(work, levels="model")
    assert set(model_calls(trace)[col.BATCH_SIZE].tolist()) == {6}
    assert analysis.model_latency(trace)["batch_size"].tolist() == [2]


def test_generate_inside_an_xsp_step_is_a_span_whose_calls_are_marked_and_counted_once():
    """A service's request step around generate(): its model calls had no prefill/decode marks,
    and the step's batch added up its per-token calls (4 for one prompt)."""
    lm = tiny_gpt2()
    prompt = torch.tensor([[1, 2, 3]])

    def work():
        for _ in range(2):
            with xsp.step("request"):
                lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, min_new_tokens=3,
                            do_sample=False, pad_token_id=0)

    trace = traced(work, levels="model")
    spans = trace.spans
    assert spans[spans[col.KIND] == SpanKind.STEP.value][col.NAME].tolist() == ["request"] * 2
    assert spans[spans[col.KIND] == SpanKind.USER.value][col.NAME].tolist() == ["lm.generate"] * 2
    attributes = [json.loads(a) for a in model_calls(trace)[col.ATTRIBUTES]]
    assert [(a["xsp.generate.phase"], a["xsp.generate.token_index"]) for a in attributes] == [
        ("prefill", 0), ("decode", 1), ("decode", 2)] * 2
    assert analysis.model_latency(trace)["batch_size"].tolist() == [1, 1]


def test_an_encoder_decoders_generate_marks_its_encoder_apart_from_the_decoders_tokens():
    """T5 and BART call their encoder once, then the decoder per token: the encoder was called
    the prefill (token 0) and the decoder's calls counted from 1, one more than the tokens."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    t5 = transformers.T5ForConditionalGeneration(config).eval()
    prompt = torch.tensor([[5, 6, 7]])

    def work():
        t5.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)

    trace = traced(work, levels="model")
    calls = model_calls(trace)
    attributes = [json.loads(a) for a in calls[col.ATTRIBUTES]]
    marked = [(a["xsp.generate.phase"], a.get("xsp.generate.token_index")) for a in attributes]
    assert marked[0] == ("encode", None)
    assert marked[1:] == [("prefill", 0)] + [("decode", token) for token in range(1, len(marked) - 1)]


def test_a_library_imported_during_the_session_is_instrumented(tmp_path, monkeypatch):
    from xsp.tracers._post_import import forget, when_imported

    (tmp_path / "late_library.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("late_library", seen.append)
    try:
        module = importlib.import_module("late_library")
        assert seen == [module] and module.VALUE == 1
        assert module.__spec__.loader.get_filename("late_library").endswith("late_library.py")
    finally:
        forget("late_library", seen.append)
        sys.modules.pop("late_library", None)


def test_work_on_a_helper_thread_during_a_step_hangs_from_that_step():
    import threading

    model = Net()
    started, release = threading.Event(), threading.Event()

    def helper():
        started.set()
        release.wait(5)
        torch.randn(64, 64) @ torch.randn(64, 64)  # operators of no model call, on another thread

    def work():
        thread = threading.Thread(target=helper)
        thread.start()
        started.wait(5)
        with xsp.step("request"):
            model(torch.randn(2, 8))
            release.set()
            thread.join()

    trace = traced(work, levels="model,layer,operator")
    spans = trace.spans
    step = spans[spans[col.KIND] == SpanKind.STEP.value].iloc[0]
    helper_ops = spans[(spans[col.LEVEL] == "operator") & (spans[col.THREAD_ID] != step[col.THREAD_ID])
                       & (spans[col.NAME] == "aten::matmul")]
    assert len(helper_ops) == 1
    op = helper_ops.iloc[0]
    assert op[col.STEP] == step[col.STEP] and op[col.TRACE_ID] == step[col.TRACE_ID]
    assert op[col.PARENT_ID] == step[col.SPAN_ID]


def test_a_real_accumulation_loop_over_a_data_loader_is_one_step_per_optimizer_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(96, 8), torch.randint(0, 3, (96,))), batch_size=16)

    with xsp.trace(levels="model", output=None) as session:
        for i, (x, y) in enumerate(loader):  # 6 batches, optimizer.step() every 2
            (criterion(model(x), y) / 2).backward()
            if (i + 1) % 2 == 0:
                optimizer.step()
                optimizer.zero_grad()
    spans = session.trace.spans
    steps = spans[spans[col.KIND] == SpanKind.STEP.value]
    assert steps[col.NAME].tolist() == ["train_step"] * 3
    pieces = spans[spans[col.LEVEL].isin(["model", "input"]) & (spans[col.KIND] != SpanKind.SESSION.value)
                   & (spans[col.KIND] != SpanKind.STEP.value)]
    per_step = pieces.groupby([col.STEP, col.KIND, col.NAME]).size()
    for step in range(3):
        assert per_step[(step, "predict", "model")] == 2
        assert per_step[(step, "backward", "backward")] == 2
        assert per_step[(step, "optimizer", "AdamW.step")] == 1
        assert per_step[(step, "input", "DataLoader.__next__")] == 2
    unstepped = pieces[pieces[col.STEP].isna()]
    assert unstepped[col.NAME].tolist() == ["DataLoader.__next__"]  # only the loop's last next() (StopIteration)


@pytest.mark.parametrize("pure_python", [False, True])
def test_a_gradient_only_loop_between_no_grad_calls_is_one_step_per_call(pure_python, monkeypatch):
    """Input gradients (PGD, saliency): an eval-mode model called once with no_grad, then forward
    and backward with no optimizer 3 times, then no_grad again (in C and in Python alike)."""
    if pure_python:
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    with xsp.trace(levels="model", output=None) as session:
        for iterations in (1, 3):  # (a single one is C's to decide, several are Python's)
            with torch.no_grad():
                model(torch.randn(4, 8))
            for _ in range(iterations):
                model(torch.randn(4, 8, requires_grad=True)).sum().backward()
            with torch.no_grad():
                model(torch.randn(4, 8))
    spans = session.trace.spans
    calls = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    assert calls[col.STEP].nunique() == len(calls) == 8  # every call a step of its own
    steps = spans[spans[col.KIND] == SpanKind.STEP.value]
    assert steps[col.NAME].tolist() == ["train_step"] * 4


@pytest.mark.parametrize("pure_python", [False, True])
def test_a_frozen_teacher_called_before_the_student_is_in_each_training_step(pure_python, monkeypatch):
    """Distillation (a frozen encoder, a target network called first): the model called without
    autograd before the one trained is part of that iteration's step, the first one too; an
    evaluation of the trained model after the loop is still a step of its own."""
    if pure_python:
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
    student = nn.Sequential(nn.Linear(8, 3))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    with xsp.trace(levels="model", output=None) as session:
        for _ in range(4):
            batch = torch.randn(4, 8)
            with torch.no_grad():
                target = teacher(batch)
            optimizer.zero_grad()
            nn.functional.mse_loss(student(batch), target).backward()
            optimizer.step()
        with torch.no_grad():
            student(torch.randn(4, 8))
    spans = session.trace.spans
    steps = spans[spans[col.KIND] == SpanKind.STEP.value]
    assert steps[col.NAME].tolist() == ["train_step"] * 4
    calls = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    assert calls.groupby(col.STEP)[col.NAME].apply(list).tolist() == [["teacher", "student"]] * 4 + [["student"]]
    breakdown = analysis.step_breakdown(session.trace)
    assert breakdown["name"].tolist() == ["train_step"] * 4 + ["student"]


@pytest.mark.parametrize("pure_python", [False, True])
@pytest.mark.parametrize("by_keyword", [False, True])
def test_an_optimizer_closures_own_code_is_other_time_not_the_optimizers(pure_python, by_keyword, monkeypatch):
    """``optimizer.step(closure)`` (LBFGS, PyTorch Lightning's automatic optimization): the
    closure runs the program's training step inside the optimizer span; what it does besides
    its forward and backward (its loss, logging: a sleep here) is ``other``, not ``optimizer``."""
    import time

    if pure_python:
        monkeypatch.setattr(hotpath, "HOTPATH", None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randn(4, 8)

    def closure():
        optimizer.zero_grad()
        loss = model(batch).sum()
        loss.backward()
        time.sleep(0.005)  # the program's own code in its training step
        return loss

    with xsp.trace(levels="model", output=None) as session:
        losses = [optimizer.step(closure=closure) if by_keyword else optimizer.step(closure) for _ in range(3)]
    assert all(isinstance(loss, torch.Tensor) for loss in losses)  # the closure's value, as without xsp
    spans = session.trace.spans
    closures = spans[spans[col.NAME] == "SGD.step.closure"]
    assert closures[col.KIND].tolist() == ["user"] * 3 and closures[col.STEP].tolist() == [0, 1, 2]
    breakdown = analysis.step_breakdown(session.trace)
    assert (breakdown["other_ms"] >= 5.0).all()
    assert (breakdown["optimizer_ms"] < breakdown["other_ms"]).all()
    assert (breakdown["forward_ms"] > 0).all() and (breakdown["backward_ms"] > 0).all()


# -- torch.compile: no frame of xsp's is dynamo's to compile ----------------------------------
class Break(nn.Module):
    def forward(self, x):
        torch._dynamo.graph_break()  # a graph break inside a layer
        return x


def nested() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Break(), nn.Linear(16, 3))


def compile_and_run(make, grad: bool):
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    torch.manual_seed(0)
    compiled = torch.compile(make(), backend="eager")
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            out = compiled(torch.randn(4, 8))
            if grad:
                out.sum().backward()
    return (dict(counters["frames"]), dict(counters["stats"]), dict(counters["graph_break"]),
            [m.co_name for m in get_compilation_metrics()])


@pytest.mark.parametrize(("make", "grad"), [(BranchyModel, False), (BranchyModel, True), (nested, False),
                                           (nested, True)])
def test_dynamo_counts_the_same_frames_under_xsp_as_without(make, grad):
    plain = compile_and_run(make, grad)
    with xsp.trace(levels="model,layer", output=None) as session:
        profiled = compile_and_run(make, grad)
    assert profiled == plain  # Branchy without grad: frames ok 2 plain, 3 before the fix (Interner.intern)
    calls = session.trace.spans[session.trace.spans[col.KIND] == SpanKind.PREDICT.value]
    assert calls[col.NAME].tolist() == ["compiled"] * 3
    assert calls[col.STEP].tolist() == [0, 1, 2]


def test_xsp_frames_are_skipped_as_frames_and_inlined_where_called():
    from torch._dynamo import trace_rules

    from xsp.record.columns import Interner
    from xsp.record.recording import ThreadBuffer
    from xsp.tracers.module_calls import interceptor

    with xsp.trace(levels="model,layer", output=None):
        compile_and_run(BranchyModel, False)  # dynamo's trace rules are imported: xsp gives its rule
    for code in (Interner.intern.__code__, ThreadBuffer.record_backward.__code__,
                 interceptor._make_all_wrapper.__code__):
        assert trace_rules.check_file(code.co_filename).skipped, code.co_filename
        assert not trace_rules.check_file(code.co_filename, is_inlined_call=True).skipped


def test_the_time_between_steps_is_whole_nanoseconds_not_a_rounding_error():
    """A session of one step said 2.8e-14 ms ran between its steps (a difference of ms figures)."""
    import numpy as np
    import pandas as pd

    from xsp.core import schema as col
    from xsp.table.build import conform

    frame = pd.DataFrame({col.NAME: ["session", "model"], col.LEVEL: ["model", "model"],
                          col.KIND: [col.SpanKind.SESSION.value, col.SpanKind.PREDICT.value],
                          col.START_NS: [0, 926_756_583], col.END_NS: [1_899_144_321, 1_838_422_746],
                          col.THREAD_ID: [1, 1], col.STEP: pd.array([None, 0], dtype="Int64")})
    frame[col.SPAN_ID] = np.arange(1, 3)
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    coverage = analysis.step_coverage(conform(frame)).iloc[0]
    assert coverage["between_ms"] == 0.0 and coverage["steps"] == 1
    assert coverage["before_ms"] == 926.756583 and coverage["after_ms"] == 60.721575


def test_compiling_outside_the_steps_is_named_as_such():
    """A compiled training function's first call compiled for 2.2 s before its step began, and the
    report called all of it 'start-up, model construction'."""
    import numpy as np
    import pandas as pd

    from xsp.core import schema as col
    from xsp.table.build import conform

    kinds = [col.SpanKind.SESSION, col.SpanKind.COMPILE, col.SpanKind.PREDICT, col.SpanKind.COMPILE,
             col.SpanKind.PREDICT]
    frame = pd.DataFrame({col.NAME: ["session", "torch.compile", "model", "torch.compile", "model"],
                          col.LEVEL: ["model"] * 5, col.KIND: [kind.value for kind in kinds],
                          # a compile of 300 ms before the first step, and one of 50 ms half inside the second
                          col.START_NS: [0, 100_000_000, 500_000_000, 575_000_000, 600_000_000],
                          col.END_NS: [1_000_000_000, 400_000_000, 550_000_000, 625_000_000, 700_000_000],
                          col.THREAD_ID: [1] * 5, col.STEP: pd.array([None, None, 0, None, 1], dtype="Int64")})
    frame[col.SPAN_ID] = np.arange(1, 6)
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    coverage = analysis.step_coverage(conform(frame)).iloc[0]
    assert coverage["compile_outside_ms"] == 325.0 and coverage["before_ms"] == 500.0
    import io

    from rich.console import Console

    from xsp.reports.terminal import render_report

    out = io.StringIO()
    render_report(xsp.Trace(spans=conform(frame), metadata={}), Console(file=out, width=200))
    assert "325.000 ms of the time outside the steps was torch.compile compiling" in out.getvalue()
