"""The operator level's recorder: a RecordFunction observer in C++ (``xsp/record/_operators/``).

PyTorch calls a global RecordFunction callback around every aten operator, autograd node and
``record_function`` annotation. xsp's observer writes one 48-byte record per call into a buffer
of the thread that ran it (its start and end on xsp's host clock, the thread's OS id, the name
and the inputs' shapes and dtypes as numbers of interned texts, the sequence number of its
autograd node): what PyTorch's profiler records too, without keeping every event as an object
until it stops. xsp takes the finished records a window at a time, so the operator level streams
like the layer level: bounded memory, and a file that ``xsp recover`` rebuilds after a kill.

The observer is C++ against the installed PyTorch's headers, which a wheel of xsp cannot ship
for every PyTorch. It is built on first use, with the C++ compiler that built xsp's C parts
(a few seconds), into a folder of the user's cache (``$XDG_CACHE_HOME/xsp``, else
``~/.cache/xsp``; ``XSP_CACHE_DIR`` overrides), once per PyTorch build and observer source.
Where it cannot be built (no compiler, no headers), the operator level falls back to PyTorch's
profiler, which holds every event until the session ends, and says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

SOURCE: Final = Path(__file__).resolve().parent / "_operators" / "observer.cpp"
ABI_VERSION: Final = 5
CACHE_VARIABLE: Final = "XSP_CACHE_DIR"
DISABLE_VARIABLE: Final = "XSP_OPERATOR_OBSERVER"
"""``XSP_OPERATOR_OBSERVER=0`` records the operator level with PyTorch's profiler instead."""
BUILD_TIMEOUT_S: Final = 300.0

RECORD: Final = np.dtype([("start_ns", "<i8"), ("end_ns", "<i8"), ("sequence_nr", "<i8"),
                          ("forward_thread", "<i8"), ("thread", "<i4"), ("name", "<i4"),
                          ("signature", "<i4"), ("flags", "<i4")])
"""One record, as observer.cpp lays it out (48 bytes)."""
USER_FLAG: Final = 1
"""``flags``: a user annotation (``torch.profiler.record_function``)."""
BACKWARD_FLAG: Final = 2
"""``flags``: a call of an autograd node (the backward pass)."""
TAKE_EVERYTHING: Final = -1


class ObserverUnavailable(Exception):
    """The observer cannot be built or loaded here (the message says why)."""


def cache_folder() -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xsp"


def _build_key(torch: Any) -> str:
    """What the built library depends on: the observer's source, PyTorch's build, the platform."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, str(Path(torch.__file__).resolve().parent), sys.platform,
                 sysconfig.get_platform(), str(torch.compiled_with_cxx11_abi())):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compiler() -> str:
    configured = os.environ.get("CXX")
    if configured:
        return configured
    found = sysconfig.get_config_var("CXX")
    return str(found).split()[0] if found else "c++"


def build(torch: Any) -> Path:
    """The observer's shared library for this PyTorch, built into the cache when missing.

    Raises:
        ObserverUnavailable: no compiler, no PyTorch headers, or the build failed.
    """
    from torch.utils import cpp_extension

    target = cache_folder() / f"operator-observer-{_build_key(torch)}" / "observer.so"
    if target.is_file():
        return target
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    if not any(Path(path, "ATen", "record_function.h").is_file() for path in cpp_extension.include_paths()):
        raise ObserverUnavailable("this PyTorch has no C++ headers (ATen/record_function.h)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ObserverUnavailable(f"cannot make the cache folder {target.parent}: {exc.strerror or exc}") from None
    abi = int(bool(torch.compiled_with_cxx11_abi()))
    with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as scratch:
        built = Path(scratch) / "observer.so"
        # NDEBUG as PyTorch's release builds have it: its headers' layouts depend on it
        command = [_compiler(), "-O2", "-shared", "-fPIC", "-std=c++17", "-w", "-DNDEBUG",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                   *includes, str(SOURCE), "-o", str(built), *(f"-L{path}" for path in libraries),
                   *(f"-Wl,-rpath,{path}" for path in libraries), "-lc10", "-ltorch_cpu"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ObserverUnavailable(f"the C++ compiler could not be run ({command[0]}: {exc})") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
            raise ObserverUnavailable(f"building it failed ({command[0]}: {last})")
        os.replace(built, target)  # atomic: a process building it too finds a whole file or none
    return target


@dataclass
class Taken:
    """Records taken for one window, and the texts they index."""

    records: np.ndarray
    """Of dtype :data:`RECORD`."""
    names: list[str]
    """Every name interned so far, by number."""
    shapes: list[str]
    """Every signature's shapes (``[[2, 8], [8]]``) so far, by number."""
    dtypes: list[str]
    """Every signature's dtypes (a JSON list of texts) so far, by number."""
    threads: dict[int, int]
    """PyTorch's thread ids -> OS thread ids, of every thread that recorded."""


