"""Perfetto's own trace format (protobuf ``TrackEvent`` slices) from a span table: what opens in
https://ui.perfetto.dev when a trace is too large for JSON.

A trace of millions of spans makes a Chrome JSON file of gigabytes (about 350 B a span), which
the Perfetto UI must parse whole in the browser: past about 1 GB it fails (kineto#760). This
format holds a span in about 50 B (two packets of varints; names and levels are written once,
interned), and the file is written in blocks as the spans are encoded, in C where xsp's
extension is built (``xsp/export/_perfetto.c``), else in Python.

Tracks: each host thread on its process (per rank, where a trace has several, as the Chrome
export has them: :class:`xsp.export.processes.Processes`), each GPU stream on a ``GPU <device>``
process. Each span is a slice on its track (its name, its level as the category), from its start
to its end in epoch nanoseconds.
A track's slices nest: a span that overlaps another on its track without fitting in it (some
imported traces have them) is cut at that span's end, and the cut is counted. What the
Chrome export adds beside the spans (arguments, memory events, counter tracks) is left out: open
the Chrome JSON of one step for those.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, Final

import numpy as np
import pandas as pd

from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.export.processes import Processes
from xsp.export.wire import varint
from xsp.io.outputs import write_output
from xsp.io.trace import Trace
from xsp.record.hotpath import optional_extension
from xsp.record.samples import is_sample

ENCODER: Any = optional_extension("xsp.export._perfetto")
SEQUENCE_ID: Final = 1
"""The one packet sequence of the file: its interned names hold for every packet."""
INCREMENTAL_STATE_CLEARED: Final = 1
NEEDS_INCREMENTAL_STATE: Final = 2
SLICE_BEGIN: Final = 1
SLICE_END: Final = 2
GPU_PID_BASE: Final = 2_000_000_000
"""Processes for GPUs (Perfetto names a process by a number): above any real pid and the
rank-numbered ones (1,000,000,000 + rank)."""


def field(number: int, value: int | bytes | str) -> bytes:
    """One protobuf field: an int as a varint, bytes or text (UTF-8) length-delimited."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    payload = value.encode("utf-8", errors="replace") if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def packet(*fields: bytes) -> bytes:
    """A ``Trace.packet`` entry holding a ``TracePacket`` of ``fields``."""
    return field(1, b"".join(fields))


def write_slices_in_python(out: BinaryIO, tracks: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                           names: np.ndarray, categories: np.ndarray, uuids: np.ndarray, sequence_id: int) -> int:
    """What ``xsp/export/_perfetto.c``'s ``write_slices`` does, where it is not built: the same
    bytes (see that file)."""
    block: list[bytes] = []
    open_ends: list[int] = []
    cut = 0
    current = -1

    def event(at: int, kind: int, track: int, name: int = 0, category: int = 0) -> None:
        body = field(9, kind) + field(11, int(uuids[track]))
        if kind == SLICE_BEGIN:
            body += field(10, name) + field(3, category)
        block.append(packet(field(8, at), field(11, body), field(10, sequence_id), field(13, NEEDS_INCREMENTAL_STATE)))

    for i in range(len(tracks) + 1):
        last = i == len(tracks)
        next_track = last or int(tracks[i]) != current
        while open_ends and (next_track or open_ends[-1] <= int(starts[i])):
            event(open_ends.pop(), SLICE_END, current)
        if last:
            break
        current = int(tracks[i])
        start = int(starts[i])
        stop = max(int(ends[i]), start)
        if open_ends and stop > open_ends[-1]:
            stop = open_ends[-1]
            cut += 1
        event(start, SLICE_BEGIN, current, int(names[i]), int(categories[i]))
        open_ends.append(stop)
        if len(block) >= 65_536:
            out.write(b"".join(block))
            block.clear()
    out.write(b"".join(block))
    return cut


class _Tracks:
    """The file's tracks: a uuid each, and their descriptor packets."""

    def __init__(self, trace: Trace) -> None:
        self.processes_of_ranks = Processes.of(trace)
        self.thread_names = trace.thread_names()
        self.descriptors: list[bytes] = []
        self.processes: dict[Any, int] = {}

    def _uuid(self) -> int:
        return len(self.descriptors) + 1

    def _process(self, key: Any, pid: int, name: str) -> int:
        if key not in self.processes:
            uuid = self._uuid()
            self.processes[key] = uuid
            self.descriptors.append(packet(field(60, field(1, uuid) + field(3, field(1, pid) + field(6, name)))))
        return self.processes[key]

    def thread(self, rank: int | None, thread: int) -> int:
        pid = self.processes_of_ranks.host(rank)
        self._process(("host", rank), pid, self.processes_of_ranks.host_name(rank))
        uuid = self._uuid()
        name = self.thread_names.get((rank, thread), f"thread {thread}")
        # (a thread's track is its process's child without a parent_uuid: Perfetto joins them by pid)
        descriptor = field(1, uuid) + field(4, field(1, pid) + field(2, thread) + field(5, name))
        self.descriptors.append(packet(field(60, descriptor)))
        return uuid

    def stream(self, rank: int | None, device: int, stream: int) -> int:
        pid = GPU_PID_BASE + (0 if rank is None else rank) * 1_000 + device
        parent = self._process(("gpu", rank, device), pid, Processes.gpu(rank, device))
        uuid = self._uuid()
        self.descriptors.append(packet(field(60, field(1, uuid) + field(2, f"stream {stream}") + field(5, parent))))
        return uuid


