"""xsp's one host clock and the offsets that move other clocks onto epoch nanoseconds.

Tracers time host events with :func:`now_ns` (``time.perf_counter_ns``, CLOCK_MONOTONIC
on Linux): cheap, and never stepped by NTP. Spans are exported in epoch nanoseconds, so a
session measures the offset between the two once at start and once at stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

now_ns: Callable[[], int] = time.perf_counter_ns
"""Read xsp's host clock (monotonic nanoseconds)."""


def measure_offset_ns(read: Callable[[], int], reference: Callable[[], int] = time.time_ns,
                      tries: int = 9) -> tuple[int, int]:
    """Offset of clock ``read`` from clock ``reference``: ``reference = read - offset``.

    Brackets each ``read()`` between two reference reads and keeps the tightest bracket.

    Returns:
        ``(offset_ns, uncertainty_ns)``; the uncertainty is half the tightest bracket.
    """
    best_width, best_offset = -1, 0
    for _ in range(tries):
        before = reference()
        value = read()
        after = reference()
        width = after - before
        if best_width < 0 or width < best_width:
            best_width, best_offset = width, value - (before + after) // 2
    return best_offset, max(best_width, 0) // 2


@dataclass(frozen=True)
class ClockSync:
    """How host-clock readings map to epoch nanoseconds during one session."""

    host_to_epoch_ns: int
    """Add to a :func:`now_ns` reading to get epoch ns."""
    uncertainty_ns: int
    drift_ns: int = 0
    """Change of the offset between session start and stop (NTP steps, clock drift)."""

    @classmethod
    def measure(cls) -> ClockSync:
        offset, uncertainty = measure_offset_ns(now_ns)
        return cls(host_to_epoch_ns=-offset, uncertainty_ns=uncertainty)

    def remeasured(self) -> ClockSync:
        """The same offset, with the drift observed since it was measured."""
        offset, _ = measure_offset_ns(now_ns)
        return ClockSync(self.host_to_epoch_ns, self.uncertainty_ns, -offset - self.host_to_epoch_ns)
