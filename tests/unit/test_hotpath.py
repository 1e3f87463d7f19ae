"""The C part of the module-call wrapper (xsp/record/_hotpath/) against its Python twin.

Every program here runs twice, with the extension and with ``hotpath.HOTPATH = None``; the two
traces must agree on everything but the times. Where the extension is not built these tests
skip, except under ``XSP_REQUIRE_HOTPATH`` (CI sets it), where that is a failure.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn

import xsp
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.record import hotpath
from xsp.record.columns import CALL_FIELDS, COMPACT_AT, FIRST_PACKED_ROWS, extend_columns, extend_columns_from_packed
from xsp.tracers.module_calls import interceptor as _module_calls
from xsp.tracers.module_calls import native_torch as _native_torch

BUILT = hotpath.load()


def require_built() -> Any:
    """xsp.record._hotpath, or the test skips (fails under XSP_REQUIRE_HOTPATH, as in CI)."""
    if BUILT is None:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.record._hotpath is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.record._hotpath is not built here (no C compiler at install, or XSP_PURE_PYTHON set)")
    return BUILT


@pytest.fixture
def c_module() -> Any:
    return require_built()


# packing -----------------------------------------------------------------------------------
def _python_packed(columns: list[array[int]], rows: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(hotpath, "HOTPATH", None)
        extend_columns(columns, rows)


def test_pack_columns_gives_the_columns_struct_packing_gives(c_module, monkeypatch):
    rng = random.Random(7)
    rows = [(rng.randrange(-2**62, 2**62), rng.randrange(0, 2**40), rng.randrange(-1, 500), rng.randrange(0, 8),
             -1) for _ in range(1000)]
    typecodes = ("q", "q", "l", "b", "l")
    by_c = [array(code) for code in typecodes]
    by_python = [array(code) for code in typecodes]
    extend_columns(by_c, rows)
    _python_packed(by_python, rows, monkeypatch)
    assert by_c == by_python
    assert list(by_c[0]) == [row[0] for row in rows]
    assert list(by_c[3]) == [row[3] for row in rows]


def test_pack_columns_reads_ints_of_every_size(c_module):
    """Ints of one and two 30-bit digits are read in place, longer ones by CPython: each side of
    every boundary, both signs, and a bool (an int subclass)."""
    values = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**60 - 1, 2**60, -(2**60) - 1, 2**62, -(2**63), 2**63 - 1,
              123_456_789_012_345, True]
    packed = c_module.pack_columns([(value,) for value in values], (8,))[0]
    assert list(struct.unpack(f"{len(values)}q", packed)) == [int(value) for value in values]
    with pytest.raises(OverflowError):
        c_module.pack_columns([(2**63,)], (8,))


def test_pack_columns_refuses_what_does_not_fit_or_is_no_row(c_module):
    with pytest.raises(OverflowError):
        c_module.pack_columns([(300,)], (1,))
    with pytest.raises(ValueError):
        c_module.pack_columns([(1,)], (8, 8))
    assert c_module.pack_columns([(1, 2, "name", None)], (8, 1)) == (struct.pack("q", 1), struct.pack("b", 2))
    with pytest.raises(TypeError):
        c_module.pack_columns([("a",)], (8,))
    with pytest.raises(ValueError):
        c_module.pack_columns([(1,)], (3,))
    assert c_module.pack_columns([], (8, 1)) == (b"", b"")
    assert c_module.pack_columns([(-1, 5)], (8, 1)) == (struct.pack("q", -1), struct.pack("b", 5))


def test_split_rows_gives_the_columns_strided_copies_give(c_module, monkeypatch):
    rng = random.Random(11)
    rows = [(rng.randrange(-2**62, 2**62), rng.randrange(0, 2**40), rng.randrange(-1, 500), rng.randrange(0, 8),
             -1) for _ in range(700)]
    packed = bytearray(struct.pack(f"{len(rows) * 5}q", *(value for row in rows for value in row)))
    typecodes = ("q", "q", "l", "b", "l")
    by_c = [array(code) for code in typecodes]
    by_python = [array(code) for code in typecodes]
    extend_columns_from_packed(by_c, memoryview(packed))
    with monkeypatch.context() as patch:
        patch.setattr(hotpath, "HOTPATH", None)
        extend_columns_from_packed(by_python, memoryview(packed))
    assert by_c == by_python
    assert [list(column) for column in by_c] == [list(values) for values in zip(*rows)]


def test_empty_packed_writes_only_the_row_count(c_module):
    """A thread's packed-call buffer is made with its count zero and its rows not written (a
    bytearray() zeroed 28 KiB at every compaction); rows past the count are never read."""
    packed = c_module.empty_packed(8 + 3 * 56)
    assert isinstance(packed, bytearray) and len(packed) == 8 + 3 * 56
    assert struct.unpack_from("q", packed)[0] == 0
    with pytest.raises(ValueError, match="row count"):
        c_module.empty_packed(7)
    with pytest.raises(TypeError):
        c_module.empty_packed("8")


def test_split_rows_refuses_what_does_not_fit_or_is_no_whole_row(c_module):
    with pytest.raises(OverflowError):
        c_module.split_rows(struct.pack("q", 300), (1,))
    with pytest.raises(ValueError):
        c_module.split_rows(struct.pack("3q", 1, 2, 3), (8, 8))
    with pytest.raises(ValueError):
        c_module.split_rows(b"", (3,))
    with pytest.raises(TypeError):
        c_module.split_rows("not a buffer", (8,))
    assert c_module.split_rows(b"", (8, 1)) == (b"", b"")
    assert c_module.split_rows(memoryview(struct.pack("2q", -1, 5)), (8, 1)) == (struct.pack("q", -1),
                                                                                 struct.pack("b", 5))


# the wrapper -------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.act(self.fc(x)) * scale


class First(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return x


class Pair(nn.Module):
    """Two outputs and a keyword argument: the descriptors' slow cases."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.block(x, scale=scale)
        return h, self.head(h)


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e6:
            raise ValueError("too large")
        return self.fc(x)


