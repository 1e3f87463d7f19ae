"""Importing the real Kineto traces in ../shared/traces (recorded on V100 and A100 GPUs)."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest

import xsp
from xsp.analysis import gpu
from xsp.core import schema as col

KERNEL_COUNTS = {  # from the traces' README and their raw events
    "v100_2rank_train_rank1": {"kernel": 19370, "memcpy": 2040, "memset": 880, "runtime": 42373},
    "a100_alexnet": {"kernel": 79, "memcpy": 16, "memset": 3, "runtime": 361, "sync": 41},
    "a100_nccl_rank0": {"kernel": 2700, "memcpy": 960, "memset": 114},
    "a100_triton": {"kernel": 1, "driver": 1, "runtime": 1},
    "a100_event_sync_multistream": {"kernel": 3, "memset": 3, "sync": 5},
    "sampled_rank0": {"kernel": 1154, "memcpy": 40, "memset": 10},
    "cpu_only_rank34": {},
}
# (share of kernels linked to a launch, share with an operator ancestor) each file reaches.
# sampled_rank0 is a sampled trace: 16 optimizer kernels were launched under a record_function
# with no aten operator recorded around them (their External ids match no operator).
ATTRIBUTION = {"v100_2rank_train_rank1": (1.0, 1.0), "a100_alexnet": (1.0, 1.0), "a100_nccl_rank0": (1.0, 1.0),
               "a100_triton": (1.0, 1.0), "a100_event_sync_multistream": (1.0, 1.0),
               "sampled_rank0": (1.0, 1138 / 1154)}


@pytest.fixture(scope="module")
def traces(shared_traces):
    return {name: xsp.load(shared_traces / "kineto" / f"{name}.json.gz") for name in KERNEL_COUNTS}


@pytest.mark.parametrize("name", sorted(KERNEL_COUNTS))
def test_activity_counts_match_the_raw_events(traces, name):
    spans = traces[name].spans
    kinds = spans[col.KIND].value_counts().to_dict()
    for kind, count in KERNEL_COUNTS[name].items():
        assert kinds.get(kind, 0) == count, kind


@pytest.mark.parametrize("name", sorted(ATTRIBUTION))
def test_kernels_are_linked_to_their_launch_and_an_operator(traces, name):
    kernels = gpu.kernel_table(traces[name])
    launched, with_operator = ATTRIBUTION[name]
    assert kernels["launch"].notna().mean() == pytest.approx(launched)
    assert kernels["operator"].notna().mean() == pytest.approx(with_operator)
    assert kernels["launch"].dropna().str.match(r"cu(da)?(LaunchKernel|LaunchKernelEx|Launch)").all()
    diagnostics = traces[name].metadata["hierarchy"]
    assert diagnostics["launch_missing"] == 0 and diagnostics["duplicate_correlation"] == 0
    assert diagnostics["overlapping"] == 0


def test_every_parent_is_in_the_table_and_encloses_host_children(traces):
    for name, trace in traces.items():
        spans = trace.spans.set_index(col.SPAN_ID)
        children = spans[spans[col.PARENT_ID].notna()]
        assert children[col.PARENT_ID].isin(spans.index).all(), name
        host = children[children[col.THREAD_ID].notna()]
        parents = spans.loc[host[col.PARENT_ID].astype("int64")]
        assert (parents[col.START_NS].to_numpy() <= host[col.START_NS].to_numpy()).all(), name
        assert (parents[col.END_NS].to_numpy() >= host[col.END_NS].to_numpy()).all(), name


def test_timestamps_keep_nanoseconds(traces, shared_traces):
    raw = json.loads(gzip.open(shared_traces / "kineto" / "a100_nccl_rank0.json.gz").read())
    base = raw["baseTimeNanoseconds"]
    first = next(e for e in raw["traceEvents"] if e.get("cat") == "cpu_op")
    assert first["ts"] == 4458676522690.655 and first["dur"] == 156.777
    spans = traces["a100_nccl_rank0"].spans
    row = spans[(spans[col.NAME] == first["name"]) & (spans[col.START_NS] == base + 4458676522690655)]
    assert len(row) == 1 and row[col.DURATION_NS].iloc[0] == 156777


def test_profiler_steps_set_the_step_number(traces):
    spans = traces["sampled_rank0"].spans
    steps = spans[spans[col.KIND] == "step"]
    assert steps[col.NAME].str.startswith("ProfilerStep#").all()
    assert (steps[col.STEP] == steps[col.NAME].str.slice(len("ProfilerStep#")).astype(int)).all()
    kernels = spans[spans[col.KIND] == "kernel"]
    assert kernels[col.STEP].notna().mean() > 0.9


def test_kernel_and_copy_attributes(traces):
    spans = traces["a100_alexnet"].spans
    kernel = spans[spans[col.KIND] == "kernel"].iloc[0]
    assert json.loads(kernel[col.GRID]) and json.loads(kernel[col.BLOCK])
    assert kernel[col.REGISTERS_PER_THREAD] > 0 and pd.notna(kernel[col.DEVICE_ID]) and pd.notna(kernel[col.STREAM_ID])
    assert pd.isna(kernel[col.THREAD_ID]) and pd.notna(kernel[col.CORRELATION_ID])
    assert "est. achieved occupancy %" in json.loads(kernel[col.ATTRIBUTES])
    copies = spans[spans[col.KIND] == "memcpy"]
    assert set(copies[col.COPY_KIND]) == {"HtoD"} and (copies[col.BYTES] > 0).all()


def test_metadata_has_rank_devices_and_what_was_not_imported(traces):
    v100 = traces["v100_2rank_train_rank1"].metadata
    assert v100["rank"] == 1 and v100["source"] == "kineto"
    assert "V100" in v100["device"] and v100["device_properties"]
    assert v100["not_imported"]["ignored cpu_instant_event events"] == 28010
    assert traces["a100_nccl_rank0"].metadata["rank"] == 0


def test_host_threads_keep_their_names(traces):
    trace = traces["a100_nccl_rank0"]
    names = trace.thread_names()
    assert names[(None, 2919752)] == "thread 2919752 (pt_autograd_0)"
    assert names[(None, 2910249)] == "thread 2910249 (pt_main_thread)"
    host = set(trace.spans[col.THREAD_ID].dropna().astype(int))
    assert {thread for _, thread in names} <= host  # the streams' names are not threads'


def test_cpu_only_trace_has_no_gpu_spans(traces):
    spans = traces["cpu_only_rank34"].spans
    assert len(spans) == 15 and set(spans[col.LEVEL]) <= {"model", "operator"}
    assert gpu.kernel_table(traces["cpu_only_rank34"]).empty


def test_counter_ranges_carry_flops(shared_traces):
    trace = xsp.load(shared_traces / "kineto" / "a100_cupti_counters.json.gz")
    ranges = trace.spans[trace.spans[col.KIND] == "counters"]
    assert len(ranges) == 77 and ranges[col.FLOPS].notna().all()
    first = ranges.sort_values(col.START_NS)
    assert (first[col.FLOPS] >= 0).all() and first[col.FLOPS].sum() > 0


def test_import_cli_round_trips(shared_traces, tmp_path):
    from xsp.cli.main import main

    output = tmp_path / "alexnet.xsp.parquet"
    assert main(["import", str(shared_traces / "kineto" / "a100_alexnet.json.gz"), "-o", str(output)]) == 0
    loaded = xsp.load(output)
    direct = xsp.load(shared_traces / "kineto" / "a100_alexnet.json.gz")
    assert len(loaded.spans) == len(direct.spans)
    assert loaded.metadata["hierarchy"] == direct.metadata["hierarchy"]


@pytest.mark.parametrize("content, message", [
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "du', "truncated"),
    (b'{"hello": 1}', "not a Chrome trace"),
    (b"\x1f\x8b\x08\x00broken", "gzip"),
    (b"not json at all", "not valid"),
])
def test_bad_kineto_files_are_refused_clearly(tmp_path, content, message):
    path = tmp_path / ("bad.json.gz" if content.startswith(b"\x1f\x8b") else "bad.json")
    path.write_bytes(content)
    with pytest.raises(xsp.TraceFormatError, match=message):
        xsp.load(path)


_SMALL_TRACE = json.dumps({"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": f"aten::op{i}", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5}
    for i in range(200)]}).encode()


def test_a_cut_gzip_file_is_called_truncated(tmp_path):
    packed = gzip.compress(_SMALL_TRACE)
    path = tmp_path / "cut.json.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(xsp.TraceFormatError, match="truncated gzip"):
        xsp.load(path)


@pytest.mark.parametrize(("name", "content", "said"), [
    ("empty.json", b"", "is empty$"), ("blank.json", b" \n\t\n", r"is empty \(blanks only\)"),
    ("empty.json.gz", b"", "is empty$"), ("nothing.json.gz", gzip.compress(b""), "is empty$")])
def test_an_empty_file_is_called_empty_not_truncated(tmp_path, name, content, said):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(xsp.TraceFormatError, match=said):
        xsp.load(path)


def test_a_gzip_file_of_several_members_is_read_whole_as_gzip_reads_it(tmp_path):
    from xsp.io.kineto_json import inflated_pieces
    from xsp.io.memory_needed import MIN_GZIP_INFLATION, inflated_bytes

    half = len(_SMALL_TRACE) // 2  # concatenated files, or blocked gzip: the members are one text
    path = tmp_path / "members.json.gz"
    path.write_bytes(gzip.compress(_SMALL_TRACE[:half]) + gzip.compress(_SMALL_TRACE[half:]))
    assert len(xsp.load(path).spans) == 200
    assert b"".join(inflated_pieces(path)) == _SMALL_TRACE
    assert inflated_bytes(path) >= MIN_GZIP_INFLATION * path.stat().st_size  # its trailer gives the last member's
    cut = tmp_path / "cut.json.gz"  # a second member cut short is a truncated file
    cut.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(xsp.TraceFormatError, match="truncated"):
        xsp.load(cut)


def test_a_gzip_trailer_with_a_wrong_size_is_corrupt(tmp_path):
    packed = gzip.compress(_SMALL_TRACE)
    path = tmp_path / "odd.json.gz"
    path.write_bytes(packed[:-4] + (1).to_bytes(4, "little"))
    with pytest.raises(xsp.TraceFormatError, match="corrupt gzip.*length"):
        xsp.load(path)


def test_a_file_compressed_beyond_the_size_hint_cap_loads(tmp_path):
    # identical events compress ~300x: the buffer starts at the capped hint and grows
    event = {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 10, "dur": 5}
    raw = json.dumps({"traceEvents": [event] * 20000}).encode()
    packed = gzip.compress(raw)
    assert len(raw) > 64 * len(packed)
    path = tmp_path / "flat.json.gz"
    path.write_bytes(packed)
    assert len(xsp.load(path).spans) == 20000


def test_report_prints_gpu_sections_only_for_traces_with_gpu_activity(shared_traces, capsys):
    from xsp.cli.main import main

    assert main(["report", str(shared_traces / "kineto" / "sampled_rank0.json.gz"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    for title in ("Latency per step", "Top 3 kernels by total time", "Kernel time per operator",
                  "Memory copies and sets", "Launch overhead per step", "GPU:"):
        assert title in out, title
    assert main(["report", str(shared_traces / "kineto" / "cpu_only_rank34.json.gz")]) == 0
    out = capsys.readouterr().out
    assert "kernels by total time" not in out and "GPU:" not in out


def test_a_profiled_training_steps_forward_backward_and_optimizer_are_its_parts(tmp_path):
    """``Optimizer.step#SGD.step`` (torch.optim's annotation) and the ``## forward ##`` and
    ``## backward ##`` ranges training loops put around their passes: a step breakdown says
    where the step went, not "other 100%"."""
    from xsp import analysis

    def annotation(name, ts, dur):
        return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [annotation("ProfilerStep#4", 0, 100), annotation("## forward ##", 1, 40),
              annotation("## backward ##", 42, 40), annotation("Optimizer.step#SGD.step", 84, 10),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 2, "dur": 30}]
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    parts = analysis.step_breakdown(xsp.load(path)).iloc[0]
    assert (parts["forward_ms"], parts["backward_ms"], parts["optimizer_ms"]) == pytest.approx((0.04, 0.04, 0.01))
    assert parts["other_ms"] == pytest.approx(0.01)


def test_report_counts_agree_with_their_nouns(shared_traces, capsys):
    """"Top 1 kernels" and "1 steps" read as a machine wrote them."""
    from xsp.cli.main import main
    from xsp.core.figures import counted

    assert [counted(1, "step"), counted(3, "step"), counted(0, "kernel"), counted(1200, "step")] == [
        "1 step", "3 steps", "0 kernels", "1,200 steps"]
    assert main(["report", str(shared_traces / "kineto" / "sampled_rank0.json.gz"), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "Top 1 kernel by total time" in out and "Top 1 operator by self time" in out
    assert "Top 1 kernels" not in out and " 1 steps" not in out


def test_operator_paths_skip_enclosing_operators_and_are_unique_per_step(traces):
    spans = traces["a100_alexnet"].spans
    operators = spans[spans[col.LEVEL] == "operator"]
    # an operator anchors at the nearest enclosing span of another level, so no path has two
    # operator components in a row
    for path in operators[col.PATH]:
        components = path.split("/")
        assert not any(a.startswith("aten::") and b.startswith("aten::") for a, b in zip(components, components[1:]))
    assert not spans.duplicated([col.TRACE_ID, col.PATH]).any()


def test_events_of_odd_phases_are_counted_not_fatal(tmp_path):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
        {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "pid": 1, "tid": 1, "ts": 5},
        {"ph": "Z", "cat": "", "name": "from a newer tool", "pid": 1, "tid": 1, "ts": 6},
        {"cat": "cpu_op", "name": "no phase", "pid": 1, "tid": 1, "ts": 7},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    ]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = xsp.load(path)
    assert trace.spans[col.NAME].tolist() == ["aten::mm"]
    assert trace.metadata["not_imported"] == {
        "ignored cpu_instant_event events": 1, "ignored Z events": 1, "ignored cpu_op events": 1}


IMPORTED = ("X",)


@pytest.mark.parametrize("name", [  # the largest trace in the heavy suite
    pytest.param("v100_2rank_train_rank1", marks=pytest.mark.heavy), "a100_alexnet", "a100_nccl_rank0", "a100_triton",
    "a100_event_sync_multistream", "sampled_rank0", "cpu_only_rank34", "a100_cupti_counters"])
def test_every_argument_comes_back_whole(shared_traces, name):
    """``attributes`` leaves out what typed columns hold; kineto_arguments gives every event's
    arguments back as the file has them."""
    from xsp.io.kineto import CATEGORIES, kineto_arguments

    source = shared_traces / "kineto" / f"{name}.json.gz"
    events = json.loads(gzip.open(source).read())["traceEvents"]
    recorded = sorted((e["name"], json.dumps(e.get("args"), sort_keys=True)) for e in events
                      if e.get("ph") in IMPORTED and str(e.get("cat", "")).lower() in CATEGORIES
                      and e.get("ts") is not None and e.get("dur") is not None)
    spans = xsp.load(source).spans
    given_back = sorted((str(n), json.dumps(a, sort_keys=True))
                        for n, a in zip(spans[col.NAME].astype(str), kineto_arguments(spans)))
    assert given_back == recorded
    moved = spans[col.ATTRIBUTES].dropna()
    assert not moved.str.contains('"External id"|"correlation":[0-9]', regex=True).any()


def test_profiler_steps_share_their_paths(traces):
    """A span has the same path in every step: the profiler's step number is not part of it."""
    spans = traces["sampled_rank0"].spans
    assert isinstance(spans[col.PATH].dtype, pd.CategoricalDtype)
    steps = spans[spans[col.KIND] == "step"]
    assert set(steps[col.PATH]) == {"ProfilerStep#*[0]"} and steps[col.STEP].nunique() == 2
    timed = spans[spans[col.STEP].notna()]
    first, second = timed.groupby(col.STEP, observed=True)[col.PATH].agg(lambda p: set(p.astype(str))).tolist()
    # 2,034 of the 2,403 paths of the first step are the second's (the trace is sampled: its two
    # steps ran a few different operators); with the step's number in them, none was
    assert len(first & second) > 0.8 * min(len(first), len(second))
    categories = spans[col.PATH].cat.categories
    assert categories.is_monotonic_increasing and categories.is_unique
