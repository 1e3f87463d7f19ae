"""What a recommendation is: the rules, their severities and thresholds, a finding, and the
context (the trace's tables, computed once) that every rule reads."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.analysis.evidence import Evidence, evidence_of
from xsp.analysis.gpu import gpu_utilization
from xsp.analysis.inputs import input_workers
from xsp.analysis.model import step_roots
from xsp.core import schema as col
from xsp.core.figures import milliseconds
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace

RULE: Final = "rule"
SEVERITY: Final = "severity"
SHARE: Final = "share"
EVIDENCE: Final = "evidence"
FIX: Final = "fix"
PATHS: Final = "paths"
COLUMNS: Final = (RULE, SEVERITY, SHARE, EVIDENCE, FIX, PATHS)

MAX_PATHS: Final = 5
"""Paths named per recommendation at most (the largest first)."""


class Severity(str, enum.Enum):
    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"

    @property
    def rank(self) -> int:
        return (Severity.HIGH, Severity.MEDIUM, Severity.LOW).index(self)


class Rule(str, enum.Enum):
    INPUT_BOUND = "input_bound"
    DATALOADER_WORKERS = "dataloader_workers"
    GPU_IDLE = "gpu_idle"
    SMALL_KERNELS = "small_kernels"
    PAGEABLE_MEMCPY = "pageable_memcpy"
    BLOCKING_SYNC = "blocking_sync"
    NO_TF32 = "no_tf32"
    NO_AMP = "no_amp"
    CHANNELS_LAST = "channels_last"
    UNFUSED_OPTIMIZER = "unfused_optimizer"
    GPU_UNDERUTILIZED = "gpu_underutilized"
    MEMORY_NEAR_CAPACITY = "memory_near_capacity"
    CPU_THREADS = "cpu_threads"
    GC_PAUSES = "gc_pauses"


@dataclass(frozen=True)
class Threshold:
    """When a rule fires, and where that threshold comes from."""

    text: str
    source: str


@dataclass
class Finding:
    severity: Severity
    share: float
    evidence: str
    fix: str
    paths: list[str]


# thresholds -----------------------------------------------------------------------------------
STEP_TIME = "step time"
TRACE_TIME = "the trace's time"
"""What a finding's share is a fraction of: the steps' time, or, in a trace without steps, its extent."""
SHARE_OF = "share_of"
"""The recommendations table's attribute (``attrs``) naming what ``share`` is a fraction of."""
INPUT_MODERATE, INPUT_HIGH = 0.05, 0.20
"""TF profiler: moderately input-bound at 5% of step time, highly at 20%."""
DATALOADER_SHARE = 0.05
"""PyTorch TensorBoard plugin: more DataLoader workers when the DataLoader takes > 5% of the step."""
EPOCH_TURNS_SHARE = 0.5
"""The share of the loop's input waits spent where one epoch turns to the next (workers stopping
and starting) past which keeping the workers (``persistent_workers=True``) leads the advice."""
WORKERS_SATURATED = 0.9
"""How busy a DataLoader's workers were (fetching, of their time alive) past which fetching further
ahead (``prefetch_factor``) cannot shorten the loop's waits: they already fetch all the time."""
HOST_IDLE_MODERATE, HOST_IDLE_HIGH = 0.10, 0.30
"""GPU idle waiting on the host, as a share of the GPU's busy window (HTA's host-wait idle)."""
LAUNCH_MODERATE, LAUNCH_HIGH = 0.03, 0.15
"""TF profiler: kernel-launch bound at 3% (moderate) and 15% (high) of step time."""
SHORT_KERNEL_FRACTION = 0.5
"""Half the kernels shorter than their launch call (HTA's short kernels: GPU < CPU duration)."""
SHARE_MODERATE, SHARE_HIGH = 0.03, 0.15
"""Severity of time lost to a named cause: TF profiler's 3% / 15% ("all other time")."""
FP32_MATMUL_SHARE = 0.10
"""Share of kernel time in fp32 (non-TF32) matmul/convolution kernels that suggests TF32."""
SIXTEEN_BIT_SHARE = 0.10
"""TF profiler: suggest 16-bit when under 10% of device compute is 16-bit."""
MATMUL_SHARE = 0.20
"""Matmul/convolution share of kernel time for AMP to be worth it."""
OPTIMIZER_SHARE = 0.05
OPTIMIZER_OPERATORS = 10
"""Operators per optimizer step above which an optimizer without foreach/fused ops is flagged."""
SM_EFFICIENCY = 0.5
"""PyTorch TensorBoard plugin: GPU utilisation < 0.5 suggests a larger batch (judged by SM efficiency)."""
KERNEL_SHARE = 0.10
"""Kernels must take this much of step time for their efficiency to matter."""
MEMORY_CAPACITY = 0.90
"""PyTorch TensorBoard plugin: peak memory > 90% of the device."""
CPU_BOUND_SHARE = 0.5
"""Share of step time in forward and backward for a CPU run's thread count to matter."""
GC_SHARE = 0.01
GC_MODERATE = 0.03
GC_HIGH = 0.10
"""Garbage collection's share of step time past which it is flagged (low, medium, high)."""

