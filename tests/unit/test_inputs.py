"""The input level: waits for data, the batch's host-to-device copy, and Kineto's DataLoader
annotations."""

from __future__ import annotations

import gzip
import json

import numpy as np

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp import analysis
from xsp.core import schema as col


def loop_on_a_gpu():
    """Two steps. Each: a wait (with workers and pinning recorded), the loop's copy of the batch
    (two HtoD copies launched before the model call), the model call launching a kernel and an
    HtoD copy of its own (a weight upload: not the batch), then a DtoH copy after the call."""
    attributes = {col.ATTRIBUTES: json.dumps({col.ATTR_INPUT_WORKERS: 4, col.ATTR_INPUT_PIN_MEMORY: True})}
    rows, next_id = [], 1
    for step, base in ((0, 0), (1, 1000)):
        step_id = next_id
        rows += [(step_id, None, "model", "step", "train_step", base, base + 900, {"step": step}),
                 (step_id + 1, step_id, "input", "input", "DataLoader.__next__", base, base + 100,
                  {"step": step, **attributes}),
                 (step_id + 2, step_id, "cuda_api", "runtime", "cudaMemcpyAsync", base + 110, base + 115,
                  {"step": step}),
                 (step_id + 3, step_id + 2, "kernel", "memcpy", "Memcpy HtoD (Pinned -> Device)", base + 120,
                  base + 150, {"step": step, col.COPY_KIND: "HtoD", col.BYTES: 4096, col.CORRELATION_ID: step_id}),
                 (step_id + 4, step_id, "cuda_api", "runtime", "cudaMemcpyAsync", base + 116, base + 118,
                  {"step": step}),
                 (step_id + 5, step_id + 4, "kernel", "memcpy", "Memcpy HtoD (Pinned -> Device)", base + 150,
                  base + 160, {"step": step, col.COPY_KIND: "HtoD", col.BYTES: 1024,
                               col.CORRELATION_ID: step_id + 100}),
                 (step_id + 6, step_id, "model", "predict", "net", base + 200, base + 700, {"step": step}),
                 (step_id + 7, step_id + 6, "cuda_api", "runtime", "cudaMemcpyAsync", base + 210, base + 215,
                  {"step": step}),
                 (step_id + 8, step_id + 7, "kernel", "memcpy", "Memcpy HtoD (Pageable -> Device)", base + 220,
                  base + 300, {"step": step, col.COPY_KIND: "HtoD", col.BYTES: 99, col.CORRELATION_ID: step_id + 200}),
                 (step_id + 9, step_id, "cuda_api", "runtime", "cudaMemcpyAsync", base + 710, base + 720,
                  {"step": step}),
                 (step_id + 10, step_id + 9, "kernel", "memcpy", "Memcpy DtoH (Device -> Pageable)", base + 720,
                  base + 730, {"step": step, col.COPY_KIND: "DtoH", col.BYTES: 8, col.CORRELATION_ID: step_id + 300})]
        next_id += 11
    return make_trace(rows)


def test_each_wait_carries_the_loader_settings_and_its_batch_copy():
    waits = analysis.input_waits(loop_on_a_gpu())
    assert waits["step"].tolist() == [0, 1] and str(waits["step"].dtype) == "Int64"
    assert str(waits["thread_id"].dtype) == "Int64"
    assert np.allclose(waits["wait_ms"], 0.1)
    assert waits["num_workers"].tolist() == [4, 4] and waits["pin_memory"].tolist() == [True, True]
    # the two copies launched between the wait and the model call; not the model's own upload
    # nor the copy back after it
    assert waits["copies"].tolist() == [2, 2]
    assert waits["copy_bytes"].tolist() == [5120, 5120]
    assert np.allclose(waits["copy_ms"], 0.04)


def test_the_input_per_step_is_in_the_model_latency():
    trace = loop_on_a_gpu()
    latency = analysis.model_latency(trace)
    assert np.allclose(latency["input_ms"], 0.1)
    per_step = analysis.input_per_step(trace)
    assert per_step["waits"].tolist() == [1, 1] and np.allclose(per_step["input_copy_ms"], 0.04)


def test_a_trace_without_waits_has_an_empty_table_with_the_columns():
    rows = [(1, None, "model", "step", "s", 0, 10, {}), (2, 1, "model", "predict", "net", 0, 10, {})]
    trace = make_trace(rows)
    assert analysis.input_waits(trace).empty
    assert list(analysis.input_waits(trace).columns) == list(analysis.inputs.INPUT_COLUMNS)
    assert analysis.model_latency(trace)["input_ms"].tolist() == [0.0]


