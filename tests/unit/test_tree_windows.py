"""A trace file read a window of whole trees at a time, and the summaries made that way: the same
as those of the trace loaded whole, on every shared trace and on traces xsp recorded."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.gate.baseline import Summary, summarize, summarize_windows
from xsp.gate.diff_columns import SAMPLES_NS, KeyBy
from xsp.io import memory_needed
from xsp.io.parquet import arrow_table, write_trace_tables
from xsp.io.tree_windows import tree_windows

LARGER_SHARED = {"kineto/a100_cupti_counters.json.gz", "kineto/a100_nccl_rank0.json.gz",
                 "kineto/v100_2rank_train_rank1.json.gz", "nsys/saxpy_mpi_cuda_rank0.sqlite"}
"""The shared traces that take seconds each to read a span at a time: checked in the heavy suite,
so that the quick one stays within its budget (the others cover the same code paths)."""
SHARED = [pytest.param(name, marks=pytest.mark.heavy) if name in LARGER_SHARED else name
          for name in ["kineto/a100_alexnet.json.gz", "kineto/a100_cupti_counters.json.gz",
                       "kineto/a100_event_sync_multistream.json.gz", "kineto/a100_nccl_rank0.json.gz",
                       "kineto/a100_triton.json.gz", "kineto/cpu_only_rank34.json.gz", "kineto/sampled_rank0.json.gz",
                       "kineto/v100_2rank_train_rank1.json.gz", "nsys/saxpy_mpi_cuda_rank0.sqlite"]]
CHOICES = [(None, None), ((Level.OPERATOR,), None), (None, slice(2, None)), ((Level.LAYER, Level.KERNEL), [3, 4])]


def assert_same_keys(whole: pd.DataFrame, windowed: pd.DataFrame) -> None:
    assert list(whole.columns) == list(windowed.columns) and len(whole) == len(windowed)
    for column in whole.columns:
        for expected, found in zip(whole[column].tolist(), windowed[column].tolist()):
            if column == SAMPLES_NS:
                assert np.array_equal(expected, found), column
            elif pd.isna(expected) if np.isscalar(expected) or expected is None else False:
                assert found is None or (np.isscalar(found) and pd.isna(found)), (column, expected, found)
            else:
                assert expected == found, (column, expected, found)


def assert_same_summaries(trace: xsp.Trace, path, window_spans: int) -> None:
    windows = tree_windows(path, window_spans=window_spans)
    compared = 0
    for levels, steps in CHOICES:
        try:
            whole = summarize(trace, levels, steps, "run")
        except ValueError as refused:  # a level or steps the trace lacks: refused alike
            with pytest.raises(ValueError, match=re.escape(str(refused))):
                summarize_windows(windows, levels, steps, "run")
            continue
        windowed = summarize_windows(windows, levels, steps, "run")
        assert windowed.metadata == whole.metadata
        for by in KeyBy:
            assert_same_keys(whole.keys[by], windowed.keys[by])
        compared += 1
    assert compared


@pytest.fixture(scope="module")
def shared_files(shared_traces, tmp_path_factory):
    """Each shared trace as an .xsp.parquet file, and loaded from it (each made when first asked for)."""
    folder = tmp_path_factory.mktemp("shared")
    files: dict[str, tuple[Path, xsp.Trace]] = {}

    class Files:
        def __getitem__(self, name: str) -> tuple[Path, xsp.Trace]:
            if name not in files:
                path = folder / (name.split("/")[1].split(".")[0] + col.FILE_SUFFIX)
                xsp.load(shared_traces / name).save(path)
                files[name] = (path, xsp.load(path))
            return files[name]

    return Files()


@pytest.mark.parametrize("window_spans", [1])
@pytest.mark.parametrize("name", SHARED)
def test_a_summary_made_a_window_at_a_time_is_the_whole_trace_s(shared_files, name, window_spans):
    path, trace = shared_files[name]
    assert_same_summaries(trace, path, window_spans)


def test_windows_hold_whole_trees_and_every_span_once_in_the_loaded_order(shared_files):
    path, trace = shared_files["kineto/v100_2rank_train_rank1.json.gz"]
    windows = tree_windows(path, window_spans=1)
    assert windows.count > 2 and windows.spans == len(trace.spans)
    assert windows.steps == trace.steps and windows.levels == set(trace.spans[col.LEVEL].astype(str))
    seen = []
    for spans, order in windows.frames():
        ids = set(spans[col.SPAN_ID])
        assert set(spans[col.PARENT_ID].dropna()) <= ids  # every parent in the window
        assert (np.diff(order[:, 0]) >= 0).all() and len(order) == len(spans)
        seen.append(spans)
    together = pd.concat(seen).sort_values([col.START_NS, col.SPAN_ID], kind="stable")
    loaded = trace.spans.sort_values([col.START_NS, col.SPAN_ID], kind="stable")
    assert together[col.SPAN_ID].tolist() == loaded[col.SPAN_ID].tolist()


def _recorded_run(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(16, 4)))
    path = tmp_path / "run.xsp.parquet"
    with xsp.trace(output=path, levels="model,layer,operator"):
        for _ in range(6):  # a step each
            model(torch.randn(2, 8)).sum()
    return path


def test_a_recorded_run_with_layers_and_lines_is_summarised_alike(tmp_path):
    path = _recorded_run(tmp_path)
    trace = xsp.load(path)
    assert len(summarize(trace).keys[KeyBy.LINE])  # its lines are compared too
    for window_spans in (1, 1 << 16):
        assert_same_summaries(trace, path, window_spans)


def test_a_file_out_of_start_order_is_read_in_the_loaded_order(shared_files, tmp_path):
    path, trace = shared_files["kineto/a100_nccl_rank0.json.gz"]
    table = arrow_table(trace.spans)
    half = len(table) // 2
    shuffled = tmp_path / "shuffled.xsp.parquet"
    write_trace_tables(shuffled, iter([table.slice(half), table.slice(0, half)]), trace.metadata)
    windows = tree_windows(shuffled, window_spans=50)
    assert not windows.in_file_order
    assert_same_summaries(xsp.load(shuffled), shuffled, 50)


def test_parents_in_a_loop_are_one_error_and_missing_parents_are_roots(shared_files, tmp_path):
    path, trace = shared_files["kineto/a100_alexnet.json.gz"]
    spans = trace.spans.copy()
    ids = spans[col.SPAN_ID].to_numpy()
    spans[col.PARENT_ID] = pd.array([ids[1], ids[0]] + spans[col.PARENT_ID].tolist()[2:], dtype="Int64")
    looped = tmp_path / "looped.xsp.parquet"
    write_trace_tables(looped, iter([arrow_table(spans)]), trace.metadata)
    with pytest.raises(xsp.TraceFormatError, match="loop"):
        tree_windows(looped)
    spans = trace.spans.copy()
    spans[col.PARENT_ID] = pd.array([ids.max() + 10] + spans[col.PARENT_ID].tolist()[1:], dtype="Int64")
    orphaned = tmp_path / "orphaned.xsp.parquet"
    write_trace_tables(orphaned, iter([arrow_table(spans)]), trace.metadata)
    with pytest.warns(xsp.XspWarning, match="1 spans name a parent that is not in the file"):
        windows = tree_windows(orphaned, window_spans=1)
    assert sum(len(frame) for frame, _ in windows.frames()) == len(spans)


@pytest.fixture
def little_free_memory(monkeypatch):
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 20)


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_xsp_summary_and_diff_of_a_trace_too_large_to_load_read_it_in_windows(shared_files, tmp_path, capsys,
                                                                               monkeypatch):
    from xsp.cli.main import main

    path, trace = shared_files["kineto/v100_2rank_train_rank1.json.gz"]
    assert main(["summary", str(path), "-o", str(tmp_path / "whole.xsp-summary.parquet")]) == 0
    assert main(["diff", str(path), str(path), "--by", "name", "--format", "json", "--fail-on", "never"]) == 0
    whole_diff = capsys.readouterr().out
    rows = json.loads(whole_diff)["rows"]  # strict JSON: five steps a side can show no change, said "inf"
    assert "inf" in {row["detectable_change"] for row in rows}
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 20)
    with pytest.raises(xsp.TraceTooLargeError):
        xsp.load(path)
    assert main(["summary", str(path), "-o", str(tmp_path / "windows.xsp-summary.parquet")]) == 0
    whole, windowed = (Summary.load(tmp_path / f"{name}.xsp-summary.parquet") for name in ("whole", "windows"))
    assert whole.metadata == windowed.metadata
    for by in KeyBy:
        assert_same_keys(whole.keys[by], windowed.keys[by])
    assert main(["diff", str(path), str(path), "--by", "name", "--format", "json", "--fail-on", "never"]) == 0
    assert capsys.readouterr().out == whole_diff


def test_a_windowed_summary_out_of_memory_is_one_error_and_leaves_no_scratch(shared_files, tmp_path, capsys,
                                                                              monkeypatch):
    import shutil

    from xsp.cli.main import main
    from xsp.gate import key_samples

    path, _ = shared_files["kineto/a100_nccl_rank0.json.gz"]
    trace = tmp_path / "nccl.xsp.parquet"
    shutil.copy(path, trace)
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 20)
    monkeypatch.setattr(key_samples, "SPILLED_MEMORY_MB", 0)  # DuckDB can hold nothing: out of memory
    assert main(["summary", str(trace), "-o", str(tmp_path / "nccl.xsp-summary.parquet")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("xsp: error: adding up the samples in ") and "failed (" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nccl.xsp.parquet"]  # no scratch, no summary


_SECTION = re.compile(r"^(Communication per rank|Clocks: |Model latency over steps|Latency per step|"
                      r"Top \d+ operators? by self time|"
                      r"Top \d+ kernels? by total time|Outside every step|no steps in this trace|Steps cover|"
                      r"Where the step time went|Your spans|GPU: |Kernel time per operator|Memory copies and sets|"
                      r"Synchronisation|Launch overhead per step|System metrics|Energy per step|CUDA graph replays|"
                      r"Hierarchy diagnostics|Recommendations|\d+\. \[|The first step took|"
                      r"Always on \(|Leveled over the drawn steps|Top \d+ layers? by self time, leveled|"
                      r"Top \d+ layers? by self time|Time per layer type|GPU vs CPU time per layer|"
                      r"[\d,]+ calls? of layers inside compiled code|FLOPs per layer|"
                      r"Backward time per forward layer|Memory allocated per layer type|FLOPs per kernel|Leveled runs|"
                      r"This trace is too large)", re.M)


def _rendered(render, *arguments) -> str:
    from rich.console import Console

    out = io.StringIO()
    render(*arguments, Console(file=out, width=80, color_system=None))
    return out.getvalue()


def assert_windowed_report_is_the_whole_s(trace: xsp.Trace, path, window_spans: int,
                                          left_out: tuple[str, ...] = ()) -> None:
    """Each section of the windowed report is the whole report's, and it makes every section the
    whole report makes, but the ``left_out`` ones (their headings' starts, as the report names them)."""
    from xsp.analysis.windowed import windowed_report
    from xsp.reports.terminal import render_report, render_windowed_report

    whole = _rendered(render_report, trace)
    windowed = _rendered(render_windowed_report, windowed_report(tree_windows(path, window_spans=window_spans)))
    starts = [found.start() for found in _SECTION.finditer(windowed)] + [len(windowed)]
    sections = [windowed[:starts[0]]] + [windowed[a:b] for a, b in zip(starts, starts[1:])]
    assert sections[-1].startswith("This trace is too large to load here")
    for section in sections[:-1]:  # each section as the whole trace's report prints it
        assert section.rstrip("\n") in whole, section
    # and every section it makes that the whole trace's report has
    assert [found.group(1) for found in _SECTION.finditer(whole) if not found.group(1).startswith(left_out)] == [
        found.group(1) for found in _SECTION.finditer(windowed)][:-1]
    for heading in left_out:  # present in the whole report, and named as left out
        assert re.search(f"^{re.escape(heading)}", whole, re.M), heading


@pytest.mark.parametrize("name", SHARED)
def test_the_gpu_s_busy_and_idle_time_swept_from_windows_is_the_whole_trace_s(shared_files, name):
    from xsp.analysis import gpu_utilization
    from xsp.analysis.windowed import windowed_report

    path, trace = shared_files[name]
    whole = gpu_utilization(trace, per_stream=False)
    windowed = windowed_report(tree_windows(path, window_spans=1)).utilization
    assert list(windowed.columns) == list(whole.columns) and len(windowed) == len(whole)
    for column in ("step", "device_id"):
        assert windowed[column].astype("Float64").tolist() == whole[column].astype("Float64").tolist()
    for column in ("activities", "window_us", "busy_us", "host_bound_idle_us", "other_idle_us", "utilization"):
        assert np.allclose(windowed[column].to_numpy(dtype=float), whole[column].to_numpy(dtype=float),
                           rtol=0, atol=1e-9, equal_nan=True), column


@pytest.mark.parametrize("name", SHARED)
def test_the_report_of_a_trace_read_a_tree_at_a_time_shows_the_whole_trace_s_figures(shared_files, name):
    path, trace = shared_files[name]
    if len(trace.ranks) > 1:
        pytest.skip("a file of several ranks is reported rank by rank")
    assert_windowed_report_is_the_whole_s(trace, path, 1)


def test_the_report_of_a_recorded_run_read_in_windows_shows_its_figures(tmp_path):
    path = _recorded_run(tmp_path)
    assert_windowed_report_is_the_whole_s(xsp.load(path), path, 1)


def test_the_report_of_a_run_recorded_with_flops_read_in_windows_shows_its_figures(tmp_path):
    from xsp.reports.terminal import render_report

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    path = tmp_path / "flops.xsp.parquet"
    with xsp.trace(output=path, levels="model,layer,operator,flops"):
        for _ in range(4):
            model(torch.randn(2, 8))
    assert "FLOPs per layer" in _rendered(render_report, xsp.load(path))
    assert_windowed_report_is_the_whole_s(xsp.load(path), path, 1)


def test_the_report_of_a_training_run_read_in_windows_shows_its_backward_time(tmp_path):
    from xsp.reports.terminal import render_report

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "train.xsp.parquet"
    with xsp.trace(output=path, levels="model,layer,operator"):
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
    assert "Backward time per forward layer" in _rendered(render_report, xsp.load(path))
    assert_windowed_report_is_the_whole_s(xsp.load(path), path, 1)


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_report_of_a_run_recorded_with_memory_read_in_windows_shows_memory_per_layer_type(tmp_path):
    from xsp.analysis.windowed import windowed_report
    from xsp.reports.terminal import render_report

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    path = tmp_path / "memory.xsp.parquet"
    with xsp.trace(output=path, levels="model,layer,operator,memory"):
        for batch in (2, 16, 4, 32):
            model(torch.randn(batch, 8))
    assert "Memory allocated per layer type" in _rendered(render_report, xsp.load(path))
    assert_windowed_report_is_the_whole_s(xsp.load(path), path, 1)
    table = windowed_report(tree_windows(path, window_spans=1)).layer_memory
    pd.testing.assert_frame_equal(table, xsp.analysis.memory_by_layer_type(xsp.load(path)))


def test_the_report_of_a_leveled_run_read_in_windows_shows_its_leveled_runs(tmp_path):
    from xsp.reports.terminal import render_report

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 8)
    with torch.no_grad():
        path = xsp.leveled(lambda: model(x), levels="model,layer", repeat=3, warmup=1, rounds=1).save(
            tmp_path / "leveled.xsp.parquet")
    whole = _rendered(render_report, xsp.load(path))
    assert "Leveled runs" in whole and "Top-level layers add up to" in whole
    assert_windowed_report_is_the_whole_s(xsp.load(path), path, 1)


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_report_of_an_always_on_run_read_in_windows_counts_the_steps_recorded_deep(tmp_path):
    from xsp.reports.terminal import render_report

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    path = tmp_path / "always_on.xsp.parquet"
    with torch.no_grad(), xsp.trace(output=path, levels="model,layer,operator,memory", sample=0.3):
        for _ in range(60):
            model(torch.randn(2, 8))  # an operator between steps, numbered with the step before
    trace = xsp.load(path)
    assert 0 < trace.spans[col.SAMPLING].isin(["sampled"]).sum() < 60
    assert "Leveled over the drawn steps" in _rendered(render_report, trace)
    assert_windowed_report_is_the_whole_s(trace, path, 1)


