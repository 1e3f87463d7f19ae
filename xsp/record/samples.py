"""System samples and garbage collections: the records of the ``system`` level, and each step's
averages of the samples.

The system level's sampler thread (:mod:`xsp.tracers.system`) reads counters a few times a
second and records, for each source, one interval ``(source, device, start_ns, end_ns,
metrics, energy_method)``: the CPU share the process and the host used during it, memory in
use at its end, and on NVIDIA GPUs utilisation, memory, power, SM clock and the energy used.
Each becomes a ``sample`` span of the system level, its metrics in ``attributes`` under
``xsp.system.<metric>``.

The level also records each garbage collection of CPython's collector (:class:`GcPause`, from
``gc.callbacks``): which generation, how long, what it freed, on which thread. Every Python thread
waits while one runs (the collector holds the GIL), so a collection inside a request is part of
that request's latency, and a full one (generation 2) walks every object the program keeps. Each
becomes a ``gc`` span of the system level on the thread that ran it.

A step overlaps some of the samples' intervals: :func:`step_averages` gives each step the time-weighted
averages of every metric over it, and the energy it used, with how that energy was obtained
(:class:`EnergyMethod`); :mod:`xsp.table.step_samples` writes them on the step roots of a built
window.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Final, NamedTuple

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd


class SampleSource(str, enum.Enum):
    """What a sample describes."""

    PROCESS = "process"
    """The profiled process (psutil)."""
    HOST = "host"
    """The whole machine: all CPUs, host memory, the CPU packages' energy (RAPL)."""
    GPU = "gpu"
    """One NVIDIA GPU (NVML), ``device_id`` its index among the devices the process sees."""


class SystemMetric(str, enum.Enum):
    """A sampled quantity; its unit is in its name and in :data:`UNITS`."""

    CPU_PERCENT = "cpu_percent"
    """Process: percent of one CPU (200 = two CPUs busy, as ``top`` shows). Host: percent of all CPUs."""
    RSS_BYTES = "rss_bytes"
    MEMORY_USED_BYTES = "memory_used_bytes"
    UTILIZATION_PERCENT = "utilization_percent"
    """GPU: percent of the interval in which a kernel was running (NVML's definition)."""
    POWER_W = "power_w"
    SM_CLOCK_MHZ = "sm_clock_mhz"
    ENERGY_J = "energy_j"
    """Energy used during the interval."""


UNITS: Final[dict[SystemMetric, str]] = {
    SystemMetric.CPU_PERCENT: "%", SystemMetric.RSS_BYTES: "B", SystemMetric.MEMORY_USED_BYTES: "B",
    SystemMetric.UTILIZATION_PERCENT: "%", SystemMetric.POWER_W: "W", SystemMetric.SM_CLOCK_MHZ: "MHz",
    SystemMetric.ENERGY_J: "J",
}


class EnergyMethod(str, enum.Enum):
    """How an energy figure was obtained."""

    COUNTER = "counter"
    """The difference of a hardware energy counter (NVML's total energy, Volta and later; RAPL)."""
    POLLED = "polled"
    """Power readings integrated over time (GPUs without an energy counter)."""
    ESTIMATED = "estimated"
    """A step shorter than the sampling interval: its share, by time, of the energy measured
    over the intervals it falls in."""
    UNAVAILABLE = "unavailable"
    """Nothing here measures it (RAPL unreadable, no NVML)."""


SAMPLE_ATTRIBUTE_PREFIX: Final = "xsp.system."
ATTR_ENERGY_METHOD: Final = "xsp.system.energy_method"
STEP_ATTRIBUTE_PREFIX: Final = "xsp.system."
"""A step's averages: ``xsp.system.<source>.<metric>`` (``gpu0`` for GPU 0), and
``xsp.system.<source>.energy_method``."""
AVERAGED: Final = tuple(metric for metric in SystemMetric if metric is not SystemMetric.ENERGY_J)


class Sample(NamedTuple):
    """One sampled interval of one source, as the sampler records it."""

    source: str
    device_id: int | None
    start_ns: int
    end_ns: int
    metrics: dict[str, float]
    energy_method: str


