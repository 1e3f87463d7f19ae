"""What recording one span costs, per level: measured here, now, to take it back out.

Profilers that time code from inside it (TAU, Score-P) compensate their own overhead: they
measure what one event costs and subtract it. xsp does the same for the levels it times on
the host. Each level's cost has two parts:

* ``inside_ns``: the part that falls inside the span it records (the hook work between the
  two clock readings), which lengthens that span;
* ``parent_ns``: everything one recorded span adds to its parent's duration (the inside part
  plus the work before the first and after the last clock reading).

A layer span also misses part of what its call costs untraced: the Python call into
``nn.Module.__call__`` and back lies outside its clock readings (``untimed_ns``, given back to
each layer figure; about 0.3 µs on this project's 2-core machine, 6% of a 5 µs layer,
measured against a loop of untraced module calls as ``nn.Sequential`` makes them).

Both are measured in a tight loop over a module (or operator) that does almost nothing, traced
and untraced, so they are the floor of what tracing costs: in a real model, colder caches
make each event somewhat dearer, and compensation leaves that part in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from xsp.core import schema as col
from xsp.core.schema import Level
from xsp.table.level_costs import LevelCost

CHILDREN = 32
"""Leaf modules under the calibration model: their costs are what the parent sees."""
CALLS = 200
"""Calls of the calibration model per measurement (CHILDREN times as many leaf calls)."""
REPEATS = 5
"""Measurements of each kind; the median is kept."""


class _Leaf(torch.nn.Module):
    """A layer doing one tiny operator: xsp's code then runs between PyTorch's, as in a real
    model, whose caches and branch predictors it disturbs (a leaf doing nothing hides that)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.neg(x)


class _Fan(torch.nn.Module):
    """A model whose forward calls ``CHILDREN`` leaf modules (or operators) in turn."""

    def __init__(self, operator: bool = False) -> None:
        super().__init__()
        self.leaves = torch.nn.ModuleList(_Leaf() for _ in range(CHILDREN))
        self.operator = operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.operator:
            for _ in range(CHILDREN):
                x = torch.neg(x)
            return x
        for leaf in self.leaves:
            x = leaf(x)
        return x


def _per_call_ns(function: Callable[[], Any], calls: int = CALLS) -> float:
    began = time.perf_counter_ns()
    for _ in range(calls):
        function()
    return (time.perf_counter_ns() - began) / calls


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _traced(levels: tuple[str, ...], function: Callable[[], Any]) -> tuple[float, Any]:
    """Per-call time of ``function`` under a session of ``levels``, and the session's trace."""
    from xsp.session.session import trace

    with trace(levels=levels, output=None, schedule=None) as session:
        per_call = _per_call_ns(function)
    return per_call, session.trace


def _durations_ns(found: Any, level: Level) -> list[float]:
    spans = found.spans if found is not None else None
    if spans is None:
        return []
    mine = spans[(spans[col.LEVEL] == level.value) & (spans[col.KIND] != col.SpanKind.PREDICT.value)]
    return mine[col.DURATION_NS].astype("float64").tolist()


def calibrate(levels: Sequence[Level], grad: bool = False) -> dict[Level, LevelCost]:
    """The cost of one span of each host-timed level among ``levels`` (model, layer, operator).

    With ``grad``, the calls are measured while autograd records a graph, as a model called
    without ``torch.no_grad`` runs: the layer level then also hooks each call's backward, which
    costs several times more than the call's own record.

    Runs in a fraction of a second per level, outside any session (it opens its own); the
    CUDA levels are not calibrated (their records come from the GPU's own buffers).
    """
    found: dict[Level, LevelCost] = {}
    x = torch.zeros(1, requires_grad=grad)  # so that every leaf's output has a graph node
    leaf = _Leaf()
    fan = _Fan()
    with torch.set_grad_enabled(grad):
        for _ in range(20):
            fan(x)
        # an untraced module call: what a span around it would measure without xsp
        call_ns = _median([_per_call_ns(lambda: leaf(x), CALLS * CHILDREN) for _ in range(REPEATS)])
        if Level.MODEL in levels:
            timings = [_traced(("model",), lambda: leaf(x)) for _ in range(REPEATS)]
            traced = _median([t for t, _ in timings])
            predicts = [d for _, trace in timings for d in _model_calls(trace)]
            found[Level.MODEL] = LevelCost(Level.MODEL.value, max(_median(predicts) - call_ns, 0.0) if predicts
                                           else 0.0, max(traced - call_ns, 0.0), len(predicts),
                                           nested_ns=_nested_pass_through_ns(fan, x))
        if Level.LAYER in levels:
            # what the parent pays per child untraced: a ModuleList loop's step and the call
            child_ns = _median([_per_call_ns(lambda: fan(x)) for _ in range(REPEATS)]) / CHILDREN
            found[Level.LAYER] = _nested_cost(Level.LAYER, lambda: fan(x), child_ns, untimed=True)
        if Level.OPERATOR in levels:
            ops = _Fan(operator=True)
            plain_op = _median([_per_call_ns(lambda: torch.neg(x), CALLS * CHILDREN) for _ in range(REPEATS)])
            found[Level.OPERATOR] = _nested_cost(Level.OPERATOR, lambda: ops(x), plain_op)
    return found


