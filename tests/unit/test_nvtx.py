"""NVTX ranges out (xsp.trace(nvtx=True), xsp run --nvtx), checked by a tool that NVTX loads the way
it loads Nsight Systems: the ranges must nest exactly as the span tree, on every thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

import xsp
from tests import nvtx_tool
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.record import nvtx

AUTOMATIC_STEPS = {"train_step", "inference_step"}


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nvtx_tool.build(tmp_path_factory.mktemp("nvtx_tool"))


def run_under_tool(recorder: Path, folder: Path, body: str, script_args: tuple[str, ...] = ()) -> tuple[
        nvtx_tool.Recorded, xsp.Trace, subprocess.CompletedProcess[str]]:
    """Run ``body`` (a script that writes its trace to sys.argv[1]) in a fresh process with the tool
    attached; what the tool recorded, the trace, and the process."""
    script = folder / "job.py"
    script.write_text(textwrap.dedent(body))
    record, trace_path = folder / "ranges.tsv", folder / "job.xsp.parquet"
    env = {**os.environ, nvtx.INJECTION_VARIABLE: str(recorder), "XSP_NVTX_RECORD": str(record)}
    env.pop(nvtx.NVTX_VARIABLE, None)
    command = [sys.executable, str(script), str(trace_path), *script_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return nvtx_tool.read(record), xsp.load(trace_path), done


def expected_tree(spans: pd.DataFrame) -> Counter[tuple[int, str, str | None]]:
    """(thread, name, name of the innermost range around it) of every span that pushes a range:
    model calls, user spans, explicit steps, layer calls, and leaf layers' backward. The span
    around one is found by inclusion on its thread, as a push inside another is: a user span
    inside a layer's forward is inside that layer's range (the span table keeps it a child of
    the model call, at the model level); every other span's parent is the one the table gives."""
    kind, level, name = spans[col.KIND], spans[col.LEVEL], spans[col.NAME]
    forward = kind == SpanKind.FORWARD.value
    ids = dict(zip(spans[col.SPAN_ID].tolist(), range(len(spans))))
    parent_rows = [ids.get(p) if pd.notna(p) else None for p in spans[col.PARENT_ID].tolist()]
    with_children = {name.iloc[p] for p, f in zip(parent_rows, forward.tolist()) if f and p is not None}
    leaves = set(name[forward | (kind == SpanKind.PREDICT.value)]) - with_children  # a loss module is a leaf model
    backward_leaf = ((kind == SpanKind.BACKWARD.value) & (level == Level.LAYER.value)
                     & name.str.removesuffix(".backward").isin(leaves))
    model_level = kind.isin([SpanKind.PREDICT.value, SpanKind.USER.value, SpanKind.STEP.value]) & ~name.isin(
        AUTOMATIC_STEPS)
    ranged = spans[(model_level | forward | backward_leaf).to_numpy()]
    tree: Counter[tuple[int, str, str | None]] = Counter()
    for thread, rows in ranged.groupby(col.THREAD_ID, sort=False):
        ordered = rows.assign(length=rows[col.END_NS] - rows[col.START_NS]).sort_values(
            [col.START_NS, "length"], ascending=[True, False], kind="stable")
        stack: list[tuple[int, int, str]] = []
        for start, end, span_name in zip(ordered[col.START_NS], ordered[col.END_NS], ordered[col.NAME]):
            while stack and not (stack[-1][0] <= start and end <= stack[-1][1]):
                stack.pop()
            tree[(int(thread), span_name, stack[-1][2] if stack else None)] += 1
            stack.append((start, end, span_name))
    return tree


def assert_same_tree(recorded: nvtx_tool.Recorded, trace: xsp.Trace) -> None:
    assert not recorded.problems, recorded.problems
    assert not recorded.unpopped, recorded.unpopped
    assert recorded.domains == ["xsp"]
    expected = expected_tree(trace.spans)
    assert sum(expected.values()) > 0
    assert recorded.tree() == expected, (recorded.tree() - expected, expected - recorded.tree())


