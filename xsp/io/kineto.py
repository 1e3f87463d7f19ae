"""Importing PyTorch profiler (Kineto) Chrome-trace files into the canonical span table.

Mapping (``cat`` of complete events):

========================  =========  ===========  ===========================================
Kineto category           level      kind         notes
========================  =========  ===========  ===========================================
``user_annotation``       model      user / step  ``ProfilerStep#N`` is step ``N``; inside an
                                                  operator: operator level;
                                                  ``enumerate(DataLoader)#...``: input level;
                                                  ``Optimizer.step#...``: optimizer;
                                                  ``## forward ##``, ``## backward ##``:
                                                  predict, backward
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
(``ac2g``) stand in for a missing ``correlation`` argument. An event's arguments that a typed
column holds exactly (``External id``, ``correlation``, ``Sequence number``, ``Input Dims``;
on a device's rows ``grid``, ``block``, ``registers per thread``, ``shared memory``, ``bytes``:
:data:`xsp.io.kineto_events.MOVED_ARGUMENTS`) are kept there only; the others (``cbid``,
occupancy, collective sizes...) are kept in ``attributes``, every key and value as recorded, as
compact JSON (without the white space between tokens). Nothing is lost:
:func:`kineto_arguments` gives each event's arguments back whole.
Instant events (memory allocations) and the profiler's own ``Trace`` spans are counted in
the metadata (``not_imported``), not imported; so are events with impossible times (not
finite, negative durations, before the epoch or after 2116: ``impossible_times``). An event whose
``args`` nest more than ``ARGS_MAX_DEPTH`` levels is imported without them, and counted
(``args_too_deep``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp._version import __version__
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspWarning, warn
from xsp.core.memory_release import release_freed_memory
from xsp.core.schema import Level, SpanKind
from xsp.io.kineto_events import (
    ARGS_TOO_DEEP,
    MISSING,
    MISSING_TIMES,
    MOVED_ARGUMENTS,
    EventColumns,
    decoded_events,
    scanned_events,
)
from xsp.io.kineto_json import ARGS_MAX_DEPTH, DICT_DECODER, collector_paused, decode
from xsp.io.trace import Trace
from xsp.table.build import build_table, new_step_state, null_column
from xsp.table.validation import LATEST_NS
from xsp.table.walks import (
    arrow_codes,
    arrow_strings,
    categorical,
    categories_at,
    inside_any,
    memory_pool,
    nullable_ints,
    strings_at,
)

STEP_NAME: Final = "ProfilerStep#"
"""How PyTorch's profiler names its steps: ``ProfilerStep#N`` is step N."""
PROFILER_STEP = re.compile(rf"^{STEP_NAME}(?P<step>[0-9]+)$")
"""The profiler's annotation of step N (an RE2 pattern too: Arrow matches the names)."""
DATALOADER_WAIT: Final = "enumerate(DataLoader)#"
"""The profiler's annotation of one DataLoader ``__next__``: an input-level wait."""
OPTIMIZER_STEP: Final = "Optimizer.step#"
"""The profiler's annotation of one ``optimizer.step()`` (``Optimizer.step#SGD.step``)."""
PASS_ANNOTATIONS: Final = {"## forward ##": SpanKind.PREDICT, "## backward ##": SpanKind.BACKWARD}
"""Annotations that training loops (and the benchmarks recorded with them) put around the
forward and backward passes: the step's forward and backward parts."""

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
LAUNCH_LINKED = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver"})


def microseconds_to_ns(values: Sequence[int | float] | np.ndarray) -> np.ndarray:
    """Microseconds (integers exactly, fractions to the nanosecond) as int64 nanoseconds."""
    as_float = np.asarray(values, dtype=np.float64)
    whole = np.floor(as_float)
    return whole.astype(np.int64) * 1000 + np.rint((as_float - whole) * 1000).astype(np.int64)


def _flops(raw: str | None) -> int | None:
    args = DICT_DECODER.decode(raw) if raw else {}
    counted = [args[name] * factor for name, factor in FLOP_COUNTERS.items() if name in args]
    return int(sum(counted)) if counted else None


