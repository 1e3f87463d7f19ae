"""The HTML report: one self-contained, offline page of charts (plotly, its JavaScript embedded).

Sections: a summary (latency, throughput, coverage, the share of step time per level, the top
recommendations), the recommendations, an icicle of a typical step's hierarchy, model latency
per step, where the step time went (and the steps' share of the session, and the user's
spans), top layers, time per layer type, the hottest files of the user's code as annotated
source, operators, kernels, GPU vs CPU time per layer, the
roofline, a flame chart of one step, memory, system metrics and the hierarchy diagnostics.
A section the trace has nothing for is left out, and named in one line at the end.
"""

from __future__ import annotations

import html
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from xsp import analysis
from xsp.analysis.findings import SHARE_OF, STEP_TIME
from xsp.core import schema as col
from xsp.core.figures import counted
from xsp.io.loading import RANKS_APART
from xsp.io.outputs import write_text_output
from xsp.io.trace import Trace
from xsp.reports.terminal import (
    StepView,
    busy_machine_line,
    deep_steps,
    export_line,
    job_file_lines,
    shorten,
    warmup_line,
)
from xsp.table.walks import depth_of, parent_positions

TIMELINE_SPANS = 3000
"""Spans drawn in the step timeline at most (the longest are kept)."""
ICICLE_NODES = 2000
"""Nodes of the aggregated hierarchy drawn at most (the largest, with their ancestors)."""
TOP = 15
_LEVEL_ORDER = ["model", "input", "layer", "operator", "cuda_api", "kernel"]
LEVEL_COLOURS = {"model": "#4c78a8", "input": "#72b7b2", "layer": "#f58518", "operator": "#54a24b",
                 "cuda_api": "#b279a2", "kernel": "#e45756", "user": "#eeca3b"}
"""One colour per level, the same in every chart (Tableau 10)."""
OTHER_COLOUR = "#9d9d9d"
READABLE_TEXT = {"minsize": 10, "mode": "hide"}
"""A box's label is shown at 10 px or not at all (hover still names it): plotly would shrink it
to fit, into specks no one can read."""
ICICLE_LABEL_CHARACTERS = 32
"""An icicle box's label at most: the node's own name (its parent's is in the box above); the
full name is on hover."""


