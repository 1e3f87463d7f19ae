"""A Kineto trace's events as columns, before they become span rows.

Two readers make the same :class:`EventColumns`:

* :func:`scanned_events`, the C scanner (``xsp.io._kineto``): the file inflated and read piece
  by piece, each event written straight into typed columns, so that neither the whole inflated
  file nor a Python object per event is ever held. It reads the files Kineto writes; anything
  else it leaves to
* :func:`decoded_events`, msgspec's typed decode of the whole file (:mod:`xsp.io.kineto_json`),
  which reads every Chrome trace and says what is wrong with those it cannot.

Rows are the complete ("X") events of a category xsp imports, in file order, with their start
and duration as recorded (microseconds); nothing is filtered by time or sorted yet.
"""

from __future__ import annotations

import queue
import re
import threading
from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.io.kineto_json import (
    ARGS_DECODER,
    MAX_VALUE_BYTES,
    MISSING,
    NO_ARGS,
    QUIET_PHASES,
    Complete,
    FileFields,
    Flow,
    FlowEnd,
    Metadata,
    ignored_key,
    inflated_pieces,
    phase,
)
from xsp.record.hotpath import optional_extension


class MovedArgument(NamedTuple):
    """An argument that a typed column holds exactly, and that ``attributes`` leaves out."""

    column: str
    """The span table's column that holds it."""
    on_device_only: bool
    """Held (so moved) only on a device's rows (kernels, copies...), where its column is kept."""
    is_array: bool
    """A shape, grid or block: moved where it is an array of no text that is not empty (the
    column holds its compact JSON); the others where they are integers (not floats or text)."""


MOVED_ARGUMENTS: Final = {
    "correlation": MovedArgument(col.CORRELATION_ID, False, False),
    "External id": MovedArgument(col.EXTERNAL_ID, False, False),
    "Sequence number": MovedArgument(col.SEQUENCE_NUMBER, False, False),
    "Input Dims": MovedArgument(col.INPUT_SHAPES, False, True),
    "registers per thread": MovedArgument(col.REGISTERS_PER_THREAD, True, False),
    "shared memory": MovedArgument(col.SHARED_MEMORY_BYTES, True, False),
    "bytes": MovedArgument(col.BYTES, True, False),
    "grid": MovedArgument(col.GRID, True, True),
    "block": MovedArgument(col.BLOCK, True, True),
}
"""Kineto's arguments that become typed columns and are not kept twice (the C scanner's
``moved_arguments`` says the same): :func:`xsp.io.kineto.kineto_arguments` puts them back."""

MISSING_TIMES: Final = "missing_times"
ARGS_TOO_DEEP: Final = "args_too_deep"
"""The count of events whose ``args`` nest more than ``ARGS_MAX_DEPTH`` levels: they are read
without them."""


@dataclass
class EventColumns:
    """The importable events of a trace, one row each, in file order."""

    category: np.ndarray
    """Index into the importer's category list."""
    ts_us: np.ndarray
    dur_us: np.ndarray
    process: np.ndarray
    """The events' ``pid``, as codes (one per distinct pid)."""
    thread: pd.arrays.IntegerArray
    """``tid`` where it is an integer."""
    name: pa.LargeStringArray | pa.DictionaryArray
    """Text a row, or (the C scanner's) codes into the distinct texts; so are the shapes, grids and blocks."""
    attributes: pa.LargeStringArray
    """The JSON of ``args`` without the arguments a typed column holds (:data:`MOVED_ARGUMENTS`),
    every other key and value as recorded, without the white space between tokens; null where
    none is left."""
    correlation: np.ndarray
    device: np.ndarray
    """``args.device``, else the pid (meaningful on device rows only); so is ``stream`` (else tid)."""
    stream: np.ndarray
    registers: np.ndarray
    shared_memory: np.ndarray
    bytes: np.ndarray
    sequence: np.ndarray
    external: np.ndarray
    """``args["External id"]``: the operator that the event belongs to (``MISSING`` where none)."""
    input_dims: pa.LargeStringArray | pa.DictionaryArray
    """Compact JSON (white space dropped), null where absent or ``[]``; so are ``grid`` and ``block``."""
    grid: pa.LargeStringArray | pa.DictionaryArray
    block: pa.LargeStringArray | pa.DictionaryArray
    fields: FileFields
    thread_names: dict[str, str]
    counts: Counter[str] = field(default_factory=Counter)
    """Events left out, by reason (``ignored X events``, ``missing_times``)."""


