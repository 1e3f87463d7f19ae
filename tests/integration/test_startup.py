"""Starting costs the program nothing it would notice: a mistyped script is answered before
torch, pandas or pyarrow is imported, and entering a session imports none of pandas, pyarrow or
OpenTelemetry's SDK on the program's thread, and times no machine-speed probe (both happen in the
background or at the end). Checked by what is imported, not by timings: the times are in
benchmarks/startup.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

HEAVY = ("torch", "pandas", "pyarrow", "opentelemetry.sdk")

ANSWER_MISSING = textwrap.dedent("""
    import json, sys
    from xsp.cli.main import main
    status = main(["run", "--", sys.argv[1]])
    print(json.dumps({"status": status, "heavy": sorted(name for name in sys.argv[2:] if name in sys.modules)}))
""")

ENTER = textwrap.dedent("""
    import json, sys, threading

    class Imports:
        '''Records the modules the main thread imports (a finder that finds nothing).'''
        def __init__(self):
            self.names = []
        def find_spec(self, name, path=None, target=None):
            if threading.current_thread() is threading.main_thread():
                self.names.append(name)
            return None

    import torch
    imports = Imports()
    sys.meta_path.insert(0, imports)
    import xsp
    from xsp.core import machine_speed
    with xsp.trace(output=sys.argv[1]) as session:
        seen = list(imports.names)
        probed = machine_speed.measure.cache_info().currsize
        torch.nn.Linear(4, 4)(torch.ones(2, 4))
    sys.meta_path.remove(imports)
    heavy = sorted({name for name in seen for top in sys.argv[2:] if name == top or name.startswith(top + ".")})
    times = session.trace.metadata.get("machine_speed") or {}
    print(json.dumps({"heavy": heavy, "probed_at_entry": probed, "probed_at_end": sorted(times),
                      "switch_s": sys.getswitchinterval()}))
""")


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_missing_script_is_answered_before_anything_heavy_is_imported(tmp_path):
    done = subprocess.run([sys.executable, "-c", ANSWER_MISSING, str(tmp_path / "missing.py"), *HEAVY],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "no such script" in done.stderr
    answer = _last_json(done.stdout)
    assert answer == {"status": 2, "heavy": []}


def test_entering_a_session_leaves_the_heavy_imports_and_the_speed_probe_for_later(tmp_path):
    done = subprocess.run([sys.executable, "-c", ENTER, str(tmp_path / "run.xsp.parquet"), *HEAVY[1:]],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    answer = _last_json(done.stdout)
    assert answer["heavy"] == [], "imported on the program's thread as the session started"
    assert answer["probed_at_entry"] == 0
    assert "python_loop_ns" in answer["probed_at_end"]  # the machine was timed, at the end
    assert answer["switch_s"] == 0.005  # Python's GIL switch interval, as the program had it


FORKS_AT_ONCE = textwrap.dedent("""
    import multiprocessing, sys, signal
    import torch, xsp

    def work(i):
        signal.alarm(60)  # a child stuck on an import lock the session's thread held dies, and says so
        import pandas, pyarrow
        return i + len(pandas.DataFrame({"a": [1]}))

    if __name__ == "__main__":
        with xsp.trace(output=sys.argv[1]):  # its thread imports pandas and pyarrow now, beside this
            with multiprocessing.get_context("fork").Pool(2) as pool:
                print(pool.map(work, range(4)))
""")


@pytest.mark.heavy  # seconds of runs: the quick run keeps under ten minutes on two cores
def test_a_program_that_forks_as_the_session_starts_gets_children_that_can_import(tmp_path):
    """The window thread imports pandas and pyarrow beside the program: a child forked meanwhile
    inherited their import locks, held, and hung on its own `import pandas` (killed by its alarm).
    Forks wait for those imports instead."""
    script = tmp_path / "pool.py"
    script.write_text(FORKS_AT_ONCE)
    for _ in range(3):  # the fork lands at a different moment of the imports each time
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "run.xsp.parquet")], capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout == "[1, 2, 3, 4]\n", done.stderr[-2000:]


FIRST_LINE = textwrap.dedent("""
    import sys, threading
    started = any(thread.name == "xsp-imports" for thread in threading.enumerate()) or "pandas" in sys.modules
    print("imports started before the script:", started)
""")


def test_xsp_run_starts_the_sessions_imports_before_the_script(tmp_path):
    """Under `xsp run` the script's own imports and model building overlap xsp's imports, so
    its first steps do not (their p90 was 4x a plain run's while a session imported beside them)."""
    script = tmp_path / "first.py"
    script.write_text(FIRST_LINE)
    done = subprocess.run([sys.executable, "-m", "xsp", "run", "-o", str(tmp_path / "run.xsp.parquet"), "--",
                           str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "imports started before the script: True\n"
