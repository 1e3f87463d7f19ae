"""The flops level against PyTorch's own FlopCounterMode on ResNet-50, BERT-base and GPT-2
(from their configs, random weights), under inference_mode, no_grad and with autograd on."""

from __future__ import annotations

import pytest
import torch

import xsp
from xsp.analysis import model_flops

transformers = pytest.importorskip("transformers")
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count  # noqa: E402

pytestmark = pytest.mark.heavy  # real ResNet-50, BERT-base and GPT-2 end to end: `python -m pytest -m heavy`

TOLERANCE = 0.02
"""xsp also counts elementwise, normalisation and reduction operators (about 1% of these
models' FLOPs), which FlopCounterMode leaves out."""
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


REFERENCE_MAPPING = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention}
"""FlopCounterMode has no entry for the CPU attention kernel: give it PyTorch's own attention
formula, which it applies to the GPU kernels."""


def resnet50():
    config = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
                                       layer_type="bottleneck", hidden_act="relu")
    return transformers.ResNetModel(config).eval(), {"pixel_values": torch.randn(1, 3, 224, 224)}


def bert_base():
    return transformers.BertModel(transformers.BertConfig()).eval(), {"input_ids": torch.randint(0, 30000, (1, 128))}


def gpt2():
    return transformers.GPT2Model(transformers.GPT2Config()).eval(), {"input_ids": torch.randint(0, 50000, (1, 128))}


@pytest.fixture(scope="module", params=[resnet50, bert_base, gpt2], ids=lambda build: build.__name__)
def model_and_inputs(request):
    torch.manual_seed(0)
    return request.param()


def reference_flops(model, inputs, backward: bool = False) -> int:
    with FlopCounterMode(display=False, custom_mapping=REFERENCE_MAPPING) as counter:
        out = model(**inputs)
        if backward:
            out.last_hidden_state.float().mean().backward()
    return counter.get_total_flops()


def xsp_flops(model, inputs, backward: bool = False) -> float:
    with xsp.trace(levels="model,flops", output=None) as session:
        out = model(**inputs)
        if backward:
            out.last_hidden_state.float().mean().backward()
    return float(model_flops(session.trace)["flops"].sum())


@pytest.mark.parametrize("mode", list(MODES))
def test_forward_flops_match_pytorchs_counter_in_every_autograd_mode(model_and_inputs, mode):
    model, inputs = model_and_inputs
    with MODES[mode]():
        expected = reference_flops(model, inputs)
        counted = xsp_flops(model, inputs)
    assert expected > 1e9
    assert counted == pytest.approx(expected, rel=TOLERANCE)


def test_forward_and_backward_flops_match_pytorchs_counter():
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=2))
    inputs = {"input_ids": torch.randint(0, 30000, (2, 64))}
    expected = reference_flops(model, inputs, backward=True)
    assert xsp_flops(model, inputs, backward=True) == pytest.approx(expected, rel=TOLERANCE)