_END: Final = object()


def _read_ahead(pieces: Iterator[bytes], depth: int = 2) -> Generator[bytes, None, None]:
    """``pieces``, made up to ``depth`` ahead by a thread of their own: inflating (zlib) and
    scanning (C) both let go of the GIL, so on two cores the file is inflated while it is read."""
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for piece in pieces:
                while not stop.is_set():
                    try:
                        ready.put(piece, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put(_END)
        except BaseException as exc:  # handed to the reader, which raises it
            ready.put(exc)

    thread = threading.Thread(target=produce, name="xsp-kineto-inflate", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                ready.get(timeout=0.05)
            except queue.Empty:
                continue
        thread.join()


FILE_ORDER: Final = "file_order"
"""The raw event table's column of each event's place among the file's rows (0, 1, 2...)."""
INT_COLUMNS: Final = ("pid", "tid", "correlation", "device", "stream", "registers", "shared_memory", "bytes",
                      "sequence", "external")
"""The raw event table's integer columns (``MISSING`` where absent)."""
INTERNED_COLUMNS: Final = ("name", "input_dims", "grid", "block")
"""The raw event table's texts that repeat (codes into their distinct texts, as the scanner keeps them)."""


def _strings(blocks: dict[str, Any], name: str, count: int, empty_is_null: bool) -> pa.LargeStringArray:
    offsets = np.frombuffer(blocks.pop(f"{name}.offsets"), dtype=np.int64)
    validity = None
    nulls = 0
    if empty_is_null:
        present = offsets[1:] != offsets[:-1]
        nulls = count - int(np.count_nonzero(present))
        validity = pa.py_buffer(np.packbits(present, bitorder="little")) if nulls else None
    texts = pa.LargeStringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(blocks.pop(f"{name}.data")),
                                             validity, nulls)
    texts.validate(full=True)  # not UTF-8: left to msgspec, which says so
    return texts


def _interned(blocks: dict[str, Any], name: str) -> pa.DictionaryArray:
    """A column the scanner interned: its distinct texts, and a code a row (-1: null)."""
    codes = np.frombuffer(blocks.pop(f"{name}.codes"), dtype=np.int32)
    offsets = np.frombuffer(blocks.pop(f"{name}.offsets"), dtype=np.int64)
    texts = pa.LargeStringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets),
                                             pa.py_buffer(blocks.pop(f"{name}.data")))
    texts.validate(full=True)  # not UTF-8: left to msgspec, which says so
    missing = codes < 0
    indices = pa.array(codes, mask=missing) if missing.any() else pa.array(codes)
    return pa.DictionaryArray.from_arrays(indices, texts)


def _raw_table(blocks: dict[str, Any], count: int, first_row: int) -> pa.Table:
    """The scanner's columns as one Arrow table (no copy of the numbers): the raw events.

    Raises:
        pa.ArrowInvalid: a text that is not UTF-8 (the file is msgspec's to read, which says so).
    """
    columns: dict[str, pa.Array] = {
        "category": pa.array(np.frombuffer(blocks.pop("category"), dtype=np.int8)),
        "ts": pa.array(np.frombuffer(blocks.pop("ts"), dtype=np.float64)),
        "dur": pa.array(np.frombuffer(blocks.pop("dur"), dtype=np.float64)),
    }
    for key in INT_COLUMNS:
        columns[key] = pa.array(np.frombuffer(blocks.pop(key), dtype=np.int64))
    for key in INTERNED_COLUMNS:
        columns[key] = _interned(blocks, key)
    columns["attributes"] = _strings(blocks, "attributes", count, empty_is_null=True)
    columns[FILE_ORDER] = pa.array(np.arange(first_row, first_row + count, dtype=np.int64))
    return pa.table(columns)


_WRITTEN_OTHERWISE: Final = ("events written otherwise than PyTorch's profiler writes them: flow events in place of "
                              "correlation ids, text where numbers belong or the like")


