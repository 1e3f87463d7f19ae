"""Printing a benchmark's result table and recording it under benchmarks/results/."""

from __future__ import annotations

from pathlib import Path


def record(lines: list[str], path: Path) -> None:
    """Print the markdown ``lines`` and write them to ``path`` (the last results)."""
    text = "\n".join(lines) + "\n"
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
