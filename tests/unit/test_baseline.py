"""Baseline summaries (xsp.gate.baseline): Parquet files that give back every key as kept, and
refuse what they cannot read in one line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.gate import diff_columns as dcol
from xsp.gate.baseline import QUANTILES, SUFFIX, Summary, summarize
from xsp.gate.significance import sample_stats


def key_table(rows: list[dict]) -> pd.DataFrame:
    filled = []
    for row in rows:
        samples = np.sort(np.asarray(row.get("samples", [1000]), dtype=np.int64))
        filled.append({col.LEVEL: row.get("level", "layer"), col.KIND: row.get("kind", "forward"),
                       col.NAME: row["name"], dcol.KEY: row["key"], dcol.PARENT_KEY: row.get("parent"),
                       dcol.COUNT: row.get("count", len(samples)), dcol.TOTAL_NS: row.get("total",
                                                                                            int(samples.sum())),
                       dcol.SAMPLES_NS: samples, dcol.SAMPLE_COUNT: row.get("sample_count", len(samples)),
                       col.INPUT_SHAPES: row.get("shapes"), dcol.KERNELS_PER_STEP: row.get("kernels", np.nan),
                       dcol.INPUT_DTYPES: row.get("dtypes")})
    return pd.DataFrame(filled, columns=list(dcol.KEY_COLUMNS))


def noisy(median: float, spread: float, count: int = 40, seed: int = 0) -> np.ndarray:
    return np.rint(median * np.exp(np.random.default_rng(seed).normal(0, spread, count))).astype(np.int64)


HAND_MADE = key_table([
    {"level": "model", "kind": "predict", "name": "net", "key": "net[0]", "samples": noisy(5e6, 0.05)},
    {"name": "net.body", "key": "net[0]/net.body[0]", "parent": "net[0]", "samples": noisy(4e6, 0.1, seed=1),
     "shapes": "[[8, 64]]"},
    # a path two segments below its parent's (a level between them was left out)
    {"name": "net.body.conv", "key": "net[0]/net.body[0]/x[0]/net.body.conv[3]", "parent": "net[0]/net.body[0]",
     "samples": noisy(2e6, 0.3, seed=2), "kernels": 3.5},
    {"level": "operator", "kind": "operator", "name": "aten::conv2d", "key": "net[0]/net.body[0]/aten::conv2d[12]",
     "parent": "net[0]/net.body[0]", "samples": noisy(1e6, 0.02, seed=3), "dtypes": "float, float, , ScalarList",
     "shapes": "[[8, 64], [64, 64]]", "count": 80},
    # a key that is no path below its parent, a lone span, zero durations, no samples at all
    {"name": "odd name [x]", "key": "elsewhere", "parent": "net[0]", "samples": [7]},
    {"level": "model", "kind": "session", "name": "session", "key": "session[0]", "samples": [0, 0, 0]},
    {"name": "nothing", "key": "nothing[0]", "samples": [], "count": 2, "total": 500, "sample_count": 0},
    {"name": "few", "key": "few[0]", "samples": [100, 5_000_000, 90_000]},
    {"name": "bimodal", "key": "bimodal[0]", "samples": np.r_[noisy(1e4, 0.01, 20), noisy(1e7, 0.01, 20, 5)]},
])


def round_trip(frames: dict[str, pd.DataFrame], tmp_path) -> dict[str, pd.DataFrame]:
    summary = Summary(keys={dcol.KeyBy(by): frame for by, frame in frames.items()}, metadata={"source": "test"})
    loaded = Summary.load(summary.save(tmp_path / f"s{SUFFIX}"))
    assert loaded.metadata == {"source": "test"}
    return {by.value: frame for by, frame in loaded.keys.items()}


def assert_faithful(sent: pd.DataFrame, back: pd.DataFrame) -> None:
    """Every column as sent, and each key's samples its :data:`QUANTILES` evenly spaced quantiles
    (all of them where it had no more), to the nanosecond."""
    assert list(back.columns) == [*dcol.KEY_COLUMNS, dcol.STEP_CV]
    # how much each key varies between steps, taken of all its samples before they were cut
    full = [np.sort(np.asarray(samples, dtype=np.int64)) for samples in sent[dcol.SAMPLES_NS]]
    np.testing.assert_allclose(back[dcol.STEP_CV].to_numpy(float), sample_stats(full)[2])
    for column in (col.LEVEL, col.KIND, col.NAME, dcol.KEY, dcol.PARENT_KEY, col.INPUT_SHAPES, dcol.INPUT_DTYPES):
        assert [None if pd.isna(v) else v for v in back[column]] == [None if pd.isna(v) else v for v in sent[column]], (
            column)
    for column in (dcol.COUNT, dcol.SAMPLE_COUNT, dcol.TOTAL_NS):
        assert back[column].tolist() == sent[column].tolist(), column
    np.testing.assert_array_equal(back[dcol.KERNELS_PER_STEP].to_numpy(float),
                                  sent[dcol.KERNELS_PER_STEP].to_numpy(float))
    for before, after in zip(sent[dcol.SAMPLES_NS], back[dcol.SAMPLES_NS]):
        before = np.sort(np.asarray(before, dtype=np.int64))
        kept = (np.rint(np.quantile(before, (np.arange(QUANTILES) + 0.5) / QUANTILES)).astype(np.int64)
                if len(before) > QUANTILES else before)
        assert after.dtype == np.int64 and after.tolist() == kept.tolist()


def test_hand_made_keys_come_back(tmp_path):
    back = round_trip({dcol.KeyBy.PATH.value: HAND_MADE}, tmp_path)
    assert_faithful(HAND_MADE, back[dcol.KeyBy.PATH.value])


def test_keys_by_name_that_stand_for_one_path_come_back_as_themselves(tmp_path):
    by_name = HAND_MADE.copy()
    by_name[dcol.KEY] = by_name[col.NAME]
    by_name[dcol.PARENT_KEY] = [None, "net", "net.body", "net.body", "net", None, None, None, None]
    by_name.loc[1, dcol.SAMPLES_NS] = np.asarray(by_name.loc[1, dcol.SAMPLES_NS]) + 1  # no longer the path's samples
    back = round_trip({dcol.KeyBy.NAME.value: by_name, dcol.KeyBy.PATH.value: HAND_MADE}, tmp_path)
    assert list(back) == [dcol.KeyBy.PATH.value, dcol.KeyBy.NAME.value]
    assert_faithful(HAND_MADE, back[dcol.KeyBy.PATH.value])
    assert_faithful(by_name, back[dcol.KeyBy.NAME.value])


def test_an_empty_table_comes_back_empty(tmp_path):
    empty = key_table([])
    back = round_trip({dcol.KeyBy.PATH.value: empty, dcol.KeyBy.NAME.value: empty}, tmp_path)
    assert all(len(frame) == 0 and list(frame.columns) == [*dcol.KEY_COLUMNS, dcol.STEP_CV] for frame in back.values())


@pytest.mark.parametrize("name", ["a100_alexnet.json.gz", "cpu_only_rank34.json.gz",
                                  pytest.param("v100_2rank_train_rank1.json.gz", marks=pytest.mark.heavy)])
def test_real_traces_summaries_come_back(shared_traces, name, tmp_path):
    trace = xsp.load(shared_traces / "kineto" / name)
    summary = summarize(trace)
    path = summary.save(tmp_path / f"s{SUFFIX}")
    loaded = Summary.load(path)
    for by, frame in summary.keys.items():
        assert_faithful(frame, loaded.keys[by])


def test_a_run_of_many_steps_costs_a_few_percent_of_its_trace(tmp_path):
    # 300 layers x 100 steps: each key keeps its shape, not its steps
    rng = np.random.default_rng(0)
    rows = []
    for step in range(100):
        start = step * 10_000_000
        rows.append({"level": "model", "kind": "predict", "name": "net", "path": "net[0]", "start_ns": start,
                     "end_ns": start + 9_000_000, "step": step, "span_id": step * 1000 + 1})
        at = start + 100
        for layer in range(300):
            length = int(20_000 * (1 + layer % 7) * np.exp(rng.normal(0, 0.05)))
            rows.append({"level": "layer", "kind": "forward", "name": f"net.layer{layer}",
                         "path": f"net[0]/net.layer{layer}[0]", "start_ns": at, "end_ns": at + length, "step": step,
                         "span_id": step * 1000 + 2 + layer, "parent_id": step * 1000 + 1,
                         "input_shapes": f"[[8, {layer % 5 + 1}]]"})
            at += length // 100
    frame = pd.DataFrame(rows)
    frame["duration_ns"] = frame["end_ns"] - frame["start_ns"]
    frame["trace_id"], frame["thread_id"] = "t", 1
    spans = pd.DataFrame({name: pd.array(frame[name].tolist() if name in frame else [None] * len(frame), dtype=dtype)
                          for name, dtype in col.COLUMNS.items()})
    trace = xsp.Trace(spans=spans, metadata={"schema_version": col.SCHEMA_VERSION})
    trace_path = trace.save(tmp_path / "run.xsp.parquet")
    summary_path = summarize(trace).save(tmp_path / f"run{SUFFIX}")
    assert summary_path.stat().st_size < 0.05 * trace_path.stat().st_size  # 3.4% (the packed JSON of 0.1.0: 0.5%)


def blocks_trace(steps: int, blocks: int = 16, seed: int = 0) -> xsp.Trace:
    """A ResNet-like run: ``blocks`` bottlenecks of three conv layers (a convolution, a norm
    and an activation each), repeated with the same shapes, as the layer level records them."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []

    def span(name: str, path: str, start: int, length: int, step: int, parent: int | None, shapes: str) -> int:
        span_id = len(rows) + 1
        rows.append({"level": "layer" if parent else "model", "kind": "forward" if parent else "predict",
                     "name": name, "path": path, "start_ns": start, "end_ns": start + length, "step": step,
                     "span_id": span_id, "parent_id": parent, "input_shapes": shapes})
        return span_id

    typical = {"convolution": 900_000, "normalization": 60_000, "activation": 30_000}
    for step in range(steps):
        start = step * 100_000_000
        model = span("model", "model[0]", start, 90_000_000, step, None, "[[1, 3, 224, 224]]")
        at = start + 1_000
        for block in range(blocks):
            stage = block // 4
            block_name = f"model.stages.{stage}.layers.{block % 4}"
            shapes = f"[[1, {64 << stage}, {56 >> stage}, {56 >> stage}]]"
            block_id = span(block_name, f"model[0]/{block_name}[0]", at, int(4_000_000 * np.exp(rng.normal(0, 0.02))),
                            step, model, shapes)
            for layer in range(3):  # each of a block's layers on its own shapes, as a bottleneck's are
                layer_name = f"{block_name}.layer.{layer}"
                layer_shapes = f"[[1, {(64 << stage) * (1 + layer)}, {56 >> stage}, {56 >> stage}]]"
                layer_id = span(layer_name, f"model[0]/{block_name}[0]/{layer_name}[0]", at,
                                int(1_200_000 * (1 + layer) * np.exp(rng.normal(0, 0.03))), step, block_id, shapes)
                for part, median in typical.items():
                    length = int(median * (1 + layer) * np.exp(rng.normal(0, 0.03)))
                    span(f"{layer_name}.{part}", f"model[0]/{block_name}[0]/{layer_name}[0]/{layer_name}.{part}[0]",
                         at, length, step, layer_id, layer_shapes)
                    at += length + 500
    frame = pd.DataFrame(rows)
    frame["duration_ns"] = frame["end_ns"] - frame["start_ns"]
    frame["trace_id"], frame["thread_id"] = "t", 1
    spans = pd.DataFrame({name: pd.array(frame[name].tolist() if name in frame else [None] * len(frame), dtype=dtype)
                          for name, dtype in col.COLUMNS.items()})
    return xsp.Trace(spans=spans, metadata={"schema_version": col.SCHEMA_VERSION})


