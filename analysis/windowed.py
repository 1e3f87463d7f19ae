"""The report's tables of a trace too large to load, read a window of whole trees at a time
(:class:`xsp.io.tree_windows.TreeWindows`), each equal to the table of the trace loaded whole:

* the span counts per level;
* the steps' latency (:func:`xsp.analysis.model_latency`, :func:`xsp.analysis.model_summary`):
  they read only the steps' roots, the model calls, torch.compile's spans and the waits for
  input, which are kept from each window (few: a handful a step) and analysed together;
* the operators by self time over the steps' work (:func:`xsp.analysis.operator_table` of the
  spans :func:`xsp.analysis.model.within_steps` keeps, the steps' times known beforehand; of an
  always-on trace, the spans of its steps recorded deep, known beforehand too), and what ran
  outside every step;
* the layers, backward time per forward layer, FLOPs per layer and per kernel, memory per layer
  type and a leveled experiment's check of its top-level layers, over the same spans, each added
  up by its key (memory's live bytes and backward's join by DuckDB, as below);
* how much of the session the steps cover, where their time went and the user's spans
  (:func:`xsp.analysis.step_coverage`, :func:`xsp.analysis.step_summary`,
  :func:`xsp.analysis.user_spans`: the session's spans, the user's model-level spans and each
  window's :func:`xsp.analysis.steps.part_times` kept, the trace's extent known);
* the system level's samples (kept: one a metric every interval) and garbage collections (kept:
  :func:`xsp.analysis.gc_collections`, and the recommendation about them, read all of them);
* the kernels by name (:func:`xsp.analysis.kernels_by_name`), kernel time per operator, copies,
  synchronisation and launch overhead per step, each added up by its key;
* the GPU's busy and idle time per step and device (:func:`xsp.analysis.gpu_utilization`): its
  activities' times are written to a scratch file, and DuckDB sweeps them in the order of their
  starts (a step's activities can lie in several windows);
* the roofline's share of the GPU's sampled counters (:func:`xsp.analysis.counters_per_kernel`):
  the samples and the kernels are written to scratch files, and DuckDB shares each sample among
  the kernels that ran during it;
* an always-on trace's steps that its leveled runs recorded (known from a first reading), kept
  whole up to :data:`LEVELED_MEMORY_BYTES`, for :func:`xsp.session.rotation.leveled_over_steps`.

Each window's table is made by the function the whole trace's is, and the tables are added up by
name: counts and times summed, means and shares made again, and names in the order they first
ran, so that equal times are listed as the whole trace lists them.
"""

from __future__ import annotations

import enum
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import pyarrow as pa

from xsp.analysis.distributed import (
    OVERLAP_COLUMNS,
    collectives,
    compute_intervals,
    computing,
    lateness,
    offsets_of,
    rank_steps_of,
    step_bounds,
    step_collectives,
)
from xsp.analysis.evidence import Evidence, added_evidence, evidence_of
from xsp.analysis.findings import Context
from xsp.analysis.gpu import (
    GPU_VS_CPU_KEYS,
    GPU_VS_CPU_SUMS,
    UTILIZATION_COLUMNS,
    CaptureSites,
    activity_times,
    capture_site_parts,
    capture_sites,
    gpu_vs_cpu_per_layer,
    gpu_vs_cpu_sums,
    kernel_table,
    kernels_by_name,
    launch_overhead_of,
    launch_sums,
    memory_operations,
    replay_sums,
    replay_sums_added,
    replay_table_of,
    replayed_layers,
    synchronization,
    whole_ns,
)
from xsp.analysis.in_order import PLACE, InOrderParts, grouped_in_order
from xsp.analysis.layers import (
    LAYER_KEYS,
    LAYER_SUMS,
    MODULE_KEYS,
    MODULE_SUMS,
    TopLevelLayers,
    layer_sums,
    layer_table,
    module_sums,
    top_level_layers,
)
from xsp.analysis.memory import ForwardMemory, forward_memory, memory_type_table
from xsp.analysis.model import OutsideSteps, outside_steps, step_extents, within_steps
from xsp.analysis.operators import BackwardParts, backward_parts, backward_table_of, operator_table
from xsp.analysis.recommend import recommendations_of
from xsp.analysis.roofline import (
    LAYER_FLOPS_SUMS,
    counter_samples_and_kernels,
    kernel_roofline_of,
    layer_flops_sums,
    roofline_sums,
    roofline_sums_added,
    trace_peak,
)
from xsp.analysis.steps import part_times
from xsp.core import schema as col
from xsp.core.errors import duckdb_interrupts, first_line, imported_duckdb
from xsp.core.schema import Level, SpanKind
from xsp.io.outputs import OutputError
from xsp.io.spill_file import SpillFile
from xsp.io.trace import Trace
from xsp.io.tree_windows import TreeWindows, scratch_folder
from xsp.record.compiled_kernels import kernel_layers
from xsp.table.build import concat_spans, empty_table
from xsp.table.sampling import deep_roots
from xsp.table.sampling import step_roots as step_root_positions

KEPT_KINDS = (SpanKind.PREDICT.value, SpanKind.COMPILE.value, SpanKind.INPUT.value, SpanKind.SESSION.value,
              SpanKind.FETCH.value)
"""The kinds of span kept from every window, beside the steps' roots, the backward passes, the
user's model-level spans and the system level's samples and garbage collections: the steps'
latency, the session's time and the recommendations about input, threads and collections read
them."""
_Found = TypeVar("_Found")
SWEEP_MEMORY_MB = 512
"""DuckDB's memory for the sweep of the GPU's activities (it spills beyond it)."""
LEVELED_MEMORY_BYTES = 1 << 30
"""The most an always-on trace's leveled steps may take, held and merged over their leveled runs
(:class:`WindowedReport` ``leveled_steps``): more, and that table is left out."""
LEVELED_BYTES_PER_SPAN = 2_000
"""What a span of those steps takes, held and merged: 480 bytes held and 1,300 more at the merge's
peak, measured on an always-on trace of 92,561 spans."""


class LeftOut(str, enum.Enum):
    """A section of the report of a trace loaded whole that :func:`windowed_report` does not make,
    in the report's order."""

    ALWAYS_ON = "the always-on layers leveled over the drawn steps (more spans than this report holds)"


def _ordered(found: set[LeftOut]) -> list[LeftOut]:
    return [member for member in LeftOut if member in found]