@pytest.mark.parametrize("smallest_window", [pytest.param(1, marks=pytest.mark.heavy), 50])
def test_an_always_on_run_s_layers_are_leveled_over_its_drawn_steps_read_in_windows(tmp_path, monkeypatch,
                                                                                   smallest_window):
    from xsp.analysis import windowed
    from xsp.session.rotation import leveled_over_steps

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.nn.Linear(16, 4))
    path = tmp_path / "always_on.xsp.parquet"
    with torch.no_grad(), xsp.trace(output=path, levels="model,layer", sample=0.5):
        for _ in range(80):
            model(torch.randn(2, 8))
    whole = leveled_over_steps(xsp.load(path))
    assert whole is not None and len(whole.overhead) >= 2  # the model-only run and the layers
    for window_spans in (smallest_window, 10_000):
        report = windowed.windowed_report(tree_windows(path, window_spans=window_spans))
        assert report.leveled_steps is not None and windowed.LeftOut.ALWAYS_ON not in report.left_out
        found = leveled_over_steps(report.leveled_steps)
        assert found is not None
        pd.testing.assert_frame_equal(found.overhead, whole.overhead)
        # the same spans and figures (a window's categories hold only its own texts)
        pd.testing.assert_frame_equal(found.trace.spans.astype(object), whole.trace.spans.astype(object))
    # steps too many to hold: the table is left out, and said to be
    monkeypatch.setattr(windowed, "LEVELED_MEMORY_BYTES", windowed.LEVELED_BYTES_PER_SPAN * 10)
    report = windowed.windowed_report(tree_windows(path, window_spans=50))
    assert report.leveled_steps is None and report.left_out == [windowed.LeftOut.ALWAYS_ON]
    from xsp.reports.terminal import render_windowed_report

    text = " ".join(_rendered(render_windowed_report, report).split())
    assert "Leveled over the drawn steps" not in text
    assert "Left out, as they need it whole: the always-on layers leveled over the drawn steps" in text


