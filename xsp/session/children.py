"""Child processes the program starts while a session runs, followed so that what they do is in
the session's trace: ``multiprocessing``'s ``Process``, the workers of a ``Pool``, of a
``ProcessPoolExecutor`` and of a DataLoader, started by fork, spawn or forkserver.

While a session runs, ``multiprocessing``'s ``Process.start`` gives each process a
:class:`ChildPlan`, which the process carries to the child: in memory after a fork, where the
plan begins once ``multiprocessing`` has set the process up (its after-fork hooks); pickled with
the process otherwise (spawn, forkserver), where it begins as it is unpickled, before the
process's function runs. Either way it begins:

* in a DataLoader worker, a :class:`FetchLog`: one record per batch the worker fetches (its
  samples' ``__getitem__`` and transforms, and the collate), appended to a file as the fetch
  ends, so that a worker ended with its epoch, or still running when the session ends, has
  handed over what it did. Module calls inside a worker (a transform that is an ``nn.Module``)
  are inside its fetch spans and not recorded apart: they are input work, and recorded as model
  calls they would count as the model's.
* in any other process, a session of its own with the session's levels, which writes its trace
  into the session's children folder when the process ends (its function returns or raises,
  it exits, or SIGTERM ends it, as ``Pool.terminate`` ends a pool's workers). It says nothing:
  its warnings are in its trace, and the session says them. Its session span is in the
  session's trace, below the session's span. It exports nothing (the session exports its spans at the
  end, ``OTEL_EXPORTER_OTLP_ENDPOINT`` in its environment notwithstanding), unless the session
  is always on and exports (a server's worker, serving for days): it then exports its own
  windows as they close, to the session's collector, but the last, which the session exports
  with its own (:data:`UNSENT_SUFFIX`); the session exports none of its other spans.

When the session ends, :meth:`Following.collect` adds each child's spans to the session's: with
their ``process_id``, below a ``process`` span of the child's (in the session's trace, below its
session span), the child's steps numbered after the session's own. Processes that handed
nothing over (still running, killed, or not followable) are counted, and said.
"""

from __future__ import annotations

import contextlib
import enum
import json
import multiprocessing
import multiprocessing.process
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np

from xsp.core import schema as col
from xsp.core.clock import now_ns
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level, SpanKind, Status
from xsp.core.threads import on_own_thread

try:
    from xsp.session._around import Around
except ImportError:  # not built (no C compiler): the same hooks, in Python
    Around = None  # type: ignore[assignment, misc]

FOLLOW_ENV: Final = "XSP_FOLLOW_CHILDREN"
"""Set to ``0`` to leave child processes alone (they are still counted, and said)."""
PLAN_ATTRIBUTE: Final = "xsp_plan"
"""The attribute of a ``Process`` that carries its plan to the child (removed once started)."""
FETCH_NAME: Final = "DataLoader.fetch"
FETCH_FIELDS: Final = 6
"""A fetch record: start and end (xsp's host clock), samples (-1: unknown), failed (0 or 1),
the worker's id and its thread's native id, as int64s."""
DATALOADER_WORKER_MODULE: Final = "torch.utils.data._utils.worker"
"""Where the function a DataLoader worker runs is defined."""
SPAWNED_RANK_MODULE: Final = "torch.multiprocessing.spawn"
"""Where the function a rank started by ``torch.multiprocessing.spawn`` runs is defined: such a
process is a rank of a distributed job, traced as ranks are (each its own file, see
docs/distributed.md), never followed; the operator-level note of the job says so."""


class ChildState(str, enum.Enum):
    """How far a child process got, as it tells the session (a file named so in the folder)."""

    BEGUN = "begun"
    """Its plan began, before the process's function: without ``RUNNING`` after it, that
    function never ran (the process ended as its session started: a pool's idle worker)."""
    RUNNING = "running"
    """Its session records: the process's function runs after this, never before."""
    FAILED = "failed"
    """Its session could not start (the file says why): the process ran untraced."""


