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

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pandas as pd

from xsp.analysis.findings import (
    COLUMNS,
    CPU_BOUND_SHARE,
    DATALOADER_SHARE,
    EPOCH_TURNS_SHARE,
    EVIDENCE,
    FIX,
    FP32_MATMUL,
    FP32_MATMUL_SHARE,
    GC_HIGH,
    GC_MODERATE,
    GC_SHARE,
    GEMM,
    HOST_IDLE_HIGH,
    HOST_IDLE_MODERATE,
    INPUT_HIGH,
    INPUT_MODERATE,
    KERNEL_SHARE,
    LAUNCH_HIGH,
    LAUNCH_MODERATE,
    LAYOUT_CONVERSION,
    MATMUL_SHARE,
    MAX_PATHS,
    MEMORY_CAPACITY,
    OPTIMIZER_OPERATORS,
    OPTIMIZER_SHARE,
    PATHS,
    RULE,
    RULES,
    SEVERITY,
    SHARE,
    SHARE_HIGH,
    SHARE_MODERATE,
    SHARE_OF,
    SHORT_KERNEL_FRACTION,
    SIXTEEN_BIT,
    SIXTEEN_BIT_SHARE,
    SM_EFFICIENCY,
    TF32,
    WORKERS_SATURATED,
    Context,
    Finding,
    Rule,
    Severity,
    Threshold,
)
from xsp.analysis.inputs import epoch_turns, input_spans, later_epochs
from xsp.analysis.model import step_roots
from xsp.analysis.system import gc_spans, gc_time_within
from xsp.core import schema as col
from xsp.core.figures import milliseconds, three_digits
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace


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


def _top_of_each(names: list[str], weights: np.ndarray, groups: list[str]) -> list[str]:
    """:func:`_top`, but with the heaviest name of every group first (a copy of each direction),
    so that a group of a few long copies does not hide the others."""
    ranked = _top(names, weights)
    firsts: list[str] = []
    for group in sorted(set(groups)):
        members = [index for index, found in enumerate(groups) if found == group]
        best = _top([names[i] for i in members], weights[members])[:1]
        firsts += [name for name in best if name not in firsts]
    return [*firsts, *(name for name in ranked if name not in firsts)][:MAX_PATHS]


