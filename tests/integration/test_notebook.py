"""docs/notebooks/analysis.ipynb runs from top to bottom: in a fresh clone on the traces it
makes itself, and with a GPU trace pointed at."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a Jupyter kernel runs the notebook: `python -m pytest -m heavy`

NOTEBOOK = Path(__file__).resolve().parents[2] / "docs" / "notebooks" / "analysis.ipynb"


def _execute(tmp_path: Path, gpu_trace: Path | None) -> str:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = {key: value for key, value in os.environ.items() if key != "XSP_GPU_TRACE"}
    if gpu_trace is not None:
        env["XSP_GPU_TRACE"] = str(gpu_trace)
    env["TMPDIR"] = str(tmp_path)  # the notebook's traces go to a folder of its own under it
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # the kernel is started with this process's environment
    try:
        client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    return "".join(str(output.get("data", {}).get("text/plain", "")) + output.get("text", "") for output in outputs)


def test_the_notebook_runs_on_the_traces_it_makes(tmp_path):
    text = _execute(tmp_path, None)
    assert text.count("aten::") >= 5 and "no GPU trace" in text  # operators of both traces
    assert list(tmp_path.glob("xsp-notebook-*/mlp.xsp.parquet")) and not list(tmp_path.glob("*.xsp.parquet"))


def test_the_notebook_analyses_a_gpu_trace_given_to_it(shared_traces, tmp_path):
    text = _execute(tmp_path, shared_traces / "kineto" / "a100_alexnet.json.gz")
    assert "aten::cudnn_convolution" in text and "0.weight" not in text
