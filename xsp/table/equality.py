"""Whether two span tables hold the same spans and the same tree, whatever their ids.

Span and trace ids are drawn at random each time a table is built, so two imports of one file
never share them: the tables are compared with each span's parent named by its place among the
spans (sorted by every other column), and each trace by the spans it holds.
"""

from __future__ import annotations

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd

_IDS = (col.SPAN_ID, col.PARENT_ID, col.TRACE_ID)
PARENT_PLACE = "parent_place"
TRACE_PLACE = "trace_place"


def _sort_key(column: pd.Series) -> np.ndarray:
    if pd.api.types.is_numeric_dtype(column.dtype) and not isinstance(column.dtype, pd.CategoricalDtype):
        return column.to_numpy(dtype=np.float64, na_value=-np.inf)
    texts = column.astype("string").fillna("\x00")
    return pd.factorize(texts, sort=True)[0]


def structural_form(spans: pd.DataFrame) -> pd.DataFrame:
    """``spans`` sorted by every column but the ids, which are replaced by places: the parent's
    row in that order (-1: a root; -2: a parent outside the table) and each trace's first row."""
    columns = sorted(c for c in spans.columns if c not in _IDS)
    frame = spans.reset_index(drop=True)
    order = np.lexsort([_sort_key(frame[c]) for c in reversed(columns)]) if len(frame) else np.zeros(0, dtype=int)
    ordered = frame.iloc[order].reset_index(drop=True)
    form = ordered[columns].copy()
    ids = ordered[col.SPAN_ID].to_numpy(dtype=np.int64)
    by_id = np.argsort(ids, kind="stable")
    parents = ordered[col.PARENT_ID]
    has_parent = parents.notna().to_numpy()
    parent_ids = parents.to_numpy(dtype=np.int64, na_value=0)
    found = np.searchsorted(ids[by_id], parent_ids).clip(0, max(len(ids) - 1, 0))
    inside = has_parent & (ids[by_id][found] == parent_ids) if len(ids) else has_parent
    form[PARENT_PLACE] = np.where(has_parent, np.where(inside, by_id[found] if len(ids) else -2, -2), -1)
    form[TRACE_PLACE] = pd.factorize(ordered[col.TRACE_ID].astype("string").fillna(""))[0]
    for column in form.columns:  # categories compared by their texts, not their codes
        if isinstance(form[column].dtype, pd.CategoricalDtype):
            form[column] = form[column].astype("string")
    return form


def span_differences(expected: pd.DataFrame, actual: pd.DataFrame) -> list[str]:
    """How ``actual`` differs from ``expected`` as spans and tree (empty where they are the same):
    a line a column that differs, with its number of rows and an example."""
    if len(expected) != len(actual):
        return [f"{len(actual)} spans, not {len(expected)}"]
    missing = sorted(set(expected.columns) ^ set(actual.columns))
    if missing:
        return [f"columns not in both: {', '.join(missing)}"]
    left, right = structural_form(expected), structural_form(actual)
    found = []
    for column in left.columns:
        a, b = left[column], right[column]
        same = (a == b).fillna(False).to_numpy(dtype=bool) | (a.isna() & b.isna()).to_numpy(dtype=bool)
        if not same.all():
            row = int(np.flatnonzero(~same)[0])
            found.append(f"{column}: {int((~same).sum())} rows differ (row {row}: {a.iloc[row]!r} against "
                         f"{b.iloc[row]!r})")
    return found
