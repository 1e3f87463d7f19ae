"""The user's source lines, as the reports show them: read from the files where they still exist."""

from __future__ import annotations

import linecache
import os

MAX_FILE_BYTES = 8 * 1024 * 1024
"""Files larger than this are not read for their text (a generated module, a data file)."""


def line_text(file: object, line: object) -> str | None:
    """The text of ``line`` (1-based) of ``file``, stripped; None where the file is gone, too
    large, not text, or shorter."""
    if not isinstance(file, str) or file.startswith("<") or line is None:
        return None
    try:
        number = int(line)  # type: ignore[call-overload]
        if number < 1 or os.path.getsize(file) > MAX_FILE_BYTES:
            return None
    except (OSError, TypeError, ValueError):
        return None
    text = linecache.getline(file, number)
    return text.strip() or None


def file_lines(file: str) -> list[str] | None:
    """Every line of ``file`` (without line ends), or None where it cannot be read."""
    try:
        if file.startswith("<") or os.path.getsize(file) > MAX_FILE_BYTES:
            return None
        with open(file, encoding="utf-8", errors="replace") as handle:
            return handle.read().splitlines()
    except OSError:
        return None
