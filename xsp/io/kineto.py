"""Importing PyTorch profiler (Kineto) Chrome-trace files into the canonical span table.

Mapping (``cat`` of complete events):

========================  =========  ===========  ===========================================
Kineto category           level      kind         notes
========================  =========  ===========  ===========================================
``user_annotation``       model      user / step  ``ProfilerStep#N`` is step ``N``; inside an
                                                  operator: operator level;
                                                  ``enumerate(DataLoader)#...``: input level
``python_function``       layer      python       kept when the profile has them
``cpu_op``                operator   operator     input shapes, sequence number
``cuda_runtime``          cuda_api   runtime      correlation id, cbid
``cuda_driver``           cuda_api   driver       correlation id, cbid
``kernel``                kernel     kernel       device, stream, grid, block, registers, shared memory
``gpu_memcpy``            kernel     memcpy       bytes, copy kind, bandwidth
``gpu_memset``            kernel     memset       bytes
``cuda_sync``             kernel     sync         synchronisation seen on a stream
``gpu_user_annotation``   kernel     user         record_function ranges on the GPU timeline
``cuda_profiler_range``   kernel     counters     CUPTI counters per range: FLOPs
========================  =========  ===========  ===========================================

Times are ``baseTimeNanoseconds`` (when present) plus ``ts`` microseconds; integer
microseconds are converted exactly and fractional ones to the nanosecond. Flow events
(``ac2g``) stand in for a missing ``correlation`` argument. Each event's arguments are kept
whole, as recorded, in ``attributes`` (``External id``, ``cbid``, occupancy, collective
sizes... as well as those copied into typed columns), so nothing is lost.
Instant events (memory allocations) and the profiler's own ``Trace`` spans are counted in
the metadata (``not_imported``), not imported; so are events with impossible times (not
finite, negative durations, before the epoch or after 2116: ``impossible_times``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp._version import __version__
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspWarning
from xsp.core.schema import Level, SpanKind
from xsp.io.kineto_json import (  # noqa: F401 - some only read from here by other code
    _ARGS_DECODER,
    _DECODER,
    _DICT_DECODER,
    _MISSING,
    _NO_ARGS,
    _QUIET_PHASES,
    _collector_paused,
    _Complete,
    _decode,
    _File,
    _Flow,
    _FlowEnd,
    _Metadata,
    _phase,
    is_kineto_path,
)
from xsp.io.trace import Trace
from xsp.table.build import build_table, new_step_state, string_array
from xsp.table.walks import MEMORY_POOL, arrow_strings, inside_any

PROFILER_STEP = re.compile(r"ProfilerStep#(\d+)$")
DATALOADER_WAIT = re.compile(r"enumerate\(DataLoader\)#")
"""The profiler's annotation of one DataLoader ``__next__``: an input-level wait."""

CATEGORIES: dict[str, tuple[Level, SpanKind]] = {
    "user_annotation": (Level.MODEL, SpanKind.USER),
    "python_function": (Level.LAYER, SpanKind.PYTHON),
    "cpu_op": (Level.OPERATOR, SpanKind.OPERATOR),
    "operator": (Level.OPERATOR, SpanKind.OPERATOR),
    "cuda_runtime": (Level.CUDA_API, SpanKind.RUNTIME),
    "runtime": (Level.CUDA_API, SpanKind.RUNTIME),
    "cuda_driver": (Level.CUDA_API, SpanKind.DRIVER),
    "kernel": (Level.KERNEL, SpanKind.KERNEL),
    "gpu_memcpy": (Level.KERNEL, SpanKind.MEMCPY),
    "gpu_memset": (Level.KERNEL, SpanKind.MEMSET),
    "cuda_sync": (Level.KERNEL, SpanKind.SYNC),
    "gpu_user_annotation": (Level.KERNEL, SpanKind.USER),
    "cuda_profiler_range": (Level.KERNEL, SpanKind.COUNTERS),
}
"""Kineto category (lower case; old traces write ``Kernel``, ``Runtime``...) -> level and kind."""
DEVICE_CATEGORIES = frozenset(
    cat for cat, (level, _) in CATEGORIES.items() if level is Level.KERNEL)
COPY_KIND = re.compile(r"Memcpy (\w+)")
FLOP_COUNTERS = {  # instruction counters -> floating-point operations per instruction
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 2,
    "smsp__sass_thread_inst_executed_op_hadd_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_hmul_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_hfma_pred_on.sum": 2,
    "smsp__sass_thread_inst_executed_op_dadd_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_dmul_pred_on.sum": 1,
    "smsp__sass_thread_inst_executed_op_dfma_pred_on.sum": 2,
}
_LAUNCH_LINKED = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"})


