"""``torch.compile``d code traced to its source on CPU, with the real compiler: each kernel that
inductor generates counts on the lines of the operators it fuses (``xsp report --lines``,
``xsp.analysis.lines``), and the session leaves inductor's configuration as it found it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import xsp
from xsp.analysis.lines import lines
from xsp.record.compiled_kernels import kernel_name, kernel_sources

PROGRAM = textwrap.dedent("""
    import sys
    import torch
    import torch._inductor.config as inductor_config
    import xsp


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)

        def forward(self, x):
            y = x * 2  # MUL
            z = torch.relu(y)  # RELU
            return self.fc(z).sum(dim=1)  # SUM


    model = torch.compile(Net())
    x = torch.randn(32, 64)
    with torch.no_grad(), xsp.trace(levels="model,layer,operator", output=sys.argv[1]):
        for _ in range(4):
            model(x)
    print("restored", inductor_config.trace.provenance_tracking_level, inductor_config.cpp.enable_kernel_profile)
""")


def line_of(marker: str) -> int:
    return next(number for number, text in enumerate(PROGRAM.splitlines(), 1) if text.endswith(f"# {marker}"))


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    script, output = folder / "net.py", folder / "net.xsp.parquet"
    script.write_text(PROGRAM)
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache")}  # a compile of its own
    for name in ("INDUCTOR_PROVENANCE", "TORCH_COMPILE_DEBUG"):
        environment.pop(name, None)
    done = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True,
                          timeout=600, env=environment, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return script, output, done


def test_a_fused_kernel_lands_on_the_lines_of_the_operators_it_fuses(compiled_run):
    script, output, done = compiled_run
    assert "restored 0 False" in done.stdout  # the session set inductor's options back
    trace = xsp.load(output)
    sources = kernel_sources(trace.metadata)
    fused = [name for name, chains in sources.items()
             if {chain[-1][1] for chain in chains} == {line_of("MUL"), line_of("RELU")}]
    assert fused, sources  # inductor fused x * 2 and relu into one kernel
    spans = trace.spans
    names = spans["name"].astype(str)
    ran = spans[names.map(kernel_name).isin(fused) & (spans["level"] == "operator")]
    assert len(ran) == 4  # one run of the kernel a step, seen by the operator level
    found = lines(trace)
    mine = found[found["file"] == str(script)].set_index("line")
    mul, relu = mine.loc[line_of("MUL")], mine.loc[line_of("RELU")]
    kernel_ms = ran["duration_ns"].sum() / 1e6
    assert mul["function"] == relu["function"] == "Net.forward"
    assert mul["self_ms"] >= kernel_ms / 2 * 0.999 and relu["self_ms"] >= kernel_ms / 2 * 0.999
    assert mul["calls"] >= 4 and relu["calls"] >= 4
    assert line_of("SUM") in mine.index  # the sum's kernel (and the matrix multiply's call) too
    # the compiler's own work (functions PyTorch made with exec) counts on the calling line, not on <string>
    assert not found["file"].astype(str).str.startswith("<").any(), found[["file", "line", "function"]]


def test_the_report_lists_the_fused_lines_with_their_text(compiled_run):
    script, output, _ = compiled_run
    done = subprocess.run([sys.executable, "-m", "xsp", "report", "--lines", str(output)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "y = x * 2" in done.stdout and "z = torch.relu(y)" in done.stdout


COMPILED_BEFORE = PROGRAM.replace(
    "    with torch.no_grad(), xsp.trace(",
    "    with torch.no_grad():\n        model(x)  # compiled before the session\n    with torch.no_grad(), xsp.trace(")


def test_a_model_compiled_before_the_session_has_its_lines_with_inductors_variables(tmp_path):
    script, output = tmp_path / "net.py", tmp_path / "net.xsp.parquet"
    script.write_text(COMPILED_BEFORE)
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
                   "INDUCTOR_PROVENANCE": "1", "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1"}
    done = subprocess.run([sys.executable, str(script), str(output)], capture_output=True, text=True,
                          timeout=600, env=environment, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restored 1 True" in done.stdout  # the user's own settings stand
    found = lines(xsp.load(output))
    mine = found[found["file"] == str(script)].set_index("line")
    assert {line_of("MUL"), line_of("RELU")} <= set(mine.index), found
