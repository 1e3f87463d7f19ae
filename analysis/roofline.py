"""FLOPs, DRAM bytes, arithmetic intensity and the roofline, per kernel, layer and model.

Peak figures are the vendors' datasheet numbers (dense, no structured sparsity):

* V100 SXM2: NVIDIA Tesla V100 datasheet (2020): 15.7 TFLOP/s FP32, 125 TFLOP/s tensor, 900 GB/s.
* A100 40 GB / 80 GB SXM: NVIDIA A100 datasheet (2021): 19.5 TFLOP/s FP32, 312 TFLOP/s FP16/BF16
  tensor; 1,555 GB/s (40 GB HBM2) and 2,039 GB/s (80 GB HBM2e).
* H100 SXM: NVIDIA H100 datasheet (2023): 67 TFLOP/s FP32, 989 TFLOP/s FP16/BF16 tensor, 3.35 TB/s.
* H200 SXM: NVIDIA H200 datasheet (2024): 67 TFLOP/s FP32, 989 TFLOP/s FP16/BF16 tensor, 4.8 TB/s.
* L4: NVIDIA L4 datasheet (2023): 30.3 TFLOP/s FP32, 121 TFLOP/s FP16 tensor, 300 GB/s.
* T4: NVIDIA T4 datasheet (2019): 8.1 TFLOP/s FP32, 65 TFLOP/s FP16 tensor, 320 GB/s.
* A10: NVIDIA A10 datasheet (2021): 31.2 TFLOP/s FP32, 125 TFLOP/s FP16 tensor, 600 GB/s.
* RTX 3090: NVIDIA Ampere GA102 whitepaper: 35.6 TFLOP/s FP32, 71 TFLOP/s FP16 tensor
  (FP32 accumulate), 936 GB/s.
* RTX 4090: NVIDIA Ada Lovelace architecture whitepaper: 82.6 TFLOP/s FP32, 165.2 TFLOP/s FP16
  tensor (FP32 accumulate), 1,008 GB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from xsp.analysis.model import model_latency, spans_of
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.io.trace import Trace
from xsp.table.walks import parent_positions, ranges, sum_into_ancestors


@dataclass(frozen=True)
class GpuPeak:
    name: str
    fp32_tflops: float
    tensor_tflops: float
    memory_gb_s: float

    def ridge_point(self, tensor: bool = False) -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory to compute bound."""
        return (self.tensor_tflops if tensor else self.fp32_tflops) * 1e12 / (self.memory_gb_s * 1e9)


GPU_PEAKS: dict[str, GpuPeak] = {peak.name: peak for peak in (
    GpuPeak("V100", 15.7, 125.0, 900.0),
    GpuPeak("A100-40GB", 19.5, 312.0, 1555.0),
    GpuPeak("A100-80GB", 19.5, 312.0, 2039.0),
    GpuPeak("H100", 67.0, 989.0, 3350.0),
    GpuPeak("H200", 67.0, 989.0, 4800.0),
    GpuPeak("L4", 30.3, 121.0, 300.0),
    GpuPeak("T4", 8.1, 65.0, 320.0),
    GpuPeak("A10", 31.2, 125.0, 600.0),
    GpuPeak("RTX 3090", 35.6, 71.0, 936.0),
    GpuPeak("RTX 4090", 82.6, 165.2, 1008.0),
)}


def peak_for(device: str, memory_bytes: int | None = None) -> GpuPeak | None:
    """The peak figures of a device name as CUDA reports it (``Tesla V100-SXM2-32GB``...)."""
    text = device.upper()
    if "A100" in text:
        large = (memory_bytes or 0) > 60e9 or "80GB" in text
        return GPU_PEAKS["A100-80GB" if large else "A100-40GB"]
    for key, name in _NAME_KEYS.items():
        if re.search(rf"(^|[^0-9A-Z]){key}([^0-9A-Z]|$)", text):
            return GPU_PEAKS[name]
    return None


_NAME_KEYS = {"H200": "H200", "H100": "H100", "V100": "V100", "L4": "L4", "T4": "T4", "A10": "A10",
              "3090": "RTX 3090", "4090": "RTX 4090"}


def trace_peak(trace: Trace) -> GpuPeak | None:
    """The peak of the (first) GPU a trace was recorded on, when it is in the table."""
    for properties in trace.metadata.get("device_properties") or []:
        peak = peak_for(str(properties.get("name", "")), properties.get("totalGlobalMem"))
        if peak is not None:
            return peak
    return peak_for(str(trace.metadata.get("device", "")))


