"""The ``kernel`` level: kernels, memory copies, memory sets and synchronisations on the GPU.

From CUPTI's activity records (``CONCURRENT_KERNEL``, ``MEMCPY``, ``MEMSET``,
``SYNCHRONIZATION``). Each activity is placed under the CUDA API call with its correlation
id, so it inherits that call's operator, layer, step and model ancestors.
"""

from __future__ import annotations

from typing import Any, ClassVar

from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.record.window import Window
from xsp.tracers.cuda.graphs import graph_node_rows
from xsp.tracers.cuda.records import ActivityColumns
from xsp.tracers.cuda.rows import activity_rows
from xsp.tracers.cuda.source import ACTIVITY_KINDS
from xsp.tracers.cuda_api import CuptiTracer


class KernelTracer(CuptiTracer):
    """GPU activities: kernels (demangled names, grid, block, registers, shared memory),
    copies (bytes, direction, bandwidth), sets and synchronisations."""

    name: ClassVar[str] = "kernel"
    level: ClassVar[Level] = Level.KERNEL
    kinds: ClassVar[tuple[Any, ...]] = ACTIVITY_KINDS

    def rows(self, records: ActivityColumns) -> pd.DataFrame:
        return activity_rows(records, self.source.clock)

    def collect(self, window: Window) -> pd.DataFrame:
        """The window's GPU activities, and the CUDA graph nodes made in it (instants on the
        threads that made them: see :mod:`xsp.tracers.cuda.graphs`)."""
        activities = super().collect(window)
        nodes = graph_node_rows(window.derived.get("cupti_graph_nodes") or [])
        if not len(nodes):
            return activities
        return nodes if not len(activities) else pd.concat([activities, nodes], ignore_index=True)
