"""Torch's own C++ functions that xsp's C wrapper may call directly, where they can be found.

Both are asked at every top-level module call, through torch's Python bindings unless found here.

``torch.is_grad_enabled()`` called from C still goes through torch's Python binding: an argument
parser, a warning-handler guard and two thread-local lookups, some 300 instructions, asked once
per top-level call and once per layer call. ``c10::GradMode::is_enabled()``, which that binding
returns, is a plain function of no arguments returning a bool: C can call it for a few
instructions. Its address is only handed over when it is found in the very libc10 that torch
loaded (never a second copy) and when it agrees with ``torch.is_grad_enabled`` with grad on,
off and in inference mode; anything else gives 0, and the C wrapper keeps calling
``torch.is_grad_enabled``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

GRAD_MODE_SYMBOL: Final = "_ZN3c108GradMode10is_enabledEv"
"""``c10::GradMode::is_enabled()``, as the Itanium C++ ABI (Linux, macOS) names it."""
LIBC10_NAMES: Final = ("libc10.so", "libc10.dylib")
GRAPH_TASK_SYMBOL: Final = "_ZN5torch8autograd25get_current_graph_task_idEv"
"""``int torch::autograd::get_current_graph_task_id()``: what ``torch._C._current_graph_task_id``
returns (-1 where no backward runs on the thread), without its pybind11 binding (its dispatcher's
code, cold at every step of a service, cost about 0.4 µs of an always-on step's 2.5 before the call)."""
LIBTORCH_CPU_NAMES: Final = ("libtorch_cpu.so", "libtorch_cpu.dylib")


@functools.cache
def grad_mode_address() -> int:
    """The address of ``c10::GradMode::is_enabled`` in the libc10 torch loaded, or 0 when it is
    not found (another platform or build) or does not agree with ``torch.is_grad_enabled``."""
    function = _loaded_function(LIBC10_NAMES, GRAD_MODE_SYMBOL)
    if function is None:  # another platform or build (Windows: no RTLD_NOLOAD): the binding is used
        return 0
    function.restype, function.argtypes = ctypes.c_bool, []
    return (ctypes.cast(function, ctypes.c_void_p).value or 0) if _agrees_with_torch(function) else 0


@functools.cache
def graph_task_id_address() -> int:
    """The address of ``torch::autograd::get_current_graph_task_id`` in the libtorch_cpu torch
    loaded, or 0 when it is not found or does not give what ``torch._C._current_graph_task_id``
    gives, outside a backward and inside one."""
    binding = getattr(torch._C, "_current_graph_task_id", None)
    function = _loaded_function(LIBTORCH_CPU_NAMES, GRAPH_TASK_SYMBOL)
    if binding is None or function is None:
        return 0
    function.restype, function.argtypes = ctypes.c_int, []  # torch declares it returning an int
    try:
        agrees = _graph_tasks_agree(function, binding)
    except Exception:  # noqa: BLE001  (a build where the check itself fails: the binding is used)
        agrees = False
    return (ctypes.cast(function, ctypes.c_void_p).value or 0) if agrees else 0


def _loaded_function(names: tuple[str, ...], symbol: str) -> Any:
    """``symbol`` of the first of torch's libraries ``names`` that the process loaded, or None."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:  # Windows: no such flag
        return None
    library_folder = Path(torch.__file__).parent / "lib"
    for name in names:
        path = library_folder / name
        if not path.exists():
            continue
        try:  # RTLD_NOLOAD: the copy torch already loaded, or nothing
            return ctypes.CDLL(str(path), mode=no_load | os.RTLD_LAZY)[symbol]
        except (OSError, AttributeError):
            continue
    return None


def _graph_tasks_agree(function: Callable[[], int], binding: Callable[[], int]) -> bool:
    """Both -1 here, and both the same task's id (not -1) inside a backward on this thread."""
    inside: list[tuple[int, int]] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        inside.append((int(function()), int(binding())))
        return grad

    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.ones(1, requires_grad=True)
        product = leaf * 2
        product.register_hook(hook)
        product.sum().backward()
    return (len(inside) == 1 and inside[0][0] == inside[0][1] != -1
            and int(function()) == int(binding()) == -1)


def _agrees_with_torch(function: Callable[[], bool]) -> bool:
    modes = (torch.enable_grad, torch.no_grad, torch.inference_mode)
    for mode in modes:
        with mode():
            if bool(function()) is not torch.is_grad_enabled():
                return False
    return bool(function()) is torch.is_grad_enabled()