@dataclass
class WindowedReport:
    """What :func:`windowed_report` found (see the module's text)."""

    metadata: dict[str, Any]
    spans: int
    steps: list[int]
    level_counts: dict[str, int]
    """Spans per level."""
    kept: Trace
    """The steps' roots, model calls, compiles, input waits, session spans, the user's
    model-level spans and the system level's samples and garbage collections, in the order
    :func:`xsp.load` gives them:
    :func:`xsp.analysis.model_latency` of it is the whole trace's."""
    extent_ns: tuple[int, int] | None
    """The first start and last end of every span (None: no span)."""
    recommendations: pd.DataFrame
    """:func:`xsp.analysis.recommend` of the whole trace."""
    left_out: list[LeftOut]
    """The sections of the report of the trace loaded whole that this trace has and these tables
    do not make."""
    backward: pd.DataFrame
    """:func:`xsp.analysis.backward_time_per_layer` of the steps' work."""
    layer_flops: pd.DataFrame | None
    """:func:`xsp.analysis.layer_flops_sums` of the whole trace (None: it has no layers)."""
    communication: RankCommunication | None
    """The communication of one rank's file of a distributed job (None: not such a file)."""
    layers: LayerSums
    """The layers of the steps' work (of the whole trace where it has no steps; of an always-on
    trace's steps recorded deep)."""
    parts: pd.DataFrame
    """:func:`xsp.analysis.steps.part_times` of the whole trace."""
    operators: pd.DataFrame
    """:func:`xsp.analysis.operator_table` of the steps' work (of the whole trace where it has no steps;
    of an always-on trace's steps recorded deep)."""
    operators_outside: OutsideSteps | None
    """The operators outside every step (None where the trace has no steps, or none ran outside)."""
    kernels: pd.DataFrame
    """:func:`xsp.analysis.kernels_by_name` of the whole trace."""
    kernels_per_operator: pd.DataFrame
    """:func:`xsp.analysis.kernel_time_per_operator` of the whole trace (a replayed kernel counts on
    the operator that captured its node, which another window can hold)."""
    graph_replays: pd.DataFrame
    """:func:`xsp.analysis.gpu.replay_table_of` the whole trace's CUDA graph replays."""
    utilization: pd.DataFrame
    """:func:`xsp.analysis.gpu_utilization` of the whole trace, per step and device."""
    memory: pd.DataFrame
    """:func:`xsp.analysis.memory_operations` of the whole trace."""
    synchronization: pd.DataFrame
    """:func:`xsp.analysis.synchronization` of the whole trace."""
    launch: pd.DataFrame
    """:func:`xsp.analysis.launch_overhead` of the whole trace."""
    top_level: TopLevelLayers | None
    """:func:`xsp.analysis.layers.top_level_layers` of the whole trace, for a leveled trace's
    table (None: the trace is not leveled)."""
    roofline: pd.DataFrame
    """:func:`xsp.analysis.kernel_roofline` of the whole trace."""
    layer_memory: pd.DataFrame
    """:func:`xsp.analysis.memory_by_layer_type` of the steps' work (as :attr:`layers` counts it)."""
    leveled_steps: Trace | None = None
    """An always-on trace's steps that its leveled runs recorded, every span numbered with one of
    them, in the loaded order: what :func:`xsp.session.rotation.leveled_over_steps` merges, to the
    whole trace's figures (None: not always on, no step drawn, or more than
    :data:`LEVELED_MEMORY_BYTES` takes: then :attr:`left_out` says so)."""


