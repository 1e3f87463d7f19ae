"""Nsight Systems exports of every release xsp reads, 2021.1 to 2025.4: each layout of the tables
xsp reads, built here column for column as that release writes them, imports to the same span
tree. The layouts of 2022.4, 2023.4 and 2024.2 were read off exports those releases made (their
`nsys export --type sqlite --lazy=false`); 2021.5 is NVIDIA's documentation of schema 2.7.1; the
2021.1-2021.3 GPU table and the 3.16 / 3.22 NVTX column come from exports others published."""

from __future__ import annotations

import pandas as pd
import pytest

import xsp
from tests.unit.test_nsys_import import EPOCH_NS, SCHEMA, TID, by_name, make_export
from xsp.core import schema as col

NVTX_3_0 = ("start INT NOT NULL, end INT, eventType INT NOT NULL, rangeId INT, category INT, color INT, text TEXT, "
            "globalTid INT, endGlobalTid INT, textId INT, domainId INT, uint64Value INT, int64Value INT, "
            "doubleValue REAL, uint32Value INT, int32Value INT, floatValue REAL, jsonTextId INT, jsonText TEXT")
RUNTIME = ("start INT NOT NULL, end INT NOT NULL, eventClass INT NOT NULL, globalTid INT, correlationId INT, "
           "nameId INT NOT NULL, returnValue INT NOT NULL, callchainId INT")


def _device(green: bool) -> str:
    """The columns every GPU table starts with (3.7 put ``greenContextId`` after the context's)."""
    return ("start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL, contextId INT NOT NULL, "
            + ("greenContextId INT, " if green else "") + "streamId INT NOT NULL, correlationId INT, globalPid INT")


def _layout(green: bool = False, nvtx_binary: bool = False, metadata: str | None = "EXPORT_META_DATA",
            gpu: str = "TARGET_INFO_GPU") -> dict[str, str]:
    """The tables xsp reads (and the metadata tables), with every column of a release."""
    tables = {
        "StringIds": "id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL",
        "ThreadNames": "nameId INT NOT NULL, priority INT, globalTid INT",
        "TARGET_INFO_SESSION_START_TIME": "utcEpochNs INT, utcTime TEXT, localTime TEXT",
        "NVTX_EVENTS": NVTX_3_0 + (", binaryData TEXT" if nvtx_binary else ""),
        "CUPTI_ACTIVITY_KIND_RUNTIME": RUNTIME,
        "CUPTI_ACTIVITY_KIND_KERNEL": _device(green) + ", demangledName INT NOT NULL, shortName INT NOT NULL, "
        "mangledName INT, launchType INT, cacheConfig INT, registersPerThread INT NOT NULL, gridX INT NOT NULL, "
        "gridY INT NOT NULL, gridZ INT NOT NULL, blockX INT NOT NULL, blockY INT NOT NULL, blockZ INT NOT NULL, "
        "staticSharedMemory INT NOT NULL, dynamicSharedMemory INT NOT NULL, localMemoryPerThread INT, "
        "localMemoryTotal INT, gridId INT, sharedMemoryExecuted INT, graphNodeId INT, sharedMemoryLimitConfig INT",
        "CUPTI_ACTIVITY_KIND_MEMCPY": _device(green) + ", bytes INT NOT NULL, copyKind INT NOT NULL, "
        "deprecatedSrcId INT, srcKind INT, dstKind INT, srcDeviceId INT, srcContextId INT, dstDeviceId INT, "
        "dstContextId INT, migrationCause INT, graphNodeId INT, virtualAddress INT",
        "CUPTI_ACTIVITY_KIND_MEMSET": _device(green) + ", value INT NOT NULL, bytes INT NOT NULL, graphNodeId INT, "
        "memKind INT",
        "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": _device(green) + ", syncType INT NOT NULL, eventId INT NOT NULL",
        "CUDA_CALLCHAINS": "id INT NOT NULL, symbol INT NOT NULL, module INT NOT NULL, unresolved INT, "
                           "originalIP INT, stackDepth INT NOT NULL",
        "TARGET_INFO_SYSTEM_ENV": SCHEMA["TARGET_INFO_SYSTEM_ENV"],
    }
    if gpu == "TARGET_INFO_CUDA_GPU":
        tables[gpu] = "deviceId INT NOT NULL, name TEXT, busLocation TEXT, totalMemory INT, smCount INT"
    else:
        tables[gpu] = ("vmId INT NOT NULL DEFAULT 0, id INT NOT NULL, name TEXT, busLocation TEXT, isDiscrete INT, "
                       "l2CacheSize INT, totalMemory INT, memoryBandwidth INT, clockRate INT, smCount INT, "
                       "pwGpuId INT, uuid TEXT, luid INT, chipName TEXT, cuDevice INT, computeMajor INT, "
                       "computeMinor INT")
    if metadata is not None:
        tables[metadata] = "name TEXT NOT NULL, value TEXT"
    if metadata == "META_DATA_EXPORT":
        tables["META_DATA_CAPTURE"] = "name TEXT NOT NULL, value TEXT"
    return tables


