"""The HTML report reads well: the hot source line's figures keep a contrast of 4.5:1 on their
red, the icicle is coloured by level with each box's own name (the full name on hover), and the
flame chart's axis is in plain milliseconds. (headless Chromium checks the same pages in
tests/integration/test_html_report.py, in the heavy suite.)"""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")

import xsp  # noqa: E402
from xsp.reports.html import (  # noqa: E402
    HEAT_RGB,
    LEVEL_COLOURS,
    icicle_section,
    own_name,
    render_html,
    source_section,
    timeline_section,
)

WCAG_AA = 4.5


def luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG 2's relative luminance of an sRGB colour (0-255 channels)."""
    def linear(channel: float) -> float:
        c = channel / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = map(linear, rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def over_white(rgb: tuple[int, int, int], alpha: float) -> tuple[float, float, float]:
    return tuple(alpha * c + (1 - alpha) * 255 for c in rgb)  # type: ignore[return-value]


def hex_rgb(text: str) -> tuple[int, int, int]:
    text = text.lstrip("#")
    if len(text) == 3:
        text = "".join(c * 2 for c in text)
    return int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16)


@pytest.fixture(scope="module")
def nested():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.nn.Linear(8, 2))
    with xsp.trace(output=None, levels="model,layer,operator") as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 8))
    return session.trace


def test_the_hot_lines_figures_keep_a_contrast_of_4_5_to_1(nested):
    section = source_section(nested)
    alphas = [float(a) for a in re.findall(r"rgba\(220, 40, 0, ([0-9.]+)\)", section)]
    assert alphas and "class='hot'" in section
    page = render_html(nested)
    hot_text = re.search(r"table\.source tr\.hot td \{ color: (#[0-9a-f]+); \}", page).group(1)
    for alpha in alphas:  # every hot line, the hottest darkest
        assert contrast(hex_rgb(hot_text), over_white(HEAT_RGB, alpha)) >= WCAG_AA
    for grey in re.findall(r"table\.source (?:td\.n, table\.source td\.t|tr\.gap td) \{ color: (#[0-9a-f]+)", page):
        assert contrast(hex_rgb(grey), (255, 255, 255)) >= WCAG_AA  # line numbers and gaps on white


def _figure_data(section: str) -> list[dict]:
    """The traces plotly was given, from the section's script."""
    found = re.search(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*\{", section, re.S)
    return json.loads(found.group(1))


def test_the_icicle_is_coloured_by_level_with_short_labels_and_full_names_on_hover(nested):
    icicle = _figure_data(icicle_section(nested))[0]
    levels = [row[1] for row in icicle["customdata"]]
    assert icicle["marker"]["colors"] == [LEVEL_COLOURS[level] for level in levels]
    assert len(set(icicle["marker"]["colors"])) == 3  # model, layer, operator
    names = [row[0] for row in icicle["customdata"]]
    inner = names.index("model.0.0")  # the inner Linear: "0" in its box, under "model.0"'s
    assert icicle["labels"][inner] == "0"
    assert all(len(label) <= 32 for label in icicle["labels"])
    assert not any(label.startswith("model.") for label in icicle["labels"])  # no parent's name repeated
    assert "%{customdata[0]}" in icicle["hovertemplate"]
    assert '"uniformtext":{"minsize":10,"mode":"hide"}' in icicle_section(nested)  # no unreadable specks


def test_a_nodes_own_name_drops_its_parents():
    assert own_name("encoder.layer.0.attention", "encoder.layer.0") == "attention"
    assert own_name("encoder.layer.0", "encoder.layer") == "0"
    assert own_name("aten::addmm", "encoder.layer.0") == "aten::addmm"
    assert own_name("encoder.layers", "encoder.layer") == "encoder.layers"  # not a part of it
    assert own_name("model", "") == "model"


def test_the_flame_chart_reads_in_plain_milliseconds(nested):
    section = timeline_section(nested)
    assert "ms from the step's start" in section and "us from" not in section
    assert '"tickformat":",~f"' in section  # plain numbers: 0.5, 1, 1,000; never 0.5M
    assert '"uniformtext":{"minsize":10,"mode":"hide"}' in section
    bars = _figure_data(section)
    step_ms = max(base + width for bar in bars for base, width in zip(_numbers(bar["base"]), _numbers(bar["x"])))
    assert step_ms < 1_000  # milliseconds, not microseconds: a toy step is well under a second
    assert {bar["marker"]["color"] for bar in bars} == {LEVEL_COLOURS[bar["name"]] for bar in bars}


def _numbers(values) -> list[float]:
    """A plotly array, plain or typed (base64, as plotly 6 writes numpy arrays)."""
    if isinstance(values, list):
        return [float(v) for v in values]
    import base64

    import numpy as np
    return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).astype(float).tolist()


def test_the_charts_of_all_steps_count_only_the_steps():
    """Issue 62 item 1: weight initialisation before the first step (aten::uniform_, normal_)
    is not a step's time: the operator and layer charts leave it out, and say whose time they show."""
    from xsp.reports.html import layers_section, operators_section

    with xsp.trace(output=None, levels="model,layer,operator") as session, torch.no_grad():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())  # built inside: its init is recorded
        for _ in range(3):
            model(torch.ones(4, 8))
    spans = session.trace.spans
    outside = spans[spans["step"].isna() & (spans["level"] == "operator")]["name"].astype(str)
    assert outside.str.contains("uniform_").any()  # the initialisation was recorded, outside the steps
    operators = _figure_data(operators_section(session.trace))[0]
    assert not any("uniform_" in name for name in operators["y"])
    assert "ms (all steps)" in operators_section(session.trace) and "ms (all steps)" in layers_section(session.trace)
    shares = [float(share) for share in re.findall(r"<td class='t'>([0-9.]+)%</td>", source_section(session.trace))]
    assert shares and sum(shares) <= 100.05  # the line that built the model is not a share of the steps
