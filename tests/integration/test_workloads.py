"""Every script of examples/workloads under ``xsp run``, as a user runs it: the same output, exit
code and warnings as a plain run, and a trace whose steps are the script's iterations."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import xsp
from xsp import analysis
from xsp.core import schema as col
from xsp.core.schema import SpanKind

pytestmark = pytest.mark.heavy  # the workload corpus under xsp run, in subprocesses: `python -m pytest -m heavy`

pytest.importorskip("transformers")

WORKLOADS = Path(__file__).resolve().parents[2] / "examples" / "workloads"
STEPS = {"mnist_train": 6, "hf_train": 3, "hf_generate": 2, "compile_inference": 5, "compile_train": 4,
         "jit_trace": 4, "jit_script": 4, "autocast_bf16": 3, "two_models": 4, "threaded_server": 12,
         "grad_accumulation": 6, "accumulate_dataloader": 3, "lbfgs_closure": 5, "checkpointing": 4,
         "quantized_inference": 4, "os_exit": 5, "process_pool": 6, "unjoined_workers": 6}


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *command], cwd=cwd, capture_output=True, text=True, timeout=600)


def own_lines(stderr: str) -> list[str]:
    """stderr without xsp's own lines (its summary and its warnings)."""
    return [line for line in stderr.splitlines() if not line.startswith(("xsp: ", "warning: "))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each workload run plainly and under ``xsp run``, once, on first use."""
    done: dict[str, tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str], xsp.Trace]] = {}

    def get(name: str):
        if name not in done:
            where = tmp_path_factory.mktemp(name)
            script, steps = str(WORKLOADS / f"{name}.py"), str(STEPS[name])
            plain = run(script, "--steps", steps, cwd=where)
            profiled = run("-m", "xsp", "run", "-o", "run.xsp.parquet", "--", script, "--steps", steps, cwd=where)
            done[name] = (plain, profiled, xsp.load(where / "run.xsp.parquet"))
        return done[name]

    return get


def test_every_workload_is_covered():
    assert sorted(p.stem for p in WORKLOADS.glob("*.py")) == sorted(STEPS)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_program_is_unchanged(runs, name):
    plain, profiled, _ = runs(name)
    assert plain.returncode == 0, plain.stderr
    assert profiled.returncode == plain.returncode, profiled.stderr
    assert profiled.stdout == plain.stdout
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)  # no new warnings, nothing else
    assert "warning:" not in profiled.stderr


def model_spans(trace: xsp.Trace, kind: SpanKind) -> pd.DataFrame:
    spans = trace.spans
    return spans[spans[col.LEVEL].isin(["model", "input"]) & (spans[col.KIND] == kind.value)]


def step_names(trace: xsp.Trace) -> list[str]:
    return analysis.model_latency(trace)["name"].tolist()


def parts_per_step(trace: xsp.Trace) -> pd.Series:
    model = trace.spans[trace.spans[col.LEVEL].isin(["model", "input"]) & trace.spans[col.STEP].notna()]
    return model.groupby(col.STEP)[col.KIND].apply(lambda kinds: sorted(set(kinds)))


def assert_whole_story(trace: xsp.Trace) -> None:
    """Every step's parts add up; no share exceeds the whole; the tree is consistent."""
    breakdown = analysis.step_breakdown(trace)
    parts = [f"{part}_ms" for part in ("forward", "backward", "optimizer", "input", "compile", "other")]
    assert np.allclose(breakdown[parts].sum(axis=1), breakdown["latency_ms"])
    if (trace.spans[col.LEVEL] == "layer").any():
        assert analysis.top_layers(trace, k=1000)["share"].sum() <= 1.0
    assert 0 < analysis.step_coverage(trace)["coverage"].iloc[0] <= 1.0
    assert trace.metadata["hierarchy"]["overlapping"] == 0
    assert trace.metadata["dropped"] == {}


def check_mnist_train(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["train_step"] * 6
    for parts in parts_per_step(trace):
        assert {"input", "predict", "backward", "optimizer"} <= set(parts)
    waits = model_spans(trace, SpanKind.INPUT)
    loader = json.loads(waits[col.ATTRIBUTES].iloc[0])  # the loader's settings, as the advice reads them
    assert loader[col.ATTR_INPUT_WORKERS] == 2 and loader[col.ATTR_INPUT_PREFETCH_FACTOR] == 2
    assert loader[col.ATTR_INPUT_PERSISTENT_WORKERS] is False
    # the two workers' fetches, each in its process, below a process span of the worker
    fetches = trace.spans[trace.spans[col.KIND] == SpanKind.FETCH.value]
    assert len(fetches) >= 6 and fetches[col.PROCESS_ID].nunique() == 2 and fetches[col.STEP].isna().all()
    assert {json.loads(a)["xsp.input.worker"] for a in fetches[col.ATTRIBUTES]} == {0, 1}
    calls = model_spans(trace, SpanKind.PREDICT)
    assert set(calls[col.NAME]) == {"model", "criterion"}
    backward = trace.spans[(trace.spans[col.LEVEL] == "layer") & (trace.spans[col.KIND] == "backward")]
    assert backward[col.STEP].notna().all() and "model.conv1.backward" in set(backward[col.NAME])


def check_process_pool(trace: xsp.Trace) -> None:
    # every request is scored in a worker process (spawned): a step of that process, in the run's trace
    calls = model_spans(trace, SpanKind.PREDICT)
    assert len(calls) == len(analysis.model_latency(trace)) == 6
    assert calls[col.PROCESS_ID].notna().all() and 1 <= calls[col.PROCESS_ID].nunique() <= 2
    processes = trace.spans[trace.spans[col.KIND] == SpanKind.PROCESS.value]
    session = trace.spans[trace.spans[col.KIND] == SpanKind.SESSION.value]
    assert set(processes[col.PARENT_ID]) == set(session[col.SPAN_ID])
    assert set(calls[col.PROCESS_ID]) <= set(processes[col.PROCESS_ID])
    assert trace.metadata["child_processes"]["untraced"] == {}


def check_hf_train(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["train_step"] * 3
    assert set(model_spans(trace, SpanKind.OPTIMIZER)[col.NAME]) == {"AdamW.step"}
    layers = set(trace.spans[trace.spans[col.LEVEL] == "layer"][col.NAME])
    assert {"model.bert.encoder.layer.0.attention.self", "model.bert.encoder.layer.0.attention.self.backward"} <= layers


def check_hf_generate(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["model.generate"] * 2
    calls = model_spans(trace, SpanKind.PREDICT)
    tokens = [json.loads(a)["xsp.generate.token_index"] for a in calls[col.ATTRIBUTES]]
    assert tokens == list(range(6)) * 2
    assert calls[col.PARENT_ID].isin(trace.spans[col.SPAN_ID]).all()


def check_compile_inference(trace: xsp.Trace) -> None:
    latency = analysis.model_latency(trace)
    assert latency["name"].tolist() == ["compiled"] * 6  # the warm-up call, then the loop
    assert latency["compile_ms"].iloc[0] > 0 and (latency["compile_ms"].iloc[1:] == 0).all()
    assert not (trace.spans[col.LEVEL] == "layer").any()  # a compiled call is one span
    assert set(model_spans(trace, SpanKind.COMPILE)[col.STEP]) == {0}


def check_compile_train(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["train_step"] * 5  # the warm-up forward and backward, then the loop
    assert set(model_spans(trace, SpanKind.COMPILE)[col.STEP]) == {0}
    assert (analysis.model_latency(trace)["compile_ms"].iloc[1:] == 0).all()
    for parts in parts_per_step(trace).iloc[1:]:
        assert {"predict", "backward", "optimizer"} <= set(parts)


def check_jit_trace(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["inference_step"] * 4
    calls = model_spans(trace, SpanKind.PREDICT)
    assert calls[col.NAME].tolist() == ["traced", "traced_ng"] * 4
    assert set(calls[col.MODULE_TYPE]) == {"SmallCNN"}


def check_jit_script(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["scripted"] * 4
    assert not (trace.spans[col.LEVEL] == "layer").any()


def check_autocast_bf16(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["model", "train_step"] * 3  # evaluation and training, apart
    training = [json.loads(a)["xsp.model.training"] for a in model_spans(trace, SpanKind.PREDICT)[col.ATTRIBUTES]
                if "xsp.model.training" in a]
    assert training[:2] == [False, True]


def check_two_models(trace: xsp.Trace) -> None:
    assert step_names(trace) == ["inference_step"] * 4
    assert model_spans(trace, SpanKind.PREDICT)[col.NAME].tolist() == ["encoder", "head"] * 4
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"][col.NAME]
    assert layers.str.startswith(("encoder.", "head.")).all()


def check_threaded_server(trace: xsp.Trace) -> None:
    calls = model_spans(trace, SpanKind.PREDICT)
    assert len(analysis.model_latency(trace)) == len(calls) == 12
    session = trace.spans[trace.spans[col.KIND] == SpanKind.SESSION.value][col.THREAD_ID].iloc[0]
    assert (calls[col.THREAD_ID] != session).all()  # each request a step of the worker that served it
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"]
    by_id = trace.spans.set_index(col.SPAN_ID)
    assert (by_id.loc[layers[col.PARENT_ID].astype("int64"), col.THREAD_ID].to_numpy()
            == layers[col.THREAD_ID].to_numpy()).all()


def check_unjoined_workers(trace: xsp.Trace) -> None:
    # every request was scored after the main thread had ended: the trace went on until the workers did
    calls = model_spans(trace, SpanKind.PREDICT)
    assert len(analysis.model_latency(trace)) == len(calls) == 6
    session = trace.spans[trace.spans[col.KIND] == SpanKind.SESSION.value]
    assert (calls[col.THREAD_ID] != session[col.THREAD_ID].iloc[0]).all()  # each a step of a worker
    assert (calls[col.END_NS] <= session[col.END_NS].iloc[0]).all()


def forwards_per_step(trace: xsp.Trace, name: str) -> list[int]:
    calls = model_spans(trace, SpanKind.PREDICT)
    return calls[calls[col.NAME] == name].groupby(col.STEP).size().tolist()


def check_grad_accumulation(trace: xsp.Trace) -> None:
    # 6 optimizer steps of 4 micro-batches of 16: every step holds its 4 forwards, the first one too
    assert step_names(trace) == ["train_step"] * 6
    assert forwards_per_step(trace, "model") == [4] * 6
    assert model_spans(trace, SpanKind.OPTIMIZER).groupby(col.STEP).size().tolist() == [1] * 6
    latency = analysis.model_latency(trace)
    assert latency["batch_size"].tolist() == [64] * 6  # the samples of the step, not of one forward
    assert np.allclose(latency["throughput_per_s"], 64 / (latency["latency_ms"] / 1e3))


def check_accumulate_dataloader(trace: xsp.Trace) -> None:
    # 3 AdamW steps of 2 DataLoader batches of 16: every step holds both batches' waits, forwards
    # and backwards, the first one too; the loop's last next() (StopIteration) begins no step
    assert step_names(trace) == ["train_step"] * 3
    assert forwards_per_step(trace, "model") == [2] * 3
    assert model_spans(trace, SpanKind.BACKWARD).groupby(col.STEP).size().tolist() == [2] * 3
    assert model_spans(trace, SpanKind.OPTIMIZER).groupby(col.STEP).size().tolist() == [1] * 3
    waits = model_spans(trace, SpanKind.INPUT)
    waits = waits[waits[col.NAME] == "DataLoader.__next__"]
    assert waits.groupby(col.STEP).size().tolist() == [2] * 3 and waits[col.STEP].isna().sum() == 1
    assert analysis.model_latency(trace)["batch_size"].tolist() == [32] * 3


def check_lbfgs_closure(trace: xsp.Trace) -> None:
    # one step per optimizer.step(closure), the closure's forwards and backwards inside it, counted once
    assert step_names(trace) == ["train_step"] * 5
    optimizer = model_spans(trace, SpanKind.OPTIMIZER)
    assert optimizer.groupby(col.STEP).size().tolist() == [1] * 5 and set(optimizer[col.NAME]) == {"LBFGS.step"}
    calls = model_spans(trace, SpanKind.PREDICT)
    closures = model_spans(trace, SpanKind.USER)
    assert set(closures[col.NAME]) == {"LBFGS.step.closure"}  # each run of the closure: the program's code
    assert closures[col.PARENT_ID].isin(optimizer[col.SPAN_ID]).all()
    assert calls[col.PARENT_ID].isin(closures[col.SPAN_ID]).all()  # every forward is the closure's
    assert sum(forwards_per_step(trace, "model")) >= 5
    assert analysis.model_latency(trace)["batch_size"].tolist() == [256] * 5
    breakdown = analysis.step_breakdown(trace)
    parts = breakdown[["forward_ms", "backward_ms", "optimizer_ms"]].sum(axis=1)
    assert (parts <= breakdown["latency_ms"] + 1e-9).all()


def check_checkpointing(trace: xsp.Trace) -> None:
    # the recomputation is the blocks' own, inside the backward: no new models, no errors
    assert step_names(trace) == ["train_step"] * 4
    assert set(model_spans(trace, SpanKind.PREDICT)[col.NAME]) == {"model"}
    assert (trace.spans[col.STATUS] == "ok").all()
    recompute = trace.spans[trace.spans[col.KIND] == SpanKind.RECOMPUTE.value]
    assert set(recompute[col.NAME]) >= {f"model.blocks.{i}" for i in range(4)}
    assert recompute.groupby(col.STEP).size().nunique() == 1 and len(recompute) > 0
    backward = trace.spans[trace.spans[col.KIND] == SpanKind.BACKWARD.value]
    in_backward = [_inside(trace, row, backward) for row in recompute.itertuples()]
    assert all(in_backward)


def _inside(trace: xsp.Trace, row, containers: pd.DataFrame) -> bool:
    return bool(((containers[col.START_NS] <= getattr(row, col.START_NS)) & (containers[col.END_NS] >= getattr(
        row, col.END_NS)) & (containers[col.STEP] == getattr(row, col.STEP))).any())


def check_quantized_inference(trace: xsp.Trace) -> None:
    # quantize_dynamic's observers are no models, and its conversion no step
    assert step_names(trace) == ["model"] * 4 + ["quantized"] * 4
    types = analysis.layer_type_summary(trace).set_index("module_type")
    assert types.loc["Linear", "calls"] == types.loc["Linear (torch.ao.nn.quantized.dynamic)", "calls"] == 3 * 4


def check_os_exit(trace: xsp.Trace) -> None:
    # the program ended by os._exit(0): its session ended there, and the file holds every step
    assert step_names(trace) == ["model"] * 5
    assert trace.metadata["ended_by"] == "os._exit(0)"


CHECKS: dict[str, Callable[[xsp.Trace], None]] = {name: globals()[f"check_{name}"] for name in STEPS}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_the_trace_tells_what_the_script_did(runs, name):
    _, _, trace = runs(name)
    CHECKS[name](trace)
    assert_whole_story(trace)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_line_the_trace_names_is_a_line_of_the_users_code(runs, name):
    """Call sites under ``xsp run``: every line a span names exists, holds code, and lies in the
    workload's own file or another file of the user's (never a library's)."""
    _, _, trace = runs(name)
    found = analysis.lines(trace)
    script = WORKLOADS / f"{name}.py"
    assert len(found), name
    assert str(script) in set(found["file"])
    for file, line in zip(found["file"], found["line"]):
        assert "site-packages" not in file and "/torch/" not in file, (name, file)
        text = Path(file).read_text().splitlines()
        assert 1 <= line <= len(text) and text[line - 1].strip(), (name, file, line)
        assert not text[line - 1].strip().startswith(("#", "def ", "class ")), (name, file, line, text[line - 1])


def test_reentrant_checkpointing_is_told_as_the_other_kind(tmp_path):
    script = str(WORKLOADS / "checkpointing.py")
    plain = run(script, "--steps", "4", "--reentrant", cwd=tmp_path)
    profiled = run("-m", "xsp", "run", "-o", "run.xsp.parquet", "--", script, "--steps", "4", "--reentrant",
                   cwd=tmp_path)
    assert profiled.returncode == plain.returncode == 0, profiled.stderr
    assert profiled.stdout == plain.stdout
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    check_checkpointing(trace)
    # the reentrant implementation runs a backward pass of its own per block: part of the step's one
    assert model_spans(trace, SpanKind.BACKWARD).groupby(col.STEP).size().tolist() == [1] * 4
    assert_whole_story(trace)


OPERATOR_LINE_WORKLOADS = ("mnist_train", "lbfgs_closure", "threaded_server", "compile_inference", "jit_script",
                           "checkpointing", "accumulate_dataloader", "two_models")
"""Patterns whose operators come from the user's lines in different ways: a training loop, a
closure optimizer, threads, compiled and scripted code, recomputation, a DataLoader."""


@pytest.mark.parametrize("name", OPERATOR_LINE_WORKLOADS)
def test_operators_carry_lines_of_the_users_code_under_xsp_run(tmp_path, runs, name):
    """At the operator level: the program is unchanged, every operator that ran on a thread of
    the user's Python has a line, and every line is a line of code in the user's files."""
    plain, _, _ = runs(name)
    script = str(WORKLOADS / f"{name}.py")
    profiled = run("-m", "xsp", "run", "--levels", "model,layer,operator", "-o", "ops.xsp.parquet", "--", script,
                   "--steps", str(STEPS[name]), cwd=tmp_path)
    assert profiled.returncode == plain.returncode, profiled.stderr
    assert profiled.stdout == plain.stdout
    assert "carry no line" not in profiled.stderr
    trace = xsp.load(tmp_path / "ops.xsp.parquet")
    spans = trace.spans
    ops = spans[spans[col.LEVEL] == "operator"]
    python_threads = spans.loc[spans[col.LEVEL] != "operator", col.THREAD_ID].dropna().unique()
    mine = ops[ops[col.THREAD_ID].isin(python_threads)]
    assert len(mine) and mine[col.CALL_LINE].notna().mean() >= 0.95, (name, mine[mine[col.CALL_LINE].isna()][col.NAME]
                                                                      .value_counts().head())
    located = ops.dropna(subset=[col.CALL_FILE, col.CALL_LINE])
    files = set(located[col.CALL_FILE])
    assert str(WORKLOADS / f"{name}.py") in files, (name, files)
    for file, line in set(zip(located[col.CALL_FILE], located[col.CALL_LINE].astype(int))):
        assert "site-packages" not in file and "/torch/" not in file, (name, file)
        if file.startswith("<"):  # code made with exec (a dataclass's __init__...): no file to read
            continue
        text = Path(file).read_text().splitlines()
        assert 1 <= line <= len(text) and text[line - 1].strip(), (name, file, line)


NVTX_WORKLOADS = ("mnist_train", "threaded_server", "checkpointing", "compile_inference", "jit_trace", "hf_train",
                  "two_models", "lbfgs_closure", "os_exit")


@pytest.fixture(scope="module")
def nvtx_recorder(tmp_path_factory):
    from tests import nvtx_tool

    return nvtx_tool.build(tmp_path_factory.mktemp("nvtx_tool"))


@pytest.mark.parametrize("name", NVTX_WORKLOADS)
def test_nvtx_ranges_under_xsp_run_leave_the_program_unchanged_and_every_range_closed(tmp_path, runs, nvtx_recorder,
                                                                                     name):
    """``xsp run --nvtx`` with an NVTX tool attached (as Nsight attaches): the same output and exit
    status, every range pushed is popped on its thread, and every range names a span of the trace."""
    import os

    from tests import nvtx_tool

    plain, _, _ = runs(name)
    record = tmp_path / "ranges.tsv"
    env = {**os.environ, "NVTX_INJECTION64_PATH": str(nvtx_recorder), "XSP_NVTX_RECORD": str(record)}
    script = str(WORKLOADS / f"{name}.py")
    profiled = subprocess.run([sys.executable, "-m", "xsp", "run", "--nvtx", "-o", "nvtx.xsp.parquet", "--", script,
                               "--steps", str(STEPS[name])], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)
    assert profiled.returncode == plain.returncode, profiled.stderr
    assert profiled.stdout == plain.stdout
    assert "warning:" not in profiled.stderr
    if name == "os_exit":  # os._exit ends the process at once: the tool never writes what it recorded
        return
    recorded = nvtx_tool.read(record)
    assert not recorded.problems and len(recorded.ranges), (name, recorded.problems)
    assert not recorded.unpopped, (name, recorded.unpopped)
    names = set(xsp.load(tmp_path / "nvtx.xsp.parquet").spans[col.NAME])
    assert {r.name for r in recorded.ranges} <= names, (name, {r.name for r in recorded.ranges} - names)
