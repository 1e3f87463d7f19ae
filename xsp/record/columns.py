"""The columns a thread's buffer fills: record layouts (calls, roots, marks, backward passes),
packed rows the C wrapper appends, interners for names and shapes, and their compaction into
typed arrays."""

from __future__ import annotations

import bisect
import enum
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, Final, Generic, TypeVar, overload

from xsp.record import hotpath

COMPACT_AT: Final = 512
"""Raw records a thread keeps before compacting them into arrays. Small on purpose: records
compacted before the garbage collector's second generation sees them never reach its oldest
one, whose growth triggers full collections of the whole heap (which made every module call
of a training loop 2x dearer at 8192)."""

DEFAULT_MAX_EVENTS: Final = 50_000_000
"""Records kept per session; past it, records are dropped and counted."""

MAX_ENDED_THREAD_NAMES: Final = 10_000
"""Names of ended threads kept for the trace's metadata (a server that starts a thread per
request would otherwise keep one per request); their spans keep their thread ids all the same."""

NEVER: Final = sys.maxsize
"""A step length no step reaches: windows end only with the session."""

BACKWARD_BEGIN: Final = 0
BACKWARD_END: Final = 1
BACKWARD_ALIAS: Final = 2
BACKWARD_END_OPEN: Final = 3
"""Phases of backward events; an alias's time is the start of the call whose backward it shares.
An open end is the end of a leaf's output node where its own part of the graph goes on past what
was searched: it ends no earlier (the next layer's backward begin ends it)."""
NO_ERROR: Final = -1
"""The error column of a module call that raised nothing (else the index of its error text)."""
ROOT_TRAINING: Final = 1
"""Flag of a top-level call: the module was in training mode."""
ROOT_GRAD: Final = 2
"""Flag of a top-level call: autograd was recording a graph."""
ROOT_MODE_UNKNOWN: Final = 4
"""Flag of a top-level call: whether the module was in training mode is not known (TorchScript)."""


class Interner:
    """Maps hashable values (or objects by identity) to dense ids, keeping the values."""

    __slots__ = ("ids", "values", "by_identity")

    def __init__(self, by_identity: bool = False) -> None:
        self.ids: dict[Any, int] = {}
        self.values: list[Any] = []
        self.by_identity = by_identity

    def intern(self, value: Any) -> int:
        key = id(value) if self.by_identity else value
        index = self.ids.get(key)
        if index is None:
            index = self.ids[key] = len(self.values)
            self.values.append(value)
        return index


def extend_columns(columns: Sequence[array[int]], rows: Sequence[tuple[Any, ...]]) -> None:
    """Append ``rows`` to ``columns``: each row's first ``len(columns)`` values, 64-bit ints, one
    per column (values after them are left alone).

    In C where that is built (``xsp.record._hotpath.pack_columns``); else one ``struct.pack`` of all
    values and a strided copy per column: ``array.extend`` of a tuple converts item by item and
    cost more than recording the rows did (the C packing costs a tenth of this).
    """
    fast = hotpath.HOTPATH
    if fast is not None:
        packed_columns = fast.pack_columns(rows if isinstance(rows, list) else list(rows),
                                           tuple(column.itemsize for column in columns))
        for column, packed_column in zip(columns, packed_columns):
            column.frombytes(packed_column)
        return
    width = len(columns)
    if rows and len(rows[0]) != width:
        rows = [row[:width] for row in rows]
    packed = memoryview(struct.pack(f"{len(rows) * width}q", *chain.from_iterable(rows))).cast("q")
    for index, column in enumerate(columns):
        strided = packed[index::width]
        if column.itemsize == 8:
            column.frombytes(strided.tobytes())
        else:  # a narrow column (flags, phases): few values per row, converted one by one
            column.fromlist(strided.tolist())


