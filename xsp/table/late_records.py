"""CUDA records that arrive in a later window than the layer call that made them.

CUPTI hands its records over when a buffer completes, which is not when a window closes: the
CUDA API calls and kernels of a window's last steps may come with the next window, after the
layer calls that made them were interpreted and written. Each window therefore leaves behind,
in the session's :class:`~xsp.table.steps.StepState`, who made what in it and in the window
before it: the span of each layer call by the external id it pushed (its start) and thread,
and the span of each CUDA API call by its correlation id. A later window's API call whose
owner is not among its own spans is placed under the remembered one (its step and trace too),
and so is a kernel whose launch came earlier, and the kernels under such a call follow it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.core.schema import Level
from xsp.table.walks import set_texts

if TYPE_CHECKING:
    from xsp.table.steps import StepState

Owner = tuple[int, Any, str]
"""(span id, step or None, trace id)."""


def adopt_late(table: pd.DataFrame, state: StepState) -> tuple[int, int]:
    """Place ``table``'s CUDA records whose owner an earlier window held, in place: how many
    API calls, and how many GPU activities (whose launch was not in ``table``)."""
    owners: dict[tuple[int, int], Owner] = state.recent_owners
    launches: dict[int, Owner] = state.recent_launches
    if not owners and not launches:
        return 0, 0
    ids = table[col.SPAN_ID].to_numpy(dtype=np.int64)
    parents = table[col.PARENT_ID].astype("Int64")  # 63-bit ids: never through floats
    loose = (parents.isna() | (parents == state.session_span_id)).to_numpy(dtype=bool)
    levels = table[col.LEVEL].to_numpy(dtype=object)
    adopted: dict[int, Owner] = {}
    api_rows = np.flatnonzero(loose & (levels == Level.CUDA_API.value) & table[col.EXTERNAL_ID].notna().to_numpy())
    if len(api_rows) and owners:
        threads = table[col.THREAD_ID].astype("Int64").tolist()
        externals = table[col.EXTERNAL_ID].astype("Int64").tolist()
        for row in api_rows.tolist():
            if threads[row] is pd.NA:
                continue
            owner = owners.get((int(threads[row]), int(externals[row])))
            if owner is not None:
                adopted[row] = owner
    device_rows = np.flatnonzero(loose & (levels == Level.KERNEL.value) & table[col.CORRELATION_ID].notna().to_numpy())
    if len(device_rows) and launches:
        correlations = table[col.CORRELATION_ID].astype("Int64").tolist()
        for row in device_rows.tolist():
            owner = launches.get(int(correlations[row]))
            if owner is not None:
                adopted[row] = owner
    if not adopted:
        return 0, 0
    rows = np.fromiter(adopted, dtype=np.int64, count=len(adopted))
    table.loc[rows, col.PARENT_ID] = [owner[0] for owner in adopted.values()]
    _set_step(table, rows, [owner[1] for owner in adopted.values()], [owner[2] for owner in adopted.values()])
    # what those calls launched in this window follows them into their step
    children = np.flatnonzero(parents.isin(ids[rows].tolist()).fillna(False).to_numpy(dtype=bool))
    if len(children):
        by_id = {int(ids[row]): adopted[int(row)] for row in rows.tolist()}
        owners_of = [by_id[int(parent)] for parent in parents.iloc[children].tolist()]
        _set_step(table, children, [owner[1] for owner in owners_of], [owner[2] for owner in owners_of])
    activities = int((levels[rows] == Level.KERNEL.value).sum())
    return len(adopted) - activities, activities


def _set_step(table: pd.DataFrame, rows: np.ndarray, steps: list[Any], traces: list[str]) -> None:
    table.loc[rows, col.STEP] = pd.array(steps, dtype="Int64")
    set_texts(table, rows, col.TRACE_ID, traces)


def remember(table: pd.DataFrame, state: StepState) -> None:
    """Keep who made what in ``table`` (and the window before it) for the next window."""
    owners: dict[tuple[int, int], Owner] = {}
    launches: dict[int, Owner] = {}
    if col.EXTERNAL_ID in table and table[col.EXTERNAL_ID].notna().any():
        levels = table[col.LEVEL].to_numpy(dtype=object)
        known = table[col.EXTERNAL_ID].notna().to_numpy() & table[col.THREAD_ID].notna().to_numpy()
        makers = table[known & (levels != Level.CUDA_API.value)]
        owners = dict(zip(zip(makers[col.THREAD_ID].astype("int64").tolist(),
                              makers[col.EXTERNAL_ID].astype("int64").tolist()), _owners(makers)))
        calls = table[(levels == Level.CUDA_API.value) & table[col.CORRELATION_ID].notna().to_numpy()]
        launches = dict(zip(calls[col.CORRELATION_ID].astype("int64").tolist(), _owners(calls)))
    state.recent_owners = {**state.window_owners, **owners}
    state.recent_launches = {**state.window_launches, **launches}
    state.window_owners, state.window_launches = owners, launches


def _owners(spans: pd.DataFrame) -> list[Owner]:
    steps = spans[col.STEP].astype("Int64").tolist()
    return [(span_id, None if step is pd.NA else int(step), trace_id) for span_id, step, trace_id in zip(
        spans[col.SPAN_ID].astype("int64").tolist(), steps, spans[col.TRACE_ID].astype(str).tolist())]
