"""The HTML report: one self-contained, offline page of charts (plotly, its JavaScript embedded).

Sections: recommendations (what to change, most at stake first), model latency per step, where
the step time went (and the steps' share of the session, and the user's spans), top layers,
time per layer type, top kernels, GPU vs CPU time per layer, the roofline, a timeline of one
step, and the hierarchy diagnostics. Sections whose data the trace lacks say so instead of
drawing an empty chart.
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

from xsp import analysis
from xsp import schema as col
from xsp.fileio import write_text_output
from xsp.trace import Trace

TIMELINE_SPANS = 3000
"""Spans drawn in the step timeline at most (the longest are kept)."""
TOP = 15
_LEVEL_ORDER = ["model", "input", "layer", "operator", "cuda_api", "kernel"]


def _figure_html(figure: go.Figure, chart_id: str) -> str:
    figure.update_layout(margin={"l": 60, "r": 20, "t": 50, "b": 60}, template="plotly_white", height=420)
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=chart_id,
                          config={"displaylogo": False, "responsive": True})


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def latency_section(trace: Trace) -> str:
    latency = analysis.model_latency(trace)
    if latency.empty:
        return _note("No steps in this trace.")
    figure = go.Figure(go.Scatter(x=latency["step"].astype(float), y=latency["latency_ms"], mode="lines+markers",
                                  name="latency"))
    figure.update_layout(title="Model latency per step", xaxis_title="step", yaxis_title="ms")
    figure.update_xaxes(tickformat="d", dtick=max(1, len(latency) // 20))
    return _figure_html(figure, "chart-latency")


STEP_PARTS = ("forward", "backward", "optimizer", "input", "compile", "other")


def steps_section(trace: Trace) -> str:
    """How much of the session the steps cover, what each kind of step spent its time on, and
    the user's own spans."""
    coverage = analysis.step_coverage(trace).iloc[0]
    if not coverage["steps"]:
        return _note("No steps in this trace.")
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
                   f"<td>{r.mean_ms:,.3f}</td><td>{r.in_steps:,}</td><td>{100 * r.share:.1f}%</td></tr>"
                   for r in user.itertuples())
    table = ('<table id="user-spans"><thead><tr><th>your span</th><th>count</th><th>total ms</th><th>mean ms</th>'
             f"<th>in steps</th><th>share of the session</th></tr></thead><tbody>{rows}</tbody></table>")
    return text + _figure_html(figure, "chart-steps") + table


def layers_section(trace: Trace) -> str:
    top = analysis.top_layers(trace, k=TOP)
    if top.empty:
        return _note("No layer spans in this trace (record it with the layer level).")
    top = top.iloc[::-1]
    bars = go.Figure(go.Bar(x=top["total_self_ms"], y=top["name"] + " (" + top["kind"] + ")", orientation="h"))
    bars.update_layout(title=f"Top {len(top)} layers by self time", xaxis_title="ms (all steps)")
    types = analysis.layer_type_summary(trace).head(TOP)
    pie = go.Figure(go.Bar(x=types["module_type"], y=types["total_self_ms"]))
    pie.update_layout(title="Time per layer type (self time)", yaxis_title="ms (all steps)")
    return _figure_html(bars, "chart-top-layers") + _figure_html(pie, "chart-layer-types")


def _top_names_chart(table: pd.DataFrame, value_us: str, what: str, share_of: str, chart_id: str) -> str:
    """Horizontal bars of the rows' ``value_us`` (shown in ms), with calls and share on hover."""
    table = table.iloc[::-1]
    figure = go.Figure(go.Bar(x=table[value_us] / 1e3, y=table["name"].str.slice(0, 80), orientation="h",
                              customdata=table[["count", "share"]].to_numpy(),
                              hovertemplate="%{y}<br>%{x:.3f} ms, %{customdata[0]} calls, "
                                            f"%{{customdata[1]:.1%}} of {share_of}<extra></extra>"))
    figure.update_layout(title=f"Top {len(table)} {what}", xaxis_title="ms (all steps)",
                         height=max(420, 28 * len(table)))
    return _figure_html(figure, chart_id)


def operators_section(trace: Trace) -> str:
    ops = analysis.operator_table(trace).head(TOP)
    if ops.empty:
        return _note("No operator spans in this trace (record it with the operator level).")
    return _top_names_chart(ops, "self_us", "operators by self time", "operator time", "chart-operators")


def leveled_section(trace: Trace) -> str:
    runs = (trace.metadata.get("leveled") or {}).get("overhead") or []
    if not runs:
        return _note("Not a leveled result (see xsp.leveled and xsp run --leveled).")
    names = [run["run"] + (" (metrics)" if run.get("metric") else "") for run in runs]
    figure = go.Figure(go.Bar(x=names, y=[run["model_latency_ms"] for run in runs],
                              text=[f"{run['overhead']:+.1%}" for run in runs], textposition="outside"))
    figure.update_layout(title="Model latency per leveled run (overhead against the model-only run)",
                         yaxis_title="ms (trimmed mean)")
    return _figure_html(figure, "chart-leveled")


def kernels_section(trace: Trace) -> str:
    kernels = analysis.kernels_by_name(trace).head(TOP)
    if kernels.empty:
        return _note("No GPU kernels in this trace.")
    return _top_names_chart(kernels, "total_us", "kernels by total time", "GPU time", "chart-kernels")


