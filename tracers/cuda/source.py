"""The process's one CUPTI client, shared by the ``cuda_api`` and ``kernel`` tracers.

CUPTI allows one subscriber per process, so both tracers go through :data:`SOURCE`, which
subscribes once, enables the activity kinds its users ask for and hands CUPTI its buffers.
cupti-python is the control plane (driver checks, kinds, flushes, the clock, callback-id
names); the records themselves are read in C where xsp's extension is built and knows the
CUPTI release (see :mod:`xsp.tracers.cuda.records`), through cupti-python otherwise.

* **Off the hot path.** CUPTI fills its buffers itself; the completed-buffer callback (on
  CUPTI's thread, or the flushing one) only queues the buffer. At each step end a background
  thread flushes the completed buffers; at session end everything is flushed (forced) after
  the device is synchronised. Records become columns when a window is collected.
* **Clock.** Where the C path can, CUPTI is handed xsp's host clock before any kind is
  enabled, so records need no conversion; otherwise CUPTI stamps records on its own time base
  (CLOCK_REALTIME on Linux), and the offset measured at each drain is interpolated (see
  :mod:`xsp.tracers.cuda.clock`).
* **Leaves CUPTI as found.** At the end the kinds are disabled first, then everything is
  flushed (forced), so no record is made after the last flush; every process-wide setting xsp
  changed (buffers handed out zeroed, the clock, the thread-id type, per-call switches) is set
  back, and the subscription released: nothing of xsp's stays attached to CUDA.
* **Linking.** While the source runs, the layer wrapper pushes an external correlation id
  (the layer call's start on the host clock) around every module call, from C on the C path.
  CUPTI reports which id was on top when each CUDA API call was made; the API call's
  ``external_id`` then names the layer span that made it, and the hierarchy builder uses it
  (see :mod:`xsp.table.parents`).
* **Never fatal.** Every CUPTI failure becomes a reason the tracer is unavailable, or a
  warning; ``cupti.finalize()`` is never called (it tears CUPTI down for everyone). What is
  lost on the way (records CUPTI dropped, unreadable records) is counted in the trace.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Final

from xsp.core.clock import now_ns
from xsp.core.threads import start_thread
from xsp.record.hotpath import PURE_PYTHON_ENV
from xsp.record.window import Window
from xsp.tracers.cuda.clock import ClockMode, CuptiClock, measure_cupti_offset
from xsp.tracers.cuda.graphs import CALLBACKS as GRAPH_CALLBACKS
from xsp.tracers.cuda.graphs import NODE_CREATED, RESOURCE_DOMAIN, SOURCE_NODE_VERSION, GraphNodeMarks
from xsp.tracers.cuda.records import (
    ACTIVITY_KINDS,
    API_KINDS,
    BUFFER_BYTES,
    EXTERNAL_KIND_CUSTOM0,
    ActivityColumns,
    Kind,
    Lost,
    NativeRecords,
    RecordStore,
    native_module,
)
from xsp.tracers.cuda.rows import RECORD_QUERIES_ENV, cupti_module, query_cbids, without_calls
from xsp.tracers.cuda.torch_profiler_watch import TorchProfilerWatch
from xsp.tracers.module_calls.call_context import Correlation

__all__ = ["ACTIVITY_KINDS", "API_KINDS", "SOURCE", "CuptiSource", "HeldElsewhere", "Kind", "StandDown",
           "measure_cupti_offset", "probe", "subscribe"]


def cupti_error_text(exc: BaseException) -> str:
    """``ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (...)`` for a cuptiError, else the message."""
    status = getattr(exc, "status", None)
    if status is not None:
        try:
            return f"{cupti_module().Result(status).name}: {exc}"
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"


def torch_profiler_active() -> bool:
    """True while PyTorch's profiler (Kineto) is recording in this process, other than the
    operator level's own CPU-only one (which leaves CUPTI alone)."""
    try:
        import torch

        from xsp.tracers.operator_profiler import own_profiler_active

        return bool(torch.autograd.profiler._is_profiler_enabled) and not own_profiler_active()
    except Exception:
        return False


_CONFLICT = ("another CUPTI client holds CUPTI and does not share it (PyTorch's profiler with CUDA "
             "activities, Nsight Systems or Compute, or another profiler); xsp's CUDA levels cannot record "
             "while it does, and PyTorch's profiler in CUDA mode cannot run inside them")

_HELD_BY_TORCH = f"PyTorch's profiler is recording in this process, and may hold CUPTI: {_CONFLICT}"


NOT_INSTALLED: Final = ('cupti-python is not installed: pip install "xsp[cuda12]" for a CUDA 12 PyTorch, '
                        '"xsp[cuda13]" for a CUDA 13 one (Linux x86_64/aarch64)')