def test_kineto_dataloader_annotations_are_input_waits(tmp_path):
    def event(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [event("ProfilerStep#3", 0, 100), event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                                                     1, 30), event("forward", 40, 50)]
    path = tmp_path / "loop.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    trace = xsp.load(path)
    waits = trace.spans[trace.spans[col.KIND] == "input"]
    assert waits[col.LEVEL].tolist() == ["input"] and waits[col.STEP].tolist() == [3]
    assert analysis.model_latency(trace)["input_ms"].tolist() == [0.03]
    assert analysis.input_waits(trace)["num_workers"].isna().all()


def test_windows_are_handed_over_after_a_dataloader_wait_never_during_it(tmp_path, monkeypatch):
    """A window's hand-off (and the helper it forks) inside ``next()`` would lengthen the very
    wait the input analyses judge: a window due then waits for the wait's end; an empty one is
    never handed over at all."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import xsp.session.options

    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)  # a window due at every step end
    taken: list[tuple[int, bool]] = []
    released: list[int] = []
    worker_class = xsp.session.windows.WindowWorker
    close_window, release_held = worker_class.close_window, worker_class.release_held

    def spy_close(worker, hold=False):
        taken.append((worker.recording.buffer().input_waits, hold))
        close_window(worker, hold)

    def spy_release(worker):
        released.append(worker.recording.buffer().input_waits)
        release_held(worker)

    monkeypatch.setattr(xsp.session.windows.WindowWorker, "close_window", spy_close)
    monkeypatch.setattr(xsp.session.windows.WindowWorker, "release_held", spy_release)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    assert all(hold == (waits > 0) for waits, hold in taken)  # taken inside a wait: held
    assert sum(hold for _, hold in taken) >= 6  # the steps' ends came inside next()
    assert len(released) >= 6 and not any(released)  # handed over once the wait was over
    assert session.trace.metadata["closed_windows"] >= 6
    assert len(session.trace.steps) == 8
    waits = session.trace.spans[session.trace.spans[col.KIND] == "input"]
    assert waits[col.STEP].notna().sum() == 9  # __iter__ and the first next() are step 0's


def test_an_empty_window_is_not_handed_over(tmp_path, monkeypatch):
    import torch

    import xsp.session.options

    monkeypatch.setattr(xsp.session.options, "WINDOW_S", 0.0)
    model = torch.nn.Linear(4, 1)
    with xsp.trace(output=tmp_path / "run.xsp.parquet") as session:
        model(torch.randn(2, 4))
        worker = session.run.windows
        before = worker.closed_windows
        worker.close_window()  # nothing recorded since the last one: nothing to interpret
        assert worker.closed_windows == before


def test_each_dataloader_worker_is_summed_from_its_fetches():
    """Two worker processes (times in µs): worker 0 fetches 3 batches of 16 back to back (busy all its time),
    worker 1 two batches 10 ms apart, the second of which raised."""
    worker = {0: json.dumps({col.ATTR_INPUT_WORKER: 0}), 1: json.dumps({col.ATTR_INPUT_WORKER: 1})}
    rows = [(1, None, "model", "process", "DataLoader worker 0", 0, 3_000, {col.PROCESS_ID: 700, "step": None}),
            (2, None, "model", "process", "DataLoader worker 1", 0, 12_000, {col.PROCESS_ID: 701})]
    for k in range(3):
        rows.append((10 + k, 1, "input", "fetch", "DataLoader.fetch", k * 1_000, (k + 1) * 1_000,
                     {"step": None, col.PROCESS_ID: 700, col.BATCH_SIZE: 16, col.ATTRIBUTES: worker[0]}))
    rows.append((20, 2, "input", "fetch", "DataLoader.fetch", 0, 2_000,
                 {"step": None, col.PROCESS_ID: 701, col.BATCH_SIZE: 16, col.ATTRIBUTES: worker[1]}))
    rows.append((21, 2, "input", "fetch", "DataLoader.fetch", 10_000, 12_000,
                 {"step": None, col.PROCESS_ID: 701, col.BATCH_SIZE: 16, col.ATTRIBUTES: worker[1],
                  col.STATUS: "error"}))
    workers = analysis.input_workers(make_trace(rows))
    assert workers["process_id"].tolist() == [700, 701] and workers["worker"].tolist() == [0, 1]
    assert workers["batches"].tolist() == [3, 2] and workers["failed"].tolist() == [0, 1]
    assert workers["samples"].tolist() == [48, 32]
    assert np.allclose(workers["fetch_ms_mean"], [1.0, 2.0]) and np.allclose(workers["alive_ms"], [3.0, 12.0])
    assert np.allclose(workers["busy"], [1.0, 4.0 / 12.0])
    assert analysis.input_workers(loop_on_a_gpu()).empty  # no worker followed: no rows