UNSENT_SUFFIX: Final = ".unsent"
"""Beside a followed child's trace, when it exports its own windows: the span ids of its last
window, which it leaves to the session to send with its own last export (a child that sent it
itself as it ended was killed mid-send when its parent stopped it: uvicorn's master, on Ctrl-C)."""


def unsent_ids_path(trace_path: Path) -> Path:
    """Where a followed child that exports writes the span ids of its last window (see :data:`UNSENT_SUFFIX`)."""
    return trace_path.with_name(trace_path.name + UNSENT_SUFFIX)


class ChildExport(NamedTuple):
    """Where a child of an always-on session that exports sends its own windows: the session's
    collector, under the session's service name and span budget."""

    endpoint: str
    protocol: str
    service_name: str
    span_budget: int


@dataclass
class ChildPlan:
    """What a child process needs to follow its parent's session: where to write, what to record.

    ``arrival`` is how an unpickled plan (a spawned child) reaches the session's code, and
    ``starter`` how the child's session begins (both set by the session, never pickled)."""

    folder: str
    levels: tuple[str, ...]
    max_events: int
    backward: bool
    layer_depth: int | None
    parent_pid: int
    dataloader_worker: bool = False
    """The process is a DataLoader's worker (told in the parent, from the function it runs)."""
    sample: float | None = None
    """The parent's session is always on: the fraction of steps the child records deep (None: it
    is not, and the child records every step, unless ``XSP_SAMPLE`` says otherwise)."""
    slow_factor: float | None = None
    """With ``sample``: the parent's slow-step factor."""
    window_s: float | None = None
    """How often the parent's windows close (None: the child's default)."""
    export: ChildExport | None = None
    """With ``sample``: where the child exports its windows as they close (None: it exports nothing,
    and the parent exports its spans with its own at the end)."""
    below: tuple[str, int] | None = None
    """The (trace id, span id) of the parent's session span, which the child's hangs below."""
    starter: Callable[[ChildPlan], None] | None = field(default=None, compare=False)
    arrival: Callable[..., ChildPlan] | None = field(default=None, compare=False)

    @property
    def fields(self) -> tuple[str, tuple[str, ...], int, bool, int | None, int, bool, float | None, float | None,
                              float | None, ChildExport | None, tuple[str, int] | None]:
        return (self.folder, self.levels, self.max_events, self.backward, self.layer_depth, self.parent_pid,
                self.dataloader_worker, self.sample, self.slow_factor, self.window_s, self.export, self.below)

    def trace_path(self, pid: int) -> Path:
        """Where child ``pid`` writes its trace."""
        return Path(self.folder) / f"{pid}.xsp.parquet"

    def mark(self, pid: int, state: ChildState, text: str = "") -> None:
        """Child ``pid`` tells the session how far it got (read by :meth:`Following.collect`)."""
        with contextlib.suppress(OSError):
            self.mark_path(pid, state).write_text(text)

    def mark_path(self, pid: int, state: ChildState) -> Path:
        return Path(self.folder) / f"{pid}.{state.value}"

    def fetch_path(self, pid: int) -> Path:
        """Where DataLoader worker ``pid`` appends its fetch records."""
        return Path(self.folder) / f"{pid}.fetch"

    def __reduce__(self) -> tuple[Any, ...]:
        # unpickling calls the session's arrival, which imports the session in the child
        assert self.arrival is not None
        return (self.arrival, self.fields)


def begin_after_fork(plan: ChildPlan) -> None:
    """In a forked child, once ``multiprocessing`` has set its process up: begin if ``plan`` is
    this process's (a forked child runs the hooks of every plan alive at the fork)."""
    process = multiprocessing.current_process()
    if getattr(process, PLAN_ATTRIBUTE, None) is not plan:
        return
    with contextlib.suppress(AttributeError):
        delattr(process, PLAN_ATTRIBUTE)
    begin(plan)