def _attributes(text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        return {}
    try:
        found = json.loads(text)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


# rules -----------------------------------------------------------------------------------------
def _input_waits(ctx: Context) -> pd.DataFrame:
    return input_spans(ctx.spans[ctx.in_steps])  # input level, or model level in older traces


def _cpus(ctx: Context) -> int:
    """The CPUs the run could use (0: not recorded)."""
    return int(ctx.metadata.get("cpus_available") or ctx.metadata.get("cpu_count") or 0)


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader settings the input waits recorded (None: not recorded, as in imported
    traces): the fewest workers, whether every wait's loader pinned memory and kept its workers,
    and the smallest prefetch factor."""

    workers: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None

    @classmethod
    def of(cls, waits: pd.DataFrame) -> LoaderSettings:
        attributes = list(map(_attributes, waits[col.ATTRIBUTES].tolist())) if col.ATTRIBUTES in waits else []

        def values(key: str, kind: type) -> list[Any]:
            return [a[key] for a in attributes if isinstance(a.get(key), kind)]

        workers = [n for n in values(col.ATTR_INPUT_WORKERS, int) if not isinstance(n, bool)]
        pinned = values(col.ATTR_INPUT_PIN_MEMORY, bool)
        persistent = values(col.ATTR_INPUT_PERSISTENT_WORKERS, bool)
        prefetch = [n for n in values(col.ATTR_INPUT_PREFETCH_FACTOR, int) if not isinstance(n, bool)]
        return cls(min(workers) if workers else None, all(pinned) if pinned else None,
                   all(persistent) if persistent else None, min(prefetch) if prefetch else None)

    def changes(self, workers: int | None, on_gpu: bool, epochs_turn: bool = True) -> list[str]:
        """The DataLoader arguments that would change something: more workers than now
        (``workers``), and with workers, keeping them across epochs (where the loop turns from
        one epoch to the next: ``epochs_turn``) and fetching further ahead; pinned memory on a
        GPU. A setting not recorded is suggested as a default to check."""
        suggested = []
        if workers is not None and (self.workers is None or workers > self.workers):
            suggested.append(f"num_workers={workers}")
        with_workers = bool(workers or self.workers)
        if on_gpu and self.pin_memory is not True:
            suggested.append("pin_memory=True")
        if with_workers and epochs_turn and self.persistent_workers is not True:
            suggested.append("persistent_workers=True")
        if with_workers and (self.prefetch_factor is None or self.prefetch_factor < PREFETCH_AHEAD):
            suggested.append(f"prefetch_factor={PREFETCH_AHEAD}")
        return suggested

    def described(self) -> str:
        """The settings recorded, as the loader's arguments (empty where none was)."""
        known = [(name, value) for name, value in (("num_workers", self.workers), ("pin_memory", self.pin_memory),
                                                   ("persistent_workers", self.persistent_workers),
                                                   ("prefetch_factor", self.prefetch_factor)) if value is not None]
        return ", ".join(f"{name}={value}" for name, value in known)


PREFETCH_AHEAD: Final = 4
"""The prefetch factor suggested where the loader's is lower (PyTorch's default is 2)."""


def suggested_workers(used: int | None, cpus: int) -> int:
    """How many DataLoader workers to try: from none, one per CPU the run could use up to 8 (4
    where the CPUs were not recorded); else twice as many as now, never more than the CPUs."""
    if not used:
        return min(cpus, 8) if cpus else 4
    return min(used * 2, cpus) if cpus else used * 2


def _workers_busy(ctx: Context) -> float | None:
    """How busy the DataLoader's workers were, on average (fetching, of their time alive); None
    where no worker was followed."""
    workers = ctx.workers
    return float(workers["busy"].mean()) if len(workers) and int(workers["batches"].sum()) else None


def _worker_fetches(ctx: Context) -> str:
    """What the DataLoader's workers were doing meanwhile, from their fetch spans (docs/processes.md):
    each batch's fetch time and how busy they were; empty where no worker was followed."""
    workers = ctx.workers
    batches = int(workers["batches"].sum()) if len(workers) else 0
    if not batches:
        return ""
    per_batch = float(workers["fetch_ms"].sum()) / batches
    return (f"; its {len(workers)} worker process{'es' if len(workers) > 1 else ''} took "
            f"{three_digits(per_batch)} ms to fetch a batch and were busy {_pct(float(workers['busy'].mean()))} "
            "of their time")


def input_bound(ctx: Context) -> Finding | None:
    waits = _input_waits(ctx)
    waited_ns = float(waits[col.DURATION_NS].sum())
    share = ctx.share(waited_ns)
    if share < INPUT_MODERATE:
        return None
    high = share >= INPUT_HIGH
    settings, cpus, on_gpu = LoaderSettings.of(waits), _cpus(ctx), bool(ctx.device())
    used = settings.workers
    suggested = suggested_workers(used, cpus)
    busy = _workers_busy(ctx)
    saturated = busy is not None and busy >= WORKERS_SATURATED
    # per-sample work already runs in the workers where there are some: it must get cheaper
    if used:
        cheaper = ("make each batch cheaper to fetch: " + (
            "move per-sample work (decoding, augmentation) onto the GPU or do it once ahead of training" if on_gpu
            else "do per-sample work (decoding, augmentation) once ahead of training, or on whole batches at once"))
    else:
        cheaper = ("move per-sample work (decoding, augmentation) into the workers or onto the GPU" if on_gpu
                   else "move per-sample work (decoding, augmentation) into the workers")
    turns_ns = float(waits[col.DURATION_NS].to_numpy(dtype=np.float64)[epoch_turns(waits)].sum())
    epochs = later_epochs(waits)
    turn = epochs is None or epochs > 0
    if used and settings.persistent_workers is False and turns_ns >= EPOCH_TURNS_SHARE * waited_ns:
        # the workers stop at each epoch's end and start again: the waits are their start-up
        advice = ("keep the workers from one epoch to the next: DataLoader(..., persistent_workers=True); "
                  f"stopping and starting them where the epochs turn ({epochs} epoch start"
                  f"{'s' if epochs != 1 else ''} after the first) "
                  f"took {milliseconds(turns_ns / 1e6)} of the {milliseconds(waited_ns / 1e6)} the loop waited")
    elif used and suggested <= used:  # more workers than CPUs only take turns: each batch must get cheaper
        changes = [change for change in settings.changes(None, on_gpu, turn)
                   if not (saturated and change.startswith("prefetch_factor"))]
        advice = (f"every CPU already runs a DataLoader worker (num_workers={used} of {cpus} CPUs): {cheaper}"
                  + (f"; and fetch further ahead: DataLoader(..., {', '.join(changes)})" if changes else ""))
    else:
        changes = settings.changes(suggested, on_gpu, turn)
        advice = (f"prepare batches ahead of the loop: DataLoader(dataset, batch_size=..., {', '.join(changes)}); "
                  f"{cheaper}" if changes else cheaper)
    if saturated and used:
        advice += f" (the workers fetched {_pct(busy or 0.0)} of their time: fetching further ahead cannot help)"
    loader = settings.described()
    return Finding(
        Severity.HIGH if high else Severity.MEDIUM, share,
        f"the loop waited for input {_pct(share)} of {ctx.time_name} ({ctx.per_step_ms(waited_ns)}): "
        f"{'highly' if high else 'moderately'} input-bound (>= {INPUT_HIGH if high else INPUT_MODERATE:.0%})"
        f"{f'; its DataLoader had {loader}' if loader else ''}{_worker_fetches(ctx)}",
        advice,
        _top(waits[col.NAME].astype(str).tolist(), waits[col.DURATION_NS].to_numpy(dtype=np.float64)))


def dataloader_workers(ctx: Context) -> Finding | None:
    waits = _input_waits(ctx)
    waited_ns = float(waits[col.DURATION_NS].sum())
    share = ctx.share(waited_ns)
    if share <= DATALOADER_SHARE:
        return None
    settings = LoaderSettings.of(waits)
    used = settings.workers
    if used is None:
        return None
    cpus = _cpus(ctx)
    if cpus and used >= cpus:
        return None  # every CPU already loads: the fix is in the input pipeline, not the worker count
    suggested = suggested_workers(used, cpus)
    changes = settings.changes(suggested, bool(ctx.device()), later_epochs(waits) != 0)
    return Finding(
        Severity.HIGH if used == 0 and share >= INPUT_HIGH else Severity.MEDIUM, share,
        f"DataLoader with num_workers={used}{f' of {cpus} CPUs' if cpus else ''}; the loop waited for it "
        f"{_pct(share)} of {ctx.time_name} (> {DATALOADER_SHARE:.0%}){_worker_fetches(ctx)}",
        f"DataLoader(dataset, ..., {', '.join(changes)})",
        _top(waits[col.NAME].astype(str).tolist()))


def gpu_idle(ctx: Context) -> Finding | None:
    usage = ctx.usage
    if not len(usage):
        return None
    window_us = float(usage["window_us"].sum())
    host_bound_us = float(usage["host_bound_idle_us"].sum())
    idle = host_bound_us / window_us if window_us > 0 else 0.0
    if idle < HOST_IDLE_MODERATE:
        return None
    devices = usage.groupby("device_id", dropna=False,
                            observed=True)["host_bound_idle_us"].sum().sort_values(ascending=False)
    return Finding(
        Severity.HIGH if idle >= HOST_IDLE_HIGH else Severity.MEDIUM, ctx.share(host_bound_us * 1e3),
        f"the GPU sat idle waiting for the host {_pct(idle)} of its active window "
        f"({milliseconds(host_bound_us / 1e3)} of {milliseconds(window_us / 1e3)}: no stream had work, and the "
        "next kernel or copy was launched only after); "
        f"busy {_pct(float(usage['busy_us'].sum()) / window_us)}",
        "take host work off the launch path: torch.compile(model, mode=\"reduce-overhead\") (CUDA graphs), keep "
        "values on the GPU instead of .item()/.cpu() in the loop, prepare inputs in DataLoader workers",
        [f"device {_plain_id(device)}" for device in devices.head(MAX_PATHS).index.tolist()])


def _plain_id(value: Any) -> str:
    return "?" if value is None or pd.isna(value) else str(int(value))


def small_kernels(ctx: Context) -> Finding | None:
    kernels = ctx.evidence.kernels
    launched = int(kernels["launched"].sum())
    if not launched:
        return None
    short = int(kernels["short"].sum())
    fraction = short / launched
    launch_share = ctx.share(float(kernels["launch_ns"].sum()))
    if fraction < SHORT_KERNEL_FRACTION or launch_share < LAUNCH_MODERATE:
        return None
    short_rows = kernels[kernels["short"] > 0]
    median_kernel_us, median_launch_us = ctx.evidence.kernel_medians_us
    return Finding(
        Severity.HIGH if launch_share >= LAUNCH_HIGH else Severity.MEDIUM,
        ctx.share(float(short_rows["short_launch_ns"].sum())),
        f"{short} of {launched} kernels ({_pct(fraction)}) ran shorter than the CPU call that "
        f"launched them (median kernel {three_digits(median_kernel_us)} us, launch "
        f"{three_digits(median_launch_us)} us); launches took {_pct(launch_share)} of {ctx.time_name}: "
        "launch-bound",
        "fuse small kernels: torch.compile(model); or capture the step in a CUDA graph "
        "(torch.compile(model, mode=\"reduce-overhead\")); or raise the batch size so each kernel does more",
        _top(_kernel_places(short_rows, "operator"), short_rows["short_launch_ns"].to_numpy(dtype=np.float64)))


def _kernel_places(kernels: pd.DataFrame, *where: str) -> list[str]:
    """Per row of :attr:`xsp.analysis.evidence.Evidence.kernels`, the first of ``where`` (its
    ``layer``, ``operator``) it has, else the kernel's name."""
    found = kernels["name"]
    for column in reversed(where):
        found = kernels[column].where(kernels[column].notna(), found)
    return [str(name) for name in found.tolist()]


def pageable_memcpy(ctx: Context) -> Finding | None:
    pageable = ctx.evidence.pageable
    if not len(pageable):
        return None
    copy_ns = float(pageable["ns"].sum())
    share = ctx.share(copy_ns)
    directions: Counter[str] = Counter()
    for direction, count in zip(pageable["direction"].tolist(), pageable["count"].tolist()):
        directions[str(direction)] += int(count)
    return Finding(
        _severity(share), share,
        f"{int(pageable['count'].sum())} copies from or to pageable host memory "
        f"({', '.join(f'{kind} x{count}' for kind, count in directions.most_common())}; "
        f"{three_digits(float(pageable['bytes'].sum()) / 1e6)} MB, "
        f"{milliseconds(copy_ns / 1e6)}): an async copy of pageable memory is staged and runs synchronously",
        "pin host memory: DataLoader(..., pin_memory=True), or x = x.pin_memory(); then "
        "x.to(\"cuda\", non_blocking=True)",
        _top_of_each(pageable["path"].astype(str).tolist(), pageable["ns"].to_numpy(dtype=np.float64),
                     pageable["direction"].astype(str).tolist()))


def blocking_sync(ctx: Context) -> Finding | None:
    calls = ctx.evidence.blocking
    if not len(calls):
        return None
    blocked_ns = float(calls["ns"].sum())
    share = ctx.share(blocked_ns)
    if share < 0.01:
        return None
    to_host = ctx.evidence.to_host_copies
    counts: Counter[str] = Counter()
    for call, count in zip(calls["call"].tolist(), calls["count"].tolist()):
        counts[str(call)] += int(count)
    per_step = f" ({three_digits(to_host / ctx.steps)} device-to-host copies per step)" \
        if ctx.steps and to_host \
        else f" ({to_host} device-to-host copies)" if to_host else ""
    return Finding(
        _severity(share), share,
        f"the host blocked {_pct(share)} of {ctx.time_name} ({milliseconds(blocked_ns / 1e6)}) in "
        f"{int(calls['count'].sum())} synchronising calls "
        f"({', '.join(f'{name} x{n}' for name, n in counts.most_common(3))}){per_step}",
        "keep values on the GPU inside the loop: accumulate with total += loss.detach() and call .item() once "
        "per logging interval; avoid torch.cuda.synchronize() and .cpu()/.tolist() on the hot path",
        _top(calls["path"].astype(str).tolist(), calls["ns"].to_numpy(dtype=np.float64)))


def _kernel_time(ctx: Context, pattern: re.Pattern[str], exclude: re.Pattern[str] | None = None) -> tuple[
        float, pd.DataFrame]:
    """The kernels whose names match ``pattern`` (not ``exclude``): their time (ns), and their rows."""
    kernels = ctx.evidence.kernels
    names = kernels["name"].astype(str)
    mask = names.str.contains(pattern).to_numpy(dtype=bool, copy=True)
    if exclude is not None:
        mask &= ~names.str.contains(exclude).to_numpy()
    chosen = kernels[mask]
    return float(chosen["duration_ns"].sum()), chosen


def _kernel_ns(ctx: Context) -> float:
    return float(ctx.evidence.kernels["duration_ns"].sum())


def no_tf32(ctx: Context) -> Finding | None:
    capability = ctx.capability()
    kernel_ns = _kernel_ns(ctx)
    if capability is None or capability < (8, 0) or kernel_ns <= 0:
        return None
    fp32_ns, fp32 = _kernel_time(ctx, FP32_MATMUL, TF32)
    fraction = fp32_ns / kernel_ns
    if fraction < FP32_MATMUL_SHARE:
        return None
    settings = "" if "tf32_matmul" not in ctx.metadata else (
        f"; torch.backends.cuda.matmul.allow_tf32={ctx.metadata['tf32_matmul']}, "
        f"cudnn.allow_tf32={ctx.metadata.get('tf32_cudnn')}")
    return Finding(
        _severity(ctx.share(fp32_ns)), ctx.share(fp32_ns),
        f"{_pct(fraction)} of kernel time is in full-fp32 matmul/convolution kernels ({int(fp32['count'].sum())} "
        f"launches, e.g. {str(fp32['name'].iloc[0])[:60]}) on a compute capability {capability[0]}.{capability[1]} "
        f"GPU whose Tensor Cores run TF32{settings}",
        "torch.backends.cuda.matmul.allow_tf32 = True; torch.backends.cudnn.allow_tf32 = True  "
        "(or torch.set_float32_matmul_precision(\"high\"))",
        _top(_kernel_places(fp32, "operator"), fp32["duration_ns"].to_numpy(dtype=np.float64)))


def no_amp(ctx: Context) -> Finding | None:
    capability = ctx.capability()
    kernel_ns = _kernel_ns(ctx)
    if capability is None or capability < (7, 0) or kernel_ns <= 0:
        return None
    matmul_ns, matmul = _kernel_time(ctx, GEMM)
    sixteen_ns, _ = _kernel_time(ctx, SIXTEEN_BIT)
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
        _top(_kernel_places(matmul, "operator"), matmul["duration_ns"].to_numpy(dtype=np.float64)))


