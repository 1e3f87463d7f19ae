"""The input level: how long the loop waited for its data, and the copy of each batch to the GPU.

A wait is the time ``next()`` on a DataLoader iterator blocked the loop (``input`` spans, with
the loader's ``num_workers`` and ``pin_memory``). On a GPU the batch then goes to the device:
the host-to-device copies the loop's thread launched after the wait ended and before its next
model call began are that batch's copy (``memcpy`` spans of the kernel level, so they are only
known when the kernel level was recorded).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pandas as pd

from xsp.analysis.model import INPUT_LEVELS, span_attribute, spans_of
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace

HOST_TO_DEVICE: Final = "HtoD"
INPUT_COLUMNS: Final = ["step", "name", "thread_id", "start_ns", "wait_ms", "num_workers", "pin_memory",
                        "copies", "copy_ms", "copy_bytes"]
WORKER_COLUMNS: Final = ["process_id", "worker", "batches", "failed", "samples", "fetch_ms", "fetch_ms_mean",
                         "fetch_ms_p95", "alive_ms", "busy"]


def input_spans(spans: pd.DataFrame) -> pd.DataFrame:
    """The loop's waits for data (input level; model level in traces recorded before it existed)."""
    return spans[(spans[col.KIND] == SpanKind.INPUT.value) & spans[col.LEVEL].isin(INPUT_LEVELS)]


def epoch_turns(waits: pd.DataFrame) -> np.ndarray:
    """Which of ``waits`` (:func:`input_spans` rows) turn from one epoch to the next, a boolean
    per row: each ``iter(loader)`` (``DataLoader.__iter__``: the epoch's workers start, where
    they do not persist) but a thread's first (its first epoch's workers start however they are
    kept: nothing the workers' persisting saves), the wait after it on its thread (their first
    batch) and the wait before it (the last epoch's end, where its workers stop)."""
    turns = np.zeros(len(waits), dtype=bool)
    if not len(waits):
        return turns
    threads = waits[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=-1.0)  # no thread: one of its own
    order = np.lexsort((waits[col.START_NS].to_numpy(dtype=np.int64), threads))
    starts_epoch = (waits[col.NAME].astype(str) == col.INPUT_ITER_NAME).to_numpy()[order]
    ordered_threads = threads[order]
    seen: set[float] = set()
    for at in np.flatnonzero(starts_epoch).tolist():
        if ordered_threads[at] not in seen:  # the thread's first epoch start
            seen.add(ordered_threads[at])
            continue
        turns[order[at]] = True
        for near in (at - 1, at + 1):
            if 0 <= near < len(order) and ordered_threads[near] == ordered_threads[at]:
                turns[order[near]] = True
    return turns


def later_epochs(waits: pd.DataFrame) -> int | None:
    """The epochs the loop began after each thread's first (whose workers start however they
    are kept), from :func:`~xsp.analysis.inputs.input_spans` rows; None where the trace has no
    ``iter(loader)`` (recorded before it was)."""
    starts = waits[waits[col.NAME].astype(str) == col.INPUT_ITER_NAME]
    return len(starts) - starts[col.THREAD_ID].nunique(dropna=False) if len(starts) else None


