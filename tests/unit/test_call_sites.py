"""Call sites: the user's line that made each module call and user span (xsp/record/sites.py).

The user's code is a module written to a temporary folder (a path under no library folder), so
its lines are known; each program runs on xsp's C path and on its Python path.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import xsp
from tests.user_code import marked_line, user_module
from xsp.core import schema as col
from xsp.core.schema import SpanKind
from xsp.record import hotpath
from xsp.record import sites as _sites
from xsp.record.sites import NO_SITE, CallSites, library_folders, line_at

USER_CODE = '''
import threading
import torch
import xsp
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.fc(x)  # FC
        x = self.blocks(x)  # BLOCKS
        return self.head(
            x)  # HEAD (a call over two lines: the line of its call)


def run(model, x, times):
    for _ in range(times):
        model(x)  # RUN


def other_line(model, x, times):
    for _ in range(times):
        model(x)  # OTHER


def with_span(model, x):
    with xsp.span("outer"):  # SPAN
        model(x)  # INSIDE_SPAN


@xsp.span("decorated")
def decorated(model, x):
    return model(x)  # IN_DECORATED


def call_decorated(model, x):
    return decorated(model, x)  # DECORATED


def through_the_attribute(model, x):
    return nn.Module.__call__(model, x)  # ATTRIBUTE (xsp's C object read as an attribute gives a function)


def in_threads(model, x):
    first = threading.Thread(target=run, args=(model, x, 3), name="first")
    second = threading.Thread(target=other_line, args=(model, x, 3), name="second")
    first.start()
    second.start()
    first.join()
    second.join()


def deep():
    return nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4)), nn.Linear(4, 4))


def two_lines(model, x, times):
    for _ in range(times):
        model(x)  # FIRST_LINE
        model(x)  # SECOND_LINE


class TwoCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.ReLU(), nn.Tanh()

    def forward(self, x):
        x = self.a(x)  # OWN_A
        return self.b(x)  # OWN_B


def mixed():
    return nn.Sequential(nn.ReLU(), TwoCalls(), nn.Sequential(nn.Sigmoid(), TwoCalls()), nn.Tanh())


def train(model, loader, optimizer):
    for x, y in loader:  # LOOP
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()  # OPTIMIZER


def from_library_only(model, x):
    thread = threading.Thread(target=model, args=(x,), name="library")  # threading calls the model
    thread.start()
    thread.join()
'''


@pytest.fixture
def user(tmp_path: Path) -> ModuleType:
    """The user's code, as a module in a file of its own."""
    return user_module(tmp_path / "user_code.py", USER_CODE, "user_code_for_call_sites")


def _line(module: ModuleType, marker: str) -> int:
    """The line of USER_CODE that carries ``# <marker>`` (``HEAD``'s call begins a line earlier)."""
    return marked_line(module, marker)


def _trace(program: Any, c: bool, monkeypatch: pytest.MonkeyPatch, levels: str = "model,layer") -> pd.DataFrame:
    if c and hotpath.load() is None:
        pytest.skip("xsp.record._hotpath is not built here")
    with monkeypatch.context() as patch:
        if not c:
            patch.setattr(hotpath, "HOTPATH", None)
        with xsp.trace(levels=levels, output=None) as session, torch.no_grad():
            program()
    return session.trace.spans


def _sites_of(spans: pd.DataFrame, **where: Any) -> set[tuple[Any, Any, Any]]:
    chosen = spans
    for column, value in where.items():
        chosen = chosen[chosen[column] == value]
    assert len(chosen), where
    return set(zip(chosen[col.CALL_FILE].astype(object).where(chosen[col.CALL_FILE].notna(), None),
                   chosen[col.CALL_LINE].astype(object).where(chosen[col.CALL_LINE].notna(), None),
                   chosen[col.CALL_FUNCTION].astype(object).where(chosen[col.CALL_FUNCTION].notna(), None)))


paths = pytest.mark.parametrize("c", [True, False], ids=["c-path", "python-path"])


