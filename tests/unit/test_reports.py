"""The terminal report fits 80 columns, numbered steps are one kind, and the Chrome export names
its processes and threads and carries system metrics and memory as counter tracks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from rich.console import Console

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp import analysis
from xsp.core import schema as col
from xsp.export.chrome import chrome_events
from xsp.reports.terminal import middle, render_report

LONG = "encoder.layer.11.attention.output.dense_projection_with_a_very_long_name"


def long_named_trace():
    rows = [(1, None, "model", "step", "inference_step", 0, 1000, {}),
            (2, 1, "model", "predict", "model", 0, 1000, {"module_type": "VeryLongModelClassNameForTesting"})]
    for i in range(12):
        rows.append((3 + i, 2, "layer", "forward", f"model.{LONG}_{i}", i * 80, i * 80 + 70,
                     {"module_type": f"SomeQuiteLongModuleTypeName{i}"}))
    return make_trace(rows)


def test_middle_keeps_both_ends():
    assert middle("abcdefghij", 10) == "abcdefghij"
    assert middle("abcdefghij", 7) == "abc…hij"
    assert len(middle(LONG, 20)) == 20 and middle(LONG, 20).startswith("encoder.l") and middle(LONG, 20).endswith(
        "long_name")


def test_the_terminal_report_fits_80_columns_and_no_row_wraps():
    console = Console(width=80, record=True, color_system=None)
    render_report(long_named_trace(), console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    start = lines.index(next(line for line in lines if line.startswith("Top 10 layers")))
    end = lines.index(next(line for line in lines[start + 1:] if line.startswith("Time per")))
    rule = next(i for i in range(start, end) if set(lines[i]) == {"─"})
    rows = lines[rule + 1:end]
    # ten rows, one line each (no continuation line), names shortened in the middle
    assert len(rows) == 10 and all(row.startswith("model.enc") and "…" in row.split()[0] for row in rows)
    assert [row.split()[0][-2:] for row in rows] == [f"_{i}" for i in range(10)]


def test_names_that_look_like_markup_are_printed_as_they_are():
    rows = [(1, None, "model", "step", "s", 0, 100, {}), (2, 1, "model", "user", "[param|cuda]", 0, 50, {})]
    console = Console(width=80, record=True, color_system=None)
    render_report(make_trace(rows), console)
    assert "[param|cuda]" in console.export_text()


def test_a_run_whose_export_failed_says_so_in_its_report_and_one_that_sent_everything_does_not():
    from xsp.reports.html import render_html

    rows = [(1, None, "model", "step", "s", 0, 100, {}), (2, 1, "model", "user", "u", 0, 50, {})]
    trace = make_trace(rows)
    trace.metadata["export"] = {"target": "http/protobuf http://collector:4318/v1/traces", "to_send": 4872,
                                "exported": 2857, "failed": 2015, "error": "the collector rejected a batch"}
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    text = " ".join(console.export_text().split())
    assert ("export to http/protobuf http://collector:4318/v1/traces: 2,015 of 4,872 spans not sent: the collector "
            "rejected a batch") in text
    assert "2,015 of 4,872 spans not sent" in render_html(trace)
    trace.metadata["export"] = {"target": "t", "to_send": 10, "exported": 10, "failed": 0, "error": None}
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    assert "not sent" not in console.export_text()


def test_numbered_kineto_steps_are_one_kind(shared_traces):
    trace = xsp.load(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz")
    summary = analysis.model_summary(trace)
    assert summary["name"].tolist() == ["ProfilerStep"] and summary["steps"].tolist() == [5]
    assert analysis.step_summary(trace)["name"].tolist() == ["ProfilerStep"]
    tree = analysis.aggregated_tree(trace, max_nodes=200)
    assert tree["path"].iloc[0] == "ProfilerStep[0]" and tree["name"].iloc[0] == "ProfilerStep"
    assert len(tree) <= 200 and set(tree["parent_path"]) - {""} <= set(tree["path"])


def test_the_aggregated_tree_folds_steps_and_nests_totals():
    trace = long_named_trace()
    tree = analysis.aggregated_tree(trace).set_index("path")
    root = tree.loc["inference_step"]
    assert root["total_ms"] >= tree.loc["model", "total_ms"] >= tree.loc[f"model.{LONG}_0", "total_ms"]
    children = tree[tree["parent_path"] == "model"]
    assert children["total_ms"].sum() <= tree.loc["model", "total_ms"] + 1e-9
    levels = analysis.level_summary(trace).set_index("level")
    assert levels.loc["steps", "share"] == 1.0 and 0.8 < levels.loc["layer", "share"] < 0.9


def test_chrome_export_names_threads_and_carries_counters(tmp_path, monkeypatch):
    monkeypatch.setenv("XSP_SYSTEM_HZ", "100")
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU())
    with xsp.trace(levels="model,layer,memory,system", output=tmp_path / "t.xsp.parquet"), torch.no_grad():
        for _ in range(5):
            model(torch.randn(8, 16))
    trace = xsp.load(tmp_path / "t.xsp.parquet")
    events = json.loads(json.dumps(chrome_events(trace)))["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "MainThread" in names
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert "process cpu_percent (%)" in counters and "process rss_bytes (B)" in counters
    assert "live tensor memory (cpu)" in counters
    assert any(e["ph"] == "i" and e["name"] == "alloc" for e in events)
    assert not any(e["ph"] == "X" and e["cat"] in ("system", "memory") for e in events)


def test_escape_sequences_in_names_never_reach_the_terminal():
    hostile = "model.\x1b]0;pwned\x07\x1b[2J\x00\nsecond line"
    rows = [(1, None, "model", "step", "s", 0, 1000, {}), (2, 1, "model", "predict", "model", 0, 1000, {}),
            (3, 2, "layer", "forward", hostile, 10, 900, {"module_type": "Evil\x1b[31m"})]
    console = Console(width=80, record=True, color_system=None)
    render_report(make_trace(rows), console)
    shown = console.export_text()
    assert not any(char in shown for char in "\x1b\x07\x00")
    assert "\\x1b" in shown  # shown, visibly
    assert max(len(line) for line in shown.splitlines()) <= 80


def two_rank_trace():
    """Rank 0 and rank 1, each a step with a forward on its main thread and a gloo worker's
    all-reduce (a thread only the profiler saw), and a kernel on rank 1's GPU."""
    rows = []
    for rank in (0, 1):
        base = 10 * rank
        rows += [(base + 1, None, "model", "step", "train_step", 0, 1000, {col.RANK: rank, col.STEP: 0}),
                 (base + 2, base + 1, "layer", "forward", "model.fc", 10, 400, {col.RANK: rank}),
                 (base + 3, None, "operator", "operator", "gloo:all_reduce", 500, 900,
                  {col.RANK: rank, col.THREAD_ID: -2})]
    rows.append((30, None, "kernel", "kernel", "k", 100, 200, {col.RANK: 1}))
    metadata = {"service_name": "job", "ranks": {
        str(rank): {"pid": 4000 + rank, "service_name": "job", "threads": {"1": "MainThread",
                                                                            "-2": "gloo worker (profiler thread 2)"}}
        for rank in (0, 1)}}
    return make_trace(rows, metadata)