def _nullable(values: np.ndarray, rows: np.ndarray | None = None) -> pd.arrays.IntegerArray:
    """An int64 column with ``MISSING`` as null; null outside ``rows`` when given."""
    mask = values == MISSING
    if rows is not None:
        outside = np.ones(len(values), dtype=bool)
        outside[rows] = False
        mask |= outside
    return nullable_ints(values, mask)  # a column this trace has nothing in costs nothing


def _decoded(texts: pa.Array) -> pa.Array:
    """Texts as plain strings (the scanner's names come as codes into the distinct ones)."""
    return texts.dictionary_decode() if isinstance(texts, pa.DictionaryArray) else texts


def _texts(texts: pa.Array) -> pd.api.extensions.ExtensionArray:
    return null_column("string", len(texts)) if texts.null_count == len(texts) else arrow_strings(texts)


def _categories_at(texts: pa.Array, rows: np.ndarray) -> pd.Categorical:
    """``texts`` where ``rows`` say, null elsewhere, as a categorical (built from codes)."""
    codes, distinct = arrow_codes(texts)
    outside = np.ones(len(codes), dtype=bool)
    outside[rows] = False
    return categories_at(np.where(outside, -1, codes), distinct)


_NO_TEXTS = pa.array([], type=pa.large_string())
_NO_INTS = np.zeros(0, dtype=np.int64)
"""What an event column is replaced with once its row column is made."""

CATEGORY_NAMES = list(CATEGORIES)
_CATEGORY_INDEX = {cat: i for i, cat in enumerate(CATEGORY_NAMES)}
_LEVEL_NAMES = [level.value for level in Level]
_KIND_NAMES = [kind.value for kind in SpanKind]
_LEVEL_OF_CATEGORY = np.array([_LEVEL_NAMES.index(CATEGORIES[c][0].value) for c in CATEGORY_NAMES])
_KIND_OF_CATEGORY = np.array([_KIND_NAMES.index(CATEGORIES[c][1].value) for c in CATEGORY_NAMES])
_DEVICE_CATEGORY = np.array([c in DEVICE_CATEGORIES for c in CATEGORY_NAMES])
_STEP_CODE = _KIND_NAMES.index(SpanKind.STEP.value)
_OPERATOR_LEVEL = _LEVEL_NAMES.index(Level.OPERATOR.value)
_INPUT_CODE = _KIND_NAMES.index(SpanKind.INPUT.value)
_INPUT_LEVEL = _LEVEL_NAMES.index(Level.INPUT.value)


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


IMPOSSIBLE_TIMES: Final = "impossible_times"
LOST: Final = {IMPOSSIBLE_TIMES: "with impossible times (not finite, a negative duration, before 1970 or after 2116)",
               MISSING_TIMES: "without a start time or a duration"}
"""The ``not_imported`` counts of events a trace meant to hold but that could not become spans
(the others are phases and categories that are no span by design)."""


def _row_order(events: EventColumns, base_ns: int) -> np.ndarray | None:
    """The rows to keep, sorted by start (stable: file order among equal starts), or None when
    that is every row as it is. Rows with impossible times (not finite, a start and end outside
    the epoch and ``LATEST_NS``, a negative duration) are left out and counted."""
    with np.errstate(invalid="ignore", over="ignore"):
        ts_ns = events.ts_us * 1e3 + base_ns
        dur_ns = events.dur_us * 1e3
        fine = (ts_ns >= 0) & (dur_ns >= 0) & (ts_ns + dur_ns <= LATEST_NS)  # NaN and inf compare False
    del ts_ns, dur_ns
    if fine.all():
        kept = None
        order = np.argsort(events.ts_us, kind="stable")
    else:
        events.counts[IMPOSSIBLE_TIMES] += int((~fine).sum())
        kept = np.flatnonzero(fine)
        order = kept[np.argsort(events.ts_us[kept], kind="stable")]
    if kept is None and (order == np.arange(len(order))).all():
        return None
    return order