def _nanoseconds(values: Sequence[int | float]) -> np.ndarray:
    """Microseconds (integers exactly, fractions to the nanosecond) as int64 nanoseconds."""
    as_float = np.asarray(values, dtype=np.float64)
    whole = np.floor(as_float)
    return whole.astype(np.int64) * 1000 + np.rint((as_float - whole) * 1000).astype(np.int64)


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def _int_column(values: list[Any]) -> pd.arrays.IntegerArray:
    """A nullable int64 column; ``None``, ``_MISSING`` and values that are not integers become null."""
    types = set(map(type, values))
    if types <= {int, type(None)}:  # the usual case, converted by numpy in one go
        plain = [_MISSING if v is None else v for v in values] if type(None) in types else values
    else:
        plain = [v if type(v) is int else _MISSING if v is None else _int_or_none(v) for v in values]
        plain = [_MISSING if v is None else v for v in plain]
    data = np.array(plain, dtype=np.int64)
    mask = data == _MISSING
    return pd.arrays.IntegerArray(np.where(mask, 0, data), mask)


def _dims_texts(raws: Sequence[msgspec.Raw]) -> pd.api.extensions.ExtensionArray:
    """Shapes, grids and blocks as compact JSON text (``[24,1,1]``); null where absent or empty."""
    texts = pc.replace_substring(pa.array(_raw_strings(raws)), " ", "", memory_pool=MEMORY_POOL)
    return arrow_strings(pc.if_else(pc.equal(texts, "[]"), pa.scalar(None, texts.type), texts,
                                    memory_pool=MEMORY_POOL))