def _program() -> None:
    """One model per iteration, two models, grad on without training, training with an
    optimizer, a raising layer, keyword arguments and tuples."""
    torch.manual_seed(0)
    model, head, pair, fails = Block(), nn.Linear(4, 3), Pair(), nn.Sequential(Fails())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(5):
            model(x)
        for _ in range(3):
            head(model(x))
        for _ in range(3):
            pair(x, scale=2.0)
    for _ in range(3):  # an evaluation with autograd on
        model(x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
    with torch.no_grad():
        fails(x)
        with pytest.raises(ValueError, match="too large"):
            fails(x + 1e7)
        fails(x)


def _training_program() -> None:
    """Training loops: a loss module joining each step, two models with two optimizers (a GAN's
    shape), input waits, evaluations in between, grad on with no optimizer after; an optimizer
    step before any model call, a backward pass that fails."""
    torch.manual_seed(0)
    model, critic, criterion = Block(), nn.Linear(4, 1), nn.MSELoss()
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=0.01)
    optimizer.step()  # an optimizer step with no model call before it opens a step of its own
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.zeros(2).sum().backward()  # a failing backward pass
    for _ in range(4):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model(x)
        model(x)
    for _ in range(3):
        optimizer.zero_grad()
        critic(model(x)).sum().backward()
        optimizer.step()
        critic_optimizer.zero_grad()
        critic(model(x).detach()).sum().backward()
        critic_optimizer.step()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 4), torch.randn(6, 4)),
                                         batch_size=2)
    for inputs, targets in loader:
        optimizer.zero_grad()
        criterion(model(inputs), targets).backward()
        optimizer.step()
    for _ in range(3):  # an evaluation call, then a training iteration, each iteration
        with torch.no_grad():
            model(x)
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    for _ in range(2):
        model(x)


def _threaded_program() -> None:
    """Threads taking turns on one model (the C wrapper keeps each thread's buffer at hand, so it
    must notice whose turn it is), then running at once; training on one, inference on another."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def infer(count: int) -> None:
        with torch.no_grad():
            for _ in range(count):
                model(x)

    def train(count: int) -> None:
        for _ in range(count):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()

    for turn in range(6):
        worker = threading.Thread(target=infer if turn % 2 else train, args=(3,), name=f"turn-{turn}")
        worker.start()
        worker.join()
        infer(2)
    together = [threading.Thread(target=infer, args=(200,), name="inference"),
                threading.Thread(target=train, args=(50,), name="training")]
    for worker in together:
        worker.start()
    for worker in together:
        worker.join()


def _structure(spans: pd.DataFrame) -> list[tuple[Any, ...]]:
    """Everything of a trace but its times and ids: each span with its parent's name."""
    names = dict(zip(spans[col.SPAN_ID], spans[col.NAME]))
    rows = []
    for span in spans.sort_values(col.START_NS).itertuples(index=False):
        row = span._asdict()
        rows.append((row[col.NAME], row[col.LEVEL], row[col.KIND], row.get(col.PATH), row.get(col.STEP),
                     names.get(row[col.PARENT_ID]), str(row.get(col.INPUT_SHAPES)), str(row.get(col.OUTPUT_SHAPES)),
                     row[col.STATUS], row.get(col.STATUS_MESSAGE),
                     str(row.get(col.CALL_FILE)), str(row.get(col.CALL_LINE)), str(row.get(col.CALL_FUNCTION))))
    return rows


def _trace(program: Callable[[], None], levels: str, c: bool, monkeypatch: pytest.MonkeyPatch,
           **options: Any) -> pd.DataFrame:
    with monkeypatch.context() as patch:
        if not c:
            patch.setattr(hotpath, "HOTPATH", None)
        with xsp.trace(levels=levels, output=None, **options) as session:
            program()
    return session.trace.spans


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_the_c_wrapper_records_what_the_python_wrapper_records(c_module, monkeypatch, levels):
    by_c = _structure(_trace(_program, levels, True, monkeypatch))
    by_python = _structure(_trace(_program, levels, False, monkeypatch))
    assert by_c == by_python
    errors = [row for row in by_c if row[8] == "error"]
    assert errors and all("too large" in str(row[9]) for row in errors)
    # every module call has its call site, in this file (failed calls too), on the line of a call
    calls = [row for row in by_c if row[2] in (SpanKind.PREDICT.value, SpanKind.FORWARD.value)]
    assert calls and {row[10] for row in calls} == {__file__}
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    assert all("(" in lines[int(row[11]) - 1] for row in calls)
    assert {row[12] for row in errors} == {"_program"}  # Fails is called by nn.Sequential: its caller's line