RULES: Final[dict[Rule, Threshold]] = {
    Rule.INPUT_BOUND: Threshold("input waits >= 5% of step time (medium), >= 20% (high)",
                                "TensorFlow profiler, input pipeline analysis"),
    Rule.DATALOADER_WORKERS: Threshold("input waits > 5% of step time with fewer workers than CPUs",
                                       "PyTorch TensorBoard plugin"),
    Rule.GPU_IDLE: Threshold("GPU idle waiting on the host >= 10% of its active window (medium), >= 30% (high)",
                             "HolisticTraceAnalysis idle-time breakdown (host wait); Nsight Systems gpu_gaps"),
    Rule.SMALL_KERNELS: Threshold("half the kernels shorter than their launch and launches >= 3% of step time "
                                  "(medium), >= 15% (high)",
                                  "HolisticTraceAnalysis short kernels; TensorFlow profiler kernel-launch time"),
    Rule.PAGEABLE_MEMCPY: Threshold("any copy from or to pageable host memory; medium at >= 3% of step time, "
                                    "high at >= 15%", "Nsight Systems cuda_memcpy_async"),
    Rule.BLOCKING_SYNC: Threshold("host blocked in synchronisation >= 1% of step time; medium >= 3%, high >= 15%",
                                  "Nsight Systems cuda_api_sync, cuda_memcpy_sync"),
    Rule.NO_TF32: Threshold("compute capability >= 8.0 and fp32 (non-TF32) matmul/convolution kernels >= 10% "
                            "of kernel time", "PyTorch TF32 notes; TensorBoard plugin Tensor Core use"),
    Rule.NO_AMP: Threshold("compute capability >= 7.0, matmul/convolution >= 20% of kernel time and 16-bit "
                           "kernels < 10% of it", "TensorFlow profiler (16-bit < 10%); TensorBoard plugin AMP"),
    Rule.CHANNELS_LAST: Threshold("NCHW <-> NHWC layout conversion kernels >= 3% of kernel time (medium), "
                                  ">= 15% (high)", "cuDNN layout conversions; PyTorch channels_last tutorial"),
    Rule.UNFUSED_OPTIMIZER: Threshold("optimizer steps >= 5% of step time running >= 10 operators per step, none "
                                      "foreach or fused", "PyTorch torch.optim foreach/fused implementations"),
    Rule.GPU_UNDERUTILIZED: Threshold("kernels >= 10% of step time with SM efficiency < 0.5 (medium), < 0.25 "
                                      "(high)", "PyTorch TensorBoard plugin (GPU utilisation < 0.5)"),
    Rule.MEMORY_NEAR_CAPACITY: Threshold("peak memory > 90% of the device's (or host's) memory",
                                         "PyTorch TensorBoard plugin"),
    Rule.CPU_THREADS: Threshold("more intra-op threads than CPUs available, or 1 thread of >= 4 CPUs in a "
                                "CPU-bound run (forward and backward >= 50% of step time)",
                                "PyTorch CPU performance tuning guide"),
    Rule.GC_PAUSES: Threshold(f"garbage collections >= {GC_SHARE:.0%} of step time (low), >= {GC_MODERATE:.0%} "
                              f"(medium), >= {GC_HIGH:.0%} (high)",
                              "Python gc.freeze() documentation; Instagram's gc.freeze in production"),
}

GEMM = re.compile(r"gemm|conv|cudnn|xmma|cutlass|implicit|winograd|fft", re.IGNORECASE)
SIXTEEN_BIT = re.compile(r"f16|fp16|bf16|half|bfloat16|hgemm|h\d{3,5}gemm|_h\d{3,5}|s16816|s1688gemm_bf16",
                          re.IGNORECASE)
FP32_MATMUL = re.compile(r"sgemm|scudnn|implicit_convolve_s|_f32f32_f32f32|fft2d_r2c|winograd.*float",
                          re.IGNORECASE)