def _raw_strings(raws: Sequence[msgspec.Raw]) -> pd.api.extensions.ExtensionArray:
    """The raw JSON texts as a string column (null where empty), built from one joined buffer.

    The texts are slices of the decoded file, already UTF-8: Arrow takes their bytes and
    offsets as they are, with no Python string made per row.
    """
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
    offsets = np.zeros(len(raws) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    valid = lengths > 0
    texts = pa.LargeStringArray.from_buffers(
        len(raws), pa.py_buffer(offsets), pa.py_buffer(b"".join(raws)),
        pa.py_buffer(np.packbits(valid, bitorder="little")), int((~valid).sum()))
    texts.validate(full=True)  # a file that is not UTF-8 fails here, as it would in a decode
    return arrow_strings(texts)


def _flops(raw: msgspec.Raw) -> int | None:
    args = _DICT_DECODER.decode(raw) if raw else {}
    counted = [args[name] * factor for name, factor in FLOP_COUNTERS.items() if name in args]
    return int(sum(counted)) if counted else None


def _complete_events(events: list[Any], counts: Counter[str]) -> list[_Complete]:
    """The complete ("X") events of an imported category; the others are counted."""
    complete = [event for event in events if type(event) is _Complete]
    kept = [event for event in complete if event.cat in CATEGORIES]
    if len(kept) < len(complete):
        for event in complete:
            if event.cat not in CATEGORIES:
                cat = event.cat.lower()
                if cat in CATEGORIES:  # old traces write Kernel, Runtime...
                    event.cat = cat
                    kept.append(event)
                else:
                    counts[f"ignored {event.cat or 'uncategorised'} events"] += 1
    noisy = {kind for kind in Counter(map(type, events)) if kind is not _Complete and kind not in _QUIET_PHASES}
    if noisy:
        skipped = Counter(event.cat or _phase(event) for event in events if type(event) in noisy)
        counts.update({f"ignored {what} events": count for what, count in skipped.items()})
    return kept


def _thread_names(events: list[Any]) -> dict[str, str]:
    """Host threads' names (``thread_name`` metadata events), by thread id."""
    names = {}
    for event in events:
        if type(event) is _Metadata and event.name == "thread_name" and event.args.name:
            thread = _int_or_none(event.tid)
            if thread is not None:
                names[str(thread)] = event.args.name
    return names


def _flow_correlations(events: list[Any]) -> dict[tuple[Any, Any, int], int]:
    """``ac2g`` flow ends, by (pid, tid, ts in ns): the correlation id a flow carries."""
    flows = {}
    for event in events:
        if type(event) in (_Flow, _FlowEnd) and event.cat == "ac2g":
            flow_id = _int_or_none(event.id)
            if flow_id is not None:
                flows[(event.pid, event.tid, int(_nanoseconds([event.ts])[0]))] = flow_id
    return flows


def _scatter(count: int, rows: np.ndarray, values: Any) -> Any:
    """A full column of ``count`` nulls with ``values`` placed at ``rows``."""
    if isinstance(values, pd.arrays.ArrowStringArray):
        positions = np.full(count, -1, dtype=np.int64)
        positions[rows] = np.arange(len(rows))
        taken = pc.take(pa.array(values), pa.array(positions, mask=positions < 0), memory_pool=MEMORY_POOL)
        return arrow_strings(taken)
    if isinstance(values, pd.arrays.IntegerArray):
        data, mask = np.zeros(count, dtype=np.int64), np.ones(count, dtype=bool)
        data[rows], mask[rows] = values.to_numpy(dtype=np.int64, na_value=0), values.isna()
        return pd.arrays.IntegerArray(data, mask)
    full = np.full(count, None, dtype=object)
    full[rows] = values
    return full


def _codes_to_strings(codes: np.ndarray, categories: list[str]) -> pd.api.extensions.ExtensionArray:
    """Strings for integer codes, expanded by Arrow (no Python string per row)."""
    names = pa.array(categories, type=pa.large_string())
    return arrow_strings(pc.take(names, pa.array(codes), memory_pool=MEMORY_POOL))


_CATEGORY_NAMES = list(CATEGORIES)
_CATEGORY_INDEX = {cat: i for i, cat in enumerate(_CATEGORY_NAMES)}
_LEVEL_NAMES = [level.value for level in Level]
_KIND_NAMES = [kind.value for kind in SpanKind]
_LEVEL_OF_CATEGORY = np.array([_LEVEL_NAMES.index(CATEGORIES[c][0].value) for c in _CATEGORY_NAMES])
_KIND_OF_CATEGORY = np.array([_KIND_NAMES.index(CATEGORIES[c][1].value) for c in _CATEGORY_NAMES])
_DEVICE_CATEGORY = np.array([c in DEVICE_CATEGORIES for c in _CATEGORY_NAMES])
_STEP_CODE = _KIND_NAMES.index(SpanKind.STEP.value)
_OPERATOR_LEVEL = _LEVEL_NAMES.index(Level.OPERATOR.value)
_INPUT_CODE = _KIND_NAMES.index(SpanKind.INPUT.value)
_INPUT_LEVEL = _LEVEL_NAMES.index(Level.INPUT.value)


_start_of = attrgetter("ts")


def _annotations_inside_operators(threads: np.ndarray, category: np.ndarray, start: np.ndarray, end: np.ndarray,
                                  kind_codes: np.ndarray, level_codes: np.ndarray) -> None:
    """Give ``record_function`` annotations that run inside an operator the operator level.

    Kineto writes every ``record_function`` range as ``user_annotation``: at the top of a
    step it is a model-level span, but inside an operator (``nccl:all_reduce`` in
    ``c10d::allreduce_``) it is part of that operator, and the kernels launched below it
    belong to the operator too. An operator encloses an annotation exactly when, among the
    operators of its thread that started no later, the latest end is no earlier than its end.
    """
    annotation = (category == _CATEGORY_INDEX["user_annotation"]) & ~np.isin(kind_codes, [_STEP_CODE, _INPUT_CODE])
    operator = np.isin(category, [_CATEGORY_INDEX["cpu_op"], _CATEGORY_INDEX["operator"]])
    level_codes[inside_any(threads, start, end, operator, annotation)] = _OPERATOR_LEVEL


LATEST_NS: Final = 1 << 62
IMPOSSIBLE_TIMES: Final = "impossible_times"
MISSING_TIMES: Final = "missing_times"
LOST: Final = {IMPOSSIBLE_TIMES: "with impossible times (not finite, a negative duration, before 1970 or after 2116)",
               MISSING_TIMES: "without a start time or a duration"}
"""The ``not_imported`` counts of events a trace meant to hold but that could not become spans
(the others are phases and categories that are no span by design)."""
"""No event starts or ends later than this (year 2116) in epoch nanoseconds."""


def _plausible(events: list[Any], base_ns: int, counts: Counter[str]) -> list[Any]:
    """The events whose times are possible: finite, a start and end between the epoch and
    ``LATEST_NS``, no negative duration. The others are counted as ``impossible_times``."""
    if not events:
        return events
    timed = [event for event in events if event.ts is not None and event.dur is not None]
    if len(timed) < len(events):
        counts[MISSING_TIMES] += len(events) - len(timed)
        events = timed
        if not events:
            return events
    ts_ns = np.fromiter((e.ts for e in events), dtype=np.float64, count=len(events)) * 1e3 + base_ns
    dur_ns = np.fromiter((e.dur for e in events), dtype=np.float64, count=len(events)) * 1e3
    with np.errstate(invalid="ignore", over="ignore"):
        fine = (ts_ns >= 0) & (dur_ns >= 0) & (ts_ns + dur_ns <= LATEST_NS)  # NaN and inf compare False
    if fine.all():
        return events
    counts[IMPOSSIBLE_TIMES] += int((~fine).sum())
    return [event for event, ok in zip(events, fine.tolist()) if ok]


def kineto_rows(decoded: _File) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Span rows (times in epoch ns, sorted by start; no ids or parents yet) and metadata.

    ``decoded`` is consumed: its events are let go as soon as their fields are read, and with the
    last raw argument text the inflated file they point into, so that a trace of millions of
    events does not hold the file, its decoded events and the columns at once.
    """
    counts: Counter[str] = Counter()
    thread_names = _thread_names(decoded.traceEvents)
    base = int(decoded.baseTimeNanoseconds or 0)
    events = _plausible(_complete_events(decoded.traceEvents, counts), base, counts)
    events.sort(key=_start_of)
    count = len(events)
    index = _CATEGORY_INDEX
    # one pass per field: cheaper than one pass building tuples and transposing them
    category = np.fromiter([index[e.cat] for e in events], dtype=np.int64, count=count)
    names = [e.name for e in events]
    start = _nanoseconds([e.ts for e in events]) + base
    end = start + np.maximum(_nanoseconds([e.dur for e in events]), 0)
    tids = [e.tid for e in events]
    pids = [e.pid for e in events]
    raw_args = [e.args for e in events]
    args = [_ARGS_DECODER.decode(raw) if raw else _NO_ARGS for raw in raw_args]
    on_device = _DEVICE_CATEGORY[category] if count else np.zeros(0, dtype=bool)
    device_rows = np.flatnonzero(on_device)
    device_list = device_rows.tolist()
    device_args = [args[i] for i in device_list]
    correlation = [a.correlation for a in args]
    linked = np.isin(category, [_CATEGORY_INDEX[c] for c in _LAUNCH_LINKED])
    if any(correlation[i] in (None, _MISSING) for i in np.flatnonzero(linked).tolist()):
        flows = _flow_correlations(decoded.traceEvents)
        for i in np.flatnonzero(linked).tolist():
            if correlation[i] in (None, _MISSING):
                correlation[i] = flows.get((pids[i], tids[i], int(start[i] - base)))
    decoded.traceEvents = []  # the flows, instants and metadata events: read, no longer needed
    counter_rows = np.flatnonzero(category == _CATEGORY_INDEX["cuda_profiler_range"])
    # the columns read from raw JSON first: once made, the raw texts (and the inflated file they
    # are slices of) can go
    raw_columns = {
        col.INPUT_SHAPES: _dims_texts([a.input_dims for a in args]),
        col.GRID: _scatter(count, device_rows, _dims_texts([a.grid for a in device_args])),
        col.BLOCK: _scatter(count, device_rows, _dims_texts([a.block for a in device_args])),
        col.FLOPS: _scatter(count, counter_rows, _int_column([_flops(raw_args[i]) for i in counter_rows.tolist()])),
        col.ATTRIBUTES: _raw_strings(raw_args),
    }
    device_columns = {
        col.DEVICE_ID: _scatter(count, device_rows, _int_column(
            [pids[i] if a.device is None else a.device for a, i in zip(device_args, device_list)])),
        col.STREAM_ID: _scatter(count, device_rows, _int_column(
            [tids[i] if a.stream is None else a.stream for a, i in zip(device_args, device_list)])),
        col.REGISTERS_PER_THREAD: _scatter(count, device_rows, _int_column([a.registers for a in device_args])),
        col.SHARED_MEMORY_BYTES: _scatter(count, device_rows, _int_column([a.shared_memory for a in device_args])),
        col.BYTES: _scatter(count, device_rows, _int_column([a.nbytes for a in device_args])),
    }
    sequence = _int_column([a.sequence for a in args])
    del events, raw_args, args, device_args  # the decoded events and, with them, the inflated file
    kind_codes = _KIND_OF_CATEGORY[category] if count else np.zeros(0, dtype=np.int64)
    steps = np.zeros(count, dtype=np.int64)
    level_codes = _LEVEL_OF_CATEGORY[category] if count else np.zeros(0, dtype=np.int64)
    for i in np.flatnonzero(category == _CATEGORY_INDEX["user_annotation"]).tolist():
        match = PROFILER_STEP.match(names[i])
        if match:
            kind_codes[i] = _STEP_CODE
            steps[i] = int(match.group(1))
        elif DATALOADER_WAIT.match(names[i]):
            kind_codes[i], level_codes[i] = _INPUT_CODE, _INPUT_LEVEL
    is_step = kind_codes == _STEP_CODE
    thread_ids = _int_column(tids)
    thread_ids[on_device] = pd.NA  # a device row's tid is its stream
    process_of = pd.factorize(np.array(pids, dtype=np.int64 if set(map(type, pids)) == {int} else object))[0]
    process_of = process_of.astype(np.int64)
    del tids, pids
    threads = process_of * 1_000_003 + thread_ids.to_numpy(dtype=np.int64, na_value=-1)
    _annotations_inside_operators(threads, category, start, end, kind_codes, level_codes)
    copy_rows = np.flatnonzero(category == _CATEGORY_INDEX["gpu_memcpy"])
    copy_kinds = [m.group(1) if (m := COPY_KIND.match(names[i])) else None for i in copy_rows.tolist()]
    rows = pd.DataFrame({
        col.LEVEL: _codes_to_strings(level_codes, _LEVEL_NAMES),
        col.KIND: _codes_to_strings(kind_codes, _KIND_NAMES),
        col.NAME: string_array(names),
        col.START_NS: start,
        col.END_NS: end,
        col.THREAD_ID: thread_ids,
        col.DEVICE_ID: device_columns.pop(col.DEVICE_ID),
        col.STREAM_ID: device_columns.pop(col.STREAM_ID),
        col.CORRELATION_ID: _int_column(correlation),
        col.STEP: pd.arrays.IntegerArray(steps, ~is_step),
        col.INPUT_SHAPES: raw_columns.pop(col.INPUT_SHAPES),
        col.GRID: raw_columns.pop(col.GRID),
        col.BLOCK: raw_columns.pop(col.BLOCK),
        **device_columns,
        col.COPY_KIND: _scatter(count, copy_rows, string_array(copy_kinds)),
        col.FLOPS: raw_columns.pop(col.FLOPS),
        col.SEQUENCE_NUMBER: sequence,
        col.ATTRIBUTES: raw_columns.pop(col.ATTRIBUTES),
    })
    host_threads = set(thread_ids.dropna().astype("int64").tolist())
    metadata = {
        "source": "kineto",
        "kineto": {
            "schema_version": decoded.schemaVersion, "trace_name": decoded.traceName,
            "cupti_version": decoded.cupti_version, "cuda_runtime_version": decoded.cuda_runtime_version,
            "cuda_driver_version": decoded.cuda_driver_version,
            "base_time_ns": decoded.baseTimeNanoseconds,
        },
        "device_properties": decoded.deviceProperties,
        "rank": decoded.distributedInfo.get("rank"),
        "world_size": decoded.distributedInfo.get("world_size"),
        "distributed": decoded.distributedInfo,
        "not_imported": dict(counts),
        "threads": {thread: name for thread, name in thread_names.items() if int(thread) in host_threads},
    }
    return rows, metadata


def load_kineto(path: str | os.PathLike[str]) -> Trace:
    """Read a PyTorch profiler (Kineto) trace into an :class:`xsp.Trace`.

    Raises:
        TraceNotFoundError: no such file (a ``FileNotFoundError`` too).
        TraceFormatError: not a Chrome trace, or truncated or corrupt.
    """
    source = Path(path)
    if source.is_dir():
        raise TraceFormatError(f"{source} is a directory, not a trace file")
    if not source.is_file():
        raise TraceNotFoundError(f"no such trace file: {source}")
    with _collector_paused():
        rows, metadata = kineto_rows(_decode(source))
        result = build_table([rows], 0, new_step_state(attach_to_session=False))
    spans = result.spans
    present = set(spans[col.LEVEL].unique())
    levels = [level.value for level in Level if level.value in present]
    not_imported = metadata.get("not_imported") or {}
    lost = {f"Kineto events {what}": int(not_imported[key]) for key, what in LOST.items() if not_imported.get(key)}
    metadata = {**metadata, "schema_version": col.SCHEMA_VERSION, "xsp_version": __version__,
                "imported_from": str(source), "levels": levels, "hierarchy": result.diagnostics,
                "dropped": lost, "service_name": source.name.split(".")[0],
                "device": _device_name(metadata["device_properties"])}
    if lost:  # every command that reads the file says so, not only xsp import
        warnings.warn(XspWarning(f"{source}: {', '.join(f'{count} {what}' for what, count in lost.items())} "
                                 "were left out"), stacklevel=2)
    return Trace(spans=spans, metadata=metadata)


def _device_name(properties: list[dict[str, Any]]) -> str:
    names = sorted({str(p.get("name")) for p in properties if p.get("name")})
    return ", ".join(names) if names else "unknown"
