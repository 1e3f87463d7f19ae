"""The real ``xsp`` CLI in a subprocess, and ``main(argv)`` in process for bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

import xsp
from xsp.cli.main import main
from xsp.core import schema as col
from xsp.core.schema import Level

ROOT = Path(__file__).resolve().parents[2]
TINY_SCRIPT = """
import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
with torch.no_grad():
    for _ in range(int(sys.argv[1])):
        model(torch.randn(2, 4))
print("args", sys.argv[1:])
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def xsp_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "xsp", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def tiny(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SCRIPT)
    return script


def test_run_profiles_an_unmodified_script_with_its_arguments(tiny, tmp_path):
    result = xsp_cli("run", "-o", "out.xsp.parquet", "--", str(tiny), "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "args ['3']" in result.stdout
    trace = xsp.load(tmp_path / "out.xsp.parquet")
    assert len(trace.steps) == 3
    assert trace.metadata["service_name"] == "tiny"
    assert "Traceback" not in result.stderr


@pytest.mark.heavy
def test_run_gives_the_script_its_argv_and_file_as_python_does(tmp_path):
    """``sys.argv[0]`` as typed, ``__file__`` absolute, ``__name__`` "__main__", classes that
    pickle: what a plain ``python sub/show.py`` gives the script."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "show.py").write_text(
        "import pickle, sys, torch\nclass Box: pass\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\n"
        "print(sys.argv, __file__, __name__, len(pickle.dumps(Box())) > 0)\n")
    plain = subprocess.run([sys.executable, "sub/show.py", "--n", "3"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    traced = xsp_cli("run", "--", "sub/show.py", "--n", "3", cwd=tmp_path)
    assert traced.returncode == plain.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout
    assert plain.stdout.startswith("['sub/show.py', '--n', '3'] " + str(tmp_path / "sub" / "show.py"))


def test_default_outputs_beside_a_read_only_folder_go_to_the_current_folder(tmp_path, monkeypatch):
    """A shared folder of traces marked read-only is never written into, even by root."""
    shared, work = tmp_path / "shared", tmp_path / "work"
    shared.mkdir()
    work.mkdir()
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10 * i, "dur": 5}
              for i in range(4)]
    (shared / "t.json").write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    shared.chmod(0o555)
    monkeypatch.chdir(work)
    try:
        assert main(["import", str(shared / "t.json")]) == 0
        assert main(["summary", str(shared / "t.json")]) == 0
        assert sorted(p.name for p in shared.iterdir()) == ["t.json"]
        assert sorted(p.name for p in work.iterdir()) == ["t.xsp-summary.parquet", "t.xsp.parquet"]
    finally:
        shared.chmod(0o755)
    assert main(["summary", str(shared / "t.json")]) == 0  # a writable folder: beside the trace, as before
    assert (shared / "t.xsp-summary.parquet").is_file()


def test_run_keeps_the_scripts_exit_code_and_still_writes_the_trace(tiny, tmp_path):
    result = xsp_cli("run", "--", str(tiny), "1", "7", cwd=tmp_path)
    assert result.returncode == 7
    assert len(xsp.load(tmp_path / "run.xsp.parquet").steps) == 1


def test_run_shows_the_scripts_own_traceback_when_it_fails(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\nraise KeyError('missing')\n")
    result = xsp_cli("run", "--", str(script), cwd=tmp_path)
    assert result.returncode == 1
    assert "KeyError: 'missing'" in result.stderr and "fails.py" in result.stderr
    assert "runpy" not in result.stderr
    assert xsp.load(tmp_path / "run.xsp.parquet").spans[col.STATUS].eq("error").any()


def test_run_takes_a_folder_with_a_main_as_python_does(tmp_path):
    """`python app` runs app/__main__.py with app first on sys.path; xsp said 'no such script: app'."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "helper.py").write_text("WORD = 'found'\n")
    (tmp_path / "app" / "__main__.py").write_text(
        "import sys, torch\nfrom helper import WORD\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\n"
        "print(WORD, sys.argv[0], __file__.endswith('__main__.py'))\nsys.exit(3)\n")
    plain = subprocess.run([sys.executable, "app"], capture_output=True, text=True, cwd=tmp_path, check=False)
    result = xsp_cli("run", "--", "app", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (plain.returncode, plain.stdout) == (3, "found app True\n")
    assert len(xsp.load(tmp_path / "run.xsp.parquet").steps) == 1
    (tmp_path / "empty").mkdir()
    refused = xsp_cli("run", "--", "empty", cwd=tmp_path)
    assert refused.returncode == 2 and "empty is a folder with no __main__.py" in refused.stderr


def test_run_then_report_then_export_then_doctor(tiny, tmp_path):
    assert xsp_cli("run", "--report", "--", str(tiny), "2", cwd=tmp_path).returncode == 0
    report = xsp_cli("report", "run.xsp.parquet", "--top", "3", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    for title in ("Model latency over steps", "Latency per step", "Top 2 layers", "Time per layer type"):
        assert title in report.stdout
    exported = xsp_cli("export", "run.xsp.parquet", "--format", "chrome", "-o", "trace.json", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(xsp.load(tmp_path / "run.xsp.parquet").spans)
    assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(complete[0])
    doctor = xsp_cli("doctor", cwd=tmp_path)
    assert doctor.returncode == 0 and "model" in doctor.stdout and "available" in doctor.stdout


@pytest.mark.parametrize("argv, message", [
    (["run", "--levels", "model,lyer", "--", "x.py"], "unknown level 'lyer'"),
    (["run", "--", "does-not-exist.py"], "no such script: does-not-exist.py"),
    (["run"], "no script given"),
    (["report", "missing.xsp.parquet"], "no such trace file"),
    (["recommend", "missing.xsp.parquet"], "no such trace file"),
    (["export", "missing.xsp.parquet", "-o", "x.json"], "no such trace file"),
    # what argparse itself refuses (it printed its usage block first)
    (["capture", "abc"], "xsp capture: error: argument pid: invalid int value: 'abc' (see xsp capture --help)"),
    (["capture", "1", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["frob"], "xsp: error: argument COMMAND: invalid choice: 'frob'"),
    # an option the subcommand does not have: its help is where to look (it said `see xsp --help`)
    (["report", "a.xsp.parquet", "--bogus"], "xsp report: error: unrecognized arguments: --bogus (see xsp report "
                                             "--help)"),
    # torchrun's ranks are programs of their own: the trace held torchrun's one span, with a wrong hint
    (["run", "--", "torchrun", "--nproc_per_node", "2", "train.py"], "put xsp inside it: torchrun [its options] -m "
                                                                     "xsp run [options] -- SCRIPT [ARGS...]"),
    # `xsp run` keeps its script's words under the name argparse gives the subcommand: a traceback
    (["run", "-o", "a.xsp.parquet", "-q", "--", "x.py"], "xsp run: error: unrecognized arguments: -q (see xsp run "
                                                          "--help)"),
    # what is no trace, under a trace's name: it replaced a trace there (xsp report then failed on it)
    (["export", "a.xsp.parquet", "-o", "b.xsp.parquet"], "b.xsp.parquet names an xsp trace (.xsp.parquet), but this "
                                                         "writes a chrome file"),
    (["summary", "a.xsp.parquet", "-o", "b.xsp.parquet"], "but this writes a summary"),
    (["summary", "a.xsp.parquet", "-o", "b.json"], "give it a .xsp-summary.parquet name (b.xsp-summary.parquet)"),
    (["summary", "a.xsp.parquet", "-o", ""], "the output path is empty"),  # it wrote the default name
    (["report", "a.xsp.parquet", "--html", "b.xsp.parquet"], "but this writes an HTML report"),
    (["diff", "a.xsp.parquet", "c.xsp.parquet", "-o", "b.xsp.parquet"], "but this writes a text report"),
])
def test_bad_input_is_one_line_on_stderr_and_a_nonzero_exit(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("value", ["-5MB", "-5s"])
def test_a_negative_rotate_is_said_by_its_own_check(value, capsys, tmp_path, monkeypatch):
    """argparse took `-5MB` for an option: `argument --rotate: expected one argument`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print(1)\n")
    assert main(["run", "--dataset", "runs", "--rotate", value, "--", "x.py", "--rotate", "-1s"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"xsp: error: --rotate must be a time (30m, 1h, 2d) or a size (500MB, 2GB), or both (1h,500MB), "
                   f"not '{value}'")


def test_a_scripts_own_rotate_argument_is_left_as_it_is(tmp_path):
    (tmp_path / "args.py").write_text("import sys\nprint(sys.argv[1:])\n")
    done = xsp_cli("run", "-o", "a.xsp.parquet", "args.py", "--rotate", "-1s", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "['--rotate', '-1s']\n", done.stderr


@pytest.mark.parametrize("options, message", [
    (["--levels", ","], "no level named in ','"),
    (["--levels", ""], "no level named in ''"),
    (["--layer-depth", "100000000000000000000"], "--layer-depth must be at most 10,000"),
    (["--top", "-1", "--report"], "--top must be at least 1"),
    (["--warmup", "3"], "--warmup applies to leveled runs only"),
    (["--rounds", "2", "--target", "5", "--no-depth"], "--rounds, --target, --no-depth apply to leveled runs only"),
    (["--budget", "1"], "--budget applies to leveled runs only"),
    (["--no-compensate"], "--no-compensate applies to leveled runs only"),
    (["--otlp", ""], "--otlp is empty"),
    # said before the script runs: it ran, and its trace was then written nowhere, exit 0
    (["-o", ""], "the output path is empty"),
    (["--dataset", ""], "the --dataset folder is empty"),  # it wrote run.xsp.parquet where it ran
    (["--otlp", "  "], "--otlp is empty"),
    (["-o", "trace.json"], "-o trace.json names a .json file, but xsp writes a Parquet trace"),
    (["-o", "out/run.json.gz"], "give it a .xsp.parquet name (run.xsp.parquet)"),
    (["-o", "nsys.sqlite"], "names a .sqlite file"),
])
def test_every_run_option_is_checked_before_the_script_runs(options, message, capsys, tmp_path, monkeypatch):
    """An option that would change nothing, or make xsp fail later, is one line and exit 2: the
    script never runs."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "marks.py"
    script.write_text("open('ran', 'w').close()\n")
    assert main(["run", *options, "--", str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "ran").exists()


def test_leveled_options_keep_their_defaults_with_leveled(tmp_path, monkeypatch):
    from xsp.cli import run as run_command

    seen = {}
    monkeypatch.setattr(run_command, "_run_leveled", lambda options, *rest: seen.update(vars(options)) or 0)
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    assert main(["run", "--leveled", "-o", str(tmp_path / "l.xsp.parquet"), "--", str(script)]) == 0
    assert seen["warmup"] == run_command.DEFAULT_WARMUP and seen["target"] == run_command.DEFAULT_TARGET_PERCENT


def test_the_api_refuses_an_output_named_as_another_tools_trace(tmp_path):
    with pytest.raises(ValueError, match=r"output .*x\.json names a \.json file"):
        xsp.trace(output=tmp_path / "x.json")


def test_a_script_that_does_not_compile_gets_pythons_own_lines_and_exit_code(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "broken.py"
    script.write_text("print('a')\ndef f(\n")
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert main(["run", "--", "broken.py"]) == python.returncode == 1
    captured = capsys.readouterr()
    assert captured.err == python.stderr and "SyntaxError: '(' was never closed" in captured.err
    assert captured.out == python.stdout == ""
    assert not (tmp_path / col.DEFAULT_OUTPUT).exists()  # nothing ran: no trace


def test_xsps_closing_line_starts_a_line_of_its_own_after_output_left_open(tmp_path):
    script = tmp_path / "open_line.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\nprint('no newline', end='')\n")
    together = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "t.xsp.parquet", "--", script.name],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert together.returncode == 0
    assert together.stdout.startswith("no newline\n"), together.stdout
    assert any(line.startswith("xsp: 2 spans") for line in together.stdout.splitlines())
    apart = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "a.xsp.parquet", "--", script.name],
                           cwd=tmp_path, capture_output=True, text=True)
    assert apart.stdout == "no newline"  # the program's output is its own, unchanged
    assert apart.stderr.startswith("xsp: 2 spans"), apart.stderr


def test_recommend_prints_the_rules_that_fire_as_text_and_json(shared_traces, capsys):
    trace = str(shared_traces / "kineto" / "v100_2rank_train_rank1.json.gz")
    assert main(["recommend", trace]) == 0
    text = capsys.readouterr().out
    assert "[high] no_amp" in text and "torch.float16" in text and "GradScaler" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert main(["recommend", trace, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)["recommendations"]
    no_amp = next(r for r in found if r["rule"] == "no_amp")
    assert no_amp["source"].startswith("TensorFlow profiler") and 0 < no_amp["share"] < 1
    assert main(["report", trace, "--top", "2"]) == 0
    report = capsys.readouterr().out
    assert report.index("Recommendations") < report.index("no_amp") < report.index("Kernel time per operator")


def test_unreadable_trace_and_non_python_script(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.xsp.parquet").write_bytes(b"PAR1 but not really")
    assert main(["report", "bad.xsp.parquet"]) == 2
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho hi && exit 0\n")
    assert main(["run", "--", "run.sh"]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and "run.sh is not a Python script" in err and "Traceback" not in err


def test_script_that_uses_no_pytorch_is_a_warning_and_keeps_its_exit_code(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('no torch here')\n")
    result = xsp_cli("run", "--", str(script), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "no torch here\n"
    assert "warning:" in result.stderr and "called no torch.nn.Module" in result.stderr
    assert "Traceback" not in result.stderr


def plain_and_profiled(script, *args, cwd):
    plain = subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, text=True,
                           timeout=300)
    return plain, xsp_cli("run", "-o", "out.xsp.parquet", "--", str(script), *args, cwd=cwd)


def own_lines(stderr: str) -> list[str]:
    """stderr without xsp's own lines (its summary and warnings)."""
    return [line for line in stderr.splitlines() if not line.startswith(("xsp: ", "warning: "))]


@pytest.mark.parametrize("body, args", [
    ("import argparse\nargparse.ArgumentParser(description='demo').parse_args()\n", ["--help"]),
    ("import sys\nsys.exit('fatal: bad config')\n", []),
    ("import sys\nsys.exit(4)\n", []),
    ("raise SystemExit\n", []),
])
@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_exit_codes_and_output_are_the_scripts_own(tmp_path, body, args):
    script = tmp_path / "script.py"
    script.write_text("import torch\n" + body)
    plain, profiled = plain_and_profiled(script, *args, cwd=tmp_path)
    assert profiled.returncode == plain.returncode
    assert profiled.stdout == plain.stdout
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)


@pytest.mark.heavy
def test_a_failing_model_shows_pythons_traceback_without_xsp_frames(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import torch\n"
        "class Broken(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        try:\n"
        "            return x @ x\n"
        "        except RuntimeError as error:\n"
        "            raise ValueError('shapes do not fit') from error\n"
        "Broken()(torch.randn(2, 3))\n")
    plain, profiled = plain_and_profiled(script, cwd=tmp_path)
    assert profiled.returncode == plain.returncode == 1
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)  # the chained traceback, frame for frame
    assert "direct cause" in profiled.stderr and "module_calls" not in profiled.stderr


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_ctrl_c_ends_the_run_as_python_ends_it_and_keeps_the_trace(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text("import torch\ntorch.nn.Linear(2, 2)(torch.randn(1, 2))\nraise KeyboardInterrupt\n")
    plain, profiled = plain_and_profiled(script, cwd=tmp_path)
    assert profiled.returncode == plain.returncode == -2  # killed by SIGINT
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)
    assert len(xsp.load(tmp_path / "out.xsp.parquet").steps) == 1


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_ctrl_c_lets_the_scripts_other_threads_finish_as_python_does(tmp_path):
    """Python waits for a script's non-daemon threads before it ends by SIGINT; xsp ended the
    process at once: the threads' work and output were lost."""
    script = tmp_path / "threads.py"
    script.write_text("import threading, time, torch\n"
                      "def work():\n"
                      "    time.sleep(1.0)\n"
                      "    torch.nn.Linear(2, 2)(torch.randn(1, 2))\n"
                      "    print('worker finished', flush=True)\n"
                      "threading.Thread(target=work).start()\n"
                      "raise KeyboardInterrupt\n")
    plain, profiled = plain_and_profiled(script, cwd=tmp_path)
    assert profiled.returncode == plain.returncode == -2  # killed by SIGINT, once the thread finished
    assert profiled.stdout == plain.stdout == "worker finished\n"
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)
    assert (tmp_path / "out.xsp.parquet").is_file()


@pytest.mark.parametrize("ending, status", [("", 0), pytest.param("raise SystemExit(3)\n", 3, marks=pytest.mark.heavy),
                                            pytest.param("raise ValueError('main failed')\n", 1,
                                                         marks=pytest.mark.heavy)])
def test_threads_the_main_thread_left_running_are_traced_until_they_end(tmp_path, ending, status):
    """Python waits for a script's non-daemon threads before it exits; xsp ended the trace when the
    main thread returned, so the steps its threads took after that were missing, and said nowhere.
    An idle ThreadPoolExecutor never shut down must not hold the end up (Python ends its workers at
    exit)."""
    script = tmp_path / "workers.py"
    script.write_text("import threading, time, torch\n"
                      "from concurrent.futures import ThreadPoolExecutor\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
                      "pool = ThreadPoolExecutor(2)\n"
                      "pool.submit(print, 'pool ran', flush=True).result()\n"
                      "def work():\n"
                      "    time.sleep(0.5)\n"
                      "    for _ in range(20):\n"
                      "        model(torch.randn(2, 4))\n"
                      "    print('worker finished', flush=True)\n"
                      "threading.Thread(target=work).start()\n"
                      "print('main returns', flush=True)\n" + ending)
    plain, profiled = plain_and_profiled(script, cwd=tmp_path)
    assert profiled.returncode == plain.returncode == status, profiled.stderr
    assert profiled.stdout == plain.stdout == "pool ran\nmain returns\nworker finished\n"
    assert own_lines(profiled.stderr) == own_lines(plain.stderr)
    assert "20 steps -> out.xsp.parquet" in profiled.stderr, profiled.stderr
    assert len(xsp.load(tmp_path / "out.xsp.parquet").steps) == 20


WORKER_LEFT_RUNNING = ("import threading, time, torch\n"
                       "model = torch.nn.Linear(4, 4)\n"
                       "def work():\n"
                       "    for _ in range({calls}):\n"
                       "        model(torch.randn(2, 4))\n"
                       "        time.sleep({pause_s})\n"
                       "    print('worker finished', flush=True)\n"
                       "threading.Thread(target=work).start()\n"
                       "print('main returns', flush=True)\n")


def test_threads_left_running_are_exported_too_when_the_trace_ends_at_exit(tmp_path):
    """The trace of a script whose threads outlive its main thread ends at exit, where Python no
    longer starts thread pools: its OTLP export (OpenTelemetry's resource detection runs on one)
    sent nothing."""
    from .otlp_receiver import HttpReceiver

    script = tmp_path / "worker.py"
    script.write_text(WORKER_LEFT_RUNNING.format(calls=15, pause_s=0.02))
    with HttpReceiver() as receiver:
        result = xsp_cli("run", "--otlp", receiver.endpoint, "--otlp-protocol", "http/protobuf", "-o",
                         "out.xsp.parquet", "--", str(script), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "warning" not in result.stderr, result.stderr
        spans = xsp.load(tmp_path / "out.xsp.parquet").spans
        assert len(xsp.load(tmp_path / "out.xsp.parquet").steps) == 15
        assert f"{len(spans)} spans sent to http/protobuf" in result.stderr, result.stderr


WORKER_AFTER_MAIN = ("import sys, threading, time, torch\n"
                     "from concurrent.futures import ThreadPoolExecutor\n"
                     "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
                     "pool = ThreadPoolExecutor(2)  # never shut down: Python ends it before the thread below\n"
                     "pool.submit(model, torch.randn(2, 4)).result()\n"
                     "def work():\n"
                     "    threading.main_thread().join()\n"
                     "    x, steps, start = torch.randn(2, 4), 0, time.monotonic()\n"
                     "    while time.monotonic() - start < float(sys.argv[1]):  # the script's own argv still\n"
                     "        model(x)\n"
                     "        steps += 1\n"
                     "    print(steps, flush=True)\n"
                     "threading.Thread(target=work).start()\n")


@pytest.mark.parametrize("options", [(), pytest.param(("--sample", "0.5"), marks=pytest.mark.heavy),
                                     pytest.param(("--dataset", "runs", "--rotate", "1s"), marks=pytest.mark.heavy)])
def test_a_thread_stepping_for_many_windows_after_the_main_thread_ended_is_traced_whole(tmp_path, options):
    """The trace of a script whose thread outlives its main thread ends at exit, after it. Python
    shuts thread pools down before it waits for the thread, and each window interpreted meanwhile
    used one (pyarrow converts a table's columns on a pool): the first attempt passed the tests
    (one window) and lost the whole trace of a long run. The thread here steps for several of
    the run's windows, and begins only once the main thread has ended."""
    script = tmp_path / "after_main.py"
    script.write_text(WORKER_AFTER_MAIN)
    output = () if "--dataset" in options else ("-o", "out.xsp.parquet")
    result = xsp_cli("run", *output, *options, "--", str(script), "4", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower() and "Traceback" not in result.stderr, result.stderr
    steps = int(result.stdout)
    trace = xsp.load(tmp_path / ("runs" if "--dataset" in options else "out.xsp.parquet"))
    assert len(trace.steps) == steps + 1  # the one step on the pool, while the main thread ran
    if "--sample" not in options:
        assert (trace.spans[col.LEVEL] == Level.LAYER.value).sum() == 2 * (steps + 1)


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_a_stopping_signal_while_python_waits_for_the_threads_writes_the_trace_and_ends_by_it(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER_LEFT_RUNNING.format(calls=3000, pause_s=0.01))
    process = subprocess.Popen([sys.executable, "-m", "xsp", "run", "-o", "out.xsp.parquet", "--", str(script)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline() == "main returns\n"
    time.sleep(1.0)  # the worker's steps go on, Python waits for it
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == -signal.SIGTERM, err  # as a plain run ends by it
    assert "Traceback" not in err and "Exception ignored" not in err, err
    steps = len(xsp.load(tmp_path / "out.xsp.parquet").steps)
    assert 10 < steps < 3000 and f"{steps} steps -> out.xsp.parquet" in err, err


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_ctrl_c_while_python_waits_for_the_threads_ends_as_in_a_plain_run(tmp_path):
    """Plain Python prints the KeyboardInterrupt as an exception ignored while it waits for the
    threads, stops waiting and exits with the script's status (0): so does xsp, its trace written
    (it ended the process by SIGINT instead)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_LEFT_RUNNING.format(calls=3000, pause_s=0.01))
    endings = []
    for command in ([str(script)], ["-m", "xsp", "run", "-o", "out.xsp.parquet", "--", str(script)]):
        process = subprocess.Popen([sys.executable, *command], cwd=tmp_path, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert process.stdout is not None
        assert process.stdout.readline() == "main returns\n"
        time.sleep(1.0)  # the worker's steps go on, Python waits for it
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
        endings.append((process.returncode, err))
    (plain_status, plain_err), (status, err) = endings
    # Python then finalises with the thread still running: one caught inside torch's C++ ends
    # the process by SIGABRT ("terminate called without an active exception"), xsp or not
    assert status in (0, -signal.SIGABRT) and plain_status in (0, -signal.SIGABRT), err
    ignored = "Exception ignored in: <module 'threading'"
    assert ignored in plain_err and ignored in err
    assert "KeyboardInterrupt" in err and "KeyboardInterrupt" in plain_err
    shown = err[err.index(ignored):].split("KeyboardInterrupt")[0]
    assert shown == plain_err[plain_err.index(ignored):].split("KeyboardInterrupt")[0]  # no frame of xsp's in it
    steps = len(xsp.load(tmp_path / "out.xsp.parquet").steps)
    assert 10 < steps < 3000 and f"{steps} steps -> out.xsp.parquet" in err, err


LEFT_TO_OTHERS = {
    "pool": ("from concurrent.futures import ThreadPoolExecutor\n"
             "pool = ThreadPoolExecutor(2)  # never shut down: Python runs its queued jobs at exit\n"
             "def job(calls):\n"
             "    for _ in range(calls):\n"
             "        model(torch.randn(2, 4))\n"
             "for _ in range(8):\n"
             "    pool.submit(job, 50)\n"),
    "children": ("import multiprocessing\n"
                 "def child(calls):\n"
                 "    for _ in range(calls):\n"
                 "        model(torch.randn(2, 4))\n"
                 "if __name__ == '__main__':\n"
                 "    for _ in range(2):  # not daemons, never joined: multiprocessing joins them at exit\n"
                 "        multiprocessing.get_context('fork').Process(target=child, args=(200,)).start()\n"),
}


@pytest.mark.parametrize("left", ["pool", pytest.param("children", marks=pytest.mark.heavy)])
def test_work_left_to_a_pool_or_child_processes_when_the_main_thread_returns_is_traced(tmp_path, left):
    """Python runs a thread pool's queued jobs, and waits for the child processes that are not
    daemons, before it exits: xsp ended the trace when the main thread returned, with none of
    their steps (1,014 of 20,000 for the pool; 0 for the children, said to have run untraced)."""
    script = tmp_path / "left.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(4, 4)\n" + LEFT_TO_OTHERS[left])
    result = xsp_cli("run", "-o", "out.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    assert len(xsp.load(tmp_path / "out.xsp.parquet").steps) == 400, result.stderr


def test_a_thread_left_running_finds_the_script_still_main(tmp_path):
    """A thread the main thread left running pickled a class of the script's: xsp had put its own
    ``__main__`` back, so the lookup failed where a plain run saves it."""
    script = tmp_path / "saver.py"
    script.write_text("import io, threading, time, torch\n"
                      "class Net(torch.nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__()\n"
                      "        self.linear = torch.nn.Linear(4, 4)\n"
                      "    def forward(self, x):\n"
                      "        return self.linear(x)\n"
                      "net = Net()\n"
                      "def work():\n"
                      "    threading.main_thread().join()\n"
                      "    net(torch.randn(2, 4))\n"
                      "    torch.save(net, io.BytesIO())\n"
                      "    print('saved', flush=True)\n"
                      "threading.Thread(target=work).start()\n")
    plain, profiled = plain_and_profiled(script, cwd=tmp_path)
    assert profiled.returncode == plain.returncode == 0, profiled.stderr
    assert profiled.stdout == plain.stdout == "saved\n"
    assert len(xsp.load(tmp_path / "out.xsp.parquet").steps) == 1


def test_leveled_refuses_a_script_that_leaves_threads_running(tmp_path):
    """--leveled runs the script several times in one process: a thread one run left running went
    on into the next runs, its steps uncounted and its time in theirs, and a script whose steps
    were all in such a thread was said to have made none."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER_LEFT_RUNNING.format(calls=30, pause_s=0.001))
    result = xsp_cli("run", "--leveled", "-o", "out.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("xsp: error:")]
    assert len(errors) == 1 and "left threads running" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.count("worker finished") == 1  # one run only, its thread let finish


def test_leveled_refuses_a_rank_of_a_distributed_job(tmp_path, monkeypatch, capsys):
    """Under torchrun, each run made the process group and the DDP model again in one process:
    the ranks then waited for each other in DDP's constructor for good, with no word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("print('ran')\n")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["run", "--leveled", "-o", "out.xsp.parquet", "--", "x.py"]) == 2
    said = capsys.readouterr()
    assert said.err.strip() == ("xsp: error: --leveled runs the script several times in one process, which a rank of "
                                "a distributed job (rank 1 of 2) cannot do: profile the job without --leveled, or run "
                                "--leveled on one process of it")
    assert "ran" not in said.out


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_leveled_takes_a_script_that_leaves_an_idle_thread_pool(tmp_path):
    """An idle pool's workers run until exit and do nothing meanwhile: not work left running."""
    script = tmp_path / "pooled.py"
    script.write_text("import torch\nfrom concurrent.futures import ThreadPoolExecutor\n"
                      "pool = ThreadPoolExecutor(2)  # never shut down\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
                      "for _ in range(12):\n"
                      "    pool.submit(model, torch.randn(2, 4)).result()\n")
    result = xsp_cli("run", "--leveled", "--rounds", "1", "-o", "out.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "error" not in result.stderr, result.stderr
    assert (tmp_path / "out.xsp.parquet").is_file()


def test_unreachable_otlp_endpoint_is_one_warning(tiny, tmp_path):
    result = xsp_cli("run", "--otlp", "http://127.0.0.1:9", "--", str(tiny), "1", cwd=tmp_path)
    assert result.returncode == 0
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    assert (tmp_path / "run.xsp.parquet").is_file()
    # the file says so too (it had no otlp and no export at all, as if none had been asked for)
    metadata = xsp.load(tmp_path / "run.xsp.parquet").metadata
    assert metadata["otlp"]["endpoint"] == "http://127.0.0.1:9"
    assert metadata["export"]["state"] == "failed" and metadata["export"]["exported"] == 0
    assert metadata["export"]["error"].startswith("not used: 127.0.0.1:9 is unreachable")


@pytest.mark.parametrize("endpoint", [pytest.param("http://127.0.0.1:abc", marks=pytest.mark.heavy),
                                      pytest.param("http://127.0.0.1:99999", marks=pytest.mark.heavy),
                                      pytest.param("http://[::1", marks=pytest.mark.heavy), "::::"])
def test_a_malformed_otlp_endpoint_is_one_line_before_the_script_runs(tiny, tmp_path, endpoint):
    result = xsp_cli("run", "--otlp", endpoint, "--", str(tiny), "1", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "OTLP endpoint" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""  # the script did not run


def test_run_never_writes_its_trace_over_the_script(tiny, tmp_path):
    before = tiny.read_bytes()
    result = xsp_cli("run", "-o", tiny.name, "--", tiny.name, "1", cwd=tmp_path)
    assert result.returncode == 2 and "is the input file" in result.stderr and "Traceback" not in result.stderr
    assert tiny.read_bytes() == before


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_run_leveled_merges_one_run_per_level_prefix(tiny, tmp_path):
    result = xsp_cli("run", "--leveled", "--levels", "model,layer,operator", "--warmup", "1", "--rounds", "2",
                     "-o", "lv.xsp.parquet", "--", str(tiny), "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    trace = xsp.load(tmp_path / "lv.xsp.parquet")
    # once to find its depth, then per run and round, and again for each run a burst of the
    # machine's noise hit (a busy machine's)
    assert result.stdout.count("args ['5']") == 1 + 3 * 2 + trace.metadata["leveled"]["repeated"]
    assert "leveled: the model's module calls nest 1 deep: 3 runs a round" in result.stderr
    for run in ("model", "model+layer", "model+layer+operator"):
        assert run in result.stdout
    assert trace.metadata["leveled"]["runs"] == ["model", "model+layer", "model+layer+operator"]
    assert trace.metadata["leveled"]["warmup_steps"] == 1 and trace.metadata["leveled"]["rounds"] == 2
    overhead = pd.DataFrame(trace.metadata["leveled"]["overhead"])
    assert overhead["steps"].tolist() == [2 * 4] * 3  # five calls, one warm-up, two rounds
    assert set(trace.spans[col.LEVELED_RUN]) >= {"model", "model+layer", "model+layer+operator"}
    assert "Traceback" not in result.stderr


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_run_leveled_respects_the_budget_and_says_what_it_gave_up(tiny, tmp_path):
    from xsp.session.leveled_rounds import MIN_ROUNDS

    result = xsp_cli("run", "--leveled", "--levels", "model", "--warmup", "1", "--budget", "0",
                     "-o", "lv.xsp.parquet", "--", str(tiny), "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("args ['3']") == 1 + 1  # the probe, then one round: no time for more
    leveled = xsp.load(tmp_path / "lv.xsp.parquet").metadata["leveled"]
    assert leveled["rounds"] == 1 and leveled["adaptive"] is True and leveled["budget_s"] == 0
    assert leveled["given_up"] == [leveled["given_up"][0]] and f"1 of {MIN_ROUNDS}" in leveled["given_up"][0]
    assert leveled["precise"] is False and "rounds: 1 of" in leveled["why_imprecise"]
    assert "not precise to ±2%" in result.stderr


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_run_leveled_runs_the_layer_level_once_per_module_depth(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text("import torch\n"
                      "block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
                      "model = torch.nn.Sequential(block(), torch.nn.Sequential(block(), block()))\n"
                      "with torch.no_grad():\n"
                      "    for _ in range(3):\n"
                      "        model(torch.randn(4, 8))\n")
    result = xsp_cli("run", "--leveled", "--levels", "model,layer", "--warmup", "1", "--rounds", "1",
                     "-o", "lv.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("leveled: the model's module calls nest 3 deep: 4 runs a round (model, model+layer<=1, model+layer<=2, "
            "model+layer)") in result.stderr
    trace = xsp.load(tmp_path / "lv.xsp.parquet")
    layers = trace.spans[trace.spans[col.LEVEL] == "layer"]
    runs = {int(depth): set(found) for depth, found in layers.groupby(col.CALL_DEPTH)[col.LEVELED_RUN]}
    assert runs == {1: {"model+layer<=1"}, 2: {"model+layer<=2"}, 3: {"model+layer"}}
    assert trace.metadata["leveled"]["by_depth"] is True and trace.metadata["leveled"]["runs_per_round"] == 4
    flat = xsp_cli("run", "--leveled", "--no-depth", "--levels", "model,layer", "--warmup", "1", "--rounds", "1",
                   "-o", "flat.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert flat.returncode == 0, flat.stderr
    assert xsp.load(tmp_path / "flat.xsp.parquet").metadata["leveled"]["runs"] == ["model", "model+layer"]


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
@pytest.mark.parametrize("trains", [False, True])
def test_run_leveled_hooks_backward_only_in_a_script_that_runs_it(tmp_path, trains):
    script = tmp_path / "grad.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
                      "for _ in range(3):\n"
                      "    out = model(torch.randn(4, 8))  # autograd records: no torch.no_grad here\n"
                      + ("    out.sum().backward()\n" if trains else ""))
    result = xsp_cli("run", "--leveled", "--levels", "model,layer", "--warmup", "1", "--rounds", "1",
                     "-o", "lv.xsp.parquet", "--", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    trace = xsp.load(tmp_path / "lv.xsp.parquet")
    layer_backward = trace.spans[(trace.spans[col.LEVEL] == "layer") & (trace.spans[col.KIND] == "backward")]
    assert (len(layer_backward) > 0) is trains
    leveled = trace.metadata["leveled"]
    assert leveled["records_autograd"] is True and leveled["backward_hooks"] is trains


def test_run_leveled_refuses_otlp_and_a_negative_warmup(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--leveled", "--warmup", "-1", "--", str(tiny), "1"]) == 2
    assert "--warmup must be 0 or more" in capsys.readouterr().err
    assert main(["run", "--leveled", "--otlp", "http://localhost:4317", "--", str(tiny), "1"]) == 2
    assert "not --otlp" in capsys.readouterr().err
    assert main(["run", "--leveled", "--rounds", "0", "--", str(tiny), "1"]) == 2
    assert "--rounds must be 1 or more" in capsys.readouterr().err
    assert main(["run", "--leveled", "--warmup", "3", "--", str(tiny), "2"]) == 2  # nothing left after warm-up
    assert "made no steps after the 3 warm-up steps" in capsys.readouterr().err


@pytest.mark.heavy  # a subprocess run or more: `python -m pytest -m heavy`
def test_the_operator_level_keeps_the_profilers_chatter_off_the_scripts_stderr(tmp_path):
    script = tmp_path / "talks.py"
    script.write_text("import sys, torch\nprint('before', file=sys.stderr)\nm = torch.nn.Linear(2, 2)\n"
                      "m(torch.ones(1, 2))\nprint('after', file=sys.stderr)\n")
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    profiled = xsp_cli("run", "--levels", "model,layer,operator", "--", str(script), cwd=tmp_path)
    assert profiled.returncode == 0, profiled.stderr
    own = [line for line in profiled.stderr.splitlines() if not line.startswith(("xsp: ", "warning: "))]
    assert own == plain.stderr.splitlines() == ["before", "after"]


def test_run_layer_depth_records_the_outer_depths_only(tmp_path, capsys, monkeypatch):
    script = tmp_path / "nested.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))\n"
                      "with torch.no_grad():\n"
                      "    model(torch.randn(2, 4))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--layer-depth", "1", "-o", "d1.xsp.parquet", "--", str(script)]) == 0
    trace = xsp.load(tmp_path / "d1.xsp.parquet")
    assert trace.spans[trace.spans[col.LEVEL] == "layer"][col.CALL_DEPTH].tolist() == [1]
    assert trace.metadata["layer_depth"] == 1
    assert main(["run", "--layer-depth", "0", "--", str(script)]) == 2
    assert "--layer-depth must be 1 or more" in capsys.readouterr().err
    assert main(["run", "--leveled", "--layer-depth", "2", "--", str(script)]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_a_trace_without_steps_reports_its_tables_over_the_whole_trace(shared_traces, capsys):
    """A Kineto trace of no ProfilerStep said "no steps in this trace", then "Top 3 operators ...
    (all steps)"."""
    assert main(["report", str(shared_traces / "kineto" / "a100_alexnet.json.gz"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "no steps in this trace" in out and "operators by self time (whole trace)" in out
    assert "(all steps" not in out


def _in_terminal(args: list[str], cwd: Path, columns: int = 80) -> tuple[int, str]:
    """Run the CLI with its stderr on a pseudo-terminal ``columns`` wide (a person's terminal);
    its exit status and what the terminal showed."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    try:
        done = subprocess.run([sys.executable, "-m", "xsp", *args], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=follower, text=True, timeout=300)
    finally:
        os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the terminal closed: everything was read
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    lines = []
    for line in shown.decode(errors="replace").replace("\r\n", "\n").split("\n"):
        line = re.split(r"\x1b\[2K|\r", line)[-1]  # what is left of a line the progress spinner erased
        lines.append(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line))
    return done.returncode, done.stdout + "\n".join(lines)


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_every_line_fits_an_80_column_terminal_warnings_and_errors_too(tiny, tmp_path):
    """Read in an 80-column terminal: xsp's warnings, errors and closing line wrap at its width;
    into a pipe or a log each stays one line, for grep."""
    deep = tmp_path / ("a-long-folder-name-" * 4) / "trace.xsp.parquet"
    levels = "model,layer,cuda_api,kernel,gpu_metrics"  # what this machine cannot record: a long warning
    status, shown = _in_terminal(["run", "--levels", levels, "-o", str(deep), "--", str(tiny), "2"], tmp_path)
    lines = [line for line in shown.splitlines() if line.strip()]
    assert status == 0 and any(line.startswith("xsp: ") for line in lines), shown
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    if "not recorded" in shown:  # on a GPU machine every level may be there
        piped = xsp_cli("run", "--levels", levels, "-o", str(deep), "--", str(tiny), "2", cwd=tmp_path)
        warning = next(line for line in piped.stderr.splitlines() if "not recorded" in line)
        assert len(warning) > 80 and " ".join(warning.split()) in " ".join(shown.split())
    status, shown = _in_terminal(["report", str(deep.with_name("missing.xsp.parquet"))], tmp_path)
    assert status == 2 and "no such trace file" in shown
    assert max(len(line) for line in shown.splitlines()) <= 80, shown


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_the_closing_line_says_when_it_replaced_an_earlier_trace(tiny, tmp_path):
    """Following the README in order, a second `xsp run` replaced the first run's trace unsaid."""
    first = xsp_cli("run", "--", str(tiny), "2", cwd=tmp_path)
    assert first.returncode == 0 and "replacing" not in first.stderr
    second = xsp_cli("run", "--", str(tiny), "2", cwd=tmp_path)
    assert "-> run.xsp.parquet (replacing the earlier trace there)" in second.stderr


def test_ctrl_c_while_the_cli_loads_ends_in_one_line():
    # the interrupt comes while xsp.cli.main is imported, as a Ctrl-C in the command's first 0.1 s does
    program = """
import importlib.abc, sys
class Interrupting(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "xsp.cli.main":
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupting())
from xsp.cli.entry import entry_point
entry_point()
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (130, "xsp: interrupted\n", "")
    as_module = program.replace("from xsp.cli.entry import entry_point\nentry_point()", "import runpy\n"
                                "runpy.run_module('xsp', run_name='__main__')")  # python -m xsp
    done = subprocess.run([sys.executable, "-c", as_module], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr, done.stdout) == (130, "xsp: interrupted\n", "")


@pytest.mark.heavy  # waits of seconds, by design: `python -m pytest -m heavy`
def test_xsp_summary_of_a_run_in_parts_gives_its_share_of_every_part(tmp_path, capsys, monkeypatch):
    import time

    import torch

    import xsp.session.options as session_options

    monkeypatch.setattr(session_options, "ALWAYS_ON_WINDOW_S", 0.1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with torch.no_grad(), xsp.trace(levels="model,layer", dataset=tmp_path / "runs", sample=0.2, slow_factor=0,
                                    rotate=0.3):
        # at least 1.5 s, then until a part is sealed: on a busy machine windows close late
        began = time.monotonic()
        while time.monotonic() - began < 60:
            model(torch.randn(2, 8))
            time.sleep(0.001)
            if time.monotonic() - began >= 1.5 and list((tmp_path / "runs").rglob("part-*.xsp.parquet")):
                break
    parts = list((tmp_path / "runs").rglob("part-*.xsp.parquet"))
    assert len(parts) >= 2
    output = tmp_path / "base.xsp-summary.parquet"
    assert main(["summary", str(tmp_path / "runs"), "-o", str(output)]) == 0
    said = " ".join(capsys.readouterr().err.split())
    share = output.stat().st_size / sum(path.stat().st_size for path in parts)
    assert f"{share:.1%} of the trace)" in said, said


def test_an_installed_command_on_path_is_run_as_a_script(tmp_path):
    """`xsp run --sample 0.01 -- uvicorn app:app` said "no such script: uvicorn": a console script
    is found on PATH (this interpreter's own first), as a shell finds it."""
    tools = tmp_path / "bin"
    tools.mkdir()
    tool = tools / "mytool"
    tool.write_text(f"#!{sys.executable}\n" + TINY_SCRIPT)
    tool.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    environment = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    plain = subprocess.run([str(tool), "2"], cwd=work, capture_output=True, text=True, timeout=300)
    traced = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", "t.xsp.parquet", "--", "mytool", "2"],
                            cwd=work, capture_output=True, text=True, timeout=300, env=environment)
    assert traced.returncode == plain.returncode == 0, traced.stderr
    assert traced.stdout == plain.stdout and (work / "t.xsp.parquet").is_file()
    missing = xsp_cli("run", "--", "no-such-tool-here", cwd=work)
    assert missing.returncode == 2 and missing.stderr.strip() == "xsp: error: no such script: no-such-tool-here"


def test_a_model_whose_class_is_defined_where_no_file_is_is_recorded(tmp_path):
    """A model class defined in `python -c` code (or a REPL: its __main__ has no file) failed both
    tracers ("source code not available"): every call was lost, and the benchmark of xsp diff's
    gate compared traces holding only their session span."""
    code = textwrap.dedent("""
        import torch, xsp
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)
            def forward(self, x):
                return self.linear(x)
        with xsp.trace(levels="model,layer", output="t.xsp.parquet") as session:
            for _ in range(3):
                Net()(torch.ones(1, 4))
        print(session.trace.spans["kind"].value_counts().to_dict(), session.warnings)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "'predict': 3" in done.stdout and "'forward': 3" in done.stdout and done.stdout.rstrip().endswith("[]")
    assert "XspWarning" not in done.stderr, done.stderr


SIGTERM_WHILE_WRITING = """
import os, signal, sys
import xsp.session.ending as ending
from xsp.cli.main import main

finish = ending.finish

def finish_after_a_sigterm(*args, **kwargs):  # torchrun ending a failed job's other ranks, at this moment
    os.kill(os.getpid(), signal.SIGTERM)
    return finish(*args, **kwargs)

ending.finish = finish_after_a_sigterm
sys.exit(main(["run", "-o", "failed.xsp.parquet", "--", "failing.py"]))
"""


def test_a_failed_scripts_traceback_is_said_though_a_sigterm_comes_while_the_trace_is_written(tmp_path):
    """The traceback came after the trace was written: torchrun's SIGTERM to the other ranks of a
    job whose rank failed ended them first, and their tracebacks were never printed, nor a word
    of the signal (3 of 3 jobs)."""
    (tmp_path / "failing.py").write_text("import torch\ntorch.nn.Linear(2, 2)(torch.ones(1, 2))\n"
                                         "raise RuntimeError('the rank failed')\n")
    (tmp_path / "drive.py").write_text(SIGTERM_WHILE_WRITING)
    done = subprocess.run([sys.executable, "drive.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM
    assert "RuntimeError: the rank failed" in done.stderr
    assert ("warning: xsp: SIGTERM came while the trace was being written: held until it was complete "
            f"({tmp_path / 'failed.xsp.parquet'}), and delivered now") in done.stderr
    assert done.stderr.index("the rank failed") < done.stderr.index("SIGTERM came")
    assert len(xsp.load(tmp_path / "failed.xsp.parquet").spans) >= 2
