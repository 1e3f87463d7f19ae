"""Whether a trace fits in memory before it is loaded whole: a trace larger than the machine's free
memory is refused in one line, pointing to the ways that read it in bounded memory, instead of the
process being killed for lack of memory part way through."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from xsp.core.errors import TraceTooLargeError

KINETO_BYTES_PER_JSON_BYTE: Final = 2.2
"""What the in-memory import holds at its peak for each byte of a trace's (inflated) JSON: 1.8-2.1
for the V100 trace repeated to 0.4 and 1 GB (benchmarks/results/large_kineto_import.md)."""
PARQUET_BYTES_PER_DATA_BYTE: Final = 2.0
"""What loading an ``.xsp.parquet`` file holds at its peak for each byte of its uncompressed data."""
MIN_GZIP_INFLATION: Final = 3
"""Kineto JSON inflates 10-15 times from gzip: a large stream's recorded size (modulo 4 GiB) is taken
with as many 4 GiB as it takes to reach at least this many times the file's size."""
MAX_DEFLATE_RATIO: Final = 1032
"""The most deflate can inflate: a file smaller than 4 GiB / this cannot hold a wrapped size."""


def free_memory_bytes() -> int:
    """Memory the process could take: what the system has available, and free swap."""
    import psutil

    return int(psutil.virtual_memory().available + psutil.swap_memory().free)


def inflated_bytes(path: Path) -> int:
    """The size of a trace's text: the file's, or a gzip file's inflated size as its trailer gives it
    (the size modulo 4 GiB, made plausible)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        if file.read(2) != b"\x1f\x8b" or size < 18:
            return size
        file.seek(-4, os.SEEK_END)
        recorded = int.from_bytes(file.read(4), "little")
    if size * MAX_DEFLATE_RATIO < 1 << 32:
        return recorded
    while recorded < MIN_GZIP_INFLATION * size:
        recorded += 1 << 32
    return recorded


def kineto_memory_bytes(path: Path) -> int:
    """About the peak memory of loading a Kineto trace whole."""
    return int(inflated_bytes(path) * KINETO_BYTES_PER_JSON_BYTE)


def parquet_memory_bytes(path: Path) -> int:
    """About the peak memory of loading an ``.xsp.parquet`` file whole (0 where its footer cannot be
    read: the reader says what is wrong)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(path)
    except (pa.ArrowException, OSError):
        return 0
    data = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    return int(data * PARQUET_BYTES_PER_DATA_BYTE)


def check_fits(path: Path, needed_bytes: int, instead: str) -> None:
    """Refuse to load ``path`` whole where it needs more than the free memory.

    Raises:
        TraceTooLargeError: one line, with the figures and ``instead``: what reads it in bounded memory.
    """
    free = free_memory_bytes()
    if needed_bytes > free:
        raise TraceTooLargeError(f"{path} is too large to load whole here: it needs about "
                                 f"{needed_bytes / 2**30:.1f} GiB and {free / 2**30:.1f} GiB is free; {instead}")
