"""What reading CUPTI's activity records costs xsp, per record, without a GPU.

CUPTI buffers are built byte for byte from cupti-python's numpy layouts (CUPTI 13.4's records,
as a PyTorch step makes them: per kernel launch an API record, an external correlation record
and a kernel record, with copies, sets and synchronisations among them) and handed to xsp's C
callbacks by the fake libcupti of the tests, from a thread of its own. Side by side:

* C drain: walking the queued buffers into packed columns (``xsp.record._activity.drain``) and
  reading them into numpy, the work that replaced one Python object per record;
* C drain + rows: the same, then the span rows the ``cuda_api`` and ``kernel`` levels make;
* Python path (xsp's part): the record objects' bytes copied in the callback and decoded a
  drain at once, as xsp does where the C path cannot run. cupti-python's own object per record
  comes on top of it (0.3-0.65 us in 13.4, 17-400 us in 13.0; see ../shared/REFERENCES.md).

The last line is the C drain's cost: ``ns per record: N`` (goal: at most 100).

    python benchmarks/cupti_records.py [--buffers 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.native_cupti: the fake libcupti and the record layouts

from benchmarks._results import record as record_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cupti_records.md"
KERNEL_NAMES = [f"_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_{i}_GLOBAL__N_115CUDAFunctorOnSelf"
                f"IfEENS_6detail5ArrayIPcLi2EEEEEviT0_T1_" for i in range(40)] + ["volta_sgemm_128x64_nn"] * 10


def step_records(release, library, launches: int) -> list[bytes]:
    """The records of ``launches`` kernel launches with a copy, a set and a sync every 20."""
    from tests.native_cupti import record

    api, external, kernel = release.dtype("api"), release.dtype("external"), release.dtype("kernel")
    out = []
    start = 1_700_000_000_000_000_000
    for i in range(launches):
        at = start + 5_000 * i
        out.append(record(api, kind=5, cbid=211, start=at, end=at + 3_000, process_id=1, thread_id=77,
                          correlation_id=i, return_value=0))
        out.append(record(external, kind=39, external_kind=3, external_id=at - 50_000, correlation_id=i))
        out.append(record(kernel, kind=10, start=at + 9_000, end=at + 20_000, correlation_id=i,
                          name=library.name_pointer(KERNEL_NAMES[i % len(KERNEL_NAMES)]), grid_x=80 + i % 7,
                          grid_y=1, grid_z=1, block_x=256, block_y=1, block_z=1, registers_per_thread=32,
                          static_shared_memory=0, dynamic_shared_memory=4096, stream_id=7, device_id=0))
        if i % 20 == 0:
            out.append(record(release.dtype("memcpy"), kind=1, copy_kind=1, bytes=1 << 20, start=at, end=at + 90_000,
                              device_id=0, stream_id=7, correlation_id=i))
            out.append(record(release.dtype("memset"), kind=2, bytes=4096, start=at, end=at + 900, device_id=0,
                              stream_id=7, correlation_id=i))
            out.append(record(release.dtype("sync"), kind=38, type=3, start=at, end=at + 40_000, correlation_id=i,
                              stream_id=7))
    return out


def time_c_path(library, native, data: bytes, records: int, buffers: int, rounds: int, rows: bool) -> float:
    """Median ns per record of a drain of ``buffers`` buffers (and the span rows, if ``rows``)."""
    from xsp.tracers.cuda.clock import CuptiClock
    from xsp.tracers.cuda.rows import activity_rows, api_rows

    costs = []
    for _ in range(rounds):
        library.deliver(data, buffers=buffers)
        began = time.perf_counter_ns()
        columns, lost = native.drain()
        if rows:
            api_rows(columns, CuptiClock.constant(0))
            activity_rows(columns, CuptiClock.constant(0))
        costs.append((time.perf_counter_ns() - began) / (records * buffers))
        assert not lost and len(columns) == records * buffers, (lost, len(columns))
    return statistics.median(costs)


def time_zeroing(library, native, data: bytes, valid: int, buffers: int, rounds: int, zeroing: str,
                 ) -> tuple[float, float]:
    """``(deliver_us, drain_us)`` per buffer: CUPTI writing ``data`` (``valid`` bytes of it
    valid) into buffers xsp zeroed as ``zeroing`` says, and the drain that reads them and zeroes
    them again. Writing into pages given back to the kernel costs a page fault each, on
    CUPTI's side: the delivery counts it."""
    from xsp.tracers.cuda.records import BUFFER_BYTES, MAX_BUFFERS

    native.module.register(BUFFER_BYTES, MAX_BUFFERS, zeroing)
    library.check_zero(0)  # the fake's check of every byte handed out would dwarf CUPTI's writes
    library.deliver(data, valid=valid, buffers=buffers)  # the pool's buffers exist and went round once
    native.drain()
    delivers, drains = [], []
    for _ in range(rounds):
        began = time.perf_counter_ns()
        library.deliver(data, valid=valid, buffers=buffers)
        delivered = time.perf_counter_ns()
        native.drain()
        drains.append((time.perf_counter_ns() - delivered) / buffers / 1e3)
        delivers.append((delivered - began) / buffers / 1e3)
    native.module.register(BUFFER_BYTES, MAX_BUFFERS)
    library.check_zero(1)
    return statistics.median(delivers), statistics.median(drains)