@pytest.mark.parametrize("wrapper", ["c", pytest.param("python", marks=pytest.mark.heavy)])
def test_inference_ranges_nest_as_the_span_tree_on_every_thread(recorder: Path, tmp_path: Path, wrapper: str) -> None:
    recorded, trace, _ = run_under_tool(recorder, tmp_path, """
        import sys, threading, torch, xsp
        import xsp.record.hotpath
        if sys.argv[2] == "python":
            xsp.record.hotpath.HOTPATH = None  # every call through the Python wrapper
        from torch import nn
        torch.set_num_threads(1)
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.act = nn.Linear(8, 8), nn.ReLU()
            def forward(self, x):
                with xsp.span("inside_forward"):
                    return self.act(self.fc(x))
        model = nn.Sequential(Block(), Block(), nn.Linear(8, 2)).eval()
        other = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
        x = torch.randn(4, 8)
        def worker():
            with torch.no_grad():
                for _ in range(5):
                    other(x)
        with xsp.trace(levels="model,layer", output=sys.argv[1], nvtx=True):
            thread = threading.Thread(target=worker)
            thread.start()
            with torch.no_grad():
                for i in range(6):
                    with xsp.step("request"):
                        with xsp.span("preprocess"):
                            y = x * 2
                        model(y)
            thread.join()
    """, script_args=(wrapper,))
    assert_same_tree(recorded, trace)
    names = {r.name for r in recorded.ranges}
    assert {"request", "preprocess", "model", "model.0.fc", "inside_forward", "other", "other.1"} <= names
    assert len({r.thread for r in recorded.ranges}) == 2
    assert trace.metadata["nvtx"]["domain"] == "xsp"
    assert trace.metadata["nvtx"]["tool"] == str(recorder)


@pytest.mark.heavy
def test_training_ranges_include_each_leaf_layers_backward(recorder: Path, tmp_path: Path) -> None:
    recorded, trace, _ = run_under_tool(recorder, tmp_path, """
        import sys, torch, xsp
        from torch import nn
        torch.set_num_threads(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.GELU()),
                              nn.Linear(16, 1))
        loss_fn = nn.MSELoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        with xsp.trace(levels="model,layer", output=sys.argv[1], nvtx=True):
            for _ in range(4):
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
    """)
    assert_same_tree(recorded, trace)
    names = Counter(r.name for r in recorded.ranges)
    assert names["model.0.backward"] == 4 and names["model.2.0.backward"] == 4
    assert names["model.2.backward"] == 0  # a container's backward is known only after its children's


@pytest.mark.heavy
def test_an_exception_inside_a_layer_pops_every_range(recorder: Path, tmp_path: Path) -> None:
    recorded, trace, _ = run_under_tool(recorder, tmp_path, """
        import sys, torch, xsp
        from torch import nn
        class Fails(nn.Module):
            def forward(self, x):
                if x.shape[0] == 3:
                    raise ValueError("bad batch")
                return x
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Fails(), nn.ReLU()))
        with xsp.trace(levels="model,layer", output=sys.argv[1], nvtx=True):
            for batch in (2, 3, 2, 3, 2):
                try:
                    with xsp.span("call"):
                        model(torch.randn(batch, 4))
                except ValueError:
                    pass
    """)
    assert_same_tree(recorded, trace)
    assert Counter(r.name for r in recorded.ranges)["model.1.0"] == 5
    assert (trace.spans[col.STATUS] == col.Status.ERROR.value).any()