def windowed_report(windows: TreeWindows) -> WindowedReport:
    """The report's tables of the trace ``windows`` reads, in one reading of the file (and a
    first one of the steps' roots' columns). DuckDB sweeps the GPU's activities in a scratch
    folder beside the trace (:func:`xsp.io.tree_windows.scratch_folder`), removed after.

    Raises:
        TraceFormatError: the file is corrupt.
        OutputError: the sweep ran out of memory or of scratch space.
    """
    known = _steps_known(windows)
    extents, deep_steps = known.extents, known.deep_steps
    sites = _capture_sites(windows) if known.graph_nodes else None
    replays: list[pd.DataFrame] = []
    levels: Counter[str] = Counter()
    kept: list[pd.DataFrame] = []
    kept_order: list[np.ndarray] = []
    parts: list[pd.DataFrame] = []
    operators = InOrderParts(["name"], OPERATOR_SUMS)
    kernels = InOrderParts(["name"], KERNEL_SUMS, smallest=["min_us"], largest=["max_us"])
    per_operator = InOrderParts(["name"], PER_OPERATOR_SUMS)
    kernel_ns = 0.0
    memory: list[pd.DataFrame] = []
    sync: list[pd.DataFrame] = []
    launch: list[pd.DataFrame] = []
    outside: list[np.ndarray] = []
    evidence: list[Evidence] = []
    first_ns, last_ns = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    extent = [np.iinfo(np.int64).max, np.iinfo(np.int64).min]
    has_steps = not extents.empty  # as the recommendations' context counts steps: by their roots
    layers = _Layers()
    flops: list[pd.DataFrame] = []
    roofline: list[pd.DataFrame] = []
    top_level = TopLevelLayers(0, 0)
    leveled = bool(windows.metadata.get("leveled"))
    left_out: set[LeftOut] = set()
    leveled_steps = known.leveled_steps
    if leveled_steps is not None and known.leveled_spans * LEVELED_BYTES_PER_SPAN > LEVELED_MEMORY_BYTES:
        left_out.add(LeftOut.ALWAYS_ON)
        leveled_steps = None
    on_leveled_steps: list[pd.DataFrame] = []
    on_leveled_order: list[np.ndarray] = []
    with tempfile.TemporaryDirectory(prefix=".xsp-report-", dir=scratch_folder(windows.source)) as scratch:
        activities = _Activities(Path(scratch), has_steps)
        backward = _Backward(Path(scratch))
        # one rank's file of a job: its communication (a file of several ranks is reported loaded whole)
        communication = _Communication(Path(scratch)) if windows.metadata.get("distributed") else None
        # the live bytes count every memory event: written only where some layer can own one
        layer_memory = _LayerMemory(Path(scratch)) if known.forward_layers else None
        sampled = _SampledCounters(Path(scratch))
        for spans, order in windows.frames():
            levels.update(spans[col.LEVEL].dropna().astype(str).tolist())
            if len(spans):
                extent = [min(extent[0], int(spans[col.START_NS].min())), max(extent[1], int(spans[col.END_NS].max()))]
            wanted = _kept_rows(spans)
            if wanted.any():
                kept.append(_own_rows(spans[wanted]))
                kept_order.append(order[wanted])
            if leveled_steps is not None:
                wanted = np.isin(spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan), leveled_steps)
                if wanted.any():
                    on_leveled_steps.append(_own_rows(spans[wanted]))
                    on_leveled_order.append(order[wanted])
            parts.append(part_times(spans))
            kernels.add(_by_name(kernels_by_name(spans), _first_places(spans, order, _is_kind(spans, SpanKind.KERNEL)),
                                 KERNEL_SUMS, ["min_us"], ["max_us"]))
            table = kernel_table(spans, sites)
            kernel_ns += float(whole_ns(table["duration_us"]).sum())
            if sites is not None:
                replays = [replay_sums_added(replays)] if len(replays) > 64 else replays
                replays.append(replay_sums(replayed_layers(spans, sites)))
            sampled.add(spans)
            per_operator.add(_by_name(*_kernels_per_operator(table, spans, order), PER_OPERATOR_SUMS))
            launch.append(launch_sums(table))
            memory.append(memory_operations(spans))
            sync.append(synchronization(spans))
            activities.add(activity_times(spans))
            if communication is not None:
                communication.add(spans)
            in_steps = spans[col.STEP].notna().to_numpy(dtype=bool) if has_steps else np.ones(len(spans), dtype=bool)
            evidence.append(evidence_of(spans, in_steps, order, table))
            if len(evidence) > 64:  # a long trace: its evidence added up as it goes
                evidence = [added_evidence(evidence)]
            if windows.steps:
                within = within_steps(spans, extents)
                if within.any():
                    first_ns = min(first_ns, int(spans[col.START_NS].to_numpy()[within].min()))
                    last_ns = max(last_ns, int(spans[col.END_NS].to_numpy()[within].max()))
                operator = (spans[col.LEVEL] == Level.OPERATOR.value).to_numpy(dtype=bool) & ~within
                outside.append(np.column_stack([spans[col.START_NS].to_numpy(dtype=np.int64)[operator],
                                                spans[col.END_NS].to_numpy(dtype=np.int64)[operator]]))
                # the steps' work; an always-on trace's, of its steps recorded deep (whose roots other
                # windows can hold): the spans numbered with one of them
                chosen = within if deep_steps is None else np.isin(
                    spans[col.STEP].to_numpy(dtype=np.float64, na_value=np.nan), deep_steps)
                view = spans[chosen].reset_index(drop=True)
                view_order = order[chosen]
            else:
                view, view_order = spans, order
            is_operator = ((view[col.LEVEL] == Level.OPERATOR.value) & (view[col.KIND] == SpanKind.OPERATOR.value))
            places = _first_places(view, view_order, is_operator.to_numpy(dtype=bool))
            operators.add(_by_name(operator_table(view), places, OPERATOR_SUMS))
            layers.add(Trace(spans=view, metadata=windows.metadata), view_order)
            if layer_memory is not None and (spans[col.LEVEL] == Level.MEMORY.value).any():
                layer_memory.add(forward_memory(view), view_order)
            backward.add(backward_parts(view, view_order))
            roofline = [roofline_sums_added(roofline)] if len(roofline) > 64 else roofline
            roofline.append(roofline_sums(spans))
            if leveled:
                top_level += top_level_layers(spans)
            if (spans[col.LEVEL] == Level.LAYER.value).any():
                flops = _flops_added([*flops, layer_flops_sums(spans)]) if len(flops) > 64 else [
                    *flops, layer_flops_sums(spans)]
        utilization, in_step_usage, medians = activities.swept()
        kept_trace = _in_loaded_order(kept, kept_order, windows.metadata)
        backward_table = backward.result()
        ranks = communication.result(kept_trace) if communication is not None else None
        by_type = layer_memory.result() if layer_memory is not None else memory_type_table(pd.DataFrame())
        counters = sampled.result()
    extent_ns = (extent[0], extent[1]) if extent[0] <= extent[1] else None
    context = Context(kept_trace, extent_ns, replace(added_evidence(evidence), kernel_medians_us=medians),
                      in_step_usage)
    return WindowedReport(
        metadata=windows.metadata, spans=windows.spans, steps=windows.steps, level_counts=dict(levels),
        kept=kept_trace, extent_ns=extent_ns, recommendations=recommendations_of(context),
        layers=layers.result(), communication=ranks, backward=backward_table,
        left_out=_ordered(left_out),
        leveled_steps=None if leveled_steps is None else _in_loaded_order(on_leveled_steps, on_leveled_order,
                                                                           windows.metadata),
        layer_flops=_flops_added(flops)[0] if flops else None,
        parts=pd.concat(parts, ignore_index=True) if parts else part_times(empty_table()),
        operators=_operator_figures(_named(operators.result(), OPERATOR_SUMS)),
        operators_outside=_outside(outside, first_ns, last_ns) if windows.steps else None,
        kernels=_kernel_figures(_named(kernels.result(), KERNEL_SUMS)),
        kernels_per_operator=_per_operator_figures(_named(per_operator.result(), PER_OPERATOR_SUMS), kernel_ns / 1e3),
        graph_replays=replay_table_of(replay_sums_added(replays)),
        utilization=utilization, memory=_memory_figures(memory), synchronization=_sync_figures(sync),
        launch=_launch_figures(launch), layer_memory=by_type,
        top_level=top_level if leveled else None,
        roofline=kernel_roofline_of(roofline_sums_added(roofline), counters, trace_peak(kept_trace)))


@dataclass
class LayerSums:
    """The layers' sums of a trace read a window at a time."""

    layers: pd.DataFrame
    """:func:`xsp.analysis.layer_sums`."""
    modules: pd.DataFrame
    """:func:`xsp.analysis.module_sums`."""
    compiled_calls: int
    """Calls of layers inside compiled code (:func:`xsp.analysis.layer_table`'s ``compiled``)."""
    gpu_vs_cpu: pd.DataFrame
    """:func:`xsp.analysis.gpu_vs_cpu_sums`."""


class _Layers:
    """:class:`LayerSums` of the windows added."""

    def __init__(self) -> None:
        self.layers = InOrderParts(LAYER_KEYS, LAYER_SUMS, ["module_type"])
        self.modules = InOrderParts(MODULE_KEYS, MODULE_SUMS)
        self.gpu_vs_cpu = InOrderParts(GPU_VS_CPU_KEYS, GPU_VS_CPU_SUMS)
        self.compiled_calls = 0

    def add(self, trace: Trace, order: np.ndarray) -> None:
        """The layers of ``trace`` (whole trees of the steps' work), each row's place in ``order``."""
        spans = trace.spans
        is_layer = (spans[col.LEVEL] == Level.LAYER.value).to_numpy(dtype=bool)
        if is_layer.any() or kernel_layers(trace.metadata):
            table = layer_table(trace)
            # the layer table's own order (start, then depth), as the whole trace's is
            places = np.column_stack([table["start_ns"].to_numpy(dtype=np.int64),
                                      pd.to_numeric(table["call_depth"]).fillna(-1).to_numpy(dtype=np.int64),
                                      np.zeros(len(table), dtype=np.int64)])
            self.layers.add(layer_sums(table, places))
            self.modules.add(module_sums(table, places))
            self.compiled_calls += int(table["compiled"].sum())
        if is_layer.any():
            self.gpu_vs_cpu.add(gpu_vs_cpu_sums(gpu_vs_cpu_per_layer(trace), order[is_layer]))

    def result(self) -> LayerSums:
        return LayerSums(layers=self.layers.result(), modules=self.modules.result(),
                         compiled_calls=self.compiled_calls, gpu_vs_cpu=self.gpu_vs_cpu.result())


