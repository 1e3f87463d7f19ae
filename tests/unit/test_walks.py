"""Pointer-jumping tree walks against the obvious step-by-step climb, on random forests."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xsp.core.schema import STEP_KINDS, Level, SpanKind
from xsp.table.paths import SKIPPING_LEVELS, anchors
from xsp.table.steps import outermost_step, root_of
from xsp.table.walks import chain_ends, depth_of, nearest_before, nearest_marked, text_matches, texts_at

LEVELS = [level.value for level in Level]
KINDS = [SpanKind.STEP.value, SpanKind.PREDICT.value, SpanKind.FORWARD.value, SpanKind.OPERATOR.value]


@st.composite
def forests(draw):
    """Parents (each row's parent is an earlier row, or -1), shuffled so order says nothing."""
    count = draw(st.integers(1, 60))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, count)]
    permutation = draw(st.permutations(range(count)))
    inverse = {old: new for new, old in enumerate(permutation)}
    shuffled = [-1] * count
    for old, parent in enumerate(parents):
        shuffled[inverse[old]] = -1 if parent < 0 else inverse[parent]
    levels = draw(st.lists(st.sampled_from(LEVELS), min_size=count, max_size=count))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=count, max_size=count))
    return np.array(shuffled, dtype=np.int64), np.array(levels, dtype=object), np.array(kinds, dtype=object)


def ancestors(parents, row):
    while parents[row] >= 0:
        row = parents[row]
        yield row


@settings(max_examples=200, deadline=None)
@given(forests())
@pytest.mark.heavy
def test_walks_match_a_step_by_step_climb(forest):
    parents, levels, kinds = forest
    count = len(parents)
    marked = np.array([kind == SpanKind.STEP.value for kind in kinds])
    is_step = np.isin(kinds, [kind.value for kind in STEP_KINDS])
    for row in range(count):
        chain = list(ancestors(parents, row))
        assert depth_of(parents)[row] == len(chain)
        assert root_of(parents)[row] == (chain[-1] if chain else row)
        assert chain_ends(parents)[row] == (chain[-1] if chain else row)
        nearest = next((a for a in chain if marked[a]), -1)
        assert nearest_marked(parents, marked)[row] == nearest
        assert nearest_marked(parents, marked, include_self=True)[row] == (row if marked[row] else nearest)
        steps = [a for a in [row, *chain] if is_step[a]]
        assert outermost_step(is_step, parents)[row] == (steps[-1] if steps else -1)
        expected_anchor = parents[row]
        if levels[row] in SKIPPING_LEVELS:
            expected_anchor = next((a for a in chain if levels[a] != levels[row]), -1)
        assert anchors(levels, parents)[row] == expected_anchor


def test_a_chain_twenty_thousand_deep_is_walked_in_logarithmic_passes():
    count = 20_000
    parents = np.arange(-1, count - 1, dtype=np.int64)
    levels = np.full(count, Level.OPERATOR.value, dtype=object)
    assert depth_of(parents)[-1] == count - 1
    assert (root_of(parents) == 0).all()
    assert (anchors(levels, parents) == -1).all()


def test_the_running_step_of_many_roots_is_the_latest_started_one_running_on_any_thread():
    """What a scan of every step a root gives (the latest start running then; of steps started
    together, the first in thread order), found without one: 28,000 steps of an import had
    85,000 roots on helper threads to place."""
    from xsp.table.steps import running_step_roots

    def scanned(step_roots: np.ndarray, starts: np.ndarray, ends: np.ndarray, at: int) -> int:
        running = step_roots[(starts[step_roots] <= at) & (ends[step_roots] >= at)]
        return -1 if not len(running) else int(running[np.argmax(starts[running])])

    rng = np.random.default_rng(7)
    for _ in range(300):
        count = int(rng.integers(1, 60))
        starts = rng.integers(0, 50, count)
        ends = starts + rng.integers(0, 30, count)
        roots = rng.choice(count, int(rng.integers(0, count + 1)), replace=False)
        roots = roots[np.lexsort((rng.integers(0, 3, len(roots)), starts[roots]))]  # by start, then thread
        at = rng.integers(-5, 90, 40)
        found = running_step_roots(roots, starts, ends, at)
        assert found.tolist() == [scanned(roots, starts, ends, int(t)) for t in at]
    # a long step still running behind shorter, later ones that ended
    starts, ends = np.array([0, 10, 20]), np.array([100, 15, 25])
    assert running_step_roots(np.arange(3), starts, ends, np.array([30, 12, 22, 101])).tolist() == [0, 1, 2, -1]


def _stack_walk(values: list[int], strict: bool) -> list[int]:
    found, stack = [], []
    for position, value in enumerate(values):
        while stack and (values[stack[-1]] <= value if strict else values[stack[-1]] < value):
            stack.pop()
        found.append(stack[-1] if stack else -1)
        stack.append(position)
    return found


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=200), st.booleans())
def test_the_nearest_earlier_position_at_least_as_large_is_the_stack_walks(values, strict):

    assert nearest_before(np.array(values, dtype=np.int64), strict).tolist() == _stack_walk(values, strict)


def test_a_long_run_of_falling_values_is_searched_past_not_walked_two_positions_a_round():
    """A CPU-only trace: 333,000 rounds of pointer jumping for two positions (2.4 s at 1M spans),
    now a direct search once the rounds run long and few positions are left."""

    falling = list(range(3000, 0, -1))
    values = [5000, *falling, 4000, 1, *falling, 6000, 2, 2]
    for strict in (False, True):
        assert nearest_before(np.array(values, dtype=np.int64), strict).tolist() == _stack_walk(values, strict)


@pytest.mark.parametrize("dtype", ["category", "string", "object"])
def test_texts_at_and_text_matches_read_each_row_as_its_text(dtype):
    texts = ["ncclKernel_AllReduce", None, "aten::mm", "MmBackward0", "ncclKernel_AllReduce", "c10d::allreduce_"]
    column = pd.Series(texts, dtype=dtype)
    positions = np.array([4, -1, 1, 0, 5], dtype=np.int64)
    assert texts_at(column, positions).tolist() == [texts[4], None, None, texts[0], texts[5]]
    assert text_matches(column, re.compile(r"nccl")).tolist() == [True, False, False, False, True, False]
    assert text_matches(column, re.compile(r"Backward\d*$"), anywhere=True).tolist() == [
        False, False, False, True, False, False]
    assert text_matches(column, re.compile(r"Backward")).tolist() == [False] * 6  # match: at the start only
