"""Many runs as one Parquet dataset: ``dataset=`` lays trace files out by run and rank, and
DuckDB queries a hundred of them at once with ``run`` and ``rank`` as partition columns."""

from __future__ import annotations

import subprocess
import sys
import time

import pandas as pd
import pyarrow.dataset as pads
import pytest
import torch
from torch import nn

import xsp
from xsp.core import schema as col

duckdb = pytest.importorskip("duckdb", reason="duckdb is in the test extra")


def infer(steps: int = 4) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randn(2, 16))


def test_a_run_writes_into_its_partition(monkeypatch, tmp_path):
    monkeypatch.setenv("XSP_RUN_ID", "nightly/42")  # not a safe folder name: made one
    with xsp.trace(levels="model,layer", dataset=tmp_path, service_name="resnet") as session:
        infer()
    assert session.output == tmp_path / "run=nightly_42" / "rank=0" / "resnet.xsp.parquet"
    assert session.output.is_file() and session.trace.metadata["run_id"] == "nightly/42"
    monkeypatch.delenv("XSP_RUN_ID")
    with xsp.trace(levels="model", dataset=tmp_path, service_name="resnet") as second:  # no run id: a fresh one
        infer(1)
    assert second.output.parent.parent != session.output.parent.parent


def test_duckdb_queries_a_hundred_trace_files_as_one_dataset(monkeypatch, tmp_path):
    monkeypatch.setenv("XSP_RUN_ID", "seed")
    with xsp.trace(levels="model,layer", dataset=tmp_path / "seed", service_name="model") as session:
        infer()
    spans = session.trace.spans
    root = tmp_path / "fleet"
    runs, ranks = 25, 4
    for run in range(runs):
        for rank in range(ranks):
            slower = spans.copy()
            # run i is i% slower: a trend a fleet query should find
            slower[col.END_NS] = slower[col.START_NS] + (slower[col.DURATION_NS] * (1 + run / 100)).astype("int64")
            slower[col.DURATION_NS] = slower[col.END_NS] - slower[col.START_NS]
            slower[col.RANK] = pd.array([rank] * len(slower), dtype="Int64")
            xsp.Trace(spans=slower, metadata=session.trace.metadata).save(
                root / f"run=r{run:03d}" / f"rank={rank}" / "model.xsp.parquet")
    files = sorted(root.rglob("*.xsp.parquet"))
    assert len(files) == 100
    dataset = f"read_parquet('{root}/**/*.xsp.parquet', hive_partitioning = true)"
    totals = duckdb.sql(f"select count(*), count(distinct run), count(distinct rank) from {dataset}").fetchall()[0]
    assert totals == (100 * len(spans), runs, ranks)
    per_run = duckdb.sql(f"""
        select run, median(duration_ns) / 1e6 as latency_ms, count(distinct rank) as ranks
        from {dataset} where kind = 'predict' group by run order by run""").df()
    assert len(per_run) == runs and (per_run["ranks"] == ranks).all()
    assert per_run["latency_ms"].is_monotonic_increasing
    # the slowest layers across the fleet, by type
    layers = duckdb.sql(f"""
        select module_type, sum(duration_ns) / 1e6 as total_ms from {dataset}
        where level = 'layer' group by module_type order by total_ms desc""").df()
    assert set(layers["module_type"]) == {"Linear", "ReLU"}
    # each file is still a trace xsp reads on its own
    assert len(xsp.load(files[0]).spans) == len(spans)
    # pandas and pyarrow read the folder as one dataset too: a file leaves out the column its
    # folder names (they refused the file's int64 rank against the folder's int32)
    frame = pd.read_parquet(root)
    assert len(frame) == 100 * len(spans)
    assert sorted(frame[col.RANK].astype(int).unique()) == list(range(ranks)) and frame["run"].nunique() == runs
    assert pads.dataset(root, partitioning="hive").count_rows() == 100 * len(spans)


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_xsp_run_writes_into_the_dataset(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nfor _ in range(3):\n    m(torch.ones(1, 4))\n")
    result = subprocess.run([sys.executable, "-m", "xsp", "run", "--dataset", "runs", "--", str(script)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "XSP_RUN_ID": "ci-7"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "run=ci-7" / "rank=0" / "job.xsp.parquet").is_file()
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    refused = subprocess.run([sys.executable, "-m", "xsp", "run", "--dataset", str(blocked / "x"), "--", str(script)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_rerun_with_the_same_run_id_takes_the_next_one_and_leaves_the_first_as_it_was(monkeypatch, tmp_path):
    """A second run with the same XSP_RUN_ID (a rerun, a restarted container) wrote part-0 over the
    first run's and left its later parts: two runs mixed in one folder, read as one, steps lost."""
    monkeypatch.setenv("XSP_RUN_ID", "svc")
    first_folder = tmp_path / "run=svc" / "rank=0"
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path, rotate=0.2, window_s=0.05):
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and not (first_folder / "part-1.xsp.parquet").exists():
            model(torch.randn(2, 16))
            time.sleep(0.001)
    first = {path.name: path.read_bytes() for path in first_folder.glob("*.xsp.parquet")}
    assert len(first) >= 3
    with pytest.warns(xsp.XspWarning, match=r"run=svc.* already holds a run's trace .* this run is svc-2"):
        with xsp.trace(levels="model,layer", dataset=tmp_path, rotate=0.2, window_s=0.05) as second:
            infer(2)
    assert {path.name: path.read_bytes() for path in first_folder.glob("*.xsp.parquet")} == first
    assert second.output == tmp_path / "run=svc-2" / "rank=0" / "part-0.xsp.parquet"
    assert second.trace.metadata["run_id"] == "svc-2"
    assert len(xsp.load(first_folder).steps) > 2 and len(xsp.load(second.output.parent).steps) == 2
    with pytest.warns(xsp.XspWarning, match="this run is svc-3"):  # whole files too (no rotate): none replaced
        with xsp.trace(levels="model", dataset=tmp_path) as third:
            infer(1)
    assert third.output.parent.parent.name == "run=svc-3" and third.output.is_file()


def test_a_run_id_a_live_session_writes_is_not_shared(tmp_path):
    """Two live sessions with one run id (workers of one server, each in parts) both wrote part-1,
    part-2...: each one's parts replaced the other's."""
    import socket

    from xsp.io.output_claim import writer_file
    from xsp.session.options import TraceOptions
    from xsp.session.output_name import OutputName
    from xsp.session.running import claim_dataset_place

    options = TraceOptions.parse(levels="model", dataset=tmp_path, rotate=60)
    first = tmp_path / "run=svc" / "rank=0" / "part-0.xsp.parquet"
    first.parent.mkdir(parents=True)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            writer_file(first).write_text(f"{socket.gethostname()}\n{other.pid}\n")  # its session's claim
            said: list[str] = []
            name = OutputName()
            path, run = claim_dataset_place(options, None, "svc", name, said.append)
            name.release()
        finally:
            other.kill()
    assert run == "svc-2" and path == tmp_path / "run=svc-2" / "rank=0" / "part-0.xsp.parquet"
    assert len(said) == 1 and "a live session" in said[0] and str(first.parent) in said[0]


def test_an_elastic_jobs_restart_is_a_run_of_its_own():
    from xsp.core.rank import rank_info, run_id

    environ = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job7"}
    assert run_id(rank_info(environ), environ) == "job7"
    restarted = {**environ, "TORCHELASTIC_RESTART_COUNT": "2"}
    assert run_id(rank_info(restarted), restarted) == "job7-restart2"
    assert run_id(rank_info(restarted), {**restarted, "XSP_RUN_ID": "mine"}) == "mine"


def test_a_sealed_part_whose_spans_hang_below_the_session_span_reads_without_a_cut_short_warning(
        monkeypatch, tmp_path):
    """Spans between steps (a `preprocess` span) hang below the session span, which only the last
    part holds: every sealed part warned that it was cut short, at the end of the run and at
    every `xsp report` of it."""
    import warnings

    from xsp.io.tree_windows import tree_windows

    monkeypatch.setenv("XSP_RUN_ID", "svc")
    folder = tmp_path / "run=svc" / "rank=0"
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path, rotate=0.2, window_s=0.05):
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and not (folder / "part-1.xsp.parquet").exists():
            with xsp.span("preprocess"):
                batch = torch.randn(2, 16)
            model(batch)
            time.sleep(0.001)
    sealed = folder / "part-0.xsp.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("error", xsp.XspWarning)
        part = xsp.load(sealed)
        windows = tree_windows(sealed, window_spans=50)
    preprocess = part.spans[part.spans[col.NAME] == "preprocess"]
    assert len(preprocess) > 0 and preprocess[col.PARENT_ID].notna().all()  # below the session span, elsewhere
    assert windows.spans == len(part.spans)
    whole = xsp.load(folder)
    session_span = whole.spans[whole.spans[col.KIND] == "session"][col.SPAN_ID].iloc[0]
    assert (whole.spans[whole.spans[col.NAME] == "preprocess"][col.PARENT_ID] == session_span).all()


def test_a_part_due_within_half_a_window_is_sealed_at_that_window_not_the_next(monkeypatch, tmp_path):
    """With windows as long as the parts (`--rotate 3s`, always-on windows of 3 s), a part is
    checked as a window closes, a little less than its time after it began, and came out 6 s
    long: twice what was asked."""
    import xsp.session.running as running

    monkeypatch.setenv("XSP_RUN_ID", "svc")
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    folder = tmp_path / "run=svc" / "rank=0"
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path, rotate=30, window_s=30) as session:
        model(torch.randn(2, 16))
        run = session.run
        assert run is not None
        began = run.part_started_ns or run.start_ns
        monkeypatch.setattr(running, "now_ns", lambda: began + int(14 * 1e9))
        run.rotate_if_due()  # 14 s of a 30 s part: not due
        assert not (folder / "part-0.xsp.parquet").exists()
        monkeypatch.setattr(running, "now_ns", lambda: began + int(29 * 1e9))
        run.rotate_if_due()  # a window's close, 1 s short of the part's 30 s: sealed now
        assert (folder / "part-0.xsp.parquet").exists()
        monkeypatch.undo()


def test_a_dataset_of_runs_in_parts_read_as_one_says_to_read_a_runs_folder(monkeypatch, tmp_path):
    """Its advice was "load one file at a time", where one file of a run in parts is a part of it."""
    model = nn.Linear(4, 4)
    for run in ("a", "b"):
        monkeypatch.setenv("XSP_RUN_ID", run)
        with torch.no_grad(), xsp.trace(levels="model", dataset=tmp_path, rotate=0.2, window_s=0.05):
            give_up, first = time.monotonic() + 60, tmp_path / f"run={run}" / "rank=0" / "part-0.xsp.parquet"
            while time.monotonic() < give_up and not first.exists():
                model(torch.randn(2, 4))
                time.sleep(0.002)
    with pytest.raises(xsp.TraceFormatError, match=r"2 separate runs.* load one run's folder at a time"):
        xsp.load(tmp_path)
    assert len(xsp.load(tmp_path / "run=a" / "rank=0").steps) > 0