def _flops_added(parts: list[pd.DataFrame]) -> list[pd.DataFrame]:
    """:func:`xsp.analysis.layer_flops_sums` of several windows, as one (in a list)."""
    every = pd.concat(parts, ignore_index=True)
    return [every.groupby("name", observed=True)[LAYER_FLOPS_SUMS].sum().reset_index()]


def _kept_rows(spans: pd.DataFrame) -> np.ndarray:
    """The rows of a window kept to the end (see :attr:`WindowedReport.kept`)."""
    wanted = np.zeros(len(spans), dtype=bool)
    wanted[step_root_positions(spans)] = True
    wanted |= spans[col.KIND].isin(KEPT_KINDS).to_numpy(dtype=bool)
    level = spans[col.LEVEL]
    wanted |= ((level == Level.MODEL.value) & spans[col.KIND].isin([SpanKind.USER.value, SpanKind.BACKWARD.value])
               ).to_numpy(dtype=bool)
    wanted |= ((level == Level.SYSTEM.value) & spans[col.KIND].isin([SpanKind.SAMPLE.value, SpanKind.GC.value])
               ).to_numpy(dtype=bool)
    return wanted


def _operator_figures(added: pd.DataFrame) -> pd.DataFrame:
    figures = added.assign(mean_us=added["total_us"] / added["count"])
    total = figures["self_us"].sum()
    figures["share"] = figures["self_us"] / total if total else np.nan
    figures = figures.sort_values("self_us", ascending=False, kind="stable").reset_index(drop=True)
    return figures[["name", "count", "total_us", "self_us", "mean_us", "share"]]


def _kernel_figures(added: pd.DataFrame) -> pd.DataFrame:
    figures = added.assign(mean_us=added["total_us"] / added["count"])
    total = figures["total_us"].sum()
    figures["share"] = figures["total_us"] / total if total else np.nan
    figures = figures[["name", "count", "total_us", "mean_us", "min_us", "max_us", "share"]]
    return figures.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)


