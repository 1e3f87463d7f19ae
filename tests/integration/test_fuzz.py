"""Property-based fuzz tests of the readers users feed files to (hypothesis).

Each target takes inputs a user could hand xsp (mutated bytes of a valid file, truncations,
random JSON or Arrow structures) and holds the reader to its contract: it succeeds, or raises
the error type it documents (:class:`xsp.TraceFormatError` and its kin, :mod:`xsp.core.errors`),
never another exception, and never hangs. Targets:

* the Kineto importer (``load_kineto``): mutated and truncated JSON and gzip, random events;
* the C scanner against the msgspec reader it accelerates: same verdict, same rows;
* the ``.xsp.parquet`` loader and its validator (``read_trace``, ``xsp.load``): mutated files
  and well-formed files of random columns and values;
* the baseline summary loader of ``xsp summary``/``xsp diff`` (``Summary.load``), and a diff of
  what it accepts (a damaged baseline must fail at load, in one line, not in the diff);
* the OTLP span budget (``within_budget``) on tables that pass the validator, and the
  splitter (``export_batch``) against collectors that refuse large batches or are busy.

Bounded: ``XSP_FUZZ_EXAMPLES`` scales every target's examples (default 1: about a minute on two
cores where nothing fails; a failure is shrunk, which takes longer). An input that breaks a
contract is saved under ``XSP_FUZZ_FOUND`` (default: a temporary folder) before hypothesis shrinks
it (``XSP_FUZZ_COLLECT=1``: saved and counted, not raised); how many inputs each target ran is
printed and, with ``XSP_FUZZ_RECORD=FILE``, written as JSON. A hard per-example timeout (faulthandler) ends the
run with every thread's stack where an example hangs, even in C.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gzip
import hashlib
import json
import os
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import xsp  # noqa: E402
from xsp.core import schema as col  # noqa: E402
from xsp.core.errors import TraceFormatError, TraceNotFoundError, XspError  # noqa: E402

pytestmark = pytest.mark.heavy  # `python -m pytest -m heavy`

SCALE = float(os.environ.get("XSP_FUZZ_EXAMPLES", "1"))
HANG_S = float(os.environ.get("XSP_FUZZ_HANG_S", "60"))
COLLECT = os.environ.get("XSP_FUZZ_COLLECT") == "1"
"""Triage: an input that breaks a contract is saved and counted (``target FAILED Error``), not
raised, so that one bounded run lists every kind of failure (nothing is shrunk)."""
FOUND = Path(os.environ.get("XSP_FUZZ_FOUND") or Path(tempfile.gettempdir()) / "xsp-fuzz-found")
RAN: Counter[str] = Counter()
"""Inputs run, by target."""


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=timedelta(seconds=10), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
                    print_blob=True)


@pytest.fixture(scope="module", autouse=True)
def record_counts():
    yield
    print("\nfuzz inputs run:", dict(RAN))
    if os.environ.get("XSP_FUZZ_RECORD"):
        Path(os.environ["XSP_FUZZ_RECORD"]).write_text(json.dumps(dict(RAN), indent=1))


@contextlib.contextmanager
def contract(target: str, data: bytes | Callable[[], bytes] | None, suffix: str,
             allowed: tuple[type[BaseException], ...] = (XspError,)):
    """Runs one input: ``allowed`` errors are fine; any other is saved with its input (``data``, or
    what it makes) and raised. A hang past ``HANG_S`` ends the process with every thread's stack."""
    RAN[target] += 1
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except allowed:
        pass
    except Exception as exc:
        if data is not None:
            data = data() if callable(data) else data
            FOUND.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha1(data).hexdigest()[:10]
            (FOUND / f"{target}-{type(exc).__name__}-{len(data)}-{digest}{suffix}").write_bytes(data)
        if not COLLECT:
            raise
        RAN[f"{target} FAILED {type(exc).__name__}"] += 1
    finally:
        faulthandler.cancel_dump_traceback_later()


# ---- inputs ----------------------------------------------------------------------------------