def counter_samples_and_kernels(spans: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What :func:`counters_per_kernel` shares: the GPU's sampled counters (the ``gpu_metrics``
    level's ``counters`` spans), and the kernels they are shared among."""
    level, kind = spans[col.LEVEL], spans[col.KIND]
    return (spans[((level == Level.GPU_METRICS.value) & (kind == SpanKind.COUNTERS.value)).to_numpy(dtype=bool)],
            spans[((level == Level.KERNEL.value) & (kind == SpanKind.KERNEL.value)).to_numpy(dtype=bool)])


def counters_per_kernel(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """FLOPs and DRAM bytes of each kernel, shared out of the GPU's sampled counters.

    Each ``gpu_metrics`` sample (a ``counters`` span covering one sampling interval on one
    device) is divided among the kernels that ran on that device during it, in proportion
    to the time each ran inside the interval; a sample during which no kernel ran is left
    out (its counts are not any kernel's).

    Columns: ``span_id``, ``name``, ``flops``, ``dram_bytes`` (floats; one row per kernel
    that overlapped a sample).
    """
    samples, kernels = counter_samples_and_kernels(spans_of(source))
    empty = pd.DataFrame({"span_id": pd.Series(dtype="int64"), "name": pd.Series(dtype="object"),
                          "flops": pd.Series(dtype="float64"), "dram_bytes": pd.Series(dtype="float64")})
    if samples.empty or kernels.empty:
        return empty
    pieces = []
    sample_device = samples[col.DEVICE_ID].fillna(-1).to_numpy(dtype=np.int64)
    kernel_device = kernels[col.DEVICE_ID].fillna(-1).to_numpy(dtype=np.int64)
    for device in np.unique(sample_device).tolist():
        mine = samples[sample_device == device].sort_values(col.START_NS)
        runs = kernels[kernel_device == device]
        if runs.empty:
            continue
        s_start, s_end = mine[col.START_NS].to_numpy(np.int64), mine[col.END_NS].to_numpy(np.int64)
        k_start, k_end = runs[col.START_NS].to_numpy(np.int64), runs[col.END_NS].to_numpy(np.int64)
        # samples are consecutive, non-overlapping intervals: each kernel meets a contiguous run of them
        first = np.searchsorted(s_end, k_start, side="right")
        last = np.searchsorted(s_start, k_end, side="left")
        count = np.maximum(last - first, 0)
        kernel_of = np.repeat(np.arange(len(runs)), count)
        sample_of = ranges(first, count)
        overlap = (np.minimum(k_end[kernel_of], s_end[sample_of])
                   - np.maximum(k_start[kernel_of], s_start[sample_of])).clip(min=0).astype(np.float64)
        busy = np.bincount(sample_of, weights=overlap, minlength=len(mine))
        share = np.divide(overlap, busy[sample_of], out=np.zeros_like(overlap), where=busy[sample_of] > 0)
        flops = mine[col.FLOPS].astype("float64").to_numpy(na_value=np.nan)
        dram = mine[col.BYTES].astype("float64").to_numpy(na_value=np.nan)
        pieces.append(pd.DataFrame({
            "row": kernel_of, "flops": flops[sample_of] * share, "dram_bytes": dram[sample_of] * share,
        }).groupby("row", sort=True, observed=True).sum(min_count=1).assign(
            span_id=lambda f, r=runs: r[col.SPAN_ID].to_numpy()[f.index],
            name=lambda f, r=runs: r[col.NAME].to_numpy(dtype=object)[f.index]))
    if not pieces:
        return empty
    return pd.concat(pieces, ignore_index=True)[["span_id", "name", "flops", "dram_bytes"]]


def kernel_roofline(trace: Trace, peak: GpuPeak | None = None) -> pd.DataFrame:
    """FLOPs, DRAM bytes, intensity and achieved FLOP/s per kernel name.

    FLOPs come from hardware-counter ranges (``counters`` spans, matched to kernels by name),
    from the ``flops`` column of kernels, or from sampled GPU counters (the ``gpu_metrics``
    level, shared among kernels by :func:`counters_per_kernel`); DRAM bytes from the
    ``bytes`` column or the sampled counters. Durations
    always come from kernel spans, never from counter ranges (counter collection replays
    kernels, which distorts their time).

    Columns: ``name``, ``count``, ``flops``, ``dram_bytes``, ``kernel_us``,
    ``arithmetic_intensity``, ``achieved_tflops``, ``bound`` (memory/compute by the ridge point,
    empty when unknown), ``ridge_point``.
    """
    return kernel_roofline_of(roofline_sums(trace.spans), counters_per_kernel(trace.spans),
                              peak or trace_peak(trace))


ROOFLINE_SUMS = ["kernels", "kernel_ns", "flops", "dram_bytes", "counter_flops", "counters"]
"""What :func:`roofline_sums` adds up per kernel name (missing: no such span in the part)."""


def roofline_sums(spans: pd.DataFrame) -> pd.DataFrame:
    """Per kernel name (``name``), the sums :func:`kernel_roofline` is made of: its kernels'
    count, time, ``flops`` and ``bytes`` (``kernels``, ``kernel_ns``, ``flops``, ``dram_bytes``)
    and its counter ranges' FLOPs and count (``counter_flops``, ``counters``). The sums of parts
    of a trace, added up by name (``min_count=1``), are the whole trace's."""
    counters = spans[(spans[col.KIND] == SpanKind.COUNTERS.value) & spans[col.FLOPS].notna()]
    kernels = spans[(spans[col.LEVEL] == Level.KERNEL.value) & (spans[col.KIND] == SpanKind.KERNEL.value)]
    per_name = kernels.groupby(col.NAME, observed=True).agg(
        kernels=(col.DURATION_NS, "size"), kernel_ns=(col.DURATION_NS, "sum"), flops=(col.FLOPS, "sum"),
        dram_bytes=(col.BYTES, "sum")).astype("float64")
    counted = counters.groupby(col.NAME, observed=True).agg(
        counter_flops=(col.FLOPS, "sum"), counters=(col.FLOPS, "size")).astype("float64")
    table = per_name.join(counted, how="outer")
    table.index = table.index.astype(object)
    return table.rename_axis("name").reset_index()[["name", *ROOFLINE_SUMS]]


def roofline_sums_added(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """The :func:`roofline_sums` of parts of a trace, as one table (a name's missing in every part
    stays missing)."""
    if not parts:
        return pd.DataFrame({"name": pd.Series(dtype=object), **{name: pd.Series(dtype=np.float64)
                                                                  for name in ROOFLINE_SUMS}})
    every = pd.concat(parts, ignore_index=True)
    return every.groupby("name", sort=False, observed=True)[ROOFLINE_SUMS].sum(min_count=1).reset_index()


def kernel_roofline_of(sums: pd.DataFrame, sampled: pd.DataFrame, peak: GpuPeak | None) -> pd.DataFrame:
    """:func:`kernel_roofline`'s table of its :func:`roofline_sums` (of every part of a trace:
    :func:`roofline_sums_added`), :func:`counters_per_kernel` and the GPU's peak."""
    sums = sums.set_index("name")
    names = sorted(sums.index)
    sums = sums.reindex(names)
    table = pd.DataFrame(index=pd.Index(names, name="name", dtype=object))
    table["count"] = sums["kernels"].fillna(sums["counters"]).astype("Int64")
    table["flops"] = sums["flops"].replace(0, np.nan).fillna(sums["counter_flops"])
    table["dram_bytes"] = sums["dram_bytes"].replace(0, np.nan)
    if not sampled.empty:
        by_name = sampled.groupby("name", observed=True)[["flops", "dram_bytes"]].sum(min_count=1).reindex(names)
        table["flops"] = table["flops"].fillna(by_name["flops"].replace(0, np.nan))
        table["dram_bytes"] = table["dram_bytes"].fillna(by_name["dram_bytes"].replace(0, np.nan))
    table["kernel_us"] = sums["kernel_ns"] / 1e3
    table["arithmetic_intensity"] = table["flops"] / table["dram_bytes"]
    table["achieved_tflops"] = table["flops"] / (table["kernel_us"] * 1e6)
    ridge = peak.ridge_point() if peak else np.nan
    table["ridge_point"] = ridge
    bound = np.where(table["arithmetic_intensity"] < ridge, "memory", "compute")
    table["bound"] = np.where(table["arithmetic_intensity"].notna() & np.isfinite(ridge), bound, "")
    return table.reset_index()


def counted_spans(spans: pd.DataFrame) -> np.ndarray:
    """Rows whose ``flops``/``bytes`` are counted, from one source only (no double counting):
    the ``flops`` level's operators if the trace has them, else kernels and counter ranges, else
    operators (a PyTorch profiler trace recorded ``with_flops``)."""
    has = spans[col.FLOPS].notna().to_numpy() | spans[col.BYTES].notna().to_numpy()
    levels = spans[col.LEVEL].to_numpy(dtype=object)
    for mask in (levels == Level.FLOPS.value, levels == Level.KERNEL.value, levels == Level.OPERATOR.value):
        if (has & mask).any():
            return np.flatnonzero(has & mask)
    return np.zeros(0, dtype=np.int64)


LAYER_FLOPS_SUMS = ["calls", "flops", "bytes", "duration_ns"]


def layer_flops_sums(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """What :func:`layer_flops` adds up per layer name: ``calls``, ``flops``, ``bytes`` and
    ``duration_ns`` (0 where none was known). Made of whole trees each, these tables added up by
    name are the whole trace's."""
    spans = spans_of(source)
    layers = np.flatnonzero((spans[col.LEVEL] == Level.LAYER.value).to_numpy())
    flops = spans[col.FLOPS].astype("float64").to_numpy(na_value=np.nan)
    moved = spans[col.BYTES].astype("float64").to_numpy(na_value=np.nan)
    own = ~np.isnan(flops[layers])
    total_flops, total_bytes = np.zeros(len(spans)), np.zeros(len(spans))
    rows = counted_spans(spans)
    if len(rows) and not own.all():
        is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy()
        total_flops, total_bytes = sum_into_ancestors(parent_positions(spans), rows, flops, moved, only=is_layer)
    layer_flops_ = np.where(own, flops[layers], total_flops[layers])
    layer_bytes = np.where(~np.isnan(moved[layers]), moved[layers], total_bytes[layers])
    frame = pd.DataFrame({"name": spans[col.NAME].to_numpy(dtype=object)[layers], "flops": layer_flops_,
                          "bytes": layer_bytes, "duration_ns": spans[col.DURATION_NS].to_numpy()[layers]})
    return frame.groupby("name", observed=True).agg(calls=("duration_ns", "size"), flops=("flops", "sum"),
                                                     bytes=("bytes", "sum"),
                                                     duration_ns=("duration_ns", "sum")).reset_index()


def layer_flops_of(sums: pd.DataFrame) -> pd.DataFrame:
    """:func:`layer_flops` from :func:`layer_flops_sums` (added up by name, in name order)."""
    grouped = sums.copy()
    grouped["flops"] = grouped["flops"].replace(0, np.nan)
    grouped["bytes"] = grouped["bytes"].replace(0, np.nan)
    grouped["flops_per_call"] = grouped["flops"] / grouped["calls"]
    grouped["duration_us"] = grouped.pop("duration_ns").astype("float64") / 1e3
    grouped["achieved_tflops"] = grouped["flops"] / (grouped["duration_us"] * 1e6)
    grouped["arithmetic_intensity"] = grouped["flops"] / grouped["bytes"]
    columns = ["name", "calls", "flops", "flops_per_call", "bytes", "duration_us", "achieved_tflops",
               "arithmetic_intensity"]
    return grouped[columns].sort_values("flops", ascending=False, na_position="last").reset_index(drop=True)


def layer_flops(source: Trace | pd.DataFrame) -> pd.DataFrame:
    """FLOPs and bytes per layer: the layer span's own figures, or those of the operators
    (the ``flops`` level) or kernels below it, each counted in every layer that encloses it.

    Columns: ``name``, ``calls``, ``flops`` (all calls), ``flops_per_call``, ``bytes``,
    ``duration_us``, ``achieved_tflops``, ``arithmetic_intensity``.
    """
    return layer_flops_of(layer_flops_sums(source))


def model_flops(trace: Trace) -> pd.DataFrame:
    """FLOPs per step (from :func:`counted_spans`), with achieved FLOP/s over the step.

    Columns: ``step``, ``flops``, ``latency_ms``, ``achieved_tflops``, ``peak_tflops``,
    ``fraction_of_peak``.
    """
    spans = trace.spans
    peak = trace_peak(trace)
    counted = spans.iloc[counted_spans(spans)]
    counted = counted[counted[col.FLOPS].notna()]
    per_step = counted.groupby(col.STEP, observed=True)[col.FLOPS].sum().astype("float64")
    latency = model_latency(trace).set_index("step")["latency_ms"]
    out = pd.DataFrame({"flops": per_step}).join(latency, how="outer").reset_index().rename(columns={"index": "step"})
    out["achieved_tflops"] = out["flops"] / (out["latency_ms"] * 1e9)
    out["peak_tflops"] = peak.fp32_tflops if peak else np.nan
    out["fraction_of_peak"] = out["achieved_tflops"] / out["peak_tflops"]
    return out
