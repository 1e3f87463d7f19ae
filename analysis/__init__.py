"""Analyses of xsp span tables: the tree, steps and paths, and the tables reports print.

Every analysis is a plain function that takes an :class:`xsp.Trace` (or its span table)
and returns a pandas DataFrame with documented columns. Nothing here plots or prints.
"""

from xsp.analysis.compensate import compensated
from xsp.analysis.distributed import (
    clock_offsets,
    collective_skew,
    collectives,
    communication,
    communication_of_steps,
    rank_steps,
    stragglers,
)
from xsp.analysis.gpu import (
    gpu_utilization,
    gpu_vs_cpu_per_layer,
    gpu_vs_cpu_sums,
    kernel_table,
    kernel_time_per_layer,
    kernel_time_per_operator,
    kernels_by_name,
    launch_overhead,
    memory_operations,
    replayed_layers,
    synchronization,
)
from xsp.analysis.inputs import input_per_step, input_waits, input_workers
from xsp.analysis.layers import (
    layer_sums,
    layer_table,
    layer_type_summary,
    layer_type_summary_of,
    module_sums,
    top_layers,
    top_layers_of,
)
from xsp.analysis.lines import lines
from xsp.analysis.memory import layer_memory, memory_by_layer_type, memory_timeline
from xsp.analysis.model import model_latency, model_summary
from xsp.analysis.operators import backward_attribution, backward_time_per_layer, operator_table
from xsp.analysis.overview import aggregated_tree, level_summary
from xsp.analysis.recommend import recommend
from xsp.analysis.roofline import (
    GPU_PEAKS,
    counters_per_kernel,
    kernel_roofline,
    layer_flops,
    layer_flops_of,
    layer_flops_sums,
    model_flops,
    peak_for,
    trace_peak,
)
from xsp.analysis.steps import step_breakdown, step_coverage, step_summary, user_spans
from xsp.analysis.system import energy_per_step, gc_collections, system_metrics, system_per_step
from xsp.table import parents as hierarchy
from xsp.table import paths as structure
from xsp.table.parents import diagnostics_table

__all__ = [
    "operator_table", "backward_attribution", "backward_time_per_layer",
    "hierarchy", "structure", "diagnostics_table", "layer_table", "layer_type_summary", "top_layers",
    "model_latency", "model_summary", "kernel_table", "kernels_by_name", "kernel_time_per_layer",
    "kernel_time_per_operator", "replayed_layers", "gpu_vs_cpu_per_layer", "memory_operations", "synchronization",
    "gpu_utilization",
    "launch_overhead", "GPU_PEAKS", "counters_per_kernel", "kernel_roofline", "layer_flops", "model_flops",
    "peak_for", "trace_peak", "input_waits", "input_per_step", "input_workers", "system_metrics", "system_per_step",
    "gc_collections", "energy_per_step", "layer_memory", "memory_by_layer_type", "memory_timeline",
    "recommend", "level_summary", "aggregated_tree", "compensated",
    "step_breakdown", "step_summary", "step_coverage", "user_spans",
    "collectives", "stragglers", "rank_steps", "communication", "clock_offsets", "collective_skew",
    "communication_of_steps", "lines", "layer_sums", "module_sums", "top_layers_of", "layer_type_summary_of",
    "gpu_vs_cpu_sums", "layer_flops_sums", "layer_flops_of",
]
