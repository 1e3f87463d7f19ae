"""Torch's own C++ functions that xsp's C wrapper may call directly, where they can be found.

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
from typing import Final

import torch

GRAD_MODE_SYMBOL: Final = "_ZN3c108GradMode10is_enabledEv"
"""``c10::GradMode::is_enabled()``, as the Itanium C++ ABI (Linux, macOS) names it."""
LIBC10_NAMES: Final = ("libc10.so", "libc10.dylib")


@functools.cache
def grad_mode_address() -> int:
    """The address of ``c10::GradMode::is_enabled`` in the libc10 torch loaded, or 0 when it is
    not found (another platform or build) or does not agree with ``torch.is_grad_enabled``."""
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:  # Windows: no such flag; the binding is used
        return 0
    library_folder = Path(torch.__file__).parent / "lib"
    for name in LIBC10_NAMES:
        path = library_folder / name
        if not path.exists():
            continue
        try:  # RTLD_NOLOAD: the copy torch already loaded, or nothing
            function = ctypes.CDLL(str(path), mode=no_load | os.RTLD_LAZY)[GRAD_MODE_SYMBOL]
        except (OSError, AttributeError):
            continue
        function.restype, function.argtypes = ctypes.c_bool, []
        if _agrees_with_torch(function):
            return ctypes.cast(function, ctypes.c_void_p).value or 0
    return 0


def _agrees_with_torch(function: Callable[[], bool]) -> bool:
    modes = (torch.enable_grad, torch.no_grad, torch.inference_mode)
    for mode in modes:
        with mode():
            if bool(function()) is not torch.is_grad_enabled():
                return False
    return bool(function()) is torch.is_grad_enabled()
