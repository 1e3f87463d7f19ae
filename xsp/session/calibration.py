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
from contextlib import AbstractContextManager
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

SessionOpener = Callable[[tuple[str, ...]], AbstractContextManager[Any]]
"""Opens a session of the given levels that writes no file and follows no schedule (a
:class:`xsp.session.session.Session`), whose ``trace`` holds what it recorded once it has ended.
Calibration is handed one by the session that calibrates, which it measures the cost of."""


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


def _per_call_ns(function: Callable[[], Any], group: int = 1) -> float:
    """One call's time: the median over ``CALLS`` groups of ``group`` calls each (a mean over
    all of them moved by 50% with the bursts of a busy machine; the median of groups stays
    within a few percent)."""
    times = []
    for _ in range(CALLS):
        began = time.perf_counter_ns()
        for _ in range(group):
            function()
        times.append(time.perf_counter_ns() - began)
    return _median(times) / group


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _traced(open_session: SessionOpener, levels: tuple[str, ...], function: Callable[[], Any],
            group: int = 1) -> tuple[float, Any]:
    """Per-call time of ``function`` under a session of ``levels`` (:func:`_per_call_ns`), and
    the session's trace."""
    with open_session(levels) as session:
        per_call = _per_call_ns(function, group)
    return per_call, session.trace


def _durations_ns(found: Any, level: Level) -> list[float]:
    spans = found.spans if found is not None else None
    if spans is None:
        return []
    mine = spans[(spans[col.LEVEL] == level.value) & (spans[col.KIND] != col.SpanKind.PREDICT.value)]
    return mine[col.DURATION_NS].astype("float64").tolist()


def calibrate(levels: Sequence[Level], open_session: SessionOpener, grad: bool = False) -> dict[Level, LevelCost]:
    """The cost of one span of each host-timed level among ``levels`` (model, layer, operator).

    With ``grad``, the calls are measured while autograd records a graph, as a model called
    without ``torch.no_grad`` runs: the layer level then also hooks each call's backward, which
    costs several times more than the call's own record.

    Runs in a fraction of a second per level, outside any session (it opens its own with
    ``open_session``); the CUDA levels are not calibrated (their records come from the GPU's own buffers).
    """
    found: dict[Level, LevelCost] = {}
    x = torch.zeros(1, requires_grad=grad)  # so that every leaf's output has a graph node
    leaf = _Leaf()
    fan = _Fan()
    with torch.set_grad_enabled(grad):
        for _ in range(20):
            fan(x)
        if Level.MODEL in levels:
            nested_ns = _nested_pass_through_ns(open_session, fan, x)
            found[Level.MODEL] = _model_cost(open_session, leaf, x, nested_ns)
        if Level.LAYER in levels:
            found[Level.LAYER] = _layer_cost(open_session, fan, x)
        if Level.OPERATOR in levels:
            ops = _Fan(operator=True)
            found[Level.OPERATOR] = _nested_cost(open_session, Level.OPERATOR, lambda: ops(x),
                                                 lambda: _per_call_ns(lambda: torch.neg(x), CHILDREN))
    return found


def _model_cost(open_session: SessionOpener, leaf: _Leaf, x: torch.Tensor, nested_ns: float) -> LevelCost:
    """What one model-level span costs, measured in pairs inside model-level sessions: a
    top-level call of ``leaf`` (recorded) right before a call of a twin whose class calls the
    original ``nn.Module.__call__`` (not recorded). The median of each pair's difference is what
    the span adds to the caller; the median span duration beyond the twin's median call is the
    part inside the span. (Traced and untraced calls timed in separate runs came out equal, a
    cost of 0, on a CI machine whose speed moved between the runs.)"""
    twin = type("_UnwrappedLeaf", (_Leaf,), {"__call__": torch.nn.Module.__call__})()
    differences: list[int] = []
    plain: list[int] = []
    predicts: list[float] = []
    for _ in range(REPEATS):
        with open_session(("model",)) as session:
            paired, untraced = _paired_calls(leaf, twin, x, CALLS)
        differences.extend(paired)
        plain.extend(untraced)
        predicts.extend(_model_calls(session.trace))
    inside = _median(predicts) - _median(plain) if predicts else 0.0
    return LevelCost(Level.MODEL.value, max(inside, 0.0), max(_median(differences), 0.0), len(predicts),
                     nested_ns=nested_ns)


def _nested_pass_through_ns(open_session: SessionOpener, fan: _Fan, x: torch.Tensor) -> float:
    """What the model level's wrapper costs each module call nested in a top-level one.

    Measured in pairs inside one model-level session: a call of ``fan`` (its children pass
    through the wrapper) right before a call of a twin whose children's class calls the original
    ``nn.Module.__call__`` (the same slot call, without the wrapper). Both are top-level calls
    and pay the same root cost, so the difference of each pair is the children's pass-through
    alone, and the median over pairs drops those a disturbance of the machine spoiled. (Runs
    of traced and untraced calls apart left a few hundred nanoseconds per child at the mercy
    of the machine's drift between them: 0 or several microseconds in one calibration of ten.)
    """
    with open_session(("model",)):
        differences, _ = _paired_calls(fan, _unwrapped_twin(), x, CALLS * 2)
    return max(_median(differences) / CHILDREN, 0.0)


