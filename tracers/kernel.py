"""The ``kernel`` level: kernels, memory copies, memory sets and synchronisations on the GPU.

From CUPTI's activity records (``CONCURRENT_KERNEL``, ``MEMCPY``, ``MEMSET``,
``SYNCHRONIZATION``). Each activity is placed under the CUDA API call with its correlation
id, so it inherits that call's operator, layer, step and model ancestors.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pandas as pd
from xsp.tracers._cupti import ACTIVITY_KINDS
from xsp.tracers._cupti_records import ActivityColumns
from xsp.tracers._cupti_rows import activity_rows
from xsp.tracers.cuda_api import CuptiTracer

from xsp.core.schema import Level


class KernelTracer(CuptiTracer):
    """GPU activities: kernels (demangled names, grid, block, registers, shared memory),
    copies (bytes, direction, bandwidth), sets and synchronisations."""

    name: ClassVar[str] = "kernel"
    level: ClassVar[Level] = Level.KERNEL
    kinds: ClassVar[tuple[Any, ...]] = ACTIVITY_KINDS

    def rows(self, records: ActivityColumns) -> pd.DataFrame:
        return activity_rows(records, self.source.clock)