TF32 = re.compile(r"tf32|s1688|s16816", re.IGNORECASE)
LAYOUT_CONVERSION = re.compile(r"nchwToNhwc|nhwcToNchw", re.IGNORECASE)
_DEVICE_CAPABILITY: Final = (("H100", 9, 0), ("H200", 9, 0), ("H20", 9, 0), ("GH200", 9, 0), ("B200", 10, 0),
                             ("A100", 8, 0), ("A10", 8, 6), ("A30", 8, 0), ("A40", 8, 6), ("L4", 8, 9),
                             ("L40", 8, 9), ("RTX 40", 8, 9), ("RTX 30", 8, 6), ("V100", 7, 0), ("T4", 7, 5),
                             ("RTX 20", 7, 5), ("P100", 6, 0))


# ---------------------------------------------------------------------------------------------
class Context:
    """What several rules read, computed once. ``extent_ns``, ``evidence`` and ``usage`` are
    given where ``trace`` holds only some spans of the trace judged (its steps' roots, model
    calls, input waits and fetches: one read a window at a time): the first start and last end of
    all its spans, :func:`xsp.analysis.evidence.added_evidence` of its windows and the GPU's busy
    and idle time of its steps' work per step and device."""

    def __init__(self, trace: Trace, extent_ns: tuple[int, int] | None = None, evidence: Evidence | None = None,
                 usage: pd.DataFrame | None = None) -> None:
        self.trace = trace
        self.spans = trace.spans
        self.metadata = trace.metadata
        spans = self.spans
        roots = step_roots(spans)
        self.steps = len(roots)
        self.time_name = STEP_TIME if self.steps else TRACE_TIME
        """What ``share`` is a fraction of, in words."""
        if self.steps:
            self.step_ns = float(roots[col.DURATION_NS].sum())
            self.in_steps = spans[col.STEP].notna().to_numpy()
        else:
            first, last = extent_ns if extent_ns is not None else (
                (int(spans[col.START_NS].min()), int(spans[col.END_NS].max())) if len(spans) else (0, 0))
            self.step_ns = float(max(last - first, 0))
            self.in_steps = np.ones(len(spans), dtype=bool)
        self._evidence = evidence
        self._usage = usage
        self._workers: pd.DataFrame | None = None

    @property
    def evidence(self) -> Evidence:
        """What the rules read of the steps' work (:mod:`xsp.analysis.evidence`)."""
        if self._evidence is None:
            self._evidence = evidence_of(self.spans, self.in_steps)
        return self._evidence

    @property
    def usage(self) -> pd.DataFrame:
        """:func:`xsp.analysis.gpu_utilization` of the steps' work, per step and device."""
        if self._usage is None:
            self._usage = gpu_utilization(self.spans if not self.steps else self.spans[self.in_steps],
                                          per_stream=False)
        return self._usage

    @property
    def workers(self) -> pd.DataFrame:
        """:func:`xsp.analysis.input_workers`: the DataLoader workers the session followed."""
        if self._workers is None:
            self._workers = input_workers(self.spans)
        return self._workers

    def share(self, ns: float) -> float:
        return min(ns / self.step_ns, 1.0) if self.step_ns > 0 else 0.0

    def per_step_ms(self, ns: float) -> str:
        return f"{milliseconds(ns / 1e6 / self.steps)} per step over {self.steps} steps" if self.steps else \
            f"{milliseconds(ns / 1e6)} in all"

    def device(self) -> dict[str, Any]:
        """The first GPU's properties (Kineto's ``deviceProperties`` keys), as far as known."""
        properties = self.metadata.get("device_properties")
        if isinstance(properties, list) and properties and isinstance(properties[0], dict):
            return dict(properties[0])
        name = str(self.metadata.get("device") or "")
        return {"name": name} if name and not name.startswith("cpu") and name != "unknown" else {}

    def capability(self) -> tuple[int, int] | None:
        device = self.device()
        if "computeMajor" in device:
            return int(device["computeMajor"]), int(device.get("computeMinor", 0))
        name = str(device.get("name", ""))
        for marker, major, minor in _DEVICE_CAPABILITY:
            if marker in name:
                return major, minor
        return None

    def of(self, level: Level, *kinds: SpanKind, in_steps: bool = True) -> pd.DataFrame:
        mask = (self.spans[col.LEVEL] == level.value).to_numpy(dtype=bool, copy=True)
        if kinds:
            mask &= self.spans[col.KIND].isin([kind.value for kind in kinds]).to_numpy()
        if in_steps:
            mask &= self.in_steps
        return self.spans[mask]