def _paired_calls(fan: torch.nn.Module, twin: torch.nn.Module, x: torch.Tensor,
                  pairs: int) -> tuple[list[int], list[int]]:
    """``pairs`` calls of ``fan``, each right before a call of ``twin``: per pair, how much longer
    the fan's call took than the twin's, and the twin's call."""
    differences, plain = [], []
    for _ in range(pairs):
        began = time.perf_counter_ns()
        fan(x)
        between = time.perf_counter_ns()
        twin(x)
        ended = time.perf_counter_ns()
        differences.append(2 * between - began - ended)
        plain.append(ended - between)
    return differences, plain


def _unwrapped_twin() -> _Fan:
    """A :class:`_Fan` whose children's class calls the original ``nn.Module.__call__``: while a
    session records, its children run as they would untraced, and only the twin itself is
    recorded (a top-level call, as is the fan it is compared with)."""
    plain_leaf = type("_UnwrappedLeaf", (_Leaf,), {"__call__": torch.nn.Module.__call__})
    twin = _Fan()
    for child in twin.leaves:
        child.__class__ = plain_leaf
    return twin


LAYER_SESSIONS = 8
"""Short sessions the layer cost is measured in; the one in which the machine ran fastest is kept."""


def _layer_cost(open_session: SessionOpener, fan: _Fan, x: torch.Tensor) -> LevelCost:
    """What one layer span costs, measured in pairs inside a model+layer session: a call of
    ``fan`` (each child recorded as a layer) right before a call of its :func:`_unwrapped_twin`
    (the same children, untraced). The median of each pair's difference, per child, is what a
    recorded layer adds to its parent; the twin's call, per child, is what a layer call costs
    its caller untraced (the loop's step and the call), which the layer spans' median duration
    exceeds by ``inside_ns`` or falls short of by ``untimed_ns``.

    Untraced and traced calls measured in separate batches moved with the machine's speed,
    which jumps by up to 2x for tens of milliseconds: in eight calibrations at one steady model
    speed, the untimed part of a layer call came out anywhere between 0 and 1.2 µs. Paired,
    they still came out 1.8x dearer in a calibration the machine ran slow throughout; of
    :data:`LAYER_SESSIONS` short sessions, the one whose untraced calls ran fastest is kept
    (:attr:`LevelCost.fastest` says so), and a leveled experiment scales it to its own speed."""
    twin = _unwrapped_twin()
    found = []
    for _ in range(LAYER_SESSIONS):
        with open_session(("model", "layer")) as session:
            differences, plain = _paired_calls(fan, twin, x, CALLS // 4)
        durations = _durations_ns(session.trace, Level.LAYER)
        if durations:
            found.append((_median(plain) / CHILDREN, _median(differences) / CHILDREN, durations))
    if not found:
        return LevelCost(Level.LAYER.value, 0.0, 0.0, 0)
    plain_ns, added, durations = min(found, key=lambda session: session[0])
    beyond = _median(durations) - plain_ns
    return LevelCost(Level.LAYER.value, max(beyond, 0.0), max(added, 0.0), sum(len(f[2]) for f in found),
                     untimed_ns=max(-beyond, 0.0), fastest=True)


ATTEMPTS = 3
"""Measurements of a nested level's cost taken at most, while the machine's noise drowns it."""


def _nested_cost(open_session: SessionOpener, level: Level, work: Callable[[], Any],
                 untraced_ns: Callable[[], float]) -> LevelCost:
    """The cost of ``level``'s spans around the ``CHILDREN`` calls inside ``work``: what each span
    measures beyond the untraced call (``untraced_ns`` measures one, untraced), and what it adds
    to the model call around them (the model-only run against the run with ``level`` too, per
    child). Every span costs something: a measurement that finds nothing was drowned by the
    machine's noise, and is taken again."""
    cost = _nested_cost_once(open_session, level, work, untraced_ns)
    for _ in range(ATTEMPTS - 1):
        if cost.parent_ns > 0:
            break
        cost = _nested_cost_once(open_session, level, work, untraced_ns)
    return cost


def _nested_cost_once(open_session: SessionOpener, level: Level, work: Callable[[], Any],
                      untraced_ns: Callable[[], float]) -> LevelCost:
    # in adjacent triples (untraced call, model-only run, run with the level), each difference
    # taken within its triple and the median of the triples kept: the differences are a few
    # hundred nanoseconds a call, and this machine's speed jumps by up to 2x for tens of
    # milliseconds; measured in separate batches, the untimed part of one layer call came out
    # anywhere between 0 and 1.2 µs in eight calibrations at one steady model speed
    beyond, added, events = [], [], 0
    for _ in range(REPEATS):
        plain = untraced_ns()
        model_only = _traced(open_session, ("model",), work)[0]
        traced, found = _traced(open_session, ("model", level.value), work)
        durations = _durations_ns(found, level)
        events += len(durations)
        if durations:
            beyond.append(_median(durations) - plain)
        added.append((traced - model_only) / CHILDREN)
    over = _median(beyond) if beyond else 0.0
    return LevelCost(level.value, max(over, 0.0), max(_median(added), 0.0), events)


def _model_calls(found: Any) -> list[float]:
    if found is None:
        return []
    spans = found.spans
    return spans[spans[col.KIND] == col.SpanKind.PREDICT.value][col.DURATION_NS].astype("float64").tolist()
