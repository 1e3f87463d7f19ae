"""Span paths written in place in C (xsp/table/_paths.c), parents first, into one buffer of
their exact size; see :func:`xsp.table.paths.assign_paths`."""

from typing_extensions import Buffer

def fill_paths(order: Buffer, anchor: Buffer, offsets: Buffer, data: Buffer, name_codes: Buffer,
               name_offsets: Buffer, names: Buffer, occurrence: Buffer, session_name: Buffer, rows: int, /) -> None:
    """Write the path of every row into ``data`` (writable, of the paths' total length) at
    ``offsets``: rows in ``order`` (parents before children), each its ``anchor``'s path, '/',
    its own name (the distinct ``names`` at ``name_offsets``, the row's at its ``name_codes``,
    none for -1; the session row's is ``session_name``) and
    ``[occurrence]``. All int64 arrays but the texts.

    Raises:
        ValueError: columns shorter than ``rows``, a row or anchor out of range, or a path of another
            length than its offsets say.
    """

def equal_neighbours(order: Buffer, offsets: Buffer, data: Buffer, /) -> bool:
    """Whether two texts next to each other in ``order`` (int64 positions of texts at ``offsets``,
    int64, into ``data``) are equal.

    Raises:
        ValueError: a position out of range.
    """
