"""Distributed jobs: collectives on every rank, stragglers, and communication against computation.

A trace of several ranks (``xsp.load("ddp.xsp.parquet")`` after a torchrun job, or a folder of
rank files) has a ``rank`` column. Collectives are seen at up to three depths:

* ``python``: torch.distributed calls made from Python (model level, ``collective`` spans: the
  call as the program made it, waiting included), and DDP's gradient all-reduces, bucket by
  bucket, from launch to completion (recorded through DDP's communication hook);
* ``backend``: the process group's own work (operator level, PyTorch's profiler:
  ``gloo:all_reduce`` on gloo's worker threads, ``nccl:all_reduce``); ``c10d::allreduce_`` and the like are the calls
  that enqueue them, on the calling thread;
* ``gpu``: NCCL kernels (kernel level).

**Stragglers** follow HolisticTraceAnalysis: every rank enters a group's collectives in the same
order, so the k-th collective of a kind in a step is the same collective on every rank; the rank
that enters it last holds the others up, and how much later it entered than the first is its
lateness. Entry is the enqueueing call (``c10d::...``) where the operator level was recorded,
else the Python call. Ranks on one host share its clock; ranks on several hosts are put on a
common clock first, by the ends of their blocking collectives (which end together on every rank).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.analysis.model import spans_of, step_roots
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.walks import text_matches, union_length

BACKEND_WORK: Final = re.compile(r"^(gloo|nccl|mpi|ucc|xccl|hccl):(\w+)")
ENQUEUE: Final = re.compile(r"^c10d::(\w+?)_?$")
NCCL_KERNEL: Final = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
STRAGGLER_MIN_NS: Final = 50_000
"""A step's latest rank is only called a straggler when it was at least this late (50 µs): ranks
that a previous collective just synchronised enter the next within microseconds of each other."""
COLLECTIVE_COLUMNS: Final = ["rank", "step", "source", "op", "name", "thread_id", "start_ns", "end_ns",
                             "duration_ns", "bytes"]
_ENQUEUED_AS: Final = {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter",
                       "broadcast": "broadcast", "barrier": "barrier", "alltoall": "all_to_all",
                       "alltoall_base": "all_to_all", "allgather_into_tensor_coalesced": "all_gather",
                       "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
                       "reduce_scatter_tensor_coalesced": "reduce_scatter", "allreduce_coalesced": "all_reduce",
                       "send": "send", "recv": "recv", "gather": "gather", "scatter": "scatter", "reduce": "reduce"}
_DTYPE_BYTES: Final = {"float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2, "bfloat16": 2,
                       "c10::BFloat16": 2, "c10::Half": 2, "int": 4, "int32": 4, "long": 8, "int64": 8,
                       "long int": 8, "signed char": 1, "unsigned char": 1, "int8": 1, "uint8": 1, "bool": 1}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _ranked(spans: pd.DataFrame) -> pd.DataFrame:
    if col.RANK in spans and spans[col.RANK].notna().any():
        return spans
    return spans.assign(**{col.RANK: pd.array(np.zeros(len(spans), dtype=np.int64), dtype="Int64")})


def _payload_bytes(shapes: Any, attributes: Any) -> int | None:
    """Bytes of a backend work span from its input dims and dtype (``Input type``)."""
    try:
        dims = json.loads(shapes) if isinstance(shapes, str) else None
        found = json.loads(attributes) if isinstance(attributes, str) else {}
    except ValueError:
        return None
    types = found.get("input_dtypes") or found.get("Input type") or []
    if not dims or not types:
        return None
    size = _DTYPE_BYTES.get(str(types[0]))
    first = dims[0]
    while isinstance(first, list) and first and isinstance(first[0], list):
        first = first[0]
    if size is None or not isinstance(first, list):
        return None
    return int(np.prod(first)) * size if first else None


def _work_ns(attributes: pd.Series) -> np.ndarray:
    """``xsp.collective.work_ns`` of each span (0 where absent)."""
    text = attributes.astype(object).to_numpy()
    out = np.zeros(len(text), dtype=np.int64)
    for i, value in enumerate(text.tolist()):
        if isinstance(value, str) and col.ATTR_COLLECTIVE_WORK_NS in value:
            out[i] = int(json.loads(value).get(col.ATTR_COLLECTIVE_WORK_NS) or 0)
    return out


def collectives(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Every collective span of every rank, one row each, in start order.

    Columns: ``rank``, ``step`` (-1 outside every step), ``source`` (``python``, ``enqueue``,
    ``backend`` or ``gpu``), ``op`` (``all_reduce``, ``broadcast``...), ``name``, ``thread_id``,
    ``start_ns``, ``end_ns``, ``duration_ns``, ``bytes`` (this rank's payload, when known).
    """
    spans = _ranked(spans_of(source))
    levels, kinds = spans[col.LEVEL], spans[col.KIND]
    python = ((levels == Level.MODEL.value) & (kinds == SpanKind.COLLECTIVE.value)).to_numpy()
    host = (levels == Level.OPERATOR.value).to_numpy()
    backend = host & text_matches(spans[col.NAME], BACKEND_WORK)
    enqueue = host & text_matches(spans[col.NAME], ENQUEUE)
    gpu = ((levels == Level.KERNEL.value) & (kinds == SpanKind.KERNEL.value)).to_numpy() & text_matches(
        spans[col.NAME], NCCL_KERNEL)
    frames = []
    for mask, source_name in ((python, "python"), (enqueue, "enqueue"), (backend, "backend"), (gpu, "gpu")):
        chosen = spans[mask]
        if chosen.empty:
            continue
        chosen_names = chosen[col.NAME].astype(str).tolist()
        if source_name == "python":
            ops = [n.removeprefix("wait ") for n in chosen_names]
        elif source_name == "enqueue":
            ops = [_ENQUEUED_AS.get(ENQUEUE.match(n)[1], ENQUEUE.match(n)[1]) for n in chosen_names]  # type: ignore[index]
        elif source_name == "backend":
            ops = [BACKEND_WORK.match(n)[2] for n in chosen_names]  # type: ignore[index]
        else:
            ops = [_snake(NCCL_KERNEL.match(n)[1]) for n in chosen_names]  # type: ignore[index]
        payload = chosen[col.BYTES].astype("Int64")
        ends = chosen[col.END_NS].to_numpy(dtype=np.int64)
        if source_name == "python":  # an asynchronous collective whose completion was seen (DDP's buckets)
            ends = np.maximum(ends, chosen[col.START_NS].to_numpy(dtype=np.int64) + _work_ns(chosen[col.ATTRIBUTES]))
        if source_name == "backend":
            computed = [_payload_bytes(s, a) for s, a in zip(chosen[col.INPUT_SHAPES].tolist(),
                                                            chosen[col.ATTRIBUTES].tolist())]
            payload = payload.fillna(pd.Series(pd.array(computed, dtype="Int64"), index=payload.index))
        frames.append(pd.DataFrame({
            "rank": chosen[col.RANK].fillna(0).astype("int64").to_numpy(),
            "step": chosen[col.STEP].fillna(-1).astype("int64").to_numpy(),
            "source": source_name, "op": ops, "name": chosen_names,
            "thread_id": chosen[col.THREAD_ID].to_numpy(),
            "start_ns": chosen[col.START_NS].to_numpy(dtype=np.int64),
            "end_ns": ends,
            "duration_ns": ends - chosen[col.START_NS].to_numpy(dtype=np.int64),
            "bytes": payload.to_numpy(),
        }))
    if not frames:
        return pd.DataFrame({name: pd.Series(dtype="object") for name in COLLECTIVE_COLUMNS})
    table = pd.concat(frames, ignore_index=True)
    return table.sort_values(["start_ns", "rank"], kind="stable").reset_index(drop=True)


