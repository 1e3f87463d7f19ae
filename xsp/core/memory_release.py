"""Giving memory the process freed back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


LARGE_TABLE_ROWS = 250_000
"""Tables from this many rows up give freed memory back between the stages of their building
(a few milliseconds each, against seconds of building)."""


def release_freed_memory() -> None:
    """Hand the heap memory freed so far back to the system (glibc's ``malloc_trim``, and Arrow's
    default pool where Arrow is loaded).

    Between the stages of a large import, columns of tens of megabytes are freed that glibc
    keeps for reuse, while the next stage's larger arrays are mapped afresh: without this the
    process holds both, and its peak is hundreds of megabytes above what it uses. A no-op where
    the C library has no such call.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:  # Arrow's own allocator keeps what pandas' Arrow columns freed, too
        arrow.default_memory_pool().release_unused()