@paths
def test_each_layer_span_has_the_line_of_the_users_call(user, monkeypatch, c):
    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.run(model, x, 3), c, monkeypatch)
    file = user.__file__
    assert _sites_of(spans, **{col.KIND: SpanKind.PREDICT.value}) == {(file, _line(user, "RUN"), "run")}
    assert _sites_of(spans, **{col.NAME: "model.fc"}) == {(file, _line(user, "FC"), "Net.forward")}
    assert _sites_of(spans, **{col.NAME: "model.blocks"}) == {(file, _line(user, "BLOCKS"), "Net.forward")}
    # the head's call spans two lines: it is made on the first (its instruction's line)
    assert _sites_of(spans, **{col.NAME: "model.head"}) == {(file, _line(user, "HEAD") - 1, "Net.forward")}


@paths
def test_a_layer_called_by_torch_gets_the_line_that_called_torch(user, monkeypatch, c):
    """nn.Sequential (torch's code) calls its children: their line is the user's call of it."""
    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.run(model, x, 2), c, monkeypatch)
    expected = {(user.__file__, _line(user, "BLOCKS"), "Net.forward")}
    for name in ("model.blocks.0", "model.blocks.1"):
        assert _sites_of(spans, **{col.NAME: name}) == expected


@paths
def test_layers_deep_in_library_code_get_the_line_of_their_own_model_call(user, monkeypatch, c):
    """Three levels of nn.Sequential, called from two lines in turn: every layer of a call has
    that call's line (C's walk stops at an enclosing call's frame; frames of one line's calls are
    freed and made again for the other line's, often at the same address)."""
    model, x = user.deep(), torch.randn(2, 4)
    spans = _trace(lambda: user.two_lines(model, x, 4), c, monkeypatch)
    calls = spans[spans[col.KIND] == SpanKind.PREDICT.value].sort_values(col.START_NS)
    layers = spans[spans[col.LEVEL] == "layer"]
    lines = [_line(user, "FIRST_LINE"), _line(user, "SECOND_LINE")]
    assert calls[col.CALL_LINE].tolist() == lines * 4
    for call in calls.itertuples(index=False):
        inside = layers[(layers[col.START_NS] >= getattr(call, col.START_NS))
                        & (layers[col.END_NS] <= getattr(call, col.END_NS))]
        assert len(inside) == 6
        assert set(inside[col.CALL_LINE].tolist()) == {getattr(call, col.CALL_LINE)}
        assert set(inside[col.CALL_FUNCTION].tolist()) == {"two_lines"}


@paths
def test_a_call_through_the_attribute_read_has_the_users_line(user, monkeypatch, c):
    """``nn.Module.__call__`` read as an attribute is a Python function of xsp's calling the C object:
    its frame is xsp's, and the walk passes it."""
    model, x = user.Net(), torch.randn(2, 4)

    def program() -> None:
        for _ in range(3):
            user.through_the_attribute(model, x)

    spans = _trace(program, c, monkeypatch)
    assert _sites_of(spans, **{col.KIND: SpanKind.PREDICT.value}) == {
        (user.__file__, _line(user, "ATTRIBUTE"), "through_the_attribute")}


@paths
def test_threads_keep_their_own_lines(user, monkeypatch, c):
    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.in_threads(model, x), c, monkeypatch)
    predicts = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    by_thread = [set(zip(rows[col.CALL_LINE].tolist(), rows[col.CALL_FUNCTION].tolist()))
                 for _, rows in predicts.groupby(col.THREAD_ID)]
    expected = [{(_line(user, "RUN"), "run")}, {(_line(user, "OTHER"), "other_line")}]
    assert sorted(by_thread, key=str) == sorted(expected, key=str)
    layers = spans[spans[col.KIND] == SpanKind.FORWARD.value]  # and the layers the lines of the model's forward
    assert set(layers[col.CALL_FUNCTION]) == {"Net.forward"}


@paths
def test_a_call_no_user_frame_made_has_no_call_site(user, monkeypatch, c):
    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.from_library_only(model, x), c, monkeypatch)
    predict = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    assert len(predict) == 1 and predict[col.CALL_FILE].isna().all() and predict[col.CALL_LINE].isna().all()
    # its layers were called by the user's forward all the same (the model is named as threading bound it)
    fc = spans[spans[col.NAME].str.endswith(".fc")]
    assert _sites_of(fc) == {(user.__file__, _line(user, "FC"), "Net.forward")}