def channels_last(ctx: Context) -> Finding | None:
    kernel_ns = _kernel_ns(ctx)
    if kernel_ns <= 0:
        return None
    converting_ns, converting = _kernel_time(ctx, LAYOUT_CONVERSION)
    fraction = converting_ns / kernel_ns
    if fraction < SHARE_MODERATE:
        return None
    return Finding(
        _severity(ctx.share(converting_ns)), ctx.share(converting_ns),
        f"{int(converting['count'].sum())} layout conversion kernels (NCHW <-> NHWC) take {_pct(fraction)} of "
        "kernel time: convolutions run in channels-last internally and convert contiguous (NCHW) tensors on every "
        "call",
        "model = model.to(memory_format=torch.channels_last); x = x.to(memory_format=torch.channels_last)",
        _top(_kernel_places(converting, "layer", "operator"), converting["duration_ns"].to_numpy(dtype=np.float64)))


def unfused_optimizer(ctx: Context) -> Finding | None:
    calls = ctx.evidence.optimizer_calls
    if not len(calls):
        return None
    optimizer_ns = float(calls["ns"].sum())
    share = ctx.share(optimizer_ns)
    if share < OPTIMIZER_SHARE:
        return None
    if not ctx.evidence.operators:
        return None  # which implementation ran is not recorded
    per_step = float(np.median(calls["operators"].to_numpy(dtype=np.int64)))
    if bool(calls["fused"].any()) or per_step < OPTIMIZER_OPERATORS:
        return None
    name = str(calls["name"].iloc[0])
    optimizer = name.split("#", 1)[1] if "#" in name else name
    optimizer = optimizer.rsplit(".", 1)[0] or "Adam"
    return Finding(
        _severity(share), share,
        f"{name} takes {_pct(share)} of {ctx.time_name} ({ctx.per_step_ms(optimizer_ns)}) and runs a median "
        f"{per_step:.0f} operators per call, none of them foreach or fused: one small operator per parameter",
        f"torch.optim.{optimizer}(model.parameters(), ..., fused=True)  (or foreach=True where fused is not "
        "supported)",
        [name])