def _figure_html(figure: go.Figure, chart_id: str) -> str:
    figure.update_layout(margin={"l": 60, "r": 20, "t": 50, "b": 60}, template="plotly_white", height=420)
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=chart_id,
                          config={"displaylogo": False, "responsive": True})


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def latency_section(trace: Trace) -> str:
    latency = analysis.model_latency(trace)
    if latency.empty:
        return ""
    figure = go.Figure(go.Scatter(x=latency["step"].astype(float), y=latency["latency_ms"], mode="lines+markers",
                                  name="latency"))
    figure.update_layout(title="Model latency per step", xaxis_title="step", yaxis_title="ms")
    figure.update_xaxes(tickformat="d", dtick=max(1, len(latency) // 20))
    busy = busy_machine_line(trace.metadata)
    return ("" if busy is None else _note(busy)) + _figure_html(figure, "chart-latency")


STEP_PARTS = ("forward", "backward", "optimizer", "input", "compile", "other")


def steps_section(trace: Trace) -> str:
    """How much of the session the steps cover, what each kind of step spent its time on, and
    the user's own spans."""
    coverage = analysis.step_coverage(trace).iloc[0]
    if not coverage["steps"]:
        return ""
    summary = analysis.step_summary(trace)
    figure = go.Figure([go.Bar(y=summary["name"], x=summary[f"{part}_ms"], name=part, orientation="h",
                               customdata=summary[f"{part}_share"],
                               hovertemplate=f"{part}: %{{x:.3f}} ms, %{{customdata:.1%}} of the step<extra></extra>")
                        for part in STEP_PARTS if summary[f"{part}_ms"].sum() > 0])
    figure.update_layout(barmode="stack", title="Where the step time went (mean per step)", xaxis_title="ms",
                         height=max(300, 80 * len(summary)))
    text = _note(f"Steps cover {100 * coverage['coverage']:.1f}% of the session ({coverage['steps_ms']:,.3f} of "
                 f"{coverage['session_ms']:,.3f} ms); {coverage['outside_ms']:,.3f} ms ran outside every step.")
    user = analysis.user_spans(trace)
    if user.empty:
        return text + _figure_html(figure, "chart-steps")
    rows = "".join(f"<tr><td>{html.escape(str(r.name))}</td><td>{r.count:,}</td><td>{r.total_ms:,.3f}</td>"
                   f"<td>{r.mean_ms:,.3f}</td><td>{r.in_steps:,}</td><td>{r.threads:,}</td>"
                   f"<td>{100 * r.share:.1f}%</td></tr>" for r in user.itertuples())
    table = ('<table id="user-spans"><thead><tr><th>your span</th><th>count</th><th>total ms</th><th>mean ms</th>'
             "<th>in steps</th><th>threads</th><th>share of the session they cover</th></tr></thead>"
             f"<tbody>{rows}</tbody></table>")
    return text + _figure_html(figure, "chart-steps") + table


def layers_section(trace: Trace, step_view: StepView | None = None) -> str:
    warmup = warmup_line(trace)
    trace, which = step_view or deep_steps(trace)  # the steps' time: what ran outside them is not a step's
    top = analysis.top_layers(trace, k=TOP)
    if top.empty:
        return ""
    top = top.iloc[::-1]
    bars = go.Figure(go.Bar(x=top["total_self_ms"], y=top["name"] + " (" + top["kind"] + ")", orientation="h"))
    bars.update_layout(title=f"Top {counted(len(top), 'layer')} by self time", xaxis_title=f"ms ({which})")
    types = analysis.layer_type_summary(trace).head(TOP)
    pie = go.Figure(go.Bar(x=types["module_type"], y=types["total_self_ms"]))
    pie.update_layout(title="Time per layer type (self time)", yaxis_title=f"ms ({which})")
    return (_note(warmup) if warmup else "") + _figure_html(bars, "chart-top-layers") + _figure_html(
        pie, "chart-layer-types")


def _top_names_chart(table: pd.DataFrame, value_us: str, what: str, share_of: str, chart_id: str,
                     which: str) -> str:
    """Horizontal bars of the rows' ``value_us`` (shown in ms), with calls and share on hover."""
    table = table.iloc[::-1]
    figure = go.Figure(go.Bar(x=table[value_us] / 1e3, y=table["name"].str.slice(0, 80), orientation="h",
                              customdata=table[["count", "share"]].to_numpy(),
                              hovertemplate="%{y}<br>%{x:.3f} ms, %{customdata[0]} calls, "
                                            f"%{{customdata[1]:.1%}} of {share_of}<extra></extra>"))
    figure.update_layout(title=f"Top {len(table)} {what}", xaxis_title=f"ms ({which})",
                         height=max(420, 28 * len(table)))
    return _figure_html(figure, chart_id)


def operators_section(trace: Trace, step_view: StepView | None = None) -> str:
    trace, which = step_view or deep_steps(trace)
    ops = analysis.operator_table(trace).head(TOP)
    if ops.empty:
        return ""
    return _top_names_chart(ops, "self_us", "operators by self time", "operator time", "chart-operators", which)


def leveled_section(trace: Trace) -> str:
    runs = (trace.metadata.get("leveled") or {}).get("overhead") or []
    if not runs:
        return ""
    names = [run["run"] + (" (metrics)" if run.get("metric") else "") for run in runs]
    errors = [run.get("model_latency_ci_ms") for run in runs]
    figure = go.Figure(go.Bar(x=names, y=[run["model_latency_ms"] for run in runs],
                              error_y={"type": "data", "array": [e if e == e and e is not None else 0 for e in errors],
                                       "visible": True},
                              text=[f"{run['overhead']:+.1%}" for run in runs], textposition="outside"))
    figure.update_layout(title="Model latency per leveled run, with 95% intervals (overhead against the model-only "
                               "run)",
                         yaxis_title="ms (trimmed mean)")
    section = _figure_html(figure, "chart-leveled")
    layers = analysis.top_layers(trace, k=TOP, by="total_ms")
    if layers.empty or not layers["mean_ci_ms"].notna().any():
        return section
    layers = layers.iloc[::-1]
    bars = go.Figure(go.Bar(x=layers["mean_ms"], y=layers["name"], orientation="h",
                            error_x={"type": "data", "array": layers["mean_ci_ms"].fillna(0.0).tolist(),
                                     "visible": True}))
    bars.update_layout(title=f"Top {len(layers)} layers' leveled durations, with 95% intervals",
                       xaxis_title="ms per call")
    return section + _figure_html(bars, "chart-leveled-layers")


def kernels_section(trace: Trace, step_view: StepView | None = None) -> str:
    trace, which = step_view or deep_steps(trace)
    kernels = analysis.kernels_by_name(trace).head(TOP)
    if kernels.empty:
        return ""
    return _top_names_chart(kernels, "total_us", "kernels by total time", "GPU time", "chart-kernels", which)


def gpu_cpu_section(trace: Trace, step_view: StepView | None = None) -> str:
    trace, which = step_view or deep_steps(trace)
    per_layer = analysis.gpu_vs_cpu_per_layer(trace)
    if per_layer.empty or not (per_layer["kernels"] > 0).any():
        return ""
    grouped = per_layer.groupby("name", sort=False, observed=True)[["duration_us", "gpu_us", "cpu_us"]].sum()
    grouped = grouped.sort_values("duration_us", ascending=False).head(TOP).iloc[::-1]
    figure = go.Figure([
        go.Bar(x=grouped["gpu_us"] / 1e3, y=grouped.index, orientation="h", name="GPU busy"),
        go.Bar(x=grouped["cpu_us"] / 1e3, y=grouped.index, orientation="h", name="non-GPU")])
    figure.update_layout(barmode="stack", title="GPU vs CPU time per layer", xaxis_title=f"ms ({which})")
    return _figure_html(figure, "chart-gpu-cpu")


def roofline_section(trace: Trace) -> str:
    peak = analysis.trace_peak(trace)
    roof = analysis.kernel_roofline(trace, peak)
    points = roof.dropna(subset=["arithmetic_intensity", "achieved_tflops"])
    if points.empty:
        return ""
    figure = go.Figure()
    if peak is not None:
        intensity = np.logspace(-2, 4, 200)
        for label, tflops in (("FP32", peak.fp32_tflops), ("tensor", peak.tensor_tflops)):
            ceiling = np.minimum(tflops, intensity * peak.memory_gb_s / 1e3)
            figure.add_trace(go.Scatter(x=intensity, y=ceiling, mode="lines", name=f"{peak.name} {label} roof"))
    if len(points):
        figure.add_trace(go.Scatter(x=points["arithmetic_intensity"], y=points["achieved_tflops"], mode="markers",
                                    text=points["name"], name="kernels"))
    figure.update_layout(title="Roofline" + (f" ({peak.name}, ridge {peak.ridge_point():.1f} FLOP/byte)"
                                             if peak else ""),
                         xaxis={"type": "log", "title": "arithmetic intensity (FLOP/byte)"},
                         yaxis={"type": "log", "title": "TFLOP/s"})
    return _figure_html(figure, "chart-roofline")


def _texts(column: pd.Series) -> list[str]:
    """An integer column as text, "?" where null."""
    return ["?" if value is None or value is pd.NA else str(int(value)) for value in column.astype("Int64").tolist()]


def _median_step(trace: Trace) -> tuple[pd.DataFrame, str]:
    """The spans of the step with the median latency (all spans when there are no steps)."""
    spans = trace.spans
    latency = analysis.model_latency(trace)
    if latency.empty:
        return spans, "Timeline"
    # among the steps of the commonest kind (training, not its evaluation steps), the lower median:
    # of two, the faster (the first is often a warm-up)
    names = latency["name"].astype(object)
    commonest = names.value_counts().index[0]
    alike = latency[(names == commonest).to_numpy()].sort_values("latency_ms", kind="stable")
    median = alike.iloc[(len(alike) - 1) // 2]
    mixed = len(alike) < len(latency)
    return (spans[spans[col.STEP] == median["step"]],
            f"Step {median['step']} (the median latency{f' of the {commonest} steps' if mixed else ''}, "
            f"{median['latency_ms']:.3f} ms)")


def _thread_labels(trace: Trace, spans: pd.DataFrame) -> list[str]:
    """Each span's thread as a lane label: its name and id (``MainThread (4230)``), else its id."""
    known = trace.thread_names()
    ranks = (spans[col.RANK].astype("Int64").tolist() if col.RANK in spans and (trace.metadata.get("ranks"))
             else [None] * len(spans))
    labels = []
    for rank, thread in zip(ranks, spans[col.THREAD_ID].astype("Int64").tolist()):
        if thread is None or thread is pd.NA:
            labels.append("?")
            continue
        rank = None if rank is None or rank is pd.NA else int(rank)
        name = known.get((rank, int(thread)))
        where = "" if rank is None else f"rank {rank} · "
        if not name:
            name = f"thread {thread}"
        elif int(thread) >= 0 and str(thread) not in name:  # a profiler-numbered thread has no OS id
            name = f"{name} ({thread})"
        labels.append(where + name)
    return labels


def timeline_section(trace: Trace) -> str:
    """A flame chart of one step: a row per host thread and depth (depth 0 at the top), a row
    per GPU stream, each span a bar from its start."""
    chosen, title = _median_step(trace)
    chosen = chosen[chosen[col.LEVEL].isin(_LEVEL_ORDER)]
    if chosen.empty:
        return ""
    if len(chosen) > TIMELINE_SPANS:
        chosen = chosen.nlargest(TIMELINE_SPANS, col.DURATION_NS)
        title += f", longest {TIMELINE_SPANS} spans"
    chosen = chosen.reset_index(drop=True)
    depth = depth_of(parent_positions(chosen))
    host = chosen[col.THREAD_ID].notna().to_numpy()
    threads = _texts(chosen[col.THREAD_ID])
    names = _thread_labels(trace, chosen)
    lanes = np.array([f"{name} · depth {d}" if on_host else f"GPU {device} · stream {stream}"
                      for on_host, name, d, device, stream in zip(host, names, depth.tolist(),
                                                                  _texts(chosen[col.DEVICE_ID]),
                                                                  _texts(chosen[col.STREAM_ID]))], dtype=object)
    order = pd.DataFrame({"lane": lanes, "gpu": ~host, "thread": threads, "depth": depth}).drop_duplicates("lane")
    order = order.sort_values(["gpu", "thread", "depth"], kind="stable")["lane"].tolist()
    origin = int(chosen[col.START_NS].min())
    figure = go.Figure()
    for level in _LEVEL_ORDER:
        rows = (chosen[col.LEVEL] == level).to_numpy()
        if not rows.any():
            continue
        part = chosen[rows]
        figure.add_trace(go.Bar(
            base=(part[col.START_NS] - origin).to_numpy(dtype=float) / 1e6,
            x=part[col.DURATION_NS].to_numpy(dtype=float) / 1e6, y=lanes[rows], orientation="h", name=level,
            marker_color=LEVEL_COLOURS.get(level, OTHER_COLOUR),
            text=part[col.NAME].astype(str), textposition="inside", insidetextanchor="start",
            hovertemplate="%{text}<br>%{base:,.3f} ms + %{x:,.3f} ms<extra>" + level + "</extra>"))
    figure.update_layout(title="Flame chart of " + title[0].lower() + title[1:], barmode="overlay",
                         xaxis={"title": "ms from the step's start", "tickformat": ",~f"},
                         height=max(420, 26 * len(order) + 120),
                         yaxis={"categoryorder": "array", "categoryarray": order[::-1]}, bargap=0.05,
                         uniformtext=READABLE_TEXT)
    return _figure_html(figure, "chart-timeline")


def icicle_section(trace: Trace) -> str:
    """The hierarchy of a typical step: step -> model -> layers -> operators -> kernels, each
    node sized by its mean time per step."""
    tree = analysis.aggregated_tree(trace, max_nodes=ICICLE_NODES)
    if tree.empty or len(tree) < 2:
        return ""
    names = tree["name"].astype(str)
    parent_names = tree["parent_path"].map(dict(zip(tree["path"], names))).fillna("")
    labels = [shorten(own_name(name, parent), ICICLE_LABEL_CHARACTERS) for name, parent in zip(names, parent_names)]
    figure = go.Figure(go.Icicle(
        ids=tree["path"], parents=tree["parent_path"], labels=labels,
        marker={"colors": [LEVEL_COLOURS.get(level, OTHER_COLOUR) for level in tree["level"]]},
        values=tree["self_ms"], branchvalues="remainder",
        customdata=np.column_stack([names, tree["level"], tree["total_ms"], tree["calls"]]),
        hovertemplate="%{customdata[0]}<br>%{customdata[1]}: %{customdata[2]:,.3f} ms per step, "
                      "%{customdata[3]:.1f} calls<extra></extra>", maxdepth=5))
    figure.update_layout(title="Where a step's time goes (mean per step; click a box to zoom)", height=560,
                         uniformtext=READABLE_TEXT)
    return _figure_html(figure, "chart-icicle")


def own_name(name: str, parent: str) -> str:
    """What a node adds to its parent's name: ``encoder.layer.0.attention`` under
    ``encoder.layer.0`` is ``attention``; a name that does not extend its parent's stays whole."""
    if parent and name.startswith(parent) and name[len(parent):len(parent) + 1] in (".", "/"):
        return name[len(parent) + 1:]
    return name


def gc_note(trace: Trace) -> str:
    """What the garbage collector took, per generation, in one line (empty when none was recorded)."""
    collections = analysis.gc_collections(trace)
    if collections.empty:
        return ""
    parts = [f"generation {row.generation}: {row.collections:,} in {row.total_ms:,.3f} ms "
             f"({100 * row.wall_share:.1f}% of wall time, the longest {row.max_ms:,.3f} ms)"
             for row in collections.itertuples()]
    return _note("Garbage collections (every Python thread waits while one runs): " + "; ".join(parts))


def system_section(trace: Trace) -> str:
    """Sampled CPU, memory, GPU utilisation and power over the session, one panel per unit, and
    the garbage collector's time per generation."""
    collected = gc_note(trace)
    metrics = analysis.system_metrics(trace)
    if metrics.empty:
        return collected
    units = list(dict.fromkeys(metrics["unit"]))
    figure = make_subplots(rows=len(units), cols=1, shared_xaxes=True, subplot_titles=units, vertical_spacing=0.08)
    origin = int(metrics["time_ns"].min())
    for row, unit in enumerate(units, start=1):
        for (device, metric), part in metrics[metrics["unit"] == unit].groupby(["device", "metric"], sort=False,
                                                                               observed=True):
            figure.add_trace(go.Scatter(x=(part["time_ns"] - origin) / 1e9, y=part["value"],
                                        mode="lines+markers" if len(part) < 30 else "lines",
                                        name=f"{device} {metric}", line_shape="hv"), row=row, col=1)
    figure.update_layout(title="System metrics (system level)", height=220 * len(units) + 120)
    figure.update_xaxes(title_text="s from the first sample", row=len(units), col=1)
    energy = analysis.energy_per_step(trace)
    measured = energy[energy["energy_j"].notna()]
    text = ""
    if not measured.empty:
        per_device = measured.groupby("device", observed=True).agg(joules=("energy_j", "mean"),
                                                    how=("method", lambda m: ", ".join(sorted(set(m)))))
        text = _note("Energy per step: " + "; ".join(f"{device} {row.joules:.3f} J ({row.how})"
                                                     for device, row in per_device.iterrows()))
    return collected + text + _figure_html(figure, "chart-system")


def memory_section(trace: Trace) -> str:
    """Live tensor memory over time per device, and what each layer type allocates."""
    timeline = analysis.memory_timeline(trace)
    if timeline.empty:
        return ""
    origin = int(timeline["time_ns"].min())
    figure = go.Figure([go.Scatter(x=(part["time_ns"] - origin) / 1e6, y=part["live_bytes"] / 2**20, mode="lines",
                                   line_shape="hv", name=str(device))
                        for device, part in timeline.groupby("device", sort=False, observed=True)])
    figure.update_layout(title="Tensor memory allocated since the session began (memory level)",
                         xaxis_title="ms", yaxis_title="MiB")
    html_text = _figure_html(figure, "chart-memory")
    by_type = analysis.memory_by_layer_type(trace).head(TOP)
    if not by_type.empty:
        bars = go.Figure(go.Bar(x=by_type["module_type"] + " (" + by_type["device"] + ")",
                                y=by_type["mean_allocated_bytes"] / 2**20))
        bars.update_layout(title="Memory allocated per call, by layer type", yaxis_title="MiB per call")
        html_text += _figure_html(bars, "chart-memory-types")
    return html_text


def recommendations_section(trace: Trace) -> str:
    """What to change, most at stake first: severity, rule, share of step time, evidence, fix."""
    table = analysis.recommend(trace)
    if table.empty:
        return _note("No rule's threshold was passed by what this trace recorded.")
    items = "".join(
        f"<li class='{html.escape(r.severity)}'><b>[{html.escape(r.severity)}] {html.escape(r.rule)}</b>: "
        f"{100 * r.share:.1f}% of {html.escape(table.attrs.get(SHARE_OF, STEP_TIME))} at stake<br>"
        f"{html.escape(r.evidence)}<br>"
        f"<b>fix:</b> <code>{html.escape(r.fix)}</code>"
        + (f"<br><b>where:</b> {html.escape(', '.join(map(str, r.paths)))}" if len(r.paths) else "") + "</li>"
        for r in table.itertuples(index=False))
    return f'<ol id="recommendations">{items}</ol>'


def diagnostics_section(trace: Trace) -> str:
    table = analysis.diagnostics_table(trace.metadata.get("hierarchy") or {})
    table = table[table["spans"] > 0]
    if table.empty:
        return ""
    rows = "".join(f"<tr><td>{html.escape(r.problem)}</td><td>{r.spans:,}</td><td>{100 * r.share:.2f}%</td>"
                   f"<td>{html.escape(r.meaning)}</td></tr>" for r in table.itertuples())
    return ('<table id="diagnostics"><thead><tr><th>problem</th><th>spans</th><th>share</th><th>meaning</th></tr>'
            f"</thead><tbody>{rows}</tbody></table>")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
p.meta, p.note { color: #555; } table { border-collapse: collapse; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: left; }
#recommendations li { margin-bottom: 0.8em; } li.high b:first-child { color: #b00; }
li.medium b:first-child { color: #b60; }
table.source { font-family: ui-monospace, monospace; font-size: 0.85em; border: none; }
table.source td { border: none; padding: 0 8px; white-space: pre; }
table.source td.n, table.source td.t { color: #595959; text-align: right; }
table.source tr.gap td { color: #595959; }
table.source tr.hot td { color: #000; }
"""

SOURCE_FILES = 3
"""Files shown as annotated source: the hottest by self time."""
SOURCE_CONTEXT = 3
"""Lines shown around each line with time."""
SOURCE_LINES = 400
"""Lines of one file shown at most."""


HEAT_RGB = (220, 40, 0)
HEAT_MOST = 0.6
"""The hottest line's red, over white: black text on it keeps a contrast of 7:1 (WCAG AA asks
4.5:1)."""


def _heat(fraction: float) -> str:
    """A background from white (no time) to red (the hottest line)."""
    alpha = 0.08 + (HEAT_MOST - 0.08) * min(max(fraction, 0.0), 1.0)
    return f"background: rgba({', '.join(map(str, HEAT_RGB))}, {alpha:.2f})"


def _shown_numbers(hot: list[int], length: int) -> list[int]:
    """The line numbers shown of a file: each hot line with its context, in order."""
    shown = sorted({n for line in hot for n in range(max(1, line - SOURCE_CONTEXT),
                                                      min(length, line + SOURCE_CONTEXT) + 1)})
    return shown[:SOURCE_LINES]


def source_section(trace: Trace, step_view: StepView | None = None) -> str:
    """The hottest files of the user's code as annotated source: each line with time gets its
    self time, its share of the step time and a heat colour (the hottest line darkest)."""
    from xsp.analysis.lines import relative_files
    from xsp.reports.source import file_lines

    trace, which = step_view or deep_steps(trace)  # shares of the steps' time: the model built before them is not in it
    found = analysis.lines(trace)
    if found.empty:
        return ""
    by_file = found.groupby("file", sort=False, observed=True)["self_ms"].sum().sort_values(ascending=False)
    files = by_file.index[:SOURCE_FILES].tolist()
    names = relative_files(files)
    hottest = float(found["self_ms"].max()) or 1.0
    parts = [_note(f"The line of your code that made each recorded call, and the time under it (self: not under "
                   f"another line; {which}); {min(len(by_file), SOURCE_FILES)} of {len(by_file)} files, the hottest "
                   "first. "
                   "A layer called inside another layer of a library (nn.Sequential) counts on the line that called "
                   "the outer one; xsp report --lines lists them too.")]
    for file in files:
        rows = found[found["file"] == file]
        per_line = {int(n): (float(ms), float(share)) for n, ms, share in
                    zip(rows["line"], rows["self_ms"], rows["self_share"])}
        text = file_lines(str(file))
        parts.append(f"<h3>{html.escape(names[file])} ({by_file[file]:,.3f} ms self)</h3>")
        if text is None:
            parts.append(_note(f"{file} cannot be read here: its lines are listed without their text."))
            numbers = sorted(per_line)
        else:
            numbers = _shown_numbers(sorted(per_line), len(text))
        body, previous = [], 0
        for number in numbers:
            if previous and number > previous + 1:
                body.append("<tr class='gap'><td class='n'>...</td><td></td><td></td><td></td></tr>")
            previous = number
            code = html.escape(text[number - 1]) if text is not None and number <= len(text) else ""
            if number in per_line:
                ms, share = per_line[number]
                shown_share = "" if np.isnan(share) else f"{share:.1%}"
                body.append(f"<tr class='hot' style='{_heat(ms / hottest)}'><td class='n'>{number}</td>"
                            f"<td class='t'>{ms:,.3f} ms</td><td class='t'>{shown_share}</td><td>{code}</td></tr>")
            else:
                body.append(f"<tr><td class='n'>{number}</td><td></td><td></td><td>{code}</td></tr>")
        parts.append("<table class='source'>" + "".join(body) + "</table>")
    return "".join(parts)



def summary_section(trace: Trace) -> str:
    """The answer first: latency, throughput, how much of the session the steps cover, the
    share of the step time each level accounts for, and the top recommendations."""
    meta = trace.metadata
    facts: list[tuple[str, str]] = []
    summary = analysis.model_summary(trace)
    if not summary.empty:
        main = summary.sort_values("steps", ascending=False).iloc[0]
        failed = int(summary["failed"].sum())
        left_out = f"; {counted(failed, 'failed step')} left out" if failed else ""
        if main["steps"]:
            facts.append(("latency", f"{main['trimmed_mean_ms']:,.3f} ms per {main['name']} (trimmed mean of "
                                     f"{counted(int(main['steps']), 'completed step')}; p50 {main['p50_ms']:,.3f}, "
                                     f"p90 {main['p90_ms']:,.3f}{left_out})"))
        else:
            facts.append(("latency", f"none: every step ended by an exception ({counted(failed, 'failed step')})"))
        if pd.notna(main["throughput_per_s"]):
            facts.append(("throughput", f"{main['throughput_per_s']:,.1f} items/s"))
        coverage = analysis.step_coverage(trace).iloc[0]
        facts.append(("coverage", f"steps cover {100 * coverage['coverage']:.1f}% of the session "
                                  f"({coverage['session_ms']:,.3f} ms)"))
    facts.append(("device", str(meta.get("device", "?"))))
    export = export_line(meta)
    if export is not None:
        facts.append(("export", export))
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    out = f'<table id="summary">{rows}</table>'
    levels = analysis.level_summary(trace)
    if len(levels) > 1:
        cells = "".join(f"<tr><td>{html.escape(str(r.level))}</td><td>{r.spans:,}</td><td>{r.time_ms:,.3f}</td>"
                        f"<td>{100 * r.share:.1f}%</td></tr>" for r in levels.itertuples())
        out += ('<h3>Where the time went, per level (inside steps)</h3><table id="levels"><thead><tr><th>level</th>'
                "<th>spans</th><th>ms covered</th><th>share of step time</th></tr></thead>"
                f"<tbody>{cells}</tbody></table>")
    advice = analysis.recommend(trace).head(3)
    if not advice.empty:
        items = "".join(f"<li><b>{html.escape(r.rule)}</b> ({html.escape(r.severity)}, {100 * r.share:.1f}% of "
                        f"step time): <code>{html.escape(r.fix)}</code></li>" for r in advice.itertuples())
        out += f'<h3>Top recommendations</h3><ol id="top-recommendations">{items}</ol>'
    return out


def ranks_section(trace: Trace) -> str:
    """A distributed job: per rank, step latency and communication; per step, how late each
    rank entered the step's collectives."""
    said = "".join(_note(line) for line in job_file_lines(trace.metadata))
    communication = analysis.communication(trace)
    if len(trace.ranks) < 2 and (communication.empty or not communication["collectives_per_step"].sum()):
        return said
    apart = bool(trace.metadata.get(RANKS_APART))  # files of different runs: no rank waited for another
    rows = "".join(
        f"<tr><td>{r.rank}</td><td>{r.steps}</td><td>{r.step_ms:,.3f}</td><td>{r.comm_ms:,.3f}</td>"
        f"<td>{100 * r.comm_share:.1f}%</td><td>{'' if pd.isna(r.overlap_share) else f'{100 * r.overlap_share:.1f}%'}"
        f"</td><td>{r.collectives_per_step:,.0f}</td><td>"
        f"{'' if apart or pd.isna(r.late_ms) else f'{r.late_ms:,.3f}'}</td></tr>"
        for r in communication.itertuples())
    table = ('<table id="ranks"><thead><tr><th>rank</th><th>steps</th><th>step ms</th><th>comm ms</th><th>comm share'
             "</th><th>overlapped with compute</th><th>collectives per step</th><th>late ms</th></tr></thead>"
             f"<tbody>{rows}</tbody></table>")
    if apart:
        return said + _note("The ranks' times do not overlap (files of different runs?): how late each rank was is "
                            "not shown.") + table
    per_step = analysis.rank_steps(trace)
    if per_step.empty or per_step["late_ms"].isna().all():
        return said + table
    figure = go.Figure([go.Bar(x=group["step"], y=group["late_ms"], name=f"rank {rank}")
                        for rank, group in per_step.groupby("rank", observed=True)])
    figure.update_layout(barmode="group", title="How late each rank entered its step's collectives (ms the others "
                         "waited)", xaxis_title="step", yaxis_title="ms")
    return said + _note("Medians over steps; late ms: how much later than the first rank this rank entered its "
                        "collectives, summed over the step.") + table + _figure_html(figure, "chart-stragglers")


def render_html(trace: Trace, rank: int | None = None) -> str:
    """The whole report as one HTML document (plotly's JavaScript inlined; works offline).

    A section with nothing to show is left out; one line at the end names them. A trace of
    several ranks gets a section comparing them; the other sections show one rank (``rank``,
    default the first)."""
    ranks_part = ranks_section(trace)
    if len(trace.ranks) > 1:
        chosen = trace.ranks[0] if rank is None else rank
        trace = trace.for_rank(chosen)
        ranks_part += _note(f"The sections below show rank {chosen} (xsp report --rank N for another), and so does the "
                            "line above.")
    meta = trace.metadata
    step_view = deep_steps(trace)  # the steps the sections count, made once
    sections = [
        ("Ranks and communication", ranks_part),
        ("Summary", summary_section(trace)),
        ("Recommendations", recommendations_section(trace)),
        ("Where a step's time goes", icicle_section(trace)),
        ("Model latency", latency_section(trace)), ("Steps", steps_section(trace)),
        ("Leveled runs", leveled_section(trace)),
        ("Layers", layers_section(trace, step_view)), ("Where in your code", source_section(trace, step_view)),
        ("Operators", operators_section(trace, step_view)), ("Kernels", kernels_section(trace, step_view)),
        ("GPU vs CPU time per layer", gpu_cpu_section(trace, step_view)),
        ("Roofline", roofline_section(trace)), ("Timeline", timeline_section(trace)),
        ("Memory", memory_section(trace)), ("System", system_section(trace)),
        ("Hierarchy diagnostics", diagnostics_section(trace)),
    ]
    body = "".join(f"<section><h2>{html.escape(title)}</h2>{content}</section>"
                   for title, content in sections if content)
    absent = [title for title, content in sections if not content]
    if absent:
        body += _note("Not in this trace (nothing recorded for them): " + ", ".join(absent) + ".")
    summary = (f"{len(trace.spans):,} spans, {counted(len(trace.steps), 'step')}; device {meta.get('device', '?')}; "
               f"levels {', '.join(meta.get('levels', []))}; made {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
               f"by xsp {meta.get('xsp_version', '')}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>xsp report: "
            f"{html.escape(str(meta.get('service_name', 'trace')))}</title><style>{_STYLE}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<h1>xsp report: {html.escape(str(meta.get('service_name', 'trace')))}</h1>"
            f"<p class='meta'>{html.escape(summary)}</p>{body}</body></html>")


def write_html(trace: Trace, path: str | os.PathLike[str], rank: int | None = None) -> Path:
    """Write the self-contained HTML report of ``trace`` (of ``rank`` in detail, for a
    distributed job), atomically.

    Raises:
        xsp.io.outputs.OutputError: the file could not be written (nothing is left at ``path``).
    """
    return write_text_output(path, render_html(trace, rank))


__all__ = ["render_html", "write_html"]