def _batch_copies(spans: pd.DataFrame, waits: pd.DataFrame) -> pd.DataFrame:
    """Per wait (by row position): count, duration and bytes of the host-to-device copies its
    thread launched between the end of the wait and the start of its next model call."""
    out = pd.DataFrame({"copies": np.zeros(len(waits), dtype=np.int64), "copy_ns": np.zeros(len(waits)),
                        "copy_bytes": np.zeros(len(waits), dtype=np.int64)})
    copies = spans[(spans[col.KIND] == SpanKind.MEMCPY.value)
                   & spans[col.COPY_KIND].fillna("").str.startswith(HOST_TO_DEVICE)]
    if copies.empty or waits.empty:
        return out
    launches = spans[spans[col.LEVEL] == Level.CUDA_API.value].set_index(col.SPAN_ID)
    launch_of = copies[col.PARENT_ID].astype("float64")
    found = launch_of.isin(launches.index.astype("float64"))
    copies, launch_ids = copies[found.to_numpy()], copies[col.PARENT_ID][found.to_numpy()].astype("int64")
    if copies.empty:
        return out
    launched_at = launches.loc[launch_ids, col.START_NS].to_numpy(dtype=np.int64)
    launched_on = launches.loc[launch_ids, col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    calls = spans[spans[col.KIND] == SpanKind.PREDICT.value]
    wait_threads = waits[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    wait_ends = waits[col.END_NS].to_numpy(dtype=np.int64)
    for thread in np.unique(wait_threads[~np.isnan(wait_threads)]):
        mine = np.flatnonzero(wait_threads == thread)
        call_starts = np.sort(calls[calls[col.THREAD_ID] == thread][col.START_NS].to_numpy(dtype=np.int64))
        wait_order = mine[np.argsort(wait_ends[mine], kind="stable")]
        ends = wait_ends[wait_order]
        # a copy belongs to the latest wait that ended before it, if no model call came between
        on_thread = np.flatnonzero(launched_on == thread)
        at = launched_at[on_thread]
        latest = np.searchsorted(ends, at, side="right") - 1
        keep = latest >= 0
        owner_end = ends[np.maximum(latest, 0)]
        next_call = np.searchsorted(call_starts, owner_end, side="left")
        call_start = np.where(next_call < len(call_starts), call_starts[np.minimum(next_call, len(call_starts) - 1)],
                              np.iinfo(np.int64).max)
        keep &= at < call_start
        for copy, wait in zip(on_thread[keep].tolist(), wait_order[latest[keep]].tolist()):
            row = copies.iloc[copy]
            out.iat[wait, 0] += 1
            out.iat[wait, 1] += float(row[col.DURATION_NS])
            out.iat[wait, 2] += int(row[col.BYTES]) if pd.notna(row[col.BYTES]) else 0
    return out


def input_waits(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per wait of the loop for a batch, in time order.

    Columns: ``step`` (null outside steps), ``name`` (``DataLoader.__next__``, or
    ``DataLoader.__iter__`` for starting an epoch's workers), ``thread_id``, ``start_ns``,
    ``wait_ms``, ``num_workers``, ``pin_memory`` (null when unknown, as in imported traces),
    ``copies``, ``copy_ms`` and ``copy_bytes`` (the batch's host-to-device copies on a GPU,
    recorded at the kernel level; 0 otherwise).
    """
    spans = spans_of(source)
    waits = input_spans(spans).sort_values(col.START_NS, kind="stable").reset_index(drop=True)
    if waits.empty:
        return pd.DataFrame(columns=INPUT_COLUMNS)
    copies = _batch_copies(spans, waits)
    attributes = waits[col.ATTRIBUTES] if col.ATTRIBUTES in waits else pd.Series([None] * len(waits))
    workers = [span_attribute(text, col.ATTR_INPUT_WORKERS) for text in attributes.tolist()]
    pinned = [span_attribute(text, col.ATTR_INPUT_PIN_MEMORY) for text in attributes.tolist()]
    return pd.DataFrame({
        # Int64 arrays, not to_numpy(): with a null among them numpy made them floats (step 0.0)
        "step": waits[col.STEP].astype("Int64").array,
        "name": waits[col.NAME].to_numpy(),
        "thread_id": waits[col.THREAD_ID].astype("Int64").array,
        "start_ns": waits[col.START_NS].to_numpy(dtype=np.int64),
        "wait_ms": waits[col.DURATION_NS].to_numpy(dtype=np.float64) / 1e6,
        "num_workers": pd.array(workers, dtype="Int64"),
        "pin_memory": pd.array(pinned, dtype="boolean"),
        "copies": copies["copies"].to_numpy(),
        "copy_ms": copies["copy_ns"].to_numpy() / 1e6,
        "copy_bytes": copies["copy_bytes"].to_numpy(),
    })[INPUT_COLUMNS]


def input_workers(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """One row per DataLoader worker process the session followed, from its ``fetch`` spans
    (see docs/processes.md): what the loop's waits were waiting for.

    Columns: ``process_id``, ``worker`` (its id in its DataLoader), ``batches`` fetched,
    ``failed`` (batches whose dataset raised), ``samples``, ``fetch_ms`` (all its fetches),
    ``fetch_ms_mean`` and ``fetch_ms_p95`` (per batch), ``alive_ms`` (its first fetch's start to
    its last one's end) and ``busy`` (``fetch_ms`` over ``alive_ms``: near 1, the worker never
    waited for work, and more workers or a faster dataset would shorten the loop's waits).
    """
    spans = spans_of(source)
    fetches = spans[spans[col.KIND] == SpanKind.FETCH.value]
    if fetches.empty or col.PROCESS_ID not in fetches:
        return pd.DataFrame(columns=WORKER_COLUMNS)
    worker = [span_attribute(text, col.ATTR_INPUT_WORKER) for text in fetches[col.ATTRIBUTES].tolist()]
    frame = pd.DataFrame({
        "process_id": fetches[col.PROCESS_ID].astype("int64").to_numpy(),
        "worker": pd.array(worker, dtype="Int64"),
        "failed": (fetches[col.STATUS].astype(str) == "error").to_numpy(),
        "samples": fetches[col.BATCH_SIZE].astype("Int64").fillna(0).to_numpy(dtype=np.int64),
        "fetch_ms": fetches[col.DURATION_NS].to_numpy(dtype=np.float64) / 1e6,
        "start_ns": fetches[col.START_NS].to_numpy(dtype=np.int64),
        "end_ns": fetches[col.END_NS].to_numpy(dtype=np.int64),
    })
    table = frame.groupby("process_id", sort=True).agg(
        worker=("worker", "first"), batches=("fetch_ms", "size"), failed=("failed", "sum"),
        samples=("samples", "sum"), fetch_ms=("fetch_ms", "sum"), fetch_ms_mean=("fetch_ms", "mean"),
        fetch_ms_p95=("fetch_ms", lambda values: float(np.percentile(values, 95))),
        first_ns=("start_ns", "min"), last_ns=("end_ns", "max")).reset_index()
    table["alive_ms"] = (table["last_ns"] - table["first_ns"]) / 1e6
    table["busy"] = np.where(table["alive_ms"] > 0, table["fetch_ms"] / table["alive_ms"].where(
        table["alive_ms"] > 0, 1.0), 1.0).clip(max=1.0)
    return table[WORKER_COLUMNS]


def input_per_step(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per step: ``step``, ``waits``, ``input_ms`` (time waiting for data) and ``input_copy_ms``."""
    waits = input_waits(source)
    waits = waits[waits["step"].notna()]
    table = waits.groupby("step", observed=True).agg(waits=("wait_ms", "size"), input_ms=("wait_ms", "sum"),
                                      input_copy_ms=("copy_ms", "sum")).reset_index()
    return table[["step", "waits", "input_ms", "input_copy_ms"]]