def test_a_summary_of_repeated_blocks_comes_back(tmp_path):
    summary = summarize(blocks_trace(40))
    loaded = Summary.load(summary.save(tmp_path / f"run{SUFFIX}"))
    for by, frame in summary.keys.items():
        assert_faithful(frame, loaded.keys[by])


def test_keys_by_name_whose_parents_come_after_them_or_round_come_back(tmp_path):
    by_name = HAND_MADE.copy()
    by_name[dcol.KEY] = by_name[col.NAME]
    # a name's parent after it, two names each other's parent, a name its own parent
    by_name[dcol.PARENT_KEY] = ["few", "net", "net.body", "aten::conv2d", "net.body.conv", "session", None, "net",
                             "bimodal"]
    back = round_trip({dcol.KeyBy.NAME.value: by_name}, tmp_path)
    assert_faithful(by_name, back[dcol.KeyBy.NAME.value])


def test_a_summary_is_a_parquet_file_pandas_reads_as_it_is(tmp_path):
    path = Summary(keys={dcol.KeyBy.PATH: HAND_MADE}, metadata={"device": "cpu"}).save(tmp_path / f"s{SUFFIX}")
    frame = pd.read_parquet(path)
    assert len(frame) == len(HAND_MADE) and set(frame["by"]) == {"path"}
    assert frame[dcol.KEY].tolist() == HAND_MADE[dcol.KEY].tolist()
    assert all(len(samples) <= QUANTILES for samples in frame[dcol.SAMPLES_NS])