TOKENS = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"null", b"-", b"1e999", b"0.5", b"\\ud800",
          b"\\u0000", b"\xff", b"\x00", b"\xc3\xa9", b" ", b"\n", b"1" * 70, b'"args":', b'"ph":"X"',
          b'{"a":' * 20]


@st.composite
def mutated(draw, seed: bytes, tail: int = 0) -> bytes:
    """``seed`` after a few random edits (bytes flipped, set, cut out, repeated, JSON tokens put in)
    or cut short; with ``tail``, edits fall in its last ``tail`` bytes half the time (a footer)."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        size = len(data)
        if tail and size and draw(st.booleans()):
            at = size - 1 - draw(st.integers(0, min(tail, size) - 1))
        else:
            at = draw(st.integers(0, max(size - 1, 0)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "repeat", "token"]))
        if op == "flip" and size:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and size:
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 64))]
        elif op == "truncate":
            del data[at:]
        elif op == "repeat":
            data[at:at] = data[at:at + draw(st.integers(1, 64))]
        else:
            data[at:at] = draw(st.sampled_from(TOKENS))
    return bytes(data)


JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
NUMBERS = st.one_of(st.integers(-(2**65), 2**65), st.integers(0, 2**40), st.floats(), st.none(), st.booleans(),
                    st.text(alphabet="-0123456789.e", max_size=6))
CATEGORIES = ["cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy",
              "gpu_memset", "cuda_sync", "gpu_user_annotation", "cuda_profiler_range", "Kernel", "Runtime", "ac2g",
              "Trace", "cpu_instant_event", ""]
NAMES = ["ProfilerStep#1", "ProfilerStep#x", "thread_name", "aten::mm", "Memcpy HtoD (Pageable -> Device)",
         "enumerate(DataLoader)#_Iter.__next__", "cudaLaunchKernel"]
ARGS = st.one_of(JSON_VALUES, st.fixed_dictionaries({}, optional={
    "correlation": NUMBERS, "device": NUMBERS, "stream": NUMBERS, "grid": JSON_VALUES, "block": JSON_VALUES,
    "registers per thread": NUMBERS, "shared memory": NUMBERS, "bytes": NUMBERS, "Input Dims": JSON_VALUES,
    "Sequence number": NUMBERS, "External id": NUMBERS, "name": JSON_VALUES,
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": NUMBERS}))
EVENTS = st.fixed_dictionaries({}, optional={
    "ph": st.sampled_from(["X", "X", "X", "M", "s", "f", "t", "i", "B", "Z", ""]) | st.text(max_size=2),
    "cat": st.sampled_from(CATEGORIES) | st.text(max_size=6),
    "name": st.sampled_from(NAMES) | st.text(max_size=8) | JSON_VALUES,
    "pid": NUMBERS, "tid": NUMBERS, "ts": NUMBERS, "dur": NUMBERS, "id": NUMBERS, "args": ARGS})
DOCUMENTS = st.fixed_dictionaries({"traceEvents": st.lists(EVENTS, max_size=10)}, optional={
    "baseTimeNanoseconds": NUMBERS, "deviceProperties": JSON_VALUES, "distributedInfo": JSON_VALUES,
    "schemaVersion": JSON_VALUES, "traceName": JSON_VALUES})


def seed_document() -> dict:
    """A small trace of every kind of event the importer reads."""
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "main \u00e9"}},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 7, "ts": 9, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 7, "ts": 10.5, "dur": 2.25,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Sequence number": 5, "External id": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7, "ts": 11, "dur": 1,
         "args": {"correlation": 5, "cbid": 211}},
        {"ph": "X", "cat": "kernel", "name": "sgemm", "pid": 0, "tid": 3, "ts": 12.001, "dur": 4,
         "args": {"correlation": 5, "device": 0, "stream": 3, "grid": [4, 1, 1], "block": [128, 1, 1],
                  "registers per thread": 32, "shared memory": 0}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": 3, "ts": 20,
         "dur": 1, "args": {"correlation": 6, "bytes": 4096, "device": 0, "stream": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 7, "ts": 19, "dur": 3,
         "args": {"correlation": 6}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "mark", "pid": 1, "tid": 7, "ts": 5, "s": "t"},
        {"ph": "s", "cat": "ac2g", "id": 5, "pid": 1, "tid": 7, "ts": 11},
        {"ph": "f", "cat": "ac2g", "id": 5, "pid": 0, "tid": 3, "ts": 12.001, "bp": "e"},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Fake GPU"}],
            "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": events,
            "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceName": "seed"}


SOUP_TOKENS = [b"{", b"}", b"[", b"]", b",", b":", b'"a"', b'"\\u00e9"', b'"\\x"', b'"\\ud800"', b"1", b"-1", b"0.5",
               b"1e5", b"01", b"-", b"1.", b".5", b"1e", b"true", b"tru", b"null", b"nul", b" ", b"\n", b"\t", b"\x0c",
               b"\x00", b"\xff", b'"ph"', b'"X"', b'"cat"', b'"cpu_op"', b'"args"', b'"traceEvents"', b'"\x01"',
               b"1" * 70, b"/", b"'", b"\xef\xbb\xbf"]
SOUPS = st.tuples(st.sampled_from([b"", b"{", b'{"traceEvents": [', b'{"traceEvents": [{"ph": "X", "args": ',
                                   b'{"a": 1, "traceEvents": [], "b": ']),
                  st.lists(st.sampled_from(SOUP_TOKENS), max_size=30)).map(lambda t: t[0] + b"".join(t[1]))
"""Token soup: JSON's tokens (and near misses) in any order, after a trace's first bytes."""

SEED_JSON = json.dumps(seed_document(), indent=1).encode()
SEED_GZIP = gzip.compress(SEED_JSON, mtime=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def seed_trace(folder):
    path = folder / "seed.json"
    path.write_bytes(SEED_JSON)
    return xsp.load(path)


def _written(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


# ---- the Kineto importer -------------------------------------------------------------------------

KINETO_ERRORS = (TraceFormatError, TraceNotFoundError)


def _load_kineto(folder: Path, data: bytes, name: str, target: str) -> None:
    from xsp.io.kineto import load_kineto

    path = _written(folder, name, data)
    with contract(target, data, Path(name).suffix, KINETO_ERRORS):
        load_kineto(path)


@fuzz(800)
@given(data=st.one_of(mutated(SEED_JSON), mutated(SEED_GZIP, tail=16)))
def test_kineto_mutated_files_load_or_are_refused(folder, data):
    _load_kineto(folder, data, "mutated.json.gz" if data[:2] == b"\x1f\x8b" else "mutated.json", "kineto-mutated")


@fuzz(600)
@given(document=DOCUMENTS, gzipped=st.booleans())
def test_kineto_random_events_load_or_are_refused(folder, document, gzipped):
    text = json.dumps(document).encode()  # NaN and Infinity as JavaScript writes them: not JSON
    data = gzip.compress(text, mtime=0) if gzipped else text
    _load_kineto(folder, data, "random.json.gz" if gzipped else "random.json", "kineto-random")


@fuzz(600)
@given(data=st.one_of(DOCUMENTS.map(lambda document: json.dumps(document).encode()), mutated(SEED_JSON), SOUPS))
def test_the_c_scanner_gives_the_msgspec_readers_verdict_and_rows(folder, monkeypatch, data):
    """The scanner is an accelerator, never a second opinion: where it refuses a file, msgspec
    does too; where it reads one, msgspec reads the same rows."""
    kineto_c = pytest.importorskip("xsp.io._kineto")
    del kineto_c
    from xsp.io import kineto
    from xsp.io.kineto_events import decoded_events, scanned_events

    try:  # (text that is not UTF-8 in a phase or name the C scanner skips over is a known difference:
        data.decode("utf-8")  # one reads the file, the other refuses it in one line; benchmarks/results/fuzz.md)
    except UnicodeDecodeError:
        return
    path = _written(folder, "scanned.json", data)
    with contract("kineto-c-vs-msgspec", data, ".json", ()):
        monkeypatch.delenv("XSP_PURE_PYTHON", raising=False)
        try:  # the error types are the other tests' business: here only the verdicts
            scanned = scanned_events(path, kineto.CATEGORY_NAMES, kineto.LAUNCH_LINKED, kineto.DEVICE_CATEGORIES)
            scanner_says = "read" if scanned is not None else "left to msgspec"
        except Exception as exc:
            scanned, scanner_says = None, f"refused: {type(exc).__name__}: {exc}"
        try:
            decoded = decoded_events(kineto.decode(path), kineto.CATEGORY_NAMES, kineto.LAUNCH_LINKED,
                                     kineto.DEVICE_CATEGORIES)
            msgspec_says = "read"
        except Exception as exc:
            decoded, msgspec_says = None, f"refused: {type(exc).__name__}: {exc}"
        if scanner_says.startswith("refused"):
            assert msgspec_says != "read", f"the scanner {scanner_says}; msgspec reads the file"
            if "not valid" in scanner_says or "truncated" in scanner_says:  # not JSON: msgspec says so too
                with pytest.raises((msgspec.DecodeError, UnicodeDecodeError)):
                    msgspec.json.decode(data)
        if scanned is not None:
            assert decoded is not None, f"the scanner reads the file; msgspec {msgspec_says}"
            if "args_too_deep" not in scanned.counts:
                rows, metadata = kineto.kineto_rows(scanned)
                expected_rows, expected_metadata = kineto.kineto_rows(decoded)
                pd.testing.assert_frame_equal(rows, expected_rows)
                assert metadata == expected_metadata


# ---- the .xsp.parquet loader and its validator -----------------------------------------------

@pytest.fixture(scope="module")
def seed_parquet(folder, seed_trace) -> bytes:
    from xsp.io.parquet import write_trace

    return write_trace(folder / "seed.xsp.parquet", seed_trace.spans, seed_trace.metadata).read_bytes()


@fuzz(600)
@given(data=st.data())
def test_parquet_mutated_files_load_or_are_refused(folder, seed_parquet, data):
    from xsp.io.parquet import read_trace

    raw = data.draw(mutated(seed_parquet, tail=800))
    path = _written(folder, "mutated.xsp.parquet", raw)
    with contract("parquet-mutated", raw, ".xsp.parquet"):
        read_trace(path)
    with contract("parquet-mutated-xsp.load", raw, ".xsp.parquet"):
        xsp.load(path)


INT64 = st.integers(-(2**63), 2**63 - 1)
TIMES = st.one_of(st.integers(0, 10**6), st.integers(-(2**63), 2**63 - 1), st.just(1 << 62))
COLUMN_TYPES = {
    "int64": (pa.int64(), st.none() | INT64), "int32": (pa.int32(), st.none() | st.integers(-(2**31), 2**31 - 1)),
    "uint64": (pa.uint64(), st.none() | st.integers(0, 2**64 - 1)), "float64": (pa.float64(), st.none() | st.floats()),
    "large_string": (pa.large_string(), st.none() | st.text(max_size=6)),
    "string": (pa.string(), st.none() | st.text(max_size=6)),
    "binary": (pa.binary(), st.none() | st.binary(max_size=4)),
    "bool": (pa.bool_(), st.none() | st.booleans()), "null": (pa.null(), st.none()),
}


@st.composite
def span_files(draw) -> tuple[pa.Table, dict]:
    """A Parquet table of spans: every column of the schema with plausible values (tree links
    among its own rows, to nowhere, or cyclic; times in order or not), then a few columns
    dropped, given another type or only nulls; and xsp metadata, mostly valid."""
    rows = draw(st.integers(0, 6))
    ids = draw(st.lists(st.integers(1, 30), min_size=rows, max_size=rows, unique=draw(st.booleans())))
    starts = draw(st.lists(TIMES if draw(st.integers(0, 9)) == 0 else st.integers(0, 10**6), min_size=rows,
                           max_size=rows))
    ends = [s + draw(st.integers(-5, 100)) if -(2**62) < s < 2**62 else s for s in starts]
    columns = {
        col.TRACE_ID: pa.array([draw(st.sampled_from(["a" * 32, "b" * 32, "", "x"])) for _ in ids], pa.large_string()),
        col.SPAN_ID: pa.array(ids, pa.int64()),
        col.PARENT_ID: pa.array([draw(st.none() | st.sampled_from(ids or [0]) | st.integers(0, 40)) for _ in ids],
                                pa.int64()),
        col.LEVEL: pa.array([draw(st.sampled_from(["model", "layer", "operator", "cuda_api", "kernel", "input",
                                                   "system", "junk", None])) for _ in ids], pa.large_string()),
        col.KIND: pa.array([draw(st.sampled_from(["operator", "session", "forward", None])) for _ in ids],
                           pa.large_string()),
        col.START_NS: pa.array(starts, pa.int64()), col.END_NS: pa.array(ends, pa.int64()),
        col.DURATION_NS: pa.array([e - s if -(2**62) < s < 2**62 else 0 for s, e in zip(starts, ends)], pa.int64()),
        col.THREAD_ID: pa.array([draw(st.sampled_from([1, 2, None])) for _ in ids], pa.int64()),
    }
    for name, dtype in col.COLUMNS.items():
        if name not in columns:
            values = st.none() | (st.text(max_size=6) if dtype == "string" else st.integers(-5, 5))
            kind = pa.large_string() if dtype == "string" else pa.int64()
            columns[name] = pa.array([draw(values) for _ in range(rows)], kind)
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(list(col.COLUMNS)))
        change = draw(st.sampled_from(["drop", "retype", "nulls"]))
        if change == "drop":
            columns.pop(name, None)
            continue
        kind, values = COLUMN_TYPES[draw(st.sampled_from(list(COLUMN_TYPES)))]
        if change == "nulls":
            kind, values = draw(st.sampled_from([pa.null(), columns.get(name, pa.array([])).type])), st.none()
        with contextlib.suppress(pa.ArrowException, OverflowError):
            columns[name] = pa.array([draw(values) for _ in range(rows)], type=kind)
    table = pa.table(columns) if columns else pa.table({"x": pa.array([], pa.int64())})
    metadata = {"schema_version": col.SCHEMA_VERSION} if draw(st.integers(0, 9)) < 8 else draw(st.one_of(
        st.fixed_dictionaries({"schema_version": st.one_of(st.integers(-2, 3), JSON_VALUES)},
                              optional={"distributed": JSON_VALUES, "levels": JSON_VALUES, "dropped": JSON_VALUES}),
        JSON_VALUES))
    return table, metadata


@fuzz(400)
@given(spec=span_files())
def test_parquet_files_of_random_spans_load_or_are_refused(folder, spec):
    """Well-formed Parquet, its checksum right: what is in it is the validator's to judge."""
    from xsp.io.parquet import CHECKSUM_KEY, _footer_checksum, read_trace

    table, metadata = spec
    metadata_json = json.dumps(metadata).encode()
    footer = {col.METADATA_KEY: metadata_json, CHECKSUM_KEY: _footer_checksum(metadata_json, table.schema)}
    path = folder / "random.xsp.parquet"
    pq.write_table(table.replace_schema_metadata(footer), path)
    raw = path.read_bytes()
    with contract("parquet-random", raw, ".xsp.parquet"):
        spans, _ = read_trace(path)
        assert list(spans.columns) == table.column_names
    with contract("parquet-random-xsp.load", raw, ".xsp.parquet"):
        xsp.load(path)


