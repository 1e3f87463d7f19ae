"""Each step root of a built window given its system averages (see :mod:`xsp.record.samples`)."""

from __future__ import annotations

import json

import numpy as np

from xsp.core import schema as col
from xsp.core.lazy import pandas as pd
from xsp.record.samples import STEP_ATTRIBUTE_PREFIX, sample_table, step_averages
from xsp.table.sampling import step_roots


def annotate_steps(table: pd.DataFrame) -> None:
    """Give each step root in ``table`` (a built window) its system averages, in place."""
    samples = sample_table(table)
    if samples.empty:
        return
    roots = step_roots(table)
    if not len(roots):
        return
    averages = step_averages(samples, table[col.START_NS].to_numpy(dtype=np.int64)[roots],
                             table[col.END_NS].to_numpy(dtype=np.int64)[roots])
    texts = table[col.ATTRIBUTES].astype(object).tolist()
    for row, found in zip(roots.tolist(), averages):
        if not found:
            continue
        current = texts[row]
        attributes = json.loads(current) if isinstance(current, str) else {}
        attributes.update({STEP_ATTRIBUTE_PREFIX + key: value for key, value in found.items()})
        texts[row] = json.dumps(attributes)
    table[col.ATTRIBUTES] = pd.array(texts, dtype="string")