def probe(load: Callable[[], Any] = cupti_module, holding: bool = False,
          share: Callable[[], bool] = lambda: False) -> str | None:
    """None when CUPTI can trace here, else why not (one line).

    Args:
        load: returns the ``cupti`` module (a seam for tests).
        holding: xsp already holds the subscription (so a test subscription would fail).
        share: whether xsp would ask to share CUPTI (asked only once the driver checks pass).
    """
    try:
        cupti = load()
    except ImportError:
        return NOT_INSTALLED
    except Exception as exc:
        return f"cupti-python cannot be imported: {type(exc).__name__}: {exc}"
    if torch_profiler_active():
        return _HELD_BY_TORCH
    try:
        cupti.get_timestamp()
    except RuntimeError as exc:  # cupti's NotSupportedError: no driver
        return f"no CUDA driver: {exc}"
    except Exception as exc:
        return f"CUPTI is not usable: {cupti_error_text(exc)}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device"
    except Exception as exc:
        return f"PyTorch cannot query CUDA: {exc}"
    if not holding:  # a subscription held elsewhere (Nsight, a profiler) shows here
        try:
            cupti.unsubscribe(subscribe(cupti, share=share())[0])
        except HeldElsewhere as exc:
            return str(exc)
        except Exception as exc:
            return f"{_CONFLICT} ({cupti_error_text(exc)})"
    return None


SUBSCRIBER_NAME: Final = b"xsp"
"""How xsp names itself to CUPTI (CUPTI shows ``CUPTI for xsp`` to a client it refuses)."""
_OLD_SUBSCRIBER_NAME_BYTES: Final = 64
"""``CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN``: room for the name of the client that holds CUPTI."""


class _SubscriberParams(ctypes.Structure):
    """``CUpti_SubscriberParams`` of ``cupti_callbacks.h`` (CUPTI 13.3 on), for ``cuptiSubscribe_v2``."""

    _fields_ = [("struct_size", ctypes.c_size_t), ("subscriber_name", ctypes.c_char_p),
                ("old_subscriber_name", ctypes.c_void_p), ("old_subscriber_size", ctypes.c_size_t),
                ("allow_multiple_subscribers", ctypes.c_uint8), ("padding", ctypes.c_uint8 * 7)]


class HeldElsewhere(RuntimeError):
    """Another CUPTI client holds the process's subscription (its name in the message where CUPTI
    said it)."""

    def __init__(self, holder: str | None, error: str) -> None:
        self.holder = holder
        named = f"CUPTI is held by {holder!r}: " if holder else ""
        super().__init__(f"{named}{_CONFLICT} ({error})")


def subscribe(cupti: Any, share: bool = False, callback: Callable[..., None] | None = None) -> tuple[Any, bool]:
    """Subscribe to CUPTI as ``xsp``: ``(handle, shared)``.

    Through ``cuptiSubscribe_v2`` where cupti-python binds it and this libcupti has it (13.3 on),
    so that a refusal names the client that holds CUPTI (Nsight Systems, another profiler); else
    through ``cuptiSubscribe``. ``share``: ask for CUPTI 13.5's multi-subscriber mode, in which
    clients that ask for it too subscribe beside xsp (only where xsp then makes every call in its
    ``_v2`` form); ``shared`` says whether CUPTI granted it. ``callback``: what CUPTI calls for
    the callbacks enabled on the subscription (None: none will be).

    Raises:
        HeldElsewhere: another client holds CUPTI alone.
        Exception: any other refusal, as cupti-python raised it.
    """
    subscribe_v2 = getattr(cupti, "subscribe_v2", None)
    if subscribe_v2 is not None:
        name = ""
        # plainly first: xsp never puts CUPTI into the multi-subscriber mode itself (a mode that may
        # outlast it); it shares only with a client that holds CUPTI in that mode already
        for allow in (False, True) if share else (False,):
            holder = ctypes.create_string_buffer(_OLD_SUBSCRIBER_NAME_BYTES)
            params = _SubscriberParams(struct_size=ctypes.sizeof(_SubscriberParams),
                                       subscriber_name=SUBSCRIBER_NAME, old_subscriber_name=ctypes.addressof(holder),
                                       old_subscriber_size=_OLD_SUBSCRIBER_NAME_BYTES,
                                       allow_multiple_subscribers=allow)
            try:
                return subscribe_v2(callback or _ignore_callback, None, ctypes.addressof(params)), allow
            except Exception as exc:
                if getattr(exc, "status", None) == _MULTIPLE_SUBSCRIBERS:
                    name = name or holder.value.decode("utf-8", "replace").strip()
                    if share and not allow:  # perhaps a client that shares: ask to share with it
                        continue
                    raise HeldElsewhere(name or None, cupti_error_text(exc)) from None
                if getattr(exc, "status", None) is not None:
                    raise
                break  # a libcupti older than 13.3 has no cuptiSubscribe_v2: cupti-python cannot find it
    try:
        return cupti.subscribe(callback or _ignore_callback, None), False
    except Exception as exc:
        if getattr(exc, "status", None) == _MULTIPLE_SUBSCRIBERS:
            raise HeldElsewhere(None, cupti_error_text(exc)) from None
        raise


COME_BACK_RETRY_NS: Final = 1_000_000_000
"""While xsp waits to take CUPTI back, how often a step end tries."""
_MULTIPLE_SUBSCRIBERS: Final = 39
"""``CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED``."""


# Which CUPTI ----------------------------------------------------------------------------------
def _major(release: str | None) -> int | None:
    try:
        return int(str(release).split(".")[0])
    except ValueError:
        return None