def begin(plan: ChildPlan) -> None:
    """In the child: follow the session as ``plan`` says (called as a spawned child unpickles
    it, or by :func:`begin_after_fork`)."""
    global _followed_by
    if plan.parent_pid == os.getpid():
        return
    _followed_by = plan
    try:
        if not plan.dataloader_worker:
            plan.mark(os.getpid(), ChildState.BEGUN)
        if plan.dataloader_worker:
            FetchLog(plan.fetch_path(os.getpid())).install()
        elif plan.starter is not None:
            plan.starter(plan)
    except Exception as exc:  # the child runs on untraced; the session says why
        plan.mark(os.getpid(), ChildState.FAILED, f"{type(exc).__name__}: {exc}")


_followed_by: ChildPlan | None = None
"""In a followed child process: the plan it follows."""


def _is_dataloader_worker(process: multiprocessing.process.BaseProcess) -> bool:
    return _target_module(process) == DATALOADER_WORKER_MODULE


def _target_module(process: multiprocessing.process.BaseProcess) -> str | None:
    target = getattr(process, "_target", None)  # the function Process(target=...) runs
    return getattr(target, "__module__", None)


class FetchLog:
    """In a DataLoader worker: each batch's fetch, appended to ``path`` as it ends."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.thread_id = threading.get_native_id()
        self.worker_id = -1

    def install(self) -> None:
        """Time the fetcher of each epoch the worker makes (the worker's own process: never undone)."""
        from torch.utils.data import dataloader

        kinds = dataloader._DatasetKind
        make = kinds.create_fetcher

        def create_fetcher(*args: Any, **kwargs: Any) -> Any:
            fetcher = make(*args, **kwargs)
            with contextlib.suppress(Exception):
                fetcher.fetch = self.timed(fetcher.fetch)
            return fetcher

        kinds.create_fetcher = staticmethod(create_fetcher)  # type: ignore[method-assign]

    def timed(self, fetch: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fetch``, each call written as a record (no frame of xsp's in an error's traceback)."""
        return around(_fetch_start, fetch, self.fetched)

    def fetched(self, index: Any, start: int | None, failed: bool) -> None:
        if start is not None:
            self.write(start, now_ns(), index, int(failed))

    def write(self, start: int, end: int, index: Any, failed: int) -> None:
        try:
            if self.worker_id < 0:
                from torch.utils.data import get_worker_info

                info = get_worker_info()
                self.worker_id = -1 if info is None else int(info.id)
            samples = len(index) if hasattr(index, "__len__") else -1
            os.write(self.fd, np.array([start, end, samples, failed, self.worker_id, self.thread_id],
                                       dtype=np.int64).tobytes())
        except Exception:  # a lost record costs its span, never the batch
            pass


@dataclass
class ChildSpans:
    """What the followed children handed over, made the session's."""

    tables: list[pd.DataFrame]
    """Each child's spans, in the session's trace and steps."""
    processes: dict[str, dict[str, Any]]
    """By process id: its name, kind (``session``, ``dataloader_worker``), spans, and its trace's
    warnings and drops."""
    untraced: dict[str, str]
    """By process id (its name beside it): why nothing came of it."""
    dropped: Counter[str]
    """The children's drops, summed."""
    steps: int
    """Steps the children added."""
    ranks: list[int]
    """Ids of the processes ``torch.multiprocessing.spawn`` started: ranks, not followed."""
    workers_before: list[int]
    """Ids of the DataLoader workers the session's loops waited for that were started before it
    (``persistent_workers=True`` keeps an epoch's workers for the next): not followed."""
    samplings: list[dict[str, Any]] = field(default_factory=list)
    """Always on: each child's ``metadata["sampling"]`` (how its steps were recorded)."""
    forked_alone: int = 0
    """Processes the program forked with ``os.fork()`` itself: not followed."""
    to_send: list[pd.DataFrame] = field(default_factory=list)
    """Those of :attr:`tables` the session exports: the children that exported their own (an
    always-on session's, with a collector) are left out."""


class Following:
    """The child processes one session starts: their plan, and what they hand over.

    Args:
        plan: what each child is given (its folder is made here, and removed by :meth:`collect`).
        follow: False leaves children alone, only counting them (``XSP_FOLLOW_CHILDREN=0``).
    """

    def __init__(self, plan: ChildPlan, follow: bool = True) -> None:
        self.plan = plan
        self.follow = follow
        self.started: list[tuple[int, str, weakref.ref[Any], bool]] = []
        """Each process started while following: its id, name, (weakly) its object, and whether
        it carries a plan (its plan then begins before its function, in every start method)."""
        self.collected = False
        self.ranks: list[int] = []
        """Processes started by ``torch.multiprocessing.spawn``: ranks, not followed (see
        :data:`SPAWNED_RANK_MODULE`)."""
        self.forked_alone = 0
        """Processes the program forked with ``os.fork()`` itself (gunicorn's workers), not through
        ``multiprocessing``: not followed, as nothing starts their session."""

    def forked(self) -> None:
        """The program forked a process of its own (see :attr:`forked_alone`)."""
        self.forked_alone += 1

    @classmethod
    def open(cls, levels: tuple[Level, ...], max_events: int, backward: bool, layer_depth: int | None,
             starter: Callable[[ChildPlan], None], arrival: Callable[..., ChildPlan],
             sampling: tuple[float, float] | None = None, window_s: float | None = None,
             export: ChildExport | None = None, below: tuple[str, int] | None = None) -> Following:
        """Follow the processes started from now on (see the module docs); ``sampling``, an always-on
        session's (its sample fraction and slow-step factor), goes with them, and ``export``, an
        always-on session's collector, where the children send their own windows; ``window_s`` is
        how often the session's windows close, and ``below`` its session span's (trace id, span id)."""
        # a child's own children are followed in its parent's folder: when the child is killed, or
        # outlives its parent's session, the parent's removal of its folder leaves nothing behind
        inside = _followed_by.folder if _followed_by is not None and os.path.isdir(_followed_by.folder) else None
        folder = tempfile.mkdtemp(prefix="xsp-children-", dir=inside)
        sample, slow_factor = sampling if sampling is not None else (None, None)
        plan = ChildPlan(folder, tuple(level.value for level in levels), max_events, backward, layer_depth,
                         os.getpid(), sample=sample, slow_factor=slow_factor, window_s=window_s, export=export,
                         below=below, starter=starter, arrival=arrival)
        following = cls(plan, follow=os.environ.get(FOLLOW_ENV, "1") != "0")
        _PATCH.push(following)
        return following

    def plan_for(self, process: Any) -> ChildPlan | None:
        """Before ``process`` starts: the plan it carries to its child (None: not followed)."""
        if not self.follow:
            return None
        plan = ChildPlan(*self.plan.fields, starter=self.plan.starter, arrival=self.plan.arrival)
        plan.dataloader_worker = _is_dataloader_worker(process)
        try:
            setattr(process, PLAN_ATTRIBUTE, plan)
        except Exception:
            return None
        multiprocessing.util.register_after_fork(plan, begin_after_fork)  # a forked child's way in
        return plan

    def started_process(self, process: Any, plan: ChildPlan | None, rank: bool = False) -> None:
        """``process`` has started, carrying ``plan`` (None: not followed); ``rank``: one of a
        distributed job's ranks (:data:`SPAWNED_RANK_MODULE`)."""
        with contextlib.suppress(AttributeError):
            delattr(process, PLAN_ATTRIBUTE)
        if process.pid is not None and rank:
            self.ranks.append(int(process.pid))
        elif process.pid is not None:
            self.started.append((int(process.pid), str(process.name), weakref.ref(process), plan is not None))

    def alive(self) -> list[int]:
        """The ids of the processes it follows that are running now."""
        running = []
        for pid, _, ref, planned in list(self.started):
            process = ref()
            if planned and process is not None and process.is_alive():
                running.append(pid)
        return running

    def close(self) -> None:
        """Follow no process started from now on."""
        _PATCH.pop(self)

    def collect(self, host_to_epoch_ns: int, session_trace_id: str, session_span_id: int,
                steps_before: int, input_worker_pids: Collection[int] = ()) -> ChildSpans:
        """The children's spans as the session's (see the module docs); the folder is removed.
        ``input_worker_pids``: the DataLoader workers the session's loops waited for."""
        self.close()
        self.collected = True
        from xsp.io.loading import load

        tables: list[pd.DataFrame] = []
        to_send: list[pd.DataFrame] = []
        processes: dict[str, dict[str, Any]] = {}
        untraced: dict[str, str] = {}
        dropped: Counter[str] = Counter()
        samplings: list[dict[str, Any]] = []
        steps = steps_before
        for pid, name, ref, planned in self.started:
            key = str(pid)
            trace_path, fetch_path = self.plan.trace_path(pid), self.plan.fetch_path(pid)
            try:
                if trace_path.exists():
                    child = load(trace_path)
                    spans, added = _child_session_spans(child.spans, pid, name, session_trace_id, session_span_id,
                                                        steps)
                    steps += added
                    dropped.update(child.metadata.get("dropped") or {})
                    if child.metadata.get("sampling"):
                        samplings.append(child.metadata["sampling"])
                    own = child.metadata.get("child_processes") or {}
                    exported = child.metadata.get("export")
                    processes[key] = {"name": name, "kind": "session", "spans": len(spans),
                                      "warnings": list(child.metadata.get("warnings") or []),
                                      "dropped": dict(child.metadata.get("dropped") or {}),
                                      "untraced_children": dict(own.get("untraced") or {}),
                                      "export": exported}
                    for grandchild, facts in (own.get("followed") or {}).items():  # its own children, below it
                        processes.setdefault(grandchild, {**facts, "parent": pid})
                    tables.append(spans)
                    if not exported:
                        to_send.append(spans)
                    else:  # it sent its own windows but the last, which it left to the session
                        unsent = unsent_ids_path(trace_path)
                        if unsent.exists():
                            ids = np.fromfile(unsent, dtype=np.int64)
                            to_send.append(spans[spans[col.SPAN_ID].isin(ids).to_numpy(dtype=bool)])
                    continue
                if fetch_path.exists():
                    spans = _fetch_spans(fetch_path, pid, name, host_to_epoch_ns, session_trace_id, session_span_id)
                    processes[key] = {"name": name, "kind": "dataloader_worker", "spans": len(spans)}
                    if len(spans) > 1:  # a worker that fetched nothing has nothing to show
                        tables.append(spans)
                        to_send.append(spans)
                    continue
            except Exception as exc:  # one unreadable child costs its spans, said
                untraced[key] = f"{name}: its spans could not be read ({type(exc).__name__}: {exc})"
                continue
            why = self._why_nothing(pid, ref(), planned)
            if why is None:  # it ended before its function began: none of its code ran
                processes[key] = {"name": name, "kind": "session", "spans": 0,
                                  "note": "ended before its function began"}
            else:
                untraced[key] = f"{name}: {why}"
        shutil.rmtree(self.plan.folder, ignore_errors=True)
        started = {pid for pid, *_ in self.started}
        return ChildSpans(tables, processes, untraced, dropped, steps - steps_before, list(self.ranks),
                          sorted(set(input_worker_pids) - started), samplings, self.forked_alone, to_send)

    def _why_nothing(self, pid: int, process: Any, planned: bool) -> str | None:
        """Why child ``pid`` handed no spans over, or None when none of its code ever ran: it
        carried a plan, which begins before its function in every start method, and its session
        never got to record (it ended as it started: a pool's idle worker that terminate() ended)."""
        if not planned:
            return f"not followed ({FOLLOW_ENV}=0)" if not self.follow else "not followed (it took no plan)"
        failed = self.plan.mark_path(pid, ChildState.FAILED)
        if failed.exists():
            return f"its session could not start ({failed.read_text()})"
        if process is not None and process.is_alive():
            return "still running when the session ended"
        if not self.plan.mark_path(pid, ChildState.RUNNING).exists():
            return None
        code = None if process is None else process.exitcode
        return "ended without handing its spans over" + ("" if code is None else f" (exit code {code})")

    def discard(self) -> None:
        """Stop following and remove the folder (the session writes no trace)."""
        self.close()
        shutil.rmtree(self.plan.folder, ignore_errors=True)




def _child_session_spans(spans: pd.DataFrame, pid: int, name: str, session_trace_id: str, session_span_id: int,
                         steps_before: int) -> tuple[pd.DataFrame, int]:
    """A child's trace made part of the session's: its session span a ``process`` span below the
    session's, its spans tagged with its process id, its steps numbered from ``steps_before``."""
    from xsp.table.build import conform

    spans = spans.copy()
    kinds = np.array(spans[col.KIND].astype(object), dtype=object)
    own_session = (kinds == SpanKind.SESSION.value) & spans[col.PARENT_ID].isna().to_numpy()
    child_trace_ids = set(spans.loc[own_session, col.TRACE_ID].astype(str))
    kinds[own_session] = SpanKind.PROCESS.value
    spans[col.KIND] = kinds
    names = np.array(spans[col.NAME].astype(object), dtype=object)
    names[own_session] = name
    spans[col.NAME] = names
    parents = spans[col.PARENT_ID].astype("Int64").copy()
    parents[own_session] = session_span_id
    spans[col.PARENT_ID] = parents
    trace_ids = np.array(spans[col.TRACE_ID].astype(object), dtype=object)
    trace_ids[np.isin(trace_ids, list(child_trace_ids))] = session_trace_id
    spans[col.TRACE_ID] = trace_ids
    process_ids = spans[col.PROCESS_ID].astype("Int64") if col.PROCESS_ID in spans else pd.array(
        [pd.NA] * len(spans), dtype="Int64")
    spans[col.PROCESS_ID] = pd.array(process_ids, dtype="Int64").fillna(pid)
    step = spans[col.STEP].astype("Int64")
    added = int(step.max()) + 1 if step.notna().any() else 0
    spans[col.STEP] = step + steps_before
    return conform(spans), added


def _fetch_spans(path: Path, pid: int, name: str, host_to_epoch_ns: int, session_trace_id: str,
                 session_span_id: int) -> pd.DataFrame:
    """A DataLoader worker's fetch records as spans, below a ``process`` span of the worker."""
    from xsp.table.build import conform, new_span_ids

    data = np.fromfile(path, dtype=np.int64)
    rows = data[: len(data) // FETCH_FIELDS * FETCH_FIELDS].reshape(-1, FETCH_FIELDS)
    count = len(rows)
    ids = new_span_ids(count + 1)
    start, end = rows[:, 0] + host_to_epoch_ns, rows[:, 1] + host_to_epoch_ns
    worker = int(rows[0, 4]) if count else -1
    thread = int(rows[0, 5]) if count else 0
    label = name if worker < 0 else f"DataLoader worker {worker}"
    attributes = json.dumps({col.ATTR_INPUT_WORKER: worker})
    frame = pd.DataFrame({
        col.TRACE_ID: [session_trace_id] * (count + 1),
        col.SPAN_ID: ids,
        col.PARENT_ID: pd.array([session_span_id, *[int(ids[0])] * count], dtype="Int64"),
        col.LEVEL: [Level.MODEL.value] + [Level.INPUT.value] * count,
        col.KIND: [SpanKind.PROCESS.value] + [SpanKind.FETCH.value] * count,
        col.NAME: [label] + [FETCH_NAME] * count,
        col.START_NS: np.concatenate([[start.min() if count else 0], start]).astype(np.int64),
        col.END_NS: np.concatenate([[end.max() if count else 0], end]).astype(np.int64),
        col.THREAD_ID: pd.array([thread] * (count + 1), dtype="Int64"),
        col.STATUS: [Status.OK.value] + [Status.ERROR.value if failed else Status.OK.value for failed in rows[:, 3]],
        col.BATCH_SIZE: pd.array([None, *[None if n < 0 else int(n) for n in rows[:, 2]]], dtype="Int64"),
        col.PROCESS_ID: pd.array([pid] * (count + 1), dtype="Int64"),
        col.ATTRIBUTES: [attributes] * (count + 1),
    })
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    return conform(frame)


class _StartPatch:
    """``multiprocessing``'s ``Process.start`` while a session follows children (the innermost
    following session's plan goes with each process); put back when the last stops, unless
    something else replaced it meanwhile."""

    def __init__(self) -> None:
        self.followings: list[Following] = []
        self.installed: Callable[[Any], None] | None = None
        """The ``Process.start`` installed (around the one found), while some session follows."""
        self.lock = threading.Lock()
        self.starting = threading.local()
        """``on``: this thread is inside ``Process.start`` (its fork is ``multiprocessing``'s)."""

    def push(self, following: Following) -> None:
        with self.lock:
            self.followings.append(following)
            if self.installed is None:
                base = multiprocessing.process.BaseProcess
                self.installed = around(self.before_start, base.start, self.after_start)
                base.start = self.installed  # type: ignore[method-assign, assignment]

    def pop(self, following: Following) -> None:
        with self.lock:
            if following in self.followings:
                self.followings.remove(following)
            if not self.followings:
                self.put_back()

    def put_back(self) -> None:
        base = multiprocessing.process.BaseProcess
        installed, self.installed = self.installed, None
        if base.__dict__.get("start") is installed and installed is not None:
            base.start = wrapped(installed)  # type: ignore[method-assign, assignment]

    def before_start(self, process: Any) -> tuple[Following, ChildPlan | None, bool] | None:
        """As ``process`` starts: its plan, from the innermost following session."""
        following = self.followings[-1] if self.followings else None
        if following is None or process.pid is not None:  # started before: this start fails, as in a plain run
            return None
        self.starting.on = True
        rank = _target_module(process) == SPAWNED_RANK_MODULE  # known before start, which forgets its target
        return following, None if rank else following.plan_for(process), rank

    def after_start(self, process: Any, planned: tuple[Following, ChildPlan | None, bool] | None,
                    failed: bool) -> None:
        self.starting.on = False
        if planned is not None:
            following, plan, rank = planned
            following.started_process(process, plan, rank)

    def after_fork(self) -> None:
        """In a forked child: nothing of the parent's followings applies (its own session, if it
        follows, starts afresh)."""
        self.followings = []
        self.lock = threading.Lock()
        self.starting = threading.local()
        self.put_back()

    def forked_in_parent(self) -> None:
        """In the parent of a fork: one the program made with ``os.fork()`` itself (not a
        ``multiprocessing`` start, nor a helper process of xsp's) is counted by the innermost
        following session."""
        if self.followings and not getattr(self.starting, "on", False) and not on_own_thread():
            self.followings[-1].forked()


def followed_alive() -> list[int]:
    """The ids of the running processes this process's innermost following session follows
    (a server's workers, where it started them through ``multiprocessing``)."""
    followings = list(_PATCH.followings)
    return followings[-1].alive() if followings else []


def _fetch_start(index: Any) -> int:
    return now_ns()


def _around_in_python(before: Callable[[Any], Any], function: Callable[[Any], Any],
                      after: Callable[[Any, Any, bool], None]) -> Callable[[Any], Any]:
    """:class:`xsp.session._around.Around` where it is not built (its frame then shows in
    tracebacks that pass through it)."""

    def call(argument: Any) -> Any:
        token = None
        with contextlib.suppress(Exception):
            token = before(argument)
        failed = True
        try:
            result = function(argument)
            failed = False
            return result
        finally:
            with contextlib.suppress(Exception):
                after(argument, token, failed)

    call.__wrapped__ = function  # type: ignore[attr-defined]
    return call


def around(before: Callable[[Any], Any], function: Callable[[Any], Any],
           after: Callable[[Any, Any, bool], None]) -> Callable[[Any], Any]:
    """``function(x)`` between ``before(x) -> token`` and ``after(x, token, failed)``, whose
    errors are dropped; bound as a method when set on a class. In C where built: no frame of
    xsp's in the tracebacks of the user's errors that pass through it."""
    if Around is None:
        return _around_in_python(before, function, after)
    return Around(before, function, after)  # type: ignore[no-any-return]


def wrapped(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The function :func:`around` wrapped in ``call``."""
    if Around is not None and isinstance(call, Around):
        return call.function  # type: ignore[no-any-return]
    return call.__wrapped__  # type: ignore[attr-defined, no-any-return]


_PATCH = _StartPatch()
os.register_at_fork(after_in_child=_PATCH.after_fork, after_in_parent=_PATCH.forked_in_parent)
