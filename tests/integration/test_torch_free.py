"""Reading never imports torch: ``import xsp``, ``xsp.load``, every analysis and every reading
command run in a fresh interpreter without it (nor OpenTelemetry's SDK, except ``push``, which
exports); torch comes with a session only."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import xsp

CHECK = textwrap.dedent("""
    import json, sys
    {body}
    print(json.dumps(sorted(m for m in ("torch", "opentelemetry.sdk") if m in sys.modules)))
""")


def fresh(body: str, cwd) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CHECK.format(body=textwrap.dedent(body))], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traces")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    for name in ("a", "b"):
        with xsp.trace(output=folder / f"{name}.xsp.parquet"), torch.no_grad():
            for _ in range(4):
                model(torch.randn(2, 8))
    return folder


def test_loading_and_every_analysis_import_no_torch(traces):
    assert fresh("""
        import inspect, xsp
        from xsp import analysis
        trace = xsp.load("a.xsp.parquet")
        for name in analysis.__all__:
            function = getattr(analysis, name)
            if callable(function) and len(inspect.signature(function).parameters) >= 1:
                try:
                    function(trace)
                except (TypeError, ValueError, KeyError, AttributeError):
                    pass  # needs more than a trace
    """, traces) == []


@pytest.mark.parametrize("command", [
    ["--help"], ["run", "--help"], ["report", "a.xsp.parquet"], ["report", "a.xsp.parquet", "--html", "r.html"],
    ["diff", "a.xsp.parquet", "b.xsp.parquet"], ["summary", "a.xsp.parquet", "-o", "s.json"],
    ["recommend", "a.xsp.parquet"], ["export", "a.xsp.parquet", "-o", "c.json"],
    ["import", "c.json", "-o", "i.xsp.parquet"], ["recover", "a.xsp.parquet"], ["doctor", "--help"],
])
def test_reading_commands_import_no_torch(traces, command):
    assert fresh(f"""
        from xsp.cli.main import main
        main({command!r})
    """, traces) == []


def test_push_imports_the_sdk_it_exports_with_but_no_torch(traces):
    assert fresh("""
        from xsp.cli.main import main
        main(["push", "a.xsp.parquet", "--otlp", "http://127.0.0.1:9"])
    """, traces) == ["opentelemetry.sdk"]


@pytest.mark.heavy
def test_the_public_functions_stay_functions_when_their_modules_are_imported(tmp_path):
    """``xsp.trace``, ``xsp.diff`` and ``xsp.leveled`` are functions; importing the modules that
    define them (as xsp's own code does) leaves them so."""
    body = """
        from xsp.io.trace import Trace
        from xsp.gate.diff import Diff
        from xsp.session.leveled_merge import LeveledResult
        import xsp
        assert callable(xsp.trace) and callable(xsp.diff) and callable(xsp.leveled), (xsp.trace, xsp.diff)
    """
    fresh(body, tmp_path)
