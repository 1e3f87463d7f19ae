"""benchmarks/production.py's intervals: two processes of one program differ (their memory
layouts) by as much as xsp's cost; an interval over rounds alone claimed a difference that was
only which processes ran."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def production():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import production
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return production


def loads_of(production, servers_ms: list[float], rounds: int, seed: int) -> list:
    """Each server's rounds: latencies around its own level (a process's layout), the same for every round."""
    draw = random.Random(seed)
    cpu = production.Cpu(total=0.0, xsp_threads=0.0, helpers=0.0)
    return [production.Load([int(1e6 * draw.gauss(level, 0.05 * level)) for _ in range(300)], 1.0, cpu, server, index)
            for index in range(rounds) for server, level in enumerate(servers_ms)]


def test_servers_that_differ_by_layout_widen_the_interval_to_cover_it(production):
    plain = loads_of(production, [4.00, 4.08, 3.96, 4.04], rounds=6, seed=1)
    twin = loads_of(production, [4.10, 3.94, 4.06, 3.98], rounds=6, seed=2)  # the same program, other processes
    pooled, low, high = production.ratio_interval_over_servers(twin, plain, 0.5)
    assert low < 1.0 < high and 0.99 < pooled < 1.01
    assert high - low > 0.02  # the servers' spread of about 2%, not only the rounds'
    _, rounds_low, rounds_high = production.ratio_interval(twin, plain, 0.5)
    assert rounds_high - rounds_low < high - low


def test_a_cost_larger_than_the_servers_spread_is_still_resolved(production):
    plain = loads_of(production, [4.00, 4.02, 3.98, 4.01], rounds=6, seed=3)
    slower = loads_of(production, [4.40, 4.42, 4.38, 4.41], rounds=6, seed=4)  # 10% on every server
    pooled, low, high = production.ratio_interval_over_servers(slower, plain, 0.5)
    assert 1.05 < low <= pooled <= high < 1.15


def test_one_server_a_variant_draws_rounds_only(production):
    plain = loads_of(production, [4.0], rounds=8, seed=5)
    other = loads_of(production, [4.2], rounds=8, seed=6)
    assert production.ratio_interval_over_servers(other, plain, 0.5)[1] > 1.02  # nothing to draw among servers