# ---- baseline summaries ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def seed_summary(folder, seed_trace) -> bytes:
    from xsp.gate.baseline import SUFFIX, summarize

    return summarize(seed_trace).save(folder / f"seed{SUFFIX}").read_bytes()


def _load_summary_and_diff(folder: Path, raw: bytes, name: str, target: str) -> None:
    from xsp.gate.baseline import Summary
    from xsp.gate.diff import diff

    path = _written(folder, name, raw)
    summary = None
    with contract(target, raw, name[name.index("."):]):
        summary = Summary.load(path)
    if summary is not None:  # a baseline it accepts, xsp diff must read or refuse in one line
        with contract(f"{target}-then-diff", raw, name[name.index("."):]):
            diff(summary, summary)


@fuzz(400)
@given(data=st.data())
def test_summary_mutated_files_load_or_are_refused(folder, seed_summary, data):
    raw = data.draw(mutated(seed_summary, tail=1500))
    _load_summary_and_diff(folder, raw, "mutated.xsp-summary.parquet", "summary-mutated")


SUMMARY_COLUMNS = ["level", "kind", "name", "key", "parent_key", "count", "total_ns", "samples_ns", "sample_count",
                   "input_shapes", "kernels_per_step", "input_dtypes", "by"]


@st.composite
def summary_files(draw) -> bytes:
    """A summary: Parquet of random key rows (columns missing, of other types) with random facts,
    or the JSON of version 1 with random rows."""
    facts = draw(st.one_of(
        st.fixed_dictionaries({"format": st.just("xsp-summary"), "version": st.sampled_from([1, 3, 3, 4, "3", None])},
                              optional={"quantiles": JSON_VALUES, "metadata": JSON_VALUES,
                                        "keys": st.dictionaries(st.sampled_from(["path", "name", "x"]), JSON_VALUES)}),
        JSON_VALUES))
    if draw(st.booleans()):
        rows = draw(st.integers(0, 6))
        natural = {
            "level": st.sampled_from(["model", "layer", "operator", "kernel", "junk"]), "kind": st.text(max_size=4),
            "name": st.text(max_size=4), "key": st.sampled_from(["a", "a/b", "a/b/c", ""]),
            "parent_key": st.none() | st.sampled_from(["a", "a/b", "zz"]), "count": st.integers(-3, 10**6),
            "total_ns": INT64, "sample_count": st.integers(-3, 50),
            "samples_ns": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6),
            "input_shapes": st.none() | st.text(max_size=6), "kernels_per_step": st.none() | st.floats(),
            "input_dtypes": st.none() | st.text(max_size=6), "by": st.sampled_from(["path", "name", "other"]),
        }
        columns = {}
        for name in SUMMARY_COLUMNS:
            choice = draw(st.sampled_from(["natural"] * 4 + ["absent", "random"]))
            if choice == "absent":
                continue
            values = [draw(natural[name] if choice == "natural" else JSON_LEAVES) for _ in range(rows)]
            with contextlib.suppress(pa.ArrowException, OverflowError, TypeError):
                columns[name] = pa.array(values)
        table = pa.table(columns) if columns else pa.table({"x": pa.array([], pa.int64())})
        table = table.replace_schema_metadata({b"xsp.summary": json.dumps(facts).encode()})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        return sink.getvalue().to_pybytes()
    rows = draw(st.lists(st.lists(JSON_LEAVES | st.lists(st.integers(-2000, 2000), max_size=4), max_size=13),
                         max_size=4))
    document = {**(facts if isinstance(facts, dict) else {}), "columns": draw(st.one_of(
        st.just(["level", "kind", "name", "key", "parent", "count", "total_ns", "sample_count", "median_ns",
                 "samples_permille", "input_shapes", "kernels_per_step", "input_dtypes"]), JSON_VALUES)),
        "keys": draw(st.one_of(st.fixed_dictionaries({}, optional={"path": st.just(rows), "name": st.just(rows)}),
                               JSON_VALUES))}
    return json.dumps(document).encode()


