"""A distributed job of many ranks made from one real rank's trace: its rank files, each rank's
clock shifted by its host's offset and chosen ranks made late in chosen steps.

Each rank is the shared trace of one NCCL rank (``a100_nccl_rank0``: three steps of seven NCCL
all-reduces, entered through ``c10d::allreduce_``) as its own ``.xsp.parquet`` file, with:

* ``ranks_per_host`` ranks a host (``node<h>``), every time of host ``h`` shifted by
  ``h * host_offset_ns`` (a host's clock is off by that much: what ``analysis.clock_offsets``
  must find);
* for each ``(rank, step): delay_ns`` of ``late``, every span of that rank in that step started
  ``delay_ns`` later (the rank enters each of the step's collectives that much after the others:
  what ``analysis.stragglers`` and ``analysis.collective_skew`` must find).

Used by benchmarks/large_job_report.py and the heavy tests.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

SOURCE_NAME = "a100_nccl_rank0.json.gz"
JOB_ID = "synthetic-job"


def write_job(source: Path, folder: Path, ranks: int, ranks_per_host: int = 8, host_offset_ns: int = 1_234_567,
              late: dict[tuple[int, int], int] | None = None, name: str = "job") -> Path:
    """Write the job's rank files into ``folder`` (``<name>.rank<r>.xsp.parquet``); returns the name
    that loads them all (``<name>.xsp.parquet``)."""
    import xsp
    from xsp.core import schema as col
    from xsp.io.parquet import arrow_table, write_trace_tables

    late = late or {}
    trace = xsp.load(source)
    table = arrow_table(trace.spans)
    starts, ends = table[col.START_NS], table[col.END_NS]
    steps = table[col.STEP]
    rank_at = table.schema.get_field_index(col.RANK)
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        host = rank // ranks_per_host
        shift = pa.array([host * host_offset_ns] * len(table), type=pa.int64())
        for (late_rank, step), delay_ns in late.items():
            if late_rank == rank:
                in_step = pc.fill_null(pc.equal(steps, step), False)
                shift = pc.if_else(in_step, pc.add(shift, delay_ns), shift)
        shifted = table.set_column(table.schema.get_field_index(col.START_NS), col.START_NS, pc.add(starts, shift))
        shifted = shifted.set_column(shifted.schema.get_field_index(col.END_NS), col.END_NS, pc.add(ends, shift))
        shifted = shifted.set_column(rank_at, col.RANK, pa.array([rank] * len(table), type=pa.int64()))
        metadata = {**trace.metadata, "host": f"node{host}",
                    "distributed": {**(trace.metadata.get("distributed") or {}), "rank": rank, "world_size": ranks,
                                    "job_id": JOB_ID, "host": f"node{host}"}}
        write_trace_tables(folder / f"{name}.rank{rank}.xsp.parquet", iter([shifted]), metadata)
    return folder / f"{name}.xsp.parquet"


if __name__ == "__main__":
    import sys

    started = time.perf_counter()
    target = write_job(Path(__file__).resolve().parents[2] / "shared" / "traces" / "kineto" / SOURCE_NAME,
                       Path(sys.argv[1]), int(sys.argv[2]))
    print(f"{target} in {time.perf_counter() - started:.1f} s")
