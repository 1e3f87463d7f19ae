"""The HTML report opened in headless Chromium: loads without console errors, charts render."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import xsp
from xsp.reports.html import write_html

pytestmark = pytest.mark.heavy  # headless Chromium opens each report: `python -m pytest -m heavy`

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000", "--window-size=1300,4000"]
CHART_IDS = ["chart-latency", "chart-operators", "chart-kernels", "chart-timeline", "chart-icicle"]


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def open_page(chromium: str, page: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()],
                          capture_output=True, text=True, timeout=180)


def console_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if "CONSOLE" in line and re.search(r"Uncaught|Error|error", line.split("CONSOLE", 1)[1])]


def test_console_error_detection_works(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>throw new Error('deliberately broken page')</script></body></html>")
    result = open_page(chromium, page, tmp_path, "--dump-dom")
    assert any("deliberately broken page" in line for line in console_errors(result.stderr)), result.stderr[-2000:]


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory, shared_traces) -> Path:
    trace = xsp.load(shared_traces / "kineto" / "sampled_rank0.json.gz")
    return write_html(trace, tmp_path_factory.mktemp("html") / "gpu.html")


@pytest.fixture(scope="module")
def layer_report(tmp_path_factory) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with xsp.trace(output=None) as session, torch.no_grad():
        for _ in range(4):
            model(torch.randn(2, 8))
    return write_html(session.trace, tmp_path_factory.mktemp("html") / "layers.html")


@pytest.fixture(scope="module")
def training_report(tmp_path_factory) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with xsp.trace(output=None) as session:
        for _ in range(4):
            with xsp.span("make_batch"):
                x = torch.randn(2, 8)
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return write_html(session.trace, tmp_path_factory.mktemp("html") / "training.html")


@pytest.fixture(scope="module")
def leveled_report(tmp_path_factory) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        result = xsp.leveled(lambda: model(x), levels="model,layer,operator", repeat=3, warmup=1)
    return write_html(result.trace, tmp_path_factory.mktemp("html") / "leveled.html")


@pytest.fixture(scope="module")
def memory_system_report(tmp_path_factory) -> Path:
    os.environ["XSP_SYSTEM_HZ"] = "100"
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        with xsp.trace(levels="model,layer,memory,system", output=None) as session, torch.no_grad():
            for _ in range(20):
                model(torch.randn(32, 64))
    finally:
        del os.environ["XSP_SYSTEM_HZ"]
    return write_html(session.trace, tmp_path_factory.mktemp("html") / "memory_system.html")


@pytest.mark.parametrize("report, charts", [("gpu_report", CHART_IDS),
                                            ("memory_system_report", ["chart-icicle", "chart-memory",
                                                                      "chart-memory-types", "chart-system",
                                                                      "chart-timeline"]),
                                            ("layer_report", ["chart-latency", "chart-top-layers",
                                                              "chart-layer-types", "chart-timeline"]),
                                            ("leveled_report", ["chart-leveled", "chart-top-layers",
                                                                "chart-operators", "chart-timeline"]),
                                            ("training_report", ["chart-steps", "chart-top-layers",
                                                                 "chart-timeline"])])
def test_report_loads_without_errors_and_renders_its_charts(chromium, tmp_path, request, report, charts):
    page = request.getfixturevalue(report)
    assert "cdn.plot.ly" not in page.read_text()[:2000]  # plotly is inlined: the page works offline
    dom = open_page(chromium, page, tmp_path, "--dump-dom")
    assert console_errors(dom.stderr) == []
    for chart in charts:
        rendered = re.search(rf'id="{chart}"[^>]*class="[^"]*plotly-graph-div[^"]*js-plotly-plot', dom.stdout) or \
            re.search(rf'id="{chart}".{{0,400}}main-svg', dom.stdout, re.S)
        assert rendered, f"{chart} was not rendered by plotly"


def test_screenshot_is_not_blank(chromium, tmp_path, gpu_report):
    from PIL import Image, ImageStat

    shot = tmp_path / "report.png"
    result = open_page(chromium, gpu_report, tmp_path, f"--screenshot={shot}")
    assert shot.is_file(), result.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == (1300, 4000)
    assert ImageStat.Stat(image).stddev[0] > 10  # a blank page has no variation at all
    assert len(image.getcolors(maxcolors=1 << 16) or []) > 20


def test_cli_writes_the_html_report(shared_traces, tmp_path):
    from xsp.cli.main import main

    target = tmp_path / "report.html"
    assert main(["report", str(shared_traces / "kineto" / "a100_alexnet.json.gz"), "--html", str(target)]) == 0
    text = target.read_text()
    assert text.startswith("<!DOCTYPE html>") and "chart-kernels" in text and "Hierarchy diagnostics" in text
    # recommendations come first
    assert text.index('id="recommendations"') < text.index("chart-kernels")
    assert "pageable_memcpy" in text and "pin_memory=True" in text


def test_the_training_report_tells_where_the_step_time_went(training_report):
    text = training_report.read_text()
    assert "Steps cover" in text and 'id="user-spans"' in text and "make_batch" in text
    assert '"name":"optimizer"' in text.replace(" ", "") and '"name":"backward"' in text.replace(" ", "")


def test_the_report_opens_with_a_summary_and_leaves_out_what_was_not_recorded(gpu_report, layer_report):
    gpu = gpu_report.read_text()
    assert gpu.index('id="summary"') < gpu.index('id="recommendations"') < gpu.index("chart-icicle")
    assert 'id="levels"' in gpu and "kernel" in gpu and 'id="top-recommendations"' in gpu
    assert "chart-roofline" not in gpu and "chart-memory" not in gpu  # nothing to draw: no empty chart
    absent = re.search(r"Not in this trace \(nothing recorded for them\): ([^<]*)", gpu)
    assert absent and "Roofline" in absent.group(1) and "Memory" in absent.group(1)
    layers = layer_report.read_text()
    assert "Kernels" in re.search(r"Not in this trace[^<]*", layers).group(0)
    assert "<h2>Kernels</h2>" not in layers


def test_the_flame_chart_has_a_row_per_thread_and_depth(layer_report):
    text = layer_report.read_text()
    lanes = set(re.findall(r"\(\d+\) \\u00b7 depth (\d+)|\(\d+\) · depth (\d+)", text))  # "MainThread (tid) · depth 0"
    depths = {int(a or b) for a, b in lanes}
    assert depths == {0, 1}  # the model call (the step), its layers


READ_BACK = """<script>
window.addEventListener("load", () => {
  const rgb = (text) => (text.match(/[0-9.]+/g) || []).map(Number);
  const hot = document.querySelector("table.source tr.hot");
  const cells = hot ? Array.from(hot.querySelectorAll("td.t")).map((td) => rgb(getComputedStyle(td).color)) : [];
  const seen = {
    hot_text: cells, hot_background: hot ? rgb(getComputedStyle(hot).backgroundColor) : [],
    ticks: Array.from(document.querySelectorAll("#chart-timeline .xtick text")).map((t) => t.textContent),
    axis: (document.querySelector("#chart-timeline .xtitle") || {}).textContent,
    icicle_fills: Array.from(document.querySelectorAll("#chart-icicle path.surface")).map(
      (p) => getComputedStyle(p).fill),
    icicle_labels: Array.from(document.querySelectorAll("#chart-icicle text.slicetext")).map((t) => t.textContent),
  };
  const out = document.createElement("pre");
  out.id = "read-back";
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
});
</script>"""


def _blend(rgba: list[float]) -> tuple[float, ...]:
    """A computed rgba() colour over the page's white."""
    alpha = rgba[3] if len(rgba) > 3 else 1.0
    return tuple(alpha * c + (1 - alpha) * 255 for c in rgba[:3])


