"""The user's own code in tests of call sites and lines: a module in a file of its own, under no
library folder, whose lines carry markers (``# BIG``) that tests look up."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def user_module(path: Path, code: str, name: str) -> ModuleType:
    """``code`` written to ``path`` and imported as module ``name``."""
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def marked_line(module: ModuleType, marker: str) -> int:
    """The one line of ``module``'s file that carries ``# <marker>`` (at its end, or followed by
    a space and more words)."""
    found = [number for number, text in enumerate(Path(str(module.__file__)).read_text().splitlines(), 1)
             if text.rstrip().endswith(f"# {marker}") or f"# {marker} " in text]
    assert len(found) == 1, marker
    return found[0]