@paths
def test_user_spans_record_their_with_statement_or_the_decorated_call(user, monkeypatch, c):
    model, x = user.Net(), torch.randn(2, 4)

    def program() -> None:
        user.with_span(model, x)
        user.call_decorated(model, x)

    spans = _trace(program, c, monkeypatch, levels="model")
    file = user.__file__
    assert _sites_of(spans, **{col.NAME: "outer"}) == {(file, _line(user, "SPAN"), "with_span")}
    assert _sites_of(spans, **{col.NAME: "decorated"}) == {(file, _line(user, "DECORATED"), "call_decorated")}
    assert _sites_of(spans, **{col.KIND: SpanKind.PREDICT.value}) == {
        (file, _line(user, "INSIDE_SPAN"), "with_span"), (file, _line(user, "IN_DECORATED"), "decorated")}


@paths
def test_input_waits_backward_passes_and_optimizer_steps_have_the_users_lines(user, monkeypatch, c):
    """They had none: a loop waiting on its DataLoader 90% of its steps was missing from "where in
    your code", whose hottest line was then a model call of 1%."""
    from torch.utils.data import DataLoader, TensorDataset

    if c and hotpath.load() is None:
        pytest.skip("xsp.record._hotpath is not built here")
    model = nn.Linear(4, 4)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with monkeypatch.context() as patch:
        if not c:
            patch.setattr(hotpath, "HOTPATH", None)
        with xsp.trace(levels="model", output=None) as session:
            user.train(model, loader, optimizer)
    spans, file = session.trace.spans, user.__file__
    assert _sites_of(spans, **{col.KIND: SpanKind.INPUT.value}) == {(file, _line(user, "LOOP"), "train")}
    assert _sites_of(spans, **{col.KIND: SpanKind.BACKWARD.value}) == {(file, _line(user, "BACKWARD"), "train")}
    assert _sites_of(spans, **{col.KIND: SpanKind.OPTIMIZER.value}) == {(file, _line(user, "OPTIMIZER"), "train")}
    assert {_line(user, marker) for marker in ("LOOP", "BACKWARD", "OPTIMIZER")} <= set(
        xsp.analysis.lines(session.trace)["line"].tolist())


def test_an_explicit_step_records_its_with_statement(monkeypatch):
    model = nn.Linear(4, 4)
    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        with xsp.step("train"):
            line = sys._getframe().f_lineno - 1
            model(torch.randn(2, 4))
    step = session.trace.spans[session.trace.spans[col.KIND] == SpanKind.STEP.value]
    assert step[col.CALL_LINE].tolist() == [line] and step[col.CALL_FILE].tolist() == [__file__]
    assert step[col.CALL_FUNCTION].tolist() == ["test_an_explicit_step_records_its_with_statement"]


def test_call_sites_are_exported_with_opentelemetrys_code_attributes(user, monkeypatch):
    from xsp.export.otlp import span_attributes

    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.run(model, x, 1), False, monkeypatch)
    fc = spans[spans[col.NAME] == "model.fc"]
    attributes = span_attributes(fc)[0]
    assert attributes["code.file.path"] == user.__file__
    assert attributes["code.line.number"] == _line(user, "FC")
    assert attributes["code.function.name"] == "Net.forward"


def test_call_sites_survive_the_file(user, monkeypatch, tmp_path):
    model, x = user.Net(), torch.randn(2, 4)
    with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet"), torch.no_grad():
        user.run(model, x, 2)
    spans = xsp.load(tmp_path / "run.xsp.parquet").spans
    assert str(spans[col.CALL_LINE].dtype) == "Int64" and str(spans[col.CALL_FILE].dtype) == "string"
    assert _sites_of(spans, **{col.NAME: "model.fc"}) == {(user.__file__, _line(user, "FC"), "Net.forward")}