def _grid_blocks(grids: pd.Series) -> np.ndarray:
    """Blocks in each kernel's grid (the product of its dimensions), NaN where none is known:
    read once per distinct grid."""
    codes, distinct = pd.factorize(grids)
    blocks = np.full(len(distinct) + 1, np.nan)  # the last: a missing grid (code -1)
    for index, text in enumerate(distinct.tolist()):
        if isinstance(text, str):
            numbers = [int(n) for n in re.findall(r"\d+", text)]
            if numbers:
                blocks[index] = float(np.prod(numbers))
    return blocks[codes]


def gpu_underutilized(ctx: Context) -> Finding | None:
    sms = ctx.device().get("numSms")
    kernels = ctx.evidence.kernels
    if not sms or not len(kernels):
        return None
    blocks = _grid_blocks(kernels["grid"])
    known = ~np.isnan(blocks)
    if not known.any():
        return None
    duration = kernels["duration_ns"].to_numpy(dtype=np.float64)[known]
    kernel_ns = float(duration.sum())
    if ctx.share(kernel_ns) < KERNEL_SHARE or kernel_ns <= 0:
        return None
    efficiency = float((duration * np.minimum(blocks[known] / float(sms), 1.0)).sum() / duration.sum())
    if efficiency >= SM_EFFICIENCY:
        return None
    sizes = ctx.evidence.batch_sizes
    batch = int(np.median(sizes)) if len(sizes) else None
    under = kernels[known][blocks[known] < float(sms)]
    return Finding(
        Severity.HIGH if efficiency < SM_EFFICIENCY / 2 else Severity.MEDIUM,
        ctx.share(kernel_ns * (1.0 - efficiency)),
        f"SM efficiency {efficiency:.2f} (< {SM_EFFICIENCY}): kernels weighted by time launch fewer blocks than the "
        f"GPU's {int(sms)} SMs ({int(under['count'].sum())} of {int(kernels['count'][known].sum())} kernels)"
        + (f"; batch size {batch}" if batch else ""),
        (f"raise the batch size (batch_size={batch * 2} or more, as memory allows)" if batch else
         "raise the batch size, as memory allows") + "; or serve several requests per call",
        _top(_kernel_places(under, "layer", "operator"), under["duration_ns"].to_numpy(dtype=np.float64)))


