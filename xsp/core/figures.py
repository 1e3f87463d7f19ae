"""Figures as xsp writes them in text: a ratio as a signed change in percent, a share in percent, a
duration in milliseconds."""

from __future__ import annotations

import math


def change_percent(ratio: float | None) -> str:
    """``1.25`` as ``+25.0%``; ``-`` for none."""
    return "-" if ratio is None or math.isnan(ratio) else f"{(ratio - 1) * 100:+.1f}%"


def percent(value: float | None) -> str:
    """``0.25`` as ``25%``; ``-`` for none."""
    return "-" if value is None or math.isnan(value) else f"{value:.0%}"


def three_digits(value: float) -> str:
    """A figure to three significant digits, never in exponent notation: ``0.0123``, ``12.3``,
    ``12,850`` (``-`` for none)."""
    if math.isnan(value):
        return "-"
    size = abs(value)
    if size >= 100 or size == 0:
        return f"{value:,.0f}"
    return f"{value:,.{2 - math.floor(math.log10(size))}f}"


def milliseconds(ms: float) -> str:
    """A duration in milliseconds to three significant digits, never in exponent notation:
    ``0.0123`` as ``0.0123 ms``, ``12.34`` as ``12.3 ms``, ``12850`` as ``12,850 ms``."""
    return f"{three_digits(ms)} ms"


def seconds_text(seconds: float) -> str:
    """A duration in seconds, to three significant digits: ``0.15 s``, ``1.5 s``, ``90 s``, ``2 h``."""
    if seconds >= 7200:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:,.0f} s"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun`` agreeing: "1 step", "3 steps" (``plural`` where it is not noun + "s")."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