@pytest.mark.parametrize("c", [True, False], ids=["c-path", "python-path"])
@pytest.mark.parametrize("depth", [1, 2, None])
def test_layer_depth_records_module_calls_down_to_that_depth_only(c_module, monkeypatch, c, depth):
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Identity())) for _ in range(2)])

    def program() -> None:
        x = torch.randn(2, 4)
        with torch.no_grad():
            deep(x)
            deep(x)  # its own step: the depth holds across calls
        deep(x).sum().backward()  # and backward spans only for the calls recorded

    spans = _trace(program, "model,layer", c, monkeypatch, layer_depth=depth)
    forward = spans[spans[col.KIND] == SpanKind.FORWARD.value]
    per_depth = forward.groupby(col.CALL_DEPTH).size().to_dict()
    full = {1: 6, 2: 12, 3: 12}
    assert per_depth == {d: n for d, n in full.items() if depth is None or d <= depth}
    backward = spans[(spans[col.KIND] == SpanKind.BACKWARD.value) & (spans[col.LEVEL] == Level.LAYER.value)]
    assert set(backward[col.NAME].str.removesuffix(".backward")) == set(forward[col.NAME]) | {"deep"}
    assert (spans[col.KIND] == SpanKind.PREDICT.value).sum() == 3


def test_layer_depth_must_be_a_depth():
    with pytest.raises(ValueError, match="layer_depth must be 1 or more"):
        xsp.trace(levels="model,layer", output=None, layer_depth=0)


class _Interleaving(nn.Module):
    """A layer in which two threads' top-level calls overlap, once armed: ``first``'s call waits
    inside it until ``second``'s has begun, and ``second``'s waits until ``first``'s has ended."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.first_inside, self.second_inside, self.first_done = threading.Event(), threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = threading.current_thread().name
        if self.armed and name == "first" and not self.first_inside.is_set():
            self.first_inside.set()
            assert self.second_inside.wait(10)
        elif self.armed and name == "second" and not self.second_inside.is_set():
            self.second_inside.set()
            assert self.first_done.wait(10)
        return x + 1


@pytest.mark.parametrize("c", [True, False], ids=["c", "python"])
def test_top_level_calls_of_two_threads_that_overlap_are_each_recorded(c_module, monkeypatch, c):
    # the model level's pass-through names the thread whose top-level call runs; here a second
    # thread's call begins inside the first's and ends after it: neither thread's next call may be
    # taken for a nested one (each thread calls twice first, so that C runs its calls)
    layer = _Interleaving()
    model = nn.Sequential(nn.Linear(4, 4), layer, nn.ReLU())
    x, second_done = torch.randn(2, 4), threading.Event()
    warm = threading.Barrier(2, action=lambda: setattr(layer, "armed", True))

    def first() -> None:
        model(x), model(x), warm.wait()
        model(x)
        layer.first_done.set()
        assert second_done.wait(10)
        model(x)

    def second() -> None:
        model(x), model(x), warm.wait()
        assert layer.first_inside.wait(10)
        model(x)
        second_done.set()

    def program() -> None:
        threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        model(x)

    spans = _trace(program, "model", c, monkeypatch)
    calls = spans[(spans[col.LEVEL] == "model") & (spans[col.NAME] == "model")]
    assert calls[col.THREAD_ID].value_counts().sort_values().tolist() == [1, 3, 4]
    assert (spans[col.LEVEL] != "layer").all()


def _grad_modes_program() -> None:
    """Inference mode, no_grad and grad on, on the same model: steps of each kind, and backward
    layer spans only where autograd recorded a graph."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 4)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
    with torch.no_grad():
        model(x)
    with torch.inference_mode(), torch.enable_grad():  # inference mode wins: no graph
        model(x)
    for _ in range(2):
        model(x).sum().backward()
    with torch.set_grad_enabled(False):
        model(x)


@pytest.mark.parametrize("native", [True, False], ids=["c10-grad-mode", "python-grad-mode"])
@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_the_c_wrapper_reads_each_grad_mode_as_torch_does(c_module, monkeypatch, levels, native):
    """The C wrapper asks c10::GradMode directly where it is found (Linux, macOS), else through
    torch.is_grad_enabled; either way it records what the Python wrapper records."""
    if sys.platform.startswith("linux"):
        assert _native_torch.grad_mode_address(), "c10::GradMode::is_enabled not found in torch's libc10"
    if not native:
        monkeypatch.setattr(_module_calls, "grad_mode_address", lambda: 0)
    by_c = _trace(_grad_modes_program, levels, True, monkeypatch)
    by_python = _trace(_grad_modes_program, levels, False, monkeypatch)
    assert _structure(by_c) == _structure(by_python)
    if levels == "model,layer":
        assert (by_c[col.KIND] == col.SpanKind.BACKWARD.value).any()


