"""Model and layer levels around a model on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

import xsp
from xsp.core import schema as col

pytestmark = pytest.mark.gpu


def test_layers_on_cuda_are_traced_and_nested():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.LazyLinear(10)).cuda().eval()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    with torch.no_grad():
        model(x)
    with xsp.trace(output=None) as session, torch.no_grad():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
    spans = session.trace.spans
    assert len(session.trace.steps) == 3
    assert (spans[spans[col.KIND] == "predict"][col.BATCH_SIZE] == 4).all()
    assert session.trace.metadata["device"].startswith("cuda:")
    layers = spans[spans[col.LEVEL] == "layer"]
    assert set(layers[col.NAME]) == {"model.0", "model.1", "model.2", "model.3"}  # named by the binding
