"""PyTorch's profiler starting with CUDA activities while xsp holds CUPTI: xsp lets go first.

Kineto (PyTorch's profiler) configures CUPTI when a profile with ``ProfilerActivity.CUDA``
is prepared: it registers its own activity-buffer callbacks (the process has one pair: the
last registered receives every buffer) and enables the kinds it wants. Were xsp still
subscribed then, both would lose records, and Kineto's teardown would switch off xsp's kinds.
So while xsp's CUDA levels run, the functions PyTorch's profiler calls to start and stop
Kineto (``torch.autograd.profiler._prepare_profiler``, ``_enable_profiler`` and
``_disable_profiler``, looked up by name at each call) are wrapped: before Kineto takes CUPTI,
xsp flushes and keeps what it has, and releases CUPTI; once Kineto has stopped, xsp takes
CUPTI back. Kineto started outside Python (on demand, by Dynolog) is not seen here: xsp's
next subscription is refused, and says so.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, Final

PROFILER_MODULE: Final = "torch.autograd.profiler"
STARTS: Final = ("_prepare_profiler", "_enable_profiler")
"""Kineto's entry points that configure CUPTI (a profile prepares, then enables; some callers
only enable)."""
STOPS: Final = ("_disable_profiler",)


def wants_cuda(activities: Any) -> bool:
    """True when ``activities`` (a set of ``torch.autograd.ProfilerActivity``) includes CUDA."""
    try:
        return any(getattr(activity, "name", None) == "CUDA" for activity in _iterable(activities))
    except Exception:
        return False


def _iterable(activities: Any) -> Iterable[Any]:
    return activities if isinstance(activities, (set, frozenset, list, tuple)) else ()


class TorchProfilerWatch:
    """Calls ``before_cuda_profiling`` before PyTorch's profiler takes CUPTI, and
    ``after_profiling`` once it has stopped, while installed.

    Args:
        before_cuda_profiling: runs on the thread that starts the profiler, before Kineto runs.
        after_profiling: runs on the thread that stops it, after Kineto has let go.
    """

    def __init__(self, before_cuda_profiling: Callable[[], None], after_profiling: Callable[[], None]) -> None:
        self._before = before_cuda_profiling
        self._after = after_profiling
        self._replaced: dict[str, tuple[Any, Any]] = {}
        """Name -> (PyTorch's function, its replacement), while installed."""

    def install(self) -> None:
        """Wrap PyTorch's profiler entry points (nothing where PyTorch is not imported yet: the
        CUDA levels import it first)."""
        module = sys.modules.get(PROFILER_MODULE)
        if module is None or self._replaced:
            return
        for name in (*STARTS, *STOPS):
            original = module.__dict__.get(name)
            if original is None:
                continue
            replacement = self._starting(original) if name in STARTS else self._stopping(original)
            setattr(module, name, replacement)
            self._replaced[name] = (original, replacement)

    def remove(self) -> None:
        """Put PyTorch's functions back, each only while it is still the one installed here."""
        module = sys.modules.get(PROFILER_MODULE)
        replaced, self._replaced = self._replaced, {}
        if module is None:
            return
        for name, (original, replacement) in replaced.items():
            if module.__dict__.get(name) is replacement:
                setattr(module, name, original)

    def _starting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        before = self._before

        after = self._after

        def starting(config: Any, activities: Any, *args: Any, **kwargs: Any) -> Any:
            cuda = wants_cuda(activities)
            if cuda:
                try:
                    before()
                except Exception:  # the user's profiler starts whatever happens to xsp's levels
                    pass
            try:
                return original(config, activities, *args, **kwargs)
            except BaseException:
                if cuda:  # it never started: no stop will follow, so CUPTI is taken back now
                    try:
                        after()
                    except Exception:
                        pass
                raise

        return starting

    def _stopping(self, original: Callable[..., Any]) -> Callable[..., Any]:
        after = self._after

        def stopping(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                try:
                    after()
                except Exception:
                    pass

        return stopping