# the table and its rule ------------------------------------------------------------------------
def _code_in(filename: str) -> Any:
    return compile("f(1)\n", filename, "exec")


def test_library_rule_folders():
    sites = CallSites()
    stdlib = sysconfig.get_paths()["stdlib"]
    assert sites.is_library(_code_in(os.path.join(stdlib, "threading.py")))
    assert sites.is_library(_code_in(os.path.join(stdlib, "..", os.path.basename(stdlib), "threading.py")))
    assert sites.is_library(_code_in(os.path.join(sysconfig.get_paths()["purelib"], "somepackage", "x.py")))
    assert sites.is_library(_code_in(torch.nn.modules.container.__file__))
    assert sites.is_library(_code_in(xsp.__file__))
    assert sites.is_library(_code_in(sys.modules["xsp.tracers.module_calls.interceptor"].__file__))
    assert sites.is_library(_code_in("<frozen importlib._bootstrap>"))
    assert sites.is_library(_code_in("<eval_with_key>.3"))
    for users in (__file__, "/home/someone/project/train.py", "<stdin>", "<string>", "train.py"):
        assert not sites.is_library(_code_in(users)), users
    assert all(folder.endswith(os.sep) for folder in library_folders())


def test_a_site_is_interned_once_per_code_and_offset_and_resolved_to_text():
    sites = CallSites(folders=())

    def where() -> Any:
        return sys._getframe()

    frame = where()
    first = sites.of_frame(frame)
    assert sites.of_frame(frame) == first == 0 and len(sites) == 1
    assert sites.resolve(first) == (__file__, frame.f_lineno, where.__qualname__)
    assert sites.resolve(NO_SITE) is None and sites.resolve(5) is None
    assert line_at(frame.f_code, frame.f_lasti) == frame.f_lineno
    assert sites.of_frame(None) == NO_SITE


def test_the_table_stops_growing_at_its_bound(monkeypatch):
    monkeypatch.setattr(_sites, "MAX_SITES", 2)
    sites = CallSites(folders=())
    codes = [compile(f"x = {i}", f"made{i}.py", "exec") for i in range(3)]
    assert [sites.intern(code, 0) for code in codes] == [0, 1, NO_SITE]
    assert sites.intern(codes[0], 0) == 0


def test_a_frame_of_library_code_is_passed_over():
    sites = CallSites()
    namespace: dict[str, Any] = {"sys": sys}
    exec(compile("def inner(walk):\n    return walk(sys._getframe())\n", torch.nn.modules.container.__file__,
                 "exec"), namespace)
    site = namespace["inner"](sites.of_frame)  # "torch's" code walks out from its own frame
    here = sys._getframe().f_lineno - 1
    assert sites.resolve(site) == (__file__, here, "test_a_frame_of_library_code_is_passed_over")


def test_unknown_records_have_no_site_columns_filled():
    from xsp.tracers.module_calls.rows import site_columns

    columns = site_columns(None, np.array([0, -1], dtype=np.int64))
    assert all(pd.isna(value) for values in columns.values() for value in list(values))
    assert json.dumps(sorted(columns)) == json.dumps(sorted([col.CALL_FILE, col.CALL_LINE, col.CALL_FUNCTION]))


@paths
def test_call_sites_can_be_switched_off(user, monkeypatch, c):
    """XSP_CALL_SITES=0: no span carries a line (what benchmarks/call_instructions.py compares)."""
    monkeypatch.setenv("XSP_CALL_SITES", "0")
    model, x = user.Net(), torch.randn(2, 4)
    spans = _trace(lambda: user.with_span(model, x), c, monkeypatch)
    assert len(spans) and spans[col.CALL_LINE].isna().all()


def test_code_that_torch_compile_made_is_a_librarys(tmp_path):
    import torch._dynamo.utils as dynamo_utils

    sites = CallSites()
    resume = compile("x = 1", str(tmp_path / "train.py"), "exec").replace(co_name="torch_dynamo_resume_in_f_at_3")
    assert sites.is_library(resume)
    rewritten = compile("y = 2", str(tmp_path / "train.py"), "exec")
    original = compile("y = 2", str(tmp_path / "train.py"), "exec")
    assert not CallSites().is_library(rewritten)
    dynamo_utils.orig_code_map[rewritten] = original
    assert CallSites().is_library(rewritten) and not CallSites().is_library(original)
    generated = compile("z = 3", os.path.join(_sites.default_inductor_folder(), "ab", "cab.py"), "exec")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") or sites.is_library(generated)


