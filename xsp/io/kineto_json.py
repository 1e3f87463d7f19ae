"""Reading a Kineto (PyTorch profiler) trace file: sniffing, bounded gzip inflation and one typed
msgspec decode of its events; :mod:`xsp.io.kineto` turns them into span rows."""

from __future__ import annotations

import gc
import os
import types
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Union

import msgspec

from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.io.parquet import GZIP_MAGIC, gunzip_bounded

MISSING = -(2**63)
"""Stands for an absent integer until a column's null mask is made."""


_NO_RAW = msgspec.Raw()
"""One shared empty raw value, the default of absent JSON fields."""


class Complete(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    """A complete event: the only phase that becomes a span."""

    cat: str = ""
    name: str = ""
    pid: Any = None
    tid: Any = None
    ts: int | float | None = None
    dur: int | float | None = None
    """None where the event has none: such an event is left out, and counted."""
    args: msgspec.Raw = _NO_RAW
    """Left as raw JSON (empty when absent): the typed fields are decoded from it, and it is kept as ``attributes``."""


class Flow(msgspec.Struct, tag_field="ph", tag="s", gc=False):
    """A flow event (``ac2g`` flows stand in for a missing correlation id)."""

    cat: str = ""
    pid: Any = None
    tid: Any = None
    ts: int | float = 0
    id: Any = None


class FlowEnd(Flow, tag="f"):
    pass


class _FlowStep(Flow, tag="t"):
    pass


class _Skipped(msgspec.Struct, tag_field="ph", gc=False):
    """Any other phase of the Chrome trace format: only its category is read, to count it."""

    cat: str = ""


def _skipped_phase(code: str) -> type[_Skipped]:
    return types.new_class(f"_Skipped{ord(code)}", (_Skipped,), {"tag": code})


class _Named(msgspec.Struct, gc=False):
    name: str = ""


class Metadata(msgspec.Struct, tag_field="ph", tag="M", gc=False):
    """A metadata event: a thread's name is kept (``thread_name``), the rest only counted."""

    cat: str = ""
    name: str = ""
    pid: Any = None
    tid: Any = None
    args: _Named = msgspec.field(default_factory=_Named)


_SKIPPED_PHASES = {code: _skipped_phase(code) for code in "BEiICbnePNODVvRc()="}
QUIET_PHASES = frozenset({FlowEnd, Flow, _FlowStep, Metadata})
"""Phases read but not worth reporting as ignored: flows and metadata."""


def ignored_key(what: str) -> str:
    """The ``not_imported`` count of the events of category (or phase) ``what`` left out."""
    return f"ignored {what} events"


IGNORED_WITHOUT_LOSS: Final = frozenset({ignored_key("Trace"), ignored_key("i")})
"""``not_imported`` counts of what every PyTorch profiler file holds and nothing is lost without:
the profiler's own span ("PyTorch Profiler (0)") and its markers ("Iteration Start", "Record
Window End")."""


def phase(event: Any) -> str:
    return str(getattr(event, "phase", "") or type(event).__struct_config__.tag)


class _AnyEvent(msgspec.Struct, gc=False):
    """An event of any phase, for files the tagged decoding refuses (an unknown or missing ``ph``)."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Any = None
    tid: Any = None
    ts: int | float | None = None
    dur: int | float | None = None
    id: Any = None
    args: msgspec.Raw = _NO_RAW

    def tagged(self) -> Any:
        if self.ph == "X":
            return Complete(self.cat, self.name, self.pid, self.tid, self.ts, self.dur, self.args)
        flow = {"s": Flow, "f": FlowEnd, "t": _FlowStep}.get(self.ph)
        if flow is not None:
            return flow(self.cat, self.pid, self.tid, self.ts or 0, self.id)
        if self.ph == "M":
            name = msgspec.json.decode(self.args, type=_Named) if self.args else _Named()
            return Metadata(self.cat, self.name, self.pid, self.tid, name)
        skipped = _SKIPPED_PHASES.get(self.ph)
        return skipped(self.cat) if skipped is not None else _Unknown(self.cat, self.ph or "unphased")


class _Unknown(_Skipped, tag=""):
    """A phase the Chrome trace format does not define (or none)."""

    phase: str = ""


_EVENT_TYPES = (Complete, Flow, FlowEnd, _FlowStep, Metadata, *_SKIPPED_PHASES.values())
_Event: Any = Union[_EVENT_TYPES]  # noqa: UP007 - a union built from a tuple, which `|` cannot spell


class _Args(msgspec.Struct, gc=False):
    """The arguments xsp has columns for; everything else stays in the raw JSON."""

    correlation: Any = MISSING
    device: Any = None
    stream: Any = None
    grid: msgspec.Raw = _NO_RAW
    block: msgspec.Raw = _NO_RAW
    registers: Any = msgspec.field(name="registers per thread", default=MISSING)
    shared_memory: Any = msgspec.field(name="shared memory", default=MISSING)
    nbytes: Any = msgspec.field(name="bytes", default=MISSING)
    input_dims: msgspec.Raw = msgspec.field(name="Input Dims", default=_NO_RAW)
    sequence: Any = msgspec.field(name="Sequence number", default=MISSING)
    external: Any = msgspec.field(name="External id", default=MISSING)


NO_ARGS = _Args()
ARGS_DECODER = msgspec.json.Decoder(_Args)
DICT_DECODER = msgspec.json.Decoder(dict[str, Any])


class FileFields(msgspec.Struct):
    deviceProperties: list[dict[str, Any]] = []  # noqa: N815 - Kineto's keys
    distributedInfo: dict[str, Any] = {}  # noqa: N815
    baseTimeNanoseconds: int = 0  # noqa: N815
    schemaVersion: Any = None  # noqa: N815
    cupti_version: Any = None
    cuda_runtime_version: Any = None
    cuda_driver_version: Any = None
    traceName: Any = None  # noqa: N815


class _File(FileFields):
    # decoded by phase: only complete events get every field, the rest are small
    traceEvents: list[_Event] = []  # type: ignore[valid-type]  # noqa: N815


class _AnyFile(FileFields):
    traceEvents: list[_AnyEvent] = []  # noqa: N815


_DECODER = msgspec.json.Decoder(_File)
_ANY_DECODER = msgspec.json.Decoder(_AnyFile)


KINETO_SUFFIXES = col.KINETO_SUFFIXES


def is_kineto_path(path: str | os.PathLike[str]) -> bool:
    name = str(path).lower()
    return name.endswith(KINETO_SUFFIXES)


MAX_INFLATION: Final = 64
"""A gzip file may inflate to at most this many times its size (or ``MIN_INFLATED_CAP_BYTES``):
Kineto JSON compresses about 10x, and a file that inflates much further is no trace but a
decompression bomb that would take the machine's memory."""
MIN_INFLATED_CAP_BYTES: Final = 256 << 20


SNIFF_BYTES: Final = 4096


def _first_text(head: bytes) -> bytes:
    """The first non-blank bytes of JSON text (after a UTF-8 byte-order mark)."""
    return head.removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")[:16]


def _sniff(source: Path, head: bytes) -> None:
    """Refuse, from its first bytes, a file that cannot be a Chrome trace (a JSON object): a file
    of zeros named .json is not read whole first."""
    first = _first_text(head)
    if not first and len(head) < SNIFF_BYTES:
        raise TraceFormatError(f"{source} is empty" + (" (blanks only)" if head else ""))
    if first[:1] == b"{" or not first:
        return
    shown = first or head[:16]
    raise TraceFormatError(f"{source} is not valid Kineto JSON: a trace begins with '{{', this file with {shown!r}")


def _read_rest(handle: Any, head: bytes) -> bytearray:
    """The file's bytes, ``head`` first, read into one buffer: never joined from a second copy."""
    size = max(os.fstat(handle.fileno()).st_size, len(head))
    data = bytearray(size)
    data[:len(head)] = head
    got = len(head)
    with memoryview(data) as view:
        while got < size and (count := handle.readinto(view[got:])):
            got += count
    del data[got:]
    data += handle.read()  # what was written since its size was read
    return data


def _read_bytes(source: Path) -> bytes | bytearray:
    try:
        with source.open("rb") as handle:
            head = handle.read(SNIFF_BYTES)
            if head[:2] == GZIP_MAGIC:
                try:
                    inflated, _ = gunzip_bounded(head, SNIFF_BYTES)  # a truncated stream is fine here
                except zlib.error as exc:
                    raise TraceFormatError(f"{source} is a corrupt gzip file ({exc})") from None
                _sniff(source, inflated)
                data = head + handle.read()
            else:
                _sniff(source, head)
                return _read_rest(handle, head)
    except OSError as exc:
        raise TraceFormatError(f"{source} cannot be read: {exc.strerror or exc}") from None
    cap = max(MAX_INFLATION * len(data), MIN_INFLATED_CAP_BYTES)
    try:
        inflated, complete = gunzip_bounded(data, cap)
    except zlib.error as exc:
        raise TraceFormatError(f"{source} is a corrupt gzip file ({exc})") from None
    if len(inflated) > cap:
        raise TraceFormatError(f"{source} inflates to more than {cap >> 20} MiB ({MAX_INFLATION}x its size): "
                               "not a plausible trace, not read")
    if not complete:
        raise TraceFormatError(f"{source} is a truncated gzip file")
    return inflated


PIECE_BYTES: Final = 4 << 20
"""How much of a file the C scanner reads at a time (inflated)."""
MAX_VALUE_BYTES: Final = 256 << 20
"""The longest event (or top-level field) the C scanner reads: Kineto's are at most kilobytes, and a
file with a longer one (a string that never ends) is refused, not held whole."""
ARGS_MAX_DEPTH: Final = 512
"""An event's ``args`` nested more levels than this are dropped, not read (``xsp.io._kineto.MAX_DEPTH``):
msgspec, which recurses, cannot read them much deeper."""
READ_BYTES: Final = 512 << 10
"""How much of a gzip file is read at a time (it inflates about 10x)."""


def inflated_pieces(source: Path) -> Iterator[bytes]:
    """The file's text in pieces of at most ``PIECE_BYTES``, inflated when it is gzip: never the
    whole file at once.

    Raises:
        TraceFormatError: unreadable, a corrupt or truncated gzip stream, or one that inflates
            past the cap of :data:`MAX_INFLATION` times its size.
    """
    try:
        with source.open("rb") as handle:
            head = handle.read(2)
            if head != GZIP_MAGIC:
                yield head
                while piece := handle.read(PIECE_BYTES):
                    yield piece
                return
            cap = max(MAX_INFLATION * os.fstat(handle.fileno()).st_size, MIN_INFLATED_CAP_BYTES)
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            total = 0
            data = head
            while True:
                if inflater.eof:  # a member ended: gzip reads the members that follow it as one text
                    data = inflater.unused_data
                    while len(data) < 2 and (more := handle.read(READ_BYTES)):
                        data += more
                    if not data.startswith(GZIP_MAGIC):  # the file's end (bytes after the stream: ignored)
                        return
                    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                if not data:
                    data = handle.read(READ_BYTES)
                try:
                    if data:
                        piece = inflater.decompress(data, PIECE_BYTES)
                        data = inflater.unconsumed_tail
                    else:  # the file ended: what zlib still holds, and the stream must be whole
                        piece = inflater.flush()
                        if not inflater.eof:
                            raise TraceFormatError(f"{source} is a truncated gzip file")
                except zlib.error as exc:
                    raise TraceFormatError(f"{source} is a corrupt gzip file ({exc})") from None
                total += len(piece)
                if total > cap:
                    raise TraceFormatError(f"{source} inflates to more than {cap >> 20} MiB ({MAX_INFLATION}x its "
                                           "size): not a plausible trace, not read")
                if piece:
                    yield piece
    except OSError as exc:
        raise TraceFormatError(f"{source} cannot be read: {exc.strerror or exc}") from None


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a trace is imported.

    An import makes hundreds of thousands of objects, none of them cyclic; with the collector
    running, each batch of new objects triggers a scan of everything alive, which costs more
    than the import itself. The collector's previous state is restored afterwards.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def drop_members(data: bytes | bytearray, ranges: Sequence[tuple[int, int]]) -> bytes | bytearray:
    """``data`` with each (start, stop) range, an object's ``"key": value`` member, made a member of
    an empty key (which no struct reads) padded with spaces: the same length, in place where it can."""
    if not ranges:
        return data
    text = data if isinstance(data, bytearray) else bytearray(data)
    for start, stop in ranges:
        text[start:stop] = b'"":0'.ljust(stop - start)
    return text


def decode(source: Path, dropped_args: Sequence[tuple[int, int]] = ()) -> _File:
    """The whole file decoded; the ``"args"`` members at ``dropped_args`` (offsets the C scanner found
    nested too deeply) are dropped first."""
    data = drop_members(_read_bytes(source), dropped_args)
    try:
        try:
            decoded = _DECODER.decode(data)
        except msgspec.ValidationError:  # an odd phase: decode every event in full, then sort them out
            generic = _ANY_DECODER.decode(data)
            decoded = _File(**{name: getattr(generic, name) for name in FileFields.__struct_fields__},
                            traceEvents=[event.tagged() for event in generic.traceEvents])
    except msgspec.DecodeError as exc:
        kind = "truncated" if "truncated" in str(exc).lower() or "end" in str(exc).lower() else "not valid"
        raise TraceFormatError(f"{source} is {kind} Kineto JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{source} is not valid Kineto JSON: text that is not UTF-8 ({exc.reason} at "
                               f"byte {exc.start} of a string)") from None
    except RecursionError:
        raise TraceFormatError(f"{source} is not a plausible Kineto trace: its JSON is nested too deeply to "
                               "read") from None
    if not decoded.traceEvents and b"traceEvents" not in data[:1 << 20]:
        raise TraceFormatError(f"{source} is JSON but not a Chrome trace (no traceEvents)")
    return decoded