class LeftToMsgspec(Exception):
    """The C scanner is not built, or leaves this file to msgspec's reader, which is to drop the
    ``"args"`` members at ``dropped_args`` (offsets the scanner found nested too deeply)."""

    def __init__(self, dropped_args: list[tuple[int, int]], reason: str) -> None:
        super().__init__(reason)
        self.dropped_args = dropped_args
        self.reason = reason
        """Why, for the user: ``the fast reader is not built``, or what the file holds."""


class EventScan:
    """One pass of the C scanner over a file: its events as raw tables (:func:`_raw_table`, at
    most ``rows_per_table`` rows each, all of them in one where None), then what the file says
    besides them (its top-level fields, its threads' names, the events left out)."""

    def __init__(self, source: Path, categories: list[str], linked: frozenset[str], device: frozenset[str],
                 rows_per_table: int | None = None) -> None:
        self.source = source
        self.categories, self.linked, self.device = categories, linked, device
        self.rows_per_table = rows_per_table
        self.fields = FileFields()
        self.thread_names: dict[str, str] = {}
        self.counts: Counter[str] = Counter()
        self.rows = 0
        """The events kept as rows (complete events of an imported category)."""
        self.events = 0
        """The events the file holds, of every phase (once the last table is given)."""

    def tables(self) -> Iterator[pa.Table]:
        """The raw event tables, in file order; ``fields``, ``thread_names`` and ``counts`` are set
        once the last is given.

        Raises:
            LeftToMsgspec: the scanner is not built or leaves the file to msgspec (raised at the
                first table where it is not built, else after the last, the file checked to be JSON).
            TraceFormatError: not JSON, truncated, nested past any plausible depth, a value longer
                than ``MAX_VALUE_BYTES``; a corrupt or truncated gzip stream or a decompression bomb.
        """
        kineto = optional_extension("xsp.io._kineto")
        if kineto is None:
            raise LeftToMsgspec([], "xsp's fast reader is not built here")
        scanner = kineto.Scanner(self.categories, sorted(self.linked), sorted(self.device))
        limit = self.rows_per_table
        given = 0
        try:
            for _ in self._scanning(scanner):
                if limit is not None and scanner.rows >= limit:
                    count = scanner.rows
                    yield _raw_table(scanner.columns(), count, self.rows)
                    self.rows += count
                    given += 1
        except kineto.Invalid as exc:
            raise TraceFormatError(f"{self.source} {exc}") from None
        except kineto.Unsupported:
            raise LeftToMsgspec(list(scanner.dropped_args), _WRITTEN_OTHERWISE) from None
        except pa.ArrowInvalid:
            raise LeftToMsgspec(list(scanner.dropped_args), "text that is not UTF-8") from None
        try:
            self.fields = msgspec.json.decode(
                b"{" + b",".join(b'"%s":%s' % pair for pair in scanner.top_fields) + b"}", type=FileFields)
            count = scanner.rows
            last = _raw_table(scanner.columns(), count, self.rows)
        except msgspec.DecodeError:
            raise LeftToMsgspec(list(scanner.dropped_args), "top-level fields of another form") from None
        except pa.ArrowInvalid:
            raise LeftToMsgspec(list(scanner.dropped_args), "text that is not UTF-8") from None
        self.rows += count
        self.events = scanner.events
        self.thread_names = {str(tid): name for tid, name in scanner.thread_names}
        self.counts = Counter({ignored_key(what): n for what, n in scanner.ignored.items()})
        if scanner.missing_times:
            self.counts[MISSING_TIMES] = scanner.missing_times
        if scanner.dropped_args:
            self.counts[ARGS_TOO_DEEP] = len(scanner.dropped_args)
        if count or not given:
            yield last

    def _scanning(self, scanner: Any) -> Iterator[None]:
        """Feeds the file to ``scanner`` piece by piece, pausing after each piece it scanned; the
        last scan (``final``) is made before it ends."""
        source = self.source
        offset = 0

        def unscanned(data: bytes) -> bytes:
            """What ``scanner`` leaves of ``data`` (a value the piece cuts), which must stay short."""
            nonlocal offset
            consumed = scanner.scan(data, False)
            offset += consumed
            if len(data) - consumed > MAX_VALUE_BYTES:  # (scanned at the latest once past the limit: never let through)
                raise TraceFormatError(
                    f"{source} is not a plausible Kineto trace: an event or field at byte {offset} is longer "
                    f"than {MAX_VALUE_BYTES >> 20} MiB")
            return data[consumed:]

        pending = b""
        waiting: list[bytes] = []  # pieces not scanned yet
        waiting_bytes = 0
        with closing(_read_ahead(inflated_pieces(source))) as pieces:
            for piece in pieces:
                waiting.append(piece)
                waiting_bytes += len(piece)
                if waiting_bytes < len(pending) and len(pending) + waiting_bytes <= MAX_VALUE_BYTES:
                    continue  # a value longer than a piece is scanned again once its bytes doubled, not at each piece
                pending = unscanned(pending + waiting[0] if len(waiting) == 1 else b"".join([pending, *waiting]))
                waiting.clear()
                waiting_bytes = 0
                yield
        if len(pending) + waiting_bytes > MAX_VALUE_BYTES:  # the last value may end past the limit: scan up to it first
            pending = unscanned(b"".join([pending, *waiting]))
            waiting.clear()
        scanner.scan(b"".join([pending, *waiting]), True)


