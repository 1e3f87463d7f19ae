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


def test_the_paired_ratio_cancels_what_moves_a_whole_round(production):
    """A machine that slows by half for some rounds, both states alike: pooled percentiles are
    led by those rounds and their interval by how many a draw takes; each round's own ratio is
    not."""
    draw = random.Random(7)
    cpu = production.Cpu(total=0.0, xsp_threads=0.0, helpers=0.0)
    speeds = [1.0 if index % 4 else 1.5 for index in range(16)]

    def loads(cost: float) -> list:
        return [production.Load([int(1e6 * speed * cost * draw.gauss(4.0, 0.2)) for _ in range(300)], 1.0, cpu, 0,
                                index) for index, speed in enumerate(speeds)]

    plain, slower = loads(1.0), loads(1.03)  # 3% on every request
    mean, low, high = production.paired_ratio_interval(slower, plain, 0.5)
    assert 1.02 < low <= mean <= high < 1.04
    _, pooled_low, pooled_high = production.ratio_interval(slower, plain, 0.5)
    assert pooled_high - pooled_low > high - low
    same_mean, same_low, same_high = production.paired_ratio_interval(loads(1.0), plain, 0.5)
    assert same_low < 1.0 < same_high and 0.99 < same_mean < 1.01


def test_saved_latencies_read_back_as_the_tables_rounds(production, tmp_path, capsys):
    """steps_in_process.py --save keeps each load's latencies; --from prints the tables of several
    files' rounds together, each round's on still paired with its off."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import steps_in_process
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cpu = production.Cpu(total=0.0, xsp_threads=0.0, helpers=0.0)
    files = []
    for run, level in enumerate((4.0, 6.0)):  # two runs on machines of different speeds
        results = {(endpoint, state): [production.Load([int(1e6 * level * (1.05 if state == "on" else 1.0))] * 100,
                                                       1.0, cpu) for _ in range(3)]
                   for endpoint in production.ENDPOINTS for state in ("off", "on")}
        files.append(tmp_path / f"run{run}.json")
        steps_in_process.save_latencies(results, files[-1])
    assert steps_in_process.main(["--from", *map(str, files)]) == 0
    printed = capsys.readouterr().out
    assert "sync  on" in printed and "CPU" not in printed  # no CPU or throughput was kept
    paired = printed[printed.index("paired"):].splitlines()
    assert all("1.0500 [1.050,1.050]" in line for line in paired[1:])  # every round 5% slower, in both runs
    with pytest.raises(SystemExit):
        steps_in_process.main(["--from", str(tmp_path / "missing.json")])
