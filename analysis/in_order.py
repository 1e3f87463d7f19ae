"""Tables added up by key over parts of a trace (windows of whole trees), each key in the order
its first span comes in the loaded trace, so that keys of equal weight are listed as the whole
trace lists them. A place is three integers compared in turn (``o0``, ``o1``, ``o2``: as
:class:`xsp.io.tree_windows.TreeWindows` gives them; a trace loaded whole uses its row position)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

PLACE = ["o0", "o1", "o2"]


def row_places(count: int) -> np.ndarray:
    """The places of the rows of a trace loaded whole: their positions (N x 3)."""
    return np.column_stack([np.arange(count, dtype=np.int64), np.zeros((count, 2), dtype=np.int64)])


def grouped_in_order(frame: pd.DataFrame, places: np.ndarray, keys: Sequence[str], sums: Sequence[str],
                     firsts: Sequence[str] = (), smallest: Sequence[str] = (),
                     largest: Sequence[str] = ()) -> pd.DataFrame:
    """``frame``'s ``sums`` added up by ``keys`` (a missing key is a key), with the ``firsts``
    of each key's first row, the least of its ``smallest`` and the most of its ``largest``, and
    its first row's place (``places``: one per row of ``frame``), in the order of those places.
    Of tables made by it (``PLACE`` columns and all), the concatenation given to it again with
    its own places gives the table of all their rows."""
    with_places = frame.assign(**{name: places[:, at] if len(places) else np.zeros(0, dtype=np.int64)
                                  for at, name in enumerate(PLACE)})
    with_places = with_places.sort_values(PLACE, kind="stable")
    group = with_places.groupby(list(keys), sort=False, dropna=False, observed=True)
    added = group[list(sums)].sum().join(group[[*firsts, *PLACE]].first())
    if smallest:
        added = added.join(group[list(smallest)].min())
    if largest:
        added = added.join(group[list(largest)].max())
    return added.reset_index()[[*keys, *firsts, *sums, *smallest, *largest, *PLACE]]


def added_in_order(tables: Sequence[pd.DataFrame], keys: Sequence[str], sums: Sequence[str],
                   firsts: Sequence[str] = (), smallest: Sequence[str] = (),
                   largest: Sequence[str] = ()) -> pd.DataFrame:
    """The tables of :func:`grouped_in_order` of several parts, as one."""
    every = pd.concat(list(tables), ignore_index=True) if tables else pd.DataFrame(
        columns=[*keys, *firsts, *sums, *smallest, *largest, *PLACE])
    return grouped_in_order(every.drop(columns=PLACE), every[PLACE].to_numpy(dtype=np.int64), keys, sums, firsts,
                            smallest, largest)


class InOrderParts:
    """Tables of :func:`grouped_in_order` of the parts of a trace, added up as they come (every
    :data:`PARTS_HELD` parts, so that a long trace holds one table and a few), then as one."""

    def __init__(self, keys: Sequence[str], sums: Sequence[str], firsts: Sequence[str] = (),
                 smallest: Sequence[str] = (), largest: Sequence[str] = ()) -> None:
        self._columns = (keys, sums, firsts, smallest, largest)
        self._parts: list[pd.DataFrame] = []

    def add(self, table: pd.DataFrame) -> None:
        """A part's table (of :func:`grouped_in_order`)."""
        self._parts.append(table)
        if len(self._parts) > PARTS_HELD:
            self._parts = [self.result()]

    def result(self) -> pd.DataFrame:
        """The table of every part added, in the order of the keys' first places."""
        return added_in_order(self._parts, *self._columns)


PARTS_HELD = 64
"""How many parts' tables :class:`InOrderParts` holds before it adds them up."""


__all__ = ["PLACE", "InOrderParts", "added_in_order", "grouped_in_order", "row_places"]
