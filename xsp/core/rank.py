"""Which rank of which distributed job this process is, and how its files and trace ids follow.

A launcher (``torchrun``, ``torch.distributed.launch``, SLURM's ``srun`` with PyTorch's variables
set, a Kubernetes PyTorchJob) tells each process its rank through ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; a process group initialised by hand tells the same through
``torch.distributed``. Either way the session then

* writes its own file beside the name it was given (``ddp.xsp.parquet`` becomes
  ``ddp.rank0.xsp.parquet``, ``ddp.rank1.xsp.parquet``...), so no rank overwrites another, and
  :func:`xsp.load` reads them back as one table with a ``rank`` column;
* derives the OpenTelemetry trace id of step ``k`` from the job id and ``k`` (and the session
  trace from the job id), so that every rank's spans of one step form one distributed trace.

The job id is ``XSP_JOB_ID`` when set, else ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``),
else the launcher's job (``SLURM_JOB_ID``), else the folder torchrun's agent made for this run
(the same for the ranks it started on one host), else the rendezvous address and the parent
process (the processes ``torch.multiprocessing.spawn`` started together share it).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from xsp.core.schema import FILE_SUFFIX

JOB_ID_ENV: Final = "XSP_JOB_ID"
RUN_ID_ENV: Final = "XSP_RUN_ID"
RANK_INFIX: Final = ".rank"
_RANK_FILE = re.compile(r"^(?P<stem>.*)\.rank(?P<rank>\d+)$")
_UNSET_RUN_IDS: Final = frozenset({"", "none", "default"})


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a distributed job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str
    job_id: str
    backend: str | None = None
    """The process group's backend (``nccl``, ``gloo``), once one is initialised."""
    restart: int = 0
    """How many times the launcher restarted the job (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""

    def as_metadata(self) -> dict[str, Any]:
        return asdict(self)

    def with_backend(self, backend: str | None) -> RankInfo:
        return self if backend is None or backend == self.backend else RankInfo(**{**asdict(self), "backend": backend})


def _int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def job_id(environ: Mapping[str, str] = os.environ) -> str:
    """The id every rank of this job shares (see the module's docs)."""
    chosen = environ.get(JOB_ID_ENV, "").strip()
    if chosen:
        return chosen
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id.lower() not in _UNSET_RUN_IDS:
        return run_id
    slurm = environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        step = environ.get("SLURM_STEP_ID", "").strip()
        return f"slurm-{slurm}" + (f".{step}" if step else "")
    error_file = environ.get("TORCHELASTIC_ERROR_FILE", "")
    if error_file:  # <tmp>/torchelastic_<random>/<run id>_<random>/attempt_<n>/<local rank>/error.json
        parts = Path(error_file).parts
        agent = next((part for part in parts if part.startswith("torchelastic_")), None)
        if agent is not None:
            return agent
    # processes started together (torch.multiprocessing.spawn) share their parent, separate runs do not
    master = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if all(master):
        return f"{master[0]}:{master[1]}-{os.getppid()}"
    return f"{socket.gethostname()}-{os.getppid()}"


def _process_group() -> tuple[int, int, str | None] | None:
    """``(rank, world size, backend)`` of an initialised default process group, else None.
    Never imports torch.distributed: a program that did not is not distributed that way."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return int(dist.get_rank()), int(dist.get_world_size()), str(dist.get_backend())
    except Exception:  # a group being torn down, a backend that cannot say
        return None


def rank_info(environ: Mapping[str, str] = os.environ,
              seen: tuple[int, int, str | None] | None = None) -> RankInfo | None:
    """This process's rank, from an initialised process group, else one ``seen`` earlier
    (``(rank, world size, backend)``: a group destroyed since), else the launcher's variables;
    None when it is not one rank of several."""
    group = _process_group() or seen
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    backend = None
    if group is not None:
        rank, world, backend = group
    if rank is None or world is None or world < 2:
        return None
    local_rank = _int(environ, "LOCAL_RANK")
    local_world = _int(environ, "LOCAL_WORLD_SIZE")
    return RankInfo(rank=rank, world_size=world, local_rank=rank if local_rank is None else local_rank,
                    local_world_size=world if local_world is None else local_world, host=socket.gethostname(),
                    job_id=job_id(environ), backend=backend, restart=_int(environ, "TORCHELASTIC_RESTART_COUNT") or 0)


def current_backend() -> str | None:
    """The default process group's backend, once it is initialised."""
    group = _process_group()
    return None if group is None else group[2]


def _split(path: Path) -> tuple[str, str]:
    """``(stem, suffix)`` of a trace file name: ``ddp`` and ``.xsp.parquet``."""
    name = path.name
    if name.endswith(FILE_SUFFIX):
        return name[: -len(FILE_SUFFIX)], FILE_SUFFIX
    return path.stem, path.suffix


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes for ``path``: ``ddp.xsp.parquet`` -> ``ddp.rank3.xsp.parquet``."""
    target = Path(path)
    stem, suffix = _split(target)
    return target.with_name(f"{stem}{RANK_INFIX}{rank}{suffix}")


def rank_files(path: str | os.PathLike[str]) -> dict[int, Path]:
    """The rank files written for ``path``, by rank (empty when there are none)."""
    target = Path(path)
    stem, suffix = _split(target)
    found: dict[int, Path] = {}
    try:
        candidates = list(target.parent.glob(f"{glob.escape(stem)}{RANK_INFIX}*{glob.escape(suffix)}"))
    except OSError:
        return {}
    for candidate in candidates:
        candidate_stem, candidate_suffix = _split(candidate)
        match = _RANK_FILE.match(candidate_stem)
        if match and match["stem"] == stem and candidate_suffix == suffix and candidate.is_file():
            found[int(match["rank"])] = candidate
    return dict(sorted(found.items()))


def _hex_id(*parts: str, digits: int) -> str:
    value = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:digits]
    return value if int(value, 16) else "1".rjust(digits, "0")  # OTel forbids an all-zero id


def step_trace_id(job: str, step: int) -> str:
    """The trace id of step ``step`` of job ``job``: the same on every rank."""
    return _hex_id("xsp-step", job, str(step), digits=32)


def session_trace_id(job: str) -> str:
    """The trace id of the job's session spans (one per rank, in one trace)."""
    return _hex_id("xsp-session", job, digits=32)


def run_id(rank: RankInfo | None, environ: Mapping[str, str] = os.environ) -> str:
    """The id of this run in a dataset of runs: ``XSP_RUN_ID`` when set, else the job's id (every
    rank of a job is one run; an elastic job's restart, ``-restart<N>`` after it, a run of its
    own), else the time it started and a random suffix."""
    chosen = environ.get(RUN_ID_ENV, "").strip()
    if chosen:
        return chosen
    if rank is not None:
        return rank.job_id if not rank.restart else f"{rank.job_id}{RESTART_INFIX}{rank.restart}"
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


RESTART_INFIX: Final = "-restart"
"""Between a job's id and its restart count in the run id of a torchrun job that restarted."""


def numbered_run(run: str, number: int) -> str:
    """The id a run takes where ``run`` is taken in its dataset (an earlier run's files, a live
    session's): ``run-2``, ``run-3``..."""
    return run if number == 1 else f"{run}-{number}"


def _partition_value(text: str) -> str:
    """A value safe as a Hive partition folder (``run=<value>``) for DuckDB, Spark and Trino."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "_"


PART_PREFIX: Final = "part-"
PART_FILE: Final = re.compile(r"^" + re.escape(PART_PREFIX) + r"(\d+)" + re.escape(FILE_SUFFIX) + "$")
"""A part of a trace written in parts (``xsp.trace(rotate=...)``): ``part-<k>.xsp.parquet``."""


def part_path(folder: Path, index: int) -> Path:
    """Part ``index`` of a trace written in parts (``rotate``): ``<folder>/part-<index>.xsp.parquet``."""
    return folder / f"{PART_PREFIX}{index}{FILE_SUFFIX}"


def next_free_part(path: Path) -> Path:
    """Where the windows of ``path``, a part, go when ``path`` is already a sealed part of its run:
    the part after the last one in its folder (a run in parts writes every part's windows into
    the first part's hidden segment folder, so a killed run's windows follow its last sealed
    part, whatever that folder is named)."""
    indexes = [int(found.group(1)) for file in path.parent.glob(f"{PART_PREFIX}*{FILE_SUFFIX}")
               if (found := PART_FILE.match(file.name)) is not None]
    return part_path(path.parent, max(indexes, default=-1) + 1)


def dataset_path(root: str | os.PathLike[str], run: str, rank: int, name: str) -> Path:
    """Where a run's rank writes its trace in a dataset of runs:
    ``<root>/run=<run>/rank=<rank>/<name>.xsp.parquet``, so that every trace under ``root`` is
    one Parquet dataset with ``run`` and ``rank`` as partition columns."""
    return Path(root) / f"run={_partition_value(run)}" / f"rank={rank}" / f"{_partition_value(name)}{FILE_SUFFIX}"
