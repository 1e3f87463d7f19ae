"""The packed keys of a baseline summary: what comes back is what went in (exactly for keys,
counts, shapes and dtypes; within the stated grids for medians, totals and samples), on
hand-made key tables and on the real traces in ../shared/traces; damage is a clear error."""

from __future__ import annotations

import base64
import json
import lzma

import numpy as np
import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.gate import columns as dcol
from xsp.gate import summary_codec as codec
from xsp.gate.baseline import Summary, summarize

MAX_BYTES = 64 * 1024 * 1024


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


def round_trip(frames: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    return codec.decode(codec.encode(frames), MAX_BYTES)


def assert_faithful(sent: pd.DataFrame, back: pd.DataFrame) -> None:
    assert list(back.columns) == list(dcol.KEY_COLUMNS)
    for column in (col.LEVEL, col.KIND, col.NAME, dcol.KEY, dcol.PARENT_KEY, col.INPUT_SHAPES, dcol.INPUT_DTYPES):
        assert [None if pd.isna(v) else v for v in back[column]] == [None if pd.isna(v) else v for v in sent[column]], (
            column)
    for column in (dcol.COUNT, dcol.SAMPLE_COUNT):
        assert back[column].tolist() == sent[column].tolist(), column
    np.testing.assert_array_equal(back[dcol.KERNELS_PER_STEP].to_numpy(float),
                                  sent[dcol.KERNELS_PER_STEP].to_numpy(float))
    np.testing.assert_allclose(back[dcol.TOTAL_NS], sent[dcol.TOTAL_NS], rtol=codec.TOTAL_STEP / 2 + 1e-9, atol=1)
    rows = np.arange(len(sent))
    if len(rows) > 3000:  # a real trace's hundred thousand keys: a fixed sample of them
        rows = np.random.default_rng(0).choice(rows, 3000, replace=False)
    for before, after in zip(sent[dcol.SAMPLES_NS].to_numpy()[rows], back[dcol.SAMPLES_NS].to_numpy()[rows]):
        before = np.sort(np.asarray(before, dtype=np.float64))
        kept = np.quantile(before, (np.arange(codec.QUANTILES) + 0.5) / codec.QUANTILES) if len(
            before) > codec.QUANTILES else before
        assert len(after) == len(kept) and list(after) == sorted(after)
        if not len(kept):
            continue
        logs = np.log1p(kept)
        spread = np.subtract(*np.quantile(logs, [0.75, 0.25]))
        # a median within half its grid: 0.2%, or a quarter of the key's sample grid if coarser
        median_step = max(codec.VALUE_STEP, max(spread / codec.UNITS_PER_IQR, codec.FINEST_UNIT)
                          / codec.MEDIAN_STEPS_PER_UNIT)
        assert abs(np.median(after) - np.median(kept)) <= np.median(kept) * median_step / 2 * 1.01 + 1
        # each comes back within a quarter of the key's spread (half its grid, and the rescale to
        # the median), never worse than the finest grid
        tolerance = max(spread / codec.UNITS_PER_IQR, codec.FINEST_UNIT) + 2 * codec.VALUE_STEP
        assert np.abs(np.log1p(after) - logs).max() <= tolerance + 1 / max(kept.min(), 1), (kept, after)


def test_hand_made_keys_come_back():
    back = round_trip({dcol.KeyBy.PATH.value: HAND_MADE})
    assert_faithful(HAND_MADE, back[dcol.KeyBy.PATH.value])


def test_keys_by_name_that_stand_for_one_path_come_back_as_themselves():
    by_name = HAND_MADE.copy()
    by_name[dcol.KEY] = by_name[col.NAME]
    by_name[dcol.PARENT_KEY] = [None, "net", "net.body", "net.body", "net", None, None, None, None]
    by_name.loc[1, dcol.SAMPLES_NS] = np.asarray(by_name.loc[1, dcol.SAMPLES_NS]) + 1  # no longer the path's samples
    back = round_trip({dcol.KeyBy.NAME.value: by_name, dcol.KeyBy.PATH.value: HAND_MADE})
    assert list(back) == [dcol.KeyBy.PATH.value, dcol.KeyBy.NAME.value]
    assert_faithful(HAND_MADE, back[dcol.KeyBy.PATH.value])
    assert_faithful(by_name, back[dcol.KeyBy.NAME.value])


def test_an_empty_table_comes_back_empty():
    empty = key_table([])
    back = round_trip({dcol.KeyBy.PATH.value: empty, dcol.KeyBy.NAME.value: empty})
    assert all(len(frame) == 0 and list(frame.columns) == list(dcol.KEY_COLUMNS) for frame in back.values())


@pytest.mark.parametrize("name", ["a100_alexnet.json.gz", "v100_2rank_train_rank1.json.gz", "cpu_only_rank34.json.gz"])
def test_real_traces_summaries_come_back(shared_traces, name, tmp_path):
    trace = xsp.load(shared_traces / "kineto" / name)
    summary = summarize(trace)
    path = summary.save(tmp_path / "s.xsp.json")
    loaded = Summary.load(path)
    for by, frame in summary.keys.items():
        assert_faithful(frame, loaded.keys[by])


def test_a_run_of_many_steps_costs_a_fraction_of_a_percent_of_its_trace(tmp_path):
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
    summary_path = summarize(trace).save(tmp_path / "run.xsp.json")
    assert summary_path.stat().st_size < 0.01 * trace_path.stat().st_size


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


def test_a_summary_of_repeated_blocks_costs_under_seven_bytes_a_key(tmp_path):
    # ResNet-50's layer level at 40 steps is 282 keys in a 291 KiB trace: 1% of it is 10 bytes a
    # key, metadata and JSON included
    summary = summarize(blocks_trace(40))
    packed = codec.encode({by.value: frame for by, frame in summary.keys.items()})
    assert len(packed) < 7 * len(summary.keys[dcol.KeyBy.PATH]), len(packed)
    loaded = Summary.load(summary.save(tmp_path / "run.xsp.json"))
    for by, frame in summary.keys.items():
        assert_faithful(frame, loaded.keys[by])


def test_a_repeated_blocks_medians_are_written_against_the_first_blocks():
    frame = summarize(blocks_trace(40, blocks=8)).keys[dcol.KeyBy.PATH]
    strings = codec._Strings()
    columns = codec._table_columns(frame, strings, np.full(len(frame), -1))
    whole = codec._sample_columns(codec._Ragged.of(frame[dcol.SAMPLES_NS].to_numpy()),
                                  frame[dcol.SAMPLE_COUNT].to_numpy(), frame[dcol.TOTAL_NS].to_numpy())["median"]
    names = frame[col.NAME].tolist()
    # blocks 1-3 of stage 0 and 5-7 of stage 1 repeat blocks 0 and 4 (the same shapes)
    repeated = [i for i, name in enumerate(names) if name.startswith("model.stages.") and name.split(".")[4] != "0"]
    assert len(repeated) == 6 * 13
    written, kept = np.abs(columns["median"][repeated]), np.abs(whole[repeated])
    assert kept.min() > 1000 and np.median(written) < 30, (written, kept)


def test_keys_by_name_whose_parents_come_after_them_or_round_come_back():
    by_name = HAND_MADE.copy()
    by_name[dcol.KEY] = by_name[col.NAME]
    # a name's parent after it, two names each other's parent, a name its own parent
    by_name[dcol.PARENT_KEY] = ["few", "net", "net.body", "aten::conv2d", "net.body.conv", "session", None, "net",
                             "bimodal"]
    back = round_trip({dcol.KeyBy.NAME.value: by_name})
    assert_faithful(by_name, back[dcol.KeyBy.NAME.value])


def test_keys_packed_by_the_first_encoding_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="make the summary again"):
        codec.decode(repacked({**json.loads(HEADER), "encoding": "xsp-packed-keys-1"}), MAX_BYTES)


