"""xsp diff on constructed runs with known deltas, A/A pairs, summaries, every output format,
and real Kineto traces from ../shared/traces."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

import xsp
from xsp.core import schema as col
from xsp.core.errors import TraceFormatError, TraceNotFoundError
from xsp.gate import comparison, significance, verdicts
from xsp.gate import diff_columns as dcol
from xsp.gate import key_samples as keyed
from xsp.gate.baseline import QUANTILES, Summary, summarize
from xsp.gate.diff import diff
from xsp.reports import diff_formats
from xsp.table.build import concat_spans, conform

STEP_NS = 1_000_000
LAYERS = {"net.a": 300_000, "net.b": 200_000, "net.c": 400_000}
"""Layer name -> its typical duration (ns) in the constructed runs."""


def run(seed: int, steps: int = 40, slower: dict[str, float] | None = None, noise: float = 0.02,
        extra_layer: bool = False, shapes: str = "[[8, 64]]", kernels: int = 0, process: float = 0.0,
        layers: dict[str, int] | None = None, gap_ns: int = 1_000) -> xsp.Trace:
    """A constructed model+layer run: one ``predict`` per step holding the layers in turn.

    ``noise`` varies each step; ``process`` sets each layer off by a random amount for the
    whole run (the same code in another process, whose memory and caches fall differently);
    ``gap_ns`` is the model's own time before, between and after its layers."""
    rng = np.random.default_rng(seed)
    rows = []
    span_id = 1
    clock = 1_000_000_000
    typical = LAYERS if layers is None else layers
    names = list(typical) + (["net.d"] if extra_layer else [])
    offsets = {name: 1 + rng.normal(0, process) for name in names}
    for _ in range(steps):
        durations = {name: int(typical.get(name, 100_000) * (1 + (slower or {}).get(name, 0.0)) * offsets[name]
                               * (1 + rng.normal(0, noise))) for name in names}
        root_id, start = span_id, clock
        span_id += 1
        children = []
        at = start + gap_ns
        for name in names:
            children.append(dict(span_id=span_id, parent_id=root_id, level="layer", kind="forward", name=name,
                                 start_ns=at, end_ns=at + durations[name], path=f"net[0]/{name}[0]",
                                 input_shapes=shapes))
            layer_id = span_id
            span_id += 1
            for k in range(kernels if name == "net.b" else 0):
                children.append(dict(span_id=span_id, parent_id=layer_id, level="kernel", kind="kernel",
                                     name=f"gemm{k}", start_ns=at + 10 + k, end_ns=at + 20 + k,
                                     path=f"net[0]/net.b[0]/gemm{k}[0]", input_shapes=None))
                span_id += 1
            at += durations[name] + gap_ns
        rows.append(dict(span_id=root_id, parent_id=None, level="model", kind="predict", name="net", start_ns=start,
                         end_ns=at, path="net[0]", input_shapes=shapes))
        rows.extend(children)
        clock = at + 50_000
    frame = pd.DataFrame(rows)
    frame["duration_ns"] = frame["end_ns"] - frame["start_ns"]
    frame["trace_id"] = "t"
    frame["step"] = np.repeat(np.arange(steps), len(rows) // steps)
    frame["thread_id"] = 1
    spans = pd.DataFrame({
        name: (pd.array(frame[name].tolist(), dtype=dtype) if name in frame else pd.array([None] * len(frame),
                                                                                          dtype=dtype))
        for name, dtype in col.COLUMNS.items()})
    return xsp.Trace(spans=spans, metadata={"schema_version": col.SCHEMA_VERSION})


def row(result: xsp.Diff, key: str) -> pd.Series:
    found = result.table[result.table[dcol.KEY] == key]
    assert len(found) == 1, key
    return found.iloc[0]


def test_a_slowed_layer_is_found_and_explains_the_model_delta():
    result = diff(run(1), run(2, slower={"net.b": 0.3}))
    assert result.verdict is dcol.Verdict.REGRESSED
    slowed = row(result, "net[0]/net.b[0]")
    assert slowed[dcol.VERDICT] == "regressed"
    assert slowed[dcol.RATIO] == pytest.approx(1.3, abs=0.03)
    assert slowed[dcol.DELTA_NS] == pytest.approx(60_000, rel=0.15)
    assert slowed[dcol.EXPLAINS] == pytest.approx(1.0, abs=0.2)
    assert slowed[dcol.Q_VALUE] < 0.01 and slowed[dcol.TEST] == dcol.Test.RANK.value
    assert row(result, "net[0]")[dcol.VERDICT] == "regressed"
    for other in ("net[0]/net.a[0]", "net[0]/net.c[0]"):
        assert row(result, other)[dcol.VERDICT] == "unchanged"
    chain = result.breakdown[[dcol.DEPTH, dcol.KEY]].values.tolist()
    assert chain[:2] == [[0, "net[0]"], [1, "net[0]/net.b[0]"]]
    assert list(result.table.columns[:14]) == [
        "level", "kind", "key", "base_count", "new_count", "base_total_ns", "new_total_ns", "base_median_ns",
        "new_median_ns", "delta_ns", "ratio", "p_value", "verdict", "explains"]


def test_an_improvement_is_improved():
    result = diff(run(1), run(2, slower={"net.c": -0.2}))
    assert result.verdict is dcol.Verdict.IMPROVED
    assert row(result, "net[0]/net.c[0]")[dcol.VERDICT] == "improved"


def test_a_and_a_pairs_raise_no_alarm():
    verdicts = [diff(run(seed), run(seed + 100)).verdict for seed in range(20)]
    assert verdicts.count(dcol.Verdict.UNCHANGED) >= 19


def test_runs_without_lines_compared_by_line_say_so_and_not_that_they_share_no_key():
    result = xsp.diff(run(1), run(2), by="line")
    assert result.table.empty and result.settings["levels"] == []
    reason = result.nothing_judged()
    assert reason is not None and reason.startswith("neither run recorded the lines of code")
    from xsp.reports.diff_formats import text

    assert "by line at no level;" in text(result, width=200)


def test_a_significant_change_below_the_threshold_or_min_delta_is_unchanged():
    base, new = run(1, noise=0.002), run(2, slower={"net.b": 0.03}, noise=0.002)
    result = diff(base, new, min_delta_us=5)  # 3% < 5%: significant, but not reported
    assert row(result, "net[0]/net.b[0]")[dcol.Q_VALUE] < 0.01
    assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged"
    assert diff(base, new, threshold=0.02, min_delta_us=5).verdict is dcol.Verdict.REGRESSED
    # 3% of 200 µs is 6 µs: below the default minimum delta of 20 µs
    assert diff(base, new, threshold=0.02).verdict is dcol.Verdict.UNCHANGED


def test_noise_larger_than_the_change_is_not_a_regression_and_is_warned_about():
    result = diff(run(1, noise=0.3), run(2, noise=0.3, slower={"net.b": 0.08}))
    assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged"
    assert any("varies" in warning and "threshold" in warning for warning in result.warnings)
    assert row(result, "net[0]")[dcol.BASE_CV] > 0.05


def test_few_samples_fall_back_to_ranges_and_one_sample_gives_no_verdict():
    result = diff(run(1, steps=3), run(2, steps=3, slower={"net.b": 0.5}))
    slowed = row(result, "net[0]/net.b[0]")
    assert slowed[dcol.TEST] == dcol.Test.OVERLAP.value and slowed[dcol.VERDICT] == "regressed"
    assert np.isnan(slowed[dcol.P_VALUE])
    single = diff(run(1, steps=1), run(2, steps=1, slower={"net.b": 0.5}))
    assert row(single, "net[0]/net.b[0]")[dcol.TEST] == dcol.Test.NONE.value
    assert single.verdict is dcol.Verdict.NO_VERDICT
    assert "no verdict" in row(single, "net[0]/net.b[0]")[dcol.NOTE]
    assert any("steps" in warning for warning in single.warnings)


def test_a_diff_that_judged_no_key_has_no_verdict_and_fails_the_gate(tmp_path, capsys):
    """One step a side, or runs sharing no key: "unchanged" would read as a verdict."""
    from xsp.cli.main import main

    single = diff(run(1, steps=1), run(2, steps=1, slower={"net.b": 0.5}))
    assert "too few steps a side" in single.nothing_judged()
    assert single.warnings[0].startswith("no key could be judged")
    assert diff_formats.text(single).startswith("xsp diff: NO VERDICT")
    assert "## xsp diff: **no verdict**" in diff_formats.markdown(single)
    assert diff(run(1), run(2)).nothing_judged() is None
    # the API, JSON and JUnit say so too (they said "unchanged", and JUnit passed: a CI reader's green)
    assert single.verdict is dcol.Verdict.NO_VERDICT
    assert json.loads(diff_formats.as_json(single))["verdict"] == "no verdict"
    suites = ET.fromstring(diff_formats.junit(single))  # JUnit: unjudged keys are skipped tests, not passed ones
    suite = suites.find("testsuite")
    assert suite.get("skipped") == str(len(single.table)) and suite.get("errors") == "1"
    cases = suites.findall(".//testcase")
    assert all(case.find("skipped") is not None for case in cases if case.get("name") != "whole run")
    whole = next(case for case in cases if case.get("name") == "whole run").find("error")
    assert whole.get("type") == "no_verdict" and "too few steps a side" in whole.get("message")
    run(1, steps=1).save(tmp_path / "a.xsp.parquet")
    run(2, steps=1).save(tmp_path / "b.xsp.parquet")
    assert main(["diff", str(tmp_path / "a.xsp.parquet"), str(tmp_path / "b.xsp.parquet")]) == 2
    captured = capsys.readouterr()
    assert "NO VERDICT" in captured.out and "no key could be judged" in captured.err
    assert main(["diff", str(tmp_path / "a.xsp.parquet"), str(tmp_path / "b.xsp.parquet"), "--fail-on", "never"]) == 0


def test_a_diff_written_to_a_file_says_its_verdict_and_where(tmp_path, capsys):
    """With -o it printed nothing at all: no verdict, no 'wrote' line."""
    from xsp.cli.main import main

    run(1).save(tmp_path / "a.xsp.parquet")
    run(2, slower={"net.b": 0.3}).save(tmp_path / "b.xsp.parquet")
    out = tmp_path / "diff.md"
    assert main(["diff", str(tmp_path / "a.xsp.parquet"), str(tmp_path / "b.xsp.parquet"), "--format", "markdown",
                 "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == f"xsp diff: regressed -> {out} (markdown)"
    assert out.read_text().startswith("## xsp diff: **regressed**")


def test_skipping_every_step_is_an_error_not_an_empty_comparison():
    with pytest.raises(ValueError, match="leave none of its 40 steps"):
        diff(run(1), run(2), steps=slice(100, None))
    assert diff(run(1), run(2), steps=slice(30, None)).base["steps"] == 10


def test_rank_test_agrees_with_scipy():
    rng = np.random.default_rng(0)
    x, y = rng.normal(100, 5, 30), rng.normal(104, 5, 25)
    p = np.full(1, np.nan)
    significance.rank_tests([np.sort(x).astype(np.int64)], [np.sort(y).astype(np.int64)], np.array([0]), p)
    expected = stats.mannwhitneyu(np.sort(x).astype(np.int64), np.sort(y).astype(np.int64)).pvalue
    assert p[0] == pytest.approx(expected)


def test_added_removed_and_structure_changes_are_named():
    result = diff(run(1, kernels=3), run(2, extra_layer=True, shapes="[[16, 64]]", kernels=2),
                  levels="model,layer,kernel")
    assert row(result, "net[0]/net.d[0]")[dcol.VERDICT] == "added"
    assert row(result, "net[0]/net.b[0]/gemm2[0]")[dcol.VERDICT] == "removed"
    changes = result.changes
    kinds = set(changes[dcol.CHANGE])
    assert {"added", "removed", "input shapes", "kernel count"} <= kinds
    kernel = changes[changes[dcol.CHANGE] == "kernel count"].iloc[0]
    assert (kernel[dcol.KEY], kernel[dcol.BASE_VALUE], kernel[dcol.NEW_VALUE]) == ("net[0]/net.b[0]", 3, 2)
    assert result.changed
    added = [line for line in diff_formats.text(result).splitlines() if "added: net[0]/net.d[0]" in line]
    assert added and "nan" not in added[0] and "->" not in added[0]


def with_operator_dtypes(trace: xsp.Trace, dtypes: list[str], kineto: bool = False) -> xsp.Trace:
    """``trace`` with one ``aten::linear`` operator span inside each ``net.a`` layer, whose
    attributes name its input dtypes as xsp's operator tracer does (or as a Kineto trace does)."""
    spans = trace.spans
    layers = spans[spans[col.NAME] == "net.a"]
    name = "Input type" if kineto else "input_dtypes"
    operators = pd.DataFrame({
        col.SPAN_ID: layers[col.SPAN_ID] + 1_000_000, col.PARENT_ID: layers[col.SPAN_ID],
        col.LEVEL: "operator", col.KIND: "operator", col.NAME: "aten::linear",
        col.START_NS: layers[col.START_NS] + 10, col.END_NS: layers[col.END_NS] - 10,
        col.PATH: "net[0]/net.a[0]/aten::linear[0]", col.STEP: layers[col.STEP], col.THREAD_ID: 1,
        col.TRACE_ID: "t", col.ATTRIBUTES: json.dumps({name: dtypes, "other": 1}),
    })
    operators[col.DURATION_NS] = operators[col.END_NS] - operators[col.START_NS]
    both = concat_spans([spans, conform(operators)])
    return xsp.Trace(spans=both[list(col.COLUMNS)], metadata=trace.metadata)


@pytest.mark.parametrize("kineto", [False, True])
def test_operator_input_dtypes_that_changed_are_named(tmp_path, kineto):
    base = with_operator_dtypes(run(1), ["float", "float", "float"], kineto)
    new = with_operator_dtypes(run(2), ["c10::BFloat16", "c10::BFloat16", "c10::BFloat16"], kineto)
    summary = summarize(base).save(tmp_path / "base.xsp-summary.parquet")
    assert diff(summary, new).base["source"].startswith("base.xsp-summary.parquet")  # the file given, not its trace
    for source in (base, summary):
        changes = diff(source, new).changes
        dtypes = changes[changes[dcol.CHANGE] == "input dtypes"]
        assert len(dtypes) == 1
        found = dtypes.iloc[0]
        assert (found[dcol.KEY], found[dcol.BASE_VALUE], found[dcol.NEW_VALUE]) == (
            "net[0]/net.a[0]/aten::linear[0]", "float, float, float",
            "c10::BFloat16, c10::BFloat16, c10::BFloat16")
    assert "input dtypes" in diff_formats.text(diff(base, new))
    unchanged = diff(base, with_operator_dtypes(run(3), ["float", "float", "float"], kineto)).changes
    assert "input dtypes" not in set(unchanged[dcol.CHANGE])


def version_1_summary(base: xsp.Trace, with_dtypes: bool) -> dict:
    """What the first xsp summary format wrote for ``base``: JSON rows, 16 quantiles as per-mille
    offsets from the median (the writer is gone; its files are still read)."""
    columns = ["level", "kind", "name", "key", "parent", "count", "total_ns", "sample_count", "median_ns",
               "samples_permille", "input_shapes", "kernels_per_step"] + (["input_dtypes"] if with_dtypes else [])
    keys = {}
    for by in dcol.KeyBy:
        frame = keyed.key_samples(base.spans, by)
        position = {key: i for i, key in enumerate(frame[dcol.KEY])}
        rows = []
        for record in frame.to_dict("records"):
            samples = np.asarray(record[dcol.SAMPLES_NS], dtype=np.float64)
            samples = np.quantile(samples, (np.arange(16) + 0.5) / 16) if len(samples) > 16 else samples
            median = float(np.median(samples))
            row_values = [record["level"], record["kind"], record["name"], record[dcol.KEY],
                          position.get(record[dcol.PARENT_KEY],
                                       -1), int(record[dcol.COUNT]), int(record[dcol.TOTAL_NS]),
                          int(record[dcol.SAMPLE_COUNT]), round(median),
                          np.rint((samples / median - 1) * 1000).astype(int).tolist(), record["input_shapes"], None]
            rows.append(row_values + ([None] if with_dtypes else []))
        keys[by.value] = rows
    return {"format": "xsp-summary", "version": 1, "metadata": {"steps": 40}, "columns": columns, "keys": keys}


@pytest.mark.parametrize("with_dtypes", [True, False])
def test_a_version_1_summary_still_loads(tmp_path, with_dtypes):
    base = run(1)
    path = tmp_path / "old.xsp.json"
    path.write_text(json.dumps(version_1_summary(base, with_dtypes)))
    loaded = Summary.load(path)
    by_path = loaded.keys[dcol.KeyBy.PATH]
    assert loaded.keys[dcol.KeyBy.PATH][dcol.INPUT_DTYPES].isna().all()
    assert len(by_path[by_path[dcol.KEY] == "net[0]/net.b[0]"][dcol.SAMPLES_NS].iloc[0]) == 16
    assert diff(path, run(2)).verdict is dcol.Verdict.UNCHANGED
    assert row(diff(path, run(2, slower={"net.b": 0.3})), "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"


def test_by_name_adds_up_spans_of_a_name():
    base = run(1)
    result = diff(base, run(2, slower={"net.a": 0.4}), by="name")
    slowed = row(result, "net.a")
    assert slowed[dcol.VERDICT] == "regressed"
    assert slowed[dcol.BASE_COUNT] == 40


def test_steps_select_samples():
    base = run(1)
    keys = keyed.key_samples(base.spans, steps=slice(10, None))
    assert int(keys[keys[dcol.KEY] == "net[0]"][dcol.SAMPLE_COUNT].iloc[0]) == 30
    keys = keyed.key_samples(base.spans, steps=[0, 1])
    assert int(keys[keys[dcol.KEY] == "net[0]"][dcol.SAMPLE_COUNT].iloc[0]) == 2


def test_a_summary_judges_as_its_trace_did(tmp_path):
    # a 10% change in one layer, 2% noise: the 9 quantiles a summary keeps of 40 steps stand for
    # 40 samples, so the test is as sure as with the trace itself (9 alone would miss some)
    found, false = 0, 0
    for seed in range(8):
        base = run(10 + seed)
        baseline = summarize(base).save(tmp_path / f"base{seed}.xsp-summary.parquet")
        slowed = run(30 + seed, slower={"net.c": 0.1})
        from_trace = row(diff(base, slowed), "net[0]/net.c[0]")
        from_summary = row(diff(baseline, slowed), "net[0]/net.c[0]")
        assert from_summary[dcol.VERDICT] == from_trace[dcol.VERDICT]
        assert from_summary[dcol.P_VALUE] == pytest.approx(from_trace[dcol.P_VALUE], rel=0.5, abs=1e-6)
        found += from_summary[dcol.VERDICT] == "regressed"
        false += diff(baseline, run(50 + seed)).verdict is not dcol.Verdict.UNCHANGED
    assert found == 8 and false == 0


def test_a_run_of_thousands_of_steps_against_its_own_summary_is_judged_not_a_traceback(tmp_path):
    """The smallest p-value two samples of 1,100 steps can give is 2 / C(2200, 1100): past any
    float, it raised OverflowError out of xsp diff."""
    base = run(3, steps=1100)
    baseline = summarize(base).save(tmp_path / "base.xsp-summary.parquet")
    result = diff(base, baseline)
    assert result.verdict is not dcol.Verdict.REGRESSED
    # how much a key varies between steps is one figure for a run and its summary (the summary's
    # quantiles leave out the tails: it said 218% for the run and 8% for its summary)
    table = result.table
    assert np.allclose(table[dcol.BASE_CV], table[dcol.NEW_CV], equal_nan=True)
    assert significance.smallest_p(1100, 1100) == 0.0
    assert significance.smallest_p(5, 5) == pytest.approx(2 / 252)


def test_summaries_round_trip_and_stand_in_for_a_trace(tmp_path):
    base, new = run(1), run(2, slower={"net.b": 0.3})
    path = summarize(base, source="base").save(tmp_path / "base.xsp-summary.parquet")
    loaded = Summary.load(path)
    by_path = loaded.keys[dcol.KeyBy.PATH]
    samples = by_path[by_path[dcol.KEY] == "net[0]/net.b[0]"][dcol.SAMPLES_NS].iloc[0]
    assert len(samples) == QUANTILES
    assert int(by_path[by_path[dcol.KEY] == "net[0]/net.b[0]"][dcol.SAMPLE_COUNT].iloc[0]) == 40
    for source in (path, loaded):
        result = diff(source, new)
        assert result.verdict is dcol.Verdict.REGRESSED
        assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"
        assert row(result, "net[0]/net.a[0]")[dcol.VERDICT] == "unchanged"
        assert row(result, "net[0]/net.b[0]")[dcol.BASE_MEDIAN_NS] == pytest.approx(
            row(diff(base, new), "net[0]/net.b[0]")[dcol.BASE_MEDIAN_NS], rel=0.002)
    assert diff(path, base).verdict is dcol.Verdict.UNCHANGED


@pytest.mark.parametrize("content", [
    b"", b"{", b"[]", b'{"format": "other"}', b'{"format": "xsp-summary", "version": 99}',
    b'{"format": "xsp-summary", "version": 1, "columns": [], "keys": {"path": [[1]]}}',
    gzip.compress(b" " * 100_000_000), gzip.compress(b'{"format": "xsp-summary"}')[:-12],
    b"\x1f\x8b\x08\x00" + b"\xff" * 40])
def test_a_damaged_summary_is_a_format_error(tmp_path, content):
    path = tmp_path / "bad.xsp.json"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError):
        Summary.load(path)
    with pytest.raises(TraceNotFoundError):
        Summary.load(tmp_path / "missing.xsp.json")


def test_bad_settings_are_refused():
    base = run(1, steps=5)
    for settings in ({"threshold": -0.1}, {"alpha": 0.0}, {"min_delta_us": -1}, {"by": "color"}):
        with pytest.raises(ValueError):
            diff(base, base, **settings)
    with pytest.raises(xsp.UnknownLevelError):
        diff(base, base, levels="model,lair")


def test_every_output_format_parses():
    result = diff(run(1), run(2, slower={"net.b": 0.3}))
    document = json.loads(diff_formats.as_json(result))
    assert document["verdict"] == "regressed"
    assert len(document["rows"]) == len(result.table)
    assert set(document["rows"][0]) >= {*dcol.DIFF_COLUMNS, "verdict_shown"}
    shown = {row["key"]: row["verdict_shown"] for row in document["rows"]}
    assert shown == {row.key: diff_formats.shown_verdict(row) for row in result.table.itertuples(index=False)}
    suites = ET.fromstring(diff_formats.junit(result))
    cases = suites.findall(".//testcase")
    assert len(cases) == len(result.table)
    failed = [case.get("name") for case in cases if case.find("failure") is not None]
    assert sorted(failed) == sorted(result.table[result.table[dcol.VERDICT] == "regressed"][dcol.KEY])
    # a failure's text is the key and its figures, not a 200-column line padded with spaces
    texts = [case.find("failure").text for case in cases if case.find("failure") is not None]
    assert all("  " not in text and text.split(": ", 1)[0] in failed for text in texts), texts
    markdown = diff_formats.markdown(result)
    assert "## xsp diff: **regressed**" in markdown and "| `net[0]/net.b[0]` |" in markdown
    text = diff_formats.text(result)
    assert "REGRESSED" in text and "net.b[0]" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.heavy
def test_a_kineto_trace_against_itself_and_against_slower_kernels(shared_traces):
    path = shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz"
    trace = xsp.load(path)
    same = diff(trace, trace, by="name")
    assert same.verdict is dcol.Verdict.UNCHANGED and not same.changed
    spans = trace.spans.copy()
    gemm = spans[col.NAME].str.contains("gemm", case=False).to_numpy() & (spans[col.KIND] == "kernel").to_numpy()
    spans.loc[gemm, col.DURATION_NS] = (spans.loc[gemm, col.DURATION_NS] * 1.5).astype("int64")
    spans.loc[gemm, col.END_NS] = spans.loc[gemm, col.START_NS] + spans.loc[gemm, col.DURATION_NS]
    slower = diff(trace, xsp.Trace(spans=spans, metadata=trace.metadata), by="name")
    # 5 steps a side: the largest changes are the gemm kernels, but no verdict can hold
    kernels = slower.table[slower.table[col.LEVEL] == "kernel"].head(3)
    assert kernels[col.NAME].str.contains("gemm", case=False).all()
    assert kernels[dcol.RATIO].to_numpy() == pytest.approx([1.5] * 3, abs=0.01)
    assert slower.verdict is dcol.Verdict.UNCHANGED
    assert any("record more steps" in warning for warning in slower.warnings)
    lenient = diff(trace, xsp.Trace(spans=spans, metadata=trace.metadata), by="name", levels="kernel", alpha=0.2)
    regressed = lenient.table[lenient.table[dcol.VERDICT] == "regressed"]
    assert len(regressed) and set(regressed[col.LEVEL]) == {"kernel"}
    assert regressed[col.NAME].str.contains("gemm", case=False).all()
    by_path = diff(path, path)
    assert by_path.verdict is dcol.Verdict.UNCHANGED


def test_two_kineto_traces_of_different_runs_compare(shared_traces):
    a = shared_traces / "kineto" / "a100_alexnet.json.gz"
    b = shared_traces / "kineto" / "cpu_only_rank34.json.gz"
    result = diff(a, b, by="name")
    assert len(result.table) and set(result.table[dcol.VERDICT]) <= {v.value for v in dcol.Verdict}
    assert diff_formats.text(result)


def _on_machine(trace: xsp.Trace, seconds_for_fixed_work: float) -> xsp.Trace:
    """``trace`` as if made on a machine that took this long for xsp's fixed work."""
    trace.metadata["machine_speed"] = {"version": 1, "python_loop_ns": int(seconds_for_fixed_work * 1e9),
                                       "matrix_product_ns": int(seconds_for_fixed_work * 2.5e8)}
    return trace


def test_a_uniform_slowdown_is_a_regression_unless_the_machines_speeds_explain_it():
    uniform = {name: 0.3 for name in LAYERS}  # every layer 30% slower: float64 instead of float32, say
    plain = diff(run(1), run(2, slower=uniform))
    assert plain.verdict is dcol.Verdict.REGRESSED and row(plain, "net[0]")[dcol.VERDICT] == "regressed"
    assert plain.settings["judged"] == "raw times" and plain.settings["machine_speed_ratio"] is None
    assert any("no machine speed recorded" in warning for warning in plain.warnings)
    # both machines equally fast at the fixed work: the code is slower, and the output says why it believes so
    same = diff(_on_machine(run(1), 0.002), _on_machine(run(2, slower=uniform), 0.00202))
    assert same.verdict is dcol.Verdict.REGRESSED
    assert any("same speed" in warning for warning in same.warnings)
    # the new machine is 30% slower at the fixed work: the evidence explains the slowdown
    slower_machine = diff(_on_machine(run(1), 0.002), _on_machine(run(2, slower=uniform), 0.0026))
    assert slower_machine.verdict is dcol.Verdict.UNCHANGED
    assert slower_machine.settings["judged"] == "at equal machine speed"
    assert any("divided by 1.30" in warning for warning in slower_machine.warnings)
    net = row(slower_machine, "net[0]")
    assert net[dcol.RATIO] == pytest.approx(1.3, abs=0.02)  # shown as measured ...
    assert net[dcol.ADJUSTED_RATIO] == pytest.approx(1.0, abs=0.02)  # ... and judged at equal speed
    assert "+30." in diff_formats.text(slower_machine) or "+29." in diff_formats.text(slower_machine)
    # a correction only explains a change away: identical runs whose probes differ (a busy runner
    # timed one of them slowly) stay unchanged, with a note on each key the correction alone moved
    identical = diff(_on_machine(run(1), 0.002), _on_machine(run(2, slower=dict.fromkeys(LAYERS, 0.0)), 0.0015))
    assert identical.verdict is dcol.Verdict.UNCHANGED
    assert identical.settings["judged"] == "at equal machine speed"
    assert (identical.table[dcol.NOTE] == "unchanged as measured: the machine-speed correction alone never makes a "
            "change").any()
    assert diff(_on_machine(run(1), 0.002), _on_machine(run(2, slower=uniform), 0.0026),
                machine_speed=False).verdict is dcol.Verdict.REGRESSED


def test_a_machine_too_busy_to_time_steadily_gets_no_correction():
    uniform = {name: 0.3 for name in LAYERS}
    base = _on_machine(run(1), 0.002)
    new = _on_machine(run(2, slower=uniform), 0.0026)
    new.metadata["machine_speed"]["spread"] = 0.12  # its rounds disagreed: someone else used the machine
    result = diff(base, new)
    assert result.verdict is dcol.Verdict.REGRESSED and result.settings["judged"] == "raw times"
    assert any("the new run's machine was too busy to time" in warning for warning in result.warnings)
    # its speed is not known, so no warning may say the machines ran at the same speed
    assert not any("at the same speed" in warning for warning in result.warnings), result.warnings
    assert any("too busy to time their own speed" in warning for warning in result.warnings)
    # corrected for the threads' waits all the same: no warning may say the times were judged raw
    base.metadata["contention"], new.metadata["contention"] = {"waited_share": 0.2}, {"waited_share": 0.1}
    waits = diff(base, new)
    assert not any("judged raw" in warning for warning in waits.warnings), waits.warnings
    assert any("only for the threads' waits" in warning for warning in waits.warnings)


def test_the_probe_rounds_agree_on_a_quiet_machine_and_say_how_far_they_spread():
    from xsp.core import machine_speed

    measured = machine_speed.measure()
    assert measured["python_loop_ns"] > 0 and measured["matrix_product_ns"] > 0
    assert 0 <= measured["spread"] < 10  # a number (how large is the machine's business, not the test's)
    assert machine_speed.steady({**measured, "spread": 0.01}) and not machine_speed.steady({**measured, "spread": 0.2})
    assert machine_speed.steady({"version": 1, "python_loop_ns": 5})  # an older trace: no rounds kept


PROBE_ALONE = """
import resource, time
import numpy as np
np.ones(4) / 2.0  # a first use of NumPy starts its BLAS's threads, once in any program
time.sleep(0.3)
from xsp.core import machine_speed
def process_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
process, thread = process_s(), time.thread_time()
machine_speed._probe()
time.sleep(0.3)
print(round((process_s() - process) - (time.thread_time() - thread), 4))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
                    reason="a BLAS pool's threads spin on a machine of several cores (getrusage counts them)")
def test_the_machine_speed_probe_keeps_to_its_own_thread():
    """A session times its fixed work as it starts and ends: a BLAS product there would wake a
    thread of the BLAS pool on every core, which spins for a tenth of a second after it."""
    done = subprocess.run([sys.executable, "-c", PROBE_ALONE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 0.02  # CPU seconds on other threads than the probe's (0.1-0.2 with BLAS)


def test_a_burst_of_load_at_one_of_the_two_moments_makes_a_run_unsteady_not_slower(monkeypatch):
    from xsp.core import machine_speed

    moments = iter([{"version": 1, "python_loop_ns": 1_000_000, "matrix_product_ns": 400_000, "spread": 0.01},
                    {"version": 1, "python_loop_ns": 1_300_000, "matrix_product_ns": 410_000, "spread": 0.02}])
    monkeypatch.setattr(machine_speed, "_probe", lambda: next(moments))
    machine_speed.measure.cache_clear()
    machine_speed.confirmed.cache_clear()
    try:
        combined = machine_speed.confirmed()
    finally:
        machine_speed.measure.cache_clear()
        machine_speed.confirmed.cache_clear()
    assert combined["python_loop_ns"] == 1_000_000 and combined["matrix_product_ns"] == 400_000  # the best
    assert combined["spread"] == 0.3 and not machine_speed.steady(combined)  # the start and end disagreed


def test_a_change_under_what_the_machines_own_timing_varied_by_is_not_judged():
    base, new = _on_machine(run(1), 0.002), _on_machine(run(2, slower={"net.b": 0.1}), 0.002)
    base.metadata["machine_speed"]["spread"], new.metadata["machine_speed"]["spread"] = 0.08, 0.06
    busy = diff(base, new)
    assert row(busy, "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged" and busy.settings["judged_threshold"] == 0.14
    assert any("varied by up to 14%" in warning for warning in busy.warnings)
    assert row(diff(base, new, machine_speed=False), "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"  # --raw
    base.metadata["machine_speed"]["spread"], new.metadata["machine_speed"]["spread"] = 0.01, 0.015
    quiet = diff(base, new)  # a quiet machine: the threshold given stands
    assert quiet.settings["judged_threshold"] == 0.05 and row(quiet, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"
    # just above the threshold given: the figures tell it apart ("under 5%, not 5%" said nothing)
    base.metadata["machine_speed"]["spread"], new.metadata["machine_speed"]["spread"] = 0.03, 0.021
    close = diff(base, new)
    assert any("changes under 5.1%, not 5.0%," in warning for warning in close.warnings), close.warnings


def test_a_run_whose_threads_waited_longer_for_a_cpu_is_judged_at_equal_load():
    uniform = {name: 0.3 for name in LAYERS}
    base, new = run(1), run(2, slower=uniform)
    base.metadata["contention"] = {"waited_share": 0.1}
    new.metadata["contention"] = {"waited_share": 0.31}  # 0.9 / 0.69: 1.30x as long for the same work
    busy = diff(base, new)
    assert busy.verdict is dcol.Verdict.UNCHANGED
    assert busy.settings["contention_ratio"] == pytest.approx(1.304, abs=1e-3)
    assert any("waited for a CPU 10% (base) and 31% (new)" in warning for warning in busy.warnings)
    # the header names the correction made: for the waits, not for the machines' speed
    assert busy.settings["judged"] == dcol.Judged.CPU_WAITS.value
    assert "judged for the threads' waits for a CPU (new times / 1.30)" in diff_formats.text(busy).replace("\n  ", " ")
    assert "at equal machine speed" not in diff_formats.text(busy)
    # the other way round, it never makes a change: identical runs, the base the busier one
    base, new = run(1), run(2)
    base.metadata["contention"], new.metadata["contention"] = {"waited_share": 0.4}, {"waited_share": 0.0}
    assert diff(base, new).verdict is dcol.Verdict.UNCHANGED
    assert diff(run(1), run(2, slower=uniform), machine_speed=False).verdict is dcol.Verdict.REGRESSED


def test_steps_chosen_against_a_summary_made_of_every_step_say_so_and_remove_no_session(tmp_path):
    """A baseline summary of every step, a trace diffed with --skip-steps 5: the summary kept its
    steps, silently, and the session's span (outside every step, left out of the trace's chosen
    steps) read as removed, which --fail-on change failed on."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with xsp.trace(levels="model,layer", output=tmp_path / "run.xsp.parquet"):
        for _ in range(20):
            model(torch.randn(2, 8))
    trace = xsp.load(tmp_path / "run.xsp.parquet")
    assert (trace.spans[col.KIND] == "session").any()
    baseline = summarize(trace).save(tmp_path / "base.xsp-summary.parquet")
    result = diff(baseline, trace, steps=slice(5, None))
    assert any("the base side is a summary, which keeps the steps it was made from" in w for w in result.warnings)
    assert not (result.table[dcol.VERDICT].isin([dcol.Verdict.REMOVED.value, dcol.Verdict.ADDED.value])).any()
    assert not any("steps it was made from" in w for w in diff(baseline, trace).warnings)  # no steps chosen


def test_a_correction_for_waits_never_says_the_machines_ran_at_the_same_speed_when_they_did_not():
    """The new machine took 1.18x the base's time for the fixed work, and the runs waited for a CPU
    for different shares: the waits corrected the times, and a warning said both machines ran at
    the same speed (within 5%)."""
    uniform = {name: 0.5 for name in LAYERS}
    base, new = _on_machine(run(1), 0.002), _on_machine(run(2, slower=uniform), 0.00236)
    base.metadata["contention"], new.metadata["contention"] = {"waited_share": 0.16}, {"waited_share": 0.09}
    result = diff(base, new)
    assert not any("at the same speed" in warning for warning in result.warnings), result.warnings
    assert any("took 1.18x the base's time" in warning and "corrected by those waits" in warning
               for warning in result.warnings), result.warnings


def test_a_key_that_changed_by_less_than_a_step_waited_for_a_cpu_is_not_judged_from_one_run_a_side():
    # net.b (and so the model call) 60 µs slower a step; the new run's threads waited 100 µs a step for a CPU: a
    # preemption met inside net.b in every step of that process looks the same (up to 1.5x that: 150 µs). Both
    # runs waited 12% of their ready time (no correction for the load itself); the base's waits, 10 µs a step.
    def busy(trace, waited_us, share=0.12):
        trace.metadata["contention"] = {"on_cpu_ns": 1, "waited_ns": waited_us * 1000 * 40, "waited_share": share}
        return trace

    assert len(run(1).steps) == 40
    base, new = busy(run(1), 10), busy(run(2, slower={"net.b": 0.3}), 100)
    result = diff(base, new)
    assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged" and result.verdict is dcol.Verdict.INCONCLUSIVE
    assert "1.5x what a run's threads waited for a CPU per step (100 µs)" in row(result, "net[0]/net.b[0]")[dcol.NOTE]
    assert result.settings["keys_within_wait"] == 2 and result.settings["wait_per_step_us"] == [10.0, 100.0]
    assert any("2 key(s) that changed by less than 150 µs a step are not judged" in warning
               for warning in result.warnings)
    # the text says "unjudged", not "unchanged", beside a change with a small q-value
    model_line = diff_formats.text(result).split("Model (median per step):\n")[1].splitlines()[0]
    assert model_line.rstrip().endswith("unjudged"), model_line
    assert row(diff(base, new, machine_speed=False), "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"  # --raw
    # the kernel's count covers the whole run, its start-up too: spread over few steps it can come to more than
    # a step takes; a step waits its run's share of its own time at most (a 66x regression was left unjudged)
    slow_start = busy(run(2, slower={"net.b": 2.0}), 5000)
    result = diff(busy(run(1), 5000), slow_start)
    assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed" and result.verdict is dcol.Verdict.REGRESSED
    assert max(result.settings["wait_per_step_us"]) < 0.12 * 1400
    # more than the wait, or a quiet machine (under 5% of the ready time waited): judged
    assert row(diff(base, busy(run(2, slower={"net.b": 0.8}), 100)), "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"
    quiet_base, quiet_new = busy(run(1), 10, 0.04), busy(run(2, slower={"net.b": 0.3}), 100, 0.04)
    assert row(diff(quiet_base, quiet_new), "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"
    # an improvement alike (either process may have met the preemption); a quiet pair judges it
    assert row(diff(new, base), "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged"
    assert row(diff(quiet_new, quiet_base), "net[0]/net.b[0]")[dcol.VERDICT] == "improved"
    # several runs a side are judged by the spread between runs instead
    pooled = diff([base, busy(run(3), 10), busy(run(4), 10)],
                  [new, busy(run(5, slower={"net.b": 0.3}), 100), busy(run(6, slower={"net.b": 0.3}), 100)])
    assert pooled.settings["keys_within_wait"] == 0


def test_a_session_keeps_how_long_its_threads_waited_for_a_cpu(tmp_path):
    from xsp.core import contention

    model = torch.nn.Linear(8, 8)
    with xsp.trace(levels="model", output=tmp_path / "t.xsp.parquet") as session:
        for _ in range(3):
            model(torch.randn(2, 8))
    kept = session.trace.metadata["contention"]
    if contention.thread_times_ns() is None:
        assert kept is None  # no /proc: nothing kept, nothing corrected
    else:
        assert kept["on_cpu_ns"] > 0 and 0 <= kept["waited_share"] < 1


def test_the_relative_view_shows_which_key_moved_more_than_the_rest():
    uniform = {name: 0.08 for name in LAYERS}
    result = diff(run(1), run(2, slower=uniform), normalize=True)
    assert result.verdict is dcol.Verdict.UNCHANGED  # what the relative view cannot see
    assert result.settings["common_shift"] == pytest.approx(1.08, abs=0.01)
    assert any("hides any change that slows every key alike" in warning for warning in result.warnings)
    one_more = {**uniform, "net.b": 0.08 + 0.3}
    found = diff(run(1), run(2, slower=one_more), normalize=True)
    regressed = set(found.table[found.table[dcol.VERDICT] == "regressed"][dcol.KEY])
    assert regressed == {"net[0]", "net[0]/net.b[0]"}  # the model, by net.b's share of it
    assert row(found, "net[0]/net.b[0]")[dcol.ADJUSTED_RATIO] == pytest.approx(1.38 / 1.08, abs=0.03)
    absolute = diff(run(1), run(2, slower=one_more))  # judged on their own times, every layer moved
    assert absolute.verdict is dcol.Verdict.REGRESSED
    # from one run a side, with 3 layers (too few to measure how far two processes sit apart),
    # the model call (+18%) is within 25% of the whole run's move (+8%): not judged; net.b is
    assert set(absolute.table[absolute.table[dcol.VERDICT] == "regressed"][dcol.KEY]) == {"net[0]/net.b[0]"}
    assert row(absolute, "net[0]")[dcol.NOTE].startswith(dcol.WITH_RUN_NOTE)
    assert row(absolute, "net[0]/net.b[0]")[dcol.RELATIVE_RATIO] == pytest.approx(1.38 / 1.08, abs=0.03)


def test_breakdown_and_explains_walk_a_hand_made_tree():
    """Parents are found by key alone; children that move the other way, or explain under
    min_share of their parent, are left out; a key whose parent is missing from the table
    explains nothing and is no top-level key either. A session (one sample a run, its delta the
    whole run's) comes after the per-step keys however large its delta."""
    keys = ["model", "model/a", "model/b", "model/c", "model/a/x", "model/a/y", "gone/orphan", "model/a/z", "session"]
    parents = [None, "model", "model", "model", "model/a", "model/a", "gone", "model/a", None]
    deltas = [100.0, 60.0, 30.0, -5.0, 50.0, 10.0, 7.0, 1.0, 4000.0]
    table = pd.DataFrame({col.LEVEL: ["layer"] * len(keys), col.KIND: ["forward"] * 8 + ["session"], dcol.KEY: keys,
                          dcol.PARENT_KEY: parents, dcol.ADJUSTED_DELTA_NS: deltas,
                          dcol.VERDICT: ["regressed"] * len(keys), dcol.TEST: ["rank"] * len(keys)})
    explains = verdicts.explains(table)
    assert explains[1] == pytest.approx(0.6) and explains[2] == pytest.approx(0.3)
    assert explains[4] == pytest.approx(50 / 60) and explains[3] == pytest.approx(-0.05)
    assert np.isnan(explains[0]) and np.isnan(explains[6])
    tree = verdicts.breakdown(table)
    assert tree[[dcol.KEY, dcol.DEPTH]].values.tolist() == [
        ["model", 0], ["model/a", 1], ["model/a/x", 2], ["model/a/y", 2], ["model/b", 1], ["session", 0]]


@pytest.mark.heavy
def test_several_runs_a_side_tell_a_process_that_ran_slower_from_a_change():
    # each layer sits a few percent off in each process: the steps of one run cannot tell that
    # from a change, the spread between runs can
    def side(first: int, **changes: float) -> list[xsp.Trace]:
        return [run(first + k, process=0.06, slower=changes or None) for k in range(3)]

    single = [diff(run(seed, process=0.06), run(seed + 100, process=0.06)).verdict for seed in range(20)]
    assert single.count(dcol.Verdict.UNCHANGED) <= 15  # one run a side: no pass (false alarms, or inconclusive)
    pooled = [diff(side(10 * seed), side(10 * seed + 500)) for seed in range(12)]
    alarms = [result.verdict for result in pooled if result.verdict in (dcol.Verdict.REGRESSED, dcol.Verdict.IMPROVED)]
    assert len(alarms) <= 1
    assert all(row(result, "net[0]/net.b[0]")[dcol.TEST] == dcol.Test.RANK_AND_RUNS.value for result in pooled)
    # net.b twice as slow: the model call around it (a third of it) moves enough for the test
    # between 3 and 3 runs of such noisy processes, and then net.b is judged (hierarchical testing)
    found = diff(side(1000), side(2000, **{"net.b": 1.0}))
    slowed = row(found, "net[0]/net.b[0]")
    assert slowed[dcol.VERDICT] == "regressed" and slowed[dcol.RUN_P_VALUE] <= slowed[dcol.P_VALUE] < 0.01
    assert (slowed[dcol.BASE_RUNS], slowed[dcol.NEW_RUNS], slowed[dcol.BASE_SAMPLES]) == (3, 3, 120)
    assert slowed[dcol.BASE_COUNT] == 40  # counts and totals are per run
    assert found.settings["base_runs"] == found.settings["new_runs"] == 3
    assert "3 runs" in diff_formats.text(found)
    # copies of one run are not several runs: no spread between them, no evidence either way
    copies = diff([run(1)] * 3, [run(2, slower={"net.b": 1.0})] * 3)
    assert row(copies, "net[0]/net.b[0]")[dcol.VERDICT] == "unchanged"
    # summaries pool as their traces do (their quantiles read back into samples)
    from_summaries = diff([summarize(trace) for trace in side(1000)], side(2000, **{"net.b": 1.0}))
    assert row(from_summaries, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"


def test_pooled_runs_keep_each_runs_median_and_judge_lone_spans_between_runs():
    frames = [keyed.key_samples(run(seed, steps=5).spans) for seed in range(3)]
    pooled = keyed.pool_runs(frames).set_index(dcol.KEY)
    medians = [float(np.median(frame.set_index(dcol.KEY).loc["net[0]/net.a[0]",
                                                              dcol.SAMPLES_NS])) for frame in frames]
    assert pooled.loc["net[0]/net.a[0]", dcol.RUN_MEDIANS_NS].tolist() == pytest.approx(medians)
    assert pooled.loc["net[0]/net.a[0]", dcol.SAMPLE_COUNT] == 15 and pooled.loc["net[0]/net.a[0]", dcol.COUNT] == 5
    assert (pooled[dcol.RUNS] == 3).all()
    # one span a run (a session outside steps): too few for a rank test, judged between runs
    lone = [run(seed, steps=4) for seed in range(3)]
    for trace in lone:
        trace.spans[col.STEP] = pd.array([None] * len(trace.spans), dtype="Int64")
    slower = [run(seed + 10, steps=4, slower=dict.fromkeys(LAYERS, 0.5)) for seed in range(3)]
    for trace in slower:
        trace.spans[col.STEP] = pd.array([None] * len(trace.spans), dtype="Int64")
    result = diff(lone, slower)
    assert row(result, "net[0]")[dcol.TEST] in (dcol.Test.RANK_AND_RUNS.value, dcol.Test.RUNS.value)


def test_a_folder_is_a_side_of_several_runs(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "new").mkdir()
    for k in range(3):
        run(k).save(tmp_path / "base" / f"run{k}.xsp.parquet")
        run(10 + k, slower={"net.b": 0.3}).save(tmp_path / "new" / f"run{k}.xsp.parquet")
    (tmp_path / "new" / "notes.txt").write_text("not a run")
    result = diff(tmp_path / "base", tmp_path / "new")
    assert result.settings["base_runs"] == result.settings["new_runs"] == 3
    assert row(result, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceNotFoundError, match="holds no traces or summaries"):
        diff(tmp_path / "empty", tmp_path / "new")


def test_a_summary_keeps_what_ran_where_and_when_to_the_second():
    trace = run(1, steps=5)
    trace.metadata.update({"created_at": "2026-11-25T04:03:08.784592+00:00", "platform": "Linux-6.1-x86_64",
                           "service_name": "python", "device": "cpu", "torch_version": "2.13.0"})
    metadata = summarize(trace).metadata
    assert metadata["created_at"] == "2026-11-25T04:03:08+00:00"
    assert metadata["device"] == "cpu" and metadata["torch_version"] == "2.13.0" and metadata["steps"] == 5
    assert "platform" not in metadata and "service_name" not in metadata


HOSTILE_NAMES = {
    "net.a": "net.\x1b[31mred\x1b[0m\x07\x00",  # colour codes, a bell, NUL
    "net.b": "net.b\nnext line | with `backticks` and <b>html</b>\rback",
    "net.c": "net.\x1b]0;pwned\x07" + "x" * 1_000_000,  # sets the terminal's title; a 1 MB name
}


def _hostile_run(seed: int, slower: dict[str, float] | None = None) -> xsp.Trace:
    trace = run(seed, slower=slower)
    spans = trace.spans
    for plain, hostile in HOSTILE_NAMES.items():
        spans[col.NAME] = spans[col.NAME].cat.rename_categories({plain: hostile})
        spans[col.PATH] = spans[col.PATH].str.replace(f"{plain}[0]", f"{hostile}[0]", regex=False)
    return trace


def test_every_format_survives_names_with_control_characters_newlines_backticks_and_a_megabyte():
    result = diff(_hostile_run(1), _hostile_run(2, slower=dict.fromkeys(LAYERS, 0.4)))
    assert result.verdict is dcol.Verdict.REGRESSED
    suites = ET.fromstring(diff_formats.junit(result))  # valid XML
    names = [case.get("name") for case in suites.findall(".//testcase")]
    assert any("\\x1b[31mred" in name for name in names)
    for text in (diff_formats.text(result), diff_formats.markdown(result)):
        assert not any(char in text for char in "\x1b\x07\x00"), "a control character reached the output"
    markdown = diff_formats.markdown(result)
    assert len(markdown) <= 65_536  # a pull-request comment holds it
    for line in markdown.splitlines():
        if line.startswith("| "):
            assert line.count(" | ") >= 4  # a table row stays one row
            assert line.count("`") % 2 == 0  # every code span closed
    assert "next line" in markdown and "\\n" in markdown and "\\rback" in markdown  # each break shown as itself
    assert max(len(line) for line in diff_formats.text(result).splitlines()) <= 80
    document = json.loads(diff_formats.as_json(result))  # JSON keeps the names as they are, but capped
    assert any(row["key"].startswith("net[0]/net.b\nnext") for row in document["rows"])
    long_keys = [row["key"] for row in document["rows"] if "net.\x1b]0;pwned" in row["key"]]
    assert long_keys and all("characters cut]" in key and len(key) < 1_100 for key in long_keys)
    junit = diff_formats.junit(result)
    assert len(junit) < 100_000 and "characters cut]" in junit  # not the name whole at every occurrence
    assert len(diff_formats.as_json(result)) < 200_000


def test_a_long_report_is_cut_to_what_a_pull_request_comment_holds():
    from xsp.core.safe_text import within

    lines = [f"| `key{i}` | {'x' * 500} |" for i in range(1000)]
    kept = within(lines)
    assert len("\n".join(kept)) <= 65_536 and "more lines cut" in kept[-1]


def leveled_run(figures_ns: dict[str, int], intervals_ns: dict[str, int]) -> xsp.Trace:
    """A leveled trace as xsp.leveled writes it: one merged step, each span's figure with the
    half-width of its 95% interval (``duration_ci_ns``)."""
    trace = run(0, steps=1, noise=0.0)
    spans = trace.spans.copy()
    for name, figure in figures_ns.items():
        at = spans[col.NAME] == name
        spans.loc[at, col.END_NS] = spans.loc[at, col.START_NS] + figure
        spans.loc[at, col.DURATION_NS] = figure
    spans[col.DURATION_CI_NS] = pd.array([intervals_ns.get(name) for name in spans[col.NAME]], dtype="Int64")
    return xsp.Trace(spans=spans, metadata={**trace.metadata, "leveled": {"runs": ["model", "model+layer"]}})


def test_two_leveled_traces_are_judged_by_their_intervals():
    intervals = {"net": 20_000, "net.a": 3_000, "net.b": 3_000, "net.c": 40_000}
    base = leveled_run({"net": 1_000_000, "net.a": 300_000, "net.b": 200_000, "net.c": 400_000}, intervals)
    # a: +30 µs, ten times its intervals; c: +30 µs, within its wide ones
    new = leveled_run({"net": 1_060_000, "net.a": 330_000, "net.b": 200_000, "net.c": 430_000}, intervals)
    result = diff(base, new, machine_speed=False)
    a, c, b = row(result, "net[0]/net.a[0]"), row(result, "net[0]/net.c[0]"), row(result, "net[0]/net.b[0]")
    assert a[dcol.TEST] == dcol.Test.INTERVAL.value and a[dcol.VERDICT] == "regressed"
    assert a[dcol.BASE_CI_NS] == 3_000 and a[dcol.NEW_CI_NS] == 3_000
    expected = 2 * stats.norm.sf(30_000 / (np.hypot(3_000, 3_000) / stats.norm.ppf(0.975)))
    assert a[dcol.P_VALUE] == pytest.approx(expected)
    assert c[dcol.VERDICT] == "unchanged" and c[dcol.P_VALUE] > 0.1
    assert b[dcol.VERDICT] == "unchanged"
    assert result.settings["keys_tested"] == 4
    assert any("95% intervals" in warning for warning in result.warnings)
    assert not any("no rank test" in warning for warning in result.warnings)
    # without intervals (plain one-step traces) there is still no verdict
    plain = diff(run(0, steps=1, noise=0.0), run(0, steps=1, noise=0.0, slower={"net.a": 0.5}), machine_speed=False)
    assert row(plain, "net[0]/net.a[0]")[dcol.TEST] == dcol.Test.NONE.value


def test_a_leveled_traces_summary_keeps_its_intervals(tmp_path):
    trace = leveled_run({"net.a": 300_000}, {"net": 20_000, "net.a": 3_000, "net.b": 3_000, "net.c": 40_000})
    loaded = Summary.load(summarize(trace).save(tmp_path / "leveled.xsp-summary.parquet"))
    keys = loaded.keys[dcol.KeyBy.PATH].set_index(dcol.KEY)
    assert keys.loc["net[0]/net.a[0]", dcol.CI_NS] == 3_000
    assert dcol.CI_NS not in Summary.load(summarize(run(0, steps=3)).save(tmp_path / "plain.xsp-summary.parquet")
                                          ).keys[dcol.KeyBy.PATH]


def test_a_model_line_with_a_judged_ratio_and_a_long_q_fits_80_columns():
    # a real CI run printed `model[0]   858.60 µs ->   1.65 ms  +92.2% (+112.4% judged) q=0.00015  regressed`:
    # 81 columns, the key's room at its floor
    result = diff(run(0), run(1, slower=dict.fromkeys(LAYERS, 1.0)), machine_speed=False)
    table = result.table
    model = table[col.LEVEL] == "model"
    table.loc[model, dcol.ADJUSTED_RATIO] = 2.124
    table.loc[model, dcol.Q_VALUE] = 0.00015
    text = diff_formats.text(result)
    assert max(len(line) for line in text.splitlines()) <= 80
    lines = text.split("Model (median per step):\n")[1].splitlines()
    assert lines[0].strip() == "net[0]" and "(+112.4% judged) q=0.00015" in lines[1] and "regressed" in lines[1]


MANY_LAYERS = {f"net.l{i}": 200_000 + 20_000 * i for i in range(12)}


@pytest.mark.heavy
def test_one_run_a_side_does_not_call_offsets_between_processes_changes(monkeypatch):
    """Each layer sits off by its own few percent for a whole process (6% spread): 40 steps of one
    run each pass a rank test, and only the keys' scatter tells that from a change."""
    def alarms() -> tuple[int, list[xsp.Diff]]:
        results = [diff(run(seed, layers=MANY_LAYERS, process=0.06),
                        run(seed + 100, layers=MANY_LAYERS, process=0.06)) for seed in range(20)]
        return sum(result.verdict in (dcol.Verdict.REGRESSED, dcol.Verdict.IMPROVED) for result in results), results

    found, results = alarms()
    assert found <= 2
    # the others are no pass either: a 5% change could not have shown, and each says what would settle it
    settled = [result for result in results if result.verdict not in (dcol.Verdict.REGRESSED, dcol.Verdict.IMPROVED)]
    assert all(result.verdict is dcol.Verdict.INCONCLUSIVE for result in settled)
    assert all(any("compare several runs a side" in reason for reason in result.inconclusive) for result in settled)
    judged = results[0]
    assert judged.settings["key_scatter"] > 0.04 and judged.settings["scatter_floor"] > 0.12
    assert any("moved against each other" in warning for warning in judged.warnings)
    monkeypatch.setattr(comparison, "SCATTER_FACTOR", 0.0)  # the rank test alone: nearly every pair an alarm
    assert alarms()[0] >= 15


def test_a_change_beyond_the_scatter_is_found_and_one_moving_every_key_alike_too():
    slowed = diff(run(1, layers=MANY_LAYERS, process=0.06),
                  run(2, layers=MANY_LAYERS, process=0.06, slower={"net.l5": 0.8}))
    assert slowed.verdict == dcol.Verdict.REGRESSED
    table = slowed.table.set_index("name")
    assert table.loc["net.l5", "verdict"] == dcol.Verdict.REGRESSED.value
    everywhere = diff(run(1, layers=MANY_LAYERS), run(2, layers=MANY_LAYERS,
                                                       slower={name: 0.4 for name in MANY_LAYERS}),
                      machine_speed=False)
    assert everywhere.settings["key_scatter"] < 0.02 and everywhere.settings["unjudged_shift"] == 1.0
    assert (everywhere.table[everywhere.table["level"] == "layer"]["verdict"] == dcol.Verdict.REGRESSED.value).all()


def test_a_move_past_the_threshold_within_the_scatter_reads_unjudged_not_unchanged():
    """One run a side: a layer +15%, under how far the keys of two processes sit apart (the scatter
    floor, 21% here), was shown "unchanged" beside its ratio (a tester's +38% generate call read
    "+38.2% (+20.3% judged) q=0.024 unchanged")."""
    result = diff(run(1, layers=MANY_LAYERS, process=0.06),
                  run(2, layers=MANY_LAYERS, process=0.06, slower={"net.l5": 0.10}))
    moved = row(result, "net[0]/net.l5[0]")
    assert moved[dcol.VERDICT] == "unchanged" and moved[dcol.RATIO] > 1.05  # not judged either way
    assert moved[dcol.NOTE].startswith(dcol.WITHIN_SCATTER_NOTE)
    assert f"({result.settings['scatter_floor']:.0%})" in moved[dcol.NOTE]
    from types import SimpleNamespace

    assert diff_formats.shown_verdict(SimpleNamespace(**moved.to_dict())) == "unjudged"


def test_a_change_moving_every_key_by_different_amounts_is_not_hidden_by_the_scatter_it_makes():
    """float64 doubled an MLP's matrix products and moved its ReLUs by 1.2x to 2.5x (a CI run);
    the keys' scatter was then 0.35, a floor of 185% that hid the whole regression."""
    names = sorted(MANY_LAYERS)
    moved = {name: (0.75 if i % 2 else (0.35, 1.5, 1.2)[i % 3]) for i, name in enumerate(names)}
    result = diff(run(1, layers=MANY_LAYERS), run(2, layers=MANY_LAYERS, slower=moved), machine_speed=False)
    assert result.settings["key_scatter"] > 0.15  # 3x that would be a floor over +55%
    assert result.settings["scatter_floor"] == pytest.approx(dcol.MAX_SCATTER_FLOOR)
    layers = result.table[result.table["level"] == "layer"]
    assert (layers["verdict"] == dcol.Verdict.REGRESSED.value).all(), layers[["name", "ratio", "verdict"]]
    assert result.verdict == dcol.Verdict.REGRESSED


def test_one_run_a_side_leaves_a_small_move_of_the_whole_run_unjudged_and_says_so():
    """Every key 12% slower, the machines' probes alike: from one run a side that is what
    another process of the same program can do (benchmarks/results/diff_loaded.md); several runs a
    side judge it."""
    moved = {name: 0.12 for name in MANY_LAYERS}
    one = diff(run(1, layers=MANY_LAYERS), run(2, layers=MANY_LAYERS, slower=moved), machine_speed=False)
    assert one.verdict == dcol.Verdict.INCONCLUSIVE  # not judged: no evidence either way, and no pass
    assert "net[0] (40 and 40 steps) was not judged (moved with the whole run" in one.inconclusive[1]
    assert one.settings["unjudged_shift"] == pytest.approx(1.12, abs=0.02)
    assert any("the whole run moved by +1" in warning for warning in one.warnings)
    notes = one.table[one.table["level"] == "layer"]["note"].astype(str)
    assert notes.str.startswith("moved with the whole run").all()
    # a key that moved beyond the run is still judged
    beyond = diff(run(1, layers=MANY_LAYERS),
                  run(2, layers=MANY_LAYERS, slower={**moved, "net.l3": 0.6}), machine_speed=False)
    assert beyond.table.set_index("name").loc["net.l3", "verdict"] == dcol.Verdict.REGRESSED.value
    # three runs a side: the runs' spread is measured, and the move is judged
    pooled = diff([run(s, layers=MANY_LAYERS) for s in (1, 2, 3)],
                  [run(s, layers=MANY_LAYERS, slower=moved) for s in (4, 5, 6)], machine_speed=False)
    assert pooled.verdict == dcol.Verdict.REGRESSED


def test_keys_are_only_those_of_kept_spans_when_the_first_row_is_left_out():
    """The session (row 0) has no key at the layer level: no key of count 0 stands in for it."""
    import torch
    from torch import nn

    from xsp.core.schema import Level
    from xsp.gate.diff_columns import COUNT, KeyBy
    from xsp.gate.key_samples import key_samples

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with xsp.trace(levels="model,layer", output=None) as session, torch.no_grad():
        for _ in range(2):
            model(torch.zeros(1, 2))
    for by in (KeyBy.PATH, KeyBy.NAME):
        keys = key_samples(session.trace.spans, by, levels=(Level.LAYER,))
        assert (keys[COUNT] > 0).all() and set(keys[col.LEVEL]) == {"layer"}, keys


def test_profiler_steps_are_one_key_whatever_their_numbers(shared_traces, tmp_path):
    """PyTorch's profiler names step N ``ProfilerStep#N``: keyed by path, each step was a key of
    its own (one sample each, nothing judged, a 2x slowdown UNCHANGED), and two runs numbered
    differently had no key in common."""

    source = shared_traces / "kineto" / "sampled_rank0.json.gz"
    document = json.loads(gzip.decompress(source.read_bytes()))
    for event in document["traceEvents"]:
        if str(event.get("name", "")).startswith("ProfilerStep#"):
            event["name"] = f"ProfilerStep#{int(event['name'].split('#')[1]) + 10}"
    renumbered = tmp_path / "renumbered.json.gz"
    renumbered.write_bytes(gzip.compress(json.dumps(document).encode()))
    base, new = xsp.load(source), xsp.load(renumbered)
    keys = keyed.key_samples(base.spans)
    steps = keys[keys[dcol.KEY].str.match(r"ProfilerStep#[^/]*$")]
    assert steps[dcol.KEY].tolist() == ["ProfilerStep#*[0]"]
    assert steps[dcol.SAMPLE_COUNT].iat[0] == base.spans[col.STEP].nunique() > 1
    result = diff(base, new, machine_speed=False)
    assert not (result.table[dcol.VERDICT].isin(["added", "removed"])).any()
    assert (result.table[dcol.KEY].str.startswith("ProfilerStep#*[0]")).mean() > 0.9


def test_a_change_judged_only_after_the_load_correction_but_within_the_wait_as_measured_is_unjudged():
    """The base's threads waited for a CPU longer (20% against 11% of their ready time): the new
    run's times are divided by 0.9 and net.b's change (140 µs as measured) grows past 1.5x the
    100 µs a step its threads waited. As measured it was within that wait: it stays unchanged,
    and says why (unjudged: a preemption met in every step), not that the correction made it."""
    def busy(trace, waited_us, share):
        trace.metadata["contention"] = {"on_cpu_ns": 1, "waited_ns": waited_us * 1000 * 40, "waited_share": share}
        return trace

    result = diff(busy(run(1), 10, 0.2), busy(run(2, slower={"net.b": 0.7}), 100, 0.11))
    assert result.settings["contention_ratio"] == pytest.approx(0.8 / 0.89, abs=1e-3)
    found = row(result, "net[0]/net.b[0]")
    assert found[dcol.VERDICT] == "unchanged"
    assert found[dcol.NOTE].startswith(dcol.WAITED_NOTE), found[dcol.NOTE]
    assert "unjudged" in diff_formats.text(result)


def test_long_keys_that_differ_in_the_middle_read_apart_in_80_columns():
    """Two layers whose paths share a long start and a long end (kernels of one template, blocks
    of one model): both regressed, and each line of the report still tells them apart."""
    start, end = "encoder.layers.blocks.attention.", ".projection.output.dense.dropout.residual"
    layers = {f"{start}{which}{end}": 300_000 for which in ("query", "value")}
    result = diff(run(1, layers=layers), run(2, layers=layers, slower={name: 0.5 for name in layers}))
    report = diff_formats.text(result)
    for section, figures in (("Regressed (", r" +\d+\.\d+ µs ->"), ("Where it lives", r" +\+\d+\.\d+ µs")):
        listed = report.split(section)[1].split("\n\n")[0].splitlines()[1:]
        keys = [re.split(figures, line)[0].strip() for line in listed if "…" in line]
        assert len(keys) == 2 and len(set(keys)) == 2, listed
    assert all(len(line) <= 80 for line in report.splitlines())


def test_the_headline_counts_unjudged_keys_as_the_rows_show_them_and_fits_80_columns():
    one_step = diff(run(1, steps=1), run(2, steps=1))
    text = diff_formats.text(one_step)
    assert "unjudged" in text.splitlines()[0] and " unchanged" not in text.splitlines()[0], text.splitlines()[0]
    assert all(len(line) <= 80 for line in text.splitlines())


def test_a_level_asked_for_that_neither_run_recorded_is_refused():
    """A gate asked to compare kernels of two runs without any would judge the other levels and
    pass: it is refused, naming the levels the runs have."""
    with pytest.raises(ValueError, match=r"level\(s\) kernel asked for but recorded in neither run \(they have"):
        diff(run(1), run(2), levels="model,layer,kernel")
    assert not any("asked for but recorded" in w for w in diff(run(1), run(2), levels="model,layer").warnings)


def test_a_level_asked_for_that_one_run_lacks_is_refused_not_read_as_removed_spans():
    """Operators recorded in the base run only: every operator key read as removed, a change of
    structure that --fail-on change failed on."""
    base = run(1)
    layers_only = run(2)
    layers_only = xsp.Trace(spans=layers_only.spans[layers_only.spans[col.LEVEL] != "layer"].reset_index(drop=True),
                            metadata=layers_only.metadata)
    with pytest.raises(ValueError, match=r"level\(s\) layer asked for but recorded in the base run only "
                                         r"\(the new run has model\)"):
        diff(base, layers_only, levels="model,layer")
    with pytest.raises(ValueError, match=r"recorded in the new run only"):
        diff(layers_only, base, levels="model,layer")
    assert "layer" not in set(diff(base, layers_only).table[col.LEVEL])  # unasked: left out, and said


def test_a_verdict_reached_by_ranges_alone_says_so():
    """Two and three steps: a key is called changed only when its ranges do not overlap, and a
    warning says no rank test stood behind it."""
    result = diff(run(1, steps=2), run(2, steps=3, slower={"net.b": 1.0}))
    judged = result.table[result.table[dcol.TEST] == dcol.Test.OVERLAP.value]
    assert (judged[dcol.VERDICT] == "regressed").any()
    assert any("judged by their ranges alone" in warning for warning in result.warnings), result.warnings


# -- a gate never passes without the evidence to pass, nor fails without it --------------------


def test_five_steps_a_side_fully_apart_are_a_regression_of_the_model_call():
    """The model call is judged among the top-level keys first (hierarchical testing): 5 steps a
    side, every one of the new run beyond every one of the base (p = 0.0079), is a regression;
    judged among every key of the run at once, it could not pass a false-discovery rate of 0.01."""
    result = diff(run(1, steps=5), run(2, steps=5, slower={"net.b": 1.0}))
    model = row(result, "net[0]")
    assert model[dcol.P_VALUE] == pytest.approx(2 / 252) and model[dcol.VERDICT] == "regressed"
    assert result.verdict is dcol.Verdict.REGRESSED and result.settings["root_family"] == 1
    # the 3 layers below it are judged together: 5 steps cannot pass there, and the report says so
    assert row(result, "net[0]/net.b[0]")[dcol.Q_VALUE] == pytest.approx(3 * 2 / 252)
    assert any("among 3 keys judged together" in warning for warning in result.warnings)
    assert result.breakdown[dcol.KEY].tolist()[:2] == ["net[0]", "net[0]/net.b[0]"]  # where it lives


def test_keys_below_a_model_call_that_did_not_change_are_not_judged():
    """Layers trade time (one 20% slower, one 15% faster: the model call the same, on noisy steps):
    no layer of a model call that did not move is searched for changes, and the report says why."""
    result = diff(run(1, noise=0.1), run(2, noise=0.1, slower={"net.a": 0.2, "net.c": -0.15}))
    assert row(result, "net[0]")[dcol.VERDICT] == "unchanged"
    for key in ("net[0]/net.a[0]", "net[0]/net.c[0]"):
        assert row(result, key)[dcol.VERDICT] == "unchanged" and row(result, key)[dcol.NOTE] == \
            dcol.BELOW_UNCHANGED_NOTE
    assert result.verdict is dcol.Verdict.UNCHANGED


def test_a_machine_too_noisy_to_see_the_threshold_is_inconclusive_and_says_what_would_settle_it():
    """Batch 1 against batch 4 under load: the machine's own timing varied by 300%, so changes under
    that are not judged; that is no pass (it was UNCHANGED, exit 0)."""
    base, new = _on_machine(run(1), 0.002), _on_machine(run(2, slower={"net.b": 0.6}), 0.002)
    base.metadata["machine_speed"]["spread"], new.metadata["machine_speed"]["spread"] = 2.0, 1.0
    result = diff(base, new)
    assert result.verdict is dcol.Verdict.INCONCLUSIVE
    assert result.inconclusive[0].startswith("INCONCLUSIVE: nothing regressed, but a change of 5% could not have")
    assert "changes under 300% cannot be told from this machine's noise" in result.inconclusive[1]
    assert "run on a quieter machine" in result.inconclusive[1]
    assert result.warnings[:2] == result.inconclusive
    assert diff_formats.text(result).startswith("xsp diff: INCONCLUSIVE")
    assert json.loads(diff_formats.as_json(result))["verdict"] == "inconclusive"
    assert diff(base, new, machine_speed=False).verdict is dcol.Verdict.REGRESSED  # --raw: the threshold given


def test_steps_too_noisy_for_the_threshold_are_inconclusive_with_the_steps_it_would_take():
    result = diff(run(1, steps=10, noise=0.4), run(2, steps=10, noise=0.4))
    assert result.verdict is dcol.Verdict.INCONCLUSIVE
    model = row(result, "net[0]")
    assert model[dcol.DETECTABLE] > 0.05
    reason = result.inconclusive[1]
    needed = int(re.search(r"record about ([\d,]+) steps a side", reason).group(1).replace(",", ""))
    assert needed > 10
    settled = diff(run(1, steps=needed, noise=0.4), run(2, steps=needed, noise=0.4))
    # about the threshold: the spread was estimated from 10 steps
    assert row(settled, "net[0]")[dcol.DETECTABLE] < min(0.1, model[dcol.DETECTABLE])
    # a quiet pair of runs is conclusive: the same code, nothing regressed, a 5% change would have shown
    quiet = diff(run(1), run(2))
    assert quiet.verdict is dcol.Verdict.UNCHANGED and not quiet.inconclusive
    assert row(quiet, "net[0]")[dcol.DETECTABLE] == pytest.approx(0.05)  # no finer than the threshold


def test_too_few_steps_for_any_verdict_is_inconclusive():
    result = diff(run(1, steps=3), run(2, steps=3))
    assert result.verdict is dcol.Verdict.INCONCLUSIVE
    assert "too few steps to tell a 5% change from noise: record at least 5 steps a side" in result.inconclusive[1]


def test_a_key_that_moved_past_the_threshold_without_a_significant_test_is_never_unchanged():
    """A new user's diff: a model call 10x slower over 5 noisy steps a side (q=0.016 at an FDR of
    0.01) read "unchanged". It moved, and the test could not say: it reads unjudged, with why."""
    result = diff(run(1, steps=5, noise=0.6), run(2, steps=5, noise=0.6, slower={name: 0.3 for name in LAYERS}))
    model = row(result, "net[0]")
    assert model[dcol.VERDICT] == "unchanged" and model[dcol.ADJUSTED_RATIO] > 1.15
    assert model[dcol.Q_VALUE] > 0.01
    assert model[dcol.NOTE].startswith(dcol.NOT_SIGNIFICANT_NOTE)
    assert diff_formats.shown_verdict(SimpleNamespace(**model)) == "unjudged"
    text = diff_formats.text(result)
    assert "unchanged" not in text.split("Model (median per step):")[1].splitlines()[1]
    assert result.verdict is dcol.Verdict.INCONCLUSIVE


def test_two_processes_of_a_small_model_that_sit_apart_as_a_whole_fail_no_gate():
    """A model of 3 layers run twice, unchanged, failed the gate (exit 1): every layer of the new
    process +23% alike, its model call +34% (the model's own time between its layers moved more).
    With too few keys to measure how far two processes sit apart (the keys' scatter), the whole-run
    rule was skipped. Now a key within 25% of the run's move is not judged from one run a side."""
    alike = dict.fromkeys(LAYERS, 0.23)
    result = diff(run(1, gap_ns=50_000), run(2, slower=alike, gap_ns=92_000))
    assert row(result, "net[0]")[dcol.RATIO] == pytest.approx(1.34, abs=0.03)
    assert result.verdict is dcol.Verdict.INCONCLUSIVE
    assert (result.table[dcol.VERDICT] == "unchanged").all()
    assert row(result, "net[0]")[dcol.NOTE].startswith(dcol.WITH_RUN_NOTE)
    assert result.settings["key_scatter"] is None  # too few keys: not measured, never 0
    assert not any("the change is the program's" in warning for warning in result.warnings)
    assert any("the whole run moved by +23" in warning for warning in result.warnings)
    # its keys did not all move alike (the model call, with the glue between layers, +34%): not said so
    assert not any("every key" in warning for warning in result.warnings)
    # a layer that moved beyond the run's move by more than that is still found
    beyond = diff(run(1, gap_ns=50_000), run(2, slower={**alike, "net.b": 0.8}, gap_ns=92_000))
    assert beyond.verdict is dcol.Verdict.REGRESSED
    assert row(beyond, "net[0]/net.b[0]")[dcol.VERDICT] == "regressed"


def _with_session(trace: xsp.Trace, model: str = "net") -> xsp.Trace:
    """``trace`` with its model renamed ``model`` and a session span around its steps."""
    spans = trace.spans.astype({col.NAME: object, col.PATH: object})
    spans[col.NAME] = spans[col.NAME].replace({"net": model})
    spans[col.PATH] = spans[col.PATH].str.replace("net[0]", f"{model}[0]", regex=False)
    row = {col.SPAN_ID: 10**9, col.LEVEL: "model", col.KIND: "session", col.NAME: "session", col.PATH: "session[0]",
           col.START_NS: int(spans[col.START_NS].min()) - 1, col.END_NS: int(spans[col.END_NS].max()) + 1,
           col.TRACE_ID: "t", col.THREAD_ID: 1}
    row[col.DURATION_NS] = row[col.END_NS] - row[col.START_NS]
    session = pd.DataFrame({name: pd.array([row.get(name)], dtype=dtype) for name, dtype in col.COLUMNS.items()})
    return xsp.Trace(spans=concat_spans([session, spans]).reset_index(drop=True), metadata=dict(trace.metadata))


def test_runs_of_different_models_are_not_said_to_have_too_few_steps():
    """Two runs sharing no key but their session (a different model each, 40 steps a side) were
    told "fewer than 5 steps on a side: no rank test was possible": the session, one sample a run,
    was the key left untested."""
    result = diff(_with_session(run(1)), _with_session(run(2), model="other"))
    assert result.verdict is dcol.Verdict.NO_VERDICT
    assert not any("steps on a side" in warning for warning in result.warnings), result.warnings


def test_a_level_both_runs_recorded_with_spans_in_one_only_is_said_as_such():
    """Eager against compiled: both recorded the layer level, and the compiled run's code called
    no module. The warning said the layer level was "recorded in one run only"."""
    base, new = run(1), run(2)
    new = xsp.Trace(spans=new.spans[new.spans[col.LEVEL] != "layer"].reset_index(drop=True),
                    metadata=dict(new.metadata))
    for trace in (base, new):
        trace.metadata["levels"] = ["model", "layer"]
    said = diff(base, new).warnings
    assert not any("recorded in one run only" in warning for warning in said), said
    assert any(warning.startswith("level(s) layer recorded in both runs, with spans in one only (the new run's")
               for warning in said), said
    new.metadata["levels"] = ["model"]  # asked for in one run only: as before
    assert any("recorded in one run only" in warning for warning in diff(base, new).warnings)


def test_a_change_far_past_its_parents_is_not_shown_as_a_share_of_it():
    """A compile of 1.46 s below a model call whose latency (compiling left out) moved by 15 µs read
    "-9953551% of parent"."""
    breakdown = pd.DataFrame({"key": ["net[0]", "net[0]/torch.compile[0]", "net[0]/net.a[0]"], "depth": [0, 1, 1],
                              "adjusted_delta_ns": [-15_000.0, 1.46e9, -12_000.0],
                              "adjusted_ratio": [0.99, np.nan, 0.9],
                              "explains": [np.nan, -97_333.0, 0.8], "verdict": ["unchanged", "added", "unchanged"],
                              "note": [None, None, None]})
    lines = diff_formats._tree_lines(breakdown, 100)
    assert "of parent" not in lines[1] and "80% of parent" in lines[2], lines
