"""The CUDA API and kernel levels on a real GPU (skipped without one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import xsp
from xsp.core import schema as col
from xsp.core.schema import Level, SpanKind
from xsp.table.walks import nearest_ancestor, of_level, parent_positions

pytestmark = pytest.mark.gpu


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(16 * 30 * 30, 10)).cuda().eval()


def _traced(model: torch.nn.Module, x: torch.Tensor, iterations: int) -> xsp.Trace:
    """``iterations`` calls of ``model`` with every host and CUDA level on (after one untraced call)."""
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        with xsp.trace(levels="model,layer,kernel", output=None) as session:
            for _ in range(iterations):
                model(x)
            torch.cuda.synchronize()
    return session.trace


@pytest.fixture(scope="module")
def traced():
    pytest.importorskip("cupti")
    return _traced(_model(), torch.randn(8, 3, 32, 32, device="cuda"), iterations=3)


def test_every_kernel_has_a_launch_and_a_layer(traced):
    spans = traced.spans
    kernels = np.flatnonzero((spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    assert len(kernels) >= 3 * 4
    parents = parent_positions(spans)
    assert (spans[col.LEVEL].to_numpy()[parents[kernels]] == Level.CUDA_API.value).all()
    layers = nearest_ancestor(spans, of_level(spans, Level.LAYER), parents)[kernels]
    assert (layers >= 0).all()
    assert traced.metadata["hierarchy"]["launch_missing"] == 0


def test_each_launch_lies_inside_its_layer_on_the_shared_clock(traced):
    spans = traced.spans
    parents = parent_positions(spans)
    # the calls made inside a layer (the closing torch.cuda.synchronize() is made outside every one)
    api = np.flatnonzero(((spans[col.LEVEL] == Level.CUDA_API.value) & spans[col.EXTERNAL_ID].notna()).to_numpy())
    assert len(api) >= 3 * 4
    owner = parents[api]
    assert (owner >= 0).all()
    assert (spans[col.LEVEL].to_numpy()[owner] == Level.LAYER.value).all()
    start, end = spans[col.START_NS].to_numpy(), spans[col.END_NS].to_numpy()
    assert ((start[owner] <= start[api]) & (end[api] <= end[owner])).all()
    assert traced.metadata["hierarchy"]["external_reparented"] == 0


def test_kernels_carry_names_geometry_and_device(traced):
    kernels = traced.spans[traced.spans[col.KIND] == SpanKind.KERNEL.value]
    assert not kernels[col.NAME].str.startswith("_Z").any()  # demangled
    assert kernels[col.GRID].str.match(r"^\[\d+,\d+,\d+\]$").all()
    assert kernels[col.REGISTERS_PER_THREAD].notna().all() and kernels[col.DEVICE_ID].notna().all()
    assert "cupti_to_host_offset_ns" in traced.metadata["tracer_details"]["kernel"]


# PyTorch's profiler keeps CUPTI's one subscription for the rest of a process once it has traced
# CUDA (docs/gpu.md): whatever runs it does so in a process of its own, never in pytest's
_PROFILED = """
import json, sys, torch
import xsp
from torch.profiler import ProfilerActivity, profile
from tests.gpu.test_cupti_gpu import _model, _traced

torch.manual_seed(0)
model, x = _model(), torch.randn(8, 3, 32, 32, device="cuda")
out = {}
if "xsp" in sys.argv:
    spans = _traced(model, x, iterations=5).spans
    kernels = spans[spans["kind"] == "kernel"]
    out["xsp"] = {"count": len(kernels), "us": float(kernels["duration_ns"].sum() / 1e3)}
with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        model(x)
    torch.cuda.synchronize()
theirs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
          and not e.name.startswith(("Memcpy", "Memset"))]
out["profiler"] = {"count": len(theirs), "us": float(sum(e.device_time for e in theirs))}
print(json.dumps(out))
"""


def _profiled(*what: str) -> dict[str, dict[str, float]]:
    """Run :data:`_PROFILED` in a fresh interpreter: ``xsp`` first (if asked), then PyTorch's profiler."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", _PROFILED, *what], capture_output=True, text=True, timeout=300,
                            cwd=root, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_kernel_count_and_time_match_pytorchs_profiler():
    pytest.importorskip("cupti")
    run = _profiled("xsp")
    ours, theirs = run["xsp"], run["profiler"]
    assert ours["count"] == theirs["count"]
    assert abs(ours["us"] - theirs["us"]) <= 0.05 * theirs["us"]


def test_pytorchs_profiler_after_an_xsp_session_records_what_it_records_without_one():
    pytest.importorskip("cupti")
    after_xsp, alone = _profiled("xsp")["profiler"], _profiled()["profiler"]
    assert after_xsp["count"] == alone["count"] > 0


def test_every_kernel_starts_after_its_launch_on_one_clock(traced):
    spans = traced.spans
    parents = parent_positions(spans)
    kernels = np.flatnonzero((spans[col.KIND] == SpanKind.KERNEL.value).to_numpy())
    start = spans[col.START_NS].to_numpy()
    launch = parents[kernels]
    assert (start[kernels] >= start[launch]).all()  # the queue may hold it, never run it before the call
    details = traced.metadata["tracer_details"]["kernel"]
    if details.get("record_path") == "C":
        assert details["clock"] == "host clock via CUPTI's timestamp callback"
        assert abs(details["cupti_get_timestamp_offset_ns"]) < 1_000_000


def test_records_are_read_in_c_with_nothing_dropped(traced):
    details = traced.metadata["tracer_details"]["kernel"]
    if details.get("record_path") != "C":
        pytest.fail(f"the CUDA levels read records through cupti-python: {details.get('why_not_c')}")
    assert details["records_read"] > 0 and details["records_of_unexpected_size"] == 0
    assert not {what for what in traced.metadata.get("dropped") or {} if "CUPTI" in what}


def test_the_c_path_and_the_python_path_see_the_same_kernels(monkeypatch):
    pytest.importorskip("cupti")
    from xsp.tracers.cuda import source as _cupti

    model, x = _model(), torch.randn(8, 3, 32, 32, device="cuda")
    by_c = _traced(model, x, iterations=3)
    monkeypatch.setattr(_cupti.SOURCE, "_use_native", False)
    by_python = _traced(model, x, iterations=3)
    assert by_python.metadata["tracer_details"]["kernel"]["record_path"] == "Python (cupti-python)"

    def kernels(trace: xsp.Trace) -> list[tuple[str, str, str]]:
        spans = trace.spans[trace.spans[col.KIND] == SpanKind.KERNEL.value]
        return sorted(zip(spans[col.NAME], spans[col.GRID], spans[col.BLOCK]))

    assert kernels(by_c) == kernels(by_python)
