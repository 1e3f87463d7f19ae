"""CUPTI's timestamps on xsp's host clock.

Two ways, chosen when the subscription opens:

* **One clock.** Where the bound libcupti has ``cuptiActivityRegisterTimestampCallback``, xsp's C
  record path hands CUPTI a function returning xsp's host clock (``CLOCK_MONOTONIC``, what
  :func:`xsp.core.clock.now_ns` reads) before any kind is enabled: CUPTI then stamps every
  record, GPU ones included (it interpolates the GPU's clock onto it), on xsp's clock, and no
  NTP slew or step of ``CLOCK_REALTIME`` can move GPU spans against host spans.
* **Measured offsets, interpolated.** Otherwise (the Python record path, an older libcupti)
  CUPTI stamps records with ``CLOCK_REALTIME`` on Linux. The offset to the host clock is
  measured when the subscription opens, at every drain and when it closes; a record's offset
  is interpolated linearly between the measurements around it, so drift and slews between
  two drains are followed, not frozen at the first measurement.

The measurements are kept in both cases: with one clock they show the offset staying ~0.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from xsp.core.clock import measure_offset_ns, now_ns


class ClockMode(str, enum.Enum):
    """How records are put on the host clock (the trace's ``tracer_details``)."""

    HOST_CALLBACK = "host clock via CUPTI's timestamp callback"
    INTERPOLATED = "CUPTI's clock, offset measured at each drain and interpolated"


def measure_cupti_offset(read_cupti: Callable[[], int]) -> tuple[int, int]:
    """``(offset_ns, uncertainty_ns)``: host clock = CUPTI timestamp - offset."""
    return measure_offset_ns(read_cupti, reference=now_ns)


@dataclass
class CuptiClock:
    """Offsets measured between CUPTI's time base and the host clock, and the conversion.

    ``anchors_cupti_ns[i]`` is CUPTI's time when ``offsets_ns[i]`` was measured.
    """

    mode: ClockMode = ClockMode.INTERPOLATED
    anchors_cupti_ns: list[int] = field(default_factory=list)
    offsets_ns: list[int] = field(default_factory=list)
    uncertainty_ns: int = 0
    """The largest uncertainty of the measurements (half the tightest bracket of each)."""

    @classmethod
    def constant(cls, offset_ns: int, mode: ClockMode = ClockMode.INTERPOLATED) -> CuptiClock:
        """A clock whose offset never changes (tests, and records read offline)."""
        return cls(mode, [0], [offset_ns])

    def measure(self, read_cupti: Callable[[], int]) -> None:
        """Add a measurement of the offset now (``read_cupti``: ``cupti.get_timestamp``)."""
        offset, uncertainty = measure_cupti_offset(read_cupti)
        anchor = now_ns() + offset
        if self.anchors_cupti_ns and anchor <= self.anchors_cupti_ns[-1]:
            self.offsets_ns[-1] = offset  # CUPTI's clock stepped back: the newest measurement holds from here
        else:
            self.anchors_cupti_ns.append(anchor)
            self.offsets_ns.append(offset)
        self.uncertainty_ns = max(self.uncertainty_ns, uncertainty)

    @property
    def offset_ns(self) -> int:
        """The first offset measured (0 before any)."""
        return self.offsets_ns[0] if self.offsets_ns else 0

    @property
    def drift_ns(self) -> int:
        """How far the offset moved between the first measurement and the last."""
        return self.offsets_ns[-1] - self.offsets_ns[0] if self.offsets_ns else 0

    def to_host_ns(self, cupti_ns: np.ndarray) -> np.ndarray:
        """CUPTI timestamps as host-clock nanoseconds (int64)."""
        values = cupti_ns.astype(np.int64)
        if len(set(self.offsets_ns)) <= 1:
            return values - self.offset_ns
        anchors = np.asarray(self.anchors_cupti_ns, dtype=np.int64)
        offsets = np.asarray(self.offsets_ns, dtype=np.int64)
        # relative to the first anchor, so that float64 keeps nanoseconds (epoch ns need 61 bits)
        relative = (values - anchors[0]).astype(np.float64)
        between = np.interp(relative, (anchors - anchors[0]).astype(np.float64), offsets.astype(np.float64))
        return values - np.rint(between).astype(np.int64)

    def metadata(self) -> dict[str, Any]:
        return {"clock": self.mode.value, "cupti_to_host_offset_ns": self.offset_ns,
                "uncertainty_ns": self.uncertainty_ns, "drift_ns": self.drift_ns,
                "clock_measurements": len(self.offsets_ns)}
