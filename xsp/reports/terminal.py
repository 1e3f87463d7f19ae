"""The terminal report: rich tables of the analyses that apply to a trace."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table

from xsp import analysis
from xsp import schema as col
from xsp.schema import Level
from xsp.trace import Trace

STEPS_SHOWN = 20


def _ms(value: float) -> str:
    return "-" if pd.isna(value) else f"{value:,.3f}"


def _share(value: float) -> str:
    return "-" if pd.isna(value) else f"{100 * value:.1f}%"


def _header(trace: Trace, console: Console) -> None:
    meta = trace.metadata
    console.print(f"[bold]xsp report[/bold]  service={meta.get('service_name', '?')}  "
                  f"device={meta.get('device', '?')}  torch={meta.get('torch_version', '?')}")
    levels = trace.spans[col.LEVEL].value_counts().to_dict()
    console.print(f"{len(trace.spans)} spans ({', '.join(f'{k} {v}' for k, v in levels.items())}), "
                  f"{len(trace.steps)} steps, levels recorded: {', '.join(meta.get('levels', []))}")
    for level, reason in (meta.get("unavailable") or {}).items():
        console.print(f"[yellow]level {level} not recorded: {reason}[/yellow]")
    dropped = meta.get("dropped") or {}
    if dropped:
        console.print(f"[yellow]dropped: {', '.join(f'{v} {k}' for k, v in dropped.items())}[/yellow]")
    hierarchy = meta.get("hierarchy") or {}
    if hierarchy.get("overlapping") or hierarchy.get("ambiguous"):
        console.print(f"[yellow]hierarchy: {hierarchy.get('overlapping', 0)} overlapping, "
                      f"{hierarchy.get('ambiguous', 0)} ambiguous spans[/yellow]")


def _latency_tables(trace: Trace, console: Console) -> None:
    latency = analysis.model_latency(trace)
    if latency.empty:
        console.print("no steps: the traced code called no top-level nn.Module")
        return
    summary = analysis.model_summary(trace)
    table = Table(title="Model latency over steps (ms)")
    for name in ("step name", "steps", "mean", "p50", "p90", "p99", "trimmed mean", "throughput/s"):
        table.add_column(name, justify="right" if name != "step name" else "left")
    for row in summary.itertuples():
        table.add_row(str(row.name), str(row.steps), _ms(row.mean_ms), _ms(row.p50_ms), _ms(row.p90_ms),
                      _ms(row.p99_ms), _ms(row.trimmed_mean_ms), _ms(row.throughput_per_s))
    console.print(table)
    shown = latency if len(latency) <= STEPS_SHOWN else pd.concat(
        [latency.head(STEPS_SHOWN // 2), latency.tail(STEPS_SHOWN // 2)])
    table = Table(title=f"Latency per step ({len(latency)} steps"
                  + (f", first and last {STEPS_SHOWN // 2})" if len(latency) > STEPS_SHOWN else ")"))
    for name in ("step", "name", "latency ms", "batch", "throughput/s", "status"):
        table.add_column(name, justify="right" if name not in ("name", "status") else "left")
    for row in shown.itertuples():
        table.add_row(str(row.step), str(row.name), _ms(row.latency_ms),
                      "-" if pd.isna(row.batch_size) else str(row.batch_size),
                      _ms(row.throughput_per_s), str(row.status))
    console.print(table)


def _layer_tables(trace: Trace, console: Console, top: int) -> None:
    if not (trace.spans[col.LEVEL] == Level.LAYER.value).any():
        return
    layers = analysis.top_layers(trace, k=top)
    table = Table(title=f"Top {len(layers)} layers by self time (all steps)")
    table.add_column("layer", overflow="fold")
    for name in ("kind", "type", "calls", "self ms", "mean ms", "share"):
        table.add_column(name, justify="left" if name in ("kind", "type") else "right", no_wrap=True)
    for row in layers.itertuples():
        table.add_row(str(row.name), str(row.kind), str(row.module_type), str(row.calls),
                      _ms(row.total_self_ms), _ms(row.mean_ms), _share(row.share))
    console.print(table)
    types = analysis.layer_type_summary(trace)
    table = Table(title="Time per layer type (self time, all steps)")
    for name in ("type", "layers", "calls", "self ms", "mean ms", "share"):
        table.add_column(name, justify="left" if name == "type" else "right")
    for row in types.itertuples():
        table.add_row(str(row.module_type), str(row.layers), str(row.calls), _ms(row.total_self_ms),
                      _ms(row.mean_ms), _share(row.share))
    console.print(table)


def render_report(trace: Trace, console: Console, top: int = 10) -> None:
    """Print every analysis that applies to ``trace``."""
    _header(trace, console)
    _latency_tables(trace, console)
    _layer_tables(trace, console, top)
