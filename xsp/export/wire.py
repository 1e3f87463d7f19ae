"""Protobuf's wire format, the little of it xsp writes in Python (OTLP spans' fixed parts in
:mod:`xsp.export.encoding`, Perfetto's packets in :mod:`xsp.export.perfetto`)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a negative one as its 64-bit two's complement)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


__all__ = ["varint"]