def python_objects(count: int) -> list[object]:
    """cupti-python record objects, as its callback hands them over (a launch: API, external, kernel)."""
    from cupti import cupti

    from tests.fake_cupti import KERNEL_RECORD, kernel_record

    out: list[object] = []
    for i in range(count // 3):
        api = cupti.ActivityAPI()
        api.kind, api.start, api.end, api.correlation_id, api.cbid, api.thread_id = 5, 10 * i, 10 * i + 3, i, 211, 77
        external = cupti.ActivityExternalCorrelation()
        external.kind, external.external_kind, external.external_id, external.correlation_id = 39, 3, 10 * i + 50, i
        out += [api, external, kernel_record(KERNEL_NAMES[i % len(KERNEL_NAMES)], 10 * i + 9, 10 * i + 20, i)]
    assert type(out[-1]) is KERNEL_RECORD
    return out


def time_python_path(count: int, rounds: int) -> float:
    from xsp.tracers.cuda.records import RecordStore

    objects = python_objects(count)
    costs = []
    for _ in range(rounds):
        store = RecordStore()
        began = time.perf_counter_ns()
        store.on_completed(objects)
        columns, _ = store.drain()
        costs.append((time.perf_counter_ns() - began) / len(objects))
        assert len(columns) == len(objects)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffers", type=int, default=8, help="buffers (of up to 8 MiB) per drain")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    from tests.native_cupti import NEWEST, FakeLibcupti, build
    from xsp.tracers.cuda.records import BUFFER_BYTES, NativeRecords

    with tempfile.TemporaryDirectory() as folder:
        library = FakeLibcupti(build(Path(folder)))
        native = NativeRecords.open(str(library.path))
        launches = 1
        while len(b"".join(step_records(NEWEST, library, launches * 2))) < BUFFER_BYTES:
            launches *= 2
        records = step_records(NEWEST, library, launches)
        data = b"".join(records)
        c_drain = time_c_path(library, native, data, len(records), args.buffers, args.rounds, rows=False)
        c_rows = time_c_path(library, native, data, len(records), args.buffers, args.rounds, rows=True)
        python = time_python_path(30_000, args.rounds)
        # a step-end flush hands back a buffer holding one step's records: 200 launches here
        step = b"".join(step_records(NEWEST, library, 200))
        zeroing = {(size, mode): time_zeroing(library, native, payload, len(payload), args.buffers, args.rounds, mode)
                   for size, payload in (("one step", step), ("full", data)) for mode in ("written", "whole")}
        native.close()
    lines = [
        "# CUPTI activity records: cost per record (no GPU)",
        "",
        f"CUPTI 13.4 records (kernel 13, memcpy 7, memset 5, sync 2), {len(records):,} a buffer of "
        f"{len(data) / 2**20:.1f} MiB, {args.buffers} buffers a drain, median of {args.rounds} rounds; handed over "
        "by the tests' fake libcupti on a thread of its own. `python benchmarks/cupti_records.py`.",
        "",
        "| path | ns per record | vs C drain |",
        "| --- | ---: | ---: |",
        f"| C drain (xsp.record._activity: buffers to numpy columns) | {c_drain:,.1f} | 1.0x |",
        f"| C drain + span rows (cuda_api and kernel levels) | {c_rows:,.1f} | {c_rows / c_drain:,.1f}x |",
        f"| Python path, xsp's part (bytes copied, numpy decode) | {python:,.1f} | {python / c_drain:,.1f}x |",
        "",
        "The Python path's figure leaves out cupti-python's own object per record (0.3-0.65 us in 13.4, "
        "17-400 us in 13.0), which the C path does not make.",
        "",
        "## Zeroing the buffers xsp tells CUPTI are zeroed",
        "",
        "CUPTI is told xsp's buffers come zeroed (so that it does not clear each one on the application's "
        "thread), so every byte it may have written must be zero again before a buffer goes back to it. "
        "`written` (the default): the pages holding the valid records are cleared and every page after them is "
        "given back to the kernel (madvise), to come back zero on the next write; `whole`: all 8 MiB cleared. "
        "Per buffer, median of the rounds: the delivery (CUPTI writing its records, page faults included) and "
        "the drain (reading and zeroing).",
        "",
        "| buffer holds | zeroing | CUPTI's writes, us | drain, us | together, us |",
        "| --- | --- | ---: | ---: | ---: |",
        *[f"| {size} ({len(step) if size == 'one step' else len(data):,} B) | {mode} | {deliver:,.1f} | {drain:,.1f} | "
          f"{deliver + drain:,.1f} |" for (size, mode), (deliver, drain) in zeroing.items()],
        "",
        f"ns per record: {c_drain:.1f}",
    ]
    record_results(lines, RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
