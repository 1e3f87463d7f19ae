"""The names of a session's top-level models: each the first name it is bound to in the code
that calls it and that no other model has, else its class name with the lowest free index
(``Sequential_0``). The models first called on the session's own thread are named first: two
threads' models bound to one name, the session's own trace gives it to its thread's model,
whichever thread called first."""

from __future__ import annotations

import threading
from typing import Any


class ModelNames:
    """The models a session has named, by ``id`` (the recorded calls keep the modules alive)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        """Name of each top-level model by ``id``; updated in place, never replaced (the C
        module-call wrapper holds it)."""
        self._bindings: dict[int, tuple[int, str, list[str]]] = {}
        """Each named model's first calling thread, class name and the names it was bound to
        there: what :meth:`own` and :meth:`names_for` name it from again."""
        self._lock = threading.Lock()
        self._owner_thread_id: int | None = None

    def name(self, module: Any, candidates: list[str]) -> str:
        """Name the top-level model ``module``: the first of ``candidates`` (names it is bound
        to in the calling code) that no other model of the session has, else its class name
        with the lowest free index (``Sequential_0``)."""
        with self._lock:
            known = self.names.get(id(module))
            if known is not None:
                return known
            thread_id = threading.get_native_id()
            self._bindings[id(module)] = (thread_id, type(module).__name__, candidates)
            if thread_id == self._owner_thread_id:  # another thread's model may hold the name it is bound to
                self.names.update(self._names_first_of(thread_id))
            else:
                self.names[id(module)] = _free_name(type(module).__name__, candidates, set(self.names.values()))
            return self.names[id(module)]

    def own(self, thread_id: int) -> None:
        """The session of thread ``thread_id`` owns the recording (it started it, or took it
        over): its trace names the models afresh, those first called on that thread first (see
        :meth:`names_for`), and so does every model named from now on."""
        with self._lock:
            self._owner_thread_id = thread_id
            self.names.update(self._names_first_of(thread_id))  # in place: the wrappers hold this dict

    def names_for(self, thread_id: int) -> dict[int, str]:
        """The models named as :meth:`name` would, those first called on thread ``thread_id``
        first: a session's own trace (two threads' models bound to one name: each session's own
        keeps it)."""
        with self._lock:
            return self._names_first_of(thread_id)

    def _names_first_of(self, thread_id: int) -> dict[int, str]:
        order = sorted(self._bindings, key=lambda model: self._bindings[model][0] != thread_id)
        names: dict[int, str] = {}
        for model in order:
            _, class_name, candidates = self._bindings[model]
            names[model] = _free_name(class_name, candidates, set(names.values()))
        return names


def _free_name(class_name: str, candidates: list[str], taken: set[str]) -> str:
    """The first of ``candidates`` not ``taken``, else ``class_name`` with the lowest free index."""
    name = next((candidate for candidate in candidates if candidate not in taken), None)
    index = 0
    while name is None:
        name = f"{class_name}_{index}"
        name, index = (None if name in taken else name), index + 1
    return name
