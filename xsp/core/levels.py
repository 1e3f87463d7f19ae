"""Parsing the ``levels`` argument."""

from __future__ import annotations

from collections.abc import Iterable

from xsp.core.errors import UnknownLevelError
from xsp.core.schema import LEVELS, Level

LevelsArg = str | Level | Iterable[str | Level]


def parse_levels(levels: LevelsArg) -> tuple[Level, ...]:
    """Turn ``"model,layer"``, ``("model", "layer")`` or ``Level`` values into sorted Levels.

    The model level is always included: its spans (the session, steps and predict calls)
    are the roots every deeper span hangs from. So is the input level, recorded by the same
    tracer: a wait for a DataLoader batch is where an automatic step begins. The kernel level brings the cuda_api level
    with it: a kernel's parent is the CUDA call that launched it.

    Raises:
        UnknownLevelError: a name that is not a level.
    """
    if isinstance(levels, (str, Level)):
        items: list[str | Level] = [levels]
    else:
        items = list(levels)
    names: list[str] = []
    for item in items:
        text = item.value if isinstance(item, Level) else str(item)
        names.extend(part.strip() for part in text.split(",") if part.strip())
    valid = ", ".join(level.value for level in LEVELS)
    if items and not names:  # "," or "": a typing slip, not a choice of the model level alone
        raise UnknownLevelError(f"no level named in {','.join(map(str, items))!r} (valid levels: {valid})")
    parsed = {Level.MODEL, Level.INPUT}
    for name in names:
        try:
            parsed.add(Level(name.lower()))
        except ValueError:
            raise UnknownLevelError(f"unknown level {name!r} (valid levels: {valid})") from None
    if Level.KERNEL in parsed:
        parsed.add(Level.CUDA_API)
    return tuple(level for level in LEVELS if level in parsed)


def missing_levels(chosen: tuple[Level, ...], recorded: set[str]) -> list[str]:
    """The levels of ``chosen`` (from :func:`parse_levels`) that ``recorded`` lacks, leaving out
    those :func:`parse_levels` adds unasked (model, input; cuda_api beside kernel): a trace
    without input waits, or an import without CUDA calls, lacks nothing asked for."""
    implied = {Level.MODEL, Level.INPUT} | ({Level.CUDA_API} if Level.KERNEL in chosen else set())
    return [level.value for level in chosen if level not in implied and level.value not in recorded]