RELEASES = {
    # release: (schema version, layout, metadata table)
    "2021.2": (None, _layout(metadata=None, gpu="TARGET_INFO_CUDA_GPU"), None),
    "2021.5": ("2.7.1", _layout(), "EXPORT_META_DATA"),
    "2022.2": ("2.9.1", _layout(), "EXPORT_META_DATA"),
    "2022.4": ("3.0.0", _layout(), "EXPORT_META_DATA"),
    "2023.4": ("3.7.2", _layout(green=True, metadata="META_DATA_EXPORT"), "META_DATA_EXPORT"),
    "2024.2": ("3.11.1", _layout(green=True, metadata="META_DATA_EXPORT"), "META_DATA_EXPORT"),
    "2024.5": ("3.13.2", _layout(green=True, metadata="META_DATA_EXPORT"), "META_DATA_EXPORT"),
    "2025.4": ("3.22.1", _layout(green=True, nvtx_binary=True, metadata="META_DATA_EXPORT"), "META_DATA_EXPORT"),
}


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_release_xsp_reads_imports_to_the_same_tree(release, tmp_path):
    schema_version, layout, metadata_table = RELEASES[release]
    path = make_export(tmp_path / f"nsys-{release}.sqlite", schema_version=schema_version or "0.0.0", schema=layout,
                       metadata_table=metadata_table,
                       gpu_table="TARGET_INFO_CUDA_GPU" if "TARGET_INFO_CUDA_GPU" in layout else "TARGET_INFO_GPU",
                       product_version=f"{release}.1")
    if metadata_table == "META_DATA_EXPORT":  # the capture's settings: never read (the process's environment)
        import sqlite3

        with sqlite3.connect(path) as connection:
            connection.executemany("insert into META_DATA_CAPTURE values (?, ?)", [
                ("CAPTURE_EVENT_TYPE", "Cuda"), ("CAPTURE_EVENT_TYPE", "NvtxEvents"),
                ("PROCESS_0:ENVIRONMENT_VARIABLE", "API_TOKEN=secret")])
    trace = xsp.load(path)
    rows = by_name(trace)
    ids = dict(zip(trace.spans[col.NAME], trace.spans[col.SPAN_ID]))
    assert len(trace.spans) == 10
    assert rows["forward"][col.PARENT_ID] == ids["step"]
    assert rows["cudaLaunchKernel"][col.START_NS] == EPOCH_NS + 1_200
    kernel = rows["void gemm<float>(float*, int)"]
    assert kernel[col.PARENT_ID] == ids["cudaLaunchKernel"] and kernel[col.GRID] == "[128,1,1]"
    assert rows["Memcpy HtoD (Pinned -> Device)"][col.BYTES] == 4096
    assert rows["step"][col.THREAD_ID] == TID and trace.metadata["device"] == "NVIDIA H100 80GB HBM3"
    facts = trace.metadata["nsys"]
    assert facts["schema_version"] == schema_version
    assert facts["product_version"] == (None if metadata_table is None else f"{release}.1")
    assert "secret" not in repr(trace.metadata)
    assert pd.notna(kernel[col.DEVICE_ID])


def test_a_schema_version_written_only_in_parts_is_put_together(tmp_path):
    """An export may give its schema version only as ``EXPORT_SCHEMA_VERSION_MAJOR``, ``_MINOR``
    and ``_MICRO``: the trace still says which it was."""
    import sqlite3

    _, layout, metadata_table = RELEASES["2024.5"]
    path = make_export(tmp_path / "parts.sqlite", schema_version="3.13.2", schema=layout, metadata_table=metadata_table,
                       gpu_table="TARGET_INFO_GPU", product_version="2024.5.1")
    with sqlite3.connect(path) as connection:
        connection.execute(f"delete from {metadata_table} where name = 'EXPORT_SCHEMA_VERSION'")
    assert xsp.load(path).metadata["nsys"]["schema_version"] == "3.13.2"


def test_an_sqlite_file_of_another_program_is_still_refused(tmp_path):
    import sqlite3

    path = tmp_path / "app.sqlite"
    with sqlite3.connect(path) as connection:
        connection.execute("create table StringIds (id INT, value TEXT)")  # a table of the same name, alone
    with pytest.raises(xsp.TraceFormatError, match="no META_DATA_EXPORT or EXPORT_META_DATA table"):
        xsp.load(path)
