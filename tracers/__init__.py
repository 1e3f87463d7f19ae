"""Tracers: one module per level, the :class:`Tracer` protocol and the registry."""

from xsp.tracers.base import Tracer
from xsp.tracers.registry import tracer_classes, tracers_for

__all__ = ["Tracer", "tracer_classes", "tracers_for"]