@fuzz(500)
@given(raw=summary_files())
def test_summary_files_of_random_keys_load_or_are_refused(folder, raw):
    name = "random.xsp-summary.parquet" if raw[:4] == b"PAR1" else "random.xsp.json"
    _load_summary_and_diff(folder, raw, name, "summary-random")


# ---- the OTLP span budget and splitter -------------------------------------------------------

@st.composite
def span_tables(draw) -> pd.DataFrame:
    """A span table as a file could hold one (it passes the validator): steps of nested spans
    at every level, on threads and streams."""
    from xsp.table.build import conform

    rows: list[dict] = []
    next_id = 1
    levels = ["model", "input", "layer", "operator", "cuda_api", "kernel"]
    for trace in range(draw(st.integers(1, 3))):
        trace_id = f"{trace + 1:032x}"
        stack: list[tuple[int, int, int, int]] = []  # (id, level index, start, end)
        for _ in range(draw(st.integers(1, 30))):
            stack = stack[:draw(st.integers(0, len(stack)))]
            parent = stack[-1] if stack else None
            level = draw(st.integers(parent[1] if parent else 0, len(levels) - 1))
            low, high = (parent[2], parent[3]) if parent else (0, 10**6)
            start = draw(st.integers(low, high))
            end = draw(st.integers(start, high))
            on_stream = levels[level] == "kernel"
            rows.append({col.TRACE_ID: trace_id, col.SPAN_ID: next_id, col.PARENT_ID: parent[0] if parent else None,
                         col.LEVEL: levels[level], col.KIND: draw(st.sampled_from(["operator", "kernel", "layer"])),
                         col.NAME: draw(st.sampled_from(["a", "b", "aten::mm", "gemm"])), col.START_NS: start,
                         col.END_NS: end, col.THREAD_ID: None if on_stream else draw(st.integers(1, 2)),
                         col.STREAM_ID: draw(st.integers(0, 2)) if on_stream else None,
                         col.ATTRIBUTES: draw(st.none() | st.just('{"k": 1}'))})
            stack.append((next_id, level, start, end))
            next_id += 1
    frame = conform(pd.DataFrame(rows))
    frame[col.DURATION_NS] = frame[col.END_NS] - frame[col.START_NS]
    return frame