def test_a_packed_summary_of_an_older_xsp_is_refused_with_how_to_make_it_again(tmp_path):
    path = tmp_path / "old.xsp.json"
    path.write_text(json.dumps({"format": "xsp-summary", "version": 2, "metadata": {}, "keys": {"path": 1},
                                "packed_keys": "abc"}))
    with pytest.raises(TraceFormatError) as raised:
        Summary.load(path)
    message = str(raised.value)
    assert "\n" not in message and f"xsp summary TRACE -o NAME{SUFFIX}" in message


def test_a_summary_is_not_written_under_the_old_json_name(tmp_path):
    with pytest.raises(ValueError, match="summaries are Parquet files now"):
        Summary(keys={dcol.KeyBy.PATH: HAND_MADE}).save(tmp_path / "s.xsp.json")


@pytest.mark.parametrize("damage", ["half", "not parquet", "no facts", "newer"])
def test_damaged_or_foreign_files_are_a_format_error(tmp_path, damage):
    good = Summary(keys={dcol.KeyBy.PATH: HAND_MADE}).save(tmp_path / f"good{SUFFIX}").read_bytes()
    path = tmp_path / f"bad{SUFFIX}"
    if damage == "half":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "not parquet":
        path.write_bytes(b"PAR1 and then nothing a reader knows")
    elif damage == "no facts":  # a Parquet file, but not a summary
        pd.DataFrame({"a": [1, 2]}).to_parquet(path)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"a": [1]}).replace_schema_metadata(
            {b"xsp.summary": json.dumps({"format": "xsp-summary", "version": 99}).encode()})
        pq.write_table(table, path)
    with pytest.raises(TraceFormatError, match="not a readable xsp summary"):
        Summary.load(path)