def _kernels_per_operator(table: pd.DataFrame, spans: pd.DataFrame, order: np.ndarray
                          ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A window's kernel time per operator (``table``: its :func:`xsp.analysis.gpu.kernel_table`),
    and each operator's first kernel's place in the loaded trace."""
    attributed = table[table["operator"].notna()]
    grouped = attributed.groupby("operator", sort=False, observed=True)["duration_us"].agg(
        kernels="size", kernel_us="sum").reset_index().rename(columns={"operator": "name"})
    rows = np.flatnonzero(_is_kind(spans, SpanKind.KERNEL) & (spans[col.LEVEL] == Level.KERNEL.value).to_numpy())
    places = pd.DataFrame(order[rows[table["operator"].notna().to_numpy()]], columns=["o0", "o1", "o2"])
    places.insert(0, "name", attributed["operator"].to_numpy())
    return grouped, places.groupby("name", sort=False).first()


def _per_operator_figures(added: pd.DataFrame, kernel_us: float) -> pd.DataFrame:
    figures = added.rename(columns={"name": "operator"})
    figures["mean_kernel_us"] = figures["kernel_us"] / figures["kernels"]
    figures["share"] = figures["kernel_us"] / kernel_us if kernel_us else np.nan
    figures = figures[["operator", "kernels", "kernel_us", "mean_kernel_us", "share"]]
    return figures.sort_values("kernel_us", ascending=False, kind="stable").reset_index(drop=True)


def _memory_figures(parts: list[pd.DataFrame]) -> pd.DataFrame:
    every = pd.concat(parts, ignore_index=True) if parts else memory_operations(empty_table())
    every = every.assign(total_us=whole_ns(every["total_us"]))
    added = every.groupby(["kind", "direction"], sort=True, observed=True)[["count", "total_us", "bytes"]].sum()
    added = added.reset_index()
    added["total_us"] /= 1e3
    added["bandwidth_gb_s"] = np.where(added["total_us"] > 0, added["bytes"] / (added["total_us"] * 1e3), np.nan)
    return added


def _sync_figures(parts: list[pd.DataFrame]) -> pd.DataFrame:
    found = [part for part in parts if len(part)]
    if not found:
        return synchronization(empty_table())
    every = pd.concat(found, ignore_index=True)
    every = every.assign(host_first=(every["where"] != "host").astype(int), total_us=whole_ns(every["total_us"]))
    added = every.groupby(["host_first", "where", "name"], sort=True, observed=True)[["count", "total_us"]].sum()
    added = added.reset_index().drop(columns="host_first")
    added["total_us"] /= 1e3
    added["mean_us"] = added["total_us"] / added["count"]
    return added.sort_values("total_us", ascending=False).reset_index(drop=True)


def _launch_figures(parts: list[pd.DataFrame]) -> pd.DataFrame:
    found = [part for part in parts if len(part)]
    every = pd.concat(found, ignore_index=True) if found else launch_sums(kernel_table(empty_table()))
    times = ["launch_us", "kernel_us", "launch_delay_us"]
    every = every.assign(**{name: whole_ns(every[name]) for name in times})
    added = every.groupby("step", dropna=False, sort=True, observed=True)[
        ["kernels", "launch_us", "kernel_us", "kernels_shorter_than_launch", "launch_delay_us", "delays"]].sum()
    added[times] /= 1e3
    return launch_overhead_of(added.reset_index())


@dataclass
class RankCommunication:
    """The communication of one rank's file of a distributed job, read a window at a time."""

    per_step: pd.DataFrame
    """:func:`xsp.analysis.rank_steps` of the whole trace."""
    clock_offsets: dict[int, int]
    """:func:`xsp.analysis.clock_offsets` of the whole trace."""


class _Communication:
    """The collectives of every window (few), and where the rank computed (its kernels, or its
    operators: many), written to a Parquet file in ``folder``; at the end, DuckDB finds how long
    its computation ran in each step with communication, and with it
    (:func:`xsp.analysis.distributed.overlap_unions`)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._computation = SpillFile(folder / "computation.parquet")
        self._collectives: list[pd.DataFrame] = []
        self._computing: dict[int, bool] = {}

    def add(self, spans: pd.DataFrame) -> None:
        """A window's spans (whole trees)."""
        found = collectives(spans)
        if len(found):
            self._collectives.append(found)
        compute = compute_intervals(spans)
        for rank, kernel in computing(compute).items():
            self._computing[rank] = self._computing.get(rank, False) or kernel
        if not len(compute):
            return
        table = pa.table({"rank": pa.Array.from_pandas(pd.Series(compute["rank"]).astype("Int64")),
                          "step": compute["step"].to_numpy(dtype=np.int64),
                          "start_ns": compute["start_ns"].to_numpy(dtype=np.int64),
                          "end_ns": compute["end_ns"].to_numpy(dtype=np.int64),
                          "kernel": compute["kernel"].to_numpy(dtype=bool)})
        self._computation.add(table)

    def result(self, kept: Trace) -> RankCommunication:
        """The communication, the steps' roots in ``kept``.

        Raises:
            OutputError: DuckDB ran out of memory or of scratch space.
        """
        table = pd.concat(self._collectives, ignore_index=True).sort_values(
            ["start_ns", "rank"], kind="stable").reset_index(drop=True) if self._collectives else collectives(
            empty_table())
        bounds = step_bounds(kept.spans)
        comm = step_collectives(table, bounds)
        unions = pd.DataFrame({name: pd.Series(dtype=np.int64) for name in OVERLAP_COLUMNS})
        if self._computation.close():
            chosen = pd.DataFrame({"rank": list(self._computing), "kernel": list(self._computing.values())})
            unions = _in_duckdb(self._folder, "the rank's computation", lambda connection: _overlaps(
                connection, str(self._computation.path), comm, chosen))
            self._computation.path.unlink(missing_ok=True)
        return RankCommunication(
            per_step=rank_steps_of(bounds, comm, unions, self._computing, lateness(table, kept.metadata)),
            clock_offsets=offsets_of(table, kept.metadata))


def _overlaps(connection: Any, path: str, comm: pd.DataFrame, chosen: pd.DataFrame) -> pd.DataFrame:
    """:func:`xsp.analysis.distributed.overlap_unions` of the computation in ``path``."""
    empty = pd.DataFrame({name: pd.Series(dtype=np.int64) for name in OVERLAP_COLUMNS})
    if comm.empty or chosen.empty:
        return empty
    connection.register("comm", comm[["rank", "step", "start_ns", "end_ns"]])
    connection.register("chosen", chosen)
    connection.execute(
        "CREATE TEMP TABLE busy AS SELECT c.rank, c.step, c.start_ns, c.end_ns FROM read_parquet($path) c "
        "JOIN chosen k ON c.rank = k.rank AND c.kernel = k.kernel "
        "JOIN (SELECT DISTINCT rank, step FROM comm) s ON c.rank = s.rank AND c.step = s.step", {"path": path})
    busy = connection.execute(_UNION.format(rows="busy")).df()
    both = connection.execute(_UNION.format(
        rows="(SELECT rank, step, start_ns, end_ns FROM busy UNION ALL SELECT rank, step, start_ns, end_ns FROM comm "
             "WHERE rank IN (SELECT rank FROM chosen))")).df()
    merged = both.rename(columns={"union_ns": "both_ns"}).merge(
        busy.rename(columns={"union_ns": "busy_ns"}), on=["rank", "step"], how="left")
    merged["busy_ns"] = merged["busy_ns"].fillna(0)
    return merged[OVERLAP_COLUMNS].astype(np.int64)


_UNION = """
SELECT rank, step, (max(end_ns) - min(start_ns)
       - coalesce(sum(CASE WHEN start_ns > covered_ns THEN start_ns - covered_ns ELSE 0 END), 0))::BIGINT AS union_ns
FROM (SELECT rank, step, start_ns, end_ns,
             max(end_ns) OVER (PARTITION BY rank, step ORDER BY start_ns
                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS covered_ns
      FROM {rows})
GROUP BY rank, step
"""
"""Per rank and step, the time covered by the intervals ``{rows}`` (overlaps counted once): their
extent less the gaps, as :func:`xsp.table.walks.union_length` counts it."""


def _in_duckdb(folder: Path, what: str, work: Callable[[Any], _Found]) -> _Found:
    """``work`` done on a DuckDB connection that spills into ``folder``, within
    :data:`SWEEP_MEMORY_MB` (``what``: what it reads, for the error).

    Raises:
        OutputError: it ran out of memory or of scratch space.
    """
    duckdb = imported_duckdb()

    connection = duckdb.connect(config={"memory_limit": f"{SWEEP_MEMORY_MB}MB", "threads": 2,
                                        "temp_directory": str(folder / "duckdb"), "preserve_insertion_order": False})
    try:
        with duckdb_interrupts():
            connection.execute("SET enable_progress_bar = false")
            return work(connection)
    except (duckdb.OutOfMemoryException, duckdb.IOException) as exc:  # the machine's, not the file's
        raise OutputError(f"{what} could not be added up in {SWEEP_MEMORY_MB} MB of memory, spilling into "
                          f"{folder.parent} ({first_line(exc)}): free memory or disk space there") from None
    finally:
        connection.close()


class _Backward:
    """:func:`xsp.analysis.backward_time_per_layer` of the windows added: their forward operators
    and backward operators written to Parquet files in ``folder``, and joined by DuckDB by step
    and sequence number (a step's backward runs on the autograd thread, in trees of its own),
    each to the first forward operator of the two (in the loaded order)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._files = {name: SpillFile(folder / f"{name}.parquet") for name in ("forward", "backward")}
        self._layers: list[pd.DataFrame] = []

    def add(self, parts: BackwardParts) -> None:
        for name, table in (("forward", parts.forward), ("backward", parts.backward)):
            if not len(table):
                continue
            self._files[name].add(pa.Table.from_pandas(table.assign(step=table["step"].fillna(NO_STEP)),
                                                       preserve_index=False))
        if len(parts.layers):
            self._layers = [pd.concat([*self._layers, parts.layers], ignore_index=True).groupby(
                "forward_layer", as_index=False)["ns"].sum()]

    def result(self) -> pd.DataFrame:
        """The table (see the class's text).

        Raises:
            OutputError: DuckDB ran out of memory or of scratch space.
        """
        written = [file.close() for file in self._files.values()]
        layer_ns = self._layers[0].set_index("forward_layer")["ns"] if self._layers else pd.Series(dtype=np.float64)
        operators = pd.DataFrame({"ns": pd.Series(dtype=np.float64), "count": pd.Series(dtype=np.int64)})
        if all(written):
            given = {name: str(file.path) for name, file in self._files.items()}
            found = _in_duckdb(self._folder, "the backward operators",
                               lambda connection: connection.execute(_BACKWARD, given).df())
            operators = found.set_index("layer")[["ns", "count"]]
        return backward_table_of(layer_ns, operators)


NO_STEP = -1.0
"""The step of a span outside every step, as the join reads it (a missing step matches a missing step)."""
_BACKWARD = """
WITH ranked AS (
    SELECT step, seq, layer, row_number() OVER (PARTITION BY step, seq ORDER BY o0, o1, o2) AS n
    FROM read_parquet($forward)),
first AS (SELECT step, seq, layer FROM ranked WHERE n = 1)
SELECT f.layer AS layer, sum(b.ns)::DOUBLE AS ns, count(*) AS count
FROM read_parquet($backward) b JOIN first f ON b.step = f.step AND b.seq = f.seq
WHERE f.layer IS NOT NULL GROUP BY f.layer
"""
"""Per forward layer, the backward operators of the step and sequence number of its first
forward operator: their time and how many."""


class _LayerMemory:
    """:func:`xsp.analysis.memory_by_layer_type` of the steps' work of every window: its memory
    events and the forward layers over them written to Parquet files in ``folder``; DuckDB counts
    the live bytes over every event in time order (as the trace loaded whole counts them) and
    adds up each layer's, then each type's."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._files = {name: SpillFile(folder / f"memory_{name}.parquet") for name in ("events", "pairs")}

    def add(self, memory: ForwardMemory, order: np.ndarray) -> None:
        if not len(memory.events):
            return
        at = order[memory.events["row"].to_numpy(dtype=np.int64)]
        self._files["events"].add(pa.table({
            "o0": at[:, 0], "o1": at[:, 1], "o2": at[:, 2], "device": memory.events["device"].to_numpy(dtype=object),
            "time_ns": memory.events["time_ns"].to_numpy(dtype=np.int64),
            "signed": memory.events["signed_bytes"].to_numpy(dtype=np.int64)}))
        if not len(memory.pairs):
            return
        layer = order[memory.pairs["layer_row"].to_numpy(dtype=np.int64)]
        event = order[memory.pairs["event_row"].to_numpy(dtype=np.int64)]
        self._files["pairs"].add(pa.table({
            "l0": layer[:, 0], "l1": layer[:, 1], "l2": layer[:, 2],
            "module_type": pa.array(memory.pairs["module_type"].to_numpy(dtype=object), type=pa.string(),
                                    from_pandas=True),
            "o0": event[:, 0], "o1": event[:, 1], "o2": event[:, 2]}))

    def result(self) -> pd.DataFrame:
        """The table (see the class's text).

        Raises:
            OutputError: DuckDB ran out of memory or of scratch space.
        """
        sums = _queried(self._folder, self._files, "the memory events", _LAYER_MEMORY)
        return memory_type_table(pd.DataFrame(columns=["module_type", "device", "layers", "allocated_bytes",
                                                       "net_bytes", "max_peak_bytes"]) if sums is None else sums)


def _queried(folder: Path, files: dict[str, SpillFile], what: str, query: str) -> pd.DataFrame | None:
    """``query`` run by DuckDB (:func:`_in_duckdb`) over ``files``, each given as a parameter by its
    name, and the files removed after; None where one of them holds nothing (nothing to query)."""
    written = [file.close() for file in files.values()]
    try:
        if not all(written):
            return None
        given = {name: str(file.path) for name, file in files.items()}
        return _in_duckdb(folder, what, lambda connection: connection.execute(query, given).df())
    finally:
        for file in files.values():
            file.path.unlink(missing_ok=True)


_LAYER_MEMORY = """
WITH live AS (
    SELECT o0, o1, o2, device, time_ns, signed,
           sum(signed) OVER (PARTITION BY device ORDER BY time_ns, o0, o1, o2 ROWS UNBOUNDED PRECEDING) AS live
    FROM read_parquet($events)),
paired AS (
    SELECT p.l0, p.l1, p.l2, p.module_type, e.device, e.signed, e.live,
           row_number() OVER (PARTITION BY p.l0, p.l1, p.l2, e.device ORDER BY e.time_ns, e.o0, e.o1, e.o2) AS n
    FROM read_parquet($pairs) p JOIN live e ON p.o0 = e.o0 AND p.o1 = e.o1 AND p.o2 = e.o2),
layers AS (
    SELECT any_value(module_type) AS module_type, device, sum(greatest(signed, 0)) AS allocated,
           sum(signed) AS net, max(live) - max(CASE WHEN n = 1 THEN live - signed END) AS above
    FROM paired GROUP BY l0, l1, l2, device)
SELECT module_type, device, count(*)::BIGINT AS layers, sum(allocated)::BIGINT AS allocated_bytes,
       sum(net)::BIGINT AS net_bytes, max(greatest(above, 0))::BIGINT AS max_peak_bytes
FROM layers GROUP BY module_type, device
"""
"""Each event's live bytes on its device (every event before it in time, ties in the loaded
order), each forward layer's allocations, net bytes and peak above what was live before its
first event, and their sums per module type and device."""


class _SampledCounters:
    """The GPU's sampled counters (the ``gpu_metrics`` level's ``counters`` spans) and the kernels
    of every window, written to Parquet files in ``folder``; DuckDB shares each sample among the
    kernels that ran on its device during it, by their time in it, as
    :func:`xsp.analysis.counters_per_kernel` shares them: a sample and the kernels it overlaps
    can lie in any windows."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._files = {name: SpillFile(folder / f"counters_{name}.parquet") for name in ("samples", "kernels")}

    def add(self, spans: pd.DataFrame) -> None:
        samples, kernels = counter_samples_and_kernels(spans)
        if len(samples):
            self._files["samples"].add(pa.table({
                **_on_device(samples),
                "flops": pa.array(samples[col.FLOPS].astype("Float64").to_numpy(dtype=np.float64, na_value=np.nan),
                                  type=pa.float64(), from_pandas=True),
                "dram_bytes": pa.array(samples[col.BYTES].astype("Float64").to_numpy(dtype=np.float64,
                                                                                     na_value=np.nan),
                                       type=pa.float64(), from_pandas=True)}))
        if len(kernels):
            self._files["kernels"].add(pa.table({
                **_on_device(kernels),
                "name": pa.array(kernels[col.NAME].to_numpy(dtype=object), type=pa.string(), from_pandas=True)}))

    def result(self) -> pd.DataFrame:
        """Per kernel name, the FLOPs and DRAM bytes shared out of the samples (``name``, ``flops``,
        ``dram_bytes``; empty where no sample met a kernel).

        Raises:
            OutputError: DuckDB ran out of memory or of scratch space.
        """
        # None: no sample, or no kernel to share one among
        found = _queried(self._folder, self._files, "the GPU's sampled counters", _SHARED_SAMPLES)
        return pd.DataFrame({"name": pd.Series(dtype=object), "flops": pd.Series(dtype=np.float64),
                             "dram_bytes": pd.Series(dtype=np.float64)}) if found is None else found


def _on_device(spans: pd.DataFrame) -> dict[str, np.ndarray]:
    """The device (-1: none) and times of ``spans``, as :func:`xsp.analysis.counters_per_kernel` reads them."""
    return {"device": spans[col.DEVICE_ID].astype("Int64").fillna(-1).to_numpy(dtype=np.int64),
            "start_ns": spans[col.START_NS].to_numpy(dtype=np.int64),
            "end_ns": spans[col.END_NS].to_numpy(dtype=np.int64)}


_SHARED_SAMPLES = """
WITH samples AS (SELECT row_number() OVER () AS sample, * FROM read_parquet($samples)),
pairs AS (
    SELECT s.sample, k.name, s.flops, s.dram_bytes,
           greatest(least(k.end_ns, s.end_ns) - greatest(k.start_ns, s.start_ns), 0)::DOUBLE AS overlap
    FROM read_parquet($kernels) k JOIN samples s
      ON k.device = s.device AND s.end_ns > k.start_ns AND s.start_ns < k.end_ns),
shared AS (
    SELECT name, flops, dram_bytes,
           CASE WHEN busy > 0 THEN overlap / busy ELSE 0 END AS share
    FROM (SELECT *, sum(overlap) OVER (PARTITION BY sample) AS busy FROM pairs))
SELECT name, sum(flops * share) AS flops, sum(dram_bytes * share) AS dram_bytes FROM shared GROUP BY name
"""
"""Each sample's counts shared among the kernels on its device that ran during it (ended after it
began and began before it ended), by their time in it; a sample no kernel ran in is no one's.
Missing counts stay missing, and a name's sum is missing only where all of its counts are."""


class _Activities:
    """The GPU's activities of every window (:func:`xsp.analysis.gpu.activity_times`), written to a
    Parquet file in ``folder`` and swept by DuckDB in the order of their starts, per step and
    device, as :func:`xsp.analysis.gpu.gpu_utilization` sweeps them (``per_stream=False``): of
    every activity, and of the steps' work (the recommendations'; ``has_steps``: the trace has
    steps, else the steps' work is all of it)."""

    def __init__(self, folder: Path, has_steps: bool) -> None:
        self._folder = folder
        self._file = SpillFile(folder / "activities.parquet")
        self._has_steps = has_steps

    def add(self, times: pd.DataFrame) -> None:
        if not len(times):
            return
        step = pd.Series(times["step"]).astype("Int64")
        launched = times["launch_end"].to_numpy(dtype=np.int64) != np.iinfo(np.int64).min
        # the kernels the recommendations' medians read: in the steps' work, with a launch call
        counted = times["kernel"].to_numpy(dtype=bool) & launched & (step.notna().to_numpy(dtype=bool)
                                                                      if self._has_steps else True)
        start, end = times["start"].to_numpy(dtype=np.int64), times["end"].to_numpy(dtype=np.int64)
        launch, launch_end = times["launch"].to_numpy(dtype=np.int64), times["launch_end"].to_numpy(dtype=np.int64)
        table = pa.table({
            "step": pa.Array.from_pandas(step),
            "device": pa.Array.from_pandas(pd.Series(times["device_id"]).astype("Int64")),
            "start_ns": start, "end_ns": end, "launch_ns": launch,
            "launch_step": times["launch_step"].to_numpy(dtype=bool),
            "kernel_ns": pa.array(end - start, mask=~counted),
            "launch_call_ns": pa.array(launch_end - launch, mask=~counted)})
        self._file.add(table)

    def swept(self) -> tuple[pd.DataFrame, pd.DataFrame, tuple[float, float]]:
        """:func:`xsp.analysis.gpu_utilization` (``per_stream=False``) of the activities added, and
        of those of the steps' work; the median kernel and launch call of the steps' work (µs).

        Raises:
            OutputError: DuckDB ran out of memory or of scratch space.
        """
        if not self._file.close():
            empty = pd.DataFrame({name: [] for name in UTILIZATION_COLUMNS})
            return empty, empty, (np.nan, np.nan)
        try:
            every, in_steps, medians = _in_duckdb(self._folder, "the GPU's activities", self._sweep)
        finally:
            self._file.path.unlink(missing_ok=True)
        found = tuple(np.nan if value is None else float(value) / 1e3 for value in medians)
        return _utilization(every), _utilization(in_steps), (found[0], found[1])

    def _sweep(self, connection: Any) -> tuple[pd.DataFrame, pd.DataFrame, tuple[Any, ...]]:
        given = {"path": str(self._file.path)}
        every = connection.execute(_SWEEP.format(launch="launch_ns", where="TRUE"), given).df()
        in_steps = connection.execute(_SWEEP.format(
            launch=f"CASE WHEN launch_step THEN launch_ns ELSE {np.iinfo(np.int64).min} END",
            where="step IS NOT NULL"), given).df() if self._has_steps else every
        medians = connection.execute("SELECT median(kernel_ns), median(launch_call_ns) FROM read_parquet($path) "
                                     "WHERE kernel_ns IS NOT NULL", given).fetchall()[0]
        return every, in_steps, medians


def _utilization(found: pd.DataFrame) -> pd.DataFrame:
    """:func:`xsp.analysis.gpu_utilization`'s table of what :data:`_SWEEP` found."""
    window = found["window_ns"].to_numpy(dtype=np.int64)
    idle = found["idle_ns"].to_numpy(dtype=np.int64)
    host_bound = found["host_bound_ns"].to_numpy(dtype=np.int64)
    busy = window - idle
    return pd.DataFrame({
        "step": found["step"].astype("Int64"), "device_id": found["device"].astype("Int64"),
        "stream_id": pd.array([pd.NA] * len(found), dtype="Int64"),
        "activities": found["activities"].to_numpy(dtype=np.int64), "window_us": window / 1e3,
        "busy_us": busy / 1e3, "host_bound_idle_us": host_bound / 1e3, "other_idle_us": (idle - host_bound) / 1e3,
        "utilization": np.where(window > 0, busy / np.where(window > 0, window, 1), np.nan)})


_SWEEP = """
WITH chosen AS (SELECT step, device, start_ns, end_ns, {launch} AS launch_ns FROM read_parquet($path) WHERE {where}),
swept AS (
    SELECT step, device, start_ns, end_ns, launch_ns,
           max(end_ns) OVER (PARTITION BY step, device ORDER BY start_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS covered_ns
    FROM chosen)
SELECT step, device, count(*) AS activities, max(end_ns) - min(start_ns) AS window_ns,
       coalesce(sum(CASE WHEN start_ns > covered_ns THEN start_ns - covered_ns ELSE 0 END), 0)::BIGINT AS idle_ns,
       coalesce(sum(CASE WHEN start_ns > covered_ns AND launch_ns >= covered_ns THEN start_ns - covered_ns ELSE 0 END),
                0)::BIGINT AS host_bound_ns
FROM swept GROUP BY step, device ORDER BY step NULLS LAST, device NULLS LAST
"""
"""Per step and device, the activities' window, their idle gaps (a start after every earlier
start's activity ended: ``covered_ns``) and those whose launch began after the GPU went idle
(the host's); the busy time is the window less the gaps. ``{launch}``: the launch's start;
``{where}``: the activities swept."""


@dataclass
class _StepsKnown:
    """What a first reading of a few columns of every window finds."""

    extents: pd.DataFrame
    """Every step's time (:func:`xsp.analysis.model.step_extents`)."""
    deep_steps: np.ndarray | None
    """An always-on trace's steps recorded deep (None: not always on), as
    :func:`xsp.reports.terminal.deep_steps` finds them: the steps of roots sampled deep."""
    forward_layers: bool
    """The trace has forward layers (what memory per layer type counts)."""
    graph_nodes: bool
    """The trace marks where CUDA graph nodes were captured."""
    leveled_steps: np.ndarray | None = None
    """An always-on trace's steps whose roots name a leveled run (the model-only steps and those
    drawn), where they name two runs or more (None: nothing to level)."""
    leveled_spans: int = 0
    """The spans numbered with one of them."""


def _steps_known(windows: TreeWindows) -> _StepsKnown:
    """See :class:`_StepsKnown`."""
    always_on = bool(windows.metadata.get("sampling"))
    found, deep, labelled = [], [], []
    counted: list[tuple[np.ndarray, np.ndarray]] = []
    runs: set[str] = set()
    forward_layers = graph_nodes = False
    for spans, _ in windows.frames(columns=[col.STEP, col.KIND, col.PARENT_ID, col.START_NS, col.END_NS, col.LEVEL,
                                            *([col.SAMPLING, col.LEVELED_RUN] if always_on else [])]):
        found.append(step_extents(spans))
        forward_layers |= bool(((spans[col.LEVEL] == Level.LAYER.value)
                                & (spans[col.KIND] == SpanKind.FORWARD.value)).any())
        graph_nodes |= bool((spans[col.KIND] == SpanKind.GRAPH_NODE.value).any())
        if always_on:
            deep.append(spans[col.STEP][deep_roots(spans)].dropna().to_numpy(dtype=np.float64))
            roots = spans.iloc[step_root_positions(spans)]
            roots = roots[roots[col.LEVELED_RUN].notna()]
            labelled.append(roots[col.STEP].to_numpy(dtype=np.float64))
            runs.update(roots[col.LEVELED_RUN].astype(str).unique().tolist())
            counted.append(np.unique(spans[col.STEP].dropna().to_numpy(dtype=np.float64), return_counts=True))
    deep_steps = np.unique(np.concatenate(deep)) if deep else (np.zeros(0) if always_on else None)
    leveled_steps, leveled_spans = _leveled_steps(labelled, counted) if len(runs) >= 2 else (None, 0)
    extents = pd.concat(found).groupby(level=0).agg(start=("start", "min"), end=("end", "max")) if found else \
        pd.DataFrame({"start": [], "end": []})
    return _StepsKnown(extents, deep_steps, forward_layers, graph_nodes, leveled_steps, leveled_spans)


def _leveled_steps(labelled: list[np.ndarray], counted: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, int]:
    """The steps whose roots name a leveled run (``labelled``, each window's), and the spans
    numbered with them (``counted``: each window's steps and their spans)."""
    steps = np.unique(np.concatenate(labelled))
    numbers = np.concatenate([found for found, _ in counted])
    spans = np.concatenate([count for _, count in counted])
    return steps, int(spans[np.isin(numbers, steps)].sum())


_CAPTURE_COLUMNS = [col.SPAN_ID, col.PARENT_ID, col.KIND, col.LEVEL, col.NAME, col.PATH, col.GRAPH_NODE_ID,
                    col.ATTRIBUTES, col.RANK, col.PROCESS_ID]
"""What :func:`xsp.analysis.gpu.capture_site_parts` reads of a window."""


def _capture_sites(windows: TreeWindows) -> CaptureSites:
    """Where the trace's CUDA graph nodes were captured, from a reading of every window: a replay
    and the capture of its graph can lie in different windows."""
    return capture_sites([capture_site_parts(spans, order)
                          for spans, order in windows.frames(columns=_CAPTURE_COLUMNS)])


def _own_rows(spans: pd.DataFrame) -> pd.DataFrame:
    """Rows kept past their window, with only their own categories: a window's categorical
    column holds every text of the window (its paths: one a span), which a few rows kept of each
    window would otherwise hold on to."""
    return spans.assign(**{name: spans[name].cat.remove_unused_categories() for name in spans.columns
                           if isinstance(spans[name].dtype, pd.CategoricalDtype)})


def _is_kind(spans: pd.DataFrame, kind: SpanKind) -> np.ndarray:
    return (spans[col.KIND] == kind.value).to_numpy(dtype=bool)


def _first_places(spans: pd.DataFrame, order: np.ndarray, rows: np.ndarray) -> pd.DataFrame:
    """Per name among ``rows``, the place of its first span in the loaded trace."""
    names = spans[col.NAME].to_numpy(dtype=object)[rows]
    places = pd.DataFrame(order[rows], columns=["o0", "o1", "o2"])
    places.insert(0, "name", names)
    return places.groupby("name", sort=False).first()


OPERATOR_SUMS = ["count", "total_us", "self_us"]
KERNEL_SUMS = ["count", "total_us"]
PER_OPERATOR_SUMS = ["kernels", "kernel_us"]


def _by_name(table: pd.DataFrame, places: pd.DataFrame, sums: list[str], smallest: Sequence[str] = (),
             largest: Sequence[str] = ()) -> pd.DataFrame:
    """A window's table by name (one row a name) for :class:`xsp.analysis.in_order.InOrderParts`:
    each name at its first span's place (``places``, by name), its times (``_us``) summed as
    whole nanoseconds (:func:`xsp.analysis.gpu.whole_ns`)."""
    exact = table.assign(**{name: whole_ns(table[name]) for name in sums if name.endswith("_us")})
    at = places.reindex(table["name"]).fillna(np.iinfo(np.int64).max).to_numpy(dtype=np.int64)
    return grouped_in_order(exact[["name", *sums, *smallest, *largest]].reset_index(drop=True), at, ["name"], sums,
                            smallest=smallest, largest=largest)


def _named(added: pd.DataFrame, sums: list[str]) -> pd.DataFrame:
    """The names' figures of :func:`_by_name` tables added up, in the order they first ran."""
    figures = added.drop(columns=PLACE)
    for name in sums:
        if name.endswith("_us"):
            figures[name] = figures[name] / 1e3
    return figures


def _in_loaded_order(frames: list[pd.DataFrame], orders: list[np.ndarray], metadata: dict[str, Any]) -> Trace:
    """The rows kept of every window as one trace, in the order :func:`xsp.load` gives them."""
    if not frames:
        return Trace(spans=empty_table(), metadata=metadata)
    spans = concat_spans(frames).reset_index(drop=True)
    order = np.concatenate(orders)
    return Trace(spans=spans.iloc[np.lexsort(order.T[::-1])].reset_index(drop=True), metadata=metadata)


def _outside(parts: list[np.ndarray], first_ns: int, last_ns: int) -> OutsideSteps | None:
    """:func:`xsp.analysis.model.outside_steps` of each window's spans of the level outside every
    step (their starts and ends), the steps' work from ``first_ns`` to ``last_ns``; None where none."""
    times = np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)
    if not len(times) or first_ns > last_ns:
        return None
    return outside_steps(times[:, 0], times[:, 1], first_ns, last_ns)


__all__ = ["WindowedReport", "windowed_report"]
