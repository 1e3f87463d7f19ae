"""Shared fixtures: a guard that no xsp state leaks between tests, the shared real traces."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings as hypothesis_settings
from hypothesis.configuration import set_hypothesis_home_dir
from torch import nn
from torch.utils.data.dataloader import DataLoader, _BaseDataLoaderIter

from xsp.core import state as _state
from xsp.session.session import active_session, forget_active_session
from xsp.tracers.module_calls.interceptor import INTERCEPTOR, JIT_TRACE_ENTRIES

# tests write only in their temporary folders: hypothesis keeps no example database and no cache
# in the folder pytest runs in
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="xsp-tests-hypothesis-"))
# and the same examples on every run: CI's verdict is this commit's, never a draw's
hypothesis_settings.register_profile("xsp", database=None, derandomize=True)
hypothesis_settings.load_profile("xsp")

# the operator level's observer is built (once a test run) into a temporary folder, never the user's cache
os.environ.setdefault("XSP_CACHE_DIR", tempfile.mkdtemp(prefix="xsp-tests-cache-"))
# and torch.compile's caches too: an entry a test made (its code run by exec, named "<doc>") was
# what a user's compile of the same model then got back, with "<doc>" for its lines
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="xsp-tests-inductor-"))

SHARED_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
_ORIGINAL_CALL = nn.Module.__call__


@pytest.fixture(autouse=True)
def nothing_written_where_the_tests_run():
    """Tests write only in their temporary folders: a file a test leaves in the folder pytest runs
    in (a trace at the default output, run.xsp.parquet) would overwrite a user's own."""
    folder = Path.cwd()
    before = set(os.listdir(folder))
    yield
    if Path.cwd() != folder:
        return  # the test changed folder (monkeypatch.chdir undoes it after this check)
    left = sorted(set(os.listdir(folder)) - before - {".pytest_cache", "__pycache__"})
    for name in left:  # removed, so that one test's leftover does not fail the next ones too
        if name.endswith(".xsp.parquet") or ".xsp-segments." in name:
            shutil.rmtree(folder / name) if (folder / name).is_dir() else (folder / name).unlink(missing_ok=True)
    assert not left, f"the test wrote {', '.join(left)} into {folder}, outside its temporary folders"


@pytest.fixture(autouse=True)
def no_tracer_left_active():
    """Every test must leave no session, no patched nn.Module.__call__ and no backward hook."""
    yield
    leaked = []
    if active_session() is not None or _state.recording is not None:
        leaked.append("an xsp session is still active")
    if nn.Module.__call__ is not _ORIGINAL_CALL:
        leaked.append("nn.Module.__call__ is still patched")
    if INTERCEPTOR.mode is not None:
        leaked.append("the module-call interceptor still has users")
    from torch.nn.modules import module as torch_module

    if torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks:
        leaked.append("global backward hooks are still registered")
    leaked += _loop_patches_left()
    forget_active_session()
    nn.Module.__call__ = _ORIGINAL_CALL  # type: ignore[method-assign]
    assert not leaked, "; ".join(leaked)


def _loop_attributes() -> dict[str, object]:
    """What the model level patches for the loop's events, as it stands now."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return {
        **{f"torch.distributed.{name}": getattr(dist, name, None) for name in ("all_reduce", "broadcast", "barrier")},
        "distributed_c10d.all_gather_single": getattr(distributed_c10d, "all_gather_single", None),
        "torch.distributed.Work.wait": dist.Work.__dict__.get("wait") if dist.is_available() else None,
        "torch.autograd.backward": torch.autograd.backward,
        "torch.jit._trace._check_trace": torch.jit._trace._check_trace,
        **{f"{getattr(owner, '__name__', owner)}.{name}": owner.__dict__.get(name)
           for owner, name in JIT_TRACE_ENTRIES},
        "DataLoader.__iter__": DataLoader.__dict__["__iter__"],
        **{f"{cls.__name__}._next_data": cls.__dict__["_next_data"] for cls in _BaseDataLoaderIter.__subclasses__()
           if "_next_data" in cls.__dict__},
    }


_ORIGINALS = _loop_attributes()


def _loop_patches_left() -> list[str]:
    """What the model level patches for the loop's events, if any of it is still in place."""
    from torch.optim import optimizer

    left = [f"{name} is still patched" for name, value in _loop_attributes().items()
            if value is not _ORIGINALS.get(name)]
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and dynamo.reset.__name__ == "reset_keeping_xsp":
        left.append("torch._dynamo.reset is still patched")
    if optimizer._global_optimizer_pre_hooks or optimizer._global_optimizer_post_hooks:
        left.append("global optimizer hooks are still registered")
    if any(type(finder).__module__.startswith("xsp.") for finder in sys.meta_path):
        left.append("xsp's import watcher is still on sys.meta_path")
    return left


@pytest.fixture(scope="session")
def fake_libcupti(tmp_path_factory):
    """The fake libcupti (tests/fake_libcupti.c), built and loaded once for the session."""
    pytest.importorskip("cupti", reason="cupti-python is not installed (Linux x86_64/aarch64 only)")
    from .native_cupti import FakeLibcupti, activity_module, build

    activity_module()
    return FakeLibcupti(build(tmp_path_factory.mktemp("fake_libcupti")))


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """``../shared/traces``; skipped when absent, an error in CI (XSP_REQUIRE_SHARED=1)."""
    if not SHARED_TRACES.is_dir():
        message = f"the shared real traces are not at {SHARED_TRACES}"
        if os.environ.get("XSP_REQUIRE_SHARED"):
            pytest.fail(message + " (XSP_REQUIRE_SHARED is set)")
        pytest.skip(message)
    return SHARED_TRACES


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
