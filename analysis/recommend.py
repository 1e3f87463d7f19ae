"""Recommendations: what to change, with the numbers that say so.

:func:`recommend` runs every rule of :data:`RULES` over a trace and returns one row per rule
that fired, most at stake first. Each rule reads what the trace recorded (model-level input
waits and optimizer steps, operators, CUDA API calls, kernels, copies, the run's settings in
metadata) and fires only past a threshold taken from a profiler that users already trust: the
TensorFlow profiler's input-pipeline and overview thresholds, PyTorch's TensorBoard plugin,
HolisticTraceAnalysis and Nsight Systems' expert rules. A rule whose evidence was not recorded
stays silent (a CPU trace has no kernels to judge); ``docs/recommendations.md`` lists what each
needs.

``share`` is the fraction of step time at stake (the time the fix could win back at most):
step time is the sum of the steps' durations, or the trace's extent when it has no steps.
"""

from __future__ import annotations

import enum
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd
from xsp.analysis.gpu import SYNC_CALLS, gpu_utilization, kernel_table
from xsp.analysis.inputs import input_spans
from xsp.analysis.model import step_roots

from xsp import schema as col
from xsp.schema import Level, SpanKind
from xsp.trace import Trace
from xsp.tree import nearest_ancestor, of_level, parent_positions

RULE: Final = "rule"
SEVERITY: Final = "severity"
SHARE: Final = "share"
EVIDENCE: Final = "evidence"
FIX: Final = "fix"
PATHS: Final = "paths"
COLUMNS: Final = (RULE, SEVERITY, SHARE, EVIDENCE, FIX, PATHS)

ATTR_WORKERS: Final = "xsp.input.num_workers"
ATTR_PIN_MEMORY: Final = "xsp.input.pin_memory"
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
INPUT_MODERATE, INPUT_HIGH = 0.05, 0.20
"""TF profiler: moderately input-bound at 5% of step time, highly at 20%."""
DATALOADER_SHARE = 0.05
"""PyTorch TensorBoard plugin: more DataLoader workers when the DataLoader takes > 5% of the step."""
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
}

_GEMM = re.compile(r"gemm|conv|cudnn|xmma|cutlass|implicit|winograd|fft", re.IGNORECASE)
_SIXTEEN_BIT = re.compile(r"f16|fp16|bf16|half|bfloat16|hgemm|h\d{3,5}gemm|_h\d{3,5}|s16816|s1688gemm_bf16",
                          re.IGNORECASE)
_FP32_MATMUL = re.compile(r"sgemm|scudnn|implicit_convolve_s|_f32f32_f32f32|fft2d_r2c|winograd.*float",
                          re.IGNORECASE)
_TF32 = re.compile(r"tf32|s1688|s16816", re.IGNORECASE)
_LAYOUT_CONVERSION = re.compile(r"nchwToNhwc|nhwcToNchw", re.IGNORECASE)
_FUSED_OPTIMIZER = re.compile(r"_foreach_|_fused_|multi_tensor_apply", re.IGNORECASE)
_OPTIMIZER_ANNOTATION = "Optimizer.step#"
_DEVICE_CAPABILITY: Final = (("H100", 9, 0), ("H200", 9, 0), ("H20", 9, 0), ("GH200", 9, 0), ("B200", 10, 0),
                             ("A100", 8, 0), ("A10", 8, 6), ("A30", 8, 0), ("A40", 8, 6), ("L4", 8, 9),
                             ("L40", 8, 9), ("RTX 40", 8, 9), ("RTX 30", 8, 6), ("V100", 7, 0), ("T4", 7, 5),
                             ("RTX 20", 7, 5), ("P100", 6, 0))