def test_memory_per_layer_type_counts_the_live_bytes_of_every_window(tmp_path):
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.analysis.windowed import windowed_report

    # two threads' steps overlap; each allocates inside its layer while the other holds memory,
    # so a layer's peak depends on events in the other's window (and two events share a time)
    rows = [(1, None, "model", "step", "s0", 0, 100, {}), (2, 1, "layer", "forward", "A", 10, 90,
                                                           {col.MODULE_TYPE: "Block"}),
            (3, None, "model", "step", "s1", 5, 95, {"step": 1}),
            (4, 3, "layer", "forward", "B", 15, 85, {col.MODULE_TYPE: "Linear", "step": 1})]
    events = [(20, "alloc", 100, 2), (25, "alloc", 500, 4), (30, "alloc", 300, 2), (30, "free", 500, 4),
              (40, "free", 100, 2), (50, "alloc", 80, 4), (60, "free", 300, 2)]
    for i, (at, kind, size, parent) in enumerate(events):
        rows.append((10 + i, parent, "memory", kind, kind, at, at, {col.BYTES: size, "step": 0 if parent == 2 else 1}))
    trace = make_trace(rows, {"schema_version": col.SCHEMA_VERSION})
    spans = trace.spans
    spans.loc[spans[col.STEP] == 1, col.THREAD_ID] = 2
    path = trace.save(tmp_path / "memory.xsp.parquet")
    whole = xsp.analysis.memory_by_layer_type(xsp.load(path))
    # B began with A's 100 live and held 600 at most; A's 900 counts B's 500, freed at A's 30 but after it
    assert whole["module_type"].tolist() == ["Linear", "Block"] and whole["max_peak_bytes"].tolist() == [500, 900]
    windows = tree_windows(path, window_spans=1)
    assert len(list(windows.frames())) == 2
    pd.testing.assert_frame_equal(windowed_report(windows).layer_memory, whole)


