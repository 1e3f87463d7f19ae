"""xsp's C record path (xsp.record._activity) without a GPU: CUPTI buffers built byte for byte from
cupti-python's numpy layouts of every record version, handed over by a fake libcupti on threads
of its own, read into columns that must equal the Python path's decode field for field."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("cupti", reason="cupti-python is not installed (Linux x86_64/aarch64 only)")

from xsp.tracers.cuda import records as _cupti_records  # noqa: E402
from xsp.tracers.cuda.records import (  # noqa: E402
    BUFFER_BYTES,
    FIELDS,
    MAX_BUFFERS,
    Family,
    Lost,
    NativeRecords,
    RawLayout,
    columns_from_tuples,
    decode,
)

from ..native_cupti import KINDS, NEWEST, RELEASES, SOURCE, FakeLibcupti, Release, assert_same_columns, record  # noqa: E402

_PYTHON_FAMILY = {"api": "API", "kernel": "Kernel", "memcpy": "Memcpy", "memset": "Memset", "sync": "Synchronization",
                  "external": "ExternalCorrelation", "memcpy_peer": "MemcpyPtoP"}
_FORMATS = {"u1": "B", "u2": "H", "i4": "i", "u4": "I", "u8": "Q"}


@pytest.fixture
def native(fake_libcupti: FakeLibcupti) -> NativeRecords:
    """The C path bound to the fake libcupti (as the newest release), nothing left queued."""
    fake_libcupti.release(NEWEST)
    records = NativeRecords.open(str(fake_libcupti.path))
    records.drain()
    return records


def _mixed(release: Release, library: FakeLibcupti, count: int = 50) -> list[tuple[str, bytes]]:
    """``(family, bytes)`` of records of every family as ``release`` writes them, with values at
    the edges of their types (top bits set, negative geometry, no stream)."""
    out = []
    top = 1 << 63
    for i in range(count):
        start = top + 1_000 * i
        out.append(("api", record(release.dtype("api"), kind=5 if i % 3 else 4, cbid=211 + i % 5, start=start,
                                  end=start + 900, process_id=4_000_000_000, thread_id=3_000_000_000 + i,
                                  correlation_id=i, return_value=0 if i % 7 else 700)))
        out.append(("external", record(release.dtype("external"), kind=39, external_kind=3 if i % 4 else 2,
                                       external_id=(1 << 64) - 1 - i, correlation_id=i)))
        out.append(("kernel", record(release.dtype("kernel"), kind=10 if i % 2 else 3, start=start + 2_000,
                                     end=start + 9_000, correlation_id=i,
                                     name=library.name_pointer(f"_Z6kernel{i % 4}Pfi" if i % 5 else "volta_sgemm"),
                                     grid_x=-1 - i, grid_y=2, grid_z=1, block_x=256, block_y=1, block_z=-3,
                                     registers_per_thread=65535 - i, static_shared_memory=-1,
                                     dynamic_shared_memory=49152, stream_id=0xFFFFFFFF, device_id=7,
                                     graph_id=0xFFFFFFFE)))
        if i % 5 == 0:
            out.append(("memcpy", record(release.dtype("memcpy"), kind=1, copy_kind=255 - i % 3, bytes=(1 << 64) - 1,
                                         start=start, end=start + 5, device_id=1, stream_id=13, correlation_id=i)))
            out.append(("memset", record(release.dtype("memset"), kind=2, value=0xFFFFFFFF, bytes=4096, start=start,
                                         end=start + 7, device_id=1, stream_id=13, correlation_id=i)))
            out.append(("sync", record(release.dtype("sync"), kind=38, type=-2 if i % 2 else 3, start=start,
                                       end=start + 11, correlation_id=i, stream_id=0xFFFFFFFF, cuda_event_id=i)))
            out.append(("memcpy_peer", record(release.dtype("memcpy_peer"), kind=22, copy_kind=10, src_kind=2,
                                              dst_kind=2, flags_=1, bytes=(1 << 40) + i, start=start, end=start + 13,
                                              device_id=1, context_id=5, stream_id=14, src_device_id=1,
                                              src_context_id=5, dst_device_id=0xFFFFFFFF - i, dst_context_id=6,
                                              correlation_id=i, graph_id=3)))
    return out


def _python_decode(release: Release, records: list[tuple[str, bytes]]) -> _cupti_records.ActivityColumns:
    """What the Python path makes of the same bytes (its numpy-layout decode, names read from the
    pointers as its callback reads them)."""
    tuples = []
    for family, data in records:
        dtype = release.dtype(family)
        fields = _cupti_records._RAW_FIELDS[_PYTHON_FAMILY[family]]
        name_offset = int(dtype.fields["name"][1]) if family == "kernel" else None
        names = []
        if name_offset is not None:
            pointer = int.from_bytes(data[name_offset:name_offset + 8], "little")
            names = [ctypes.string_at(pointer).decode()]
        tuples += decode(RawLayout(dtype, fields, name_offset), [data], names)
    return columns_from_tuples(tuples)


# the layout ---------------------------------------------------------------------------------
def test_cs_offsets_are_cupti_pythons_in_every_record_version():
    from cupti import cupti

    from ..native_cupti import activity_module

    layouts = activity_module().layouts()
    versions = {"api": [""], "external": [""], "kernel": ["9", "10", "11", "12", "13"], "memcpy": ["5", "6", "7"],
                "memset": ["4", "5"], "sync": ["", "2"], "memcpy_peer": ["4"]}
    prefixes = {"api": "activity_api", "external": "activity_external_correlation", "kernel": "activity_kernel",
                "memcpy": "activity_memcpy", "memset": "activity_memset", "sync": "activity_synchronization",
                "memcpy_peer": "activity_memcpy_pto_p"}
    for family, fields in layouts.items():
        assert list(fields) == list(FIELDS[Family(family)]), family  # C's columns are the Python path's
        for version in versions[family]:
            dtype = getattr(cupti, f"{prefixes[family]}{version}_dtype")
            for name, (offset, format_, size) in fields.items():
                if name not in dtype.fields:  # a field only the newer versions have: C reads 0 from the others
                    assert name == "source_graph_node_id" and dtype.itemsize <= offset, (family, version, name)
                    continue
                field_dtype, field_offset = dtype.fields[name][:2]
                assert (field_offset, field_dtype.itemsize) == (offset, size), (family, version, name)
                if name != "name":  # the name is a pointer in the record, an id in the column
                    assert _FORMATS[FIELDS[Family(family)][name]] == format_, (family, name)


def test_the_record_sizes_c_knows_are_those_each_release_writes():
    from ..native_cupti import activity_module

    known = {entry["release"]: entry for entry in activity_module().known_releases()}
    for release in RELEASES:
        entry = known[release.name]
        assert entry["first_version"] <= release.version <= entry["last_version"]
        assert entry["sizes"] == {family: release.dtype(family).itemsize
                                  for family in ("kernel", "memcpy", "memset", "sync")}, release.name


# records -> columns -------------------------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES, ids=[release.name for release in RELEASES])
def test_cs_columns_equal_the_python_decode_field_for_field(release, native, fake_libcupti):
    fake_libcupti.release(release)
    native = NativeRecords.open(str(fake_libcupti.path))
    assert native.bound["release"] == release.name and native.bound["version"] == release.version
    records = _mixed(release, fake_libcupti)
    before = native.totals.copy()
    fake_libcupti.deliver(b"".join(data for _, data in records))
    columns, lost = native.drain()
    assert not lost
    assert_same_columns(columns, _python_decode(release, records))
    assert len(columns) == len(records)
    read = native.totals - before
    assert read["records"] == len(records) and read["buffers"] == 1
    assert read["other_kinds"] == 0 and read["size_mismatch"] == 0


def test_records_of_other_kinds_are_skipped_and_counted(native, fake_libcupti):
    fake_libcupti.lib.fake_set_record_size(17, 40)  # OVERHEAD, which xsp does not read
    records = _mixed(NEWEST, fake_libcupti, count=4)
    overhead = record(np.dtype([("kind", "<u4"), ("rest", "V36")]), kind=17)
    before = native.totals.copy()
    fake_libcupti.deliver(overhead + b"".join(data for _, data in records) + overhead)
    columns, lost = native.drain()
    assert not lost
    assert_same_columns(columns, _python_decode(NEWEST, records))
    assert (native.totals - before)["other_kinds"] == 2


def test_a_buffer_cut_short_keeps_its_whole_records_and_counts_the_cut(native, fake_libcupti):
    records = _mixed(NEWEST, fake_libcupti, count=3)
    data = b"".join(item for _, item in records)
    fake_libcupti.deliver(data, valid=len(data) - 100)  # the last record is incomplete
    columns, lost = native.drain()
    assert lost == {Lost.CUT_SHORT.value: 1}
    assert_same_columns(columns, _python_decode(NEWEST, records[:-1]))


def test_a_record_too_short_for_its_fields_is_counted_not_read(native, fake_libcupti):
    fake_libcupti.lib.fake_set_record_size(10, 120)  # a kernel record of 120 bytes: name and graph id lie beyond
    short_kernel = record(NEWEST.dtype("kernel"), kind=10, correlation_id=9)[:120]
    api = record(NEWEST.dtype("api"), kind=5, cbid=211, start=1, end=2, correlation_id=9)
    fake_libcupti.deliver(api + short_kernel + api)
    try:
        columns, lost = native.drain()
    finally:
        fake_libcupti.release(NEWEST)
    assert lost == {Lost.UNREADABLE.value: 1}
    assert columns.count(Family.API) == 2 and columns.count(Family.KERNEL) == 0


def test_records_cupti_dropped_and_refused_external_ids_are_counted(native, fake_libcupti):
    fake_libcupti.add_dropped(7)
    native.module.pop()  # nothing pushed: CUPTI refuses the pop
    fake_libcupti.deliver(record(NEWEST.dtype("api"), kind=5, cbid=211, start=1, end=2))
    _, lost = native.drain()
    assert lost == {Lost.BY_CUPTI.value: 7, Lost.CORRELATION.value: 1}


def test_a_buffer_xsp_did_not_hand_out_is_counted_and_left_alone(native, fake_libcupti):
    fake_libcupti.complete_foreign()
    columns, lost = native.drain()
    assert lost == {Lost.FOREIGN.value: 1} and len(columns) == 0


# buffers ------------------------------------------------------------------------------------
def test_buffers_are_pooled_handed_out_zeroed_and_cupti_is_told_so(native, fake_libcupti):
    assert fake_libcupti.zeroed_attribute() == 1 and native.zeroed_by_xsp
    records = _mixed(NEWEST, fake_libcupti, count=200)
    data = b"".join(item for _, item in records)
    dirty = fake_libcupti.dirty_buffers()
    for _ in range(5):  # each round reuses the buffers the drain before gave back
        fake_libcupti.deliver(data, threads=4, buffers=3)
        columns, lost = native.drain()
        assert not lost and len(columns) == 12 * len(records)
    stats = native.module.pool_stats()
    assert stats["buffer_bytes"] == BUFFER_BYTES and stats["allocated"] <= 12 and stats["queued"] == 0
    assert fake_libcupti.dirty_buffers() == dirty  # every buffer CUPTI got was zero
    native.close()
    assert native.module.pool_stats()["allocated"] == 0  # idle buffers freed


@pytest.mark.parametrize("zeroing", ["written", "whole"])
def test_bytes_cupti_wrote_past_the_valid_size_are_zeroed_too(native, fake_libcupti, zeroing):
    # xsp tells CUPTI its buffers come zeroed: whatever CUPTI wrote, valid or not (a record begun and
    # never completed, anywhere in the buffer), must be zero when the buffer is handed out again
    native.module.register(BUFFER_BYTES, MAX_BUFFERS, zeroing)
    try:
        mixed = _mixed(NEWEST, fake_libcupti, count=10)
        records = b"".join(item for _, item in mixed)
        scribbled = records + b"\xa5" * (BUFFER_BYTES - len(records))  # written to the last byte
        dirty = fake_libcupti.dirty_buffers()
        for _ in range(3):
            fake_libcupti.deliver(scribbled, valid=len(records), threads=2, buffers=2)
            columns, lost = native.drain()
            assert not lost and len(columns) == 4 * len(mixed)
        assert fake_libcupti.dirty_buffers() == dirty
    finally:
        native.module.register(BUFFER_BYTES, MAX_BUFFERS)
    with pytest.raises(ValueError, match="zeroing"):
        native.module.register(BUFFER_BYTES, MAX_BUFFERS, "some")


def test_requests_past_the_pool_are_refused_and_counted(native, fake_libcupti):
    data = record(NEWEST.dtype("api"), kind=5, cbid=211, start=1, end=2)
    refused = fake_libcupti.deliver(data, buffers=MAX_BUFFERS + 3)  # no drain meanwhile: none comes back
    columns, lost = native.drain()
    assert refused == 3 and lost == {Lost.BUFFERS_REFUSED.value: 3}
    assert columns.count(Family.API) == MAX_BUFFERS


def test_callbacks_on_cuptis_threads_and_drains_run_at_once_without_losing_a_record(native, fake_libcupti):
    records = _mixed(NEWEST, fake_libcupti, count=20)
    data = b"".join(item for _, item in records)
    drained: list[int] = []
    refused: list[int] = []
    done = threading.Event()

    def drain_until_done() -> None:
        while not done.is_set():
            columns, lost = native.drain()
            drained.append(len(columns))
            refused.append(lost.get(Lost.BUFFERS_REFUSED.value, 0))

    drainer = threading.Thread(target=drain_until_done)
    drainer.start()
    try:
        refused_by_fake = fake_libcupti.deliver(data, threads=8, buffers=40)
    finally:
        done.set()
        drainer.join()
    columns, lost = native.drain()
    drained.append(len(columns))
    refused.append(lost.get(Lost.BUFFERS_REFUSED.value, 0))
    assert sum(refused) == refused_by_fake
    assert sum(drained) == (8 * 40 - refused_by_fake) * len(records)
    assert native.module.pool_stats()["allocated"] <= MAX_BUFFERS


# binding ------------------------------------------------------------------------------------
def test_a_release_xsp_does_not_know_is_refused_with_its_version(native, fake_libcupti):
    fake_libcupti.lib.fake_set_version(131313)
    try:
        with pytest.raises(OSError, match="CUPTI API version 131313 is not one whose records xsp knows"):
            NativeRecords.open(str(fake_libcupti.path))
    finally:
        fake_libcupti.release(NEWEST)


def test_a_library_not_loaded_is_never_loaded(tmp_path):
    from ..native_cupti import activity_module

    with pytest.raises(OSError, match="is not loaded in this process"):
        activity_module().bind(str(tmp_path / "libcupti.so.13"))


def test_the_loaded_libcupti_is_found_by_its_name(fake_libcupti):
    script = ("import ctypes, sys, xsp.record._activity as a\n"
              "try:\n    a.bind()\nexcept OSError as e:\n    print('before:', e)\n"
              f"ctypes.CDLL({str(fake_libcupti.path)!r})\n"
              "print('after:', a.bind()['path'])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "before: no libcupti is loaded in this process" in result.stdout
    assert f"after: {fake_libcupti.path}" in result.stdout


def test_the_fake_libcupti_is_the_one_the_tests_build():
    assert SOURCE.is_file() and set(KINDS) == {family.value for family in Family}


def test_of_two_libcupti_loaded_the_one_of_cupti_pythons_release_is_bound(fake_libcupti, tmp_path):
    # a CUDA 12 PyTorch loads libcupti.so.12, a cupti-python 13 its libcupti.so.13: both in one process
    from ..native_cupti import build

    older = build(tmp_path)  # named libcupti.so.13 too: the release comes from the library, not the name
    script = ("import ctypes, xsp.record._activity as a\n"
              f"twelve = ctypes.CDLL({str(older)!r}); twelve.fake_set_version(28)\n"
              f"ctypes.CDLL({str(fake_libcupti.path)!r}).fake_set_version(130401)\n"
              "for major in (13, 12, 0):\n"
              "    try:\n        print(major, a.bind(None, major)['release'])\n"
              "    except OSError as e:\n        print(major, 'refused:', e)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["13 13.4", "12 12.9"]
    assert lines[2].startswith("0 refused: 2 libcupti libraries are loaded in this process")
