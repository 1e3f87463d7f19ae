"""docs/notebooks/analysis.ipynb runs from top to bottom."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "docs" / "notebooks" / "analysis.ipynb"


def test_analysis_notebook_executes(shared_traces, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("XSP_SHARED_TRACES", str(shared_traces))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    text = "".join(str(output.get("data", {}).get("text/plain", "")) + output.get("text", "") for output in outputs)
    assert "aten::cudnn_convolution" in text and "0.weight" not in text
