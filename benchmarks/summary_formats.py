"""Baseline summaries (``xsp summary``): the Parquet file xsp writes against other layouts.

A summary is committed to a repository for every model a team gates, and loaded by every CI
run that checks against it, so its size and its load time are what count. For summaries of
real runs, the same keys (at most ``QUANTILES`` samples each, as the summary keeps them) are
written as:

* **xsp summary**: what ``Summary.save`` writes (Parquet, zstd 19, the facts in the schema's
  metadata), loaded with ``Summary.load``;
* **Parquet (zstd 22)**: the same table at zstd's highest level, read with pyarrow;
* **JSON rows (gzip)**: every key a JSON object, samples a list (``jq`` and ``pandas.read_json``
  read it), gzip-compressed.

Sizes in bytes and load times (median of ``--rounds``, the file read to key-samples frames)
go to benchmarks/results/summary_formats.md. The packed JSON codec of earlier versions was
measured against these before it was removed: benchmarks/results/summary_formats_codec.md.

Usage: python benchmarks/summary_formats.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from _results import record

import xsp
from xsp.gate import diff_columns as dcol
from xsp.gate.baseline import Summary, summarize

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "kineto"
RESULTS = ROOT / "benchmarks" / "results" / "summary_formats.md"
RUNS = ("a100_alexnet", "a100_nccl_rank0", "v100_2rank_train_rank1")


def _frames(summary: Summary) -> pd.DataFrame:
    """Every key of ``summary`` in one frame, with the way it was keyed."""
    parts = [frame.assign(by=by.value) for by, frame in summary.keys.items()]
    return pd.concat(parts, ignore_index=True)


def parquet_bytes(summary: Summary) -> bytes:
    table = pa.Table.from_pandas(_frames(summary), preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           b"xsp.summary": json.dumps(summary.metadata).encode()})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", compression_level=22)
    return sink.getvalue()


def parquet_load(data: bytes) -> dict[str, pd.DataFrame]:
    frame = pq.read_table(io.BytesIO(data)).to_pandas()
    return {by: part.drop(columns="by").reset_index(drop=True) for by, part in frame.groupby("by")}


def json_bytes(summary: Summary) -> bytes:
    rows = []
    for row in _frames(summary).to_dict(orient="records"):
        rows.append({key: (value.tolist() if isinstance(value, np.ndarray) else
                           None if isinstance(value, float) and np.isnan(value) else value)
                     for key, value in row.items()})
    text = json.dumps({"metadata": summary.metadata, "keys": rows}, separators=(",", ":"))
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def json_load(data: bytes) -> dict[str, pd.DataFrame]:
    document = json.loads(gzip.decompress(data))
    frame = pd.DataFrame(document["keys"])
    frame[dcol.SAMPLES_NS] = [np.asarray(samples, dtype=np.int64) for samples in frame[dcol.SAMPLES_NS]]
    return {by: part.drop(columns="by").reset_index(drop=True) for by, part in frame.groupby("by")}


def _median_ms(load: Any, data: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        load(data)
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not TRACES.is_dir():
        print(f"the shared traces are not at {TRACES}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for run in RUNS:
            trace = xsp.load(TRACES / f"{run}.json.gz")
            summary = summarize(trace, source=run)
            keys = sum(len(frame) for frame in summary.keys.values())
            written = summary.save(Path(folder) / f"{run}.xsp-summary.parquet")
            kept = Summary.load(written)  # the keys as a summary keeps them (quantiles)
            parquet, rows_json = parquet_bytes(kept), json_bytes(kept)
            rows.append({
                "run": run, "spans": len(trace.spans), "keys": keys, "summary": written.stat().st_size,
                "parquet": len(parquet), "json_gz": len(rows_json),
                "summary_ms": _median_ms(Summary.load, written, args.rounds),
                "parquet_ms": _median_ms(parquet_load, parquet, args.rounds),
                "json_ms": _median_ms(json_load, rows_json, args.rounds),
            })
            print(rows[-1], flush=True)
    lines = [
        "# Baseline summaries: xsp's Parquet file against other layouts", "",
        f"`python benchmarks/summary_formats.py --rounds {args.rounds}`: summaries (by path and by name) of "
        "three shared traces (../shared/traces/kineto), the same keys written each way; bytes on disk, and "
        "the median time to load the file into key-samples frames. The packed codec of earlier versions: "
        "summary_formats_codec.md.", "",
        "| run | spans | keys | xsp summary (Parquet, zstd 19) | Parquet (zstd 22) | JSON rows (gzip 9) "
        "| load: xsp summary | load: Parquet | load: JSON |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['run']} | {r['spans']:,} | {r['keys']:,} | {r['summary']:,} B | {r['parquet']:,} B | "
                     f"{r['json_gz']:,} B ({r['json_gz'] / r['summary']:.1f}x) | {r['summary_ms']:.1f} ms | "
                     f"{r['parquet_ms']:.1f} ms | {r['json_ms']:.1f} ms |")
    record(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
