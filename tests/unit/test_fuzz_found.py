"""Every input the fuzzer (tests/integration/test_fuzz.py) ever found breaking a reader's
contract, kept as a test: each loads, or is refused with the documented error in one line."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest

import xsp
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError
from xsp.export.budget import ATTR_AGGREGATED_COUNT, within_budget
from xsp.gate.baseline import Summary
from xsp.io.kineto import load_kineto
from xsp.io.parquet import read_trace
from xsp.table.build import conform

FOUND = Path(__file__).resolve().parents[1] / "data" / "fuzz_found"
REFUSED = {  # found raising UnicodeDecodeError, ArrowInvalid, ValidationError, AttributeError, OverflowError
    "B1_kineto_non_utf8_name.json": "not",
    "B1b_kineto_non_utf8_top_field.json": "not",
    "B2_kineto_non_utf8_args_key.json": "UTF8",
    "B12_kineto_non_utf8_args_key_msgspec_path.json": "Invalid UTF-8",  # (where the C scanner leaves it to msgspec)
    "B3_kineto_args_not_object.json": "Expected `object`",
    "B7_summary_keys_null.xsp.json": "not a readable xsp summary",
    "B9_kineto_huge_base_time.json": "OverflowError",
    "B10_parquet_null_typed_call_depth.xsp.parquet": "run outside their parent",
    "B11_summary_parquet_keys_null.xsp-summary.parquet": "not a readable xsp summary: a key that is null",
}
READ = {"B5_parquet_null_typed_int_column.xsp.parquet", "B6_parquet_null_kind.xsp.parquet",
        "B4_kineto_c_reads_msgspec_refuses_phase.json", "B4b_kineto_c_reads_msgspec_refuses_surrogate.json"}


def _read(path: Path) -> object:
    if path.name.endswith((".xsp.json", ".xsp-summary.parquet")):
        return Summary.load(path)
    if path.name.endswith(".parquet"):
        return read_trace(path)
    return load_kineto(path)


def test_every_found_input_is_listed():
    assert {path.name for path in FOUND.iterdir()} == set(REFUSED) | READ


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_found_input_is_refused_in_one_line(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TraceFormatError) as refused:
            _read(FOUND / name)
    assert REFUSED[name] in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name", sorted(READ))
def test_a_found_input_is_read_or_refused_never_a_traceback(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _read(FOUND / name)
        except TraceFormatError as refused:  # the msgspec path refuses what the C scanner may read
            assert name.startswith("B4") and "\n" not in str(refused)
    if name.endswith(".parquet"):
        assert len(xsp.load(FOUND / name).spans)


def test_the_span_budget_counts_the_spans_a_dropped_aggregate_stood_for():
    rows = [{col.TRACE_ID: "a" * 32, col.SPAN_ID: 1, col.LEVEL: "model", col.KIND: "predict", col.NAME: "m",
             col.START_NS: 0, col.END_NS: 10, col.THREAD_ID: 1}] + [
        {col.TRACE_ID: "a" * 32, col.SPAN_ID: i, col.PARENT_ID: 1, col.LEVEL: "layer", col.KIND: "forward",
         col.NAME: "l", col.START_NS: i, col.END_NS: i + 1, col.THREAD_ID: 1} for i in (2, 3)]
    spans = conform(pd.DataFrame(rows))
    spans[col.DURATION_NS] = spans[col.END_NS] - spans[col.START_NS]
    folded = within_budget(spans, 1)
    sent = sum(json.loads(text).get(ATTR_AGGREGATED_COUNT, 1) if isinstance(text, str) else 1
               for text in folded.spans[col.ATTRIBUTES])
    assert sent + folded.dropped == 3  # (2 before: an aggregate of two layers was counted as one)
