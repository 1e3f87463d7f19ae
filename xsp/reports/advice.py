"""Recommendations as text: the lines ``xsp recommend`` and the terminal report print."""

from __future__ import annotations

import textwrap
from typing import Any

import pandas as pd

from xsp.analysis.findings import SHARE_OF, STEP_TIME
from xsp.analysis.recommend import RULES, Rule

WIDTH = 80


def recommendation_lines(table: pd.DataFrame, width: int = WIDTH) -> list[str]:
    """Each recommendation as a numbered block: severity, rule and share, then the evidence,
    the fix and where, wrapped to ``width`` columns."""
    if table.empty:
        return ["No recommendation: no rule's threshold was passed by what this trace recorded."]
    lines: list[str] = []
    share_of = table.attrs.get(SHARE_OF, STEP_TIME)
    for number, row in enumerate(table.itertuples(index=False), start=1):
        lines.append(f"{number}. [{row.severity}] {row.rule}: {row.share:.1%} of {share_of} at stake")
        lines += _wrapped(str(row.evidence), width)
        lines += _wrapped(f"fix: {row.fix}", width)
        if len(row.paths):
            lines += _wrapped("where: " + ", ".join(_middle(str(path), 60) for path in row.paths), width)
    return lines


def recommendation_records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The recommendations as JSON-ready records, each with its rule's threshold and source."""
    records = []
    for row in table.to_dict("records"):
        threshold = RULES[Rule(row["rule"])]
        records.append({**row, "share": float(row["share"]), "paths": list(row["paths"]),
                        "threshold": threshold.text, "source": threshold.source})
    return records


def _wrapped(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent="   ", subsequent_indent="     ",
                         break_long_words=True, break_on_hyphens=False)


def _middle(text: str, limit: int) -> str:
    """``text`` shortened in the middle to ``limit`` characters (paths keep both ends)."""
    if len(text) <= limit:
        return text
    keep = (limit - 1) // 2
    return text[:keep] + "…" + text[len(text) - (limit - 1 - keep):]
