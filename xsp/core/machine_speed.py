"""How fast the machine of a run was: a fixed piece of work, timed once per process.

``xsp diff`` compares runs that CI may have made on different machines. A slower runner slows
every key of a run at once, and so does a uniform regression (a model moved to float64): the
two cannot be told apart from the traces themselves. So every session times the same small
work (a Python loop and a NumPy matrix product on one thread, in interleaved rounds of a few tries) as it starts
and again as it ends, and keeps the best times and how much the rounds and the two moments
disagreed in its metadata; the diff compares the
two runs' times, and only that evidence, not how many keys moved together, makes it say the
runners differ. It trusts it only where both runs' rounds agreed, and a correction may only
explain a change away, never make one (:func:`xsp.gate.comparison.compare_keys`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from functools import cache
from typing import Any, Final

METADATA_KEY: Final = "machine_speed"
PROBE_VERSION: Final = 2
"""Bumped when the work changes: times of different versions are never compared (2: the matrix
product on one thread, no longer BLAS's)."""
TRIES: Final = 3
ROUNDS: Final = 5
"""The probes are timed in rounds, each probe ``TRIES`` times a round (best of them), the
rounds interleaved: a burst of load on a busy runner slows a round or two, not the minimum."""
SAME_SPEED: Final = 0.05
"""Runs whose machines' times differ by less than this share ran on machines of one speed."""
STEADY: Final = 0.05
"""A run's rounds agree when their median is within this share of their best: else its machine
was too busy to time, and no correction is made from it."""


def _python_loop() -> int:
    total = 0
    for i in range(20_000):
        total += (i * i) % 7
    return total


def _matrix_product() -> float:
    import numpy as np

    # einsum's own loops, on this thread: a BLAS product of this size runs on every core's thread
    # of the BLAS pool, which then spins for a tenth of a second, on cores the program may need
    a = np.full((64, 64), 1.0001)
    for _ in range(10):
        a = np.einsum("ij,jk->ik", a, a, optimize=False) / 64.0
    return float(a[0, 0])


PROBES: Final[dict[str, Callable[[], object]]] = {"python_loop_ns": _python_loop, "matrix_product_ns": _matrix_product}


def _timed_ns(work: Callable[[], object]) -> int:
    best = math.inf
    for _ in range(TRIES):
        start = time.perf_counter_ns()
        work()
        best = min(best, time.perf_counter_ns() - start)
    return int(best)


def _probe() -> dict[str, Any]:
    """The best times of :data:`ROUNDS` interleaved rounds, and their ``spread``: how far the
    rounds' median lies above that best (the largest over the probes)."""
    for work in PROBES.values():
        work()  # warm: first-call costs are not the machine's speed
    rounds: dict[str, list[int]] = {name: [] for name in PROBES}
    for _ in range(ROUNDS):
        for name, work in PROBES.items():
            rounds[name].append(_timed_ns(work))
    measured: dict[str, Any] = {"version": PROBE_VERSION, **{name: min(times) for name, times in rounds.items()}}
    measured["spread"] = round(max(statistics.median(times) / min(times) - 1 for times in rounds.values()), 4)
    return measured


@cache
def measure() -> dict[str, Any]:
    """This process's machine times (ns) of each probe, measured on first use (~25 ms): a
    session takes them as it starts (see :func:`confirmed`)."""
    return _probe()


@cache
def confirmed() -> dict[str, Any]:
    """The times of :func:`measure` taken again, once per process (a session's end): the best of
    both, with a ``spread`` that also counts how far the two moments disagreed. A burst of load
    during one of them shows as a spread past :data:`STEADY`, not as a slower machine."""
    first, again = measure(), _probe()
    combined: dict[str, Any] = {"version": PROBE_VERSION}
    apart = 0.0
    for name in PROBES:
        low, high = sorted((first[name], again[name]))
        combined[name] = low
        apart = max(apart, high / low - 1 if low > 0 else 0.0)
    combined["spread"] = round(max(first["spread"], again["spread"], apart), 4)
    return combined


def machine_spread(times: dict[str, Any] | None) -> float:
    """How much a run's timing of the fixed work varied (``spread``; 0 where none was kept)."""
    spread = times.get("spread") if isinstance(times, dict) else None
    return float(spread) if isinstance(spread, (int, float)) and spread > 0 else 0.0


def steady(times: dict[str, Any] | None) -> bool:
    """Whether a run's machine times can be trusted: its rounds agreed (runs from before the
    rounds were kept have no ``spread`` and count as steady)."""
    return machine_spread(times) <= STEADY


def speed_ratio(base: dict[str, Any] | None, new: dict[str, Any] | None) -> float | None:
    """How much longer the new run's machine took for the same work than the base run's (the
    geometric mean over the probes both have; 1.25: the new machine is 25% slower), or None
    when a run has no such times (an older trace, an imported one)."""
    if not isinstance(base, dict) or not isinstance(new, dict) or base.get("version") != new.get("version"):
        return None
    ratios = [new[name] / base[name] for name in PROBES
              if isinstance(base.get(name), (int, float)) and isinstance(new.get(name), (int, float))
              and base[name] > 0 and new[name] > 0]
    if not ratios:
        return None
    return math.exp(sum(math.log(ratio) for ratio in ratios) / len(ratios))
