"""Figures as xsp writes them in text: a ratio as a signed change in percent, a share in percent."""

from __future__ import annotations

import math


def change_percent(ratio: float | None) -> str:
    """``1.25`` as ``+25.0%``; ``-`` for none."""
    return "-" if ratio is None or math.isnan(ratio) else f"{(ratio - 1) * 100:+.1f}%"


def percent(value: float | None) -> str:
    """``0.25`` as ``25%``; ``-`` for none."""
    return "-" if value is None or math.isnan(value) else f"{value:.0%}"