def _array(column: pa.ChunkedArray) -> pa.Array:
    """A table's column as one array (no copy where it is one chunk)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def events_from_table(table: pa.Table, fields: FileFields, thread_names: dict[str, str],
                      counts: Counter[str]) -> EventColumns:
    """Raw events (:class:`EventScan`'s tables, or rows of them read back) as the columns that
    :func:`xsp.io.kineto.kineto_rows` takes, in the table's order."""
    count = len(table)

    def ints(key: str) -> np.ndarray:
        return np.asarray(_array(table[key]).to_numpy(zero_copy_only=False), dtype=np.int64)

    return EventColumns(
        category=np.asarray(_array(table["category"]).to_numpy(zero_copy_only=False), dtype=np.int8),
        ts_us=np.asarray(_array(table["ts"]).to_numpy(zero_copy_only=False), dtype=np.float64),
        dur_us=np.asarray(_array(table["dur"]).to_numpy(zero_copy_only=False), dtype=np.float64),
        process=pd.factorize(ints("pid"))[0].astype(np.int64),
        thread=pd.arrays.IntegerArray(ints("tid"), np.zeros(count, dtype=bool)),
        name=_array(table["name"]), attributes=_array(table["attributes"]),
        correlation=ints("correlation"), device=ints("device"), stream=ints("stream"),
        registers=ints("registers"), shared_memory=ints("shared_memory"), bytes=ints("bytes"),
        sequence=ints("sequence"), external=ints("external"),
        input_dims=_array(table["input_dims"]), grid=_array(table["grid"]), block=_array(table["block"]),
        fields=fields, thread_names=thread_names, counts=counts,
    )


def scanned_events(source: Path, categories: list[str], linked: frozenset[str], device: frozenset[str],
                   dropped_args: list[tuple[int, int]] | None = None) -> EventColumns | None:
    """The events read by the C scanner; None where it is not built or leaves the file to msgspec.

    Where it leaves the file to msgspec, it has still read it to the end, checking only its JSON:
    a file that is not JSON fails here, holding no more of it than a piece, and ``dropped_args``
    (when given) gets the (start, stop) offsets of the ``"args"`` members nested too deeply, for
    :func:`xsp.io.kineto_json.decode` to drop as the scanner does.

    Raises:
        TraceFormatError: not JSON, truncated, nested past any plausible depth, a value longer than
            ``MAX_VALUE_BYTES``; a corrupt or truncated gzip stream or a decompression bomb.
    """
    scan = EventScan(source, categories, linked, device)
    try:
        (table,) = scan.tables()
    except LeftToMsgspec as left:
        if dropped_args is not None:
            dropped_args.extend(left.dropped_args)
        return None
    return events_from_table(table, scan.fields, scan.thread_names, scan.counts)


# ---- the msgspec reader ---------------------------------------------------------------------------


def int_or_none(value: Any) -> int | None:
    """An integer argument as Kineto may write one (an int, a bool, a whole float, digits)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def int_column(values: list[Any]) -> pd.arrays.IntegerArray:
    """A nullable int64 column; ``None``, ``MISSING`` and values that are not integers become null."""
    types = set(map(type, values))
    if types <= {int, type(None)}:  # the usual case, converted by numpy in one go
        plain = [MISSING if v is None else v for v in values] if type(None) in types else values
    else:
        plain = [v if type(v) is int else MISSING if v is None else int_or_none(v) for v in values]
        plain = [MISSING if v is None else v for v in plain]
    data = np.array(plain, dtype=np.int64)
    mask = data == MISSING
    return pd.arrays.IntegerArray(np.where(mask, 0, data), mask)


def _coded(values: list[Any]) -> np.ndarray:
    """Integers with ``MISSING`` for null, read as :func:`int_column` reads them."""
    column = int_column(values)
    return column.to_numpy(dtype=np.int64, na_value=MISSING)


_MEMBERS_DECODER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_INTEGER = re.compile(rb"-?(?:0|[1-9][0-9]*)")
_NAMES_A_MOVED_ARGUMENT = re.compile(b"|".join(b'"' + re.escape(key.encode()) + b'"' for key in MOVED_ARGUMENTS))


def _is_moved(key: str, raw: msgspec.Raw, on_device: bool) -> bool:
    moved = MOVED_ARGUMENTS.get(key)
    if moved is None or (moved.on_device_only and not on_device):
        return False
    text = bytes(raw)
    if moved.is_array:
        return text[:1] == b"[" and b'"' not in text and bool(text[1:-1].strip(b" \t\r\n"))
    return _INTEGER.fullmatch(text) is not None and -(2**63) < int(text) < 2**63


def unmoved_arguments(raw: msgspec.Raw, on_device: bool) -> msgspec.Raw | bytes:
    """An event's ``args`` without those a typed column holds (:data:`MOVED_ARGUMENTS`), the
    others as written; empty where none is left."""
    if not raw or _NAMES_A_MOVED_ARGUMENT.search(bytes(raw)) is None:
        return raw
    members = _MEMBERS_DECODER.decode(raw)
    kept = [msgspec.json.encode(key) + b":" + bytes(value) for key, value in members.items()
            if not _is_moved(key, value, on_device)]
    if len(kept) == len(members):
        return raw
    return b"{" + b",".join(kept) + b"}" if kept else b""


def raw_strings(raws: list[msgspec.Raw] | list[bytes]) -> pa.LargeStringArray:
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
    return texts


_STRING_OR_SPACE = re.compile(rb'("(?:[^"\\]|\\.)*")|[ \t\n\r]+', re.DOTALL)


def compact_json(raws: Sequence[msgspec.Raw | bytes]) -> list[bytes]:
    """Each JSON text without the white space between its tokens (what the C scanner writes).

    Valid JSON holds no NUL byte, so the texts are joined by one and compacted in a single pass."""
    return _STRING_OR_SPACE.sub(rb"\1", b"\x00".join(raws)).split(b"\x00") if raws else []


def _dims(raws: list[msgspec.Raw]) -> pa.LargeStringArray:
    """Shapes, grids and blocks as compact JSON text (``[24,1,1]``: no white space); null where absent or ``[]``."""
    texts = pc.replace_substring_regex(raw_strings(raws), "[ \t\r\n]", "")
    return pc.if_else(pc.equal(texts, "[]"), pa.scalar(None, texts.type), texts)


def _complete_events(events: list[Any], categories: dict[str, int], counts: Counter[str]) -> list[Complete]:
    """The complete ("X") events of an imported category, in file order; the others are counted."""
    complete = [event for event in events if type(event) is Complete]
    kept = [event for event in complete if event.cat in categories]
    if len(kept) < len(complete):
        kept = []
        for event in complete:
            if event.cat not in categories:
                cat = event.cat.lower()
                if cat not in categories:  # old traces write Kernel, Runtime...
                    counts[ignored_key(event.cat or 'uncategorised')] += 1
                    continue
                event.cat = cat
            kept.append(event)
    noisy = {kind for kind in Counter(map(type, events)) if kind is not Complete and kind not in QUIET_PHASES}
    if noisy:
        skipped = Counter(event.cat or phase(event) for event in events if type(event) in noisy)
        counts.update({ignored_key(what): count for what, count in skipped.items()})
    return kept


def _thread_names(events: list[Any]) -> dict[str, str]:
    """Host threads' names (``thread_name`` metadata events), by thread id."""
    names = {}
    for event in events:
        if type(event) is Metadata and event.name == "thread_name" and event.args.name:
            thread = int_or_none(event.tid)
            if thread is not None:
                names[str(thread)] = event.args.name
    return names


def _microseconds_to_ns(value: int | float) -> int:
    whole = np.floor(np.float64(value))
    return int(whole) * 1000 + int(np.rint((np.float64(value) - whole) * 1000))


def _flow_correlations(events: list[Any]) -> dict[tuple[Any, Any, int], int]:
    """``ac2g`` flow ends, by (pid, tid, ts in ns): the correlation id a flow carries."""
    flows = {}
    for event in events:
        if type(event) in (Flow, FlowEnd) and event.cat == "ac2g":
            flow_id = int_or_none(event.id)
            if flow_id is not None:
                flows[(event.pid, event.tid, _microseconds_to_ns(event.ts))] = flow_id
    return flows


def decoded_events(decoded: Any, categories: list[str], linked: frozenset[str],
                   device_categories: frozenset[str]) -> EventColumns:
    """The events of a whole decoded file (:func:`xsp.io.kineto_json._decode`), which is consumed."""
    counts: Counter[str] = Counter()
    index = {cat: i for i, cat in enumerate(categories)}
    all_events = decoded.traceEvents
    thread_names = _thread_names(all_events)
    events = _complete_events(all_events, index, counts)
    timed = [event for event in events if event.ts is not None and event.dur is not None]
    if len(timed) < len(events):
        counts[MISSING_TIMES] += len(events) - len(timed)
    events = timed
    count = len(events)
    category = np.fromiter([index[e.cat] for e in events], dtype=np.int8, count=count)
    pids = [e.pid for e in events]
    tids = [e.tid for e in events]
    raw_args = [e.args for e in events]
    args = [ARGS_DECODER.decode(raw) if raw else NO_ARGS for raw in raw_args]
    correlation: list[Any] = [a.correlation for a in args]
    linked_rows = np.flatnonzero(np.isin(category, [index[c] for c in linked])).tolist()
    if any(correlation[i] in (None, MISSING) for i in linked_rows):
        flows = _flow_correlations(all_events)
        for i in linked_rows:
            if correlation[i] in (None, MISSING):
                correlation[i] = flows.get((pids[i], tids[i], _microseconds_to_ns(events[i].ts)))
    device_rows = np.flatnonzero(np.isin(category, [index[c] for c in device_categories])).tolist()

    def on_device(values: list[Any]) -> np.ndarray:
        full = np.full(count, MISSING, dtype=np.int64)
        full[device_rows] = _coded(values)
        return full

    device_args = [args[i] for i in device_rows]
    pid_is_int = set(map(type, pids)) == {int}
    columns = EventColumns(
        category=category,
        ts_us=np.array([e.ts for e in events], dtype=np.float64),
        dur_us=np.array([e.dur for e in events], dtype=np.float64),
        process=pd.factorize(np.array(pids, dtype=np.int64 if pid_is_int else object))[0].astype(np.int64),
        thread=int_column(tids),
        name=pa.array([e.name for e in events], type=pa.large_string()),
        attributes=raw_strings(compact_json([unmoved_arguments(raw, on) for raw, on in zip(
            raw_args, np.isin(category, [index[c] for c in device_categories]).tolist())])),
        correlation=_coded(correlation),
        device=on_device([pids[i] if a.device is None else a.device for a, i in zip(device_args, device_rows)]),
        stream=on_device([tids[i] if a.stream is None else a.stream for a, i in zip(device_args, device_rows)]),
        registers=_coded([a.registers for a in args]),
        shared_memory=_coded([a.shared_memory for a in args]),
        bytes=_coded([a.nbytes for a in args]),
        sequence=_coded([a.sequence for a in args]),
        external=_coded([a.external for a in args]),
        input_dims=_dims([a.input_dims for a in args]),
        grid=_dims([a.grid for a in args]),
        block=_dims([a.block for a in args]),
        fields=decoded,
        thread_names=thread_names,
        counts=counts,
    )
    decoded.traceEvents = []
    return columns
