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

def bind(path: str | None = None, major: int = 0, /) -> Bound:
    """Bind to the libcupti loaded in this process (``path``, or the only one loaded; where several
    are, the one of CUDA release ``major``).

    Raises:
        OSError: none loaded (it is never loaded here), several loaded and none (or more than one)
            of ``major``, a symbol missing, or a CUPTI API version whose record layouts xsp does
            not know.
    """

def bound() -> Bound | None: ...
def register(buffer_bytes: int, max_buffers: int, zeroing: str = "written", /) -> bool:
    """Set CUPTI's zeroed-buffer attribute (its value before kept, for :func:`restore`) and
    register xsp's buffer callbacks; True when CUPTI took the attribute (it then leaves the
    zeroing to xsp). ``zeroing``: how a buffer read is made zero again, ``"written"`` (the pages
    of its records cleared, the rest given back to the kernel) or ``"whole"`` (all cleared)."""

def use_host_clock() -> bool:
    """Have CUPTI stamp records with xsp's host clock (CLOCK_MONOTONIC, as ``time.perf_counter_ns``)
    through its timestamp callback; False where the library has none or refused it. Call before
    enabling any activity kind."""

def restore() -> None:
    """Set back every process-wide CUPTI setting :func:`register` and :func:`use_host_clock`
    changed (the zeroed-buffer attribute to its value before; CUPTI's own clock).

    Raises:
        OSError: CUPTI refused; the message names what stays changed.
    """

def settings() -> dict[str, Any]:
    """What xsp holds changed of CUPTI's settings: ``zeroed_buffers_claimed``, ``zeroed_before``,
    ``host_clock``, and what the library offers (``can_read_attributes``, ``has_timestamp_callback``)."""

def drain() -> dict[str, Any]:
    """The records of every completed buffer: ``{family: {field: Column}}`` for the families
    api, kernel, memcpy, memset, sync, external and memcpy_peer; ``names`` (kernel names interned since the
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
def count_drops() -> None:
    """Count what CUPTI dropped since its last completed buffer (its global queue's count), for
    the next :func:`drain`: called after the final flush."""
def can_share() -> bool:
    """True when the bound libcupti has CUPTI 13.5's multi-subscriber calls (every ``_v2`` call
    xsp makes), so that xsp can share CUPTI with other clients."""

def share(subscriber: int | None, /) -> None:
    """Make every CUPTI call of this module for xsp's ``subscriber`` handle (the ``_v2`` forms),
    from the buffer callbacks' registration on; None goes back to the one-subscriber calls.

    Raises:
        RuntimeError: the bound libcupti cannot share CUPTI.
    """

def enable_kind(kind: int, on: bool, /) -> None:
    """``cuptiActivityEnable_v2`` / ``Disable_v2`` for xsp's subscriber.

    Raises:
        RuntimeError: not sharing, or CUPTI refused (its result code in ``status``).
    """

def enable_api(kind: int, cbid: int, on: bool, /) -> None:
    """Records of one runtime (``kind`` 5) or driver (4) API call on or off, for xsp's subscriber."""

def set_thread_id_type(thread_id_type: int, /) -> None:
    """The thread-id type of xsp's subscriber's records (its ``CUPTI_ACTIVITY_ATTR_THREAD_ID_TYPE``)."""