def cupti_python_release() -> str | None:
    """The installed cupti-python's version (``13.4.0``), or None."""
    try:
        return metadata.version("cupti-python")
    except metadata.PackageNotFoundError:
        return None


def torch_cuda_release() -> str | None:
    """The CUDA release PyTorch was built for (``12.8``), or None (a CPU build)."""
    try:
        import torch

        return torch.version.cuda  # type: ignore[no-any-return]
    except Exception:
        return None


def pairing_note(cupti_release: str | None = None, cuda_release: str | None = None) -> str | None:
    """One line when cupti-python drives the CUPTI of another CUDA major release than PyTorch's
    (pip pairs cupti-python 13 with a CUDA 12 PyTorch: it requires ``nvidia-cuda-cupti~=13``,
    beside PyTorch's ``nvidia-cuda-cupti-cu12``), else None."""
    cupti_release = cupti_release or cupti_python_release()
    cuda_release = cuda_release or torch_cuda_release()
    cupti_major, cuda_major = _major(cupti_release), _major(cuda_release)
    if cupti_major is None or cuda_major is None or cupti_major == cuda_major:
        return None
    return (f"cupti-python {cupti_release} drives CUPTI {cupti_major}, but PyTorch runs CUDA {cuda_release}: two "
            f"CUPTI libraries are loaded, and CUDA {cuda_major}'s calls may go unrecorded; install the bindings of "
            f"PyTorch's CUDA: pip install 'xsp[cuda{cuda_major}]'")


def record_path() -> tuple[str, str | None]:
    """``(path, why)``: how the CUDA levels would read records here, without subscribing:
    ``("C", None)``, ``("Python (cupti-python)", why not C)``, or ``("none", why not at all)``."""
    reason = probe(holding=True)
    if reason is not None:
        return "none", reason
    if os.environ.get(PURE_PYTHON_ENV):
        return "Python (cupti-python)", f"{PURE_PYTHON_ENV} is set"
    try:
        NativeRecords.bind_only(major=_major(cupti_python_release()))
    except OSError as exc:
        return "Python (cupti-python)", str(exc)
    return "C", None


# The shared source ---------------------------------------------------------------------------
class SharedControl:
    """cupti-python's control calls as xsp makes them while it shares CUPTI with other clients
    (13.5's multi-subscriber mode): those that act for one subscriber go through their ``_v2``
    forms, in xsp's C record path (cupti-python does not bind them); the rest (flushes, which are
    for every subscriber, the clock, the enums) are cupti-python's own."""

    get_thread_id_type = None
    """Not supported while CUPTI is shared: the thread-id type is each subscriber's own."""

    def __init__(self, cupti: Any, native: Any) -> None:
        self._cupti = cupti
        self._native = native

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cupti, name)

    def activity_enable(self, kind: int) -> None:
        self._native.enable_kind(int(kind), True)

    def activity_disable(self, kind: int) -> None:
        self._native.enable_kind(int(kind), False)

    def activity_enable_runtime_api(self, cbid: int, enable: int) -> None:
        self._native.enable_api(int(Kind.RUNTIME), int(cbid), bool(enable))

    def activity_enable_driver_api(self, cbid: int, enable: int) -> None:
        self._native.enable_api(int(Kind.DRIVER), int(cbid), bool(enable))

    def set_thread_id_type(self, kind: int) -> None:
        self._native.set_thread_id_type(int(kind))


@dataclass
class StandDown:
    """A time xsp let go of CUPTI for another client: no CUDA record of xsp's from ``from_ns``
    to ``to_ns`` (host clock; the metadata has them in epoch ns, as the spans)."""

    why: str
    from_ns: int
    host_to_epoch_ns: int = field(default_factory=lambda: time.time_ns() - now_ns())
    to_ns: int | None = None
    """When xsp took CUPTI back, or the session ended (None: still down)."""
    taken_back: bool = False
    """xsp took CUPTI back at ``to_ns`` (False: the session ended first, or CUPTI refused)."""
    other_stopped: bool = False
    """The other client has stopped: xsp tries to take CUPTI back at step ends until it can (a
    client may let go of CUPTI some time after it stops: Kineto finalizes on a later CUDA call)."""
    last_try_ns: int = 0
    could_not_come_back: str | None = None
    """Why CUPTI could not be taken back when the other client let go (None: it was, or the
    other client has not let go)."""

    def describe(self) -> str:
        """One line for the user."""
        head = (f"{self.why}: xsp's CUDA levels let go of CUPTI for it (it takes CUPTI for itself); "
                "their records until then are kept")
        if self.could_not_come_back is not None:
            return f"{head}, but they could not take CUPTI back when it stopped, and recorded nothing after: " \
                   f"{self.could_not_come_back}"
        return f"{head}, and they recorded again once it had stopped" if self.taken_back else head

    def metadata(self) -> dict[str, Any]:
        return {"why": self.why, "from_ns": self.from_ns + self.host_to_epoch_ns,
                "to_ns": None if self.to_ns is None else self.to_ns + self.host_to_epoch_ns,
                "taken_back": self.taken_back,
                **({"could_not_come_back": self.could_not_come_back} if self.could_not_come_back else {})}