def test_xsp_report_reads_a_trace_too_large_to_load_in_windows(shared_files, capsys, monkeypatch):
    from xsp.cli.main import main

    path, _ = shared_files["kineto/a100_nccl_rank0.json.gz"]
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: 1 << 20)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Top 10 kernels by total time" in out and "read a part at a time" in " ".join(out.split())
    assert main(["report", str(path), "--html", str(path.parent / "r.html"), "--lines"]) == 2  # they need it whole
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "too large to load whole here" in error
    assert "--html and --lines need it loaded whole: without --html and --lines, xsp report prints" in error


def test_a_trace_whose_report_would_not_fit_is_reported_in_windows_though_it_would_load(shared_files, capsys,
                                                                                          monkeypatch):
    from xsp.cli.main import main
    from xsp.io.memory_needed import analysis_memory_bytes, parquet_memory_bytes

    path, _ = shared_files["kineto/a100_nccl_rank0.json.gz"]
    load_bytes, report_bytes = parquet_memory_bytes(path), analysis_memory_bytes(path)
    assert report_bytes > load_bytes  # free memory for the load, not for the report made of it
    monkeypatch.setattr(memory_needed, "free_memory_bytes", lambda: int((load_bytes + report_bytes) / 2 / 0.9))
    xsp.load(path)
    assert main(["report", str(path)]) == 0
    assert "read a part at a time" in " ".join(capsys.readouterr().out.split())
    assert main(["summary", str(path), "-o", str(path.parent / "nccl.xsp-summary.parquet")]) == 0


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_roofline_of_sampled_counters_read_in_windows_is_the_whole_trace_s(tmp_path):
    """Each sample of the GPU's counters is shared among the kernels that ran during it, whichever
    windows hold them: a kernel spanning two samples, a sample no kernel ran in, a second device."""
    from xsp.analysis.windowed import windowed_report
    from xsp.core.schema import SpanKind
    from xsp.table.build import conform

    def span(level: Level, kind: SpanKind, name: str, start: int, end: int, device: int, **counts: float) -> dict:
        return {col.LEVEL: level.value, col.KIND: kind.value, col.NAME: name, col.START_NS: start, col.END_NS: end,
                col.DEVICE_ID: device, **{getattr(col, key.upper()): value for key, value in counts.items()}}

    rows = [span(Level.GPU_METRICS, SpanKind.COUNTERS, "pm_sample", start, start + 100, device,
                 flops=1_000.0 + start, bytes=10.0 + start / 10)
            for device in (0, 1) for start in range(0, 1_000, 100)]
    rows[3][col.FLOPS] = None  # a sample whose FLOPs were not counted
    rows += [span(Level.KERNEL, SpanKind.KERNEL, name, start, end, device)
             for name, start, end, device in [("gemm", 0, 150, 0), ("relu", 50, 100, 0), ("gemm", 150, 420, 0),
                                              ("copy", 500, 510, 0), ("gemm", 0, 1_000, 1), ("relu", 990, 1_200, 1)]]
    spans = conform(pd.DataFrame(rows))
    spans[col.SPAN_ID] = np.arange(1, len(spans) + 1)
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    metadata = {"schema_version": col.SCHEMA_VERSION, "device": "cuda:0 NVIDIA A100-SXM4-80GB"}
    path = xsp.Trace(spans=spans, metadata=metadata).save(tmp_path / "counters.xsp.parquet")
    trace = xsp.load(path)
    whole = xsp.analysis.kernel_roofline(trace)
    assert whole["flops"].notna().all() and (whole["flops"] > 0).all()  # every kernel met a sample
    for window_spans in (1, 7, 1_000):
        found = windowed_report(tree_windows(path, window_spans=window_spans)).roofline
        assert found["name"].tolist() == whole["name"].tolist()
        for column in ("count", "flops", "dram_bytes", "kernel_us", "arithmetic_intensity", "achieved_tflops",
                       "ridge_point"):
            assert np.allclose(found[column].to_numpy(dtype=float), whole[column].to_numpy(dtype=float), rtol=1e-12,
                               atol=0, equal_nan=True), column
        assert found["bound"].tolist() == whole["bound"].tolist()
    assert_windowed_report_is_the_whole_s(trace, path, 1)