def gpu_cpu_section(trace: Trace) -> str:
    per_layer = analysis.gpu_vs_cpu_per_layer(trace)
    if per_layer.empty or not (per_layer["kernels"] > 0).any():
        return _note("No layer launched GPU work in this trace, so there is no GPU/CPU split per layer.")
    grouped = per_layer.groupby("name", sort=False)[["duration_us", "gpu_us", "cpu_us"]].sum()
    grouped = grouped.sort_values("duration_us", ascending=False).head(TOP).iloc[::-1]
    figure = go.Figure([
        go.Bar(x=grouped["gpu_us"] / 1e3, y=grouped.index, orientation="h", name="GPU busy"),
        go.Bar(x=grouped["cpu_us"] / 1e3, y=grouped.index, orientation="h", name="non-GPU")])
    figure.update_layout(barmode="stack", title="GPU vs CPU time per layer", xaxis_title="ms (all steps)")
    return _figure_html(figure, "chart-gpu-cpu")


def roofline_section(trace: Trace) -> str:
    peak = analysis.trace_peak(trace)
    roof = analysis.kernel_roofline(trace, peak)
    points = roof.dropna(subset=["arithmetic_intensity", "achieved_tflops"])
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
    note = "" if len(points) else _note(
        "No kernel in this trace has both FLOPs and DRAM bytes, so no kernel can be placed on the roofline "
        "(FLOPs come from hardware counters or analytic FLOPs; see docs/analyses.md).")
    return note + _figure_html(figure, "chart-roofline")


def timeline_section(trace: Trace) -> str:
    spans = trace.spans
    latency = analysis.model_latency(trace)
    if latency.empty:
        chosen = spans
        title = "Timeline"
    else:
        median = latency.iloc[(latency["latency_ms"] - latency["latency_ms"].median()).abs().argmin()]
        chosen = spans[spans[col.STEP] == median["step"]]
        title = f"Timeline of step {median['step']} (the median latency, {median['latency_ms']:.3f} ms)"
    if chosen.empty:
        return _note("No spans to draw.")
    if len(chosen) > TIMELINE_SPANS:
        chosen = chosen.nlargest(TIMELINE_SPANS, col.DURATION_NS)
        title += f", longest {TIMELINE_SPANS} spans"
    origin = int(chosen[col.START_NS].min())
    lane = np.where(chosen[col.THREAD_ID].notna(),
                    chosen[col.LEVEL].astype(str) + " · thread " + chosen[col.THREAD_ID].astype(str),
                    "GPU " + chosen[col.DEVICE_ID].astype(str) + " · stream " + chosen[col.STREAM_ID].astype(str))
    figure = go.Figure()
    for level in _LEVEL_ORDER:
        rows = (chosen[col.LEVEL] == level).to_numpy()
        if not rows.any():
            continue
        part = chosen[rows]
        figure.add_trace(go.Bar(
            base=(part[col.START_NS] - origin).to_numpy(dtype=float) / 1e3,
            x=part[col.DURATION_NS].to_numpy(dtype=float) / 1e3, y=lane[rows], orientation="h", name=level,
            text=part[col.NAME].astype(str), hovertemplate="%{text}<br>%{x:.1f} us<extra></extra>"))
    figure.update_layout(title=title, barmode="overlay", xaxis_title="us from the step's start",
                         height=max(420, 60 * len(set(lane))))
    return _figure_html(figure, "chart-timeline")


def recommendations_section(trace: Trace) -> str:
    """What to change, most at stake first: severity, rule, share of step time, evidence, fix."""
    table = analysis.recommend(trace)
    if table.empty:
        return _note("No rule's threshold was passed by what this trace recorded.")
    items = "".join(
        f"<li class='{html.escape(r.severity)}'><b>[{html.escape(r.severity)}] {html.escape(r.rule)}</b>: "
        f"{100 * r.share:.1f}% of step time at stake<br>{html.escape(r.evidence)}<br>"
        f"<b>fix:</b> <code>{html.escape(r.fix)}</code>"
        + (f"<br><b>where:</b> {html.escape(', '.join(map(str, r.paths)))}" if len(r.paths) else "") + "</li>"
        for r in table.itertuples(index=False))
    return f'<ol id="recommendations">{items}</ol>'


def diagnostics_section(trace: Trace) -> str:
    table = analysis.diagnostics_table(trace.metadata.get("hierarchy") or {})
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
"""


def render_html(trace: Trace) -> str:
    """The whole report as one HTML document (plotly's JavaScript inlined; works offline)."""
    meta = trace.metadata
    sections = [
        ("Recommendations", recommendations_section(trace)),
        ("Model latency", latency_section(trace)), ("Steps", steps_section(trace)),
        ("Leveled runs", leveled_section(trace)),
        ("Layers", layers_section(trace)), ("Operators", operators_section(trace)),
        ("Kernels", kernels_section(trace)), ("GPU vs CPU time per layer", gpu_cpu_section(trace)),
        ("Roofline", roofline_section(trace)), ("Timeline", timeline_section(trace)),
        ("Hierarchy diagnostics", diagnostics_section(trace)),
    ]
    body = "".join(f"<section><h2>{html.escape(title)}</h2>{content}</section>" for title, content in sections)
    summary = (f"{len(trace.spans):,} spans, {len(trace.steps)} steps; device {meta.get('device', '?')}; "
               f"levels {', '.join(meta.get('levels', []))}; made {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
               f"by xsp {meta.get('xsp_version', '')}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>xsp report: "
            f"{html.escape(str(meta.get('service_name', 'trace')))}</title><style>{_STYLE}</style>"
            f"<script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            f"<h1>xsp report: {html.escape(str(meta.get('service_name', 'trace')))}</h1>"
            f"<p class='meta'>{html.escape(summary)}</p>{body}</body></html>")


def write_html(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write the self-contained HTML report of ``trace``, atomically.

    Raises:
        xsp.fileio.OutputError: the file could not be written (nothing is left at ``path``).
    """
    return write_text_output(path, render_html(trace))


__all__ = ["render_html", "write_html"]
