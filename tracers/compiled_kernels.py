"""Inductor's provenance of the kernels ``torch.compile`` generates while a session records
operators: turned on for the session's compiles, read from dynamo's compilation metrics, kept
in the trace's metadata (see :mod:`xsp.record.compiled_kernels`)."""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType
from typing import Any, Final, TypeVar

from xsp.record.compiled_kernels import (
    AMBIGUOUS_KEY,
    CALLED_SEPARATOR,
    LAYERS_KEY,
    METADATA_KEY,
    REBASED_KEY,
    STALE_KEY,
    Frame,
    LayerHints,
    LayerShare,
    layer_hints,
    layers_of_metrics,
    rebased_provenance,
    sources_of_metrics,
)
from xsp.tracers._post_import import forget, when_imported

INDUCTOR_CONFIG: Final = "torch._inductor.config"
DYNAMO_UTILS: Final = "torch._dynamo.utils"
COMPILE_FX: Final = "torch._inductor.compile_fx"
"""Where inductor's entry point lives: dynamo's ``inductor`` backend imports ``compile_fx`` from it
at each compile, so a wrapper set there sees every graph, whether FX's cache answers or not."""


Read = TypeVar("Read", list[list[Frame]], list[LayerShare])


def _merged(found: dict[str, Read], read: dict[str, Read]) -> set[str]:
    """Put a compile's ``read`` into ``found``; the kernel names it gives another value than an
    earlier compile did (ambiguous). An operator called as it is (its key names its compile) takes
    the value read from its whole compile."""
    ambiguous: set[str] = set()
    for name, value in read.items():
        known = found.get(name)
        if known is None or CALLED_SEPARATOR in name:
            found[name] = value
        elif sorted(known) != sorted(value):
            ambiguous.add(name)
    return ambiguous


class CompiledKernels:
    """Inductor's provenance of the kernels compiled while a session runs (see the module's text)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read: dict[int, object] = {}
        """The compiles of the last read, by id (held: an id is not reused while its object lives)."""
        self._sources: dict[str, list[list[Frame]]] = {}
        self._layers: dict[str, list[LayerShare]] = {}
        self._provenance: dict[str, set[str]] = {}
        """Each compile id's provenance texts: its forward's and its backward's (two compiles of one id)."""
        self._hints: LayerHints = {}
        """Each operator's stack trace to the modules that ran it, from the graphs compiled."""
        self._ambiguous: set[str] = set()
        self._rebased = 0
        """Stack traces of compiles FX's graph cache answered, taken from this program's graphs."""
        self._stale = 0
        """Stack traces FX's graph cache answered that match none of this program's code, left out."""
        self._restore: list[tuple[Any, str, Any, Any]] = []

    def install(self) -> None:
        """Turn the tracking on for compiles from now on (at once if inductor's config is imported,
        else when it is: importing it here would cost the session a second and more)."""
        when_imported(INDUCTOR_CONFIG, self._configure)
        when_imported(COMPILE_FX, self._wrap_compile)

    def uninstall(self) -> None:
        """Stop turning it on; what the session set is set back (unless changed since)."""
        forget(INDUCTOR_CONFIG, self._configure)
        forget(COMPILE_FX, self._wrap_compile)
        for owner, name, ours, before in reversed(self._restore):
            try:
                if getattr(owner, name) == ours:
                    setattr(owner, name, before)
            except Exception:  # a config that refuses: the user's compiles keep ours, harmlessly
                pass
        self._restore = []

    def _configure(self, config: ModuleType) -> None:
        for owner, name, value in ((getattr(config, "trace", None), "provenance_tracking_level", 1),
                                   (getattr(config, "cpp", None), "enable_kernel_profile", True)):
            if owner is None or not hasattr(owner, name):
                continue
            before = getattr(owner, name)
            if before:  # the user's own setting stands
                continue
            setattr(owner, name, value)
            self._restore.append((owner, name, value, before))

    def _wrap_compile(self, module: ModuleType) -> None:
        compile_fx = getattr(module, "compile_fx", None)
        if not callable(compile_fx):
            return
        notice = self._notice

        @functools.wraps(compile_fx)
        def compile_fx_noticed(model_: Any, *args: Any, **kwargs: Any) -> Any:
            notice(model_)
            return compile_fx(model_, *args, **kwargs)

        module.compile_fx = compile_fx_noticed  # type: ignore[attr-defined]
        self._restore.append((module, "compile_fx", compile_fx_noticed, compile_fx))

    def _notice(self, graph_module: Any) -> None:
        """Keep the modules of each operator of a graph about to be compiled (compile time only)."""
        try:
            hints = layer_hints(graph_module)
        except Exception:  # a graph of another shape: its kernels stay on the calling layer
            return
        with self._lock:
            for trace, modules in hints.items():
                self._hints.setdefault(trace, {}).update(modules)

    def read(self) -> None:
        """Take the sources of compiles made since the last read (a window's close, the end)."""
        utils = sys.modules.get(DYNAMO_UTILS)
        metrics = getattr(utils, "get_compilation_metrics", None)
        if metrics is None:
            return
        try:
            compiles = list(metrics())
        except Exception:  # dynamo's bookkeeping changed: no sources, times stay on the calling line
            return
        with self._lock:
            # dynamo keeps the last 64: a compile not among the last read's is new
            new = [compiled for compiled in compiles if id(compiled) not in self._read]
            self._read = {id(compiled): compiled for compiled in compiles}
            for compiled in new:
                texts = getattr(compiled, "inductor_provenance", None)
                if not texts:
                    continue
                compile_id = str(getattr(compiled, "compile_id", ""))
                # one FX's graph cache answered may name the files of the program that first
                # compiled it: its traces become this program's (the same code on the same lines)
                texts, replaced, dropped = rebased_provenance(list(texts), self._hints)
                self._rebased += replaced
                self._stale += dropped
                # a compile's forward and backward come as two compiles of one id: each is read with
                # the other's texts, so an operator called as it is in both has the lines and modules
                # of both (the whole compile's, replacing what was read of it); a kernel name that
                # another compile gave other sources or layers is ambiguous
                of_compile = self._provenance.setdefault(compile_id, set())
                of_compile.update(texts)
                every = sorted(of_compile)
                self._ambiguous |= _merged(self._sources, sources_of_metrics(every, compile_id))
                self._ambiguous |= _merged(self._layers, layers_of_metrics(every, self._hints, compile_id))

    def details(self) -> dict[str, Any]:
        """For the trace's metadata: each kernel's operators' frames, and the ambiguous names."""
        self.read()
        with self._lock:
            sources = {name: [[list(frame) for frame in chain] for chain in chains]
                       for name, chains in sorted(self._sources.items()) if name not in self._ambiguous}
            layers = {name: [list(share) for share in shares]
                      for name, shares in sorted(self._layers.items()) if name not in self._ambiguous}
            ambiguous = sorted(self._ambiguous)
            rebased, stale = self._rebased, self._stale
        details: dict[str, Any] = {}
        if sources:
            details[METADATA_KEY] = sources
        if layers:
            details[LAYERS_KEY] = layers
        if ambiguous:
            details[AMBIGUOUS_KEY] = ambiguous
        if rebased:
            details[REBASED_KEY] = rebased
        if stale:
            details[STALE_KEY] = stale
        return details
