"""xsp's spans as NVTX ranges, for Nsight Systems (``xsp.trace(nvtx=True)``, ``xsp run --nvtx``).

While a session records with NVTX on, each model call and layer call (forward, and the backward
of each leaf layer) and each user span and explicit step (``xsp.span``, ``xsp.step``) pushes an
NVTX range in the domain ``xsp``, named as its span is in the span table, and pops it where the
span ends, on the thread that ran it. Nsight's timeline then shows xsp's hierarchy above the
CUDA rows with no change to the program.

NVTX reaches a tool through the library that implements its calls (NVIDIA's
``libnvtx3interop.so.1`` from the ``nvidia-nvtx`` wheels or CUDA, or ``libnvToolsExt.so.1``):
its first call loads the tool that ``NVTX_INJECTION64_PATH`` names, as Nsight Systems sets it
for the programs it starts. Where that variable is unset no tool can attach, so xsp sends
nothing and costs nothing. Names are registered once each (``nvtxDomainRegisterStringA``), and
module calls push and pop from C (:mod:`xsp.record._nvtx`, used by the module-call wrapper).
"""

from __future__ import annotations

import ctypes.util
import enum
import glob
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from xsp.record import hotpath

NVTX_VARIABLE: Final = "XSP_NVTX"
"""``1`` turns NVTX ranges on for sessions that do not say (``xsp run --nvtx`` sets it)."""
LIBRARY_VARIABLE: Final = "XSP_NVTX_LIBRARY"
"""The path of the NVTX library to load, instead of looking for one."""
INJECTION_VARIABLE: Final = "NVTX_INJECTION64_PATH"
"""The tool NVTX loads at its first call: set by Nsight Systems for the programs it starts."""
DOMAIN: Final = "xsp"
LIBRARY_NAMES: Final = ("libnvtx3interop.so.1", "libnvToolsExt.so.1")
METADATA_KEY: Final = "nvtx"

NVTX = hotpath.optional_extension("xsp.record._nvtx")


class RangeKind(enum.IntEnum):
    """What a range stands for, sent as its NVTX category (which Nsight exports with each range,
    so that xsp's import of the export gives the spans back at their levels)."""

    MODEL = 1
    LAYER = 2
    BACKWARD = 3
    USER = 4
    STEP = 5

    @property
    def color(self) -> int:
        """The range's ARGB colour in Nsight's timeline, one per kind."""
        return _COLORS[self]


_COLORS: Final = {RangeKind.MODEL: 0xFF76B900, RangeKind.LAYER: 0xFF1F77B4, RangeKind.BACKWARD: 0xFFFF7F0E,
                  RangeKind.USER: 0xFF9467BD, RangeKind.STEP: 0xFF7F7F7F}


def wanted(asked: bool | None) -> bool:
    """Whether a session sends NVTX ranges: as asked, else as :data:`NVTX_VARIABLE` says."""
    if asked is not None:
        return asked
    return os.environ.get(NVTX_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def find_library() -> str | None:
    """The NVTX library to load: :data:`LIBRARY_VARIABLE`, else one in an ``nvidia`` wheel's
    ``lib`` folder (``nvidia-nvtx-cu12``, which CUDA builds of PyTorch install), else one the
    dynamic loader finds, else one in ``CUDA_HOME``'s ``lib64``; None where there is none."""
    named = os.environ.get(LIBRARY_VARIABLE)
    if named:
        return named
    for entry in sys.path:
        for name in LIBRARY_NAMES:
            found = sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib", name)))
            if found:
                return found[0]
    for stem in ("nvtx3interop", "nvToolsExt"):
        found_name = ctypes.util.find_library(stem)
        if found_name:
            return found_name
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        for name in LIBRARY_NAMES:
            if home and Path(home, "lib64", name).exists():
                return str(Path(home, "lib64", name))
    return None


@dataclass
class NvtxRanges:
    """The ranges of one session: the bound library, and each name's registered message.

    ``forward`` and ``backward`` map a module to the message of its call and of its backward
    (the module-call wrapper reads ``forward`` from C, and asks ``name_of`` on a miss).
    """

    extension: ModuleType
    library: str
    forward: dict[Any, int] = field(default_factory=dict)
    backward: dict[Any, int] = field(default_factory=dict)
    messages: dict[tuple[str, int], int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def message(self, name: str, kind: RangeKind) -> int:
        """The message index of ``name`` as a range of ``kind``, registered with the tool the first time."""
        key = (name, int(kind))
        found = self.messages.get(key)
        if found is None:
            found = self.messages[key] = self.extension.message(name, kind.color, int(kind))
            self.names[found] = name
        return found

    def name_of(self, message: int) -> str | None:
        """The name a message was made for (None: not one of :meth:`message`'s)."""
        return self.names.get(message)

    def push(self, message: int) -> None:
        self.extension.push(message)

    def pop(self) -> None:
        self.extension.pop()

    def start(self, message: int) -> int:
        return int(self.extension.start(message))

    def end(self, range_id: int) -> None:
        self.extension.end(range_id)

    @property
    def capsule(self) -> Any:
        """What the C module-call wrapper pushes and pops through."""
        return self.extension.ranges

    def facts(self) -> dict[str, Any]:
        """What the trace's metadata keeps: the library, the tool, the domain, how many names."""
        return {"library": self.library, "tool": os.environ.get(INJECTION_VARIABLE), "domain": DOMAIN,
                "names": len(self.messages)}


def open_ranges() -> tuple[NvtxRanges | None, str]:
    """NVTX ranges for a session, the library bound on first use; or None and why not (a sentence).

    None, with nothing loaded, where no tool can attach (:data:`INJECTION_VARIABLE` unset), where
    the C extension is not built, or where no NVTX library is found or it cannot be loaded.
    """
    if not os.environ.get(INJECTION_VARIABLE):
        return None, (f"no NVTX tool is attached ({INJECTION_VARIABLE} is unset; Nsight Systems sets it for "
                      "the programs it starts): no ranges are sent")
    if NVTX is None:
        return None, "xsp's C extension xsp.record._nvtx is not built here: no ranges are sent"
    global _LIBRARY
    if _LIBRARY is not None:
        return NvtxRanges(NVTX, _LIBRARY, messages=_MESSAGES, names=_NAMES), ""
    library = find_library()
    if library is None:
        return None, ("no NVTX library found (pip install nvidia-nvtx-cu12, or name one in "
                      f"{LIBRARY_VARIABLE}): no ranges are sent")
    try:
        if not NVTX.is_bound():
            NVTX.bind(library, DOMAIN)
    except (OSError, RuntimeError) as exc:
        return None, f"the NVTX library {library} could not be loaded ({exc}): no ranges are sent"
    _LIBRARY = library
    return NvtxRanges(NVTX, library, messages=_MESSAGES, names=_NAMES), ""


_LIBRARY: str | None = None
"""The library bound, once per process: NVTX loads its tool once."""
_MESSAGES: dict[tuple[str, int], int] = {}
"""Every name registered in this process (registered strings stay valid for the process)."""
_NAMES: dict[int, str] = {}
"""Each message's name."""


__all__ = ["NVTX_VARIABLE", "LIBRARY_VARIABLE", "INJECTION_VARIABLE", "DOMAIN", "METADATA_KEY", "RangeKind",
           "NvtxRanges", "wanted", "find_library", "open_ranges"]
