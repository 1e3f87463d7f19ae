"""An NVTX tool without Nsight: tests/nvtx_recorder.c built against NVIDIA's NVTX headers, loaded
by NVTX as Nsight is (``NVTX_INJECTION64_PATH``), and its record of ranges read back."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("nvtx_recorder.c")


def nvtx_headers() -> Path | None:
    """The folder holding ``nvtx3/nvToolsExt.h``: the ``nvidia-nvtx-cu12`` wheel's, else CUDA's."""
    try:
        import nvidia.nvtx  # type: ignore[import-not-found]

        folders = [Path(entry) / "include" for entry in nvidia.nvtx.__path__]
    except ImportError:
        folders = []
    folders += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"]
    return next((folder for folder in folders if (folder / "nvtx3" / "nvToolsExt.h").exists()), None)


def _unavailable(why: str) -> None:
    if os.environ.get("XSP_REQUIRE_HOTPATH"):
        pytest.fail(f"{why} (XSP_REQUIRE_HOTPATH is set)")
    pytest.skip(why)


def build(directory: Path) -> Path:
    """Compile the recorder into ``directory``; skipped without a compiler or NVTX's headers."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        _unavailable("no C compiler to build the NVTX test tool")
    headers = nvtx_headers()
    if headers is None:
        _unavailable("no NVTX headers (pip install nvidia-nvtx-cu12) to build the NVTX test tool")
    try:
        import xsp.record._nvtx  # noqa: F401
    except ImportError:
        _unavailable("xsp.record._nvtx is not built here")
    library = directory / "libxsp_nvtx_recorder.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Werror", f"-I{headers}", "-o",
                    str(library), str(SOURCE)], check=True)
    return library


@dataclass(frozen=True)
class Range:
    thread: int
    name: str
    parent: str | None
    """The name of the range it was pushed inside, on its thread (None: none)."""
    category: int = 0
    start_ns: int = 0
    end_ns: int = 0


@dataclass
class Recorded:
    """What the tool saw: push/pop ranges with their nesting, start/end ranges, and problems."""

    ranges: list[Range] = field(default_factory=list)
    started: list[tuple[int, str]] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    unpopped: dict[int, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def tree(self) -> Counter[tuple[int, str, str | None]]:
        return Counter((r.thread, r.name, r.parent) for r in self.ranges)


def read(path: Path) -> Recorded:
    """Parse the recorder's file: every push paired with its thread's next pop (ranges in the
    order they ended)."""
    recorded = Recorded()
    stacks: dict[int, list[tuple[str, int, int]]] = {}  # name, category, push time
    open_ids: dict[str, tuple[int, str]] = {}
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        kind = fields[0]
        if kind == "events":
            continue
        thread = int(fields[1])
        if kind == "domain":
            recorded.domains.append(fields[3])
        elif kind == "push":
            if fields[3] != "xsp":
                recorded.problems.append(f"range in domain {fields[3]}")
            stack = stacks.setdefault(thread, [])
            stack.append((fields[5], int(fields[4]), int(fields[2])))
        elif kind == "pop":
            stack = stacks.setdefault(thread, [])
            if not stack:
                recorded.problems.append(f"pop without a push on thread {thread}")
            else:
                name, category, start_ns = stack.pop()
                recorded.ranges.append(Range(thread, name, stack[-1][0] if stack else None, category, start_ns,
                                             int(fields[2])))
        elif kind == "start":
            open_ids[fields[4]] = (thread, fields[5])
        elif kind == "end":
            if open_ids.pop(fields[4], None) is None:
                recorded.problems.append(f"end of a range never started: {fields[4]}")
            else:
                recorded.started.append((thread, fields[4]))
        elif kind == "bad":
            recorded.problems.append(line)
    recorded.unpopped = {thread: [entry[0] for entry in stack] for thread, stack in stacks.items() if stack}
    if open_ids:
        recorded.problems.append(f"ranges started and never ended: {sorted(open_ids)}")
    return recorded