def _checkpointed_program() -> None:
    """A model checkpointed whole: its forward runs again inside the backward, on this thread."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).sum().backward()


@pytest.mark.parametrize("native", [True, False], ids=["native-graph-task", "binding-graph-task"])
@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_the_c_wrapper_tells_a_recomputation_inside_a_backward_as_torch_does(c_module, monkeypatch, levels, native):
    """The C wrapper asks torch::autograd::get_current_graph_task_id directly where it is found
    (Linux, macOS), else through torch._C._current_graph_task_id: either way a block recomputed
    inside the backward (the model's own forward, again) is no new step, as the Python wrapper records it."""
    if sys.platform.startswith("linux"):
        assert _native_torch.graph_task_id_address(), "get_current_graph_task_id not found in libtorch_cpu"
    if not native:
        monkeypatch.setattr(_module_calls, "graph_task_id_address", lambda: 0)
    by_c = _trace(_checkpointed_program, levels, True, monkeypatch)
    by_python = _trace(_checkpointed_program, levels, False, monkeypatch)
    assert _structure(by_c) == _structure(by_python)
    assert by_c[col.STEP].dropna().nunique() == 3


def test_a_top_level_calls_shapes_are_compared_by_value(c_module, monkeypatch):
    """The C wrapper reuses the last top-level call's shape index when the shapes are equal: dims
    past 256 are equal ints that are different objects, and a single dim's change is a miss."""
    model = First()
    widths = [300, 300, 301, 301, 2**40, 300, 7]

    def program() -> None:
        with torch.no_grad():
            for width in widths:
                model(torch.zeros(1).expand(2, width), torch.zeros(1).expand(width, 1) if width < 2**20 else None)

    spans = _trace(program, "model", True, monkeypatch)
    calls = spans[spans[col.KIND] == col.SpanKind.PREDICT.value].sort_values(col.START_NS)
    assert [json.loads(shapes) for shapes in calls[col.INPUT_SHAPES]] == [  # a JSON string per span
        [[2, width], [width, 1]] if width < 2**20 else [[2, width]] for width in widths]
    assert [json.loads(shapes) for shapes in calls[col.OUTPUT_SHAPES]] == [[[2, width]] for width in widths]
    assert _structure(spans) == _structure(_trace(program, "model", False, monkeypatch))


class _ShapeOfItsOwn(torch.Tensor):
    """A tensor subclass whose ``shape`` is its own."""

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return torch.Size([7, 7])


def test_shapes_are_read_as_attribute_lookup_reads_them_when_the_tensor_class_changes(c_module, monkeypatch):
    # the C wrapper reads torch.Tensor's shape through the descriptor it found at its start, while
    # the class is unchanged; a subclass, or torch.Tensor changed since, is read by attribute lookup
    model = nn.Linear(4, 4)
    plain, own = torch.randn(2, 4), torch.randn(3, 4).as_subclass(_ShapeOfItsOwn)

    def program() -> None:
        with torch.no_grad():
            model(plain)
            model(own)
            torch.Tensor.xsp_test_marker = 1  # any change to the class gives it a new version tag
            try:
                model(plain)
                model(own)
            finally:
                del torch.Tensor.xsp_test_marker

    spans = _trace(program, "model", True, monkeypatch)
    calls = spans[spans[col.KIND] == col.SpanKind.PREDICT.value].sort_values(col.START_NS)
    assert [json.loads(shapes) for shapes in calls[col.INPUT_SHAPES]] == [[[2, 4]], [[7, 7]]] * 2
    assert _structure(spans) == _structure(_trace(program, "model", False, monkeypatch))


class Counted(nn.Module):
    """A model called without a tensor: its input shapes are none."""

    def forward(self, n: int = 3) -> torch.Tensor:
        return torch.ones(n)


def test_models_called_by_turns_each_keep_their_shapes_and_a_call_without_tensors_has_none(c_module,
                                                                                           monkeypatch):
    """The C wrapper keeps the last top-level call's model and shapes of two models (a forward and
    its loss by turns hit both); a third model, a new shape or a call without tensors is a miss
    that records the truth. A thread's first top-level call without tensors (inputs None, as the
    empty cache holds) once failed the user's call."""
    model, criterion, counted = First(), nn.MSELoss(), Counted()
    x, y = torch.randn(2, 4), torch.randn(2, 4)

    def program() -> None:
        with torch.no_grad():
            counted()  # the thread's first call: no tensor at all
            for step in range(6):
                out = model(x if step != 3 else torch.randn(3, 4))
                criterion(out, y if step != 3 else torch.randn(3, 4))
                if step % 2:
                    counted(step)

    spans = _trace(program, "model", True, monkeypatch)
    assert _structure(spans) == _structure(_trace(program, "model", False, monkeypatch))
    calls = spans[spans[col.KIND] == col.SpanKind.PREDICT.value].sort_values(col.START_NS)
    shapes = [(name, None if pd.isna(i) else json.loads(i), json.loads(o))
              for name, i, o in zip(calls[col.NAME], calls[col.INPUT_SHAPES], calls[col.OUTPUT_SHAPES])]
    assert shapes[0] == ("counted", None, [[3]])
    assert shapes[1:4] == [("model", [[2, 4]], [[2, 4]]), ("criterion", [[2, 4], [2, 4]], [[]]),
                           ("model", [[2, 4]], [[2, 4]])]
    assert ("model", [[3, 4]], [[3, 4]]) in shapes and ("criterion", [[3, 4], [3, 4]], [[]]) in shapes
    assert shapes.count(("criterion", [[2, 4], [2, 4]], [[]])) == 5
    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        for _ in range(3):
            criterion(model(x), y)
        buffer = session.recording.buffer()
        assert (buffer.hot_module, buffer.hot2_module) == (criterion, model)  # each model's own entry
        assert (buffer.hot_inputs, buffer.hot2_inputs) == ((x.shape, y.shape), x.shape)


def test_top_level_calls_past_a_threads_first_packed_roots_keep_their_mode_and_order(c_module, monkeypatch):
    # the C wrapper packs each top-level call's (start, flags) while the thread's roots list is
    # empty; 150 calls overflow the first packed rows (64), and a call the Python path takes (inside
    # xsp.step) puts rows in the list between packed ones
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    modes = [(step % 3 != 0, step % 2 == 0) for step in range(150)]  # (grad, training)

    def program() -> None:
        for step, (grad, training) in enumerate(modes):
            model.train(training)
            with torch.set_grad_enabled(grad):
                if step == 70:
                    with xsp.step():
                        model(x)
                else:
                    model(x)

    for c in (True, False):
        spans = _trace(program, "model", c, monkeypatch)
        calls = spans[(spans[col.LEVEL] == "model") & (spans[col.NAME] == "model")].sort_values(col.START_NS)
        seen = [(json.loads(a)[col.ATTR_MODEL_GRAD], json.loads(a)[col.ATTR_MODEL_TRAINING])
                for a in calls[col.ATTRIBUTES]]
        assert seen == modes, c


def _many_calls_program() -> None:
    """More calls than a thread's first packed buffer holds, before any compaction, on a new
    thread and on the main one; shapes alternate so that each row says which call it was."""
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 4)

    def infer() -> None:
        with torch.no_grad():
            for i in range(FIRST_PACKED_ROWS + 40):
                model(x[: 1 + i % 2])

    worker = threading.Thread(target=infer, name="worker")
    worker.start()
    worker.join()
    infer()


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_calls_past_a_threads_first_packed_rows_are_all_recorded(c_module, monkeypatch, levels):
    """A thread's first packed buffer is small (FIRST_PACKED_ROWS): the C wrapper puts the calls
    after it in the list, and compaction keeps them all, as the Python wrapper records them."""
    by_c = _trace(_many_calls_program, levels, True, monkeypatch)
    by_python = _trace(_many_calls_program, levels, False, monkeypatch)
    predictions = by_c[by_c[col.KIND] == col.SpanKind.PREDICT.value]
    assert len(predictions) == 2 * (FIRST_PACKED_ROWS + 40)
    assert _structure(by_c) == _structure(by_python)