def packed_document(blob: bytes) -> bytes:
    return json.dumps({"format": "xsp-summary", "version": 2, "metadata": {}, "keys": {"path": 1},
                       "packed_keys": base64.b85encode(blob).decode()}).encode()


GOOD = codec.encode({dcol.KeyBy.PATH.value: HAND_MADE})
PAYLOAD = lzma.decompress(GOOD)
HEADER, BODY = PAYLOAD.split(b"\0", 1)


def repacked(header: dict, body: bytes = BODY) -> bytes:
    return lzma.compress(json.dumps(header).encode() + b"\0" + body)


@pytest.mark.parametrize("blob", [
    GOOD[: len(GOOD) // 2], b"not xz at all", lzma.compress(b"no header"), lzma.compress(b"\0" * 10),
    repacked({**json.loads(HEADER), "encoding": "xsp-packed-keys-99"}),
    repacked(json.loads(HEADER), BODY[:-5]),
    repacked({**json.loads(HEADER), "strings": []}),
    repacked(json.loads(HEADER), bytes(len(BODY))),
])
def test_damaged_packed_keys_are_a_format_error(tmp_path, blob):
    with pytest.raises(ValueError):
        codec.decode(blob, MAX_BYTES)
    path = tmp_path / "bad.xsp.json"
    path.write_bytes(packed_document(blob))
    with pytest.raises(TraceFormatError, match="not a readable xsp summary"):
        Summary.load(path)


def test_packed_keys_that_inflate_past_the_limit_are_refused():
    with pytest.raises(ValueError, match="inflate past"):
        codec.decode(lzma.compress(PAYLOAD), len(PAYLOAD) - 1)
    assert len(codec.decode(lzma.compress(PAYLOAD), len(PAYLOAD))["path"]) == len(HAND_MADE)


def test_packed_keys_that_are_not_base85_are_a_format_error(tmp_path):
    path = tmp_path / "bad.xsp.json"
    path.write_text(json.dumps({"format": "xsp-summary", "version": 2, "packed_keys": "\\"}))
    with pytest.raises(TraceFormatError):
        Summary.load(path)