@pytest.mark.heavy
def test_xsp_run_nvtx_and_the_variable_turn_ranges_on_with_no_code_change(recorder: Path, tmp_path: Path) -> None:
    body = """
        import torch
        from torch import nn
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        for _ in range(3):
            model(torch.randn(2, 4))
        print("done")
    """
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, nvtx.INJECTION_VARIABLE: str(recorder)}
    for flag, extra in ((["--nvtx"], {}), ([], {nvtx.NVTX_VARIABLE: "1"})):
        record = tmp_path / f"ranges{len(flag)}.tsv"
        done = subprocess.run([sys.executable, "-m", "xsp", "run", *flag, "-o", str(tmp_path / "plain.xsp.parquet"),
                               "--", str(script)], env={**env, **extra, "XSP_NVTX_RECORD": str(record)},
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[0] == "done"
        recorded = nvtx_tool.read(record)
        assert_same_tree(recorded, xsp.load(tmp_path / "plain.xsp.parquet"))
        assert Counter(r.name for r in recorded.ranges) == {"model": 3, "model.0": 3, "model.1": 3}


def test_without_a_tool_nothing_is_loaded_and_the_session_says_so(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv(nvtx.INJECTION_VARIABLE, raising=False)
    model = torch.nn.Linear(2, 2)
    with pytest.warns(xsp.XspWarning, match="no NVTX tool is attached"):
        with xsp.trace(output=None, nvtx=True) as session:
            model(torch.randn(1, 2))
    assert session.trace is not None and session.trace.metadata["nvtx"] is None
    assert session.recording is not None and session.recording.nvtx is None


def test_nvtx_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(nvtx.NVTX_VARIABLE, raising=False)
    assert not nvtx.wanted(None) and nvtx.wanted(True)
    monkeypatch.setenv(nvtx.NVTX_VARIABLE, "1")
    assert nvtx.wanted(None) and not nvtx.wanted(False)


def test_the_library_is_found_in_the_nvidia_wheel_or_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(nvtx.LIBRARY_VARIABLE, str(tmp_path / "mine.so"))
    assert nvtx.find_library() == str(tmp_path / "mine.so")
    monkeypatch.delenv(nvtx.LIBRARY_VARIABLE)
    found = nvtx.find_library()
    if nvtx_tool.nvtx_headers() is not None and found is None:
        pytest.fail("nvidia-nvtx-cu12 is installed (its headers are) but its library was not found")


def nsight_export(recorded: nvtx_tool.Recorded, path: Path) -> Path:
    """An Nsight Systems SQLite export of what the tool saw, as ``nsys export`` writes one: each
    push/pop range an ``NVTX_EVENTS`` row (type 59) with its domain, category, text and thread."""
    import sqlite3

    from tests.unit.test_nsys_import import SCHEMA
    from xsp.io.nsys import NVTX_DOMAIN_CREATE, NVTX_PUSH_POP

    pid, domain_id = 4242, 1
    connection = sqlite3.connect(path)
    for table, columns in SCHEMA.items():
        connection.execute(f"create table {table} ({columns})")
    connection.executemany("insert into EXPORT_META_DATA values (?, ?)", [
        ("EXPORT_SCHEMA_VERSION", "3.0.0"), ("EXPORT_SCHEMA_VERSION_MAJOR", "3"),
        ("EXPORT_SCHEMA_VERSION_MINOR", "0"), ("EXPORT_SCHEMA_VERSION_MICRO", "0")])
    connection.execute("insert into TARGET_INFO_SESSION_START_TIME values (?, ?, ?)",
                       (1_700_000_000_000_000_000, "", ""))
    base_ns = min(r.start_ns for r in recorded.ranges)
    rows = [(0, None, NVTX_DOMAIN_CREATE, None, None, None, "xsp", pid << 24 | recorded.ranges[0].thread, None, None,
             domain_id)]
    rows += [(r.start_ns - base_ns, r.end_ns - base_ns, NVTX_PUSH_POP, None, r.category, None, r.name,
              pid << 24 | r.thread, None, None, domain_id) for r in recorded.ranges]
    connection.executemany("insert into NVTX_EVENTS values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    connection.commit()
    connection.close()
    return path


@pytest.mark.heavy
def test_an_nsight_export_of_the_ranges_gives_the_spans_back(recorder: Path, tmp_path: Path) -> None:
    recorded, trace, _ = run_under_tool(recorder, tmp_path, """
        import sys, torch, xsp
        from torch import nn
        torch.set_num_threads(1)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.GELU()))
        x = torch.randn(4, 8)
        with xsp.trace(levels="model,layer", output=sys.argv[1], nvtx=True):
            for _ in range(3):
                with xsp.step("train"):
                    with xsp.span("load"):
                        pass
                    model(x).sum().backward()
    """)
    assert_same_tree(recorded, trace)
    imported = xsp.load(nsight_export(recorded, tmp_path / "report.sqlite")).spans
    imported = imported[imported[col.NAME] != "session"]
    spans = trace.spans
    original = spans[spans[col.NAME].isin({r.name for r in recorded.ranges})
                     & ~((spans[col.KIND] == SpanKind.BACKWARD.value) & (spans[col.LEVEL] == Level.MODEL.value))]
    assert Counter(zip(imported[col.NAME], imported[col.LEVEL], imported[col.KIND])) == Counter(
        zip(original[col.NAME], original[col.LEVEL], original[col.KIND]))
    assert expected_tree(imported) == recorded.tree()


def test_ranges_that_need_not_nest_start_and_end_by_id_on_any_thread(recorder: Path, tmp_path: Path) -> None:
    script = tmp_path / "ranges.py"
    script.write_text(textwrap.dedent("""
        import threading
        from xsp.record import nvtx
        ranges, why = nvtx.open_ranges()
        assert ranges is not None, why
        first = ranges.start(ranges.message("step", nvtx.RangeKind.STEP))
        second = ranges.start(ranges.message("prefetch", nvtx.RangeKind.USER))
        ranges.end(first)  # not the innermost: start/end ranges need not nest
        thread = threading.Thread(target=ranges.end, args=(second,))  # and may end on another thread
        thread.start(); thread.join()
    """))
    record = tmp_path / "ranges.tsv"
    env = {**os.environ, nvtx.INJECTION_VARIABLE: str(recorder), "XSP_NVTX_RECORD": str(record)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    recorded = nvtx_tool.read(record)
    assert not recorded.problems and len(recorded.started) == 2
    assert len({thread for thread, _ in recorded.started}) == 2
