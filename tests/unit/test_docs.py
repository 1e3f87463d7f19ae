"""The Python examples in the README and docs run as written (files written to a temp dir)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks():
    for doc in DOCS:
        for number, block in enumerate(BLOCK.findall(doc.read_text())):
            if "localhost" in block:  # needs a running collector: covered by the OTLP tests
                continue
            # the leveled runs' examples run the model many times over: the heavier suite's
            marks = [pytest.mark.heavy] if "xsp.leveled(" in block else []
            yield pytest.param(block, id=f"{doc.name}-{number}", marks=marks)


@pytest.mark.parametrize("code", list(python_blocks()))
def test_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a module of its own, as a script's is: a Pool can pickle the functions it defines
    module = types.ModuleType("__doc_example__")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "<doc>", "exec"), module.__dict__)


def test_docstring_examples():
    import doctest
    import importlib

    import xsp.record.user_spans
    import xsp.session.session

    leveled_module = importlib.import_module("xsp.session.leveled")
    import xsp.record.schedule

    for module in (xsp.session.session, xsp.record.user_spans, xsp.record.schedule, leveled_module):
        failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert failures == 0, module.__name__
