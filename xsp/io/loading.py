"""``xsp.load``: a trace from any file xsp reads (its own, a PyTorch profiler trace, an Nsight
Systems export), or the
files of every rank of a distributed job as one trace."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspError, XspWarning, warn
from xsp.core.rank import rank_files
from xsp.io.memory_needed import check_fits, kineto_memory_bytes, parquet_memory_bytes
from xsp.io.parquet import read_trace
from xsp.io.segments import load_unfinished
from xsp.io.trace import Trace
from xsp.table.build import concat_spans

PathArg = str | os.PathLike[str]


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
    return _noting_missing_ranks(_one(path))


NSYS_SUFFIXES = col.NSYS_SUFFIXES
FOREIGN_SUFFIXES = col.FOREIGN_SUFFIXES
"""Names of the traces other tools write that a folder is searched for when it holds no xsp trace."""


def traces_in(folder: Path) -> list[Path]:
    """The trace files under ``folder`` (and its subfolders) that :func:`load` joins: its xsp
    traces, or where there are none, its PyTorch profiler traces and Nsight Systems exports (a
    profiler's ``tensorboard_trace_handler`` writes one file per rank into one folder).

    Raises:
        xsp.TraceNotFoundError: it holds none of them.
    """
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    found = [p for p in files if p.name.endswith(col.FILE_SUFFIX)]
    if not found:
        found = [p for p in files if p.name.endswith(FOREIGN_SUFFIXES)]
    if not found:
        raise TraceNotFoundError(f"{folder} is a folder with no traces ({col.FILE_SUFFIX}, "
                                 f"{', '.join(FOREIGN_SUFFIXES)} files)")
    return found


PART_FILE = re.compile(r"^part-(\d+)" + re.escape(col.FILE_SUFFIX) + "$")
"""A part of a trace written in parts (``xsp.trace(rotate=...)``): ``part-<k>.xsp.parquet``."""


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
    (which ends the session), every part's file in ``metadata["parts"]``."""
    traces = [_one(file) for file in files]
    spans = concat_spans(trace.spans for trace in traces)
    metadata = {**traces[-1].metadata, "parts": [str(file) for file in files]}
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
            return _with_rank(load_kineto(path))
        if is_nsys_path(path):
            return _with_rank(load_nsys(path))
        if str(path).endswith(NSYS_SUFFIXES) and os.path.isfile(path):
            raise TraceFormatError(f"{path} is not an SQLite file, so no Nsight Systems export (empty or damaged?)")
        if not os.path.lexists(path):
            unfinished = load_unfinished(path)
            if unfinished is not None:
                return _with_rank(Trace(spans=unfinished[0], metadata=unfinished[1]))
        if os.path.isfile(path):
            check_fits(Path(path), parquet_memory_bytes(Path(path)),
                       "DuckDB queries it without loading it (docs/fleet.md)")
        spans, metadata = read_trace(path)
    except XspError:
        raise
    except Exception as exc:  # whatever else a damaged file provokes: still the caller's one error type
        raise TraceFormatError(f"{path} could not be read: {type(exc).__name__}: {exc}") from None
    return _with_rank(Trace(spans=spans, metadata=metadata))


def _rank_of(metadata: dict[str, Any]) -> int | None:
    job = metadata.get("distributed")
    if isinstance(job, dict) and isinstance(job.get("rank"), int):
        return int(job["rank"])
    return None


def _with_rank(trace: Trace) -> Trace:
    """A rank's file whose spans carry no rank (its process group was set up inside the
    session): the rank from its metadata."""
    rank = _rank_of(trace.metadata)
    if rank is None:
        return trace
    spans = trace.spans
    if col.RANK not in spans or spans[col.RANK].isna().all():
        spans[col.RANK] = pd.array(np.full(len(spans), rank), dtype="Int64")
    return trace


def _job_of(trace: Trace) -> str | None:
    job = trace.metadata.get("distributed")
    return str(job.get("job_id")) if isinstance(job, dict) and job.get("job_id") is not None else None


RANKS_APART = "ranks_apart"
"""Metadata of a joined trace whose ranks' times do not overlap (True): its cross-rank figures
(who waited for whom) mean nothing, and reports leave them out."""


def _ranks_apart(by_rank: dict[int, Trace]) -> bool:
    """Whether some rank's spans end before another's begin (and warn so): ranks of one job run
    together, and files of different runs joined as ranks make every cross-rank figure (who
    waited for whom) meaningless. Asked only of files that do not name their job."""
    spans = {rank: trace.spans for rank, trace in by_rank.items() if len(trace.spans)}
    if len(spans) < 2:
        return False
    latest_start = max(int(s[col.START_NS].min()) for s in spans.values())
    earliest_end = min(int(s[col.END_NS].max()) for s in spans.values())
    if latest_start <= earliest_end:
        return False
    files = ", ".join(str(by_rank[rank].metadata.get("file")) for rank in sorted(spans))
    warn(XspWarning(f"the ranks' times do not overlap ({files}): the files may come from "
                             "different runs, and what one rank waited for another is meaningless"))
    return True


def _read(entry: Path | list[Path]) -> Trace:
    """One file, or the parts of one trace."""
    return _in_parts(entry) if isinstance(entry, list) else _one(entry)


def _named(entry: Path | list[Path]) -> Path:
    """What names an entry of :func:`_joined`: the file, or the last part."""
    return entry[-1] if isinstance(entry, list) else entry


def _joined(files: Sequence[Path | list[Path]], newest_job: bool = False) -> Trace:
    """Several files as one trace: each keeps its rank (from its spans or metadata), else its
    position in ``files``; every rank's metadata under ``metadata["ranks"]``.

    Files of several distributed jobs are refused, or with ``newest_job`` (the rank files found
    for one name: an earlier job may have left some) only the newest job's are read, and the
    others named in ``metadata["ignored_files"]``.
    """
    if len(files) == 1:
        return _noting_missing_ranks(_read(files[0]))
    traces = [(_named(file), _read(file)) for file in files]
    jobs = {_job_of(trace) for _, trace in traces}
    ignored: list[str] = []
    if len(jobs) > 1:
        if not newest_job:
            raise TraceFormatError(f"the files hold {len(jobs)} different jobs ({', '.join(sorted(map(str, jobs)))}): "
                                   "load the files of one job at a time")
        newest = max(traces, key=lambda item: item[0].stat().st_mtime)
        keep = _job_of(newest[1])
        ignored = [str(file) for file, trace in traces if _job_of(trace) != keep]
        traces = [(file, trace) for file, trace in traces if _job_of(trace) == keep]
        if len(traces) == 1:
            trace = _noting_missing_ranks(traces[0][1])
            trace.metadata["ignored_files"] = ignored
            return trace
    by_rank: dict[int, Trace] = {}
    for position, (file, trace) in enumerate(traces):
        spans = trace.spans
        rank = _rank_of(trace.metadata)
        if rank is None:
            present = spans[col.RANK].dropna().unique() if col.RANK in spans else []
            rank = int(present[0]) if len(present) == 1 else position
        if rank in by_rank:
            raise TraceFormatError(f"{file} and {by_rank[rank].metadata.get('file')} both hold rank {rank}: load the "
                                   "files of one run at a time")
        spans[col.RANK] = pd.array(np.full(len(spans), rank), dtype="Int64")
        trace.metadata["file"] = str(file)
        by_rank[rank] = trace
    ranks = sorted(by_rank)
    # files that name their job are its ranks; files that do not (a profiler's) may be anything
    apart = jobs == {None} and _ranks_apart(by_rank)
    spans = concat_spans(by_rank[r].spans for r in ranks)
    spans = spans.sort_values([col.START_NS, col.RANK], kind="stable").reset_index(drop=True)
    first = by_rank[ranks[0]].metadata
    metadata = {**first, "ranks": {str(r): by_rank[r].metadata for r in ranks},
                "files": [by_rank[r].metadata["file"] for r in ranks], "ignored_files": ignored, RANKS_APART: apart}
    return _noting_missing_ranks(Trace(spans=spans, metadata=metadata), ranks)


def _noting_missing_ranks(trace: Trace, ranks: list[int] | None = None) -> Trace:
    """``metadata["missing_ranks"]``: the ranks of the job (by its world size) with no file."""
    job = trace.metadata.get("distributed")
    world = job.get("world_size") if isinstance(job, dict) and job.get("job_id") is not None else None
    if isinstance(world, int) and world > 1:  # a job xsp recorded (an imported rank knows no job)
        present = set(ranks if ranks is not None else [r for r in [_rank_of(trace.metadata)] if r is not None])
        trace.metadata["missing_ranks"] = sorted(set(range(world)) - present)
    return trace