def _timing_source(table: pd.DataFrame) -> str | None:
    """Where communication time is best seen: NCCL kernels, else the backend's work, else Python."""
    present = set(table["source"].unique().tolist())
    return next((s for s in ("gpu", "backend", "python") if s in present), None)


def _entry_source(table: pd.DataFrame) -> str | None:
    present = set(table["source"].unique().tolist())
    return next((s for s in ("enqueue", "python", "backend", "gpu") if s in present), None)


def _occurrences(table: pd.DataFrame) -> pd.DataFrame:
    """Each collective numbered within its rank, step and op: the same number is the same
    collective on every rank."""
    ordered = table.sort_values(["rank", "step", "op", "start_ns"], kind="stable")
    return ordered.assign(k=ordered.groupby(["rank", "step", "op"], observed=True).cumcount().to_numpy())


def _metadata(source: Trace | pd.DataFrame) -> dict[str, Any]:
    return source.metadata if isinstance(source, Trace) else {}


def clock_offsets(source: Trace | pd.DataFrame, metadata: dict[str, Any] | None = None) -> dict[int, int]:
    """Nanoseconds to subtract from each rank's times to put it on rank 0's clock.

    Zero for ranks on one host (they share its clock). Across hosts, the median difference of
    the ends of the same blocking collectives (which end together on every rank).
    """
    return offsets_of(collectives(source), metadata if metadata is not None else _metadata(source))


