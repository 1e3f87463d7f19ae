"""Tracing the real ResNet-50 and BERT examples (random weights, built from configs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import xsp  # noqa: E402
from xsp import analysis  # noqa: E402
from xsp.core import schema as col  # noqa: E402

pytestmark = pytest.mark.heavy  # real ResNet-50 and BERT end to end: `python -m pytest -m heavy`

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def resnet_trace(tmp_path_factory):
    output = tmp_path_factory.mktemp("resnet") / "resnet.xsp.parquet"
    with xsp.trace(levels="model,layer", output=output):
        example("resnet50_inference").main(["--batch-size", "2", "--iterations", "2", "--image-size", "64"])
    return xsp.load(output)


@pytest.fixture(scope="module")
def bert_trace(tmp_path_factory):
    output = tmp_path_factory.mktemp("bert") / "bert.xsp.parquet"
    with xsp.trace(levels=("model", "layer"), output=output):
        example("bert_inference").main(["--batch-size", "3", "--seq-len", "16", "--iterations", "2"])
    return xsp.load(output)


def test_resnet50_steps_layers_and_shapes(resnet_trace):
    spans = resnet_trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 2 and set(predicts[col.BATCH_SIZE]) == {2}
    assert set(predicts[col.MODULE_TYPE]) == {"ResNetForImageClassification"}
    layers = spans[(spans[col.LEVEL] == "layer") & (spans[col.STEP] == 0)]
    assert (layers[col.MODULE_TYPE] == "Conv2d").sum() == 53  # ResNet-50's convolutions
    stem = layers[layers[col.NAME] == "model.resnet.embedder.embedder.convolution"].iloc[0]
    assert json.loads(stem[col.INPUT_SHAPES]) == [[2, 3, 64, 64]]
    assert json.loads(stem[col.OUTPUT_SHAPES]) == [[2, 64, 32, 32]]
    assert stem[col.PARAM_COUNT] == 64 * 3 * 7 * 7
    assert stem[col.PATH] == "model[0]/model.resnet.embedder.embedder.convolution[0]"
    assert "modeling_resnet.py" in layers[layers[col.MODULE_TYPE] == "ResNetConvLayer"][col.SOURCE].iloc[0]
    # both steps have exactly the same structure
    paths = spans[spans[col.LEVEL] == "layer"].groupby(col.STEP)[col.PATH].apply(frozenset)
    assert paths[0] == paths[1]


def test_resnet50_tree_is_consistent(resnet_trace):
    spans = resnet_trace.spans.set_index(col.SPAN_ID)
    children = spans[spans[col.PARENT_ID].notna()]
    parents = spans.loc[children[col.PARENT_ID].astype("int64")]
    assert (parents[col.START_NS].to_numpy() <= children[col.START_NS].to_numpy()).all()
    assert (parents[col.END_NS].to_numpy() >= children[col.END_NS].to_numpy()).all()
    assert (parents[col.TRACE_ID].to_numpy() == children[col.TRACE_ID].to_numpy()).all()
    assert resnet_trace.metadata["hierarchy"]["overlapping"] == 0
    assert resnet_trace.metadata["hierarchy"]["ambiguous"] == 0


def test_resnet50_analyses_add_up(resnet_trace):
    latency = analysis.model_latency(resnet_trace)
    assert latency["step"].tolist() == [0, 1] and (latency["batch_size"] == 2).all()
    types = analysis.layer_type_summary(resnet_trace)
    assert types.iloc[0]["module_type"] == "Conv2d"
    layer_self = analysis.layer_table(resnet_trace)["self_ms"].sum()
    assert layer_self <= latency["latency_ms"].sum() * 1.0001
    top = analysis.top_layers(resnet_trace, k=5)
    assert len(top) == 5 and (top["calls"] == 2).all()


def test_bert_is_traced_with_keyword_inputs(bert_trace):
    spans = bert_trace.spans
    predicts = spans[spans[col.KIND] == "predict"]
    assert len(predicts) == 2 and set(predicts[col.BATCH_SIZE]) == {3}
    assert json.loads(predicts[col.INPUT_SHAPES].iloc[0]) == [[3, 16], [3, 16]]
    names = set(spans[spans[col.LEVEL] == "layer"][col.NAME])
    assert {"model.bert.embeddings", "model.bert.encoder.layer.11.attention", "model.bert.pooler",
            "model.classifier"} <= names
    attention = spans[spans[col.NAME] == "model.bert.encoder.layer.3.attention.self.query"].iloc[0]
    assert attention[col.MODULE_TYPE] == "Linear"
    assert json.loads(attention[col.OUTPUT_SHAPES]) == [[3, 16, 768]]
    assert attention[col.PARAM_COUNT] == 768 * 768 + 768
    ids = dict(zip(spans[col.SPAN_ID], spans[col.NAME]))
    assert ids[attention[col.PARENT_ID]] == "model.bert.encoder.layer.3.attention.self"


def test_cli_report_on_the_bert_trace_runs(bert_trace, tmp_path, capsys):
    from xsp.cli.main import main

    path = tmp_path / "b.xsp.parquet"
    bert_trace.save(path)
    assert main(["report", str(path), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "Linear" in out and "Top 5 layers" in out