# ---------------------------------------------------------------------------------------------
class _Context:
    """What several rules read, computed once."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.spans = trace.spans
        self.metadata = trace.metadata
        spans = self.spans
        roots = step_roots(spans)
        self.steps = len(roots)
        if self.steps:
            self.step_ns = float(roots[col.DURATION_NS].sum())
            self.in_steps = spans[col.STEP].notna().to_numpy()
        else:
            extent = (int(spans[col.END_NS].max()) - int(spans[col.START_NS].min())) if len(spans) else 0
            self.step_ns = float(max(extent, 0))
            self.in_steps = np.ones(len(spans), dtype=bool)
        self._parents: np.ndarray | None = None
        self._kernels: pd.DataFrame | None = None

    @property
    def parents(self) -> np.ndarray:
        if self._parents is None:
            self._parents = parent_positions(self.spans)
        return self._parents

    @property
    def kernels(self) -> pd.DataFrame:
        """:func:`kernel_table` of the spans in steps."""
        if self._kernels is None:
            table = kernel_table(self.spans)
            self._kernels = table[table["step"].notna()] if self.steps else table
        return self._kernels

    def share(self, ns: float) -> float:
        return min(ns / self.step_ns, 1.0) if self.step_ns > 0 else 0.0

    def per_step_ms(self, ns: float) -> str:
        return f"{ns / 1e6 / self.steps:.3g} ms per step over {self.steps} steps" if self.steps else \
            f"{ns / 1e6:.3g} ms in all"

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

    def operator_names(self, rows: np.ndarray) -> list[str]:
        """For each span position, the path (else name) of its innermost operator (else itself)."""
        operators = nearest_ancestor(self.spans, of_level(self.spans, Level.OPERATOR), self.parents)
        paths = self.spans[col.PATH].to_numpy(dtype=object, na_value=None)
        names = self.spans[col.NAME].to_numpy(dtype=object, na_value=None)
        found = []
        for row in rows.tolist():
            at = int(operators[row]) if operators[row] >= 0 else row
            found.append(str(paths[at] or names[at]))
        return found


def _severity(share: float, moderate: float = SHARE_MODERATE, high: float = SHARE_HIGH) -> Severity:
    return Severity.HIGH if share >= high else Severity.MEDIUM if share >= moderate else Severity.LOW


def _pct(value: float) -> str:
    return f"{value:.1%}"


def _top(names: list[str], weights: np.ndarray | None = None) -> list[str]:
    """The names that weigh most (or come most often), at most :data:`MAX_PATHS`."""
    totals: dict[str, float] = {}
    for index, name in enumerate(names):
        totals[name] = totals.get(name, 0.0) + (float(weights[index]) if weights is not None else 1.0)
    return sorted(totals, key=lambda name: -totals[name])[:MAX_PATHS]


def _attributes(text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        return {}
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


# rules -----------------------------------------------------------------------------------------
def _input_waits(ctx: _Context) -> pd.DataFrame:
    return input_spans(ctx.spans[ctx.in_steps])  # input level, or model level in older traces


def input_bound(ctx: _Context) -> Finding | None:
    waits = _input_waits(ctx)
    waited_ns = float(waits[col.DURATION_NS].sum())
    share = ctx.share(waited_ns)
    if share < INPUT_MODERATE:
        return None
    high = share >= INPUT_HIGH
    return Finding(
        Severity.HIGH if high else Severity.MEDIUM, share,
        f"the loop waited for input {_pct(share)} of step time ({ctx.per_step_ms(waited_ns)}): "
        f"{'highly' if high else 'moderately'} input-bound (>= {INPUT_HIGH if high else INPUT_MODERATE:.0%})",
        "prepare batches ahead of the loop: DataLoader(dataset, batch_size=..., num_workers=4, pin_memory=True, "
        "persistent_workers=True, prefetch_factor=4); move per-sample work (decoding, augmentation) into the "
        "workers or onto the GPU",
        _top(waits[col.NAME].astype(str).tolist(), waits[col.DURATION_NS].to_numpy(dtype=np.float64)))


def dataloader_workers(ctx: _Context) -> Finding | None:
    waits = _input_waits(ctx)
    waited_ns = float(waits[col.DURATION_NS].sum())
    share = ctx.share(waited_ns)
    if share <= DATALOADER_SHARE:
        return None
    attributes = [_attributes(text) for text in waits[col.ATTRIBUTES].tolist()]
    workers = [int(a[ATTR_WORKERS]) for a in attributes if isinstance(a.get(ATTR_WORKERS), int)]
    if not workers:
        return None
    used = min(workers)
    cpus = int(ctx.metadata.get("cpus_available") or ctx.metadata.get("cpu_count") or 0)
    if cpus and used >= cpus:
        return None  # every CPU already loads: the fix is in the input pipeline, not the worker count
    suggested = max(2, min(cpus or 4, 8)) if used == 0 else min(used * 2, cpus or used * 2)
    pinned = [a.get(ATTR_PIN_MEMORY) for a in attributes if ATTR_PIN_MEMORY in a]
    on_gpu = bool(ctx.device())
    pin = ", pin_memory=True" if on_gpu and pinned and not any(pinned) else ""
    return Finding(
        Severity.HIGH if used == 0 and share >= INPUT_HIGH else Severity.MEDIUM, share,
        f"DataLoader with num_workers={used}{f' of {cpus} CPUs' if cpus else ''}; the loop waited for it "
        f"{_pct(share)} of step time (> {DATALOADER_SHARE:.0%})",
        f"DataLoader(dataset, ..., num_workers={suggested}, persistent_workers=True{pin})",
        _top(waits[col.NAME].astype(str).tolist()))


def gpu_idle(ctx: _Context) -> Finding | None:
    spans = ctx.spans if not ctx.steps else ctx.spans[ctx.in_steps]
    usage = gpu_utilization(spans, per_stream=False)
    if not len(usage):
        return None
    window_us = float(usage["window_us"].sum())
    host_bound_us = float(usage["host_bound_idle_us"].sum())
    idle = host_bound_us / window_us if window_us > 0 else 0.0
    if idle < HOST_IDLE_MODERATE:
        return None
    devices = usage.groupby("device_id", dropna=False)["host_bound_idle_us"].sum().sort_values(ascending=False)
    return Finding(
        Severity.HIGH if idle >= HOST_IDLE_HIGH else Severity.MEDIUM, ctx.share(host_bound_us * 1e3),
        f"the GPU sat idle waiting for the host {_pct(idle)} of its active window ({host_bound_us / 1e3:.4g} ms of "
        f"{window_us / 1e3:.4g} ms: no stream had work, and the next kernel or copy was launched only after); "
        f"busy {_pct(float(usage['busy_us'].sum()) / window_us)}",
        "take host work off the launch path: torch.compile(model, mode=\"reduce-overhead\") (CUDA graphs), keep "
        "values on the GPU instead of .item()/.cpu() in the loop, prepare inputs in DataLoader workers",
        [f"device {_plain_id(device)}" for device in devices.head(MAX_PATHS).index.tolist()])


def _plain_id(value: Any) -> str:
    return "?" if value is None or pd.isna(value) else str(int(value))


def small_kernels(ctx: _Context) -> Finding | None:
    kernels = ctx.kernels
    kernels = kernels[kernels["launch_duration_us"].notna()]
    if not len(kernels):
        return None
    short = (kernels["duration_us"] < kernels["launch_duration_us"]).to_numpy()
    fraction = float(short.mean())
    launch_ns = float(kernels["launch_duration_us"].sum()) * 1e3
    launch_share = ctx.share(launch_ns)
    if fraction < SHORT_KERNEL_FRACTION or launch_share < LAUNCH_MODERATE:
        return None
    short_rows = kernels[short]
    return Finding(
        Severity.HIGH if launch_share >= LAUNCH_HIGH else Severity.MEDIUM,
        ctx.share(float(short_rows["launch_duration_us"].sum()) * 1e3),
        f"{int(short.sum())} of {len(kernels)} kernels ({_pct(fraction)}) ran shorter than the CPU call that "
        f"launched them (median kernel {float(kernels['duration_us'].median()):.3g} us, launch "
        f"{float(kernels['launch_duration_us'].median()):.3g} us); launches took {_pct(launch_share)} of step time: "
        "launch-bound",
        "fuse small kernels: torch.compile(model); or capture the step in a CUDA graph "
        "(torch.compile(model, mode=\"reduce-overhead\")); or raise the batch size so each kernel does more",
        _top([str(name) for name in short_rows["operator"].fillna(short_rows["name"]).tolist()],
             short_rows["launch_duration_us"].to_numpy(dtype=np.float64)))


def pageable_memcpy(ctx: _Context) -> Finding | None:
    copies = ctx.of(Level.KERNEL, SpanKind.MEMCPY)
    pageable = copies[copies[col.NAME].str.contains("Pageable", case=False, na=False).to_numpy()]
    if not len(pageable):
        return None
    copy_ns = float(pageable[col.DURATION_NS].sum())
    share = ctx.share(copy_ns)
    directions = Counter(str(kind) for kind in pageable[col.COPY_KIND].fillna("?").tolist())
    moved = int(pageable[col.BYTES].fillna(0).sum())
    rows = np.flatnonzero(ctx.spans.index.isin(pageable.index))
    return Finding(
        _severity(share), share,
        f"{len(pageable)} copies from or to pageable host memory "
        f"({', '.join(f'{kind} x{count}' for kind, count in directions.most_common())}; {moved / 1e6:.3g} MB, "
        f"{copy_ns / 1e6:.3g} ms): an async copy of pageable memory is staged and runs synchronously",
        "pin host memory: DataLoader(..., pin_memory=True), or x = x.pin_memory(); then "
        "x.to(\"cuda\", non_blocking=True)",
        _top(ctx.operator_names(rows), ctx.spans[col.DURATION_NS].to_numpy(dtype=np.float64)[rows]))


def blocking_sync(ctx: _Context) -> Finding | None:
    api = ctx.of(Level.CUDA_API)
    names = api[col.NAME].astype(str)
    blocking = names.str.startswith(tuple(call for call in SYNC_CALLS if "WaitEvent" not in call)) | (
        names == "cudaMemcpy") | names.str.startswith("cuMemcpyDtoH")
    calls = api[blocking.to_numpy()]
    if not len(calls):
        return None
    blocked_ns = float(calls[col.DURATION_NS].sum())
    share = ctx.share(blocked_ns)
    if share < 0.01:
        return None
    to_host = ctx.of(Level.KERNEL, SpanKind.MEMCPY)
    to_host = to_host[to_host[col.COPY_KIND].fillna("").str.startswith("DtoH").to_numpy()]
    counts = Counter(names[blocking.to_numpy()].tolist())
    rows = np.flatnonzero(ctx.spans.index.isin(calls.index))
    per_step = f" ({len(to_host) / ctx.steps:.3g} device-to-host copies per step)" if ctx.steps and len(to_host) \
        else f" ({len(to_host)} device-to-host copies)" if len(to_host) else ""
    return Finding(
        _severity(share), share,
        f"the host blocked {_pct(share)} of step time ({blocked_ns / 1e6:.3g} ms) in "
        f"{len(calls)} synchronising calls ({', '.join(f'{name} x{n}' for name, n in counts.most_common(3))})"
        f"{per_step}",
        "keep values on the GPU inside the loop: accumulate with total += loss.detach() and call .item() once "
        "per logging interval; avoid torch.cuda.synchronize() and .cpu()/.tolist() on the hot path",
        _top(ctx.operator_names(rows), ctx.spans[col.DURATION_NS].to_numpy(dtype=np.float64)[rows]))


def _kernel_time(ctx: _Context, pattern: re.Pattern[str], exclude: re.Pattern[str] | None = None) -> tuple[
        float, pd.DataFrame]:
    kernels = ctx.kernels
    names = kernels["name"].astype(str)
    mask = names.str.contains(pattern).to_numpy(dtype=bool, copy=True)
    if exclude is not None:
        mask &= ~names.str.contains(exclude).to_numpy()
    chosen = kernels[mask]
    return float(chosen["duration_us"].sum()) * 1e3, chosen


def no_tf32(ctx: _Context) -> Finding | None:
    capability = ctx.capability()
    kernel_ns = float(ctx.kernels["duration_us"].sum()) * 1e3
    if capability is None or capability < (8, 0) or kernel_ns <= 0:
        return None
    fp32_ns, fp32 = _kernel_time(ctx, _FP32_MATMUL, _TF32)
    fraction = fp32_ns / kernel_ns
    if fraction < FP32_MATMUL_SHARE:
        return None
    settings = "" if "tf32_matmul" not in ctx.metadata else (
        f"; torch.backends.cuda.matmul.allow_tf32={ctx.metadata['tf32_matmul']}, "
        f"cudnn.allow_tf32={ctx.metadata.get('tf32_cudnn')}")
    return Finding(
        _severity(ctx.share(fp32_ns)), ctx.share(fp32_ns),
        f"{_pct(fraction)} of kernel time is in full-fp32 matmul/convolution kernels ({len(fp32)} launches, e.g. "
        f"{str(fp32['name'].iloc[0])[:60]}) on a compute capability {capability[0]}.{capability[1]} GPU whose "
        f"Tensor Cores run TF32{settings}",
        "torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True  "
        "(or torch.set_float32_matmul_precision(\"high\"))",
        _top([str(name) for name in fp32["operator"].fillna(fp32["name"]).tolist()],
             fp32["duration_us"].to_numpy(dtype=np.float64)))


def no_amp(ctx: _Context) -> Finding | None:
    capability = ctx.capability()
    kernel_ns = float(ctx.kernels["duration_us"].sum()) * 1e3
    if capability is None or capability < (7, 0) or kernel_ns <= 0:
        return None
    matmul_ns, matmul = _kernel_time(ctx, _GEMM)
    sixteen_ns, _ = _kernel_time(ctx, _SIXTEEN_BIT)
    if matmul_ns / kernel_ns < MATMUL_SHARE or sixteen_ns / kernel_ns >= SIXTEEN_BIT_SHARE:
        return None
    dtype = "bfloat16" if capability >= (8, 0) else "float16"
    return Finding(
        _severity(ctx.share(matmul_ns)), ctx.share(matmul_ns),
        f"{_pct(sixteen_ns / kernel_ns)} of kernel time is 16-bit (< {SIXTEEN_BIT_SHARE:.0%}) while matmul and "
        f"convolution kernels take {_pct(matmul_ns / kernel_ns)} of it, on a compute capability "
        f"{capability[0]}.{capability[1]} GPU with 16-bit Tensor Cores",
        f"with torch.autocast(\"cuda\", dtype=torch.{dtype}): output = model(x); loss = criterion(output, y)"
        + ("  (and torch.amp.GradScaler(\"cuda\") for training)" if dtype == "float16" else ""),
        _top([str(name) for name in matmul["operator"].fillna(matmul["name"]).tolist()],
             matmul["duration_us"].to_numpy(dtype=np.float64)))


def channels_last(ctx: _Context) -> Finding | None:
    kernel_ns = float(ctx.kernels["duration_us"].sum()) * 1e3
    if kernel_ns <= 0:
        return None
    converting_ns, converting = _kernel_time(ctx, _LAYOUT_CONVERSION)
    fraction = converting_ns / kernel_ns
    if fraction < SHARE_MODERATE:
        return None
    return Finding(
        _severity(ctx.share(converting_ns)), ctx.share(converting_ns),
        f"{len(converting)} layout conversion kernels (NCHW <-> NHWC) take {_pct(fraction)} of kernel time: "
        "convolutions run in channels-last internally and convert contiguous (NCHW) tensors on every call",
        "model = model.to(memory_format=torch.channels_last); x = x.to(memory_format=torch.channels_last)",
        _top([str(name) for name in converting["layer"].fillna(converting["operator"]).fillna(
            converting["name"]).tolist()], converting["duration_us"].to_numpy(dtype=np.float64)))


def unfused_optimizer(ctx: _Context) -> Finding | None:
    spans = ctx.spans
    model = (spans[col.LEVEL] == Level.MODEL.value).to_numpy() & ctx.in_steps
    steps = spans[model & ((spans[col.KIND] == SpanKind.OPTIMIZER.value).to_numpy()
                           | spans[col.NAME].str.startswith(_OPTIMIZER_ANNOTATION).fillna(False).to_numpy())]
    if not len(steps):
        return None
    optimizer_ns = float(steps[col.DURATION_NS].sum())
    share = ctx.share(optimizer_ns)
    if share < OPTIMIZER_SHARE:
        return None
    operators = spans[(spans[col.LEVEL] == Level.OPERATOR.value).to_numpy()
                      & (spans[col.KIND] == SpanKind.OPERATOR.value).to_numpy()]
    if not len(operators):
        return None  # which implementation ran is not recorded
    op_start = operators[col.START_NS].to_numpy(dtype=np.int64)
    op_end = operators[col.END_NS].to_numpy(dtype=np.int64)
    op_thread = operators[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan)
    op_names = operators[col.NAME].astype(str).to_numpy(dtype=object)
    counts, fused = [], False
    for start, end, thread in zip(steps[col.START_NS].tolist(), steps[col.END_NS].tolist(),
                                  steps[col.THREAD_ID].to_numpy(dtype=np.float64, na_value=np.nan).tolist()):
        inside = (op_start >= start) & (op_end <= end) & ((op_thread == thread) | np.isnan(thread))
        counts.append(int(inside.sum()))
        fused |= any(_FUSED_OPTIMIZER.search(name) for name in op_names[inside])
    per_step = float(np.median(counts))
    if fused or per_step < OPTIMIZER_OPERATORS:
        return None
    name = str(steps[col.NAME].iloc[0])
    optimizer = name.split("#", 1)[1] if "#" in name else name
    optimizer = optimizer.rsplit(".", 1)[0] or "Adam"
    return Finding(
        _severity(share), share,
        f"{name} takes {_pct(share)} of step time ({ctx.per_step_ms(optimizer_ns)}) and runs a median "
        f"{per_step:.0f} operators per call, none of them foreach or fused: one small operator per parameter",
        f"torch.optim.{optimizer}(model.parameters(), ..., fused=True)  (or foreach=True where fused is not "
        "supported)",
        [name])


def _grid_blocks(grids: pd.Series) -> np.ndarray:
    blocks = np.full(len(grids), np.nan)
    for index, text in enumerate(grids.tolist()):
        if isinstance(text, str):
            numbers = [int(n) for n in re.findall(r"\d+", text)]
            if numbers:
                blocks[index] = float(np.prod(numbers))
    return blocks


def gpu_underutilized(ctx: _Context) -> Finding | None:
    sms = ctx.device().get("numSms")
    kernels = ctx.kernels
    if not sms or not len(kernels):
        return None
    blocks = _grid_blocks(kernels["grid"])
    known = ~np.isnan(blocks)
    if not known.any():
        return None
    duration = kernels["duration_us"].to_numpy(dtype=np.float64)[known]
    kernel_ns = float(duration.sum()) * 1e3
    if ctx.share(kernel_ns) < KERNEL_SHARE or kernel_ns <= 0:
        return None
    efficiency = float((duration * np.minimum(blocks[known] / float(sms), 1.0)).sum() / duration.sum())
    if efficiency >= SM_EFFICIENCY:
        return None
    sizes = ctx.spans[col.BATCH_SIZE].dropna()
    batch = int(sizes.median()) if len(sizes) else None
    under = kernels[known][blocks[known] < float(sms)]
    return Finding(
        Severity.HIGH if efficiency < SM_EFFICIENCY / 2 else Severity.MEDIUM,
        ctx.share(kernel_ns * (1.0 - efficiency)),
        f"SM efficiency {efficiency:.2f} (< {SM_EFFICIENCY}): kernels weighted by time launch fewer blocks than the "
        f"GPU's {int(sms)} SMs ({len(under)} of {int(known.sum())} kernels)"
        + (f"; batch size {batch}" if batch else ""),
        (f"raise the batch size (batch_size={batch * 2} or more, as memory allows)" if batch else
         "raise the batch size, as memory allows") + "; or serve several requests per call",
        _top([str(name) for name in under["layer"].fillna(under["operator"]).fillna(under["name"]).tolist()],
             under["duration_us"].to_numpy(dtype=np.float64)))


def memory_near_capacity(ctx: _Context) -> Finding | None:
    memory = ctx.metadata.get("memory")
    if not isinstance(memory, dict):
        return None
    worst: tuple[float, str, int, int] | None = None
    candidates = [(f"GPU {d.get('device')}", d.get("peak_reserved_bytes"), d.get("total_bytes"))
                  for d in memory.get("devices", []) if isinstance(d, dict)]
    candidates.append(("host", memory.get("host_peak_rss_bytes"), memory.get("host_total_bytes")))
    for where, peak, total in candidates:
        if isinstance(peak, int) and isinstance(total, int) and total > 0:
            used = peak / total
            if worst is None or used > worst[0]:
                worst = (used, where, peak, total)
    if worst is None or worst[0] <= MEMORY_CAPACITY:
        return None
    used, where, peak, total = worst
    return Finding(
        Severity.HIGH if used >= 0.97 else Severity.MEDIUM, 0.0,
        f"peak memory on the {where} reached {_pct(used)} of its capacity ({peak / 2**30:.3g} of "
        f"{total / 2**30:.3g} GiB; > {MEMORY_CAPACITY:.0%}): a larger input or batch will not fit",
        "activation checkpointing (torch.utils.checkpoint.checkpoint(block, x)), mixed precision "
        "(torch.autocast), or a smaller batch with gradient accumulation",
        [where])


def cpu_threads(ctx: _Context) -> Finding | None:
    threads = ctx.metadata.get("torch_num_threads")
    cpus = ctx.metadata.get("cpus_available") or ctx.metadata.get("cpu_count")
    if not isinstance(threads, int) or not isinstance(cpus, int) or cpus <= 0:
        return None
    model = ctx.of(Level.MODEL, SpanKind.PREDICT, SpanKind.BACKWARD)
    compute_share = ctx.share(float(model[col.DURATION_NS].sum()))
    if threads > cpus:
        return Finding(
            Severity.MEDIUM, compute_share,
            f"PyTorch runs {threads} intra-op threads on {cpus} available CPUs: threads compete for cores "
            "(oversubscription)", f"torch.set_num_threads({cpus})", [])
    if threads == 1 and cpus >= 4 and not ctx.device() and compute_share >= CPU_BOUND_SHARE:
        return Finding(
            Severity.MEDIUM, compute_share,
            f"PyTorch runs 1 intra-op thread of {cpus} available CPUs while forward and backward take "
            f"{_pct(compute_share)} of step time", f"torch.set_num_threads({cpus})", [])
    return None


CHECKS: Final[dict[Rule, Callable[[_Context], Finding | None]]] = {
    Rule.INPUT_BOUND: input_bound,
    Rule.DATALOADER_WORKERS: dataloader_workers,
    Rule.GPU_IDLE: gpu_idle,
    Rule.SMALL_KERNELS: small_kernels,
    Rule.PAGEABLE_MEMCPY: pageable_memcpy,
    Rule.BLOCKING_SYNC: blocking_sync,
    Rule.NO_TF32: no_tf32,
    Rule.NO_AMP: no_amp,
    Rule.CHANNELS_LAST: channels_last,
    Rule.UNFUSED_OPTIMIZER: unfused_optimizer,
    Rule.GPU_UNDERUTILIZED: gpu_underutilized,
    Rule.MEMORY_NEAR_CAPACITY: memory_near_capacity,
    Rule.CPU_THREADS: cpu_threads,
}


def recommend(trace: Trace | pd.DataFrame) -> pd.DataFrame:
    """What to change, most at stake first: one row per rule that fired.

    Columns: ``rule`` (a :class:`Rule` id), ``severity`` (high, medium, low), ``share`` (the
    fraction of step time at stake), ``evidence`` (the numbers that triggered it, with the
    threshold), ``fix`` (what to change, with a code line), ``paths`` (the spans it concerns,
    largest first; a list). An empty frame says no rule fired; ``docs/recommendations.md`` says
    what each rule needs recorded.
    """
    context = _Context(trace if isinstance(trace, Trace) else Trace(spans=trace, metadata={}))
    rows = []
    for rule, check in CHECKS.items():
        finding = check(context)
        if finding is not None:
            rows.append({RULE: rule.value, SEVERITY: finding.severity.value, SHARE: float(finding.share),
                         EVIDENCE: finding.evidence, FIX: finding.fix, PATHS: finding.paths,
                         "_rank": finding.severity.rank})
    if not rows:
        return pd.DataFrame({name: pd.Series(dtype=object if name != SHARE else np.float64) for name in COLUMNS})
    frame = pd.DataFrame(rows).sort_values(["_rank", SHARE], ascending=[True, False], kind="stable")
    return frame[list(COLUMNS)].reset_index(drop=True)


__all__ = ["Rule", "Severity", "Threshold", "RULES", "recommend"]