def _nested_pass_through_ns(fan: _Fan, x: torch.Tensor) -> float:
    """What the model level's wrapper costs each module call nested in a top-level one.

    Measured in pairs inside one model-level session: a call of ``fan`` (its children pass
    through the wrapper) right before a call of a twin whose children's class calls the original
    ``nn.Module.__call__`` (the same slot call, without the wrapper). Both are top-level calls
    and pay the same root cost, so the difference of each pair is the children's pass-through
    alone, and the median over pairs drops those a disturbance of the machine spoiled. (Runs
    of traced and untraced calls apart left a few hundred nanoseconds per child at the mercy
    of the machine's drift between them: 0 or several microseconds in one calibration of ten.)
    """
    from xsp.session.session import trace

    original = torch.nn.Module.__call__
    plain_leaf = type("_UnwrappedLeaf", (_Leaf,), {"__call__": original})
    twin = _Fan()
    for child in twin.leaves:
        child.__class__ = plain_leaf
    differences = []
    with trace(levels=("model",), output=None, schedule=None):
        for _ in range(CALLS * 2):
            began = time.perf_counter_ns()
            fan(x)
            between = time.perf_counter_ns()
            twin(x)
            differences.append(2 * between - began - time.perf_counter_ns())
    return max(_median(differences) / CHILDREN, 0.0)


ATTEMPTS = 3
"""Measurements of a nested level's cost taken at most, while the machine's noise drowns it."""


def _nested_cost(level: Level, work: Callable[[], Any], untraced_ns: float, untimed: bool = False) -> LevelCost:
    """The cost of ``level``'s spans around the ``CHILDREN`` calls inside ``work``: what each span
    measures beyond the untraced call (``untraced_ns``), and what it adds to the model call
    around them (the model-only run against the run with ``level`` too, per child). With
    ``untimed``, a span that measures less than the untraced call gives the shortfall back
    (``untimed_ns``). Every span costs something: a measurement that finds nothing was drowned
    by the machine's noise, and is taken again."""
    cost = _nested_cost_once(level, work, untraced_ns, untimed)
    for _ in range(ATTEMPTS - 1):
        if cost.parent_ns > 0:
            break
        cost = _nested_cost_once(level, work, untraced_ns, untimed)
    return cost


def _nested_cost_once(level: Level, work: Callable[[], Any], untraced_ns: float, untimed: bool) -> LevelCost:
    # interleaved, and the least disturbed of each kept: the difference is a few hundred
    # nanoseconds a call, which a drift of the machine between two batches of runs can hide
    model_only_runs, timings = [], []
    for _ in range(REPEATS):
        model_only_runs.append(_traced(("model",), work)[0])
        timings.append(_traced(("model", level.value), work))
    model_only = min(model_only_runs)
    traced = min(t for t, _ in timings)
    durations = [d for _, trace in timings for d in _durations_ns(trace, level)]
    beyond = _median(durations) - untraced_ns if durations else 0.0
    return LevelCost(level.value, max(beyond, 0.0), max((traced - model_only) / CHILDREN, 0.0), len(durations),
                     untimed_ns=max(-beyond, 0.0) if untimed else 0.0)


def _model_calls(found: Any) -> list[float]:
    if found is None:
        return []
    spans = found.spans
    return spans[spans[col.KIND] == col.SpanKind.PREDICT.value][col.DURATION_NS].astype("float64").tolist()