class OperatorObserver:
    """The loaded observer: start, stop, and take the finished records of a window."""

    _lock = threading.Lock()

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        lib = library
        lib.xsp_ops_abi_version.restype = ctypes.c_int
        lib.xsp_ops_start.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.xsp_ops_start.restype = ctypes.c_int
        lib.xsp_ops_dropped.restype = ctypes.c_int64
        lib.xsp_ops_failed.restype = ctypes.c_int64
        lib.xsp_ops_recorded.restype = ctypes.c_int64
        lib.xsp_ops_take.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.xsp_ops_take.restype = ctypes.c_int64
        lib.xsp_ops_copy.argtypes = [ctypes.c_void_p]
        for name in ("xsp_ops_name", "xsp_ops_shapes", "xsp_ops_dtypes"):
            getattr(lib, name).argtypes = [ctypes.c_int32]
            getattr(lib, name).restype = ctypes.c_char_p
        lib.xsp_ops_name_count.restype = ctypes.c_int32
        lib.xsp_ops_signature_count.restype = ctypes.c_int32
        lib.xsp_ops_threads.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.xsp_ops_threads.restype = ctypes.c_int64
        lib.xsp_ops_now_ns.restype = ctypes.c_int64
        lib.xsp_ops_pause_thread.argtypes = [ctypes.c_int]
        lib.xsp_ops_pause_thread.restype = ctypes.c_int
        if lib.xsp_ops_abi_version() != ABI_VERSION:
            raise ObserverUnavailable("the observer built in the cache is of another version")
        self.names: list[str] = []
        self.shapes: list[str] = []
        self.dtypes: list[str] = []

    def pause_thread(self, pause: int) -> int:
        """Pause (1) or resume (0) the calling thread's records (PyTorch's RecordFunction callbacks
        of the thread: its operators then cost what they cost without xsp). Only what this paused
        is resumed. Returns 1 when the thread's state changed."""
        return int(self.library.xsp_ops_pause_thread(int(pause)))

    @property
    def pause_address(self) -> int:
        """The address of :meth:`pause_thread`'s C function (``int f(int)``), for xsp's C wrapper."""
        return int(ctypes.cast(self.library.xsp_ops_pause_thread, ctypes.c_void_p).value or 0)

    def start(self, shapes: bool, max_records: int) -> None:
        if self.library.xsp_ops_start(int(shapes), max_records) != 0:
            raise ObserverUnavailable("xsp's operator observer is recording for another session already")

    def stop(self) -> None:
        self.library.xsp_ops_stop()

    def recorded(self) -> int:
        """Records kept since :meth:`start`, taken or not."""
        return int(self.library.xsp_ops_recorded())

    def dropped(self) -> int:
        """Records not kept since the last call (past the session's ``max_events``)."""
        return int(self.library.xsp_ops_dropped())

    def failed(self) -> int:
        """Calls since the last call whose record could not be made (an error inside the observer)."""
        return int(self.library.xsp_ops_failed())

    def take(self, cut_ns: int = TAKE_EVERYTHING, held_since_ns: int = 2**62,
             held_threads_since_ns: Mapping[int, int] | None = None) -> Taken:
        """The finished records of a window ending at ``cut_ns`` (every record with the default):
        those that ended by then, of any thread none that started at or after ``held_since_ns``,
        and of each thread in ``held_threads_since_ns`` none that started at or after its time
        there (``Window.held_since_ns``: the window left that thread's records since then for
        later)."""
        threads = sorted((held_threads_since_ns or {}).items())
        held = np.array([thread for thread, _ in threads], dtype=np.int32)
        held_from = np.array([since_ns for _, since_ns in threads], dtype=np.int64)
        with self._lock:
            count = self.library.xsp_ops_take(cut_ns, held_since_ns, held.ctypes.data if threads else None,
                                              held_from.ctypes.data if threads else None, len(threads))
            records = np.empty(count, dtype=RECORD)
            self.library.xsp_ops_copy(records.ctypes.data if count else None)
            self._new_texts()
            return Taken(records, list(self.names), list(self.shapes), list(self.dtypes), self._threads())

    def _new_texts(self) -> None:
        lib = self.library
        for number in range(len(self.names), lib.xsp_ops_name_count()):
            self.names.append((lib.xsp_ops_name(number) or b"").decode("utf-8", "replace"))
        for number in range(len(self.shapes), lib.xsp_ops_signature_count()):
            self.shapes.append((lib.xsp_ops_shapes(number) or b"[]").decode("utf-8", "replace"))
            self.dtypes.append((lib.xsp_ops_dtypes(number) or b"[]").decode("utf-8", "replace"))

    def _threads(self) -> dict[int, int]:
        room = 64
        while True:
            native = np.empty(room, dtype=np.int32)
            torch_ids = np.empty(room, dtype=np.uint64)
            count = int(self.library.xsp_ops_threads(native.ctypes.data, torch_ids.ctypes.data, room))
            if count <= room:
                return {int(t): int(n) for t, n in zip(torch_ids[:count].tolist(), native[:count].tolist())}
            room = count

    def now_ns(self) -> int:
        """The observer's clock (CLOCK_MONOTONIC, xsp's host clock)."""
        return int(self.library.xsp_ops_now_ns())


_loaded: OperatorObserver | None = None
_failure: str | None = None


def observer() -> OperatorObserver:
    """The observer of this process, built and loaded on first use.

    Raises:
        ObserverUnavailable: it cannot be here (the message says why; said once, then the same).
    """
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if os.environ.get(DISABLE_VARIABLE, "1").strip() == "0":
        raise ObserverUnavailable(f"{DISABLE_VARIABLE}=0")
    if _failure is not None:
        raise ObserverUnavailable(_failure)
    try:
        import torch

        library = ctypes.CDLL(str(build(torch)), mode=ctypes.RTLD_GLOBAL)
        _loaded = OperatorObserver(library)
    except ObserverUnavailable as exc:
        _failure = str(exc)
        raise
    except (OSError, AttributeError) as exc:
        _failure = f"it could not be loaded ({exc})"
        raise ObserverUnavailable(_failure) from None
    return _loaded
