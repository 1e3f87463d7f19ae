"""The checks of the options ``xsp.trace`` and the CLI share: each written once, here, and called
by both (the CLI names the option as its flag, the API as its argument)."""

from __future__ import annotations

from typing import Final

from xsp.core.schema import FILE_SUFFIX, FOREIGN_SUFFIXES

MAX_LAYER_DEPTH: Final = 10_000
"""The deepest ``layer_depth`` taken: no model nests module calls deeper (Python's own recursion
limit is 1,000 frames by default), and xsp's C wrapper keeps depths in 64-bit integers."""


def checked_layer_depth(depth: int | None, name: str = "layer_depth") -> int | None:
    """``depth`` (None: every depth), or ValueError when it is below 1 or above
    :data:`MAX_LAYER_DEPTH`."""
    if depth is not None and depth < 1:
        raise ValueError(f"{name} must be 1 or more (1: the calls the model makes itself), not {depth}")
    if depth is not None and depth > MAX_LAYER_DEPTH:
        raise ValueError(f"{name} must be at most {MAX_LAYER_DEPTH:,} (leave it out for every depth), not {depth}")
    return depth


def checked_span_budget(budget: int | None, name: str = "span_budget") -> int | None:
    """``budget`` (None: from the environment, 0: no limit), or ValueError when it is negative."""
    if budget is not None and budget < 0:
        raise ValueError(f"{name} must be 0 (no limit) or more, not {budget}")
    return budget


def checked_output_name(output: str | None, name: str = "output", writes: str = "a Parquet trace",
                        suffix: str = FILE_SUFFIX) -> str | None:
    """``output``, or ValueError when its name says another tool's format (``x.json``: xsp would
    write Parquet under it, then read it back as a Kineto trace and fail). ``writes`` and
    ``suffix``: what is written there, and the name it takes (a summary's, for one)."""
    if output is not None and str(output).lower().endswith(FOREIGN_SUFFIXES):
        stem = str(output).rsplit("/", 1)[-1].split(".", 1)[0] or "run"
        raise ValueError(f"{name} {output} names a {'.' + str(output).lower().split('.', 1)[-1]} file, but xsp writes "
                         f"{writes}: give it a {suffix} name ({stem}{suffix})")
    return output