def _in_order(events: EventColumns, order: np.ndarray | None) -> EventColumns:
    """``events`` with its rows taken in ``order`` (each column replaced as soon as it is taken)."""
    if order is None:
        return events
    positions = pa.array(order)
    for name in (f.name for f in dataclasses.fields(events)):
        column = getattr(events, name)
        if isinstance(column, np.ndarray):
            setattr(events, name, column[order])
        elif isinstance(column, pd.arrays.IntegerArray):
            setattr(events, name, column.take(order))
        elif isinstance(column, pa.Array):
            setattr(events, name, pc.take(column, positions, memory_pool=memory_pool()))
    return events


def kineto_rows(events: EventColumns) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Span rows (times in epoch ns, sorted by start; no ids or parents yet) and metadata.

    ``events`` is consumed: each column is let go once its row column is made, so that a trace
    of millions of events does not hold both at once.
    """
    fields = events.fields
    base = int(fields.baseTimeNanoseconds or 0)
    events = _in_order(events, _row_order(events, base))
    counts = events.counts
    category = events.category.astype(np.int64)
    count = len(category)
    start = microseconds_to_ns(events.ts_us) + base
    end = start + np.maximum(microseconds_to_ns(events.dur_us), 0)
    events.ts_us = events.dur_us = np.zeros(0)
    on_device = _DEVICE_CATEGORY[category] if count else np.zeros(0, dtype=bool)
    device_rows = np.flatnonzero(on_device)
    counter_rows = np.flatnonzero(category == _CATEGORY_INDEX["cuda_profiler_range"])
    flops = null_column("Int64", count)
    if len(counter_rows):
        counted = [_flops(raw) for raw in pc.take(events.attributes, pa.array(counter_rows)).to_pylist()]
        flops = np.full(count, MISSING, dtype=np.int64)
        flops[counter_rows] = [MISSING if value is None else value for value in counted]
        flops = _nullable(flops)
    kind_codes = _KIND_OF_CATEGORY[category] if count else np.zeros(0, dtype=np.int64)
    steps = np.zeros(count, dtype=np.int64)
    level_codes = _LEVEL_OF_CATEGORY[category] if count else np.zeros(0, dtype=np.int64)
    annotation_rows = np.flatnonzero(category == _CATEGORY_INDEX["user_annotation"])
    # matched by Arrow, not a Python string an annotation: a CPU-only trace has millions of them
    annotation_names = _decoded(pc.take(events.name, pa.array(annotation_rows), memory_pool=memory_pool()))
    step_numbers = pc.struct_field(pc.extract_regex(annotation_names, PROFILER_STEP.pattern), [0])
    is_step_name = step_numbers.is_valid().to_numpy(zero_copy_only=False)
    step_rows = annotation_rows[is_step_name]
    kind_codes[step_rows] = _STEP_CODE
    steps[step_rows] = pc.cast(step_numbers.filter(pa.array(is_step_name)), pa.int64()).to_numpy()
    waits = annotation_rows[~is_step_name & pc.starts_with(annotation_names, DATALOADER_WAIT).to_numpy(
        zero_copy_only=False)]
    kind_codes[waits], level_codes[waits] = _INPUT_CODE, _INPUT_LEVEL
    named = ~is_step_name
    optimizer = named & pc.starts_with(annotation_names, OPTIMIZER_STEP).to_numpy(zero_copy_only=False)
    kind_codes[annotation_rows[optimizer]] = _KIND_NAMES.index(SpanKind.OPTIMIZER.value)
    for text, kind in PASS_ANNOTATIONS.items():
        passes = named & pc.equal(annotation_names, text).to_numpy(zero_copy_only=False)
        kind_codes[annotation_rows[passes]] = _KIND_NAMES.index(kind.value)
    del annotation_names, step_numbers
    is_step = kind_codes == _STEP_CODE
    thread_ids = events.thread.copy()
    thread_ids[on_device] = pd.NA  # a device row's tid is its stream
    threads = events.process * 1_000_003 + thread_ids.to_numpy(dtype=np.int64, na_value=-1)
    _annotations_inside_operators(threads, category, start, end, kind_codes, level_codes)
    del threads
    copy_rows = np.flatnonzero(category == _CATEGORY_INDEX["gpu_memcpy"])
    copy_names = pc.take(events.name, pa.array(copy_rows)).to_pylist()
    copy_kind_codes, copy_kinds = pd.factorize(
        np.array([m.group(1) if (m := COPY_KIND.match(name)) else None for name in copy_names], dtype=object))
    copy_kind = np.full(count, -1, dtype=np.int64)
    copy_kind[copy_rows] = copy_kind_codes
    # each event column is let go as soon as its row column is made (and freed memory handed
    # back), so that the import never holds a trace's events and its rows whole at once
    rows = pd.DataFrame({col.LEVEL: categories_at(level_codes, _LEVEL_NAMES),
                         col.KIND: categories_at(kind_codes, _KIND_NAMES)})
    del level_codes, kind_codes
    rows[col.NAME] = categorical(events.name)
    events.name = _NO_TEXTS
    rows[col.INPUT_SHAPES] = categorical(events.input_dims)
    events.input_dims = _NO_TEXTS
    rows[col.GRID] = _categories_at(events.grid, device_rows)
    rows[col.BLOCK] = _categories_at(events.block, device_rows)
    events.grid = events.block = _NO_TEXTS
    release_freed_memory()
    rows[col.START_NS] = start
    rows[col.END_NS] = end
    del start, end
    rows[col.THREAD_ID] = thread_ids
    for column, name, where in ((col.DEVICE_ID, "device", device_rows), (col.STREAM_ID, "stream", device_rows),
                                (col.CORRELATION_ID, "correlation", None),
                                (col.REGISTERS_PER_THREAD, "registers", device_rows),
                                (col.SHARED_MEMORY_BYTES, "shared_memory", device_rows),
                                (col.BYTES, "bytes", device_rows), (col.SEQUENCE_NUMBER, "sequence", None),
                                (col.EXTERNAL_ID, "external", None)):
        rows[column] = _nullable(getattr(events, name), where)
        setattr(events, name, _NO_INTS)
    rows[col.STEP] = pd.arrays.IntegerArray(steps, ~is_step)
    rows[col.COPY_KIND] = strings_at(copy_kind, copy_kinds) if len(copy_rows) else null_column("string", count)
    rows[col.FLOPS] = flops
    rows[col.ATTRIBUTES] = _texts(events.attributes)
    events.attributes = _NO_TEXTS
    release_freed_memory()
    host_threads = set(np.unique(thread_ids[~thread_ids.isna()].to_numpy(dtype=np.int64)).tolist())
    metadata = {
        "source": "kineto",
        "kineto": {
            "schema_version": fields.schemaVersion, "trace_name": fields.traceName,
            "cupti_version": fields.cupti_version, "cuda_runtime_version": fields.cuda_runtime_version,
            "cuda_driver_version": fields.cuda_driver_version,
            "base_time_ns": fields.baseTimeNanoseconds,
        },
        "device_properties": fields.deviceProperties,
        "rank": fields.distributedInfo.get("rank"),
        "world_size": fields.distributedInfo.get("world_size"),
        "distributed": fields.distributedInfo,
        "not_imported": dict(counts),
        "threads": {thread: name for thread, name in events.thread_names.items() if int(thread) in host_threads},
    }
    return rows, metadata


def read_events(source: Path) -> EventColumns:
    """The trace's events as columns: by the C scanner where it reads the file, else by msgspec."""
    dropped_args: list[tuple[int, int]] = []
    events = scanned_events(source, CATEGORY_NAMES, LAUNCH_LINKED, DEVICE_CATEGORIES, dropped_args)
    if events is None:
        events = decoded_events(decode(source, dropped_args), CATEGORY_NAMES, LAUNCH_LINKED, DEVICE_CATEGORIES)
        if dropped_args:
            events.counts[ARGS_TOO_DEEP] += len(dropped_args)
    return events


