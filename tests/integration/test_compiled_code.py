"""``torch.compile``d code traced to its source on CPU, with the real compiler: each kernel that
inductor generates counts on the lines of the operators it fuses (``xsp report --lines``,
``xsp.analysis.lines``) and on the layers that ran them (the layer table), and the session leaves
inductor's configuration as it found it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import xsp
from xsp.analysis.layers import layer_table
from xsp.analysis.lines import lines
from xsp.record.compiled_kernels import kernel_layers, kernel_name, kernel_sources

pytestmark = pytest.mark.heavy  # each compile of its own takes tens of seconds

PROGRAM = textwrap.dedent("""
    import sys
    import torch
    import torch._inductor.config as inductor_config
    import xsp


    class Scale(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 0.5  # SCALE


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.blocks = torch.nn.ModuleList([Scale(), Scale()])

        def forward(self, x):
            y = x * 2  # MUL
            z = torch.relu(y)  # RELU
            h = self.fc(z)  # FC
            for block in self.blocks:
                h = block(h)
            return h.sum(dim=1)  # SUM


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
    assert line_of("SUM") in mine.index  # the sum's kernel too
    # the Linear's matrix multiply, which compiled code calls as it is, on the line that calls the Linear
    matmuls = spans[(spans["name"] == "aten::addmm") & spans["parent_id"].isin(
        spans.loc[spans["name"].astype(str).str.startswith("Torch-Compiled Region"), "span_id"])]
    assert len(matmuls) == 4
    assert mine.loc[line_of("FC"), "calls"] == 4
    assert mine.loc[line_of("FC"), "inclusive_ms"] == pytest.approx(matmuls["duration_ns"].sum() / 1e6)
    # the compiler's own work (functions PyTorch made with exec) counts on the calling line, not on <string>
    assert not found["file"].astype(str).str.startswith("<").any(), found[["file", "line", "function"]]


def test_a_compiled_model_has_its_layers_with_their_shares_of_the_kernels(compiled_run):
    _, output, _ = compiled_run
    trace = xsp.load(output)
    table = layer_table(trace)
    compiled = table[table["compiled"]]
    last = compiled[compiled["step"] == compiled["step"].max()].set_index("name")
    assert set(last.index) == {"model.fc", "model.blocks.0", "model.blocks.1"}, last
    assert last.loc["model.fc", "module_type"] == "Linear" and last.loc["model.blocks.0", "module_type"] == "Scale"
    spans = trace.spans
    step = spans[spans["step"] == compiled["step"].max()]
    region = step[step["name"].astype(str).str.startswith("Torch-Compiled Region")]
    assert len(region) == 1
    # the Linear's matrix multiply, which compiled code calls as it is, is all the fc's (its only caller)
    matmul = step[(step["parent_id"] == region["span_id"].iloc[0]) & (step["name"] == "aten::addmm")]
    assert len(matmul) == 1
    assert last.loc["model.fc", "self_ms"] == pytest.approx(matmul["duration_ns"].iloc[0] / 1e6)
    # one line (the loop) runs both blocks: their shares of the kernel fusing tanh and * 0.5 are equal
    fused = [name for name, shares in kernel_layers(trace.metadata).items()
             if {path for path, _, _ in shares} == {"blocks.0", "blocks.1"}]
    assert fused, kernel_layers(trace.metadata)
    assert last.loc["model.blocks.0", "self_ms"] == pytest.approx(last.loc["model.blocks.1", "self_ms"])
    assert last.loc["model.blocks.0", "self_ms"] > 0
    regions = spans[spans["name"].astype(str).str.startswith("Torch-Compiled Region")]
    per_step = regions.groupby("step")["duration_ns"].sum() / 1e6
    assert (compiled.groupby("step")["self_ms"].sum() <= per_step.reindex(compiled["step"].unique())).all()


def test_the_report_lists_the_fused_lines_with_their_text(compiled_run):
    script, output, _ = compiled_run
    done = subprocess.run([sys.executable, "-m", "xsp", "report", "--lines", str(output)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    assert "y = x * 2" in done.stdout and "z = torch.relu(y)" in done.stdout


COMPILED_BEFORE = PROGRAM.replace(
    "\nwith torch.no_grad(), xsp.trace(",
    "\nwith torch.no_grad():\n    model(x)  # compiled before the session\nwith torch.no_grad(), xsp.trace(")
assert COMPILED_BEFORE != PROGRAM


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
    # its graph was compiled before the session, unseen: no layers of compiled code
    assert not layer_table(xsp.load(output))["compiled"].any()


DYNAMIC = textwrap.dedent("""
    import sys
    import torch
    import xsp

    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()))
    with torch.no_grad(), xsp.trace(levels="model,layer,operator", output=sys.argv[1]) as session:
        for batch in range(2, 7):
            model(torch.randn(batch, 16))
    compiles = session.trace.spans
    print("compiles", int((compiles["kind"] == "compile").sum()))
""")


def test_the_operator_level_reads_no_symbolic_shape_so_a_new_batch_size_compiles_once(tmp_path):
    """Reading a fake tensor's symbolic sizes as numbers makes dynamo specialize them: every new
    batch size would recompile (seconds a step). As without xsp: the first compile, then one
    with a dynamic batch size for all the others."""
    script = tmp_path / "dynamic.py"
    script.write_text(DYNAMIC)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run.xsp.parquet")], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiles 2" in done.stdout, done.stdout
    assert "dropped" not in done.stderr  # no call lost to a shape that could not be read