def extend_columns_from_packed(columns: Sequence[array[int]], packed: memoryview) -> None:
    """Append rows of native int64s, ``len(columns)`` values per row (as xsp's C wrapper packs
    them into ``ThreadBuffer.packed_calls``), to ``columns``.

    In C where that is built (``xsp.record._hotpath.split_rows``); else a strided copy per column, which
    copies value by value (some ten times dearer, about 500 instructions a row of seven).
    """
    fast = hotpath.HOTPATH
    if fast is not None:
        for column, split_column in zip(columns, fast.split_rows(packed, tuple(c.itemsize for c in columns))):
            column.frombytes(split_column)
        return
    width = len(columns)
    values = packed.cast("q")
    for index, column in enumerate(columns):
        strided = values[index::width]
        if column.itemsize == 8:
            column.frombytes(strided.tobytes())
        else:
            column.fromlist(strided.tolist())


CALL_FIELDS: Final = 8
"""Fields of a module-call record (``ThreadBuffer.calls``' tuples and packed rows): start, end,
module, depth, inputs, outputs, error and call site (:mod:`xsp.record.sites`)."""

ROOT_FIELDS: Final = 2
"""Fields of a top-level call's record (``ThreadBuffer.roots``' tuples and packed rows)."""


class NoteField(enum.IntEnum):
    """The fields of a packed step note, by their place in ``ThreadBuffer.packed_notes``' rows of
    int64s (behind the rows' count, as ``packed_calls``' are): a step note's
    (:class:`xsp.record.sampling.NoteKind`) with its trace id in two halves."""

    TIME_NS = 0
    KIND = 1
    REASON = 2
    TRACE_HIGH = 3
    """The trace id's high 64 bits (its bits as an int64)."""
    TRACE_LOW = 4
    SPAN_ID = 5
    """The span id's 64 bits, as an int64."""
    PLAN_OR_DURATION_NS = 6
    """A decision's 1 + its depth plan's index (0: none); a slow step's duration."""
    MEDIAN_NS = 7
    """A slow step's running median (0 in a decision)."""


NOTE_FIELDS: Final = len(NoteField)
NOTE_BYTES: Final = NOTE_FIELDS * 8


