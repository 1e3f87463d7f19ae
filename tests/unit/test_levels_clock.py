from __future__ import annotations

import itertools

import pytest

from xsp.core.clock import ClockSync, measure_offset_ns
from xsp.core.errors import UnknownLevelError
from xsp.core.levels import parse_levels
from xsp.core.schema import Level


@pytest.mark.parametrize("given", ["model,layer", ("model", "layer"), ["layer"], " Layer , model ",
                                   (Level.LAYER,), "layer"])
def test_levels_accept_strings_sequences_and_enums_and_always_include_model_and_input(given):
    assert parse_levels(given) == (Level.MODEL, Level.INPUT, Level.LAYER)


def test_levels_are_ordered_shallowest_first():
    assert parse_levels("operator,model,layer") == (Level.MODEL, Level.INPUT, Level.LAYER, Level.OPERATOR)


def test_the_kernel_level_brings_the_cuda_api_level_that_launches_kernels():
    assert parse_levels("kernel,model,operator") == (Level.MODEL, Level.INPUT, Level.OPERATOR, Level.CUDA_API,
                                                     Level.KERNEL)


def test_unknown_level_names_the_valid_ones():
    with pytest.raises(UnknownLevelError, match=r"unknown level 'layers' \(valid levels: model, input, layer"):
        parse_levels("model,layers")


def test_offset_keeps_the_tightest_bracket():
    # reference reads: brackets of width 10, 2, 6 around other-clock values 1000, 2000, 3000
    reference = iter([0, 10, 100, 102, 200, 206])
    other = iter([1000 + 5, 2000 + 101, 3000 + 203])
    offset, uncertainty = measure_offset_ns(lambda: next(other), lambda: next(reference), tries=3)
    assert offset == 2000 and uncertainty == 1


def test_clock_sync_maps_host_time_to_epoch():
    sync = ClockSync.measure()
    import time

    from xsp.core.clock import now_ns
    assert abs(now_ns() + sync.host_to_epoch_ns - time.time_ns()) < 50_000_000
    assert abs(sync.remeasured().drift_ns) < 50_000_000


def test_levels_rank_matches_depth():
    assert [level.rank for level in Level] == list(itertools.islice(itertools.count(), len(Level)))
    assert Level.MODEL.rank == 0 and Level.INPUT.rank == 1 and Level.FLOPS.rank == 5 and Level.SYSTEM.rank == 9