def offsets_of(table: pd.DataFrame, metadata: dict[str, Any]) -> dict[int, int]:
    """:func:`clock_offsets` of a :func:`collectives` table and the trace's metadata."""
    if table.empty:
        return {}
    ranks = sorted(int(r) for r in table["rank"].unique())
    hosts = {str(v.get("host")) for v in metadata.get("ranks", {}).values()} if metadata.get("ranks") else set()
    if len(hosts) <= 1:
        return dict.fromkeys(ranks, 0)
    timing = _occurrences(table[table["source"] == _timing_source(table)])
    reference = ranks[0]
    base = timing[timing["rank"] == reference].set_index(["step", "op", "k"])["end_ns"]
    offsets = {reference: 0}
    for rank in ranks[1:]:
        mine = timing[timing["rank"] == rank].set_index(["step", "op", "k"])["end_ns"]
        joined = mine.to_frame("mine").join(base.to_frame("base"), how="inner")
        offsets[rank] = int(np.median(joined["mine"] - joined["base"])) if len(joined) else 0
    return offsets


def _entries(table: pd.DataFrame, metadata: dict[str, Any]) -> pd.DataFrame:
    """Each collective of a :func:`collectives` table entered on each rank, on a common clock,
    with its lateness: how much later than the first rank this rank entered it."""
    if table.empty:
        return table.assign(k=pd.Series(dtype="int64"), late_ns=pd.Series(dtype="int64"))
    offsets = offsets_of(table, metadata)
    entries = _occurrences(table[table["source"] == _entry_source(table)])
    entries = entries.assign(start_ns=entries["start_ns"] - entries["rank"].map(offsets).fillna(0).astype("int64"))
    ranks = entries["rank"].nunique()
    counts = entries.groupby(["step", "op", "k"], observed=True)["rank"].transform("nunique")
    entries = entries[counts.to_numpy() == ranks]  # a collective every rank entered
    first = entries.groupby(["step", "op", "k"], observed=True)["start_ns"].transform("min")
    return entries.assign(late_ns=(entries["start_ns"] - first).to_numpy(dtype=np.int64))


