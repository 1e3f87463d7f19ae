"""Whether a trace fits in memory before it is loaded whole: a trace larger than the machine's free
memory is refused in one line, pointing to the ways that read it in bounded memory, instead of the
process being killed for lack of memory part way through."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from xsp.core.errors import TraceTooLargeError

KINETO_BYTES_PER_JSON_BYTE: Final = 2.2
"""What loading a trace's (inflated) JSON holds at its peak, per byte: 1.8-2.1 for the V100 trace
repeated to 0.4 and 1 GB (benchmarks/results/large_kineto_import.md). ``xsp report`` holds up to
1.4 times more (2.9 for the 1 GB one): the check is of the load, which every reader makes."""
PARQUET_BYTES_PER_DATA_BYTE: Final = 4.0
"""The same for an ``.xsp.parquet`` file, per byte of its uncompressed data: ``xsp.load`` of the
1 GB trace's import peaked at 3.9 times it (``xsp report`` at 6.2)."""
ANALYSIS_BYTES_PER_DATA_BYTE: Final = 6.5
"""What ``xsp report``, ``xsp summary`` and ``xsp diff`` of an ``.xsp.parquet`` file loaded whole
hold at their peak, per byte of its uncompressed data: ``xsp report`` of the 1 GB trace's import
peaked at 6.2 times it. Past the free memory, they read the file a window at a time instead."""
HEADROOM: Final = 0.9
"""The share of the free memory a load counts on: the rest covers the estimates' spread and what
other processes take meanwhile (a report whose estimate fit by 0.04 of 22 GiB was killed)."""
MIN_GZIP_INFLATION: Final = 3
"""Kineto JSON inflates 10-15 times from gzip: a large stream's recorded size (modulo 4 GiB) is taken
with as many 4 GiB as it takes to reach at least this many times the file's size."""
MAX_DEFLATE_RATIO: Final = 1032
"""The most deflate can inflate: a file smaller than 4 GiB / this cannot hold a wrapped size."""


CGROUP_FILES: Final = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                        "/sys/fs/cgroup/memory.stat", "inactive_file"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                        "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))
"""A container's memory limit, its use, and the page cache in it the kernel can take back (cgroup v2,
then v1): what the machine's figures do not show."""


def _reclaimable(stat_file: str, key: str) -> int:
    try:
        for line in Path(stat_file).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_room_bytes() -> int | None:
    for limit_file, usage_file, stat_file, reclaimable in CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's huge number: no limit
            return max(int(limit) - usage + _reclaimable(stat_file, reclaimable), 0)
    return None


def free_memory_bytes() -> int:
    """Memory the process could take: what the system has available and free swap, or less where
    its container's limit leaves less."""
    import psutil

    free = int(psutil.virtual_memory().available + psutil.swap_memory().free)
    room = _cgroup_room_bytes()
    return free if room is None else min(free, room)


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 1 << 30 else f"{max(count, 1 << 20) / 2**20:.0f} MiB"


def inflated_bytes(path: Path) -> int:
    """The size of a trace's text: the file's, or a gzip file's inflated size as its trailer gives it
    (the size modulo 4 GiB, made plausible; at least :data:`MIN_GZIP_INFLATION` times the file, as
    the trailer of a file of several members gives only its last member's size)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        if file.read(2) != b"\x1f\x8b" or size < 18:
            return size
        file.seek(-4, os.SEEK_END)
        recorded = int.from_bytes(file.read(4), "little")
    if size * MAX_DEFLATE_RATIO < 1 << 32:
        return max(recorded, MIN_GZIP_INFLATION * size)
    while recorded < MIN_GZIP_INFLATION * size:
        recorded += 1 << 32
    return recorded


def kineto_memory_bytes(path: Path) -> int:
    """About the peak memory of loading a Kineto trace whole."""
    return int(inflated_bytes(path) * KINETO_BYTES_PER_JSON_BYTE)


def parquet_memory_bytes(path: Path) -> int:
    """About the peak memory of loading an ``.xsp.parquet`` file whole (0 where its footer cannot be
    read: the reader says what is wrong)."""
    return int(_data_bytes(path) * PARQUET_BYTES_PER_DATA_BYTE)


def analysis_memory_bytes(path: Path) -> int:
    """About the peak memory of a report or summary of an ``.xsp.parquet`` file loaded whole (0
    where its footer cannot be read)."""
    return int(_data_bytes(path) * ANALYSIS_BYTES_PER_DATA_BYTE)


def _data_bytes(path: Path) -> int:
    """An ``.xsp.parquet`` file's uncompressed data (0 where its footer cannot be read: the reader
    says what is wrong)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except (pa.ArrowException, OSError):
        return 0
    return sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))


def check_fits(path: Path | str, needed_bytes: int, instead: str) -> None:
    """Refuse to load ``path`` whole where it needs more than the free memory (less
    :data:`HEADROOM`).

    Raises:
        TraceTooLargeError: one line, with the figures and ``instead``: what reads it in bounded memory.
    """
    free = free_memory_bytes()
    if needed_bytes > HEADROOM * free:
        raise TraceTooLargeError(f"{path} is too large to load whole here: it needs about {_size(needed_bytes)} "
                                 f"and {_size(free)} is free; {instead}")
