"""Faults at the destination and in the input: one line on stderr, a non-zero exit, nothing
truncated at the destination, every failure of ``xsp.load`` an ``XspError``."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import xsp
from xsp.cli.main import main
from xsp.core import schema as col
from xsp.core.errors import XspError
from xsp.io.outputs import atomic_output

SCRIPT = "import torch\nm = torch.nn.Linear(4, 4)\nfor _ in range(3):\n    m(torch.randn(2, 4))\nprint('done')\n"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "t.xsp.parquet"
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    with xsp.trace(output=path):
        for _ in range(4):
            model(torch.randn(2, 4))
    return path


def destinations(tmp_path: Path) -> dict[str, Path]:
    directory = tmp_path / "adir"
    directory.mkdir()
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    return {"a directory": directory, "below a file": blocker / "x.out"}


def leftovers(tmp_path: Path) -> list[str]:
    return [p.name for p in tmp_path.rglob("*") if p.name.endswith((".partial", ".probe"))]


@pytest.mark.parametrize("command", ["export", "report --html", "import", "run"])
@pytest.mark.parametrize("case", ["a directory", "below a file"])
def test_every_output_fault_is_one_line_and_a_nonzero_exit(command, case, trace_file, shared_traces, tmp_path,
                                                         capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = str(destinations(tmp_path)[case])
    if command == "export":
        argv = ["export", str(trace_file), "-o", target]
    elif command == "report --html":
        argv = ["report", str(trace_file), "--html", target]
    elif command == "import":
        argv = ["import", str(shared_traces / "kineto" / "a100_alexnet.json.gz"), "-o", target]
    else:
        script = tmp_path / "s.py"
        script.write_text(SCRIPT)
        argv = ["run", "-o", target, "--", str(script)]
    status = main(argv)
    said = capsys.readouterr()
    err = said.err
    assert status != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("xsp: error: cannot write"), err
    if case == "below a file":
        assert lines[-1].endswith(f"{tmp_path / 'afile'} is a file, not a directory"), err
    assert "Traceback" not in err
    assert leftovers(tmp_path) == []
    if command != "run":  # said before any work: no report rendered, then refused
        assert said.out == "", said.out[:500]


def test_a_write_that_fails_midway_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "report.html"
    target.write_text("the old report")
    with pytest.raises(RuntimeError), atomic_output(target) as temporary:
        temporary.write_text("half of the new one")
        raise RuntimeError("disk full")
    assert target.read_text() == "the old report"
    assert leftovers(tmp_path) == []


def test_full_disk_is_one_line(trace_file, tmp_path):
    """A file-size limit makes the write fail midway, as a full disk does."""
    target = tmp_path / "out.json"
    target.write_text("old")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096));"
            "from xsp.cli.main import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "export", str(trace_file), "-o", str(target)],
                            capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: __import__("signal").signal(__import__("signal").SIGXFSZ,
                                                                           __import__("signal").SIG_IGN))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith("xsp: error: cannot write"), result.stderr
    assert "Traceback" not in result.stderr
    assert target.read_text() == "old"
    assert leftovers(tmp_path) == []


def test_writing_over_the_input_is_refused(trace_file, tmp_path, capsys):
    copy = tmp_path / "t.xsp.parquet"
    copy.write_bytes(trace_file.read_bytes())
    for argv in (["export", str(copy), "-o", str(copy)], ["report", str(copy), "--html", str(copy)]):
        assert main(argv) == 2
        assert "is the input file" in capsys.readouterr().err
    assert xsp.load(copy).spans.shape == xsp.load(trace_file).spans.shape


def test_a_device_destination_is_written_in_place_not_replaced(trace_file, tmp_path):
    assert main(["export", str(trace_file), "-o", os.devnull]) == 0
    assert Path(os.devnull).is_char_device()


def _full_device(tmp_path: Path) -> Path:
    """A character device that fails every write (a copy of /dev/full), or skip where none can be made."""
    device = tmp_path / "full"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except (OSError, AttributeError) as exc:
        pytest.skip(f"cannot make a device node here ({exc}): needs root on Linux")
    return device


@pytest.mark.parametrize("command", ["summary", "export", "report --html", "diff -o", "run -o"])
def test_a_device_that_fails_the_write_is_never_removed(command, trace_file, tmp_path, capsys, monkeypatch):
    """Only a regular file xsp wrote may be removed or replaced: pyarrow removes the path it was
    given when a write fails, so a device must never be handed to it."""
    device = _full_device(tmp_path)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    argv = {"summary": ["summary", str(trace_file), "-o", str(device)],
            "export": ["export", str(trace_file), "-o", str(device)],
            "report --html": ["report", str(trace_file), "--html", str(device)],
            "diff -o": ["diff", str(trace_file), str(trace_file), "--fail-on", "never", "-o", str(device)],
            "run -o": ["run", "-o", str(device), "--", str(script)]}[command]
    status = main(argv)
    err = capsys.readouterr().err
    # xsp run's exit status is the script's own; it says the file was not written
    assert (status == 0 and "the trace file was not written" in err) if command == "run -o" else status != 0, err
    assert "cannot write" in err and "Traceback" not in err, err
    assert device.is_char_device(), f"{command} removed the device it could not write"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to make stdout fail")
def test_stdout_that_cannot_be_written_is_one_line(trace_file):
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "xsp", "report", str(trace_file)], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("xsp: error:"), result.stderr
    assert "Traceback" not in result.stderr


def _with_metadata(path: Path, target: Path, metadata: bytes) -> Path:
    table = pq.read_table(path)
    table = table.replace_schema_metadata({col.METADATA_KEY: metadata})
    pq.write_table(table, target)
    return target


@pytest.mark.parametrize("metadata", [b"[1, 2]", b"5", b'"text"', b"null", b'{"schema_version": true}'])
def test_xsp_metadata_that_is_not_an_object_is_a_format_error(metadata, trace_file, tmp_path, capsys):
    bad = _with_metadata(trace_file, tmp_path / "bad.xsp.parquet", metadata)
    with pytest.raises(xsp.TraceFormatError):
        xsp.load(bad)
    assert main(["report", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("xsp: error:")


def test_every_load_failure_is_an_xsp_error(trace_file, tmp_path):
    directory = tmp_path / "d.xsp.parquet"
    directory.mkdir()
    empty = tmp_path / "e.xsp.parquet"
    empty.write_bytes(b"")
    half = tmp_path / "h.xsp.parquet"
    half.write_bytes(trace_file.read_bytes()[: trace_file.stat().st_size // 2])
    typed = tmp_path / "typed.xsp.parquet"
    table = pq.read_table(trace_file)
    table = table.set_column(table.column_names.index(col.START_NS), col.START_NS,
                             pa.array([str(v) for v in table[col.START_NS].to_pylist()]))
    pq.write_table(table, typed)
    for path in (tmp_path / "missing.xsp.parquet", directory, empty, half, typed,
                 tmp_path / "missing.json.gz", directory.with_suffix(".json")):
        if path.suffix == ".json":
            path.mkdir()
        with pytest.raises(XspError):
            xsp.load(path)
    with pytest.raises(FileNotFoundError):  # still what callers catching the built-in expect
        xsp.load(tmp_path / "missing.xsp.parquet")


def test_single_byte_flips_never_load_as_changed_data(trace_file, tmp_path):
    """Page checksums cover the data; a checksum of xsp's own footer entries covers the rest
    that xsp reads; the pandas metadata is not trusted."""
    data = trace_file.read_bytes()
    original = xsp.load(trace_file).spans
    footer_length = int.from_bytes(data[-8:-4], "little")
    data_end = len(data) - 8 - footer_length
    rng = random.Random(7)
    offsets = rng.sample(range(4, data_end), 60) + rng.sample(range(data_end, len(data) - 8), 60)
    outcomes = {"same": 0, "refused": 0}
    for offset in offsets:
        for flip in (0xFF, 0x01):
            damaged = bytearray(data)
            damaged[offset] ^= flip
            path = tmp_path / "flipped.xsp.parquet"
            path.write_bytes(bytes(damaged))
            try:
                loaded = xsp.load(path).spans
            except XspError:
                outcomes["refused"] += 1
                continue
            pd.testing.assert_frame_equal(loaded, original)  # loaded: then exactly what was written
            outcomes["same"] += 1
    assert outcomes["refused"] > 60


def _kineto(tmp_path: Path, events: list[dict[str, object]]) -> Path:
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_impossible_kineto_times_are_dropped_and_counted(tmp_path, capsys):
    good = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100.0, "dur": 5.0}
    events = [good, {**good, "ts": 1e300}, {**good, "dur": -5}, {**good, "ts": 200.0, "dur": 1e300},
              {**good, "ts": -1e300}, {**good, "ts": 300.0}]
    path = _kineto(tmp_path, events)
    with pytest.warns(xsp.XspWarning, match="4 Kineto events with impossible times"):
        trace = xsp.load(path)
    assert sorted(trace.spans[col.START_NS].tolist()) == [100_000, 300_000]
    assert trace.metadata["not_imported"]["impossible_times"] == 4
    assert main(["import", str(path), "-o", str(tmp_path / "k.xsp.parquet")]) == 0
    assert "4 Kineto events with impossible times" in capsys.readouterr().err


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_a_gzip_bomb_is_refused_without_taking_the_memory(tmp_path):
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as out:
        out.write(b'{"traceEvents": [')
        for _ in range(600):
            out.write(b" " * (1 << 20))
    assert bomb.stat().st_size < 2 << 20
    code = ("import re, sys, xsp\n"
            "try:\n    xsp.load(sys.argv[1])\nexcept xsp.TraceFormatError as e:\n    print(e)\n"
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")
    result = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, timeout=300)
    message, peak_kib = result.stdout.strip().splitlines()
    assert "inflates to more than" in message
    assert int(peak_kib) < 1_000_000  # the inflated 600 MiB never all in memory (import alone: ~120 MB)



@pytest.mark.parametrize("command", ["run", "export", "report --html"])
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_symbolic_link_is_never_written_through(command, dangling, trace_file, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "notes.txt"
    if not dangling:
        target.write_text("my notes")
    link = tmp_path / "out.link"
    link.symlink_to(target)
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    argv = {"run": ["run", "-o", str(link), "--", str(script)],
            "export": ["export", str(trace_file), "-o", str(link)],
            "report --html": ["report", str(trace_file), "--html", str(link)]}[command]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 2
    assert "is a symbolic link" in captured.err and "Traceback" not in captured.err
    assert "done" not in captured.out  # refused before the script ran
    assert link.is_symlink()
    assert target.read_text() == "my notes" if not dangling else not target.exists()
    assert leftovers(tmp_path) == []


def test_the_python_api_never_writes_through_a_link_either(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("my notes")
    link = tmp_path / "run.xsp.parquet"
    link.symlink_to(target)
    with pytest.warns(xsp.XspWarning, match="symbolic link"), xsp.trace(output=link) as session:
        torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert session.trace is not None and len(session.trace.spans)  # kept in memory
    assert target.read_text() == "my notes" and link.is_symlink()


def test_a_link_to_a_pipe_such_as_dev_stdout_is_still_written(trace_file, tmp_path):
    done = subprocess.run([sys.executable, "-m", "xsp", "export", str(trace_file), "--format", "chrome", "-o",
                           "/dev/stdout"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traceEvents"]


def test_xsp_run_into_dev_null_keeps_the_scripts_exit_status(tmp_path):
    """The closing line read the trace back to count it: /dev/null said 'xsp: error: /dev/null', exit 2,
    after the script had run and exited 0."""
    script = tmp_path / "tiny.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\nprint('ran')\n")
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "/dev/null", "--", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("xsp: trace written -> /dev/null (not a file it can be read back "
                                                    "from, so its spans are not counted here)")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_run_into_a_device_keeps_its_windows_in_the_spool_not_in_dev(tmp_path):
    """-o /dev/full: the windows the file could not take were kept in /dev/.full.xsp-segments.PID."""
    script = tmp_path / "tiny.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\n")
    before = set(Path("/dev").glob(".full.xsp-segments.*"))
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "/dev/full", "--", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "XSP_SPOOL_DIR": str(tmp_path / "spool")})
    assert done.returncode == 0, done.stderr
    assert set(Path("/dev").glob(".full.xsp-segments.*")) == before
    kept = list((tmp_path / "spool").rglob("*full.xsp-segments.*"))
    assert len(kept) == 1 and f"kept in {kept[0]} (" in done.stderr, done.stderr


def test_a_huge_file_that_is_not_json_is_refused_from_its_first_bytes(tmp_path):
    zeros = tmp_path / "zeros.json"
    with zeros.open("wb") as handle:
        handle.truncate(4 << 30)  # 4 GiB of zeros, sparse: nothing on disk
    measured = ("import resource, subprocess, sys; "
                "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); print(done.returncode); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
                "print(done.stderr, end='')")
    done = subprocess.run([sys.executable, "-c", measured, sys.executable, "-m", "xsp", "import", str(zeros), "-o",
                           str(tmp_path / "o.xsp.parquet")], capture_output=True, text=True, timeout=300)
    status, peak_kib, stderr = done.stdout.split("\n", 2)
    assert int(status) == 2
    assert "is not valid Kineto JSON: a trace begins with '{'" in stderr and "Traceback" not in stderr
    assert int(peak_kib) < 2 << 20  # far from the 4 GiB it would take to read it whole


@pytest.mark.heavy
def test_json_nested_too_deeply_is_one_line(tmp_path):
    depth = 100_000
    nested = '{"a": ' * depth + "1" + "}" * depth

    def event(name: str, args: str) -> str:
        return (f'{{"ph": "X", "cat": "cpu_op", "name": "{name}", "pid": 1, "tid": 1, "ts": 0, "dur": 1, '
                f'"args": {args}}}')

    deep = tmp_path / "deep.json"  # a value nested that deep outside an event's arguments: refused
    deep.write_text(f'{{"deviceProperties": [{nested}], "traceEvents": [{event("a", "{}")}]}}')
    deep_args = tmp_path / "deep_args.json"  # an event's arguments: dropped, the event and the rest read
    deep_args.write_text(f'{{"traceEvents": [{event("a", nested)}, {event("b", "{}")}]}}')
    for command in ("import", "summary", "report"):
        argv = [command, str(deep)] + (["-o", str(tmp_path / f"o{command}")] if command != "report" else [])
        done = subprocess.run([sys.executable, "-m", "xsp", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "nested too deeply" in done.stderr, done.stderr
        argv[1] = str(deep_args)
        done = subprocess.run([sys.executable, "-m", "xsp", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "1 Kineto events' arguments nested more than 512 levels were left out" in done.stderr, done.stderr


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_kineto_events_without_times_are_counted_and_every_command_says_so(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5}
              for i in range(48)]
    for i in range(7):
        del events[5 * i]["dur" if i % 2 else "ts"]
    path = _kineto(tmp_path, events)
    with pytest.warns(xsp.XspWarning, match="7 Kineto events without a start time or a duration were left out"):
        trace = xsp.load(path)
    assert len(trace.spans) == 41 and trace.metadata["dropped"] == {
        "Kineto events without a start time or a duration": 7}
    for argv in (["report", str(path)], ["summary", str(path), "-o", str(tmp_path / "s.xsp-summary.parquet")],
                 ["export", str(path), "-o", str(tmp_path / "e.json")], ["recommend", str(path)],
                 # a trace without steps judges no key: --fail-on never, or the diff exits 2 for that
                 ["diff", str(path), str(path), "--fail-on", "never"],
                 ["import", str(path), "-o", str(tmp_path / "i.xsp.parquet")]):
        done = subprocess.run([sys.executable, "-m", "xsp", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (argv, done.stderr)
        assert "warning: " in done.stderr and "7 Kineto events without a start time" in done.stderr, argv


def test_spans_whose_parent_is_not_in_the_file_are_read_as_roots_and_said(trace_file, tmp_path):
    from xsp.io.parquet import write_trace

    trace = xsp.load(trace_file)
    spans = trace.spans.copy()
    layers = spans.index[spans[col.LEVEL] == "layer"][:3]
    spans.loc[layers, col.PARENT_ID] = 123456789
    forged = tmp_path / "orphans.xsp.parquet"
    write_trace(forged, spans, trace.metadata)
    with pytest.warns(xsp.XspWarning, match="3 spans name a parent that is not in the file"):
        assert len(xsp.load(forged).spans) == len(spans)
    done = subprocess.run([sys.executable, "-m", "xsp", "report", str(forged)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "3 spans name a parent that is not in the file" in done.stderr, done.stderr
    shares = [float(text[:-1]) for text in re.findall(r"\s(\d[\d,.]*)%", done.stdout.replace(",", ""))]
    assert shares and max(shares) <= 100.0


@pytest.mark.parametrize("damage, said", [
    ("negative", "end before they start"),
    ("far", "have times before 1970 or after 2116"),
    ("duration", "have a duration that is not their end minus their start"),
    ("duplicate", "share their span id with another"),
    ("self", "are their own parent"),
    ("cycle", "are their own ancestor"),
    ("outside", "run outside their parent on their thread"),
])
def test_a_trace_with_impossible_spans_is_refused_and_says_what_is_wrong(damage, said, trace_file, tmp_path):
    from xsp.io.parquet import write_trace

    trace = xsp.load(trace_file)
    spans = trace.spans.copy()
    if damage == "negative":
        spans.loc[1, col.END_NS] = spans.loc[1, col.START_NS] - 1_000
        spans.loc[1, col.DURATION_NS] = -1_000
    elif damage == "far":
        spans.loc[1, col.END_NS] = 2**63 - 1
        spans.loc[1, col.DURATION_NS] = spans.loc[1, col.END_NS] - spans.loc[1, col.START_NS]
    elif damage == "duration":
        spans.loc[1, col.DURATION_NS] = 7
    elif damage == "duplicate":
        spans.loc[2, col.SPAN_ID] = spans.loc[1, col.SPAN_ID]
    elif damage == "self":
        spans.loc[1, col.PARENT_ID] = spans.loc[1, col.SPAN_ID]
    elif damage == "outside":  # a layer of 50 ms inside its parent of well under 1 ms
        layer = spans.index[spans[col.LEVEL] == "layer"][3]
        spans.loc[layer, col.END_NS] = spans.loc[layer, col.START_NS] + 50_000_000
        spans.loc[layer, col.DURATION_NS] = 50_000_000
    else:  # two spans each the other's parent
        spans.loc[1, col.PARENT_ID] = spans.loc[2, col.SPAN_ID]
        spans.loc[2, col.PARENT_ID] = spans.loc[1, col.SPAN_ID]
    forged = tmp_path / "forged.xsp.parquet"
    write_trace(forged, spans, trace.metadata)
    with pytest.raises(xsp.TraceFormatError, match=said):
        xsp.load(forged)
    done = subprocess.run([sys.executable, "-m", "xsp", "report", str(forged)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