def _packed_count(buffer: Any) -> int:
    return int.from_bytes(buffer.packed_calls[:8], sys.byteorder)


def _roots_count(buffer: Any) -> int:
    return int.from_bytes(buffer.packed_roots[:8], sys.byteorder)


def _packed_calls_and_roots_of_a_new_thread(hold_a_view: bool) -> tuple[dict[str, tuple[int, ...]], Any]:
    """What a new thread's buffer holds after its first calls, after the call that moves the
    Python path's rows into the packed buffers, and after FIRST_PACKED_ROWS + 8 more calls (with a
    view of the thread's packed calls held meanwhile where ``hold_a_view``); and the session."""
    model, other, x = Block(), Block(), torch.randn(2, 4)
    seen: dict[str, tuple[int, ...]] = {}

    def first_call() -> None:
        with torch.no_grad():
            model(x)
        buffer = session.recording.buffer()
        seen["new thread"] = (len(buffer.calls), _packed_count(buffer))

    def worker() -> None:
        with torch.no_grad():
            other(x)
            buffer = session.recording.buffer()
            seen["first"] = (len(buffer.calls), _packed_count(buffer), len(buffer.packed_calls), len(buffer.roots),
                             _roots_count(buffer))
            model(x)
            seen["second"] = (len(buffer.calls), _packed_count(buffer), len(buffer.roots), _roots_count(buffer))
            view = memoryview(buffer.packed_calls) if hold_a_view else None
            for _ in range(FIRST_PACKED_ROWS + 8):
                model(x)
            seen["after"] = (len(buffer.calls), _packed_count(buffer), len(buffer.packed_calls),
                             len(buffer.call_columns), len(buffer.roots), _roots_count(buffer),
                             len(buffer.root_columns))
            if view is not None:
                view.release()

    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        model(x)  # names the model
        for target in (first_call, worker):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
    return seen, session


def test_a_threads_calls_are_all_packed_and_a_full_first_buffer_grows(c_module):
    """A new thread's first call of a known model is the C wrapper's, which makes the thread's
    buffer. A call the Python path records (a model's first call names it) appends a tuple to
    ``calls`` and one to ``roots``; the C wrapper's next call moves those rows into the packed
    buffers and packs its own, so that the calls after it are packed too. The first packed
    buffers are small (FIRST_PACKED_ROWS): once full, they grow to their full size in place, with
    no compaction."""
    seen, session = _packed_calls_and_roots_of_a_new_thread(hold_a_view=False)
    assert seen["new thread"] == (0, 1)
    assert seen["first"] == (1, 0, 8 + FIRST_PACKED_ROWS * CALL_FIELDS * 8, 1, 0)
    assert seen["second"] == (0, 2, 0, 2)
    calls = 2 + FIRST_PACKED_ROWS + 8
    assert seen["after"] == (0, calls, 8 + COMPACT_AT * CALL_FIELDS * 8, 0, 0, calls, 0)
    predictions = session.trace.spans[session.trace.spans[col.KIND] == col.SpanKind.PREDICT.value]
    assert len(predictions) == 1 + 1 + 2 + FIRST_PACKED_ROWS + 8