@dataclass
class _Flusher:
    """Flushes CUPTI's completed buffers on its own thread when a step ends."""

    flush: Callable[[], None]
    wanted: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = start_thread(self._run, "xsp-cupti-flush")

    def request(self) -> None:
        self.wanted.set()

    def stop(self) -> None:
        self.stopping = True
        self.wanted.set()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            if self.stopping:
                return
            try:
                self.flush()
            except Exception:  # the final forced flush at stop still runs
                pass


class CuptiSource:
    """The one CUPTI subscription of the process, shared by the tracers that need it.

    Args:
        module: returns the ``cupti`` module (a seam for tests).
        library: the libcupti the C record path binds to; None finds the one loaded.
        native: read records in C where it can (False: always through cupti-python).
    """

    def __init__(self, module: Callable[[], Any] = cupti_module, library: str | None = None,
                 native: bool = True) -> None:
        self._module = module
        self._library = library
        self._use_native = native
        self._lock = threading.Lock()
        self._users: dict[str, tuple[Kind, ...]] = {}
        self._enabled: set[Kind] = set()
        self._subscriber: Any = None
        self._flusher: _Flusher | None = None
        self.store = RecordStore()
        self.native: NativeRecords | None = None
        """The C record path, while the subscription uses it."""
        self.python_path_reason: str | None = None
        """Why records are read through cupti-python in this subscription (None: they are not)."""
        self.releases: tuple[str | None, str | None] = (None, None)
        """cupti-python's release and PyTorch's CUDA release, read when the subscription opened."""
        self.pairing: str | None = None
        """Why the CUPTI cupti-python drives is not PyTorch's (None: it is), for the user."""
        self.record_queries = False
        """Record :data:`QUERY_CALLS` too (``XSP_CUDA_API_QUERIES=1`` when the subscription opened)."""
        self._left_out_by_cupti: dict[Kind, tuple[int, ...]] = {}
        self.left_out: frozenset[tuple[int, int]] = frozenset()
        """``(kind, cbid)`` of API calls to leave out here, where CUPTI could not leave them out itself."""
        self.left_out_count = 0
        self._carried = ActivityColumns()
        """Records drained with a window that belong to a later one."""
        self.clock = CuptiClock()
        """How this subscription's records are put on the host clock."""
        self.cupti_timestamp_offset_ns: int | None = None
        """With CUPTI on xsp's clock: what ``cupti.get_timestamp()`` read against it (expected ~0)."""
        self._thread_id_type_before: int | None = None
        self.opened_ns: int | None = None
        """When the subscription opened (host clock; a stand-down keeps it): no record of it can
        be much older."""
        self.warnings: list[str] = []
        self._watch = TorchProfilerWatch(self._torch_profiler_starting, self._torch_profiler_stopped)
        self._down: StandDown | None = None
        """Why and since when xsp has let go of CUPTI for another client, while it has."""
        self.stand_downs: list[StandDown] = []
        """Every time this subscription let go of CUPTI for another client (the last perhaps
        still open: ``to_ns`` None)."""
        self._listeners: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
        self._shared: SharedControl | None = None
        """The control calls for xsp's subscriber while it shares CUPTI (13.5's multi-subscriber
        mode); None while xsp is CUPTI's one subscriber."""
        self.shared_subscription = False
        """The subscription shared CUPTI with other clients (kept for the metadata)."""
        self._drain_lock = threading.Lock()
        """One reader of the C path's buffers at a time (a window's drain, or a shared
        subscription's close), and the hand-over of what the close read."""
        self.graph_nodes = GraphNodeMarks()
        """The CUDA graph nodes made or cloned while the subscription is open."""
        self.graph_nodes_reason: str | None = None
        """Why graph nodes are not followed (None: they are)."""
        self._drained_at_close: tuple[ActivityColumns, Counter[str]] | None = None
        """Records read as a shared subscription ended: CUPTI reads them for a subscriber that
        still exists, so they are read before it unsubscribes, and handed over at the next drain."""

    def listen(self, user: str, stood_down: Callable[[], None], came_back: Callable[[], None]) -> None:
        """Have ``user`` told when xsp lets go of CUPTI for another client (``stood_down``, on the
        thread that starts that client) and when it has taken CUPTI back (``came_back``); until
        ``user`` releases the source."""
        with self._lock:
            self._listeners[user] = (stood_down, came_back)

    @property
    def running(self) -> bool:
        """Subscribed for some user, and recording (not stood down for another client)."""
        return bool(self._users) and self._down is None

    def available(self) -> str | None:
        return probe(self._module, holding=self.running, share=self._can_share)

    def _can_share(self) -> bool:
        """The C path would run here on a libcupti that shares CUPTI (13.5): xsp then asks to."""
        return self._use_native and NativeRecords.can_share(self._library, _major(cupti_python_release()))

    def acquire(self, user: str, kinds: tuple[Kind, ...]) -> None:
        """Start (or widen) tracing for ``user``.

        Raises:
            RuntimeError: CUPTI refused; the message says why (another subscriber, no permission).
        """
        with self._lock:
            if not self._users:
                self.stand_downs = []
                with self._drain_lock:  # what an earlier subscription's failed start read is not this one's
                    self._drained_at_close = None
                self._open(self._module())
                self._watch.install()
            elif self._down is not None:  # its kinds are enabled when CUPTI is taken back
                self._users[user] = kinds
                return
            self._users[user] = kinds
            cupti = self._control()
            try:
                self._enable(cupti, kinds)
            except RuntimeError:
                if not self._enabled:
                    self._close(cupti)
                    self._users.pop(user, None)
                    self._watch.remove()
                raise

    def _enable(self, cupti: Any, kinds: tuple[Kind, ...]) -> None:
        for kind in (*kinds, Kind.EXTERNAL_CORRELATION):
            if kind not in self._enabled:
                try:
                    cupti.activity_enable(int(kind))
                except Exception as exc:
                    raise RuntimeError(f"CUPTI refused activity kind {kind.name}: "
                                       f"{cupti_error_text(exc)}") from None
                self._enabled.add(kind)
                if kind in API_KINDS and not self.record_queries:
                    self._leave_out_queries(cupti, kind)

    def _on_callback(self, userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
        """The subscription's callback: CUDA graph nodes made or cloned (the only ones enabled)."""
        self.graph_nodes.on_callback(self._module(), domain, cbid, cbdata)

    def _follow_graphs(self, cupti: Any) -> None:
        """Have CUPTI call back when a CUDA graph node is made or cloned (see
        :mod:`xsp.tracers.cuda.graphs`); where it cannot, replayed kernels keep only their launch."""
        self.graph_nodes_reason = None
        # from CUPTI 13.4 each replayed record names the captured node it came from: clones need no
        # callback (one that may come inside cudaGraphInstantiate, which PyTorch calls without the GIL)
        version = self.native.bound.get("version") if self.native is not None else None
        callbacks = GRAPH_CALLBACKS if version is None or version < SOURCE_NODE_VERSION else (NODE_CREATED,)
        try:
            for cbid in callbacks:
                cupti.enable_callback(1, self._subscriber, RESOURCE_DOMAIN, cbid)
        except Exception as exc:
            self.graph_nodes_reason = (f"CUDA graph nodes are not followed (replayed kernels keep their launch, not "
                                       f"the layers that made them): {cupti_error_text(exc)}")

    def _control(self) -> Any:
        """What xsp's control calls go to: cupti-python, or their ``_v2`` forms while CUPTI is shared."""
        return self._shared if self._shared is not None else self._module()

    def _open(self, cupti: Any, again: bool = False) -> None:
        """Subscribe and set CUPTI up (``again``: taking CUPTI back after a stand-down, when
        what the subscription has counted and left out so far still holds)."""
        if torch_profiler_active() and not again:
            raise RuntimeError(_HELD_BY_TORCH)
        if not again:
            self.opened_ns = now_ns()
            self.record_queries = os.environ.get(RECORD_QUERIES_ENV, "") not in ("", "0")
            # records made before a kind is disabled still arrive with the final flush: what this
            # subscription leaves out holds until the next one
            self.left_out, self.left_out_count = frozenset(), 0
        try:
            # one subscription, held for the session: it fails when another client holds CUPTI
            # alone; shared, beside other clients that share it too (CUPTI 13.5)
            self._subscriber, share = subscribe(cupti, share=self._can_share(), callback=self._on_callback)
        except HeldElsewhere:
            raise
        except Exception as exc:
            raise RuntimeError(f"{_CONFLICT} ({cupti_error_text(exc)})") from None
        self.shared_subscription = share
        control = cupti
        try:
            if share:
                NativeRecords.share(self._subscriber)
                control = self._shared = SharedControl(cupti, native_module())
            self._thread_id_type_before = _thread_id_type(control)
            control.set_thread_id_type(_SYSTEM_THREAD_IDS)  # thread ids as threading.get_native_id()
            self._register_buffers(cupti, again, shared=share)
            self._follow_graphs(cupti)
        except Exception as exc:
            self._give_back_settings(control)
            self._unsubscribe(control)
            raise RuntimeError(f"CUPTI could not be set up: {cupti_error_text(exc)}") from None
        self._start_clock(cupti, again)
        self._flusher = _Flusher(lambda: cupti.activity_flush_all(0))
        self._flusher.start()

    def _register_buffers(self, cupti: Any, again: bool = False, shared: bool = False) -> None:
        """Hand CUPTI xsp's C buffer callbacks, or, where the C path cannot run, cupti-python's
        (never both: the process has one pair, and the last registered receives every buffer).
        ``again``: after a stand-down, the same path registers its callbacks once more.
        ``shared``: CUPTI is shared, and only the C path's per-subscriber callbacks may be
        registered (cupti-python's are the process's one pair).

        Raises:
            RuntimeError: shared, and the C path could not start.
        """
        if again and self.native is not None:
            self.native.register_again()
            return
        if again and self.python_path_reason is not None:
            cupti.activity_register_callbacks(_buffer_requested, self._python_buffer_completed)
            return
        self.native, self.python_path_reason = None, None
        self.releases = (cupti_python_release(), torch_cuda_release())
        self.pairing = pairing_note(*self.releases)
        if self._use_native:
            try:
                self.native = NativeRecords.open(self._library, major=_major(self.releases[0]))
            except (OSError, RuntimeError) as exc:
                self.python_path_reason = str(exc)
        else:
            self.python_path_reason = "the C record path is switched off for this source"
        if self.native is None and shared:
            raise RuntimeError(f"the C record path could not start while CUPTI is shared: {self.python_path_reason}")
        if self.native is None:
            cupti.activity_register_callbacks(_buffer_requested, self._python_buffer_completed)

    def _python_buffer_completed(self, activities: Any) -> None:
        """cupti-python's buffer-completed callback: the records kept, and what CUPTI dropped
        since the last buffer counted (cupti-python hands over no context or stream: CUPTI's
        global queue's count, which is every buffer's since CUDA 12)."""
        self.store.on_completed(activities)
        self._count_python_drops()

    def _count_python_drops(self) -> None:
        dropped = ctypes.c_size_t(0)
        try:
            self._module().activity_get_num_dropped_records(0, 0, ctypes.addressof(dropped))
        except Exception:  # a cupti-python without it: CUPTI's drops go uncounted, as before
            return
        self.store.count_cupti_drops(int(dropped.value))

    def _start_clock(self, cupti: Any, again: bool = False) -> None:
        """Put CUPTI on xsp's host clock where the C path can (before any kind is enabled), else
        measure the first offset of CUPTI's own (``again``: after a stand-down, the clock so far
        goes on, for the records made before it)."""
        on_host_clock = self.native is not None and self.native.use_host_clock()
        if again and (self.clock.mode is ClockMode.HOST_CALLBACK) == on_host_clock:
            self._measure_clock()
            return
        self.cupti_timestamp_offset_ns = None
        if on_host_clock:
            self.clock = CuptiClock.constant(0, ClockMode.HOST_CALLBACK)
            try:  # a shared subscription's clock is its own: cuptiGetTimestamp reads CUPTI's default one
                if not self.shared_subscription:
                    self.cupti_timestamp_offset_ns = measure_cupti_offset(cupti.get_timestamp)[0]
            except Exception:
                pass
        else:
            self.clock = CuptiClock()
            self.clock.measure(cupti.get_timestamp)

    def _measure_clock(self) -> None:
        """One more offset measurement, where records are on CUPTI's own clock."""
        if self.clock.mode is ClockMode.INTERPOLATED:
            try:
                self.clock.measure(self._module().get_timestamp)
            except Exception:  # the measurements so far still hold
                pass

    @property
    def path_note(self) -> str | None:
        """One line for the user when records are read the slow way though the C path was wanted
        (None on the C path, or when the user chose Python: ``XSP_PURE_PYTHON``)."""
        if self.python_path_reason is None or not self._use_native or os.environ.get(PURE_PYTHON_ENV):
            return None
        return ("CUDA activity records are read through cupti-python, one Python object per record (many "
                f"times xsp's C path's cost, under the GIL): {self.python_path_reason}")

    def step_ended(self) -> None:
        """A step ended: flush CUPTI's completed buffers, on the flusher thread; while xsp waits to
        take CUPTI back from a client that has stopped, try again (at most once a second)."""
        if self._flusher is not None:
            self._flusher.request()
        down = self._down
        if down is not None and down.other_stopped and now_ns() - down.last_try_ns >= COME_BACK_RETRY_NS:
            self.come_back()

    def release(self, user: str) -> None:
        """Stop tracing for ``user``; the last one out flushes everything and unsubscribes."""
        with self._lock:
            kinds = self._users.pop(user, ())
            self._listeners.pop(user, None)
            if self._down is not None:  # CUPTI is another client's: nothing of xsp's is set
                if not self._users:
                    self._end_stand_down(now_ns())
                    self._watch.remove()
                return
            cupti = self._control()
            still_wanted = {kind for wanted in self._users.values() for kind in wanted}
            if self._users:
                still_wanted.add(Kind.EXTERNAL_CORRELATION)
            for kind in kinds:
                if kind in self._enabled and kind not in still_wanted:
                    self._disable(cupti, kind)
            if not self._users:
                self._close(cupti)
                self._watch.remove()

    # another client takes CUPTI ---------------------------------------------------------
    def _torch_profiler_starting(self) -> None:
        self.stand_down("PyTorch's profiler started with CUDA activities")

    def _torch_profiler_stopped(self) -> None:
        down = self._down
        if down is not None:
            down.other_stopped = True
        self.come_back()

    def stand_down(self, why: str) -> None:
        """Let go of CUPTI for another client (``why``: which), keeping every record made so far
        (flushed, read with the next window): kinds off, settings set back, unsubscribed, as at
        the end of a session. The users stay; :meth:`come_back` takes CUPTI back for them."""
        with self._lock:
            if not self._users or self._down is not None:
                return
            listeners = list(self._listeners.values())
        for stood_down, _ in listeners:  # layer calls stop pushing ids before CUPTI is let go
            stood_down()
        with self._lock:
            if not self._users or self._down is not None:
                return
            self._close(self._control())
            self._down = StandDown(why, now_ns())
            self.stand_downs.append(self._down)

    def come_back(self) -> None:
        """Take CUPTI back after a stand-down, for the users still here. Where CUPTI is still
        held, or refuses, xsp stays down, and the stand-down says why."""
        with self._lock:
            down = self._down
            if down is None:
                return
            down.last_try_ns = now_ns()
            try:
                self._open(self._module(), again=True)
                cupti = self._control()
                self._enable(cupti, tuple(dict.fromkeys(kind for kinds in self._users.values() for kind in kinds)))
            except Exception as exc:
                if self._subscriber is not None:
                    self._close(self._control())
                down.could_not_come_back = f"{exc}"
                return
            down.taken_back, down.could_not_come_back = True, None
            self._end_stand_down(now_ns())
            listeners = list(self._listeners.values())
        for _, came_back in listeners:
            came_back()

    def _end_stand_down(self, at_ns: int) -> None:
        if self._down is not None:
            self._down.to_ns = at_ns
            self._down = None

    def _close(self, cupti: Any) -> None:
        if self._flusher is not None:
            self._flusher.stop()
            self._flusher = None
        _synchronize_device()
        # Kineto's order: with every kind off, nothing (another thread, NCCL, a DataLoader) makes a
        # record after the forced flush, to surface in the next client's first buffer
        for kind in list(self._enabled):
            self._disable(cupti, kind)
        try:
            cupti.activity_flush_all(1)  # forced: incomplete records too
        except Exception as exc:
            self.warnings.append(f"CUPTI's final flush failed; records still in its buffers are lost: "
                                 f"{cupti_error_text(exc)}")
        self._measure_clock()
        if self.native is None:  # drops after the last completed buffer
            self._count_python_drops()
        else:
            self.native.count_drops()
        if self._shared is not None and self.native is not None:
            with self._drain_lock:  # after an earlier close's (a stand-down's), when not drained yet
                self._drained_at_close = self._after_drained_at_close(*self.native.drain())
        self._give_back_settings(cupti)
        self._unsubscribe(cupti)

    def _give_back_settings(self, cupti: Any) -> None:
        """Set back every process-wide CUPTI setting this subscription changed."""
        if self.native is not None:
            try:
                self.native.restore()
            except Exception as exc:
                self.warnings.append(f"CUPTI's settings could not all be set back: {exc}")
        if self._thread_id_type_before is not None and self._thread_id_type_before != _SYSTEM_THREAD_IDS:
            try:
                cupti.set_thread_id_type(self._thread_id_type_before)
            except Exception as exc:
                self.warnings.append(f"CUPTI's thread-id type could not be set back: {cupti_error_text(exc)}")
        self._thread_id_type_before = None

    def _disable(self, cupti: Any, kind: Kind) -> None:
        try:
            cupti.activity_disable(int(kind))
        except Exception as exc:
            self.warnings.append(f"CUPTI activity kind {kind.name} could not be disabled: {cupti_error_text(exc)}")
        self._enabled.discard(kind)
        left_out = self._left_out_by_cupti.pop(kind, ())
        if left_out:  # CUPTI keeps the setting for the process: give the next client its default back
            enable = _per_call_switch(cupti, kind)
            try:
                for cbid in left_out:
                    enable(cbid, 1)
            except Exception as exc:
                self.warnings.append(f"CUPTI's records of {kind.name.lower()} query calls could not be "
                                     f"switched back on: {cupti_error_text(exc)}")

    def _leave_out_queries(self, cupti: Any, kind: Kind) -> None:
        """Ask CUPTI to make no records of :data:`QUERY_CALLS`; where it cannot (a cupti-python
        without the per-call switch), they are left out when the records are drained."""
        cbids = query_cbids(cupti, kind)
        try:
            enable = _per_call_switch(cupti, kind)
            for done, cbid in enumerate(cbids):
                enable(cbid, 0)
                self._left_out_by_cupti[kind] = cbids[:done + 1]
        except Exception:
            self.left_out = self.left_out | {(int(kind), cbid) for cbid in cbids}

    def _unsubscribe(self, cupti: Any) -> None:
        if self._shared is not None:  # the C path's calls are the one-subscriber ones again, first:
            self._shared = None  # none is made for a subscriber that is gone
            try:
                NativeRecords.share(None)
            except Exception:
                pass
        if self._subscriber is not None:
            try:
                cupti.unsubscribe(self._subscriber)
            except Exception as exc:
                self.warnings.append(f"CUPTI unsubscribe failed: {cupti_error_text(exc)}")
            self._subscriber = None

    def drain(self) -> tuple[ActivityColumns, Counter[str]]:
        """Every record completed so far, as columns (what CUPTI could not leave out left out
        here), and the counts of what was lost."""
        native = self.native
        with self._drain_lock:
            drained = native.drain() if native is not None else self.store.drain()
            columns, lost = self._after_drained_at_close(*drained)
        columns, left_out = without_calls(columns, self.left_out)
        self.left_out_count += left_out
        if native is not None and not self.running:
            native.close()  # the subscription's last drain: its idle buffers are freed
        return columns, lost

    def _after_drained_at_close(self, columns: ActivityColumns, lost: Counter[str],
                                ) -> tuple[ActivityColumns, Counter[str]]:
        """``columns`` (and ``lost``) after the records read at a close and not handed over yet,
        which are handed over here (with :attr:`_drain_lock` held)."""
        if self._drained_at_close is None:
            return columns, lost
        (earlier, earlier_lost), self._drained_at_close = self._drained_at_close, None
        return earlier.then(columns), earlier_lost + lost

    def records_for(self, window: Window, flush: bool = False) -> ActivityColumns:
        """The records of one collection round: drained once (what was lost counted in the
        window), shared by every tracer of the round.

        Args:
            flush: first have CUPTI hand over every buffer it has completed, and wait for it (off
                the user's threads: the step-end flush runs on its own thread, and a window
                drained before it is done would leave its last step's records to the next one,
                away from the layers that made them).
        """
        if "cupti_records" not in window.derived:
            if flush and self.running:
                self._flush_completed()
            if self.running:
                self._measure_clock()
            columns, lost = self.drain()
            columns, bad_times = columns.without_bad_times(self.clock, self.opened_ns, now_ns())
            lost.update(bad_times)
            columns = self._carried.then(columns)
            if window.closed_ns is None:
                self._carried = ActivityColumns()
            else:
                columns, self._carried = columns.split(window.closed_ns, window.held_since_ns(), self.clock)
            window.derived["cupti_records"] = columns
            window.derived["cupti_graph_nodes"] = self.graph_nodes.take(
                window.closed_ns, None if window.closed_ns is None else window.held_since_ns())
            unreadable = self.graph_nodes.take_unreadable()
            if unreadable:
                lost[Lost.GRAPH_NODE_UNREADABLE.value] += unreadable
            window.dropped.update(lost)
        return window.derived["cupti_records"]  # type: ignore[no-any-return]

    def _flush_completed(self) -> None:
        try:
            self._module().activity_flush_all(0)
        except Exception:  # an optimisation: what is not flushed now comes with a later window
            pass

    def metadata(self) -> dict[str, Any]:
        details: dict[str, Any] = {**self.clock.metadata(),
                                   "query_calls": "recorded" if self.record_queries else "left out"}
        if self.cupti_timestamp_offset_ns is not None:
            details["cupti_get_timestamp_offset_ns"] = self.cupti_timestamp_offset_ns
        if self.left_out_count:
            details["query_calls_left_out"] = self.left_out_count
        if self.native is not None:
            details.update(self.native.metadata())
        else:
            details.update({"record_path": "Python (cupti-python)", "why_not_c": self.python_path_reason,
                            "records_dropped_by_cupti": 0, "buffers_with_records_dropped": 0,
                            "most_records_dropped_in_a_buffer": 0, **self.store.cupti_drops})
        details.update({"cupti_python": self.releases[0], "torch_cuda": self.releases[1],
                        "cupti_subscription": "shared with other clients (CUPTI's multi-subscriber mode)"
                        if self.shared_subscription else "xsp alone"})
        if self.pairing is not None:
            details["cupti_pairing"] = self.pairing
        details["graph_nodes"] = "followed" if self.graph_nodes_reason is None else self.graph_nodes_reason
        if self.stand_downs:
            details["cupti_stood_down"] = [down.metadata() for down in self.stand_downs]
        return details

    # external correlation around layer calls -------------------------------------------
    def correlation_hooks(self) -> Correlation:
        """The push and pop of external correlation ids, for the layer wrapper."""
        native = self.native
        if native is not None:
            return Correlation(native.module.push, native.module.pop, native.module.correlation)
        cupti = self._module()
        push, pop = cupti.activity_push_external_correlation_id, cupti.activity_pop_external_correlation_id
        kind = EXTERNAL_KIND_CUSTOM0
        failures = self.store.dropped

        # these run inside the user's module calls: a CUPTI error is counted, never raised
        def push_id(external_id: int) -> None:
            try:
                push(kind, external_id)
            except Exception:
                failures[Lost.CORRELATION.value] += 1

        def pop_id() -> None:
            try:
                pop(kind)
            except Exception:
                failures[Lost.CORRELATION.value] += 1

        return Correlation(push_id, pop_id)


def _per_call_switch(cupti: Any, kind: Kind) -> Callable[[int, int], Any]:
    """``cupti.activity_enable_runtime_api`` (or ``_driver_api``): records of one call on or off."""
    return cupti.activity_enable_runtime_api if kind == Kind.RUNTIME else cupti.activity_enable_driver_api  # type: ignore[no-any-return]


_SYSTEM_THREAD_IDS: Final = 1
"""``cupti.ActivityThreadIdType.SYSTEM``: records carry ``threading.get_native_id()``."""


def _thread_id_type(cupti: Any) -> int | None:
    """The process's thread-id type before xsp changes it (None: this cupti-python cannot say)."""
    read = getattr(cupti, "get_thread_id_type", None)
    if read is None:
        return None
    try:
        return int(read())
    except Exception:
        return None


def _buffer_requested() -> tuple[int, int]:
    """cupti-python's buffer request (the Python path): cupti-python allocates the buffer."""
    return BUFFER_BYTES, 0  # 0: as many records as fit


def _ignore_callback(*_: Any) -> None:
    """A test subscription's callback: none is enabled on it."""


def _synchronize_device() -> None:
    """Wait for the GPU so that every kernel launched has a record to flush."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    except Exception:
        pass


SOURCE = CuptiSource()
"""The process's one CUPTI client."""