def test_chrome_export_gives_each_rank_its_own_processes_and_keeps_thread_names():
    events = json.loads(json.dumps(chrome_events(two_rank_trace())))["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {4000: "job rank 0 (4000)", 4001: "job rank 1 (4001)", "rank 1 GPU 0": "rank 1 GPU 0"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans if e["name"] == "model.fc"} == {4000, 4001}
    assert [e["pid"] for e in spans if e["name"] == "k"] == ["rank 1 GPU 0"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads[(4000, 1)] == threads[(4001, 1)] == "MainThread"
    assert threads[(4001, -2)] == "gloo worker (profiler thread 2)"
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert order == {4000: 0, 4001: 1}


def test_the_chrome_file_is_written_in_chunks_that_join_into_the_same_document(tmp_path, monkeypatch):
    from xsp.export import chrome

    trace = two_rank_trace()
    whole = json.loads(json.dumps(chrome_events(trace)))
    monkeypatch.setattr(chrome, "SPAN_CHUNK_ROWS", 2)  # seven spans: four chunks, and the naming events
    chrome.write_chrome(trace, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == whole
    assert [e["name"] for e in whole["traceEvents"] if e["ph"] == "X"] == trace.spans[col.NAME].tolist()


def test_the_flame_chart_labels_threads_by_name():
    from xsp.reports.html import _thread_labels

    trace = two_rank_trace()
    labels = set(_thread_labels(trace, trace.spans[trace.spans[col.THREAD_ID].notna()]))
    assert labels == {"rank 0 · MainThread (1)", "rank 1 · MainThread (1)",
                      "rank 0 · gloo worker (profiler thread 2)", "rank 1 · gloo worker (profiler thread 2)"}
    assert not any(label.startswith("thread ") for label in labels)


def test_threads_only_the_profiler_saw_are_named_after_what_they_ran():
    import pandas as pd

    from xsp.tracers.operator_profiler import unmarked_thread_names

    rows = pd.DataFrame({col.THREAD_ID: [5, -2, -2, -3, -3, -3, -4],
                         col.NAME: ["aten::mm", "gloo:all_reduce", "gloo:all_reduce", "autograd::engine::evaluate_"
                                    "function: MmBackward0", "aten::mm", "aten::t", "aten::add"]})
    assert unmarked_thread_names(rows) == {-2: "gloo worker (profiler thread 2)",
                                           -3: "autograd engine (profiler thread 3)", -4: "profiler thread 4"}


def test_every_column_and_every_value_survives_80_columns():
    import pandas as pd

    from xsp.reports.terminal import frame_table, number, text
    frame = pd.DataFrame({"name": ["inference_step_with_a_long_name"], "steps": [1200],
                          **{f"c{i}": [1234.567] for i in range(5)}, "throughput_per_s": [98765.4]})
    columns = [("name", "step name", text), ("steps", "steps", number(0))]
    columns += [(f"c{i}", f"trimmed mean {i}", number()) for i in range(5)]
    columns += [("throughput_per_s", "throughput/s", number(1))]
    console = Console(width=80, record=True, color_system=None)
    console.print(frame_table(frame, "", columns, width=80))
    shown = console.export_text()
    assert max(len(line) for line in shown.splitlines()) <= 80
    assert shown.count("1,234.567") == 5 and "98,765.4" in shown and "1,200" in shown
    assert "throughp" in shown and "ut/s" in shown  # the heading wraps inside its word


def test_shortened_names_never_read_the_same():
    from xsp.reports.terminal import distinct_middles
    names = [f"model.resnet.encoder.stages.{stage}.layers.{block}.shortcut.convolution"
             for stage in range(3) for block in range(2)]
    shortened = distinct_middles(names, 30)
    assert len(set(shortened.values())) == len(names) and all(len(s) <= 30 for s in shortened.values())
    same_tail = [f"{'x' * 40}{i}{'y' * 40}" for i in range(3)]
    numbered = distinct_middles(same_tail, 20)
    assert len(set(numbered.values())) == 3 and all(len(s) <= 20 for s in numbered.values())
    assert distinct_middles(["short", "short"], 20) == {"short": "short"}


def test_a_shortened_path_keeps_its_last_parts_whole():
    from xsp.reports.terminal import distinct_middles, shorten

    path = "model.resnet.encoder.stages.3.layers.0.layer.1.convolution"
    assert shorten(path, 32) == "…3.layers.0.layer.1.convolution"
    assert shorten(path, 30) == "…layers.0.layer.1.convolution"
    assert shorten("model[0]/resnet[0]/embedder[0]/embedder[0]", 24) == "…embedder[0]/embedder[0]"
    # the issue's: "model.resnet.en…cut.convolution" and "m…3.layers.0.layer.1.convolution"
    names = ["model.resnet.encoder.stages.0.layers.0.shortcut.convolution",
             "model.resnet.encoder.stages.3.layers.0.layer.1.convolution", "model.resnet.embedder.embedder.convolution"]
    shown = distinct_middles(names, 32)
    assert shown == {names[0]: "…0.layers.0.shortcut.convolution", names[1]: "…3.layers.0.layer.1.convolution",
                     names[2]: "…embedder.embedder.convolution"}
    # a kernel's signature is no path: its middle goes
    kernel = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>"
    assert shorten(kernel, 30) == "void at::native…unctor<float>>"


def test_paths_told_apart_keep_their_last_part_whole():
    """Two paths that differ only far from their ends were told apart by a long start, which left
    one letter of the last part: 'model.resnet.encoder.stages.0…n' (a new user's ResNet report)."""
    from xsp.reports.terminal import distinct_middles

    names = ["model.resnet.encoder.stages.0.layers.0.shortcut.convolution",
             "model.resnet.encoder.stages.1.layers.0.shortcut.convolution",
             "model.resnet.encoder.stages.0.layers.1.shortcut.convolution"]
    for limit in range(14, 40):
        shown = distinct_middles(names, limit)
        assert len(set(shown.values())) == 3 and all(len(text) <= limit for text in shown.values())
        assert all(text.rstrip("#0123456789").endswith("convolution") for text in shown.values()), (limit, shown)


def test_wide_characters_count_as_the_two_columns_they_take():
    """CJK names were measured in characters: rich then cut each to half its column, where all
    nine layers read "日本語のとても長い名前のモデル …", or "モデル.0…" in a 49-column table."""
    from rich.cells import cell_len

    from xsp.reports.terminal import distinct_middles, shorten

    assert shorten("モデル.0.全結合", 16) == "モデル.0.全結合"  # 15 columns: whole
    assert shorten("モデル.0.全結合", 12) == "…0.全結合"
    names = [f"日本語のとても長い名前のモデル.{block}.{part}" for block in range(3) for part in ("全結合", "活性化")]
    for limit in (10, 14, 20, 30):
        shown = distinct_middles(names, limit)
        assert len(set(shown.values())) == len(names) and all(cell_len(text) <= limit for text in shown.values())
    rows = [(1, None, "model", "step", "s", 0, 1000, {}),
            (2, 1, "model", "predict", "モデル", 0, 1000, {"module_type": "Sequential"})]
    rows += [(3 + i, 2, "layer", "forward", f"モデル.{i // 2}.{('全結合', '活性化')[i % 2]}", i * 100, i * 100 + 90,
              {"module_type": ("Linear", "ReLU")[i % 2]}) for i in range(6)]
    console = Console(width=80, record=True, color_system=None)
    render_report(make_trace(rows), console)
    lines = console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert sum(line.startswith(("モデル.0.全結合 ", "モデル.2.活性化 ")) for line in lines) == 2, "\n".join(lines)


def test_an_import_says_what_it_left_out_but_the_profilers_own_markers():
    """A PyTorch profiler file with profile_memory: its allocations were left out of the import
    (no memory level, no layer memory) and the report did not say so."""
    rows = [(1, None, "model", "step", "s", 0, 100, {}), (2, 1, "operator", "operator", "aten::mm", 0, 50, {})]
    trace = make_trace(rows)
    trace.metadata.update({"imported_from": "kin.json", "not_imported": {
        "ignored cpu_instant_event events": 1234, "ignored Trace events": 1, "ignored i events": 2}})
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    text = " ".join(console.export_text().split())
    assert "not imported from the file: 1,234 cpu_instant_event events (metadata 'not_imported')" in text
    trace.metadata["not_imported"] = {"ignored Trace events": 1, "ignored i events": 2}
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    assert "not imported" not in console.export_text()


@pytest.mark.parametrize("seed", range(20))
def test_no_two_shortened_names_of_a_table_read_alike(seed):
    from xsp.reports.terminal import distinct_middles

    rng = np.random.default_rng(seed)
    parts = ["model", "encoder", "layers", "block", "attention", "conv", "0", "1", "2", "10", "norm"]
    names = {".".join(rng.choice(parts, size=rng.integers(2, 12))) for _ in range(60)}
    for limit in (8, 12, 20, 30):
        shown = distinct_middles(sorted(names), limit)
        assert len(set(shown.values())) == len(names), (limit, shown)
        assert all(len(text) <= limit for text in shown.values())


def test_the_reports_gpu_idle_time_is_the_recommendations(shared_traces):
    """Both count a device idle only while all its streams are (summed over streams, the report
    said 24.9 s where the recommendation said 12.9 s)."""
    import re

    trace = xsp.load(shared_traces / "kineto" / "a100_alexnet.json.gz")
    console = Console(width=80, record=True)
    render_report(trace, console)
    text = " ".join(console.export_text().split())
    reported = re.search(r"idle ([\d,.]+) ms waiting for the host", text)
    recommended = re.search(r"sat idle waiting for the host [\d.]+% of its active window \(([\d,.]+) ms", text)
    assert reported and recommended, text[:2000]
    assert float(reported.group(1).replace(",", "")) == pytest.approx(float(recommended.group(1).replace(",", "")),
                                                                       rel=0.01)
    assert "e+" not in text


class Flaky(torch.nn.Module):
    """Fails on every other call, after some work: a service answering bad requests."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.fail = False

    def forward(self, x):
        x = self.layer(x)
        if self.fail:
            for _ in range(20):  # the failed request's own work
                x = self.layer(x)
            raise ValueError("bad request")
        return x


@pytest.mark.parametrize("fail_every", [2, 1])
def test_failed_steps_are_counted_apart_and_left_out_of_latency_and_throughput(fail_every):
    model = Flaky()
    with xsp.trace(levels="model", output=None) as session:
        for i in range(8):
            model.fail = i % fail_every == fail_every - 1
            try:
                model(torch.randn(2, 4))
            except ValueError:
                pass
    latency = analysis.model_latency(session.trace)
    completed = latency[latency["status"] == "ok"]["latency_ms"]
    assert latency[latency["status"] == "error"]["throughput_per_s"].isna().all()  # it delivered no items
    assert latency[latency["status"] == "ok"]["throughput_per_s"].notna().all()
    summary = analysis.model_summary(session.trace).iloc[0]
    assert summary["steps"] == len(completed) == 8 - 8 // fail_every and summary["failed"] == 8 // fail_every
    if len(completed):
        assert summary["mean_ms"] == pytest.approx(completed.mean())
        assert summary["max_ms"] == pytest.approx(completed.max())
    else:
        assert summary[["mean_ms", "p50_ms", "throughput_per_s"]].isna().all()
    console = Console(width=80, record=True, color_system=None)
    render_report(session.trace, console)
    report = console.export_text()
    assert "completed steps only" in report
    assert f"{8 // fail_every} steps ended by an exception (status error), left out of latency" in report
    assert max(len(line) for line in report.splitlines()) <= 80


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("bad gradient")


def test_a_training_step_whose_backward_raised_and_was_caught_is_a_failed_step():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with xsp.trace(levels="model", output=None) as session:
        for i in range(4):
            optimizer.zero_grad()
            out = model(torch.randn(2, 4))
            try:
                (_FailsBackward.apply(out) if i == 2 else out).sum().backward()
            except RuntimeError:
                continue  # no update this step
            optimizer.step()
    latency = analysis.model_latency(session.trace)
    assert latency["name"].tolist() == ["train_step"] * 4
    assert latency["status"].tolist() == ["ok", "ok", "error", "ok"]
    assert latency["throughput_per_s"].isna().tolist() == [False, False, True, False]
    summary = analysis.model_summary(session.trace).iloc[0]
    assert (summary["steps"], summary["failed"]) == (3, 1)


def test_layer_tables_give_self_and_inclusive_time_per_call_and_intervals_in_percent(tmp_path):
    """One meaning per column: both layer times per call (self was a total over calls beside a
    per-call inclusive mean, so self read larger than inclusive), every 95% interval in percent (±5.0%), and
    "1 round", not "1 rounds"."""
    from xsp.reports.terminal import render_report

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with xsp.trace(levels="model,layer", output=None) as session, torch.no_grad():
        for _ in range(5):
            model(torch.randn(2, 8))
    trace = session.trace
    trace.metadata["leveled"] = {"rounds": 1, "unmatched": 0, "overhead": [
        {"run": "model", "steps": 5, "model_latency_ms": 2.0, "model_latency_ci_ms": 0.1, "overhead": 0.0,
         "metric": False}]}
    console = Console(width=100, record=True, color_system=None)
    render_report(trace, console)
    out = console.export_text()
    layer_table = out[out.index("by self time (all steps; ms per call)"):out.index("Time per layer type")]
    assert layer_table.count("ms/call") == 2 and "incl." in layer_table  # (headings wrap at their column's width)
    assert "1 round)" in out and "1 rounds" not in out
    runs = out[out.index("Leveled runs"):].splitlines()[:8]
    assert any(line.split()[:4] == ["model", "5", "2.000", "±5.0%"] for line in runs)  # ± 0.1 of 2.0 ms: in percent
    assert "95%" in "".join(runs[:4]) and "CI" in "".join(runs[:4]) and "False" not in "".join(runs)
    table = analysis.top_layers(trace)
    assert (table["mean_self_ms"] <= table["mean_ms"] + 1e-9).all()


def test_a_tables_time_unit_follows_its_largest_figure_and_is_in_the_heading(shared_traces, capsys):
    """Operators were shown in µs as 18,913,012.8: each table's unit now comes from its largest
    figure (µs below 10 ms, then ms, then s), named in its heading."""
    import re

    import pandas as pd

    from xsp.cli.main import main
    from xsp.reports.terminal import time_unit

    assert time_unit(pd.Series([12.5, 9_999.0]))[:2] == (1.0, "us")
    assert time_unit(pd.Series([10.0]), pd.Series([18_913_012.8]))[:2] == (1e3, "ms")
    assert time_unit(pd.Series([2e10]))[:2] == (1e6, "s")
    assert time_unit()[:2] == (1.0, "us")
    for trace in sorted((shared_traces / "kineto").glob("*.json.gz")):
        assert main(["report", str(trace), "--top", "5"]) == 0
        out = capsys.readouterr().out
        for title in ("operators by self time", "kernels by total time"):
            if title not in out:
                continue
            table = out[out.index(title):].split("\n\n")[0]
            table = "\n".join(table.splitlines()[:10])
            assert not re.search(r"\d{1,3}(,\d{3}){2,}\.\d", table), (trace.name, table)  # no 1,000,000.0 and up
            assert re.search(r"(self|total) (us|ms|s)\b", table.replace("\n", " ")) or "ms" in table or "us" in table


def test_a_steps_work_is_what_runs_under_its_root_or_beside_it():
    """An inference loop's step is its model call: the batch made before the call (numbered with
    the step) is between steps, so per-step tables and shares leave it out and say it apart."""
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.analysis.model import within_steps
    from xsp.core.schema import Level
    from xsp.reports.terminal import deep_steps, outside_steps_line

    rows = [(1, None, "operator", "operator", "aten::ones", 0, 5, {}),  # the batch, before the call
            (2, None, "model", "predict", "net", 10, 100, {}),
            (3, 2, "operator", "operator", "aten::addmm", 20, 80, {}),
            (4, 3, "kernel", "kernel", "gemm", 90, 120, {}),  # ran on after the call returned
            (5, None, "operator", "operator", "aten::copy_", 50, 60, {col.THREAD_ID: 2})]  # another thread, meanwhile
    trace = make_trace(rows)
    assert within_steps(trace).tolist() == [False, True, True, True, True]
    kept, which = deep_steps(trace)
    assert which == "all steps" and "aten::ones" not in set(kept.spans[col.NAME].astype(str))
    assert outside_steps_line(trace, Level.OPERATOR, "operator") == (
        "Outside every step, not in these figures: 1 operator, 0.005 ms before the first step (model construction, "
        "start-up)")
    # operators inside operators outside the steps (a compile's first call) are their time once: the three
    # added up to more than the session
    nested = make_trace([(1, None, "operator", "operator", "Torch-Compiled Region", 0, 40, {}),
                         (2, 1, "operator", "operator", "CompiledFunction", 5, 35, {}),
                         (3, 2, "operator", "operator", "aten::addmm", 10, 30, {}),
                         (4, None, "model", "predict", "net", 50, 100, {})])
    assert outside_steps_line(nested, Level.OPERATOR, "operator") == (
        "Outside every step, not in these figures: 3 operators, 0.040 ms before the first step (model construction, "
        "start-up)")


def test_a_slow_first_step_is_called_warm_up_beside_the_layer_tables():
    """A new user's ResNet: one convolution's first call took 32 ms, the next ones 1-2 ms, and
    it led the layer table; the report says the first step's warm-up is in those figures, and
    how to record without it."""
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.reports.terminal import render_report, warmup_line

    def steps(first_us: int) -> xsp.Trace:
        rows, span_id, at = [], 1, 0
        for step, length in enumerate([first_us, 100, 110, 90]):
            rows.append((span_id, None, "model", "predict", "net", at, at + length, {"step": step}))
            rows.append((span_id + 1, span_id, "layer", "forward", "net.conv", at + 1, at + length - 1,
                         {"step": step, col.MODULE_TYPE: "Conv2d"}))
            span_id, at = span_id + 2, at + length + 10
        return make_trace(rows)

    slow = steps(3_200)
    line = warmup_line(slow)
    assert line is not None and line.startswith("The first step took 3.200 ms, 32.0x the median of the others")
    assert "--schedule skip_first=1" in line
    console = Console(width=80, record=True, color_system=None)
    render_report(slow, console)
    out = console.export_text()
    assert out.index("The first step took") < out.index("Top 1 layer by self time")
    assert warmup_line(steps(250)) is None  # 2.5x: not warm-up
    # the next step as slow (a ResNet on a busy machine): skipping the first alone would keep it
    two = make_trace([(i + 1, None, "model", "predict", "net", i * 10_000_000, i * 10_000_000 + length,
                       {"step": i}) for i, length in enumerate([2_627_000, 2_652_000, 580_000, 222_000, 40_000])])
    assert warmup_line(two) == (
        "The first 2 steps took 2,627.000 and 2,652.000 ms, each 3x or more the median of the others (222.000 ms): "
        "their "
        "warm-up is in these figures. To record without it: xsp run --schedule skip_first=2 (or "
        "xsp.trace(schedule=\"skip_first=2\")), or run more steps")
    captured = steps(3_200)
    captured.metadata["capture"] = {"steps": [0, 1, 2, 3]}
    assert warmup_line(captured) is None  # a capture of a process running on: no warm-up, and no schedule applies
    from xsp.reports.html import layers_section
    assert "The first step took 3.200 ms" in layers_section(slow) and "first step" not in layers_section(steps(250))


def test_warm_up_and_the_median_step_are_judged_among_steps_of_one_kind():
    """Training steps beside evaluation steps 10x shorter: an ordinary first training step was
    called 22x the median (of mostly evaluation steps) and its warm-up, with advice to skip it;
    the HTML report's flame chart could show an evaluation step as the median one."""
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.reports.html import _median_step
    from xsp.reports.terminal import warmup_line

    def loop(first_train_us: int) -> xsp.Trace:
        rows, span_id, at = [], 1, 0
        plan = [("train", first_train_us), ("train", 1300), ("eval", 100), ("eval", 100), ("train", 1400),
                ("train", 1200), ("eval", 90), ("eval", 110), ("train", 1250)]
        for step, (name, length) in enumerate(plan):
            rows.append((span_id, None, "model", "step", name, at, at + length, {"step": step}))
            rows.append((span_id + 1, span_id, "model", "predict", "net", at + 1, at + length - 1, {"step": step}))
            span_id, at = span_id + 2, at + length + 10
        return make_trace(rows)

    assert warmup_line(loop(2_500)) is None  # 1.9x the other training steps
    line = warmup_line(loop(4_000))
    assert line is not None and line.startswith("The first train step took 4.000 ms, 3.1x the median of the others")
    assert "skip_first=1" in line
    _, title = _median_step(loop(4_000))  # train: 5 steps, eval: 4
    assert title == "Step 1 (the median latency of the train steps, 1.300 ms)"


def test_a_compiled_model_without_layers_is_told_how_to_see_them():
    """At the default levels a compiled model has no layer span: the report showed no layer table
    and said nothing of why."""
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.reports.terminal import render_report

    rows = [(1, None, "model", "predict", "net", 0, 1_000, {"step": 0}),
            (2, 1, "model", "compile", "torch.compile", 10, 900, {"step": 0}),
            (3, None, "model", "predict", "net", 1_100, 1_200, {"step": 1})]
    trace = make_trace(rows, {"levels": ["model", "input", "layer"]})
    console = Console(width=120, record=True, color_system=None)
    render_report(trace, console)
    assert "No layer table: torch.compile'd code calls no module" in console.export_text()
    trace.metadata["levels"] = ["model", "layer", "operator"]  # operators recorded: nothing to add
    console = Console(width=120, record=True, color_system=None)
    render_report(trace, console)
    assert "No layer table" not in console.export_text()


def test_the_report_shows_what_garbage_collection_took_per_generation_and_recommends_freezing():
    rows = [(1, None, "model", "step", "request", 0, 1000, {col.STEP: 0}),
            (2, 1, "model", "predict", "model", 0, 1000, {col.STEP: 0})]
    for index, (generation, start, end) in enumerate([(0, 100, 110), (0, 300, 312), (2, 500, 580)]):
        rows.append((10 + index, None, "system", "gc", f"gc generation {generation}", start, end,
                     {col.STEP: None, col.ATTRIBUTES: json.dumps({col.ATTR_GC_GENERATION: generation,
                                                                  col.ATTR_GC_COLLECTED: 4})}))
    console = Console(width=80, record=True, color_system=None)
    system = {"gc_collections": 3, "gc_collections_by_xsp": 12, "gc_ms_by_xsp": 41.5}
    render_report(make_trace(rows, {"tracer_details": {"system": system}}), console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "Not in the table: 12 collections on xsp's own threads (its imports and windows), 41.5 ms: xsp's cost, " \
           "not the program's" in " ".join(line.strip() for line in lines)
    heading = next(i for i, line in enumerate(lines) if line.startswith("Garbage collections"))
    rule = next(i for i in range(heading, len(lines)) if set(lines[i]) == {"─"})
    assert [line.split()[:3] for line in lines[rule + 1:rule + 3]] == [["0", "2", "0.022"], ["2", "1", "0.080"]]
    assert lines[rule + 2].split()[-1] == "8.0%"  # 80 of 1,000 us of wall time
    said = "\n".join(lines)
    assert "gc_pauses" in said and "gc.freeze()" in said
    from xsp.reports.html import system_section

    assert ("generation 0: 2 in 0.022 ms (2.2% of wall time, the longest 0.012 ms); generation 2: 1 in 0.080 ms "
            "(8.0% of wall time, the longest 0.080 ms)") in system_section(make_trace(rows))


def test_siblings_deep_in_a_model_keep_the_part_where_they_differ():
    """README's first report, at 80 columns, named four of its top ten layers
    '…0.layer.1.convolution#1' and the like: which stage each was, nothing said."""
    from xsp.reports.terminal import distinct_middles

    names = [f"model.resnet.encoder.stages.{stage}.layers.0.{part}.convolution"
             for stage in range(4) for part in ("layer.1", "shortcut")]
    shown = distinct_middles([*names, "model.resnet.embedder.convolution"], 30)
    assert shown[names[7]] == "…stages.3…shortcut.convolution"
    assert shown[names[6]] == "…stages.3…layer.1.convolution"
    assert len(set(shown.values())) == len(names) + 1 and not any("#" in text for text in shown.values())
    for limit in range(12, 40):
        narrow = distinct_middles(names, limit)
        assert len(set(narrow.values())) == len(names) and all(len(text) <= limit for text in narrow.values())


def test_the_report_says_when_the_machine_was_busy():
    """A run whose threads waited for a CPU 42% of their ready time: the report gave its figures
    with no word of it (the waits were in the metadata, read only by xsp diff)."""
    from xsp.reports.html import latency_section

    rows = [(i + 1, None, "model", "predict", "net", i * 1000, i * 1000 + 500, {"step": i}) for i in range(3)]
    busy, quiet = make_trace(rows), make_trace(rows)
    busy.metadata["contention"] = {"waited_share": 0.42}
    quiet.metadata["contention"] = {"waited_share": 0.01}
    said = "The machine was busy: the program's threads waited for a CPU 42% of the time they were ready to run"
    for trace, shown in ((busy, True), (quiet, False)):
        console = Console(width=80, record=True, color_system=None)
        render_report(trace, console)
        assert (said in " ".join(console.export_text().split())) is shown
        assert ("The machine was busy" in latency_section(trace)) is shown


def test_the_wait_for_xsps_imports_before_the_first_step_is_said_to_be_xsps():
    """The README's example: 456 ms "before the first step (start-up, model construction)", of
    which the model was built before the session: the first recorded call waited for the modules
    xsp imports beside the program."""
    rows = [(1, None, "model", "span", "preprocess", 0, 1_000, {}),
            *[(i + 2, None, "model", "predict", "net", 300_000 + i * 1_000, 300_500 + i * 1_000, {"step": i})
              for i in range(3)]]
    trace = make_trace(rows)
    trace.metadata["imports_wait_ms"] = 290.0
    console = Console(width=80, record=True, color_system=None)
    render_report(trace, console)
    text = " ".join(console.export_text().split())
    assert ("before the first step (start-up, model construction; 290.000 ms of it xsp's own: the first recorded "
            "call waited for the modules xsp imports beside the program)") in text