def test_a_full_first_buffer_that_a_view_holds_is_compacted_and_replaced(c_module):
    """A packed buffer that a view holds cannot grow: the call that finds it full is appended as
    a tuple, and a compaction at once moves every row into the columns and puts a full-size
    buffer in its place; no call is lost."""
    seen, session = _packed_calls_and_roots_of_a_new_thread(hold_a_view=True)
    calls = 2 + FIRST_PACKED_ROWS + 8
    assert seen["after"] == (0, 9, 8 + COMPACT_AT * CALL_FIELDS * 8, FIRST_PACKED_ROWS + 1, 0, 9,
                             FIRST_PACKED_ROWS + 1)
    predictions = session.trace.spans[session.trace.spans[col.KIND] == col.SpanKind.PREDICT.value]
    assert len(predictions) == 1 + 1 + calls


@pytest.mark.parametrize("levels", ["model", "model,layer"])
@pytest.mark.parametrize("schedule", [None, "wait=1,warmup=0,active=2,repeat=3"])
def test_the_c_wrapper_decides_training_steps_as_the_python_wrapper(c_module, monkeypatch, levels, schedule):
    by_c = _structure(_trace(_training_program, levels, True, monkeypatch, schedule=schedule))
    by_python = _structure(_trace(_training_program, levels, False, monkeypatch, schedule=schedule))
    assert by_c == by_python
    steps = [row for row in by_c if row[2] == "step"]
    assert len(steps) >= (4 if schedule else 12)


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_the_c_wrapper_records_each_thread_in_its_own_buffer(c_module, monkeypatch, levels):
    by_c = _trace(_threaded_program, levels, True, monkeypatch)
    by_python = _trace(_threaded_program, levels, False, monkeypatch)
    for spans in (by_c, by_python):
        predicts = spans[spans[col.KIND] == "predict"]
        assert sorted(predicts.groupby(col.THREAD_ID).size().tolist()) == [3, 3, 3, 3, 3, 3, 12, 50, 200]
    assert _by_thread(by_c) == _by_thread(by_python)


def _by_thread(spans: pd.DataFrame) -> list[tuple[Any, ...]]:
    """The structure of each thread's spans, threads numbered in the order they first recorded
    (step numbers left out: threads running at once interleave their steps differently)."""
    ordered = spans.sort_values(col.START_NS)
    threads = ordered[col.THREAD_ID].tolist()
    number = {thread: index for index, thread in enumerate(dict.fromkeys(threads))}
    return sorted((number[thread], *row[:4], *row[5:]) for thread, row in zip(threads, _structure(spans)))


