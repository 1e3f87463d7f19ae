"""Distributed jobs: rank detection, rank files, joint trace ids, loading every rank, collectives
recorded from Python, and the cross-rank analyses on constructed collectives."""

from __future__ import annotations

import io
import json
import os
import threading
import time
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
from torch import nn

import xsp
from xsp import analysis
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspWarning
from xsp.core.rank import (
    job_id,
    rank_files,
    rank_info,
    rank_path,
    session_trace_id,
    step_trace_id,
)
from xsp.export.otlp import resource_for
from xsp.table.build import conform

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "job-42", "TORCHELASTIC_RESTART_COUNT": "1"}


# rank and job ------------------------------------------------------------------------
def test_rank_from_the_launchers_variables():
    info = rank_info(TORCHRUN_ENV)
    assert info is not None
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.job_id, info.restart) == (
        1, 4, 1, 2, "job-42", 1)
    assert info.as_metadata()["host"]


@pytest.mark.parametrize("environ", [{}, {"RANK": "0", "WORLD_SIZE": "1"}, {"RANK": "x", "WORLD_SIZE": "2"}])
def test_one_process_is_no_rank(environ):
    assert rank_info(environ) is None


def test_job_id_prefers_the_users_then_the_launchers():
    assert job_id({"XSP_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "run"}) == "mine"
    assert job_id({"TORCHELASTIC_RUN_ID": "run"}) == "run"
    # torchrun without a rendezvous id says "none": the agent's folder is shared by its ranks
    agent = "/tmp/torchelastic_ab12cd/none_xyz/attempt_0/1/error.json"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_ERROR_FILE": agent}) == "torchelastic_ab12cd"
    assert job_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "2"}) == "slurm-77.2"
    # processes spawned together share their parent; another run has another parent
    assert job_id({"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}) == f"node1:29500-{os.getppid()}"


def test_rank_files_sit_beside_the_given_name(tmp_path):
    target = tmp_path / "ddp.xsp.parquet"
    assert rank_path(target, 3) == tmp_path / "ddp.rank3.xsp.parquet"
    assert rank_path(tmp_path / "trace.parquet", 0) == tmp_path / "trace.rank0.parquet"
    for rank in (0, 1, 10):
        rank_path(target, rank).write_bytes(b"")
    (tmp_path / "ddpx.rank2.xsp.parquet").write_bytes(b"")  # another run's name
    assert list(rank_files(target)) == [0, 1, 10]
    assert rank_files(tmp_path / "other.xsp.parquet") == {}


def test_trace_ids_are_shared_by_every_rank_of_a_step():
    assert step_trace_id("job", 3) == step_trace_id("job", 3)
    ids = {step_trace_id("job", k) for k in range(100)} | {step_trace_id("other", 0), session_trace_id("job")}
    assert len(ids) == 102
    assert all(len(i) == 32 and int(i, 16) for i in ids)


def test_each_rank_is_its_own_service_instance():
    resource = resource_for("train", {"host": "h", "pid": 1, "distributed": {"rank": 2, "world_size": 4,
                                                                              "job_id": "job-42"}})
    attributes = dict(resource.attributes)
    assert attributes["service.instance.id"] == "job-42/rank2"
    assert (attributes["xsp.rank"], attributes["xsp.world_size"], attributes["xsp.job_id"]) == (2, 4, "job-42")
    single = dict(resource_for("train", {"host": "h", "pid": 1}).attributes)
    assert "xsp.rank" not in single and "/rank" not in str(single.get("service.instance.id", ""))


# sessions of ranks ---------------------------------------------------------------------
def train(steps: int = 3) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def record_rank(monkeypatch, output, rank: int, world: int = 2, job: str = "job-7") -> xsp.Session:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("XSP_JOB_ID", job)
    with xsp.trace(levels="model,layer", output=output) as session:
        train()
    return session


def test_a_rank_writes_its_own_file_with_its_rank_and_the_jobs_trace_ids(monkeypatch, tmp_path):
    session = record_rank(monkeypatch, tmp_path / "ddp.xsp.parquet", rank=1)
    assert session.output == tmp_path / "ddp.rank1.xsp.parquet" and session.output.is_file()
    assert not (tmp_path / "ddp.xsp.parquet").exists()
    spans = session.trace.spans
    assert (spans[col.RANK] == 1).all()
    meta = session.trace.metadata["distributed"]
    assert (meta["rank"], meta["world_size"], meta["job_id"]) == (1, 2, "job-7")
    roots = spans[spans[col.KIND] == "step"]
    assert len(roots) == 3
    assert roots[col.TRACE_ID].tolist() == [step_trace_id("job-7", int(s)) for s in roots[col.STEP]]
    session_row = spans[spans[col.KIND] == "session"].iloc[0]
    assert session_row[col.TRACE_ID] == session_trace_id("job-7")


def test_loading_the_given_name_joins_every_rank(monkeypatch, tmp_path):
    output = tmp_path / "ddp.xsp.parquet"
    for rank in (0, 1):
        record_rank(monkeypatch, output, rank)
    trace = xsp.load(output)
    assert trace.ranks == [0, 1]
    assert sorted(trace.metadata["ranks"]) == ["0", "1"] and len(trace.metadata["files"]) == 2
    assert trace.spans[col.START_NS].is_monotonic_increasing
    one = trace.for_rank(1)
    assert (one.spans[col.RANK] == 1).all() and one.metadata["distributed"]["rank"] == 1
    assert len(one.spans) + len(trace.for_rank(0).spans) == len(trace.spans)
    # a step of the job is one trace id on every rank
    steps = trace.spans[trace.spans[col.KIND] == "step"]
    assert (steps.groupby(col.STEP)[col.TRACE_ID].nunique() == 1).all()
    assert (steps.groupby(col.STEP)[col.RANK].nunique() == 2).all()
    # the same from the folder and from a list of files
    assert xsp.load(tmp_path).ranks == [0, 1]
    assert xsp.load(sorted(tmp_path.glob("*.rank*.xsp.parquet"))).ranks == [0, 1]
    with pytest.raises(KeyError, match="no spans of rank 5"):
        trace.for_rank(5)


def test_loading_two_files_of_one_rank_is_an_error(monkeypatch, tmp_path):
    record_rank(monkeypatch, tmp_path / "a.xsp.parquet", 0)
    record_rank(monkeypatch, tmp_path / "b.xsp.parquet", 0)
    with pytest.raises(TraceFormatError, match="both hold rank 0"):
        xsp.load([tmp_path / "a.rank0.xsp.parquet", tmp_path / "b.rank0.xsp.parquet"])


def test_a_folder_of_separate_runs_is_refused_not_read_as_ranks(tmp_path):
    """Two runs of one process each are no job: read as its ranks, every cross-rank figure was made up."""
    for name in ("monday", "tuesday"):
        with xsp.trace(levels="model,layer", output=tmp_path / f"{name}.xsp.parquet"):
            train()
    with pytest.raises(TraceFormatError, match=r"2 separate runs, not the ranks of one job .*load one file at a time"):
        xsp.load(tmp_path)
    with pytest.raises(TraceFormatError, match="separate runs"):
        xsp.load([tmp_path / "monday.xsp.parquet", tmp_path / "tuesday.xsp.parquet"])
    assert xsp.load(tmp_path / "monday.xsp.parquet").ranks == []  # each alone, as it is
    (tmp_path / "tuesday.xsp.parquet").unlink()
    assert xsp.load(tmp_path).metadata["distributed"] is None  # a folder of one run reads as that run


def _profiler_trace(path, rank: int, start_us: float) -> None:
    """A PyTorch profiler trace of one rank, as ``tensorboard_trace_handler`` writes it."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": start_us + 10 * i,
               "dur": 5, "args": {"External id": i + 1}} for i in range(4)]
    path.write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2},
                                "traceEvents": events, "baseTimeNanoseconds": 1_700_000_000_000_000_000}))


def test_a_folder_of_profiler_traces_loads_as_one_job(tmp_path):
    """``tensorboard_trace_handler`` writes one trace per rank into one folder."""
    for rank in (0, 1):
        _profiler_trace(tmp_path / f"worker{rank}.123.pt.trace.json", rank, 1000.0 + rank)
    (tmp_path / ".hidden.json").write_text("not a trace")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trace = xsp.load(tmp_path)
    assert trace.ranks == [0, 1] and len(trace.metadata["files"]) == 2
    assert (trace.for_rank(1).spans[col.NAME] == "aten::mm").sum() == 4
    # an xsp trace in the folder is what it is taken for; the profiler's files are then left alone
    xsp.load(tmp_path / "worker0.123.pt.trace.json").save(tmp_path / "imported.xsp.parquet")
    assert xsp.load(tmp_path).ranks == [0]


def test_ranks_whose_times_do_not_overlap_are_joined_with_a_warning(tmp_path):
    _profiler_trace(tmp_path / "a.json", 0, 1000.0)
    _profiler_trace(tmp_path / "b.json", 1, 9_000_000.0)  # nine seconds later: another run
    with pytest.warns(XspWarning, match="times do not overlap"):
        trace = xsp.load(tmp_path)
    assert trace.ranks == [0, 1] and trace.metadata["ranks_apart"] is True
    # the report shows each rank, and no figure of who waited for whom
    from rich.console import Console

    from xsp.reports.html import ranks_section
    from xsp.reports.terminal import render_report

    shown = io.StringIO()
    render_report(trace, Console(file=shown, width=80, color_system=None))
    assert "do not overlap" in shown.getvalue() and "late ms" not in shown.getvalue()
    assert "Stragglers" not in shown.getvalue() and "chart-stragglers" not in ranks_section(trace)


def test_loading_an_empty_folder_or_list_says_so(tmp_path):
    with pytest.raises(TraceNotFoundError, match="a folder with no traces"):
        xsp.load(tmp_path)
    with pytest.raises(TraceNotFoundError):
        xsp.load([])


def test_one_process_has_no_ranks(tmp_path):
    with xsp.trace(output=tmp_path / "one.xsp.parquet") as session:
        train(1)
    assert session.output == tmp_path / "one.xsp.parquet"
    assert session.trace.ranks == [] and session.trace.metadata["distributed"] is None
    assert xsp.load(tmp_path / "one.xsp.parquet").ranks == []


# collectives from Python -------------------------------------------------------------------
@pytest.fixture
def process_group():
    """A real gloo process group of one process (collectives run for real)."""
    if not dist.is_available():
        pytest.skip("this PyTorch has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_called_from_python_are_spans_with_their_payload(process_group):
    tensor = torch.ones(16)
    with xsp.trace(levels="model", output=None) as session:
        dist.all_reduce(tensor)
        dist.broadcast(tensor, src=0)
        gathered = [torch.zeros(16)]
        dist.all_gather(gathered, tensor)
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        out = torch.zeros(16)
        with pytest.warns(FutureWarning):  # PyTorch's own deprecation, unchanged under xsp
            dist.all_gather_into_tensor(out, tensor)
        dist.barrier()
    assert torch.equal(gathered[0], torch.ones(16)) and torch.equal(out, torch.ones(16))
    spans = session.trace.spans
    found = spans[spans[col.KIND].isin(["collective", "collective_wait"])]
    assert found[col.NAME].tolist() == ["all_reduce", "broadcast", "all_gather", "all_reduce", "wait all_reduce",
                                        "all_gather_into_tensor", "barrier"]
    attributes = [json.loads(a) for a in found[col.ATTRIBUTES]]
    assert [a["xsp.collective.seq"] for a in attributes] == [0, 1, 2, 3, 3, 4, 5]
    assert all(a["xsp.collective.backend"] == "gloo" and a["xsp.collective.group_size"] == 1 for a in attributes)
    assert attributes[3]["xsp.collective.async"] is True
    assert found[col.BYTES].tolist()[:4] == [64, 64, 64, 64]
    assert pd.isna(found[col.BYTES].iloc[4]) and pd.isna(found[col.BYTES].iloc[6])
    assert (found[col.LEVEL] == "model").all()
    assert dist.all_reduce.__name__ == "all_reduce" and "xsp" not in dist.all_reduce.__code__.co_filename


def test_a_failing_collective_is_an_error_span_and_still_fails(process_group):
    with xsp.trace(levels="model", output=None) as session, pytest.raises((ValueError, RuntimeError)):
        dist.broadcast(torch.ones(2), src=5)
    spans = session.trace.spans
    failed = spans[spans[col.KIND] == "collective"]
    assert failed[col.STATUS].tolist() == ["error"]


# cross-rank analyses on constructed spans ------------------------------------------------
def collective_rows(rank: int, step: int, entries_ms: list[tuple[float, float]], host_shift_ms: float = 0.0,
                    step_start_ms: float = 0.0, step_ms: float = 100.0) -> list[dict]:
    base = 1_000_000_000_000 + int(host_shift_ms * 1e6)
    rows = [{col.LEVEL: "model", col.KIND: "step", col.NAME: "train_step", col.STEP: step, col.RANK: rank,
             col.SPAN_ID: rank * 1000 + step * 100 + 1, col.THREAD_ID: 1,
             col.START_NS: base + int(step_start_ms * 1e6), col.END_NS: base + int((step_start_ms + step_ms) * 1e6)},
            {col.LEVEL: "model", col.KIND: "predict", col.NAME: "model", col.STEP: step, col.RANK: rank,
             col.SPAN_ID: rank * 1000 + step * 100 + 2, col.PARENT_ID: rank * 1000 + step * 100 + 1, col.THREAD_ID: 1,
             col.START_NS: base + int(step_start_ms * 1e6), col.END_NS: base + int((step_start_ms + 40) * 1e6)}]
    for k, (entry, duration_ms) in enumerate(entries_ms):
        start = base + int((step_start_ms + entry) * 1e6)
        rows.append({col.LEVEL: "model", col.KIND: "collective", col.NAME: "all_reduce", col.STEP: step,
                     col.RANK: rank, col.SPAN_ID: rank * 1000 + step * 100 + 10 + k,
                     col.PARENT_ID: rank * 1000 + step * 100 + 1, col.THREAD_ID: 1, col.BYTES: 1024,
                     col.START_NS: start, col.END_NS: start + int(duration_ms * 1e6)})
    return rows


def job_table(late_rank: int, delay_ms: float, ranks: int = 4, steps: int = 3, shifts: dict | None = None):
    rows = []
    for rank in range(ranks):
        shift = (shifts or {}).get(rank, 0.0)
        for step in range(steps):
            first = 50.0 + (delay_ms if rank == late_rank else 0.0)
            # the collective ends when the late rank has arrived: the same end on every rank
            end = 50.0 + delay_ms + 5.0
            rows += collective_rows(rank, step, [(first, end - first), (90.0, 5.0)], shift, step_start_ms=step * 200.0)
    frame = conform(pd.DataFrame(rows))
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    return frame


def test_the_rank_that_enters_collectives_last_is_the_straggler():
    table = analysis.stragglers(job_table(late_rank=2, delay_ms=30.0))
    assert table["straggler"].tolist() == [2, 2, 2]
    assert table["late_ms"].round(3).tolist() == [30.0, 30.0, 30.0]
    assert table["next_late_ms"].max() == pytest.approx(0.0)
    assert (table["collectives"] == 2).all() and (table["ranks"] == 4).all()


def test_communication_per_rank_counts_waiting_inside_collectives():
    per_rank = analysis.communication(job_table(late_rank=2, delay_ms=30.0))
    waiting = per_rank.set_index("rank")
    # the others waited 30 ms for rank 2 inside the first all_reduce (35 + 5 ms); rank 2 spent 5 + 5 ms
    assert waiting.loc[0, "comm_ms"] == pytest.approx(40.0)
    assert waiting.loc[2, "comm_ms"] == pytest.approx(10.0)
    assert waiting.loc[2, "late_ms"] == pytest.approx(30.0) and waiting.loc[0, "late_ms"] == pytest.approx(0.0)
    # a model-level forward span holds its collectives: it cannot tell overlap
    assert per_rank["overlap_share"].isna().all()


def test_overlap_is_communication_time_while_operators_ran():
    table = job_table(late_rank=2, delay_ms=30.0, ranks=4, steps=1)
    base = 1_000_000_000_000
    operator = {col.LEVEL: "operator", col.KIND: "operator", col.NAME: "aten::mm", col.STEP: 0, col.RANK: 0,
                col.SPAN_ID: 99_999, col.PARENT_ID: 1, col.THREAD_ID: 2,
                col.START_NS: base + 70_000_000, col.END_NS: base + 95_000_000, col.DURATION_NS: 25_000_000}
    with_ops = conform(pd.concat([table, pd.DataFrame([operator])], ignore_index=True))
    per_rank = analysis.communication(with_ops).set_index("rank")
    # rank 0 communicates 50-85 and 90-95 ms (40 ms); aten::mm runs 70-95: 15 + 5 ms of it overlap
    assert per_rank.loc[0, "overlap_share"] == pytest.approx(20 / 40)


def test_ranks_on_other_hosts_are_put_on_one_clock_by_their_collectives_ends():
    table = job_table(late_rank=1, delay_ms=20.0, shifts={3: 250.0})
    hosts = {"ranks": {str(r): {"host": "a" if r < 2 else "b"} for r in range(4)}}
    offsets = analysis.clock_offsets(xsp.Trace(spans=table, metadata=hosts))
    assert offsets[3] == pytest.approx(250e6) and offsets[1] == 0 and offsets[2] == 0
    found = analysis.stragglers(xsp.Trace(spans=table, metadata=hosts))
    assert found["straggler"].tolist() == [1, 1, 1]
    assert found["late_ms"].round(3).tolist() == [20.0, 20.0, 20.0]


def test_one_rank_has_no_stragglers_and_no_lateness():
    table = job_table(late_rank=-1, delay_ms=0.0, ranks=1)
    assert analysis.stragglers(table).empty
    assert np.isnan(analysis.communication(table)["late_ms"].iloc[0])


def test_backend_work_and_nccl_kernels_are_collectives(shared_traces):
    trace = xsp.load(shared_traces / "kineto" / "a100_nccl_rank0.json.gz")
    assert trace.ranks == [0]
    found = analysis.collectives(trace)
    assert {"enqueue", "backend", "gpu"} <= set(found["source"])
    assert set(found[found["source"] == "gpu"]["op"]) == {"all_reduce", "broadcast"}
    per_rank = analysis.communication(trace)
    assert per_rank["comm_ms"].iloc[0] > 0 and 0 <= per_rank["overlap_share"].iloc[0] <= 1
    from rich.console import Console

    from xsp.reports.terminal import render_report

    console = Console(record=True, width=80)
    render_report(trace, console)
    text = console.export_text()
    assert text.startswith("xsp report") and text.index("xsp report") < text.index("Communication per rank")


# reports and diffs of a job -------------------------------------------------------------------
def test_reports_compare_the_ranks_then_show_one(monkeypatch, tmp_path):
    from rich.console import Console

    from xsp.reports.html import render_html
    from xsp.reports.terminal import render_report

    output = tmp_path / "ddp.xsp.parquet"
    for rank in (0, 1):
        record_rank(monkeypatch, output, rank)
    trace = xsp.load(output)
    spans = conform(pd.concat([trace.spans, job_table(late_rank=1, delay_ms=25.0, ranks=2, steps=3)],
                              ignore_index=True))
    job = xsp.Trace(spans=spans, metadata=trace.metadata)
    console = Console(width=80, record=True)
    render_report(job, console, rank=1)
    text = console.export_text()
    assert "Communication per rank" in text and "Rank 1 entered the collectives last in 3 of 3 steps" in text
    assert "Rank 1 in detail" in text
    with pytest.raises(KeyError, match="no rank 7"):
        render_report(job, Console(width=80, record=True), rank=7)
    page = render_html(job)
    assert 'id="ranks"' in page and "chart-stragglers" in page


def test_two_ranks_are_compared_as_two_traces_and_a_job_is_not_one_sample(monkeypatch, tmp_path):
    output = tmp_path / "ddp.xsp.parquet"
    for rank in (0, 1):
        record_rank(monkeypatch, output, rank)
    result = xsp.diff(tmp_path / "ddp.rank0.xsp.parquet", tmp_path / "ddp.rank1.xsp.parquet", by="name")
    assert len(result.table) > 0
    job = xsp.load(output)
    assert len(xsp.diff(job.for_rank(0), job.for_rank(1), by="name").table) == len(result.table)
    with pytest.raises(ValueError, match="holds 2 ranks"):
        xsp.diff(output, tmp_path / "ddp.rank1.xsp.parquet")


def test_rank_files_of_an_earlier_job_are_left_out_and_a_missing_rank_is_named(monkeypatch, tmp_path):
    import os as _os
    import time as _time

    output = tmp_path / "job.xsp.parquet"
    for rank in (0, 1, 2):
        record_rank(monkeypatch, output, rank, world=3, job="first")
    _time.sleep(0.05)
    for rank in (0, 1):
        record_rank(monkeypatch, output, rank, world=2, job="second")
    _os.utime(tmp_path / "job.rank2.xsp.parquet", (1, 1))  # the older job's leftover
    trace = xsp.load(output)
    assert trace.ranks == [0, 1] and trace.metadata["distributed"]["job_id"] == "second"
    assert trace.metadata["ignored_files"] == [str(tmp_path / "job.rank2.xsp.parquet")]
    assert trace.metadata["missing_ranks"] == []
    with pytest.raises(TraceFormatError, match="2 different jobs"):
        xsp.load(sorted(tmp_path.glob("job.rank*.xsp.parquet")))
    (tmp_path / "job.rank2.xsp.parquet").unlink()
    (tmp_path / "job.rank1.xsp.parquet").unlink()
    alone = xsp.load(output)
    assert alone.ranks == [0] and alone.metadata["missing_ranks"] == [1]


def test_a_rank_file_with_no_spans_is_named_in_the_job_report(monkeypatch, tmp_path):
    import pyarrow.parquet as pq
    from rich.console import Console

    from xsp.analysis.job import load_job
    from xsp.reports.terminal import render_job_report, render_report

    output = tmp_path / "job.xsp.parquet"
    for rank in (0, 1, 2):
        record_rank(monkeypatch, output, rank, world=3)
    emptied = tmp_path / "job.rank1.xsp.parquet"  # as `xsp recover` leaves a rank killed before its first window
    table = pq.read_table(emptied)
    pq.write_table(table.slice(0, 0), emptied)
    whole, job = xsp.load(output), load_job(output)  # `xsp report --html` reads it whole, `xsp report` not
    for trace, render in ((whole, render_report), (job, lambda job, out: render_job_report(job, 0, whole, out))):
        assert trace.metadata["empty_ranks"] == [1] and trace.metadata["missing_ranks"] == []
        console = Console(width=80, record=True, color_system=None)
        render(trace, console)
        text = " ".join(console.export_text().split())
        assert "the file of rank(s) 1 holds no spans" in text
    from xsp.reports.html import render_html

    assert "the file of rank(s) 1 holds no spans" in render_html(whole)  # `xsp report --html`
    (tmp_path / "job.rank2.xsp.parquet").unlink()
    assert "no file of rank(s) 2 of this job was found" in render_html(xsp.load(output))
    assert "empty_ranks" not in xsp.load(tmp_path / "job.rank0.xsp.parquet").metadata


def test_ranks_that_enter_together_have_no_straggler():
    table = analysis.stragglers(job_table(late_rank=-1, delay_ms=0.0, ranks=3))
    assert table["straggler"].isna().all() and (table["late_ms"] == 0).all()


def test_a_bucket_whose_completion_callback_runs_late_still_has_its_work_time(process_group):
    # DDP's finalisation wakes when the bucket's future completes, before the future's callbacks
    # run: xsp's completion callback can run after backward has finished (on a busy machine, most
    # steps did), and the bucket then read as ending at its launch
    def late_callbacks(state, bucket):
        future: torch.futures.Future = torch.futures.Future()
        future.add_done_callback(lambda _: time.sleep(0.3))  # runs before xsp's, which comes second
        threading.Timer(0.05, future.set_result, args=(bucket.buffer(),)).start()
        return future

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    with xsp.trace(levels="model", output=None) as session:
        ddp(torch.randn(3, 4)).sum().backward()  # xsp's hook goes on at the model's first call
        ddp.register_comm_hook(None, late_callbacks)
        ddp(torch.randn(3, 4)).sum().backward()
    spans = session.trace.spans
    buckets = spans[(spans[col.KIND] == "collective") & (spans[col.NAME] == "all_reduce")]
    assert len(buckets) == 2
    works = [json.loads(a).get(col.ATTR_COLLECTIVE_WORK_NS) for a in buckets[col.ATTRIBUTES]]
    assert works[1] is not None and works[1] >= 50e6, works