class GcPause(NamedTuple):
    """One garbage collection, as the system level records it (``gc.callbacks``' start and stop)."""

    thread_id: int
    """The native id of the thread that ran it (the one whose allocation set it off)."""
    start_ns: int
    end_ns: int
    generation: int
    collected: int
    uncollectable: int


GC_NAME: Final = "gc generation {generation}"
"""The name of a ``gc`` span."""


def gc_rows(pauses: list[GcPause]) -> pd.DataFrame:
    """``gc`` spans (system level) from recorded collections, times on the host clock, each on the
    thread that ran it: the tree puts it under the span it interrupted there (a layer, an
    operator, a request's model call), though every Python thread waited for it."""
    if not pauses:
        return pd.DataFrame()
    return pd.DataFrame({
        col.LEVEL: col.Level.SYSTEM.value,
        col.KIND: col.SpanKind.GC.value,
        col.NAME: [GC_NAME.format(generation=p.generation) for p in pauses],
        col.START_NS: np.array([p.start_ns for p in pauses], dtype=np.int64),
        col.END_NS: np.array([p.end_ns for p in pauses], dtype=np.int64),
        col.THREAD_ID: pd.array([p.thread_id for p in pauses], dtype="Int64"),
        col.ATTRIBUTES: [json.dumps({col.ATTR_GC_GENERATION: p.generation, col.ATTR_GC_COLLECTED: p.collected,
                                     col.ATTR_GC_UNCOLLECTABLE: p.uncollectable}) for p in pauses],
    })


def is_sample(spans: pd.DataFrame) -> np.ndarray:
    """Per row of ``spans``: whether it is a system sample, an interval of metrics (the system
    level's spans but its garbage collections): a counter's values, not a slice of a thread."""
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    kinds = spans[col.KIND].to_numpy(dtype=object) if col.KIND in spans else np.full(len(spans), None)
    return np.asarray((levels == col.Level.SYSTEM.value) & (kinds != col.SpanKind.GC.value), dtype=bool)


def sample_rows(samples: list[Sample]) -> pd.DataFrame:
    """``sample`` spans (system level) from recorded samples, times on the host clock."""
    if not samples:
        return pd.DataFrame()
    return pd.DataFrame({
        col.LEVEL: col.Level.SYSTEM.value,
        col.KIND: col.SpanKind.SAMPLE.value,
        col.NAME: [s.source for s in samples],
        col.START_NS: np.array([s.start_ns for s in samples], dtype=np.int64),
        col.END_NS: np.array([s.end_ns for s in samples], dtype=np.int64),
        col.DEVICE_ID: pd.array([s.device_id for s in samples], dtype="Int64"),
        col.ATTRIBUTES: [json.dumps({**{SAMPLE_ATTRIBUTE_PREFIX + k: v for k, v in s.metrics.items()},
                                     ATTR_ENERGY_METHOD: s.energy_method}) for s in samples],
    })


def sample_table(spans: pd.DataFrame) -> pd.DataFrame:
    """The system samples of a span table, one row per sample and metric: ``start_ns``,
    ``end_ns``, ``source``, ``device`` (``gpu0``; the source for the others), ``metric``,
    ``value``, ``energy_method``."""
    columns = ["start_ns", "end_ns", "source", "device", "metric", "value", "energy_method"]
    samples = spans[(spans[col.LEVEL] == col.Level.SYSTEM.value) & (spans[col.KIND] == col.SpanKind.SAMPLE.value)]
    if samples.empty:
        return pd.DataFrame(columns=columns)
    rows: list[tuple[Any, ...]] = []
    devices = samples[col.DEVICE_ID].astype("Int64").tolist()
    for start, end, source, device, text in zip(samples[col.START_NS].tolist(), samples[col.END_NS].tolist(),
                                                samples[col.NAME].tolist(), devices,
                                                samples[col.ATTRIBUTES].tolist()):
        values = json.loads(text) if isinstance(text, str) else {}
        method = values.pop(ATTR_ENERGY_METHOD, EnergyMethod.UNAVAILABLE.value)
        name = f"{source}{device}" if device is not None and device is not pd.NA else str(source)
        for key, value in values.items():
            if key.startswith(SAMPLE_ATTRIBUTE_PREFIX) and value is not None:
                rows.append((start, end, source, name, key[len(SAMPLE_ATTRIBUTE_PREFIX):], float(value), method))
    return pd.DataFrame(rows, columns=columns)


