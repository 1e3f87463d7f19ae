"""The checks of the options ``xsp.trace`` and the CLI share: each written once, here, and called
by both (the CLI names the option as its flag, the API as its argument)."""

from __future__ import annotations


def checked_layer_depth(depth: int | None, name: str = "layer_depth") -> int | None:
    """``depth`` (None: every depth), or ValueError when it is below 1."""
    if depth is not None and depth < 1:
        raise ValueError(f"{name} must be 1 or more (1: the calls the model makes itself), not {depth}")
    return depth


def checked_span_budget(budget: int | None, name: str = "span_budget") -> int | None:
    """``budget`` (None: from the environment, 0: no limit), or ValueError when it is negative."""
    if budget is not None and budget < 0:
        raise ValueError(f"{name} must be 0 (no limit) or more, not {budget}")
    return budget
