"""Kineto JSON read into columns in C (xsp/io/_kineto/scanner.c); see xsp.io.kineto_events."""

from collections.abc import Sequence

from typing_extensions import Buffer

MAX_DEPTH: int
"""An event's ``args`` nested more levels than this are dropped (``dropped_args``)."""

class Unsupported(ValueError):
    """The file holds something this scanner leaves to the msgspec reader (raised by the last
    ``scan``, once the whole file was checked to be JSON)."""

class Invalid(ValueError):
    """The file is not JSON, is cut short, or nests past any plausible depth: the message, from
    "is ...", says how and at which byte."""

class Block:
    """A column's bytes, owned by the block and read through the buffer protocol."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class Scanner:
    """Reads a Kineto trace's JSON text, piece by piece, into columns."""

    rows: int
    events: int
    missing_times: int
    finished: bool
    top_fields: list[tuple[bytes, bytes]]
    thread_names: list[tuple[int, str]]
    ignored: dict[str, int]
    dropped_args: list[tuple[int, int]]
    """(start, stop) offsets of each ``"args": ...`` member of an event nested past ``MAX_DEPTH``."""
    def __init__(self, categories: Sequence[str], linked: Sequence[str], device: Sequence[str]) -> None: ...
    def scan(self, data: Buffer, final: bool, /) -> int:
        """Reads the events whole in ``data``; returns the bytes consumed (the rest comes again).

        Raises:
            Invalid: at the first byte that cannot be JSON (or, with ``final``, a cut document).
            Unsupported: with ``final``, where the file is the msgspec reader's to read.
        """
    def columns(self) -> dict[str, Block]:
        """The columns read so far, by name; the scanner keeps none of them."""
