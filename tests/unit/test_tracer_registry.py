"""Tracers are found by name, built-in or installed as plugins, and declare their hooks on one
typed base class."""

from __future__ import annotations

import sys
import types

import pandas as pd

from xsp.core.schema import Level
from xsp.tracers import registry
from xsp.tracers.base import Tracer
from xsp.tracers.registry import BUILTIN_TRACERS, tracer_classes, tracers_for


class CountingTracer(Tracer):
    """A plugin's tracer: only what it must define."""

    name = "counting"
    level = Level.SYSTEM

    def start(self, recording):  # noqa: ANN001
        self.started = True

    def stop(self) -> None:
        pass

    def collect(self, window) -> pd.DataFrame:  # noqa: ANN001
        return pd.DataFrame()


class NotATracer:
    name = "stray"
    level = Level.SYSTEM


def test_every_builtin_tracer_derives_from_the_base_class_and_declares_its_hooks():
    classes = tracer_classes()
    for name in BUILTIN_TRACERS:
        cls = classes[name]
        assert isinstance(cls, type) and issubclass(cls, Tracer), name
    chosen, _ = tracers_for((Level.MODEL, Level.LAYER, Level.OPERATOR))
    for tracer in chosen:  # the hooks the session calls on every tracer, without getattr
        assert isinstance(tracer.collects_at_end, bool) and isinstance(tracer.interprets_in_child, bool)
        assert tracer.step_end_hook() is None or callable(tracer.step_end_hook())
        assert tracer.metadata() is None or isinstance(tracer.metadata(), dict)


def test_a_plugin_gets_the_hooks_defaults_and_a_class_that_is_no_tracer_is_refused(monkeypatch):
    module = types.ModuleType("xsp_plugin_for_test")
    module.CountingTracer, module.NotATracer = CountingTracer, NotATracer
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "_plugin_targets", lambda: (("counting", f"{module.__name__}:CountingTracer"),
                                                              ("stray", f"{module.__name__}:NotATracer")))
    classes = tracer_classes()
    assert classes["counting"] is CountingTracer
    assert classes["stray"] == f"cannot use {module.__name__}:NotATracer: not a subclass of xsp.tracers.Tracer"
    tracer = CountingTracer()
    assert tracer.available() is None and tracer.step_end_hook() is None and tracer.metadata() is None
    assert not tracer.collects_at_end and not tracer.interprets_in_child and tracer.also_records == ()
    assert tracer.prepare(None) is None  # type: ignore[arg-type]
