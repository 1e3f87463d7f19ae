"""Run a function when a module is imported (at once if it already is).

xsp instruments libraries the user's script may import only after the session started
(``transformers`` for ``generate()``, ``torch._dynamo`` for compile times), and importing them
itself would cost seconds. A finder on ``sys.meta_path`` notices the import and calls the
function right after the module has executed.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """The real loader, and the callbacks once the module has executed."""

    def __init__(self, loader: Any, callbacks: list[Callback]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in list(self._callbacks):
            _call(callback, module)

    def __getattr__(self, name: str) -> Any:  # resources, get_data, is_package...
        return getattr(self._loader, name)


def _call(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # instrumentation must never break the user's import
        pass


class _Watcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._lock = threading.Lock()
        self._searching = threading.local()

    def wait_for(self, name: str, callback: Callback) -> None:
        """Call ``callback`` when ``name`` is imported (installed in ``sys.meta_path`` while waiting)."""
        with self._lock:
            waiting = self.callbacks.setdefault(name, [])
            if callback not in waiting:
                waiting.append(callback)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def stop_waiting(self, name: str, callback: Callback) -> None:
        """Forget ``callback`` for ``name``; out of ``sys.meta_path`` once nothing is awaited."""
        with self._lock:
            waiting = self.callbacks.get(name, [])
            if callback in waiting:
                waiting.remove(callback)
            if not waiting:
                self.callbacks.pop(name, None)
            if not self.callbacks and self in sys.meta_path:
                sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        callbacks = self.callbacks.get(fullname)
        if not callbacks or getattr(self._searching, "name", None) == fullname:
            return None
        self._searching.name = fullname
        try:
            spec = _spec_from_others(self, fullname, path, target)
        finally:
            self._searching.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, callbacks)
        return spec


def _spec_from_others(watcher: _Watcher, fullname: str, path: Sequence[str] | None,
                      target: ModuleType | None) -> ModuleSpec | None:
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if finder is watcher or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec  # type: ignore[no-any-return]
    return None


_WATCHER = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now, if it already is.

    Asking again for the same callback changes nothing; one :func:`forget` undoes it."""
    module = sys.modules.get(name)
    if module is not None:
        _call(callback, module)
        return
    _WATCHER.wait_for(name, callback)


def forget(name: str, callback: Callback) -> None:
    """Stop waiting for ``name`` on behalf of ``callback``; leave ``sys.meta_path`` as found."""
    _WATCHER.stop_waiting(name, callback)