@contextmanager
def unreadable_as_format_error(source: Path) -> Iterator[None]:
    """What a file that is no readable Kineto trace raises as it is read, as a
    :class:`TraceFormatError`: text that is not UTF-8, a field of the wrong kind, a time past any
    clock (what the fuzzer found, tests/unit/test_fuzz_found.py) is one line, never a traceback."""
    try:
        yield
    except (UnicodeDecodeError, msgspec.ValidationError, msgspec.DecodeError, pa.ArrowInvalid,
            OverflowError) as exc:
        raise TraceFormatError(f"{source} is not a Kineto trace xsp can read: {type(exc).__name__}: "
                               f"{str(exc)[:200]}") from None


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
    with collector_paused():
        with unreadable_as_format_error(source):
            rows, metadata = kineto_rows(read_events(source))
        release_freed_memory()
        frames = iter([rows])  # build_table holds the only reference, and lets the rows go as it goes
        del rows
        # a CUDA call made outside every operator carries the "External id" of the last one
        # (a100_alexnet: a cudaMalloc 30 s after its aten::uniform_ ended): inclusion places them
        result = build_table(frames, 0, new_step_state(attach_to_session=False), live_records=False)
        release_freed_memory()
    spans = result.spans
    metadata = imported_metadata(source, metadata, result.diagnostics, set(spans[col.LEVEL].unique()))
    return Trace(spans=spans, metadata=metadata)