def _ints(column: pd.Series, missing: int) -> np.ndarray:
    return np.nan_to_num(column.to_numpy(dtype=np.float64, na_value=np.nan), nan=missing).astype(np.int64)


def _track_of_each_span(spans: pd.DataFrame, tracks: _Tracks) -> np.ndarray:
    """Each span's track (a place in the uuid table the tracks make, in order)."""
    several = tracks.processes_of_ranks.several
    ranks = _ints(spans[col.RANK], -1) if several else np.full(len(spans), -1, dtype=np.int64)
    threads = spans[col.THREAD_ID]
    on_device = (threads.isna() & spans[col.DEVICE_ID].notna()).to_numpy()
    keys = pd.DataFrame({
        "device_side": on_device, "rank": ranks,
        "thread": np.where(on_device, -1, _ints(threads, 0)),
        "device": np.where(on_device, _ints(spans[col.DEVICE_ID], 0), -1),
        "stream": np.where(on_device, _ints(spans[col.STREAM_ID], 0), -1)})
    codes, distinct = pd.factorize(pd.MultiIndex.from_frame(keys))
    uuids = []
    for device_side, rank, thread, device, stream in distinct:
        rank_or_none = None if rank < 0 else int(rank)
        uuids.append(tracks.stream(rank_or_none, int(device), int(stream)) if device_side
                     else tracks.thread(rank_or_none, int(thread)))
    return np.asarray(uuids, dtype=np.uint64)[codes] if len(codes) else np.zeros(0, dtype=np.uint64)


def _interned(kind: int, texts: Iterable[str]) -> bytes:
    """``InternedData`` entries (``event_categories`` 1, ``event_names`` 2), ids from 1."""
    return b"".join(field(kind, field(1, iid) + field(2, text)) for iid, text in enumerate(texts, start=1))


def write_perfetto(trace: Trace, path: str | os.PathLike[str],
                   write_slices: Callable[..., int] | None = None) -> tuple[Path, int, int]:
    """Write ``trace``'s spans as a Perfetto protobuf trace (see the module's text), atomically.

    Returns the file, the number of spans written (a trace's system samples and memory events are
    not) and how many of them were cut at the end of a span they overlap on their track.
    ``write_slices``: the slices' encoder (default: the C one, else :func:`write_slices_in_python`).

    Raises:
        xsp.io.outputs.OutputError: the file could not be written (nothing is left at ``path``).
    """
    spans = trace.spans
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    needed = [name for name in (col.NAME, col.LEVEL, col.START_NS, col.END_NS, col.THREAD_ID, col.DEVICE_ID,
                                col.STREAM_ID, col.RANK) if name in spans]
    timed = spans[needed][~is_sample(spans) & (levels != Level.MEMORY.value)]
    tracks = _Tracks(trace)
    uuid_of_span = _track_of_each_span(timed, tracks)
    # the uuid table the encoder indexes: tracks are numbered by uuid (1, 2, ...), slot 0 unused
    uuid_table = np.arange(len(tracks.descriptors) + 1, dtype=np.uint64)
    track = uuid_of_span.astype(np.int64)
    name_codes, names = pd.factorize(timed[col.NAME].astype(object).fillna(""), use_na_sentinel=False)
    level_codes, level_names = pd.factorize(timed[col.LEVEL].astype(object).fillna(""), use_na_sentinel=False)
    starts = timed[col.START_NS].to_numpy(dtype=np.int64)
    ends = np.maximum(timed[col.END_NS].to_numpy(dtype=np.int64), starts)
    order = np.lexsort((-ends, starts, track))
    header = packet(field(10, SEQUENCE_ID), field(13, INCREMENTAL_STATE_CLEARED),
                    field(12, _interned(1, map(str, level_names)) + _interned(2, map(str, names))))
    encode = write_slices or (ENCODER.write_slices if ENCODER is not None else write_slices_in_python)
    cut = 0

    def write(temporary: Path) -> None:
        nonlocal cut
        with open(temporary, "wb") as out:
            out.write(b"".join(tracks.descriptors))
            out.write(header)
            cut = encode(out, np.ascontiguousarray(track[order]), np.ascontiguousarray(starts[order]),
                         np.ascontiguousarray(ends[order]),
                         np.ascontiguousarray(name_codes[order].astype(np.int64) + 1),
                         np.ascontiguousarray(level_codes[order].astype(np.int64) + 1), uuid_table, SEQUENCE_ID)

    return write_output(path, write), len(timed), cut


__all__ = ["write_perfetto", "write_slices_in_python", "field", "packet"]
