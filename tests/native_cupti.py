"""xsp's C record path without a GPU: a fake libcupti built from tests/fake_libcupti.c, and CUPTI
records built byte for byte from cupti-python's numpy layouts of every record version."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cupti import cupti as real

SOURCE = Path(__file__).with_name("fake_libcupti.c")
SONAME = "libcupti.so.13"


def activity_module() -> Any:
    """``xsp.record._activity``; skipped where it is not built (a failure under ``XSP_REQUIRE_HOTPATH``)."""
    try:
        import xsp.record._activity as activity
    except ImportError:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("xsp.record._activity is not built (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("xsp.record._activity is not built here (no C compiler at install time)")
    return activity


def build(directory: Path) -> Path:
    """Compile the fake libcupti into ``directory`` (named as the real one, so that xsp finds it
    among the loaded libraries)."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        if os.environ.get("XSP_REQUIRE_HOTPATH"):
            pytest.fail("no C compiler to build the fake libcupti (XSP_REQUIRE_HOTPATH is set)")
        pytest.skip("no C compiler to build the fake libcupti")
    library = directory / SONAME
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(library), str(SOURCE)], check=True)
    return library


@dataclass(frozen=True)
class Release:
    """What one CUPTI release writes: its API version and its record layouts (cupti-python dtypes)."""

    name: str
    version: int
    kernel: str
    memcpy: str
    memset: str
    sync: str

    def dtype(self, family: str) -> np.dtype:
        layout = {"api": "activity_api_dtype", "external": "activity_external_correlation_dtype",
                  "kernel": f"activity_kernel{self.kernel}_dtype", "memcpy": f"activity_memcpy{self.memcpy}_dtype",
                  "memset": f"activity_memset{self.memset}_dtype",
                  "sync": f"activity_synchronization{self.sync}_dtype",
                  "memcpy_peer": "activity_memcpy_pto_p4_dtype"}[family]
        return np.dtype(getattr(real, layout))


# from each release's cupti_version.h and the record versions its cupti_activity.h documents
RELEASES = (
    Release("12.6", 24, "9", "5", "4", ""),
    Release("12.8", 26, "9", "6", "4", "2"),
    Release("12.9", 28, "9", "6", "4", "2"),
    Release("13.0", 130001, "10", "6", "4", "2"),
    Release("13.2", 130202, "11", "6", "4", "2"),
    Release("13.3", 130301, "12", "6", "4", "2"),
    Release("13.4", 130401, "13", "7", "5", "2"),
)
NEWEST = RELEASES[-1]
SHARING = Release("13.5", 130500, "13", "7", "5", "2")
"""A CUPTI with the multi-subscriber mode (13.5: the records of 13.4)."""
KINDS = {"api": (4, 5), "kernel": (3, 10), "memcpy": (1,), "memset": (2,), "sync": (38,), "external": (39,),
         "memcpy_peer": (22,)}


def record(dtype: np.dtype, **fields: Any) -> bytes:
    """One record's bytes, every other field zero."""
    value = np.zeros(1, dtype=dtype)
    for name, item in fields.items():
        value[name] = item
    return value.tobytes()


class FakeLibcupti:
    """The fake libcupti, loaded in this process, with its controls."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        lib = self.lib
        lib.fake_stage.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.fake_deliver_raw.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                                         ctypes.c_int]
        lib.fake_deliver_raw.restype = ctypes.c_long
        lib.fake_set_version.argtypes = [ctypes.c_uint32]
        lib.fake_set_record_size.argtypes = [ctypes.c_uint32, ctypes.c_size_t]
        lib.fake_add_dropped.argtypes = [ctypes.c_size_t]
        lib.fake_top_external_id.restype = ctypes.c_uint64
        for name in ("fake_registrations", "fake_flushes", "fake_dirty_buffers", "fake_refused_requests",
                     "fake_pushes", "fake_attribute_sets", "fake_timestamp_registrations", "fake_staged"):
            getattr(lib, name).restype = ctypes.c_long
        lib.fake_timestamp.restype = ctypes.c_uint64
        lib.fake_reset_attribute.argtypes = [ctypes.c_int]
        lib.fake_set_shared.argtypes = [ctypes.c_void_p]
        lib.fake_enabled_v2.argtypes = [ctypes.c_uint32]
        for name in ("fake_silenced_v2", "fake_refused_one_subscriber_calls"):
            getattr(lib, name).restype = ctypes.c_long
        lib.cuptiActivityFlushAll.argtypes = [ctypes.c_uint32]
        self.names: dict[str, ctypes.Array[ctypes.c_char]] = {}
        """Kernel names, kept alive: records point at them, as at CUPTI's own strings."""
        self.release(NEWEST)

    def release(self, release: Release) -> None:
        """Behave as ``release``: its version, and the sizes of the records it writes."""
        self.lib.fake_set_version(release.version)
        for family, kinds in KINDS.items():
            for kind in kinds:
                self.lib.fake_set_record_size(kind, release.dtype(family).itemsize)

    def name_pointer(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = ctypes.create_string_buffer(name.encode())
        return ctypes.addressof(self.names[name])

    def stage(self, data: bytes) -> None:
        assert self.lib.fake_stage(data, len(data)) == 0

    def flush(self, flag: int = 1) -> None:
        self.lib.cuptiActivityFlushAll(flag)

    def deliver(self, data: bytes, valid: int | None = None, threads: int = 1, buffers: int = 1) -> int:
        """``data`` as one buffer's contents, ``buffers`` times on each of ``threads`` threads;
        returns the buffer requests xsp refused."""
        return int(self.lib.fake_deliver_raw(data, len(data), len(data) if valid is None else valid, threads,
                                             buffers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, f"fake_{name}")


def assert_same_columns(got: Any, expected: Any) -> None:
    """Two :class:`~xsp.tracers.cuda.records.ActivityColumns` hold the same records, field for
    field (kernel names compared as text: each path numbers them its own way)."""
    from xsp.tracers.cuda.records import FIELDS, Family

    for family in Family:
        for name, dtype in FIELDS[family].items():
            left, right = got[family][name], expected[family][name]
            assert left.dtype == np.dtype(dtype), (family, name, left.dtype)
            if family is Family.KERNEL and name == "name":
                left = [got.kernel_names[i] for i in left]
                right = [expected.kernel_names[i] for i in right]
            assert list(left) == list(right), (family, name)