def test_chromium_shows_the_hot_line_legible_the_icicle_by_level_and_the_axis_in_ms(chromium, tmp_path):
    """Issue 62 item 7 as a reader meets it: what Chromium computed and drew, read back from the
    page, and a screenshot of it that is not blank."""
    import json

    from PIL import Image

    from tests.unit.test_html_readability import WCAG_AA, contrast
    from xsp.reports.html import LEVEL_COLOURS, render_html

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.nn.Linear(8, 2))
    with xsp.trace(output=None, levels="model,layer,operator") as session, torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 8))
    page = tmp_path / "readable.html"
    page.write_text(render_html(session.trace).replace("</body>", READ_BACK + "</body>"))
    dom = open_page(chromium, page, tmp_path, "--dump-dom")
    assert console_errors(dom.stderr) == []
    seen = json.loads(re.search(r'<pre id="read-back">(.*?)</pre>', dom.stdout, re.S).group(1).replace("&quot;", '"'))
    background = _blend(seen["hot_background"])
    assert seen["hot_text"] and all(contrast(tuple(text[:3]), background) >= WCAG_AA for text in seen["hot_text"])
    assert seen["axis"] == "ms from the step's start"
    assert seen["ticks"] and all(re.fullmatch(r"[0-9.,]+", tick.replace("\u2212", "-").lstrip("-"))
                                 for tick in seen["ticks"])  # 0.1, 0.2: no 0.5M, no µ
    fills = {tuple(round(c) for c in _blend([float(x) for x in re.findall(r"[0-9.]+", fill)])) for fill in
             seen["icicle_fills"]}
    expected = {tuple(int(LEVEL_COLOURS[level][i:i + 2], 16) for i in (1, 3, 5)) for level in
                ("model", "layer", "operator")}
    assert expected <= fills
    assert "model.0.0" not in seen["icicle_labels"] and "0" in seen["icicle_labels"]
    shot = tmp_path / "readable.png"
    open_page(chromium, page, tmp_path, f"--screenshot={shot}")
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50  # text, charts and colours drawn: not a blank page
