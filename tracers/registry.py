"""Finding tracers: built-ins plus third-party ones under the ``xsp.tracers`` entry-point group."""

from __future__ import annotations

from functools import lru_cache
from importlib import import_module
from importlib.metadata import entry_points

from xsp.core.schema import Level
from xsp.tracers.base import Tracer

ENTRY_POINT_GROUP = "xsp.tracers"
BUILTIN_TRACERS: dict[str, str] = {
    "model": "xsp.tracers.model:ModelTracer",
    "layer": "xsp.tracers.layer:LayerTracer",
    "operator": "xsp.tracers.operator:OperatorTracer",
    "memory": "xsp.tracers.operator:MemoryTracer",
    "flops": "xsp.tracers.flops:FlopsTracer",
    "cuda_api": "xsp.tracers.cuda_api:CudaApiTracer",
    "kernel": "xsp.tracers.kernel:KernelTracer",
    "gpu_metrics": "xsp.tracers.gpu_metrics:GpuMetricsTracer",
    "system": "xsp.tracers.system:SystemTracer",
}


def _load(target: str) -> type[Tracer]:
    module_name, _, attribute = target.partition(":")
    return getattr(import_module(module_name), attribute)  # type: ignore[no-any-return]


@lru_cache(maxsize=1)
def _plugin_targets() -> tuple[tuple[str, str], ...]:
    """The installed plugins' tracers, by name: read once a process (reading every installed
    package's entry points takes ~15 ms, which a followed child process would pay each time)."""
    return tuple((entry.name, entry.value) for entry in entry_points(group=ENTRY_POINT_GROUP))


def tracer_classes() -> dict[str, type[Tracer] | str]:
    """Every known tracer by name: its class, or why it could not be loaded (plugins installed
    while the process runs are found by the next process)."""
    targets = dict(BUILTIN_TRACERS)
    for name, value in _plugin_targets():
        targets.setdefault(name, value)
    found: dict[str, type[Tracer] | str] = {}
    for name, target in targets.items():
        try:
            loaded = _load(target)
        except Exception as exc:  # a broken plugin must not break xsp
            found[name] = f"cannot load {target}: {type(exc).__name__}: {exc}"
            continue
        found[name] = loaded if isinstance(loaded, type) and issubclass(loaded, Tracer) else (
            f"cannot use {target}: not a subclass of xsp.tracers.Tracer")
    return found


def tracers_for(levels: tuple[Level, ...]) -> tuple[list[Tracer], dict[Level, str]]:
    """Instances of the tracers recording ``levels``, and why any level has none that can run."""
    chosen: list[Tracer] = []
    reasons: dict[Level, list[str]] = {level: [] for level in levels}
    for name, cls in tracer_classes().items():
        if isinstance(cls, str):
            continue
        if cls.level not in reasons:
            continue
        tracer = cls()
        reason = tracer.available()
        if reason is None:
            chosen.append(tracer)
        else:
            reasons[cls.level].append(f"{name}: {reason}")
    covered = {level for tracer in chosen for level in (tracer.level, *tracer.also_records)}
    missing = {
        level: (why[0].partition(": ")[2] if len(why) == 1 else "; ".join(why)) if why
        else "no tracer records this level yet"
        for level, why in reasons.items() if level not in covered
    }
    return chosen, missing
