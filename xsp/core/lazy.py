"""Heavy libraries imported on first use, so that entering a session costs the user's program
next to nothing: pandas, pyarrow and OpenTelemetry's SDK take most of a second to import, and a
session needs them only when it interprets what it recorded (in its window thread, or at its
end).

A module that needs pandas only inside its functions takes its stand-in from here, which type
checkers see as the module itself::

    from xsp.core.lazy import pandas as pd

The first attribute read imports the module; each attribute read is then kept on the stand-in,
so later reads cost what a module's attribute read costs. Nothing is put in ``sys.modules``:
the program's own ``import pandas`` is untouched.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any


class LazyModule(types.ModuleType):
    """A stand-in for the module of its name, imported when an attribute is first read."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)  # copy, pickle and inspect probing dunders import nothing
        value = getattr(importlib.import_module(self.__name__), attribute)
        setattr(self, attribute, value)
        return value


def lazy_module(name: str) -> Any:
    """A stand-in for the module ``name`` (such as ``"pyarrow.compute"``), imported on first use."""
    return LazyModule(name)


if TYPE_CHECKING:
    import pandas
    import pyarrow
    import pyarrow.compute as pyarrow_compute
    import pyarrow.parquet as pyarrow_parquet
    from opentelemetry.sdk.trace import export as otel_span_export
else:
    pandas = lazy_module("pandas")
    pyarrow = lazy_module("pyarrow")
    pyarrow_compute = lazy_module("pyarrow.compute")
    pyarrow_parquet = lazy_module("pyarrow.parquet")
    otel_span_export = lazy_module("opentelemetry.sdk.trace.export")
