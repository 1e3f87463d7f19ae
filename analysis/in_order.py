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
                     firsts: Sequence[str] = ()) -> pd.DataFrame:
    """``frame``'s ``sums`` added up by ``keys`` (a missing key is a key), with the ``firsts``
    of each key's first row and that row's place (``places``: one per row of ``frame``), in the
    order of those places. Of tables made by it (``PLACE`` columns and all), the concatenation
    given to it again with its own places gives the table of all their rows."""
    with_places = frame.assign(**{name: places[:, at] if len(places) else np.zeros(0, dtype=np.int64)
                                  for at, name in enumerate(PLACE)})
    with_places = with_places.sort_values(PLACE, kind="stable")
    group = with_places.groupby(list(keys), sort=False, dropna=False, observed=True)
    added = group[list(sums)].sum().join(group[[*firsts, *PLACE]].first())
    return added.reset_index()[[*keys, *firsts, *sums, *PLACE]]


def added_in_order(tables: Sequence[pd.DataFrame], keys: Sequence[str], sums: Sequence[str],
                   firsts: Sequence[str] = ()) -> pd.DataFrame:
    """The tables of :func:`grouped_in_order` of several parts, as one."""
    every = pd.concat(list(tables), ignore_index=True) if tables else pd.DataFrame(
        columns=[*keys, *firsts, *sums, *PLACE])
    return grouped_in_order(every.drop(columns=PLACE), every[PLACE].to_numpy(dtype=np.int64), keys, sums, firsts)


__all__ = ["PLACE", "added_in_order", "grouped_in_order", "row_places"]
