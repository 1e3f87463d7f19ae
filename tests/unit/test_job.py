"""A distributed job's cross-rank tables read from its rank files without loading them
(xsp.analysis.job): the same figures as on the whole job loaded, what was injected found."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

import xsp
from xsp import analysis
from xsp.analysis.job import BUSY, load_job

ROOT = Path(__file__).resolve().parents[2]
HOST_OFFSET_NS = 1_234_567
LATE = {(3, 5): 250_000, (1, 6): 40_000}


@pytest.fixture(scope="module")
def job_name(shared_traces, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from job_dataset import write_job
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    folder = tmp_path_factory.mktemp("job")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return write_job(shared_traces / "kineto" / "a100_nccl_rank0.json.gz", folder, 4, ranks_per_host=2,
                         host_offset_ns=HOST_OFFSET_NS, late=LATE)


@pytest.fixture(scope="module")
def both(job_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xsp.load(job_name), load_job(job_name)


@pytest.mark.parametrize("table", ["stragglers", "rank_steps", "communication", "collective_skew", "collectives"])
def test_the_job_read_from_its_files_gives_the_whole_job_s_figures(both, table):
    whole, job = both
    assert getattr(analysis, table)(job).equals(getattr(analysis, table)(whole))


def test_it_holds_a_fraction_of_the_spans_and_the_same_metadata(both):
    whole, job = both
    assert len(job.spans) < len(whole.spans) / 5 and (job.spans["name"] == BUSY).any()
    assert job.ranks == whole.ranks == [0, 1, 2, 3]
    assert job.metadata["ranks"].keys() == whole.metadata["ranks"].keys()
    assert analysis.clock_offsets(job) == analysis.clock_offsets(whole)


def test_what_was_injected_is_found_to_the_nanosecond(both):
    _, job = both
    assert analysis.clock_offsets(job) == {0: 0, 1: 0, 2: HOST_OFFSET_NS, 3: HOST_OFFSET_NS}
    stragglers = analysis.stragglers(job).set_index("step")
    skew = analysis.collective_skew(job)
    for (rank, step), delay_ns in LATE.items():
        assert int(stragglers.loc[step, "straggler"]) == rank
        assert round(stragglers.loc[step, "late_ms"] * 1e6) == 7 * delay_ns  # seven collectives a step
        in_step = skew[skew["step"] == step]
        assert set(in_step["skew_ns"]) == {delay_ns} and set(in_step["latest_rank"]) == {rank}
    entered_together = skew[skew["step"] == 4]
    assert set(entered_together["skew_ns"]) == {0} and entered_together["latest_rank"].isna().all()


def test_the_report_of_the_job_is_the_one_of_the_whole_job(job_name, both, capsys):
    from rich.console import Console

    from xsp.cli.main import main
    from xsp.reports.terminal import render_report

    whole, _ = both
    recorded = Console(record=True, width=80, file=open("/dev/null", "w"))  # noqa: SIM115
    render_report(whole, recorded, rank=2)
    assert main(["report", str(job_name), "--rank", "2"]) == 0
    printed = capsys.readouterr().out
    expected = recorded.export_text()
    assert "Collective skew" in expected and "Clocks: 2 hosts" in expected
    assert [line.rstrip() for line in printed.splitlines()] == [line.rstrip() for line in expected.splitlines()]


def test_a_rank_the_job_has_not_is_one_line(job_name, capsys):
    from xsp.cli.main import main

    assert main(["report", str(job_name), "--rank", "9"]) == 2
    assert capsys.readouterr().err.strip() == f"xsp: error: {job_name} holds no rank 9 (ranks: 0, 1, 2, 3)"


def test_one_file_or_no_job_is_not_read_as_one(job_name, shared_traces):
    assert load_job(job_name.with_name("job.rank0.xsp.parquet")) is None
    assert load_job(shared_traces / "kineto") is None  # profiler traces: loaded whole, as before


def _copy_job(job_name, folder, change=None):
    """The job's rank files copied into ``folder``, each table changed by ``change``."""
    import pyarrow.parquet as pq

    from xsp.io.parquet import read_trace_metadata, write_trace_tables

    folder.mkdir()
    for path in sorted(job_name.parent.glob("job.rank*.xsp.parquet")):
        metadata, _ = read_trace_metadata(path)
        table = pq.read_table(path)
        write_trace_tables(folder / path.name, iter([change(table) if change else table]), metadata)
    return folder / job_name.name


def test_a_corrupt_rank_file_is_refused_not_read(job_name, tmp_path):
    copied = _copy_job(job_name, tmp_path / "corrupt")
    damaged = copied.with_name("job.rank2.xsp.parquet")
    data = bytearray(damaged.read_bytes())
    middle = len(data) // 3
    data[middle:middle + 400] = bytes(400)
    damaged.write_bytes(bytes(data))
    with pytest.raises(xsp.TraceFormatError, match="job.rank2"):
        load_job(copied)


def test_rank_files_without_the_optional_columns_are_read(job_name, both, tmp_path, capsys):
    from xsp.cli.main import main
    from xsp.core import schema as col

    optional = [col.BYTES, col.MODULE_TYPE, col.INPUT_SHAPES, col.CALL_DEPTH]
    copied = _copy_job(job_name, tmp_path / "plain", lambda table: table.drop_columns(
        [name for name in optional if name in table.column_names]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        job = load_job(copied)
    _, full = both
    assert analysis.stragglers(job).equals(analysis.stragglers(full))
    assert analysis.rank_steps(job)["bytes"].eq(0).all()  # no payload column: none known, as in a whole load
    assert main(["report", str(copied), "--rank", "1"]) == 0
    assert "Rank 1 in detail" in capsys.readouterr().out


def test_a_large_job_s_table_shows_the_ranks_latest_over_all_steps(shared_traces, tmp_path, capsys):
    from xsp.cli.main import main

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from job_dataset import write_job
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        name = write_job(shared_traces / "kineto" / "a100_nccl_rank0.json.gz", tmp_path, 20,
                         late={(17, 5): 300_000, (3, 6): 300_000})
    assert main(["report", str(name)]) == 0
    printed = capsys.readouterr().out
    words = " ".join(printed.split())  # as read, whatever the lines' wrapping
    assert "the 16 of 20 ranks latest over all steps" in words
    table = printed.split("rank  steps")[1].split("Clocks:")[0]
    shown = [int(line.split()[0]) for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(shown) == 16 and {3, 17} <= set(shown)  # late in one step of three: a median of 0, all the same
    assert "Ranks 3, 17 each entered the collectives last in 1 of 3 steps" in words
    assert main(["report", str(name), "--rank", "99"]) == 2
    assert "(ranks: 0, 1, 2, 3, 4, 5, 6, 7, ... 19 (20 ranks))" in capsys.readouterr().err