def imported_metadata(source: Path, metadata: dict[str, Any], hierarchy: dict[str, int],
                      present_levels: set[str]) -> dict[str, Any]:
    """An imported trace's metadata: what :func:`kineto_rows` found (``metadata``), the tree's
    diagnostics and the levels its spans have; what was left out is warned of here, once."""
    levels = [level.value for level in Level if level.value in present_levels]
    not_imported = metadata.get("not_imported") or {}
    lost = {f"Kineto events {what}": int(not_imported[key]) for key, what in LOST.items() if not_imported.get(key)}
    if not_imported.get(ARGS_TOO_DEEP):  # the events are imported, without their arguments
        lost[f"Kineto events' arguments nested more than {ARGS_MAX_DEPTH} levels"] = int(not_imported[ARGS_TOO_DEEP])
    metadata = {**metadata, "schema_version": col.SCHEMA_VERSION, "xsp_version": __version__,
                "imported_from": str(source), "levels": levels, "hierarchy": hierarchy,
                "dropped": lost, "service_name": source.name.split(".")[0],
                "device": _device_name(metadata["device_properties"])}
    if lost:  # every command that reads the file says so, not only xsp import
        warn(XspWarning(f"{source}: {', '.join(f'{count} {what}' for what, count in lost.items())} "
                                 "were left out"))
    return metadata


def kineto_arguments(spans: pd.DataFrame) -> list[dict[str, Any] | None]:
    """Each imported Kineto event's ``args``, whole (key order aside): its ``attributes`` and
    the arguments that typed columns hold (:data:`xsp.io.kineto_events.MOVED_ARGUMENTS`), under
    their Kineto names; None for an event that had none. One dict a row, for the rows you ask
    about (``kineto_arguments(spans[spans.name == "ncclKernel"])``).

    A correlation id that only a flow event gave (old traces) comes back as ``correlation``.
    """
    on_device = (spans[col.LEVEL] == Level.KERNEL.value).to_numpy(dtype=bool, na_value=False)
    moved = [(key, argument, spans[argument.column].to_numpy(dtype=object, na_value=None))
             for key, argument in MOVED_ARGUMENTS.items() if argument.column in spans]
    found: list[dict[str, Any] | None] = []
    for row, text in enumerate(spans[col.ATTRIBUTES].to_numpy(dtype=object, na_value=None).tolist()):
        arguments = None if text is None else DICT_DECODER.decode(text)
        for key, argument, values in moved:
            value = values[row]
            if value is None or (argument.on_device_only and not on_device[row]):
                continue
            arguments = {} if arguments is None else arguments
            if key not in arguments:  # as written where it was not exactly what the column holds
                arguments[key] = msgspec.json.decode(value) if argument.is_array else int(value)
        found.append(arguments)
    return found


def _device_name(properties: list[dict[str, Any]]) -> str:
    names = sorted({str(p.get("name")) for p in properties if p.get("name")})
    return ", ".join(names) if names else "unknown"
