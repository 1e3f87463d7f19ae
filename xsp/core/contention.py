"""How long the program's threads waited for a CPU while a session ran, as the kernel counts it.

A busy CI runner slows a run by taking its CPUs away: its threads are ready to run and wait in
the kernel's run queue. Linux counts that wait per thread (``/proc/self/task/*/schedstat``:
time on a CPU, time waiting for one). A session reads both as it starts and as it ends and
keeps the difference in its metadata (``contention``); ``xsp diff`` compares two runs' shares
of waiting, which is evidence of a loaded machine measured over the whole run, not in a probe
of a few milliseconds. Elsewhere (no ``/proc``) nothing is kept and nothing is corrected.
"""

from __future__ import annotations

import glob
import math
import statistics
from typing import Any, Final

METADATA_KEY: Final = "contention"
TASKS: Final = "/proc/self/task/*/schedstat"


def thread_times_ns() -> tuple[int, int] | None:
    """The process's threads' time on a CPU and time waiting for one (ns, summed over the
    threads alive now), or None where the kernel does not say."""
    on_cpu = waited = 0
    found = False
    for path in glob.glob(TASKS):
        try:
            with open(path) as handle:
                fields = handle.read().split()
            on_cpu += int(fields[0])
            waited += int(fields[1])
            found = True
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return (on_cpu, waited) if found else None


def since(start: tuple[int, int] | None) -> dict[str, Any] | None:
    """What the threads did since ``start`` (:func:`thread_times_ns` then): ``on_cpu_ns``,
    ``waited_ns`` and ``waited_share`` (of the time they were ready to run, the share spent
    waiting for a CPU), or None."""
    end = thread_times_ns()
    if start is None or end is None:
        return None
    on_cpu, waited = max(end[0] - start[0], 0), max(end[1] - start[1], 0)
    ready = on_cpu + waited
    return {"on_cpu_ns": on_cpu, "waited_ns": waited, "waited_share": round(waited / ready, 4) if ready else 0.0}


def waited_share(contention: dict[str, Any] | None) -> float | None:
    """A run's share of ready time spent waiting for a CPU (None where it was not kept)."""
    share = contention.get("waited_share") if isinstance(contention, dict) else None
    return float(share) if isinstance(share, (int, float)) and 0 <= share < 1 else None


def contention_ratio(base: dict[str, Any] | None, new: dict[str, Any] | None) -> float | None:
    """How much longer the new run's CPU work took for waiting on busier CPUs than the base's
    (1.25: 25% longer), or None where a run did not keep it. A run that waited a share ``w`` of
    its ready time ran its work ``1 / (1 - w)`` times as long as on an idle machine."""
    base_share, new_share = waited_share(base), waited_share(new)
    if base_share is None or new_share is None:
        return None
    return (1 - base_share) / (1 - new_share)


def pooled(contentions: list[Any]) -> dict[str, Any] | None:
    """Several runs' contention: the median share (None unless every run kept one)."""
    shares = [waited_share(item) for item in contentions]
    known = [share for share in shares if share is not None]
    if not shares or len(known) < len(shares):
        return None
    return {"waited_share": round(statistics.median(known), 4)}


WAIT_EXPLAINS_SHARE: Final = 0.05
"""A run whose threads waited for a CPU this share of their ready time or more (a loaded machine)
may have lost a preemption's wait inside any one key of a step (see :func:`wait_per_step_ns`)."""


PREEMPTION_FACTOR: Final = 1.5
"""A preempted key loses its wait for a CPU and then refills the caches the other process evicted:
on a loaded 2-core machine keys moved by up to 1.1x their run's mean wait per step
(benchmarks/results/diff_loaded.md); changes within this multiple of it are not judged from one
run a side."""


def wait_per_step_ns(contention: dict[str, Any] | None, steps: object, step_ns: float | None = None) -> float:
    """The time a run's threads waited for a CPU, per step (0.0 where the run waited less than
    :data:`WAIT_EXPLAINS_SHARE` of its ready time, or where it was not kept). ``step_ns``: a
    step's mean time, where known: a step that took it waited the run's share of it, at most
    (the kernel's count covers the whole run, its start-up too: divided among few short steps it
    came to 3.7 ms a step of 64 µs, and left a 66x regression unjudged).

    On a loaded machine the scheduler takes the CPU away for a timeslice of another process at a
    time, and a program whose steps take a steady time can meet that preemption at the same point
    of every step: one key then lasts a timeslice longer in every step of that process, which a
    test over the steps of one run takes for a certain change. A key that changed by less than
    its slower run's wait per step cannot be told from that from one run a side.
    """
    share = waited_share(contention)
    waited = contention.get("waited_ns") if isinstance(contention, dict) else None
    if share is None or share < WAIT_EXPLAINS_SHARE or not isinstance(waited, (int, float)):
        return 0.0
    if not isinstance(steps, (int, float)) or steps < 1:
        return 0.0
    spread = float(waited) / float(steps)
    return spread if step_ns is None or not step_ns > 0 else min(spread, share * step_ns)


def is_noticeable(ratio: float | None, same: float) -> bool:
    """Whether ``ratio`` differs from 1 by at least the share ``same``."""
    return ratio is not None and abs(math.log(ratio)) >= math.log1p(same)
