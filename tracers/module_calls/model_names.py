"""Naming top-level models by the name the calling code binds them to (``encoder``, ``head``).

Model-level spans are named by their model and layer names start with it, so that two
models called in one iteration (even two ``nn.Sequential``) never share names or paths. The
name is found once per model, at its first top-level call, by looking at the code that made
the call: its local variables, the attributes of its ``self``, then its module's globals.
Frames inside PyTorch and Python's standard library (a thread pool's worker holds the model as
``fn``, a thread as ``_target``), and frames of the model's own methods (``generate()`` calling
``self(...)``), are skipped in favour of the user's code above them.
"""

from __future__ import annotations

import os
import sysconfig
from types import BuiltinFunctionType, FrameType, FunctionType, MethodType, ModuleType
from typing import Any, Final

import torch

from xsp.record import recording
from xsp.record.recording import Recording

_TORCH_DIR: Final = os.path.dirname(torch.__file__) + os.sep
_XSP_DIRS: Final = (os.path.dirname(__file__) + os.sep, os.path.dirname(recording.__file__) + os.sep)
_PATHS: Final = sysconfig.get_paths()
_STANDARD_LIBRARY: Final = tuple(dict.fromkeys(_PATHS[name] + os.sep for name in ("stdlib", "platstdlib")
                                               if _PATHS.get(name)))
_INSTALLED: Final = tuple(dict.fromkeys(_PATHS[name] + os.sep for name in ("purelib", "platlib") if _PATHS.get(name)))
"""Packages installed beside the standard library (its ``site-packages``, often inside it): not
skipped, since a library's own binding (a pipeline's ``self.model``) names the model well."""
_NO_MEMBERS: Final = (type, ModuleType, FunctionType, MethodType, BuiltinFunctionType)
"""What binds no model in its attributes: classes and modules of code (their attributes are the
program's definitions), functions."""
FRAMES_SEARCHED: Final = 8
"""How far up the calling code a binding is looked for."""
PUBLIC_FRAMES_SEARCHED: Final = 64
"""How far up it is looked for where the frames within :data:`FRAMES_SEARCHED` bind the model to
private names only (a framework's own attribute: Lightning's strategy calls the user's module
as ``self._lightning_module``, many frames below the user's ``trainer.fit(model)``). Once a
model: its name is made at its first call."""


def _skipped(frame: FrameType, module: Any) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith(_TORCH_DIR) or filename.startswith(_XSP_DIRS) or filename.startswith("<frozen "):
        return True
    if filename.startswith(_STANDARD_LIBRARY) and not filename.startswith(_INSTALLED):
        return True
    return frame.f_locals.get("self") is module


def _snapshot(mapping: Any) -> dict[str, Any]:
    """A copy of ``mapping``, taken in one step under the GIL: another thread may add names to it
    meanwhile (a script's loop at module level binds globals as it runs), and iterating the dict
    itself would then raise in the user's thread."""
    return dict(mapping) if not isinstance(mapping, dict) else mapping.copy()


def _bound_names(module: Any, frame: FrameType) -> list[str]:
    local_names = _snapshot(frame.f_locals)
    names = [name for name, value in local_names.items() if value is module and name != "self"]
    owner = local_names.get("self")
    if owner is not None:
        members = owner._modules if isinstance(owner, torch.nn.Module) else getattr(owner, "__dict__", {})
        names += [name for name, value in _snapshot(members).items() if value is module]
    global_names = _snapshot(frame.f_globals)
    names += [name for name, value in global_names.items() if value is module and not name.startswith("__")]
    if not names:  # called through an attribute: `net.backbone(x)`, `holder.model(x)` at module level
        for scope in (local_names, global_names):
            names += [f"{name}.{member}" for name, value in scope.items()
                      if name != "self" and not name.startswith("__") and value is not module
                      for member in _members_bound_to(value, module)]
            if names:
                break
    return names


def _members_bound_to(owner: Any, module: Any) -> list[str]:
    """The attributes of ``owner`` (its submodules, for a module) that are ``module``; none for
    what has no attributes of its own (numbers, functions, classes and modules of code)."""
    if isinstance(owner, torch.nn.Module):
        members = owner.__dict__.get("_modules") or {}
    elif isinstance(owner, _NO_MEMBERS) or not hasattr(owner, "__dict__"):
        return []
    else:
        members = getattr(owner, "__dict__", None)
        if not isinstance(members, dict):
            return []
    return [member for member, value in _snapshot(members).items() if value is module]


def binding_names(module: Any, frame: FrameType | None) -> list[str]:
    """Names ``module`` is bound to in the first calling frame that binds it (best first)."""
    private: list[str] = []
    library: list[str] = []  # past private names: a framework's public one (Lightning's `pl_module`)
    for depth in range(PUBLIC_FRAMES_SEARCHED):
        if frame is None or (depth >= FRAMES_SEARCHED and not private):
            break
        if not _skipped(frame, module):
            names = _bound_names(module, frame)
            if any(not _private(name) for name in names):
                if not private or not frame.f_code.co_filename.startswith(_INSTALLED):
                    return list(dict.fromkeys(names))
                library = library or names  # the user's own code, further up, may name it
            private = private or names
        frame = frame.f_back
    return list(dict.fromkeys(library or private))


def _private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split("."))


def model_name(session_recording: Recording, module: Any, frame: FrameType | None) -> str:
    """The model's name in this session, found from ``frame`` (the calling code) the first time."""
    known = session_recording.model_names.get(id(module))
    if known is not None:
        return known
    try:
        candidates = binding_names(module, frame)
    except Exception:  # noqa: BLE001 - the user's call must go on: the model is then named by its class
        candidates = []
    return session_recording.models.name(module, candidates)