def test_a_file_of_several_ranks_is_refused_naming_a_rank_file_only_where_one_is_there(tmp_path):
    from tests.unit.test_gpu_analyses import make_trace
    from xsp.gate.baseline import summarize_file

    rows = [(1, None, "model", "predict", "model", 0, 100, {col.RANK: 0}),
            (2, 1, "layer", "forward", "model.0", 10, 90, {col.RANK: 0}),
            (3, None, "model", "predict", "model", 0, 100, {col.RANK: 1}),
            (4, 3, "layer", "forward", "model.0", 10, 90, {col.RANK: 1})]
    path = make_trace(rows, {"schema_version": col.SCHEMA_VERSION}).save(tmp_path / "job.xsp.parquet")
    with pytest.raises(ValueError, match="holds 2 ranks") as refused:
        summarize_file(path)
    assert "job.rank0.xsp.parquet" in str(refused.value) and ".for_rank(0).save(" in str(refused.value)
    xsp.load(path).for_rank(0).save(tmp_path / "job.rank0.xsp.parquet")  # as the message says
    with pytest.raises(ValueError, match=r"summarise one rank's file \(job\.rank0\.xsp\.parquet\)"):
        summarize_file(path)
    assert len(summarize_file(tmp_path / "job.rank0.xsp.parquet").keys)


def test_a_summary_given_where_a_trace_is_read_says_what_it_is(tmp_path):
    """It said 'a Parquet file but not an xsp trace (no xsp metadata)'."""
    path = Summary(keys={dcol.KeyBy.PATH: HAND_MADE}, metadata={"source": "test"}).save(tmp_path / f"s{SUFFIX}")
    with pytest.raises(xsp.TraceFormatError, match=r"is an xsp summary, which xsp diff reads as a run to compare"):
        xsp.load(path)