@fuzz(250)
@given(spans=span_tables(), budget=st.integers(-1, 30))
def test_the_span_budget_fits_every_trace_and_loses_nothing(spans, budget):
    from xsp.export.budget import ATTR_AGGREGATED_COUNT, within_budget
    from xsp.table.validation import impossible_spans

    assert impossible_spans(spans) == []  # a table a file could hold
    with contract("otlp-budget", lambda: spans.to_csv().encode(), ".csv", ()):
        folded = within_budget(spans, budget)
        out = folded.spans
        if budget > 0:
            assert out[col.TRACE_ID].value_counts().max() <= budget
        represented = sum(json.loads(a).get(ATTR_AGGREGATED_COUNT, 1) if isinstance(a, str) else 1
                          for a in out[col.ATTRIBUTES])
        assert represented + folded.dropped == len(spans)
        assert out[col.SPAN_ID].is_unique
        assert set(out[col.PARENT_ID].dropna().astype(int)) <= set(out[col.SPAN_ID])


class _Collector:
    """An OTLP exporter that refuses batches over a size (413), is busy at times (429), or raises."""

    def __init__(self, limit: int, answers: list[str]) -> None:
        from xsp.export.delivery import CollectorAnswers

        self.limit, self.answers, self.calls = limit, answers, 0
        self.xsp_answers = CollectorAnswers()
        self.received: list[int] = []

    def export(self, batch):
        from opentelemetry.sdk.trace.export import SpanExportResult

        answer = self.answers[self.calls % len(self.answers)] if self.answers else "ok"
        self.calls += 1
        if answer == "raise":
            raise ConnectionError("reset by peer")
        if answer == "busy":
            self.xsp_answers.status, self.xsp_answers.retry_after_s = 429, 0.0
            return SpanExportResult.FAILURE
        if len(batch) > self.limit:
            self.xsp_answers.status = 413
            return SpanExportResult.FAILURE
        self.received += batch
        return SpanExportResult.SUCCESS


@fuzz(300)
@given(size=st.integers(1, 300), limit=st.integers(0, 64),
       answers=st.lists(st.sampled_from(["ok", "ok", "ok", "busy", "raise"]), max_size=6))
def test_the_splitter_sends_or_counts_every_span_and_ends(size, limit, answers):
    from xsp.export.delivery import ExportReport, export_batch

    collector = _Collector(limit, answers)
    report = ExportReport(target="fuzz")
    report.deadline = time.monotonic() + 0.2  # busy answers are retried until then
    batch = list(range(size))
    with contract("otlp-splitter", None, "", ()):
        started = time.monotonic()
        export_batch(batch, collector, report)
        assert time.monotonic() - started < 2.0
        assert report.exported + report.failed == report.submitted == size
        assert sorted(collector.received) == sorted(set(collector.received)), "a span sent twice"
        assert report.exported == len(collector.received)
        assert (report.error is None) == (report.failed == 0)