def _integral(starts: np.ndarray, ends: np.ndarray, rates: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The integral of a piecewise-constant ``rates`` (over sorted, non-overlapping intervals;
    zero in the gaps) from the first interval's start to each time in ``at``."""
    lengths = (ends - starts).astype(np.float64)
    before = np.concatenate([[0.0], np.cumsum(rates * lengths)])
    index = np.searchsorted(starts, at, side="right") - 1
    inside = np.clip(at - starts[np.maximum(index, 0)], 0, lengths[np.maximum(index, 0)]).astype(np.float64)
    partial = np.where(index >= 0, rates[np.maximum(index, 0)] * inside, 0.0)
    return before[np.maximum(index, 0)] * (index >= 0) + partial


def step_averages(samples: pd.DataFrame, step_starts: np.ndarray, step_ends: np.ndarray) -> list[dict[str, Any]]:
    """For each step ``[start, end]``: ``<device>.<metric>`` averaged over the time the samples
    cover, ``<device>.energy_j`` (the energy used in the step) and ``<device>.energy_method``.

    ``samples`` is :func:`sample_table`'s long format. Energy is the integral of each
    interval's mean power, so a step inside one interval gets its share by time (and the
    method ``estimated``).
    """
    out: list[dict[str, Any]] = [{} for _ in range(len(step_starts))]
    if samples.empty or not len(step_starts):
        return out
    starts_at, ends_at = step_starts.astype(np.int64), step_ends.astype(np.int64)
    for (device, metric), group in samples.groupby(["device", "metric"], sort=False, observed=True):
        group = group.sort_values("start_ns", kind="stable")
        starts = group["start_ns"].to_numpy(dtype=np.int64)
        ends = group["end_ns"].to_numpy(dtype=np.int64)
        values = group["value"].to_numpy(dtype=np.float64)
        lengths = np.maximum(ends - starts, 1).astype(np.float64)
        if metric == SystemMetric.ENERGY_J.value:
            rates = values / lengths
            energy = _integral(starts, ends, rates, ends_at) - _integral(starts, ends, rates, starts_at)
            covered = (_integral(starts, ends, np.ones(len(values)), ends_at)
                       - _integral(starts, ends, np.ones(len(values)), starts_at))
            method = str(group["energy_method"].iloc[-1])
            interval = float(np.median(lengths))
            for i in range(len(out)):
                if covered[i] > 0:
                    out[i][f"{device}.energy_j"] = float(energy[i])
                    out[i][f"{device}.energy_method"] = (EnergyMethod.ESTIMATED.value
                                                         if ends_at[i] - starts_at[i] < interval else method)
            continue
        covered = (_integral(starts, ends, np.ones(len(values)), ends_at)
                   - _integral(starts, ends, np.ones(len(values)), starts_at))
        total = _integral(starts, ends, values, ends_at) - _integral(starts, ends, values, starts_at)
        # a step shorter than one interval and inside it: the interval's value
        inside = np.searchsorted(starts, starts_at, side="right") - 1
        for i in range(len(out)):
            if covered[i] > 0:
                out[i][f"{device}.{metric}"] = float(total[i] / covered[i])
            elif 0 <= inside[i] < len(values) and starts[inside[i]] <= starts_at[i] <= ends[inside[i]]:
                out[i][f"{device}.{metric}"] = float(values[inside[i]])
    unmeasured = samples[samples["energy_method"] == EnergyMethod.UNAVAILABLE.value]
    for device in set(unmeasured["device"]) - {SampleSource.PROCESS.value}:
        for found in out:
            if any(key.startswith(f"{device}.") for key in found):
                found.setdefault(f"{device}.energy_method", EnergyMethod.UNAVAILABLE.value)
    return out
