"""Small parts of how common training and inference patterns are told: samples per step,
nested backward passes, library classes in the type tables, library calls that are no models."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import xsp
from tests.unit.test_gpu_analyses import make_trace
from xsp import analysis
from xsp.core import schema as col
from xsp.record.marks import MarkKind
from xsp.tracers.model import _nested_backward
from xsp.tracers.module_calls.rows import module_type_name


def test_samples_per_step_count_accumulated_micro_batches_but_not_closures_or_generation():
    rows = [
        # step 0: four accumulated micro-batches of 16, each a call made by the step itself
        (1, None, "model", "step", "train_step", 0, 1000, {}),
        *[(10 + i, 1, "model", "predict", "model", i * 200, i * 200 + 100, {col.BATCH_SIZE: 16}) for i in range(4)],
        (20, 1, "model", "predict", "criterion", 950, 960, {col.BATCH_SIZE: 16}),
        # step 1: a closure optimizer calling the model three times on the same 256 samples
        (2, None, "model", "step", "train_step", 2000, 3000, {col.STEP: 1}),
        (30, 2, "model", "optimizer", "LBFGS.step", 2000, 3000, {col.STEP: 1}),
        *[(31 + i, 30, "model", "predict", "model", 2000 + i * 300, 2100 + i * 300, {col.BATCH_SIZE: 256,
                                                                                       col.STEP: 1})
          for i in range(3)],
        # step 2: generate() calling the model once per token for a batch of 2
        (3, None, "model", "step", "model.generate", 4000, 5000, {col.STEP: 2}),
        *[(40 + i, 3, "model", "predict", "model", 4000 + i * 100, 4050 + i * 100, {col.BATCH_SIZE: 2, col.STEP: 2})
          for i in range(6)],
        # step 3: one call that is its own step
        (50, None, "model", "predict", "model", 6000, 6100, {col.BATCH_SIZE: 8, col.STEP: 3}),
    ]
    latency = analysis.model_latency(make_trace(rows))
    assert latency["batch_size"].tolist() == [64, 256, 2, 8]
    assert np.allclose(latency["throughput_per_s"], latency["batch_size"] / (latency["latency_ms"] / 1e3))


def test_a_backward_pass_run_inside_another_is_part_of_it():
    kinds = np.array([MarkKind.BACKWARD, MarkKind.BACKWARD, MarkKind.BACKWARD, MarkKind.OPTIMIZER, MarkKind.BACKWARD])
    starts = np.array([10, 0, 30, 0, 100])
    ends = np.array([20, 50, 40, 200, 150])
    # the inner two (a reentrant checkpoint's) end first, so are recorded first
    assert _nested_backward(kinds, starts, ends).tolist() == [True, False, True, False, False]


def test_pytorch_classes_outside_torch_nn_say_where_they_are_from():
    import torch.ao.nn.quantized.dynamic as quantized

    assert module_type_name(torch.nn.Linear) == "Linear"
    assert module_type_name(quantized.Linear) == "Linear (torch.ao.nn.quantized.dynamic)"
    assert module_type_name(torch.nn.parallel.DistributedDataParallel) == "DistributedDataParallel"

    class Linear(torch.nn.Module):  # the user's own: its name, as written
        pass

    assert module_type_name(Linear) == "Linear"


@pytest.mark.parametrize("levels", ["model", "model,layer"])
def test_modules_called_by_pytorch_s_quantization_are_not_models(levels):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    with warnings.catch_warnings(), xsp.trace(levels=levels, output=None) as session, torch.no_grad():
        warnings.simplefilter("ignore")  # quantization's deprecation notices
        for _ in range(3):
            model(torch.randn(4, 8))
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        for _ in range(3):
            quantized(torch.randn(4, 8))
    predicts = session.trace.spans[session.trace.spans[col.KIND] == "predict"]
    assert predicts[col.NAME].tolist() == ["model"] * 3 + ["quantized"] * 3
    assert len(session.trace.steps) == 6