def stragglers(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per step, the rank that held the others up in the step's collectives, and by how much.

    A rank's lateness in a step is the sum, over the step's collectives, of how much later it
    entered each than the first rank did: the time the others waited for it (a delay is
    absorbed by the first collective after it, so the sum counts it once).

    Columns: ``step`` (-1: collectives outside every step), ``collectives`` (matched on every
    rank), ``straggler`` (the latest rank; NA when it was less than 50 µs late: no straggler),
    ``late_ms`` (its lateness), ``next_late_ms`` (the
    next latest rank's: a straggler stands out when this is small), ``ranks``, ``entry`` (what
    entering a collective was read from: ``enqueue`` with the operator level, else ``python``).
    Empty for a trace of one rank.
    """
    columns = ["step", "collectives", "straggler", "late_ms", "next_late_ms", "ranks", "entry"]
    entries = _entries(collectives(source), _metadata(source))
    if entries.empty or entries["rank"].nunique() < 2:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
    per_rank = entries.groupby(["step", "rank"], observed=True)["late_ns"].agg(["sum", "size"]).reset_index()
    entry = str(entries["source"].iloc[0])
    rows = []
    for step, group in per_rank.groupby("step", observed=True):
        ordered = group.sort_values("sum", ascending=False, kind="stable")
        late_ns = float(ordered["sum"].iloc[0])
        rows.append({"step": int(step), "collectives": int(group["size"].min()),
                     "straggler": int(ordered["rank"].iloc[0]) if late_ns >= STRAGGLER_MIN_NS else pd.NA,
                     "late_ms": late_ns / 1e6,
                     "next_late_ms": float(ordered["sum"].iloc[1]) / 1e6, "ranks": len(group), "entry": entry})
    table = pd.DataFrame(rows, columns=columns)
    table["straggler"] = table["straggler"].astype("Int64")
    return table


COMPUTE_COLUMNS: Final = ["rank", "step", "start_ns", "end_ns", "kernel"]


def compute_intervals(spans: pd.DataFrame) -> pd.DataFrame:
    """Where each rank may compute: GPU kernels other than NCCL's (``kernel`` true) and operators
    other than communication. A rank's computation is its kernels where the kernel level was
    recorded, else its operators (:func:`computing`). ``step`` is -1 outside every step. Made of
    whole trees each, these tables add up (concatenated) to the whole trace's."""
    spans = _ranked(spans)
    names = spans[col.NAME]
    comm_names = (text_matches(names, BACKEND_WORK) | text_matches(names, ENQUEUE) | text_matches(names, NCCL_KERNEL)
                  | (spans[col.KIND] == SpanKind.COLLECTIVE.value).to_numpy())
    levels, kinds = spans[col.LEVEL], spans[col.KIND]
    kernels = ((levels == Level.KERNEL.value) & (kinds == SpanKind.KERNEL.value)).to_numpy() & ~comm_names
    operators = ((levels == Level.OPERATOR.value) & (kinds == SpanKind.OPERATOR.value)).to_numpy() & ~comm_names
    rows = kernels | operators
    return pd.DataFrame({"rank": spans[col.RANK].to_numpy(dtype=np.float64, na_value=np.nan)[rows],
                         "step": spans[col.STEP].to_numpy(dtype=np.float64, na_value=-1.0)[rows].astype(np.int64),
                         "start_ns": spans[col.START_NS].to_numpy(dtype=np.int64)[rows],
                         "end_ns": spans[col.END_NS].to_numpy(dtype=np.int64)[rows], "kernel": kernels[rows]})


def computing(compute: pd.DataFrame) -> dict[int, bool]:
    """Per rank with a compute level (:func:`compute_intervals`): whether it is the kernels'
    (else the operators'). A rank without either (only a model-level forward or backward span
    holds its collectives) cannot say whether they overlapped computation."""
    found: dict[int, bool] = {}
    for rank, kernel in zip(compute["rank"].tolist(), compute["kernel"].tolist()):
        if rank == rank:  # not NaN
            found[int(rank)] = found.get(int(rank), False) or bool(kernel)
    return found


def step_bounds(spans: pd.DataFrame) -> pd.DataFrame:
    """Each rank's steps: from their roots' first start to their last end (``rank``, ``step``,
    ``start``, ``end``, by rank and step)."""
    roots = step_roots(_ranked(spans))
    return roots.groupby([col.RANK, col.STEP], observed=True).agg(
        start=(col.START_NS, "min"), end=(col.END_NS, "max")).reset_index().rename(
        columns={col.RANK: "rank", col.STEP: "step"}).astype({"rank": np.int64, "step": np.int64})


def step_collectives(table: pd.DataFrame, bounds: pd.DataFrame) -> pd.DataFrame:
    """The collectives of each rank's step (a :func:`collectives` table, as its communication time
    is best seen) that ran within the step's time, clipped to it: ``rank``, ``step``,
    ``start_ns``, ``end_ns``, ``bytes``."""
    timing = _timing_source(table) if not table.empty else None
    chosen = table[table["source"] == timing] if timing else table.iloc[:0]
    merged = chosen[["rank", "step", "start_ns", "end_ns", "bytes"]].merge(bounds, on=["rank", "step"])
    inside = (merged["start_ns"] < merged["end"]) & (merged["end_ns"] > merged["start"])
    merged = merged[inside.to_numpy(dtype=bool)]
    return pd.DataFrame({"rank": merged["rank"].to_numpy(dtype=np.int64),
                         "step": merged["step"].to_numpy(dtype=np.int64),
                         "start_ns": np.maximum(merged["start_ns"], merged["start"]).to_numpy(dtype=np.int64),
                         "end_ns": np.minimum(merged["end_ns"], merged["end"]).to_numpy(dtype=np.int64),
                         "bytes": merged["bytes"].fillna(0).to_numpy(dtype=np.float64)})


OVERLAP_COLUMNS: Final = ["rank", "step", "busy_ns", "both_ns"]


def overlap_unions(comm: pd.DataFrame, compute: pd.DataFrame) -> pd.DataFrame:
    """Per rank and step with communication (:func:`step_collectives`): the time its computation
    ran (``busy_ns``: its chosen :func:`compute_intervals` of the step, overlaps counted once)
    and the time either ran (``both_ns``)."""
    chosen = computing(compute)
    rows = []
    for (rank, step), group in comm.groupby(["rank", "step"], sort=True):
        if int(rank) not in chosen:
            continue
        busy = compute[(compute["rank"] == rank) & (compute["step"] == step)
                       & (compute["kernel"] == chosen[int(rank)])]
        busy_starts, busy_ends = busy["start_ns"].to_numpy(dtype=np.int64), busy["end_ns"].to_numpy(dtype=np.int64)
        rows.append((int(rank), int(step), union_length(busy_starts, busy_ends), union_length(
            np.concatenate([group["start_ns"].to_numpy(dtype=np.int64), busy_starts]),
            np.concatenate([group["end_ns"].to_numpy(dtype=np.int64), busy_ends]))))
    return pd.DataFrame(rows, columns=OVERLAP_COLUMNS)


def lateness(table: pd.DataFrame, metadata: dict[str, Any]) -> dict[tuple[int, int], float]:
    """Per rank and step, the rank's lateness into the step's collectives (ms, as in
    :func:`stragglers`); empty with one rank."""
    entries = _entries(table, metadata)
    if entries.empty or entries["rank"].nunique() < 2:
        return {}
    late = entries.groupby(["rank", "step"], observed=True)["late_ns"].sum() / 1e6
    return {(int(r), int(s)): float(v) for (r, s), v in late.items()}


def rank_steps_of(bounds: pd.DataFrame, comm: pd.DataFrame, unions: pd.DataFrame, computed: dict[int, bool],
                  late: dict[tuple[int, int], float]) -> pd.DataFrame:
    """:func:`rank_steps` from its parts: :func:`step_bounds`, :func:`step_collectives`,
    :func:`overlap_unions`, :func:`computing` and :func:`lateness`."""
    per_step = comm.groupby(["rank", "step"], sort=False).agg(collectives=("bytes", "size"), bytes=("bytes", "sum"))
    union_of = {(int(r), int(s)): (int(b), int(both)) for r, s, b, both in unions[OVERLAP_COLUMNS].itertuples(
        index=False)}
    comm_ns = {key: union_length(group["start_ns"].to_numpy(dtype=np.int64), group["end_ns"].to_numpy(dtype=np.int64))
               for key, group in comm.groupby(["rank", "step"], sort=False)}
    rows = []
    for rank, step, start, end in bounds[["rank", "step", "start", "end"]].itertuples(index=False):
        key = (int(rank), int(step))
        communicated = comm_ns.get(key, 0)
        if int(rank) not in computed:
            overlap_ms = float("nan")
        elif communicated:
            busy_ns, both_ns = union_of.get(key, (0, communicated))
            overlap_ms = (communicated + busy_ns - both_ns) / 1e6
        else:
            overlap_ms = 0.0
        counted = per_step.loc[key] if key in per_step.index else None
        rows.append({
            "rank": int(rank), "step": int(step), "step_ms": (end - start) / 1e6, "comm_ms": communicated / 1e6,
            "overlap_ms": overlap_ms, "collectives": int(counted["collectives"]) if counted is not None else 0,
            "bytes": int(counted["bytes"]) if counted is not None else 0,
            "late_ms": late.get(key, float("nan")),
        })
    return pd.DataFrame(rows, columns=["rank", "step", "step_ms", "comm_ms", "overlap_ms", "collectives", "bytes",
                                       "late_ms"])


def rank_steps(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per rank and step: the step's latency, its communication time, how much of that
    overlapped computation, and the rank's lateness into the step's collectives.

    Columns: ``rank``, ``step``, ``step_ms``, ``comm_ms`` (time inside communication, overlaps
    counted once), ``overlap_ms`` (of it, while computation ran: NaN without the operator or
    kernel level, which alone show it), ``collectives``, ``bytes``,
    ``late_ms`` (the rank's lateness, as in :func:`stragglers`; NaN with one rank).
    """
    spans = _ranked(spans_of(source))
    table = collectives(spans)
    bounds = step_bounds(spans)
    comm = step_collectives(table, bounds)
    compute = compute_intervals(spans)
    # the trace's metadata says which host each rank ran on
    return rank_steps_of(bounds, comm, overlap_unions(comm, compute), computing(compute),
                         lateness(table, _metadata(source)))


def communication(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per rank, over its steps: median step latency, communication per step and its share of
    the step, the share of communication that overlapped computation, and its median lateness.

    Columns: ``rank``, ``steps``, ``step_ms``, ``comm_ms``, ``comm_share``, ``overlap_share``,
    ``collectives_per_step``, ``bytes_per_step``, ``late_ms``.
    """
    return communication_of_steps(rank_steps(source))


def communication_of_steps(per_step: pd.DataFrame) -> pd.DataFrame:
    """:func:`communication` of a :func:`rank_steps` table (for a caller that has one already)."""
    columns = ["rank", "steps", "step_ms", "comm_ms", "comm_share", "overlap_share", "collectives_per_step",
               "bytes_per_step", "late_ms"]
    if per_step.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
    rows = []
    for rank, group in per_step.groupby("rank", observed=True):
        comm = group["comm_ms"].sum()
        rows.append({
            "rank": int(rank), "steps": len(group), "step_ms": float(group["step_ms"].median()),
            "comm_ms": float(group["comm_ms"].median()),
            "comm_share": float(comm / group["step_ms"].sum()) if group["step_ms"].sum() else 0.0,
            "overlap_share": (float(group["overlap_ms"].sum() / comm) if comm and group["overlap_ms"].notna().all()
                              else float("nan")),
            "collectives_per_step": float(group["collectives"].median()),
            "bytes_per_step": float(group["bytes"].median()),
            "late_ms": float(group["late_ms"].median()),
        })
    return pd.DataFrame(rows, columns=columns)


def collective_skew(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per collective every rank entered (its step, op and number ``k`` in the step), how far apart
    the ranks entered it, on a common clock: ``skew_ns`` (the latest entry less the first), the
    latest rank and the first.

    Columns: ``step``, ``op``, ``k``, ``skew_ns``, ``latest_rank``, ``first_rank`` (both null where
    every rank entered at once), ``ranks``.
    """
    metadata = source.metadata if isinstance(source, Trace) else {}
    entries = _entries(collectives(source), metadata)
    columns = ["step", "op", "k", "skew_ns", "latest_rank", "first_rank", "ranks"]
    if entries.empty:
        return pd.DataFrame({name: pd.Series(dtype="int64") for name in columns})
    ordered = entries.sort_values(["step", "op", "k", "start_ns", "rank"], kind="stable")
    grouped = ordered.groupby(["step", "op", "k"], observed=True, sort=True)
    table = grouped.agg(skew_ns=("late_ns", "max"), latest_rank=("rank", "last"), first_rank=("rank", "first"),
                        ranks=("rank", "nunique")).reset_index()
    together = table["skew_ns"].to_numpy() == 0  # no rank was last, none first
    for name in ("latest_rank", "first_rank"):
        table[name] = table[name].astype("Int64").mask(together)
    return table[columns]