@paths
def test_a_layer_of_the_users_inside_library_containers_keeps_its_own_lines(user, monkeypatch, c):
    """Leaves a container's forward (torch's) calls take the line that called the container; the
    layers a forward of the user's calls inside it take that forward's lines, however the
    containers nest and however often they run from two lines in turn."""
    model, x = user.mixed(), torch.zeros(1, 4)
    spans = _trace(lambda: user.two_lines(model, x, 3), c, monkeypatch)
    layers = spans[spans[col.KIND] == SpanKind.FORWARD.value]
    names = layers[col.NAME].astype(str)
    outer = {(user.__file__, _line(user, "FIRST_LINE"), "two_lines"), (user.__file__, _line(user, "SECOND_LINE"),
                                                                         "two_lines")}
    for leaf in layers[names.str.endswith(("ReLU_0", "Tanh_0", "Sigmoid_0")) | names.str.fullmatch(r".*\.(0|3|2\.0)")][
            col.NAME].unique():
        assert _sites_of(layers, **{col.NAME: leaf}) == outer, leaf
    own_a = layers[names.str.endswith(".a")]
    own_b = layers[names.str.endswith(".b")]
    assert len(own_a) == len(own_b) == 2 * 2 * 3  # two TwoCalls, two lines, three times
    assert _sites_of(own_a, **{}) == {(user.__file__, _line(user, "OWN_A"), "TwoCalls.forward")}
    assert _sites_of(own_b, **{}) == {(user.__file__, _line(user, "OWN_B"), "TwoCalls.forward")}


def test_a_module_classs_source_line_is_the_one_inspect_gives(tmp_path, monkeypatch):
    import inspect
    import textwrap

    from xsp.tracers.module_calls.rows import class_source

    source = tmp_path / "models_here.py"
    source.write_text(textwrap.dedent('''
        import dataclasses, torch

        class Plain(torch.nn.Module):
            pass

        @dataclasses.dataclass(eq=False)
        class Decorated(torch.nn.Module):
            def __post_init__(self):
                super().__init__()

        class Twice(torch.nn.Module):
            pass

        if True:
            class Twice(torch.nn.Module):  # the second one: inspect's answer, not the first line found
                pass
        '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import models_here

    classes = [models_here.Plain, models_here.Decorated, models_here.Twice, torch.nn.Linear, torch.nn.ReLU,
               torch.nn.Sequential, torch.nn.MultiheadAttention]
    for cls in classes:
        assert class_source(cls) == f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}", cls
    assert class_source(models_here.Decorated).endswith(":7")  # the decorator's line, as inspect says


def test_a_class_of_a_notebook_cell_is_placed_by_its_methods_code(tmp_path):
    """A class of a notebook's cell has no source file to its module (``__main__`` of the
    kernel): its place was null, where its methods' code names the cell's file, whose lines
    IPython keeps in linecache. Where no lines are kept (``python -c``), it stays unplaced."""
    import linecache

    from xsp.tracers.module_calls.rows import class_source

    def defined(code: str, filename: str, lines: bool) -> type:
        if lines:
            linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        namespace: dict[str, Any] = {"nn": nn, "__name__": "a_kernels_main_not_imported"}
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - a cell's code, as IPython runs it
        return namespace["Cell"]

    code = "import math\n\nclass Cell(nn.Module):\n    def forward(self, x):\n        return x\n"
    cell = str(tmp_path / "ipykernel_1" / "205268494.py")  # IPython's name for a cell: no such file
    try:
        assert class_source(defined(code, cell, lines=True)) == f"{cell}:3"
    finally:
        linecache.cache.pop(cell, None)
    assert class_source(defined(code, "<string>", lines=False)) is None