def notes_buffer(rows: bytes = b"") -> bytearray:
    """A ``ThreadBuffer.packed_notes`` holding ``rows`` (packed notes, whole rows), behind their count.
    Empty, it holds only the count: xsp's C sampler grows it as the notes come, doubling it."""
    return bytearray(struct.pack("q", len(rows) // NOTE_BYTES)) + rows


def note_rows(packed: bytes | bytearray) -> bytes:
    """The rows a ``packed_notes`` buffer holds (a copy, without their count)."""
    count = count_packed_rows(packed) if len(packed) >= 8 else 0
    return bytes(memoryview(packed)[8:8 + count * NOTE_BYTES])


def split_packed_notes(packed: bytes | bytearray, cut_ns: int) -> tuple[bytearray, bytearray]:
    """A ``packed_notes`` buffer (rows in time order) as two: the notes from before ``cut_ns``, and
    those from it on."""
    rows = note_rows(packed)
    cut = bisect.bisect_left(memoryview(rows).cast("q")[NoteField.TIME_NS::NOTE_FIELDS], cut_ns) * NOTE_BYTES
    return notes_buffer(rows[:cut]), notes_buffer(rows[cut:])


FIRST_PACKED_ROWS: Final = 64
"""Rows of a thread's first ``packed_calls`` and ``packed_roots`` (one page). A thread's first
buffer is made of fresh memory: at full size (28 KiB) it cost ~35 µs of page faults here, on the
first call of every new thread (a server that starts threads per request paid it per request).
Once full, the C wrapper grows it in place to its full size (``COMPACT_AT`` rows): compacting a
thread's first 64 rows would cost ~90,000 instructions, ~1,400 a row."""


# Empty arrays are made by copying these: array() parses its type code each time, and a
# new thread makes 19 of them
_new_int8 = array("b").__copy__
_new_int64 = array("q").__copy__
_new_long = array("l").__copy__


def packed_rows(rows: int = COMPACT_AT, fields: int = CALL_FIELDS) -> bytearray:
    """An empty ``ThreadBuffer.packed_calls`` (or ``packed_roots``, ``fields=ROOT_FIELDS``): a zero
    count and room for ``rows`` rows (made at its full size, so that the C wrapper only writes into
    it; rows after them go to ``calls``). Only the count is written where the C part is built (rows
    past the count are never read)."""
    size = 8 + rows * fields * 8
    fast = hotpath.HOTPATH
    return bytearray(size) if fast is None else fast.empty_packed(size)  # type: ignore[no-any-return]


def count_packed_rows(packed: bytes | bytearray) -> int:
    """The row count a ``packed_calls`` or ``packed_roots`` buffer starts with."""
    return int(memoryview(packed)[:8].cast("q")[0])


def extend_from_packed_rows(columns: Sequence[array[int]], packed: bytearray, rows: int) -> None:
    """Append the first ``rows`` rows of a ``packed_calls`` or ``packed_roots`` buffer (one value
    per column a row) to ``columns``."""
    extend_columns_from_packed(columns, memoryview(packed)[8:8 + rows * len(columns) * 8])


class CallColumns:
    """Compacted module-call records of one thread (one row per finished call)."""

    __slots__ = ("start", "end", "module", "depth", "inputs", "outputs", "error", "site")

    def __init__(self) -> None:
        self.start = _new_int64()
        self.end = _new_int64()
        self.module = _new_long()
        self.depth = _new_long()
        self.inputs = _new_long()
        self.outputs = _new_long()
        self.error = _new_long()
        self.site = _new_long()
        """The call site's id in the recording's :class:`xsp.record.sites.CallSites` (``NO_SITE``: none)."""

    def __len__(self) -> int:
        return len(self.start)


class MarkColumns:
    """Compacted user-span and step records of one thread."""

    __slots__ = ("kind", "start", "end", "name", "attributes", "error", "site")

    def __init__(self) -> None:
        self.kind = _new_int8()
        self.start = _new_int64()
        self.end = _new_int64()
        self.name = _new_long()
        self.attributes: list[dict[str, Any] | None] = []
        self.error = _new_long()
        self.site = _new_long()
        """A user span's or explicit step's call site id (``NO_SITE`` for every other mark)."""

    def __len__(self) -> int:
        return len(self.start)


class BackwardColumns:
    """Compacted backward events of one thread: begin (``BACKWARD_BEGIN``) and end
    (``BACKWARD_END``) of the backward of the module call that started at ``call`` (its start
    on the host clock), or ``BACKWARD_ALIAS``: that call's backward is the one of the call that
    started at ``time``."""

    __slots__ = ("module", "time", "phase", "call")

    def __init__(self) -> None:
        self.module = _new_long()
        self.time = _new_int64()
        self.phase = _new_int8()
        self.call = _new_int64()

    def __len__(self) -> int:
        return len(self.time)


class RootColumns:
    """Compacted facts of one thread's top-level model calls: start and ``ROOT_*`` flags."""

    __slots__ = ("start", "flags")

    def __init__(self) -> None:
        self.start = _new_int64()
        self.flags = _new_int8()

    def __len__(self) -> int:
        return len(self.start)


_Columns = TypeVar("_Columns")


class MadeOnFirstUse(Generic[_Columns]):
    """A :class:`ThreadBuffer`'s columns object, kept in the slot of its name with a leading
    underscore and made when first read: a new thread's buffer would otherwise make four of them
    (19 arrays, a third of its making) before its first call, and a thread that ends before its
    first compaction never reads them."""

    def __init__(self, make: Callable[[], _Columns]) -> None:
        self.make = make
        self.slot: Any = None

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = owner.__dict__["_" + name]  # the slot's member descriptor

    @overload
    def __get__(self, buffer: None, owner: type | None = None) -> MadeOnFirstUse[_Columns]: ...
    @overload
    def __get__(self, buffer: object, owner: type | None = None) -> _Columns: ...

    def __get__(self, buffer: object | None, owner: type | None = None) -> Any:
        if buffer is None:
            return self
        columns = self.slot.__get__(buffer, owner)
        if columns is None:
            columns = self.make()
            self.slot.__set__(buffer, columns)
        return columns

    def __set__(self, buffer: object, columns: _Columns) -> None:
        self.slot.__set__(buffer, columns)