def memory_near_capacity(ctx: Context) -> Finding | None:
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
        f"peak memory on the {where} reached {_pct(used)} of its capacity ({three_digits(peak / 2**30)} of "
        f"{three_digits(total / 2**30)} GiB; > {MEMORY_CAPACITY:.0%}): a larger input or batch will not fit",
        "activation checkpointing (torch.utils.checkpoint.checkpoint(block, x)), mixed precision "
        "(torch.autocast), or a smaller batch with gradient accumulation",
        [where])


def cpu_threads(ctx: Context) -> Finding | None:
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
            f"{_pct(compute_share)} of {ctx.time_name}", f"torch.set_num_threads({cpus})", [])
    return None


def gc_pauses(ctx: Context) -> Finding | None:
    found = gc_spans(ctx.spans)
    if found.empty:
        return None
    full = found[found["generation"] == 2]
    if ctx.steps:  # what the steps in flight waited for; collections between steps delay none
        roots = step_roots(ctx.spans)
        starts, ends = roots[col.START_NS].to_numpy(), roots[col.END_NS].to_numpy()
        total_ns = float(gc_time_within(found, starts, ends).sum())
        full_ns = float(gc_time_within(full, starts, ends).sum())
    else:
        total_ns, full_ns = float(found[col.DURATION_NS].sum()), float(full[col.DURATION_NS].sum())
    share = ctx.share(total_ns)
    if share < GC_SHARE:
        return None
    return Finding(
        _severity(share, GC_MODERATE, GC_HIGH), share,
        f"garbage collections took {_pct(share)} of {ctx.time_name} (>= {GC_SHARE:.0%}), "
        f"{ctx.per_step_ms(total_ns)}"
        + (f"; full ones (generation 2), which walk every object the program keeps, {milliseconds(full_ns / 1e6)} "
           "of it" if full_ns > 0 else "")
        + "; every Python thread waits while one runs",
        "gc.freeze() once the model is built and warmed up: what exists then leaves every later collection; "
        "gc.set_threshold(...) higher collects the young generation less often",
        [])


