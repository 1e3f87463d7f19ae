"""``xsp.load``: a trace from any file xsp reads (its own, a PyTorch profiler trace, an Nsight
Systems export), or the
files of every rank of a distributed job as one trace."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspError, XspWarning, warn
from xsp.core.figures import counted
from xsp.core.rank import PART_FILE, rank_files
from xsp.io.memory_needed import analysis_memory_bytes, check_fits, kineto_memory_bytes, parquet_memory_bytes
from xsp.io.parquet import read_trace
from xsp.io.segments import SEGMENT_DIR_INFIX, load_unfinished, unfinished_outputs, unsealed_windows
from xsp.io.trace import Trace
from xsp.table.build import concat_spans

PathArg = str | os.PathLike[str]


READ_IN_WINDOWS: Final = ("xsp report, xsp summary and xsp diff read it a window at a time, and DuckDB queries it "
                          "without loading it (docs/fleet.md)")
"""What reads an ``.xsp.parquet`` file too large to load, in bounded memory."""


def load_to_analyse(path: PathArg) -> Trace:
    """:func:`load` of a trace that a report or summary will analyse whole: an ``.xsp.parquet``
    file is refused where the analysis, not only the load, needs more than the free memory.

    Raises:
        xsp.TraceTooLargeError: it does not fit (see :func:`load` for the rest).
    """
    if str(path).endswith(col.FILE_SUFFIX) and os.path.isfile(path):
        check_fits(Path(path), analysis_memory_bytes(Path(path)), READ_IN_WINDOWS)
    return load(path)


def load(path: PathArg | Sequence[PathArg]) -> Trace:
    """Read a trace: xsp's ``.xsp.parquet``, a PyTorch profiler (Kineto) ``.json``/``.json.gz``, or
    an Nsight Systems SQLite export (``nsys export --type sqlite``).

    A distributed job writes one file per rank beside the name it was given
    (``ddp.rank0.xsp.parquet``, ...): loading that name (``ddp.xsp.parquet``), a folder of
    trace files, or a list of files returns them all as one trace with a ``rank`` column
    (:meth:`xsp.Trace.for_rank` takes one apart again).

    Where no file exists but a run writing it was killed before it finished, the windows it
    closed are read instead (``metadata["recovered"]`` says so; ``xsp recover`` writes the file).
    Every failure is an :class:`xsp.XspError`.

    Raises:
        xsp.TraceNotFoundError: the file does not exist (also a ``FileNotFoundError``).
        xsp.TraceFormatError: the file is not a trace xsp reads, or is truncated or corrupt.
        xsp.SchemaVersionError: the file was written by a newer xsp.
    """
    if not isinstance(path, (str, os.PathLike)):
        files = [Path(p) for p in path]
        if not files:
            raise TraceNotFoundError("no trace files given")
        return _joined(files)
    if os.path.isdir(path):
        return _joined(_parts_joined(traces_in(Path(path))))
    if not os.path.lexists(path):
        ranks = rank_files(path)
        if ranks:
            return _joined(list(ranks.values()), newest_job=True)
    return noting_missing_ranks(_one(path))


NSYS_SUFFIXES = col.NSYS_SUFFIXES
FOREIGN_SUFFIXES = col.FOREIGN_SUFFIXES
"""Names of the traces other tools write that a folder is searched for when it holds no xsp trace."""


def traces_in(folder: Path) -> list[Path]:
    """The trace files under ``folder`` (and its subfolders) that :func:`load` joins: its xsp
    traces; where none is written yet, those that runs writing them (or killed first) left windows
    for, which :func:`load` reads; else its PyTorch profiler traces and Nsight Systems exports (a
    profiler's ``tensorboard_trace_handler`` writes one file per rank into one folder).

    Raises:
        xsp.TraceNotFoundError: it holds none of them.
    """
    # a hidden folder is a running (or killed) session's windows, never a trace of its own
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    found = [p for p in files if p.name.endswith(col.FILE_SUFFIX)]
    if not found:  # a run still writing its first file (or killed first): its windows, read as load() reads them
        places = {p.parent for p in folder.rglob(f".*{SEGMENT_DIR_INFIX}*")}
        found = sorted(output for place in places for output in unfinished_outputs(place)
                       if output.name.endswith(col.FILE_SUFFIX))
    if not found:
        found = [p for p in files if p.name.endswith(FOREIGN_SUFFIXES)]
    if not found:
        raise TraceNotFoundError(f"{folder} is a folder with no traces ({col.FILE_SUFFIX}, "
                                 f"{', '.join(FOREIGN_SUFFIXES)} files)")
    return found


def _parts_joined(files: list[Path]) -> list[Path | list[Path]]:
    """``files`` with the parts of one trace (one folder's ``part-<k>`` files) together, in order."""
    by_folder: dict[Path, list[tuple[int, Path]]] = {}
    joined: list[Path | list[Path]] = []
    for file in files:
        found = PART_FILE.match(file.name)
        if found is None:
            joined.append(file)
        else:
            by_folder.setdefault(file.parent, []).append((int(found.group(1)), file))
    joined.extend([file for _, file in sorted(parts)] for parts in by_folder.values())
    return joined


def _in_parts(files: list[Path]) -> Trace:
    """The parts of one trace as one: their spans one after another, the last part's metadata
    (which ends the session), every part's file in ``metadata["parts"]``. Where the last part is
    not the session's last, the windows written after it (a run still running, or killed before
    it wrote its last part) follow it, and a warning says where they come from."""
    traces = [_one(file) for file in files]
    metadata = {**traces[-1].metadata, "parts": [str(file) for file in files]}
    last = traces[-1].metadata.get("part")
    if isinstance(last, dict) and last.get("last") is False:
        after = unsealed_windows(files[0])
        if after is not None:
            windows, later, running = after
            traces.append(Trace(spans=windows, metadata=later))
            why = (f"the run (process {running}) is still running" if running is not None else
                   f"the run was killed before it wrote them: `xsp recover {files[0].parent}` writes them as the "
                   "next part")
            count = int(later.get("recovered", {}).get("windows", 0))
            metadata = {**later, "parts": metadata["parts"], "part": last,
                        "warnings": [*later.get("warnings", []),
                                     f"{counted(count, 'window')} written after {files[-1].name} are read from "
                                     f"the windows beside {files[0].name}: {why}"]}
    spans = concat_spans(trace.spans for trace in traces)
    return Trace(spans=spans.reset_index(drop=True), metadata=metadata)


def _one(path: PathArg) -> Trace:
    from xsp.io.kineto import load_kineto  # the importers, only when asked for
    from xsp.io.kineto_json import is_kineto_path
    from xsp.io.nsys import load_nsys
    from xsp.io.nsys_export import is_nsys_path

    try:
        if is_kineto_path(path) and os.path.isfile(path):
            check_fits(Path(path), kineto_memory_bytes(Path(path)),
                       f"`xsp import {path}` converts it a window at a time, in bounded memory, into an "
                       ".xsp.parquet file that DuckDB queries without loading it (docs/fleet.md)")
        if is_kineto_path(path):
            return with_rank(load_kineto(path))
        if is_nsys_path(path):
            return with_rank(load_nsys(path))
        if str(path).endswith(NSYS_SUFFIXES) and os.path.isfile(path):
            raise TraceFormatError(f"{path} is not an SQLite file, so no Nsight Systems export (empty or damaged?)")
        if not os.path.lexists(path):
            unfinished = load_unfinished(path)
            if unfinished is not None:
                return with_rank(Trace(spans=unfinished[0], metadata=unfinished[1]))
        if os.path.isfile(path):
            check_fits(Path(path), parquet_memory_bytes(Path(path)), READ_IN_WINDOWS)
        spans, metadata = read_trace(path)
    except XspError:
        raise
    except Exception as exc:  # whatever else a damaged file provokes: still the caller's one error type
        raise TraceFormatError(f"{path} could not be read: {type(exc).__name__}: {exc}") from None
    return with_rank(Trace(spans=spans, metadata=metadata))


def rank_of_metadata(metadata: dict[str, Any]) -> int | None:
    job = metadata.get("distributed")
    if isinstance(job, dict) and isinstance(job.get("rank"), int):
        return int(job["rank"])
    return None


def with_rank(trace: Trace) -> Trace:
    """A rank's trace whose spans carry no rank (its process group was set up inside the
    session, or an imported profiler trace): the rank from its metadata, in place."""
    rank = rank_of_metadata(trace.metadata)
    if rank is None:
        return trace
    spans = trace.spans
    if col.RANK not in spans or spans[col.RANK].isna().all():
        spans[col.RANK] = pd.array(np.full(len(spans), rank), dtype="Int64")
    return trace


RANKS_APART = "ranks_apart"
"""Metadata of a joined trace whose ranks' times do not overlap (True): its cross-rank figures
(who waited for whom) mean nothing, and reports leave them out."""


@dataclass
class JobMember:
    """What joining one file into a job takes from it: its metadata, the ranks its spans carry,
    and when its spans begin and end."""

    file: Path
    metadata: dict[str, Any]
    ranks_in_spans: list[int]
    first_start_ns: int | None
    last_end_ns: int | None


EMPTY_RANKS: Final = "empty_ranks"
"""The job metadata's ranks whose file holds no span (a process killed before its first window
was written, recovered empty): counted as ranks, with nothing of theirs in any table."""


@dataclass
class JobLayout:
    """A job's files, by rank, and the joined trace's metadata (every rank's under ``ranks``)."""

    members: dict[int, JobMember]
    metadata: dict[str, Any]


def _ranks_apart(members: dict[int, JobMember]) -> bool:
    """Whether some rank's spans end before another's begin (and warn so): ranks of one job run
    together, and files of different runs joined as ranks make every cross-rank figure (who
    waited for whom) meaningless. Asked only of files that do not name their job."""
    timed = {rank: member for rank, member in members.items()
             if member.first_start_ns is not None and member.last_end_ns is not None}
    if len(timed) < 2:
        return False
    latest_start = max(int(member.first_start_ns or 0) for member in timed.values())
    earliest_end = min(int(member.last_end_ns or 0) for member in timed.values())
    if latest_start <= earliest_end:
        return False
    files = ", ".join(str(timed[rank].file) for rank in sorted(timed))
    warn(XspWarning(f"the ranks' times do not overlap ({files}): the files may come from "
                             "different runs, and what one rank waited for another is meaningless"))
    return True


def job_layout(members: list[JobMember], newest_job: bool = False) -> JobLayout:
    """Which rank each file holds, and the joined metadata, for files of one job: each keeps its
    rank (from its metadata, else from its spans), else its position in ``members``.

    Files of several distributed jobs are refused, or with ``newest_job`` (the rank files found
    for one name: an earlier job may have left some) only the newest job's are kept, and the
    others named in ``metadata["ignored_files"]``.

    Raises:
        TraceFormatError: several jobs (without ``newest_job``), or two files of one rank.
    """
    alone = [member for member in members if _recorded_alone(member)]
    if len(members) > 1 and alone:
        shown = ", ".join(str(member.file) for member in members[:3]) + (", ..." if len(members) > 3 else "")
        in_parts = any(PART_FILE.match(Path(str(member.file)).name) for member in members)
        one = ("load one run's folder at a time (run=<id>/rank=<r>: a run in parts is its folder)" if in_parts
               else "load one file at a time")
        raise TraceFormatError(f"the files hold {len(members)} separate runs, not the ranks of one job ({shown}): "
                               f"{alone[0].file} was recorded by a process of no distributed job; {one} "
                               "(xsp diff takes a folder of runs as one side)")
    jobs = {_job_of_metadata(member.metadata) for member in members}
    ignored: list[str] = []
    if len(jobs) > 1:
        if not newest_job:
            raise TraceFormatError(f"the files hold {len(jobs)} different jobs ({', '.join(sorted(map(str, jobs)))}): "
                                   "load the files of one job at a time")
        newest = max(members, key=lambda member: member.file.stat().st_mtime)
        keep = _job_of_metadata(newest.metadata)
        ignored = [str(member.file) for member in members if _job_of_metadata(member.metadata) != keep]
        members = [member for member in members if _job_of_metadata(member.metadata) == keep]
    if len(members) == 1:  # one file of the newest job left: read as it is, with the others named
        return JobLayout({0: members[0]}, {**members[0].metadata, "ignored_files": ignored})
    by_rank: dict[int, JobMember] = {}
    for position, member in enumerate(members):
        rank = rank_of_metadata(member.metadata)
        if rank is None:
            rank = member.ranks_in_spans[0] if len(member.ranks_in_spans) == 1 else position
        if rank in by_rank:
            raise TraceFormatError(f"{member.file} and {by_rank[rank].file} both hold rank {rank}: load the "
                                   "files of one run at a time")
        member.metadata["file"] = str(member.file)
        by_rank[rank] = member
    ranks = sorted(by_rank)
    # files that name their job are its ranks; files that do not (a profiler's) may be anything
    apart = jobs == {None} and _ranks_apart(by_rank)
    first = by_rank[ranks[0]].metadata
    metadata = {**first, "ranks": {str(r): by_rank[r].metadata for r in ranks},
                "files": [by_rank[r].metadata["file"] for r in ranks], "ignored_files": ignored, RANKS_APART: apart,
                EMPTY_RANKS: [r for r in ranks if by_rank[r].first_start_ns is None]}
    return JobLayout({rank: by_rank[rank] for rank in ranks}, metadata)


def _recorded_alone(member: JobMember) -> bool:
    """Whether the file is xsp's record of a process that belonged to no distributed job (its
    session found no rank, and its spans carry none): a run of its own, never one rank of a job.
    Imported traces (a profiler's, with a ``source``) may be ranks without saying so."""
    metadata = member.metadata
    return ("source" not in metadata and "distributed" in metadata and metadata["distributed"] is None
            and not member.ranks_in_spans)


def _job_of_metadata(metadata: dict[str, Any]) -> str | None:
    job = metadata.get("distributed")
    return str(job.get("job_id")) if isinstance(job, dict) and job.get("job_id") is not None else None


def _read(entry: Path | list[Path]) -> Trace:
    """One file, or the parts of one trace."""
    return _in_parts(entry) if isinstance(entry, list) else _one(entry)


def _named(entry: Path | list[Path]) -> Path:
    """What names an entry of :func:`_joined`: the file, or the last part."""
    return entry[-1] if isinstance(entry, list) else entry


def _member(file: Path, trace: Trace) -> JobMember:
    spans = trace.spans
    present = spans[col.RANK].dropna().unique() if col.RANK in spans else []
    timed = len(spans) > 0
    return JobMember(file, trace.metadata, [int(rank) for rank in present],
                     int(spans[col.START_NS].min()) if timed else None, int(spans[col.END_NS].max()) if timed else None)


def _joined(files: Sequence[Path | list[Path]], newest_job: bool = False) -> Trace:
    """Several files as one trace (:func:`job_layout`), every rank's spans with its rank."""
    if len(files) == 1:
        if isinstance(files[0], list):  # one trace in parts (a job's are counted with the job's files below)
            _check_parts_fit(files[0])
        return noting_missing_ranks(_read(files[0]))
    _check_job_fits([part for file in files for part in (file if isinstance(file, list) else [file])])
    traces = [_read(file) for file in files]
    members = [_member(_named(file), trace) for file, trace in zip(files, traces)]
    trace_of = {id(member): trace for member, trace in zip(members, traces)}
    layout = job_layout(members, newest_job)
    if len(layout.members) == 1:
        trace = noting_missing_ranks(trace_of[id(next(iter(layout.members.values())))])
        trace.metadata["ignored_files"] = layout.metadata["ignored_files"]
        return trace
    by_rank = {rank: trace_of[id(member)] for rank, member in layout.members.items()}
    for rank, trace in by_rank.items():
        trace.spans[col.RANK] = pd.array(np.full(len(trace.spans), rank), dtype="Int64")
    spans = concat_spans(by_rank[r].spans for r in sorted(by_rank))
    spans = spans.sort_values([col.START_NS, col.RANK], kind="stable").reset_index(drop=True)
    return noting_missing_ranks(Trace(spans=spans, metadata=layout.metadata), sorted(by_rank))


JOINED_COPIES: Final = 2
"""A job loaded whole holds its ranks' tables and the joined one: 24 GB measured for 1,024 ranks of
551 MB of Parquet, twice what one load of each file takes."""


def _joined_memory_bytes(files: list[Path]) -> int:
    """About the peak memory of loading ``files`` as one trace: each file's table, and the one
    made of them, are held at once while they are joined."""
    return JOINED_COPIES * sum(parquet_memory_bytes(file) for file in files
                               if file.name.endswith(col.FILE_SUFFIX) and file.is_file())


def _check_job_fits(files: list[Path]) -> None:
    """Refuse a job whose files together need more than the free memory (each may fit alone)."""
    check_fits(f"the job of {len(files)} files in {files[0].parent}", _joined_memory_bytes(files),
               "`xsp report` of the job (without --html) reads its cross-rank tables without loading it whole, then "
               "one rank's file")


def _check_parts_fit(files: list[Path]) -> None:
    """Refuse the parts of one trace where, loaded together, they need more than the free
    memory (each may fit alone): a service that ran for days has more parts than any machine
    loads at once. The message names the newest part, a trace file of its own.

    Raises:
        xsp.TraceTooLargeError: they do not fit.
    """
    check_fits(f"the trace in {files[-1].parent} ({len(files)} parts)", _joined_memory_bytes(files),
               f"each part is a trace file of its own, which xsp report reads (a window at a time where it is "
               f"too large to load), the newest {files[-1]}, and DuckDB queries them all without loading them "
               "(docs/fleet.md)")


def noting_missing_ranks(trace: Trace, ranks: list[int] | None = None) -> Trace:
    """``metadata["missing_ranks"]``: the ranks of the job (by its world size) with no file."""
    job = trace.metadata.get("distributed")
    world = job.get("world_size") if isinstance(job, dict) and job.get("job_id") is not None else None
    if isinstance(world, int) and world > 1:  # a job xsp recorded (an imported rank knows no job)
        present = set(ranks if ranks is not None else [r for r in [rank_of_metadata(trace.metadata)] if r is not None])
        trace.metadata["missing_ranks"] = sorted(set(range(world)) - present)
    return trace