def _counting_begin_root(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    begun: list[int] = []
    original = _module_calls._root_call

    def counting(recording: Any) -> Callable[..., int]:
        begin = original(recording)

        def begin_root(buffer: Any, module: nn.Module) -> int:
            begun.append(id(module))
            return begin(buffer, module)

        return begin_root

    monkeypatch.setattr(_module_calls, "_root_call", counting)
    return begun


def test_the_c_wrapper_is_the_one_installed_and_takes_the_lane(c_module, monkeypatch):
    begun = _counting_begin_root(monkeypatch)
    model, x = Block(), torch.randn(2, 4)
    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        for _ in range(50):
            model(x)
    predicts = session.trace.spans[session.trace.spans[col.KIND] == "predict"]
    assert len(predicts) == 50
    assert len(begun) <= 2, "each call after the first should take the C lane"


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_the_c_wrapper_decides_a_training_loops_steps(c_module, monkeypatch, levels):
    begun = _counting_begin_root(monkeypatch)
    model, criterion = Block(), nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with xsp.trace(levels=levels, output=None) as session:
        for _ in range(30):
            with torch.no_grad():  # an evaluation call before each training iteration
                model(x)
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    spans = session.trace.spans
    assert (spans[col.NAME] == "train_step").sum() == 30
    assert (spans[col.KIND] == "predict").sum() == 90  # the evaluation, the forward and the loss
    assert len(begun) <= 4, "every step of the loop should be decided in C"


def test_the_c_wrapper_reads_xsps_clock(c_module):
    model, x = Block(), torch.randn(2, 4)
    with xsp.trace(levels="model,layer", output=None) as session, torch.no_grad():
        model(x)  # the thread's buffer and the lane
        recording = session.recording
        assert recording is not None
        buffer = recording.buffer()
        before = time.perf_counter_ns()
        model(x)
        after = time.perf_counter_ns()
        buffer.compact()
        columns = buffer.call_columns
        recorded = list(zip(columns.start[-3:], columns.end[-3:], columns.depth[-3:]))
    assert [depth for _, _, depth in recorded] == [1, 1, 0]  # fc and act inside the top-level call
    for start, end, _ in recorded:
        assert before <= start <= end <= after


def test_an_exception_keeps_its_traceback_through_the_c_wrapper(c_module):
    fails = nn.Sequential(Fails())
    with xsp.trace(levels="model,layer", output=None), torch.no_grad():
        fails(torch.zeros(1, 4))
        with pytest.raises(ValueError) as raised:
            fails(torch.full((1, 4), 1e7))
    frames = [frame.name for frame in raised.traceback]
    assert "forward" in frames


# the installed descriptor ------------------------------------------------------------------
class Calls(nn.Module):
    """A module with its own ``__call__`` that goes through ``nn.Module``'s (as OptimizedModule does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Block()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.fixture
def descriptor_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo, for the test, an earlier test's dynamo compile (after which xsp installs functions)."""
    monkeypatch.setattr(_module_calls.INTERCEPTOR, "functions_only", False)


def test_module_call_is_a_c_descriptor_that_reads_as_a_function(c_module, descriptor_allowed):
    model, calls, x = Block(), Calls(), torch.randn(2, 4)
    plain_signature = inspect.signature(model)
    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        entry = nn.Module.__dict__["__call__"]
        assert type(entry) is c_module.FastCall
        read = nn.Module.__call__
        assert inspect.isfunction(read) and read.__name__ == "_wrapped_call_impl"
        assert read.__wrapped__ is entry.original
        assert inspect.signature(model) == plain_signature
        bound = model.__call__  # on an instance, while nothing compiles: the C object itself, bound
        assert bound.__self__ is model and bound.__func__ is entry
        assert inspect.signature(bound) == inspect.signature(Block().__call__)
        model(x)
        bound(x)
        nn.Module.__call__(model, x, scale=2.0)
        calls(x)
        assert nn.Module.__dict__["__call__"] is entry, "reading the attribute outside dynamo changes nothing"
    spans = session.trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 4
    assert nn.Module.__dict__["__call__"] is entry.original


def test_a_tool_that_patches_module_call_for_a_while_leaves_xsp_recording(c_module, descriptor_allowed):
    model, x = Block(), torch.randn(2, 4)
    with xsp.trace(levels="model,layer", output=None) as session, torch.no_grad():
        model(x)
        traced = torch.fx.symbolic_trace(Block())  # patches nn.Module.__call__ and puts back what it read
        assert torch.allclose(traced(x), traced(x))
        model(x)
    assert not any("replaced" in str(w) for w in session.warnings)
    spans = session.trace.spans
    assert (spans[col.KIND] == "predict").sum() == 4  # the model twice, the traced GraphModule twice
    assert (spans[col.LEVEL] == "layer").sum() >= 4


def test_a_module_compiled_before_tracing_runs_no_python_frame_of_xsps(c_module, descriptor_allowed):
    """torch.compile's OptimizedModule calls its module through ``super().__call__``: read while
    nothing compiles, that is xsp's C object, bound, so a compiled call runs no xsp function."""
    import torch._dynamo

    torch._dynamo.reset()
    model, x = Block(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(x)  # compiled before the trace (as a script that warms up first), for no_grad calls
    ours: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == _module_calls.__file__:
            ours.append(frame.f_code.co_name)

    with xsp.trace(levels="model", output=None) as session, torch.no_grad():
        compiled(x)
        sys.setprofile(profile)
        try:
            for _ in range(3):
                compiled(x)
        finally:
            sys.setprofile(None)
    assert ours == []
    assert type(nn.Module.__dict__.get("__call__")) is not c_module.FastCall  # put back
    assert not _module_calls.INTERCEPTOR.functions_only
    spans = session.trace.spans
    assert (spans[col.KIND] == "predict").sum() == 4


def test_dynamo_tracing_puts_the_python_wrapper_in_the_descriptors_place(c_module, descriptor_allowed):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, x = Block(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="eager")
    with xsp.trace(levels="model,layer", output=None) as session, torch.no_grad():
        assert type(nn.Module.__dict__["__call__"]) is c_module.FastCall
        for _ in range(3):
            compiled(x)
        entry = nn.Module.__dict__["__call__"]
        assert inspect.isfunction(entry), "dynamo guards on the closure of a function"
        assert _module_calls.INTERCEPTOR.functions_only
        compiled(x)
        model(x)
    spans = session.trace.spans
    assert (spans[col.KIND] == "predict").sum() == 5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not session.warnings



@pytest.mark.filterwarnings("ignore:`torch.jit.trace.* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_jit_tracing_a_model_the_c_wrapper_knows_records_nothing_of_the_trace(c_module, levels):
    model, frozen, x = Block(), Block().requires_grad_(False), torch.randn(2, 4)
    with xsp.trace(levels=levels, output=None) as session:
        for _ in range(3):
            model(x)  # known to the C wrapper, and its lane
        frozen(x)
        traced = torch.jit.trace(model, x)  # calls model(x): the tracer's, not a step of the loop
        traced_function = torch.jit.trace(lambda inputs: frozen(inputs) * 2, x)  # a function calling a known model
        assert not any(node.kind().startswith("prim::PythonOp") for node in traced.graph.nodes())
        for _ in range(2):
            model(x)
    assert torch.allclose(traced(x), model(x)) and torch.allclose(traced_function(x), frozen(x) * 2)
    spans = session.trace.spans
    assert (spans[col.KIND] == "predict").sum() == 6
    assert not session.warnings


def test_backward_is_timed_by_an_object_of_c_that_reads_as_torch_autograd_backward(c_module):
    original = torch.autograd.backward
    model = nn.Linear(4, 1)
    with xsp.trace(levels="model", output=None) as session:
        timed = torch.autograd.backward
        assert isinstance(timed, c_module.BackwardCall)
        assert timed.__wrapped__ is original and timed.__name__ == "backward" and timed.__doc__ == original.__doc__
        assert timed.__module__ == "torch.autograd"
        assert inspect.signature(timed) == inspect.signature(original)
        torch.autograd.backward(model(torch.randn(2, 4)).sum(), inputs=[model.weight])  # keywords pass through
        assert model.weight.grad is not None and model.bias.grad is None
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.backward(torch.zeros(2).sum())
    assert torch.autograd.backward is original
    backward = session.trace.spans[session.trace.spans[col.KIND] == col.SpanKind.BACKWARD.value]
    assert backward[col.STATUS].tolist() == [col.Status.OK.value, col.Status.ERROR.value]
    assert "does not require grad" in backward[col.STATUS_MESSAGE].iloc[1]


_ACTIONS = ("infer", "infer_head", "grad_call", "train", "backward", "optimizer", "zero_grad", "other_model")


def _steps_state(buffer: Any) -> tuple[Any, ...]:
    """A thread's step state after an event, without its times (which differ from run to run):
    what the step rule decided, whichever of C and Python applied it."""
    steps = buffer.steps
    return (steps.type, steps.pieces, steps.trained, steps.optimizer_seen, steps.nested, steps.python_decides,
            len(steps.tentative), len(steps.joined), bool(steps.closed_ns), bool(steps.lane), steps.lane_grad,
            len(buffer.marks) if hasattr(buffer.marks, "__len__") else None)


def _random_program(seed: int) -> tuple[list[str], Callable[[Callable[[], None]], None]]:
    chooser = random.Random(seed)
    actions = [chooser.choice(_ACTIONS) for _ in range(30)]

    def program(after_each: Callable[[], None]) -> None:
        torch.manual_seed(seed)
        model, head, other = Block(), nn.Linear(4, 3), nn.Linear(4, 4)
        optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
        x = torch.randn(2, 4)
        out = None
        for action in actions:
            if action == "infer":
                with torch.no_grad():
                    model(x)
            elif action == "infer_head":
                with torch.no_grad():
                    head(model(x))
            elif action == "grad_call":
                model(x)
            elif action == "train":
                out = head(model(x)).sum()
            elif action == "backward" and out is not None:
                out.backward()
                out = None
            elif action == "optimizer":
                out = None  # a graph made before the parameters change cannot run backward after it
                optimizer.step()
            elif action == "zero_grad":
                optimizer.zero_grad()
            elif action == "other_model":
                with torch.no_grad():
                    other(x)
            after_each()

    return actions, program


@pytest.mark.parametrize("seed", range(12))
def test_c_applies_the_step_rule_as_python_states_it_event_by_event(c_module, monkeypatch, seed):
    """The step rule lives in xsp/record/steps.py (AutoSteps); the C wrapper decides its common
    cases itself. After every event of a random program (inference, heads joining, calls with
    autograd on, training, backward, optimizer steps, another model), the thread's step state
    is the same whichever decided it, and so are the spans."""
    from xsp.core import state as _state

    _, program = _random_program(seed)
    states: dict[bool, list[tuple[Any, ...]]] = {}
    spans: dict[bool, list[tuple[Any, ...]]] = {}
    for c in (True, False):
        seen: list[tuple[Any, ...]] = []
        with monkeypatch.context() as patch:
            if not c:
                patch.setattr(hotpath, "HOTPATH", None)
            with xsp.trace(levels="model,layer", output=None) as session:
                buffer = None

                def after_each(seen: list[tuple[Any, ...]] = seen) -> None:
                    nonlocal buffer
                    recording = _state.recording
                    if buffer is None and recording is not None:
                        buffer = next((b for b in recording.buffers if b.thread_id == threading.get_native_id()), None)
                    seen.append(_steps_state(buffer) if buffer is not None else ())

                program(after_each)
        states[c], spans[c] = seen, _structure(session.trace.spans)
    for event, (by_c, by_python) in enumerate(zip(states[True], states[False])):
        assert by_c == by_python, f"event {event}: C {by_c} != Python {by_python}"
    assert spans[True] == spans[False]


def test_a_slot_the_c_part_reads_that_python_renamed_is_refused_and_recorded_in_python(c_module, monkeypatch):
    """The C part finds each ThreadBuffer and AutoSteps slot by name and type: a slot renamed in
    Python without it is refused as the session starts, never read at a stale offset, and the
    calls are recorded by the Python wrapper (said once)."""
    from xsp.record.recording import ThreadBuffer

    renamed = type("ThreadBuffer", (), {"__slots__": tuple(name if name != "depth" else "call_depth"
                                                           for name in ThreadBuffer.__slots__)})
    monkeypatch.setattr(_module_calls, "ThreadBuffer", renamed)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.warns(xsp.XspWarning, match="C module-call wrapper does not match") as said:
        with xsp.trace(levels="model,layer", output=None) as session:
            model(torch.randn(2, 4))
    assert "depth" in str(said[0].message) and len(said) == 1  # said once, and nothing else went wrong
    spans = session.trace.spans
    assert (spans[col.KIND] == SpanKind.PREDICT.value).sum() == 1 and (spans[col.LEVEL] == "layer").sum() == 2
