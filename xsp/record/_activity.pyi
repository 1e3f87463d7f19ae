"""CUPTI activity records read in C (xsp/record/_activity/*.c): the C record path of the CUDA levels."""

from typing import Any, TypedDict

class Column:
    """One packed column of CUPTI records: ``numpy.asarray(column)`` reads it without a copy."""

    def __len__(self) -> int: ...

class Bound(TypedDict):
    path: str
    version: int
    release: str

correlation: Any
"""A PyCapsule (``xsp.record._activity.correlation``) holding the C push and pop of external ids."""

def bind(path: str | None = None, /) -> Bound:
    """Bind to the libcupti loaded in this process (``path``, or the only one loaded).

    Raises:
        OSError: none loaded (it is never loaded here), several loaded, a symbol missing, or a
            CUPTI API version whose record layouts xsp does not know.
    """

def bound() -> Bound | None: ...
def register(buffer_bytes: int, max_buffers: int, /) -> bool:
    """Set CUPTI's zeroed-buffer attribute and register xsp's buffer callbacks; True when CUPTI
    took the attribute (it then leaves the zeroing to xsp)."""

def drain() -> dict[str, Any]:
    """The records of every completed buffer: ``{family: {field: Column}}`` for the families
    api, kernel, memcpy, memset, sync and external; ``names`` (kernel names interned since the
    last drain, in id order); and counts: buffers, bytes, records, other_kinds, unreadable,
    cut_short, size_mismatch, dropped_by_cupti, buffers_refused, correlation_failed,
    foreign_buffers (those after ``size_mismatch`` are since the last drain)."""

def push(external_id: int, /) -> None: ...
def pop() -> None: ...
def layouts() -> dict[str, dict[str, tuple[int, str, int]]]:
    """``{family: {field: (offset, format, bytes)}}`` of the record fields C reads."""

def known_releases() -> list[dict[str, Any]]: ...
def pool_stats() -> dict[str, int]: ...
def trim() -> None: ...