CHECKS: Final[dict[Rule, Callable[[Context], Finding | None]]] = {
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
    Rule.GC_PAUSES: gc_pauses,
}


MIN_SHARE_AT_STAKE = 0.0005
"""A low finding with less of the time at stake (it would read "0.0%") is left out: its rule
fired, but acting on it cannot change the time (a handful of pageable copies of 0.08 ms in a
trace of seconds). Findings whose stake is not time (memory near capacity) are medium or high."""


def recommend(trace: Trace | pd.DataFrame) -> pd.DataFrame:
    """What to change, most at stake first: one row per rule that fired.

    Columns: ``rule`` (a :class:`Rule` id), ``severity`` (high, medium, low), ``share`` (the
    fraction of step time at stake), ``evidence`` (the numbers that triggered it, with the
    threshold), ``fix`` (what to change, with a code line), ``paths`` (the spans it concerns,
    largest first; a list). An empty frame says no rule fired; ``docs/recommendations.md`` says
    what each rule needs recorded.
    """
    return recommendations_of(Context(trace if isinstance(trace, Trace) else Trace(spans=trace, metadata={})))


def recommendations_of(context: Context) -> pd.DataFrame:
    """:func:`recommend` of the trace ``context`` reads (one read a window at a time gives its
    context the evidence of all its windows)."""
    rows = []
    for rule, check in CHECKS.items():
        finding = check(context)
        if finding is not None and (finding.severity is not Severity.LOW or finding.share >= MIN_SHARE_AT_STAKE):
            rows.append({RULE: rule.value, SEVERITY: finding.severity.value, SHARE: float(finding.share),
                         EVIDENCE: finding.evidence, FIX: finding.fix, PATHS: finding.paths,
                         "_rank": finding.severity.rank})
    if not rows:
        return pd.DataFrame({name: pd.Series(dtype=object if name != SHARE else np.float64) for name in COLUMNS})
    frame = pd.DataFrame(rows).sort_values(["_rank", SHARE], ascending=[True, False], kind="stable")
    frame = frame[list(COLUMNS)].reset_index(drop=True)
    frame.attrs[SHARE_OF] = context.time_name
    return frame


__all__ = ["Rule", "Severity", "Threshold", "RULES", "recommend", "recommendations_of"]
