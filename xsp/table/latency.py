"""Step and layer latency of an always-on session, as bounded histograms: what it exports as
OpenTelemetry metrics (``xsp.step.duration``, ``xsp.layer.duration``) and keeps in the trace's
metadata (``latency``), window by window.

Every step counts toward the step histogram; the layers count from the steps recorded deep.
A layer is its structural ``path``; only the :data:`MAX_LAYERS` layers that took the most time in
the first window with layers are series of their own, the others count as :data:`OTHER_LAYERS`,
so that the number of series (each distinct attribute set is one) stays bounded for days."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.table.sampling import step_roots

BOUNDS_S: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
"""Histogram bucket bounds, in seconds (OpenTelemetry's unit for durations)."""
MAX_LAYERS: Final = 20
OTHER_LAYERS: Final = "other"
"""The series every layer outside the top :data:`MAX_LAYERS` counts in."""


@dataclass
class Latencies:
    """One window's durations: every step's, and each layer's forward calls in the deep steps."""

    step_ns: np.ndarray
    layer_ns: dict[str, np.ndarray] = field(default_factory=dict)
    deep_steps: int = 0
    deepest_layer: int = 0
    """The deepest module call depth of the window's layer spans (0: none)."""


def window_latencies(spans: pd.DataFrame) -> Latencies:
    """The step roots' durations, and the layer forwards' by path (steps recorded at the layer level)."""
    durations = spans[col.DURATION_NS].to_numpy(dtype=np.int64)
    step_ns = durations[step_roots(spans)]
    layers = ((spans[col.LEVEL] == col.Level.LAYER.value)
              & (spans[col.KIND] == col.SpanKind.FORWARD.value)).to_numpy(dtype=bool)
    if not layers.any():
        return Latencies(step_ns=step_ns)
    # the layer rows first: an always-on window is mostly model-level rows, whose paths are not needed
    frame = pd.DataFrame({"path": spans[col.PATH][layers].astype(str).to_numpy(), "ns": durations[layers]})
    layer_ns = {str(path): group.to_numpy(dtype=np.int64) for path, group in frame.groupby("path", sort=False)["ns"]}
    deep_steps = int(spans[col.STEP][layers].nunique())
    depths = spans[col.CALL_DEPTH][layers]
    deepest = int(depths.max()) if depths.notna().any() else 0
    return Latencies(step_ns=step_ns, layer_ns=layer_ns, deep_steps=deep_steps, deepest_layer=deepest)


@dataclass
class Histogram:
    """Counts per bucket of :data:`BOUNDS_S` (one more for above the last), with sum, min and max."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_S) + 1))
    count: int = 0
    sum_ns: int = 0
    min_ns: int | None = None
    max_ns: int | None = None

    def add(self, values_ns: np.ndarray) -> None:
        if not len(values_ns):
            return
        buckets = np.searchsorted(np.asarray(BOUNDS_S) * 1e9, values_ns, side="left")
        for bucket, number in zip(*np.unique(buckets, return_counts=True)):
            self.counts[int(bucket)] += int(number)
        self.count += len(values_ns)
        self.sum_ns += int(values_ns.sum())
        low, high = int(values_ns.min()), int(values_ns.max())
        self.min_ns = low if self.min_ns is None else min(self.min_ns, low)
        self.max_ns = high if self.max_ns is None else max(self.max_ns, high)

    def as_metadata(self) -> dict[str, Any]:
        return {"count": self.count, "sum_ns": self.sum_ns, "min_ns": self.min_ns, "max_ns": self.max_ns,
                "bucket_counts": self.counts}

    def copy(self) -> Histogram:
        """The figures as they are now (later windows count into this one, not the copy)."""
        return Histogram(list(self.counts), self.count, self.sum_ns, self.min_ns, self.max_ns)


@dataclass
class LatencyHistograms:
    """The session's step and layer histograms, with the layers that are series of their own."""

    step: Histogram = field(default_factory=Histogram)
    layers: dict[str, Histogram] = field(default_factory=dict)
    deep_steps: int = 0

    def add(self, latencies: Latencies) -> dict[str, np.ndarray]:
        """Count one window; returns its layer durations by series (path or :data:`OTHER_LAYERS`)."""
        self.step.add(latencies.step_ns)
        self.deep_steps += latencies.deep_steps
        if not latencies.layer_ns:
            return {}
        if not self.layers:  # the first window with layers chooses the series: the top layers by time
            ranked = sorted(latencies.layer_ns, key=lambda path: -int(latencies.layer_ns[path].sum()))
            self.layers = {path: Histogram() for path in ranked[:MAX_LAYERS]}
        series: dict[str, list[np.ndarray]] = {}
        for path, values in latencies.layer_ns.items():
            series.setdefault(path if path in self.layers and path != OTHER_LAYERS else OTHER_LAYERS, []).append(values)
        joined = {name: np.concatenate(parts) for name, parts in series.items()}
        for name, values in joined.items():
            self.layers.setdefault(name, Histogram()).add(values)
        return joined

    def as_metadata(self) -> dict[str, Any]:
        """The trace's ``latency``: bounds, the step histogram, and each layer series'."""
        return {"bounds_s": list(BOUNDS_S), "deep_steps": self.deep_steps, "step": self.step.as_metadata(),
                "layers": {path: histogram.as_metadata() for path, histogram in self.layers.items()}}
